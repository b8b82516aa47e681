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
import zlib

import numpy as np

RAW = 0
ZSTD = 1

#: Every word of a *tombstone*, the record a deleted row's id is written with: a quiet NaN
#: whose payload no arithmetic makes (a NaN an operation yields carries its operand's
#: payload or the CPU's default one), and no row holds a NaN (writes and gradients are checked).
TOMBSTONE_WORD = 0x7FC0DE1E


def tombstones(n: int, width: int) -> np.ndarray:
    """``n`` tombstone records of ``width`` words, float32 (n, width)."""
    return np.full((n, width), TOMBSTONE_WORD, dtype=np.uint32).view(np.float32)


def is_tombstone(rows: np.ndarray) -> np.ndarray:
    """Which records of ``rows`` (k, W) float32 are tombstones (their first word), bool (k,)."""
    return rows[:, 0].view(np.uint32) == TOMBSTONE_WORD


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
#   header, 24 bytes little-endian: b"TSEG", version (u8: 3), tag (u8: RAW or ZSTD), the
#   rows' dtype (u8: DTYPE_CODES), a zero byte, rows n (u32), width W (u32), the CRC-32 of
#   its number and ids (u32), 4 zero bytes;
#   ids: n int64 little-endian, increasing;
#   records: n * (W + 1) words little-endian, raw, or with ZSTD one zstd frame of them: each
#   row's W float32 then its checksum (:func:`row_sums`), so a read checks every row it copies.
# Version 2: the same, its dtype byte zero (float32: stores written before row precision).
# Version 1 (stores written before checksums): a 16-byte header (no CRC) and records of W
# words, no checksum; read as they are, rewritten as version 3 by compaction.
SEGMENT_MAGIC = b"TSEG"
SEGMENT_VERSION = 3
#: the byte of a segment's header that names its rows' dtype, and each dtype's code there
DTYPE_AT = 6
DTYPE_CODES = {"float32": 0, "float16": 1, "bfloat16": 2, "int8": 3}
SEGMENT_HEADER = struct.Struct("<4sBBxxIII4x")
SEGMENT_HEADER_V1 = struct.Struct("<4sBBxxII")

# the constants of :func:`row_sums` (odd: multiplying by one is a bijection mod 2**32)
SUM_SEED = 0x9E3779B9
SUM_MUL_ID = 0x85EBCA6B
SUM_MUL_HI = 0xC2B2AE35
SUM_WEIGHT = 0x9E3779B1


def sum_weights(width: int) -> np.ndarray:
    """The weight (uint32, odd) of each of the ``width`` words of a row in its checksum."""
    return ((np.arange(1, width + 1, dtype=np.uint64) * np.uint64(SUM_WEIGHT)) & np.uint64(0xFFFFFFFF)).astype(
        np.uint32
    ) | np.uint32(1)


def row_sums(ids: np.ndarray, words: np.ndarray, chunk_rows: int = 1 << 14) -> np.ndarray:
    """The checksum (uint32 (n,)) of each row of ``words`` (n, W) uint32 under its id: the id
    mixed, plus a term per word, mod 2**32.  A word's term is the word mixed by four steps,
    each a bijection of 32 bits: times its odd weight (:func:`sum_weights`), xor-shift right
    16, times an odd constant, xor-shift right 13.  So a change to any one word changes its
    term and the sum, always; and a change of any bit (a float's sign too) reaches every
    bit of the term, depending on the word's value, so changes to several words cancel only
    by chance (about 2**-32).  The terms do not wait on each other: the gather's twin
    (:func:`.mapped.row_sum`) runs them side by side.  ``chunk_rows`` rows at a time."""
    ids = np.asarray(ids, dtype=np.int64)
    h = (ids & 0xFFFFFFFF).astype(np.uint32) ^ np.uint32(SUM_SEED)
    h *= np.uint32(SUM_MUL_ID)
    h ^= (ids >> 32).astype(np.uint32)
    h *= np.uint32(SUM_MUL_HI)
    weights = sum_weights(words.shape[1])
    for a in range(0, words.shape[0], chunk_rows):
        terms = words[a : a + chunk_rows] * weights
        terms ^= terms >> np.uint32(16)
        terms *= np.uint32(SUM_MUL_ID)
        terms ^= terms >> np.uint32(13)
        h[a : a + chunk_rows] += terms.sum(axis=1, dtype=np.uint32)
    return h


