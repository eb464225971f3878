// rope: y = x with the first n_rot dims of each head rotated by position; pairs (2i, 2i+1), or (i, i + n_rot/2) for
// neox; dims n_rot..head_dim are copied. Out of place, so the caller needs no copy of x.
//   x, y : [n, heads, head_dim] f32, positions : [n] int32 (read on the device: a CUDA graph replays with new ones)
// The angle pos * base^(-2i/n_rot) and its cos/sin are computed in double (as the numpy reference does), once per
// (token, pair) for all heads.
// Launch rule: one thread per (token, pair of dims), head_dim/2 pairs per token; block 256;
// grid ceil(n * head_dim/2 / 256).
#include "common.cuh"

extern "C" __global__ void rope(const float* __restrict__ x, float* __restrict__ y, const int* __restrict__ positions,
                                int n, int heads, int head_dim, int n_rot, double base, int neox) {
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
    const double angle = (double)positions[tok] * pow(base, -2.0 * (double)i / (double)n_rot);
    const float c = (float)cos(angle), s = (float)sin(angle);
    const int ia = neox ? i : 2 * i, ib = neox ? i + half : 2 * i + 1;
    for (int h = 0; h < heads; ++h) {
        const float a = xt[h * head_dim + ia], b = xt[h * head_dim + ib];
        yt[h * head_dim + ia] = a * c - b * s;
        yt[h * head_dim + ib] = a * s + b * c;
    }
}
