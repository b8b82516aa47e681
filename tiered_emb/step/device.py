"""The step's device operations: kernel launches over one array module.

:class:`DeviceKernels` is what a :class:`~tiered_emb.step.resolve.Resolver` holds as
``kernels`` when the HBM tier lives on a GPU (``xp`` is CuPy): the pooled forward, the
gather, the backward's reduce and the optimizer updates then run as CUDA kernels on the
HBM records, bitwise the host's Numba kernels.  ``None`` is the host path.  The kernels are
the CUDA C ones of ``native/`` (:mod:`tiered_emb.step.native`) or, with
``TIERED_EMB_CUDA_KERNELS=numba``, their numba-cuda twins (:mod:`tiered_emb.step.cuda_kernels`);
both take the same arguments in the same order.

``TIERED_EMB_DEVICE_KERNELS=1`` makes a store whose HBM tier is in host memory (NumPy)
run every step through the same launches too.  Under Numba's CUDA simulator
(``NUMBA_ENABLE_CUDASIM=1``) that is how CI trains, checkpoints and reopens a whole store
on the GPU's code path without a GPU (tests/test_device_path.py); the kernels then work on
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
    rows, host or ``xp`` index arrays (copied to the device when they are host arrays), and
    returns ``xp`` arrays.  Launches go to Numba's default stream, the legacy default
    stream, where CuPy's copies in and out and torch's kernels go too unless a caller makes
    another stream current: so they run in the order they are issued.
    """

    def __init__(self, xp, backend=None):
        self.xp = xp
        self.native = backend
        self.in_place = None
        self.no_weights = xp.empty(0, dtype=xp.float32)  # made once: a copy to the device costs a call
        if backend is not None:
            # CUDA C (native/): CuPy's RawModule on a GPU, or the host build the tests run
            self.simulated = xp is np
            return
        from tiered_emb.step import cuda_kernels  # imports numba.cuda: only where it is used

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
            self.launch(
                "pool_bags",
                num_bags,
                self.threads(dim),
                records,
                self.asarray(slots, np.int64),
                self.asarray(inverse, np.int64),
                self.asarray(offsets, np.int64),
                self.asarray(weights, np.float32) if use_w else self.no_weights,
                use_w,
                bool(mean),
                out,
            )
        return out

    def gather(self, records, slots, inverse, dim: int):
        """Rows ``records[slots[inverse], :dim]``: float32 (n, dim) on the device."""
        n = inverse.shape[0]
        out = self.xp.empty((n, dim), dtype=self.xp.float32)
        if n:
            self.launch(
                "gather_rows",
                n,
                self.threads(dim),
                records,
                self.asarray(slots, np.int64),
                self.asarray(inverse, np.int64),
                out,
            )
        return out

    def reduce_bags(self, grad_out, grouped: tuple[np.ndarray, np.ndarray, np.ndarray]):
        """Each unique id's gradient from the bags' ``grad_out`` (B, dim; host or device).

        ``grouped``: :func:`tiered_emb.step.reduce.group_bag_positions`.  Returns
        ``(summed, bad)``: float32 (k, dim) on the device and uint8 (k,) on the host (1 where
        a sum is not finite), bitwise :func:`tiered_emb.step.reduce.reduce_bag_grads`.
        """
        starts, bag, scale = grouped
        starts = to_host(starts)
        k = starts.shape[0] - 1
        dim = grad_out.shape[1]
        out = self.xp.empty((k, dim), dtype=self.xp.float32)
        bad = self.xp.zeros(k, dtype=self.xp.uint8)
        if k:
            chunks = np.maximum(-(-np.diff(starts) // REDUCE_CHUNK), 1)  # every id holds a position
            chunk_first = np.zeros(k + 1, dtype=np.int64)
            np.cumsum(chunks, out=chunk_first[1:])
            several = np.flatnonzero(chunks > 1)
            part_first = np.zeros(k, dtype=np.int64)  # where an id's chunk sums go in ``partial``
            part_first[several[1:]] = np.cumsum(chunks[several])[:-1]
            partial = self.xp.empty((max(int(chunks[several].sum()), 1), dim), dtype=self.xp.float32)
            chunk_first_d = self.asarray(chunk_first)
            part_first_d = self.asarray(part_first)
            threads = self.threads(dim)
            self.launch(
                "reduce_chunks",
                int(chunk_first[k]),
                threads,
                self.asarray(grad_out, np.float32),
                self.asarray(starts, np.int64),
                chunk_first_d,
                part_first_d,
                self.asarray(bag, np.int32),
                self.asarray(scale, np.float32),
                out,
                partial,
                bad,
            )
            if several.shape[0]:
                self.launch(
                    "reduce_partials",
                    several.shape[0],
                    threads,
                    chunk_first_d,
                    part_first_d,
                    self.asarray(several),
                    partial,
                    out,
                    bad,
                )
        return out, self.to_host(bad)

    def update(self, opt, records, slots, grads) -> None:
        """The optimizer ``opt`` once per row: ``records[slots[k]]`` with ``grads[k]`` (host or
        device, float32 (k, dim)); ``slots`` distinct.  Bitwise :data:`tiered_emb.step.update.CPU_KERNELS`."""
        k = slots.shape[0]
        if k:
            self.launch(
                f"{opt.name}_update",
                k,
                self.threads(grads.shape[1]),
                records,
                self.asarray(slots, np.int64),
                self.asarray(grads, np.float32),
                self.asarray(opt.params(), np.float32),
            )


KERNELS_ENV = "TIERED_EMB_CUDA_KERNELS"


def kernels_for(xp) -> DeviceKernels | None:
    """The step's device kernels for an HBM tier on ``xp``, None for the host's Numba path.

    On a GPU: the CUDA C kernels (:mod:`tiered_emb.step.native`), or their numba-cuda twins with
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
    from tiered_emb.step.native import cupy_module

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
