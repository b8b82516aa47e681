"""What trusting the bytes costs: checksums on SSD-tier reads, and readers beside a writer.

Two parts, one JSON:

- ``checksums``: warm SSD-tier reads (page cache warm) of ``--batch`` distinct random rows
  of a table of ``--rows`` rows at ``--dim``, every row checked against its checksum, and
  the same reads with the check off (``SegmentLog.check_sums``), interleaved; medians over
  ``--repeats``.  The cost is ``1 - checked / unchecked`` of the rows/s.
- ``readers``: a writer trains (lookup + RowWiseAdagrad update of ``--batch`` Zipf ids per
  step over ``--rows`` ids, HBM a tenth of the table, a checkpoint every
  ``--checkpoint-every`` steps) for ``--steps`` steps, alone and then with ``--readers``
  reader processes beside it (``TieredStore.open(path, mode="r")``: each looks up
  ``--reader-batch`` random ids, ``--reader-pause`` seconds between lookups, and refreshes
  to the newest checkpoint every ``--reader-refresh-every`` lookups; a refresh reads the
  segments written or rewritten since its snapshot).  Reported: the writer's steps/s in both
  runs and their ratio, the readers' lookups/s and rows/s, and the share of a core each
  reader took.  Readers and writer share the machine's cores, so a third run is the
  control: as many processes that take the same share of a core each (working while behind
  it, else asleep) and touch no store.  The writer's ratio beside them is what sharing the
  cores costs; beside the readers, what sharing the cores and the store costs.

Run from the repository root::

    python bench/bench_reliability.py --json bench/results/reliability.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine

from tiered_emb import SGD, RowWiseAdagrad, TableConfig, TierConfig, TieredStore

READER = """
import json, sys, time
import numpy as np
from tiered_emb import TieredStore
path, stop, out, batch, pause = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), float(sys.argv[5])
rng, refresh_every = np.random.default_rng(int(sys.argv[6])), int(sys.argv[7])
with TieredStore.open(path, mode="r") as r:
    size = r.table_config("t").num_rows
    r.lookup("t", rng.integers(0, size, batch))  # (compiles)
    open(out + ".ready", "w").close()
    n, rows, t0, c0 = 0, 0, time.perf_counter(), time.process_time()
    while not __import__("os").path.exists(stop):
        if n % refresh_every == 0:
            r.refresh()
        r.lookup("t", rng.integers(0, size, batch))
        n, rows = n + 1, rows + batch
        time.sleep(pause)
seconds = time.perf_counter() - t0
cpu = time.process_time() - c0
open(out, "w").write(json.dumps({"lookups": n, "rows": rows, "seconds": seconds, "cpu_share": cpu / seconds}))
"""

# the control: a process that takes ``share`` of a core (it works while its CPU time is behind
# ``share`` of the time gone, else sleeps 1 ms) and touches no store, so the writer shares
# the cores as it does with a reader
BURNER = """
import json, os, sys, time
import numpy as np
stop, out, share = sys.argv[1], sys.argv[2], float(sys.argv[3])
a = np.random.default_rng(0).standard_normal((64, 64))
open(out + ".ready", "w").close()
t0, c0 = time.perf_counter(), time.process_time()
n = 0
while n % 64 or not os.path.exists(stop):
    n += 1
    if time.process_time() - c0 < share * (time.perf_counter() - t0):
        a = np.tanh(a @ a.T / 64)  # (behind its share: work)
    else:
        time.sleep(0.001)
