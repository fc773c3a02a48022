/* out[M, N] = x[M, K] @ W^T (+ bias) for few rows (a decode step's), W prepacked (CPU, float32).
 *
 * Built and loaded by radixrt.kernels.native (ctypes); radixrt.kernels.gemm_cpu is the Python
 * side: it packs W [N, K] into panels of 16 output features, `wp[N16 / 16][K][16]` (N16 = N
 * rounded up to 16, zero columns past N), so a panel's k-th 16 weights are one 64-byte line.
 *
 * Why: at 32 rows oneDNN's packed GEMM costs ~14 us a call before any arithmetic, and a decode
 * step of the tiny Llama makes 17 of them; its weights (7.8 MB) come from L3 or DRAM each step.
 * Here a call costs a few microseconds, and while a panel is multiplied the next panel is
 * prefetched, one line per k, so the weights stream in behind the arithmetic.
 *
 * The micro-kernel keeps a 6 x 16 tile of outputs in 12 AVX2 registers: per k, two loads of the
 * panel's line, six broadcasts of x, twelve FMAs. Each output is one sequential FMA chain over
 * k (its value does not depend on M or on which tile the row is in). Threads (num_threads > 1,
 * OpenMP builds) split the panels. A portable C path (no AVX2/FMA, or -DRADIXRT_PORTABLE)
 * computes the same sums in the same order, without FMA contraction it rounds each product.
 */
#include <stdint.h>
#include <stddef.h>
#if defined(_OPENMP) && !defined(RADIXRT_NO_OPENMP)
#include <omp.h>
#define USE_OPENMP 1
#endif

#define NR 16
#define MR 6

#if defined(__AVX2__) && defined(__FMA__) && !defined(RADIXRT_PORTABLE)
#include <immintrin.h>
#define HAVE_AVX2 1
#endif

#ifdef HAVE_AVX2
/* A full 6 x 16 tile: its accumulators are named registers (an array indexed by a run-time
 * row count made GCC store all twelve every k). Prefetches `next` one line per k if given. */
static inline void tile6(const float *a, int64_t lda, int64_t k_len, const float *p,
                         const float *next, float tile[MR][NR]) {
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
    __m256 c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
    const float *a0 = a, *a1 = a + lda, *a2 = a + 2 * lda, *a3 = a + 3 * lda;
    const float *a4 = a + 4 * lda, *a5 = a + 5 * lda;
    for (int64_t k = 0; k < k_len; k++) {
        if (next != NULL) __builtin_prefetch(next + k * NR, 0, 3);
        __m256 b0 = _mm256_loadu_ps(p + k * NR), b1 = _mm256_loadu_ps(p + k * NR + 8);
        __m256 v = _mm256_broadcast_ss(a0 + k);
        c00 = _mm256_fmadd_ps(v, b0, c00), c01 = _mm256_fmadd_ps(v, b1, c01);
        v = _mm256_broadcast_ss(a1 + k);
        c10 = _mm256_fmadd_ps(v, b0, c10), c11 = _mm256_fmadd_ps(v, b1, c11);
        v = _mm256_broadcast_ss(a2 + k);
        c20 = _mm256_fmadd_ps(v, b0, c20), c21 = _mm256_fmadd_ps(v, b1, c21);
        v = _mm256_broadcast_ss(a3 + k);
        c30 = _mm256_fmadd_ps(v, b0, c30), c31 = _mm256_fmadd_ps(v, b1, c31);
        v = _mm256_broadcast_ss(a4 + k);
        c40 = _mm256_fmadd_ps(v, b0, c40), c41 = _mm256_fmadd_ps(v, b1, c41);
        v = _mm256_broadcast_ss(a5 + k);
        c50 = _mm256_fmadd_ps(v, b0, c50), c51 = _mm256_fmadd_ps(v, b1, c51);
    }
    _mm256_storeu_ps(tile[0], c00), _mm256_storeu_ps(tile[0] + 8, c01);
    _mm256_storeu_ps(tile[1], c10), _mm256_storeu_ps(tile[1] + 8, c11);
    _mm256_storeu_ps(tile[2], c20), _mm256_storeu_ps(tile[2] + 8, c21);
    _mm256_storeu_ps(tile[3], c30), _mm256_storeu_ps(tile[3] + 8, c31);
    _mm256_storeu_ps(tile[4], c40), _mm256_storeu_ps(tile[4] + 8, c41);
    _mm256_storeu_ps(tile[5], c50), _mm256_storeu_ps(tile[5] + 8, c51);
}

