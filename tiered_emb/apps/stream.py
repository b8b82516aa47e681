"""The streaming job: Zipf batches through a store larger than HBM + DDR; per-tier statistics.

``tiered-emb stream`` runs it.  It is the storage engine alone, without a model: every
batch is a lookup plus a row-wise update of the rows it touched, so rows become dirty,
move down the tiers and land in LMDB.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from tiered_emb._args import finite_arg
from tiered_emb._options import STDOUT, add_alias, add_command, check_run_dir, count, make_run_dir
from tiered_emb._progress import progress_bar
from tiered_emb.apps.checkpoints import checkpoint_due, format_checkpoints, timed_checkpoint
from tiered_emb.cache.policies import POLICIES
from tiered_emb.config import TableConfig, TierConfig
from tiered_emb.errors import ConfigError
from tiered_emb.optimizers import RowWiseAdagrad
from tiered_emb.sim.bench import check_output, emit_json
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
    p = add_command(sub, "stream", "stream Zipf batches through a store larger than HBM+DDR; print tier stats")
    p.add_argument(
        "--run-dir",
        default="runs/stream",
        help="run directory: its store and report.json (an earlier run of `tiered-emb stream` there is "
        "replaced; any other non-empty directory is refused)",
    )
    p.add_argument("--tables", type=count, default=4, help="tables, each with its own batches")
    p.add_argument("--rows", type=count, default="2M", help="rows per table (its num_rows): ids are drawn below it")
    add_alias(p, "--ids", "rows", type=count)
    p.add_argument("--dim", type=count, default=32, help="embedding dimension")
    p.add_argument("--alpha", type=float, default=1.05, help="Zipf skew of the ids (0: uniform)")
    p.add_argument("--batch", type=count, default=8192, help="samples per step; each looks up one id in every table")
    p.add_argument("--steps", type=count, default=200, help="steps (a lookup and an update of every table)")
    p.add_argument("--hbm-rows", type=count, default=8192, help="HBM rows per table")
    p.add_argument("--ddr-rows", type=count, default=32768, help="DDR rows per table")
    p.add_argument("--policy", default="lru", help=f"eviction policy of the tiers: {', '.join(sorted(POLICIES))}")
    p.add_argument("--seed", type=count, default=0, help="seed of the initial rows and the batches")
    p.add_argument(
        "--checkpoint-every",
        type=count,
        default=0,
        help="steps between checkpoints (0: only the one at the end, which every run takes)",
    )
    p.set_defaults(func=run)


def _check_flags(args) -> tuple[list[TableConfig], TierConfig]:
    """Every flag checked (ConfigError naming it), before anything on disk changes."""
    for flag, value, lo in (
        ("--tables", args.tables, 1),
        ("--batch", args.batch, 1),
        ("--steps", args.steps, 0),
        ("--seed", args.seed, 0),
        ("--checkpoint-every", args.checkpoint_every, 0),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < lo:
            why = " (0: checkpoint only at the end)" if flag == "--checkpoint-every" else ""
            raise ConfigError(f"{flag} {value!r} is invalid", f"use an int >= {lo}{why}")
    finite_arg("--alpha", args.alpha, 0.0, hint="give a finite Zipf skew >= 0 (0: uniform ids)")
    tables = [
        TableConfig(f"t{i}", dim=args.dim, num_rows=args.rows, optimizer=RowWiseAdagrad(lr=0.05))
        for i in range(args.tables)
    ]
    tiers = TierConfig(hbm_rows=args.hbm_rows, ddr_rows=args.ddr_rows, policy=args.policy, device="cpu")
    return tables, tiers


def run(args) -> int:
    run_dir = Path(args.run_dir)
    check_run_dir(run_dir, "stream")  # before anything else: a directory of the user's is never removed
    tables, tiers = _check_flags(args)
    if args.json not in (None, STDOUT):
        check_output(args.json, "--json")
    make_run_dir(run_dir, "stream")
    settings = {k: v for k, v in sorted(vars(args).items()) if k not in ("func", "command")}
    (run_dir / "stream.json").write_text(json.dumps(settings, indent=2, sort_keys=True))
    checkpoints = []  # one record a checkpoint: its step, seconds and rows written
    t0 = time.perf_counter()
    with TieredStore.create(run_dir / "store", tables, tiers, seed=args.seed) as store:
        with progress_bar(args.steps, "steps", args.quiet) as bar:
            for step in range(args.steps):
                for i, t in enumerate(tables):
                    ids = zipf_ids(args.rows, args.alpha, args.batch, seed=args.seed * 1_000_003 + step * 131 + i)
                    rows = store.lookup(t.name, ids)
                    store.apply_gradients(t.name, ids, np.asarray(rows) * np.float32(0.01))
                if checkpoint_due(step + 1, args.checkpoint_every, args.steps):
                    checkpoints.append(timed_checkpoint(store, step + 1))
                bar.update(1)
        checkpoints.append(timed_checkpoint(store, max(args.steps, 0)))
        elapsed = time.perf_counter() - t0
        stats = store.stats()
        # After the checkpoint LMDB holds every row the run touched (each was updated), the
        # rows still in HBM and DDR included: its record count is the distinct rows.
        touched = sum(s["ssd"]["rows"] for s in stats.values())
        cap = args.tables * (args.hbm_rows + args.ddr_rows)
        report = {
            "steps": args.steps,
            "seconds": elapsed,
            "lookups_per_s": args.steps * args.tables * args.batch / max(elapsed, 1e-9),
            "rows_stored": touched,
            "capacity_rows": cap,
            "lmdb_file_bytes": store.engine.disk_bytes(),
            "checkpoints": checkpoints,
            "tiers": stats,
        }
    # the figures printed, and a record a checkpoint (whose seconds vary from run to run)
    (run_dir / "report.json").write_text(json.dumps(report, indent=2, sort_keys=True))
    if emit_json(args.json, report):
        return 0
    print(format_tier_table(stats))
    print(
        f"\n{args.steps} steps x {args.tables} tables x {args.batch} ids in {elapsed:.1f} s "
        f"({report['lookups_per_s']:,.0f} lookups/s); "
        f"rows stored {touched:,} = {touched / cap:.1f}x HBM+DDR capacity; "
        f"LMDB files {report['lmdb_file_bytes'] / 2**20:.1f} MiB"
    )
    print(format_checkpoints(checkpoints))
    return 0
