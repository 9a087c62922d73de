// Skinny matmul for XLA:CPU: y[T, N] = x[T, K] @ W[K, N] for small T (decode, verify windows, small batches).
//
// The weight is packed once, at load time, into panels of P = 16 output columns:
//   packed[p, k, j] = W[k, 16 p + j]   (shape [ceil(N / 16), K, 16], zero-padded past N)
// so one panel is a contiguous K x 16 stream. Each panel is read from memory once per call; the rows of x
// are processed in chunks whose accumulators (chunk rows x 16 columns) stay in vector registers while
// the panel streams through (it stays in L1/L2 for the next chunk). Threads split the panels.
//
// Weight element types: f32; bf16 (widened to f32 by a 16-bit shift); s8 with a per-output-column f32
// scale applied to the sums. x and y are f32; accumulation is f32 throughout.
//
// AVX-512F and AVX2+FMA paths, chosen at run time (CPUID; see `cpu_features`). `jse_cpu_features` tells the Python side
// which one runs (0: neither; the engine then keeps XLA's dot).

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t P = 16;  // panel width (output columns)

enum class WType { F32, BF16, S8 };

// ---- AVX-512: one zmm per k-row of a panel, up to 8 rows of x per chunk --------------------------

template <WType W>
__attribute__((target("avx512f"))) inline __m512 load_panel_row_512(const void* base, int64_t k) {
  if constexpr (W == WType::F32) {
    return _mm512_loadu_ps(static_cast<const float*>(base) + k * P);
  } else if constexpr (W == WType::BF16) {
    __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(base) + k * P));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  } else {
    __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const int8_t*>(base) + k * P));
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
  }
}

template <WType W, int R>
__attribute__((target("avx512f"))) void chunk_512(const float* x, int64_t ldx, const void* panel, int64_t K,
                                                  const float* scale, float* y, int64_t ldy, int64_t ncols) {
  // Two accumulators per row over interleaved k, so one row is not bound by FMA latency. The same for
  // every R: a row's sums then do not depend on how many rows share its chunk (batch invariance).
  constexpr int U = 2;
  __m512 acc[R][U];
  for (int r = 0; r < R; ++r)
    for (int u = 0; u < U; ++u) acc[r][u] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + U <= K; k += U) {
    for (int u = 0; u < U; ++u) {
      __m512 w = load_panel_row_512<W>(panel, k + u);
      for (int r = 0; r < R; ++r) acc[r][u] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * ldx + k + u]), w, acc[r][u]);
    }
  }
  for (; k < K; ++k) {
    __m512 w = load_panel_row_512<W>(panel, k);
    for (int r = 0; r < R; ++r) acc[r][0] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * ldx + k]), w, acc[r][0]);
  }
  __mmask16 mask = static_cast<__mmask16>((ncols >= 16) ? 0xFFFF : ((1u << ncols) - 1));
  __m512 s = scale ? _mm512_maskz_loadu_ps(mask, scale) : _mm512_set1_ps(1.0f);
  for (int r = 0; r < R; ++r) {
    __m512 sum = acc[r][0];
    for (int u = 1; u < U; ++u) sum = _mm512_add_ps(sum, acc[r][u]);
    _mm512_mask_storeu_ps(y + r * ldy, mask, _mm512_mul_ps(sum, s));
  }
}

// ---- AVX2 + FMA: two ymm per k-row of a panel, up to 6 rows of x per chunk ----------------------

template <WType W>
__attribute__((target("avx2,fma"))) inline void load_panel_row_256(const void* base, int64_t k, __m256& lo,
                                                                    __m256& hi) {
  if constexpr (W == WType::F32) {
    const float* p = static_cast<const float*>(base) + k * P;
    lo = _mm256_loadu_ps(p);
    hi = _mm256_loadu_ps(p + 8);
  } else if constexpr (W == WType::BF16) {
    const uint16_t* p = static_cast<const uint16_t*>(base) + k * P;
    __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8));
    lo = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(a), 16));
    hi = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16));
  } else {
    const int8_t* p = static_cast<const int8_t*>(base) + k * P;
    lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
    hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8))));
  }
}

