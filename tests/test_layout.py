"""The layout rules of DESIGN.md ("Layout"), checked on the source with ``ast`` (nothing is imported).

- (a) ``cache/`` and ``tiers/`` never import ``step/``, the store, ``prefetch/``, ``apps/`` or ``sim/``;
- (b) ``sim/`` never imports the store, ``tiers/``, ``apps/``, the prefetch thread or the torch front end
  (it runs the prefetch window's own rules, ``prefetch/window.py``);
- (c) torch is imported only by ``torch/``, ``torchrec.py``, ``distributed/`` and ``apps/``;
  ``torch.distributed`` only by ``distributed/``; torchrec only by ``torchrec.py`` and ``apps/``, and at
  import time only by ``torchrec.py``; cupy at import time only by ``_backend.py``;
- (d) no module reads another module's underscored members;
- (e) every module is 30-600 lines;
- (f) tests read no private member of the store or a tier, and import no underscored name of
  the package; above ``tests/tiers/`` they make a tier fail or watch it through
  ``tiered_emb.testing.faults``, never by patching its parts;
- (g) the wheel's package list (pyproject.toml) names every package of the tree, and ships
  ``native/`` (the CUDA C kernels) as ``tiered_emb.native``;
- (h) ``TieredStore`` has at most 22 public names (the rest is ``store.engine``).

Each test reports every offender in one assertion message, grouped by file.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "tiered_emb"
TESTS = ROOT / "tests"

MIN_LINES, MAX_LINES = 30, 600
SHORT_OK = {"__init__.py", "_version.py"}  # a package's re-exports, the version: short by nature

# Attribute names that begin with one underscore but are public API where they come from.
PUBLIC_UNDERSCORED = {
    "_replace": "namedtuple API",
    "_asdict": "namedtuple API",
    "_fields": "namedtuple API",
    "_make": "namedtuple API",
    "_field_defaults": "namedtuple API",
}

# Reads of other libraries' members that begin with one underscore and are the way their authors document
# (or the only way there is) to do the thing, by the expression as written.
FOREIGN_API: dict[str, str] = {
    "os._exit": "the stdlib's exit of a forked child without the parent's cleanup handlers",
    "ary._getvalue": "Numba's struct proxy (context.make_array) hands its LLVM value out this way in an intrinsic",
    "torch.autograd.Variable._execution_engine": "the only hook that queues a callback after the whole backward "
    "(FBGEMM and DeepSpeed use it too); torch has no public one",
    "parser._actions": "argparse's list of a parser's options; it has no public one (the CLI shows each default "
    "and its tests check each option's help from it)",
    "ddp._get_active_ddp_module": "DistributedDataParallel's own record of the module whose forward runs "
    "(TorchDynamo reads it the same way); torch has no public one",
}

# (file relative to the repository root, "<expression>._name"): why it is allowed.  Keep it short:
# a private read between modules means an interface is missing.
PRIVATE_READ_ALLOWED: dict[tuple[str, str], str] = {}

# "<name>._<attr>" reads in tests/ that are allowed, each with its reason.  Tests use the public API.
TEST_PRIVATE_READ_ALLOWED: dict[str, str] = {
    "la._store_lookahead": "the simulator's jitted window loop, driven batch by batch against the store's own "
    "threaded window (the test of their equivalence)",
    "mrc._sweep_chunk": "the miss-ratio curve's chunk kernel at its edges (a chunk of one request, the last)",
    "dlrm._step_threads": "the DLRM job's thread-count rule for a resumed run, tested without training",
}


# ---------------------------------------------------------------------------------------------------------
# the source, parsed


@dataclass(frozen=True)
class Import:
    module: str  # absolute dotted name: "tiered_emb.store", "torch.distributed"
    line: int
    at_import_time: bool  # executed when the module is imported (not inside a function)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def package_files() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def sources_of_tests() -> list[Path]:
    return sorted(p for p in TESTS.rglob("*.py") if "__pycache__" not in p.parts)


@cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _walk_imports(node: ast.AST, in_function: bool, type_only: bool) -> Iterator[tuple[ast.AST, bool, bool]]:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child, in_function, type_only
        elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            yield from _walk_imports(child, True, type_only)
        elif isinstance(child, ast.If) and _is_type_checking(child.test):
            for stmt in child.body:
                yield from _walk_imports(ast.Module(body=[stmt], type_ignores=[]), in_function, True)
            for stmt in child.orelse:
                yield from _walk_imports(ast.Module(body=[stmt], type_ignores=[]), in_function, type_only)
        else:
            yield from _walk_imports(child, in_function, type_only)


def _resolve_from(path: Path, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = _module_name(path).split(".")
    if path.name != "__init__.py":
        base.pop()
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports(path: Path) -> list[Import]:
    """Every module ``path`` imports: ``from a.b import c`` gives ``a.b`` and ``a.b.c`` (c may be a module)."""
    out = []
    for node, in_function, type_only in _walk_imports(_tree(path), False, False):
        at_import_time = not in_function and not type_only
        if isinstance(node, ast.Import):
            out += [Import(alias.name, node.lineno, at_import_time) for alias in node.names]
        else:
            assert isinstance(node, ast.ImportFrom)
            base = _resolve_from(path, node)
            out.append(Import(base, node.lineno, at_import_time))
            out += [Import(f"{base}.{a.name}", node.lineno, at_import_time) for a in node.names if a.name != "*"]
    return out


def _under(module: str, prefixes: Iterable[str]) -> str | None:
    for p in prefixes:
        if module == p or module.startswith(p + "."):
            return p
    return None


def _in(path: Path, *homes: str) -> bool:
    """``path`` is one of ``homes`` (files or folders relative to the repository root)."""
    rel = _rel(path)
    return any(rel == h or rel.startswith(h.rstrip("/") + "/") for h in homes)


def _grouped(offenders: Iterable[tuple[str, str]]) -> str:
    by_file: dict[str, list[str]] = defaultdict(list)
    for file, what in offenders:
        by_file[file].append(what)
    return "\n".join(f"{f}:\n" + "\n".join(f"    {w}" for w in by_file[f]) for f in sorted(by_file))


def _forbidden_imports(homes: tuple[str, ...], forbidden: tuple[str, ...]) -> list[tuple[str, str]]:
    found = []
    for path in package_files():
        if not _in(path, *homes):
            continue
        for imp in imports(path):
            hit = _under(imp.module, forbidden)
            if hit and _module_name(path) != hit and not _module_name(path).startswith(hit + "."):
                found.append((_rel(path), f"line {imp.line}: imports {imp.module}"))
    return sorted(set(found))


# ---------------------------------------------------------------------------------------------------------
# (a), (b): the layers


def test_cache_and_tiers_import_no_upper_layer() -> None:
    found = _forbidden_imports(
        ("tiered_emb/cache", "tiered_emb/tiers"),
        ("tiered_emb.step", "tiered_emb.store", "tiered_emb.prefetch", "tiered_emb.apps", "tiered_emb.sim"),
    )
    assert not found, "cache/ and tiers/ import a layer above them:\n" + _grouped(found)


def test_sim_imports_neither_the_store_nor_the_tiers() -> None:
    found = _forbidden_imports(
        ("tiered_emb/sim",),
        (
            "tiered_emb.store",
            "tiered_emb.tiers",
            "tiered_emb.apps",
            "tiered_emb.prefetch.worker",
            "tiered_emb.prefetch.lookahead",
            "tiered_emb.step.resolve",
            "tiered_emb.torch",
        ),
    )
    assert not found, "sim/ imports the store's side of the package:\n" + _grouped(found)


def test_torch_front_end_goes_through_the_engine() -> None:
    """The torch front end plans, looks up, reduces and updates through ``store.engine``
    (the step as values: a plan, a forward record), never through the step's modules."""
    found = _forbidden_imports(("tiered_emb/torch",), ("tiered_emb.step",))
    assert not found, "torch/ imports the step's modules (ask the engine):\n" + _grouped(found)


