// Wide matmul on Intel AMX for XLA:CPU: y[T, N] = x[T, K] @ W[K, N] for products over many tokens (prefill
// chunks, scoring, large decode batches), where the skinny kernel's one-pass stream no longer pays.
//
// AMX (Intel Architecture Instructions Set Extensions, ch. 3, "Intel AMX"): TDPBF16PS multiplies a 16 x 32
// bf16 tile of A by a 32 x 16 bf16 tile of B held in pairs of k ("VNNI" layout: B row r holds k = 2r and
// 2r + 1 of all 16 columns, interleaved) and adds the products to a 16 x 16 f32 tile of C.
//
// The weight is packed once, at load time: packed[p, c, r, 2 j + e] = W[32 c + 2 r + e, 16 p + j], shape
// [Np / 16, Kp / 32, 16, 32] (K padded to Kp, a multiple of 32; N to Np, a multiple of 32; zeros), so each
// (panel, k chunk) tile is 1 KiB contiguous. Each call splits x into bf16 once, then every thread takes
// 32-column blocks of y and runs all 32-row blocks of x through them: 2 x 2 C tiles, 2 A tiles, 2 B tiles.
//
// Precision: x is always split, x = x_hi + x_lo in bf16 (x is then kept to ~2^-17, as an fp32 activation
// nearly is). With `lo` given (3 passes), W = W_hi + W_lo and y = x_hi W_hi + x_lo W_hi + x_hi W_lo with f32
// sums (the "bf16x3" split of fp32 products): each product is within ~2^-16 of its f32 value, close to an
// fp32 GEMM. With `lo` empty (2 passes), W is bf16 (the engine's bfloat16 kernel weights) and y = x_hi W +
// x_lo W: the skinny kernel's bf16-weight numerics. Rounding x to bf16 alone would turn the 1e-7 differences
// in attention between a decode step and a verify window into 2^-9 ones, and greedy tokens would diverge.

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <cmath>
#include <limits>
#include <memory>
#include <vector>

#include "vector_math.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kTileK = 32;   // bf16 elements of k per tile row (64 bytes)
constexpr int64_t kBlock = 32;   // rows (and columns) of one 2 x 2 block of C tiles
constexpr int64_t kTileElems = 16 * 32;

struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// CPUID: AMX-TILE and AMX-BF16 (leaf 7.0 EDX bits 24, 22), AVX512-BF16 (leaf 7.1 EAX bit 5); the OS saves
// the tile state (XCR0 bits 17, 18); and Linux lets this process use it (arch_prctl ARCH_REQ_XCOMP_PERM).
bool amx_usable() {
  const char* isa = std::getenv("JSE_CPU_ISA");
  if (isa != nullptr && (std::strcmp(isa, "avx2") == 0 || std::strcmp(isa, "avx512") == 0)) return false;
  unsigned a, b, c, d;
  __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(0));
  if (a < 7) return false;
  __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(0));
  if (!(d & (1u << 24)) || !(d & (1u << 22))) return false;
  unsigned a1, b1, c1, d1;
  __asm__ volatile("cpuid" : "=a"(a1), "=b"(b1), "=c"(c1), "=d"(d1) : "a"(7), "c"(1));
  if (!(a1 & (1u << 5))) return false;
  __asm__ volatile("cpuid" : "=a"(a1), "=b"(b1), "=c"(c1), "=d"(d1) : "a"(1));
  if (!(c1 & (1u << 27))) return false;  // OSXSAVE: xgetbv is allowed
  unsigned lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  if ((lo & (3u << 17)) != (3u << 17)) return false;
  constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
}

const bool kAmx = amx_usable();

