// Attention over the KV cache, GQA, causal with an optional sliding window; fp32 online softmax.
//
// The cache is paged: cache_k, cache_v : [n_blocks, rows, n_kv, head_dim] f16 (or f32 with KV_F32; or kvq8_0: each
// head row GGML's q8_0 blocks, head_dim / 32 of 34 bytes, [n_blocks, rows, n_kv, head_dim / 32 * 34]), and position j
// of the sequence whose block table is row `tab` of tables ([*, width] int32) sits in cache row
// tables[tab * width + (j >> shift)] * rows + (j & (2^shift - 1)) (KVRows). Blocks of 2^shift = rows positions;
// a cache of one block per sequence's whole context is shift 31, rows n_ctx, and a one-entry table per sequence.
// Every kernel takes (tabs : [n] int32, each query row's table row; tables, width, shift, rows).
//
// kv_store: write this batch's k, v into the cache.
//   k, v : [n, n_kv, head_dim] f32
//   Launch rule: one thread per element; block 256.
// kv_store_q8_0: the same into a q8_0 cache, a warp per block of 32 values (warp_store_q8_0: GGML's rounding, as
// the numpy backend's quantize_q8_0). Launch rule: one thread per element; block 256.
//
// attention: one warp per (query token, head); the warp streams the keys p-window+1..p of the token's sequence
// (p = its position), each lane holding head_dim/32 of q and of the output, with an online softmax in fp32.
//   q : [n, n_head, head_dim] f32; out : [n, n_head, head_dim] f32; positions : [n] int32
//   Launch rule: grid (n, n_head), block 32; head_dim a multiple of 32, at most 32 * MAXE (2, 4 or 8: the
//   instantiation taking head_dim, backends/cuda.py attention_head_chunks).
//
// attention_decode: the same attention for few query tokens (decode), flash-decoding: a block takes one query token
// and one KV head's GQA group of query heads (at most GMAX of them; a group of more takes several blocks), so each
// key and value is read once for the group. The keys p-window+1..p split into chunks whose size depends on the
// sequence's length and the launch's chunk_cap alone, never on the batch (decode_chunk: a multiple of
// DECODE_CHUNK_KEYS, more of them where the length needs over chunk_cap chunks; chunk_cap <= DECODE_MAX_CHUNKS is
// the model's, backends/cuda.py CUDABackend._chunk_cap: one sequence's blocks fill the GPU once): block z of n_split
// takes chunks z, z + n_split, .... Within a block DP / 8 lanes hold a key's head_dim (8 values each: Raw8's
// loads), so a warp takes 32 / (DP / 8) keys at a time, DECODE_KEYS of those loaded together; each key group keeps
// an online softmax per query head; at the chunk's end the groups merge (shuffles, then the 4 warps through shared
// memory) into the chunk's state in part. The last block of the (token,
// group) to finish (a ticket from counters, reset to 0 for the next launch) merges the chunks' states in chunk
// order into out, so a token's output does not depend on n_split or on the other rows of the batch. When qs is not
// null it writes out's q8_1 blocks (qs : [n, n_head * head_dim] int8, ds : [n, n_head * head_dim / 16] float2, as
// quantize_q8_1 writes them), and when rs is not null their residual plane (rs : as qs; common.cuh
// warp_store_q8_1); when h16 is not null, out in f16 too (h16 : [n, n_head * head_dim], round to nearest even, as a
// cast: its f16 form for the next mul_mat). When k_new, v_new ([n, n_kv, head_dim] f32) are given - a decode step,
// one token per sequence, so no block reads another token's new key - the block that takes the last chunk stores its
// token's k, v in the cache before reading it (kv_store's work, one launch less).
//   part : [n, n_head, max_chunks, head_dim + 4] f32, per chunk (max score m, sum l, 2 unused, unnormalized
//   output[head_dim]);
//   max_chunks >= the chunks of the longest sequence (decode_chunks); chunk_cap as above; counters :
//   [n * gridDim.y] int32, zero before the launch (and after it)
//   Launch rule: grid (n, n_kv * ceil(G / GMAX), n_split) with G = n_head / n_kv, GMAX the smallest of
//   build.DECODE_GROUPS >= G (else the largest), DP the smallest of build.DECODE_HEAD_DIMS >= head_dim; n_split
//   <= max_chunks; block (32, DECODE_WARPS).
//
// attention_decode_mma: attention_decode on f16 tensor cores for an f16 cache of head_dim 64, 128 or 256 (below).
//
// attention_prefill: many query tokens of one sequence at consecutive positions (a prefill ubatch) with an f32 or q8_0
// cache (attention_mma.cu serves an f16 cache on tensor cores), tiled: a block
// takes 32 queries of one head and streams their keys in tiles of 32 through shared memory (as f32); scores and
// output in fp32 with an online softmax per query. Thread (r = tid / 4, c = tid % 4) owns query r: the scores of
// keys c, c+4, ... of each tile and the output dims c, c+4, .... A block's table row and first position are its
// first query's. Rows are padded by one float (no shared-memory bank conflicts).
//   q : [n, n_head, D] f32; out : [n, n_head, D] f32; tiles : [gridDim.x, 2] int32 or null, as attention_mma.cu's
//   attention_prefill_mma takes them (32 rows a tile)
//   Launch rule: grid (tiles' count, or ceil(n / 32), n_head), block 128, dynamic shared memory
//   prefill_smem_floats(D) * 4 bytes; D (head_dim) one of 64, 128, 256.
#include "common.cuh"

#define DECODE_WARPS 4           // attention_decode's warps per block
#define PREFILL_BQ 32            // attention_prefill's queries per block
#define PREFILL_BK 32            // ... and keys per tile
#define DECODE_KEYS 8            // keys a lane of attention_decode loads together
#define DECODE_CHUNK_KEYS 128    // attention_decode's chunk: a multiple of this many keys (two decode_mma tiles)
#define DECODE_MAX_CHUNKS 128    // ... and chunk_cap's bound: chunks a sequence's keys split into
#define DECODE_MMA_ROWS 16       // attention_decode_mma: query heads a block takes (the mma's 16 rows)
#define DECODE_MMA_KEYS 64       // ... keys of a tile (16 a warp), two tiles in flight
#define DECODE_MMA_SMEM_ROWS (DECODE_MMA_ROWS + 4 * DECODE_MMA_KEYS)   // its f16 rows of head_dim + 8 in shared memory

