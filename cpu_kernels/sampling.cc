// The sampler's two per-row passes for XLA:CPU (engine/sampler.py says what they compute):
//
//   JseFilterLogits: logits [N, V] / temperature, then top-k, top-p (Holtzman et al. 2020, §3.1) and min-p
//     (Nguyen et al. 2024) as one threshold per row; dropped tokens get -inf.
//   JseDraw: one token per row from softmax(scores) by the inverse CDF of a given uniform u in [0, 1).
//
// Top-k takes an nth_element, top-p a weighted quickselect: expected O(V) a row, no sort. In XLA these were
// ~60 kernels per step program (a top-k, a 32-step bisection, blocked cumulative sums):
// half of what every step program compiled. Here a row is one thread's: its result does not depend on the
// rows beside it (a seeded request samples the same token in any batch). Built for AVX-512, AVX2 and the
// baseline from one source (GCC target clones).

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int64_t kBlock = 128;       // tokens per block of the inverse CDF

// e^x (Cephes' expf, as model/numerics.py): 0 below -87.34 (and for -inf).
inline float exp_f32(float x) {
  float c = x > -87.33654f ? x : -87.33654f;  // the comparison forms map onto vector max / min
  c = c < 88.37626f ? c : 88.37626f;
  const float n = (c * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest
  float r = c - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + (r + 1.0f);
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  __builtin_memcpy(&scale, &bits, 4);
  return x >= -87.33654f ? p * scale : 0.0f;
}

__attribute__((target_clones("avx512f", "avx2", "default"))) void scale_row(const float* l, float temperature,
                                                                           int64_t V, float* out) {
  for (int64_t v = 0; v < V; ++v) out[v] = l[v] / temperature;
}

// Reductions keep kLanes partial results (one vector) so that they vectorize in a fixed order.
constexpr int64_t kLanes = 16;

__attribute__((target_clones("avx512f", "avx2", "default"))) float max_row(const float* x, int64_t V) {
  float lane[kLanes];
  std::fill(lane, lane + kLanes, kNegInf);
  int64_t v = 0;
  for (; v + kLanes <= V; v += kLanes)
    for (int64_t j = 0; j < kLanes; ++j) lane[j] = lane[j] > x[v + j] ? lane[j] : x[v + j];
  float m = kNegInf;
  for (int64_t j = 0; j < kLanes; ++j) m = std::max(m, lane[j]);
  for (; v < V; ++v) m = std::max(m, x[v]);
  return m;
}

// w[v] = e^(x[v] - m); block[b] = the sum of block b's weights (kBlock at a time).
__attribute__((target_clones("avx512f", "avx2", "default"))) void weights_row(const float* x, int64_t V, float m,
                                                                             float* w, float* block) {
  for (int64_t v = 0; v < V; ++v) w[v] = exp_f32(x[v] - m);
  for (int64_t b = 0, v0 = 0; v0 < V; ++b, v0 += kBlock) {
    const int64_t v1 = std::min(V, v0 + kBlock);
    float lane[kLanes] = {};
    int64_t v = v0;
    for (; v + kLanes <= v1; v += kLanes)
      for (int64_t j = 0; j < kLanes; ++j) lane[j] += w[v + j];
    float s = 0.0f;
    for (int64_t j = 0; j < kLanes; ++j) s += lane[j];
    for (; v < v1; ++v) s += w[v];
    block[b] = s;
  }
}

__attribute__((target_clones("avx512f", "avx2", "default"))) void threshold_row(float* x, int64_t V, float t) {
  for (int64_t v = 0; v < V; ++v) x[v] = x[v] >= t ? x[v] : kNegInf;
}

struct Scratch {
  std::vector<float> w, block, work;
  explicit Scratch(int64_t V) : w(V), block((V + kBlock - 1) / kBlock), work(V) {}
};

double sum_blocks(const Scratch& s, int64_t V) {
  double total = 0.0;
  for (int64_t b = 0; b < (V + kBlock - 1) / kBlock; ++b) total += s.block[b];
  return total;
}

// Sum of e^(x[i] - m) over [0, n), in lanes.
__attribute__((target_clones("avx512f", "avx2", "default"))) double mass(const float* x, int64_t n, float m) {
  float lane[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int64_t j = 0; j < kLanes; ++j) lane[j] += exp_f32(x[i + j] - m);
  double s = 0.0;
  for (int64_t j = 0; j < kLanes; ++j) s += lane[j];
  for (; i < n; ++i) s += exp_f32(x[i] - m);
  return s;
}

// Top-p's threshold: walking the values in descending order, the first whose running mass (itself included)
// reaches top_p * total; -inf where rounding leaves it short of that (every token stays). A weighted
// quickselect over `x` (reordered in place): expected O(V), no sort.
float top_p_threshold(float* x, int64_t n, float m, double total, float top_p) {
  const double target = static_cast<double>(top_p) * total;
  double above = 0.0;  // the mass of every value greater than those in [lo, hi)
  float *lo = x, *hi = x + n;
  while (lo < hi) {
    const float a = lo[0], b = lo[(hi - lo) / 2], c = hi[-1];
    const float pivot = std::max(std::min(a, b), std::min(std::max(a, b), c));  // median of three
    float* gt = std::partition(lo, hi, [pivot](float v) { return v > pivot; });
    float* eq = std::partition(gt, hi, [pivot](float v) { return v == pivot; });
    const double greater = mass(lo, gt - lo, m);
    if (above + greater >= target) {
      hi = gt;  // non-empty: above < target
      continue;
    }
    above += greater + static_cast<double>(eq - gt) * exp_f32(pivot - m);
    if (above >= target) return pivot;
    lo = eq;
  }
  return kNegInf;
}

void filter_row(const float* l, int64_t V, float temperature, int32_t top_k, float top_p, float min_p, float* out,
                Scratch& s) {
  scale_row(l, temperature, V, out);
  const float m = max_row(out, V);
  float threshold = kNegInf;
  if (top_k > 0 && top_k < V) {  // every token at least as large as the k-th largest
    std::copy(out, out + V, s.work.begin());
    std::nth_element(s.work.begin(), s.work.begin() + (top_k - 1), s.work.end(), std::greater<float>());
    threshold = s.work[top_k - 1];
  }
  if (top_p < 1.0f) {
    std::copy(out, out + V, s.work.begin());
    threshold = std::max(threshold, top_p_threshold(s.work.data(), V, m, mass(out, V, m), top_p));
  }
  if (min_p > 0.0f) threshold = std::max(threshold, m + std::log(std::max(min_p, 1e-30f)));  // p >= min_p * p_max
  if (threshold > kNegInf) threshold_row(out, V, threshold);
}

// The first token whose running weight passes u * total, else the last token with weight.
int32_t draw_row(const float* x, int64_t V, float u, Scratch& s) {
  const float m = max_row(x, V);
  weights_row(x, V, m, s.w.data(), s.block.data());
  const int64_t nb = (V + kBlock - 1) / kBlock;
  const double r = static_cast<double>(u) * sum_blocks(s, V);
  double cum = 0.0;
  int64_t last = -1;
  for (int64_t b = 0; b < nb; ++b) {
    if (s.block[b] > 0.0f) last = b;
    if (cum + s.block[b] <= r) {
      cum += s.block[b];
      continue;
    }
    for (int64_t v = b * kBlock; v < std::min(V, (b + 1) * kBlock); ++v) {
      cum += s.w[v];
      if (cum > r && s.w[v] > 0.0f) return static_cast<int32_t>(v);
    }
  }
  for (int64_t v = std::min(V, (last + 1) * kBlock) - 1; v >= 0; --v)
    if (s.w[v] > 0.0f) return static_cast<int32_t>(v);
  return 0;  // unreachable for a row with a finite score
}

// Runs row(t, scratch) for t in [0, T) on the calling thread and the pool's; one row per work item.
template <typename Row>
void for_rows(ffi::ThreadPool& pool, int64_t T, int64_t V, Row row) {
  struct Shared {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
  };
  auto shared = std::make_shared<Shared>();
  auto work = [shared, T, V, row] {
    Scratch s(V);
    for (int64_t t; (t = shared->next.fetch_add(1)) < T;) {
      row(t, s);
      shared->done.fetch_add(1, std::memory_order_release);
    }
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), T) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([work] { work(); });
  work();
  while (shared->done.load(std::memory_order_acquire) < T) std::this_thread::yield();
}

