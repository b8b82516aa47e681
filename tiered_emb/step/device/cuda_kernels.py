"""The step's GPU kernels, in Numba's CUDA target: pool, gather, reduce, the four optimizer updates.

Each kernel is the device twin of a CPU kernel in :mod:`tiered_emb.step.gather`,
:mod:`tiered_emb.step.reduce` or :mod:`tiered_emb.step.update`, and gives the same bytes:

- the same order of every sum: one block per bag (pool), per unique id (reduce) or per
  row (update), its threads striding over the row's columns, each thread summing its
  column in position order, as the CPU loops do; no atomics, no tree reductions;
- the same roundings: every operation is a libdevice ``*_rn`` intrinsic (``fmul_rn``,
  ``fadd_rn``, ...).  NVVM contracts ``a * b + c`` into one fused multiply-add unless told
  otherwise, and the CPU twin never does; an ``_rn`` intrinsic is a PTX ``mul.rn`` /
  ``add.rn``, which the compiler may not fuse.  Division and square root are the IEEE
  ones (``fdiv_rn``, ``fsqrt_rn``), as NumPy's and LLVM's on the host.

Under Numba's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``, how CI runs them on a machine
without a GPU) libdevice has no implementations; the same names are then NumPy scalar
operations, which round each result to float32 (or float64) exactly as the intrinsics do.
The kernels' logic (indexing, order, which operation where) is what the simulator runs.
"""

from __future__ import annotations

import math
import os

import numba
import numpy as np
from numba import cuda

from tiered_emb.step.reduce import REDUCE_CHUNK

# The variable both Numba's bundled CUDA target and numba-cuda read when first imported.
SIMULATED = os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0")

if SIMULATED:
    _f32 = np.float32
    _f64 = np.float64

    def f_add(a, b):
        return _f32(a) + _f32(b)

    def f_sub(a, b):
        return _f32(a) - _f32(b)

    def f_mul(a, b):
        return _f32(a) * _f32(b)

    def f_div(a, b):
        return _f32(a) / _f32(b)

    def f_sqrt(a):
        return np.sqrt(_f32(a))

    def d_add(a, b):
        return _f64(a) + _f64(b)

    def d_mul(a, b):
        return _f64(a) * _f64(b)

    def d_div(a, b):
        return _f64(a) / _f64(b)

    def d_to_f(a):
        return _f32(a)

else:  # pragma: no cover - needs a GPU
    from numba.cuda.libdevice import dadd_rn as d_add
    from numba.cuda.libdevice import ddiv_rn as d_div
    from numba.cuda.libdevice import dmul_rn as d_mul
    from numba.cuda.libdevice import double2float_rn as d_to_f
    from numba.cuda.libdevice import fadd_rn as f_add
    from numba.cuda.libdevice import fdiv_rn as f_div
    from numba.cuda.libdevice import fmul_rn as f_mul
    from numba.cuda.libdevice import fsqrt_rn as f_sqrt
    from numba.cuda.libdevice import fsub_rn as f_sub


@cuda.jit(device=True)
def pow_by_squaring(base, n):
    """``base ** n`` (float64, ``n`` an int64 >= 0) by squaring: IEEE multiplies only, so the
    host (:func:`tiered_emb._jit.pow_by_squaring`) gets the same bits."""
    result = np.float64(1.0)
    b = np.float64(base)
    while n > 0:
        if n & 1:
            result = d_mul(result, b)
        b = d_mul(b, b)
        n >>= 1
    return result