// The cache's value types: u16 (f16), float, and kvq8_0, a byte of a head row of q8_0 blocks. A head row of
// head_dim values is kv_row_elems<KV>(head_dim) of them, and kv_get reads its value i.
#define Q8_0_BYTES 34            // a q8_0 block: f16 scale, 32 int8
struct kvq8_0 { u8 b; };
template <typename KV> __host__ __device__ constexpr int kv_row_elems(int head_dim) { return head_dim; }
template <> __host__ __device__ constexpr int kv_row_elems<kvq8_0>(int head_dim) { return head_dim / 32 * Q8_0_BYTES; }
template <typename KV> __device__ __forceinline__ float kv_get(const KV* row, int i);
template <> __device__ __forceinline__ float kv_get<u16>(const u16* row, int i) { return h2f(row[i]); }
template <> __device__ __forceinline__ float kv_get<float>(const float* row, int i) { return row[i]; }
template <> __device__ __forceinline__ float kv_get<kvq8_0>(const kvq8_0* row, int i) {
    const u8* b = (const u8*)row + (i >> 5) * Q8_0_BYTES;
    return h2f(*(const u16*)b) * (float)(signed char)b[2 + (i & 31)];
}
template <typename KV> __device__ __forceinline__ KV kv_cast(float v);
template <> __device__ __forceinline__ u16 kv_cast<u16>(float v) { return f2h(v); }
template <> __device__ __forceinline__ float kv_cast<float>(float v) { return v; }

// A warp stores one q8_0 block: lane i's value x as int8 i of blk, the scale max|x| / 127 (f32, stored as f16);
// values x / scale through the f32 inverse, rounded half away from zero (GGML's quantize_row_q8_0).
__device__ __forceinline__ void warp_store_q8_0(float x, int lane, u8* blk) {
    float amax = fabsf(x);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f, y = x * id;
    blk[2 + lane] = (u8)(signed char)(int)truncf(y + copysignf(0.5f, y));
    if (lane == 0) *(u16*)blk = f2h(d);
}

template <typename KV>
__global__ void kv_store(const float* __restrict__ k, const float* __restrict__ v, KV* __restrict__ cache_k,
                         KV* __restrict__ cache_v, const int* __restrict__ tabs, const int* __restrict__ positions,
                         const int* __restrict__ tables, int width, int shift, int rows,
                         int n, int row) {   // row = n_kv * head_dim
    PDL_WAIT();
    const long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= (long long)n * row) return;
    const int tok = (int)(t / row), e = (int)(t % row);
    const long long dst = KVRows(tables, width, shift, rows, tabs[tok])(positions[tok]) * row + e;
    cache_k[dst] = kv_cast<KV>(k[t]);
    cache_v[dst] = kv_cast<KV>(v[t]);
}

__global__ void kv_store_q8_0(const float* __restrict__ k, const float* __restrict__ v, kvq8_0* __restrict__ cache_k,
                              kvq8_0* __restrict__ cache_v, const int* __restrict__ tabs,
                              const int* __restrict__ positions, const int* __restrict__ tables, int width, int shift,
                              int rows, int n, int row) {   // row = n_kv * head_dim, a multiple of 32
    PDL_WAIT();
    const long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= (long long)n * row) return;                   // whole warps: n * row is a multiple of 32
    const int tok = (int)(t / row), blk = (int)(t % row) >> 5;
    const long long dst = KVRows(tables, width, shift, rows, tabs[tok])(positions[tok]) * (row / 32 * Q8_0_BYTES) +
                          (long long)blk * Q8_0_BYTES;
    warp_store_q8_0(k[t], threadIdx.x & 31, (u8*)cache_k + dst);
    warp_store_q8_0(v[t], threadIdx.x & 31, (u8*)cache_v + dst);
}

// One warp's online softmax over keys j0, j0 + step, ... < j1 (cache rows kv(j)): updates (m, l, acc); CAP caps each
// score s at softcap * tanh(s / softcap) (Gemma 2; a template argument: the branch in the loop cost Gemma 3's decode
// step 15 %, 782 -> 898 us a graph replay). Keys go ATTN_KEYS at a time: their k and v rows loaded together, then
// one max and one rescale for the group; the rest one by one.
#define ATTN_KEYS 4
template <typename KV, int MAXE, bool CAP>
__device__ __forceinline__ void attend_keys(const KV* kb, const KV* vb, long long stride, const KVRows& kv,
                                            int j0, int j1, int step, const float* qv, float* acc, float& m,
                                            float& l, int per, int lane, float softcap) {
    int j = j0;
    for (; j + (ATTN_KEYS - 1) * step < j1; j += ATTN_KEYS * step) {
        float kx[ATTN_KEYS][MAXE], vx[ATTN_KEYS][MAXE], s[ATTN_KEYS];
#pragma unroll
        for (int u = 0; u < ATTN_KEYS; ++u) {
            const long long r = kv(j + u * step) * stride;
#pragma unroll
            for (int e = 0; e < MAXE; ++e)
                if (e < per) {
                    kx[u][e] = kv_get<KV>(kb + r, e * 32 + lane);
                    vx[u][e] = kv_get<KV>(vb + r, e * 32 + lane);
                }
        }
#pragma unroll
        for (int u = 0; u < ATTN_KEYS; ++u) {
            s[u] = 0.f;
#pragma unroll
            for (int e = 0; e < MAXE; ++e) if (e < per) s[u] += qv[e] * kx[u][e];
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1)
#pragma unroll
            for (int u = 0; u < ATTN_KEYS; ++u) s[u] += __shfl_xor_sync(0xffffffffu, s[u], o);
        if (CAP)
#pragma unroll
            for (int u = 0; u < ATTN_KEYS; ++u) s[u] = softcap * tanhf(s[u] / softcap);
        float m_new = m;
#pragma unroll
        for (int u = 0; u < ATTN_KEYS; ++u) m_new = fmaxf(m_new, s[u]);
        const float corr = expf(m - m_new);
        float p[ATTN_KEYS], psum = 0.f;
#pragma unroll
        for (int u = 0; u < ATTN_KEYS; ++u) { p[u] = expf(s[u] - m_new); psum += p[u]; }
        l = l * corr + psum;
#pragma unroll
        for (int e = 0; e < MAXE; ++e)
            if (e < per) {
                float a = acc[e] * corr;
#pragma unroll
                for (int u = 0; u < ATTN_KEYS; ++u) a += p[u] * vx[u][e];
                acc[e] = a;
            }
        m = m_new;
    }
    for (; j < j1; j += step) {
        const long long r = kv(j) * stride;
        float s = 0.f;
#pragma unroll
        for (int e = 0; e < MAXE; ++e) if (e < per) s += qv[e] * kv_get<KV>(kb + r, e * 32 + lane);
        s = warp_sum(s);
        if (CAP) s = softcap * tanhf(s / softcap);
        const float m_new = fmaxf(m, s);
        const float corr = expf(m - m_new), pj = expf(s - m_new);
        l = l * corr + pj;
#pragma unroll
        for (int e = 0; e < MAXE; ++e) if (e < per) acc[e] = acc[e] * corr + pj * kv_get<KV>(vb + r, e * 32 + lane);
        m = m_new;
    }
}

