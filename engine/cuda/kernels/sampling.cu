// Sampling a batch of rows on the device: engine/sampling.py's chain (penalties, top-k, top-p, min-p, temperature, a
// seeded draw), with only the token ids crossing to the host.
//
// apply_penalties: the repeat / presence / frequency penalties of each (row, token, count) entry, in place.
//   logits : [n, m] f32; rows, ids : [P] i32; counts : [P] f32; pen : [n, 3] f32 (repeat, presence, frequency)
//   Launch rule (cuda/sampling.py): grid ceil(P / 256), block 256, one entry a thread; ids unique within a row.
//
// sample_rows: one token per row of [n, m] logits.
//   params : [n, SAMPLE_PARAM_WORDS] u32: temperature (f32 bits), top_k, top_p (f32), min_p (f32), seed low, seed
//            high, draw counter, unused. Greedy rows (temperature < SAMPLE_GREEDY_BELOW) take the first maximum, as
//            numpy's argmax. The others keep the candidates of engine/sampling.py -- the top_k largest, then the
//            smallest prefix of those holding top_p of their probability mass at temperature 1, then those within
//            a factor min_p of the best -- and draw from softmax(x / temperature) over them by Gumbel-max: the
//            argmax of x / T - log(-log u), u hashed from (seed, draw counter, token id). That is the categorical
//            draw's distribution, in one pass, and a seed gives the same draws whatever else shares the batch.
//   The thresholds are exact: a 16-way search over the floats' order-preserving 32-bit keys, 4 bits a pass, each
//   pass counting (top-k) or summing the mass (top-p) above 15 trial keys at once; block reductions in a fixed
//   order, so a row's result does not depend on timing.
//   out : [n] i32. Launch rule (cuda/sampling.py): grid n, block SAMPLE_THREADS.
//
// add_bias: a request's logit_bias, logits[rows[e], ids[e]] += values[e] ((row, id) unique).
//   rows, ids : [P] i32; values : [P] f32. Launch rule: grid ceil(P / 256), block 256.
// constrain_rows: a grammar's mask, row rows[j] keeps only the tokens whose bit is set in masks[j] (bit i % 32 of
// word i / 32), -inf elsewhere.
//   rows : [R] i32; masks : [R, words] u32. Launch rule: grid (ceil(m / 256), R), block 256.
#include "common.cuh"

#define SAMPLE_THREADS 1024
#define SAMPLE_PARAM_WORDS 8
#define SAMPLE_GREEDY_BELOW 1e-5f
#define SAMPLE_TRIALS 15

extern "C" __global__ void __launch_bounds__(256)
apply_penalties(float* __restrict__ logits, int m, const int* __restrict__ rows, const int* __restrict__ ids,
                const float* __restrict__ counts, const float* __restrict__ pen, int n_entries) {
    PDL_WAIT();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n_entries) return;
    const int r = rows[i];
    float* x = logits + (long long)r * m + ids[i];
    float v = *x;
    const float repeat = pen[3 * r], presence = pen[3 * r + 1], frequency = pen[3 * r + 2];
    if (repeat != 1.0f) v = v > 0.0f ? v / repeat : v * repeat;
    *x = v - (counts[i] * frequency + presence);
}

extern "C" __global__ void __launch_bounds__(256)
add_bias(float* __restrict__ logits, int m, const int* __restrict__ rows, const int* __restrict__ ids,
         const float* __restrict__ values, int n_entries) {
    PDL_WAIT();
    const int e = blockIdx.x * blockDim.x + threadIdx.x;
    if (e < n_entries) logits[(long long)rows[e] * m + ids[e]] += values[e];
}

extern "C" __global__ void __launch_bounds__(256)
constrain_rows(float* __restrict__ logits, int m, const int* __restrict__ rows, const u32* __restrict__ masks,
               int words) {
    PDL_WAIT();
    const int i = blockIdx.x * blockDim.x + threadIdx.x, j = blockIdx.y;
    if (i < m && !((masks[(long long)j * words + (i >> 5)] >> (i & 31)) & 1u))
        logits[(long long)rows[j] * m + i] = __int_as_float(0xff800000);   // -inf (NVRTC has no INFINITY)
}

__device__ __forceinline__ u32 order_key(float v) {           // unsigned order of keys = float order of values
    const u32 u = __float_as_uint(v);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ unsigned long long mix64(unsigned long long z) {   // splitmix64's finaliser
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

// the block's sum of v[0..SAMPLE_TRIALS-1], in a fixed order; every thread gets the totals
__device__ void block_sum_trials(float v[SAMPLE_TRIALS], float (*red)[SAMPLE_TRIALS + 1]) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int j = 0; j < SAMPLE_TRIALS; ++j) {
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) v[j] += __shfl_xor_sync(0xffffffffu, v[j], o);
    }
    if (lane == 0) {
#pragma unroll
        for (int j = 0; j < SAMPLE_TRIALS; ++j) red[warp][j] = v[j];
    }
    __syncthreads();
#pragma unroll
    for (int j = 0; j < SAMPLE_TRIALS; ++j) {
        float s = 0.0f;
        for (int w = 0; w < SAMPLE_THREADS / 32; ++w) s += red[w][j];
        v[j] = s;
    }
    __syncthreads();
}

