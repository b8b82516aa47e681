// Builds native/*.cu with a host C++ compiler, for the tests on machines without a GPU.
//
// The CUDA built-ins a kernel reads become globals that te_host_set() sets; the caller
// (tiered_emb/testing/native_host.py) runs each kernel once per (block, thread), blocks in
// order and threads in order within a block.  That sequential order is a valid schedule of
// every kernel here: the only __syncthreads() follows thread 0's setup, which runs first.
// Each _rn intrinsic is the plain IEEE operation on float or double; the file is compiled
// with -ffp-contract=off, so nothing is fused, as on the GPU.
#pragma once
#include <cmath>

struct te_dim3 {
    unsigned int x, y, z;
};
static te_dim3 blockIdx, threadIdx, blockDim, gridDim;

extern "C" void te_host_set(unsigned int block, unsigned int thread, unsigned int threads, unsigned int blocks) {
    blockIdx = {block, 0, 0};
    threadIdx = {thread, 0, 0};
    blockDim = {threads, 1, 1};
    gridDim = {blocks, 1, 1};
}

#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
static inline void __syncthreads() {}

using std::isinf;
using std::isnan;

static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fdiv_rn(float a, float b) { return a / b; }
static inline float __fsqrt_rn(float a) { return std::sqrt(a); }
static inline double __dadd_rn(double a, double b) { return a + b; }
static inline double __dmul_rn(double a, double b) { return a * b; }
static inline double __ddiv_rn(double a, double b) { return a / b; }
static inline float __double2float_rn(double a) { return (float)a; }
