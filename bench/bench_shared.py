"""Tiers sized in bytes and shared by the tables, against the same bytes split evenly per table.

Four tables (default 1M rows x 64, row-wise Adagrad) whose traffic is uneven, as a
model's features are: of the ids of a step (default 160,000, Zipf 1.05 within each table),
the tables take 70 %, 20 %, 8 % and 2 %.  The same HBM and DDR bytes (default HBM 5 % and
DDR 20 % of one table's records, for all four) are given two ways, each in a store of its
own, stepped side by side on the same batches (lookup, then the update of every id):

- ``per_table``: ``TierConfig(hbm_rows, ddr_rows)``, the bytes split evenly: each table
  gets a quarter of the rows;
- ``shared``: ``TierConfig(hbm_bytes, ddr_bytes)``, one HBM and one DDR tier for the four;
- ``reserved``: the same, with ``--reserve`` of each budget set apart for the coldest
  table (``TierConfig(reserved=...)``: tiers of its own), the other three sharing the rest.

Per configuration: the HBM and DDR hit rates over the timed steps (all tables together,
and HBM's per table), the rows read from LMDB a step, and the median step; the headline
is the shared step over the per-table one (below 1: faster), with every store's rows
byte for byte equal at the end.

Command (figures in docs/benchmarks.md)::

    python bench/bench_shared.py --json bench/results/shared.json
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, median, write_json

from tiered_emb import RowWiseAdagrad, TableConfig, TierConfig, TieredStore
from tiered_emb.sim.traces import zipf_ids
from tiered_emb.tiers.pool import slot_floats

SHARES = (0.70, 0.20, 0.08, 0.02)


def _tables(args) -> list[TableConfig]:
    return [
        TableConfig(f"f{i}", dim=args.dim, num_rows=args.rows, optimizer=RowWiseAdagrad(lr=0.01))
        for i in range(len(SHARES))
    ]


def _batches(args, first: int, count: int) -> list[dict[str, np.ndarray]]:
    return [
        {
            f"f{i}": zipf_ids(args.rows, args.alpha, max(1, int(args.ids * share)), seed=1000 * (first + k) + i)
            for i, share in enumerate(SHARES)
        }
        for k in range(count)
    ]


def _step(store: TieredStore, batch: dict[str, np.ndarray]) -> None:
    for name, ids in batch.items():
        rows = store.lookup(name, ids)
        store.apply_gradients(name, ids, rows * np.float32(0.01))


def _counts(store: TieredStore) -> np.ndarray:
    """Lookups and hits of each tier, all tables together, then HBM's of each table."""
    s = store.stats()
    every = [sum(s[t][tier][k] for t in s) for tier in ("hbm", "ddr", "ssd") for k in ("lookups", "hits")]
    return np.array(every + [s[t]["hbm"][k] for t in sorted(s) for k in ("lookups", "hits")], dtype=np.float64)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--ids", type=int, default=160_000, help="ids a step, all tables")
    p.add_argument("--alpha", type=float, default=1.05)
    p.add_argument("--hbm", type=float, default=0.05, help="HBM bytes, as a share of one table's records")
    p.add_argument("--ddr", type=float, default=0.20, help="DDR bytes, as a share of one table's records")
    p.add_argument("--reserve", type=float, default=0.125, help="share of each budget reserved for the coldest table")
    p.add_argument("--warm-steps", type=int, default=20)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--json", default="bench/results/shared.json")
    args = p.parse_args()

    tables = _tables(args)
    hbm_slot, ddr_slot = (4 * f for f in slot_floats(tables))
    hbm_bytes = int(args.hbm * args.rows) * hbm_slot
    ddr_bytes = int(args.ddr * args.rows) * ddr_slot
    configs = {
        "per_table": TierConfig(
            hbm_rows=hbm_bytes // hbm_slot // len(tables), ddr_rows=ddr_bytes // ddr_slot // len(tables), device="cpu"
        ),
        "shared": TierConfig(hbm_bytes=hbm_bytes, ddr_bytes=ddr_bytes, device="cpu"),
        "reserved": TierConfig(
            hbm_bytes=hbm_bytes,
            ddr_bytes=ddr_bytes,
            device="cpu",
            reserved={tables[-1].name: (int(hbm_bytes * args.reserve), int(ddr_bytes * args.reserve))},
        ),
    }
    root = Path(tempfile.mkdtemp(prefix="bench_shared_"))
    try:
        stores = {name: TieredStore.create(root / name, tables, tiers, seed=3) for name, tiers in configs.items()}
        for batch in _batches(args, 0, args.warm_steps):
            for s in stores.values():
                _step(s, batch)
        before = {name: _counts(s) for name, s in stores.items()}
        times: dict[str, list[float]] = {name: [] for name in stores}
        for batch in _batches(args, args.warm_steps, args.steps):
            for name, s in stores.items():  # (side by side: each batch on both, in turn)
                t0 = time.perf_counter()
                _step(s, batch)
                times[name].append(time.perf_counter() - t0)
        out: dict = {}
        for name, s in stores.items():
            c = _counts(s) - before[name]
            out[name] = {
                "step_median_s": median(times[name]),
                "step_s": times[name],
                "hbm_hit_rate": c[1] / c[0],
                "ddr_hit_rate": c[3] / max(c[2], 1),
                "ssd_reads_per_step": c[4] / args.steps,
                "hbm_hit_rate_per_table": {t.name: c[7 + 2 * k] / max(c[6 + 2 * k], 1) for k, t in enumerate(tables)},
                "tiers": configs[name].to_dict(),
            }
        ids = np.arange(args.rows)
        want = {t.name: stores["per_table"].peek(t.name, ids, with_state=True).tobytes() for t in tables}
        same = all(
            s.peek(t.name, ids, with_state=True).tobytes() == want[t.name] for s in stores.values() for t in tables
        )
        for s in stores.values():
            s.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    ratio = out["shared"]["step_median_s"] / out["per_table"]["step_median_s"]
    for name, r in out.items():
        print(
            f"{name:10s} step {1e3 * r['step_median_s']:7.1f} ms  HBM hit {r['hbm_hit_rate']:.3f}  "
            f"DDR hit {r['ddr_hit_rate']:.3f}  LMDB reads {r['ssd_reads_per_step']:,.0f}/step  HBM hit per table "
            + " ".join(f"{v:.3f}" for v in r["hbm_hit_rate_per_table"].values())
        )
    print(f"shared / per_table step: {ratio:.2f}x; rows and states byte for byte equal: {same}")
    reserved_ratio = out["reserved"]["step_median_s"] / out["per_table"]["step_median_s"]
    write_json(
        args.json,
        {
            "benchmark": "bench_shared",
            "command": " ".join(sys.argv),
            "machine": machine(),
            "config": {**vars(args), "shares": SHARES, "hbm_bytes": hbm_bytes, "ddr_bytes": ddr_bytes},
            "configs": out,
            "ratios": {"shared_vs_per_table_step": ratio, "reserved_vs_per_table_step": reserved_ratio},
            "bitwise_equal": same,
        },
    )
    if not same:
        raise SystemExit("the two stores' rows differ")


if __name__ == "__main__":
    main()
