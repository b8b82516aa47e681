"""The step's CUDA kernels against their host twins (the Numba CPU kernels), bitwise.

Every test runs each implementation through :class:`DeviceKernels`:

- ``numba``: the numba-cuda kernels (tiered_emb/step/device/cuda_kernels.py); without a GPU in
  Numba's CUDA simulator (tests/conftest.py sets ``NUMBA_ENABLE_CUDASIM=1``), with one
  compiled, on NumPy arrays Numba copies to the device and back;
- ``c-host``: the CUDA C kernels (native/step_kernels.cu) built for the host with
  native/host_shim.h and run a block and a thread at a time, so every CI run checks their
  logic (indexing, the order of every sum, which rounding where) without a GPU;
- ``c-gpu``: the same CUDA C kernels compiled by CuPy's NVRTC, on a GPU (``-m gpu``).

Sizes stay tiny: the simulator runs each CUDA thread as a Python thread.
"""

import dataclasses

import numpy as np
import pytest

from tiered_emb._backend import to_host
from tiered_emb._jit import pow_by_squaring
from tiered_emb.errors import ConfigError
from tiered_emb.optimizers import SGD, Adagrad, Adam, RowWiseAdagrad
from tiered_emb.step.device.launch import KERNELS_ENV, DeviceKernels, kernels_for
from tiered_emb.step.device.native import KERNEL_NAMES, expand
from tiered_emb.step.gather import pool_kernel
from tiered_emb.step.plan import plan_bags
from tiered_emb.step.reduce import REDUCE_CHUNK, group_bag_positions, reduce_bag_grads
from tiered_emb.step.update import CPU_KERNELS
from tiered_emb.testing.native_host import HostModule, host_compiler, nvrtc_ptx

SEEDS = range(3)


def _bits(a) -> np.ndarray:
    return np.ascontiguousarray(to_host(a)).view(np.uint32)


def _batch(seed: int, num_ids: int = 12, num_bags: int = 5, id_range: int = 7):
    """Ids with duplicates and bag offsets with empty bags (the first and a middle one)."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, id_range, num_ids).astype(np.int64)
    cuts = np.sort(rng.integers(0, num_ids + 1, num_bags - 3))
    offsets = np.concatenate([[0, 0], cuts, [cuts[-1] if cuts.size else 0, num_ids]]).astype(np.int64)
    return rng, ids, offsets


class _OnGpu:
    """DeviceKernels on CuPy with the tests' host records: copied up, and back where updated."""

    def __init__(self, cupy, kernels: DeviceKernels):
        self.cupy = cupy
        self.kernels = kernels

    def pool(self, records, *args):
        return self.kernels.pool(self.cupy.asarray(records), *args)

    def gather(self, records, *args):
        return self.kernels.gather(self.cupy.asarray(records), *args)

    def reduce_bags(self, grad_out, grouped):
        return self.kernels.reduce_bags(self.cupy.asarray(grad_out), grouped)

    def update(self, opt, records, slots, grads) -> None:
        on_gpu = self.cupy.asarray(records)
        self.kernels.update(opt, on_gpu, slots, grads)
        records[...] = on_gpu.get()


@pytest.fixture(scope="module", params=["numba", "c-host", pytest.param("c-gpu", marks=pytest.mark.gpu)])
def kernels(request, tmp_path_factory):
    if request.param == "numba":
        return DeviceKernels(np)
    if request.param == "c-host":
        if host_compiler() is None:
            pytest.skip("no C++ compiler on PATH to build native/step_kernels.cu for the host")
        return DeviceKernels(np, HostModule(tmp_path_factory.mktemp("native")))
    import cupy

    return _OnGpu(cupy, kernels_for(cupy))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode", ["sum", "mean", "weighted"])
