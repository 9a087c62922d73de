// Ragged paged attention for XLA:CPU: the CPU counterpart of pallas_kernels/ragged_paged_attention.py, with the
// contract of pallas_kernels/reference.py (ragged_paged_attention_reference).
//
// Query token t of sequence s (query length n_s, KV length seq_lens[s]) sits at position
// p = seq_lens[s] - n_s + (t - query_start_loc[s]) and attends causally to KV positions 0..p, read from the
// pool through row s of the block table (this step's own K/V are already written there). One work item is
// up to 4 consecutive query tokens of one sequence (16 for prefill chunks) and one KV head, or every KV head
// when a step has many short items: its rows (tokens x the G = H / K query heads of a KV head) share each K
// and V row, read from the pool directly on AVX-512 for head dims 64 and 128 (the split path; bf16 rows
// split into even and odd elements, tiles prefetched ahead) or converted to f32 once per tile of 32 context
// positions. One path serves every item of a call whatever its length, so a row's result is bitwise the
// same in a prefill chunk, a verify window or a decode step (batch invariance).
// The tiles are walked with an online softmax (Milakov & Gimelshein 2018; FlashAttention, Dao et al. 2022,
// §3.1): scores 8 positions at a time (8 independent FMA chains, one transposing reduction), a running max
// and sum per row, the accumulator rescaled when the max grows. exp is a vectorized polynomial (Cephes' expf range reduction,
// relative error below 2e-7). Accumulation is float32; the pool is float32 or bfloat16.
//
// Sliding windows: with a window W > 0 the token at position p sees KV positions p - W + 1 .. p only; the walk
// starts at the tile holding the earliest position any row of the item sees.
//
// Soft-capped scores (Gemma 2): with softcap c > 0 each scaled score s becomes c tanh(s / c) before the softmax.
//
// Token trees: with a tree mask (int32 per query token), a token sees KV position p of its window (the step's
// own tokens, from seq_len - n_s) only if bit p - (seq_len - n_s) of its mask is set (positions from the
// 33rd window token on are not gated): the rule of reference.tree_visible. The cached prefix is unaffected.
//
// Requires AVX2 + FMA (the library's Python side only registers it when the CPU has them) and D % 8 == 0.
// Threads of XLA's intra-op pool split the work items.

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <type_traits>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "vector_math.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kTile = 32;   // context positions per online-softmax step (a multiple of 8)
constexpr int64_t kTileQ = 4;   // query tokens of one sequence per work item
constexpr int64_t kMaxG = 16;   // query heads per KV head
constexpr int64_t kMaxD = 256;  // head dim
constexpr int64_t kTileQLong = 16;  // ... for runs of at least 2 x 16 query tokens (prefill chunks), on AVX-512
constexpr int64_t kMaxRows = kTileQLong * kMaxG;
constexpr int64_t kTreeWindow = 32;  // window tokens a tree mask covers

// JSE_CPU_ISA=avx2 keeps an AVX-512 machine on the AVX2 path (as in skinny_matmul.cc).
bool avx512_usable() {
  __builtin_cpu_init();
  const char* isa = std::getenv("JSE_CPU_ISA");
  return __builtin_cpu_supports("avx512f") && !(isa != nullptr && std::strcmp(isa, "avx2") == 0);
}
const bool kAvx512 = avx512_usable();

__attribute__((target("avx2,fma"))) inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

__attribute__((target("avx2,fma"))) inline __m256 load8(const uint16_t* p) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

__attribute__((target("avx2,fma"))) inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

__attribute__((target("avx2,fma"))) inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

// exp(x) for 8 lanes; x below -87.3 gives 0 (as exp does in float32, up to denormals).
__attribute__((target("avx2,fma"))) inline __m256 exp8(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.3f), hi = _mm256_set1_ps(88.3f);
  __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
  // x = n ln2 + r, |r| <= ln2 / 2; ln2 split in two for an exact product.
  __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

struct Layout {
  int64_t T, H, Kh, G, D, P, B, max_blocks;
  float scale;
  float softcap;  // 0: none
};

// s[0, n) -> c tanh(s / c), n a multiple of 8; tanh(y) = sign(y) (1 - e^{-2|y|}) / (1 + e^{-2|y|}), which has no
// overflow for any |y| (-inf gives -c). One path for every caller (the AVX-512 ones too: AVX-512F CPUs run AVX2).
__attribute__((target("avx2,fma"), noinline)) void soft_cap(float* s, int64_t n, float c) {
  const __m256 cv = _mm256_set1_ps(c), inv = _mm256_set1_ps(1.f / c), sign = _mm256_set1_ps(-0.f);
  const __m256 one = _mm256_set1_ps(1.f), minus_two = _mm256_set1_ps(-2.f);
  for (int64_t j = 0; j < n; j += 8) {
    const __m256 y = _mm256_mul_ps(_mm256_loadu_ps(s + j), inv);
    const __m256 e = exp8(_mm256_mul_ps(minus_two, _mm256_andnot_ps(sign, y)));
    const __m256 t = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));
    _mm256_storeu_ps(s + j, _mm256_mul_ps(cv, _mm256_or_ps(t, _mm256_and_ps(sign, y))));
  }
}