// x [T, K] f32 -> hi and lo [Mp, Kp] bf16, rows [row_begin, row_end) (rows past T and columns past K: zeros).
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) void split_rows(const float* x, int64_t T, int64_t K,
                                                                                int64_t Kp, uint16_t* hi, uint16_t* lo,
                                                                                int64_t row_begin, int64_t row_end) {
  for (int64_t t = row_begin; t < row_end; ++t) {
    const float* src = x + std::min(t, T - 1) * K;
    for (int64_t k = 0; k < Kp; k += 16) {
      const int64_t n = t < T ? std::clamp<int64_t>(K - k, 0, 16) : 0;
      const __mmask16 m = static_cast<__mmask16>(n == 16 ? 0xFFFF : (1u << n) - 1);
      const __m512 v = _mm512_maskz_loadu_ps(m, src + k);
      const __m256i h = (__m256i)_mm512_cvtneps_pbh(v);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi + t * Kp + k), h);
      const __m512 hf = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo + t * Kp + k),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(v, hf)));
    }
  }
}

// Where a block of C goes: stored into y [T, N], or (the scoring head) reduced per row over the vocabulary.
struct Reduce {
  const int32_t* targets;  // [T]
  float* target_logit;     // [T]: written by the group holding each row's target column
  float* max;              // [groups, T]: per group, each row's max logit ...
  int32_t* arg;            // ... its lowest column ...
  float* sum;              // ... and the sum of exp(logit - max) over the group's columns
};

struct Operands {
  const uint16_t *a_hi, *a_lo;  // [Mp, Kp]
  const uint16_t *b_hi, *b_lo;  // [Np / 16, Kp / 32, 16, 32]
  float* y;                     // [T, N], or null with `reduce`
  const Reduce* reduce;
  int64_t T, N, Mp, Kp;
};

constexpr int64_t kMaxGroup = 8;  // column blocks per work item

// C tiles 0-3 (rows 0-15 / 16-31 x columns 0-15 / 16-31), A tiles 4-5, B tiles 6-7. Column blocks
// [nb_begin, nb_end) are work item `g`.
__attribute__((target("amx-tile,amx-bf16,avx512f"))) void run_blocks(const Operands& o, int64_t nb_begin,
                                                                      int64_t nb_end, int64_t g) {
  TileConfig cfg{};
  cfg.palette_id = 1;
  for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  _tile_loadconfig(&cfg);
  const int64_t chunks = o.Kp / kTileK, panel = chunks * kTileElems, lda = o.Kp * 2;
  const int64_t width = kBlock * (nb_end - nb_begin), ldt = kBlock * kMaxGroup;
  static thread_local float tmp[kBlock * kBlock * kMaxGroup];  // a row block x the group's columns
  // Rows outer, the group's column blocks inner: its B tiles stay in L2 and y is written a row segment of
  // the whole group at a time (a wide y, the output head's, otherwise costs a TLB miss per tile row).
  for (int64_t row = 0; row < o.Mp; row += kBlock) {
    const int64_t nrows = std::min(kBlock, o.T - row);
    for (int64_t nb = nb_begin; nb < nb_end; ++nb) {
      const uint16_t* b0 = o.b_hi + 2 * nb * panel;
      const uint16_t* l0 = o.b_lo ? o.b_lo + 2 * nb * panel : nullptr;
      const int64_t col = nb * kBlock, ncols = std::min(kBlock, o.N - col);
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      const uint16_t* a = o.a_hi + row * o.Kp;
      const uint16_t* al = o.a_lo + row * o.Kp;
      // A block of at most 16 real rows (a decode step, a verify window) leaves C tiles 2 and 3 at zero: half
      // the tile products, which a product over few rows is bound by. Passes x_hi W_hi, x_lo W_hi, then (with
      // W_lo) x_hi W_lo: each C tile sums in the same order whatever the block's height.
      const bool lower = nrows > 16;
      for (int64_t c = 0; c < chunks; ++c) {
        for (int pass = 0; pass < (l0 != nullptr ? 3 : 2); ++pass) {
          if (pass != 1) {  // pass 1 reuses W_hi's tiles
            const uint16_t* b = (pass == 0 ? b0 : l0) + c * kTileElems;
            _tile_loadd(6, b, 64);
            _tile_loadd(7, b + panel, 64);
          }
          const uint16_t* x = (pass == 1 ? al : a) + c * kTileK;
          _tile_loadd(4, x, lda);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 4, 7);
          if (lower) {
            _tile_loadd(5, x + 16 * o.Kp, lda);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
          }
        }
      }
      if (o.reduce == nullptr && nrows == kBlock && ncols == kBlock) {
        float* dst = o.y + row * o.N + col;
        const int64_t ldy = o.N * 4;
        _tile_stored(0, dst, ldy);
        _tile_stored(1, dst + 16, ldy);
        _tile_stored(2, dst + 16 * o.N, ldy);
        _tile_stored(3, dst + 16 * o.N + 16, ldy);
        continue;
      }
      float* t0 = tmp + (nb - nb_begin) * kBlock;
      _tile_stored(0, t0, ldt * 4);
      _tile_stored(1, t0 + 16, ldt * 4);
      _tile_stored(2, t0 + 16 * ldt, ldt * 4);
      _tile_stored(3, t0 + 16 * ldt + 16, ldt * 4);
      if (o.reduce == nullptr)
        for (int64_t r = 0; r < nrows; ++r)
          std::memcpy(o.y + (row + r) * o.N + col, t0 + r * ldt, ncols * sizeof(float));
    }
    if (o.reduce != nullptr) {
      const Reduce& rd = *o.reduce;
      const int64_t col0 = nb_begin * kBlock, n = std::min(width, o.N - col0);
      for (int64_t r = 0; r < nrows; ++r) {
        const int64_t t = row + r;
        const float* l = tmp + r * ldt;
        float m;
        int32_t arg;
        jse::row_max(l, n, &m, &arg);
        rd.max[g * o.T + t] = m;
        rd.arg[g * o.T + t] = static_cast<int32_t>(col0) + arg;
        rd.sum[g * o.T + t] = jse::row_sum_exp(l, n, m);
        const int64_t target = rd.targets[t] - col0;
        if (target >= 0 && target < n) rd.target_logit[t] = l[target];
      }
    }
  }
  _tile_release();
}

