"""Every byte of an SSD tier checked, and every damaged record listed: ``tiered-emb verify``.

:func:`verify` walks the ``meta`` database and each table's segments in one read
transaction (a reader: a writer may run meanwhile), one segment at a time, so its memory is one segment (at most 64 MiB)
whatever the store's size.  Each segment's header, length, ids (order, range, CRC-32) and
every row's checksum are checked (:mod:`.decode`), and the records of ``t:`` of stores
of format 2 (no checksums: their tag and length).  A page LMDB cannot read ends the walk
of that table and is listed too.
"""

from __future__ import annotations

from pathlib import Path

import lmdb
import zstandard

from tiered_emb.errors import CorruptStoreError
from tiered_emb.tiers.ssd import decode, snapshots
from tiered_emb.tiers.ssd.codec import DTYPE_CODES, RAW, ZSTD, PerThread
from tiered_emb.tiers.ssd.lmdb_env import LmdbEnv
from tiered_emb.tiers.ssd.mapped import value_offset

#: bad rows named one by one in a finding (the rest are counted)
NAMED_ROWS = 16


def verify(
    env: LmdbEnv, widths: dict[str, int], table_rows: dict[str, int | None], decompressor, dtypes: dict | None = None
) -> dict:
    """``{"segments", "rows", "unchecked_rows", "records", "damaged": [finding, ...]}``: what
    was checked (``unchecked_rows``: rows of segments written before checksums), and
    each damaged segment or record (a dict: ``table``, ``segment`` or ``record``, ``what``,
    and where known ``ids`` (its first and last), ``bad_ids``, ``bad_rows``, ``offset`` in
    ``data.mdb``).  ``dtypes``: table -> its rows' dtype code in segment headers (none: float32)."""
    codes = {n: (d if isinstance(d, int) else DTYPE_CODES[d]) for n, d in (dtypes or {}).items()}
    out: dict = {"segments": 0, "rows": 0, "unchecked_rows": 0, "records": 0, "damaged": []}
    psize = int(env.env.stat()["psize"])
    with env.gate.reading():  # (held against this process's map growth while the walk runs)
        txn = env.begin_read()
        try:
            with env.corrupt_on_error("reading the meta database of"):
                for what in snapshots.problems(txn, env.meta, env.path):
                    out["damaged"].append({"table": None, "what": what})
            for table in sorted(widths):
                code = codes.get(table, 0)
                _segments(txn, env, table, (widths[table], code), table_rows.get(table), decompressor, psize, out)
                if env.records[table]:
                    _records(txn, env, table, widths[table], decompressor, out)
        finally:
            txn.abort()
    return out


def verify_path(
    path: Path, widths: dict[str, int], table_rows: dict[str, int | None], dtypes: dict | None = None
) -> dict:
    """:func:`verify` of the LMDB environment at ``path``, opened read-only for it (no index
    is built: a store too damaged to open is listed too; a writer may run meanwhile)."""
    env = LmdbEnv(path, sorted(widths), 1 << 20, existing=True, readonly=True)
    try:
        return verify(env, widths, table_rows, PerThread(zstandard.ZstdDecompressor), dtypes)
    finally:
        env.close()


def _segments(txn, env: LmdbEnv, table: str, layout, num_rows, decompressor, psize: int, out: dict) -> None:
    """Check every segment of ``table`` (``layout``: its rows' width and dtype code) into ``out``."""
    seq = -1
    try:
        with txn.cursor(db=env.pending[table]) as cur:
            for key, value in cur:
                seq = int.from_bytes(key, "big")
                out["segments"] += 1
                found = _segment(env, table, seq, value, layout, num_rows, decompressor)
                if found is not None:
                    found["offset"] = value_offset(value, psize)
                    out["damaged"].append(found)
                else:
                    h = decode.head(env.path, table, seq, value, *layout)
                    out["rows" if h.crc is not None else "unchecked_rows"] += h.n
    except lmdb.Error as err:
        out["damaged"].append(
            {"table": table, "segment": seq, "what": f"LMDB cannot read p:{table} after this segment: {err}"}
        )


def _segment(env: LmdbEnv, table: str, seq: int, value, layout, num_rows, decompressor) -> dict | None:
    """The finding of one segment, or None when it is whole."""
    found: dict = {"table": table, "segment": seq}
    width = layout[0]
    try:
        h = decode.head(env.path, table, seq, value, *layout)
        ids = decode.ids_of(env.path, table, seq, value, h, num_rows)
        found["ids"] = [int(ids[0]), int(ids[-1])] if h.n else []
        records = decode.records_of(env.path, table, seq, value, h, decompressor)
    except CorruptStoreError as err:
        found["what"] = err.args[0]
        return found
    bad = decode.bad_rows(ids, records, width)
    if not bad.shape[0]:
        return None
    found["what"] = f"{bad.shape[0]} of its {h.n} rows fail their checksums"
    found["bad_rows"] = int(bad.shape[0])
    found["bad_ids"] = ids[bad[:NAMED_ROWS]].tolist()
    return found


def _records(txn, env: LmdbEnv, table: str, width: int, decompressor, out: dict) -> None:
    """The records of ``t:<table>`` (format 2): a tag and the length of a row each."""
    key = b""
    try:
        with txn.cursor(db=env.main[table]) as cur:
            for key, value in cur:
                out["records"] += 1
                what = _record(value, width, decompressor)
                if what is not None:
                    row_id = int.from_bytes(key, "big") if len(key) == 8 else None
                    out["damaged"].append({"table": table, "record": row_id, "what": what})
    except lmdb.Error as err:
        out["damaged"].append(
            {"table": table, "record": bytes(key).hex(), "what": f"LMDB cannot read t:{table} here: {err}"}
        )


def _record(value, width: int, decompressor) -> str | None:
    tag, body = value[0], bytes(value[1:])
    if tag == ZSTD:
        try:
            body = decompressor.decompress(body, max_output_size=4 * width)
        except zstandard.ZstdError as err:
            return f"does not decompress: {err}"
    elif tag != RAW:
        return f"unknown tag {tag}"
    if len(body) != 4 * width:
        return f"{len(body)} bytes of row, expected {4 * width}"
    return None


__all__ = ["verify", "verify_path"]
