"""Row precision: the DLRM job at one byte budget with float32 / float16 / bfloat16 / int8
rows, and the resident train step against FBGEMM's CPU TBE in FP32 and FP16.

Part 1 runs ``tiered-emb train`` per dtype with the same ``--hbm-bytes`` and
``--ddr-bytes`` (the tables ``--factor`` times the budget in float32), ``--job-repeats``
times, the dtypes interleaved: rows resident, hit rates per tier, samples/s (the median of
the runs), LMDB bytes, checkpoint seconds, held-out log loss and AUC after the same steps
(the runs of a dtype give the same bytes; the first run's figures), beside the same job
resident (float32, every row in HBM: ``--hbm-rows`` = ``--rows``, no DDR), the ceiling
no dtype's tiers can pass (``resident_vs_float32``).  Part 3 runs the job
on Criteo's table sizes (``--cardinalities criteo``: 3 ids to ``--rows``), float32, at one
byte budget given as rows per table (the bytes split evenly) and as tiers shared by the
tables: hit rates, rows held and samples/s.  Part 2 times the
train step (forward + fused backward, row-wise Adagrad, every row resident) of one table,
ours in each dtype and FBGEMM's TBE in FP32 and FP16 weights, alternating batch by batch
over the same ids; lookups/s, medians.
Run from the repository root::

    python bench/bench_precision.py --json bench/results/precision.json --plot docs/img/precision.png
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import cpu, fbgemm_tbe, machine, write_json

from tiered_emb import RowWiseAdagrad, TableConfig, TierConfig, TieredStore
from tiered_emb.apps.clicks import table_rows
from tiered_emb.apps.dlrm_config import feature_names
from tiered_emb.cli import main as cli
from tiered_emb.sim.traces import zipf_ids

DTYPES = ("float32", "float16", "bfloat16", "int8")
LR, EPS = 0.05, 1e-8


def _job(args, root: Path, dtype: str, hbm_bytes: int, ddr_bytes: int) -> dict:
    return _run(
        args, root, f"job_{dtype}", ["--hbm-bytes", str(hbm_bytes), "--ddr-bytes", str(ddr_bytes), "--dtype", dtype]
    )


def _run(args, root: Path, name: str, tier_flags: list[str]) -> dict:
    """One ``tiered-emb train`` run of the job with ``tier_flags``: its figures."""
    flags = ["--steps", str(args.steps), "--batch", str(args.batch), "--rows", str(args.rows), "--dim", str(args.dim)]
    flags += [*tier_flags, "--eval-batches", str(args.eval_batches), "--checkpoint-every", "0", "--quiet"]
    flags += ["--json", str(root / f"{name}.json")]
    assert cli(["train", "--run-dir", str(root / name), *flags]) == 0
    report = json.loads((root / f"{name}.json").read_text())
    tiers, ahead = report["tiers"], report["prefetch"]
    out = {k: report[k] for k in ("samples_per_s", "test_auc", "test_logloss", "lmdb_file_bytes", "capacity_rows")}
    out["checkpoint_s"] = sum(c["seconds"] for c in report["checkpoints"])
    out["rows_resident"] = {t: tiers[t]["rows"] for t in ("hbm", "ddr")}
    out["bytes_resident"] = {t: tiers[t]["bytes"] for t in ("hbm", "ddr")}
    # what each tier answered, the lookahead thread's requests and the step's together
    out["hit_rate"] = {}
    for t in ("hbm", "ddr", "ssd"):
        look = tiers[t]["lookups"] + ahead[t]["lookups"]
        out["hit_rate"][t] = (tiers[t]["hits"] + ahead[t]["hits"]) / look if look else 0.0
    shutil.rmtree(root / name)
    return out


def _shared_vs_rows(args, root: Path) -> dict:
    """The job on Criteo's table sizes (3 ids to ``--rows``), float32, at one byte budget
    (``--factor`` below its tables' bytes): rows per table (the bytes split evenly, as
    ``--hbm-rows`` / ``--ddr-rows``) against the tiers shared by the tables; runs interleaved."""
    cfg = TableConfig("t", dim=args.dim, optimizer=RowWiseAdagrad())
    table_bytes = sum(table_rows(args.rows, "criteo")) * 4 * cfg.record_width
    hbm, ddr = table_bytes // args.factor // 2, table_bytes // args.factor - table_bytes // args.factor // 2
    per_table = 4 * cfg.record_width * len(feature_names())
    ways = {
        "rows_per_table": ["--hbm-rows", str(hbm // per_table), "--ddr-rows", str(ddr // per_table)],
        "shared": ["--hbm-bytes", str(hbm), "--ddr-bytes", str(ddr)],
    }
    small = argparse.Namespace(**{**vars(args), "rows": 2000, "steps": 4, "eval_batches": 1})
    for w, flags in ways.items():  # (every kernel either way compiled before anything is timed)
        _run(small, root, f"skew_{w}", ["--cardinalities", "criteo", *flags])
    runs: dict[str, list[dict]] = {w: [] for w in ways}
    for _ in range(args.job_repeats):
        for w, flags in ways.items():
            runs[w].append(_run(args, root, f"skew_{w}", ["--cardinalities", "criteo", *flags]))
    out = {"table_bytes": table_bytes, "budget_bytes": {"hbm": hbm, "ddr": ddr}}
    for w, rs in runs.items():
        speeds = [r["samples_per_s"] for r in rs]
        out[w] = dict(rs[0], samples_per_s=float(np.median(speeds)), samples_per_s_runs=speeds)
    out["shared_vs_rows_per_table"] = out["shared"]["samples_per_s"] / out["rows_per_table"]["samples_per_s"]
    return out


def _batches(args, first: int, count: int):
    import torch

    out = []
    for k in range(count):
        ids = torch.from_numpy(zipf_ids(args.step_rows, 1.05, args.bags * args.bag_size, seed=first + k))
        offsets = torch.arange(args.bags + 1, dtype=torch.int64) * args.bag_size
        g = np.random.default_rng(first + k).normal(0, 1e-2, (args.bags, args.step_dim)).astype(np.float32)
        out.append((ids, offsets, torch.from_numpy(g)))
    return out


def _steps(args, root: Path) -> dict:
    """Train-step lookups/s of ours per dtype and FBGEMM's TBE in FP32 / FP16, interleaved."""
    from tiered_emb.torch import TieredEmbeddingBag

    peers, stores = {}, []
    for dtype in DTYPES:
        cfg = TableConfig(
            "t", dim=args.step_dim, num_rows=args.step_rows, dtype=dtype, optimizer=RowWiseAdagrad(lr=LR, eps=EPS)
        )
        tiers = TierConfig(hbm_rows=args.step_rows, ddr_rows=0, device="cpu")
        store = TieredStore.create(root / f"step_{dtype}", [cfg], tiers, seed=0)
        stores.append(store)
        bag = TieredEmbeddingBag(store, "t", mode="sum", include_last_offset=True)
        peers[f"ours_{dtype}"] = lambda i, o, g, bag=bag: bag(i, o).backward(g)
    for prec in ("FP32", "FP16"):
        tbe = fbgemm_tbe(args.step_rows, args.step_dim, False, LR, EPS, prec)
        if tbe is not None:
            peers[f"fbgemm_{prec.lower()}"] = lambda i, o, g, tbe=tbe: tbe(i, o).backward(g)
    batches = _batches(args, 1, args.step_batches)
    for step in peers.values():  # warm-up: every row touched once, every kernel compiled
        for b in batches:
            step(*b)
    times: dict[str, list[float]] = {name: [] for name in peers}
    for _ in range(args.repeats):
        for b in batches:
            for name, step in peers.items():
                t0 = time.perf_counter()
                step(*b)
                times[name].append(time.perf_counter() - t0)
    for s in stores:
        s.close()
    lookups = args.bags * args.bag_size
    return {
        name: {"median_s": float(np.median(t)), "lookups_per_s": lookups / float(np.median(t))}
        for name, t in times.items()
    }


