// quantize_q8_1: f32 activations -> q8_1 in two planes, once per mul_mat call.
//   x  : [n, k] f32 (row stride k)
//   qs : [n_pad, k] int8, round(x / d) with d = max|x| / 127 per 32 values
//   ds : [n_pad, k/16] float2 (d of the enclosing 32 values, d * sum of the 16 quantized values)
//   rs : [n_pad, k] int8 or null: the residual plane (common.cuh warp_store_q8_1), ds's sums then those of q + rs / 254
// Rows n..n_pad-1 are written as zeros (MMQ reads whole column tiles).
// Launch rule: one warp per 32 values; block (32, 8); grid ceil(n_pad * k/32 / 8).
#include "common.cuh"

extern "C" __global__ void quantize_q8_1(const float* __restrict__ x, signed char* __restrict__ qs,
                                         float2* __restrict__ ds, signed char* __restrict__ rs, int n,
                                         int n_pad, int k) {
    PDL_WAIT();
    const int chunks = k / 32;
    const long long chunk = (long long)blockIdx.x * blockDim.y + threadIdx.y;
    if (chunk >= (long long)n_pad * chunks) return;
    const int row = (int)(chunk / chunks), c = (int)(chunk % chunks), lane = threadIdx.x;
    const float xi = row < n ? x[(long long)row * k + c * 32 + lane] : 0.f;
    warp_store_q8_1(xi, lane, qs + (long long)row * k + c * 32, ds + (long long)row * (k / 16) + c * 2,
                    rs == nullptr ? nullptr : rs + (long long)row * k + c * 32);
}
