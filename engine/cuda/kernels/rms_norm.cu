// rms_norm: y = x / sqrt(mean(x^2) + eps) * w over rows of length d.
//   x : [rows, d] f32, w : [d] f32, y : [rows, d] f32
// add_rms_norm: the residual add fused with the norm that follows it (one pass instead of two):
//   s = x + r, or x + rms_norm(r) * wr when wr is given (Gemma 3's post-norms); y = rms_norm(s) * w
//   x, r, s, y : [rows, d] f32; w, wr : [d] f32 (wr may be null)
//   When qs is not null, y is also written as q8_1 blocks for MMVQ (exactly as quantize_q8_1 writes them, d a
//   multiple of 32): qs : [rows, d] int8, ds : [rows, d/16] float2; and when rs is not null its residual plane
//   rs : [rows, d] int8 (common.cuh warp_store_q8_1).
// Launch rule (both): one block per row, a multiple of 32 threads up to 1024 (norm_threads in backends/cuda.py: about
// two values per thread, so one short row still spreads over many warps); fp32 reduction through shared memory (block_sum).
#include "common.cuh"

extern "C" __global__ void __launch_bounds__(1024)
rms_norm(const float* __restrict__ x, const float* __restrict__ w, float* __restrict__ y, int d, float eps) {
    const float* xr = x + (long long)blockIdx.x * d;
    float* yr = y + (long long)blockIdx.x * d;
    float s = 0.f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) s += xr[i] * xr[i];
    const float inv = 1.0f / sqrtf(block_sum(s) / (float)d + eps);
    for (int i = threadIdx.x; i < d; i += blockDim.x) yr[i] = xr[i] * inv * w[i];
}

extern "C" __global__ void __launch_bounds__(1024)
add_rms_norm(const float* __restrict__ x, const float* __restrict__ r, const float* __restrict__ wr,
             const float* __restrict__ w, float* __restrict__ s_out, float* __restrict__ y,
             signed char* __restrict__ qs, float2* __restrict__ ds, signed char* __restrict__ rs, int d,
             float eps) {
    const long long row = (long long)blockIdx.x * d;
    float r_inv = 1.f;
    if (wr != nullptr) {
        float ss = 0.f;
        for (int i = threadIdx.x; i < d; i += blockDim.x) ss += r[row + i] * r[row + i];
        r_inv = 1.0f / sqrtf(block_sum(ss) / (float)d + eps);
    }
    float ss = 0.f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        const float v = x[row + i] + (wr != nullptr ? r[row + i] * r_inv * wr[i] : r[row + i]);
        s_out[row + i] = v;
        ss += v * v;
    }
    const float inv = 1.0f / sqrtf(block_sum(ss) / (float)d + eps);
    const int lane = threadIdx.x & 31;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {    // every lane of a warp takes the same trips
        const float v = s_out[row + i] * inv * w[i];
        y[row + i] = v;
        if (qs == nullptr) continue;
        warp_store_q8_1(v, lane, qs + row + i - lane, ds + (row + i - lane) / 16,       // lanes: 32 consecutive values
                        rs == nullptr ? nullptr : rs + row + i - lane);
    }
}
