/* Vector helpers shared by the native kernels' sources (radixrt.kernels.native hashes every
 * csrc file into each library's cache key): exp for x <= 0, scalar and on 8 AVX2 lanes, a
 * Cephes-style polynomial (worst relative error 1.2e-7 over [-87, 0]; below -87 both return
 * e^-87, ~1.6e-38), and horizontal sum / max of 8 lanes. */
#ifndef RADIXRT_SIMD_H
#define RADIXRT_SIMD_H
#include <math.h>
#include <stdint.h>

static inline float exp_nonpos(float x) {
    /* e^x for x <= 0; below -87 it returns e^-87 (~1.6e-38: nothing beside the max's 1). */
    x = x < -87.0f ? -87.0f : x;
    float fx = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - fx * 0.693359375f + fx * 2.12194440e-4f;
    float y = 1.9875691500e-4f;
    y = y * r + 1.3981999507e-3f;
    y = y * r + 8.3334519073e-3f;
    y = y * r + 4.1665795894e-2f;
    y = y * r + 1.6666665459e-1f;
    y = y * r + 5.0000001201e-1f;
    y = y * r * r + r + 1.0f;
    int32_t n = (int32_t)fx;
    union { int32_t i; float f; } two_n;
    two_n.i = (n + 127) << 23;
    return y * two_n.f;
}

#if defined(__AVX2__) && defined(__FMA__) && !defined(RADIXRT_PORTABLE)
#include <immintrin.h>
static inline __m256 exp_nonpos8(__m256 x) {
    /* exp_nonpos on 8 lanes. n = round(x / ln 2) by the 1.5 * 2^23 trick (adding it leaves
     * n in the low mantissa bits): no round or convert instruction. */
    const __m256 magic = _mm256_set1_ps(12582912.0f);
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256 t = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), magic);
    const __m256 fx = _mm256_sub_ps(t, magic);
    __m256 r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fmadd_ps(fx, _mm256_set1_ps(2.12194440e-4f), r);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(_mm256_mul_ps(y, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    /* 2^n: t's bits are magic's plus n; (n + 127) << 23 */
    const __m256i n = _mm256_sub_epi32(_mm256_castps_si256(t),
                                       _mm256_set1_epi32(0x4B400000 - 127));
    return _mm256_mul_ps(y, _mm256_castsi256_ps(_mm256_slli_epi32(n, 23)));
}

static inline float hsum8(__m256 v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}

static inline float hmax8(__m256 v) {
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    x = _mm_max_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}
#endif
#endif