@cuda.jit
def pool_bags(records, slots, inverse, offsets, weights, use_weights, mean, out):
    """``out[b, j] = sum_i w_i * records[slots[inverse[i]], j]`` over bag ``b``, in position order.

    One block per bag (grid = B), threads over columns.  ``records`` float32 (cap, W >= dim);
    ``slots`` int64 (k,); ``inverse`` int64 (n,); ``offsets`` int64 (B+1,); ``weights``
    float32 (n,) read when ``use_weights``; ``mean`` divides by the bag length (an empty bag
    gives zeros); ``out`` float32 (B, dim).  Bitwise :func:`tiered_emb.step.gather.pool_kernel`.
    """
    b = cuda.blockIdx.x
    dim = out.shape[1]
    lo = offsets[b]
    hi = offsets[b + 1]
    for j in range(cuda.threadIdx.x, dim, cuda.blockDim.x):
        acc = np.float32(0.0)
        i = lo
        while i + 4 <= hi:  # four rows' loads in flight at once; the sum keeps position order
            x0 = records[slots[inverse[i]], j]
            x1 = records[slots[inverse[i + 1]], j]
            x2 = records[slots[inverse[i + 2]], j]
            x3 = records[slots[inverse[i + 3]], j]
            if use_weights:
                x0 = f_mul(weights[i], x0)
                x1 = f_mul(weights[i + 1], x1)
                x2 = f_mul(weights[i + 2], x2)
                x3 = f_mul(weights[i + 3], x3)
            acc = f_add(f_add(f_add(f_add(acc, x0), x1), x2), x3)
            i += 4
        while i < hi:
            x = records[slots[inverse[i]], j]
            if use_weights:
                x = f_mul(weights[i], x)
            acc = f_add(acc, x)
            i += 1
        if mean and hi > lo:
            acc = f_mul(acc, f_div(np.float32(1.0), np.float32(hi - lo)))
        out[b, j] = acc


@cuda.jit
def gather_rows(records, slots, inverse, out):
    """``out[i] = records[slots[inverse[i]], :dim]``: one block per output row, threads over columns."""
    i = cuda.blockIdx.x
    r = slots[inverse[i]]
    for j in range(cuda.threadIdx.x, out.shape[1], cuda.blockDim.x):
        out[i, j] = records[r, j]


@cuda.jit(device=True)
def _sum_terms(grad_out, bag, scale, lo, hi, j):
    """``sum_q scale[q] * grad_out[bag[q], j]`` for q in ``lo:hi`` from +0.0, in order."""
    acc = np.float32(0.0)
    q = lo
    while q + 8 <= hi:  # as pool_bags: eight loads in flight, the sum in position order
        g0 = grad_out[bag[q], j]
        g1 = grad_out[bag[q + 1], j]
        g2 = grad_out[bag[q + 2], j]
        g3 = grad_out[bag[q + 3], j]
        g4 = grad_out[bag[q + 4], j]
        g5 = grad_out[bag[q + 5], j]
        g6 = grad_out[bag[q + 6], j]
        g7 = grad_out[bag[q + 7], j]
        acc = f_add(
            f_add(f_add(f_add(acc, f_mul(scale[q], g0)), f_mul(scale[q + 1], g1)), f_mul(scale[q + 2], g2)),
            f_mul(scale[q + 3], g3),
        )
        acc = f_add(
            f_add(f_add(f_add(acc, f_mul(scale[q + 4], g4)), f_mul(scale[q + 5], g5)), f_mul(scale[q + 6], g6)),
            f_mul(scale[q + 7], g7),
        )
        q += 8
    while q < hi:
        acc = f_add(acc, f_mul(scale[q], grad_out[bag[q], j]))
        q += 1
    return acc


@cuda.jit
def reduce_ids(grad_out, starts, bag, scale, out, bad):
    """The backward's reduce of ids seen at most :data:`REDUCE_CHUNK` times, one block per unique id.

    Unique id u's positions are ``starts[u]:starts[u+1]``
    (:func:`tiered_emb.step.reduce.group_bag_positions`' ``starts``, ``bag``, ``scale``); each
    thread sums its columns over them in position order from +0.0 (:func:`_sum_terms`) into
    ``out[u]`` and sets ``bad[u]`` (zeroed by the caller) where the sum is not finite.  An id
    seen more often is left to :func:`reduce_chunks` and :func:`reduce_partials`.
    """
    u = cuda.blockIdx.x
    lo = starts[u]
    hi = starts[u + 1]
    if hi - lo > REDUCE_CHUNK:
        return
    for j in range(cuda.threadIdx.x, out.shape[1], cuda.blockDim.x):
        acc = _sum_terms(grad_out, bag, scale, lo, hi, j)
        out[u, j] = acc
        if math.isinf(acc) or math.isnan(acc):
            bad[u] = 1