# ---------------------------------------------------------------------------------------------------------
# (c): optional dependencies stay optional

# torch/ is the torch front end; torchrec.py its TorchRec collection; distributed/ shards over
# torch.distributed; apps/dlrm.py builds its dense MLPs with torch (the apps use the public API, torch included)
TORCH_HOMES = ("tiered_emb/torch", "tiered_emb/torchrec.py", "tiered_emb/distributed", "tiered_emb/apps")
TORCH_DISTRIBUTED_HOMES = ("tiered_emb/distributed",)
# torchrec.py imports torchrec when it is imported (its classes derive from TorchRec's); the apps when they run
TORCHREC_HOMES = ("tiered_emb/torchrec.py", "tiered_emb/apps")
TORCHREC_IMPORT_TIME_HOMES = ("tiered_emb/torchrec.py",)
CUPY_HOMES = ("tiered_emb/_backend.py",)  # every other module gets cupy as `xp` from it


def test_optional_imports_stay_in_their_homes() -> None:
    found = []
    for path in package_files():
        for imp in imports(path):
            if _under(imp.module, ("torch.distributed",)) and not _in(path, *TORCH_DISTRIBUTED_HOMES):
                found.append((_rel(path), f"line {imp.line}: imports {imp.module} (only distributed/ may)"))
            elif _under(imp.module, ("torch",)) and not _in(path, *TORCH_HOMES):
                found.append((_rel(path), f"line {imp.line}: imports {imp.module} (only {', '.join(TORCH_HOMES)} may)"))
            if _under(imp.module, ("torchrec",)) and not _in(path, *TORCHREC_HOMES):
                found.append(
                    (_rel(path), f"line {imp.line}: imports {imp.module} (only {', '.join(TORCHREC_HOMES)} may)")
                )
            elif (
                _under(imp.module, ("torchrec",)) and imp.at_import_time and not _in(path, *TORCHREC_IMPORT_TIME_HOMES)
            ):
                found.append(
                    (_rel(path), f"line {imp.line}: imports {imp.module} at import time (only torchrec.py may)")
                )
            if _under(imp.module, ("cupy", "cupyx")) and imp.at_import_time and not _in(path, *CUPY_HOMES):
                why = "at import time (take it from tiered_emb._backend)"
                found.append((_rel(path), f"line {imp.line}: imports {imp.module} {why}"))
    found = sorted(set(found))
    assert not found, "optional dependencies imported outside their homes:\n" + _grouped(found)