template <typename KV, int MAXE, bool CAP>             // MAXE: head_dim / 32 at most (build.ATTENTION_HEAD_CHUNKS)
__global__ void __launch_bounds__(32)
attention(const float* __restrict__ q, const KV* __restrict__ cache_k, const KV* __restrict__ cache_v,
          float* __restrict__ out, const int* __restrict__ tabs, const int* __restrict__ positions,
          const int* __restrict__ tables, int width, int shift, int rows,
          int n_head, int n_kv, int head_dim, float scale, int window, float softcap) {
    PDL_WAIT();
    const int tok = blockIdx.x, h = blockIdx.y, lane = threadIdx.x;
    const int per = head_dim / 32, kvh = h / (n_head / n_kv);
    const int p = positions[tok];
    const int lo = window > 0 ? max(0, p - window + 1) : 0;
    const float* qh = q + ((long long)tok * n_head + h) * head_dim;
    float qv[MAXE], acc[MAXE];
#pragma unroll
    for (int e = 0; e < MAXE; ++e) { qv[e] = e < per ? qh[e * 32 + lane] * scale : 0.f; acc[e] = 0.f; }
    const long long off = (long long)kvh * kv_row_elems<KV>(head_dim);
    float m = NEG_INF, l = 0.f;
    attend_keys<KV, MAXE, CAP>(cache_k + off, cache_v + off, (long long)n_kv * kv_row_elems<KV>(head_dim),
                               KVRows(tables, width, shift, rows, tabs[tok]), lo, p + 1, 1, qv, acc, m, l, per, lane,
                               softcap);
    float* oh = out + ((long long)tok * n_head + h) * head_dim;
#pragma unroll
    for (int e = 0; e < MAXE; ++e) if (e < per) oh[e * 32 + lane] = acc[e] / l;
}

// attention_decode's chunk of keys for a sequence of len keys: at most cap chunks, each a multiple of
// DECODE_CHUNK_KEYS keys (backends/cuda.py decode_chunks mirrors it).
__device__ __forceinline__ int decode_chunk(int len, int cap) {
    const int keys = max(DECODE_CHUNK_KEYS, (len + cap - 1) / cap);
    return (keys + DECODE_CHUNK_KEYS - 1) / DECODE_CHUNK_KEYS * DECODE_CHUNK_KEYS;
}

// A decode attention block's share of the work (grid (n, n_kv * parts, n_split), at most `rows` query heads a block):
// token tok, KV head kvh, query heads h0..h0 + gq - 1, and of the token's keys lo..p (its window) in n_chunks chunks
// of `chunk` keys, chunks z, z + n_split, ....
struct DecodeBlock {
    int tok, z, n_split, kvh, h0, gq, p, lo, chunk, n_chunks;
    __device__ __forceinline__ DecodeBlock(const int* positions, int n_head, int n_kv, int rows, int window,
                                           int chunk_cap) {
        tok = blockIdx.x; z = blockIdx.z; n_split = gridDim.z;
        const int parts = gridDim.y / n_kv, part_i = blockIdx.y % parts, G = n_head / n_kv;
        kvh = blockIdx.y / parts; h0 = kvh * G + part_i * rows; gq = min(rows, G - part_i * rows);
        p = positions[tok];
        lo = window > 0 ? max(0, p - window + 1) : 0;
        const int len = p - lo + 1;
        chunk = decode_chunk(len, chunk_cap); n_chunks = (len + chunk - 1) / chunk;
    }
};

