"""The LMDB writer process: commits the SSD tier's background write-backs outside the trainer's process.

Why a process: py-lmdb releases the GIL around every key it puts (``Cursor.putmulti``
included), so a writer *thread* hands the GIL back and forth with the step and the
prefetch thread for every key, and slows both of them and itself.  A process has its own
GIL: the trainer's side only sends the rows down a pipe and waits for the reply with the
GIL released.  LMDB is built for several processes on one environment (its lock file
serialises the writers and tracks every process's readers), so the trainer's own reads
and its checkpoints go on through its own environment.

This module runs as a plain script (``python writer_main.py <parent pid>``: no package
import, so it starts in a fraction of a second) and loads :mod:`.codec` from beside it
by its path; the package imports it for :func:`disk_full`, the full-disk test that both
processes must share.

Protocol, frames of a 4-byte little-endian length and a JSON object, on stdin / stdout:

- first ``{"path", "map_size", "max_dbs", "max_readers", "compression", "dbs", "dtypes"}``
  (``dtypes``: db name -> its rows' dtype code, :data:`.codec.DTYPE_CODES`); reply ``{"ok": true}``;
- then per write ``{"map_size", "parts": [[db name, segment number, rows, width], ...]}``
  followed, per part, by its ids (int64) and rows (float32, rows x width) as raw bytes;
  each part is put as one segment (see :func:`.codec.encode_segment`); a part
  ``[db name, segment number, bytes]`` is followed by the segment's value, encoded by the
  trainer (its Numba kernels on its threads), and put as it is; reply ``{"ok": true}``,
  or ``{"error": "map_full"}`` (nothing written: the trainer's side grows the map and sends the write again), or
  ``{"error": "full" | "failed", "message": ...}`` (rolled back).  Where the hello named a
  ``shared_fd`` (memory both processes map), a write may carry ``shared_bytes`` (the
  region's size now) and parts ``[db name, segment number, bytes, "shared", offset]``: a
  segment's value at that offset of the region, nothing of it on the pipe.

The process ends when stdin closes (its parent closed it, or ended: the kernel closes a
dead process's pipes; a frame cut short is never committed) and, while it waits for a write, within a second of
its parent's end (a process forked from the parent may hold the pipe open).  It runs in a
session of its own and ignores SIGINT: a Ctrl-C or a signal to the trainer's process
group is the trainer's to handle.  A write the parent did not live to see is never committed: the
process looks at its parent *inside* the write transaction, after LMDB's writer lock is
taken and just before the commit.  A process that opens the store after the parent's
death must first take the parent's store lock, released only at its death, and then
LMDB's writer lock to drop ``p:``; so either this commit came first (and is dropped with
``p:``), or this process takes LMDB's lock after that and finds its parent gone (the
kernel re-parents it as part of the parent's exit, long before another process can have
opened LMDB).  (``PR_SET_PDEATHSIG`` is no use here: it fires when the *thread* that
started the process ends, and each write-back runs on a thread of its own.)
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__" and sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]  # run as a script: this package's modules (index.py, ...) must not shadow others

import errno
import shutil

import numpy as np


def _codec_beside():
    """:mod:`.codec`, loaded from this file's directory without importing the package."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "tiered_emb_writer_codec", os.path.join(os.path.dirname(os.path.abspath(__file__)), "codec.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


if __name__ == "__main__":
    codec = _codec_beside()
else:
    from tiered_emb.tiers.ssd import codec

#: Free bytes under which an I/O error of a write is taken for a full disk.
FULL_BELOW_BYTES = 64 << 20


def disk_full(err: BaseException, path) -> bool:
    """Whether a failed write transaction ran out of disk.  Besides ENOSPC: LMDB reports a
    short write of its pages as EIO ("Input/output error"), the usual first failure of a
    filling disk; an EIO with less than :data:`FULL_BELOW_BYTES` free counts as full."""
    import lmdb

    if isinstance(err, lmdb.DiskError) or getattr(err, "errno", None) == errno.ENOSPC or "No space" in str(err):
        return True
    if getattr(err, "errno", None) != errno.EIO and "Input/output error" not in str(err):
        return False
    try:
        return shutil.disk_usage(path).free < FULL_BELOW_BYTES
    except OSError:
        return False


#: glibc's ``mallopt`` parameters (malloc.h) and the largest mmap threshold it takes on 64 bits.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_THRESHOLD_BYTES = 32 << 20
_tuned = [0]  # the trim threshold set in this process (0: none)