// The sums of 8 vectors, one per lane: out[j] = sum of a[j]'s 8 lanes.
__attribute__((target("avx2,fma"))) inline __m256 hsum8(const __m256* a) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// Rows of one work item: up to kTileQ consecutive query tokens of one sequence x the G query heads of one
// KV head. Each K/V row of the context is converted to f32 once per tile and used by every row.
struct Rows {
  int64_t n = 0;
  const float* q[kMaxRows];
  float* out[kMaxRows];
  int64_t limit[kMaxRows];  // KV positions the row attends to (its causal limit)
  int64_t start[kMaxRows];  // the first KV position it sees (its sliding window's start; 0 without one)
  bool tree = false;        // the rows carry tree masks:
  uint32_t bits[kMaxRows];  // the row's token's mask
  int64_t window[kMaxRows];  // KV position of its sequence's first step token
};

// Bit jj: whether row r sees KV position j0 + jj, for jj < valid (its causal limit within the tile of
// kTile positions from j0) and, with tree masks, its mask.
inline uint32_t visible(const Rows& R, int64_t r, int64_t j0, int64_t valid) {
  static_assert(kTile == 32, "one bit per tile position");
  const int64_t skip = R.start[r] - j0;  // the tile's positions before the row's window
  if (valid <= 0 || skip >= kTile) return 0;
  uint32_t causal = valid >= 32 ? ~0u : (1u << valid) - 1;
  if (skip > 0) causal &= ~((1u << skip) - 1);
  const int64_t shift = j0 - (R.tree ? R.window[r] : 0);  // window index of position j0
  if (!R.tree || shift >= kTreeWindow || shift <= -kTile) return causal;
  const uint64_t ext = R.bits[r] | (~0ull << kTreeWindow);  // window index e < 64 is visible iff bit e
  const uint64_t word = shift >= 0 ? ext >> shift : (ext << -shift) | ((1ull << -shift) - 1);
  return causal & static_cast<uint32_t>(word);
}

// The first tile (a multiple of kTile) any row of R sees.
inline int64_t first_tile(const Rows& R) {
  int64_t first = R.n ? R.start[0] : 0;
  for (int64_t r = 1; r < R.n; ++r) first = std::min(first, R.start[r]);
  return first / kTile * kTile;
}

// acc[0, 8 ND) = acc * corr + sum_{jj < n} p[jj] v_jj[d0, d0 + 8 ND). ND is a constant so the ND
// accumulators stay in registers (a run-time count spilled them to the stack at every FMA).
template <int ND>
__attribute__((target("avx2,fma"))) void pv_avx2(float* acc, float corr, const float* p, int64_t n,
                                                 const float* const* vrow, int64_t d0) {
  __m256 o[ND];
  const __m256 c = _mm256_set1_ps(corr);
  for (int d = 0; d < ND; ++d) o[d] = _mm256_mul_ps(_mm256_load_ps(acc + 8 * d), c);
  for (int64_t jj = 0; jj < n; ++jj) {
    const __m256 pj = _mm256_set1_ps(p[jj]);
    for (int d = 0; d < ND; ++d) o[d] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vrow[jj] + d0 + 8 * d), o[d]);
  }
  for (int d = 0; d < ND; ++d) _mm256_store_ps(acc + 8 * d, o[d]);
}
using PvAvx2Fn = void (*)(float*, float, const float*, int64_t, const float* const*, int64_t);
constexpr PvAvx2Fn kPvAvx2[4] = {&pv_avx2<1>, &pv_avx2<2>, &pv_avx2<3>, &pv_avx2<4>};