struct Shared {
  std::atomic<int64_t> next_rows{0}, rows_done{0};  // phase 1: x split into bf16, by row blocks
  std::atomic<int64_t> next{0}, done{0};            // phase 2: column groups
};

// Column blocks per work item: up to 8 (256 columns: 8 x 32 x Kp x 2 bytes of B per pass, in L2), at least 4
// items per thread where the width allows, for balance.
int64_t GroupSize(ffi::ThreadPool& pool, int64_t N) {
  const int64_t threads = std::max<int64_t>(1, pool.num_threads()), blocks = (N + kBlock - 1) / kBlock;
  return std::clamp<int64_t>(blocks / (4 * threads), 1, kMaxGroup);
}

// The product (or the fused head reduction) with x split into bf16 first. Work sharing as in
// skinny_matmul.cc: the caller takes items too and waits for all; helpers hold `shared` alive and touch the
// operands only after taking an item, which the caller waits for.
ffi::Error Run(ffi::ThreadPool& pool, const float* x, int64_t T, int64_t K, const uint16_t* w_hi,
               const uint16_t* w_lo, int64_t Kp, int64_t N, float* y, Reduce* reduce) {
  const int64_t Mp = (T + kBlock - 1) / kBlock * kBlock;
  const size_t plane = static_cast<size_t>(Mp * Kp);
  static thread_local std::vector<uint16_t> scratch;  // the caller's, kept: a fresh buffer costs page faults
  if (scratch.size() < 2 * plane) scratch.resize(2 * plane);
  uint16_t* a_hi = scratch.data();
  uint16_t* a_lo = a_hi + plane;
  const Operands o{a_hi, a_lo, w_hi, w_lo, y, reduce, T, N, Mp, Kp};
  const int64_t threads = std::max<int64_t>(1, pool.num_threads()), blocks = (N + kBlock - 1) / kBlock;
  const int64_t group = GroupSize(pool, N), groups = (blocks + group - 1) / group;
  const int64_t row_items = Mp / kBlock;
  auto shared = std::make_shared<Shared>();
  auto work = [shared, &o, x, K, blocks, group, groups, row_items] {
    Shared& s = *shared;
    for (int64_t i; (i = s.next_rows.fetch_add(1)) < row_items;) {
      split_rows(x, o.T, K, o.Kp, const_cast<uint16_t*>(o.a_hi), const_cast<uint16_t*>(o.a_lo), i * kBlock,
                 (i + 1) * kBlock);
      s.rows_done.fetch_add(1, std::memory_order_release);
    }
    if (s.next.load() >= groups) return;  // a helper that starts late
    while (s.rows_done.load(std::memory_order_acquire) < row_items) _mm_pause();
    for (int64_t g; (g = s.next.fetch_add(1)) < groups;) {
      run_blocks(o, g * group, std::min(blocks, (g + 1) * group), g);
      s.done.fetch_add(1, std::memory_order_release);
    }
  };
  const int64_t helpers = std::min(threads, std::max(groups, row_items)) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([shared, work] { work(); });
  work();
  while (shared->done.load(std::memory_order_acquire) < groups) _mm_pause();
  return ffi::Error::Success();
}

