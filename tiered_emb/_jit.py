"""Numba building blocks shared by the step's kernels and the caches: prefetch hints,
stack arrays, the thread count a batch's kernels run on, and a row copy on the threads.

Nothing here changes a result: prefetches are hints, and every parallel kernel sums in a
fixed order whatever the thread count.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from typing import Any, TypeVar, overload

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

_F = TypeVar("_F", bound=Callable[..., Any])


@overload
def kernel(fn: _F, /) -> _F: ...


@overload
def kernel(fn: None = None, /, **options: Any) -> Callable[[_F], _F]: ...


def kernel(fn: Any = None, /, **options: Any) -> Any:
    """``numba.njit(cache=True, nogil=True, **options)`` for a kernel that makes no array
    (it writes into the arrays it is given and returns scalars, or nothing): compiled
    without Numba's reference counting.

    Numba counts a reference to each array an inlined helper or a called kernel is given,
    and its pass that removes the pairs gives up on loops of many shapes: the counts then
    run at every call, each an atomic operation, and a loop that calls such helpers runs
    several times slower (docs/benchmarks.md, "Kernel choices").  The arrays a kernel is
    given outlive its call, so it needs no counts; Numba refuses to compile a kernel so
    built that makes an array, or returns one it was not given.  Use with or without
    arguments: ``@kernel``, ``@kernel(parallel=True)``."""
    options = {"cache": True, "nogil": True, "_nrt": False, **options}
    if fn is None:
        return numba.njit(**options)
    return numba.njit(**options)(fn)


# Rows this many positions ahead are prefetched by the pooling loops: a row read at
# random from a large table misses the caches, and the loop's own loads cannot run far
# enough ahead to hide it (docs/benchmarks.md, "Kernel choices").
PREFETCH_DISTANCE = 8
#: The same for loops that read whole rows at random from a table far larger than the caches
#: (the forward's pooling, the SSD tier's gather from its file): a row from memory takes
#: longer than pooling or checking eight, so they look further ahead (docs/benchmarks.md).
ROW_PREFETCH_DISTANCE = 24


@intrinsic
def prefetch_hint(typingctx, arr, idx):
    """LLVM's prefetch of ``arr[idx]`` (read, keep in all cache levels; ``idx`` an integer or
    a tuple of them, in bounds): a hint to the CPU, no effect on results."""

    def codegen(context, builder, signature, args):
        aty, ity = signature.args
        ary = context.make_array(aty)(context, builder, args[0])
        idxs = cgutils.unpack_tuple(builder, args[1]) if isinstance(ity, types.BaseTuple) else [args[1]]
        ptr = cgutils.get_item_pointer(context, builder, aty, ary, idxs, wraparound=False)
        i8p = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]), "llvm.prefetch.p0"
        )
        builder.call(fn, [builder.bitcast(ptr, i8p), i32(0), i32(3), i32(1)])
        return context.get_dummy_value()

    return types.void(arr, idx), codegen


def _local_array(n, dtype, llvm_type, itemsize: int):
    """The typing and codegen of a ``dtype`` array of ``n`` on the stack (:func:`local_f32`)."""
    if not isinstance(n, types.IntegerLiteral):
        return None
    size = n.literal_value
    arrty = types.Array(dtype, 1, "C")

    def codegen(context, builder, signature, args):
        ptr = cgutils.alloca_once(builder, llvm_type, size=size)
        ary = context.make_array(arrty)(context, builder)
        intp = context.get_value_type(types.intp)
        context.populate_array(
            ary, data=ptr, shape=[intp(size)], strides=[intp(itemsize)], itemsize=intp(itemsize), meminfo=None
        )
        return ary._getvalue()

    return arrty(n), codegen


@intrinsic
def local_f32(typingctx, n):
    """A float32 array of ``n`` (a compile-time integer) on the calling function's stack.

    Uninitialised, and valid only within the function (a prange body's array lives as
    long as its thread's share of the loop).  Where ``np.zeros(n)`` takes a heap block
    per call, this takes none, and a small fixed-size array stays in registers: a bag's
    running sum of 128 floats in 16 vector registers instead of a memory round trip per
    row (docs/benchmarks.md, "Kernel choices").
    """
    return _local_array(n, types.float32, ir.FloatType(), 4)


@intrinsic
def local_u32(typingctx, n):
    """A uint32 array of ``n`` on the stack, as :func:`local_f32`."""
    return _local_array(n, types.uint32, ir.IntType(32), 4)


@intrinsic
def f32_bits(typingctx, x):
    """The bits of float32 ``x`` as a uint32 (a bitcast: no conversion)."""
    if x != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(types.float32), codegen


@intrinsic
def f32_of_bits(typingctx, b):
    """The float32 whose bits are the low 32 bits of unsigned ``b`` (a bitcast)."""
    if not isinstance(b, types.Integer) or b.signed:
        return None

    def codegen(context, builder, signature, args):
        word = args[0] if b.bitwidth == 32 else builder.trunc(args[0], ir.IntType(32))
        return builder.bitcast(word, ir.FloatType())

    return types.float32(b), codegen


@intrinsic
def f32_of_half(typingctx, h):
    """The float32 value of IEEE binary16 bits ``h`` (uint16): LLVM's exact ``fpext half``,
    one vector instruction for 16 values where the CPU has F16C (:data:`HAS_F16C`)."""
    if h != types.uint16:
        return None

    def codegen(context, builder, signature, args):
        half = builder.bitcast(args[0], ir.HalfType())
        return builder.fpext(half, ir.FloatType())

    return types.float32(types.uint16), codegen


def _host_has_f16c() -> bool:
    from llvmlite import binding

    try:
        return "+f16c" in binding.get_host_cpu_features().flatten().split(",")
    except RuntimeError:  # (features unknown: the table lookup, which needs none)
        return False


#: whether this CPU converts binary16 in hardware (x86's F16C); elsewhere ``fpext half``
#: would call a runtime helper that Numba's JIT may not link, so kernels take a table
HAS_F16C = _host_has_f16c()


@numba.njit(inline="always")
def square_sums4(grads, u0):
    """The float64 sums of squares of rows ``u0 .. u0 + 3`` of ``grads`` (float32), each in
    column order: four chains of dependent adds side by side, hiding each other's latency
    (row-wise Adagrad's means)."""
    a0 = 0.0
    a1 = 0.0
    a2 = 0.0
    a3 = 0.0
    for j in range(grads.shape[1]):
        g0 = np.float64(grads[u0, j])
        g1 = np.float64(grads[u0 + 1, j])
        g2 = np.float64(grads[u0 + 2, j])
        g3 = np.float64(grads[u0 + 3, j])
        a0 += g0 * g0
        a1 += g1 * g1
        a2 += g2 * g2
        a3 += g3 * g3
    return a0, a1, a2, a3


@numba.njit(inline="always")
def prefetch_row_hint(records, row):
    """Prefetch every 64-byte line of ``records[row]`` (the records as any 2-D view)."""
    for c in range(0, records.shape[1], 64 // records.itemsize):
        prefetch_hint(records, (row, c))


# Below this many float32 elements of work a batch runs its kernels on one thread: waking
# the thread pool costs more than the work, and far more when torch's OpenMP threads are
# still spinning on the same cores.  Results do not depend on the thread count.
_SERIAL_BELOW = 1 << 16


def split_parts(items: int, least: int) -> int:
    """How many slices a batch of ``items`` independent items is cut into for Numba's threads:
    the current thread count (see :func:`threads_for`), each slice at least ``least`` items."""
    return max(1, min(numba.get_num_threads(), items // max(least, 1)))


def one_thread(when: bool = True):
    """Numba's kernels on the calling thread alone while in the block, ``when`` true: where
    other work holds the cores (the SSD tier's writer), a kernel cut in halves waits for
    its slowest half.  Results do not depend on it."""
    return _one_thread() if when else _NOTHING


_NOTHING = nullcontext()


@contextmanager
def _one_thread():
    if numba.get_num_threads() == 1:
        yield
        return
    before = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        yield
    finally:
        numba.set_num_threads(before)


def threads_for(work: int):
    """:func:`one_thread` for a batch of ``work`` float32 elements too small to share."""
    return one_thread(work < _SERIAL_BELOW)


@kernel(parallel=True)
def _take_rows(rows, at, out):
    n = at.shape[0]
    for i in numba.prange(n):
        if i + ROW_PREFETCH_DISTANCE < n:
            for c in range(0, rows.shape[1], 16):
                prefetch_hint(rows, (at[i + ROW_PREFETCH_DISTANCE], c))
        src = rows[at[i]]
        dst = out[i]
        for k in range(out.shape[1]):
            dst[k] = src[k]


def take_rows(rows: np.ndarray, at: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """``rows[at]`` as float32 (``at`` int64), rows copied side by side on Numba's threads
    with the GIL let go (NumPy's fancy indexing holds it); into ``out`` (float32, C order,
    ``at``'s rows by ``rows``' width) where given."""
    if out is None:
        out = np.empty((at.shape[0], rows.shape[1]), dtype=np.float32)
    elif out.shape != (at.shape[0], rows.shape[1]) or out.dtype != np.float32 or not out.flags.c_contiguous:
        raise ValueError(
            f"take_rows: out is {out.dtype} {out.shape}, not float32 ({at.shape[0]}, {rows.shape[1]}) in C order"
        )
    _take_rows(np.ascontiguousarray(rows, dtype=np.float32), np.ascontiguousarray(at, dtype=np.int64), out)
    return out


@kernel
def _move_span(src, src_at, dst, dst_at, width, lo, hi):
    """The moves ``lo:hi`` of :func:`move_rows`, each row's lines fetched
    ``ROW_PREFETCH_DISTANCE`` moves ahead (its source's and its destination's: each most
    often a cache miss of its own).

    One flat loop, the positions' presence tested once: the same moves through an inlined
    per-row helper compiled to code many times slower (docs/benchmarks.md, "Kernel choices")."""
    by_src = src_at.shape[0] > 0
    by_dst = dst_at.shape[0] > 0
    for i in range(lo, hi):
        j = i + ROW_PREFETCH_DISTANCE
        if j < hi:
            if by_src and src_at[j] >= 0:
                for c in range(0, width, 16):
                    prefetch_hint(src, (src_at[j], c))
            if by_dst and dst_at[j] >= 0:
                for c in range(0, width, 16):
                    prefetch_hint(dst, (dst_at[j], c))
        d = dst_at[i] if by_dst else i
        if d < 0:
            continue
        s = src_at[i] if by_src else i
        for k in range(width):
            dst[d, k] = src[s, k]


@kernel(parallel=True)
def _move_rows(src, src_at, dst, dst_at, width, parts):
    n = max(src_at.shape[0], dst_at.shape[0])
    for p in numba.prange(parts):
        _move_span(src, src_at, dst, dst_at, width, n * p // parts, n * (p + 1) // parts)


_ALL = np.empty(0, dtype=np.int64)


def move_rows(
    src: np.ndarray, src_at: np.ndarray | None, dst: np.ndarray, dst_at: np.ndarray | None, width: int
) -> None:
    """``dst[dst_at[i], :width] = src[src_at[i], :width]`` for every ``i`` with ``dst_at[i] >= 0``
    (``src_at`` None or empty: ``src[i]``; ``dst_at`` None or empty: ``dst[i]``); float32 host
    arrays, int64 positions, each destination distinct.  One copy a row, side by side on
    Numba's threads with the GIL let go (a move of under ``_SERIAL_BELOW`` floats on the
    calling thread): the row movement of the tier path, whatever the arrays' padding."""
    src_at = _ALL if src_at is None else src_at
    dst_at = _ALL if dst_at is None else dst_at
    n = max(src_at.shape[0], dst_at.shape[0])
    if n * width < _SERIAL_BELOW:
        _move_span(src, src_at, dst, dst_at, width, 0, n)
    else:
        _move_rows(src, src_at, dst, dst_at, width, split_parts(n, 256))


@kernel
def pow_by_squaring(base, n):
    """``base ** n`` (float64, ``n`` an int64 >= 0) by squaring, IEEE multiplies only.

    Adam's bias corrections use it rather than ``pow``: a libm's ``pow`` and CUDA's differ
    in their last bits, products do not, so the GPU twin
    (:func:`tiered_emb.step.device.cuda_kernels.pow_by_squaring`) gets the same bytes.
    """
    result = 1.0
    b = base
    while n > 0:
        if n & 1:
            result = result * b
        b = b * b
        n >>= 1
    return result
