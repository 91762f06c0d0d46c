// The greedy choice of each row of logits, as torch.argmax(dim=-1) makes it (see ops.cpp).
#pragma once

#include "common.h"

namespace {

// Vocabulary entries a thread takes at least: a row of 49k floats is ~10 us over two
// passes, a fork and join ~1 us, so one-row steps stay on the calling thread.
constexpr int64_t kGreedyGrain = 1 << 16;

// The index of the first NaN in row[0..n), or -1.
inline int64_t first_nan(const float* row, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    if (row[i] != row[i]) return i;
  return -1;
}

// torch.argmax's choice over row[0..n), n >= 1: the first index of the maximum, where a NaN
// is greater than any number (the first NaN wins) and -0 equals +0. Two passes: the
// maximum and whether a NaN is there, then the first index holding it.
inline int64_t first_maximum(const float* row, int64_t n) {
#if defined(__AVX512F__)
  const __m512 lowest = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const auto load = [&](int64_t i) {
    const int64_t left = n - i;
    if (left >= 16) return _mm512_loadu_ps(row + i);
    return _mm512_mask_loadu_ps(lowest, static_cast<__mmask16>((1u << left) - 1), row + i);
  };
  __m512 best = lowest;
  __mmask16 nan = 0;
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 v = load(i);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    best = _mm512_max_ps(best, v);
  }
  if (nan) return first_nan(row, n);
  const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(best));
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 hit = _mm512_cmp_ps_mask(load(i), top, _CMP_EQ_OQ);
    if (hit) return i + __builtin_ctz(hit);
  }
  return 0;  // not reached: the maximum is some entry's
#else
  int64_t at = 0;
  for (int64_t i = 1; i < n && row[at] == row[at]; ++i)
    if (row[i] > row[at] || row[i] != row[i]) at = i;
  return at;
#endif
}

// logits: [R, V] float32, each row contiguous -> [R] int64, each row's first_maximum.
at::Tensor greedy_tokens(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.size(1) >= 1 &&
                  (logits.stride(1) == 1 || logits.size(1) == 1),
              "greedy tokens: logits must be float32 [rows, vocab >= 1] with contiguous rows");
  const int64_t rows = logits.size(0), vocab = logits.size(1), stride = logits.stride(0);
  at::Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
  const float* data = logits.data_ptr<float>();
  int64_t* tokens = out.data_ptr<int64_t>();
  const int64_t grain = std::max<int64_t>(1, kGreedyGrain / vocab);
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) tokens[r] = first_maximum(data + r * stride, vocab);
  });
  return out;
}

}  // namespace
