"""The GPU suite (``pytest -m gpu``): the HBM tier on a real GPU, bitwise the CPU path.

Skipped where no CUDA GPU is usable (tests/conftest.py); the kernels' logic is checked on
every run anyway: the numba-cuda twins in Numba's simulator, the CUDA C kernels built for the host
(tests/step/device/test_cuda_kernels.py, tests/step/device/test_device_path.py).
Here the compiled kernels run on CuPy arrays: a training run with device="cuda" must give
the bytes of the same run with device="cpu", through the store, the torch modules and the
DLRM job.
"""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from tiered_emb import SGD, Adagrad, Adam, RowWiseAdagrad, TableConfig, TierConfig, TieredStore
from tiered_emb.step.device.launch import KERNELS_ENV
from tiered_emb.step.plan import plan_bags

pytestmark = pytest.mark.gpu

TABLES = [
    TableConfig("s", dim=7, optimizer=SGD(lr=0.5)),
    TableConfig("a", dim=33, optimizer=Adagrad(lr=0.2)),
    TableConfig("r", dim=128, optimizer=RowWiseAdagrad(lr=0.3)),
    TableConfig("m", dim=16, optimizer=Adam(lr=0.05), num_rows=90),  # HBM holds it whole: the direct tier
]


def _host(a) -> np.ndarray:
    return a if isinstance(a, np.ndarray) else a.get()


def _train(path, device: str, steps: int = 8, seed: int = 0, shared: bool = False):
    """Pooled forward + fused backward (sum, mean, weighted), lookups and apply_gradients with
    spills (HBM smaller than a batch), a checkpoint and a reopen; outputs and every row at the
    end.  ``shared``: one HBM and one DDR tier for the tables, sized in bytes."""
    rng = np.random.default_rng(seed)
    outputs = []
    tiers = TierConfig(hbm_rows=96, ddr_rows=64, policy="lru", device=device)
    if shared:
        tiers = TierConfig(hbm_bytes=300 * 4 * 144, ddr_bytes=200 * 4 * 129, policy="lru", device=device)
    store = TieredStore.create(path, TABLES, tiers, seed=3)
    for step in range(steps):
        for cfg in TABLES:
            n, hi = 160, cfg.num_rows or 500
            ids = rng.zipf(1.2, n).astype(np.int64) % hi
            offsets = np.concatenate([[0, 0], np.sort(rng.integers(0, n, 30)), [n]]).astype(np.int64)
            mode = ("sum", "mean", "weighted")[step % 3]
            w = rng.standard_normal(n).astype(np.float32) if mode == "weighted" else None
            plan = plan_bags(ids, offsets, w, mean=mode == "mean")
            out, fwd = store.engine.lookup_pooled(cfg.name, plan)
            out = _host(out)
            outputs.append(out.copy())
            store.engine.apply_pooled_gradients(cfg.name, fwd, np.sin(out * np.float32(3.0)) + np.float32(0.1))
            few = rng.integers(0, hi, 40)
            rows = _host(store.lookup(cfg.name, few))
            outputs.append(rows.copy())
            store.apply_gradients(cfg.name, few, np.cos(rows))
        if step == steps // 2:
            store.checkpoint()
            store.close()
            store = TieredStore.open(path, tiers=tiers)
    rows = [store.peek(cfg.name, np.arange(cfg.num_rows or 500), with_state=True) for cfg in TABLES]
    store.close()
    return outputs, rows


@pytest.mark.parametrize("kernels", ["native", "numba"])
def test_a_training_run_on_the_gpu_is_bitwise_the_cpus(tmp_path, monkeypatch, kernels):
    """The CUDA C kernels (the default) and their numba-cuda twins both give the CPU's bytes."""
    if kernels == "numba":
        pytest.importorskip("numba_cuda")
    monkeypatch.setenv(KERNELS_ENV, kernels)
    cpu = _train(tmp_path / "cpu", "cpu")
    gpu = _train(tmp_path / "gpu", "cuda")
    assert all(a.tobytes() == b.tobytes() for a, b in zip(gpu[0], cpu[0], strict=True))
    assert all(a.tobytes() == b.tobytes() for a, b in zip(gpu[1], cpu[1], strict=True))


def test_tiers_shared_by_the_tables_on_the_gpu_are_bitwise_the_cpus(tmp_path):
    """One HBM tier on the GPU for the four tables (slots of the widest record, 144 floats):
    the bytes of the same run on the CPU, and of tiers per table."""
    cpu = _train(tmp_path / "cpu", "cpu", shared=True)
    gpu = _train(tmp_path / "gpu", "cuda", shared=True)
    own = _train(tmp_path / "own", "cpu")
    for run in (cpu, own):
        assert all(a.tobytes() == b.tobytes() for a, b in zip(gpu[0], run[0], strict=True))
        assert all(a.tobytes() == b.tobytes() for a, b in zip(gpu[1], run[1], strict=True))