// Values i..i+7 (i a multiple of 8) of a head row as raw loads - 16 bytes (f16), 32 bytes (f32), or 8 bytes and
// their block's scale (q8_0, 2-byte aligned: four 2-byte loads) - and as floats.
template <typename KV> struct Raw8;
template <> struct Raw8<u16> {
    uint4 r;
    __device__ __forceinline__ void load(const u16* row, int i) { r = *(const uint4*)(row + i); }
    __device__ __forceinline__ void zero() { r = make_uint4(0u, 0u, 0u, 0u); }
    __device__ __forceinline__ void floats(float x[8]) const {
        const u32 w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) { x[2 * i] = h2f((u16)(w[i] & 0xffffu)); x[2 * i + 1] = h2f((u16)(w[i] >> 16)); }
    }
};
template <> struct Raw8<float> {
    float4 a, b;
    __device__ __forceinline__ void load(const float* row, int i) {
        a = ((const float4*)(row + i))[0]; b = ((const float4*)(row + i))[1];
    }
    __device__ __forceinline__ void zero() { a = b = make_float4(0.f, 0.f, 0.f, 0.f); }
    __device__ __forceinline__ void floats(float x[8]) const {
        x[0] = a.x; x[1] = a.y; x[2] = a.z; x[3] = a.w; x[4] = b.x; x[5] = b.y; x[6] = b.z; x[7] = b.w;
    }
};
template <> struct Raw8<kvq8_0> {
    u16 d, w[4];
    __device__ __forceinline__ void load(const kvq8_0* row, int i) {
        const u8* b = (const u8*)row + (i >> 5) * Q8_0_BYTES;
        const u16* qs = (const u16*)(b + 2 + (i & 31));
        d = *(const u16*)b;
#pragma unroll
        for (int k = 0; k < 4; ++k) w[k] = qs[k];
    }
    __device__ __forceinline__ void zero() { d = w[0] = w[1] = w[2] = w[3] = 0; }
    __device__ __forceinline__ void floats(float x[8]) const {
        const float s = h2f(d);
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            x[2 * k] = s * (float)(signed char)(w[k] & 0xffu);
            x[2 * k + 1] = s * (float)(signed char)(w[k] >> 8);
        }
    }
};

// attention_decode's store of a decode step's new key and value at position p, by the block that takes the chunk
// holding p (on), before any of the block's threads reads it.
template <typename KV>
__device__ __forceinline__ void decode_store_new(const float* __restrict__ k_new, const float* __restrict__ v_new,
                                                 KV* cache_k, KV* cache_v, const KVRows& kv, int p, int tok, int kvh,
                                                 int n_kv, int head_dim, bool on, int tid) {
    if (on) {
        const long long src = ((long long)tok * n_kv + kvh) * head_dim;
        const long long dst = kv(p) * n_kv * head_dim + (long long)kvh * head_dim;
        for (int e = tid; e < head_dim; e += DECODE_WARPS * 32) {
            cache_k[dst + e] = kv_cast<KV>(k_new[src + e]);
            cache_v[dst + e] = kv_cast<KV>(v_new[src + e]);
        }
    }
    __syncthreads();
}
template <>
__device__ __forceinline__ void decode_store_new<kvq8_0>(const float* __restrict__ k_new,
                                                         const float* __restrict__ v_new, kvq8_0* cache_k,
                                                         kvq8_0* cache_v, const KVRows& kv, int p, int tok, int kvh,
                                                         int n_kv, int head_dim, bool on, int tid) {
    if (on) {                                            // warp w: the head row's blocks w, w + DECODE_WARPS, ...
        const int row = kv_row_elems<kvq8_0>(head_dim), lane = tid & 31;
        const long long src = ((long long)tok * n_kv + kvh) * head_dim;
        const long long dst = kv(p) * n_kv * row + (long long)kvh * row;
        for (int b = tid >> 5; b < head_dim / 32; b += DECODE_WARPS) {
            warp_store_q8_0(k_new[src + b * 32 + lane], lane, (u8*)cache_k + dst + b * Q8_0_BYTES);
            warp_store_q8_0(v_new[src + b * 32 + lane], lane, (u8*)cache_v + dst + b * Q8_0_BYTES);
        }
    }
    __syncthreads();
}

// attention_decode's (and attention_decode_mma's) last step: the block's chunk states are in part; the last block of
// the (token, group) to finish merges the chunks' states in chunk order into out (and out's q8_1 blocks when qs is
// not null, its f16 form when h16 is; s_out: shared memory for gq * head_dim floats).
template <int GM>
__device__ __forceinline__ void decode_finish(float* __restrict__ out, const float* part, int* __restrict__ counters,
                                              signed char* __restrict__ qs, float2* __restrict__ ds,
                                              signed char* __restrict__ rs, u16* __restrict__ h16, float* s_out,
                                              int tok, int n_head, int h0, int gq, int head_dim, int max_chunks,
                                              int n_chunks, int n_split, int tid) {
    const int lane = tid & 31, w = tid >> 5;
    __threadfence();                                    // this block's chunk states are visible before the ticket
    __shared__ int s_ticket;
    if (tid == 0) s_ticket = atomicAdd(&counters[(long long)tok * gridDim.y + blockIdx.y], 1);
    __syncthreads();
    if (s_ticket != min(n_split, n_chunks) - 1) return;
    __threadfence();
    if (tid == 0) counters[(long long)tok * gridDim.y + blockIdx.y] = 0;
    // the last block: warp w weighs the chunks of heads w, w + DECODE_WARPS, ... (lane i: chunks i, i + 32, ...) ...
    __shared__ float s_f[GM][DECODE_MAX_CHUNKS], s_sum[GM];
    const int cstride = head_dim + 4, pstride = max_chunks * cstride;
    for (int g = w; g < gq; g += DECODE_WARPS) {
        const float* pp = part + ((long long)tok * n_head + h0 + g) * pstride;
        constexpr int PER_LANE = DECODE_MAX_CHUNKS / 32;
        float mz[PER_LANE], mall = NEG_INF;
#pragma unroll
        for (int b = 0; b < PER_LANE; ++b) {
            const int cz = lane + 32 * b;
            mz[b] = cz < n_chunks ? __ldcg(pp + cz * cstride) : NEG_INF;
            mall = fmaxf(mall, mz[b]);
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) mall = fmaxf(mall, __shfl_xor_sync(0xffffffffu, mall, o));
        float lsum = 0.f;
#pragma unroll
        for (int b = 0; b < PER_LANE; ++b) {
            const int cz = lane + 32 * b;
            if (cz < n_chunks) {
                const float f = expf(mz[b] - mall);
                s_f[g][cz] = f;
                lsum += f * __ldcg(pp + cz * cstride + 1);
            }
        }
        lsum = warp_sum(lsum);
        if (lane == 0) s_sum[g] = lsum;
    }
    __syncthreads();
    // ... then each thread sums 4 consecutive output values over the chunks, in chunk order (16-byte loads, many in
    // flight: one block reads every chunk's outputs) ...
    for (int e = tid * 4; e < gq * head_dim; e += DECODE_WARPS * 128) {
        const int g = e / head_dim, d = e % head_dim;
        const long long th = (long long)tok * n_head + h0 + g;
        const float* pp = part + th * pstride + 4 + d;
        float4 a = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 16
        for (int cz = 0; cz < n_chunks; ++cz) {
            const float f = s_f[g][cz];
            const float4 x = __ldcg((const float4*)(pp + cz * cstride));
            a.x += f * x.x; a.y += f * x.y; a.z += f * x.z; a.w += f * x.w;
        }
        const float sum = s_sum[g];
        const float4 v = make_float4(a.x / sum, a.y / sum, a.z / sum, a.w / sum);
        *(float4*)(out + th * head_dim + d) = v;
        if (h16 != nullptr)
            *(uint2*)(h16 + th * head_dim + d) = make_uint2(pack_f16x2(v.x, v.y), pack_f16x2(v.z, v.w));
        *(float4*)(s_out + e) = v;
    }
    if (qs == nullptr) return;
    __syncthreads();
    // ... and, for the next mul_mat, their q8_1 blocks (a warp per block of 32)
    for (int e0 = w * 32; e0 < gq * head_dim; e0 += DECODE_WARPS * 32) {
        const long long at = ((long long)tok * n_head + h0) * head_dim + e0;   // in [n, n_head * head_dim]
        warp_store_q8_1(s_out[e0 + lane], lane, qs + at, ds + at / 16, rs == nullptr ? nullptr : rs + at);
    }
}

