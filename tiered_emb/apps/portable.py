"""``tiered-emb export`` / ``import`` / ``convert``: a whole store to plain NumPy files and
back, or into a new store of another row precision.

An export is a directory of its own: ``export.json`` (the format, the tables' configs,
the seed and each table's row count) and per table ``<table>.ids.npy`` (int64, increasing)
and ``<table>.rows.npy`` (rows x record width: the weights, then the optimizer's state;
float32 for a float32 table, else uint32: the record's words as the store holds them,
the weights and state packed in the table's dtypes, :mod:`tiered_emb.precision`).  Format 2 says
so; format 1 (float32 tables only) still imports.  It holds the rows of the store's last
checkpoint that were ever written; the others are the initialiser's, drawn again alike by
a store of the same seed.  All three stream: a chunk of ``TierConfig.budget_bytes`` of rows at a time, written
through ``numpy.lib.format.open_memmap`` (the page cache, not the process's memory).
Export opens the store as :meth:`TieredStore.open` does: at its last checkpoint by default
(rows written after it by a run that did not close are dropped, as any open drops them),
or with ``--restore latest`` keeping them; it closes without a checkpoint of its own.
Export refuses an existing directory, import an existing store (and removes the one it
made when the export turns out damaged).
"""

from __future__ import annotations

import dataclasses
import io
import json
import shutil
from pathlib import Path

import numpy as np

from tiered_emb._options import add_command, byte_size, count
from tiered_emb.config import TableConfig, TierConfig
from tiered_emb.errors import ConfigError, CorruptStoreError, StoreExistsError
from tiered_emb.precision import canonical, is_lossless, records_of, values_of
from tiered_emb.store import TieredStore

EXPORT_FORMAT = "tiered_emb-export/2"
#: the formats :func:`import_store` reads (1: float32 rows only, as 2 writes them)
IMPORT_FORMATS = ("tiered_emb-export/1", EXPORT_FORMAT)


def _words_dtype(cfg: TableConfig) -> type:
    """What an export's ``rows.npy`` holds for ``cfg``: float32 values, or the words of narrow rows."""
    return np.uint32 if cfg.packed else np.float32


def converted(src: TableConfig, dst: TableConfig, records: np.ndarray) -> np.ndarray:
    """Records of ``src`` (float32 words (k, record_width)) as records of ``dst`` (the same
    table in another dtype): the weights rounded to nearest, the state as it is."""
    if (src.dtype, src.state_dtype) == (dst.dtype, dst.state_dtype):
        return records
    return records_of(dst, values_of(src, records))


def check_int8_scales(table: str, records: np.ndarray, where) -> None:
    """CorruptStoreError where an int8 record's scale (its first word) is NaN, infinite or
    not above zero: its values cannot be decoded (a row the store wrote never has one)."""
    scale = records[:, 0]
    bad = ~(np.isfinite(scale) & (scale > 0))
    if bad.any():
        raise CorruptStoreError(
            f"{where}: {int(bad.sum())} int8 rows of table {table!r} have a NaN, infinite or zero scale",
            "export the store again; nothing was imported",
        )


def target_tables(tables: list[TableConfig], dtype: str | None, lossy: bool) -> list[TableConfig]:
    """``tables`` in ``dtype`` (None: as they are); ConfigError, before anything changes, for
    a conversion that rounds unless ``lossy``."""
    if dtype is None:
        return tables
    dtype = canonical(dtype, "--dtype")
    narrowed = [t.name for t in tables if not is_lossless(t.dtype, dtype)]
    if narrowed and not lossy:
        raise ConfigError(
            f"rows of tables {narrowed} would be rounded to {dtype}",
            "give --lossy (lossy=True) to round them to nearest, or keep their dtype",
        )
    return [dataclasses.replace(t, dtype=dtype) for t in tables]