# ---------------------------------------------------------------------------------------------------------
# (d): no module reads another's underscored members


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and name not in PUBLIC_UNDERSCORED


def _dotted(node: ast.expr) -> str | None:
    """``a.b.c`` for a chain of names and attributes, else None."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = _dotted(node.value)
        return None if head is None else f"{head}.{node.attr}"
    return None


def _is_module(dotted: str) -> bool:
    rel = Path(*dotted.split("."))
    return (ROOT / rel).with_suffix(".py").is_file() or (ROOT / rel / "__init__.py").is_file()


def _own_private_attributes(tree: ast.Module) -> set[str]:
    """Underscored attributes the module's own classes define: ``self._x = ...`` (or ``cls._x``) anywhere,
    and methods or class attributes named ``_x``.  ``other._x`` is then a read of the module's own class
    (``other`` another instance of it, as in ``__eq__``), resolved no further than that."""
    own = set()
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Name)
            and node.value.id in ("self", "cls")
        ):
            own.add(node.attr)
        elif isinstance(node, ast.ClassDef):
            for stmt in node.body:
                if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    own.add(stmt.name)
                elif isinstance(stmt, ast.Assign):
                    own.update(t.id for t in stmt.targets if isinstance(t, ast.Name))
                elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                    own.add(stmt.target.id)
    return {a for a in own if _private(a)}


def _module_aliases(path: Path) -> dict[str, str]:
    """Local names bound to modules of the package: ``import tiered_emb.x as m``, ``from tiered_emb import x``."""
    aliases = {}
    for node, _, _ in _walk_imports(_tree(path), False, False):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.asname:
                    aliases[a.asname] = a.name
                else:  # `import tiered_emb.x` binds `tiered_emb`; `tiered_emb.x._y` is caught by its dotted name
                    aliases[a.name.split(".")[0]] = a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve_from(path, node)
            for a in node.names:
                if _is_module(f"{base}.{a.name}"):
                    aliases[a.asname or a.name] = f"{base}.{a.name}"
    return aliases


def private_reads(path: Path) -> list[tuple[int, str]]:
    """``(line, "<expression>._name")`` for every use of another module's underscored member in ``path``."""
    tree = _tree(path)
    own = _own_private_attributes(tree)
    aliases = _module_aliases(path)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = _resolve_from(path, node)
            # a private module of the package (tiered_emb._args) is the package's own: importing it is fine
            out += [
                (node.lineno, f"from {base} import {a.name}")
                for a in node.names
                if _private(a.name) and not _is_module(f"{base}.{a.name}")
            ]
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            value = node.value
            if isinstance(value, ast.Name) and value.id in ("self", "cls"):
                continue
            if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "super":
                continue
            dotted = _dotted(value)
            head = dotted.split(".")[0] if dotted else None
            if f"{dotted}.{node.attr}" in FOREIGN_API:
                continue
            if head in aliases:  # a module: m._x, tiered_emb.x._y
                module = aliases[head] + dotted[len(head) :]
                if _is_module(f"{module}.{node.attr}"):
                    continue  # a private module (tiered_emb._args, say): the package's own
                out.append((node.lineno, f"{dotted}.{node.attr}"))
            elif node.attr not in own and f"{dotted}.{node.attr}" not in FOREIGN_API:
                out.append((node.lineno, f"{dotted or ast.unparse(value)}.{node.attr}"))
    return sorted(set(out))


