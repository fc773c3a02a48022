/* Fused elementwise ops of a CPU float32 forward: add + RMSNorm, rotary embedding, KV store.
 *
 * Built and loaded by radixrt.kernels.native (ctypes); radixrt.kernels.cpu_ops is the Python
 * side and states the contracts. Each op is one pass over its rows where torch runs several
 * ops (torch.rms_norm on CPU is pow, mean, add, rsqrt and two muls, ~40 us a call at 32 x 192;
 * the rotary formula is four ops; the KV store two index_copy_ calls).
 *
 * Numerics: rotary and the store are bitwise those of the torch formulas (two rounded products
 * and a rounded sum per element: the file is compiled as ISO C, where GCC and clang contract
 * no a * b + c into an FMA, and the loops below never ask for one). RMSNorm sums the squares in
 * double, so its mean is the correctly rounded one more often than torch's float cascade sum:
 * the two differ in the last bit of a few outputs.
 *
 * Threads (num_threads > 1) split the rows when built with OpenMP (torch's own pool).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "simd.h"
#if defined(_OPENMP) && !defined(RADIXRT_NO_OPENMP)
#include <omp.h>
#define PARALLEL_ROWS _Pragma("omp parallel for num_threads(num_threads) schedule(static)")
#else
#define PARALLEL_ROWS
#endif

/* RMSNorm of rows of h floats: s = x[t], or with residual first residual[t] += x[t] (in
 * place) and s = residual[t]; then out[t] = w * (s * (1 / sqrt(mean(s * s) + eps))). out may be
 * x itself (x is read before out is written). Row strides in floats. */
int radixrt_add_rmsnorm_f32(const float *x, int64_t x_stride, float *residual, int64_t r_stride,
                            const float *w, float *out, int64_t out_stride, int64_t n, int64_t h,
                            float eps, int num_threads) {
    if (n < 0 || h <= 0) return 2;
    if (num_threads < 1) num_threads = 1;
    (void)num_threads;
    PARALLEL_ROWS
    for (int64_t t = 0; t < n; t++) {
        const float *xr = x + t * x_stride;
        float *o = out + t * out_stride;
        const float *s = xr;
        if (residual != NULL) {
            float *rr = residual + t * r_stride;
#pragma omp simd
            for (int64_t i = 0; i < h; i++) rr[i] = xr[i] + rr[i];
            s = rr;
        }
        double acc = 0.0;
#pragma omp simd reduction(+ : acc)
        for (int64_t i = 0; i < h; i++) acc += (double)(s[i] * s[i]);
        float mean = (float)(acc / (double)h);
        float r = 1.0f / sqrtf(mean + eps);
#pragma omp simd
        for (int64_t i = 0; i < h; i++) o[i] = w[i] * (s[i] * r);
    }
    return 0;
}

/* Neox rotary, in place: for token t and head j < heads, x = buf[t, j] becomes x * (cos | cos)
 * + (x2 | x1) * (-sin | sin), the rows of table[pos[t]] (RotaryEmbedding.rope_table's layout
 * [max_pos, 2d]), i.e. each half x1 * cos - x2 * sin, x2 * cos + x1 * sin. Token rows are
 * stride floats apart, a row's heads contiguous (d floats each; heads after the first `heads`
 * are left alone). A position out of [0, max_pos) is an error (nothing is written). */
int radixrt_rope_neox_f32(float *buf, int64_t stride, const int64_t *pos, const float *table,
                          int64_t max_pos, int64_t n, int heads, int d, int num_threads) {
    if (n < 0 || heads <= 0 || d <= 0 || d % 2 != 0) return 2;
    for (int64_t t = 0; t < n; t++)
        if (pos[t] < 0 || pos[t] >= max_pos) return 3;
    if (num_threads < 1) num_threads = 1;
    (void)num_threads;
    const int half = d / 2;
    PARALLEL_ROWS
    for (int64_t t = 0; t < n; t++) {
        const float *c = table + pos[t] * 2 * d; /* cos | cos */
        const float *sn = c + d;                 /* -sin | sin */
        for (int j = 0; j < heads; j++) {
            float *x = buf + t * stride + (int64_t)j * d;
#pragma omp simd
            for (int i = 0; i < half; i++) {
                float x1 = x[i], x2 = x[i + half];
                float a = x1 * c[i], b = x2 * sn[i];
                float e = x2 * c[i + half], f = x1 * sn[i + half];
                x[i] = a + b;
                x[i + half] = e + f;
            }
        }
    }
    return 0;
}

/* The KV store: k_pool[slots[t]] = k[t], v_pool[slots[t]] = v[t] for rows of `row` floats
 * (kv_heads * head_dim), k and v rows k_stride / v_stride floats apart; pools are
 * [num_slots, row] contiguous. A slot out of range is an error (nothing is written). */
int radixrt_store_kv_f32(const float *k, int64_t k_stride, const float *v, int64_t v_stride,
                         const int64_t *slots, float *k_pool, float *v_pool, int64_t num_slots,
                         int64_t n, int64_t row) {
    if (n < 0 || row <= 0) return 2;
    for (int64_t t = 0; t < n; t++)
        if (slots[t] < 0 || slots[t] >= num_slots) return 3;
    const size_t bytes = (size_t)row * sizeof(float);
    for (int64_t t = 0; t < n; t++) {
        memcpy(k_pool + slots[t] * row, k + t * k_stride, bytes);
        memcpy(v_pool + slots[t] * row, v + t * v_stride, bytes);
    }
    return 0;
}

/* out[t] = silu(gate[t]) * up[t] over rows of `inter` floats, silu(g) = g * sigmoid(g) with
 * sigmoid from e = exp(-|g|) (1 / (1 + e), or e / (1 + e) for g < 0: no overflow). gate, up and
 * out have their own row strides; out may be gate itself (each element is read before it is
 * written). Relative error against g / (1 + exp(-g)) ~3e-7. */
int radixrt_silu_mul_f32(const float *gate, int64_t g_stride, const float *up, int64_t u_stride,
                         float *out, int64_t o_stride, int64_t n, int64_t inter,
                         int num_threads) {
    if (n < 0 || inter <= 0) return 2;
    if (num_threads < 1) num_threads = 1;
    (void)num_threads;
    PARALLEL_ROWS
    for (int64_t t = 0; t < n; t++) {
        const float *g = gate + t * g_stride, *u = up + t * u_stride;
        float *o = out + t * o_stride;
        int64_t i = 0;
#ifdef __AVX2__
#if defined(__FMA__) && !defined(RADIXRT_PORTABLE)
        const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
        for (; i + 8 <= inter; i += 8) {
            __m256 x = _mm256_loadu_ps(g + i);
            __m256 e = exp_nonpos8(_mm256_or_ps(x, sign)); /* exp(-|x|) */
            __m256 inv = _mm256_div_ps(one, _mm256_add_ps(one, e));
            __m256 neg = _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_LT_OQ);
            __m256 sig = _mm256_blendv_ps(inv, _mm256_mul_ps(e, inv), neg);
            _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_mul_ps(x, sig), _mm256_loadu_ps(u + i)));
        }
#endif
#endif
        for (; i < inter; i++) {
            float x = g[i];
            float e = exp_nonpos(-fabsf(x));
            float inv = 1.0f / (1.0f + e);
            float sig = x < 0.0f ? e * inv : inv;
            o[i] = x * sig * u[i];
        }
    }
    return 0;
}
