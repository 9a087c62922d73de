// Ragged paged attention for XLA:CPU: the CPU counterpart of pallas_kernels/ragged_paged_attention.py, with the
// contract of pallas_kernels/reference.py (ragged_paged_attention_reference).
//
// Query token t of sequence s (query length n_s, KV length seq_lens[s]) sits at position
// p = seq_lens[s] - n_s + (t - query_start_loc[s]) and attends causally to KV positions 0..p, read from the
// pool through row s of the block table (this step's own K/V are already written there). One work item is
// up to 4 consecutive query tokens of one sequence and one KV head: its rows (tokens x the G = H / K query
// heads of that KV head) share each K and V row, read in the pool (f32) or converted to f32 once per tile of
// 32 context positions (bf16).
// The tiles are walked with an online softmax (Milakov & Gimelshein 2018; FlashAttention, Dao et al. 2022,
// §3.1): scores 8 positions at a time (8 independent FMA chains, one transposing reduction), a running max
// and sum per row, the accumulator rescaled when the max grows. exp is a vectorized polynomial (Cephes' expf range reduction,
// relative error below 2e-7). Accumulation is float32; the pool is float32 or bfloat16.
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
};

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
};

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
  for (int64_t j0 = 0; j0 < longest; j0 += kTile) {
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
      const int64_t valid = std::min(n, R.limit[r] - j0);  // >= 1 while the row has context left
      if (valid <= 0) continue;
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
      for (int64_t jj = valid; jj < kTile; ++jj) s[r][jj] = neg_inf;
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
    const __m256 inv = _mm256_set1_ps(1.f / l[r]);
    for (int64_t d = 0; d < Dv; ++d) _mm256_storeu_ps(R.out[r] + 8 * d, _mm256_mul_ps(_mm256_load_ps(acc[r] + 8 * d), inv));
  }
}

// ---- AVX-512, for work items of many rows (prefill chunks): K transposed per tile, so the scores of 8 rows
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
  for (int64_t j0 = 0; j0 < longest; j0 += kTile) {
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
    for (int64_t r = 0; r < R.n; ++r) {
      const int64_t valid = std::min(n, R.limit[r] - j0);
      if (valid <= 0) {  // no context left for this row: nothing added, nothing rescaled
        std::fill(s[r], s[r] + kTile, 0.f);
        corr[r] = 1.f;
        continue;
      }
      const __mmask16 k0 = static_cast<__mmask16>(valid >= 16 ? 0xFFFF : (1u << valid) - 1);
      const __mmask16 k1 = static_cast<__mmask16>(valid >= 32 ? 0xFFFF : valid <= 16 ? 0 : (1u << (valid - 16)) - 1);
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
    const __m512 inv = _mm512_set1_ps(1.f / l[r]);
    for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(R.out[r] + d, _mm512_mul_ps(_mm512_load_ps(acc[r] + d), inv));
  }
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
  };
  std::vector<Tile> tiles;
  int64_t items = 0;  // tiles x KV heads
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void item(int64_t i) const {
    const Tile& t = tiles[i / L.Kh];
    const int64_t kh = i % L.Kh;
    Rows R;
    for (int64_t ti = 0; ti < t.count; ++ti)
      for (int64_t g = 0; g < L.G; ++g, ++R.n) {
        const int64_t at = ((t.first + ti) * L.H + kh * L.G + g) * L.D;
        R.q[R.n] = q + at, R.out[R.n] = out + at, R.limit[R.n] = t.ctx0 + ti + 1;
      }
    const int32_t* table = tables + static_cast<int64_t>(t.seq) * L.max_blocks;
    if (t.count > kTileQ)  // a long tile: AVX-512 (see Run)
      attend_512<KV>(L, R, k_layer, v_layer, table, kh);
    else
      attend<KV>(L, R, k_layer, v_layer, table, kh);
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
               const int32_t* tables, const int32_t* seq_lens, const int32_t* qsl, int64_t S, int64_t layer,
               float* out) {
  auto job = std::make_shared<Job<KV>>();
  job->L = L, job->q = q, job->tables = tables, job->out = out;
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
    // Long query runs (prefill chunks) take tiles of 16 tokens on the AVX-512 path: many rows share each
    // K/V tile. Short ones (decode, verify windows) keep tiles of 4 and the AVX2 path.
    const int64_t tile_q = kAvx512 && L.D % 16 == 0 && n >= 2 * kTileQLong ? kTileQLong : kTileQ;
    for (int64_t t = a; t < b; t += tile_q) {
      const int64_t count = std::min(tile_q, b - t);
      job->tiles.push_back({static_cast<int32_t>(s), static_cast<int32_t>(t), static_cast<int32_t>(count),
                            len - n + (t - a)});
    }
    std::fill(covered.begin() + a, covered.begin() + b, true);
  }
  for (int64_t t = 0; t < L.T; ++t)  // padding tokens
    if (!covered[t]) std::fill(out + t * L.H * L.D, out + (t + 1) * L.H * L.D, 0.f);
  job->items = static_cast<int64_t>(job->tiles.size()) * L.Kh;
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
                              ffi::Buffer<ffi::S32> layer, float sm_scale, ffi::ResultBuffer<ffi::F32> out) {
  auto qd = q.dimensions(), kd = k_pages.dimensions(), bd = block_tables.dimensions();
  if (qd.size() != 3 || kd.size() != 5 || bd.size() != 2 || k_pages.element_type() != v_pages.element_type())
    return ffi::Error::InvalidArgument("paged attention: want q [T, H, D], pools [L, P, B, K, D], tables [S, M]");
  Layout L{qd[0], qd[1], kd[3], qd[1] / kd[3], qd[2], kd[1], kd[2], bd[1], sm_scale};
  const int64_t S = bd[0];
  if (kd[4] != L.D || L.H % L.Kh != 0 || L.G > kMaxG || L.D % 8 != 0 || L.D > kMaxD ||
      seq_lens.element_count() != S || query_start_loc.element_count() != S + 1)
    return ffi::Error::InvalidArgument("paged attention: unsupported or inconsistent shapes");
  const int64_t lay = layer.typed_data()[0];
  if (lay < 0 || lay >= kd[0]) return ffi::Error::InvalidArgument("paged attention: layer out of range");
  const float* qp = q.typed_data();
  const int32_t *tp = block_tables.typed_data(), *sp = seq_lens.typed_data(), *qs = query_start_loc.typed_data();
  float* op = out->typed_data();
  switch (k_pages.element_type()) {
    case ffi::DataType::F32:
      return Run(pool, L, qp, static_cast<const float*>(k_pages.untyped_data()),
                 static_cast<const float*>(v_pages.untyped_data()), tp, sp, qs, S, lay, op);
    case ffi::DataType::BF16:
      return Run(pool, L, qp, static_cast<const uint16_t*>(k_pages.untyped_data()),
                 static_cast<const uint16_t*>(v_pages.untyped_data()), tp, sp, qs, S, lay, op);
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
                                  .Attr<float>("sm_scale")
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out [T, H, D]
);
