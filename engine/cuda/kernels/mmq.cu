// MMQ: y = x W^T on int8 tensor cores (mma.sync m16n8k32 / m16n8k16 s8.s8.s32) for many activation columns.
//   w  : [m, k] in T's blocks (row stride row_bytes)
//   qs : [n_pad, k] int8 and ds : [n_pad, k/16] float2, from quantize_q8_1 (n_pad a multiple of MMQ_BN)
//   y  : [n, m] f32
// Each block computes a MMQ_BM x MMQ_BN tile of y^T. Per stage of 256 k-values it unpacks the raw weight blocks into
// int8 + per-16/32 scales in shared memory, copies the q8_1 activation tile beside them, and every warp runs the mma
// over its 32 x 32 sub-tile: integer accumulation over each 32-wide chunk (two k16 halves for the per-16-scale types
// Q2_K/Q3_K/Q6_K), then the fp32 rescale  acc += d_w * d_x * int_dot (+ m_w * d_x * sum(q_x) for the affine types).
// Launch rule (should_use_mmq in dispatch.py): block 256 threads, grid (ceil(m / MMQ_BM), n_pad / MMQ_BN),
// dynamic shared memory MMQ_SMEM_BYTES.
#include "common.cuh"

#define MMQ_BM 128
#define MMQ_BN 64
#define MMQ_KT 256                       // k-values per stage
#define MMQ_CH (MMQ_KT / 32)             // chunks per stage
#define MMQ_LD (MMQ_KT + 16)             // smem row stride in bytes: 68 words = 4 (mod 32) banks apart
#define MMQ_THREADS 256

// shared memory layout (bytes)
#define SM_A 0
#define SM_B (SM_A + MMQ_BM * MMQ_LD)
#define SM_AD (SM_B + MMQ_BN * MMQ_LD)                    // float [MMQ_BM][MMQ_CH][2]  weight scale per half
#define SM_AM (SM_AD + MMQ_BM * MMQ_CH * 2 * 4)           // float [MMQ_BM][MMQ_CH][2]  weight additive term
#define SM_BD (SM_AM + MMQ_BM * MMQ_CH * 2 * 4)           // float2 [MMQ_BN][MMQ_CH*2]  activation (d, d*sum16)
#define MMQ_SMEM_BYTES (SM_BD + MMQ_BN * MMQ_CH * 2 * 8)

__device__ __forceinline__ void mma_k32(int c[4], const int a[4], const int b[2]) {
    asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

__device__ __forceinline__ void mma_k16(int c[4], int a0, int a1, int b0) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};"
                 : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
                 : "r"(a0), "r"(a1), "r"(b0));
}

template <int T>
__global__ void __launch_bounds__(MMQ_THREADS, 2)
mmq(const u8* __restrict__ w, const signed char* __restrict__ qs, const float2* __restrict__ ds,
    float* __restrict__ y, int m, int n, int k, long long row_bytes) {
    extern __shared__ __align__(16) u8 smem[];
    u8* sA = smem + SM_A;
    u8* sB = smem + SM_B;
    float* sAd = (float*)(smem + SM_AD);
    float* sAm = (float*)(smem + SM_AM);
    float2* sBd = (float2*)(smem + SM_BD);
    constexpr bool PER16 = TypeTraits<T>::per16, HAS_MIN = TypeTraits<T>::has_min;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int row0 = blockIdx.x * MMQ_BM, col0 = blockIdx.y * MMQ_BN;
    const int wm = (warp >> 1) * 32, wn = (warp & 1) * 32;     // this warp's 32 x 32 sub-tile
    const int chunks = k / 32;

    float acc[2][4][4];
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int l = 0; l < 4; ++l) acc[i][j][l] = 0.f;

    for (int c0 = 0; c0 < chunks; c0 += MMQ_CH) {
        // ---- stage: weights, unpacked to int8 + scales (one chunk per thread per pass)
#pragma unroll
        for (int p = 0; p < MMQ_BM * MMQ_CH / MMQ_THREADS; ++p) {
            const int idx = tid + p * MMQ_THREADS, r = idx / MMQ_CH, ch = idx % MMQ_CH;
            int v[8] = {0, 0, 0, 0, 0, 0, 0, 0};
            ChunkScale s = {{0.f, 0.f}, {0.f, 0.f}};
            if (row0 + r < m && c0 + ch < chunks) unpack<T>(w + (long long)(row0 + r) * row_bytes, c0 + ch, v, s);
            int4* dst = (int4*)(sA + r * MMQ_LD + ch * 32);
            dst[0] = make_int4(v[0], v[1], v[2], v[3]);
            dst[1] = make_int4(v[4], v[5], v[6], v[7]);
            sAd[(r * MMQ_CH + ch) * 2 + 0] = s.d[0];
            sAd[(r * MMQ_CH + ch) * 2 + 1] = s.d[1];
            if (HAS_MIN) {
                sAm[(r * MMQ_CH + ch) * 2 + 0] = s.m[0];
                sAm[(r * MMQ_CH + ch) * 2 + 1] = s.m[1];
            }
        }
        // ---- stage: activations (16 bytes per thread per pass)
#pragma unroll
        for (int p = 0; p < MMQ_BN * (MMQ_KT / 16) / MMQ_THREADS; ++p) {
            const int idx = tid + p * MMQ_THREADS, cl = idx / (MMQ_KT / 16), part = idx % (MMQ_KT / 16);
            const int kk = c0 * 32 + part * 16;
            int4 val = make_int4(0, 0, 0, 0);
            if (kk < k) val = *(const int4*)(qs + (long long)(col0 + cl) * k + kk);
            *(int4*)(sB + cl * MMQ_LD + part * 16) = val;
        }
#pragma unroll
        for (int p = 0; p < MMQ_BN * MMQ_CH * 2 / MMQ_THREADS; ++p) {
            const int idx = tid + p * MMQ_THREADS, cl = idx / (MMQ_CH * 2), h = idx % (MMQ_CH * 2);
            const int kh = c0 * 2 + h;
            sBd[idx] = kh < chunks * 2 ? ds[(long long)(col0 + cl) * (k / 16) + kh] : make_float2(0.f, 0.f);
        }
        __syncthreads();

        // ---- compute
#pragma unroll 2
        for (int ch = 0; ch < MMQ_CH; ++ch) {
            int a[2][4], b[4][2];
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                const u8* base = sA + (wm + i * 16 + g) * MMQ_LD + ch * 32 + t * 4;
                a[i][0] = *(const int*)(base);
                a[i][1] = *(const int*)(base + 8 * MMQ_LD);
                a[i][2] = *(const int*)(base + 16);
                a[i][3] = *(const int*)(base + 8 * MMQ_LD + 16);
            }
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const u8* base = sB + (wn + j * 8 + g) * MMQ_LD + ch * 32 + t * 4;
                b[j][0] = *(const int*)(base);
                b[j][1] = *(const int*)(base + 16);
            }
            float dw[2][2][2], mw[2][2][2];     // [i][row half][k half]
