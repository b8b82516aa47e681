"""The step of a table far larger than memory, with and without a memory limit that
counts page cache (a cgroup, as a container's).

A table of 1e9 ids (dim 16, row-wise Adagrad), HBM 1M + DDR 2M rows, each step a lookup
and an update of 65,536 ids drawn uniformly (nearly all never seen: every step's rows
come up initialised and go down to LMDB dirty).  The run goes once as it is and once
under ``shared/tools/memlimit`` (needs root and a cgroup memory controller), whose limit
is the run's own peak anonymous memory plus ``--headroom-mib`` of page cache; the
headline is the ratio of the last ``--tail`` steps' medians (limited / free).

Command (figures in docs/benchmarks.md and docs/tuning.md)::

    python bench/bench_memlimit.py --json bench/results/memlimit.json

``--limit-mib`` sets the limit itself instead.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, write_json

ROOT = Path(__file__).resolve().parents[1]
MEMLIMIT = ROOT.parent / "shared" / "tools" / "memlimit"


def child(args) -> None:
    """One run: ``--steps`` steps, the seconds of each as JSON on stdout."""
    from tiered_emb import RowWiseAdagrad, TableConfig, TierConfig, TieredStore

    cfg = TableConfig("t", dim=args.dim, num_rows=args.id_space, optimizer=RowWiseAdagrad(lr=0.01))
    tiers = TierConfig(hbm_rows=args.hbm_rows, ddr_rows=args.ddr_rows, device="cpu")
    times = []
    with TieredStore.create(args.child, [cfg], tiers, seed=0) as store:
        for step in range(args.steps):
            ids = np.unique(np.random.default_rng(step).integers(0, args.id_space, args.batch))
            t0 = time.perf_counter()
            rows = store.lookup("t", ids)
            store.apply_gradients("t", ids, rows * np.float32(0.01))
            times.append(time.perf_counter() - t0)
    print(json.dumps(times))


def _run(args, path: Path, limit_mib: int | None) -> dict:
    cmd = [sys.executable, __file__, "--child", str(path), *_shape(args)]
    if limit_mib is not None:
        cmd = [sys.executable, str(args.memlimit), str(limit_mib), "--", *cmd]
    else:
        cmd = [sys.executable, str(args.memlimit), str(1 << 20), "--", *cmd]  # no real limit: the peaks alone
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    shutil.rmtree(path, ignore_errors=True)
    tail = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else ""
    if done.returncode != 0:
        return {"limit_mib": limit_mib, "failed": done.returncode, "memlimit": tail}
    times = json.loads(done.stdout.strip().splitlines()[-1])
    peak = re.search(r"peak anon (\d+) MiB", tail)
    return {
        "limit_mib": limit_mib,
        "step_s": times,
        "tail_median_s": float(np.median(times[-args.tail :])),
        "peak_anon_mib": int(peak.group(1)) if peak else None,
        "memlimit": tail,
    }


def _shape(args) -> list[str]:
    return [
        f"--{k.replace('_', '-')}={getattr(args, k)}"
        for k in ("steps", "batch", "dim", "id_space", "hbm_rows", "ddr_rows")
    ]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--tail", type=int, default=50, help="last steps whose median is compared")
    p.add_argument("--batch", type=int, default=65_536)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--id-space", type=int, default=1_000_000_000)
    p.add_argument("--hbm-rows", type=int, default=1_000_000)
    p.add_argument("--ddr-rows", type=int, default=2_000_000)
    p.add_argument("--headroom-mib", type=int, default=160, help="page cache beyond the free run's peak")
    p.add_argument("--limit-mib", type=int, default=None)
    p.add_argument("--memlimit", type=Path, default=MEMLIMIT)
    p.add_argument("--json", default="bench/results/memlimit.json")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(args)
        return {}
    tmp = Path(tempfile.mkdtemp(prefix="bench_memlimit_"))
    try:
        free = _run(args, tmp / "free", None)
        if "failed" in free:  # (no memlimit here, or no cgroup: nothing to compare)
            limited = {"limit_mib": args.limit_mib, "failed": "not run", "memlimit": "the free run failed"}
        else:
            limit = args.limit_mib or (free["peak_anon_mib"] or 0) + args.headroom_mib
            limited = _run(args, tmp / "limited", limit)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    both = "tail_median_s" in limited and "tail_median_s" in free
    ratio = limited["tail_median_s"] / free["tail_median_s"] if both else None
    out = {
        "benchmark": "memlimit",
        "command": "python bench/bench_memlimit.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "config": {k: str(v) for k, v in vars(args).items()},
        "machine": machine(),
        "free": free,
        "limited": limited,
        "limited_over_free": ratio,
    }
    for name, r in (("free", free), ("limited", limited)):
        if "tail_median_s" in r:
            print(f"{name:<8} limit {r['limit_mib']} MiB: last {args.tail} steps {1e3 * r['tail_median_s']:.0f} ms")
        print(f"         {r['memlimit']}")
    print(f"limited / free: {ratio:.2f}x" if ratio else "limited run failed")
    if args.json:
        write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
