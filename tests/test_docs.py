"""Every example of README.md and docs/ runs, as the page shows it (rules: tests/support/docs.py).

The python examples are grouped by their number of ranks and each group runs in one launch of gloo
ranks on CPU (the ranks import torch once, not once per example); each example still gets a
process group and a working directory of its own. A bash example runs in ``bash -e`` there.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from hp_dcp_hf.tools.launch import run_ranks
from tests.support.docs import (
    Block,
    DocsFormatError,
    blocks,
    broken_links,
    run_examples,
    transcript,
    tree_modules,
)

ROOT = Path(__file__).resolve().parent.parent
PAGES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
BLOCKS = [block for page in PAGES for block in blocks(ROOT, page)]
RUNNABLE = [block for block in BLOCKS if block.run]
PYTHON = [block for block in RUNNABLE if block.language == "python"]
SHELL = [block for block in RUNNABLE if block.language == "bash"]
TRANSCRIPTS = [block for block in RUNNABLE if block.language == "text"]


@pytest.fixture(scope="module")
def directories(tmp_path_factory, tiny_checkpoints) -> dict[str, Path]:
    """What the examples' ``given`` names hold (tests/support/docs.py's GIVEN), built once."""
    from tests.support.peft import make_adapter
    from tests.support.quantized import make_fp8_checkpoint, make_mxfp4_checkpoint

    needed = {name for block in RUNNABLE for name in block.given}
    made: dict[str, Path] = {"path": tiny_checkpoints("mixtral").path}
    made["tiny-mixtral/"] = made["path"]
    if needed & {"base-model/", "my-adapter/"}:
        made["base-model/"], made["my-adapter/"] = make_adapter("llama", tmp_path_factory.mktemp("peft"))
    if "deepseek-v3-fp8/" in needed:
        made["deepseek-v3-fp8/"] = make_fp8_checkpoint("deepseek_v3", tmp_path_factory.mktemp("fp8")).path
    if "gpt-oss-20b/" in needed:
        made["gpt-oss-20b/"] = make_mxfp4_checkpoint(tmp_path_factory.mktemp("mxfp4")).path
    return made


@pytest.fixture(scope="module")
def workdirs(tmp_path_factory, directories) -> dict[str, Path]:
    """Each runnable example's own working directory, holding the directories its ``given`` names."""
    made = {}
    for block in RUNNABLE:
        made[block.name] = cwd = tmp_path_factory.mktemp(block.name.replace("/", "_").replace(":", "_"))
        for name in block.given:
            if name.endswith("/"):
                (cwd / name.rstrip("/")).symlink_to(directories[name], target_is_directory=True)
    return made


@pytest.fixture(scope="module")
def outcomes(request, workdirs, directories) -> dict[str, list[str | None]]:
    """Each python example's traceback per rank (None: it ran), all groups run once; an example
    the README repeats word for word from a docs page runs once for both."""
    groups: dict[int, list[tuple[Block, str]]] = defaultdict(list)
    first: dict[tuple, Block] = {}
    for block in PYTHON:
        if first.setdefault((block.source, block.ranks, block.given), block) is block:
            groups[block.ranks].append((block, str(workdirs[block.name])))
    values = {"path": str(directories["path"])}
    if any("s3_options" in block.given for block in RUNNABLE):
        values["s3_options"] = request.getfixturevalue("moto").storage_options()
    ran: dict[str, list[str | None]] = {}
    for world, examples in sorted(groups.items()):
        per_rank = run_ranks(world, run_examples, examples, values, timeout=120 + 60 * len(examples))
        for i, (block, _) in enumerate(examples):
            ran[block.name] = [errors[i] for errors in per_rank]
    return {block.name: ran[first[block.source, block.ranks, block.given].name] for block in PYTHON}


@pytest.mark.parametrize("block", PYTHON, ids=[block.name for block in PYTHON])
def test_example_runs(block: Block, outcomes):
    failed = {rank: error for rank, error in enumerate(outcomes[block.name]) if error}
    assert not failed, f"{block.name} on {block.ranks} rank(s) failed:\n" + "\n".join(
        f"rank {rank}:\n{error}" for rank, error in failed.items())


