"""The step's CUDA C kernels (``native/step_kernels.cu``): their source, its compile options, their launch.

On a GPU the step launches these through CuPy's ``RawModule`` (NVRTC compiles the source
once per process and device).  A launch then costs little host time; the numba-cuda
twins (:mod:`tiered_emb.step.device.cuda_kernels`) cost far more a launch, because numba-cuda
types every CuPy argument at every call (figures: docs/gpu.md).  Both give the bytes of
the host's Numba kernels, which are the reference the tests hold them to.

The launch convention is the one the source declares: every array argument is passed as
its pointer followed by its extents (int64; one for a 1-D array, two for a 2-D one), every
scalar as an int64.  :func:`expand` builds that list, for CuPy here and for the host build
the tests run without a GPU (:mod:`tiered_emb.testing.native_host`).
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import numpy as np

from tiered_emb.errors import DeviceError
from tiered_emb.step.reduce import REDUCE_CHUNK

SOURCE_NAME = "step_kernels.cu"
# Each kernel's parameters as the source declares them: an array as its dtype and ndim ("f4:2" is a
# float32 matrix), a scalar as "s".  A launch checks its arguments against them: a wrong dtype would
# otherwise be read as another type's bytes.
_UPDATE = ("f4:2", "i8:1", "f4:2", "f4:1")
SIGNATURES = {
    "pool_bags": ("f4:2", "i8:1", "i8:1", "i8:1", "f4:1", "s", "s", "f4:2"),
    "gather_rows": ("f4:2", "i8:1", "i8:1", "f4:2"),
    "reduce_ids": ("f4:2", "i8:1", "i4:1", "f4:1", "f4:2", "u1:1"),
    "reduce_chunks": ("f4:2", "i8:1", "i8:1", "i4:1", "f4:1", "f4:2"),
    "reduce_partials": ("i8:1", "i8:1", "f4:2", "f4:2", "u1:1"),
    "sgd_update": _UPDATE,
    "adagrad_update": _UPDATE,
    "rowwise_adagrad_update": _UPDATE,
    "adam_update": _UPDATE,
}
KERNEL_NAMES = tuple(SIGNATURES)
# NVRTC's options: no contraction into fused multiply-adds anywhere (the _rn intrinsics already
# forbid it where it matters), and the one constant the host's reduce shares
NVRTC_OPTIONS = ("--fmad=false", "-std=c++14", f"-DREDUCE_CHUNK={REDUCE_CHUNK}")


def native_dir() -> Path:
    """The folder holding the CUDA C sources: ``tiered_emb/native`` in a wheel, ``native/`` in a checkout."""
    here = Path(__file__).resolve().parents[2]
    for folder in (here / "native", here.parent / "native"):
        if (folder / SOURCE_NAME).is_file():
            return folder
    raise DeviceError(
        f"the step's CUDA C source {SOURCE_NAME} is in neither {here / 'native'} nor {here.parent / 'native'}",
        "reinstall tiered-emb (the wheel ships it), or run from a checkout that has native/",
    )


@cache
def source() -> str:
    return (native_dir() / SOURCE_NAME).read_text(encoding="utf-8")


def expand(name: str, args) -> list:
    """The arguments of kernel ``name`` in the source's convention: an array becomes itself and its
    extents, an int or bool an int64.  Raises TypeError where one does not match the signature."""
    signature = SIGNATURES[name]
    if len(args) != len(signature):
        raise TypeError(f"{name} takes {len(signature)} arguments, got {len(args)}")
    out: list = []
    for pos, (a, want) in enumerate(zip(args, signature, strict=True)):
        if want == "s":
            if not isinstance(a, (bool, int, np.integer, np.bool_)):
                raise TypeError(f"{name} argument {pos} must be an int or a bool, not {type(a).__name__}")
            out.append(np.int64(a))
            continue
        got = f"{np.dtype(a.dtype).str[1:]}:{a.ndim}" if hasattr(a, "dtype") else type(a).__name__
        if got != want or not a.flags.c_contiguous:
            raise TypeError(f"{name} argument {pos} must be a C-contiguous array {want} (dtype:ndim), got {got}")
        out.append(a)
        out.extend(np.int64(n) for n in a.shape)
    return out


class CupyModule:
    """The source compiled by CuPy's NVRTC for the current device, its kernels by name."""

    def __init__(self, cupy):
        try:
            module = cupy.RawModule(code=source(), options=NVRTC_OPTIONS)
            self.functions = {name: module.get_function(name) for name in KERNEL_NAMES}
        except Exception as err:  # NVRTC missing or too old for the driver: CuPy raises its own types
            raise DeviceError(
                f"CuPy could not compile the step's CUDA C kernels ({type(err).__name__}: {err})",
                "install the CuPy build for the CUDA major version the driver runs (docs/gpu.md), "
                "or TIERED_EMB_CUDA_KERNELS=numba to use the numba-cuda twins",
            ) from err

    def launch(self, name: str, blocks: int, threads: int, *args) -> None:
        self.functions[name]((blocks,), (threads,), tuple(expand(name, args)))


@cache
def cupy_module(device_id: int) -> CupyModule:
    """One compiled module per device and process."""
    import cupy

    with cupy.cuda.Device(device_id):
        return CupyModule(cupy)


__all__ = [
    "KERNEL_NAMES",
    "NVRTC_OPTIONS",
    "SOURCE_NAME",
    "CupyModule",
    "cupy_module",
    "expand",
    "native_dir",
    "source",
]
