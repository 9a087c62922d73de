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
// Precision: with `lo` given (3 passes), x = x_hi + x_lo and W = W_hi + W_lo in bf16, and
// y = x_hi W_hi + x_hi W_lo + x_lo W_hi with f32 sums (the "bf16x3" split of fp32 products): each product
// is within ~2^-16 of its f32 value, close to an fp32 GEMM at 3 passes' cost. With `lo` empty (1 pass), x
// and W are bf16-rounded (W already is: the engine's bfloat16 kernel weights).

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>

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

// x [T, K] f32 -> hi (and lo) [Mp, Kp] bf16, rows [row_begin, row_end); padding stays zero (the caller zeroes).
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) void split_rows(const float* x, int64_t K, int64_t Kp,
                                                                         uint16_t* hi, uint16_t* lo,
                                                                         int64_t row_begin, int64_t row_end) {
  for (int64_t t = row_begin; t < row_end; ++t) {
    const float* src = x + t * K;
    for (int64_t k = 0; k < K; k += 16) {
      const int64_t n = std::min<int64_t>(16, K - k);
      const __mmask16 m = static_cast<__mmask16>(n == 16 ? 0xFFFF : (1u << n) - 1);
      const __m512 v = _mm512_maskz_loadu_ps(m, src + k);
      const __m256i h = (__m256i)_mm512_cvtneps_pbh(v);
      _mm256_mask_storeu_epi16(hi + t * Kp + k, m, h);
      if (lo != nullptr) {
        const __m512 hf = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
        _mm256_mask_storeu_epi16(lo + t * Kp + k, m, (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(v, hf)));
      }
    }
  }
}

struct Operands {
  const uint16_t *a_hi, *a_lo;  // [Mp, Kp]
  const uint16_t *b_hi, *b_lo;  // [Np / 16, Kp / 32, 16, 32]
  float* y;                     // [T, N]
  int64_t T, N, Mp, Kp;
};

// C tiles 0-3 (rows 0-15 / 16-31 x columns 0-15 / 16-31), A tiles 4-5, B tiles 6-7.
__attribute__((target("amx-tile,amx-bf16"))) void run_blocks(const Operands& o, int64_t nb_begin, int64_t nb_end) {
  TileConfig cfg{};
  cfg.palette_id = 1;
  for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  _tile_loadconfig(&cfg);
  const int64_t chunks = o.Kp / kTileK, panel = chunks * kTileElems, lda = o.Kp * 2;
  alignas(64) float tmp[kBlock * kBlock];
  // Rows outer, the group's column blocks inner: its B tiles stay in L2 and y is written a row segment of
  // the whole group at a time (a wide y, the output head's, otherwise costs a TLB miss per tile row).
  for (int64_t row = 0; row < o.Mp; row += kBlock) {
    for (int64_t nb = nb_begin; nb < nb_end; ++nb) {
      const uint16_t* b0 = o.b_hi + 2 * nb * panel;
      const uint16_t* l0 = o.b_lo ? o.b_lo + 2 * nb * panel : nullptr;
      const int64_t col = nb * kBlock, ncols = std::min(kBlock, o.N - col);
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      const uint16_t* a = o.a_hi + row * o.Kp;
      const uint16_t* al = o.a_lo ? o.a_lo + row * o.Kp : nullptr;
      for (int64_t c = 0; c < chunks; ++c) {
        _tile_loadd(4, a + c * kTileK, lda);
        _tile_loadd(5, a + 16 * o.Kp + c * kTileK, lda);
        _tile_loadd(6, b0 + c * kTileElems, 64);
        _tile_loadd(7, b0 + panel + c * kTileElems, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
        if (al != nullptr) {  // x_lo W_hi, then x_hi W_lo
          _tile_loadd(4, al + c * kTileK, lda);
          _tile_loadd(5, al + 16 * o.Kp + c * kTileK, lda);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 4, 7);
          _tile_dpbf16ps(2, 5, 6);
          _tile_dpbf16ps(3, 5, 7);
          _tile_loadd(4, a + c * kTileK, lda);
          _tile_loadd(5, a + 16 * o.Kp + c * kTileK, lda);
          _tile_loadd(6, l0 + c * kTileElems, 64);
          _tile_loadd(7, l0 + panel + c * kTileElems, 64);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 4, 7);
          _tile_dpbf16ps(2, 5, 6);
          _tile_dpbf16ps(3, 5, 7);
        }
      }
      const int64_t nrows = std::min(kBlock, o.T - row);
      if (nrows == kBlock && ncols == kBlock) {
        float* dst = o.y + row * o.N + col;
        const int64_t ldy = o.N * 4;
        _tile_stored(0, dst, ldy);
        _tile_stored(1, dst + 16, ldy);
        _tile_stored(2, dst + 16 * o.N, ldy);
        _tile_stored(3, dst + 16 * o.N + 16, ldy);
      } else {
        _tile_stored(0, tmp, kBlock * 4);
        _tile_stored(1, tmp + 16, kBlock * 4);
        _tile_stored(2, tmp + 16 * kBlock, kBlock * 4);
        _tile_stored(3, tmp + 16 * kBlock + 16, kBlock * 4);
        for (int64_t r = 0; r < nrows; ++r)
          std::memcpy(o.y + (row + r) * o.N + col, tmp + r * kBlock, ncols * sizeof(float));
      }
    }
  }
  _tile_release();
}

