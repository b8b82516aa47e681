"""The linters, the type checker and the duplicate-code check, run as tests.

Each runs in a subprocess from the repository root with the configuration in
pyproject.toml (rule sets, the strictly typed modules), so ``python -m pytest`` is the one
command that checks everything.  Versions are pinned in the ``test`` extra: a new release
adds rules, and these tests must not start failing by themselves.  A tool that is not
installed skips its test with the command that installs it.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINTED = ["tiered_emb", "tests", "bench"]
_INSTALL = 'install the test extra: python -m pip install -e ".[test]"'


def _run(module: str, *args: str) -> subprocess.CompletedProcess[str]:
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed ({_INSTALL})")
    return subprocess.run(
        [sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True, timeout=600, check=False
    )


def _report(proc: subprocess.CompletedProcess[str]) -> str:
    return f"exit status {proc.returncode}\n{proc.stdout}\n{proc.stderr}"


def test_ruff_is_clean() -> None:
    proc = _run("ruff", "check", "--no-cache", "--output-format", "concise", *LINTED)
    assert proc.returncode == 0, _report(proc)


def test_ruff_format_is_clean() -> None:
    """The tree is as ``ruff format`` writes it (run ``python -m ruff format tiered_emb tests bench``)."""
    proc = _run("ruff", "format", "--no-cache", "--check", *LINTED)
    assert proc.returncode == 0, _report(proc)


def test_mypy_is_clean() -> None:
    """The modules listed under ``[tool.mypy] files`` type-check strictly."""
    proc = _run("mypy", "--cache-dir=/dev/null")
    assert proc.returncode == 0, _report(proc)


def test_no_duplicate_blocks() -> None:
    """No block of 6 or more lines (imports, docstrings and comments aside) is repeated in the package."""
    proc = _run(
        "pylint",
        "--disable=all",
        "--enable=duplicate-code",
        "--min-similarity-lines=6",
        "--ignore-imports=yes",
        "--ignore-docstrings=yes",
        "--ignore-comments=yes",
        "--score=no",
        "--persistent=no",
        "tiered_emb",
    )
    assert proc.returncode == 0, _report(proc)
