// The step's GPU kernels in CUDA C, compiled at run time by CuPy (NVRTC) into a RawModule.
//
// Each kernel gives the bytes of its twins: the Numba CPU kernels of tiered_emb/step/gather.py,
// reduce.py and update.py (the reference), and the numba-cuda kernels of
// tiered_emb/step/device/cuda_kernels.py, which these follow line for line:
//   - the same order of every sum: one block per bag (pool), chunk of an id (reduce) or row
//     (update), threads striding over the row's columns, each summing its column in position
//     order; no atomics, no tree reductions;
//   - the same roundings: every operation an _rn intrinsic, which the compiler may not fuse
//     into a multiply-add (and the module is compiled with --fmad=false besides); division
//     and square root the IEEE ones.
//
// Argument convention (tiered_emb/step/device/native.py passes it): every array is its pointer
// followed by its extents as long long (a 1-D array: n; a 2-D array: rows, cols), C-contiguous;
// every scalar is a long long.  tiered_emb/step/device/native.py's SIGNATURES mirrors each kernel's
// parameters, and a launch is checked against it.  REDUCE_CHUNK comes from the compiler's command line.
//
// CI has no GPU: native/host_shim.h lets a host C++ compiler build this same file, and the
// tests run it a block and a thread at a time against the Numba twins (docs/gpu.md).

#ifndef REDUCE_CHUNK
#error "compile with -DREDUCE_CHUNK=<tiered_emb.step.reduce.REDUCE_CHUNK>"
#endif

typedef long long i64;
typedef unsigned char u8;

#define ARR1(T, a) T* __restrict__ a, i64 a##_n
#define ARR2(T, a) T* __restrict__ a, i64 a##_rows, i64 a##_cols

static __device__ __forceinline__ bool not_finite(float x) { return isinf(x) || isnan(x); }

// out[b, j] = sum_i w_i * records[slots[inverse[i]], j] over bag b, in position order; an empty
// bag gives zeros; mean divides by the bag's length.  Grid: one block per bag.
extern "C" __global__ void pool_bags(ARR2(const float, records), ARR1(const i64, slots), ARR1(const i64, inverse),
                                     ARR1(const i64, offsets), ARR1(const float, weights), i64 use_weights,
                                     i64 mean, ARR2(float, out)) {
    const i64 b = blockIdx.x;
    const i64 lo = offsets[b];
    const i64 hi = offsets[b + 1];
    const i64 w = records_cols;
    for (i64 j = threadIdx.x; j < out_cols; j += blockDim.x) {
        float acc = 0.0f;
        i64 i = lo;
        for (; i + 4 <= hi; i += 4) {  // four rows' loads in flight at once; the sum keeps position order
            float x0 = records[slots[inverse[i]] * w + j];
            float x1 = records[slots[inverse[i + 1]] * w + j];
            float x2 = records[slots[inverse[i + 2]] * w + j];
            float x3 = records[slots[inverse[i + 3]] * w + j];
            if (use_weights) {
                x0 = __fmul_rn(weights[i], x0);
                x1 = __fmul_rn(weights[i + 1], x1);
                x2 = __fmul_rn(weights[i + 2], x2);
                x3 = __fmul_rn(weights[i + 3], x3);
            }
            acc = __fadd_rn(__fadd_rn(__fadd_rn(__fadd_rn(acc, x0), x1), x2), x3);
        }
        for (; i < hi; ++i) {
            float x = records[slots[inverse[i]] * w + j];
            if (use_weights) x = __fmul_rn(weights[i], x);
            acc = __fadd_rn(acc, x);
        }
        if (mean && hi > lo) acc = __fmul_rn(acc, __fdiv_rn(1.0f, (float)(hi - lo)));
        out[b * out_cols + j] = acc;
    }
}

// out[i] = records[slots[inverse[i]], :dim].  Grid: one block per output row.
extern "C" __global__ void gather_rows(ARR2(const float, records), ARR1(const i64, slots), ARR1(const i64, inverse),
                                       ARR2(float, out)) {
    const i64 i = blockIdx.x;
    const i64 r = slots[inverse[i]];
    for (i64 j = threadIdx.x; j < out_cols; j += blockDim.x) out[i * out_cols + j] = records[r * records_cols + j];
}

// sum_q scale[q] * grad_out[bag[q], j] for q in lo:hi, from +0.0, in order.
static __device__ __forceinline__ float sum_terms(const float* __restrict__ grad_out, i64 cols,
                                                  const int* __restrict__ bag, const float* __restrict__ scale,
                                                  i64 lo, i64 hi, i64 j) {
    float acc = 0.0f;
    i64 q = lo;
    for (; q + 8 <= hi; q += 8) {  // eight loads in flight, the sum in position order
        float g[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) g[e] = grad_out[bag[q + e] * cols + j];
#pragma unroll
        for (int e = 0; e < 8; ++e) acc = __fadd_rn(acc, __fmul_rn(scale[q + e], g[e]));
    }
    for (; q < hi; ++q) acc = __fadd_rn(acc, __fmul_rn(scale[q], grad_out[bag[q] * cols + j]));
    return acc;
}

