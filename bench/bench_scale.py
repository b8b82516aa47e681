"""The SSD tier at scale: a long run over a table far larger than memory, and its I/O rates.

Two parts, one JSON:

- ``run``: training steps (lookup + RowWiseAdagrad update of every distinct id of a batch)
  over a table of ``--ids`` ids at ``--dim``, each batch ``--batch`` ids of which half are
  new (uniform over the table) and half hot (Zipf 1.05 over the first 1M ids), until
  ``--rows`` distinct rows were touched; a checkpoint every ``--checkpoint-every`` steps,
  each after a flush 2, 8, 32, 128 steps before it or none (cycling), so that they write
  different numbers of rows.  Sampled each step: RSS, anonymous RSS, steps/s, rows stored, the SSD
  index's bytes; per checkpoint: seconds and rows written; at the end, the store opened
  again in a child process: seconds and peak anonymous RSS.
- ``io``: on a table of ``--io-rows`` rows at dim 64 (rows only, SGD), side by side in one
  run: SSD-tier reads of 65,536 distinct random rows (page cache warm) against
  ``numpy.memmap`` fancy indexing of the same rows and a py-lmdb ``get`` loop over the
  same rows stored one record per id; with the page cache dropped (root only), against
  the disk's own 4 KiB random-read rate (``os.pread`` loop); bulk ``write`` + checkpoint
  rows/s, and checkpoints of a quarter of the rows and of all of them, all dirty in DDR,
  against the disk's sequential write rate (a file of the same bytes, fdatasync),
  alternating, three of ours, medians compared, each write from the same state of
  free memory: *warm*, into pages a write deleted just before freed, and for the bulk
  write and the checkpoint of every row also *cold*, after ``--idle`` seconds idle (a
  virtual machine that gives freed memory back to its host runs a write at a fraction
  of the rate then: :func:`_settle`);
  ``tiered-emb export`` and ``import`` of the whole table, rows/s.

Medians over repeats.  Run from the repository root::

    python bench/bench_scale.py --json bench/results/scale.json --plot docs/img/scale.png

(defaults: 1,000,000,000 ids, 100M rows touched, dim 16, batches of 65,536, a checkpoint
every 400 steps; ``--quick`` for a minute-long check).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import lmdb
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine

from tiered_emb import SGD, RowWiseAdagrad, TableConfig, TierConfig, TieredStore


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))


#: Steps before each checkpoint at which a flush writes the dirty rows (cycling; None: no flush).
FLUSH_BEFORE = (2, 8, 32, 128, None)


def run_part(path: Path, args) -> dict:
    """The long run: what memory, speed and checkpoints do as the table fills."""
    table = TableConfig("t", dim=args.dim, num_rows=args.ids, optimizer=RowWiseAdagrad(lr=0.05))
    tiers = TierConfig(hbm_rows=args.hbm_rows, ddr_rows=args.ddr_rows, device="cpu", budget_bytes=args.budget)
    store = TieredStore.create(path, [table], tiers, seed=1)
    reference = _Reference(path.with_name(path.name + "_reference"), args)
    rng = np.random.default_rng(0)
    hot = np.arange(1, 1 << 20, dtype=np.float64) ** -1.05
    hot_cdf = np.cumsum(hot) / hot.sum()
    samples, checkpoints, touched, t0, step = [], [], 0, time.perf_counter(), 0
    drift: list[tuple[int, float]] = []  # (samples before it, a reference step's seconds)
    seen_bits = np.zeros((args.ids + 7) // 8, dtype=np.uint8)
    while touched < args.rows:
        half = args.batch // 2
        ids = np.concatenate(
            [rng.integers(0, args.ids, half), np.searchsorted(hot_cdf, rng.random(args.batch - half))]
        ).astype(np.int64)
        uids = np.unique(ids)
        grads = rng.standard_normal((uids.shape[0], args.dim), dtype=np.float32)
        s = time.perf_counter()
        store.apply_gradients("t", uids, grads)
        step_s = time.perf_counter() - s
        if step % args.reference_every == 0 and not store.engine.ssd.writing:
            drift += [(step, x) for x in reference.times(2)]
        byte, bit = uids >> 3, (uids & 7).astype(np.uint8)
        new = (seen_bits[byte] >> bit) & 1 == 0
        touched += int(np.unique(uids[new]).shape[0])
        np.bitwise_or.at(seen_bits, byte, np.left_shift(np.uint8(1), bit))
        step += 1
        ck = None
        # Checkpoints every `checkpoint_every` steps; before each, a flush FLUSH_BEFORE[i] steps
        # earlier (cycling) makes it write only what changed since: sizes that differ, to show
        # the time against the rows written.
        lead = FLUSH_BEFORE[len(checkpoints) % len(FLUSH_BEFORE)]
        if lead and step % args.checkpoint_every == args.checkpoint_every - lead:
            store.flush()
        if step % args.checkpoint_every == 0:
            s = time.perf_counter()
            store.checkpoint()
            rows = store.engine.last_checkpoint_rows
            ck = {
                "step": step,
                "seconds": time.perf_counter() - s,
                "rows_written": rows,
            }
            checkpoints.append(ck)
        st = store.stats()["t"]["ssd"]
        samples.append(
            {
                "t": time.perf_counter() - t0,
                "step": step,
                "step_s": step_s,
                "touched": touched,
                "rows_stored": st["rows"],
                "copies_stored": st["stored_rows"],
                "rss": _status("VmRSS"),
                "rss_anon": _status("RssAnon"),
                "index_bytes": store.engine.ssd.index_bytes(),
                "disk_bytes": store.engine.disk_bytes(),
            }
        )
        if step % 50 == 0:
            print(
                f"step {step}: {touched:,} rows touched, {step_s * 1e3:.0f} ms/step, "
                f"anon {samples[-1]['rss_anon'] / 2**30:.2f} GiB",
                flush=True,
            )
        if ck:
            print(f"checkpoint at step {step}: {ck['seconds']:.2f} s, {ck['rows_written']:,} rows", flush=True)
    s = time.perf_counter()
    store.checkpoint()
    checkpoints.append(
        {"step": step, "seconds": time.perf_counter() - s, "rows_written": store.engine.last_checkpoint_rows}
    )
    store.close()
    reference.close()
    reopen = _reopen(path, tiers)
    print(f"reopened in {reopen['seconds']:.1f} s, peak anonymous RSS {reopen['peak_rss_anon'] / 2**30:.2f} GiB")
    return {
        "samples": samples,
        "checkpoints": checkpoints,
        "steps": step,
        "reference": drift,
        **growth(samples, checkpoints, drift),
        "peak_rss_anon": max(x["rss_anon"] for x in samples),
        "final_index_bytes_per_row": samples[-1]["index_bytes"] / max(1, samples[-1]["rows_stored"]),
        "reopen": reopen,
    }


class _Reference:
    """The machine's own drift, measured beside the run: a step of the same batch size on a
    table held whole in memory (1M rows, the run's dim and optimizer), two timed every
    ``--reference-every`` steps of the run when the store has no write-back in flight, so
    that they see what else runs on the machine and none of the store's own work.  Its rows
    are all made before the run, so that its steps are alike from the first; its batches
    come from a generator of their own: the run's batches are those of a run without it."""

    def __init__(self, path: Path, args):
        rows = 1 << 20
        table = TableConfig("t", dim=args.dim, num_rows=rows, optimizer=RowWiseAdagrad(lr=0.05))
        tiers = TierConfig(hbm_rows=rows, ddr_rows=1024, device="cpu", budget_bytes=args.budget)
        self.path, self.rows, self.batch, self.dim = path, rows, args.batch, args.dim
        self.store = TieredStore.create(path, [table], tiers, seed=1)
        self.rng = np.random.default_rng(1)
        for a in range(0, rows, self.batch):  # every row made once, then steps as timed: steady from the first
            ids = np.arange(a, min(rows, a + self.batch))
            self.store.apply_gradients("t", ids, np.zeros((ids.shape[0], self.dim), dtype=np.float32))
        self.times(9)

    def times(self, steps: int) -> list[float]:
        """Seconds of each of ``steps`` steps."""
        times = []
        for _ in range(steps):
            uids = np.unique(self.rng.integers(0, self.rows, self.batch))
            grads = self.rng.standard_normal((uids.shape[0], self.dim), dtype=np.float32)
            s = time.perf_counter()
            self.store.apply_gradients("t", uids, grads)
            times.append(time.perf_counter() - s)
        return times

    def close(self) -> None:
        self.store.close(checkpoint=False)
        shutil.rmtree(self.path)  # (made by __init__)


def growth(samples: list[dict], checkpoints: list[dict], drift: list[tuple[int, float]]) -> dict:
    """The last tenth's median step time against the first tenth's after warm-up (the second
    tenth), and the same for two tenths that each begin just after a checkpoint; each also
    divided by the same ratio of the :class:`_Reference` steps timed within those tenths
    (``drift``: ``(samples before it, seconds)``), the machine's own drift between them.

    Steps after a checkpoint (or a flush) evict clean rows, which are dropped, and get
    slower as rows turn dirty and each eviction is written back: a tenth of the run
    (318 steps at the defaults) and the cycle of checkpoints (400) do not line up, so
    the plain tenths hold different shares of clean and dirty steps.  The second ratio
    compares tenths in the same place of the cycle: what is left is the store's size."""
    n = len(samples)
    tenth = max(1, n // 10)
    step_s = [x["step_s"] for x in samples]

    def ratio(warm: int, last: int, key: str) -> dict:  # (tenths from sample `warm` and `last`)
        out = {key: statistics.median(step_s[last : last + tenth]) / statistics.median(step_s[warm : warm + tenth])}
        ref = [[x for s, x in drift if a <= s < a + tenth] for a in (warm, last)]
        if all(len(r) >= 3 for r in ref):
            out["reference_" + key] = statistics.median(ref[1]) / statistics.median(ref[0])
            out[key + "_over_reference"] = out[key] / out["reference_" + key]
            out["reference_samples_" + key] = [len(r) for r in ref]
        return out

    out = ratio(tenth, n - tenth, "last_tenth_vs_warm_tenth")
    starts = [c["step"] for c in checkpoints if tenth <= c["step"] and c["step"] + tenth <= n]
    if starts:
        out["same_phase_steps"] = [starts[0], starts[-1], tenth]
        out.update(ratio(starts[0], starts[-1], "last_vs_warm_same_phase"))
    return out


_REOPEN = r"""
import json, sys, time
from tiered_emb import TierConfig, TieredStore
from tiered_emb.testing import AnonPeak

memory = AnonPeak(every=0.005)
tiers = TierConfig(**json.loads(sys.argv[2]))
s = time.perf_counter()
store = TieredStore.open(sys.argv[1], tiers)
took = time.perf_counter() - s
out = {"seconds": took, "peak_rss_anon": memory.peak(), "index_bytes": store.engine.ssd.index_bytes()}
store.close(checkpoint=False)
print(json.dumps(out))
"""


def _reopen(path: Path, tiers: TierConfig) -> dict:
    """Open the store again in a child process: seconds, and its peak anonymous RSS (sampled)."""
    conf = {"hbm_rows": tiers.hbm_rows, "ddr_rows": tiers.ddr_rows, "device": "cpu", "budget_bytes": tiers.budget_bytes}
    out = subprocess.run(
        [sys.executable, "-c", _REOPEN, str(path), json.dumps(conf)], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def _disk_seq_write(path: Path, nbytes: int) -> float:
    """Bytes/s of a sequential write of ``nbytes`` with fdatasync (as ``dd ... conv=fdatasync``)."""
    block = np.ones(4 << 20, dtype=np.uint8).tobytes()
    s = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(max(1, nbytes // len(block))):
            f.write(block)
        f.flush()
        os.fdatasync(f.fileno())
    rate = max(1, nbytes // len(block)) * len(block) / (time.perf_counter() - s)
    path.unlink()
    return rate


def _drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def _settle(path: Path, nbytes: int, idle_s: float | None) -> None:
    """Put the machine's free memory in the state each timed write starts from, the same for
    ours and the disk's.  A virtual machine that gives freed memory back to its host (here:
    virtio-balloon free page reporting, after a page stays free a few seconds) pays a fault
    on the host the first time a page is used again: a write into pages freed just before
    ran at 1.3-2.2 GB/s, the same write after 10 s idle at 400 MB/s.  ``idle_s`` None
    (warm): a write of ``nbytes`` deleted just before, whose pages the timed write reuses;
    else (cold): ``idle_s`` seconds idle, every free page given back (as ``dd`` on an idle
    machine)."""
    if idle_s is None:
        _disk_seq_write(path / "primer.bin", nbytes)
    else:
        time.sleep(idle_s)


def _paired(prepare, path: Path, nbytes: int, idle_s: float | None, reps: int = 3) -> tuple[list, list]:
    """Rows/s of ``reps`` of ours and bytes/s of ``reps + 1`` of the disk's writes of ``nbytes``
    (fdatasync), alternating, each from the same state of memory (:func:`_settle`) after
    its own set-up: ``prepare(rep)`` builds a store and returns the timed part, which
    returns rows/s."""
    disks, ours = [], []
    for rep in range(reps + 1):
        _settle(path, nbytes, idle_s)
        disks.append(_disk_seq_write(path / "seq.bin", nbytes))
        if rep < reps:
            timed = prepare(rep)
            _settle(path, nbytes, idle_s)
            ours.append(timed())
    return ours, disks


def _checkpoint_of_dirty(path: Path, table: TableConfig, data: np.ndarray, k: int, budget: int):
    """A store whose rows are all dirty in DDR (trained, none written yet); the timed part
    checkpoints them (rows/s) and deletes the store."""
    n = data.shape[0]
    tiers = TierConfig(hbm_rows=k, ddr_rows=n, device="cpu", budget_bytes=budget)
    store = TieredStore.create(path, [table], tiers, seed=1)
    for a in range(0, n, k):
        store.apply_gradients("t", np.arange(a, min(n, a + k)), data[a : a + k])

    def timed() -> float:
        s = time.perf_counter()
        store.checkpoint()
        rate = store.engine.last_checkpoint_rows / (time.perf_counter() - s)
        store.close()
        shutil.rmtree(path)
        return rate

    return timed


def _compared(out: dict, key: str, ours: list, disks: list, row_bytes: int) -> None:
    """``out[key]``: ours (rows/s) and the disk's (MB/s), each run and medians, and the ratio
    of the bytes of the medians."""
    out[key] = {
        "rows_per_s": statistics.median(ours),
        "rows_per_s_each": ours,
        "disk_MBps": statistics.median(disks) / 1e6,
        "disk_MBps_each": [d / 1e6 for d in disks],
        "vs_disk": statistics.median(ours) * row_bytes / statistics.median(disks),
    }


def io_part(path: Path, args) -> dict:
    """Read, write and checkpoint rates of the SSD tier against the plain peers, same rows."""
    rows, dim, k = args.io_rows, 64, 65536
    table = TableConfig("t", dim=dim, num_rows=rows, optimizer=SGD(lr=0.1))
    tiers = TierConfig(hbm_rows=k, device="cpu", budget_bytes=args.budget)
    data = np.random.default_rng(1).standard_normal((rows, dim), dtype=np.float32)
    out: dict = {"rows": rows, "dim": dim, "batch": k, "cold_idle_s": args.idle}
    warm = TieredStore.create(path / "warm", [table], tiers, seed=1)  # (compiles what a bulk write runs)
    warm.write("t", np.arange(4 * k), data[: 4 * k])
    warm.close()
    # Each of ours against the disk's write of the same bytes (a row's bytes: its 64 float32;
    # a segment also holds its id and checksum), alternating, from the same state of memory.
    nbytes, ck_rows = rows * dim * 4, rows // 4

    def bulk(rep: int, name: str = "w"):
        """A new store; the timed part writes every row in bulk and checkpoints (rows/s).
        The first warm one is kept for the reads below."""
        store = TieredStore.create(path / f"{name}{rep}", [table], tiers, seed=1)

        def timed() -> float:
            s = time.perf_counter()
            for a in range(0, rows, 4 * k):  # bulk writes of 4x HBM: straight to LMDB
                store.write("t", np.arange(a, min(rows, a + 4 * k)), data[a : a + 4 * k])
            store.checkpoint()
            rate = rows / (time.perf_counter() - s)
            out["checkpoint_rows_written"] = store.engine.last_checkpoint_rows
            store.close()
            if rep or name != "w":
                shutil.rmtree(path / f"{name}{rep}")
            return rate

        return timed

    _compared(out, "bulk_write", *_paired(bulk, path, nbytes, None), dim * 4)
    if args.idle:
        cold = _paired(lambda rep: bulk(rep, "cold"), path, nbytes, args.idle)
        _compared(out, "bulk_write_cold", *cold, dim * 4)

    def quarter(rep: int):
        return _checkpoint_of_dirty(path / f"c{rep}", table, data[:ck_rows], k, args.budget)

    def every(rep: int):
        return _checkpoint_of_dirty(path / f"c{rep}", table, data, k, args.budget)

    _compared(out, "checkpoint_quarter", *_paired(quarter, path, ck_rows * dim * 4, None), dim * 4)
    _compared(out, "checkpoint_all", *_paired(every, path, nbytes, None), dim * 4)
    if args.idle:
        _compared(out, "checkpoint_all_cold", *_paired(every, path, nbytes, args.idle), dim * 4)
    store = TieredStore.open(path / "w0", tiers)
    mm_path = path / "table.npy"
    np.save(mm_path, data)
    mm = np.load(mm_path, mmap_mode="r")
    env = lmdb.open(str(path / "records"), map_size=1 << 36, readahead=False)
    with env.begin(write=True) as txn, txn.cursor() as cur:
        cur.putmulti(zip(np.arange(rows).astype(">i8").view("V8").tolist(), [r.tobytes() for r in data], strict=False))
    rng = np.random.default_rng(2)
    ssd = store.engine.ssd
    res: dict = {"ours": [], "memmap": [], "lmdb_get": []}
    for rep in range(args.repeats + 1):
        ids = np.sort(rng.choice(rows, k, replace=False)).astype(np.int64)
        got = np.empty((k, dim), dtype=np.float32)
        s = time.perf_counter()
        ssd.read("t", ids, got)
        t_ours = time.perf_counter() - s
        s = time.perf_counter()
        want = mm[ids]
        t_mm = time.perf_counter() - s
        s = time.perf_counter()
        with env.begin(buffers=True) as txn:
            keys = ids.astype(">i8").view("V8").tolist()
            vals = [txn.get(key) for key in keys]
        t_get = time.perf_counter() - s
        assert np.array_equal(got, want) and len(vals) == k
        if rep:  # the first: warm-up
            res["ours"].append(k / t_ours)
            res["memmap"].append(k / t_mm)
            res["lmdb_get"].append(k / t_get)
    out["warm_rows_per_s"] = {n: statistics.median(v) for n, v in res.items()}
    out["warm_ours_vs_memmap"] = out["warm_rows_per_s"]["ours"] / out["warm_rows_per_s"]["memmap"]
    if _drop_caches():
        ids = np.sort(rng.choice(rows, k, replace=False)).astype(np.int64)
        s = time.perf_counter()
        ssd.read("t", ids, np.empty((k, dim), dtype=np.float32))
        cold = k / (time.perf_counter() - s)
        _drop_caches()
        fd = os.open(mm_path, os.O_RDONLY)
        size = os.fstat(fd).st_size
        offs = rng.integers(0, size // 4096, k) * 4096
        s = time.perf_counter()
        for o in offs.tolist():
            os.pread(fd, 4096, o)
        disk_reads = k / (time.perf_counter() - s)
        os.close(fd)
        out["cold"] = {"ours_rows_per_s": cold, "disk_4k_reads_per_s": disk_reads, "ratio": cold / disk_reads}
    else:
        out["cold"] = "not measured: /proc/sys/vm/drop_caches is not writable here"
    env.close()
    store.close()
    from tiered_emb.apps.portable import export_store, import_store

    s = time.perf_counter()
    export_store(path / "w0", path / "export")
    out["export_rows_per_s"] = rows / (time.perf_counter() - s)
    s = time.perf_counter()
    import_store(path / "export", path / "imported", tiers)
    out["import_rows_per_s"] = rows / (time.perf_counter() - s)
    return out


def _plot(result: dict, png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = result["run"]["samples"]
    t = [x["t"] / 60 for x in xs]
    fig, ax = plt.subplots(2, 2, figsize=(11, 7))
    ax[0, 0].plot(t, [x["rss_anon"] / 2**30 for x in xs], label="anonymous RSS")
    ax[0, 0].plot(t, [x["index_bytes"] / 2**30 for x in xs], label="SSD index")
    ax[0, 0].set_ylabel("GiB")
    ax[0, 0].legend()
    ax[0, 1].plot(t, [x["step_s"] * 1e3 for x in xs], lw=0.5)
    ax[0, 1].set_ylabel("ms / step")
    ax[1, 0].plot(t, [x["rows_stored"] / 1e6 for x in xs])
    ax[1, 0].set_ylabel("rows stored (M)")
    cks = result["run"]["checkpoints"]
    ax[1, 1].scatter([c["rows_written"] / 1e6 for c in cks], [c["seconds"] for c in cks])
    ax[1, 1].set_xlabel("rows written by the checkpoint (M)")
    ax[1, 1].set_ylabel("checkpoint s")
    for a in ax[:, 0].tolist() + [ax[0, 1]]:
        a.set_xlabel("minutes")
    fig.tight_layout()
    fig.savefig(png, dpi=90)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ids", type=int, default=1_000_000_000)
    p.add_argument("--rows", type=int, default=100_000_000, help="distinct rows to touch (default 100M)")
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--batch", type=int, default=65536)
    p.add_argument("--hbm-rows", type=int, default=1 << 20)
    p.add_argument("--ddr-rows", type=int, default=4 << 20)
    p.add_argument("--budget", type=int, default=256 << 20, help="TierConfig.budget_bytes")
    p.add_argument("--checkpoint-every", type=int, default=400, help="steps")
    p.add_argument("--reference-every", type=int, default=8, help="steps between timings of the reference")
    p.add_argument("--io-rows", type=int, default=4_000_000)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument(
        "--idle", type=float, default=15.0, help="seconds idle before each cold write (memory given back); 0: none"
    )
    p.add_argument("--part", choices=["run", "io", "both"], default="both")
    p.add_argument("--quick", action="store_true", help="a minute-long check of every part")
    p.add_argument("--dir", default=None, help="where the stores go (default: a temporary directory)")
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None)
    args = p.parse_args()
    if args.quick:
        args.ids, args.rows, args.hbm_rows, args.ddr_rows = 10_000_000, 1_000_000, 1 << 16, 1 << 18
        args.checkpoint_every, args.io_rows, args.repeats, args.reference_every = 5, 500_000, 3, 1
        args.idle = 0.5
    if args.dir:
        Path(args.dir).mkdir(parents=True, exist_ok=True)
    base = Path(tempfile.mkdtemp(prefix="bench_scale_", dir=args.dir))
    result: dict = {"machine": machine(), "args": vars(args)}
    try:
        if args.part in ("io", "both"):
            result["io"] = io_part(base / "io", args) if (base / "io").mkdir() is None else None
            print(json.dumps(result["io"], indent=1))
        if args.part in ("run", "both"):
            result["run"] = run_part(base / "run", args)
            r = result["run"]
            print(
                f"run: {r['steps']} steps; last tenth / warm tenth = {r['last_tenth_vs_warm_tenth']:.2f} "
                f"(in the same place of the checkpoint cycle: {r.get('last_vs_warm_same_phase', float('nan')):.2f}); "
                f"over the reference's drift: {r.get('last_tenth_vs_warm_tenth_over_reference', float('nan')):.2f} "
                f"({r.get('last_vs_warm_same_phase_over_reference', float('nan')):.2f}); "
                f"peak anonymous RSS {r['peak_rss_anon'] / 2**30:.2f} GiB; "
                f"index {r['final_index_bytes_per_row']:.1f} B/row"
            )
    finally:
        shutil.rmtree(base, ignore_errors=True)  # (a directory of its own, made above)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    if args.plot and "run" in result:
        _plot(result, args.plot)


if __name__ == "__main__":
    main()
