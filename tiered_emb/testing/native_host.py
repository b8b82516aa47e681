"""The step's CUDA C kernels built for the host, run a block and a thread at a time: how CI checks them.

A host C++ compiler builds ``native/step_kernels.cu`` with ``native/host_shim.h`` (the CUDA
built-ins as globals, the ``_rn`` intrinsics as plain IEEE operations, no contraction), and
:class:`HostModule` runs each kernel once per (block, thread) in order, which is a valid
schedule of every kernel in the file (the shim says why).  The tests hold the result to the
host's Numba kernels bitwise, so the CUDA C source's logic (indexing, the order of every
sum, which operation where) is checked on every CI run, without a GPU.

:func:`nvrtc_ptx` compiles the same source with NVRTC (the ``nvidia-cuda-nvrtc`` wheel, no
GPU needed) to the PTX a GPU of a given architecture would run, so CI also checks that the
source compiles as CUDA C and that it holds no fused multiply-add.
"""

from __future__ import annotations

import ctypes
import hashlib
import shutil
import subprocess
from pathlib import Path

import numpy as np

from tiered_emb.step.device.native import KERNEL_NAMES, NVRTC_OPTIONS, SOURCE_NAME, expand, native_dir, source
from tiered_emb.step.reduce import REDUCE_CHUNK

_SHIM = "host_shim.h"


def host_compiler() -> str | None:
    """A C++ compiler on PATH (``c++``, ``g++`` or ``clang++``), or None."""
    return next((path for name in ("c++", "g++", "clang++") if (path := shutil.which(name))), None)


class HostModule:
    """The CUDA C source compiled into a shared library in ``build_dir``; kernels run by :meth:`launch`."""

    def __init__(self, build_dir: Path):
        compiler = host_compiler()
        if compiler is None:
            raise RuntimeError("no C++ compiler (c++, g++ or clang++) on PATH")
        folder = native_dir()
        tag = hashlib.sha256((source() + (folder / _SHIM).read_text(encoding="utf-8")).encode()).hexdigest()[:16]
        lib = Path(build_dir) / f"step_kernels_{tag}.so"
        if not lib.exists():
            cmd = [compiler, "-O2", "-ffp-contract=off", "-fno-fast-math", "-std=c++14", "-shared", "-fPIC"]
            cmd += [f"-DREDUCE_CHUNK={REDUCE_CHUNK}", "-include", str(folder / _SHIM), "-x", "c++"]
            cmd += [str(folder / SOURCE_NAME), "-o", str(lib)]
            subprocess.run(cmd, check=True, capture_output=True, text=True)
        self.lib = ctypes.CDLL(str(lib))
        self.lib.te_host_set.argtypes = [ctypes.c_uint] * 4
        self.functions = {name: getattr(self.lib, name) for name in KERNEL_NAMES}

    def launch(self, name: str, blocks: int, threads: int, *args) -> None:
        c_args = [
            ctypes.c_void_p(a.ctypes.data) if isinstance(a, np.ndarray) else ctypes.c_longlong(int(a))
            for a in expand(name, args)
        ]
        fn = self.functions[name]
        for b in range(blocks):
            for t in range(threads):
                self.lib.te_host_set(b, t, threads, blocks)
                fn(*c_args)


def _nvrtc_lib():
    """libnvrtc from the ``nvidia-cuda-nvrtc`` wheel (CUDA 13 or 12 layout), or None."""
    try:
        import nvidia
    except ImportError:
        return None
    for root in nvidia.__path__:
        for pattern in ("cu13/lib/libnvrtc.so*", "cuda_nvrtc/lib/libnvrtc.so*"):
            for path in sorted(Path(root).glob(pattern)):
                if "builtins" not in path.name and "alt" not in path.name:
                    return ctypes.CDLL(str(path))
    return None


def nvrtc_ptx(arch: str) -> str | None:
    """The source's PTX for ``arch`` (``compute_80``, ``compute_90``) with the step's options, None
    where NVRTC is not installed; raises RuntimeError with NVRTC's log where it does not compile."""
    lib = _nvrtc_lib()
    if lib is None:
        return None
    prog = ctypes.c_void_p()
    check = _nvrtc_check(lib)
    check(lib.nvrtcCreateProgram(ctypes.byref(prog), source().encode(), SOURCE_NAME.encode(), 0, None, None))
    try:
        opts = [o.encode() for o in (*NVRTC_OPTIONS, f"--gpu-architecture={arch}")]
        status = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
        if status != 0:
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(prog, log)
            raise RuntimeError(f"NVRTC could not compile {SOURCE_NAME} for {arch}:\n{log.value.decode()}")
        size = ctypes.c_size_t()
        check(lib.nvrtcGetPTXSize(prog, ctypes.byref(size)))
        ptx = ctypes.create_string_buffer(size.value)
        check(lib.nvrtcGetPTX(prog, ptx))
        return ptx.value.decode()
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def _nvrtc_check(lib):
    lib.nvrtcGetErrorString.restype = ctypes.c_char_p

    def check(status: int) -> None:
        if status != 0:
            raise RuntimeError(f"NVRTC: {lib.nvrtcGetErrorString(status).decode()}")

    return check


__all__ = ["HostModule", "host_compiler", "nvrtc_ptx"]