def test_no_module_reads_another_modules_private_members() -> None:
    found = []
    for path in package_files():
        for line, what in private_reads(path):
            if (_rel(path), what) not in PRIVATE_READ_ALLOWED:
                found.append((_rel(path), f"line {line}: {what}"))
    assert not found, (
        "modules read other modules' underscored members (make the member public, or add the "
        "interface that is missing):\n" + _grouped(found)
    )


def test_allow_lists_hold_no_stale_entries() -> None:
    reads = {(_rel(p), what) for p in package_files() for _, what in private_reads(p)}
    stale = sorted(k for k in PRIVATE_READ_ALLOWED if k not in reads)
    test_reads = {what for p in sources_of_tests() for _, what in private_reads_in_test(p)}
    stale_tests = sorted(k for k in TEST_PRIVATE_READ_ALLOWED if k not in test_reads)
    assert not stale and not stale_tests, f"allow-list entries that match nothing any more: {stale + stale_tests}"


def test_the_checks_see_what_is_there() -> None:
    """The parser finds known imports and reads, so an empty report means a clean tree, not a blind check."""
    backend = {(i.module, i.at_import_time) for i in imports(PACKAGE / "_backend.py")}
    assert ("cupy", False) in backend  # imported inside a function: not at import time
    assert ("tiered_emb.errors.DeviceError", True) in backend
    config = PACKAGE / "config.py"
    assert any(i.module == "tiered_emb.errors" for i in imports(config))
    assert "_is_int" not in _own_private_attributes(_tree(config))  # a function, not an attribute
    assert _is_module("tiered_emb._args") and not _is_module("tiered_emb._args.int_arg")


# ---------------------------------------------------------------------------------------------------------
# (e): module size