struct Shared {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};

ffi::Error AmxMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::BF16> w_hi,
                         ffi::Buffer<ffi::BF16> w_lo, ffi::ResultBuffer<ffi::F32> y) {
  if (!kAmx) return ffi::Error::InvalidArgument("amx matmul: this CPU (or OS) does not allow AMX-BF16");
  auto xd = x.dimensions(), wd = w_hi.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 4 || yd.size() != 2 || wd[2] != 16 || wd[3] != kTileK)
    return ffi::Error::InvalidArgument("amx matmul: want x [T, K], w [Np/16, Kp/32, 16, 32], y [T, N]");
  const int64_t T = xd[0], K = xd[1], N = yd[1], Np = wd[0] * 16, Kp = wd[1] * kTileK;
  if (yd[0] != T || Np % kBlock != 0 || N > Np || N <= Np - kBlock || K > Kp || K <= Kp - kTileK)
    return ffi::Error::InvalidArgument("amx matmul: shapes of x, w and y disagree");
  const bool three = w_lo.element_count() != 0;
  if (three && w_lo.element_count() != w_hi.element_count())
    return ffi::Error::InvalidArgument("amx matmul: w_lo must be empty or shaped as w_hi");
  if (T == 0 || N == 0) return ffi::Error::Success();
  const int64_t Mp = (T + kBlock - 1) / kBlock * kBlock;
  const size_t plane = static_cast<size_t>(Mp * Kp);
  std::unique_ptr<uint16_t, FreeDeleter> a(
      static_cast<uint16_t*>(std::aligned_alloc(64, (three ? 2 : 1) * plane * sizeof(uint16_t))));
  if (!a) return ffi::Error::Internal("amx matmul: out of memory for the bf16 copy of x");
  uint16_t* a_hi = a.get();
  uint16_t* a_lo = three ? a_hi + plane : nullptr;
  if (K != Kp || Mp != T) std::memset(a_hi, 0, (three ? 2 : 1) * plane * sizeof(uint16_t));
  split_rows(x.typed_data(), K, Kp, a_hi, a_lo, 0, T);
  const Operands o{a_hi, a_lo, reinterpret_cast<const uint16_t*>(w_hi.typed_data()),
                   three ? reinterpret_cast<const uint16_t*>(w_lo.typed_data()) : nullptr, y->typed_data(), T, N, Mp,
                   Kp};
  // Work sharing over column blocks, as in skinny_matmul.cc: the caller takes blocks too and waits for all.
  // Groups of up to 8 column blocks (256 columns: 8 x 32 x Kp x 2 bytes of B per pass, in L2), at least 4
  // groups per thread where the width allows, for balance.
  const int64_t blocks = (N + kBlock - 1) / kBlock, threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t group = std::clamp<int64_t>(blocks / (4 * threads), 1, 8);
  const int64_t groups = (blocks + group - 1) / group;
  auto shared = std::make_shared<Shared>();
  auto work = [shared, &o, blocks, group, groups] {
    for (int64_t g; (g = shared->next.fetch_add(1)) < groups;) {
      run_blocks(o, g * group, std::min(blocks, (g + 1) * group));
      shared->done.fetch_add(1, std::memory_order_release);
    }
  };
  const int64_t helpers = std::min(threads, groups) - 1;
  // Helpers hold `shared` alive; they read `o` only after taking a group, which the caller waits for.
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([shared, work] { work(); });
  work();
  while (shared->done.load(std::memory_order_acquire) < groups) _mm_pause();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JseAmxMatmul, AmxMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [T, K]
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // w_hi [Np/16, Kp/32, 16, 32]
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // w_lo: the same shape (3 passes) or [0] (1 pass)
                                  .Ret<ffi::Buffer<ffi::F32>>()   // y [T, N]
);

extern "C" int jse_amx_available() { return kAmx ? 1 : 0; }