template <WType W, int R>
__attribute__((target("avx2,fma"))) void chunk_256(const float* x, int64_t ldx, const void* panel, int64_t K,
                                                   const float* scale, float* y, int64_t ldy, int64_t ncols) {
  __m256 lo[R], hi[R];
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m256 wl, wh;
    load_panel_row_256<W>(panel, k, wl, wh);
    for (int r = 0; r < R; ++r) {
      __m256 xb = _mm256_broadcast_ss(x + r * ldx + k);
      lo[r] = _mm256_fmadd_ps(xb, wl, lo[r]);
      hi[r] = _mm256_fmadd_ps(xb, wh, hi[r]);
    }
  }
  alignas(32) float buf[P];
  for (int r = 0; r < R; ++r) {
    _mm256_store_ps(buf, lo[r]);
    _mm256_store_ps(buf + 8, hi[r]);
    for (int64_t j = 0; j < ncols; ++j) y[r * ldy + j] = scale ? buf[j] * scale[j] : buf[j];
  }
}

using ChunkFn = void (*)(const float*, int64_t, const void*, int64_t, const float*, float*, int64_t, int64_t);

template <WType W, int... Rs>
constexpr auto table_512(std::integer_sequence<int, Rs...>) {
  return std::array<ChunkFn, sizeof...(Rs)>{&chunk_512<W, Rs + 1>...};
}
template <WType W, int... Rs>
constexpr auto table_256(std::integer_sequence<int, Rs...>) {
  return std::array<ChunkFn, sizeof...(Rs)>{&chunk_256<W, Rs + 1>...};
}

// JSE_CPU_ISA=avx2 keeps an AVX-512 machine on the AVX2 path (so tests cover both); it never upgrades.
int cpu_features() {
  __builtin_cpu_init();
  const char* isa = std::getenv("JSE_CPU_ISA");
  const bool avx2_only = isa != nullptr && std::strcmp(isa, "avx2") == 0;
  if (__builtin_cpu_supports("avx512f") && !avx2_only) return 2;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return 1;
  return 0;
}

const int kFeatures = cpu_features();

template <WType W>
void run_panels(int isa, const float* x, int64_t T, int64_t K, const uint8_t* w, int64_t elem_bytes,
                const float* scale, float* y, int64_t N, int64_t p_begin, int64_t p_end) {
  static const auto t512 = table_512<W>(std::make_integer_sequence<int, 8>{});
  static const auto t256 = table_256<W>(std::make_integer_sequence<int, 6>{});
  const int64_t rows = isa == 2 ? 8 : 6;
  for (int64_t p = p_begin; p < p_end; ++p) {
    const void* panel = w + p * K * P * elem_bytes;
    const int64_t col = p * P, ncols = std::min<int64_t>(P, N - col);
    const float* s = scale ? scale + col : nullptr;
    for (int64_t t = 0; t < T; t += rows) {
      const int64_t r = std::min(rows, T - t);
      const ChunkFn fn = isa == 2 ? t512[r - 1] : t256[r - 1];
      fn(x + t * K, K, panel, K, s, y + t * N + col, N, ncols);
    }
  }
}

