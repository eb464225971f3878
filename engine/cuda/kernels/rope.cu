// rope: y = x with the first n_rot dims of each head rotated by position; pairs (2i, 2i+1), or (i, i + n_rot/2) for
// neox; dims n_rot..head_dim are copied. Out of place, so the caller needs no copy of x.
//   x, y : [n, heads, head_dim] f32, positions : [n] int32 (read on the device: a CUDA graph replays with new ones)
//   inv_freq : [n_rot/2] f64, pair i's angle per position (engine/model/rope.py: base^(-2i/n_rot) / its scaling);
//   mscale: cos and sin times it (LongRoPE's attention factor: the rotated dims only)
// The angle pos * inv_freq[i] and its cos/sin are computed in double (as the numpy reference does), once per
// (token, pair) for all heads.
// Launch rule: one thread per (token, pair of dims), head_dim/2 pairs per token; block 256;
// grid ceil(n * head_dim/2 / 256).
#include "common.cuh"

extern "C" __global__ void rope(const float* __restrict__ x, float* __restrict__ y, const int* __restrict__ positions,
                                int n, int heads, int head_dim, int n_rot, const double* __restrict__ inv_freq,
                                int neox, float mscale) {
    PDL_WAIT();
    const long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const int pairs = head_dim / 2, half = n_rot / 2;
    if (t >= (long long)n * pairs) return;
    const int i = (int)(t % pairs), tok = (int)(t / pairs);
    const float* xt = x + (long long)tok * heads * head_dim;
    float* yt = y + (long long)tok * heads * head_dim;
    if (i >= half) {                                   // the unrotated tail: dims n_rot + 2(i - half), +1
        const int d = n_rot + 2 * (i - half);
        for (int h = 0; h < heads; ++h) {
            yt[h * head_dim + d] = xt[h * head_dim + d];
            yt[h * head_dim + d + 1] = xt[h * head_dim + d + 1];
        }
        return;
    }
    const double angle = (double)positions[tok] * inv_freq[i];
    const float c = (float)cos(angle) * mscale, s = (float)sin(angle) * mscale;
    const int ia = neox ? i : 2 * i, ib = neox ? i + half : 2 * i + 1;
    for (int h = 0; h < heads; ++h) {
        const float a = xt[h * head_dim + ia], b = xt[h * head_dim + ib];
        yt[h * head_dim + ia] = a * c - b * s;
        yt[h * head_dim + ib] = a * s + b * c;
    }
}

// rope_qk: the q and k of a batch in one launch, each head optionally RMS-normed first (Gemma 3's q_norm, k_norm).
//   q : [n, n_head, head_dim], k : [n, n_kv, head_dim] f32 -> yq, yk (same shapes); q_norm, k_norm : [head_dim] f32
//   or null; inv_freq : [n_rot/2] f64 and mscale as for rope; positions : [n] int32 (on the device)
// Thread i of a head's block owns one pair of dims: rotated pair i (i < n_rot/2) or two tail dims.
// Launch rule: grid (n, n_head + n_kv), block head_dim/2 threads (head_dim a multiple of 64, at most 256).
extern "C" __global__ void __launch_bounds__(128)
rope_qk(const float* __restrict__ q, const float* __restrict__ k, float* __restrict__ yq, float* __restrict__ yk,
        const float* __restrict__ q_norm, const float* __restrict__ k_norm, const double* __restrict__ inv_freq,
        const int* __restrict__ positions, int n_head, int n_kv, int head_dim, int n_rot, int neox, float eps,
        float mscale) {
    PDL_WAIT();
    const int tok = blockIdx.x, is_k = blockIdx.y >= n_head;
    const int h = is_k ? blockIdx.y - n_head : blockIdx.y, heads = is_k ? n_kv : n_head;
    const long long off = ((long long)tok * heads + h) * head_dim;
    const float* x = (is_k ? k : q) + off;
    float* y = (is_k ? yk : yq) + off;
    const float* nw = is_k ? k_norm : q_norm;
    const int i = threadIdx.x, half = n_rot / 2;
    const bool rot = i < half;
    const int ia = rot ? (neox ? i : 2 * i) : n_rot + 2 * (i - half);
    const int ib = rot ? (neox ? i + half : 2 * i + 1) : ia + 1;
    float a = x[ia], b = x[ib];
    if (nw != nullptr) {
        const float total = block_sum(a * a + b * b);
        const float inv = 1.0f / sqrtf(total / (float)head_dim + eps);
        a = a * inv * nw[ia];
        b = b * inv * nw[ib];
    }
    if (rot) {
        double sn, cs;
        sincos((double)positions[tok] * inv_freq[i], &sn, &cs);
        const float c = (float)cs * mscale, s = (float)sn * mscale;
        const float ra = a * c - b * s, rb = a * s + b * c;
        a = ra;
        b = rb;
    }
    y[ia] = a;
    y[ib] = b;
}