template <typename KV, int DP, int GMAX, bool CAP>   // DP: head_dim padded (DECODE_HEAD_DIMS); GMAX: query heads
__global__ void __launch_bounds__(DECODE_WARPS * 32)
attention_decode(const float* __restrict__ q, KV* cache_k, KV* cache_v, float* __restrict__ out,
                 const int* __restrict__ tabs, const int* __restrict__ positions, const int* __restrict__ tables,
                 int width, int shift, int rows, int n_head, int n_kv, int head_dim, float scale, int window,
                 float softcap, float* __restrict__ part, int max_chunks, int chunk_cap, int* __restrict__ counters,
                 signed char* __restrict__ qs, float2* __restrict__ ds, signed char* __restrict__ rs,
                 u16* __restrict__ h16, const float* __restrict__ k_new, const float* __restrict__ v_new) {
    PDL_WAIT();
    constexpr int LPK = DP / 8, KPW = 32 / LPK, GROUPS = DECODE_WARPS * KPW;   // lanes per key, keys per warp
    __shared__ float s_m[DECODE_WARPS][GMAX], s_l[DECODE_WARPS][GMAX];
    __shared__ float s_acc[DECODE_WARPS][GMAX][DP];
    const DecodeBlock blk(positions, n_head, n_kv, GMAX, window, chunk_cap);
    if (blk.z >= blk.n_chunks) return;
    const int tok = blk.tok, z = blk.z, n_split = blk.n_split, kvh = blk.kvh, h0 = blk.h0, gq = blk.gq;
    const int p = blk.p, lo = blk.lo, chunk = blk.chunk, n_chunks = blk.n_chunks;
    const int lane = threadIdx.x, w = threadIdx.y, tid = w * 32 + lane, sub = lane % LPK, ks = lane / LPK;
    const KVRows kv(tables, width, shift, rows, tabs[tok]);
    const int row = kv_row_elems<KV>(head_dim);          // a head row's cache elements
    const long long stride = (long long)n_kv * row, off = (long long)kvh * row;
    const bool lane_on = sub * 8 < head_dim;
    float qv[GMAX][8];
#pragma unroll
    for (int g = 0; g < GMAX; ++g)
#pragma unroll
        for (int i = 0; i < 8; ++i)
            qv[g][i] = g < gq && lane_on ? q[((long long)tok * n_head + h0 + g) * head_dim + sub * 8 + i] * scale : 0.f;
    decode_store_new(k_new, v_new, cache_k, cache_v, kv, p, tok, kvh, n_kv, head_dim,
                     k_new != nullptr && z == (n_chunks - 1) % n_split, tid);
    for (int c = z; c < n_chunks; c += n_split) {
        const int j0 = lo + c * chunk, j1 = min(p + 1, j0 + chunk);
        float m[GMAX], l[GMAX], acc[GMAX][8];
#pragma unroll
        for (int g = 0; g < GMAX; ++g) {
            m[g] = NEG_INF; l[g] = 0.f;
#pragma unroll
            for (int i = 0; i < 8; ++i) acc[g][i] = 0.f;
        }
        for (int jw = j0 + w * KPW; jw < j1; jw += DECODE_KEYS * GROUPS) {     // the same trip count in a warp
            Raw8<KV> kr[DECODE_KEYS], vr[DECODE_KEYS];
#pragma unroll
            for (int u = 0; u < DECODE_KEYS; ++u) {
                const int j = jw + ks + u * GROUPS;
                if (j < j1 && lane_on) {
                    const long long r = kv(j) * stride + off;
                    kr[u].load(cache_k + r, sub * 8);
                    vr[u].load(cache_v + r, sub * 8);
                } else {
                    kr[u].zero();
                    vr[u].zero();
                }
            }
            float s[DECODE_KEYS][GMAX];                 // scores, then probabilities
#pragma unroll
            for (int u = 0; u < DECODE_KEYS; ++u) {
                float kx[8];
                kr[u].floats(kx);
#pragma unroll
                for (int g = 0; g < GMAX; ++g) {
                    float a = 0.f;
#pragma unroll
                    for (int i = 0; i < 8; ++i) a += qv[g][i] * kx[i];
                    s[u][g] = a;
                }
            }
#pragma unroll
            for (int o = LPK / 2; o > 0; o >>= 1)
#pragma unroll
                for (int u = 0; u < DECODE_KEYS; ++u)
#pragma unroll
                    for (int g = 0; g < GMAX; ++g) s[u][g] += __shfl_xor_sync(0xffffffffu, s[u][g], o);
#pragma unroll
            for (int u = 0; u < DECODE_KEYS; ++u) {
                const bool in = jw + ks + u * GROUPS < j1;
#pragma unroll
                for (int g = 0; g < GMAX; ++g)
                    s[u][g] = !in ? NEG_INF : CAP ? softcap * tanhf(s[u][g] / softcap) : s[u][g];
            }
#pragma unroll
            for (int g = 0; g < GMAX; ++g) {
                float m_new = m[g];
#pragma unroll
                for (int u = 0; u < DECODE_KEYS; ++u) m_new = fmaxf(m_new, s[u][g]);
                const float corr = m_new == NEG_INF ? 1.f : expf(m[g] - m_new);   // no key of this group yet: 1
                float psum = 0.f;
#pragma unroll
                for (int u = 0; u < DECODE_KEYS; ++u) {
                    s[u][g] = s[u][g] == NEG_INF ? 0.f : expf(s[u][g] - m_new);
                    psum += s[u][g];
                }
                l[g] = l[g] * corr + psum;
                m[g] = m_new;
#pragma unroll
                for (int i = 0; i < 8; ++i) acc[g][i] *= corr;
            }
#pragma unroll
            for (int u = 0; u < DECODE_KEYS; ++u) {
                float vx[8];
                vr[u].floats(vx);
#pragma unroll
                for (int g = 0; g < GMAX; ++g)
#pragma unroll
                    for (int i = 0; i < 8; ++i) acc[g][i] += s[u][g] * vx[i];
            }
        }
        // the warp's key groups merge (lanes LPK apart hold the same dims of different keys) ...
#pragma unroll
        for (int o = LPK; o < 32; o <<= 1)
#pragma unroll
            for (int g = 0; g < GMAX; ++g) {
                const float mo = __shfl_xor_sync(0xffffffffu, m[g], o), lo_ = __shfl_xor_sync(0xffffffffu, l[g], o);
                const float mn = fmaxf(m[g], mo);
                const float fs = m[g] == NEG_INF ? 0.f : expf(m[g] - mn), fo = mo == NEG_INF ? 0.f : expf(mo - mn);
                l[g] = l[g] * fs + lo_ * fo;
#pragma unroll
                for (int i = 0; i < 8; ++i) acc[g][i] = acc[g][i] * fs + __shfl_xor_sync(0xffffffffu, acc[g][i], o) * fo;
                m[g] = mn;
            }
        // ... then the warps, through shared memory, into the chunk's state
        if (ks == 0 && lane_on)
#pragma unroll
            for (int g = 0; g < GMAX; ++g)
#pragma unroll
                for (int i = 0; i < 8; ++i) s_acc[w][g][sub * 8 + i] = acc[g][i];
        if (lane == 0)
#pragma unroll
            for (int g = 0; g < GMAX; ++g) { s_m[w][g] = m[g]; s_l[w][g] = l[g]; }
        __syncthreads();
        for (int e = tid; e < gq * head_dim; e += DECODE_WARPS * 32) {
            const int g = e / head_dim, d = e % head_dim;
            float mx = NEG_INF;
#pragma unroll
            for (int i = 0; i < DECODE_WARPS; ++i) mx = fmaxf(mx, s_m[i][g]);
            float lt = 0.f, a = 0.f;                    // the chunk has keys: mx is finite
#pragma unroll
            for (int i = 0; i < DECODE_WARPS; ++i) {
                const float f = s_m[i][g] == NEG_INF ? 0.f : expf(s_m[i][g] - mx);
                lt += f * s_l[i][g];
                a += f * s_acc[i][g][d];
            }
            float* pp = part + (((long long)tok * n_head + h0 + g) * max_chunks + c) * (head_dim + 4);
            if (d == 0) { pp[0] = mx; pp[1] = lt; }
            pp[4 + d] = a;
        }
        __syncthreads();                                // s_* are read before the next chunk writes them
    }
    decode_finish<GMAX>(out, part, counters, qs, ds, rs, h16, &s_acc[0][0][0], tok, n_head, h0, gq, head_dim,
                        max_chunks, n_chunks, n_split, tid);
}

