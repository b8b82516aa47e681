"""The LMDB writer process: commits the SSD tier's background write-backs outside the trainer's process.

Why a process: py-lmdb releases the GIL around every key it puts (``Cursor.putmulti``
included), so a writer *thread* hands the GIL back and forth ~10,000 times a step with
the step and the prefetch thread; in the DLRM job its 65,536-row transactions took 2-3x
their own CPU in wall time and slowed both other threads.  A process has its own GIL: the
trainer's side only sends the rows down a pipe and waits for the reply with the GIL
released.  LMDB is built for several processes on one environment (its lock file
serialises the writers and tracks every process's readers), so the trainer's own reads
and its checkpoints go on through its own environment.

This file runs as a plain script (``python writer_main.py <parent pid>``: no package
import, so it starts in a fraction of a second) and is imported by
:mod:`tiered_emb.tiers.ssd.tier` for the record encoding and the full-disk test, which both
processes must share.

Protocol, frames of a 4-byte little-endian length and a JSON object, on stdin / stdout:

- first ``{"path", "map_size", "max_dbs", "max_readers", "compression", "dbs"}``; reply ``{"ok": true}``;
- then per write ``{"map_size", "parts": [[db name, segment number, rows, width], ...]}``
  followed, per part, by its ids (int64) and rows (float32, rows x width) as raw bytes;
  each part is put as one segment (see :func:`encode_segment`); reply ``{"ok": true}``,
  or ``{"error": "map_full"}`` (nothing written: the trainer's side grows the map and sends the write again), or
  ``{"error": "full" | "failed", "message": ...}`` (rolled back).

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
    del sys.path[0]  # run as a script: this package's modules (cache.py, ...) must not shadow others

import errno  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import struct  # noqa: E402

import numpy as np  # noqa: E402

RAW = 0
ZSTD = 1
#: Free bytes under which an I/O error of a write is taken for a full disk.
FULL_BELOW_BYTES = 64 << 20


def encode_rows(rows: np.ndarray, compressor) -> list[bytes]:
    """The LMDB values of ``rows`` (k, W) float32: a tag byte, then the record's bytes
    (zstd-compressed with ``compressor``, or raw: built as one array)."""
    if compressor is not None:
        return [bytes((ZSTD,)) + compressor.compress(r.tobytes()) for r in rows]
    k = rows.shape[0]
    size = 1 + rows.shape[1] * 4
    payload = np.empty((k, size), dtype=np.uint8)
    payload[:, 0] = RAW
    payload[:, 1:] = np.ascontiguousarray(rows, dtype=np.float32).view(np.uint8).reshape(k, size - 1)
    return payload.view(f"V{size}").reshape(k).tolist()  # one bytes object per row, built in C


def lmdb_keys(ids: np.ndarray) -> list[bytes]:
    """LMDB keys of ``ids`` (int64 (k,)): 8 big-endian bytes each (byte order = id order)."""
    return ids.astype(">i8").view("V8").tolist()


# A segment: rows written back together, one LMDB value in ``p:<table>`` under its
# sequence number (8 big-endian bytes: keys only ever grow, so each put appends).
#   header, 16 bytes little-endian: b"TSEG", version (u8), tag (u8: RAW or ZSTD), 2 zero
#   bytes, rows n (u32), width W (u32);
#   ids: n int64 little-endian, increasing;
#   rows: n * W float32 little-endian, raw, or with ZSTD one zstd frame of them.
SEGMENT_MAGIC = b"TSEG"
SEGMENT_VERSION = 1
SEGMENT_HEADER = struct.Struct("<4sBBxxII")


def segment_key(seq: int) -> bytes:
    return int(seq).to_bytes(8, "big")


def last_rows(ids: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(ids, rows)`` in id order with each id once: a repeated id's last row kept."""
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    if ids.shape[0] > 1 and not (ids[1:] > ids[:-1]).all():
        last = ids.shape[0] - 1 - np.unique(ids[::-1], return_index=True)[1]  # each id's last position, id order
        ids, rows = ids[last], rows[last]
    return ids, np.ascontiguousarray(rows, dtype=np.float32)


def encode_segment(ids: np.ndarray, rows: np.ndarray, compressor) -> bytes:
    """The value of a segment of ``rows`` (k, W) under ``ids`` (k,): in id order, a repeated
    id's last row kept."""
    ids, rows = last_rows(ids, rows)
    body = rows.astype("<f4", copy=False).tobytes()
    tag = RAW
    if compressor is not None:
        body, tag = compressor.compress(body), ZSTD
    head = SEGMENT_HEADER.pack(SEGMENT_MAGIC, SEGMENT_VERSION, tag, ids.shape[0], rows.shape[1])
    return head + ids.astype("<i8", copy=False).tobytes() + body