// the block's largest key; every thread gets it
__device__ unsigned long long block_max_key(unsigned long long key, unsigned long long* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const unsigned long long other = __shfl_xor_sync(0xffffffffu, key, o);
        key = other > key ? other : key;
    }
    if (lane == 0) scratch[warp] = key;
    __syncthreads();
    for (int w = 0; w < SAMPLE_THREADS / 32; ++w) key = scratch[w] > key ? scratch[w] : key;
    __syncthreads();
    return key;
}

// the largest key t >= floor such that the candidates (key >= floor) at or above t number at least `target`
// (mass = false) or hold at least `target` of exp(x - best) (mass = true)
__device__ u32 search_key(const float* __restrict__ x, int m, u32 floor, float best, bool mass, float target,
                          float (*red)[SAMPLE_TRIALS + 1]) {
    u32 t = floor;
    for (int shift = 28; shift >= 0; shift -= 4) {
        const u32 step = 1u << shift;
        const u32 base = t & ~(step * 16u - 1u);            // t's bits above this digit; the digit is searched
        float acc[SAMPLE_TRIALS];
#pragma unroll
        for (int j = 0; j < SAMPLE_TRIALS; ++j) acc[j] = 0.0f;
        for (int i = threadIdx.x; i < m; i += SAMPLE_THREADS) {
            const u32 k = order_key(x[i]);
            if (k < floor || k < base) continue;
            const float w = mass ? __expf(x[i] - best) : 1.0f;
#pragma unroll
            for (int j = 0; j < SAMPLE_TRIALS; ++j) acc[j] += (k >= base + (u32)(j + 1) * step) ? w : 0.0f;
        }
        block_sum_trials(acc, red);
        u32 digit = 0;
#pragma unroll
        for (int j = 0; j < SAMPLE_TRIALS; ++j)
            if (acc[j] >= target && base + (u32)(j + 1) * step >= t) digit = j + 1;
        const u32 next = base + digit * step;
        t = next > t ? next : t;
    }
    return t;
}

extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
sample_rows(const float* __restrict__ logits, int m, const u32* __restrict__ params, int* __restrict__ out) {
    PDL_WAIT();
    __shared__ float red[SAMPLE_THREADS / 32][SAMPLE_TRIALS + 1];
    __shared__ unsigned long long best_key[SAMPLE_THREADS / 32];
    const int row = blockIdx.x;
    const float* x = logits + (long long)row * m;
    const u32* p = params + row * SAMPLE_PARAM_WORDS;
    const float temperature = __uint_as_float(p[0]), top_p = __uint_as_float(p[2]), min_p = __uint_as_float(p[3]);
    const int top_k = (int)p[1];
    const unsigned long long seed = ((unsigned long long)p[5] << 32) | p[4];
    const u32 counter = p[6];

    // the first maximum: key (value order << 32) | (0xffffffff - index)
    unsigned long long key = 0;
    for (int i = threadIdx.x; i < m; i += SAMPLE_THREADS) {
        const unsigned long long k = ((unsigned long long)order_key(x[i]) << 32) | (0xffffffffu - (u32)i);
        key = k > key ? k : key;
    }
    key = block_max_key(key, best_key);
    const int first_max = (int)(0xffffffffu - (u32)(key & 0xffffffffu));
    if (!(temperature >= SAMPLE_GREEDY_BELOW)) {
        if (threadIdx.x == 0) out[row] = first_max;
        return;
    }
    const float best = x[first_max];

    u32 floor = 0;                                              // candidates: key >= floor
    if (top_k > 0 && top_k < m) floor = search_key(x, m, 0, best, false, (float)top_k, red);
    if (top_p < 1.0f) {
        float total[SAMPLE_TRIALS];
#pragma unroll
        for (int j = 0; j < SAMPLE_TRIALS; ++j) total[j] = 0.0f;
        for (int i = threadIdx.x; i < m; i += SAMPLE_THREADS)
            if (order_key(x[i]) >= floor) total[0] += __expf(x[i] - best);
        block_sum_trials(total, red);
        floor = search_key(x, m, floor, best, true, top_p * total[0], red);
    }
    if (min_p > 0.0f) {
        const u32 k = order_key(best + __logf(min_p));
        floor = k > floor ? k : floor;
    }
    const u32 best_order = order_key(best);
    floor = floor < best_order ? floor : best_order;           // the best token always stays

    // Gumbel-max over the candidates: score (order key of x / T - log(-log u)) << 32 | (0xffffffff - index)
    const float inv_t = 1.0f / temperature;
    key = 0;
    for (int i = threadIdx.x; i < m; i += SAMPLE_THREADS) {
        const float v = x[i];
        if (order_key(v) < floor) continue;
        const unsigned long long h = mix64(seed ^ mix64(((unsigned long long)counter << 32) | (u32)i));
        const float u = ((float)(h >> 40) + 0.5f) * (1.0f / 16777216.0f);      // (0, 1)
        const float score = v * inv_t - __logf(-__logf(u));
        const unsigned long long k = ((unsigned long long)order_key(score) << 32) | (0xffffffffu - (u32)i);
        key = k > key ? k : key;
    }
    key = block_max_key(key, best_key);
    if (threadIdx.x == 0) out[row] = (int)(0xffffffffu - (u32)(key & 0xffffffffu));
}
