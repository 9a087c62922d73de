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
// Block formats: float32 weights that are exactly GGUF Q4_1 or Q8_0 blocks (32 consecutive k of one column
// share fp16 scales; ggml's `dequantize_row_q4_1` / `_q8_0`) stay in those blocks and are widened in
// registers: w = q * d + m (Q4_1, q in [0, 15]) or q * d (Q8_0, q in [-127, 127]). q * d is exact in f32
// (at most 15 significant bits), so the widened w are the float32 values bit for bit and the sums are those
// of the f32 panels, in the same order, from a fifth (Q4_1) or a quarter (Q8_0) of the bytes. A panel is
// K / 32 blocks, each a header (16 fp16 d, then for Q4_1 16 fp16 m) and 32 k-rows of 16 columns: Q4_1 a
// 64-bit row whose 32-bit half c holds column 2 i + c in its nibble i (so lane j of a broadcast row shifts
// right by 4 (j / 2) to reach its own), Q8_0 16 int8.
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

enum class WType { F32, BF16, S8, Q4_1, Q8_0 };

constexpr int64_t QK = 32;  // k rows per block of the block formats
template <WType W>
constexpr int64_t kBlockBytes = W == WType::Q4_1 ? 64 + QK * P / 2 : 32 + QK * P;
template <WType W>
constexpr bool kBlocks = W == WType::Q4_1 || W == WType::Q8_0;

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

// The same sums over block-format panels: two k-rows widened per step, accumulators as in `chunk_512`.
template <WType W, int R>
__attribute__((target("avx512f"))) void chunk_blocks_512(const float* x, int64_t ldx, const void* panel, int64_t K,
                                                         const float*, float* y, int64_t ldy, int64_t ncols) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const __m512i shifts = _mm512_set_epi32(28, 28, 24, 24, 20, 20, 16, 16, 12, 12, 8, 8, 4, 4, 0, 0);
  const __m512 levels = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const auto* b = static_cast<const uint8_t*>(panel);
  for (int64_t k0 = 0; k0 < K; k0 += QK, b += kBlockBytes<W>) {
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)));
    const __m512 m = W == WType::Q4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 32)))
                                      : _mm512_setzero_ps();
    for (int64_t kk = 0; kk < QK; kk += 2) {
      __m512 w0, w1;
      if constexpr (W == WType::Q4_1) {
        // Each lane shifts its own nibble to the bottom of a broadcast row; vpermps reads only the low 4
        // bits of an index, so it turns the nibble into its float with no masking.
        const auto* row = reinterpret_cast<const long long*>(b + 64 + kk * P / 2);
        w0 = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srlv_epi32(_mm512_set1_epi64(row[0]), shifts), levels), d, m);
        w1 = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srlv_epi32(_mm512_set1_epi64(row[1]), shifts), levels), d, m);
      } else {
        const auto* q = reinterpret_cast<const __m128i*>(b + 32 + kk * P);
        w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q))), d);
        w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q + 1))), d);
      }
      for (int r = 0; r < R; ++r) {
        acc[r][0] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * ldx + k0 + kk]), w0, acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * ldx + k0 + kk + 1]), w1, acc[r][1]);
      }
    }
  }
  __mmask16 mask = static_cast<__mmask16>((ncols >= 16) ? 0xFFFF : ((1u << ncols) - 1));
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + r * ldy, mask, _mm512_add_ps(acc[r][0], acc[r][1]));
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

