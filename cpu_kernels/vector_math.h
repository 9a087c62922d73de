// Vector math shared by the kernels: exp and a row's max / argmax / sum of exp, AVX-512.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <limits>

namespace jse {

// exp(x) for 16 lanes (Cephes' expf: exp(x) = 2^n exp(r), r = x - n ln 2 with ln 2 split in two, a degree-6
// polynomial for exp(r); within 2 ulp of f32). Below -87.3 it gives ~1e-38 instead of 0 or a denormal.
__attribute__((target("avx512f"))) inline __m512 exp512(__m512 x) {
  const __m512 log2e = _mm512_set1_ps(1.44269504088896341f);
  const __m512 ln2_hi = _mm512_set1_ps(0.693359375f), ln2_lo = _mm512_set1_ps(-2.12194440e-4f);
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.33654f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, ln2_hi, x);
  r = _mm512_fnmadd_ps(n, ln2_lo, r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

// The maximum of l[0, n) and its lowest index (n >= 1; -inf and index 0 for a row of -inf).
__attribute__((target("avx512f"))) inline void row_max(const float* l, int64_t n, float* max, int32_t* arg) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  __m512 best = _mm512_set1_ps(neg_inf);
  __m512i best_i = _mm512_setzero_si512();
  __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i step = _mm512_set1_epi32(16);
  int64_t v = 0;
  for (; v + 16 <= n; v += 16, idx = _mm512_add_epi32(idx, step)) {
    const __m512 x = _mm512_loadu_ps(l + v);
    const __mmask16 gt = _mm512_cmp_ps_mask(x, best, _CMP_GT_OQ);  // strictly greater: the first index stays
    best = _mm512_mask_mov_ps(best, gt, x);
    best_i = _mm512_mask_mov_epi32(best_i, gt, idx);
  }
  alignas(64) float bv[16];
  alignas(64) int32_t bi[16];
  _mm512_store_ps(bv, best);
  _mm512_store_epi32(bi, best_i);
  float m = neg_inf;
  int32_t mi = 0;
  for (int j = 0; j < 16; ++j)
    if (bv[j] > m || (bv[j] == m && bi[j] < mi)) m = bv[j], mi = bi[j];
  for (; v < n; ++v)
    if (l[v] > m) m = l[v], mi = static_cast<int32_t>(v);
  *max = m;
  *arg = mi;
}

// sum of exp(l[v] - m) over [0, n).
__attribute__((target("avx512f"))) inline float row_sum_exp(const float* l, int64_t n, float m) {
  const __m512 mv = _mm512_set1_ps(m);
  __m512 sum = _mm512_setzero_ps();
  int64_t v = 0;
  for (; v + 16 <= n; v += 16) sum = _mm512_add_ps(sum, exp512(_mm512_sub_ps(_mm512_loadu_ps(l + v), mv)));
  if (v < n) {
    const __mmask16 tail = static_cast<__mmask16>((1u << (n - v)) - 1);
    sum = _mm512_mask_add_ps(sum, tail, sum, exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, l + v), mv)));
  }
  return _mm512_reduce_add_ps(sum);
}

}  // namespace jse
