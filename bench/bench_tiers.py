"""A training step taken apart: what each part of moving rows between tiers costs, beside a
memcpy of the same bytes in the same run.

One table (default 1M rows x 64, row-wise Adagrad), a fresh batch of 8,192 bags x 20
Zipf(1.05) ids every step (``TieredEmbeddingBag``: forward, backward, fused update), in
three tier configurations, every row written to the store and every kernel compiled
before timing:

- ``resident``: HBM holds the whole table;
- ``ddr``: HBM 10 % + DDR 90 % (no LMDB read);
- ``lmdb``: HBM 5 % + DDR 5 %, the rest read from LMDB (its pages in the page cache).

``resident`` and ``ddr`` run side by side (``--interleave``): both stores open, their steps
alternating batch by batch, so the machine's slow spells fall on both, and their ratio is
also taken batch by batch (``ddr_vs_resident_paired``, the median of the paired ratios).
The LMDB cases run one after another: their background writes would spill into the
others' steps.

Per configuration: the median step (the ratios' figure) and the mean step, and per part
of the moves (``store.stats()[table]["moves"]``: both indexes probed, HBM's victims
chosen and copied out, DDR's rows taken up, LMDB's read, the initialiser, rows copied up,
victims admitted into DDR, write-backs handed to the SSD tier) its mean time and bytes a
step; the rest of the step (plan, gather, reduce, update, torch) is the mean step less
those parts (the plot).  Beside them, in the same run: a ``memcpy`` of the bytes the step
moved between tiers (one contiguous copy) and a gather-copy of as many rows of the
table's width at random (``numpy.take``).  The headline: the tiered step's
overhead over resident, in units of that memcpy and of that gather.  After the timed
steps, the copies LMDB's segments hold against the live rows (compaction's bound: twice
the live rows, plus the copies the fill's checkpoint still reads); compaction is due
only after ~40 steps of the LMDB case, so its long-run cost needs ``--steps`` of a few
hundred (``--configs lmdb --steps 1000``).

Command (figures in docs/benchmarks.md, plot in docs/img/tiers.png)::

    python bench/bench_tiers.py --json bench/results/tiers.json --plot docs/img/tiers.png

Beside them, the peer a user would write with no cache at all (torch: the table and its
state in host memory, each step's unique rows gathered, sent up, updated and sent back).
``--device cuda`` runs the same on a GPU (HBM in CuPy; the peer's table in pinned memory).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, median, write_json

from tiered_emb import RowWiseAdagrad, TableConfig, TierConfig, TieredStore
from tiered_emb.sim.traces import zipf_ids
from tiered_emb.step.resolve import MOVE_PARTS
from tiered_emb.torch import TieredEmbeddingBag, TrainPipeline

LR, EPS = 0.01, 1e-8


def _batches(args, first_seed: int, count: int) -> list:
    out = []
    for k in range(count):
        ids = torch.from_numpy(zipf_ids(args.rows, args.alpha, args.bags * args.bag_size, seed=first_seed + k))
        offsets = torch.arange(args.bags + 1, dtype=torch.int64) * args.bag_size
        g = np.random.default_rng(first_seed + k).normal(0, 1e-2, (args.bags, args.dim)).astype(np.float32)
        out.append((ids, offsets, torch.from_numpy(g)))
    return out


def _configs(rows: int) -> dict[str, tuple[int, int]]:
    return {
        "resident": (rows, 0),
        "ddr": (max(rows // 10, 1), rows - max(rows // 10, 1)),
        "lmdb": (max(rows // 20, 1), max(rows // 20, 1)),
    }


def _fill(store: TieredStore, rows: int, chunk: int = 1 << 16) -> None:
    """Write every row (its initial value) and checkpoint, so LMDB holds the table, then
    look every row up, so HBM and DDR hold as much of it as they can."""
    for a in range(0, rows, chunk):
        ids = np.arange(a, min(a + chunk, rows), dtype=np.int64)
        store.write("t", ids, store.peek("t", ids))
    store.checkpoint()
    for a in range(0, rows, chunk):
        store.lookup("t", np.arange(a, min(a + chunk, rows), dtype=np.int64))


def _moves_delta(after: dict, before: dict, steps: int) -> dict:
    return {
        part: {k: (after[part][k] - before[part][k]) / steps for k in ("seconds", "rows", "bytes")}
        for part in MOVE_PARTS
    }


def _piped(store, bag, warm, timed, args) -> tuple[dict, list]:
    """The batches through a :class:`TrainPipeline` (lookahead 2, the next batch's rows brought
    up on its thread while this one trains, the step on one thread fewer than the cores):
    the store's stats after the warm-up steps and the timed steps' times."""
    pipe = TrainPipeline(
        store,
        bag,
        None,
        lambda b: {"t": b[0]},
        lambda m, b: (m(b[0], b[1]) * b[2]).sum(),
        lookahead_batches=2,
        step_threads=max(1, (os.cpu_count() or 2) - 1),
    )
    times, before = [], None
    t0 = time.perf_counter()
    for k, _ in enumerate(pipe.run(iter(warm + timed))):
        if args.device != "cpu":
            torch.cuda.synchronize()
        now = time.perf_counter()
        if k == len(warm) - 1:
            before = store.stats()["t"]
        elif k >= len(warm):
            times.append(now - t0)
        t0 = now
    return before, times


def _open(stack: contextlib.ExitStack, path: Path, args, hbm_rows: int, ddr_rows: int):
    """A store of one configuration, filled (held open by ``stack``), and its module."""
    cfg = TableConfig("t", dim=args.dim, num_rows=args.rows, optimizer=RowWiseAdagrad(lr=LR, eps=EPS))
    tiers = TierConfig(hbm_rows=hbm_rows, ddr_rows=ddr_rows, device=args.device, policy=args.policy)
    store = stack.enter_context(TieredStore.create(path, [cfg], tiers, seed=0))
    _fill(store, args.rows)
    return store, TieredEmbeddingBag(store, "t", mode="sum", include_last_offset=True)


def _step(bag, batch, device: str) -> float:
    """Seconds of one training step (forward, backward, fused update) on ``batch``."""
    ids, offsets, g = batch
    t0 = time.perf_counter()
    bag(ids, offsets).backward(g)
    if device != "cpu":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def run_config(path: Path, args, hbm_rows: int, ddr_rows: int, warm, timed, piped: bool = False) -> dict:
    with contextlib.ExitStack() as stack:
        store, bag = _open(stack, path, args, hbm_rows, ddr_rows)
        if piped:
            before, times = _piped(store, bag, warm, timed, args)
        else:
            for batch in warm:
                _step(bag, batch, args.device)
            before = store.stats()["t"]
            times = [_step(bag, batch, args.device) for batch in timed]
        after = store.stats()["t"]
    return _summary(args, hbm_rows, ddr_rows, before, after, times)


def run_interleaved(tmp: Path, names: list[str], args, warm, timed) -> dict:
    """The configurations ``names`` open side by side, their steps alternating batch by batch
    (the first of each round turning): each sees the batches it would alone, in the same
    order, and the machine's slow spells fall on all of them.  Each step evicts the others'
    rows from the CPU's caches, as a model's other layers would."""
    with contextlib.ExitStack() as stack:
        opened = {name: _open(stack, tmp / name, args, *_configs(args.rows)[name]) for name in names}
        for batch in warm:
            for _, bag in opened.values():
                _step(bag, batch, args.device)
        before = {name: store.stats()["t"] for name, (store, _) in opened.items()}
        times: dict[str, list[float]] = {name: [] for name in names}
        for k, batch in enumerate(timed):
            for name in names[k % len(names) :] + names[: k % len(names)]:
                times[name].append(_step(opened[name][1], batch, args.device))
        return {
            name: _summary(args, *_configs(args.rows)[name], before[name], store.stats()["t"], times[name])
            | {"interleaved": names}
            for name, (store, _) in opened.items()
        }


def _summary(args, hbm_rows: int, ddr_rows: int, before: dict, after: dict, times: list[float]) -> dict:
    """A configuration's figures from its table's stats before and after the timed steps."""
    steps = len(times)
    moves = _moves_delta(after["moves"], before["moves"], steps)
    # the step's own traffic and the prefetch thread's (the pipelined configurations' moves)
    delta = {
        key: sum(a[tier][key] - b[tier][key] for a, b in ((after, before), (after["prefetch"], before["prefetch"])))
        / steps
        for tier, key in (("hbm", "misses"), ("hbm", "evictions"), ("ssd", "hits"), ("ssd", "writebacks"))
    }
    # rows that crossed a tier boundary: up into HBM, down out of it, down out of DDR
    moved_rows = delta["misses"] + delta["evictions"] + delta["writebacks"]
    return {
        "hbm_rows": hbm_rows,
        "ddr_rows": ddr_rows,
        "step_median_s": median(times),
        "step_s": times,
        "step_p90_s": float(np.percentile(times, 90)),
        # the parts are sums over the timed steps: set beside the mean step, not the median
        "step_mean_s": float(np.mean(times)),
        "moves": moves,
        "moves_s": sum(m["seconds"] for m in moves.values()),
        "moved_rows": moved_rows,
        "moved_bytes": moved_rows * 4 * (args.dim + 1),  # row-wise Adagrad: one float of state a row
        "copied_bytes": sum(m["bytes"] for m in moves.values()),
        "hbm_misses": delta["misses"],
        "hbm_evictions": delta["evictions"],
        "ssd_reads": delta["hits"],
        "ssd_writebacks": delta["writebacks"],
        # after the timed steps: every copy LMDB's segments hold (stale ones too), and the live rows
        "ssd_stored_rows": after["ssd"]["stored_rows"],
        "ssd_live_rows": after["ssd"]["rows"],
    }


def fresh_lookup(path: Path, args, batch: int, repeats: int) -> dict:
    """``store.lookup`` of ``batch`` ids never looked up since the table was written (all read
    from LMDB, admitted into HBM and DDR of 5 % each), and ``store.lookup(admit=False)`` of
    the same ids first (read where they are, nothing moved), against a ``numpy.memmap``
    gather of the same rows from a file holding the same records, its pages read once
    before.  Disjoint ids each repeat; medians."""
    cfg = TableConfig("t", dim=args.dim, num_rows=args.rows, optimizer=RowWiseAdagrad(lr=LR, eps=EPS))
    hbm_rows, ddr_rows = _configs(args.rows)["lmdb"]
    tiers = TierConfig(hbm_rows=hbm_rows, ddr_rows=ddr_rows, device=args.device)
    width = args.dim + 1
    flat = path.with_suffix(".f32")
    rng = np.random.default_rng(7)
    cold = rng.permutation(args.rows - hbm_rows - ddr_rows)  # the rows _fill's lookups left in LMDB alone
    batch = min(batch, cold.shape[0] // (repeats + 1))
    ours, peer, through = [], [], []
    with TieredStore.create(path, [cfg], tiers, seed=0) as store:
        _fill(store, args.rows)
        table = np.memmap(flat, dtype=np.float32, mode="w+", shape=(args.rows, width))
        for a in range(0, args.rows, 1 << 16):
            ids = np.arange(a, min(a + (1 << 16), args.rows))
            table[ids] = store.peek("t", ids, with_state=True)
        table.flush()
        del table
        table = np.memmap(flat, dtype=np.float32, mode="r", shape=(args.rows, width))
        np.asarray(table).sum()  # its pages in the page cache, as LMDB's are
        for r in range(repeats + 1):
            ids = np.sort(cold[r * batch : (r + 1) * batch]) if args.sorted_fresh else cold[r * batch : (r + 1) * batch]
            t0 = time.perf_counter()
            store.lookup("t", ids, admit=False)  # (first: it leaves the rows where they are)
            t1 = time.perf_counter()
            np.asarray(table[ids])
            t2 = time.perf_counter()
            store.lookup("t", ids)
            t3 = time.perf_counter()
            if r:  # the first: kernels compiled
                through.append(t1 - t0)
                peer.append(t2 - t1)
                ours.append(t3 - t2)
    flat.unlink()
    return {
        "batch": batch,
        "ours_rows_per_s": batch / median(ours),
        "memmap_rows_per_s": batch / median(peer),
        "ratio": median(peer) / median(ours),
        "read_through_rows_per_s": batch / median(through),
        "read_through_ratio": median(peer) / median(through),
    }


def cache_free(args, warm, timed) -> dict:
    """The peer a user writes with no cache: table and row-wise Adagrad state in host memory
    (pinned when the step runs on a GPU); each step gathers the batch's unique rows on the
    host, sends them up, pools, takes the gradient, updates and sends the rows back.  Not
    deterministic across thread counts (torch's unique and index_add), and its rows start
    from a fixed draw, not ours: a timing peer only."""
    dev = torch.device(args.device)
    gen = torch.Generator().manual_seed(0)
    table = torch.empty(args.rows, args.dim).uniform_(-0.01, 0.01, generator=gen)
    state = torch.zeros(args.rows)
    if dev.type == "cuda":
        table, state = table.pin_memory(), state.pin_memory()

    def step(ids, offsets, g):
        uniq, inverse = torch.unique(ids, return_inverse=True)
        rows = table.index_select(0, uniq).to(dev, non_blocking=True).requires_grad_()
        st = state.index_select(0, uniq).to(dev, non_blocking=True)
        out = torch.nn.functional.embedding_bag(
            inverse.to(dev), rows, offsets.to(dev), mode="sum", include_last_offset=True
        )
        out.backward(g.to(dev))
        with torch.no_grad():
            st += rows.grad.pow(2).mean(1)
            new = rows - LR * rows.grad / (st.sqrt() + EPS)[:, None]
            table.index_copy_(0, uniq, new.cpu())
            state.index_copy_(0, uniq, st.cpu())

    for b in warm:
        step(*b)
    times = []
    for b in timed:
        t0 = time.perf_counter()
        step(*b)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return {"step_median_s": median(times), "step_p90_s": float(np.percentile(times, 90))}


def copy_references(nbytes: int, width: int, table_rows: int, repeats: int, seed: int) -> dict:
    """Median seconds of a contiguous memcpy of ``nbytes`` and of a ``numpy.take`` of as many
    ``width``-float rows drawn at random from a ``table_rows``-row table."""
    words = max(nbytes // 4, 1)
    src, dst = np.ones(words, dtype=np.float32), np.empty(words, dtype=np.float32)
    n_rows = max(words // width, 1)
    table = np.ones((table_rows, width), dtype=np.float32)
    at = np.random.default_rng(seed).integers(0, table_rows, n_rows)
    out = np.empty((n_rows, width), dtype=np.float32)
    memcpy, gather = [], []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        t1 = time.perf_counter()
        np.take(table, at, axis=0, out=out)
        t2 = time.perf_counter()
        memcpy.append(t1 - t0)
        gather.append(t2 - t1)
    return {"memcpy_s": median(memcpy[1:]), "gather_s": median(gather[1:]), "gather_rows": n_rows}


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results["configs"])
    fig, ax = plt.subplots(figsize=(7, 4))
    bottom = np.zeros(len(names))
    parts = [*MOVE_PARTS, "rest of the step"]
    for part in parts:
        ms = np.array(
            [
                1e3
                * (
                    results["configs"][n]["moves"][part]["seconds"]
                    if part in MOVE_PARTS
                    else results["configs"][n]["step_mean_s"] - results["configs"][n]["moves_s"]
                )
                for n in names
            ]
        )
        if ms.any():
            ax.bar(names, ms, bottom=bottom, label=part)
            bottom += ms
    for i, n in enumerate(names):
        ref = results["configs"][n]["copy_reference"]
        ax.plot([i - 0.4, i + 0.4], [1e3 * ref["gather_s"]] * 2, "k--", lw=1)
    ax.set_ylabel("ms per step")
    cfg = results["config"]
    ax.set_title(f"{cfg['rows']:,} rows x {cfg['dim']}: a step's parts (dashes: a gather of its bytes)")
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--bags", type=int, default=8192)
    p.add_argument("--bag-size", type=int, default=20)
    p.add_argument("--alpha", type=float, default=1.05)
    p.add_argument("--warm-steps", type=int, default=5)
    p.add_argument("--steps", type=int, default=12, help="fresh batches timed per configuration")
    p.add_argument(
        "--configs",
        default="resident,ddr,lmdb,ddr+pipe,lmdb+pipe",
        help="comma-separated, of resident, ddr, lmdb, and ddr+pipe, lmdb+pipe (through TrainPipeline)",
    )
    p.add_argument(
        "--interleave",
        default="resident,ddr",
        help="of --configs, those run side by side, alternating step by step (the rest run one after"
        " another; the LMDB cases' background writes would spill into the others' steps); '': none",
    )
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--policy", default="lru", help="the tiers' eviction policy (TierConfig.policy)")
    p.add_argument("--fresh-batch", type=int, default=65_536, help="ids of the fresh-lookup comparison (0: skip)")
    p.add_argument("--fresh-repeats", type=int, default=5)
    p.add_argument("--sorted-fresh", action="store_true", help="fresh ids in id order (default: random order)")
    p.add_argument("--no-cache-free", dest="cache_free", action="store_false", help="skip the cache-free torch peer")
    p.add_argument("--json", default="bench/results/tiers.json")
    p.add_argument("--plot", default=None, help="a PNG of the parts (matplotlib)")
    args = p.parse_args(argv)
    warm = _batches(args, 1, args.warm_steps)
    timed = _batches(args, 1000, args.steps)
    configs = {}
    tmp = Path(tempfile.mkdtemp(prefix="bench_tiers_"))
    try:
        names = args.configs.split(",")
        together = [n for n in names if n in args.interleave.split(",")]
        done = run_interleaved(tmp, together, args, warm, timed) if len(together) > 1 else {}
        for name in names:
            if name in done:
                configs[name] = done[name]
                continue
            hbm_rows, ddr_rows = _configs(args.rows)[name.removesuffix("+pipe")]
            configs[name] = run_config(tmp / name, args, hbm_rows, ddr_rows, warm, timed, name.endswith("+pipe"))
            shutil.rmtree(tmp / name)
        fresh = fresh_lookup(tmp / "fresh", args, args.fresh_batch, args.fresh_repeats) if args.fresh_batch else None
        free = cache_free(args, warm, timed) if args.cache_free else None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    width = args.dim + 1  # row-wise Adagrad: one float of state a row
    for c in configs.values():
        c["copy_reference"] = copy_references(int(c["moved_bytes"]), width, args.rows, 5, seed=0)
    ratios = {}
    if "resident" in configs:
        base = configs["resident"]["step_median_s"]
        for name, c in configs.items():
            if name == "resident":
                continue
            over = c["step_median_s"] - base
            ratios[f"{name}_vs_resident"] = base / c["step_median_s"]
            if c.get("interleaved") and configs["resident"].get("interleaved"):  # (step k of each on batch k)
                pairs = zip(configs["resident"]["step_s"], c["step_s"], strict=True)
                ratios[f"{name}_vs_resident_paired"] = median([r / t for r, t in pairs])
            ratios[f"{name}_overhead_in_memcpys"] = over / max(c["copy_reference"]["memcpy_s"], 1e-9)
            ratios[f"{name}_overhead_in_gathers"] = over / max(c["copy_reference"]["gather_s"], 1e-9)
    out = {
        "benchmark": "tiers",
        "command": "python bench/bench_tiers.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "config": vars(args),
        "machine": machine(),
        "configs": configs,
        "ratios": ratios,
        "fresh_lookup": fresh,
        "cache_free": free,
    }
    head = ("step ms", "mean ms", "moves ms", "MB moved", "memcpy ms", "gather ms")
    print(f"{'config':<10} " + " ".join(f"{h:>9}" for h in head))
    for name, c in configs.items():
        ref = c["copy_reference"]
        print(
            f"{name:<10} {1e3 * c['step_median_s']:>9.1f} {1e3 * c['step_mean_s']:>9.1f} {1e3 * c['moves_s']:>9.1f}"
            f" {c['moved_bytes'] / 1e6:>9.2f} {1e3 * ref['memcpy_s']:>9.2f} {1e3 * ref['gather_s']:>9.2f}"
        )
        for part, m in c["moves"].items():
            if m["seconds"]:
                ms, mb = 1e3 * m["seconds"], m["bytes"] / 1e6
                print(f"    {part:<12} {ms:>7.2f} ms {m['rows']:>9.0f} rows {mb:>7.2f} MB")
        if c["ssd_stored_rows"]:
            print(f"    LMDB holds {c['ssd_stored_rows']:,} copies of {c['ssd_live_rows']:,} live rows")
    if free is not None:
        print(f"{'cache-free':<10} {1e3 * free['step_median_s']:>8.1f}  (torch, no cache: the table in host memory)")
        for name in ("ddr", "lmdb"):
            if name in configs:
                ratios[f"{name}_vs_cache_free"] = free["step_median_s"] / configs[name]["step_median_s"]
    if fresh is not None:
        ratios["fresh_lookup_vs_memmap"] = fresh["ratio"]
        ratios["fresh_read_through_vs_memmap"] = fresh["read_through_ratio"]
        print(
            f"fresh lookup of {fresh['batch']:,} ids: ours {fresh['ours_rows_per_s'] / 1e6:.2f} M rows/s,"
            f" (read through {fresh['read_through_rows_per_s'] / 1e6:.2f} M),"
            f" memmap {fresh['memmap_rows_per_s'] / 1e6:.2f} M"
        )
    for name, v in ratios.items():
        print(f"{name:<32} {v:.2f}")
    if args.json:
        write_json(args.json, out)
    if args.plot:
        plot(out, args.plot)
    return out


if __name__ == "__main__":
    main()
