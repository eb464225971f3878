// rms_norm: y = x / sqrt(mean(x^2) + eps) * w over rows of length d.
//   x : [rows, d] f32, w : [d] f32, y : [rows, d] f32
// add_rms_norm: the residual add fused with the norm that follows it (one pass instead of two):
//   s = x + r, or x + rms_norm(r) * wr when wr is given (Gemma 3's post-norms); y = rms_norm(s) * w
//   x, r, s, y : [rows, d] f32; w, wr : [d] f32 (wr may be null)
//   When qs is not null, y is also written as q8_1 blocks for MMVQ (exactly as quantize_q8_1 writes them, d a
//   multiple of 32): qs : [rows, d] int8, ds : [rows, d/16] float2; and when rs is not null its residual plane
//   rs : [rows, d] int8 (common.cuh warp_store_q8_1). When h is not null, y is also written in f16 (round to nearest
//   even, as a cast): h : [rows, d] f16.
// Thread t of a row's block holds values t, t + blockDim.x, ... (at most NV of them) in registers: every load is
// issued before the first reduction, and nothing is read twice. A warp holds 32 consecutive values, as the q8_1
// blocks need. fp32 sums through shared memory (block_sum), each thread's values added in order.
// Launch rule (both): one block per row, a multiple of 32 threads up to 1024 (norm_threads in backends/cuda.py: about
// two values per thread, so one short row still spreads over many warps); NV the smallest of build.NORM_VALUES
// holding d / threads (norm_values).
#include "common.cuh"

template <int NV>
__global__ void __launch_bounds__(1024)
rms_norm(const float* __restrict__ x, const float* __restrict__ w, float* __restrict__ y, int d, float eps) {
    PDL_WAIT();
    const long long row = (long long)blockIdx.x * d;
    float xv[NV], wv[NV];
    float s = 0.f;
#pragma unroll
    for (int k = 0; k < NV; ++k) {
        const int i = threadIdx.x + k * blockDim.x;
        xv[k] = i < d ? x[row + i] : 0.f;
        wv[k] = i < d ? w[i] : 0.f;
    }
#pragma unroll
    for (int k = 0; k < NV; ++k) s += xv[k] * xv[k];
    const float inv = 1.0f / sqrtf(block_sum(s) / (float)d + eps);
#pragma unroll
    for (int k = 0; k < NV; ++k) {
        const int i = threadIdx.x + k * blockDim.x;
        if (i < d) y[row + i] = xv[k] * inv * wv[k];
    }
}

template <int NV>
__global__ void __launch_bounds__(1024)
add_rms_norm(const float* __restrict__ x, const float* __restrict__ r, const float* __restrict__ wr,
             const float* __restrict__ w, float* __restrict__ s_out, float* __restrict__ y,
             signed char* __restrict__ qs, float2* __restrict__ ds, signed char* __restrict__ rs,
             u16* __restrict__ h, int d, float eps) {
    PDL_WAIT();
    const long long row = (long long)blockIdx.x * d;
    float sv[NV], rv[NV], wv[NV], wrv[NV];
#pragma unroll
    for (int k = 0; k < NV; ++k) {
        const int i = threadIdx.x + k * blockDim.x;
        const bool in = i < d;
        sv[k] = in ? x[row + i] : 0.f;
        rv[k] = in ? r[row + i] : 0.f;
        wv[k] = in ? w[i] : 0.f;
        wrv[k] = in && wr != nullptr ? wr[i] : 0.f;
    }
    float r_inv = 1.f;
    if (wr != nullptr) {
        float ss = 0.f;
#pragma unroll
        for (int k = 0; k < NV; ++k) ss += rv[k] * rv[k];
        r_inv = 1.0f / sqrtf(block_sum(ss) / (float)d + eps);
    }
    float ss = 0.f;
#pragma unroll
    for (int k = 0; k < NV; ++k) {
        const int i = threadIdx.x + k * blockDim.x;
        sv[k] += wr != nullptr ? rv[k] * r_inv * wrv[k] : rv[k];
        if (i < d) s_out[row + i] = sv[k];
        ss += sv[k] * sv[k];
    }
    const float inv = 1.0f / sqrtf(block_sum(ss) / (float)d + eps);
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int k = 0; k < NV; ++k) {
        const int i = threadIdx.x + k * blockDim.x;
        if (i >= d) break;                              // every lane of a warp takes the same trips (d % 32 == 0)
        const float v = sv[k] * inv * wv[k];
        y[row + i] = v;
        if (h != nullptr) h[row + i] = f2h(v);
        if (qs == nullptr) continue;
        warp_store_q8_1(v, lane, qs + row + i - lane, ds + (row + i - lane) / 16,       // lanes: 32 consecutive values
                        rs == nullptr ? nullptr : rs + row + i - lane);
    }
}
