"""A whole training run on the GPU's code path equals the host path's, byte for byte.

``TIERED_EMB_DEVICE_KERNELS=1`` makes the store run every pooled forward, gather, reduce
and optimizer update through the CUDA kernel launches (tiered_emb/step/device/launch.py) while
its HBM records stay in host memory; without a GPU those kernels run in Numba's simulator
(tests/conftest.py), so CI checks the device path's wiring (chunks, spills, the prefetch
window's pinned batches, checkpoints and reopening) against the host's on every run.
Sizes stay tiny: the simulator runs each CUDA thread as a Python thread.
"""

import os
import subprocess
import sys

import numpy as np
import pytest

from tiered_emb import SGD, Adagrad, Adam, RowWiseAdagrad, TableConfig, TierConfig, TieredStore
from tiered_emb.errors import DeviceError, NonFiniteGradientError
from tiered_emb.prefetch import lookahead
from tiered_emb.step.device.launch import DeviceKernels, kernels_for
from tiered_emb.step.plan import plan_bags

TABLES = [
    TableConfig("s", dim=3, optimizer=SGD(lr=0.5)),
    TableConfig("a", dim=4, optimizer=Adagrad(lr=0.2)),
    TableConfig("r", dim=5, optimizer=RowWiseAdagrad(lr=0.3)),
    TableConfig("m", dim=3, optimizer=Adam(lr=0.05), num_rows=12),  # HBM holds it whole: the direct tier
]
NUM_IDS = 30


def _bags(rng, step: int):
    n = int(rng.integers(4, 11))
    ids = rng.integers(0, 12, n).astype(np.int64)  # duplicates, and (12 > hbm_rows) chunks that spill
    cuts = np.sort(rng.integers(0, n + 1, 2))
    offsets = np.array([0, cuts[0], cuts[0], cuts[1], n], dtype=np.int64)  # an empty bag
    mode = ("sum", "mean", "weighted")[step % 3]
    weights = rng.standard_normal(n).astype(np.float32) if mode == "weighted" else None
    return plan_bags(ids, offsets, weights, mean=mode == "mean")


def _train(path, steps: int, seed: int, reopen: bool):
    """Pooled forward + fused backward, plain lookups and apply_gradients, a checkpoint and a reopen;
    every pooled output and, at the end, every row with its state."""
    rng = np.random.default_rng(seed)
    outputs = []
    tiers = TierConfig(hbm_rows=6, ddr_rows=4, policy="lfu", device="cpu")
    store = TieredStore.create(path, TABLES, tiers, seed=3)
    for step in range(steps):
        for cfg in TABLES:
            plan = _bags(rng, step)
            out, fwd = store.engine.lookup_pooled(cfg.name, plan)
            outputs.append(np.array(out))
            grad = np.sin(np.asarray(out) * np.float32(3.0)) + np.float32(0.1 * step)
            store.engine.apply_pooled_gradients(cfg.name, fwd, grad.astype(np.float32))
            ids = rng.integers(0, 12, 5)
            rows = store.lookup(cfg.name, ids)
            outputs.append(np.array(rows))
            store.apply_gradients(cfg.name, ids, np.cos(np.asarray(rows)).astype(np.float32))
        if reopen and step == steps // 2:
            store.checkpoint()
            store.close()
            store = TieredStore.open(path)
    rows = [store.peek(cfg.name, np.arange(12), with_state=True) for cfg in TABLES]
    store.close()
    return outputs, rows


def _same_bytes(a: list, b: list) -> bool:
    return len(a) == len(b) and all(
        x.shape == y.shape and x.tobytes() == y.tobytes() for x, y in zip(a, b, strict=True)
    )


@pytest.mark.parametrize("seed", [0, 1])
def test_a_training_run_on_the_device_path_is_bitwise_the_hosts(tmp_path, monkeypatch, seed):
    host = _train(tmp_path / "host", 6, seed, reopen=True)
    monkeypatch.setenv("TIERED_EMB_DEVICE_KERNELS", "1")
    device = _train(tmp_path / "device", 6, seed, reopen=True)
    assert _same_bytes(device[0], host[0])  # every pooled output and looked-up row
    assert _same_bytes(device[1], host[1])  # every row and its optimizer state


