"""The step's device operations: kernel launches over one array module.

:class:`DeviceKernels` is what a :class:`~tiered_emb.step.resolve.Resolver` holds as
``kernels`` when the HBM tier lives on a GPU (``xp`` is CuPy): the pooled forward, the
gather, the backward's reduce and the optimizer updates then run as CUDA kernels on the
HBM records, bitwise the host's Numba kernels.  ``None`` is the host path.  The kernels are
the CUDA C ones of ``native/`` (:mod:`tiered_emb.step.device.native`) or, with
``TIERED_EMB_CUDA_KERNELS=numba``, their numba-cuda twins (:mod:`tiered_emb.step.device.cuda_kernels`);
both take the same arguments in the same order.

``TIERED_EMB_DEVICE_KERNELS=1`` makes a store whose HBM tier is in host memory (NumPy)
run every step through the same launches too.  Under Numba's CUDA simulator
(``NUMBA_ENABLE_CUDASIM=1``) that is how CI trains, checkpoints and reopens a whole store
on the GPU's code path without a GPU (tests/step/device/test_device_path.py); the kernels then work on
the host arrays in place, as on device memory.  On a machine with a GPU and no simulator
Numba copies each host array to the device and the whole of it back after each launch:
slow, and a prefetch thread's rows placed meanwhile would be overwritten, so there it is a
check for one thread with no prefetch, not a mode to train in.
"""

from __future__ import annotations

import os
import warnings

import numpy as np

from tiered_emb._backend import GPU_HINT, to_host
from tiered_emb.errors import ConfigError, DeviceError
from tiered_emb.step.device.staging import Stager
from tiered_emb.step.reduce import REDUCE_CHUNK

# Numba's performance hints that the step accepts: a small batch launches few blocks, and the
# host-memory check (TIERED_EMB_DEVICE_KERNELS=1) hands the kernels host arrays on purpose.  numba-cuda
# wraps the message in a terminal's bold escape, and a filter's pattern must match from its start.
_ACCEPTED_HINTS = (
    r"(\x1b\[[0-9;]*m)?(Grid size \d+ will likely result in GPU under-utilization|Host array used in CUDA kernel)"
)


