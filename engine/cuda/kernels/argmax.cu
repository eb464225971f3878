// argmax_rows: the first maximum of each row, as numpy's argmax gives it (greedy decoding without copying the logits
// to the host).
//   x : [n, m] f32; best : [n] u64, zero before the launch, then (ordered value << 32) | (0xffffffff - index): the
//   largest key is the largest value and, among equal values, the smallest index. The host reads the index back.
// Launch rule (backends/cuda.py argmax): grid (parts, n), block 256; block (p, r) takes elements p*256 + t,
// p*256 + t + parts*256, ... of row r; one atomicMax per warp.
#include "common.cuh"

__device__ __forceinline__ unsigned long long argmax_key(float v, int i) {
    const u32 u = __float_as_uint(v);
    const u32 ordered = (u & 0x80000000u) ? ~u : (u | 0x80000000u);   // unsigned order = float order
    return ((unsigned long long)ordered << 32) | (0xffffffffu - (u32)i);
}

extern "C" __global__ void __launch_bounds__(256)
argmax_rows(const float* __restrict__ x, unsigned long long* __restrict__ best, int m) {
    PDL_WAIT();
    const float* row = x + (long long)blockIdx.y * m;
    unsigned long long key = 0;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < m; i += gridDim.x * blockDim.x) {
        const unsigned long long k = argmax_key(row[i], i);
        key = k > key ? k : key;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const unsigned long long other = __shfl_xor_sync(0xffffffffu, key, o);
        key = other > key ? other : key;
    }
    if ((threadIdx.x & 31) == 0) atomicMax(best + blockIdx.y, key);
}
