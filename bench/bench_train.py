"""Train-step and forward throughput of TieredEmbeddingBag against FBGEMM's CPU TBE and torch.

Peers run side by side in one process on the same ids (Zipf-skewed bags):

- train step = forward + backward + row-wise Adagrad:
  ``TieredEmbeddingBag`` (fused backward, the store's RowWiseAdagrad, all rows resident),
  FBGEMM ``SplitTableBatchedEmbeddingBagsCodegen`` on CPU with EXACT_ROWWISE_ADAGRAD,
  ``torch.nn.EmbeddingBag(sparse=True)`` + ``torch.optim.Adagrad``;
- forward alone: ours vs ``torch.nn.EmbeddingBag`` vs FBGEMM, each peer on its own (its
  hot rows stay in cache between the timed batches), then again with the peers
  alternating batch by batch (each evicts the others' rows, as a training step's other
  work would);
- the same train step on a stream of fresh batches, with tables 10x larger than HBM +
  DDR (rows go down to LMDB and come back), relative to an all-resident store on the
  same batches.

Medians (and P90) over the timed steps; one warm-up pass first (numba compilation,
lazy initialisation of the rows).  Run from the repository root::

    python bench/bench_train.py --json bench/results/train.json

(defaults: 1M rows, dim 128, 8,192 bags x 20 ids, Zipf 1.05).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import tiered_emb
from tiered_emb import RowWiseAdagrad, TableConfig, TierConfig, TieredStore
from tiered_emb.sim.traces import zipf_ids
from tiered_emb.torch import TieredEmbeddingBag

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import cpu, fbgemm_tbe

LR, EPS = 0.01, 1e-8


def _batches(args, first_seed: int, count: int):
    """``count`` batches of (ids, offsets (B+1,), grad (B, dim)), seeded from ``first_seed``."""
    out = []
    for k in range(count):
        ids = torch.from_numpy(zipf_ids(args.rows, args.alpha, args.bags * args.bag_size, seed=first_seed + k))
        offsets = torch.arange(args.bags + 1, dtype=torch.int64) * args.bag_size
        g = np.random.default_rng(first_seed + k).normal(0, 1e-2, (args.bags, args.dim))
        g = torch.from_numpy(g.astype(np.float32))
        out.append((ids, offsets, g))
    return out


def _time_steps(step, batches, repeats: int) -> list[float]:
    """Warm up once over ``batches``, then time ``repeats`` passes; seconds per step."""
    for b in batches:
        step(*b)
    times = []
    for _ in range(repeats):
        for b in batches:
            t = time.perf_counter()
            step(*b)
            times.append(time.perf_counter() - t)
    return times


def _time_interleaved(steps: dict, batches, repeats: int) -> dict[str, list[float]]:
    """Like :func:`_time_steps` for several peers at once, alternating them batch by batch,
    so a burst of noise on the (shared) machine lands on every peer alike."""
    for step in steps.values():
        for b in batches:
            step(*b)
    times = {name: [] for name in steps}
    for _ in range(repeats):
        for b in batches:
            for name, step in steps.items():
                t = time.perf_counter()
                step(*b)
                times[name].append(time.perf_counter() - t)
    return times


def _time_stream(step, warm, timed) -> list[float]:
    for b in warm:
        step(*b)
    times = []
    for b in timed:
        t = time.perf_counter()
        step(*b)
        times.append(time.perf_counter() - t)
    return times


def _summary(times: list[float], lookups: int) -> dict:
    med = float(np.median(times))
    return {
        "median_s": med,
        "p90_s": float(np.percentile(times, 90)),
        "steps": len(times),
        "lookups_per_s": lookups / med,
    }


def _ours(path, args, hbm_rows: int, ddr_rows: int):
    cfg = TableConfig("t", dim=args.dim, num_rows=args.rows, optimizer=RowWiseAdagrad(lr=LR, eps=EPS))
    store = TieredStore.create(path, [cfg], TierConfig(hbm_rows=hbm_rows, ddr_rows=ddr_rows, device="cpu"), seed=0)
    return store, TieredEmbeddingBag(store, "t", mode="sum", include_last_offset=True)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--bags", type=int, default=8192)
    p.add_argument("--bag-size", type=int, default=20)
    p.add_argument("--alpha", type=float, default=1.05)
    p.add_argument("--batches", type=int, default=3, help="distinct batches cycled in the resident runs")
    p.add_argument("--repeats", type=int, default=4, help="timed passes over the batches (train steps)")
    p.add_argument("--forward-repeats", type=int, default=10, help="timed passes over the batches (forward)")
    p.add_argument("--stream-steps", type=int, default=8, help="fresh batches timed in the LMDB comparison")
    p.add_argument("--lmdb-factor", type=int, default=10, help="table rows / (HBM + DDR rows) in the LMDB run")
    p.add_argument("--json", default="bench/results/train.json")
    p.add_argument("--skip-torch-train", action="store_true", help="skip the (slow) torch sparse Adagrad peer")
    args = p.parse_args(argv)
    lookups = args.bags * args.bag_size
    batches = _batches(args, 1, args.batches)
    results: dict[str, dict] = {}
    tmp = Path(tempfile.mkdtemp(prefix="bench_train_"))
    try:
        # ---- ours (all rows resident), FBGEMM's CPU TBE, torch.nn.EmbeddingBag
        store, bag = _ours(tmp / "resident", args, hbm_rows=args.rows, ddr_rows=0)
        tbe = fbgemm_tbe(args.rows, args.dim, False, LR, EPS)
        emb = torch.nn.EmbeddingBag(args.rows, args.dim, mode="sum", sparse=True, include_last_offset=True)
        opt = torch.optim.Adagrad(emb.parameters(), lr=LR, eps=EPS)

        def ours_train(ids, offsets, g):
            bag(ids, offsets).backward(g)

        def fb_train(ids, offsets, g):
            tbe(ids, offsets).backward(g)  # noqa: F821 (deleted below, once the timings are done)

        def torch_train(ids, offsets, g):
            emb(ids, offsets).backward(g)  # noqa: F821 (as above)
            opt.step()  # noqa: F821
            opt.zero_grad(set_to_none=True)  # noqa: F821

        def forward_of(module):
            def fwd(ids, offsets, g):
                with torch.no_grad():
                    module(ids, offsets)

            return fwd

        # Each peer alone over the same few batches (its hot rows stay in cache), then the
        # forwards again alternating batch by batch (each evicts the others' rows, as the
        # rest of a training step would).
        peers = {"ours": (ours_train, forward_of(bag)), "torch": (None, forward_of(emb))} | (
            {"fbgemm": (fb_train, forward_of(tbe))} if tbe is not None else {}
        )
        for name, (train, fwd) in peers.items():
            if train is not None:
                results[f"{name}_train"] = _summary(_time_steps(train, batches, args.repeats), lookups)
            results[f"{name}_forward"] = _summary(_time_steps(fwd, batches, args.forward_repeats), lookups)
        mixed = _time_interleaved({name: fwd for name, (_, fwd) in peers.items()}, batches, args.forward_repeats)
        for name, times in mixed.items():
            results[f"{name}_forward_interleaved"] = _summary(times, lookups)
        if not args.skip_torch_train:  # timed alone: its step is much the slowest and would set the others' pace
            results["torch_train"] = _summary(_time_steps(torch_train, batches, max(1, args.repeats // 2)), lookups)
        store.close()
        shutil.rmtree(tmp / "resident")
        del store, bag, tbe, emb, opt

        # ---- fresh batches: tables 10x HBM+DDR (LMDB in use) vs all resident, same batches
        warm = _batches(args, 1000, args.stream_steps)
        timed = _batches(args, 2000, args.stream_steps)
        capacity = max(args.rows // args.lmdb_factor, 2)
        unique_max = max(int(np.unique(b[0].numpy()).shape[0]) for b in warm + timed)
        hbm_rows = min(max(unique_max, capacity // 2), capacity - 1)  # HBM holds a batch: no spill path
        stream = {}
        for name, (h, d) in {"resident": (args.rows, 0), "lmdb": (hbm_rows, capacity - hbm_rows)}.items():
            store, bag = _ours(tmp / name, args, hbm_rows=h, ddr_rows=d)

            def step(ids, offsets, g, bag=bag):
                bag(ids, offsets).backward(g)

            stream[name] = _summary(_time_stream(step, warm, timed), lookups)
            s = store.stats()["t"]
            stream[name]["hit_rates"] = {t: s[t]["hit_rate"] for t in ("hbm", "ddr", "ssd")}
            stream[name]["lmdb_rows"] = s["ssd"]["rows"] + s["ssd"]["writeback_rows"]  # written or waiting to be
            stream[name]["tiers"] = {"hbm_rows": h, "ddr_rows": d}
            store.close()
            shutil.rmtree(tmp / name)
        results["stream_resident_train"] = stream["resident"]
        results["stream_lmdb_train"] = stream["lmdb"]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    def ratio(a, b):
        return results[a]["lookups_per_s"] / results[b]["lookups_per_s"] if a in results and b in results else None

    ratios = {
        "train_vs_fbgemm": ratio("ours_train", "fbgemm_train"),
        "train_vs_torch_sparse_adagrad": ratio("ours_train", "torch_train"),
        "forward_vs_torch": ratio("ours_forward", "torch_forward"),
        "forward_interleaved_vs_torch": ratio("ours_forward_interleaved", "torch_forward_interleaved"),
        "forward_vs_fbgemm": ratio("ours_forward", "fbgemm_forward"),
        "lmdb_vs_resident_train": ratio("stream_lmdb_train", "stream_resident_train"),
    }
    out = {
        "benchmark": "train",
        "command": "python bench/bench_train.py " + " ".join(argv or sys.argv[1:]),
        "config": vars(args),
        "seed_first_batch": 1,
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "cpu": cpu(),
            "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "numba_threads": int(os.environ.get("NUMBA_NUM_THREADS", os.cpu_count() or 1)),
        },
        "versions": {
            "tiered_emb": tiered_emb.__version__,
            "torch": torch.__version__,
            "numpy": np.__version__,
            "fbgemm_gpu": _version("fbgemm_gpu"),
            "numba": _version("numba"),
        },
        "results": results,
        "ratios": ratios,
    }
    print(f"{'peer':<24} {'median ms':>10} {'p90 ms':>8} {'M lookups/s':>12}")
    for name, r in results.items():
        print(f"{name:<24} {1e3 * r['median_s']:>10.1f} {1e3 * r['p90_s']:>8.1f} {r['lookups_per_s'] / 1e6:>12.2f}")
    for name, v in ratios.items():
        print(f"{name:<30} {'n/a' if v is None else f'{v:.2f}x'}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=2, sort_keys=True))
    return out


def _version(mod: str) -> str | None:
    try:
        from importlib.metadata import version

        return version({"fbgemm_gpu": "fbgemm-gpu-cpu"}.get(mod, mod))
    except Exception:
        return None


if __name__ == "__main__":
    main()
