// rms_norm: y = x / sqrt(mean(x^2) + eps) * w over rows of length d.
//   x : [rows, d] f32, w : [d] f32, y : [rows, d] f32
// Launch rule: one block of 256 threads per row (d up to any size; the row is reduced in fp32 through shared memory).
#include "common.cuh"

extern "C" __global__ void __launch_bounds__(256)
rms_norm(const float* __restrict__ x, const float* __restrict__ w, float* __restrict__ y, int d, float eps) {
    __shared__ float warp_sums[8];
    const float* xr = x + (long long)blockIdx.x * d;
    float* yr = y + (long long)blockIdx.x * d;
    float s = 0.f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) s += xr[i] * xr[i];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5] = s;
    __syncthreads();
    float total = 0.f;
#pragma unroll
    for (int i = 0; i < 8; ++i) total += warp_sums[i];
    const float inv = 1.0f / sqrtf(total / (float)d + eps);
    for (int i = threadIdx.x; i < d; i += blockDim.x) yr[i] = xr[i] * inv * w[i];
}