def test_the_device_path_takes_the_kernels(tmp_path, monkeypatch):
    """The hook does select the device kernels (an equality of two host runs would prove nothing)."""
    assert kernels_for(np) is None  # the host path by default
    monkeypatch.setenv("TIERED_EMB_DEVICE_KERNELS", "1")
    assert isinstance(kernels_for(np), DeviceKernels)
    calls = []
    real = DeviceKernels.pool

    def counting(self, *args):
        calls.append(args)
        return real(self, *args)

    monkeypatch.setattr(DeviceKernels, "pool", counting)
    with TieredStore.create(tmp_path / "s", TABLES[:1], TierConfig(4, device="cpu")) as s:
        s.engine.lookup_pooled("s", plan_bags(np.array([1, 2, 1]), np.array([0, 2, 3])))
    assert len(calls) == 1


def test_prefetched_batches_on_the_device_path(tmp_path, monkeypatch):
    """Batches pinned by the prefetch window are pooled and updated by the kernels too, without
    the lock while the thread places the next batches' rows, bitwise."""
    if not DeviceKernels(np).simulated:
        pytest.skip("on a GPU host arrays are copied back whole after each launch (step/device/launch.py)")

    def run(path):
        rng = np.random.default_rng(5)
        plans = [_bags(rng, step) for step in range(5)]
        outs = []
        with TieredStore.create(path, TABLES[2:3], TierConfig(16, 4, "lru", "cpu"), seed=1) as s:
            for plan in lookahead(s, plans, lambda p: {"r": p.ids}, 2, load_ahead=1):
                out, fwd = s.engine.lookup_pooled("r", plan)
                out = np.array(out)
                s.engine.apply_pooled_gradients("r", fwd, np.tanh(out + np.float32(0.5)))
                outs.append(out)
            return outs + [s.peek("r", np.arange(12), with_state=True)]

    host = run(tmp_path / "host")
    monkeypatch.setenv("TIERED_EMB_DEVICE_KERNELS", "1")
    assert _same_bytes(run(tmp_path / "device"), host)


@pytest.mark.parametrize("nonfinite", ["raise", "skip", "zero"])
def test_nonfinite_gradients_on_the_device_path(tmp_path, monkeypatch, nonfinite):
    def run(path):
        with TieredStore.create(path, TABLES[1:2], TierConfig(8, device="cpu"), seed=2) as s:
            plan = plan_bags(np.array([1, 2, 3, 2]), np.array([0, 2, 4]))
            _, fwd = s.engine.lookup_pooled("a", plan)
            g = np.ones((2, 4), dtype=np.float32)
            g[1, 2] = np.nan
            try:
                s.engine.apply_pooled_gradients("a", fwd, g, nonfinite=nonfinite)
            except NonFiniteGradientError:
                pass
            return [s.peek("a", np.arange(5), with_state=True)]

    host = run(tmp_path / "host")
    monkeypatch.setenv("TIERED_EMB_DEVICE_KERNELS", "1")
    assert _same_bytes(run(tmp_path / "device"), host)


def test_cuda_without_a_gpu_names_the_extras(tmp_path):
    import importlib.util

    if importlib.util.find_spec("cupy") is not None:
        pytest.skip("CuPy is installed here")
    with pytest.raises(DeviceError) as err:
        TieredStore.create(tmp_path / "g", TABLES, TierConfig(hbm_rows=2, device="cuda"))
    assert "gpu-cuda12" in err.value.hint and "gpu-cuda13" in err.value.hint
    assert not (tmp_path / "g").exists()


