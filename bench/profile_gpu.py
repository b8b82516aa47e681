"""Where a GPU step's time goes: each kernel's launch and device time, the host's plan, a cProfile.

Run from the repository root on a machine with a GPU (as ``bench/bench_gpu.py``)::

    python bench/profile_gpu.py

It prints, for the CUDA C kernels and (where numba-cuda imports) their numba twins: the
host time per launch of the pool, the reduce and an update (calls issued back to back),
the same calls' device time by CUDA events, and whether the two pools are bitwise equal;
then the host's dedupe and grouping of one batch, the resident train step's median and
the 30 costliest functions of 12 resident steps (cProfile, by own time).  Defaults are
``bench_gpu``'s: 1M rows, dim 128, 8,192 bags of 20 ids, Zipf 1.05.  Figures go to
docs/gpu.md by hand; nothing here is asserted.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_gpu

ROWS, DIM, BAGS, BAG_SIZE = 1_000_000, 128, 8192, 20


def timed(cupy, call, reps: int = 50) -> str:
    call()
    cupy.cuda.Device().synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        call()
    host = (time.perf_counter() - t) / reps
    cupy.cuda.Device().synchronize()
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    call()
    stop.record()
    stop.synchronize()
    return f"host {host * 1e6:8.1f} us a call, device {cupy.cuda.get_elapsed_time(start, stop) * 1e3:8.1f} us"


def kernels(cupy):
    """(name, DeviceKernels) for the CUDA C kernels and, where they import, the numba twins."""
    from tiered_emb.step.device.launch import DeviceKernels
    from tiered_emb.step.device.native import cupy_module

    out = [("native", DeviceKernels(cupy, cupy_module(0)))]
    try:
        out.append(("numba", DeviceKernels(cupy)))
    except Exception as err:
        print(f"numba twins not measured ({type(err).__name__}: {err})")
    return out


def launches(cupy) -> None:
    from tiered_emb.optimizers import RowWiseAdagrad
    from tiered_emb.sim.traces import zipf_ids
    from tiered_emb.step.plan import dedupe, plan_bags
    from tiered_emb.step.reduce import group_bag_positions

    records = cupy.random.standard_normal((ROWS, 2 * DIM), dtype=cupy.float32)
    ids = zipf_ids(ROWS, 1.05, BAGS * BAG_SIZE, seed=7)
    uids, inverse = dedupe(ids)
    slots, inv = cupy.asarray(uids), cupy.asarray(inverse)
    offsets = cupy.arange(BAGS + 1, dtype=cupy.int64) * BAG_SIZE
    plan = plan_bags(ids, np.arange(BAGS + 1, dtype=np.int64) * BAG_SIZE)
    grouped = group_bag_positions(plan)
    on_device = tuple(cupy.asarray(a) for a in grouped)
    grad_out = cupy.random.standard_normal((BAGS, DIM), dtype=cupy.float32)
    few, few_grads, opt = cupy.asarray(uids[:64]), cupy.ones((64, DIM), dtype=cupy.float32), RowWiseAdagrad(lr=0.01)
    both = kernels(cupy)
    # before any update below changes the rows
    pools = [k.pool(records, slots, inv, offsets, None, False, DIM).view(cupy.uint32) for _, k in both]
    print("pools bitwise equal:", all(bool((p == pools[0]).all()) for p in pools))
    for name, k in both:
        print(f"pool {name:7s}", timed(cupy, lambda k=k: k.pool(records, slots, inv, offsets, None, False, DIM)))
        print(f"reduce {name:7s}", timed(cupy, lambda k=k: k.reduce_bags(grad_out, grouped), reps=10))
        print(f"reduce, grouping on the device, {name:7s}", timed(cupy, lambda k=k: k.reduce_bags(grad_out, on_device)))
        print(f"update of 64 rows {name:7s}", timed(cupy, lambda k=k: k.update(opt, records, few, few_grads)))
    for what, call in (("dedupe", lambda: dedupe(ids)), ("group_bag_positions", lambda: group_bag_positions(plan))):
        t = time.perf_counter()
        for _ in range(10):
            call()
        print(f"{what} on the host: {(time.perf_counter() - t) / 10 * 1e6:.0f} us")


def resident_steps() -> None:
    import torch

    torch.sparse.check_sparse_tensor_invariants.disable()  # torch's default, said out loud
    args = type("Args", (), {"rows": ROWS, "dim": DIM, "bags": BAGS, "bag_size": BAG_SIZE, "alpha": 1.05})()
    batches = bench_gpu._batches(args, 0, 4)
    with tempfile.TemporaryDirectory() as tmp:
        store, module = bench_gpu._ours(Path(tmp) / "resident", args, ROWS)

        def step(ids, offsets, g):
            module(ids, offsets).backward(g)

        times = bench_gpu._times(step, batches, 3)
        print(f"resident step: median {np.median(times) * 1e3:.2f} ms over {len(times)}")
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(3):
            for b in batches:
                step(*b)
        bench_gpu._sync()
        profile.disable()
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(30)
        print("12 resident steps, by own time\n", text.getvalue())
        store.close()


def main() -> None:
    reason = bench_gpu.gpu_or_reason()
    if reason is not None:
        print(f"profile_gpu: no usable GPU here ({reason}); nothing measured", file=sys.stderr)
        raise SystemExit(2)
    import cupy

    launches(cupy)
    resident_steps()


if __name__ == "__main__":
    main()