struct Shared {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

ffi::Error SkinnyMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                            ffi::Buffer<ffi::F32> scales, ffi::ResultBuffer<ffi::F32> y, int32_t isa) {
  if (kFeatures == 0) return ffi::Error::InvalidArgument("skinny matmul: this CPU has neither AVX-512F nor AVX2+FMA");
  // isa 0: the best path this CPU (and JSE_CPU_ISA) allows; 1: AVX2; 2: AVX-512 (chosen by measurement,
  // `engine.kernels`).
  if (isa == 0) isa = kFeatures;
  if (isa < 1 || isa > kFeatures)
    return ffi::Error::InvalidArgument("skinny matmul: isa must be 0, 1 (AVX2) or 2 (AVX-512, where the CPU has it)");
  auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 3 || yd.size() != 2 || wd[2] != P)
    return ffi::Error::InvalidArgument("skinny matmul: want x [T, K], w [N/16, K, 16], y [T, N]");
  const int64_t T = xd[0], K = xd[1], N = yd[1], panels = wd[0];
  if (wd[1] != K || yd[0] != T || panels != (N + P - 1) / P)
    return ffi::Error::InvalidArgument("skinny matmul: shapes of x, w and y disagree");
  const auto type = w.element_type();
  const bool s8 = type == ffi::DataType::S8;
  if (s8 && scales.element_count() != panels * P)
    return ffi::Error::InvalidArgument("skinny matmul: s8 weights need one scale per (padded) output column");
  const float* xp = x.typed_data();
  const float* sp = s8 ? scales.typed_data() : nullptr;
  const auto* wp = static_cast<const uint8_t*>(w.untyped_data());
  float* yp = y->typed_data();
  void (*run)(int, const float*, int64_t, int64_t, const uint8_t*, int64_t, const float*, float*, int64_t, int64_t,
              int64_t);
  int64_t elem_bytes;
  switch (type) {
    case ffi::DataType::F32: run = &run_panels<WType::F32>, elem_bytes = 4; break;
    case ffi::DataType::BF16: run = &run_panels<WType::BF16>, elem_bytes = 2; break;
    case ffi::DataType::S8: run = &run_panels<WType::S8>, elem_bytes = 1; break;
    default: return ffi::Error::InvalidArgument("skinny matmul: weights must be f32, bf16 or s8");
  }
  // Work sharing over groups of panels: the calling thread takes groups too, so the call completes
  // even when the pool is busy; helpers that start late find nothing left and only touch `shared`.
  constexpr int64_t kGroup = 4;
  const int64_t groups = (panels + kGroup - 1) / kGroup;
  auto shared = std::make_shared<Shared>();
  auto work = [=](Shared& s) {
    for (int64_t g; (g = s.next.fetch_add(1)) < groups;) {
      run(isa, xp, T, K, wp, elem_bytes, sp, yp, N, g * kGroup, std::min(panels, (g + 1) * kGroup));
      s.done.fetch_add(1, std::memory_order_release);
    }
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), groups) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([shared, work] { work(*shared); });
  work(*shared);
  while (shared->done.load(std::memory_order_acquire) < groups) _mm_pause();
  return ffi::Error::Success();
}

// One layer's product inside a loop over layers (`lax.scan`): the weights of every layer are operands that
// the loop passes through untouched, and `layer` picks one, so no layer's weight is copied out of a stack.
ffi::Error SkinnyMatmulLayersImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> layer,
                                  ffi::RemainingArgs weights, ffi::ResultBuffer<ffi::F32> y, int32_t isa) {
  // weights: L panels then L scales.
  const int64_t L = static_cast<int64_t>(weights.size()) / 2;
  if (L == 0 || weights.size() % 2 || layer.element_count() != 1)
    return ffi::Error::InvalidArgument("skinny matmul (layers): want a layer index, L weights and L scales");
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= L) return ffi::Error::InvalidArgument("skinny matmul (layers): layer index out of range");
  auto w = weights.get<ffi::AnyBuffer>(l);
  auto scales = weights.get<ffi::Buffer<ffi::F32>>(L + l);
  if (!w.has_value() || !scales.has_value())
    return ffi::Error::InvalidArgument("skinny matmul (layers): weights must be arrays, scales float32");
  return SkinnyMatmulImpl(pool, x, *w, *scales, y, isa);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JseSkinnyMatmulLayers, SkinnyMatmulLayersImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [T, K]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer []
                                  .RemainingArgs()               // L weights [N/16, K, 16], then L scales
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [T, N]
                                  .Attr<int32_t>("isa"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JseSkinnyMatmul, SkinnyMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [T, K]
                                  .Arg<ffi::AnyBuffer>()         // w [N/16, K, 16]: f32, bf16 or s8
                                  .Arg<ffi::Buffer<ffi::F32>>()  // scales [N/16 * 16] (s8), else [0]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [T, N]
                                  .Attr<int32_t>("isa"));

extern "C" int jse_cpu_features() { return kFeatures; }