class DeviceKernels:
    """The step's kernels launched on arrays of ``xp`` (CuPy; NumPy under the simulator).

    Every method takes the tier's ``records`` (float32 (cap, W)) where it reads or writes
    rows, host or ``xp`` index arrays (a launch's host arrays go up together in one staged
    copy, :meth:`stage`), and returns ``xp`` arrays.  The CUDA C kernels and the staged
    copies go to CuPy's current stream, the numba twins to Numba's default stream: both the
    legacy default stream, where torch's kernels go too unless a caller makes another
    stream current, so everything runs in the order it is issued.
    """

    def __init__(self, xp, backend=None):
        self.xp = xp
        self.native = backend
        self.in_place = None
        self.no_weights = xp.empty(0, dtype=xp.float32)  # made once: a copy to the device costs a call
        self.stager = None if xp is np else Stager(xp)
        if backend is not None:
            # CUDA C (native/): CuPy's RawModule on a GPU, or the host build the tests run
            self.simulated = xp is np
            return
        from tiered_emb.step.device import cuda_kernels  # imports numba.cuda: only where it is used

        self.cuda = cuda_kernels
        self.simulated = cuda_kernels.SIMULATED
        if self.simulated:
            # The simulator copies a NumPy argument in and the whole of it back out after the
            # kernel, which would write stale rows over those a prefetch thread placed meanwhile;
            # its device-array wrapper hands the kernel the array itself, as device memory is.
            from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

            self.in_place = FakeCUDAArray

    def launch(self, name: str, blocks: int, threads: int, *args) -> None:
        """The kernel ``name`` over ``blocks`` blocks of ``threads`` threads: the CUDA C one where a
        backend was given, else the numba-cuda twin, without Numba's hints the step accepts (above)."""
        if self.native is not None:
            self.native.launch(name, blocks, threads, *args)
            return
        kernel = getattr(self.cuda, name)
        if self.simulated:
            kernel[blocks, threads](*(self.in_place(a) if isinstance(a, np.ndarray) else a for a in args))
            return
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_ACCEPTED_HINTS)
            kernel[blocks, threads](*args)

    def threads(self, dim: int) -> int:
        """Threads per block for rows of ``dim`` floats: whole warps on a GPU, a few on the host
        (the simulator's, one Python thread each; fewer than ``dim`` so the column loops stride)."""
        if self.simulated:
            return max(1, min(dim, 3))
        return min(256, max(32, -(-dim // 32) * 32))

    def asarray(self, a, dtype=None):
        """``a`` on the device (itself when it is already an ``xp`` array of ``dtype``)."""
        if self.xp is np:
            return np.ascontiguousarray(a, dtype=dtype)
        return self.xp.ascontiguousarray(self.xp.asarray(a, dtype=dtype))

    def stage(self, *pairs) -> list:
        """Each ``(array, dtype)`` as a contiguous ``xp`` array of ``dtype``: the host arrays go up
        together in one copy (:class:`~tiered_emb.step.device.staging.Stager`), device ones as they are."""
        if self.stager is None:
            return [np.ascontiguousarray(a, dtype=dtype) for a, dtype in pairs]
        out = [None if isinstance(a, np.ndarray) else self.asarray(a, dtype) for a, dtype in pairs]
        on_host = [i for i, got in enumerate(out) if got is None]
        if on_host:
            for i, dev in zip(on_host, self.stager.put([pairs[i] for i in on_host]), strict=True):
                out[i] = dev
        return out

    def to_host(self, a) -> np.ndarray:
        return to_host(a)

    def pool(self, records, slots, inverse, offsets, weights, mean: bool, dim: int):
        """Bags pooled from ``records[slots[inverse]]``: float32 (B, dim) on the device.

        ``offsets`` int64 (B+1,); ``weights`` float32 (n,) or None; ``mean`` divides by the
        bag length.  Bitwise :func:`tiered_emb.step.gather.pool_kernel`.
        """
        num_bags = offsets.shape[0] - 1
        out = self.xp.empty((num_bags, dim), dtype=self.xp.float32)
        if num_bags:
            use_w = weights is not None
            args = [(slots, np.int64), (inverse, np.int64), (offsets, np.int64)]
            staged = self.stage(*args, *([(weights, np.float32)] if use_w else []))
            w = staged[3] if use_w else self.no_weights
            self.launch("pool_bags", num_bags, self.threads(dim), records, *staged[:3], w, use_w, bool(mean), out)
        return out

    def gather(self, records, slots, inverse, dim: int):
        """Rows ``records[slots[inverse], :dim]``: float32 (n, dim) on the device."""
        n = inverse.shape[0]
        out = self.xp.empty((n, dim), dtype=self.xp.float32)
        if n:
            staged = self.stage((slots, np.int64), (inverse, np.int64))
            self.launch("gather_rows", n, self.threads(dim), records, *staged, out)
        return out

    def reduce_bags(self, grad_out, grouped: tuple[np.ndarray, np.ndarray, np.ndarray]):
        """Each unique id's gradient from the bags' ``grad_out`` (B, dim; host or device).

        ``grouped``: :func:`tiered_emb.step.reduce.group_bag_positions`.  Returns
        ``(summed, bad)``: float32 (k, dim) on the device and uint8 (k,) on the host (1 where
        a sum is not finite), bitwise :func:`tiered_emb.step.reduce.reduce_bag_grads`.
        """
        starts, bag, scale = grouped
        if bag.dtype != np.int32:
            raise DeviceError(
                f"a batch of {grad_out.shape[0]} bags: the device reduce numbers bags as int32",
                "split the batch into batches of fewer than 2**31 bags",
            )
        starts = to_host(starts)
        k = starts.shape[0] - 1
        dim = grad_out.shape[1]
        out = self.xp.empty((k, dim), dtype=self.xp.float32)
        bad = self.xp.zeros(k, dtype=self.xp.uint8)
        if k:
            lengths = np.diff(starts)
            several = np.flatnonzero(lengths > REDUCE_CHUNK)  # ids summed a chunk at a time
            chunks = -(-lengths[several] // REDUCE_CHUNK)
            part_first = np.zeros(several.shape[0] + 1, dtype=np.int64)  # id i's chunks in ``partial``
            np.cumsum(chunks, out=part_first[1:])
            first = np.repeat(starts[several], chunks)
            chunk_lo = first + (np.arange(part_first[-1]) - np.repeat(part_first[:-1], chunks)) * REDUCE_CHUNK
            chunk_hi = np.minimum(chunk_lo + REDUCE_CHUNK, np.repeat(starts[several + 1], chunks))
            starts_d, bag_d, scale_d, several_d, part_first_d, lo_d, hi_d = self.stage(
                (starts, np.int64),
                (bag, np.int32),
                (scale, np.float32),
                (several, np.int64),
                (part_first, np.int64),
                (chunk_lo, np.int64),
                (chunk_hi, np.int64),
            )
            threads = self.threads(dim)
            grads = self.asarray(grad_out, np.float32)
            self.launch("reduce_ids", k, threads, grads, starts_d, bag_d, scale_d, out, bad)
            if several.shape[0]:
                partial = self.xp.empty((int(part_first[-1]), dim), dtype=self.xp.float32)
                self.launch("reduce_chunks", int(part_first[-1]), threads, grads, lo_d, hi_d, bag_d, scale_d, partial)
                self.launch("reduce_partials", several.shape[0], threads, part_first_d, several_d, partial, out, bad)
        return out, self.to_host(bad)

    def update(self, opt, records, slots, grads) -> None:
        """The optimizer ``opt`` once per row: ``records[slots[k]]`` with ``grads[k]`` (host or
        device, float32 (k, dim)); ``slots`` distinct.  Bitwise :data:`tiered_emb.step.update.CPU_KERNELS`."""
        k = slots.shape[0]
        if k:
            staged = self.stage((slots, np.int64), (grads, np.float32), (opt.params(), np.float32))
            self.launch(f"{opt.name}_update", k, self.threads(grads.shape[1]), records, *staged)


KERNELS_ENV = "TIERED_EMB_CUDA_KERNELS"


def kernels_for(xp) -> DeviceKernels | None:
    """The step's device kernels for an HBM tier on ``xp``, None for the host's Numba path.

    On a GPU: the CUDA C kernels (:mod:`tiered_emb.step.device.native`), or their numba-cuda twins with
    ``TIERED_EMB_CUDA_KERNELS=numba``.  On the host: None, or the numba twins with
    ``TIERED_EMB_DEVICE_KERNELS=1`` (see the module docstring).
    """
    choice = os.environ.get(KERNELS_ENV, "native").strip().lower() or "native"
    if choice not in ("native", "numba"):
        raise ConfigError(f"{KERNELS_ENV}={choice!r} names no kernels", "use 'native' (the default) or 'numba'")
    if xp is np:
        if os.environ.get("TIERED_EMB_DEVICE_KERNELS", "") in ("", "0"):
            return None
        return _numba_kernels(xp)
    if choice == "numba":
        return _numba_kernels(xp)
    from tiered_emb.step.device.native import cupy_module

    return DeviceKernels(xp, cupy_module(xp.cuda.Device().id))


def _numba_kernels(xp) -> DeviceKernels:
    kernels = DeviceKernels(xp)
    if kernels.simulated and xp is not np:
        raise DeviceError(
            "NUMBA_ENABLE_CUDASIM=1 runs the step's kernels in Numba's simulator, which cannot read GPU arrays",
            "unset NUMBA_ENABLE_CUDASIM, or use device='cpu' with TIERED_EMB_DEVICE_KERNELS=1",
        )
    if not kernels.simulated:
        from numba import cuda

        if not cuda.is_available():
            raise DeviceError(
                "the step's numba-cuda kernels were asked for (TIERED_EMB_CUDA_KERNELS=numba or "
                "TIERED_EMB_DEVICE_KERNELS=1) but Numba's CUDA target finds no usable GPU",
                GPU_HINT + ", or NUMBA_ENABLE_CUDASIM=1 to run the kernels in Numba's simulator",
            )
    return kernels


__all__ = ["KERNELS_ENV", "DeviceKernels", "kernels_for"]