template <typename KV>
__attribute__((target("avx2,fma"))) void attend(const Layout& L, const Rows& R, const KV* k_layer,
                                                const KV* v_layer, const int32_t* table, int64_t kh) {
  const int64_t D = L.D, Dv = D / 8, row = L.Kh * D;  // elements per pool slot
  alignas(32) static thread_local float kbuf[kTile * kMaxD], vbuf[kTile * kMaxD];
  alignas(32) static thread_local float s[kMaxRows][kTile], acc[kMaxRows][kMaxD];
  float m[kMaxRows], l[kMaxRows];
  int64_t longest = 0;
  for (int64_t r = 0; r < R.n; ++r) {
    m[r] = -std::numeric_limits<float>::infinity(), l[r] = 0.f;
    std::fill(acc[r], acc[r] + D, 0.f);
    longest = std::max(longest, R.limit[r]);
  }
  const float neg_inf = -std::numeric_limits<float>::infinity();
  alignas(32) static thread_local float zeros[kMaxD];  // K of the positions past the context in a group of 8
  const float* krow[kTile];  // each position's K and V row: in the pool itself (f32), else converted to f32
  const float* vrow[kTile];
  for (int64_t j0 = first_tile(R); j0 < longest; j0 += kTile) {
    const int64_t n = std::min(kTile, longest - j0);
    for (int64_t jj = 0; jj < n; ++jj) {
      const int64_t j = j0 + jj, slot = static_cast<int64_t>(table[j / L.B]) * L.B + j % L.B;
      const KV* kp = k_layer + slot * row + kh * D;
      const KV* vp = v_layer + slot * row + kh * D;
      if constexpr (std::is_same_v<KV, float>) {
        krow[jj] = kp, vrow[jj] = vp;
      } else {
        for (int64_t d = 0; d < Dv; ++d) {
          _mm256_store_ps(kbuf + jj * D + 8 * d, load8(kp + 8 * d));
          _mm256_store_ps(vbuf + jj * D + 8 * d, load8(vp + 8 * d));
        }
        krow[jj] = kbuf + jj * D, vrow[jj] = vbuf + jj * D;
      }
    }
    for (int64_t jj = n; jj < (n + 7) / 8 * 8; ++jj) krow[jj] = zeros;
    for (int64_t r = 0; r < R.n; ++r) {
      const int64_t valid = std::min(n, R.limit[r] - j0);
      const uint32_t seen = visible(R, r, j0, valid);
      if (seen == 0) continue;  // nothing to add, nothing to rescale
      // Scores, 8 positions at a time: 8 independent FMA chains, then one transposing reduction.
      const __m256 scale = _mm256_set1_ps(L.scale);
      for (int64_t jb = 0; jb < valid; jb += 8) {
        __m256 a[8];
        for (int j = 0; j < 8; ++j) a[j] = _mm256_setzero_ps();
        for (int64_t d = 0; d < Dv; ++d) {
          const __m256 qd = _mm256_loadu_ps(R.q[r] + 8 * d);
          for (int j = 0; j < 8; ++j) a[j] = _mm256_fmadd_ps(qd, _mm256_loadu_ps(krow[jb + j] + 8 * d), a[j]);
        }
        _mm256_store_ps(&s[r][jb], _mm256_mul_ps(hsum8(a), scale));
      }
      if (L.softcap > 0.f) soft_cap(s[r], kTile, L.softcap);
      for (int64_t jj = 0; jj < kTile; ++jj)
        if (!(seen >> jj & 1)) s[r][jj] = neg_inf;
      __m256 mx = _mm256_load_ps(&s[r][0]);  // the positions past valid hold -inf
      for (int64_t jj = 8; jj < kTile; jj += 8) mx = _mm256_max_ps(mx, _mm256_load_ps(&s[r][jj]));
      const float m_new = std::max(m[r], hmax(mx));
      const __m256 mv = _mm256_set1_ps(m_new);
      __m256 sum = _mm256_setzero_ps();
      for (int64_t jj = 0; jj < kTile; jj += 8) {
        const __m256 p = exp8(_mm256_sub_ps(_mm256_load_ps(&s[r][jj]), mv));
        _mm256_store_ps(&s[r][jj], p);
        sum = _mm256_add_ps(sum, p);
      }
      const float corr = std::exp(m[r] - m_new);  // 0 on the first tile (m = -inf)
      l[r] = l[r] * corr + hsum(sum);
      m[r] = m_new;
      // acc = acc * corr + sum_jj p[jj] v[jj], D in register blocks of 4 vectors.
      for (int64_t d0 = 0; d0 < Dv; d0 += 4)
        kPvAvx2[std::min<int64_t>(4, Dv - d0) - 1](acc[r] + 8 * d0, corr, s[r], valid, vrow, 8 * d0);
    }
  }
  for (int64_t r = 0; r < R.n; ++r) {
    const __m256 inv = _mm256_set1_ps(l[r] > 0.f ? 1.f / l[r] : 0.f);  // 0: a row that sees nothing
    for (int64_t d = 0; d < Dv; ++d) _mm256_storeu_ps(R.out[r] + 8 * d, _mm256_mul_ps(_mm256_load_ps(acc[r] + 8 * d), inv));
  }
}

// ---- AVX-512, for head dims other than 64 and 128 (multiples of 16): K transposed per tile, so the scores of 8 rows
// x 32 positions are 16 accumulators fed by broadcasts of q (no horizontal sums), and P V runs 4 rows x 64
// columns of V at a time. The online softmax is the same as above.

__attribute__((target("avx512f"))) inline float to_f32(float x) { return x; }
__attribute__((target("avx512f"))) inline float to_f32(uint16_t x) {
  const uint32_t u = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

template <int RB>
__attribute__((target("avx512f"))) void scores_512(const float* const* q, const float* kT, int64_t D, float scale,
                                                   float (*s)[kTile]) {
  static_assert(kTile == 32, "two vectors of positions");
  __m512 a0[RB], a1[RB];
  for (int r = 0; r < RB; ++r) a0[r] = a1[r] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    const __m512 k0 = _mm512_load_ps(kT + d * kTile), k1 = _mm512_load_ps(kT + d * kTile + 16);
    for (int r = 0; r < RB; ++r) {
      const __m512 qv = _mm512_set1_ps(q[r][d]);
      a0[r] = _mm512_fmadd_ps(qv, k0, a0[r]);
      a1[r] = _mm512_fmadd_ps(qv, k1, a1[r]);
    }
  }
  const __m512 sc = _mm512_set1_ps(scale);
  for (int r = 0; r < RB; ++r) {
    _mm512_store_ps(s[r], _mm512_mul_ps(a0[r], sc));
    _mm512_store_ps(s[r] + 16, _mm512_mul_ps(a1[r], sc));
  }
}

// acc[r] = acc[r] * corr[r] + sum_{jj < n} p[r][jj] v[jj], for RB rows.
template <int RB>
__attribute__((target("avx512f"))) void pv_512(const float (*p)[kTile], int64_t n, const float* vbuf, int64_t D,
                                               float (*acc)[kMaxD], const float* corr) {
  for (int64_t d0 = 0; d0 < D; d0 += 64) {
    const int64_t nd = std::min<int64_t>(4, (D - d0) / 16);
    __m512 o[RB][4];
    for (int r = 0; r < RB; ++r)
      for (int64_t d = 0; d < nd; ++d) o[r][d] = _mm512_mul_ps(_mm512_load_ps(acc[r] + d0 + 16 * d), _mm512_set1_ps(corr[r]));
    for (int64_t jj = 0; jj < n; ++jj) {
      __m512 v[4];
      for (int64_t d = 0; d < nd; ++d) v[d] = _mm512_load_ps(vbuf + jj * D + d0 + 16 * d);
      for (int r = 0; r < RB; ++r) {
        const __m512 pr = _mm512_set1_ps(p[r][jj]);
        for (int64_t d = 0; d < nd; ++d) o[r][d] = _mm512_fmadd_ps(pr, v[d], o[r][d]);
      }
    }
    for (int r = 0; r < RB; ++r)
      for (int64_t d = 0; d < nd; ++d) _mm512_store_ps(acc[r] + d0 + 16 * d, o[r][d]);
  }
}

