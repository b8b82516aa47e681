"""The API reference builds from the docstrings without a warning, and documents every public name.

The reference is Sphinx (autodoc + napoleon) over ``docs/api/`` (docs/api.md says why and how to
build it by hand).  The build runs once per session into a temporary folder; the generated HTML
is never committed.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "docs" / "api"
# the modules a user imports; each must be in the reference, every name of its __all__ documented
PUBLIC = [
    "tiered_emb",
    "tiered_emb.errors",
    "tiered_emb.torch",
    "tiered_emb.torchrec",
    "tiered_emb.distributed",
    "tiered_emb.prefetch",
    "tiered_emb.sim",
]
_INSTALL = 'install the test extra: python -m pip install -e ".[test]"'


def _needs(module: str, why: str) -> None:
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed ({why})")


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], str]:
    """The reference built into a temporary folder: the build's process and all its HTML, joined."""
    _needs("sphinx", _INSTALL)
    _needs("torch", "the reference documents tiered_emb.torch")
    out = tmp_path_factory.mktemp("api")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    # -W: a warning fails the build; --keep-going: but only after reporting every one; -E: no cache
    cmd = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-E", "-q", "-b", "html"]
    proc = subprocess.run(
        [*cmd, "-d", str(out / ".doctrees"), str(SOURCE), str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    html = "\n".join(p.read_text(encoding="utf-8") for p in sorted(out.glob("*.html")))
    return proc, html


def public_names(module: ModuleType) -> list[str]:
    """``__all__``, or (errors.py has none) the classes the module defines."""
    names = getattr(module, "__all__", None)
    if names is not None:
        return list(names)
    return [n for n, v in vars(module).items() if inspect.isclass(v) and v.__module__ == module.__name__]


def _own_doc(obj: object) -> str:
    """The object's own docstring; a dataclass's generated signature does not count."""
    doc = (getattr(obj, "__doc__", None) or "").strip()
    if inspect.isclass(obj) and doc.startswith(f"{obj.__name__}("):
        return ""
    return doc


def _undocumented_members(cls: type) -> list[str]:
    """Public methods and properties the class defines without a docstring (an override may take its base's)."""
    missing = []
    for name, value in vars(cls).items():
        if name.startswith("_") or not (callable(value) or isinstance(value, (property, staticmethod, classmethod))):
            continue
        if not (inspect.getdoc(getattr(cls, name)) or "").strip():
            missing.append(name)
    return missing


def test_reference_covers_the_public_modules() -> None:
    sources = "\n".join(p.read_text(encoding="utf-8") for p in SOURCE.glob("*.rst"))
    documented = set(re.findall(r"^\.\. automodule:: (\S+)", sources, flags=re.MULTILINE))
    assert set(PUBLIC) <= documented, f"not in docs/api: {sorted(set(PUBLIC) - documented)}"


def test_reference_builds_without_warnings(built: tuple[subprocess.CompletedProcess[str], str]) -> None:
    proc, html = built
    assert proc.returncode == 0 and "WARNING" not in proc.stderr, f"sphinx-build:\n{proc.stdout}\n{proc.stderr}"
    assert html


@pytest.mark.parametrize("module_name", PUBLIC)
def test_public_names_have_docstrings(module_name: str) -> None:
    _needs("torch", "the public modules include tiered_emb.torch")
    module = importlib.import_module(module_name)
    missing = []
    for name in public_names(module):
        obj = getattr(module, name)
        if inspect.isclass(obj) or inspect.isfunction(obj):
            if not _own_doc(obj):
                missing.append(name)
            if inspect.isclass(obj):
                missing += [f"{name}.{m}" for m in _undocumented_members(obj)]
    assert not missing, f"{module_name}: public names without a docstring: {missing}"


@pytest.mark.parametrize("module_name", PUBLIC)
def test_public_names_are_in_the_reference(
    module_name: str, built: tuple[subprocess.CompletedProcess[str], str]
) -> None:
    """Each name has its entry (autodoc leaves out what has no docstring; data is described in docs/api)."""
    _, html = built
    module = importlib.import_module(module_name)
    absent = [n for n in public_names(module) if f'id="{module_name}.{n}"' not in html]
    assert not absent, f"{module_name}: not in the API reference: {absent}"
