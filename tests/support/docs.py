"""The code blocks of README.md and docs/*.md, and running them as a reader would.

Every fenced block has an info string: ``python`` (an example: it runs), ``text`` (output shown,
never run) or ``bash`` (commands). The line just before a block may carry one marker comment:

    <!-- example: ranks=4 given=path,model -->   run on 4 gloo ranks, with these names defined
    <!-- no-run: why -->                          not run (placeholder paths, a whole test run, ...)

A python block with no marker runs in one process with nothing defined. A bash block needs a
marker: ``no-run`` and its reason, or ``example`` to run it in ``bash -e`` (one process; its
``given`` can only be directories). A text block marked ``example`` is a transcript: each ``$ ``
line a command, the lines after it its output, where a line ``...`` stands for any lines. ``given`` names what the prose around a fragment assumes
(:data:`GIVEN`): ``path``, ``model`` and ``s3_options`` are values; a name ending in ``/`` is a directory the
example's working directory holds. Each example runs in a working directory of its own, its
process group set up as ``torchrun`` does (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ...):
an example that calls ``init_process_group`` itself gets the environment only.
"""

from __future__ import annotations

import dataclasses
import os
import re
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor.debug import _clear_sharding_prop_cache

from hp_dcp_hf.tools.launch import free_port

FENCE = re.compile(r"^```(\S*)\s*$")
MARKER = re.compile(r"^<!--\s*(example|no-run)\s*:?\s*(.*?)\s*-->\s*$")
LANGUAGES = ("python", "bash", "text")
GIVEN = {
    "path": "a tiny bf16 Mixtral checkpoint (its directory, a str)",
    "model": "the model of that checkpoint, built from its config.json by transformers on this rank",
    "batches": "a list of two [2, 8] batches of token ids",
    "s3_options": "s3fs options of a local S3 server (moto) that has a bucket named checkpoints",
    "tiny-mixtral/": "the same checkpoint as path, as a directory of the example's own",
    "base-model/": "a tiny float32 llama checkpoint",
    "my-adapter/": "a LoRA adapter of it (peft's save_pretrained)",
    "deepseek-v3-fp8/": "a tiny DeepSeek-V3 checkpoint, FP8 block-scaled",
    "gpt-oss-20b/": "a tiny gpt-oss checkpoint, MXFP4 experts",
}
GROUP_TIMEOUT = timedelta(seconds=90)


class DocsFormatError(ValueError):
    """A block or marker the rules in this module's docstring do not allow."""


@dataclasses.dataclass(frozen=True)
class Block:
    file: str      # relative to the repository root
    line: int      # of the opening fence, 1-based
    language: str
    source: str
    run: bool
    ranks: int = 1
    given: tuple[str, ...] = ()
    reason: str = ""  # why a block does not run

    @property
    def name(self) -> str:
        return f"{self.file}:{self.line}"

    @property
    def inits_group(self) -> bool:
        return "init_process_group(" in self.source


def _marker(file: str, line: int, language: str, kind: str, text: str) -> dict:
    if kind == "no-run":
        if not text:
            raise DocsFormatError(f"{file}:{line}: no-run needs its reason")
        return {"run": False, "reason": text}
    fields: dict = {"run": True}
    for item in text.split():
        key, _, value = item.partition("=")
        if key == "ranks" and value.isdigit():
            fields["ranks"] = int(value)
        elif key == "given" and value:
            fields["given"] = tuple(value.split(","))
            unknown = sorted(set(fields["given"]) - set(GIVEN))
            if unknown:
                raise DocsFormatError(f"{file}:{line}: given names {unknown} not in {sorted(GIVEN)}")
        else:
            raise DocsFormatError(f"{file}:{line}: unknown example field {item!r}")
    if language != "python" and (fields.get("ranks", 1) != 1 or any(not g.endswith("/") for g in fields.get("given", ()))):
        raise DocsFormatError(f"{file}:{line}: a {language} example runs in one process, given directories only")
    return fields


def blocks(root: Path, file: str) -> list[Block]:
    """Every fenced block of ``root / file``, with its marker read and checked."""
    lines = (root / file).read_text().splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            if MARKER.match(lines[i]) and not (i + 1 < len(lines) and FENCE.match(lines[i + 1])):
                raise DocsFormatError(f"{file}:{i + 1}: a marker must be the line just before a block")
            i += 1
            continue
        language, start = fence.group(1), i
        if language not in LANGUAGES:
            raise DocsFormatError(f"{file}:{i + 1}: a block's info string is one of {LANGUAGES}, not {language!r}")
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), None)
        if end is None:
            raise DocsFormatError(f"{file}:{i + 1}: block never closed")
        marker = MARKER.match(lines[start - 1]) if start else None
        if marker:
            fields = _marker(file, start + 1, language, marker.group(1), marker.group(2))
        elif language == "python":
            fields = {"run": True}
        elif language == "text":
            fields = {"run": False, "reason": "output"}
        else:
            raise DocsFormatError(f"{file}:{start + 1}: a {language} block needs <!-- no-run: why -->")
        if language == "text" and fields["run"] and not lines[start + 1].startswith("$ "):
            raise DocsFormatError(f"{file}:{start + 1}: a transcript starts with a '$ ' command line")
        found.append(Block(file, start + 1, language, "\n".join(lines[start + 1:end]) + "\n", **fields))
        i = end + 1
    return found


