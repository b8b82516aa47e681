"""Reading one segment of ``p:`` back, every byte checked (format: :mod:`.codec`).

:func:`head` checks a segment's header and length, :func:`ids_of` its ids (increasing,
in range, their CRC-32); :func:`bad_rows` checks the records :func:`records_of` gives
against their checksums.  A check that fails raises
:class:`~tiered_emb.errors.CorruptStoreError` naming the table, the segment, its ids and
the file; :mod:`.verify` collects the same findings instead.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import numpy as np
import zstandard

from tiered_emb.errors import CorruptStoreError
from tiered_emb.tiers.ssd.codec import (
    DTYPE_AT,
    RAW,
    SEGMENT_HEADER,
    SEGMENT_HEADER_V1,
    SEGMENT_MAGIC,
    SEGMENT_VERSION,
    ZSTD,
    ids_crc,
    row_sums,
)

#: what a damaged store's error suggests
RESTORE = "restore the store directory from a backup (tiered-emb verify PATH lists every damaged record)"


class Head(NamedTuple):
    """A segment's layout: ``n`` rows, ``tag`` (RAW or ZSTD), the byte offset of its ids and
    of its records, ``stride`` words a record (W + 1 with a checksum, W in version 1), its ids' CRC."""

    n: int
    tag: int
    ids_at: int
    rows_at: int
    stride: int
    crc: int | None


def damaged(path: Path, table: str, seq: int, what: str) -> CorruptStoreError:
    """The error of segment ``seq`` of ``table`` in the LMDB files at ``path`` being damaged."""
    return CorruptStoreError(f"segment {seq} of table {table!r} in {path / 'data.mdb'} is damaged ({what})", RESTORE)


def head(path: Path, table: str, seq: int, value, width: int, dtype: int = 0) -> Head:
    """The layout of segment ``seq`` of ``table`` (``value``: its bytes or a buffer of them),
    after checking its header and its length against ``width`` (W, words of a row) and its
    rows' dtype against ``dtype`` (a code of ``codec.DTYPE_CODES``; versions 1 and 2: float32)."""
    try:
        magic, version, tag, n, w = SEGMENT_HEADER_V1.unpack_from(value)
        crc = SEGMENT_HEADER.unpack_from(value)[5] if version >= 2 else None
        code = value[DTYPE_AT] if version == SEGMENT_VERSION else 0
    except Exception:  # (struct.error: shorter than a header)
        raise damaged(path, table, seq, "shorter than a header") from None
    if magic != SEGMENT_MAGIC or version not in (1, 2, SEGMENT_VERSION) or tag not in (RAW, ZSTD) or w != width:
        raise damaged(path, table, seq, "its header")
    if code != dtype:
        raise damaged(path, table, seq, f"its rows are of dtype code {code}, the table's {dtype}")
    ids_at = SEGMENT_HEADER.size if version >= 2 else SEGMENT_HEADER_V1.size
    stride = width + 1 if version >= 2 else width
    rows_at = ids_at + 8 * n
    size = rows_at + 4 * n * stride
    if (tag == RAW and len(value) != size) or len(value) < rows_at:
        raise damaged(path, table, seq, f"{len(value)} bytes where its header says {size}")
    return Head(n, tag, ids_at, rows_at, stride, crc)


def ids_of(path: Path, table: str, seq: int, value, h: Head, num_rows: int | None) -> np.ndarray:
    """The ids (int64, a view of ``value``) of segment ``seq``, checked: increasing, in
    ``0 .. num_rows``, and (version 2) matching their CRC-32."""
    ids = np.frombuffer(value, dtype="<i8", count=h.n, offset=h.ids_at)
    if h.crc is not None and ids_crc(seq, ids) != h.crc:
        raise damaged(path, table, seq, "its number or its ids do not match their CRC-32")
    if not ids_sound(ids, num_rows):
        raise damaged(path, table, seq, "its ids are out of order or out of range")
    return ids


def ids_sound(ids: np.ndarray, num_rows: int | None) -> bool:
    """Whether a segment's ``ids`` are increasing and in ``0 .. num_rows``."""
    n = ids.shape[0]
    ordered = n < 2 or bool((ids[1:] > ids[:-1]).all())
    return ordered and (n == 0 or (ids[0] >= 0 and (num_rows is None or ids[-1] < num_rows)))


def records_of(path: Path, table: str, seq: int, value, h: Head, decompressor) -> np.ndarray:
    """The records (n, stride) uint32 of segment ``seq``: a view of ``value`` when raw."""
    if h.tag == RAW:
        return np.frombuffer(value, dtype="<u4", count=h.n * h.stride, offset=h.rows_at).reshape(h.n, h.stride)
    size = 4 * h.n * h.stride
    try:
        body = decompressor.decompress(bytes(value[h.rows_at :]), max_output_size=size)
    except zstandard.ZstdError as err:
        raise damaged(path, table, seq, f"its rows do not decompress: {err}") from err
    if len(body) != size:
        raise damaged(path, table, seq, f"{len(body)} bytes of rows where its header says {size}")
    return np.frombuffer(body, dtype="<u4").reshape(h.n, h.stride)


def bad_rows(ids: np.ndarray, records: np.ndarray, width: int) -> np.ndarray:
    """Positions of the rows of ``records`` whose checksum does not match (none in version 1)."""
    if records.shape[1] == width:
        return np.empty(0, dtype=np.int64)
    return np.flatnonzero(row_sums(ids, records[:, :width]) != records[:, width])


def checksum_error(path: Path, table: str, seq: int, ids: np.ndarray, bad: np.ndarray) -> CorruptStoreError:
    """The error of rows at positions ``bad`` of segment ``seq`` failing their checksums."""
    first = int(bad[0])
    return CorruptStoreError(
        f"{bad.shape[0]} row(s) of segment {seq} of table {table!r} in {path / 'data.mdb'} fail their "
        f"checksums: first the row of id {int(ids[first])} (the segment holds ids {int(ids[0])}..{int(ids[-1])})",
        RESTORE,
    )


__all__ = ["Head", "bad_rows", "checksum_error", "damaged", "head", "ids_of", "ids_sound", "records_of"]