using ScoresFn = void (*)(const float* const*, const float*, int64_t, float, float (*)[kTile]);
using PvFn = void (*)(const float (*)[kTile], int64_t, const float*, int64_t, float (*)[kMaxD], const float*);
constexpr ScoresFn kScores[8] = {&scores_512<1>, &scores_512<2>, &scores_512<3>, &scores_512<4>,
                                 &scores_512<5>, &scores_512<6>, &scores_512<7>, &scores_512<8>};
constexpr PvFn kPv[4] = {&pv_512<1>, &pv_512<2>, &pv_512<3>, &pv_512<4>};

// Requires D % 16 == 0.
template <typename KV>
__attribute__((target("avx512f"))) void attend_512(const Layout& L, const Rows& R, const KV* k_layer,
                                                   const KV* v_layer, const int32_t* table, int64_t kh) {
  const int64_t D = L.D, row = L.Kh * D;
  alignas(64) static thread_local float kT[kMaxD * kTile], vbuf[kTile * kMaxD];
  alignas(64) static thread_local float s[kMaxRows][kTile], acc[kMaxRows][kMaxD];
  float m[kMaxRows], l[kMaxRows], corr[kMaxRows];
  int64_t longest = 0;
  for (int64_t r = 0; r < R.n; ++r) {
    m[r] = -std::numeric_limits<float>::infinity(), l[r] = 0.f;
    std::fill(acc[r], acc[r] + D, 0.f);
    longest = std::max(longest, R.limit[r]);
  }
  for (int64_t j0 = first_tile(R); j0 < longest; j0 += kTile) {
    const int64_t n = std::min(kTile, longest - j0);
    for (int64_t jj = 0; jj < kTile; ++jj) {
      if (jj >= n) {
        for (int64_t d = 0; d < D; ++d) kT[d * kTile + jj] = 0.f;
        continue;
      }
      const int64_t j = j0 + jj, slot = static_cast<int64_t>(table[j / L.B]) * L.B + j % L.B;
      const KV* kp = k_layer + slot * row + kh * D;
      const KV* vp = v_layer + slot * row + kh * D;
      for (int64_t d = 0; d < D; ++d) kT[d * kTile + jj] = to_f32(kp[d]);
      for (int64_t d = 0; d < D; ++d) vbuf[jj * D + d] = to_f32(vp[d]);
    }
    for (int64_t r0 = 0; r0 < R.n; r0 += 8) kScores[std::min<int64_t>(8, R.n - r0) - 1](R.q + r0, kT, D, L.scale, s + r0);
    if (L.softcap > 0.f)
      for (int64_t r = 0; r < R.n; ++r) soft_cap(s[r], kTile, L.softcap);
    for (int64_t r = 0; r < R.n; ++r) {
      const uint32_t seen = visible(R, r, j0, std::min(n, R.limit[r] - j0));
      if (seen == 0) {  // nothing this row sees here: nothing added, nothing rescaled
        std::fill(s[r], s[r] + kTile, 0.f);
        corr[r] = 1.f;
        continue;
      }
      const __mmask16 k0 = static_cast<__mmask16>(seen), k1 = static_cast<__mmask16>(seen >> 16);
      const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
      const __m512 s0 = _mm512_mask_load_ps(neg_inf, k0, s[r]), s1 = _mm512_mask_load_ps(neg_inf, k1, s[r] + 16);
      const float m_new = std::max(m[r], _mm512_reduce_max_ps(_mm512_max_ps(s0, s1)));
      const __m512 mv = _mm512_set1_ps(m_new);
      const __m512 p0 = _mm512_maskz_mov_ps(k0, jse::exp512(_mm512_sub_ps(s0, mv)));
      const __m512 p1 = _mm512_maskz_mov_ps(k1, jse::exp512(_mm512_sub_ps(s1, mv)));
      _mm512_store_ps(s[r], p0);
      _mm512_store_ps(s[r] + 16, p1);
      corr[r] = std::exp(m[r] - m_new);  // 0 on the first tile (m = -inf)
      l[r] = l[r] * corr[r] + _mm512_reduce_add_ps(_mm512_add_ps(p0, p1));
      m[r] = m_new;
    }
    for (int64_t r0 = 0; r0 < R.n; r0 += 4) kPv[std::min<int64_t>(4, R.n - r0) - 1](s + r0, n, vbuf, D, acc + r0, corr + r0);
  }
  for (int64_t r = 0; r < R.n; ++r) {
    const __m512 inv = _mm512_set1_ps(l[r] > 0.f ? 1.f / l[r] : 0.f);
    for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(R.out[r] + d, _mm512_mul_ps(_mm512_load_ps(acc[r] + d), inv));
  }
}

// ---- AVX-512, for head dims 64 and 128 (SmolLM2, Llama): K and V read from the pool in place, each row
// of 32 elements as two float32 vectors. In a bf16 pool a 32-bit lane holds elements 2i (low half) and
// 2i + 1 (high half); a shift and a mask make both exact float32 vectors, so the two vectors are the row's
// even and odd elements. q is split the same way once per work item and the accumulator is kept split,
// interleaved back at the end: the dot products and the P V sums never need the elements in order. In a
// float32 pool the two vectors are the row's halves and no reordering is needed.

