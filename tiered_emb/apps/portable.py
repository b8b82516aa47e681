"""``tiered-emb export`` / ``tiered-emb import``: a whole store to plain NumPy files and back.

An export is a directory of its own: ``export.json`` (the format, the tables' configs,
the seed and each table's row count) and per table ``<table>.ids.npy`` (int64, increasing)
and ``<table>.rows.npy`` (float32, rows x record width: the weights, then the optimizer's
state).  It holds the rows of the store's last checkpoint that were ever written; the
others are the initialiser's, drawn again alike by a store of the same seed.  Both
commands stream: a chunk of ``TierConfig.budget_bytes`` of rows at a time, written
through ``numpy.lib.format.open_memmap`` (the page cache, not the process's memory).
Export opens the store as :meth:`TieredStore.open` does: at its last checkpoint by default
(rows written after it by a run that did not close are dropped, as any open drops them),
or with ``--restore latest`` keeping them; it closes without a checkpoint of its own.
Export refuses an existing directory, import an existing store (and removes the one it
made when the export turns out damaged).
"""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import numpy as np

from tiered_emb._options import add_command, count
from tiered_emb.config import TableConfig, TierConfig
from tiered_emb.errors import CorruptStoreError, StoreExistsError
from tiered_emb.store import TieredStore

EXPORT_FORMAT = "tiered_emb-export/1"


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
            out_rows = np.lib.format.open_memmap(dest / f"{name}.rows.npy", "w+", np.float32, (stored, width))
            a = 0
            for ids, rows in chunks:
                out_ids[a : a + ids.shape[0]] = ids
                out_rows[a : a + ids.shape[0]] = rows
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


def import_store(src: str | Path, path: str | Path, tiers: TierConfig) -> dict:
    """Make a new store at ``path`` holding the export at ``src``; returns the rows per table."""
    src = Path(src)
    try:
        meta = json.loads((src / "export.json").read_text())
        if meta.get("format") != EXPORT_FORMAT:
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
        if ids.dtype != np.int64 or rows.dtype != np.float32 or rows.shape != (ids.shape[0], t.record_width):
            raise CorruptStoreError(f"{src}: the arrays of table {t.name!r} do not match its config", "export again")
        arrays[t.name] = (ids, rows)
    store = TieredStore.create(path, tables, tiers, seed=int(meta["seed"]))
    try:
        with store:
            counts = {t.name: _import_table(store, src, t, *arrays[t.name], tiers) for t in tables}
            store.checkpoint()
    except BaseException:
        shutil.rmtree(path, ignore_errors=True)  # the store this call made, half filled
        raise
    return counts


def _import_table(store: TieredStore, src: Path, t: TableConfig, ids, rows, tiers: TierConfig) -> int:
    step = _chunk_rows(tiers, t.record_width)
    last = -1
    for a in range(0, ids.shape[0], step):
        chunk = np.array(ids[a : a + step])
        if chunk[0] <= last or (chunk.shape[0] > 1 and (np.diff(chunk) <= 0).any()):
            raise CorruptStoreError(f"{src}: the ids of table {t.name!r} are not increasing", "export again")
        store.engine.check_ids(t.name, chunk)
        store.engine.ssd.write_pending({t.name: (chunk, np.array(rows[a : a + step]))}, durable=True)
        last = int(chunk[-1])
    return int(ids.shape[0])


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
    p.add_argument("--hbm-rows", type=count, default=65536, help="HBM rows per table of the new store")
    p.add_argument("--ddr-rows", type=count, default=0, help="DDR rows per table of the new store")
    p.add_argument(
        "--budget-bytes",
        type=count,
        default=256 << 20,
        help="the SSD tier's memory budget in bytes (TierConfig.budget_bytes; 256M is 256,000,000)",
    )
    p.set_defaults(func=_run_import)


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
    tiers = TierConfig(hbm_rows=args.hbm_rows, ddr_rows=args.ddr_rows, device="cpu", budget_bytes=args.budget_bytes)
    counts = import_store(args.src, args.path, tiers)
    _report(args, "imported", counts, f"into {args.path}")
    return 0