def test_pool_equals_the_host_kernel(kernels, seed, mode):
    rng, ids, offsets = _batch(seed)
    weights = rng.standard_normal(ids.shape[0]).astype(np.float32) if mode == "weighted" else None
    plan = plan_bags(ids, offsets, weights, mean=mode == "mean")
    dim, width = 5, 11  # records wider than dim: state and padding after the weights
    records = (rng.standard_normal((16, width)) * 100).astype(np.float32)
    slots = rng.permutation(16)[: plan.uids.shape[0]].astype(np.int64)
    want = np.empty((plan.num_bags, dim), dtype=np.float32)
    w = weights if weights is not None else np.empty(0, dtype=np.float32)
    pool_kernel(dim, False, weights is not None)(records, slots, plan.inverse, False, 0, offsets, w, plan.mean, want)
    got = kernels.pool(records, slots, plan.inverse, offsets, weights, plan.mean, dim)
    assert np.array_equal(_bits(got), want.view(np.uint32))
    assert not want[0].any()  # an empty bag pools to zeros, on both


@pytest.mark.parametrize("seed", SEEDS)
def test_gather_copies_rows(kernels, seed):
    rng, ids, _ = _batch(seed)
    plan = plan_bags(ids, np.array([0, ids.shape[0]], dtype=np.int64))
    records = rng.standard_normal((9, 6)).astype(np.float32)
    slots = rng.permutation(9)[: plan.uids.shape[0]].astype(np.int64)
    got = kernels.gather(records, slots, plan.inverse, 4)
    assert np.array_equal(_bits(got), records[slots[plan.inverse], :4].view(np.uint32))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode", ["sum", "mean", "weighted"])
def test_reduce_equals_the_host_kernel(kernels, seed, mode):
    rng, ids, offsets = _batch(seed, num_ids=14)
    weights = rng.standard_normal(ids.shape[0]).astype(np.float32) if mode == "weighted" else None
    plan = plan_bags(ids, offsets, weights, mean=mode == "mean")
    grad_out = (rng.standard_normal((plan.num_bags, 5)) * 10).astype(np.float32)
    if seed == 1:  # non-finite sums are flagged alike
        grad_out[2, 1] = np.inf
        grad_out[3, 0] = np.nan
    want, want_bad = reduce_bag_grads(plan, grad_out)
    got, bad = kernels.reduce_bags(grad_out, group_bag_positions(plan))
    assert np.array_equal(_bits(got), want.view(np.uint32))
    assert bad.tolist() == want_bad.tolist()


@pytest.mark.parametrize("mode", ["sum", "mean", "weighted"])
def test_long_bags_and_ids_seen_often_sum_in_position_order(kernels, mode):
    """Bags of 0 to 18 ids and ids seen ~57 times: the kernels' loads four or eight at a time and the
    remainder after them give the host's bits."""
    rng = np.random.default_rng(11)
    offsets = np.concatenate([[0], np.cumsum(np.arange(19))]).astype(np.int64)
    ids = rng.integers(0, 3, int(offsets[-1])).astype(np.int64)
    weights = rng.standard_normal(ids.shape[0]).astype(np.float32) if mode == "weighted" else None
    plan = plan_bags(ids, offsets, weights, mean=mode == "mean")
    records = (rng.standard_normal((4, 7)) * 100).astype(np.float32)
    slots = np.array([2, 0, 3], dtype=np.int64)[: plan.uids.shape[0]]
    want = np.empty((plan.num_bags, 6), dtype=np.float32)
    w = weights if weights is not None else np.empty(0, dtype=np.float32)
    pool_kernel(6, False, weights is not None)(records, slots, plan.inverse, False, 0, offsets, w, plan.mean, want)
    got = kernels.pool(records, slots, plan.inverse, offsets, weights, plan.mean, 6)
    assert np.array_equal(_bits(got), want.view(np.uint32))
    grad_out = (rng.standard_normal((plan.num_bags, 6)) * 10).astype(np.float32)
    want_sum, _ = reduce_bag_grads(plan, grad_out)
    got_sum, _ = kernels.reduce_bags(grad_out, group_bag_positions(plan))
    assert np.array_equal(_bits(got_sum), want_sum.view(np.uint32))