@cuda.jit
def reduce_chunks(grad_out, chunk_lo, chunk_hi, bag, scale, partial):
    """One chunk of an id seen more than :data:`REDUCE_CHUNK` times per block: positions
    ``chunk_lo[t]:chunk_hi[t]`` summed from +0.0 into ``partial[t]``."""
    t = cuda.blockIdx.x
    lo = chunk_lo[t]
    hi = chunk_hi[t]
    for j in range(cuda.threadIdx.x, partial.shape[1], cuda.blockDim.x):
        partial[t, j] = _sum_terms(grad_out, bag, scale, lo, hi, j)


@cuda.jit
def reduce_partials(part_first, ids, partial, out, bad):
    """``out[ids[i]]`` = the sum of ``partial[part_first[i]:part_first[i+1]]`` in order from +0.0:
    the chunk sums of the i-th id seen more than :data:`REDUCE_CHUNK` times, one block each;
    ``bad`` as :func:`reduce_ids`.  Bitwise the host's chunked reduce."""
    i = cuda.blockIdx.x
    u = ids[i]
    first = part_first[i]
    last = part_first[i + 1]
    for j in range(cuda.threadIdx.x, out.shape[1], cuda.blockDim.x):
        acc = np.float32(0.0)
        for c in range(first, last):
            acc = f_add(acc, partial[c, j])
        out[u, j] = acc
        if math.isinf(acc) or math.isnan(acc):
            bad[u] = 1


# ---------------------------------------------------------------------------------------------------------
# the optimizers: one block per unique row, ``records[slots[k]]`` updated with ``grads[k]``
# (float32 (k, dim)); ``params`` float32 as :meth:`tiered_emb.optimizers.SGD.params` and the rest,
# weight decay's ``[weight_decay, mode]`` last.  Decay as :mod:`tiered_emb.step.update`: L2
# (mode 1) uses ``g + wd * w`` (``w`` the weight before this update) for ``g`` everywhere;
# decoupled (mode 2) makes the weight update ``w = c * w - step`` with ``c = 1 - lr * wd``;
# mode 0 computes ``c * w - step`` with ``c = 1``, exactly ``w - step``.


@cuda.jit(device=True)
def _decayed(g, w, wd, mode):
    """The gradient an update uses: ``g + wd * w`` with L2 decay (mode 1), else ``g``."""
    if mode == 1.0:
        return f_add(g, f_mul(wd, w))
    return g


@cuda.jit(device=True)
def _kept(lr, wd, mode):
    """What a row's weights are scaled by in its update: ``1 - lr * wd`` when decoupled (mode 2), else 1."""
    if mode == 2.0:
        return f_sub(np.float32(1.0), f_mul(lr, wd))
    return np.float32(1.0)


@cuda.jit
def sgd_update(records, slots, grads, params):
    """``w = c * w - lr * g``."""
    k = cuda.blockIdx.x
    s = slots[k]
    lr = params[0]
    wd = params[1]
    mode = params[2]
    c = _kept(lr, wd, mode)
    for j in range(cuda.threadIdx.x, grads.shape[1], cuda.blockDim.x):
        g = _decayed(grads[k, j], records[s, j], wd, mode)
        records[s, j] = f_sub(f_mul(c, records[s, j]), f_mul(lr, g))


@cuda.jit
def adagrad_update(records, slots, grads, params):
    """``s += g*g; w = c * w - lr * (g / (sqrt(s) + eps))``, element-wise."""
    k = cuda.blockIdx.x
    s = slots[k]
    lr = params[0]
    eps = params[1]
    wd = params[2]
    mode = params[3]
    c = _kept(lr, wd, mode)
    dim = grads.shape[1]
    for j in range(cuda.threadIdx.x, dim, cuda.blockDim.x):
        g = _decayed(grads[k, j], records[s, j], wd, mode)
        st = f_add(records[s, dim + j], f_mul(g, g))
        records[s, dim + j] = st
        records[s, j] = f_sub(f_mul(c, records[s, j]), f_mul(lr, f_div(g, f_add(f_sqrt(st), eps))))