// ND x 32 elements as 2 ND float32 vectors: bf16, the even / odd elements.
template <int ND>
__attribute__((target("avx512f"))) inline void split_row(const uint16_t* p, __m512* even, __m512* odd) {
  const __m512i high = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  for (int c = 0; c < ND; ++c) {
    const __m512i x = _mm512_loadu_si512(p + 32 * c);
    even[c] = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
    odd[c] = _mm512_castsi512_ps(_mm512_and_si512(x, high));
  }
}

// ... float32: elements 0-15 and 16-31 of each 32.
template <int ND>
__attribute__((target("avx512f"))) inline void split_row(const float* p, __m512* lo, __m512* hi) {
  for (int c = 0; c < ND; ++c) lo[c] = _mm512_loadu_ps(p + 32 * c), hi[c] = _mm512_loadu_ps(p + 32 * c + 16);
}

// out[j] = the sum of a[j]'s 16 lanes, j < 16: a transposing reduction (halves, then quarters, of pairs of
// vectors; 45 shuffles and adds for the 16 sums) and one permute back to order.
__attribute__((target("avx512f"))) inline __m512 hsum16(const __m512* a) {
  __m512 c[8], e[4], f[2];
  for (int i = 0; i < 8; ++i)  // c[i]: halves of a[i] | a[i + 8]
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[i], a[i + 8], 0x44), _mm512_shuffle_f32x4(a[i], a[i + 8], 0xEE));
  for (int i = 0; i < 4; ++i)  // e[i]: quarters of a[i], a[i + 8], a[i + 4], a[i + 12]
    e[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[i], c[i + 4], 0x88), _mm512_shuffle_f32x4(c[i], c[i + 4], 0xDD));
  for (int i = 0; i < 2; ++i)
    f[i] = _mm512_add_ps(_mm512_unpacklo_ps(e[i], e[i + 2]), _mm512_unpackhi_ps(e[i], e[i + 2]));
  const __m512 g = _mm512_add_ps(_mm512_shuffle_ps(f[0], f[1], 0x44), _mm512_shuffle_ps(f[0], f[1], 0xEE));
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15), g);
}

// Online-softmax state of a work item's rows; q and acc in split_row's layout.
struct Split {
  alignas(64) float q[kMaxRows][kMaxD];
  alignas(64) float acc[kMaxRows][kMaxD];
  alignas(64) float s[kMaxRows][kTile];
  float m[kMaxRows], l[kMaxRows];
};

// One tile of n <= kTile positions (rows of the pool at k[jj], v[jj]) for rows r0 .. r0 + RB - 1.
template <typename KV, int ND, int RB>
__attribute__((target("avx512f"))) void tile_split(Split& S, const Rows& R, int64_t r0, int64_t j0, int64_t n,
                                                   const KV* const* k, const KV* const* v, float scale, float cap) {
  static_assert(kTile == 32, "two blocks of 16 positions");
  alignas(64) __m512 part[RB][16];
  __m512 qe[RB][ND], qo[RB][ND], ke[ND], ko[ND];
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < ND; ++c) qe[r][c] = _mm512_load_ps(S.q[r0 + r] + 32 * c), qo[r][c] = _mm512_load_ps(S.q[r0 + r] + 32 * c + 16);
  const __m512 sc = _mm512_set1_ps(scale);
  for (int64_t jb = 0; jb < n; jb += 16) {
    for (int jj = 0; jj < 16; ++jj) {
      split_row<ND>(k[std::min<int64_t>(jb + jj, n - 1)], ke, ko);  // positions past n: masked below
      for (int r = 0; r < RB; ++r) {
        __m512 a = _mm512_mul_ps(qe[r][0], ke[0]);
        a = _mm512_fmadd_ps(qo[r][0], ko[0], a);
        for (int c = 1; c < ND; ++c) a = _mm512_fmadd_ps(qo[r][c], ko[c], _mm512_fmadd_ps(qe[r][c], ke[c], a));
        part[r][jj] = a;
      }
    }
    for (int r = 0; r < RB; ++r) _mm512_store_ps(S.s[r0 + r] + jb, _mm512_mul_ps(hsum16(part[r]), sc));
  }
  if (cap > 0.f)
    for (int r = 0; r < RB; ++r) soft_cap(S.s[r0 + r], kTile, cap);
  float corr[RB];
  for (int r = 0; r < RB; ++r) {
    float* s = S.s[r0 + r];
    const uint32_t seen = visible(R, r0 + r, j0, std::min(n, R.limit[r0 + r] - j0));
    if (seen == 0) {  // nothing this row sees here: nothing added, nothing rescaled
      std::fill(s, s + kTile, 0.f);
      corr[r] = 1.f;
      continue;
    }
    const __mmask16 k0 = static_cast<__mmask16>(seen), k1 = static_cast<__mmask16>(seen >> 16);
    const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    const __m512 s0 = _mm512_mask_load_ps(neg_inf, k0, s), s1 = _mm512_mask_load_ps(neg_inf, k1, s + 16);
    const float m_new = std::max(S.m[r0 + r], _mm512_reduce_max_ps(_mm512_max_ps(s0, s1)));
    const __m512 mv = _mm512_set1_ps(m_new);
    const __m512 p0 = _mm512_maskz_mov_ps(k0, jse::exp512(_mm512_sub_ps(s0, mv)));
    const __m512 p1 = _mm512_maskz_mov_ps(k1, jse::exp512(_mm512_sub_ps(s1, mv)));
    _mm512_store_ps(s, p0);
    _mm512_store_ps(s + 16, p1);
    corr[r] = std::exp(S.m[r0 + r] - m_new);  // 0 on the first tile (m = -inf)
    S.l[r0 + r] = S.l[r0 + r] * corr[r] + _mm512_reduce_add_ps(_mm512_add_ps(p0, p1));
    S.m[r0 + r] = m_new;
  }
  __m512 oe[RB][ND], oo[RB][ND], ve[ND], vo[ND];
  for (int r = 0; r < RB; ++r) {
    const __m512 cr = _mm512_set1_ps(corr[r]);
    for (int c = 0; c < ND; ++c) {
      oe[r][c] = _mm512_mul_ps(_mm512_load_ps(S.acc[r0 + r] + 32 * c), cr);
      oo[r][c] = _mm512_mul_ps(_mm512_load_ps(S.acc[r0 + r] + 32 * c + 16), cr);
    }
  }
  for (int64_t jj = 0; jj < n; ++jj) {
    split_row<ND>(v[jj], ve, vo);
    for (int r = 0; r < RB; ++r) {
      const __m512 p = _mm512_set1_ps(S.s[r0 + r][jj]);
      for (int c = 0; c < ND; ++c) oe[r][c] = _mm512_fmadd_ps(p, ve[c], oe[r][c]), oo[r][c] = _mm512_fmadd_ps(p, vo[c], oo[r][c]);
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < ND; ++c) {
      _mm512_store_ps(S.acc[r0 + r] + 32 * c, oe[r][c]);
      _mm512_store_ps(S.acc[r0 + r] + 32 * c + 16, oo[r][c]);
    }
}

