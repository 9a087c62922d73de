// Ragged paged attention for XLA:CPU: the CPU counterpart of pallas_kernels/ragged_paged_attention.py, with the
// contract of pallas_kernels/reference.py (ragged_paged_attention_reference).
//
// Query token t of sequence s (query length n_s, KV length seq_lens[s]) sits at position
// p = seq_lens[s] - n_s + (t - query_start_loc[s]) and attends causally to KV positions 0..p, read from the
// pool through row s of the block table (this step's own K/V are already written there). One work item is a
// (token, KV head) pair: the G = H / K query heads of that KV head share each K and V row as it is loaded.
// The context is walked in tiles of 32 positions with an online softmax (Milakov & Gimelshein 2018;
// FlashAttention, Dao et al. 2022, §3.1): scores for the tile, a running max and sum per head, the
// accumulator rescaled when the max grows. exp is a vectorized polynomial (Cephes' expf range reduction,
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
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kTile = 32;     // context positions per online-softmax step
constexpr int64_t kMaxG = 16;     // query heads per KV head
constexpr int64_t kMaxD = 256;    // head dim

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

// One (token, KV head): out[g, :] for the G query heads of KV head kh.
template <typename KV>
__attribute__((target("avx2,fma"))) void attend(const Layout& L, const float* q, const KV* k_layer,
                                                const KV* v_layer, const int32_t* table, int64_t n_ctx, int64_t kh,
                                                float* out) {
  const int64_t G = L.G, D = L.D, Dv = D / 8;
  alignas(32) float s[kMaxG][kTile];
  __m256 acc[kMaxG][kMaxD / 8];
  float m[kMaxG], l[kMaxG];
  for (int64_t g = 0; g < G; ++g) {
    m[g] = -std::numeric_limits<float>::infinity(), l[g] = 0.f;
    for (int64_t d = 0; d < Dv; ++d) acc[g][d] = _mm256_setzero_ps();
  }
  const int64_t row = L.Kh * D;  // elements per pool slot
  for (int64_t j0 = 0; j0 < n_ctx; j0 += kTile) {
    const int64_t n = std::min(kTile, n_ctx - j0);
    const KV* krow[kTile];
    const KV* vrow[kTile];
    for (int64_t jj = 0; jj < n; ++jj) {
      const int64_t j = j0 + jj, slot = static_cast<int64_t>(table[j / L.B]) * L.B + j % L.B;
      krow[jj] = k_layer + slot * row + kh * D;
      vrow[jj] = v_layer + slot * row + kh * D;
    }
    for (int64_t jj = 0; jj < n; ++jj) {
      __m256 kv[kMaxD / 8];
      for (int64_t d = 0; d < Dv; ++d) kv[d] = load8(krow[jj] + 8 * d);
      for (int64_t g = 0; g < G; ++g) {
        __m256 a = _mm256_setzero_ps();
        for (int64_t d = 0; d < Dv; ++d) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * D + 8 * d), kv[d], a);
        s[g][jj] = hsum(a) * L.scale;
      }
    }
    for (int64_t g = 0; g < G; ++g) {
      float tile_max = s[g][0];
      for (int64_t jj = 1; jj < n; ++jj) tile_max = std::max(tile_max, s[g][jj]);
      const float m_new = std::max(m[g], tile_max);
      for (int64_t jj = n; jj < kTile; ++jj) s[g][jj] = -std::numeric_limits<float>::infinity();
      __m256 sum = _mm256_setzero_ps(), mv = _mm256_set1_ps(m_new);
      for (int64_t jj = 0; jj < kTile; jj += 8) {
        __m256 p = exp8(_mm256_sub_ps(_mm256_load_ps(&s[g][jj]), mv));
        _mm256_store_ps(&s[g][jj], p);
        sum = _mm256_add_ps(sum, p);
      }
      const float corr = std::exp(m[g] - m_new);  // 0 on the first tile (m = -inf)
      l[g] = l[g] * corr + hsum(sum);
      m[g] = m_new;
      const __m256 c = _mm256_set1_ps(corr);
      for (int64_t d = 0; d < Dv; ++d) acc[g][d] = _mm256_mul_ps(acc[g][d], c);
    }
    for (int64_t jj = 0; jj < n; ++jj) {
      __m256 vv[kMaxD / 8];
      for (int64_t d = 0; d < Dv; ++d) vv[d] = load8(vrow[jj] + 8 * d);
      for (int64_t g = 0; g < G; ++g) {
        const __m256 p = _mm256_set1_ps(s[g][jj]);
        for (int64_t d = 0; d < Dv; ++d) acc[g][d] = _mm256_fmadd_ps(p, vv[d], acc[g][d]);
      }
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    const __m256 inv = _mm256_set1_ps(1.f / l[g]);
    for (int64_t d = 0; d < Dv; ++d) _mm256_storeu_ps(out + g * D + 8 * d, _mm256_mul_ps(acc[g][d], inv));
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
  std::vector<int32_t> seq_of;  // per token: its sequence, -1 for padding (zeros out)
  std::vector<int64_t> n_ctx;   // per token: KV positions it attends to
  int64_t items = 0;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void item(int64_t i) const {
    const int64_t t = i / L.Kh, kh = i % L.Kh, at = (t * L.H + kh * L.G) * L.D;
    if (seq_of[t] < 0) {
      std::fill(out + at, out + at + L.G * L.D, 0.f);
      return;
    }
    attend<KV>(L, q + at, k_layer, v_layer, tables + seq_of[t] * L.max_blocks, n_ctx[t], kh, out + at);
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
  job->seq_of.assign(L.T, -1);
  job->n_ctx.assign(L.T, 0);
  for (int64_t s = 0; s < S; ++s) {
    const int64_t a = qsl[s], b = qsl[s + 1], n = b - a, len = seq_lens[s];
    if (a < 0 || b < a || b > L.T || n > len || len > L.max_blocks * L.B)
      return ffi::Error::InvalidArgument("paged attention: query_start_loc / seq_lens out of range");
    if (n == 0) continue;
    for (int64_t i = 0; i < (len + L.B - 1) / L.B; ++i)
      if (tables[s * L.max_blocks + i] < 0 || tables[s * L.max_blocks + i] >= L.P)
        return ffi::Error::InvalidArgument("paged attention: block table entry out of range");
    for (int64_t t = a; t < b; ++t) job->seq_of[t] = s, job->n_ctx[t] = len - n + (t - a) + 1;
  }
  job->items = L.T * L.Kh;
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
