"""The life of rows and of a run: what admission and expiry keep on disk, what they cost a step,
and what admission and a learning-rate schedule do to the DLRM job's held-out AUC.

1. **A stream whose head moves**: each step draws ``--batch`` ids Zipf(``--alpha``) over a
   window of ``--window`` ids that slides ``--shift`` ids a step, so new ids keep arriving
   and old ones stop.  One table (``--dim``, RowWiseAdagrad) over HBM + DDR much smaller
   than what the stream touches, a checkpoint every ``--every`` steps.  Runs:

   - ``plain``: every id trained and kept;
   - ``admit2`` / ``admit5``: ``min_count`` 2 and 5;
   - ``expire`` / ``expire_admit2``: ``ttl_steps`` ``--ttl`` (and ``min_count`` 2), with
     ``store.engine.ssd.purge`` of the table every fourth checkpoint (stale copies and the
     tombstones nothing needs any more out of the segments).

   For each, at each checkpoint: the live rows in LMDB (``stored_ids``), the ids its
   index holds (``stats()["ssd"]["rows"]``: tombstones too), every copy the segments hold
   (stale ones too) and the files' bytes; and the median step time, admission's beside ``plain``'s (target: under
   10 % more).
2. **The DLRM job** (``tiered-emb train``, in-process): held-out AUC and log loss with
   ``--min-count`` 1, 2 and 5, and with ``--lr-schedule cosine --warmup-steps 20``.

Writes JSON (``--json``) and a plot of rows on disk against steps (``--plot``).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, median, write_json

from tiered_emb import RowWiseAdagrad, TableConfig, TierConfig, TieredStore

#: run -> (min_count, expires)
RUNS = {
    "plain": (1, False),
    "admit2": (2, False),
    "admit5": (5, False),
    "expire": (1, True),
    "expire_admit2": (2, True),
}


def _batch(step: int, args) -> np.ndarray:
    """Step ``step``'s ids: Zipf over the window that starts at ``step * shift``, its newest ids the
    hottest (an id cools as the window moves on, then leaves it); a pure function of the step."""
    rng = np.random.default_rng(step)
    rank = (rng.zipf(args.alpha, args.batch) - 1) % args.window
    return step * args.shift + (args.window - 1 - rank)


def _stream(name: str, args, root: Path) -> dict:
    min_count, expires = RUNS[name]
    ttl = args.ttl if expires else None
    cfg = TableConfig("t", args.dim, None, optimizer=RowWiseAdagrad(lr=0.05), min_count=min_count, ttl_steps=ttl)
    tiers = TierConfig(hbm_rows=args.hbm_rows, ddr_rows=args.ddr_rows, device="cpu")
    store = TieredStore.create(root / name, [cfg], tiers, seed=0)
    rng = np.random.default_rng(0)
    grads = rng.normal(0.0, 1.0, (args.batch, args.dim)).astype(np.float32)
    step_s, points = [], []
    for step in range(args.steps):
        ids = _batch(step, args)
        t0 = time.perf_counter()
        store.apply_gradients("t", ids, grads)
        store.advance_step()
        step_s.append(time.perf_counter() - t0)
        if (step + 1) % args.every == 0:
            if expires and (step + 1) % (4 * args.every) == 0:
                with store.engine.lock:
                    store.engine.ssd.purge(["t"])
            store.checkpoint()
            ssd = store.stats()["t"]["ssd"]
            _, chunks = store.engine.ssd.stored_ids("t")  # (reads each row: deleted ones are skipped)
            points.append(
                {
                    "step": step + 1,
                    "live_rows": sum(c.shape[0] for c in chunks),
                    "rows": int(ssd["rows"]),
                    "stored_rows": int(store.engine.ssd.table_stats("t")["stored_rows"]),
                    "file_bytes": store.engine.disk_bytes(),
                }
            )
    store.close()
    return {"min_count": min_count, "ttl_steps": ttl, "step_s_median": median(step_s[args.every :]), "points": points}


def _dlrm(args, root: Path) -> dict:
    from tiered_emb.cli import main as cli

    runs = {
        "constant": [],
        "min_count2": ["--min-count", "2"],
        "min_count5": ["--min-count", "5"],
        "cosine_warmup": ["--lr-schedule", "cosine", "--warmup-steps", "20"],
    }
    out = {}
    for name, flags in runs.items():
        run = root / f"dlrm_{name}"
        shape = ["--steps", str(args.dlrm_steps), "--batch", str(args.dlrm_batch), "--rows", str(args.dlrm_rows)]
        cli(["train", "--run-dir", str(run), "--quiet", *shape, *flags])
        r = json.loads((run / "report.json").read_text())
        out[name] = {
            k: r[k] for k in ("test_auc", "test_logloss", "train_auc", "samples_per_s", "lr_final", "lmdb_file_bytes")
        }
        out[name]["flags"] = flags
    return out


def _plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(10, 3.6))
    for name, run in result["stream"].items():
        steps = [p["step"] for p in run["points"]]
        ax[0].plot(steps, [p["live_rows"] for p in run["points"]], label=name)
        ax[1].plot(steps, [p["file_bytes"] / 2**20 for p in run["points"]], label=name)
    ax[0].set(xlabel="step", ylabel="live rows in LMDB", title="rows kept")
    ax[1].set(xlabel="step", ylabel="data.mdb + lock (MiB)", title="files")
    ax[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--every", type=int, default=20, help="steps between checkpoints")
    p.add_argument("--batch", type=int, default=8192)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--window", type=int, default=200_000, help="ids the stream draws from at a step")
    p.add_argument("--shift", type=int, default=1000, help="ids the window moves a step")
    p.add_argument("--alpha", type=float, default=1.1)
    p.add_argument("--ttl", type=int, default=100, help="ttl_steps of the expiring runs")
    p.add_argument("--hbm-rows", type=int, default=16_384)
    p.add_argument("--ddr-rows", type=int, default=32_768)
    p.add_argument("--dlrm-steps", type=int, default=200)
    p.add_argument("--dlrm-batch", type=int, default=2048)
    p.add_argument("--dlrm-rows", type=int, default=100_000)
    p.add_argument("--no-dlrm", action="store_true", help="skip the DLRM runs")
    p.add_argument("--json", default="bench/results/lifecycle.json")
    p.add_argument("--plot", default="docs/img/lifecycle.png")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        stream = {name: _stream(name, args, root) for name in RUNS}
        plain = stream["plain"]["step_s_median"]
        result = {
            "machine": machine(),
            "args": vars(args),
            "stream": stream,
            "step_cost": {n: stream[n]["step_s_median"] / plain for n in RUNS if n != "plain"},
            "dlrm": None if args.no_dlrm else _dlrm(args, root),
        }
    write_json(args.json, result)
    if args.plot:
        _plot(result, args.plot)
    for name, run in stream.items():
        last = run["points"][-1]
        print(
            f"{name:8s} step {run['step_s_median'] * 1e3:7.2f} ms  live {last['live_rows']:>9,}  "
            f"indexed {last['rows']:>9,}  "
            f"stored {last['stored_rows']:>9,}  file {last['file_bytes'] / 2**20:7.1f} MiB"
        )
    print("step time over plain:", {k: round(v, 3) for k, v in result["step_cost"].items()})
    if result["dlrm"]:
        for name, r in result["dlrm"].items():
            print(f"dlrm {name:14s} held-out AUC {r['test_auc']:.4f}  log loss {r['test_logloss']:.4f}")
    return result


if __name__ == "__main__":
    main()