def test_modules_are_30_to_600_lines() -> None:
    found = []
    for path in package_files():
        n = len(path.read_text(encoding="utf-8").splitlines())
        if n > MAX_LINES:
            found.append((_rel(path), f"{n} lines > {MAX_LINES}: two concerns, two modules"))
        elif n < MIN_LINES and path.name not in SHORT_OK:
            found.append((_rel(path), f"{n} lines < {MIN_LINES}: fold it into the module that uses it"))
    assert not found, "modules outside 30-600 lines:\n" + _grouped(found)


#: The most parameters a function or kernel takes (``self`` / ``cls`` not counted): state that
#: travels together goes in one named structure (a ``NamedTuple`` or a tuple a kernel unpacks,
#: a settings dataclass), not in a long positional list.
MAX_PARAMETERS = 12


def long_signatures(path: Path) -> list[tuple[str, str]]:
    """``(module, "name (n parameters)")`` for each function of ``path`` over :data:`MAX_PARAMETERS`."""
    found = []
    where = _rel(path) if path.is_relative_to(ROOT) else path.name
    for node in ast.walk(_tree(path)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            names = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
            n = len(names) - (1 if names and names[0] in ("self", "cls") else 0)
            if n > MAX_PARAMETERS:
                found.append((where, f"{node.name} ({n} parameters, line {node.lineno})"))
    return found


def test_no_function_takes_a_long_positional_list(tmp_path) -> None:
    found = [f for path in package_files() for f in long_signatures(path)]
    assert not found, f"functions over {MAX_PARAMETERS} parameters:\n" + _grouped(found)
    probe = tmp_path / "probe.py"  # the check sees one when there is one
    probe.write_text("def f(self, " + ", ".join(f"a{i}" for i in range(MAX_PARAMETERS + 1)) + "):\n    pass\n")
    assert [name for _, name in long_signatures(probe)] == [f"f ({MAX_PARAMETERS + 1} parameters, line 1)"]


# ---------------------------------------------------------------------------------------------------------
# (f): tests use the public interface


def private_reads_in_test(path: Path) -> list[tuple[int, str]]:
    """``(line, "<name>._<attr>")`` for reads of an underscored attribute of a plain name in a test
    file, and ``(line, "from <module> import _<name>")`` for an underscored name (not a module)
    imported from the package."""
    tree = _tree(path)
    out = {
        (node.lineno, f"{node.value.id}.{node.attr}")
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and _private(node.attr)
        and isinstance(node.value, ast.Name)
        and node.value.id not in ("self", "cls")
    }
    out |= {
        (node.lineno, f"from {node.module} import {a.name}")
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "tiered_emb"
        for a in node.names
        if _private(a.name) and not _is_module(f"{node.module}.{a.name}")
    }
    return sorted((line, what) for line, what in out if what not in FOREIGN_API)


def test_tests_read_no_private_members(tmp_path) -> None:
    probe = tmp_path / "test_probe.py"
    probe.write_text("from tiered_emb.step.reduce import _reduce_grads\nfrom tiered_emb import _directory\n")
    assert private_reads_in_test(probe) == [(1, "from tiered_emb.step.reduce import _reduce_grads")]  # (modules pass)
    found = [(_rel(p), line, what) for p in sources_of_tests() for line, what in private_reads_in_test(p)]
    extra = sorted({what for _, _, what in found} - set(TEST_PRIVATE_READ_ALLOWED))
    where = [(f, f"line {line}: {what}") for f, line, what in found if what in extra]
    assert not extra, (
        f"tests read private members ({len(extra)} distinct: {', '.join(extra)}); use the public "
        "interface, or add the read to TEST_PRIVATE_READ_ALLOWED with its reason:\n" + _grouped(where)
    )


# ---------------------------------------------------------------------------------------------------------
# (g): the wheel holds every package and the native sources


def test_the_wheel_lists_every_package_and_ships_native() -> None:
    tomllib = pytest.importorskip("tomllib")
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
    tree = {".".join(p.parent.relative_to(ROOT).parts) for p in PACKAGE.rglob("__init__.py")}
    assert set(tool["packages"]) == tree | {"tiered_emb.native"}
    assert tool["package-dir"] == {"tiered_emb.native": "native"}
    shipped = {p.name for pattern in tool["package-data"]["tiered_emb.native"] for p in (ROOT / "native").glob(pattern)}
    assert {"step_kernels.cu", "host_shim.h"} <= shipped


#: What a user calls on a store: the facade stays this narrow; the rest is ``store.engine``.
FACADE_MAX_NAMES = 22


def test_the_store_facade_has_at_most_22_public_names(tmp_path) -> None:
    """``TieredStore``'s public names, its methods and properties and an open store's
    attributes together, are at most 22; the plumbing is the engine's."""
    from tiered_emb import TableConfig, TierConfig, TieredStore

    with TieredStore.create(tmp_path / "s", [TableConfig("t", dim=4)], TierConfig(hbm_rows=2, device="cpu")) as s:
        names = {n for n in dir(s) if not n.startswith("_")}
        assert "engine" in names and "lookup" in names
        assert len(names) <= FACADE_MAX_NAMES, sorted(names)
        assert not {"ssd", "tiers_of", "lookup_pooled", "gradient_update", "window"} & names


_TIER_PARTS = re.compile(
    r"monkeypatch\.setattr\(\s*([^,]*(?:engine\.(?:ssd|resolver)|SegmentLog|SegmentIndex|Compactor|HbmTier|DdrTier|"
    r"CacheTier|Writer|SsdTier\b\.)[^,]*),"
    r"|^\s*[\w.]*engine\.(?:ssd|resolver)\.\w+\.\w+\s*=[^=]"  # (or assigned a tier part's method)
)


def _above_the_tiers(pattern: re.Pattern) -> list[str]:
    """``path:line: text`` of every line of a test outside ``tests/tiers/`` that ``pattern`` finds."""
    found = []
    for path in sorted(TESTS.rglob("*.py")):
        if "tiers" in path.relative_to(TESTS).parts[:1] or path == Path(__file__).resolve():
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line):
                found.append(f"{path.relative_to(TESTS)}:{n}: {line.strip()}")
    return found


