"""GPU figures of the HBM tier: pool bandwidth, the resident train step against torch, the tiered step.

Needs an NVIDIA GPU with CuPy and a CUDA build of torch (``pip install -e
".[gpu-cuda13,torch]"``, or ``gpu-cuda12``; docs/gpu.md), and numba-cuda for
``--kernels numba``.  Without them it prints why
and exits with status 2, measuring nothing.  Run from the repository root::

    python bench/bench_gpu.py --json bench/results/gpu.json

(defaults: 1M rows, dim 128, 8,192 bags x 20 ids, Zipf 1.05).  Every peer runs in this
process on the same ids; each figure is the median (and P90) over the timed steps, the
device synchronised around each one; one warm-up pass first (kernel compilation, lazy
initialisation of the rows).  Three parts, each a ratio:

``--kernels`` picks the step's kernels: ``native`` (the CUDA C of ``native/``, the default)
or ``numba`` (their numba-cuda twins); the figures name which.

- **pool bandwidth**: the pooled forward kernel (``pool_bags``)
  over rows resident on the device, in bytes read and written per second, against the
  device's own copy bandwidth (a CuPy device-to-device copy of as many bytes) measured in
  the same run, both timed by CUDA events around 20 calls in a row (the kernels' own time;
  one call with the host's launch and a synchronisation is reported beside it); target >= 0.8;
- **resident train step** (forward + backward + row-wise Adagrad, every row in HBM):
  ``TieredEmbeddingBag`` on a ``device="cuda"`` store against ``torch.nn.EmbeddingBag
  (sparse=True)`` + ``torch.optim.Adagrad`` on CUDA, and FBGEMM's GPU TBE
  (EXACT_ROWWISE_ADAGRAD) where ``fbgemm_gpu`` imports; target >= 2x torch;
- **tiered step**: the same step on fresh batches with the table 10x larger than HBM,
  through ``TrainPipeline`` with lookahead, against the resident store; target >= 0.8x.
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
from _common import fbgemm_tbe, machine, write_json

from tiered_emb.step.device.launch import KERNELS_ENV

LR, EPS = 0.01, 1e-8


def gpu_or_reason(kernels: str = "native") -> str | None:
    """None when this machine can run the benchmark with ``kernels``, else why not (one line)."""
    if kernels == "numba" and os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0"):
        return "NUMBA_ENABLE_CUDASIM is set: the kernels would run in Numba's simulator"
    try:
        import cupy
        import torch
    except Exception as err:
        return f"a GPU package is missing ({type(err).__name__}: {err})"
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1 or not torch.cuda.is_available():
            return "CuPy or torch sees no CUDA device"
        if kernels == "numba":
            from numba import cuda

            if not cuda.is_available():
                return "Numba's CUDA target sees no device"
    except Exception as err:
        return f"CUDA is not usable ({type(err).__name__}: {err})"
    return None


def _sync() -> None:
    import cupy
    import torch

    cupy.cuda.Device().synchronize()
    torch.cuda.synchronize()


def _times(step, batches, repeats: int) -> list[float]:
    """Warm up once over ``batches``, then ``repeats`` timed passes; seconds per step, device synchronised."""
    for b in batches:
        step(*b)
    out = []
    for _ in range(repeats):
        for b in batches:
            _sync()
            t = time.perf_counter()
            step(*b)
            _sync()
            out.append(time.perf_counter() - t)
    return out


def _device_seconds(launch, repeats: int, back_to_back: int = 20) -> list[float]:
    """Device seconds per call of ``launch``: CUDA events around ``back_to_back`` calls issued in a
    row (the kernel's own time, the host's launch cost hidden behind it), ``repeats`` times."""
    import cupy

    launch()
    out = []
    for _ in range(repeats):
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        for _ in range(back_to_back):
            launch()
        stop.record()
        stop.synchronize()
        out.append(cupy.cuda.get_elapsed_time(start, stop) / 1e3 / back_to_back)
    return out


def _summary(times: list[float], lookups: int) -> dict:
    med = float(np.median(times))
    return {
        "median_s": med,
        "p90_s": float(np.percentile(times, 90)),
        "steps": len(times),
        "lookups_per_s": lookups / med,
    }


def _batches(args, first_seed: int, count: int):
    """``count`` batches of (ids (host), offsets (host, B+1), gradient (CUDA, (B, dim)))."""
    import torch

    from tiered_emb.sim.traces import zipf_ids

    out = []
    for k in range(count):
        ids = torch.from_numpy(zipf_ids(args.rows, args.alpha, args.bags * args.bag_size, seed=first_seed + k))
        offsets = torch.arange(args.bags + 1, dtype=torch.int64) * args.bag_size
        g = np.random.default_rng(first_seed + k).normal(0, 1e-2, (args.bags, args.dim)).astype(np.float32)
        out.append((ids, offsets, torch.from_numpy(g).cuda()))
    return out


def pool_bandwidth(args) -> dict:
    """The pool kernel's bytes per second against a device-to-device copy's, same run."""
    import cupy

    from tiered_emb.sim.traces import zipf_ids
    from tiered_emb.step.device.launch import kernels_for
    from tiered_emb.step.plan import dedupe

    kernels = kernels_for(cupy)
    records = cupy.random.standard_normal((args.rows, args.dim), dtype=cupy.float32)
    n = args.bags * args.bag_size
    uids, inverse = dedupe(zipf_ids(args.rows, args.alpha, n, seed=7))
    slots, inv = cupy.asarray(uids), cupy.asarray(inverse)  # every row resident: slot = id
    offsets = cupy.arange(args.bags + 1, dtype=cupy.int64) * args.bag_size
    moved = n * args.dim * 4 + args.bags * args.dim * 4 + n * 8 + uids.shape[0] * 8  # rows, output, indices
    pool = _device_seconds(lambda: kernels.pool(records, slots, inv, offsets, None, False, args.dim), args.repeats)
    synced = _times(lambda: kernels.pool(records, slots, inv, offsets, None, False, args.dim), [()], args.repeats)
    src = cupy.ones(moved // 4, dtype=cupy.float32)
    dst = cupy.empty_like(src)
    copy = _device_seconds(lambda: dst.__setitem__(Ellipsis, src), args.repeats)
    pool_bw = moved / float(np.median(pool))
    copy_bw = 2 * moved / float(np.median(copy))  # a copy reads and writes its bytes
    return {
        "pool_bytes_per_s": pool_bw,
        "copy_bytes_per_s": copy_bw,
        "ratio": pool_bw / copy_bw,
        "bytes": moved,
        "pool_device_s": float(np.median(pool)),
        "pool_synced_s": float(np.median(synced)),  # one call, host launch and synchronisation included
    }


def _ours(path, args, hbm_rows: int):
    from tiered_emb import RowWiseAdagrad, TableConfig, TierConfig, TieredStore
    from tiered_emb.torch import TieredEmbeddingBag

    cfg = TableConfig("t", dim=args.dim, num_rows=args.rows, optimizer=RowWiseAdagrad(lr=LR, eps=EPS))
    store = TieredStore.create(path, [cfg], TierConfig(hbm_rows=hbm_rows, ddr_rows=hbm_rows, device="cuda"), seed=0)
    return store, TieredEmbeddingBag(store, "t", mode="sum", include_last_offset=True)


def train_steps(args, tmp: str) -> dict:
    """Resident step: ours against torch (and FBGEMM); tiered step (table 10x HBM) against resident."""
    import torch

    from tiered_emb.torch import TrainPipeline

    lookups = args.bags * args.bag_size
    batches = _batches(args, 0, args.batches)
    results = {}
    store, ours = _ours(Path(tmp) / "resident", args, args.rows)

    def ours_step(ids, offsets, g):
        ours(ids, offsets).backward(g)  # the fused backward updates the rows on the device

    results["ours_resident"] = _summary(_times(ours_step, batches, args.repeats), lookups)
    # torch's default, said out loud: unsaid, its sparse Adagrad warns at every step
    torch.sparse.check_sparse_tensor_invariants.disable()
    emb = torch.nn.EmbeddingBag(args.rows, args.dim, mode="sum", sparse=True, include_last_offset=True).cuda()
    opt = torch.optim.Adagrad(emb.parameters(), lr=LR, eps=EPS)

    def torch_step(ids, offsets, g):
        opt.zero_grad(set_to_none=True)
        emb(ids.cuda(), offsets.cuda()).backward(g)
        opt.step()

    results["torch_embeddingbag"] = _summary(_times(torch_step, batches, args.repeats), lookups)
    tbe = fbgemm_tbe(args.rows, args.dim, True, LR, EPS)
    if tbe is not None:
        results["fbgemm_tbe"] = _summary(
            _times(lambda i, o, g: tbe(i.cuda(), o.cuda()).backward(g), batches, args.repeats), lookups
        )
    fresh = _batches(args, 1000, args.stream_steps)
    for name, hbm in (("stream_resident", args.rows), ("stream_tiered", max(args.rows // 10, 1))):
        s, module = (store, ours) if hbm == args.rows else _ours(Path(tmp) / name, args, hbm)
        pipe = TrainPipeline(s, module, None, lambda b: {"t": b[0]}, lambda m, b: (m(b[0], b[1]) * b[2]).sum(), 2)
        times, t = [], time.perf_counter()
        for _ in pipe.run(iter(fresh)):
            _sync()
            times.append(time.perf_counter() - t)
            t = time.perf_counter()
        results[name] = _summary(times[1:] or times, lookups)
        s.close()
    return results


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--bags", type=int, default=8192)
    p.add_argument("--bag-size", type=int, default=20)
    p.add_argument("--alpha", type=float, default=1.05)
    p.add_argument("--batches", type=int, default=4, help="distinct batches per timed pass")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--stream-steps", type=int, default=24, help="fresh batches of the tiered comparison")
    p.add_argument("--kernels", choices=["native", "numba"], default="native", help="the step's CUDA kernels")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    os.environ[KERNELS_ENV] = args.kernels
    reason = gpu_or_reason(args.kernels)
    if reason is not None:
        print(f"bench_gpu: no usable GPU here ({reason}); nothing measured (docs/gpu.md)", file=sys.stderr)
        raise SystemExit(2)
    import cupy

    with tempfile.TemporaryDirectory() as tmp:
        res = {"pool_bandwidth": pool_bandwidth(args), **train_steps(args, tmp)}
    r = res
    ratios = {
        "pool_vs_copy_bandwidth": r["pool_bandwidth"]["ratio"],
        "resident_vs_torch": r["ours_resident"]["lookups_per_s"] / r["torch_embeddingbag"]["lookups_per_s"],
        "tiered_vs_resident": r["stream_tiered"]["lookups_per_s"] / r["stream_resident"]["lookups_per_s"],
    }
    if "fbgemm_tbe" in r:
        ratios["resident_vs_fbgemm"] = r["ours_resident"]["lookups_per_s"] / r["fbgemm_tbe"]["lookups_per_s"]
    device = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    payload = {"machine": dict(machine(), gpu=device), "args": vars(args), "results": res, "ratios": ratios}
    print(f"device: {device}, kernels: {args.kernels}")
    for name, value in ratios.items():
        print(f"{name:28s} {value:8.3f}")
    if args.json:
        write_json(args.json, payload)
    return payload


if __name__ == "__main__":
    main()