__host__ __device__ constexpr int decode_mma_smem_bytes(int d) {   // queries, then two stages of K and V tiles, f16
    return DECODE_MMA_SMEM_ROWS * (d + 8) * 2;
}

// attention_decode on f16 tensor cores, for an f16 cache of head_dim D: the block's query heads are the rows of the
// mma's A (as attention_prefill_mma's queries are; rows past the group are zero), its chunks the same as
// attention_decode's. A chunk's keys come in tiles of DECODE_MMA_KEYS (cp.async, the next tile loading while the warps
// work on this one); warp w takes keys 16w..16w+15 of each tile: S = Q K^T, the online softmax in fp32 (log2
// units), O += P V with Q and P rounded to f16; at the chunk's end the warps' states merge through shared memory
// into the chunk's state in part (its max in natural-log units, as attention_decode's). decode_finish as there.
// The first chunk's tiles start loading before anything else; a decode step's new key and value (k_new, v_new)
// go to the cache for later steps and, as f16, straight into the tile row of position p, which is not read back.
//   Launch rule: grid (n, n_kv * ceil(G / DECODE_MMA_ROWS), n_split), block (32, DECODE_WARPS), dynamic shared
//   memory decode_mma_smem_bytes(D); D one of build.DECODE_MMA_HEAD_DIMS; n_split <= max_chunks.
template <int D, bool CAP>
__global__ void __launch_bounds__(DECODE_WARPS * 32)
attention_decode_mma(const float* __restrict__ q, u16* cache_k, u16* cache_v, float* __restrict__ out,
                     const int* __restrict__ tabs, const int* __restrict__ positions, const int* __restrict__ tables,
                     int width, int shift, int rows, int n_head, int n_kv, int head_dim, float scale, int window,
                     float softcap, float* __restrict__ part, int max_chunks, int chunk_cap,
                     int* __restrict__ counters,
                     signed char* __restrict__ qs, float2* __restrict__ ds, signed char* __restrict__ rs,
                     u16* __restrict__ h16, const float* __restrict__ k_new, const float* __restrict__ v_new) {
    PDL_WAIT();
    constexpr int LDS = D + 8, R = DECODE_MMA_ROWS, BK = DECODE_MMA_KEYS, TILE = 2 * BK * LDS;   // TILE: K then V
    extern __shared__ __align__(16) u16 dm_smem[];
    u16* sQ = dm_smem;                          // [R][LDS] the queries, scaled (log2 units), f16
    u16* sKV = sQ + R * LDS;                    // [2 stages][K, V][BK][LDS] tiles
    const DecodeBlock blk(positions, n_head, n_kv, R, window, chunk_cap);
    if (blk.z >= blk.n_chunks) return;
    const int tok = blk.tok, z = blk.z, n_split = blk.n_split, kvh = blk.kvh, h0 = blk.h0, gq = blk.gq;
    const int p = blk.p, lo = blk.lo, chunk = blk.chunk, n_chunks = blk.n_chunks;
    const int lane = threadIdx.x, w = threadIdx.y, tid = w * 32 + lane;
    const KVRows kv(tables, width, shift, rows, tabs[tok]);
    const long long stride = (long long)n_kv * D, off = (long long)kvh * D;
    auto load_tile = [&](int stage, int j0, int j1) {   // keys j0.. (< j1, else zeros) into a stage, one group
        u16* sK = sKV + stage * TILE;
        u16* sV = sK + BK * LDS;
        for (int e = tid; e < BK * D / 8; e += DECODE_WARPS * 32) {
            const int r = e / (D / 8), c = (e % (D / 8)) * 8, j = j0 + r;
            const bool in = j < j1;
            const long long at = in ? kv(j) * stride + off + c : 0;
            cp_async16(sK + r * LDS + c, cache_k + at, in ? 16 : 0);
            cp_async16(sV + r * LDS + c, cache_v + at, in ? 16 : 0);
        }
        cp_async_commit();
    };
    auto load_chunk = [&](int c) {                      // a chunk's first two tiles
        const int j0 = lo + c * chunk, j1 = min(p + 1, j0 + chunk);
        load_tile(0, j0, j1);
        if (j1 - j0 > BK) load_tile(1, j0 + BK, j1);
    };
    load_chunk(z);          // at once: the new key's row (position p) is written into its tile below, not read back
    const bool stores = k_new != nullptr && z == (n_chunks - 1) % n_split;   // the block of the chunk holding p
    constexpr int PER = (D + DECODE_WARPS * 32 - 1) / (DECODE_WARPS * 32);
    u16 kn[PER], vn[PER];                               // the new key and value, f16 as the cache holds them
    if (stores)
#pragma unroll
        for (int i = 0; i < PER; ++i) {
            const int e = tid + i * DECODE_WARPS * 32;
            const long long src = ((long long)tok * n_kv + kvh) * D + e;
            kn[i] = e < D ? f2h(k_new[src]) : 0;
            vn[i] = e < D ? f2h(v_new[src]) : 0;
        }
    const float qscale = scale * 1.4426950408889634f, cap2 = softcap * 1.4426950408889634f;
    for (int e = tid; e < R * D / 2; e += DECODE_WARPS * 32) {
        const int r = e / (D / 2), c = (e % (D / 2)) * 2;
        float2 v = make_float2(0.f, 0.f);
        if (r < gq) v = *(const float2*)(q + ((long long)tok * n_head + h0 + r) * D + c);
        *(u32*)(sQ + r * LDS + c) = pack_f16x2(v.x * qscale, v.y * qscale);
    }
    if (stores) {                               // for later steps, from the registers the tile row is patched from
        const long long dst = kv(p) * stride + off;
#pragma unroll
        for (int i = 0; i < PER; ++i) {
            const int e = tid + i * DECODE_WARPS * 32;
            if (e < D) { cache_k[dst + e] = kn[i]; cache_v[dst + e] = vn[i]; }
        }
    }
    const int kw = w * 16;                      // this warp's first key in a tile
    for (int c = z; c < n_chunks; c += n_split) {
        const int j0 = lo + c * chunk, j1 = min(p + 1, j0 + chunk), n_tiles = (j1 - j0 + BK - 1) / BK;
        if (c != z) load_chunk(c);
        float o[D / 8][4];                      // O rows g, g + 8: 8-column tiles
#pragma unroll
        for (int i = 0; i < D / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
        float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f};   // l: this lane's part of the row sums
        for (int ti = 0; ti < n_tiles; ++ti) {
            if (ti + 1 < n_tiles) cp_async_wait<1>(); else cp_async_wait_all();
            __syncthreads();                    // tile ti is in shared memory (and sQ written)
            const int jt = j0 + ti * BK;
            const u16* sK = sKV + (ti & 1) * TILE;
            const u16* sV = sK + BK * LDS;
            if (stores && jt <= p && p < jt + BK) {     // the new key's row: the values decode_store_new wrote
                u16* row = sKV + (ti & 1) * TILE + (p - jt) * LDS;
#pragma unroll
                for (int i = 0; i < PER; ++i) {
                    const int e = tid + i * DECODE_WARPS * 32;
                    if (e < D) { row[e] = kn[i]; row[BK * LDS + e] = vn[i]; }
                }
                __syncthreads();
            }
            if (jt + kw < j1) {                 // some of this warp's keys are in the chunk
                fa_tile_step<D>(sQ, sK, sV, kw, lane, CAP, cap2,
                                [&](int key, int) { return jt + key < j1; }, o, m, l);
            }
            __syncthreads();                    // the stage is consumed: the tile after next may load into it
            if (ti + 2 < n_tiles) load_tile(ti & 1, jt + 2 * BK, j1);
        }
        // the four warps' states merge through shared memory (the tiles' space: none is loading) into part
        float* sO = (float*)sKV;                // [DECODE_WARPS][R][D] outputs, then [DECODE_WARPS][R] maxima, sums
        float* sM = sO + DECODE_WARPS * R * D;
        float* sL = sM + DECODE_WARPS * R;
        fa_publish<D>(sO, sM, sL, w, lane, o, m, l);
        __syncthreads();
        for (int e = tid; e < gq * D; e += DECODE_WARPS * 32) {
            const int r = e / D, d = e % D;
            float mx, lt;                       // the chunk has keys: mx is finite
            const float a = fa_merge<D, DECODE_WARPS>(sO, sM, sL, r, d, mx, lt);
            float* pp = part + (((long long)tok * n_head + h0 + r) * max_chunks + c) * (D + 4);
            if (d == 0) { pp[0] = mx * 0.6931471805599453f; pp[1] = lt; }    // the max in natural-log units
            pp[4 + d] = a;
        }
        __syncthreads();                        // sO is read before the next chunk's tiles load
    }
    decode_finish<R>(out, part, counters, qs, ds, rs, h16, (float*)sKV, tok, n_head, h0, gq, D, max_chunks, n_chunks,
                     n_split, tid);
}

