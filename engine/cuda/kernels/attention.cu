// Attention over the KV cache, GQA, causal with an optional sliding window; fp32 online softmax.
//
// kv_store: write this batch's k, v into the cache.
//   k, v : [n, n_kv, head_dim] f32; cache_k, cache_v : [n_seq, n_ctx, n_kv, head_dim] f16 (or f32 with KV_F32)
//   Launch rule: one thread per element; block 256.
//
// attention: one warp per (query token, head); the warp streams the keys p-window+1..p of the token's sequence
// (p = its position), each lane holding head_dim/32 of q and of the output, with an online softmax in fp32.
//   q : [n, n_head, head_dim] f32; out : [n, n_head, head_dim] f32; seq_ids, positions : [n] int32
//   Launch rule: grid (n, n_head), block 32; head_dim a multiple of 32, at most 32 * MAXE (2, 4 or 8: the
//   instantiation taking head_dim, backends/cuda.py attention_head_chunks).
//
// attention_split: the same attention for few query tokens (decode), split over the keys so that
// n * n_head * n_split blocks fill the GPU. Block z of a (token, head) takes the z-th of n_split equal chunks of the
// token's keys (chunk sizes follow the position read on the device, so a CUDA graph stays valid as the context
// grows); only as many chunks as give each at least MIN_SPLIT_KEYS keys are used (the other blocks return at once).
// A block's 4 warps take every 4th key of its chunk and merge their softmax states through shared memory, then write
// the chunk's state to part. The last block of the (token, head) to finish (a ticket from counters, which it resets
// to 0 for the next launch) merges the chunks' states into out, and, when qs is not null, writes out's q8_1 blocks
// (qs : [n, n_head * head_dim] int8, ds : [n, n_head * head_dim / 16] float2, as quantize_q8_1 writes them), and
// when rs is not null their residual plane (rs : as qs; common.cuh warp_store_q8_1).
// When k_new, v_new ([n, n_kv, head_dim] f32) are given - a decode step, one token per sequence, so no block reads
// another token's new key - the blocks of the last chunk store their token's k, v in the cache before reading it
// (kv_store's work, one launch less; the blocks of a GQA group write the same values).
//   part : [n, n_head, n_split, head_dim + 2] f32, per chunk (max score m, sum l, unnormalized output[head_dim])
//   counters : [n * n_head] int32, zero before the launch (and after it)
//   Launch rule: grid (n, n_head, n_split), n_split <= 32, block (32, 4).
//
// attention_prefill: many query tokens of one sequence at consecutive positions (a prefill ubatch) with an f32 cache
// (attention_mma.cu serves an f16 cache on tensor cores), tiled: a block
// takes 32 queries of one head and streams their keys in tiles of 32 through shared memory (as f32); scores and
// output in fp32 with an online softmax per query. Thread (r = tid / 4, c = tid % 4) owns query r: the scores of
// keys c, c+4, ... of each tile and the output dims c, c+4, .... The sequence slot and the first position are
// seq_ids[0] and positions[0]. Rows are padded by one float (no shared-memory bank conflicts).
//   q : [n, n_head, D] f32; out : [n, n_head, D] f32
//   Launch rule: grid (ceil(n / 32), n_head), block 128, dynamic shared memory prefill_smem_floats(D) * 4 bytes;
//   D (head_dim) one of 64, 128, 256.
#include "common.cuh"

#define NEG_INF __int_as_float(0xff800000)
#define MIN_SPLIT_KEYS 16

template <typename KV> __device__ __forceinline__ float kv_load(const KV* p);
template <> __device__ __forceinline__ float kv_load<u16>(const u16* p) { return h2f(*p); }
template <> __device__ __forceinline__ float kv_load<float>(const float* p) { return *p; }
template <typename KV> __device__ __forceinline__ KV kv_cast(float v);
template <> __device__ __forceinline__ u16 kv_cast<u16>(float v) { return f2h(v); }
template <> __device__ __forceinline__ float kv_cast<float>(float v) { return v; }