@pytest.mark.parametrize("repeats", [REDUCE_CHUNK, REDUCE_CHUNK + 9, 2 * REDUCE_CHUNK + 1])
def test_an_id_of_several_chunks_is_reduced_as_on_the_host(kernels, repeats):
    """Two ids past REDUCE_CHUNK positions among ids of one: chunk sums, then their sum, bitwise."""
    rng = np.random.default_rng(repeats)
    many = np.concatenate([np.full(repeats, 7), np.full(REDUCE_CHUNK + 3, 2), np.arange(10, 30)])
    ids = rng.permutation(many).astype(np.int64)
    offsets = np.concatenate([np.arange(0, ids.shape[0], 5), [ids.shape[0]]]).astype(np.int64)
    weights = np.abs(rng.standard_normal(ids.shape[0])).astype(np.float32)  # no inf - inf below
    plan = plan_bags(ids, offsets, weights)
    grad_out = (rng.standard_normal((plan.num_bags, 4)) * 10).astype(np.float32)
    grad_out[3, 1] = np.inf  # a non-finite sum is flagged alike, in a chunked id or not
    want, want_bad = reduce_bag_grads(plan, grad_out)
    got, bad = kernels.reduce_bags(grad_out, group_bag_positions(plan))
    assert np.array_equal(_bits(got), want.view(np.uint32))
    assert bad.tolist() == want_bad.tolist() and want_bad.any()


OPTIMIZERS = [SGD(lr=0.1), Adagrad(lr=0.05, eps=1e-8), RowWiseAdagrad(lr=0.3, eps=1e-6), Adam(lr=0.01)]


def _records_for(opt, rng, cap: int, dim: int) -> np.ndarray:
    """Rows with state an earlier run could have left: sums of squares >= 0, Adam's count an integer."""
    width = dim + opt.state_width(dim) + 3  # + padding, never touched
    records = rng.standard_normal((cap, width)).astype(np.float32)
    if opt.name in ("adagrad", "rowwise_adagrad"):
        records[:, dim : dim + opt.state_width(dim)] **= 2
    if opt.name == "adam":
        records[:, 2 * dim : 3 * dim] **= 2
        records[:, 3 * dim] = rng.choice([0, 1, 7, 999, 123_456], cap)  # the count, before this step
    return records


WEIGHT_DECAY = 0.05  # lr * WEIGHT_DECAY < 1 for every optimizer above


def _decayed(opt, decay: str | None):
    """``opt`` with weight decay in mode ``decay`` ("l2", "decoupled"), or as it is (None)."""
    if decay is None:
        return opt
    return dataclasses.replace(opt, weight_decay=WEIGHT_DECAY, weight_decay_mode=decay)


@pytest.mark.parametrize("decay", [None, "l2", "decoupled"])
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("opt", OPTIMIZERS, ids=lambda o: o.name)
def test_update_equals_the_host_kernel(kernels, opt, seed, decay):
    opt = _decayed(opt, decay)
    rng = np.random.default_rng(seed)
    dim, cap = 7, 10
    records = _records_for(opt, rng, cap, dim)
    slots = rng.permutation(cap)[:6].astype(np.int64)
    grads = (rng.standard_normal((6, dim)) * 3).astype(np.float32)
    grads[0] = 0.0  # a row with a zero gradient still advances its state
    want = records.copy()
    CPU_KERNELS[opt.name](want, slots, grads, opt.params())
    got = records.copy()
    kernels.update(opt, got, slots, grads)
    assert np.array_equal(_bits(got), want.view(np.uint32))
    assert not np.array_equal(got, records)  # it did something


