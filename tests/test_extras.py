"""The optional extras: each one's install command is in the README, and an integration whose
framework is not installed says what to install (and, for torchtitan, which Python it needs)."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _install_section() -> str:
    readme = (REPO / "README.md").read_text()
    start = readme.index("\n## Install\n")
    return readme[start : readme.index("\n## ", start + 1)]


def test_the_readme_gives_every_feature_extra_its_install_command():
    extras = metadata("hp-dcp-hf").get_all("Provides-Extra")
    section = _install_section()
    for extra in ("remote", "peft", "quant", "torchtitan", "demo"):
        assert extra in extras
        assert f"pip install -e '.[{extra}]'" in section, extra
    assert "pip install -e '.[test,demo]'" in section
    assert [e for e in extras if f"[{e}]" not in section] == ["test"]  # aws and bench too; test is above
    assert "`[torchtitan]` needs Python >= 3.11" in section


def test_the_torchtitan_integration_without_torchtitan_names_the_extra():
    """torchtitan not importable (here: refused by the import system): importing the integration
    raises an ImportError naming the extra, not torchtitan's ModuleNotFoundError from deep inside."""
    code = ("import sys; sys.modules['torchtitan'] = None\n"
            "try:\n    import hp_dcp_hf.integrations.torchtitan\n"
            "except ImportError as e:\n    print(type(e).__name__, e)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == ("ImportError hp_dcp_hf.integrations.torchtitan needs torchtitan: pip install "
                                  "'hp-dcp-hf[torchtitan]' (from a checkout: pip install -e '.[torchtitan]')")


def test_on_python_3_10_it_says_the_extra_installs_nothing():
    from hp_dcp_hf.integrations.torchtitan import missing_torchtitan

    message = missing_torchtitan((3, 10, 14, "final", 0))
    assert message == ("hp_dcp_hf.integrations.torchtitan needs torchtitan, and torchtitan 0.3 needs Python >= 3.11: "
                       "this is Python 3.10.14, where the [torchtitan] extra installs nothing")
    assert "pip install" in missing_torchtitan((3, 11, 7))