template <typename KV>
__global__ void kv_store(const float* __restrict__ k, const float* __restrict__ v, KV* __restrict__ cache_k,
                         KV* __restrict__ cache_v, const int* __restrict__ seq_ids, const int* __restrict__ positions,
                         int n, int n_ctx, int row) {   // row = n_kv * head_dim
    const long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= (long long)n * row) return;
    const int tok = (int)(t / row), e = (int)(t % row);
    const long long dst = ((long long)seq_ids[tok] * n_ctx + positions[tok]) * row + e;
    cache_k[dst] = kv_cast<KV>(k[t]);
    cache_v[dst] = kv_cast<KV>(v[t]);
}

// One warp's online softmax over keys j0, j0 + step, ... < j1: updates (m, l, acc); softcap > 0 caps each score s at
// softcap * tanh(s / softcap) where CAP (Gemma 2; a template argument: the branch in the loop cost Gemma 3's decode
// step 15 %, 782 -> 898 us a graph replay). Keys go ATTN_KEYS at a time:
// their k and v rows loaded together (the loads of a key no longer wait for the previous key's softmax: a decode
// step's attention is bound by that latency), then one max and one rescale for the group; the rest one by one.
#define ATTN_KEYS 4
template <typename KV, int MAXE, bool CAP>
__device__ __forceinline__ void attend_keys(const KV* kb, const KV* vb, long long stride,
                                            int j0, int j1, int step, const float* qv, float* acc, float& m,
                                            float& l, int per, int lane, float softcap) {
    int j = j0;
    for (; j + (ATTN_KEYS - 1) * step < j1; j += ATTN_KEYS * step) {
        float kx[ATTN_KEYS][MAXE], vx[ATTN_KEYS][MAXE], s[ATTN_KEYS];
#pragma unroll
        for (int u = 0; u < ATTN_KEYS; ++u) {
            const KV* kr = kb + (long long)(j + u * step) * stride;
            const KV* vr = vb + (long long)(j + u * step) * stride;
#pragma unroll
            for (int e = 0; e < MAXE; ++e)
                if (e < per) { kx[u][e] = kv_load<KV>(kr + e * 32 + lane); vx[u][e] = kv_load<KV>(vr + e * 32 + lane); }
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
        const KV* kr = kb + (long long)j * stride;
        float s = 0.f;
#pragma unroll
        for (int e = 0; e < MAXE; ++e) if (e < per) s += qv[e] * kv_load<KV>(kr + e * 32 + lane);
        s = warp_sum(s);
        if (CAP) s = softcap * tanhf(s / softcap);
        const float m_new = fmaxf(m, s);
        const float corr = expf(m - m_new), pj = expf(s - m_new);
        l = l * corr + pj;
        const KV* vr = vb + (long long)j * stride;
#pragma unroll
        for (int e = 0; e < MAXE; ++e) if (e < per) acc[e] = acc[e] * corr + pj * kv_load<KV>(vr + e * 32 + lane);
        m = m_new;
    }
}

template <typename KV, int MAXE, bool CAP>             // MAXE: head_dim / 32 at most (build.ATTENTION_HEAD_CHUNKS)
__global__ void __launch_bounds__(32)
attention(const float* __restrict__ q, const KV* __restrict__ cache_k, const KV* __restrict__ cache_v,
          float* __restrict__ out, const int* __restrict__ seq_ids, const int* __restrict__ positions,
          int n_head, int n_kv, int head_dim, int n_ctx, float scale, int window, float softcap) {
    const int tok = blockIdx.x, h = blockIdx.y, lane = threadIdx.x;
    const int per = head_dim / 32, kvh = h / (n_head / n_kv);
    const int p = positions[tok];
    const int lo = window > 0 ? max(0, p - window + 1) : 0;
    const float* qh = q + ((long long)tok * n_head + h) * head_dim;
    float qv[MAXE], acc[MAXE];
#pragma unroll
    for (int e = 0; e < MAXE; ++e) { qv[e] = e < per ? qh[e * 32 + lane] * scale : 0.f; acc[e] = 0.f; }
    const long long base = ((long long)seq_ids[tok] * n_ctx) * n_kv * head_dim + (long long)kvh * head_dim;
    const long long stride = (long long)n_kv * head_dim;
    float m = NEG_INF, l = 0.f;
    attend_keys<KV, MAXE, CAP>(cache_k + base, cache_v + base, stride, lo, p + 1, 1, qv, acc, m, l, per, lane, softcap);
    float* oh = out + ((long long)tok * n_head + h) * head_dim;
#pragma unroll
    for (int e = 0; e < MAXE; ++e) if (e < per) oh[e * 32 + lane] = acc[e] / l;
}

template <typename KV, int MAXE, bool CAP>
__global__ void __launch_bounds__(128)
attention_split(const float* __restrict__ q, KV* cache_k, KV* cache_v,
                float* __restrict__ out, const int* __restrict__ seq_ids, const int* __restrict__ positions,
                int n_head, int n_kv, int head_dim, int n_ctx, float scale, int window, float softcap,
                float* __restrict__ part,
                int* __restrict__ counters, signed char* __restrict__ qs, float2* __restrict__ ds,
                signed char* __restrict__ rs, const float* __restrict__ k_new, const float* __restrict__ v_new) {
    constexpr int WARPS = 4;
    __shared__ float s_m[WARPS], s_l[WARPS], s_acc[WARPS][MAXE * 32];
    const int tok = blockIdx.x, h = blockIdx.y, z = blockIdx.z, n_split = gridDim.z;
    const int lane = threadIdx.x, w = threadIdx.y;
    const int per = head_dim / 32, kvh = h / (n_head / n_kv);
    const int p = positions[tok];
    const int lo = window > 0 ? max(0, p - window + 1) : 0;
    const int active = min(n_split, (p - lo + MIN_SPLIT_KEYS) / MIN_SPLIT_KEYS);   // chunks of >= 16 keys
    if (z >= active) return;
    const int chunk = (p - lo + 1 + active - 1) / active;
    const int j0 = lo + z * chunk, j1 = min(p + 1, j0 + chunk);
    const float* qh = q + ((long long)tok * n_head + h) * head_dim;
    float qv[MAXE], acc[MAXE];
#pragma unroll
    for (int e = 0; e < MAXE; ++e) { qv[e] = e < per ? qh[e * 32 + lane] * scale : 0.f; acc[e] = 0.f; }
    const long long base = ((long long)seq_ids[tok] * n_ctx) * n_kv * head_dim + (long long)kvh * head_dim;
    if (k_new != nullptr && z == active - 1) {          // the chunk holding position p stores the token's k, v first
        const long long src = ((long long)tok * n_kv + kvh) * head_dim, dst = base + (long long)p * n_kv * head_dim;
        for (int e = w * 32 + lane; e < head_dim; e += WARPS * 32) {
            cache_k[dst + e] = kv_cast<KV>(k_new[src + e]);
            cache_v[dst + e] = kv_cast<KV>(v_new[src + e]);
        }
        __syncthreads();
    }
    float m = NEG_INF, l = 0.f;
    attend_keys<KV, MAXE, CAP>(cache_k + base, cache_v + base, (long long)n_kv * head_dim, j0 + w, j1, WARPS, qv, acc, m,
                         l, per, lane, softcap);
    if (lane == 0) { s_m[w] = m; s_l[w] = l; }
#pragma unroll
    for (int e = 0; e < MAXE; ++e) if (e < per) s_acc[w][e * 32 + lane] = acc[e];
    __syncthreads();
    if (w != 0) return;
    float mx = NEG_INF;
#pragma unroll
    for (int i = 0; i < WARPS; ++i) mx = fmaxf(mx, s_m[i]);
    float f[WARPS], lt = 0.f;
#pragma unroll
    for (int i = 0; i < WARPS; ++i) { f[i] = mx == NEG_INF ? 0.f : expf(s_m[i] - mx); lt += f[i] * s_l[i]; }
    const long long th = (long long)tok * n_head + h;
    const int stride = head_dim + 2;
    float* pp = part + th * n_split * stride;
    if (lane == 0) { pp[z * stride] = mx; pp[z * stride + 1] = lt; }
    for (int e = 0; e < per; ++e) {
        float a = 0.f;
#pragma unroll
        for (int i = 0; i < WARPS; ++i) a += f[i] * s_acc[i][e * 32 + lane];
        pp[z * stride + 2 + e * 32 + lane] = a;
    }
    __threadfence();                                   // this chunk's state is visible before the ticket
    int ticket = 0;
    if (lane == 0) ticket = atomicAdd(&counters[th], 1);
    ticket = __shfl_sync(0xffffffffu, ticket, 0);
    if (ticket != active - 1) return;
    __threadfence();
    if (lane == 0) counters[th] = 0;
    // the last block: lane i < active holds chunk i's max and sum (chunk 0 always has keys: the max is finite)
    const float mz = lane < active ? __ldcg(pp + lane * stride) : NEG_INF;
    float mall = mz;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) mall = fmaxf(mall, __shfl_xor_sync(0xffffffffu, mall, o));
    const float fz = lane < active ? expf(mz - mall) : 0.f;
    float lsum = lane < active ? fz * __ldcg(pp + lane * stride + 1) : 0.f;
    lsum = warp_sum(lsum);
    float* oh = out + th * head_dim;
    for (int e = 0; e < per; ++e) {
        float a = 0.f;
        for (int zz = 0; zz < active; ++zz)
            a += __shfl_sync(0xffffffffu, fz, zz) * __ldcg(pp + zz * stride + 2 + e * 32 + lane);
        const float v = a / lsum;
        oh[e * 32 + lane] = v;
        if (qs != nullptr) {                            // q8_1 blocks of the output (the next mul_mat's input)
            const long long at = th * head_dim + e * 32;   // this block's first value in [n, n_head * head_dim]
            warp_store_q8_1(v, lane, qs + at, ds + at / 16, rs == nullptr ? nullptr : rs + at);
        }
    }
}

