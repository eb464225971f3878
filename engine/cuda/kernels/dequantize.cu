// dequantize<T>: quantized rows -> f16 (the cuBLAS fallback path) or f32 (embedding rows).
//   w   : [rows, k] in T's blocks, row stride row_bytes
//   out : [rows, k] f16 or f32
//   idx : optional [rows] row ids to gather (embedding lookup); null means rows 0..rows-1
// Launch rule: one thread per 32-value chunk; block DEQUANT_THREADS; grid ceil(rows * k/32 / DEQUANT_THREADS).
// Thread t's chunk is out[32t .. 32t + 31] (chunk t % (k/32) of row t / (k/32)), so a warp's output is one contiguous
// run: the f16 kernel stages it in shared memory and writes it 512 bytes a store instruction.
#include "common.cuh"

#define DEQUANT_THREADS 256

// Chunk t's 32 values (t < rows * k/32)
template <int T>
__device__ __forceinline__ void dequantize_chunk(const u8* __restrict__ w, const int* __restrict__ idx, int k,
                                                 long long row_bytes, long long t, float val[32]) {
    const int chunks = k / 32;
    const int r = (int)(t / chunks), c = (int)(t % chunks);
    const long long src = idx ? idx[r] : r;
    int v[8];
    ChunkScale s;
    unpack<T>(w + src * row_bytes, c, v, s);
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int b = 0; b < 4; ++b) val[4 * i + b] = s.d[i >> 2] * (float)(signed char)(v[i] >> (8 * b)) + s.m[i >> 2];
}

// The warp's 32 chunks (2 KB of f16) go through shared memory: each thread writes its four 16-byte pieces there (the
// piece index XORed with bits 1-2 of the lane, so that neither side of the exchange has bank conflicts), then the
// warp stores the run in four instructions of 512 contiguous bytes (storing each thread's 64 bytes directly wrote
// 32 scattered 16-byte pieces an instruction).
template <int T>
__global__ void __launch_bounds__(DEQUANT_THREADS) dequantize_f16(const u8* __restrict__ w,
        const int* __restrict__ idx, u16* __restrict__ out, int rows, int k, long long row_bytes) {
    PDL_WAIT();
    __shared__ uint4 stage[DEQUANT_THREADS / 32][32 * 4];     // per warp: [thread][piece ^ swizzle]
    const long long total = (long long)rows * (k / 32);
    const long long t = (long long)blockIdx.x * DEQUANT_THREADS + threadIdx.x;
    const int lane = threadIdx.x & 31;
    uint4* mine = stage[threadIdx.x >> 5];
    if (t < total) {
        float val[32];
        dequantize_chunk<T>(w, idx, k, row_bytes, t, val);
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            u32 p[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) p[e] = (u32)f2h(val[8 * q + 2 * e]) | ((u32)f2h(val[8 * q + 2 * e + 1]) << 16);
            mine[lane * 4 + (q ^ ((lane >> 1) & 3))] = make_uint4(p[0], p[1], p[2], p[3]);
        }
    }
    __syncwarp();
    const long long first = t - lane;                           // the warp's first chunk
    uint4* o = (uint4*)(out + first * 32);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int u = i * 32 + lane, from = u >> 2;             // 16-byte piece u of the run: thread from's piece u % 4
        if (first + from < total) o[u] = mine[from * 4 + ((u & 3) ^ ((from >> 1) & 3))];
    }
}

// f32 (embedding rows): eight 16-byte stores of 4 floats a thread
template <int T>
__global__ void dequantize_f32(const u8* __restrict__ w, const int* __restrict__ idx, float* __restrict__ out,
                               int rows, int k, long long row_bytes) {
    PDL_WAIT();
    const long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= (long long)rows * (k / 32)) return;
    float val[32];
    dequantize_chunk<T>(w, idx, k, row_bytes, t, val);
    float4* o = (float4*)(out + t * 32);
#pragma unroll
    for (int q = 0; q < 8; ++q) o[q] = make_float4(val[4 * q], val[4 * q + 1], val[4 * q + 2], val[4 * q + 3]);
}