@pytest.mark.parametrize("decay", ["l2", "decoupled"])
@pytest.mark.parametrize("opt", OPTIMIZERS, ids=lambda o: o.name)
def test_weight_decay_changes_every_updated_row(kernels, opt, decay):
    """Decay is not silently dropped: each updated row's weights differ from the undecayed update's,
    a row with a zero gradient included (SGD's then, exactly: ``c * w`` or ``w - lr * (wd * w)``)."""
    rng = np.random.default_rng(5)
    dim, cap = 7, 8
    records = _records_for(opt, rng, cap, dim)
    slots = rng.permutation(cap)[:5].astype(np.int64)
    grads = (rng.standard_normal((5, dim)) * 3).astype(np.float32)
    grads[0] = 0.0
    plain = records.copy()
    kernels.update(opt, plain, slots, grads)
    got = records.copy()
    kernels.update(_decayed(opt, decay), got, slots, grads)
    assert (got[slots, :dim] != plain[slots, :dim]).any(axis=1).all()
    if opt.name == "sgd":
        f32 = np.float32
        lr, wd, w = f32(opt.lr), f32(WEIGHT_DECAY), records[slots[0], :dim]
        want = (f32(1.0) - lr * wd) * w if decay == "decoupled" else w - lr * (wd * w)
        assert np.array_equal(got[slots[0], :dim].view(np.uint32), want.view(np.uint32))


def test_empty_launches_do_nothing(kernels):
    records = np.ones((4, 3), dtype=np.float32)
    none = np.empty(0, dtype=np.int64)
    assert kernels.gather(records, none, none, 3).shape == (0, 3)
    assert kernels.pool(records, none, none, np.zeros(1, dtype=np.int64), None, False, 3).shape == (0, 3)
    kernels.update(SGD(), records, none, np.empty((0, 3), dtype=np.float32))
    assert (records == 1).all()


@pytest.mark.parametrize("base", [0.9, 0.999, 0.5, 0.0, 1.0 - 2.0**-30])
def test_power_by_squaring_is_close_to_pow(base):
    """Adam's bias correction: the same multiplies on both sides, and within float32 of libm's ``pow``."""
    for n in (0, 1, 2, 3, 10, 1000, 2**24):
        got = pow_by_squaring(base, n)
        assert np.float32(got) == pytest.approx(np.float32(base**n), rel=1e-6, abs=1e-45)


@pytest.mark.parametrize("arch", ["compute_80", "compute_90"])
def test_the_cuda_c_source_compiles_with_nvrtc_and_fuses_nothing(arch):
    """NVRTC (the nvidia-cuda-nvrtc wheel of the test extra; no GPU needed) compiles native/ for
    A100- and H100-class GPUs with the step's options, every kernel is there, and no multiply-add is
    fused: the CPU twins never fuse one."""
    ptx = nvrtc_ptx(arch)
    if ptx is None:
        pytest.skip("NVRTC is not installed (pip install nvidia-cuda-nvrtc)")
    for name in KERNEL_NAMES:
        assert f".entry {name}(" in ptx
    assert "fma." not in ptx
    assert "add.rn.f32" in ptx and "mul.rn.f32" in ptx


def test_a_bad_kernels_flag_is_a_config_error(monkeypatch):
    monkeypatch.setenv(KERNELS_ENV, "cutlass")
    with pytest.raises(ConfigError, match="native"):
        kernels_for(np)


def test_a_launch_with_a_wrong_dtype_is_refused_before_the_kernel_reads_it():
    """The CUDA C kernels read raw pointers: a float64 matrix or an int32 slot array would be read
    as other bytes, so the launch checks each argument against the kernel's signature first."""
    rows = np.zeros((4, 3), dtype=np.float32)
    idx = np.zeros(2, dtype=np.int64)
    assert len(expand("gather_rows", (rows, idx, idx, rows))) == 4 + 6
    with pytest.raises(TypeError, match="argument 0 must be a C-contiguous array f4:2"):
        expand("gather_rows", (rows.astype(np.float64), idx, idx, rows))
    with pytest.raises(TypeError, match="argument 1"):
        expand("gather_rows", (rows, idx.astype(np.int32), idx, rows))
    with pytest.raises(TypeError, match="argument 3"):
        expand("gather_rows", (rows, idx, idx, rows[:, :2]))  # not contiguous
    with pytest.raises(TypeError, match="takes 4 arguments"):
        expand("gather_rows", (rows, idx, idx))