// Checks x [T, K], w [Np/16, Kp/32, 16, 32] (and w_lo: empty or the same) against N; sets Kp.
ffi::Error CheckShapes(ffi::Buffer<ffi::F32>& x, ffi::Buffer<ffi::BF16>& w_hi, ffi::Buffer<ffi::BF16>& w_lo,
                       int64_t N, int64_t& kp) {
  if (!kAmx) return ffi::Error::InvalidArgument("amx matmul: this CPU (or OS) does not allow AMX-BF16");
  auto xd = x.dimensions(), wd = w_hi.dimensions();
  if (xd.size() != 2 || wd.size() != 4 || wd[2] != 16 || wd[3] != kTileK)
    return ffi::Error::InvalidArgument("amx matmul: want x [T, K], w [Np/16, Kp/32, 16, 32]");
  const int64_t K = xd[1], Np = wd[0] * 16, Kp = wd[1] * kTileK;
  if (Np % kBlock != 0 || N > Np || N <= Np - kBlock || K > Kp || K <= Kp - kTileK)
    return ffi::Error::InvalidArgument("amx matmul: shapes of x, w and y disagree");
  if (w_lo.element_count() != 0 && w_lo.element_count() != w_hi.element_count())
    return ffi::Error::InvalidArgument("amx matmul: w_lo must be empty or shaped as w_hi");
  kp = Kp;
  return ffi::Error::Success();
}

const uint16_t* Bits(ffi::Buffer<ffi::BF16>& w) {
  return w.element_count() ? reinterpret_cast<const uint16_t*>(w.typed_data()) : nullptr;
}

ffi::Error AmxMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::BF16> w_hi,
                         ffi::Buffer<ffi::BF16> w_lo, ffi::ResultBuffer<ffi::F32> y) {
  auto yd = y->dimensions();
  if (yd.size() != 2 || x.dimensions().size() != 2 || yd[0] != x.dimensions()[0])
    return ffi::Error::InvalidArgument("amx matmul: want y [T, N] for x [T, K]");
  const int64_t T = yd[0], N = yd[1];
  int64_t kp;
  if (auto err = CheckShapes(x, w_hi, w_lo, N, kp); err.failure()) return err;
  if (T == 0 || N == 0) return ffi::Error::Success();
  return Run(pool, x.typed_data(), T, x.dimensions()[1], Bits(w_hi), Bits(w_lo), kp, N, y->typed_data(),
             nullptr);
}

