"""The bytes of the SSD tier that both of its processes write: records, segments, frames.

A record of ``t:<table>`` is one tag byte (:data:`RAW` or :data:`ZSTD`) and its float32
bytes, under its id as 8 big-endian bytes (LMDB's byte order is then id order).  A
segment of ``p:<table>`` holds the rows of one write-back, under its sequence number
(format below).  A frame is what the writer process and its client send each other.

This module imports nothing of the package (numpy, struct and json only): the writer
process loads it from beside :mod:`.writer_main` without importing ``tiered_emb``, so
that it starts quickly.  Decoding raises the package's typed errors, so it lives with
the readers (:mod:`.reads`, :mod:`.segments`).
"""

from __future__ import annotations

import json
import struct
import threading

import numpy as np

RAW = 0
ZSTD = 1


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
    """The key of segment ``seq``: 8 big-endian bytes (keys only ever grow: each put appends)."""
    return int(seq).to_bytes(8, "big")


def last_rows(ids: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(ids, rows)`` in id order with each id once: a repeated id's last row kept."""
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    if ids.shape[0] > 1 and not (ids[1:] > ids[:-1]).all():
        last = ids.shape[0] - 1 - np.unique(ids[::-1], return_index=True)[1]  # each id's last position, id order
        ids, rows = ids[last], rows[last]
    return ids, np.ascontiguousarray(rows, dtype=np.float32)


def encode_segment(ids: np.ndarray, rows: np.ndarray, compressor):
    """The value of a segment of ``rows`` (k, W) under ``ids`` (k,): in id order, a repeated
    id's last row kept (raw: one array, built with a single copy of the rows)."""
    ids, rows = last_rows(ids, rows)
    n, width = rows.shape
    if compressor is not None:
        body = compressor.compress(rows.astype("<f4", copy=False).tobytes())
        head = SEGMENT_HEADER.pack(SEGMENT_MAGIC, SEGMENT_VERSION, ZSTD, n, width)
        return head + ids.astype("<i8", copy=False).tobytes() + body
    out = np.empty(SEGMENT_HEADER.size + 8 * n + 4 * n * width, dtype=np.uint8)
    SEGMENT_HEADER.pack_into(out, 0, SEGMENT_MAGIC, SEGMENT_VERSION, RAW, n, width)
    at = SEGMENT_HEADER.size
    out[at : at + 8 * n].view("<i8")[:] = ids
    out[at + 8 * n :].view("<f4").reshape(n, width)[:] = rows
    return out


def put_segment(txn, db, seq: int, ids: np.ndarray, rows: np.ndarray, compressor, append: bool = True) -> None:
    """Put the segment of ``rows`` under ``ids`` as number ``seq``: appended (above every one in
    ``db``), or with ``append=False`` in a place a compaction freed in the same transaction."""
    if not txn.put(segment_key(seq), encode_segment(ids, rows, compressor), db=db, append=append):
        import lmdb

        raise lmdb.KeyExistsError(f"segment {seq} is not above the last one")


def put_rows(txn, db, ids: np.ndarray, rows: np.ndarray, compressor) -> None:
    """Put ``rows`` under ``ids`` in ``db``, in key order (a repeated id's last row wins)."""
    order = np.argsort(ids, kind="stable")
    with txn.cursor(db=db) as cur:
        cur.putmulti(zip(lmdb_keys(ids[order]), encode_rows(rows[order], compressor), strict=False))


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
    """Write one frame of ``obj`` and flush it."""
    stream.write(frame_bytes(obj))
    stream.flush()


class PerThread:
    """A zstd compressor or decompressor for each thread that uses it, made by ``factory``.

    zstandard's contexts must not be shared between threads: the step and the prefetch
    thread decompressing through one at once read back garbage (a false "does not
    decompress" error).  ``compress`` and ``decompress`` are those of the calling thread's
    own context.
    """

    def __init__(self, factory):
        self._factory = factory
        self._local = threading.local()

    def context(self):
        """The calling thread's context (made on its first use)."""
        ctx = getattr(self._local, "ctx", None)
        if ctx is None:
            ctx = self._local.ctx = self._factory()
        return ctx

    def compress(self, data: bytes) -> bytes:
        return self.context().compress(data)

    def decompress(self, data: bytes, **kwargs) -> bytes:
        return self.context().decompress(data, **kwargs)