_TIER_REACH = re.compile(r"engine\.(?:ssd|resolver)\.\w+(?:\[[^\]]*\])?\.\w+")


def test_no_test_above_the_tiers_reaches_two_levels_into_a_tier() -> None:
    """Tests outside ``tests/tiers/`` reach a tier's settings and methods (one level) but not
    its parts' parts (``engine.ssd.held.staged``, ``engine.ssd.lmdb.env``): they watch those
    through the probes of :mod:`tiered_emb.testing.faults`."""
    assert _TIER_REACH.search("assert len(s.engine.ssd.held.flushing) == 2")  # (the check sees one)
    assert _TIER_REACH.search('t = s.engine.resolver.tables["t"].hbm')
    assert not _TIER_REACH.search("s.engine.ssd.writeback_rows = 32")
    assert not _TIER_REACH.search("s.engine.ssd.wait_writes()")
    found = _above_the_tiers(_TIER_REACH)
    assert not found, found


def test_no_test_above_the_tiers_monkeypatches_a_tier() -> None:
    """Tests outside ``tests/tiers/`` make a tier fail or watch it through
    :mod:`tiered_emb.testing.faults`, never by monkeypatching its parts."""
    assert _TIER_PARTS.search('monkeypatch.setattr(s.engine.ssd.lmdb, "write", full)')  # (the check sees one)
    assert _TIER_PARTS.search("    s.engine.ssd.reader.read_lmdb = spy")
    assert not _TIER_PARTS.search('monkeypatch.setattr(sys, "argv", [])')
    assert not _TIER_PARTS.search("    s.engine.ssd.writeback_rows = 32")  # (a setting, not a part)
    found = _above_the_tiers(_TIER_PARTS)
    assert not found, found
