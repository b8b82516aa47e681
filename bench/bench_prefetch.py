"""Lookahead prefetch: tier hit rates against Belady, and training speed with the pipeline.

Part 1, hit rates (the simulator, :mod:`tiered_emb.sim.lookahead`, which makes the
store's own decisions batch by batch).  Each trace is cut into batches; per batch its
unique ids are asked of HBM (with an exclusive DDR tier below, 4x HBM).  At HBM = 1 %
and 10 % of the trace's distinct ids:

- plain ``lru`` / ``lfu`` (no window);
- ``lookahead+lru`` / ``lookahead+lfu`` with window k: rows loaded by the step (L0),
  ``load_ahead`` batches early (L1 by default), and the whole window at once (to show
  why not);
- windowed Belady with the same window (ties outside the window by LRU, or by LFU);
- full Belady (the whole future, no batches): the bound.

A miss is a row brought into HBM for a batch, by the prefetch thread or by the step.
Targets: lookahead at least the best plain policy, and within 1 point of windowed Belady.

Part 2, end to end: the DLRM main job (``tiered-emb train``) with tables 10x HBM + DDR,
samples/s without the pipeline (write-backs on the step's thread, and on the writer
thread), with it (window k: rows placed by the step, or brought up and pinned
``load_ahead`` batches ahead, the job's default, also reading LMDB that far ahead), and
with every row resident (with and without the pipeline); each at the job's default
thread count for the step (every core but one) and, for the pipeline and both
baselines, on every core.  The headline
ratios take each baseline at its faster setting.  All configurations of a repeat run
back to back, medians over repeats.

Run from the repository root::

    python bench/bench_prefetch.py --json bench/results/prefetch.json
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, median, write_json

from tiered_emb.sim.engine import simulate
from tiered_emb.sim.lookahead import batch_uniques, store_hits, window_belady_hits
from tiered_emb.sim.traces import drift_ids, zipf_ids

AMAZON = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "amazon_video_user_item.txt"


def traces(args) -> dict[str, tuple[np.ndarray, int, str]]:
    """name -> (requests, batch size, description)."""
    n, size = args.ids, args.requests
    out = {
        "zipf0.9": (zipf_ids(n, 0.9, size, seed=args.seed), args.batch, f"Zipf(0.9) over {n:,} ids, {size:,} requests"),
        "zipf1.2": (
            zipf_ids(n, 1.2, size, seed=args.seed + 1),
            args.batch,
            f"Zipf(1.2) over {n:,} ids, {size:,} requests",
        ),
        "drift": (
            drift_ids(n, 1.0, size, seed=args.seed + 2, period=size // 10),
            args.batch,
            f"Zipf(1.0) over {n:,} ids whose ranking moves by 1% of the ids every {size // 10:,} requests",
        ),
    }
    if AMAZON.is_file():
        items = np.loadtxt(AMAZON, dtype=np.int64)[:, 1]
        items = items[np.random.default_rng(args.seed).permutation(items.shape[0])]  # a loader's shuffle
        out["amazon"] = (
            items,
            args.amazon_batch,
            f"Amazon Video item ids, {items.shape[0]:,} interactions shuffled (seed {args.seed})",
        )
    else:
        print(f"{AMAZON} is absent; skipping the Amazon trace", file=sys.stderr)
    return out


def hit_rates(trace: np.ndarray, batch: int, frac: float, window: int, load_ahead: int) -> dict:
    uids, boff = batch_uniques(trace, batch)
    distinct = int(np.unique(trace).shape[0])
    hbm = max(2, round(frac * distinct))
    ddr = 4 * hbm
    n = uids.shape[0]
    row = {
        "hbm_rows": hbm,
        "ddr_rows": ddr,
        "distinct_ids": distinct,
        "unique_ids_per_batch": n / (boff.shape[0] - 1),
        "lookups": n,
    }
    runs = {"lru": ("lru", 0, 0), "lfu": ("lfu", 0, 0)}
    for load, label in ((0, "load 0"), (load_ahead, f"load {load_ahead}"), (window, "load all")):
        for base in ("lru", "lfu"):
            runs[f"lookahead+{base} {label}"] = (f"lookahead+{base}", window, load)
    policies = {}
    for name, (policy, k, load) in runs.items():
        t0 = time.perf_counter()
        h = store_hits(uids, boff, hbm, policy, k, ddr_rows=ddr, load_ahead=load)
        policies[name] = {
            "hbm_hit_rate": h.hbm_hit_rate,
            "ddr_hit_rate": h.ddr_hit_rate,
            "hbm_plus_ddr_hit_rate": (h.hbm_hits + h.ddr_hits) / n,
            "seconds": time.perf_counter() - t0,
        }
    for ties in ("lru", "lfu"):
        hits = window_belady_hits(uids, boff, hbm, window, ties)
        policies[f"window belady ({ties} ties)"] = {"hbm_hit_rate": hits / n}
    policies["belady (full)"] = {"hbm_hit_rate": simulate(uids, hbm, "belady") / n}
    row["policies"] = policies
    rate = {k: v["hbm_hit_rate"] for k, v in policies.items()}
    best_plain = max(rate["lru"], rate["lfu"])
    best_wb = max(rate["window belady (lru ties)"], rate["window belady (lfu ties)"])
    row["checks"] = {}
    for label in ("load 0", f"load {load_ahead}"):
        best_la = max(rate[f"lookahead+lru {label}"], rate[f"lookahead+lfu {label}"])
        row["checks"][label] = {
            "minus_best_plain": best_la - best_plain,
            "minus_best_window_belady": best_la - best_wb,
            "lru_minus_window_belady_lru": rate[f"lookahead+lru {label}"] - rate["window belady (lru ties)"],
            "lfu_minus_window_belady_lfu": rate[f"lookahead+lfu {label}"] - rate["window belady (lfu ties)"],
        }
        row["checks"][label]["meets_targets"] = bool(best_la >= best_plain and best_la - best_wb >= -0.01)
    return row


def end_to_end(args) -> dict:
    """samples/s of the DLRM job: no prefetch, the pipeline, every row resident (same data and steps)."""
    from tiered_emb.apps import dlrm

    parser = argparse.ArgumentParser()
    dlrm.add_parser(parser.add_subparsers(dest="command"))

    base = ["train", "--steps", str(args.e2e_steps), "--quiet", "--eval-batches", "1", "--checkpoint-every", "0"]
    # tables (26 x 100k rows) = 12.2x HBM + DDR, split as the job's GPU default (on the CPU
    # the job's default holds both in HBM: docs/tuning.md, "The CPU: one tier")
    hbm, ddr = 4096, 4096
    k, la = str(args.window), str(args.load_ahead)
    cores = str(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1))
    every_core = ["--step-threads", cores]  # the job's default leaves one core to its background threads
    configs = {
        "no prefetch, writes on the step": ["--lookahead", "0", "--sync-writes"],
        "no prefetch": ["--lookahead", "0"],
        "no prefetch, step on every core": ["--lookahead", "0", *every_core],
        f"pipeline k={k} load 0": ["--lookahead", k, "--load-ahead", "0"],
        f"pipeline k={k} load {la}": ["--lookahead", k, "--load-ahead", la],
        f"pipeline k={k} load {la} read-ahead {la}": ["--lookahead", k, "--load-ahead", la, "--read-ahead", la],
        f"pipeline k={k} load {la}, step on every core": ["--lookahead", k, "--load-ahead", la, *every_core],
        "every row resident": ["--hbm-rows", "100000", "--ddr-rows", "0"],
        "every row resident, no prefetch": ["--hbm-rows", "100000", "--ddr-rows", "0", "--lookahead", "0"],
        "every row resident, no prefetch, step on every core": [
            "--hbm-rows",
            "100000",
            "--ddr-rows",
            "0",
            "--lookahead",
            "0",
            *every_core,
        ],
    }
    out = {}
    with tempfile.TemporaryDirectory(prefix="bench_prefetch_") as tmp:
        for rep in range(args.e2e_repeats):
            for name, extra in configs.items():
                argv = [
                    *base,
                    "--run-dir",
                    f"{tmp}/{rep}_{len(out)}",
                    "--hbm-rows",
                    str(hbm),
                    "--ddr-rows",
                    str(ddr),
                    *extra,
                ]
                r = dlrm.train(parser.parse_args(argv))
                out.setdefault(
                    name,
                    {
                        "flags": extra,
                        "samples_per_s": [],
                        "step_hbm_hit_rate": r["tiers"]["hbm"]["hit_rate"],
                        "prefetched_rows": r["prefetch"]["hbm"]["lookups"],
                    },
                )
                out[name]["samples_per_s"].append(r["samples_per_s"])
                out[name].setdefault("thread_cpu_ms_per_step", []).append(r["thread_cpu_ms_per_step"])
    for v in out.values():
        v["median_samples_per_s"] = median(v["samples_per_s"])
    med = {name: out[name]["median_samples_per_s"] for name in configs}
    sync, none, none_all, load0, pipe, pipe_read, pipe_all, resident, resident_none, resident_all = list(configs)
    best_none = max(med[none], med[none_all])  # each baseline at its fastest setting
    best_resident = max(med[resident], med[resident_none], med[resident_all])
    out["ratios"] = {
        "pipeline_vs_no_prefetch": med[pipe] / best_none,
        "pipeline_vs_resident": med[pipe] / best_resident,
        "pipeline_vs_no_prefetch_same_threads": med[pipe] / med[none],
        "pipeline_vs_resident_same_threads": med[pipe] / med[resident],
        "pipeline_load0_vs_no_prefetch": med[load0] / med[none],
        "pipeline_read_ahead_vs_pipeline": med[pipe_read] / med[pipe],
        "pipeline_every_core_vs_pipeline": med[pipe_all] / med[pipe],
        "writer_thread_vs_writes_on_step": med[none] / med[sync],
        "no_prefetch_vs_resident": best_none / best_resident,
    }
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ids", type=int, default=1_000_000, help="id universe of the synthetic traces")
    p.add_argument("--requests", type=int, default=2_000_000, help="requests per synthetic trace")
    p.add_argument("--batch", type=int, default=1024, help="requests per batch (synthetic traces)")
    p.add_argument("--amazon-batch", type=int, default=32, help="requests per batch (Amazon trace)")
    p.add_argument("--sizes", default="0.01,0.1", help="HBM sizes, fractions of the distinct ids")
    p.add_argument("--window", type=int, default=4, help="lookahead window k (batches)")
    p.add_argument("--load-ahead", type=int, default=1, help="batches ahead whose rows are brought up")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--e2e-steps", type=int, default=100, help="training steps per end-to-end run (0: skip part 2)")
    p.add_argument("--e2e-repeats", type=int, default=3)
    p.add_argument("--e2e-only", action="store_true", help="skip part 1 (hit rates)")
    p.add_argument("--json", default="bench/results/prefetch.json")
    args = p.parse_args(argv)
    sizes = [float(x) for x in args.sizes.split(",")]
    results = {}
    la = f"load {args.load_ahead}"
    print(
        f"HBM hit rates; lookahead window k={args.window}; 'L0': rows loaded by the step, 'L{args.load_ahead}': "
        f"loaded {args.load_ahead} batch(es) ahead; wB: windowed Belady"
    )
    print(
        f"{'trace':<9} {'HBM':>4} {'lru':>6} {'lfu':>6} {'L0 lru':>6} {'L0 lfu':>6} {'L1 lru':>6} {'L1 lfu':>6} "
        f"{'wB lru':>6} {'wB lfu':>6} {'belady':>6}  targets L0 / L{args.load_ahead}"
    )
    for name, (trace, batch, desc) in ({} if args.e2e_only else traces(args)).items():
        results[name] = {"description": desc, "batch": batch, "points": {}}
        for frac in sizes:
            row = hit_rates(trace, batch, frac, args.window, args.load_ahead)
            results[name]["points"][f"{frac:.0%}"] = row
            r = {k: v["hbm_hit_rate"] for k, v in row["policies"].items()}
            ok = ["met" if row["checks"][x]["meets_targets"] else "MISSED" for x in ("load 0", la)]
            print(
                f"{name:<9} {frac:>4.0%} {r['lru']:>6.3f} {r['lfu']:>6.3f} {r['lookahead+lru load 0']:>6.3f} "
                f"{r['lookahead+lfu load 0']:>6.3f} {r[f'lookahead+lru {la}']:>6.3f} "
                f"{r[f'lookahead+lfu {la}']:>6.3f} {r['window belady (lru ties)']:>6.3f} "
                f"{r['window belady (lfu ties)']:>6.3f} {r['belady (full)']:>6.3f}  {ok[0]} / {ok[1]}"
            )
    out = {
        "benchmark": "prefetch",
        "command": "python bench/bench_prefetch.py " + " ".join(argv or sys.argv[1:]),
        "config": vars(args),
        "machine": machine(),
        "hit_rates": results,
    }
    if args.e2e_steps > 0:
        e2e = end_to_end(args)
        out["end_to_end"] = e2e
        for name, v in e2e.items():
            if name != "ratios":
                print(
                    f"{name:<34} {v['median_samples_per_s']:>10,.0f} samples/s  (the steps' HBM hit rate "
                    f"{v['step_hbm_hit_rate']:.3f})"
                )
        for name, v in e2e["ratios"].items():
            print(f"{name:<40} {v:.2f}x")
    if args.json:
        write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