#pragma unroll
            for (int i = 0; i < 2; ++i)
#pragma unroll
                for (int rh = 0; rh < 2; ++rh) {
                    const int r = wm + i * 16 + g + rh * 8;
                    const float2 d2 = *(const float2*)(sAd + (r * MMQ_CH + ch) * 2);
                    dw[i][rh][0] = d2.x; dw[i][rh][1] = d2.y;
                    if (HAS_MIN) {
                        const float2 m2 = *(const float2*)(sAm + (r * MMQ_CH + ch) * 2);
                        mw[i][rh][0] = m2.x; mw[i][rh][1] = m2.y;
                    }
                }
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                float dx[2], sx[2][2];          // [col parity], [col parity][k half]
#pragma unroll
                for (int cp = 0; cp < 2; ++cp) {
                    const int cl = wn + j * 8 + t * 2 + cp;
                    const float4 q = *(const float4*)(sBd + cl * MMQ_CH * 2 + ch * 2);
                    dx[cp] = q.x; sx[cp][0] = q.y; sx[cp][1] = q.w;
                }
#pragma unroll
                for (int i = 0; i < 2; ++i) {
                    if (PER16) {
                        int c0v[4] = {0, 0, 0, 0}, c1v[4] = {0, 0, 0, 0};
                        mma_k16(c0v, a[i][0], a[i][1], b[j][0]);
                        mma_k16(c1v, a[i][2], a[i][3], b[j][1]);
#pragma unroll
                        for (int l = 0; l < 4; ++l) {
                            const int rh = l >> 1, cp = l & 1;
                            acc[i][j][l] += dx[cp] * (dw[i][rh][0] * (float)c0v[l] + dw[i][rh][1] * (float)c1v[l]);
                            if (HAS_MIN) acc[i][j][l] += mw[i][rh][0] * sx[cp][0] + mw[i][rh][1] * sx[cp][1];
                        }
                    } else {
                        int cv[4] = {0, 0, 0, 0};
                        mma_k32(cv, a[i], b[j]);
#pragma unroll
                        for (int l = 0; l < 4; ++l) {
                            const int rh = l >> 1, cp = l & 1;
                            acc[i][j][l] += (dw[i][rh][0] * dx[cp]) * (float)cv[l];
                            if (HAS_MIN) acc[i][j][l] += mw[i][rh][0] * (sx[cp][0] + sx[cp][1]);
                        }
                    }
                }
            }
        }
        __syncthreads();
    }

    // ---- write back y[col][row]
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int l = 0; l < 4; ++l) {
                const int r = row0 + wm + i * 16 + g + (l >> 1) * 8;
                const int cl = col0 + wn + j * 8 + t * 2 + (l & 1);
                if (r < m && cl < n) y[(long long)cl * m + r] = acc[i][j][l];
            }
}

#define INSTANTIATE_MMQ(T) template __global__ void mmq<T>(const u8* __restrict__, const signed char* __restrict__, \
    const float2* __restrict__, float* __restrict__, int, int, int, long long);
FOR_EACH_QTYPE(INSTANTIATE_MMQ)