// The backward's reduce of ids seen at most REDUCE_CHUNK times: one block per unique id u, its
// positions starts[u]:starts[u+1] summed from +0.0 into out[u]; bad[u] (zeroed by the caller) set
// where the sum is not finite.  An id seen more often is left to reduce_chunks + reduce_partials.
extern "C" __global__ void reduce_ids(ARR2(const float, grad_out), ARR1(const i64, starts), ARR1(const int, bag),
                                      ARR1(const float, scale), ARR2(float, out), ARR1(u8, bad)) {
    const i64 u = blockIdx.x;
    const i64 lo = starts[u];
    const i64 hi = starts[u + 1];
    if (hi - lo > REDUCE_CHUNK) return;
    for (i64 j = threadIdx.x; j < out_cols; j += blockDim.x) {
        const float acc = sum_terms(grad_out, grad_out_cols, bag, scale, lo, hi, j);
        out[u * out_cols + j] = acc;
        if (not_finite(acc)) bad[u] = 1;
    }
}

// One chunk of an id seen more than REDUCE_CHUNK times per block: positions
// chunk_lo[t]:chunk_hi[t] summed from +0.0 into partial[t].
extern "C" __global__ void reduce_chunks(ARR2(const float, grad_out), ARR1(const i64, chunk_lo),
                                         ARR1(const i64, chunk_hi), ARR1(const int, bag), ARR1(const float, scale),
                                         ARR2(float, partial)) {
    const i64 t = blockIdx.x;
    const i64 lo = chunk_lo[t];
    const i64 hi = chunk_hi[t];
    for (i64 j = threadIdx.x; j < partial_cols; j += blockDim.x)
        partial[t * partial_cols + j] = sum_terms(grad_out, grad_out_cols, bag, scale, lo, hi, j);
}

// out[ids[i]] = the sum of partial[part_first[i]:part_first[i+1]], in order from +0.0: the
// chunks' sums of the i-th id seen more than REDUCE_CHUNK times (one block each); bad as reduce_ids.
extern "C" __global__ void reduce_partials(ARR1(const i64, part_first), ARR1(const i64, ids),
                                           ARR2(const float, partial), ARR2(float, out), ARR1(u8, bad)) {
    const i64 i = blockIdx.x;
    const i64 u = ids[i];
    const i64 first = part_first[i];
    const i64 last = part_first[i + 1];
    for (i64 j = threadIdx.x; j < out_cols; j += blockDim.x) {
        float acc = 0.0f;
        for (i64 c = first; c < last; ++c) acc = __fadd_rn(acc, partial[c * partial_cols + j]);
        out[u * out_cols + j] = acc;
        if (not_finite(acc)) bad[u] = 1;
    }
}

// ---------------------------------------------------------------------------------------------
// The optimizers: one block per unique row, records[slots[k]] updated with grads[k] (float32
// (k, dim)); params as tiered_emb.optimizers' params(), weight decay's [weight_decay, mode] last.
// Decay as tiered_emb.step.update: L2 (mode 1) uses g + wd * w (w the weight before this update)
// for g everywhere; decoupled (mode 2) makes the weight update w = c * w - step with
// c = 1 - lr * wd; mode 0 computes c * w - step with c = 1, exactly w - step.

#define ROW_SETUP                               \
    const i64 k = blockIdx.x;                   \
    float* __restrict__ row = records + slots[k] * records_cols; \
    const float* __restrict__ g_row = grads + k * grads_cols; \
    const i64 dim = grads_cols;

// The gradient an update uses: g + wd * w with L2 decay (mode 1), else g.
static __device__ __forceinline__ float decayed(float g, float w, float wd, float mode) {
    return mode == 1.0f ? __fadd_rn(g, __fmul_rn(wd, w)) : g;
}

// What a row's weights are scaled by in its update: 1 - lr * wd when decoupled (mode 2), else 1.
static __device__ __forceinline__ float kept(float lr, float wd, float mode) {
    return mode == 2.0f ? __fsub_rn(1.0f, __fmul_rn(lr, wd)) : 1.0f;
}

// w = c * w - lr * g
extern "C" __global__ void sgd_update(ARR2(float, records), ARR1(const i64, slots), ARR2(const float, grads),
                                      ARR1(const float, params)) {
    ROW_SETUP
    const float lr = params[0];
    const float wd = params[1];
    const float mode = params[2];
    const float c = kept(lr, wd, mode);
    for (i64 j = threadIdx.x; j < dim; j += blockDim.x) {
        const float g = decayed(g_row[j], row[j], wd, mode);
        row[j] = __fsub_rn(__fmul_rn(c, row[j]), __fmul_rn(lr, g));
    }
}