def tune_allocator(trim_bytes: int) -> bool:
    """Keep the memory of a large write's buffers for the next one (glibc only; False elsewhere).

    LMDB copies each transaction into pages it allocates, and the encoded segments are as
    large: allocations of 1-64 MiB, each freed when its transaction commits.  By default
    glibc serves most of them by ``mmap`` and gives them back on free, or trims its heap
    above 2x the largest such block, so each transaction faults its pages in again (a
    zeroed page each 4 KiB).  This serves blocks up to 32 MiB from the heap and trims only
    the free memory above ``trim_bytes`` (32 MiB to 1 GiB; the largest asked in the process
    is kept): each arena keeps up to that much of what earlier writes freed."""
    trim = int(min(max(trim_bytes, _MMAP_THRESHOLD_BYTES), 1 << 30))
    if not sys.platform.startswith("linux") or trim <= _tuned[0]:
        return _tuned[0] > 0
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        if not hasattr(libc, "gnu_get_libc_version"):
            return False  # (not glibc: its mallopt, if any, means something else)
        ok = libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES) and libc.mallopt(_M_TRIM_THRESHOLD, trim)
    except (OSError, AttributeError):
        return False
    if ok:
        _tuned[0] = trim
    return bool(ok)


class _Orphaned(Exception):
    """The parent ended during a write: the transaction is rolled back."""


def _read_exact(stream, n: int) -> bytes:
    data = codec.read_exact(stream, n)
    if data is None:
        sys.exit(0)  # the trainer's side is gone mid-write: nothing is committed
    return data


def _wait_for_input(stream, parent: int) -> bool:
    """Wait until ``stream`` has input (True) or the parent is gone (False), looking at the
    parent once a second."""
    import select

    try:
        fd = stream.fileno()
    except (OSError, ValueError):  # not a file (a test's in-memory stream): input is there
        return True
    while True:
        try:
            ready, _, _ = select.select([fd], [], [], 1.0)
        except InterruptedError:
            ready = []
        if ready:
            return True
        if os.getppid() != parent:
            return False


def main() -> None:
    import mmap
    import signal

    import lmdb
    import zstandard

    parent = int(sys.argv[1])
    if os.getppid() != parent:
        return
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Unbuffered input: between writes nothing waits in a buffer, so select() on the pipe
    # tells whether the next frame has come.
    inp, out = getattr(sys.stdin.buffer, "raw", sys.stdin.buffer), sys.stdout.buffer
    hello = codec.read_frame(inp)
    if hello is None:
        return
    if hello.get("malloc_trim"):
        tune_allocator(hello["malloc_trim"])
    env = lmdb.open(
        hello["path"],
        map_size=hello["map_size"],
        max_dbs=hello["max_dbs"],
        subdir=True,
        readahead=False,
        meminit=False,
        metasync=False,  # (as the trainer's environment: one sync a commit)
        max_readers=hello["max_readers"],
    )
    level = hello["compression"]
    compressor = zstandard.ZstdCompressor(level=level) if level else None
    dbs = {name: env.open_db(name.encode()) for name in hello["dbs"]}
    dtypes = hello.get("dtypes", {})
    shared_fd, shared = hello.get("shared_fd"), None
    codec.write_frame(out, {"ok": True})
    while True:
        if not _wait_for_input(inp, parent):
            return
        req = codec.read_frame(inp)
        if req is None:
            return
        parts = []
        if req.get("shared_bytes") and (shared is None or len(shared) != req["shared_bytes"]):
            # the trainer grew the region (a map of the old size, with views of it, dies with them)
            shared = mmap.mmap(shared_fd, req["shared_bytes"], prot=mmap.PROT_READ)
        for part in req["parts"]:
            if len(part) == 5:  # a segment's value in the shared region
                name, seq, nbytes, _, at = part
                parts.append((name, seq, None, memoryview(shared)[at : at + nbytes]))
                continue
            if len(part) == 3:  # a segment's value, encoded by the trainer
                name, seq, nbytes = part
                parts.append((name, seq, None, _read_exact(inp, nbytes)))
                continue
            name, seq, n, width = part
            ids = np.frombuffer(_read_exact(inp, 8 * n), dtype=np.int64)
            rows = np.frombuffer(_read_exact(inp, 4 * n * width), dtype=np.float32).reshape(n, width)
            parts.append((name, seq, ids, rows))
        try:
            if req["map_size"] != env.info()["map_size"]:
                env.set_mapsize(req["map_size"])  # the trainer's size (it grows the map)
            with env.begin(write=True) as txn:
                for name, seq, ids, rows in parts:
                    if ids is None:
                        codec.put_value(txn, dbs[name], seq, rows)
                    else:
                        codec.put_segment(txn, dbs[name], seq, ids, rows, compressor, dtype=dtypes.get(name, 0))
                if os.getppid() != parent:  # under LMDB's writer lock: see the module's docstring
                    raise _Orphaned
        except _Orphaned:
            return
        except lmdb.MapFullError:
            codec.write_frame(out, {"error": "map_full"})
            continue
        except lmdb.Error as err:
            codec.write_frame(
                out,
                {
                    "error": "full" if disk_full(err, hello["path"]) else "failed",
                    "message": f"{type(err).__name__}: {err}",
                },
            )
            continue
        codec.write_frame(out, {"ok": True})


if __name__ == "__main__":
    main()