def ids_crc(seq: int, ids: np.ndarray) -> int:
    """The CRC-32 a segment's header holds: of its number (8 bytes little-endian, so that a
    segment found under another key is damage) and its ids."""
    return zlib.crc32(ids, zlib.crc32(int(seq).to_bytes(8, "little")))


def segment_key(seq: int) -> bytes:
    """The key of segment ``seq``: 8 big-endian bytes (keys only ever grow: each put appends)."""
    return int(seq).to_bytes(8, "big")


def last_rows(ids: np.ndarray, rows: np.ndarray, take=None, argsort=None) -> tuple[np.ndarray, np.ndarray]:
    """``(ids, rows)`` in id order with each id once: a repeated id's last row kept.

    ``take(rows, at)``, where given, is ``rows[at]`` as float32, and ``argsort(ids)`` a stable
    argsort (the main process passes :func:`tiered_emb._jit.take_rows`, rows copied on
    Numba's threads, and :func:`tiered_emb._order.stable_argsort`; this module also runs
    in the writer process, which imports nothing of the package)."""
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    if ids.shape[0] > 1 and not (ids[1:] > ids[:-1]).all():
        # an id's positions in batch order, so its last position is its run's last
        order = np.argsort(ids, kind="stable") if argsort is None else argsort(ids)
        by_id = ids[order]
        keep = np.empty(by_id.shape[0], dtype=bool)
        keep[-1] = True
        np.not_equal(by_id[1:], by_id[:-1], out=keep[:-1])
        last = order[keep]
        return by_id[keep], (rows[last] if take is None else take(rows, last))
    return ids, np.ascontiguousarray(rows, dtype=np.float32)


def encode_segment(ids: np.ndarray, rows: np.ndarray, compressor, seq: int = 0, pack=None, dtype: int = 0):
    """The value of a segment of ``rows`` (k, W) under ``ids`` (k,): in id order, a repeated
    id's last row kept, each row followed by its checksum (raw: one array, one copy of the rows).

    ``pack(ids, words, records)``, where given, copies the rows' words (uint32 (k, W)) into
    ``records`` (uint32 (k, W + 1)) with each row's checksum after it, as the NumPy lines
    below do (the main process passes :func:`.mapped.pack_rows`, a Numba twin on its threads;
    the writer process, which imports no Numba, has these).  ``dtype``: the rows' code in
    :data:`DTYPE_CODES`, named in the header."""
    ids, rows = last_rows(ids, rows)
    n, width = rows.shape
    ids = ids.astype("<i8", copy=False)
    crc = ids_crc(seq, ids)
    head = SEGMENT_HEADER.size + 8 * n
    out = np.empty(head + 4 * n * (width + 1), dtype=np.uint8)
    SEGMENT_HEADER.pack_into(out, 0, SEGMENT_MAGIC, SEGMENT_VERSION, RAW, n, width, crc)
    out[DTYPE_AT] = dtype
    out[SEGMENT_HEADER.size : head].view("<i8")[:] = ids
    records = out[head:].view("<u4").reshape(n, width + 1)
    if pack is not None:
        pack(ids, rows.view(np.uint32), records)
    else:
        records[:, :width] = rows.view(np.uint32)
        records[:, width] = row_sums(ids, records[:, :width])
    if compressor is None:
        return out
    out[5] = ZSTD
    return out[:head].tobytes() + compressor.compress(out[head:])


def put_segment(
    txn, db, seq: int, ids: np.ndarray, rows: np.ndarray, compressor, append: bool = True, pack=None, dtype: int = 0
) -> None:
    """Put the segment of ``rows`` under ``ids`` as number ``seq``: appended (above every one in
    ``db``), or with ``append=False`` in a place a compaction freed in the same transaction
    (``pack``, ``dtype``: as :func:`encode_segment`'s)."""
    put_value(txn, db, seq, encode_segment(ids, rows, compressor, seq, pack, dtype), append)


def put_value(txn, db, seq: int, value, append: bool = True) -> None:
    """Put segment ``seq`` encoded already (:func:`encode_segment`), as :func:`put_segment` does."""
    if not txn.put(segment_key(seq), value, db=db, append=append):
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
