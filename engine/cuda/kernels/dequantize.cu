// dequantize<T>: quantized rows -> f16 (the cuBLAS fallback path) or f32 (embedding rows).
//   w   : [rows, k] in T's blocks, row stride row_bytes
//   out : [rows, k] f16 or f32
//   idx : optional [rows] row ids to gather (embedding lookup); null means rows 0..rows-1
// Launch rule: one thread per 32-value chunk; block 256; grid ceil(rows * k/32 / 256).
#include "common.cuh"

template <int T, typename OUT>
__device__ __forceinline__ void dequantize_impl(const u8* __restrict__ w, const int* __restrict__ idx,
                                                OUT* __restrict__ out, int rows, int k, long long row_bytes) {
    const int chunks = k / 32;
    const long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= (long long)rows * chunks) return;
    const int r = (int)(t / chunks), c = (int)(t % chunks);
    const long long src = idx ? idx[r] : r;
    int v[8];
    ChunkScale s;
    unpack<T>(w + src * row_bytes, c, v, s);
    OUT* o = out + (long long)r * k + c * 32;
    float val[32];
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int b = 0; b < 4; ++b) val[4 * i + b] = s.d[i >> 2] * (float)(signed char)(v[i] >> (8 * b)) + s.m[i >> 2];
    if constexpr (sizeof(OUT) == 2) {          // four 16-byte stores of 8 halves
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            u32 p[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) p[e] = (u32)f2h(val[8 * q + 2 * e]) | ((u32)f2h(val[8 * q + 2 * e + 1]) << 16);
            ((uint4*)o)[q] = make_uint4(p[0], p[1], p[2], p[3]);
        }
    } else {                                   // eight 16-byte stores of 4 floats
#pragma unroll
        for (int q = 0; q < 8; ++q) ((float4*)o)[q] = make_float4(val[4 * q], val[4 * q + 1], val[4 * q + 2], val[4 * q + 3]);
    }
}

template <int T>
__global__ void dequantize_f16(const u8* __restrict__ w, const int* __restrict__ idx, u16* __restrict__ out,
                               int rows, int k, long long row_bytes) {
    dequantize_impl<T, u16>(w, idx, out, rows, k, row_bytes);
}

template <int T>
__global__ void dequantize_f32(const u8* __restrict__ w, const int* __restrict__ idx, float* __restrict__ out,
                               int rows, int k, long long row_bytes) {
    dequantize_impl<T, float>(w, idx, out, rows, k, row_bytes);
}
