// What the CPU kernels share: whether this build has AVX2+FMA (and AVX-512), and a horizontal sum.
#pragma once

#if defined(__AVX512F__)
#define PAGEDSERVE_AVX512 1
#endif

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PAGEDSERVE_AVX2 1

namespace pagedserve {

// the sum of the eight lanes of v
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

}  // namespace pagedserve
#endif
