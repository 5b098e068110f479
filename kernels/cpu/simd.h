// What the CPU kernels share: whether this build has AVX2+FMA (and AVX-512), a horizontal sum and a
// sixteen-lane exp.
#pragma once

#if defined(__AVX512F__)
#define PAGEDSERVE_AVX512 1
#include <immintrin.h>

namespace pagedserve {

// e^x in sixteen lanes for x in [-87.3, 88] (clamped to it outside: 0 below, e^88 above): x = n ln2 + r,
// |r| <= ln2/2, e^r by a degree-6 polynomial (Taylor coefficients; relative error ~2e-7), 2^n put into
// the exponent bits. Shared by the attention's softmax, SiLU and the sampler's log-sum-exp.
inline __m512 exp16(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-87.3f);
  const __mmask16 underflow = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  x = _mm512_min_ps(_mm512_max_ps(x, lo), _mm512_set1_ps(88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  // ln2 split in a part exact in float and a correction, so that r keeps its low bits
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mul_ps(static_cast<__mmask16>(~underflow), p, _mm512_castsi512_ps(bits));
}

}  // namespace pagedserve
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
