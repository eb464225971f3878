// MMVQ: y = x W^T for 1..8 activation columns, quantized W read once for all columns.
//   w  : [m, k] in T's blocks (row stride row_bytes)
//   qs : [ncols, k] int8 and ds : [ncols, k/16] float2, from quantize_q8_1
//   y  : [ncols, m] f32
// Launch rule (should_use_mmvq in dispatch.py: quantized T, ncols <= 8): block of 128 threads serving
// rows_per_block rows (1, 2 or 4, so that each row gets 128, 64 or 32 threads); each thread takes every
// (128/rows_per_block)-th chunk of its row and dots it with all NCOLS columns; grid ceil(m / rows_per_block).
#include "common.cuh"

#define MMVQ_THREADS 128

template <int T, int NCOLS>
__global__ void __launch_bounds__(MMVQ_THREADS)
mmvq(const u8* __restrict__ w, const signed char* __restrict__ qs, const float2* __restrict__ ds,
     float* __restrict__ y, int m, int k, long long row_bytes, int rows_per_block) {
    __shared__ float partial[NCOLS][MMVQ_THREADS / 32];
    const int tpr = MMVQ_THREADS / rows_per_block;               // threads per row
    const int r_local = threadIdx.x / tpr, lane = threadIdx.x % tpr;
    const int row = blockIdx.x * rows_per_block + r_local;
    const int chunks = k / 32;
    float acc[NCOLS];
#pragma unroll
    for (int j = 0; j < NCOLS; ++j) acc[j] = 0.f;
    if (row < m) {
        const u8* wr = w + (long long)row * row_bytes;
        for (int c = lane; c < chunks; c += tpr) {
            int v[8];
            ChunkScale s;
            unpack<T>(wr, c, v, s);
#pragma unroll
            for (int j = 0; j < NCOLS; ++j) {
                const int4* a = (const int4*)(qs + (long long)j * k + c * 32);
                const int4 a0 = a[0], a1 = a[1];
                int d0 = dp4a(v[0], a0.x, 0); d0 = dp4a(v[1], a0.y, d0); d0 = dp4a(v[2], a0.z, d0); d0 = dp4a(v[3], a0.w, d0);
                int d1 = dp4a(v[4], a1.x, 0); d1 = dp4a(v[5], a1.y, d1); d1 = dp4a(v[6], a1.z, d1); d1 = dp4a(v[7], a1.w, d1);
                const float4 sa = *(const float4*)(ds + (long long)j * (k / 16) + c * 2);   // (d, s0, d, s1)
                if constexpr (TypeTraits<T>::per16)
                    acc[j] += sa.x * (s.d[0] * (float)d0 + s.d[1] * (float)d1);
                else
                    acc[j] += sa.x * s.d[0] * (float)(d0 + d1);
                if constexpr (TypeTraits<T>::has_min) acc[j] += s.m[0] * sa.y + s.m[1] * sa.w;
            }
        }
    }
    const int warp = threadIdx.x / 32;
#pragma unroll
    for (int j = 0; j < NCOLS; ++j) {
        float a = acc[j];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) a += __shfl_xor_sync(0xffffffffu, a, o);
        if ((threadIdx.x & 31) == 0) partial[j][warp] = a;
    }
    __syncthreads();
    const int wpr = tpr / 32;                                      // warps per row
    if (threadIdx.x < rows_per_block * NCOLS) {
        const int r = threadIdx.x / NCOLS, j = threadIdx.x % NCOLS;
        const int out_row = blockIdx.x * rows_per_block + r;
        float a = 0.f;
        for (int q = 0; q < wpr; ++q) a += partial[j][r * wpr + q];
        if (out_row < m) y[(long long)j * m + out_row] = a;
    }
}

#define INSTANTIATE_MMVQ_N(T, N) template __global__ void mmvq<T, N>(const u8* __restrict__, \
    const signed char* __restrict__, const float2* __restrict__, float* __restrict__, int, int, long long, int);
#define INSTANTIATE_MMVQ(T) INSTANTIATE_MMVQ_N(T, 1) INSTANTIATE_MMVQ_N(T, 2) INSTANTIATE_MMVQ_N(T, 3) \
    INSTANTIATE_MMVQ_N(T, 4) INSTANTIATE_MMVQ_N(T, 5) INSTANTIATE_MMVQ_N(T, 6) INSTANTIATE_MMVQ_N(T, 7) \
    INSTANTIATE_MMVQ_N(T, 8)
FOR_EACH_QTYPE(INSTANTIATE_MMVQ)
