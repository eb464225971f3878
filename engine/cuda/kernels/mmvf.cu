// MMVF: y = x W^T for 1..8 columns with f16 or f32 weights (a GEMV family, all columns in registers).
//   w : [m, k] f16 or f32 (row-major), x : [ncols, k] f32, y : [ncols, m] f32
// A 128-thread block serves mmvf_rows(ncols) rows together: its threads walk k in VEC-value pieces (one 16-byte
// load of each row's weights, VEC f32 loads of each column's x per piece), so each x piece loaded serves all the
// block's rows; then a warp-shuffle and shared-memory sum of each (row, column). VEC = 16 / sizeof(W) where rows are
// 16-byte aligned (k % VEC == 0), else 1 (plain loads).
// Launch rule (launch.mmvf; dispatch.py: float weights, ncols <= 8): block 128, grid ceil(m / mmvf_rows(ncols)).
#include "common.cuh"

// rows per block at 1 column, 2..3, 4..8 (the launch rule reads them: build.constants)
#define MMVF_ROWS_1 2
#define MMVF_ROWS_N 4
#define MMVF_ROWS_HI 8
#define MMVF_THREADS 128
__host__ __device__ constexpr int mmvf_rows(int ncols) {
    return ncols == 1 ? MMVF_ROWS_1 : ncols <= 3 ? MMVF_ROWS_N : MMVF_ROWS_HI;
}

template <typename W, int VEC> __device__ __forceinline__ void load_w(const W* p, float v[VEC]);
template <> __device__ __forceinline__ void load_w<float, 1>(const float* p, float v[1]) { v[0] = *p; }
template <> __device__ __forceinline__ void load_w<u16, 1>(const u16* p, float v[1]) { v[0] = h2f(*p); }
template <> __device__ __forceinline__ void load_w<float, 4>(const float* p, float v[4]) {
    const float4 q = *(const float4*)p;
    v[0] = q.x; v[1] = q.y; v[2] = q.z; v[3] = q.w;
}
template <> __device__ __forceinline__ void load_w<u16, 8>(const u16* p, float v[8]) {
    const uint4 q = *(const uint4*)p;
    const u32 words[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        v[2 * i] = h2f((u16)words[i]);
        v[2 * i + 1] = h2f((u16)(words[i] >> 16));
    }
}

template <int VEC> __device__ __forceinline__ void load_x(const float* p, float v[VEC]) {
    if constexpr (VEC == 1) {
        v[0] = *p;
    } else {
#pragma unroll
        for (int i = 0; i < VEC / 4; ++i) {
            const float4 q = ((const float4*)p)[i];
            v[4 * i] = q.x; v[4 * i + 1] = q.y; v[4 * i + 2] = q.z; v[4 * i + 3] = q.w;
        }
    }
}

template <typename W, int NCOLS, int VEC>
__global__ void __launch_bounds__(MMVF_THREADS) mmvf(const W* __restrict__ w, const float* __restrict__ x,
                                                     float* __restrict__ y, int m, int k) {
    PDL_WAIT();
    constexpr int R = mmvf_rows(NCOLS);
    __shared__ float partial[MMVF_THREADS / 32][R][NCOLS];
    const int row0 = blockIdx.x * R;
    const W* wr[R];                                               // past m: row m - 1, not stored
#pragma unroll
    for (int r = 0; r < R; ++r) wr[r] = w + (long long)min(row0 + r, m - 1) * k;
    float acc[R][NCOLS];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int j = 0; j < NCOLS; ++j) acc[r][j] = 0.f;
    for (int i = threadIdx.x * VEC; i < k; i += MMVF_THREADS * VEC) {
        float wv[R][VEC];
#pragma unroll
        for (int r = 0; r < R; ++r) load_w<W, VEC>(wr[r] + i, wv[r]);
#pragma unroll
        for (int j = 0; j < NCOLS; ++j) {
            float xv[VEC];
            load_x<VEC>(x + (long long)j * k + i, xv);
#pragma unroll
            for (int r = 0; r < R; ++r)
#pragma unroll
                for (int e = 0; e < VEC; ++e) acc[r][j] += wv[r][e] * xv[e];
        }
    }
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int j = 0; j < NCOLS; ++j) {
            const float a = warp_sum(acc[r][j]);
            if (lane == 0) partial[warp][r][j] = a;
        }
    __syncthreads();
    if (threadIdx.x < R * NCOLS) {
        const int r = threadIdx.x / NCOLS, j = threadIdx.x % NCOLS;
        float a = 0.f;
#pragma unroll
        for (int q = 0; q < MMVF_THREADS / 32; ++q) a += partial[q][r][j];
        if (row0 + r < m) y[(long long)j * m + row0 + r] = a;
    }
}