/* A tile of R < 6 rows (R a constant once inlined, so its accumulators stay in registers). */
static inline __attribute__((always_inline)) void tile_r(const int R, const float *a, int64_t lda,
                                                        int64_t k_len, const float *p,
                                                        const float *next, float tile[MR][NR]) {
    __m256 c[MR][2];
    for (int r = 0; r < R; r++) c[r][0] = c[r][1] = _mm256_setzero_ps();
    for (int64_t k = 0; k < k_len; k++) {
        if (next != NULL) __builtin_prefetch(next + k * NR, 0, 3);
        __m256 b0 = _mm256_loadu_ps(p + k * NR), b1 = _mm256_loadu_ps(p + k * NR + 8);
        for (int r = 0; r < R; r++) {
            __m256 v = _mm256_broadcast_ss(a + r * lda + k);
            c[r][0] = _mm256_fmadd_ps(v, b0, c[r][0]);
            c[r][1] = _mm256_fmadd_ps(v, b1, c[r][1]);
        }
    }
    for (int r = 0; r < R; r++) {
        _mm256_storeu_ps(tile[r], c[r][0]);
        _mm256_storeu_ps(tile[r] + 8, c[r][1]);
    }
}
#endif

/* One panel: rows [0, m) of x times panel `p` (K x 16) into out columns [n0, n0 + nc); the
 * first row tile prefetches the next panel (`next`, or NULL). */
static void panel(const float *x, int64_t x_stride, int64_t m, int64_t k_len, const float *p,
                  const float *next, const float *bias, float *out, int64_t out_stride,
                  int64_t n0, int64_t nc) {
    for (int64_t i0 = 0; i0 < m; i0 += MR) {
        int64_t mr = m - i0 < MR ? m - i0 : MR;
        const float *a = x + i0 * x_stride;
        const float *pf = i0 == 0 ? next : NULL;
        float tile[MR][NR];
#ifdef HAVE_AVX2
        if (mr == MR) {
            tile6(a, x_stride, k_len, p, pf, tile);
        } else {
            switch (mr) {
            case 1: tile_r(1, a, x_stride, k_len, p, pf, tile); break;
            case 2: tile_r(2, a, x_stride, k_len, p, pf, tile); break;
            case 3: tile_r(3, a, x_stride, k_len, p, pf, tile); break;
            case 4: tile_r(4, a, x_stride, k_len, p, pf, tile); break;
            default: tile_r(5, a, x_stride, k_len, p, pf, tile); break;
            }
        }
#else
        for (int r = 0; r < mr; r++) {
            float acc[NR] = {0};
            for (int64_t k = 0; k < k_len; k++) {
                float av = a[r * x_stride + k];
                const float *b = p + k * NR;
#pragma omp simd
                for (int j = 0; j < NR; j++) acc[j] += av * b[j];
            }
            for (int j = 0; j < NR; j++) tile[r][j] = acc[j];
        }
        (void)pf;
#endif
        for (int r = 0; r < mr; r++) {
            float *o = out + (i0 + r) * out_stride + n0;
            if (bias != NULL) {
                for (int64_t j = 0; j < nc; j++) o[j] = tile[r][j] + bias[n0 + j];
            } else {
                for (int64_t j = 0; j < nc; j++) o[j] = tile[r][j];
            }
        }
    }
}

/* x [m, k_len] (rows x_stride floats apart, k contiguous); wp the packed weight of n outputs;
 * bias [n] or NULL; out [m, n] (rows out_stride apart). Returns 0, or 2 for bad sizes. */
int radixrt_gemm_small_f32(const float *x, int64_t x_stride, int64_t m, int64_t k_len,
                           const float *wp, int64_t n, const float *bias, float *out,
                           int64_t out_stride, int num_threads) {
    if (m < 0 || k_len <= 0 || n <= 0 || x_stride < k_len || out_stride < n) return 2;
    if (m == 0) return 0;
    const int64_t panels = (n + NR - 1) / NR;
    const int64_t panel_floats = k_len * NR;
    if (num_threads < 1) num_threads = 1;
    if (num_threads > panels) num_threads = (int)panels;
#ifdef USE_OPENMP
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
    {
        int nt = omp_get_num_threads(), tid = omp_get_thread_num();
#else
    {
        int nt = 1, tid = 0;
        (void)num_threads;
#endif
        int64_t lo = panels * tid / nt, hi = panels * (tid + 1) / nt;
        for (int64_t q = lo; q < hi; q++) {
            const float *p = wp + q * panel_floats;
            const float *next = q + 1 < hi ? p + panel_floats : NULL;
            int64_t n0 = q * NR, nc = n - n0 < NR ? n - n0 : NR;
            panel(x, x_stride, m, k_len, p, next, bias, out, out_stride, n0, nc);
        }
    }
    return 0;
}