def _chunk_rows(tiers: TierConfig, width: int) -> int:
    return max(1, tiers.budget_bytes // (8 + 4 * width))


_NPY = {
    (1, 0): (np.lib.format.read_array_header_1_0, np.lib.format.write_array_header_1_0),
    (2, 0): (np.lib.format.read_array_header_2_0, np.lib.format.write_array_header_2_0),
}


def read_npy_header(f) -> tuple[tuple[int, int], tuple, bool, np.dtype]:
    """``(version, shape, fortran_order, dtype)`` of the ``.npy`` file open at ``f`` (left at its data)."""
    version = np.lib.format.read_magic(f)
    if version not in _NPY:
        raise ValueError(f".npy format version {version} is not one numpy writes")
    shape, fortran, dtype = _NPY[version][0](f)
    return version, shape, fortran, dtype


def _shrink_npy(path: Path, shape: tuple) -> None:
    """Cut the ``.npy`` file at ``path`` down to its first ``shape[0]`` rows, in place: the
    header rewritten to the same length (numpy pads it to 64 bytes), the file truncated."""
    fmt = np.lib.format
    with open(path, "r+b") as f:
        version, _, fortran, dtype = read_npy_header(f)
        write = _NPY[version][1]
        start = f.tell()
        buf = io.BytesIO()
        write(buf, {"descr": fmt.dtype_to_descr(dtype), "fortran_order": fortran, "shape": shape})
        if buf.tell() != start:
            raise CorruptStoreError(f"cannot rewrite the header of {path}", "export again")
        f.seek(0)
        f.write(buf.getvalue())
        f.truncate(start + int(np.prod(shape)) * dtype.itemsize)


def export_store(path: str | Path, dest: str | Path, restore: str = "checkpoint") -> dict:
    """Write the store at ``path``, opened at ``restore`` (see :meth:`TieredStore.open`), into
    the new directory ``dest``; returns the rows written per table."""
    dest = Path(dest)
    if dest.exists():
        raise StoreExistsError(f"export directory {str(dest)!r} already exists", "choose a new directory")
    store = TieredStore.open(path, restore=restore)
    try:
        dest.mkdir(parents=True)
        counts = {}
        for name in store.tables:
            cfg = store.engine.table_config(name)
            width = cfg.record_width
            step = _chunk_rows(store.engine.tiers, width)
            stored, chunks = store.engine.ssd.stored_rows(name, step)  # (deleted rows skipped)
            out_ids = np.lib.format.open_memmap(dest / f"{name}.ids.npy", "w+", np.int64, (stored,))
            kind = _words_dtype(cfg)
            out_rows = np.lib.format.open_memmap(dest / f"{name}.rows.npy", "w+", kind, (stored, width))
            a = 0
            for ids, rows in chunks:
                out_ids[a : a + ids.shape[0]] = ids
                out_rows[a : a + ids.shape[0]] = rows.view(kind)
                a += ids.shape[0]
            out_ids.flush()
            out_rows.flush()
            del out_ids, out_rows
            if a < stored:
                for f, shape in ((f"{name}.ids.npy", (a,)), (f"{name}.rows.npy", (a, width))):
                    _shrink_npy(dest / f, shape)
            stored = a
            counts[name] = int(stored)
        meta = {
            "format": EXPORT_FORMAT,
            "seed": store.engine.seed,
            "tables": [store.engine.table_config(n).to_dict() for n in store.tables],
            "rows": counts,
        }
    finally:
        store.close(checkpoint=False)  # (nothing changed: no checkpoint, no new epoch)
    (dest / "export.json").write_text(json.dumps(meta, indent=1, sort_keys=True))
    return counts


def import_store(
    src: str | Path, path: str | Path, tiers: TierConfig, dtype: str | None = None, lossy: bool = False
) -> dict:
    """Make a new store at ``path`` holding the export at ``src``, its tables in ``dtype``
    (None: the export's; a conversion that rounds needs ``lossy``); returns the rows per table."""
    src = Path(src)
    try:
        meta = json.loads((src / "export.json").read_text())
        if meta.get("format") not in IMPORT_FORMATS:
            raise ValueError(f"format {meta.get('format')!r}")
        tables = [TableConfig.from_dict(t) for t in meta["tables"]]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CorruptStoreError(
            f"{src} is not an export of tiered_emb ({err})", "point at a tiered-emb export"
        ) from err
    arrays = {}
    for t in tables:  # every table checked before anything is made
        try:
            ids = np.load(src / f"{t.name}.ids.npy", mmap_mode="r")
            rows = np.load(src / f"{t.name}.rows.npy", mmap_mode="r")
        except (OSError, ValueError) as err:
            raise CorruptStoreError(
                f"{src}: the arrays of table {t.name!r} cannot be read ({err})", "export again"
            ) from err
        kind = _words_dtype(t)
        if ids.dtype != np.int64 or rows.dtype != kind or rows.shape != (ids.shape[0], t.record_width):
            raise CorruptStoreError(f"{src}: the arrays of table {t.name!r} do not match its config", "export again")
        arrays[t.name] = (ids, rows)
    targets = target_tables(tables, dtype, lossy)
    store = TieredStore.create(path, targets, tiers, seed=int(meta["seed"]))
    try:
        with store:
            counts = {
                t.name: _import_table(store, src, t, d, *arrays[t.name], tiers)
                for t, d in zip(tables, targets, strict=True)
            }
            store.checkpoint()
    except BaseException:
        shutil.rmtree(path, ignore_errors=True)  # the store this call made, half filled
        raise
    return counts


def _import_table(store: TieredStore, src: Path, t: TableConfig, dst: TableConfig, ids, rows, tiers: TierConfig) -> int:
    step = _chunk_rows(tiers, max(t.value_width, dst.record_width))
    last = -1
    for a in range(0, ids.shape[0], step):
        chunk = np.array(ids[a : a + step])
        if chunk[0] <= last or (chunk.shape[0] > 1 and (np.diff(chunk) <= 0).any()):
            raise CorruptStoreError(f"{src}: the ids of table {t.name!r} are not increasing", "export again")
        store.engine.check_ids(t.name, chunk)
        recs = np.array(rows[a : a + step]).view(np.float32)
        if t.dtype == "int8":
            check_int8_scales(t.name, recs, src)
        recs = converted(t, dst, recs)
        store.engine.ssd.write_pending({t.name: (chunk, recs)}, durable=True)
        last = int(chunk[-1])
    return int(ids.shape[0])


def convert_store(path: str | Path, dest: str | Path, dtype: str, tiers: TierConfig, lossy: bool = False) -> dict:
    """Write the store at ``path`` (its last checkpoint) into a new store at ``dest`` whose
    tables hold their rows in ``dtype``: streamed a chunk of ``tiers.budget_bytes`` at a
    time, each row rounded to nearest (``lossy`` must say so where that loses bits); the
    seed, the step counter and the admission counts go along.  Rows never written start as
    the new dtype's first values (narrowing: the old ones rounded alike; widening: the
    float32 draws, not their 16-bit roundings).  Returns the rows per table.

    The source opens as the store's writer: a store in use by another process is a
    StoreLockedError, with nothing made."""
    dest = Path(dest)
    if dest.exists():
        raise StoreExistsError(f"store path {str(dest)!r} already exists", "choose a new path")
    source = TieredStore.open(path, restore="checkpoint")
    made = False
    try:
        tables = [source.engine.table_config(n) for n in source.tables]
        targets = target_tables(tables, dtype, lossy)
        store = TieredStore.create(dest, targets, tiers, seed=source.engine.seed)
        made = True
        with store:
            counts = {}
            for t, d in zip(tables, targets, strict=True):
                stored, chunks = source.engine.ssd.stored_rows(t.name, _chunk_rows(tiers, max(t.value_width, 1)))
                for ids, rows in chunks:
                    if t.dtype == "int8":
                        check_int8_scales(t.name, rows, path)
                    store.engine.ssd.write_pending({t.name: (ids, converted(t, d, rows))}, durable=True)
                counts[t.name] = int(stored)
            store.engine.carry_counters(source.engine)
            store.checkpoint()
    except BaseException:
        if made:
            shutil.rmtree(dest, ignore_errors=True)  # the store this call made, half filled
        raise
    finally:
        source.close(checkpoint=False)
    return counts


def add_parser(sub) -> None:
    p = add_command(
        sub, "export", "write a store (its last checkpoint by default) as .npy files (streaming)", json_file=False
    )
    p.add_argument("path", help="the store")
    p.add_argument("dest", help="a new directory for the export")
    p.add_argument(
        "--restore",
        choices=["checkpoint", "latest"],
        default="checkpoint",
        help="where to open the store: its last checkpoint, or also the rows a run wrote after it",
    )
    p.set_defaults(func=_run_export)
    p = add_command(sub, "import", "make a new store from an export (streaming)", json_file=False)
    p.add_argument("src", help="an export directory")
    p.add_argument("path", help="the new store")
    _new_store_options(p)
    p.add_argument(
        "--dtype",
        help="the new store's row precision (float32, float16 / fp16, bfloat16 / bf16, int8; default: the export's)",
    )
    p.add_argument("--lossy", action="store_true", help="allow a --dtype that rounds the rows (to nearest)")
    p.set_defaults(func=_run_import)
    p = add_command(sub, "convert", "copy a store into a new one of another row precision (streaming)", json_file=False)
    p.add_argument("path", help="the store (opened at its last checkpoint; it is not changed)")
    p.add_argument("--dtype", required=True, help="float32, float16 / fp16, bfloat16 / bf16 or int8")
    p.add_argument("--out", required=True, help="the new store (the source stays as it is)")
    p.add_argument("--lossy", action="store_true", help="allow a --dtype that rounds the rows (to nearest)")
    _new_store_options(p)
    p.set_defaults(func=_run_convert)


def _new_store_options(p) -> None:
    """The options of a command that makes a new store: its tiers and its memory budget."""
    p.add_argument("--hbm-rows", type=count, default=65536, help="HBM rows per table of the new store")
    p.add_argument("--ddr-rows", type=count, default=0, help="DDR rows per table of the new store")
    p.add_argument(
        "--budget-bytes",
        type=byte_size,
        default=256 << 20,
        help="the memory a chunk of rows may take (TierConfig.budget_bytes): 256MiB, or 256M for 256,000,000 bytes",
    )


def _tiers_of(args) -> TierConfig:
    return TierConfig(hbm_rows=args.hbm_rows, ddr_rows=args.ddr_rows, device="cpu", budget_bytes=args.budget_bytes)


def _report(args, what: str, counts: dict, where: str) -> None:
    if args.json:
        print(json.dumps({what: counts}))
    else:
        print(f"{what} {len(counts)} tables, {sum(counts.values()):,} rows {where}")


def _run_export(args) -> int:
    counts = export_store(args.path, args.dest, args.restore)
    _report(args, "exported", counts, f"to {args.dest}")
    return 0


def _run_import(args) -> int:
    if Path(args.path).exists():
        raise StoreExistsError(f"store path {args.path!r} already exists", "choose a new path")
    counts = import_store(args.src, args.path, _tiers_of(args), args.dtype, args.lossy)
    _report(args, "imported", counts, f"into {args.path}")
    return 0


def _run_convert(args) -> int:
    counts = convert_store(args.path, args.out, args.dtype, _tiers_of(args), args.lossy)
    _report(args, "converted", counts, f"into {args.out}")
    return 0
