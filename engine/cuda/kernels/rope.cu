// rope: rotate the first n_rot dims of each head by position; pairs (2i, 2i+1), or (i, i + n_rot/2) for neox.
//   x : [n, heads, head_dim] f32 (in place), positions : [n] int32
// The angle pos * base^(-2i/n_rot) and its cos/sin are computed in double (as the numpy reference does).
// Launch rule: one thread per rotated pair; block 256; grid ceil(n * heads * n_rot/2 / 256).
#include "common.cuh"

extern "C" __global__ void rope(float* __restrict__ x, const int* __restrict__ positions, int n, int heads,
                                int head_dim, int n_rot, double base, int neox) {
    const long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const int half = n_rot / 2;
    if (t >= (long long)n * heads * half) return;
    const int i = (int)(t % half);
    const long long th = t / half;                     // token * heads + head
    const int tok = (int)(th / heads);
    const double angle = (double)positions[tok] * pow(base, -2.0 * (double)i / (double)n_rot);
    const float c = (float)cos(angle), s = (float)sin(angle);
    float* h = x + th * head_dim;
    const int ia = neox ? i : 2 * i, ib = neox ? i + half : 2 * i + 1;
    const float a = h[ia], b = h[ib];
    h[ia] = a * c - b * s;
    h[ib] = a * s + b * c;
}