// The output head fused with scoring's reduction: logprob[t] = (x W)[t, targets[t]] - logsumexp((x W)[t, :N])
// and argmax[t] (lowest index), without writing the [T, N] logits.
ffi::Error AmxHeadLogSoftmaxImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::BF16> w_hi,
                                 ffi::Buffer<ffi::BF16> w_lo, ffi::Buffer<ffi::S32> targets, int64_t n,
                                 ffi::ResultBuffer<ffi::F32> logprob, ffi::ResultBuffer<ffi::S32> argmax) {
  if (x.dimensions().size() != 2) return ffi::Error::InvalidArgument("amx head: want x [T, K]");
  const int64_t T = x.dimensions()[0];
  if (targets.element_count() != T || logprob->element_count() != T || argmax->element_count() != T)
    return ffi::Error::InvalidArgument("amx head: targets, logprob and argmax must be [T]");
  int64_t kp;
  if (auto err = CheckShapes(x, w_hi, w_lo, n, kp); err.failure()) return err;
  const int32_t* tg = targets.typed_data();
  for (int64_t t = 0; t < T; ++t)
    if (tg[t] < 0 || tg[t] >= n) return ffi::Error::InvalidArgument("amx head: target id out of range");
  if (T == 0 || n == 0) return ffi::Error::Success();
  const int64_t blocks = (n + kBlock - 1) / kBlock, group = GroupSize(pool, n), groups = (blocks + group - 1) / group;
  std::vector<float> target_logit(T), max(groups * T), sum(groups * T);
  std::vector<int32_t> arg(groups * T);
  Reduce rd{tg, target_logit.data(), max.data(), arg.data(), sum.data()};
  auto err = Run(pool, x.typed_data(), T, x.dimensions()[1], Bits(w_hi), Bits(w_lo), kp, n, nullptr, &rd);
  if (err.failure()) return err;
  float* lp = logprob->typed_data();
  int32_t* am = argmax->typed_data();
  for (int64_t t = 0; t < T; ++t) {  // merge the groups (in column order: the first maximum is the lowest index)
    float m = -std::numeric_limits<float>::infinity();
    int32_t a = 0;
    for (int64_t g = 0; g < groups; ++g)
      if (max[g * T + t] > m) m = max[g * T + t], a = arg[g * T + t];
    double s = 0;
    for (int64_t g = 0; g < groups; ++g) s += sum[g * T + t] * std::exp(double(max[g * T + t]) - m);
    lp[t] = target_logit[t] - (m + static_cast<float>(std::log(s)));
    am[t] = a;
  }
  return ffi::Error::Success();
}

// One layer's product inside a loop over layers (`lax.scan`), as `JseSkinnyMatmulLayers`: every layer's tiles
// are operands the loop passes through untouched, and `layer` picks one.
ffi::Error AmxMatmulLayersImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> layer,
                               ffi::RemainingArgs weights, ffi::ResultBuffer<ffi::F32> y) {
  // weights: L hi parts then L lo parts.
  const int64_t L = static_cast<int64_t>(weights.size()) / 2;
  if (L == 0 || weights.size() % 2 || layer.element_count() != 1)
    return ffi::Error::InvalidArgument("amx matmul (layers): want a layer index, L hi parts and L lo parts");
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= L) return ffi::Error::InvalidArgument("amx matmul (layers): layer index out of range");
  auto hi = weights.get<ffi::Buffer<ffi::BF16>>(l);
  auto lo = weights.get<ffi::Buffer<ffi::BF16>>(L + l);
  if (!hi.has_value() || !lo.has_value())
    return ffi::Error::InvalidArgument("amx matmul (layers): the tiles must be bfloat16");
  return AmxMatmulImpl(pool, x, *hi, *lo, y);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JseAmxMatmulLayers, AmxMatmulLayersImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [T, K]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer []
                                  .RemainingArgs()               // L hi parts, then L lo parts
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [T, N]
);

XLA_FFI_DEFINE_HANDLER_SYMBOL(JseAmxMatmul, AmxMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [T, K]
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // w_hi [Np/16, Kp/32, 16, 32]
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // w_lo: the same shape (3 passes) or [0] (2 passes)
                                  .Ret<ffi::Buffer<ffi::F32>>()   // y [T, N]
);

XLA_FFI_DEFINE_HANDLER_SYMBOL(JseAmxHeadLogSoftmax, AmxHeadLogSoftmaxImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [T, K]: final hidden states
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // w_hi: the head [K, N] in AMX tiles
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // w_lo
                                  .Arg<ffi::Buffer<ffi::S32>>()   // targets [T]
                                  .Attr<int64_t>("n")             // N, the vocabulary
                                  .Ret<ffi::Buffer<ffi::F32>>()   // logprob [T]
                                  .Ret<ffi::Buffer<ffi::S32>>()   // argmax [T]
);

extern "C" int jse_amx_available() { return kAmx ? 1 : 0; }
