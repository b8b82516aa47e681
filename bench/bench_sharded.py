"""The DLRM job sharded over 1, 2 and 4 ranks: samples/s, bytes sent between ranks per
sample for fp32 / fp16 / bf16 communication, the planner's estimated imbalance against the
measured one, and TorchRec's planner's plan on the same tables where torchrec is installed.

Each run is ``tiered-emb train`` (one process at world size 1; ``--world-size N`` starts N
ranks on this machine, gloo).  On a machine with fewer cores than ranks the ranks share
them ("oversubscribed" in the JSON and the plot): samples/s then measures the sharded
step's overhead, not a speed-up.  Run from the repository root::

    python bench/bench_sharded.py --json bench/results/sharded.json --plot docs/img/sharded.png

(defaults: the job's 26 tables of 100,000 rows x 16, 2,048 samples a step, 200 steps,
8 held-out batches;
``--row-wise`` adds runs with every table row-wise, the most communication per sample).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import cpu, machine

from tiered_emb.apps.dlrm_config import feature_names
from tiered_emb.cli import main as cli
from tiered_emb.distributed import ShardingPlan, ShardingType, TablePlan


def _job(args, root: Path, name: str, world: int, *extra: str) -> dict:
    run = root / name
    flags = ["--steps", str(args.steps), "--batch", str(args.batch), "--rows", str(args.rows), "--dim", str(args.dim)]
    flags += ["--eval-batches", str(args.eval_batches), "--quiet", "--json", str(root / f"{name}.json")]
    if world > 1:
        flags += ["--world-size", str(world)]
    assert cli(["train", "--run-dir", str(run), *flags, *extra]) == 0
    report = json.loads((root / f"{name}.json").read_text())
    keep = ("samples_per_s", "bytes_sent_per_sample", "measured_imbalance", "estimated_imbalance")
    out = {k: report.get(k) for k in keep}
    out.update(test_logloss=report["test_logloss"], test_auc=report["test_auc"], world_size=world, run=name)
    if world > 1:
        out["plan"] = sorted({t["sharding_type"] for t in report["plan"]["tables"]})
    return out


def _row_wise(root: Path, world: int) -> str:
    plan = ShardingPlan(world, tuple(TablePlan(f, ShardingType.ROW_WISE, tuple(range(world))) for f in feature_names()))
    path = root / f"rw{world}.plan.json"
    plan.save(path)
    return str(path)


def _torchrec_plan(args, root: Path, world: int) -> str | None:
    """TorchRec's planner's plan of the job's tables for ``world`` ranks, as ours; None without torchrec."""
    try:
        import torch
        from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
        from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
        from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
        from torchrec.distributed.planner.storage_reservations import FixedPercentageStorageReservation

        from tiered_emb.torchrec import sharding_plan
    except ImportError:
        return None
    configs = [
        EmbeddingBagConfig(num_embeddings=args.rows, embedding_dim=args.dim, name=f, feature_names=[f])
        for f in feature_names()
    ]
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=world, compute_device="cpu"),
        storage_reservation=FixedPercentageStorageReservation(0.1),
    )
    theirs = planner.plan(
        EmbeddingBagCollection(tables=configs, device=torch.device("meta")), [EmbeddingBagCollectionSharder()]
    )
    path = root / f"torchrec{world}.plan.json"
    sharding_plan(theirs, world).save(path)
    return str(path)


def run(args) -> dict:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-sharded-") as tmp:
        root = Path(tmp)
        # not timed: compiles the kernels and fills Numba's cache (the first run after an edit would pay it)
        cli(
            ["train", "--run-dir", str(root / "warm"), "--steps", "3", "--batch", str(args.batch), "--rows", "1000"]
            + ["--dim", str(args.dim), "--eval-batches", "1", "--quiet", "--world-size", "2"]
        )
        cli(
            ["train", "--run-dir", str(root / "warm1"), "--steps", "3", "--batch", str(args.batch), "--rows", "1000"]
            + ["--dim", str(args.dim), "--eval-batches", "1", "--quiet"]
        )
        rows.append(_job(args, root, "w1", 1))
        for world in args.worlds:
            for dt in ("fp32", "fp16", "bf16"):
                rows.append(_job(args, root, f"w{world}-{dt}", world, "--comm-dtype", dt))
            if args.row_wise:
                rows.append(_job(args, root, f"w{world}-rw", world, "--plan", _row_wise(root, world)))
            theirs = _torchrec_plan(args, root, world)
            if theirs is not None:
                rows.append(_job(args, root, f"w{world}-torchrec-plan", world, "--plan", theirs))
    base = rows[0]
    for r in rows:
        r["vs_one_process"] = r["samples_per_s"] / base["samples_per_s"]
        r["auc_minus_one_process"] = r["test_auc"] - base["test_auc"]
        r["oversubscribed"] = r["world_size"] > cores
    return {
        "bench": "sharded",
        "cpu": cpu(),
        "machine": machine(),
        "cores": cores,
        "config": {k: getattr(args, k) for k in ("steps", "batch", "rows", "dim", "eval_batches")},
        "runs": rows,
    }


def _plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    names = [r["run"] + (" *" if r["oversubscribed"] else "") for r in runs]
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    a.barh(names, [r["samples_per_s"] for r in runs], color="tab:blue")
    a.set_xlabel("samples/s")
    a.invert_yaxis()
    b.barh(names, [r["bytes_sent_per_sample"] or 0 for r in runs], color="tab:orange")
    b.set_xlabel("bytes sent between ranks per sample")
    b.invert_yaxis()
    fig.suptitle(f"tiered-emb train sharded, {result['cpu']['model']} ({result['cores']} cores; * oversubscribed)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--batch", type=int, default=2048)
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    p.add_argument("--row-wise", action="store_true", help="also every table row-wise")
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None)
    args = p.parse_args(argv)
    result = run(args)
    for r in result["runs"]:
        print(
            f"{r['run']:>22}: {r['samples_per_s']:>9,.0f} samples/s ({r['vs_one_process']:.2f}x one process)"
            f"  {r['bytes_sent_per_sample'] or 0:>7,.0f} B/sample  imbalance est {r['estimated_imbalance'] or 1:.3f}"
            f" measured {r['measured_imbalance'] or 1:.3f}  AUC {r['test_auc']:.4f} ({r['auc_minus_one_process']:+.4f})"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, sort_keys=True))
    if args.plot:
        _plot(result, args.plot)
    return result


if __name__ == "__main__":
    main()