// Rows per call of tile_split: all of q's split vectors and the accumulators stay in registers.
template <int ND>
constexpr int kSplitRows = ND <= 2 ? 4 : ND <= 4 ? 2 : 1;

// KV heads kh0 .. kh0 + heads - 1, R's rows head-major (R.n / heads rows a head): a slot's heads are adjacent
// in the pool, so one item walking them all reads whole slot rows.
template <typename KV, int ND>
__attribute__((target("avx512f"))) void attend_split(const Layout& L, const Rows& R, const KV* k_layer,
                                                     const KV* v_layer, const int32_t* table, int64_t kh0,
                                                     int64_t heads) {
  using TileFn = void (*)(Split&, const Rows&, int64_t, int64_t, int64_t, const KV* const*, const KV* const*,
                          float, float);
  static constexpr TileFn kTiles[4] = {&tile_split<KV, ND, 1>, &tile_split<KV, ND, std::min(2, kSplitRows<ND>)>,
                                       &tile_split<KV, ND, std::min(3, kSplitRows<ND>)>,
                                       &tile_split<KV, ND, std::min(4, kSplitRows<ND>)>};
  constexpr bool kBf16 = std::is_same_v<KV, uint16_t>;
  constexpr int64_t D = 32 * ND;
  const int64_t row = L.Kh * D;
  static thread_local Split S;
  int64_t longest = 0;
  for (int64_t r = 0; r < R.n; ++r) {
    S.m[r] = -std::numeric_limits<float>::infinity(), S.l[r] = 0.f;
    std::fill(S.acc[r], S.acc[r] + D, 0.f);
    if constexpr (kBf16) {
      for (int64_t c = 0; c < ND; ++c)
        for (int64_t i = 0; i < 16; ++i) S.q[r][32 * c + i] = R.q[r][32 * c + 2 * i], S.q[r][32 * c + 16 + i] = R.q[r][32 * c + 2 * i + 1];
    } else {
      std::copy(R.q[r], R.q[r] + D, S.q[r]);
    }
    longest = std::max(longest, R.limit[r]);
  }
  const int64_t per_head = R.n / heads;
  int64_t at[kTile];
  const KV* krow[kTile];
  const KV* vrow[kTile];
  for (int64_t j0 = first_tile(R); j0 < longest; j0 += kTile) {
    const int64_t n = std::min(kTile, longest - j0);
    for (int64_t jj = 0; jj < n; ++jj) {
      const int64_t j = j0 + jj;
      at[jj] = (static_cast<int64_t>(table[j / L.B]) * L.B + j % L.B) * row + kh0 * D;
    }
    // The tile after next, requested now (the first call: the next one too): one item's walk alone keeps
    // too few misses in flight.
    for (int64_t j = j0 == first_tile(R) ? j0 + kTile : j0 + 2 * kTile; j < std::min(longest, j0 + 3 * kTile); ++j) {
      const int64_t a = (static_cast<int64_t>(table[j / L.B]) * L.B + j % L.B) * row + kh0 * D;
      const char *kp = reinterpret_cast<const char*>(k_layer + a), *vp = reinterpret_cast<const char*>(v_layer + a);
      for (int64_t b = 0; b < static_cast<int64_t>(sizeof(KV)) * D * heads; b += 64) _mm_prefetch(kp + b, _MM_HINT_T0), _mm_prefetch(vp + b, _MM_HINT_T0);
    }
    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t jj = 0; jj < n; ++jj) krow[jj] = k_layer + at[jj] + h * D, vrow[jj] = v_layer + at[jj] + h * D;
      for (int64_t r0 = h * per_head; r0 < (h + 1) * per_head;) {
        const int64_t rb = std::min<int64_t>(kSplitRows<ND>, (h + 1) * per_head - r0);
        kTiles[rb - 1](S, R, r0, j0, n, krow, vrow, L.scale, L.softcap);
        r0 += rb;
      }
    }
  }
  // Back to element order (bf16: lanes i of the even / odd halves are elements 2i / 2i + 1).
  const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i hi = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  for (int64_t r = 0; r < R.n; ++r) {
    const __m512 inv = _mm512_set1_ps(S.l[r] > 0.f ? 1.f / S.l[r] : 0.f);
    for (int64_t c = 0; c < ND; ++c) {
      const __m512 e = _mm512_load_ps(S.acc[r] + 32 * c), o = _mm512_load_ps(S.acc[r] + 32 * c + 16);
      _mm512_storeu_ps(R.out[r] + 32 * c, _mm512_mul_ps(kBf16 ? _mm512_permutex2var_ps(e, lo, o) : e, inv));
      _mm512_storeu_ps(R.out[r] + 32 * c + 16, _mm512_mul_ps(kBf16 ? _mm512_permutex2var_ps(e, hi, o) : o, inv));
    }
  }
}

