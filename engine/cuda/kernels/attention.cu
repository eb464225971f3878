// Attention over the KV cache, GQA, causal with an optional sliding window; fp32 online softmax.
//
// kv_store: write this batch's k, v into the cache.
//   k, v : [n, n_kv, head_dim] f32; cache_k, cache_v : [n_seq, n_ctx, n_kv, head_dim] f16 (or f32 with KV_F32)
//   Launch rule: one thread per element; block 256.
//
// attention: one warp per (query token, head); the warp streams the keys p-window+1..p of the token's sequence
// (p = its position), each lane holding head_dim/32 of q and of the output, with an online softmax in fp32.
//   q : [n, n_head, head_dim] f32; out : [n, n_head, head_dim] f32; seq_ids, positions : [n] int32
//   Launch rule: grid (n, n_head), block 32; head_dim a multiple of 32, at most 256.
#include "common.cuh"

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

template <typename KV>
__global__ void __launch_bounds__(32)
attention(const float* __restrict__ q, const KV* __restrict__ cache_k, const KV* __restrict__ cache_v,
          float* __restrict__ out, const int* __restrict__ seq_ids, const int* __restrict__ positions,
          int n_head, int n_kv, int head_dim, int n_ctx, float scale, int window) {
    constexpr int MAXE = 8;                            // head_dim / 32 <= 8
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
    float m = __int_as_float(0xff800000), l = 0.f;   // -inf
    for (int j = lo; j <= p; ++j) {
        const KV* kr = cache_k + base + j * stride;
        float s = 0.f;
#pragma unroll
        for (int e = 0; e < MAXE; ++e) if (e < per) s += qv[e] * kv_load<KV>(kr + e * 32 + lane);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        const float m_new = fmaxf(m, s);
        const float corr = expf(m - m_new), pj = expf(s - m_new);
        l = l * corr + pj;
        const KV* vr = cache_v + base + j * stride;
#pragma unroll
        for (int e = 0; e < MAXE; ++e) if (e < per) acc[e] = acc[e] * corr + pj * kv_load<KV>(vr + e * 32 + lane);
        m = m_new;
    }
    float* oh = out + ((long long)tok * n_head + h) * head_dim;
#pragma unroll
    for (int e = 0; e < MAXE; ++e) if (e < per) oh[e * 32 + lane] = acc[e] / l;
}

#define INSTANTIATE_ATTENTION(KV) \
    template __global__ void kv_store<KV>(const float* __restrict__, const float* __restrict__, KV* __restrict__, \
        KV* __restrict__, const int* __restrict__, const int* __restrict__, int, int, int); \
    template __global__ void attention<KV>(const float* __restrict__, const KV* __restrict__, \
        const KV* __restrict__, float* __restrict__, const int* __restrict__, const int* __restrict__, int, int, \
        int, int, float, int);
INSTANTIATE_ATTENTION(u16)
INSTANTIATE_ATTENTION(float)
