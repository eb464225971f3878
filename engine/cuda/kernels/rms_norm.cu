// rms_norm: y = x / sqrt(mean(x^2) + eps) * w over rows of length d.
//   x : [rows, d] f32, w : [d] f32, y : [rows, d] f32
// add_rms_norm: the residual add fused with the norm that follows it (one pass instead of two):
//   s = x + r, or x + rms_norm(r) * wr when wr is given (Gemma 3's post-norms); y = rms_norm(s) * w
//   x, r, s, y : [rows, d] f32; w, wr : [d] f32 (wr may be null)
// Launch rule (both): one block of 256 threads per row; the row is reduced in fp32 through shared memory.
#include "common.cuh"

__device__ __forceinline__ float block_sum_256(float s) {
    __shared__ float warp_sums[8];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    __syncthreads();                                   // warp_sums may still be read by a previous call
    if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5] = s;
    __syncthreads();
    float total = 0.f;
#pragma unroll
    for (int i = 0; i < 8; ++i) total += warp_sums[i];
    return total;
}

extern "C" __global__ void __launch_bounds__(256)
rms_norm(const float* __restrict__ x, const float* __restrict__ w, float* __restrict__ y, int d, float eps) {
    const float* xr = x + (long long)blockIdx.x * d;
    float* yr = y + (long long)blockIdx.x * d;
    float s = 0.f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) s += xr[i] * xr[i];
    const float inv = 1.0f / sqrtf(block_sum_256(s) / (float)d + eps);
    for (int i = threadIdx.x; i < d; i += blockDim.x) yr[i] = xr[i] * inv * w[i];
}

extern "C" __global__ void __launch_bounds__(256)
add_rms_norm(const float* __restrict__ x, const float* __restrict__ r, const float* __restrict__ wr,
             const float* __restrict__ w, float* __restrict__ s_out, float* __restrict__ y, int d, float eps) {
    const long long row = (long long)blockIdx.x * d;
    float r_inv = 1.f;
    if (wr != nullptr) {
        float ss = 0.f;
        for (int i = threadIdx.x; i < d; i += blockDim.x) ss += r[row + i] * r[row + i];
        r_inv = 1.0f / sqrtf(block_sum_256(ss) / (float)d + eps);
    }
    float ss = 0.f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        const float v = x[row + i] + (wr != nullptr ? r[row + i] * r_inv * wr[i] : r[row + i]);
        s_out[row + i] = v;
        ss += v * v;
    }
    const float inv = 1.0f / sqrtf(block_sum_256(ss) / (float)d + eps);
    for (int i = threadIdx.x; i < d; i += blockDim.x) y[row + i] = s_out[row + i] * inv * w[i];
}