__host__ __device__ constexpr int prefill_smem_floats(int d) { return 2 * 32 * (d + 1) + 32 * d + 32 * 33; }

template <typename KV, int D>
__global__ void __launch_bounds__(128)
attention_prefill(const float* __restrict__ q, const KV* __restrict__ cache_k, const KV* __restrict__ cache_v,
                  float* __restrict__ out, const int* __restrict__ seq_ids, const int* __restrict__ positions, int n,
                  int n_head, int n_kv, int n_ctx, float scale, int window, float softcap) {
    constexpr int BQ = 32, BK = 32, DP = D + 1, PP = BK + 1, PER = D / 4;
    extern __shared__ float smem[];
    float* sq = smem;                  // [BQ][DP] queries, scaled
    float* sk = sq + BQ * DP;          // [BK][DP] keys of the tile
    float* sv = sk + BK * DP;          // [BK][D]  values of the tile
    float* sp = sv + BK * D;           // [BQ][PP] probabilities of the tile
    const int tid = threadIdx.x, r = tid >> 2, c = tid & 3;
    const int h = blockIdx.y, kvh = h / (n_head / n_kv);
    const int t0 = blockIdx.x * BQ, nq = min(BQ, n - t0);
    const int p0 = positions[0];
    for (int e = tid; e < BQ * D; e += 128) {
        const int rr = e / D, d = e % D;
        sq[rr * DP + d] = rr < nq ? q[((long long)(t0 + rr) * n_head + h) * D + d] * scale : 0.f;
    }
    const int qp = p0 + t0 + r, qp_last = p0 + t0 + nq - 1;
    const int lo = window > 0 ? max(0, p0 + t0 - window + 1) : 0;
    const long long stride = (long long)n_kv * D;
    const long long base = (long long)seq_ids[0] * n_ctx * stride + (long long)kvh * D;
    float o[PER];
#pragma unroll
    for (int i = 0; i < PER; ++i) o[i] = 0.f;
    float m = NEG_INF, l = 0.f;
    for (int j0 = lo; j0 <= qp_last; j0 += BK) {
        __syncthreads();                                    // the previous tile is consumed (and sq is written)
        for (int e = tid; e < BK * D; e += 128) {
            const int jj = e / D, d = e % D, j = j0 + jj;
            const bool in = j <= qp_last;
            sk[jj * DP + d] = in ? kv_load<KV>(cache_k + base + j * stride + d) : 0.f;
            sv[jj * D + d] = in ? kv_load<KV>(cache_v + base + j * stride + d) : 0.f;
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
