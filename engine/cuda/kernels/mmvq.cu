// MMVQ: y = x W^T for 1..8 activation columns, quantized W read once for all columns.
//   w  : [m, k] in T's blocks (row stride row_bytes)
//   qs : [ncols, k] int8 and ds : [ncols, k/16] float2, from quantize_q8_1
//   y  : [ncols, m] f32
// Launch rule (should_use_mmvq in dispatch.py: quantized T, ncols <= 8): block of 128 threads in groups of
// 128/groups threads (groups = 1, 2 or 4); each group serves mmvq_rows(NCOLS) consecutive rows (1 for one column,
// where more blocks in flight matter most; 2 above, where reusing the activations matters), each thread takes every
// (128/groups)-th chunk of those rows, loads the chunk's activations of all NCOLS columns once and dots them with each
// row's weight chunk; grid ceil(m / (groups * mmvq_rows(NCOLS))). Registers are capped at 128 per thread
// (MMVQ_MIN_BLOCKS = 4 blocks per SM): at 6-8 columns 9-19 % faster than the 168 registers left to themselves
// (BENCHMARKS.md, scripts/bench_mmvq_variants.py).
//
// One launch serves up to three matrices of the same type and k multiplied by the same activations (q, k and v):
// w0..w2 with m0..m2 rows (m = 0: absent) into y0..y2; the grid is the sum of the three grids, in order.
// GLU (1 = silu, 2 = gelu-tanh) instead computes y0 = act(x w0^T) * (x w1^T) (the gate and up matrices of a gated
// FFN, m0 = m1 rows): each group serves one output row, dotting the gate row and the up row; grid
// ceil(m0 / groups).
#include "common.cuh"

#define MMVQ_THREADS 128
// Tuning knobs (scripts/bench_mmvq_variants.py times alternatives by compiling with -D): rows per group for one
// column, for 2..4 and for 5..8 columns; blocks per SM the registers must allow; how many chunk iterations a thread
// unrolls (its loads in flight at once).
#ifndef MMVQ_ROWS_1
#define MMVQ_ROWS_1 1
#endif
#ifndef MMVQ_ROWS_N
#define MMVQ_ROWS_N 2
#endif
#ifndef MMVQ_ROWS_HI
#define MMVQ_ROWS_HI MMVQ_ROWS_N
#endif
#ifndef MMVQ_MIN_BLOCKS
#define MMVQ_MIN_BLOCKS 4                  // blocks per SM the registers must allow (<= 128 each)
#endif
#ifndef MMVQ_UNROLL
#define MMVQ_UNROLL 1
#endif
__host__ __device__ constexpr int mmvq_rows(int ncols) {
    return ncols == 1 ? MMVQ_ROWS_1 : ncols <= 4 ? MMVQ_ROWS_N : MMVQ_ROWS_HI;
}

__device__ __forceinline__ float glu_act(int glu, float g) {
    return glu == 1 ? g / (1.0f + expf(-g))
                    : 0.5f * g * (1.0f + tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g)));
}

template <int T, int NCOLS, int GLU>
__global__ void __launch_bounds__(MMVQ_THREADS, MMVQ_MIN_BLOCKS)
mmvq(const u8* __restrict__ w0, const u8* __restrict__ w1, const u8* __restrict__ w2,
     const signed char* __restrict__ qs, const float2* __restrict__ ds, float* __restrict__ y0,
     float* __restrict__ y1, float* __restrict__ y2, int m0, int m1, int m2, int k, long long row_bytes,
     int groups) {
    constexpr int MMVQ_ROWS = GLU ? 2 : mmvq_rows(NCOLS);        // rows dotted per group (GLU: gate and up row)
    constexpr int OUT_ROWS = GLU ? 1 : MMVQ_ROWS;                  // output rows per group
    __shared__ float partial[MMVQ_ROWS][NCOLS][MMVQ_THREADS / 32];
    const int tpg = MMVQ_THREADS / groups;                       // threads per group
    const int group = threadIdx.x / tpg, lane = threadIdx.x % tpg;
    int b = blockIdx.x, m = m0;
    const u8* w = w0;
    float* y = y0;
    if (!GLU) {                                                   // which of the matrices this block serves
        const int per_block = groups * OUT_ROWS;
        const int nb0 = (m0 + per_block - 1) / per_block, nb1 = (m1 + per_block - 1) / per_block;
        if (b >= nb0) {
            b -= nb0; w = w1; y = y1; m = m1;
            if (b >= nb1) { b -= nb1; w = w2; y = y2; m = m2; }
        }
    }
    const int row0 = (b * groups + group) * OUT_ROWS;
    const int chunks = k / 32;
    float acc[MMVQ_ROWS][NCOLS];
#pragma unroll
    for (int r = 0; r < MMVQ_ROWS; ++r)
#pragma unroll
        for (int j = 0; j < NCOLS; ++j) acc[r][j] = 0.f;
    constexpr int UNROLL = MMVQ_UNROLL;
    if (row0 < m) {
#pragma unroll UNROLL
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
                if (!GLU && row0 + r >= m) break;
                int v[8];
                ChunkScale s;
                const u8* wr = GLU ? (r == 0 ? w0 : w1) + (long long)row0 * row_bytes
                                   : w + (long long)(row0 + r) * row_bytes;
                unpack<T>(wr, c, v, s);
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
    if (threadIdx.x < groups * OUT_ROWS * NCOLS) {
        const int gi = threadIdx.x / (OUT_ROWS * NCOLS), r = (threadIdx.x / NCOLS) % OUT_ROWS, j = threadIdx.x % NCOLS;
        const int out_row = (b * groups + gi) * OUT_ROWS + r;
        float a = 0.f;
        for (int q = 0; q < wpg; ++q) a += partial[r][j][gi * wpg + q];
        if (GLU) {
            float u = 0.f;
            for (int q = 0; q < wpg; ++q) u += partial[1][j][gi * wpg + q];
            a = glu_act(GLU, a) * u;
        }
        if (out_row < m) y[(long long)j * m + out_row] = a;
    }
}

#define INSTANTIATE_MMVQ_G(T, N, G) template __global__ void mmvq<T, N, G>(const u8* __restrict__, \
    const u8* __restrict__, const u8* __restrict__, const signed char* __restrict__, const float2* __restrict__, \
    float* __restrict__, float* __restrict__, float* __restrict__, int, int, int, int, long long, int);
#define INSTANTIATE_MMVQ_N(T, N) INSTANTIATE_MMVQ_G(T, N, 0) INSTANTIATE_MMVQ_G(T, N, 1) INSTANTIATE_MMVQ_G(T, N, 2)
#define INSTANTIATE_MMVQ(T) INSTANTIATE_MMVQ_N(T, 1) INSTANTIATE_MMVQ_N(T, 2) INSTANTIATE_MMVQ_N(T, 3) \
    INSTANTIATE_MMVQ_N(T, 4) INSTANTIATE_MMVQ_N(T, 5) INSTANTIATE_MMVQ_N(T, 6) INSTANTIATE_MMVQ_N(T, 7) \
    INSTANTIATE_MMVQ_N(T, 8)
#ifdef MMVQ_ONLY_TYPE                                 // a benchmark's variant build: one type
INSTANTIATE_MMVQ(MMVQ_ONLY_TYPE)
#else
FOR_EACH_QTYPE(INSTANTIATE_MMVQ)
#endif