// The path every tile of a call takes, fixed by the ISA and the head dim alone: the paths sum a score's
// products in different orders, so a token's result would otherwise depend on how many of its sequence's
// tokens share the step (chunked prefill, prefix-cache hits) and a seeded sample on its batch mates.
enum class Path { kSplit, kLong, kAvx2 };
inline Path path_for(const Layout& L) {
  if (kAvx512 && (L.D == 64 || L.D == 128)) return Path::kSplit;
  return kAvx512 && L.D % 16 == 0 ? Path::kLong : Path::kAvx2;
}

// Everything a helper thread touches; shared-owned, so a helper that starts after the call returned only
// finds no work left.
template <typename KV>
struct Job {
  Layout L;
  const float* q;
  const KV *k_layer, *v_layer;
  const int32_t* tables;
  float* out;
  struct Tile {
    int32_t seq, first, count;  // query tokens first .. first + count - 1 of sequence seq
    int64_t ctx0;               // KV positions before the first one (its causal limit - 1)
    int64_t window;             // KV position of the sequence's first step token
  };
  const int32_t* tree = nullptr;  // tree masks [T], or none (causal)
  int64_t sliding = 0;            // the sliding window, 0: none
  std::vector<Tile> tiles;
  struct Item {
    int32_t tile, kh0, heads;  // KV heads kh0 .. kh0 + heads - 1 of one tile
  };
  std::vector<Item> work;
  int64_t items = 0;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void item(int64_t i) const {
    const Item& w = work[i];
    const Tile& t = tiles[w.tile];
    Rows R;
    for (int64_t kh = w.kh0; kh < w.kh0 + w.heads; ++kh)
      for (int64_t ti = 0; ti < t.count; ++ti)
        for (int64_t g = 0; g < L.G; ++g, ++R.n) {
          const int64_t at = ((t.first + ti) * L.H + kh * L.G + g) * L.D;
          R.q[R.n] = q + at, R.out[R.n] = out + at, R.limit[R.n] = t.ctx0 + ti + 1;
          R.start[R.n] = sliding > 0 ? std::max<int64_t>(0, t.ctx0 + ti + 1 - sliding) : 0;
          if (tree) R.bits[R.n] = static_cast<uint32_t>(tree[t.first + ti]), R.window[R.n] = t.window;
        }
    R.tree = tree != nullptr;
    const int32_t* table = tables + static_cast<int64_t>(t.seq) * L.max_blocks;
    switch (path_for(L)) {
      case Path::kSplit:
        if (L.D == 64) return attend_split<KV, 2>(L, R, k_layer, v_layer, table, w.kh0, w.heads);
        return attend_split<KV, 4>(L, R, k_layer, v_layer, table, w.kh0, w.heads);
      case Path::kLong:
        return attend_512<KV>(L, R, k_layer, v_layer, table, w.kh0);
      case Path::kAvx2:
        return attend<KV>(L, R, k_layer, v_layer, table, w.kh0);
    }
  }
  void loop() {
    for (int64_t i; (i = next.fetch_add(1)) < items;) {
      item(i);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

template <typename KV>
ffi::Error Run(ffi::ThreadPool pool, const Layout& L, const float* q, const KV* k, const KV* v,
               const int32_t* tables, const int32_t* seq_lens, const int32_t* qsl, const int32_t* tree, int64_t S,
               int64_t layer, int64_t sliding, float* out) {
  auto job = std::make_shared<Job<KV>>();
  job->L = L, job->q = q, job->tables = tables, job->out = out, job->tree = tree, job->sliding = sliding;
  const int64_t layer_elems = L.P * L.B * L.Kh * L.D;
  job->k_layer = k + layer * layer_elems, job->v_layer = v + layer * layer_elems;
  std::vector<bool> covered(L.T, false);
  for (int64_t s = 0; s < S; ++s) {
    const int64_t a = qsl[s], b = qsl[s + 1], n = b - a, len = seq_lens[s];
    if (a < 0 || b < a || b > L.T || n > len || len > L.max_blocks * L.B)
      return ffi::Error::InvalidArgument("paged attention: query_start_loc / seq_lens out of range");
    if (n == 0) continue;
    for (int64_t i = 0; i < (len + L.B - 1) / L.B; ++i)
      if (tables[s * L.max_blocks + i] < 0 || tables[s * L.max_blocks + i] >= L.P)
        return ffi::Error::InvalidArgument("paged attention: block table entry out of range");
    // Long query runs (prefill chunks) take tiles of 16 tokens on AVX-512: many rows share each K/V tile.
    // Short ones (decode, verify windows) keep tiles of 4. A row's arithmetic is the same in either.
    const int64_t tile_q = path_for(L) != Path::kAvx2 && n >= 2 * kTileQLong ? kTileQLong : kTileQ;
    for (int64_t t = a; t < b; t += tile_q) {
      const int64_t count = std::min(tile_q, b - t);
      job->tiles.push_back({static_cast<int32_t>(s), static_cast<int32_t>(t), static_cast<int32_t>(count),
                            len - n + (t - a), len - n});
    }
    std::fill(covered.begin() + a, covered.begin() + b, true);
  }
  for (int64_t t = 0; t < L.T; ++t)  // padding tokens
    if (!covered[t]) std::fill(out + t * L.H * L.D, out + (t + 1) * L.H * L.D, 0.f);
  // Short tiles on the split path take every KV head in one item (whole slot rows) when there are enough
  // of them to keep the threads busy.
  int64_t short_tiles = 0;
  for (const auto& t : job->tiles) short_tiles += path_for(L) == Path::kSplit && t.count <= kTileQ;
  const bool whole = short_tiles >= 4 * std::max<int64_t>(1, pool.num_threads()) && kTileQ * L.H <= kMaxRows;
  for (int32_t i = 0; i < static_cast<int32_t>(job->tiles.size()); ++i) {
    if (whole && path_for(L) == Path::kSplit && job->tiles[i].count <= kTileQ) {
      job->work.push_back({i, 0, static_cast<int32_t>(L.Kh)});
      continue;
    }
    for (int32_t kh = 0; kh < L.Kh; ++kh) job->work.push_back({i, kh, 1});
  }
  job->items = static_cast<int64_t>(job->work.size());
  // Work sharing as in skinny_matmul.cc: the caller takes items too, so the call completes even when the
  // pool is busy.
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), job->items) - 1;
  for (int64_t h = 0; h < helpers; ++h) pool.Schedule([job] { job->loop(); });
  job->loop();
  while (job->done.load(std::memory_order_acquire) < job->items) _mm_pause();
  return ffi::Error::Success();
}

ffi::Error PagedAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k_pages,
                              ffi::AnyBuffer v_pages, ffi::Buffer<ffi::S32> block_tables,
                              ffi::Buffer<ffi::S32> seq_lens, ffi::Buffer<ffi::S32> query_start_loc,
                              ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> sliding_window,
                              ffi::Buffer<ffi::S32> tree_mask, float sm_scale, float softcap,
                              ffi::ResultBuffer<ffi::F32> out) {
  auto qd = q.dimensions(), kd = k_pages.dimensions(), bd = block_tables.dimensions();
  if (qd.size() != 3 || kd.size() != 5 || bd.size() != 2 || k_pages.element_type() != v_pages.element_type())
    return ffi::Error::InvalidArgument("paged attention: want q [T, H, D], pools [L, P, B, K, D], tables [S, M]");
  Layout L{qd[0], qd[1], kd[3], qd[1] / kd[3], qd[2], kd[1], kd[2], bd[1], sm_scale, softcap};
  const int64_t S = bd[0];
  if (kd[4] != L.D || L.H % L.Kh != 0 || L.G > kMaxG || L.D % 8 != 0 || L.D > kMaxD ||
      seq_lens.element_count() != S || query_start_loc.element_count() != S + 1 ||
      (tree_mask.element_count() != 0 && tree_mask.element_count() != L.T))
    return ffi::Error::InvalidArgument("paged attention: unsupported or inconsistent shapes");
  const int64_t lay = layer.typed_data()[0], sliding = sliding_window.typed_data()[0];
  if (lay < 0 || lay >= kd[0]) return ffi::Error::InvalidArgument("paged attention: layer out of range");
  const float* qp = q.typed_data();
  const int32_t *tp = block_tables.typed_data(), *sp = seq_lens.typed_data(), *qs = query_start_loc.typed_data();
  float* op = out->typed_data();
  const int32_t* tree = tree_mask.element_count() ? tree_mask.typed_data() : nullptr;
  switch (k_pages.element_type()) {
    case ffi::DataType::F32:
      return Run(pool, L, qp, static_cast<const float*>(k_pages.untyped_data()),
                 static_cast<const float*>(v_pages.untyped_data()), tp, sp, qs, tree, S, lay, sliding, op);
    case ffi::DataType::BF16:
      return Run(pool, L, qp, static_cast<const uint16_t*>(k_pages.untyped_data()),
                 static_cast<const uint16_t*>(v_pages.untyped_data()), tp, sp, qs, tree, S, lay, sliding, op);
    default:
      return ffi::Error::InvalidArgument("paged attention: the pool must be f32 or bf16");
  }
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JsePagedAttention, PagedAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q [T, H, D]
                                  .Arg<ffi::AnyBuffer>()         // k_pages [L, P, B, K, D]: f32 or bf16
                                  .Arg<ffi::AnyBuffer>()         // v_pages
                                  .Arg<ffi::Buffer<ffi::S32>>()  // block_tables [S, M]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // seq_lens [S]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // query_start_loc [S + 1]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer []
                                  .Arg<ffi::Buffer<ffi::S32>>()  // sliding_window []: 0 = none
                                  .Arg<ffi::Buffer<ffi::S32>>()  // tree_mask [T], or [0]: causal
                                  .Attr<float>("sm_scale")
                                  .Attr<float>("softcap")  // 0: none
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out [T, H, D]
);
