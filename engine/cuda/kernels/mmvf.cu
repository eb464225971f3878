// MMVF: y = x W^T for 1..8 columns with f16 or f32 weights (a GEMV family, all columns in registers).
//   w : [m, k] f16 or f32 (row-major), x : [ncols, k] f32, y : [ncols, m] f32
// Launch rule (dispatch.py: float weights, ncols <= 8): one warp per row; block (32, 4); grid ceil(m / 4).
#include "common.cuh"

template <typename W> __device__ __forceinline__ float wval(const W* w, long long i);
template <> __device__ __forceinline__ float wval<float>(const float* w, long long i) { return w[i]; }
template <> __device__ __forceinline__ float wval<u16>(const u16* w, long long i) { return h2f(w[i]); }

template <typename W, int NCOLS>
__global__ void __launch_bounds__(128) mmvf(const W* __restrict__ w, const float* __restrict__ x,
                                            float* __restrict__ y, int m, int k) {
    const int row = blockIdx.x * 4 + threadIdx.y;
    if (row >= m) return;
    const int lane = threadIdx.x;
    float acc[NCOLS];
#pragma unroll
    for (int j = 0; j < NCOLS; ++j) acc[j] = 0.f;
    for (int i = lane; i < k; i += 32) {
        const float wv = wval<W>(w, (long long)row * k + i);
#pragma unroll
        for (int j = 0; j < NCOLS; ++j) acc[j] += wv * x[(long long)j * k + i];
    }
#pragma unroll
    for (int j = 0; j < NCOLS; ++j) {
        float a = acc[j];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) a += __shfl_xor_sync(0xffffffffu, a, o);
        if (lane == 0) y[(long long)j * m + row] = a;
    }
}

#define INSTANTIATE_MMVF_N(W, N) template __global__ void mmvf<W, N>(const W* __restrict__, const float* __restrict__, \
    float* __restrict__, int, int);
#define INSTANTIATE_MMVF(W) INSTANTIATE_MMVF_N(W, 1) INSTANTIATE_MMVF_N(W, 2) INSTANTIATE_MMVF_N(W, 3) \
    INSTANTIATE_MMVF_N(W, 4) INSTANTIATE_MMVF_N(W, 5) INSTANTIATE_MMVF_N(W, 6) INSTANTIATE_MMVF_N(W, 7) \
    INSTANTIATE_MMVF_N(W, 8)
INSTANTIATE_MMVF(float)
INSTANTIATE_MMVF(u16)