seconds = time.perf_counter() - t0
open(out, "w").write(json.dumps({"seconds": seconds, "cpu_share": (time.process_time() - c0) / seconds}))
"""


def checksums(path: Path, args) -> dict:
    table = TableConfig("t", dim=args.dim, num_rows=args.rows, optimizer=SGD(lr=0.1))
    tiers = TierConfig(hbm_rows=args.batch, device="cpu")
    data = np.random.default_rng(1).standard_normal((args.rows, args.dim), dtype=np.float32)
    with TieredStore.create(path / "sums", [table], tiers, seed=1) as s:
        for a in range(0, args.rows, 4 * args.batch):
            s.write("t", np.arange(a, min(args.rows, a + 4 * args.batch)), data[a : a + 4 * args.batch])
    store = TieredStore.open(path / "sums")
    rng = np.random.default_rng(2)
    rates: dict = {"checked": [], "unchecked": []}
    for rep in range(args.repeats + 1):
        ids = np.sort(rng.choice(args.rows, args.batch, replace=False)).astype(np.int64)
        for mode in ("checked", "unchecked") if rep % 2 else ("unchecked", "checked"):
            store.engine.ssd.segments.check_sums = mode == "checked"
            got = np.empty((args.batch, args.dim), dtype=np.float32)
            s = time.perf_counter()
            store.engine.ssd.read("t", ids, got)
            took = time.perf_counter() - s
            assert np.array_equal(got, data[ids])
            if rep:
                rates[mode].append(args.batch / took)
    store.engine.ssd.segments.check_sums = True
    store.close()
    med = {m: statistics.median(v) for m, v in rates.items()}
    return {"rows_per_s": med, "cost": 1 - med["checked"] / med["unchecked"], "rows": args.rows, "dim": args.dim}


def _train(path: Path, args, readers: int, burn: float | None = None) -> dict:
    """The writer's run with ``readers`` reader processes beside it, or (``burn``) as many
    processes that take that share of a core each and touch no store."""
    table = TableConfig("t", dim=args.dim, num_rows=args.rows, optimizer=RowWiseAdagrad(lr=0.05))
    tiers = TierConfig(hbm_rows=args.rows // 10, device="cpu")
    rng = np.random.default_rng(3)
    batches = [np.minimum(rng.zipf(1.05, args.batch) - 1, args.rows - 1) for _ in range(args.steps)]
    grads = rng.standard_normal((args.batch, args.dim)).astype(np.float32)
    store = TieredStore.create(path, [table], tiers, seed=1)
    for ids in batches[:20]:  # warm-up: compiles, fills HBM
        store.lookup("t", ids)
        store.apply_gradients("t", ids, grads)
    store.checkpoint()
    stop = path.parent / f"stop-{readers}"
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    outs = [path.parent / f"reader-{readers}-{k}.json" for k in range(readers)]
    reader = [READER, str(path), str(stop)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", BURNER, str(stop), str(o), str(burn)]
            if burn is not None
            else [sys.executable, "-c", *reader, str(o), str(args.reader_batch), str(args.reader_pause)]
            + [str(k), str(args.reader_refresh_every)],
            env=env if burn is None else dict(env, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1"),
        )
        for k, o in enumerate(outs)
    ]
    while not all(Path(f"{o}.ready").exists() for o in outs):  # (each reader has opened and read once)
        time.sleep(0.1)
    step_s = []
    for i, ids in enumerate(batches):
        s = time.perf_counter()
        store.lookup("t", ids)
        store.apply_gradients("t", ids, grads)
        if (i + 1) % args.checkpoint_every == 0:
            store.checkpoint()
        step_s.append(time.perf_counter() - s)
    stop.touch()
    for p in procs:
        p.wait(timeout=300)
    store.close()
    got = [json.loads(o.read_text()) for o in outs]
    out: dict = {"steps_per_s": len(step_s) / sum(step_s), "median_step_s": statistics.median(step_s)}
    if got:
        out["cpu_share_each"] = statistics.mean(g["cpu_share"] for g in got)
    if got and burn is None:
        out["reader_lookups_per_s"] = sum(g["lookups"] / g["seconds"] for g in got)
        out["reader_rows_per_s"] = sum(g["rows"] / g["seconds"] for g in got)
    return out


def readers_part(path: Path, args) -> dict:
    alone = _train(path / "alone" / "s", args, 0)
    beside = _train(path / "beside" / "s", args, args.readers)
    control = _train(path / "control" / "s", args, args.readers, burn=beside["cpu_share_each"])
    return {
        "alone": alone,
        "with_readers": beside,
        "with_cpu_burners": control,
        "readers": args.readers,
        "writer_steps_ratio": beside["steps_per_s"] / alone["steps_per_s"],
        "burners_steps_ratio": control["steps_per_s"] / alone["steps_per_s"],
        "cpus": os.cpu_count(),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=2_000_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=65536)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--checkpoint-every", type=int, default=30)
    p.add_argument("--readers", type=int, default=4)
    p.add_argument("--reader-batch", type=int, default=4096)
    p.add_argument("--reader-pause", type=float, default=0.05, help="seconds between a reader's lookups")
    p.add_argument("--reader-refresh-every", type=int, default=20, help="lookups between a reader's refreshes")
    p.add_argument("--part", choices=["checksums", "readers", "both"], default="both")
    p.add_argument("--quick", action="store_true", help="a short check of both parts")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.quick:
        args.rows, args.batch, args.repeats, args.steps, args.checkpoint_every = 200_000, 8192, 3, 40, 10
    result: dict = {"args": vars(args), "machine": machine()}
    with tempfile.TemporaryDirectory() as tmp:
        if args.part in ("checksums", "both"):
            result["checksums"] = checksums(Path(tmp), args)
            print(json.dumps(result["checksums"]))
        if args.part in ("readers", "both"):
            for arm in ("alone", "beside", "control"):
                (Path(tmp) / arm).mkdir()
            result["readers"] = readers_part(Path(tmp), args)
            print(json.dumps(result["readers"]))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
