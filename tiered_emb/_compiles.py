"""Kernel compiles across processes: one compile of each kernel, and the list of a run's kernels.

Numba compiles a kernel the first time a process calls it with a signature that is not in
the kernel cache, and saves it there.  Two processes that reach the same kernel at once (a
first ``tiered-emb train`` and the small job that compiles beside it,
:mod:`tiered_emb.apps.warm`; the ranks of a sharded job) would each compile it.  Here a
compile of a cached kernel of this package first takes an exclusive lock (``fcntl.flock``)
on a file named by the kernel (and the factory arguments that made it) and its signature,
in ``locks/`` of the kernel cache directory; Numba then looks in the cache again under
that lock, so the process that waited loads what the other one saved instead of
compiling it again.

No deadlock: a process holds the locks of the kernels it is compiling, one inside the
other (a kernel's callees compile inside its compile), a path down the call graph, which
has no cycles; a kernel compiling inside its own compile in the same process does not take
its lock again.  A lock held longer than :data:`WAIT_S` (a process stopped while
compiling) is passed by: its compile is then done here too, as without the lock.  A
process that ends lets its locks go.  Where ``fcntl`` is missing (Windows) nothing is
locked.

The lock spares a core the same work; it does not make two processes that call kernels
in the same order compile different ones.  For that, :func:`recording` lists the kernels
a run calls, in the order it first calls them, with their signatures, and
:func:`compile_listed` compiles such a list (the process beside a first run compiles the
default job's from its end: :mod:`tiered_emb.apps.warm`).
"""

from __future__ import annotations

import base64
import hashlib
import importlib
import inspect
import os
import pickle
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numba
from numba.core import sigutils
from numba.core.compiler_lock import global_compiler_lock
from numba.core.dispatcher import Dispatcher

try:
    import fcntl
except ImportError:  # (Windows)
    fcntl = None  # type: ignore[assignment]

#: Longest wait for another process's compile of one kernel before compiling it here.
WAIT_S = 600.0
_POLL_S = 0.01

_held: set[str] = set()  # keys this process is compiling (under Numba's compiler lock)
_installed = threading.Lock()
_original = None
_recorded: list[tuple] | None = None  # (module:qualname, factory's arguments, signature), first call first
_MADE_BY = "_tiered_emb_made_by"


def made_by(kernel, factory, *args):
    """Mark ``kernel`` as made by ``factory(*args)`` (ints, bools, strings), for :func:`recording`;
    returns ``kernel``."""
    setattr(kernel, _MADE_BY, (f"{factory.__module__}:{factory.__qualname__}", list(args)))
    return kernel


def lock_key(func, args, made=None) -> str:
    """The lock file's name for a compile of ``func`` (the Python function) for ``args``
    (``made``: the factory and arguments that made it, :func:`made_by`)."""
    text = f"{func.__module__}:{func.__qualname__}:{made!r}:{tuple(args)!r}"
    return hashlib.blake2b(text.encode(), digest_size=10).hexdigest()


@contextmanager
def _file_lock(path: Path):
    """Hold an exclusive ``flock`` on ``path``, waiting at most :data:`WAIT_S` (then go on
    unlocked); nothing where ``fcntl`` is missing."""
    if fcntl is None:
        yield
        return
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:  # (a cache directory that cannot be written: no lock, as without one)
        yield
        return
    try:
        deadline = time.monotonic() + WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    break
                time.sleep(_POLL_S)
        yield
    finally:
        os.close(fd)  # (lets the lock go)


def _ours(dispatcher) -> bool:
    """A kernel of this package whose compiled code goes to the on-disk cache."""
    module = getattr(getattr(dispatcher, "py_func", None), "__module__", None) or ""
    return module.startswith("tiered_emb.") and getattr(dispatcher.stats, "cache_path", None) is not None


def _compile(self, sig):
    if not _ours(self):
        return _original(self, sig)
    with global_compiler_lock:  # (Numba's own, reentrant: taken first, as its compile does)
        args, _ = sigutils.normalize_signature(sig)
        args = tuple(args)
        if args in self.overloads:
            return _original(self, sig)
        func, made = self.py_func, getattr(self, _MADE_BY, None)
        if _recorded is not None and not _held:
            name = made or (f"{func.__module__}:{func.__qualname__}", None)
            if "<locals>" not in name[0]:
                _recorded.append((*name, args))
        key = lock_key(func, args, made)
        cache = os.environ.get("NUMBA_CACHE_DIR")
        if key in _held or not cache:
            return _original(self, sig)
        where = Path(cache) / "locks"
        try:
            where.mkdir(exist_ok=True)
        except OSError:
            return _original(self, sig)
        with _file_lock(where / (key + ".lock")):
            _held.add(key)
            try:
                return _original(self, sig)
            finally:
                _held.discard(key)


def install() -> None:
    """Take a lock around each compile of this package's cached kernels (see the module doc;
    where ``fcntl`` is missing, only :func:`recording` sees them); once per process."""
    global _original
    with _installed:
        if _original is not None:
            return
        _original = Dispatcher.compile
        Dispatcher.compile = _compile  # type: ignore[method-assign]


@contextmanager
def recording() -> Iterator[list[dict]]:
    """List every kernel of this package that the block calls for the first time in this
    process (compiled or loaded from the cache), in that order: entries ``{"kernel":
    "module:qualname", "sig": text}`` for :func:`compile_listed`, and for a kernel that a
    function makes (marked by :func:`made_by`), that function's name and ``"made_by"``: its
    arguments.  Left out: the kernels called inside another's compile (they compile with
    it, and a kernel loaded from the cache calls none), and those made by a function
    without the mark."""
    global _recorded
    if _original is None:
        raise RuntimeError("tiered_emb._compiles.install() was not called")
    _recorded, out = [], []
    try:
        yield out
    finally:
        found, _recorded = _recorded, None
        seen = set()
        for name, made, args in found:
            key = (name, repr(made), args)
            if key not in seen:
                seen.add(key)
                entry = {"kernel": name, "sig": base64.b64encode(pickle.dumps(args)).decode()}
                out.append(entry if made is None else entry | {"made_by": made})


def compile_listed(entries: list[dict], numba_version: str, dim: int | None = None, retype=None) -> int:
    """Compile (or load from the cache) each kernel of ``entries`` (from :func:`recording`)
    with its signature, in order; returns how many.  A kernel made by a factory with a
    parameter ``dim`` is made for ``dim`` where given (else for the recorded one); each
    argument's type goes through ``retype`` (a type -> type function) where given.  Nothing
    where ``numba_version`` is not the running Numba's (its types may not unpickle the
    same); an entry whose kernel or signature no longer exists, or does not compile, is
    passed by (the run compiles what it needs itself)."""
    if numba_version != numba.__version__:
        return 0
    done = 0
    for entry in entries:
        try:
            module, qualname = entry["kernel"].split(":")
            kernel = importlib.import_module(module)
            for part in qualname.split("."):
                kernel = getattr(kernel, part)
            if "made_by" in entry:  # (a factory: the kernel it makes for these arguments)
                made = inspect.signature(kernel).bind(*entry["made_by"])
                if dim is not None and "dim" in made.arguments:
                    made.arguments["dim"] = dim
                kernel = kernel(*made.args, **made.kwargs)
            args = pickle.loads(base64.b64decode(entry["sig"]))
            kernel.compile(args if retype is None else tuple(retype(a) for a in args))
        except Exception:  # (a list older than the code: this entry is of no use)
            continue
        done += 1
    return done
