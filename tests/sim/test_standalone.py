"""The simulator stands alone (DESIGN.md, "Layout"): nothing it imports, directly or through
the modules it imports, is the store, the tiers, the apps or torch glue; and
its modules read no underscored member of one another.

Checked on the source (every import statement, at any depth of a module), since importing
``tiered_emb`` itself loads the store for the package's own namespace.
"""

import ast
from pathlib import Path

import pytest

import tiered_emb

ROOT = Path(tiered_emb.__file__).resolve().parent
SIM = ROOT / "sim"
# The prefetch window's rules (prefetch/window.py) and the dedupe (step/plan.py) are allowed:
# the simulator runs the store's own window code, and neither reaches the tiers.
FORBIDDEN = (
    "tiered_emb.store",
    "tiered_emb.tiers",
    "tiered_emb.apps",
    "tiered_emb.torch",
    "tiered_emb.step.resolve",
    "tiered_emb.step.gather",
    "tiered_emb.step.update",
    "tiered_emb.distributed",
)


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _path_of(module: str) -> Path | None:
    base = ROOT.parent.joinpath(*module.split("."))
    for p in (base.with_suffix(".py"), base / "__init__.py"):
        if p.is_file():
            return p
    return None


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    """``(module, names)`` of every ``import`` / ``from ... import`` in ``path``, relative ones resolved."""
    here = _module_name(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([mod] if mod else []))
            out.append((mod, [a.name for a in node.names]))
    return out


def _reached(start: list[Path]) -> dict[str, str]:
    """Every tiered_emb module reached from ``start`` -> the module that imports it first.
    Parent packages count (their ``__init__`` runs), except ``tiered_emb`` itself."""
    seen, todo = {}, [(_module_name(p), "") for p in start]
    while todo:
        mod, by = todo.pop()
        if mod in seen or not mod.startswith("tiered_emb."):
            continue
        seen[mod] = by
        parts = mod.split(".")
        todo += [(".".join(parts[:i]), mod) for i in range(2, len(parts))]
        path = _path_of(mod)
        if path is None:
            continue
        for imported, names in _imports(path):
            todo.append((imported, mod))
            todo += [(f"{imported}.{n}", mod) for n in names if _path_of(f"{imported}.{n}")]
    return seen


SIM_FILES = sorted(SIM.rglob("*.py"))


def test_the_scan_sees_the_simulator():
    reached = _reached(SIM_FILES)
    assert {"tiered_emb.sim.policies.lru", "tiered_emb.cache.slots", "tiered_emb._progress"} <= set(reached)


@pytest.mark.parametrize("forbidden", FORBIDDEN)
def test_sim_never_imports_the_store_side(forbidden):
    reached = _reached(SIM_FILES)
    bad = {m: by for m, by in reached.items() if m == forbidden or m.startswith(forbidden + ".")}
    assert not bad, f"reached from the simulator (module: imported by): {bad}"


def test_the_scan_would_see_a_forbidden_import():
    """The check is live: the apps' streaming job is reached, and it imports the store."""
    reached = _reached([ROOT / "apps" / "stream.py"])
    assert "tiered_emb.store" in reached


@pytest.mark.parametrize("path", SIM_FILES, ids=lambda p: str(p.relative_to(SIM)))
def test_sim_modules_read_no_underscored_member_of_one_another(path):
    bad = [
        (mod, n)
        for mod, names in _imports(path)
        if mod.startswith("tiered_emb.sim")
        for n in names
        if n.startswith("_") and n != "__version__"
    ]
    assert not bad
