"""Where Numba keeps the compiled kernels: one directory per version of the package's source.

Numba's on-disk cache checks a kernel against its own source file only.  A kernel that
inlines functions of another module (the tier kernels inline the policies, the
simulator's batch loop inlines the tier kernels) keeps the machine code of the old
functions when only those change: after a ``git pull`` that touched
``cache/policies/`` and not ``sim/lookahead.py``, the cached ``_store_lookahead`` read the
policy state by the old layout and wrote outside its arrays.  So the cache directory is
named by a hash of every source file of the package: any change to any of them starts a
fresh cache (one full compile, as on the first run), and the kernels never mix versions.

The directory is ``tiered_emb/__pycache__/kernels-<hash>`` beside the sources when that is
writable, else ``~/.cache/tiered_emb/kernels-<hash>``; where neither can be made, Numba's
own default stays.  In the first, directories of older sources are removed but for the
two newest and any touched in the last hour (another process of an older tree may still
be saving there), so that a tree edited often does not keep every version it went
through (they are this module's own).

The choice is made through ``NUMBA_CACHE_DIR`` in the environment as well as Numba's
config: Numba reloads its config from the environment when a ``NUMBA_*`` variable
changes, which would otherwise drop the directory, and the processes the store starts
(its writer) inherit it.  Kernels of other packages compiled in the same process are
cached there too.  A ``NUMBA_CACHE_DIR`` set before the import is left as it is.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import time
from pathlib import Path

import numba

from tiered_emb import _compiles

PACKAGE = Path(__file__).resolve().parent
KEEP_OLDER = 2  # directories of older sources kept beside the current one
RECENT_S = 3600  # nor is one removed that was touched this recently


def source_hash(root: Path = PACKAGE) -> str:
    """A hash of the path and bytes of every ``.py`` file under ``root``, in path order."""
    h = hashlib.blake2b(digest_size=8)
    for path in sorted(root.rglob("*.py")):
        h.update(path.relative_to(root).as_posix().encode() + b"\0")
        h.update(path.read_bytes())
    return h.hexdigest()


def cache_dir(root: Path = PACKAGE) -> Path:
    """The directory for the kernels of the source under ``root`` (see the module doc)."""
    name = f"kernels-{source_hash(root)}"
    beside = root / "__pycache__"
    if os.access(beside if beside.exists() else root, os.W_OK):
        return beside / name
    return Path.home() / ".cache" / "tiered_emb" / name


def prune_older(current: Path) -> None:
    """Remove the older ``kernels-*`` directories beside ``current`` but the newest few."""
    older = [p for p in current.parent.glob("kernels-*") if p != current and p.is_dir()]
    older.sort(key=lambda p: p.stat().st_mtime, reverse=True)
    now = time.time()
    for p in older[KEEP_OLDER:]:
        if now - p.stat().st_mtime > RECENT_S:
            shutil.rmtree(p, ignore_errors=True)


def use() -> None:
    """Point Numba's cache at :func:`cache_dir`, and compile each kernel once across the
    processes that share it (:mod:`tiered_emb._compiles`); before any kernel module is imported."""
    _compiles.install()
    prefer_wide_vectors()
    if os.environ.get("NUMBA_CACHE_DIR"):
        return
    where = cache_dir()
    fresh = not where.exists()
    try:
        where.mkdir(parents=True, exist_ok=True)
    except OSError:  # (a read-only tree and no home to write in: Numba's default)
        return
    os.environ["NUMBA_CACHE_DIR"] = str(where)
    # (numba.config sets its attributes at run time from the environment: mypy sees none)
    setattr(numba.config, "CACHE_DIR", str(where))  # noqa: B010
    if fresh and where.parent.parent == PACKAGE:
        prune_older(where)


def prefer_wide_vectors() -> None:
    """On a CPU with AVX-512, have LLVM prefer 512-bit vectors (through ``NUMBA_CPU_FEATURES``:
    the host's features and ``-prefer-256-bit``), unless ``NUMBA_CPU_FEATURES`` or
    ``NUMBA_CPU_NAME`` is set already.

    LLVM's tuning for recent Intel server cores prefers 256-bit vectors, so Numba's loops
    over a row (pooling, the updates, row copies) ran on half-width registers.  With
    512-bit ones the resident step and the forward ran faster (docs/benchmarks.md,
    "Kernel choices"); every lane computes what it did, so the results are bitwise the
    same (no kernel lets the compiler reorder a sum).  It applies to every Numba function
    compiled in the process afterwards, as the cache directory does.
    """
    if os.environ.get("NUMBA_CPU_FEATURES") or os.environ.get("NUMBA_CPU_NAME"):
        return
    try:
        import llvmlite.binding as llvm

        features = llvm.get_host_cpu_features().flatten()
    except Exception:  # (a host whose features LLVM cannot read: Numba's default)
        return
    if "+avx512f" not in features.split(","):
        return
    wide = features + ",-prefer-256-bit"
    os.environ["NUMBA_CPU_FEATURES"] = wide
    setattr(numba.config, "CPU_FEATURES", wide)  # noqa: B010