// s += g*g; w = c * w - lr * (g / (sqrt(s) + eps)), element-wise
extern "C" __global__ void adagrad_update(ARR2(float, records), ARR1(const i64, slots), ARR2(const float, grads),
                                          ARR1(const float, params)) {
    ROW_SETUP
    const float lr = params[0];
    const float eps = params[1];
    const float wd = params[2];
    const float mode = params[3];
    const float c = kept(lr, wd, mode);
    for (i64 j = threadIdx.x; j < dim; j += blockDim.x) {
        const float g = decayed(g_row[j], row[j], wd, mode);
        const float st = __fadd_rn(row[dim + j], __fmul_rn(g, g));
        row[dim + j] = st;
        row[j] = __fsub_rn(__fmul_rn(c, row[j]), __fmul_rn(lr, __fdiv_rn(g, __fadd_rn(__fsqrt_rn(st), eps))));
    }
}

// s += float32(sum(g*g) / dim) (float64, in column order); w = c * w - (lr / (sqrt(s) + eps)) * g.
// The float64 sum is one serial chain, as on the host: thread 0 runs it and hands the step size on
// through shared memory.  With L2 decay the sum reads the row's weights: it runs before the
// __syncthreads, so before any thread writes them.
extern "C" __global__ void rowwise_adagrad_update(ARR2(float, records), ARR1(const i64, slots),
                                                  ARR2(const float, grads), ARR1(const float, params)) {
    ROW_SETUP
    const float lr = params[0];
    const float eps = params[1];
    const float wd = params[2];
    const float mode = params[3];
    const float c = kept(lr, wd, mode);
    __shared__ float step;
    if (threadIdx.x == 0) {
        double acc = 0.0;
        for (i64 j = 0; j < dim; ++j) {
            const double g = (double)decayed(g_row[j], row[j], wd, mode);
            acc = __dadd_rn(acc, __dmul_rn(g, g));
        }
        const float st = __fadd_rn(row[dim], __double2float_rn(__ddiv_rn(acc, (double)dim)));
        row[dim] = st;
        step = __fdiv_rn(lr, __fadd_rn(__fsqrt_rn(st), eps));
    }
    __syncthreads();
    const float lr_row = step;
    for (i64 j = threadIdx.x; j < dim; j += blockDim.x) {
        const float g = decayed(g_row[j], row[j], wd, mode);
        row[j] = __fsub_rn(__fmul_rn(c, row[j]), __fmul_rn(lr_row, g));
    }
}

// base ** n (n >= 0) by squaring, IEEE multiplies only: tiered_emb._jit.pow_by_squaring.
static __device__ double pow_by_squaring(double base, i64 n) {
    double result = 1.0;
    double b = base;
    while (n > 0) {
        if (n & 1) result = __dmul_rn(result, b);
        b = __dmul_rn(b, b);
        n >>= 1;
    }
    return result;
}

// Lazy Adam with the row's own step count (tiered_emb.optimizers.Adam): thread 0 advances the
// count and the bias corrections (shared); every thread then updates its columns,
// w = c * w - lr * ((m / c1) / (sqrt(v / c2) + eps)).
extern "C" __global__ void adam_update(ARR2(float, records), ARR1(const i64, slots), ARR2(const float, grads),
                                       ARR1(const float, params)) {
    ROW_SETUP
    const float lr = params[0];
    const float b1 = params[1];
    const float b2 = params[2];
    const float eps = params[3];
    const float wd = params[4];
    const float mode = params[5];
    const float c = kept(lr, wd, mode);
    __shared__ float corr[2];
    if (threadIdx.x == 0) {
        const float t = __fadd_rn(row[3 * dim], 1.0f);
        row[3 * dim] = t;
        const i64 n = (i64)t;
        corr[0] = __fsub_rn(1.0f, __double2float_rn(pow_by_squaring((double)b1, n)));
        corr[1] = __fsub_rn(1.0f, __double2float_rn(pow_by_squaring((double)b2, n)));
    }
    __syncthreads();
    const float c1 = corr[0];
    const float c2 = corr[1];
    for (i64 j = threadIdx.x; j < dim; j += blockDim.x) {
        const float g = decayed(g_row[j], row[j], wd, mode);
        const float m = __fadd_rn(__fmul_rn(b1, row[dim + j]), __fmul_rn(__fsub_rn(1.0f, b1), g));
        const float v = __fadd_rn(__fmul_rn(b2, row[2 * dim + j]), __fmul_rn(__fmul_rn(__fsub_rn(1.0f, b2), g), g));
        row[dim + j] = m;
        row[2 * dim + j] = v;
        row[j] = __fsub_rn(__fmul_rn(c, row[j]),
                           __fmul_rn(lr, __fdiv_rn(__fdiv_rn(m, c1), __fadd_rn(__fsqrt_rn(__fdiv_rn(v, c2)), eps))));
    }
}
