// Scoring's per-row reduction for XLA:CPU: for logits [T, V] and targets [T], logprob[t] = l[t, target] -
// logsumexp(l[t, :]), argmax[t] (the lowest index among equal maxima, as jnp.argmax) and top[t], the argmax's
// log-probability (max - logsumexp: what OpenAI's top_logprobs report beside a prompt token).
//
// One read of a row finds its maximum and argmax, a second (from L2: a 49,152-token row is 192 KiB) sums
// exp(l - max) (vector_math.h). XLA:CPU ran the same reduction single-threaded, at
// 113 ms for T = 512; threads here split the rows.

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>

#include "vector_math.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

__attribute__((target("avx512f"))) void reduce_row(const float* l, int64_t V, int32_t target, float* logprob,
                                                   int32_t* argmax, float* top) {
  float m;
  jse::row_max(l, V, &m, argmax);
  const float log_sum = std::log(jse::row_sum_exp(l, V, m));
  *logprob = (l[target] - m) - log_sum;  // exactly *top when the target is the argmax
  *top = -log_sum;
}

struct Shared {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

ffi::Error LogSoftmaxGatherImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> logits, ffi::Buffer<ffi::S32> targets,
                                ffi::ResultBuffer<ffi::F32> logprob, ffi::ResultBuffer<ffi::S32> argmax,
                                ffi::ResultBuffer<ffi::F32> top) {
  if (!__builtin_cpu_supports("avx512f"))
    return ffi::Error::InvalidArgument("log_softmax_gather: this CPU has no AVX-512F");
  auto ld = logits.dimensions();
  if (ld.size() != 2 || targets.element_count() != ld[0] || logprob->element_count() != ld[0] ||
      argmax->element_count() != ld[0] || top->element_count() != ld[0])
    return ffi::Error::InvalidArgument("log_softmax_gather: want logits [T, V], targets, logprob, argmax, top [T]");
  const int64_t T = ld[0], V = ld[1];
  const float* l = logits.typed_data();
  const int32_t* tg = targets.typed_data();
  for (int64_t t = 0; t < T; ++t)
    if (tg[t] < 0 || tg[t] >= V) return ffi::Error::InvalidArgument("log_softmax_gather: target id out of range");
  float* lp = logprob->typed_data();
  int32_t* am = argmax->typed_data();
  float* tp = top->typed_data();
  constexpr int64_t kRows = 8;  // rows per work item
  const int64_t items = (T + kRows - 1) / kRows;
  auto shared = std::make_shared<Shared>();
  auto work = [shared, l, tg, lp, am, tp, T, V, items] {
    for (int64_t i; (i = shared->next.fetch_add(1)) < items;) {
      for (int64_t t = i * kRows; t < std::min(T, (i + 1) * kRows); ++t)
        reduce_row(l + t * V, V, tg[t], lp + t, am + t, tp + t);
      shared->done.fetch_add(1, std::memory_order_release);
    }
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), items) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([work] { work(); });
  work();
  while (shared->done.load(std::memory_order_acquire) < items) _mm_pause();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JseLogSoftmaxGather, LogSoftmaxGatherImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // logits [T, V]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // targets [T]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // logprob [T]
                                  .Ret<ffi::Buffer<ffi::S32>>()  // argmax [T]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // top [T]: the argmax's log-probability
);
