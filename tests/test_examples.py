"""The examples users copy run: the Python blocks of the README and of docs/getting-started.md, and every
docstring example in the package."""

from __future__ import annotations

import doctest
import importlib
import importlib.util
import io
import os
import pkgutil
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

import tiered_emb

ROOT = Path(__file__).resolve().parents[1]
HAS_TORCH = importlib.util.find_spec("torch") is not None
# Optional dependencies: a module that cannot be imported for want of one of these is skipped, not failed.
OPTIONAL = {"torch", "cupy", "cupyx", "matplotlib", "libcachesim", "fbgemm_gpu"}
NEEDS_TORCH = re.compile(r"^tiered_emb\.(torch|torchrec|apps)(\.|$)")


def _env() -> dict[str, str]:
    """The subprocess imports this checkout's tiered_emb, whatever is installed."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    return env


# ---------------------------------------------------------------------------------------------------------
# the README


def python_blocks(page: Path) -> list[str]:
    text = page.read_text(encoding="utf-8")
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.DOTALL | re.MULTILINE)


def readme_blocks() -> list[str]:
    return python_blocks(ROOT / "README.md")


def _run_python(code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, env=_env(), capture_output=True, text=True, timeout=300, check=False
    )


def test_readme_has_python_blocks() -> None:
    assert readme_blocks(), "the README holds no ```python block: the example a user copies first is untested"


@pytest.mark.parametrize("index", range(len(readme_blocks())))
def test_readme_python_block_runs(index: int, tmp_path: Path) -> None:
    if not HAS_TORCH:
        pytest.skip("the README's example trains with torch, which is not installed")
    code = readme_blocks()[index]
    proc = _run_python(code, tmp_path)
    assert proc.returncode == 0, f"README block {index} failed:\n{code}\n{proc.stdout}\n{proc.stderr}"


# ---------------------------------------------------------------------------------------------------------
# docs/getting-started.md: its blocks build on each other, so they run in order as one script


GETTING_STARTED = ROOT / "docs" / "getting-started.md"


def test_getting_started_runs(tmp_path: Path) -> None:
    blocks = python_blocks(GETTING_STARTED)
    assert len(blocks) >= 4, "docs/getting-started.md lost its ```python blocks: the first code a newcomer runs"
    if not HAS_TORCH:
        pytest.skip("docs/getting-started.md trains with torch, which is not installed")
    code = "\n".join(blocks)
    proc = _run_python(code, tmp_path)
    numbered = "\n".join(f"{i + 1:4d}  {line}" for i, line in enumerate(code.splitlines()))
    assert proc.returncode == 0, f"docs/getting-started.md failed:\n{numbered}\n{proc.stdout}\n{proc.stderr}"


# ---------------------------------------------------------------------------------------------------------
# docstring examples


def _import(name: str) -> ModuleType | str:
    """The module, or why it is skipped."""
    if NEEDS_TORCH.match(name) and not HAS_TORCH:
        return "needs torch, which is not installed"
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as err:
        if err.name and err.name.split(".")[0] in OPTIONAL:
            return f"needs {err.name}, which is not installed"
        raise
    if getattr(module, "TORCHREC_ERROR", None):  # imports without torchrec; its examples need it
        return f"needs torchrec, which cannot be imported ({module.TORCHREC_ERROR})"
    return module


def examples(module: ModuleType) -> list[doctest.DocTest]:
    """The docstrings of ``module``'s own objects that hold examples."""
    return [t for t in doctest.DocTestFinder().find(module, module.__name__) if t.examples]


def modules_with_examples() -> list[object]:
    params: list[object] = []
    for info in pkgutil.walk_packages(tiered_emb.__path__, prefix="tiered_emb."):
        module = _import(info.name)
        if isinstance(module, str):
            params.append(pytest.param(info.name, marks=pytest.mark.skip(reason=module), id=info.name))
        elif examples(module):
            params.append(pytest.param(info.name, id=info.name))
    return params


OPTIONS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


@pytest.mark.parametrize("name", modules_with_examples())
def test_docstring_examples_run(name: str) -> None:
    module = importlib.import_module(name)
    out = io.StringIO()
    runner = doctest.DocTestRunner(optionflags=OPTIONS)
    for test in examples(module):
        runner.run(test, out=out.write)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples in {name} failed:\n{out.getvalue()}"
