"""The client side of the LMDB writer process (its own side: :mod:`.writer_main`).

The writer thread hands each background write-back to a process of its own, which has
its own GIL (why: :mod:`.writer_main`).  This module starts it, sends it writes and ends
it, and makes sure it never outlives its trainer's interest: ended by
:meth:`WriterProcess.close`, when the object is collected, at exit, and a process forked
from the trainer does not keep its pipe.

The segments a write puts (encoded by the trainer) reach the process through memory both
map (a ``memfd`` on Linux, handed to the process at its start): copied in once here,
put by the process straight from the map.  Through the pipe they were copied into the
kernel, out again in pieces, then joined: three copies of every byte on a 2-core host
where the process shares a core with the step.  The region grows with the writes it
carries up to ``shared_max`` bytes (the writer's transactions are an eighth of
``budget_bytes``; a background write-back of ``writeback_rows`` may be larger); a write
larger than that, and every write where no ``memfd`` can be made, goes down the pipe.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import select
import signal
import subprocess
import sys
import weakref

import numpy as np

from tiered_emb.errors import CorruptStoreError
from tiered_emb.tiers.ssd import writer_main
from tiered_emb.tiers.ssd.codec import frame_bytes, read_frame
from tiered_emb.tiers.ssd.lmdb_env import LmdbEnv

#: Whether background write-backs go through a writer process (POSIX: it relies on the
#: parent's pipes closing and on re-parenting at the parent's death; elsewhere the writer
#: thread writes itself).
WRITER_PROCESS = os.name == "posix"


class WriterStartError(Exception):
    """The writer process could not start or open the environment."""


class WriterProcess:
    """The trainer's side of one writer process (protocol: :mod:`.writer_main`).  Used by
    the writer thread only, one write at a time.

    The process runs in a session of its own (a Ctrl-C or a signal to the trainer's process
    group does not reach it) with this interpreter's ``sys.path``.  It is ended by
    :meth:`close`, or when this object is collected (a store dropped without ``close()``),
    or at exit; a process forked from this one does not keep its pipe (each pipe end is
    pointed at /dev/null in the fork), so the process still sees its input close.
    """

    #: Seconds the process has to start and open the environment.
    START_TIMEOUT_S = 60

    def __init__(
        self,
        lmdb_env: LmdbEnv,
        compression: int | None,
        tables: list[str],
        malloc_trim: int = 0,
        dtypes: dict[str, int] | None = None,
        shared_max: int = 0,
    ):
        self.path = lmdb_env.path
        if getattr(sys, "frozen", False) or not sys.executable:  # sys.executable is the app, or none
            raise WriterStartError(
                f"the LMDB writer process for {self.path} cannot start (no Python interpreter "
                "to run it: a frozen or embedded app)"
            )
        #: the region shared with the process (its fd, the map, the most it may grow to); its fd
        #: is closed by close() or when this object is collected
        self.shared_fd = _memfd() if shared_max > 0 else None
        self.shared: mmap.mmap | None = None
        self.shared_max = int(shared_max) if self.shared_fd is not None else 0
        self._fd_end = weakref.finalize(self, _close_fd, self.shared_fd)
        paths = [p for p in sys.path if isinstance(p, str) and p and os.pathsep not in p]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths))
        try:
            self.proc = subprocess.Popen(
                [sys.executable, writer_main.__file__, str(os.getpid())],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                close_fds=True,
                pass_fds=() if self.shared_fd is None else (self.shared_fd,),
                start_new_session=True,
                env=env,
            )
        except (OSError, TypeError, ValueError) as err:
            self._close_shared()
            raise WriterStartError(f"the LMDB writer process for {self.path} cannot start ({err})") from err
        _widen_pipe(self.proc.stdin)
        self._end = weakref.finalize(self, _end_process, self.proc)
        _RUNNING.add(self)
        hello = {
            "path": str(lmdb_env.path),
            "map_size": lmdb_env.map_size(),
            "max_dbs": lmdb_env.max_dbs,
            "max_readers": lmdb_env.max_readers,
            "compression": compression,
            "dbs": ["p:" + t for t in sorted(tables)],
            "dtypes": {"p:" + t: int(c) for t, c in sorted((dtypes or {}).items())},
            "malloc_trim": int(malloc_trim),
            "shared_fd": self.shared_fd,
        }
        try:
            reply = self._call(hello, [], timeout=self.START_TIMEOUT_S, max_reply=1 << 12)
        except CorruptStoreError as err:
            self.close()
            raise WriterStartError(
                f"the LMDB writer process for {self.path} could not start ({err.args[0]}; "
                "its error, if any, is on stderr)"
            ) from err
        if reply.get("ok") is not True:
            self.close()
            raise WriterStartError(f"the LMDB writer process for {self.path} could not open it ({reply})")

    def write(self, segments, map_size: int) -> dict:
        """Send one write and return the process's reply: ``[(table, number, ids int64, value)]``,
        each value a segment's LMDB value (:meth:`.SegmentLog.encoded`), put as it is, or its
        rows (float32 (k, W)), which the process encodes."""
        parts, arrays = [], []
        encoded = [memoryview(rows).cast("B") for _, _, _, rows in segments if not _is_rows(rows)]
        shared = self._share(sum(_aligned(v.nbytes) for v in encoded))
        at = 0
        for t, seq, ids, rows in segments:
            if _is_rows(rows):
                parts.append(["p:" + t, int(seq), int(ids.shape[0]), int(rows.shape[1])])
                arrays += [ids, rows]
                continue
            value = memoryview(rows).cast("B")
            if shared is None:
                parts.append(["p:" + t, int(seq), value.nbytes])
                arrays.append(value)
            else:  # into the shared region; the part names where
                shared[at : at + value.nbytes] = value
                parts.append(["p:" + t, int(seq), value.nbytes, "shared", at])
                at += _aligned(value.nbytes)
        head = {"map_size": map_size, "parts": parts}
        if shared is not None:
            head["shared_bytes"] = len(shared)
        return self._call(head, arrays)

    def _share(self, nbytes: int) -> mmap.mmap | None:
        """The shared region, grown to at least ``nbytes`` (in steps of doubling, at most
        ``shared_max``), or None: the write goes down the pipe."""
        if self.shared_fd is None or not 0 < nbytes <= self.shared_max:
            return None
        size = len(self.shared) if self.shared is not None else 0
        if size < nbytes:
            size = min(max(nbytes, 2 * size, 1 << 20), self.shared_max)
            try:
                os.ftruncate(self.shared_fd, size)
                region = mmap.mmap(self.shared_fd, size)
            except OSError:
                return None  # (no memory for it now: the pipe)
            if self.shared is not None:
                self.shared.close()
            self.shared = region
        return self.shared

    def _close_shared(self) -> None:
        if self.shared is not None:
            self.shared.close()
            self.shared = None
        self._fd_end()
        self.shared_fd = None

    def _call(self, head: dict, arrays, timeout: float | None = None, max_reply: int | None = None) -> dict:
        """Send a frame (and ``arrays``' bytes) and return the reply; ``timeout`` seconds for
        it to begin and ``max_reply`` bytes at most (for the start: a program that is not
        the writer may answer anything, or nothing)."""
        try:
            self.proc.stdin.write(frame_bytes(head))
            for a in arrays:
                self.proc.stdin.write(memoryview(a).cast("B"))
            self.proc.stdin.flush()
            if timeout is not None and not select.select([self.proc.stdout], [], [], timeout)[0]:
                self.proc.kill()
                reply = None
            else:
                reply = read_frame(self.proc.stdout, max_reply)
        except (OSError, ValueError):  # a broken pipe: the process is gone; or not a frame
            reply = None
        if reply is None:
            try:
                status = self.proc.wait(timeout=1)
            except subprocess.TimeoutExpired:
                status = None
            raise CorruptStoreError(
                f"the LMDB writer process of {self.path} ended (exit status {status}) before its "
                "reply; its write was rolled back, or committed and is written again",
                "the rows wait in memory: the next write starts a new writer process",
            )
        return reply

    def close(self) -> None:
        """End the process and reap it (between writes: it holds no transaction)."""
        _RUNNING.discard(self)
        self._end()
        self._close_shared()


def _is_rows(rows) -> bool:
    """Whether a part carries rows for the process to encode (else a segment encoded here)."""
    return isinstance(rows, np.ndarray) and rows.ndim == 2


def _aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to 64: each part in the shared region starts on a cache line."""
    return (nbytes + 63) & ~63


def _close_fd(fd: int | None) -> None:
    if fd is not None:
        with contextlib.suppress(OSError):
            os.close(fd)


def _memfd() -> int | None:
    """A new anonymous shared-memory file (Linux's ``memfd_create``), or None where there is none."""
    create = getattr(os, "memfd_create", None)
    if create is None:
        return None
    try:
        return int(create("tiered_emb-writes"))
    except OSError:
        return None


#: The pipe buffer asked for the writes (Linux; capped by ``/proc/sys/fs/pipe-max-size``).
PIPE_BYTES = 1 << 20


def _widen_pipe(stream) -> None:
    """Give the pipe to the process a buffer of :data:`PIPE_BYTES` where Linux allows it: a
    write of 16 MiB then wakes each side 16 times, not 256 (64 KiB by default).  Left as it
    is where the call is refused."""
    import fcntl

    setsize = getattr(fcntl, "F_SETPIPE_SZ", None)
    if setsize is None:
        return
    try:
        with open("/proc/sys/fs/pipe-max-size") as f:
            most = int(f.read())
    except (OSError, ValueError):
        most = PIPE_BYTES
    with contextlib.suppress(OSError):
        fcntl.fcntl(stream.fileno(), setsize, min(PIPE_BYTES, most))


def _end_process(proc: subprocess.Popen) -> None:
    """Close the writer process's input (it exits at its end: a frame cut short is never
    committed, so this may run while the writer thread is sending one, as at interpreter
    exit) and its output, and reap it (killed if it lingers)."""
    if hasattr(signal, "sigtimedwait"):
        # Closing flushes what a failed write left in the buffer: a SIGPIPE that raises is taken back.
        old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGPIPE})
        try:
            proc.stdin.close()
        except (OSError, ValueError):
            pass  # already gone
        finally:
            signal.sigtimedwait({signal.SIGPIPE}, 0)
            signal.pthread_sigmask(signal.SIG_SETMASK, old)
    for f in (proc.stdin, proc.stdout):
        with contextlib.suppress(OSError):
            f.close()
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


_RUNNING: weakref.WeakSet[WriterProcess] = weakref.WeakSet()


def _forget_pipes_in_fork() -> None:
    """In a process forked from this one: point every writer pipe end it inherited at
    /dev/null, so that a writer still sees its input close when its trainer closes it or
    dies (the fork itself never talks to the writers; its copies of these objects just
    close /dev/null)."""
    if not _RUNNING:
        return
    null = os.open(os.devnull, os.O_RDWR)
    try:
        for w in list(_RUNNING):
            for f in (w.proc.stdin, w.proc.stdout):
                with contextlib.suppress(OSError, ValueError):
                    os.dup2(null, f.fileno())
        _RUNNING.clear()
    finally:
        os.close(null)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pipes_in_fork)
