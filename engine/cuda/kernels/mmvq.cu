// MMVQ: y = x W^T for 1..8 activation columns, quantized W read once for all columns.
//   w  : [m, k] in T's blocks (row stride row_bytes)
//   qs : [ncols, k] int8 and ds : [ncols, k/16] float2, from quantize_q8_1
//   y  : [ncols, m] f32
// Launch rule (should_use_mmvq in dispatch.py: quantized T, ncols <= 8): block of 128 threads in groups of
// 128/groups threads (groups = 1, 2 or 4); each group serves mmvq_rows(NCOLS) consecutive rows (1 for one column,
// where more blocks in flight matter most; 2 above, where reusing the activations matters), each thread takes every
// (128/groups)-th chunk of those rows, loads the chunk's activations of all NCOLS columns once and dots them with each
// row's weight chunk; grid ceil(m / (groups * mmvq_rows(NCOLS))).
#include "common.cuh"

#define MMVQ_THREADS 128
__host__ __device__ constexpr int mmvq_rows(int ncols) { return ncols == 1 ? 1 : 2; }

template <int T, int NCOLS>
__global__ void __launch_bounds__(MMVQ_THREADS)
mmvq(const u8* __restrict__ w, const signed char* __restrict__ qs, const float2* __restrict__ ds,
     float* __restrict__ y, int m, int k, long long row_bytes, int groups) {
    constexpr int MMVQ_ROWS = mmvq_rows(NCOLS);
    __shared__ float partial[MMVQ_ROWS][NCOLS][MMVQ_THREADS / 32];
    const int tpg = MMVQ_THREADS / groups;                       // threads per group
    const int group = threadIdx.x / tpg, lane = threadIdx.x % tpg;
    const int row0 = (blockIdx.x * groups + group) * MMVQ_ROWS;
    const int chunks = k / 32;
    float acc[MMVQ_ROWS][NCOLS];
#pragma unroll
    for (int r = 0; r < MMVQ_ROWS; ++r)
#pragma unroll
        for (int j = 0; j < NCOLS; ++j) acc[r][j] = 0.f;
    if (row0 < m) {
        for (int c = lane; c < chunks; c += tpg) {
            int4 a0[NCOLS], a1[NCOLS];
            float4 sa[NCOLS];                                          // (d, s0, d, s1)
#pragma unroll
            for (int j = 0; j < NCOLS; ++j) {
                const int4* a = (const int4*)(qs + (long long)j * k + c * 32);
                a0[j] = a[0];
                a1[j] = a[1];
                sa[j] = *(const float4*)(ds + (long long)j * (k / 16) + c * 2);
            }
#pragma unroll
            for (int r = 0; r < MMVQ_ROWS; ++r) {
                if (row0 + r >= m) break;
                int v[8];
                ChunkScale s;
                unpack<T>(w + (long long)(row0 + r) * row_bytes, c, v, s);
#pragma unroll
                for (int j = 0; j < NCOLS; ++j) {
                    int d0 = dp4a(v[0], a0[j].x, 0); d0 = dp4a(v[1], a0[j].y, d0);
                    d0 = dp4a(v[2], a0[j].z, d0); d0 = dp4a(v[3], a0[j].w, d0);
                    int d1 = dp4a(v[4], a1[j].x, 0); d1 = dp4a(v[5], a1[j].y, d1);
                    d1 = dp4a(v[6], a1[j].z, d1); d1 = dp4a(v[7], a1[j].w, d1);
                    if constexpr (TypeTraits<T>::per16)
                        acc[r][j] += sa[j].x * (s.d[0] * (float)d0 + s.d[1] * (float)d1);
                    else
                        acc[r][j] += sa[j].x * s.d[0] * (float)(d0 + d1);
                    if constexpr (TypeTraits<T>::has_min) acc[r][j] += s.m[0] * sa[j].y + s.m[1] * sa[j].w;
                }
            }
        }
    }
    const int warp = threadIdx.x / 32;
#pragma unroll
    for (int r = 0; r < MMVQ_ROWS; ++r)
#pragma unroll
        for (int j = 0; j < NCOLS; ++j) {
            float a = acc[r][j];
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) a += __shfl_xor_sync(0xffffffffu, a, o);
            if ((threadIdx.x & 31) == 0) partial[r][j][warp] = a;
        }
    __syncthreads();
    const int wpg = tpg / 32;                                      // warps per group
    if (threadIdx.x < groups * MMVQ_ROWS * NCOLS) {
        const int gi = threadIdx.x / (MMVQ_ROWS * NCOLS), r = (threadIdx.x / NCOLS) % MMVQ_ROWS, j = threadIdx.x % NCOLS;
        const int out_row = (blockIdx.x * groups + gi) * MMVQ_ROWS + r;
        float a = 0.f;
        for (int q = 0; q < wpg; ++q) a += partial[r][j][gi * wpg + q];
        if (out_row < m) y[(long long)j * m + out_row] = a;
    }
}

#define INSTANTIATE_MMVQ_N(T, N) template __global__ void mmvq<T, N>(const u8* __restrict__, \
    const signed char* __restrict__, const float2* __restrict__, float* __restrict__, int, int, long long, int);
#define INSTANTIATE_MMVQ(T) INSTANTIATE_MMVQ_N(T, 1) INSTANTIATE_MMVQ_N(T, 2) INSTANTIATE_MMVQ_N(T, 3) \
    INSTANTIATE_MMVQ_N(T, 4) INSTANTIATE_MMVQ_N(T, 5) INSTANTIATE_MMVQ_N(T, 6) INSTANTIATE_MMVQ_N(T, 7) \
    INSTANTIATE_MMVQ_N(T, 8)
FOR_EACH_QTYPE(INSTANTIATE_MMVQ)