ffi::Error FilterLogitsImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> logits, ffi::Buffer<ffi::F32> temperature,
                            ffi::Buffer<ffi::S32> top_k, ffi::Buffer<ffi::F32> top_p, ffi::Buffer<ffi::F32> min_p,
                            ffi::ResultBuffer<ffi::F32> out) {
  auto d = logits.dimensions();
  if (d.size() != 2 || temperature.element_count() != d[0] || top_k.element_count() != d[0] ||
      top_p.element_count() != d[0] || min_p.element_count() != d[0])
    return ffi::Error::InvalidArgument("filter_logits: want logits [N, V] and [N] settings");
  const int64_t N = d[0], V = d[1];
  const float *l = logits.typed_data(), *t = temperature.typed_data(), *p = top_p.typed_data(),
              *mp = min_p.typed_data();
  const int32_t* k = top_k.typed_data();
  float* o = out->typed_data();
  for_rows(pool, N, V, [=](int64_t i, Scratch& s) { filter_row(l + i * V, V, t[i], k[i], p[i], mp[i], o + i * V, s); });
  return ffi::Error::Success();
}

ffi::Error DrawImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> scores, ffi::Buffer<ffi::F32> uniforms,
                    ffi::ResultBuffer<ffi::S32> tokens) {
  auto d = scores.dimensions();
  if (d.size() != 2 || uniforms.element_count() != d[0] || tokens->element_count() != d[0])
    return ffi::Error::InvalidArgument("draw: want scores [N, V], uniforms and tokens [N]");
  const int64_t N = d[0], V = d[1];
  const float *x = scores.typed_data(), *u = uniforms.typed_data();
  int32_t* out = tokens->typed_data();
  for_rows(pool, N, V, [=](int64_t i, Scratch& s) { out[i] = draw_row(x + i * V, V, u[i], s); });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JseFilterLogits, FilterLogitsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // logits [N, V]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // temperature [N], > 0
                                  .Arg<ffi::Buffer<ffi::S32>>()  // top_k [N], 0 = off
                                  .Arg<ffi::Buffer<ffi::F32>>()  // top_p [N], 1 = off
                                  .Arg<ffi::Buffer<ffi::F32>>()  // min_p [N], 0 = off
                                  .Ret<ffi::Buffer<ffi::F32>>()  // filtered [N, V]
);

XLA_FFI_DEFINE_HANDLER_SYMBOL(JseDraw, DrawImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // scores [N, V], log-weights, -inf excluded
                                  .Arg<ffi::Buffer<ffi::F32>>()  // uniforms [N] in [0, 1)
                                  .Ret<ffi::Buffer<ffi::S32>>()  // tokens [N]
);