__host__ __device__ constexpr int prefill_smem_floats(int d) {   // attention_prefill's sq, sk, sv, sp below
    return (PREFILL_BQ + PREFILL_BK) * (d + 1) + PREFILL_BK * d + PREFILL_BQ * (PREFILL_BK + 1);
}

template <typename KV, int D>
__global__ void __launch_bounds__(128)
attention_prefill(const float* __restrict__ q, const KV* __restrict__ cache_k, const KV* __restrict__ cache_v,
                  float* __restrict__ out, const int* __restrict__ tabs, const int* __restrict__ positions,
                  const int* __restrict__ tables, int width, int shift, int rows, const int* __restrict__ tiles,
                  int n, int n_head, int n_kv, float scale, int window, float softcap) {
    PDL_WAIT();
    constexpr int BQ = PREFILL_BQ, BK = PREFILL_BK, DP = D + 1, PP = BK + 1, PER = D / 4;
    extern __shared__ float smem[];
    float* sq = smem;                  // [BQ][DP] queries, scaled
    float* sk = sq + BQ * DP;          // [BK][DP] keys of the tile
    float* sv = sk + BK * DP;          // [BK][D]  values of the tile
    float* sp = sv + BK * D;           // [BQ][PP] probabilities of the tile
    const int tid = threadIdx.x, r = tid >> 2, c = tid & 3;
    const int h = blockIdx.y, kvh = h / (n_head / n_kv);
    const int t0 = tiles ? tiles[2 * blockIdx.x] : blockIdx.x * BQ;
    const int nq = tiles ? tiles[2 * blockIdx.x + 1] : min(BQ, n - t0);
    const int p0 = positions[t0];                          // the block's first query's position
    for (int e = tid; e < BQ * D; e += 128) {
        const int rr = e / D, d = e % D;
        sq[rr * DP + d] = rr < nq ? q[((long long)(t0 + rr) * n_head + h) * D + d] * scale : 0.f;
    }
    const int qp = p0 + r, qp_last = p0 + nq - 1;
    const int lo = window > 0 ? max(0, p0 - window + 1) : 0;
    const long long stride = (long long)n_kv * kv_row_elems<KV>(D), off = (long long)kvh * kv_row_elems<KV>(D);
    const KVRows kv(tables, width, shift, rows, tabs[t0]);
    float o[PER];
#pragma unroll
    for (int i = 0; i < PER; ++i) o[i] = 0.f;
    float m = NEG_INF, l = 0.f;
    for (int j0 = lo; j0 <= qp_last; j0 += BK) {
        __syncthreads();                                    // the previous tile is consumed (and sq is written)
        for (int e = tid; e < BK * D; e += 128) {
            const int jj = e / D, d = e % D, j = j0 + jj;
            const bool in = j <= qp_last;
            const long long r = in ? kv(j) * stride + off : 0;
            sk[jj * DP + d] = in ? kv_get<KV>(cache_k + r, d) : 0.f;
            sv[jj * D + d] = in ? kv_get<KV>(cache_v + r, d) : 0.f;
        }
        __syncthreads();
        float s[BK / 4];
#pragma unroll
        for (int i = 0; i < BK / 4; ++i) s[i] = 0.f;
#pragma unroll 8
        for (int d = 0; d < D; ++d) {
            const float qd = sq[r * DP + d];
#pragma unroll
            for (int i = 0; i < BK / 4; ++i) s[i] += qd * sk[(c + 4 * i) * DP + d];
        }
        float tmax = NEG_INF;
#pragma unroll
        for (int i = 0; i < BK / 4; ++i) {
            const int j = j0 + c + 4 * i;
            const bool ok = r < nq && j <= qp && (window <= 0 || j > qp - window);
            s[i] = ok ? (softcap > 0.f ? softcap * tanhf(s[i] / softcap) : s[i]) : NEG_INF;
            tmax = fmaxf(tmax, s[i]);
        }
        tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, 1));
        tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, 2));
        const float m_new = fmaxf(m, tmax);
        const float corr = m_new == NEG_INF ? 1.f : expf(m - m_new);
        float psum = 0.f;
#pragma unroll
        for (int i = 0; i < BK / 4; ++i) {
            const float pj = s[i] == NEG_INF ? 0.f : expf(s[i] - m_new);
            sp[r * PP + c + 4 * i] = pj;
            psum += pj;
        }
        psum += __shfl_xor_sync(0xffffffffu, psum, 1);
        psum += __shfl_xor_sync(0xffffffffu, psum, 2);
        l = l * corr + psum;
        m = m_new;
        __syncwarp();                                       // row r's probabilities come from its 4 lanes
#pragma unroll
        for (int i = 0; i < PER; ++i) o[i] *= corr;
        for (int jj = 0; jj < BK; ++jj) {
            const float pj = sp[r * PP + jj];
#pragma unroll
            for (int i = 0; i < PER; ++i) o[i] += pj * sv[jj * D + c + 4 * i];
        }
    }
    if (r < nq) {
        float* oh = out + ((long long)(t0 + r) * n_head + h) * D;
#pragma unroll
        for (int i = 0; i < PER; ++i) oh[c + 4 * i] = o[i] / l;
    }
}