def put_segment(txn, db, seq: int, ids: np.ndarray, rows: np.ndarray, compressor) -> None:
    """Append the segment of ``rows`` under ``ids`` as number ``seq`` (above every one in ``db``)."""
    if not txn.put(segment_key(seq), encode_segment(ids, rows, compressor), db=db, append=True):
        import lmdb
        raise lmdb.KeyExistsError(f"segment {seq} is not above the last one")


def put_rows(txn, db, ids: np.ndarray, rows: np.ndarray, compressor) -> None:
    """Put ``rows`` under ``ids`` in ``db``, in key order (a repeated id's last row wins)."""
    order = np.argsort(ids, kind="stable")
    with txn.cursor(db=db) as cur:
        cur.putmulti(zip(lmdb_keys(ids[order]), encode_rows(rows[order], compressor)))


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


def read_frame(stream, max_len: int | None = None) -> dict | None:
    """The next JSON frame, or None at the end of the stream; ``ValueError`` when it is
    longer than ``max_len`` bytes or not JSON."""
    head = read_exact(stream, 4)
    if head is None:
        return None
    (n,) = struct.unpack("<I", head)
    if max_len is not None and n > max_len:
        raise ValueError(f"a frame of {n} bytes, more than {max_len}")
    body = read_exact(stream, n)
    return None if body is None else json.loads(body)


def read_exact(stream, n: int) -> bytes | None:
    """``n`` bytes of ``stream`` (buffered or raw: a raw read may return fewer), or None at its end."""
    parts, got = [], 0
    while got < n:
        b = stream.read(n - got)
        if not b:
            return None
        parts.append(b)
        got += len(b)
    return b"".join(parts)


def frame_bytes(obj: dict) -> bytes:
    """One frame: the length of ``obj``'s JSON, 4 bytes little-endian, then the JSON."""
    body = json.dumps(obj).encode()
    return struct.pack("<I", len(body)) + body


def write_frame(stream, obj: dict) -> None:
    stream.write(frame_bytes(obj))
    stream.flush()


class _Orphaned(Exception):
    """The parent ended during a write: the transaction is rolled back."""


def _read_exact(stream, n: int) -> bytes:
    data = read_exact(stream, n)
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
    import lmdb
    import zstandard

    import signal

    parent = int(sys.argv[1])
    if os.getppid() != parent:
        return
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Unbuffered input: between writes nothing waits in a buffer, so select() on the pipe
    # tells whether the next frame has come.
    inp, out = getattr(sys.stdin.buffer, "raw", sys.stdin.buffer), sys.stdout.buffer
    hello = read_frame(inp)
    if hello is None:
        return
    env = lmdb.open(hello["path"], map_size=hello["map_size"], max_dbs=hello["max_dbs"], subdir=True,
                    readahead=False, meminit=False, max_readers=hello["max_readers"])
    level = hello["compression"]
    compressor = zstandard.ZstdCompressor(level=level) if level else None
    dbs = {name: env.open_db(name.encode()) for name in hello["dbs"]}
    write_frame(out, {"ok": True})
    while True:
        if not _wait_for_input(inp, parent):
            return
        req = read_frame(inp)
        if req is None:
            return
        parts = []
        for name, seq, n, width in req["parts"]:
            ids = np.frombuffer(_read_exact(inp, 8 * n), dtype=np.int64)
            rows = np.frombuffer(_read_exact(inp, 4 * n * width), dtype=np.float32).reshape(n, width)
            parts.append((name, seq, ids, rows))
        try:
            if req["map_size"] != env.info()["map_size"]:
                env.set_mapsize(req["map_size"])  # the trainer's size (it grows the map)
            with env.begin(write=True) as txn:
                for name, seq, ids, rows in parts:
                    put_segment(txn, dbs[name], seq, ids, rows, compressor)
                if os.getppid() != parent:  # under LMDB's writer lock: see the module's docstring
                    raise _Orphaned
        except _Orphaned:
            return
        except lmdb.MapFullError:
            write_frame(out, {"error": "map_full"})
            continue
        except lmdb.Error as err:
            write_frame(out, {"error": "full" if disk_full(err, hello["path"]) else "failed",
                              "message": f"{type(err).__name__}: {err}"})
            continue
        write_frame(out, {"ok": True})


if __name__ == "__main__":
    main()