@cuda.jit
def rowwise_adagrad_update(records, slots, grads, params):
    """``s += float32(sum(g*g) / dim)`` (float64, column order); ``w = c * w - (lr / (sqrt(s) + eps)) * g``.

    The float64 sum is one serial chain, as on the host: thread 0 runs it and hands the
    step size to the block through shared memory.  With L2 decay the sum reads the row's
    weights: it runs before ``syncthreads``, so before any thread writes them.
    """
    k = cuda.blockIdx.x
    s = slots[k]
    dim = grads.shape[1]
    lr = params[0]
    eps = params[1]
    wd = params[2]
    mode = params[3]
    c = _kept(lr, wd, mode)
    step = cuda.shared.array(1, numba.float32)
    if cuda.threadIdx.x == 0:
        acc = np.float64(0.0)
        for j in range(dim):
            g = np.float64(_decayed(grads[k, j], records[s, j], wd, mode))
            acc = d_add(acc, d_mul(g, g))
        st = f_add(records[s, dim], d_to_f(d_div(acc, np.float64(dim))))
        records[s, dim] = st
        step[0] = f_div(lr, f_add(f_sqrt(st), eps))
    cuda.syncthreads()
    lr_row = step[0]
    for j in range(cuda.threadIdx.x, dim, cuda.blockDim.x):
        g = _decayed(grads[k, j], records[s, j], wd, mode)
        records[s, j] = f_sub(f_mul(c, records[s, j]), f_mul(lr_row, g))


@cuda.jit
def adam_update(records, slots, grads, params):
    """Lazy Adam with the row's own step count (see :class:`tiered_emb.optimizers.Adam`).

    Thread 0 advances the count and the bias corrections (shared); every thread then
    updates its columns' moments and weights, ``w = c * w - lr * ((m / c1) / (sqrt(v / c2) + eps))``.
    """
    k = cuda.blockIdx.x
    s = slots[k]
    dim = grads.shape[1]
    lr = params[0]
    b1 = params[1]
    b2 = params[2]
    eps = params[3]
    wd = params[4]
    mode = params[5]
    c = _kept(lr, wd, mode)
    one = np.float32(1.0)
    corr = cuda.shared.array(2, numba.float32)
    if cuda.threadIdx.x == 0:
        t = f_add(records[s, 3 * dim], one)
        records[s, 3 * dim] = t
        n = np.int64(t)
        corr[0] = f_sub(one, d_to_f(pow_by_squaring(np.float64(b1), n)))
        corr[1] = f_sub(one, d_to_f(pow_by_squaring(np.float64(b2), n)))
    cuda.syncthreads()
    c1 = corr[0]
    c2 = corr[1]
    for j in range(cuda.threadIdx.x, dim, cuda.blockDim.x):
        g = _decayed(grads[k, j], records[s, j], wd, mode)
        m = f_add(f_mul(b1, records[s, dim + j]), f_mul(f_sub(one, b1), g))
        v = f_add(f_mul(b2, records[s, 2 * dim + j]), f_mul(f_mul(f_sub(one, b2), g), g))
        records[s, dim + j] = m
        records[s, 2 * dim + j] = v
        records[s, j] = f_sub(f_mul(c, records[s, j]), f_mul(lr, f_div(f_div(m, c1), f_add(f_sqrt(f_div(v, c2)), eps))))


UPDATE_KERNELS = {
    "sgd": sgd_update,
    "adagrad": adagrad_update,
    "rowwise_adagrad": rowwise_adagrad_update,
    "adam": adam_update,
}

__all__ = [
    "SIMULATED",
    "UPDATE_KERNELS",
    "gather_rows",
    "pool_bags",
    "pow_by_squaring",
    "reduce_chunks",
    "reduce_ids",
    "reduce_partials",
]