def test_device_kernels_without_a_gpu_or_the_simulator_are_a_device_error():
    """The hook outside the simulator, on a machine without a GPU: a typed error, not a crash."""
    import shutil

    if shutil.which("nvidia-smi") is not None:
        pytest.skip("an NVIDIA driver is here")
    code = (
        "import numpy as np\n"
        "from tiered_emb.errors import DeviceError\n"
        "from tiered_emb.step.device.launch import kernels_for\n"
        "try:\n"
        "    kernels_for(np)\n"
        "except DeviceError as err:\n"
        "    print('DeviceError', err.hint)\n"
    )
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0", TIERED_EMB_DEVICE_KERNELS="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.startswith("DeviceError") and "NUMBA_ENABLE_CUDASIM" in out.stdout


def test_a_table_held_whole_is_planned_on_the_device_with_the_hosts_counts(tmp_path, monkeypatch):
    """A direct tier's pooled step groups its positions on the device (step/device/plan.py): the
    same bytes and the same HBM counts (lookups and hits per unique id, misses per row brought up)
    as the host path, and the kernels' path does take it.  Non-finite sums follow the rules."""
    from tiered_emb.step.device import plan as device_plan

    table = TableConfig("m", dim=3, optimizer=Adam(lr=0.05), num_rows=40)

    def run(path):
        rng = np.random.default_rng(9)
        outs = []
        with TieredStore.create(path, [table], TierConfig(64, device="cpu"), seed=2) as s:
            for step in range(6):  # new ids each step, and ids seen again
                plan = _bags(rng, step)
                plan = plan_bags(plan.ids * 3 % 40, plan.offsets, plan.weights, mean=plan.mean)
                out, fwd = s.engine.lookup_pooled("m", plan)
                out = np.array(out)
                s.engine.apply_pooled_gradients("m", fwd, np.tanh(out + np.float32(step)))
                outs.append(out)
            bad = plan_bags(np.array([1, 2, 1]), np.array([0, 2, 3]))
            out, fwd = s.engine.lookup_pooled("m", bad)
            grad = np.ones((2, 3), dtype=np.float32)
            grad[1, 0] = np.nan  # id 1's sum (bags 0 and 1) is NaN, id 2's is not
            with pytest.raises(NonFiniteGradientError):
                s.engine.apply_pooled_gradients("m", fwd, grad)
            s.engine.apply_pooled_gradients("m", fwd, grad, nonfinite="skip")
            outs.append(s.peek("m", np.arange(40), with_state=True))
            return outs, s.stats()["m"]["hbm"]

    host = run(tmp_path / "host")
    monkeypatch.setenv("TIERED_EMB_DEVICE_KERNELS", "1")
    planned = []
    real = device_plan.pool
    monkeypatch.setattr(device_plan, "pool", lambda *a: planned.append(1) or real(*a))
    device = run(tmp_path / "device")
    assert len(planned) == 7
    assert _same_bytes(device[0], host[0])
    assert device[1] == host[1] and host[1]["misses"] > 0 and host[1]["hits"] > 0


def test_a_batch_over_the_budget_on_the_device_plan_changes_nothing(tmp_path, monkeypatch):
    """The device plan checks the batch's distinct rows against the budget before any row moves,
    as the host path does: a ConfigError, no row brought up, no count changed."""
    from tiered_emb.errors import ConfigError

    monkeypatch.setenv("TIERED_EMB_DEVICE_KERNELS", "1")
    wide = TableConfig("w", dim=1000, optimizer=Adam(lr=0.05), num_rows=200)  # 12 KB records: 87 fit 1 MiB
    with TieredStore.create(tmp_path / "s", [wide], TierConfig(256, device="cpu", budget_bytes=1 << 20)) as s:
        s.engine.lookup_pooled("w", plan_bags(np.arange(60), np.array([0, 60])))  # up: 40 more would fit
        before = s.stats()["w"]["hbm"]
        with pytest.raises(ConfigError, match="budget_bytes"):
            s.engine.lookup_pooled("w", plan_bags(np.arange(100), np.array([0, 50, 100])))
        assert s.stats()["w"]["hbm"] == before