// Rows' sums (16 columns as two ymm each) into y, the first `ncols` columns, times `scale` where given.
template <int R>
__attribute__((target("avx2,fma"))) inline void store_256(const __m256* lo, const __m256* hi, const float* scale,
                                                          float* y, int64_t ldy, int64_t ncols) {
  alignas(32) float buf[P];
  for (int r = 0; r < R; ++r) {
    _mm256_store_ps(buf, lo[r]);
    _mm256_store_ps(buf + 8, hi[r]);
    for (int64_t j = 0; j < ncols; ++j) y[r * ldy + j] = scale ? buf[j] * scale[j] : buf[j];
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
  store_256<R>(lo, hi, scale, y, ldy, ncols);
}

// The same sums over block-format panels, accumulators as in `chunk_256`.
template <WType W, int R>
__attribute__((target("avx2,fma,f16c"))) void chunk_blocks_256(const float* x, int64_t ldx, const void* panel,
                                                                int64_t K, const float*, float* y, int64_t ldy,
                                                                int64_t ncols) {
  __m256 lo[R], hi[R];
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
  const __m256i nibble = _mm256_set1_epi32(0x0F);
  const __m256i shifts_lo = _mm256_set_epi32(12, 12, 8, 8, 4, 4, 0, 0);
  const __m256i shifts_hi = _mm256_set_epi32(28, 28, 24, 24, 20, 20, 16, 16);
  const auto* b = static_cast<const uint8_t*>(panel);
  for (int64_t k0 = 0; k0 < K; k0 += QK, b += kBlockBytes<W>) {
    const __m256 dl = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b)));
    const __m256 dh = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 16)));
    __m256 ml = _mm256_setzero_ps(), mh = _mm256_setzero_ps();
    if constexpr (W == WType::Q4_1) {
      ml = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 32)));
      mh = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 48)));
    }
    for (int64_t kk = 0; kk < QK; ++kk) {
      __m256 wl, wh;
      if constexpr (W == WType::Q4_1) {
        const __m256i row = _mm256_set1_epi64x(*reinterpret_cast<const long long*>(b + 64 + kk * P / 2));
        wl = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(row, shifts_lo), nibble)), dl, ml);
        wh = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(row, shifts_hi), nibble)), dh, mh);
      } else {
        const uint8_t* q = b + 32 + kk * P;
        wl = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q)))), dl);
        wh = _mm256_mul_ps(
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8)))), dh);
      }
      for (int r = 0; r < R; ++r) {
        __m256 xb = _mm256_broadcast_ss(x + r * ldx + k0 + kk);
        lo[r] = _mm256_fmadd_ps(xb, wl, lo[r]);
        hi[r] = _mm256_fmadd_ps(xb, wh, hi[r]);
      }
    }
  }
  store_256<R>(lo, hi, nullptr, y, ldy, ncols);
}

using ChunkFn = void (*)(const float*, int64_t, const void*, int64_t, const float*, float*, int64_t, int64_t);

