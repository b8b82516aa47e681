"""The streaming job: Zipf batches through a store larger than HBM + DDR; per-tier statistics.

``tiered-emb stream`` runs it.  It is the storage engine alone, without a model: every
batch is a lookup plus a row-wise update of the rows it touched, so rows become dirty,
move down the tiers and land in LMDB.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import numpy as np

from tiered_emb._progress import progress
from tiered_emb.apps.checkpoints import checkpoint_due, format_checkpoints, timed_checkpoint
from tiered_emb.config import TableConfig, TierConfig
from tiered_emb.errors import ConfigError
from tiered_emb.optimizers import RowWiseAdagrad
from tiered_emb.sim.traces import zipf_ids
from tiered_emb.store import TieredStore


def format_tier_table(stats: dict) -> str:
    """A table of per-tier statistics for every table of ``store.stats()``."""
    head = (
        f"{'table':<10} {'tier':<4} {'lookups':>11} {'hit rate':>8} {'evictions':>10} {'writebacks':>10} "
        f"{'rows':>10} {'MiB':>8}"
    )
    lines = [head, "-" * len(head)]
    for name, s in stats.items():
        for tier in ("hbm", "ddr", "ssd"):
            t = s[tier]
            lines.append(
                f"{name:<10} {tier:<4} {t['lookups']:>11,} {t['hit_rate']:>8.3f} {t['evictions']:>10,} "
                f"{t['writebacks']:>10,} {t['rows']:>10,} {t['bytes'] / 2**20:>8.1f}"
            )
    return "\n".join(lines)


def add_parser(sub) -> None:
    p = sub.add_parser(
        "stream",
        help="stream Zipf batches through a store larger than HBM+DDR; print tier stats",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--run-dir",
        default="runs/stream",
        help="run directory: its store, stream.json (the flags) and report.json (an earlier run is replaced)",
    )
    p.add_argument("--tables", type=int, default=4, help="tables, each with its own batches")
    p.add_argument("--ids", type=int, default=2_000_000, help="distinct ids per table (its num_rows)")
    p.add_argument("--dim", type=int, default=32, help="embedding dimension")
    p.add_argument("--alpha", type=float, default=1.05, help="Zipf skew of the ids")
    p.add_argument("--batch", type=int, default=8192, help="ids per table per step")
    p.add_argument("--steps", type=int, default=200, help="steps (a lookup and an update of every table)")
    p.add_argument("--hbm-rows", type=int, default=8192, help="HBM rows per table")
    p.add_argument("--ddr-rows", type=int, default=32768, help="DDR rows per table")
    p.add_argument("--policy", default="lru", help="eviction policy (tiered_emb.POLICIES)")
    p.add_argument("--seed", type=int, default=0, help="seed of the initial rows and the batches")
    p.add_argument(
        "--checkpoint-every",
        type=int,
        default=0,
        help="steps between checkpoints (0: only the one at the end, which every run takes)",
    )
    p.set_defaults(func=run)


#: The file that marks a directory as a run of this job (its arguments): only such a
#: directory, or an empty one, is replaced by the next run.
RUN_FILE = "stream.json"


def _replace_run(run_dir: Path, settings: dict) -> Path:
    """Make ``run_dir`` a new run (removing an earlier run of this job there); returns the
    store's path.  ConfigError, with nothing removed, when ``run_dir`` holds anything else."""
    if run_dir.is_symlink() or (run_dir.exists() and not run_dir.is_dir()):
        raise ConfigError(f"--run-dir {str(run_dir)!r} exists and is not a directory", "choose another --run-dir")
    if run_dir.is_dir() and any(run_dir.iterdir()):
        if not (run_dir / RUN_FILE).is_file():
            raise ConfigError(
                f"--run-dir {str(run_dir)!r} holds files but no run of `tiered-emb stream` (no {RUN_FILE}); "
                "not replaced",
                "choose a new or empty --run-dir, or remove that one yourself",
            )
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / RUN_FILE).write_text(json.dumps(settings, indent=2, sort_keys=True))
    return run_dir / "store"


def run(args) -> int:
    # every argument checked before anything on disk changes
    every = args.checkpoint_every
    if not isinstance(every, int) or isinstance(every, bool) or every < 0:
        raise ConfigError(f"--checkpoint-every {every!r} is invalid", "use an int >= 0 (0: checkpoint only at the end)")
    tables = [
        TableConfig(f"t{i}", dim=args.dim, num_rows=args.ids, optimizer=RowWiseAdagrad(lr=0.05))
        for i in range(args.tables)
    ]
    tiers = TierConfig(hbm_rows=args.hbm_rows, ddr_rows=args.ddr_rows, policy=args.policy, device="cpu")
    settings = {k: v for k, v in sorted(vars(args).items()) if k not in ("func", "command")}
    path = _replace_run(Path(args.run_dir), settings)
    checkpoints = []  # one record a checkpoint: its step, seconds and rows written
    t0 = time.perf_counter()
    with TieredStore.create(path, tables, tiers, seed=args.seed) as store:
        for step in range(args.steps):
            for i, t in enumerate(tables):
                ids = zipf_ids(args.ids, args.alpha, args.batch, seed=args.seed * 1_000_003 + step * 131 + i)
                rows = store.lookup(t.name, ids)
                store.apply_gradients(t.name, ids, np.asarray(rows) * np.float32(0.01))
            if checkpoint_due(step + 1, every, args.steps):
                checkpoints.append(timed_checkpoint(store, step + 1))
            progress(step + 1, args.steps, t0, "steps")
        checkpoints.append(timed_checkpoint(store, max(args.steps, 0)))
        elapsed = time.perf_counter() - t0
        stats = store.stats()
        print(format_tier_table(stats))
        # After the checkpoint LMDB holds every row the run touched (each was updated), the
        # rows still in HBM and DDR included: its record count is the distinct rows.
        touched = sum(s["ssd"]["rows"] for s in stats.values())
        cap = args.tables * (args.hbm_rows + args.ddr_rows)
        lmdb_file_bytes = store.disk_bytes()
        print(
            f"\n{args.steps} steps x {args.tables} tables x {args.batch} ids in {elapsed:.1f} s "
            f"({args.steps * args.tables * args.batch / elapsed:,.0f} lookups/s); "
            f"rows stored {touched:,} = {touched / cap:.1f}x HBM+DDR capacity; "
            f"LMDB files {lmdb_file_bytes / 2**20:.1f} MiB"
        )
        print(format_checkpoints(checkpoints))
        report = {
            "steps": args.steps,
            "seconds": elapsed,
            "rows_stored": touched,
            "capacity_rows": cap,
            "lmdb_file_bytes": lmdb_file_bytes,
            "checkpoints": checkpoints,
        }
    # the figures printed, and a record a checkpoint (whose seconds vary from run to run)
    (Path(args.run_dir) / "report.json").write_text(json.dumps(report, indent=2, sort_keys=True))
    return 0