def test_every_page_has_examples_and_every_skip_a_reason():
    assert all(block.reason for block in BLOCKS if not block.run)
    pages = {block.file for block in RUNNABLE}
    assert "README.md" in pages and len(RUNNABLE) >= 20, (pages, len(RUNNABLE))


def _bash(command: str, cwd: Path) -> subprocess.CompletedProcess:
    """``command`` in bash -e, with this venv's hp-dcp-hf first on PATH and this checkout's package."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.run(["bash", "-e", "-o", "pipefail", "-c", command], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("block", SHELL, ids=[block.name for block in SHELL])
def test_shell_example_runs(block: Block, workdirs):
    done = _bash(block.source, workdirs[block.name])
    assert done.returncode == 0, f"{block.name} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"


@pytest.mark.parametrize("block", TRANSCRIPTS, ids=[block.name for block in TRANSCRIPTS])
def test_transcript_shows_what_the_commands_print(block: Block, workdirs):
    for command, output in transcript(block.source):
        done = _bash(command, workdirs[block.name])
        printed = done.stdout + done.stderr
        assert output.fullmatch(printed), f"{block.name}: {command!r} printed:\n{printed}"


@pytest.mark.parametrize(
    "page, error",
    [
        ("```bash\nmake test\n```\n", "needs <!-- no-run: why -->"),
        ("```\nx = 1\n```\n", "info string"),
        ("<!-- no-run: -->\n```python\nx = 1\n```\n", "needs its reason"),
        ("<!-- example: ranks=2 -->\n\n```python\nx = 1\n```\n", "just before a block"),
        ("<!-- example: given=weights -->\n```python\nx = 1\n```\n", "not in"),
        ("<!-- example -->\n```text\nls\n```\n", "starts with a '\\$ ' command"),
        ("<!-- example: ranks=2 -->\n```bash\nls\n```\n", "one process"),
        ("<!-- example: given=path -->\n```bash\nls\n```\n", "given directories only"),
    ],
)
def test_unmarked_or_badly_marked_blocks_are_refused(tmp_path, page, error):
    (tmp_path / "page.md").write_text(page)
    with pytest.raises(DocsFormatError, match=error):
        blocks(tmp_path, "page.md")


def test_an_unmarked_python_block_is_an_example_that_runs(tmp_path):
    (tmp_path / "page.md").write_text("text\n\n```python\nraise SystemExit(1)\n```\n")
    (block,) = blocks(tmp_path, "page.md")
    assert block.run and block.ranks == 1 and block.given == ()
    [[error]] = run_ranks(1, run_examples, [(block, str(tmp_path))], {})
    assert "SystemExit" in error


def test_a_transcript_s_output_must_match_line_for_line_but_for_its_ellipses():
    [(command, output)] = transcript("$ hp-dcp-hf plan x\nplan for x\n...\nlast line\n")
    assert command == "hp-dcp-hf plan x"
    assert output.fullmatch("plan for x\nlast line\n") and output.fullmatch("plan for x\na\nb\nlast line\n")
    assert not output.fullmatch("plan for y\nlast line\n") and not output.fullmatch("plan for x\n")


def test_every_relative_link_reaches_its_page_and_heading():
    assert {page: broken for page in PAGES if (broken := broken_links(ROOT, page))} == {}


def test_a_link_to_a_missing_page_or_heading_is_broken(tmp_path):
    (tmp_path / "a.md").write_text("# A page\n\n## The `x=` option\n")
    (tmp_path / "b.md").write_text("[ok](a.md#the-x-option) [page](c.md) [heading](a.md#the-y-option)\n"
                                   "```python\nf(x)[0](y)\n```\n")
    assert broken_links(tmp_path, "b.md") == ["c.md", "a.md#the-y-option"]


def test_the_architecture_page_draws_every_module_of_the_package_and_no_other():
    """Each module, that is: a package's ``__init__.py`` may be drawn or not."""
    package = {str(path.relative_to(ROOT)) for path in (ROOT / "hp_dcp_hf").rglob("*.py")}
    drawn = tree_modules(ROOT, "docs/architecture.md")
    package -= {name for name in package - drawn if name.endswith("/__init__.py")}
    assert (sorted(package - drawn), sorted(drawn - package)) == ([], [])


def test_the_readme_links_every_page_of_the_manual():
    readme = (ROOT / "README.md").read_text()
    assert [page for page in PAGES[1:] if f"]({page})" not in readme] == []