template <WType W, int... Rs>
constexpr auto table_512(std::integer_sequence<int, Rs...>) {
  if constexpr (kBlocks<W>)
    return std::array<ChunkFn, sizeof...(Rs)>{&chunk_blocks_512<W, Rs + 1>...};
  else
    return std::array<ChunkFn, sizeof...(Rs)>{&chunk_512<W, Rs + 1>...};
}
template <WType W, int... Rs>
constexpr auto table_256(std::integer_sequence<int, Rs...>) {
  if constexpr (kBlocks<W>)
    return std::array<ChunkFn, sizeof...(Rs)>{&chunk_blocks_256<W, Rs + 1>...};
  else
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
void run_panels(int isa, const float* x, int64_t T, int64_t K, const uint8_t* w, int64_t panel_bytes,
                const float* scale, float* y, int64_t N, int64_t p_begin, int64_t p_end) {
  static const auto t512 = table_512<W>(std::make_integer_sequence<int, 8>{});
  static const auto t256 = table_256<W>(std::make_integer_sequence<int, 6>{});
  const int64_t rows = isa == 2 ? 8 : 6;
  for (int64_t p = p_begin; p < p_end; ++p) {
    const void* panel = w + p * panel_bytes;
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
                            ffi::Buffer<ffi::F32> scales, ffi::ResultBuffer<ffi::F32> y, int32_t isa, int32_t format) {
  if (kFeatures == 0) return ffi::Error::InvalidArgument("skinny matmul: this CPU has neither AVX-512F nor AVX2+FMA");
  // isa 0: the best path this CPU (and JSE_CPU_ISA) allows; 1: AVX2; 2: AVX-512 (chosen by measurement,
  // `engine.kernels`).
  if (isa == 0) isa = kFeatures;
  if (isa < 1 || isa > kFeatures)
    return ffi::Error::InvalidArgument("skinny matmul: isa must be 0, 1 (AVX2) or 2 (AVX-512, where the CPU has it)");
  auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 3 || yd.size() != 2)
    return ffi::Error::InvalidArgument("skinny matmul: want x [T, K], w of rank 3, y [T, N]");
  const int64_t T = xd[0], K = xd[1], N = yd[1], panels = wd[0];
  if (yd[0] != T || panels != (N + P - 1) / P)
    return ffi::Error::InvalidArgument("skinny matmul: shapes of x, w and y disagree");
  const auto type = w.element_type();
  void (*run)(int, const float*, int64_t, int64_t, const uint8_t*, int64_t, const float*, float*, int64_t, int64_t,
              int64_t);
  int64_t panel_bytes;
  if (format == 0) {  // plain panels [N/16, K, 16] of the weights' element type
    if (wd[1] != K || wd[2] != P) return ffi::Error::InvalidArgument("skinny matmul: want w [N/16, K, 16]");
    switch (type) {
      case ffi::DataType::F32: run = &run_panels<WType::F32>, panel_bytes = 4 * K * P; break;
      case ffi::DataType::BF16: run = &run_panels<WType::BF16>, panel_bytes = 2 * K * P; break;
      case ffi::DataType::S8: run = &run_panels<WType::S8>, panel_bytes = K * P; break;
      default: return ffi::Error::InvalidArgument("skinny matmul: weights must be f32, bf16 or s8");
    }
  } else if (format == 1 || format == 2) {  // block formats, u8 [N/16, K/32, block bytes]
    const int64_t bytes = format == 1 ? kBlockBytes<WType::Q4_1> : kBlockBytes<WType::Q8_0>;
    if (type != ffi::DataType::U8 || K % QK || wd[1] != K / QK || wd[2] != bytes)
      return ffi::Error::InvalidArgument("skinny matmul: block-format weights must be u8 [N/16, K/32, block bytes]");
    run = format == 1 ? &run_panels<WType::Q4_1> : &run_panels<WType::Q8_0>;
    panel_bytes = K / QK * bytes;
  } else {
    return ffi::Error::InvalidArgument("skinny matmul: format must be 0 (panels), 1 (Q4_1) or 2 (Q8_0 blocks)");
  }
  const bool s8 = format == 0 && type == ffi::DataType::S8;
  if (s8 && scales.element_count() != panels * P)
    return ffi::Error::InvalidArgument("skinny matmul: s8 weights need one scale per (padded) output column");
  const float* xp = x.typed_data();
  const float* sp = s8 ? scales.typed_data() : nullptr;
  const auto* wp = static_cast<const uint8_t*>(w.untyped_data());
  float* yp = y->typed_data();
  // Work sharing over groups of panels: the calling thread takes groups too, so the call completes
  // even when the pool is busy; helpers that start late find nothing left and only touch `shared`.
  constexpr int64_t kGroup = 4;
  const int64_t groups = (panels + kGroup - 1) / kGroup;
  auto shared = std::make_shared<Shared>();
  auto work = [=](Shared& s) {
    for (int64_t g; (g = s.next.fetch_add(1)) < groups;) {
      run(isa, xp, T, K, wp, panel_bytes, sp, yp, N, g * kGroup, std::min(panels, (g + 1) * kGroup));
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
                                  ffi::RemainingArgs weights, ffi::ResultBuffer<ffi::F32> y, int32_t isa,
                                  int32_t format) {
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
  return SkinnyMatmulImpl(pool, x, *w, *scales, y, isa, format);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JseSkinnyMatmulLayers, SkinnyMatmulLayersImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [T, K]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer []
                                  .RemainingArgs()               // L weights [N/16, K, 16], then L scales
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [T, N]
                                  .Attr<int32_t>("isa")
                                  .Attr<int32_t>("format"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JseSkinnyMatmul, SkinnyMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [T, K]
                                  .Arg<ffi::AnyBuffer>()         // w [N/16, K, 16] f32, bf16, s8; u8 blocks
                                  .Arg<ffi::Buffer<ffi::F32>>()  // scales [N/16 * 16] (s8), else [0]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [T, N]
                                  .Attr<int32_t>("isa")
                                  .Attr<int32_t>("format"));

extern "C" int jse_cpu_features() { return kFeatures; }
