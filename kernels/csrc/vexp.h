/* exp for x <= 0, scalar and on 8 AVX2 lanes: a Cephes-style polynomial (relative error
 * < 2e-7); below -87 both return e^-87 (~1.6e-38). Shared by the native kernels' sources
 * (radixrt.kernels.native hashes this header into every library's cache key). */
#ifndef RADIXRT_VEXP_H
#define RADIXRT_VEXP_H
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
    /* exp_nonpos on 8 lanes */
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f),
                                                _mm256_set1_ps(0.5f)));
    __m256 r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fmadd_ps(fx, _mm256_set1_ps(2.12194440e-4f), r);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(_mm256_mul_ps(y, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i n = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(n));
}
#endif
#endif