def _plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    jobs = result["job"]
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.6))
    names = list(jobs)
    panels = [
        ("samples/s (same byte budget)", [jobs[d]["samples_per_s"] for d in names]),
        ("rows held in HBM + DDR", [sum(jobs[d]["rows_resident"].values()) for d in names]),
        ("LMDB MiB", [jobs[d]["lmdb_file_bytes"] / 2**20 for d in names]),
        ("held-out AUC", [jobs[d]["test_auc"] for d in names]),
    ]
    for ax, (title, vals) in zip(axes, panels, strict=True):
        ax.bar(names, vals, color=["#4c72b0", "#dd8452", "#55a868", "#c44e52"][: len(names)])
        ax.set_title(title, fontsize=10)
        if title.startswith("samples/s") and "job_resident" in result:
            ax.axhline(result["job_resident"]["samples_per_s"], color="k", ls="--", lw=1, label="resident float32")
            ax.legend(fontsize=8, loc="lower right")
        if title == "held-out AUC":
            ax.set_ylim(min(vals) - 0.01, max(vals) + 0.005)
    fig.suptitle(f"DLRM job, tables {result['config']['factor']}x the budget; {result['cpu']['model']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=100_000, help="rows per table of the job (26 tables)")
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--batch", type=int, default=2048)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--factor", type=int, default=10, help="float32 tables / (HBM + DDR) bytes")
    p.add_argument("--job-repeats", type=int, default=3, help="runs of the job per dtype (samples/s: their median)")
    p.add_argument("--step-rows", type=int, default=1_000_000, help="rows of the train-step comparison's table")
    p.add_argument("--step-dim", type=int, default=128)
    p.add_argument("--bags", type=int, default=8192)
    p.add_argument("--bag-size", type=int, default=20)
    p.add_argument("--step-batches", type=int, default=3)
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--skip-job", action="store_true")
    p.add_argument("--skip-steps", action="store_true")
    p.add_argument("--skip-skewed", action="store_true", help="skip part 3 (shared against rows per table)")
    p.add_argument("--json", default="bench/results/precision.json")
    p.add_argument("--plot", default=None)
    args = p.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="bench_precision_"))
    result: dict = {"cpu": cpu(), "machine": machine(), "config": vars(args)}
    try:
        if not args.skip_job:
            fp32 = TableConfig("t", dim=args.dim, optimizer=RowWiseAdagrad())
            budget = len(feature_names()) * args.rows * 4 * fp32.record_width // args.factor
            result["budget_bytes"] = {"hbm": budget // 2, "ddr": budget - budget // 2}
            for d in DTYPES:  # (every kernel of every dtype compiled before anything is timed)
                small = argparse.Namespace(**{**vars(args), "rows": 2000, "steps": 4, "eval_batches": 1})
                _job(small, root, d, budget // 200, budget // 200)
            resident = ["--hbm-rows", str(args.rows), "--ddr-rows", "0"]
            _run(argparse.Namespace(**{**vars(args), "steps": 4, "eval_batches": 1}), root, "job_resident", resident)
            runs: dict[str, list[dict]] = {d: [] for d in (*DTYPES, "resident")}
            for _ in range(args.job_repeats):  # (interleaved: a burst of noise lands on every dtype alike)
                for d in DTYPES:
                    runs[d].append(_job(args, root, d, budget // 2, budget - budget // 2))
                runs["resident"].append(_run(args, root, "job_resident", resident))
            result["job"] = {}
            for d, rs in runs.items():
                speeds = [r["samples_per_s"] for r in rs]
                result["job"][d] = dict(rs[0], samples_per_s=float(np.median(speeds)), samples_per_s_runs=speeds)
            result["job_resident"] = result["job"].pop("resident")
            base = result["job"]["float32"]
            result["resident_vs_float32"] = result["job_resident"]["samples_per_s"] / base["samples_per_s"]
            result["job_vs_float32"] = {
                d: {
                    "samples_per_s": r["samples_per_s"] / base["samples_per_s"],
                    "lmdb_bytes": r["lmdb_file_bytes"] / base["lmdb_file_bytes"],
                    "auc_delta": r["test_auc"] - base["test_auc"],
                }
                for d, r in result["job"].items()
            }
        if not args.skip_skewed:
            result["skewed_tables"] = _shared_vs_rows(args, root)
        if not args.skip_steps:
            steps = _steps(args, root)
            result["train_step"] = steps
            if "fbgemm_fp16" in steps:
                fb16, fb32 = steps["fbgemm_fp16"]["lookups_per_s"], steps["fbgemm_fp32"]["lookups_per_s"]
                result["train_step_ratios"] = {
                    "ours_float16_vs_fbgemm_fp16": steps["ours_float16"]["lookups_per_s"] / fb16,
                    "ours_float32_vs_fbgemm_fp32": steps["ours_float32"]["lookups_per_s"] / fb32,
                    "ours_float16_vs_ours_float32": steps["ours_float16"]["lookups_per_s"]
                    / steps["ours_float32"]["lookups_per_s"],
                    "fbgemm_fp16_vs_fbgemm_fp32": fb16 / fb32,
                }
    finally:
        shutil.rmtree(root, ignore_errors=True)
    write_json(args.json, result)
    if args.plot and "job" in result:
        _plot(result, args.plot)
    shown = ("job_vs_float32", "resident_vs_float32", "train_step_ratios")
    print(json.dumps({k: result[k] for k in shown if k in result}, indent=1))
    if "skewed_tables" in result:
        sk = result["skewed_tables"]
        for w in ("rows_per_table", "shared"):
            r = sk[w]
            hits = " ".join(f"{t} {r['hit_rate'][t]:.3f}" for t in ("hbm", "ddr", "ssd"))
            held = sum(r["rows_resident"].values())
            print(f"criteo sizes, {w:14s} {r['samples_per_s']:9.0f} samples/s  rows held {held:,}  hit {hits}")
        print(f"shared / rows per table: {sk['shared_vs_rows_per_table']:.2f}x samples/s")
    return result


if __name__ == "__main__":
    main()
