"""``tiered-emb verify`` and ``tiered-emb inspect``: a store looked at without changing it.

Both read as a reader does (``TieredStore.open(path, mode="r")``): no lock is taken, so
they run beside a writer that trains the store, and see its last completed checkpoint.
``verify`` checks every stored byte (every row's checksum, every segment's header and
ids), a segment at a time, and exits 1 when anything is damaged; ``inspect`` lists the
tables, their rows and bytes, and the checkpoint with its ``extra``.
"""

from __future__ import annotations

import json
import sys

from tiered_emb._options import add_command
from tiered_emb.config import TableConfig, TierConfig
from tiered_emb.reader import StoreReader, verify_store
from tiered_emb.tiers.pool import pool_rows, reserved_of, slot_floats


def add_parser(sub) -> None:
    for name, run, what in (
        ("verify", _run_verify, "check every byte a store holds; exit status 1 when anything is damaged"),
        ("inspect", _run_inspect, "list a store's tables, rows, bytes and the checkpoints it keeps"),
    ):
        p = add_command(sub, name, what, json_file=False)
        p.add_argument("path", help="the store (a writer may be training it meanwhile)")
        p.set_defaults(func=run)


def _run_verify(args) -> int:
    report = verify_store(args.path)
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print(
            f"{args.path}: {report['segments']:,} segments ({report['rows']:,} rows with checksums, "
            f"{report['unchecked_rows']:,} written before them) and {report['records']:,} records "
            f"checked, {len(report['damaged'])} damaged"
        )
        for found in report["damaged"]:
            where = (
                f"segment {found['segment']}"
                if "segment" in found
                else (f"record {found['record']}" if "record" in found else "")
            )
            ids = f" ids {found['ids'][0]}..{found['ids'][1]}" if found.get("ids") else ""
            offset = f" at byte {found['offset']:,} of data.mdb" if found.get("offset", -1) >= 0 else ""
            table = "the checkpoint records" if found["table"] is None else f"table {found['table']!r}"
            print(f"  {table} {where}{ids}{offset}: {found['what']}", file=sys.stderr)
    return 1 if report["damaged"] else 0


def inspect_store(path: str) -> dict:
    """What ``tiered-emb inspect`` prints: tables (config, rows), files' bytes, the checkpoint."""
    with StoreReader(path) as r:
        stats = r.stats()
        extra = r.extra
        return {
            "path": str(path),
            "checkpoint": {"epoch": r.epoch, "extra_bytes": None if extra is None else len(extra)},
            "snapshots": r.kept_checkpoints(),
            "disk_bytes": r.disk_bytes(),
            "tiers": tier_sizes(list(r.tables.values()), r.tiers),
            "tables": {
                n: dict(cfg.to_dict(), rows=stats[n]["ssd"]["rows"], row_bytes=4 * cfg.record_width)
                for n, cfg in sorted(r.tables.items())
            },
        }


def tier_sizes(tables: list[TableConfig], tiers: TierConfig) -> dict:
    """The HBM and DDR tiers the store was last opened with: shared by the tables (their
    bytes, what the reservations leave of the budgets, and the rows a slot of the widest
    record of the tables sharing them gives; the tiers of their own that reserved tables
    hold), or rows per table (and the
    bytes those take of each table, with its state)."""
    if tiers.shared:
        hbm_rows, ddr_rows = pool_rows(tables, tiers)
        own = reserved_of(tables, tiers)
        rest = [t for t in tables if t.name not in own]
        hbm_slot, ddr_slot = (4 * f for f in slot_floats(rest)) if rest else (0, 0)
        kept = [sum(e[k] for e in tiers.reserved) for k in (1, 2)]  # (bytes set apart from each budget)
        return {
            "shared": True,
            "hbm": {"bytes": (tiers.hbm_bytes or 0) - kept[0], "rows": hbm_rows, "slot_bytes": hbm_slot},
            "ddr": {"bytes": (tiers.ddr_bytes or 0) - kept[1], "rows": ddr_rows, "slot_bytes": ddr_slot},
            "reserved": {
                name: {"hbm_bytes": h, "ddr_bytes": d, "hbm_rows": own[name][0], "ddr_rows": own[name][1]}
                for name, h, d in tiers.reserved
            },
        }
    return {
        "shared": False,
        **{
            tier: {
                "rows_per_table": rows,
                "bytes": {t.name: rows * 4 * t.record_width for t in sorted(tables, key=lambda t: t.name)},
            }
            for tier, rows in (("hbm", tiers.hbm_rows), ("ddr", tiers.ddr_rows))
        },
    }


def _run_inspect(args) -> int:
    out = inspect_store(args.path)
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    ck = out["checkpoint"]
    print(f"{out['path']}: checkpoint {ck['epoch']}, {out['disk_bytes']:,} bytes on disk, extra: {ck['extra_bytes']}")
    print(f"  checkpoints kept: {', '.join(str(x['epoch']) for x in out['snapshots'])}")
    tiers = out["tiers"]
    if tiers["shared"]:
        print(
            "  tiers shared by the tables: "
            + ", ".join(
                f"{tier.upper()} {t['bytes']:,} bytes ({t['rows']:,} rows of {t['slot_bytes']} bytes)"
                for tier, t in (("hbm", tiers["hbm"]), ("ddr", tiers["ddr"]))
            )
            + "".join(
                f"; {name}'s own: HBM {r['hbm_bytes']:,} bytes ({r['hbm_rows']:,} rows), "
                f"DDR {r['ddr_bytes']:,} bytes ({r['ddr_rows']:,} rows)"
                for name, r in tiers["reserved"].items()
            )
        )
    else:
        print(
            f"  tiers per table: HBM {tiers['hbm']['rows_per_table']:,} rows, "
            f"DDR {tiers['ddr']['rows_per_table']:,} rows"
        )
    for name, t in out["tables"].items():
        print(
            f"  {name}: dim {t['dim']} {t['dtype']} ({t['row_bytes']} bytes a row with its state), "
            f"{t['rows']:,} rows stored, num_rows {t.get('num_rows')}"
            + (
                ""
                if tiers["shared"]
                else f"; HBM {tiers['hbm']['bytes'][name]:,} bytes, DDR {tiers['ddr']['bytes'][name]:,} bytes"
            )
        )
    return 0