def test_the_numba_kernels_without_division_hold_no_fused_multiply_add(tmp_path, monkeypatch):
    """NVVM fuses a*b+c unless each operation is an _rn intrinsic: the PTX must show none.  (The
    CUDA C kernels' PTX is checked on every run, tests/step/device/test_cuda_kernels.py.)"""
    pytest.importorskip("numba_cuda")
    from tiered_emb.step.device import cuda_kernels

    monkeypatch.setenv(KERNELS_ENV, "numba")
    _train(tmp_path / "gpu", "cuda", steps=2)  # compiles every kernel
    for kernel in (
        cuda_kernels.sgd_update,
        cuda_kernels.reduce_chunks,
        cuda_kernels.reduce_partials,
        cuda_kernels.gather_rows,
    ):
        for ptx in kernel.inspect_asm().values():
            assert "fma." not in ptx


def test_torch_module_on_cuda_stays_on_the_device(tmp_path):
    torch = pytest.importorskip("torch")
    from tiered_emb.torch import TieredEmbeddingBag

    def run(device):
        cfg = TableConfig("t", dim=32, optimizer=RowWiseAdagrad(lr=0.1))
        store = TieredStore.create(tmp_path / device, [cfg], TierConfig(64, 64, device=device), seed=1)
        emb = TieredEmbeddingBag(store, "t", mode="mean", include_last_offset=True)
        outs = []
        for step in range(4):
            ids = torch.from_numpy(np.random.default_rng(step).integers(0, 300, 90))
            offsets = torch.tensor([0, 10, 10, 50, 90])
            out = emb(ids, offsets)
            assert out.device.type == ("cuda" if device == "cuda" else "cpu")
            g = torch.sin(out.detach() * 3)
            out.backward(g)  # on the device: the store's kernels take the CUDA gradient by DLPack
            outs.append(out.detach().cpu().numpy())
        rows = store.peek("t", np.arange(300), with_state=True)
        store.close()
        return outs, rows

    gpu, cpu = run("cuda"), run("cpu")
    assert all(a.tobytes() == b.tobytes() for a, b in zip(gpu[0], cpu[0], strict=True))
    assert gpu[1].tobytes() == cpu[1].tobytes()


def test_torch_embedding_with_padding_on_cuda_is_the_cpus(tmp_path):
    """The padding row (read on the host) joins the CUDA rows on the device."""
    torch = pytest.importorskip("torch")
    from tiered_emb.torch import TieredEmbedding

    def run(device):
        cfg = TableConfig("t", dim=8, num_rows=50, optimizer=SGD(lr=0.5))
        store = TieredStore.create(tmp_path / device, [cfg], TierConfig(16, 16, device=device), seed=1)
        emb = TieredEmbedding(store, "t", padding_idx=3)
        out = emb(torch.tensor([[1, 3, 9], [3, 3, 7]]))
        assert out.device.type == device
        out.backward(torch.ones_like(out))
        rows = store.peek("t", np.arange(50), with_state=True)
        store.close()
        return out.detach().cpu().numpy(), rows

    gpu, cpu = run("cuda"), run("cpu")
    assert gpu[0].tobytes() == cpu[0].tobytes() and gpu[1].tobytes() == cpu[1].tobytes()


def test_collection_joins_weighted_and_plain_cuda_features(tmp_path):
    """Two features of one table, one with CUDA per-sample weights and one without: the
    weights of 1 made for the second go to the first's device (torch.cat of both)."""
    torch = pytest.importorskip("torch")
    from tiered_emb.torch import TieredEmbeddingBagCollection

    def run(device):
        cfg = TableConfig("t", dim=8, num_rows=50, optimizer=SGD(lr=0.5))
        store = TieredStore.create(tmp_path / device, [cfg], TierConfig(16, 16, device=device), seed=1)
        ebc = TieredEmbeddingBagCollection(store, {"f": "t", "g": "t"})
        w = torch.tensor([0.5, 2.0, -1.0], device=device)
        out = ebc(
            {"f": (torch.tensor([1, 2, 3]), torch.tensor([2, 1]), w), "g": (torch.tensor([3, 9]), torch.tensor([1, 1]))}
        )
        (out["f"].sum() + out["g"].sum()).backward()
        rows = store.peek("t", np.arange(50), with_state=True)
        store.close()
        return out["f"].detach().cpu().numpy(), rows

    gpu, cpu = run("cuda"), run("cpu")
    assert gpu[0].tobytes() == cpu[0].tobytes() and gpu[1].tobytes() == cpu[1].tobytes()


def test_dlrm_job_end_to_end_on_cuda(tmp_path):
    pytest.importorskip("torch")
    from tiered_emb.cli import main

    run = tmp_path / "run"
    tiny = ["--batch", "64", "--rows", "3000", "--dim", "4", "--hbm-rows", "64", "--ddr-rows", "128", "--quiet"]
    assert main(["train", "--run-dir", str(run), *tiny, "--steps", "6", "--device", "cuda"]) == 0
    report = json.loads((run / "report.json").read_text())
    assert report["steps"] == 6 and np.isfinite(report["test_logloss"])


def test_bench_gpu_at_tiny_size(tmp_path):
    path = Path(__file__).resolve().parents[3] / "bench" / "bench_gpu.py"
    spec = importlib.util.spec_from_file_location("bench_gpu", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    tiny = ["--rows", "5000", "--dim", "16", "--bags", "64", "--bag-size", "4", "--batches", "2", "--repeats", "1"]
    payload = mod.main([*tiny, "--stream-steps", "3", "--json", str(tmp_path / "gpu.json")])
    assert all(v > 0 for v in payload["ratios"].values())