def _given(names: tuple[str, ...], values: dict[str, str]) -> dict:
    """The namespace of an example: the values its ``given`` names (directories are in its cwd)."""
    namespace: dict = {"__name__": "__main__"}
    if "path" in names or "model" in names:
        namespace["path"] = values["path"]
    if "model" in names:
        from transformers import AutoConfig, AutoModelForCausalLM

        namespace["model"] = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(values["path"]))
    if "s3_options" in names:
        namespace["s3_options"] = values["s3_options"]
    if "batches" in names:
        generator = torch.Generator().manual_seed(0)
        namespace["batches"] = [torch.randint(0, 100, (2, 8), generator=generator) for _ in range(2)]
    return namespace


def _port(rank: int, cwd: str) -> int:
    """The example's ``MASTER_PORT``: rank 0 takes a free one just before the group starts (ports
    taken earlier may be another job's by then) and leaves it in the example's directory."""
    file = Path(cwd) / ".master_port"
    if rank == 0:
        file.with_suffix(".tmp").write_text(str(free_port()))
        file.with_suffix(".tmp").rename(file)
    deadline = time.monotonic() + GROUP_TIMEOUT.total_seconds()
    while not file.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank 0 gave no port in {cwd}")
        time.sleep(0.01)
    return int(file.read_text())


def run_examples(rank: int, world: int, examples: list[tuple[Block, str]], values: dict[str, str]) -> list[str | None]:
    """``run_ranks`` target: each example (block, working directory) on this rank in turn, each
    under a process group of its own; the traceback of each that failed, None for each that ran."""
    dist.barrier()  # every rank is through the launcher's group set-up before it goes
    dist.destroy_process_group()  # each example gets a group of its own, as under torchrun
    errors: list[str | None] = []
    for block, cwd in examples:
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_port(rank, cwd)))
        os.chdir(cwd)
        error = None
        try:
            if world > 1 and not block.inits_group:
                dist.init_process_group("gloo", timeout=GROUP_TIMEOUT)
            exec(compile(block.source, block.name, "exec"), _given(block.given, values))  # noqa: S102
            if dist.is_initialized():
                dist.barrier()
        except BaseException:  # the example's failure is the result, whatever it is
            error = traceback.format_exc()
        if dist.is_initialized():
            dist.destroy_process_group()
        # DTensor's sharding-propagation caches key meshes by value: the next example's meshes
        # would come back as this one's, whose groups are gone (under torchrun, a process each).
        _clear_sharding_prop_cache()
        errors.append(error)
    return errors


def transcript(source: str) -> list[tuple[str, re.Pattern]]:
    """A transcript's commands, each with the pattern its output (stdout and stderr) must match."""
    steps: list[tuple[str, list[str]]] = []
    for line in source.splitlines():
        if line.startswith("$ "):
            steps.append((line[2:], []))
        else:
            steps[-1][1].append(line)
    return [(command, re.compile("\n".join(".*?" if line == "..." else re.escape(line) for line in output)
                                 .replace("\n.*?\n", "(?:\n.*?)?\n").rstrip("\n") + r"\s*", re.DOTALL))
            for command, output in steps]


LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def broken_links(root: Path, file: str) -> list[str]:
    """The relative links of ``root / file`` (outside code blocks) to a missing file or heading."""
    text = (root / file).read_text()
    prose = re.sub(r"^```.*?^```", "", text, flags=re.DOTALL | re.MULTILINE)
    broken = []
    for target in LINK.findall(prose):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        page, _, fragment = target.partition("#")
        linked = (root / file).parent / page if page else root / file
        if not linked.exists():
            broken.append(target)
        elif fragment and linked.suffix == ".md":
            headings = re.findall(r"^#+ (.*)$", re.sub(r"^```.*?^```", "", linked.read_text(),
                                                         flags=re.DOTALL | re.MULTILINE), flags=re.MULTILINE)
            if fragment not in {anchor(h) for h in headings}:
                broken.append(target)
    return broken


def tree_modules(root: Path, file: str, heading: str = "## The tree") -> set[str]:
    """The module paths the first text block after ``heading`` draws as an indented tree (two
    spaces a level; a name ending in ``/`` opens a folder; what follows a name is its description)."""
    text = (root / file).read_text()
    block = text[text.index(heading):].split("```text\n", 1)[1].split("```", 1)[0]
    folders: list[str] = []
    found = set()
    for line in block.splitlines():
        name = line.strip().split(" ", 1)[0]
        depth = (len(line) - len(line.lstrip(" "))) // 2
        del folders[depth:]
        if name.endswith("/"):
            folders.append(name.rstrip("/"))
        elif name.endswith(".py"):
            found.add("/".join([*folders, name]))
    return found
