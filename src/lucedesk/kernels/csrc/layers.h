// Residual add + RMSNorm and in-place rotary, rounding where the torch reference rounds.
#pragma once

#include "common.h"

namespace {

template <typename T, typename W>
void add_rms_norm_impl(T* normed, T* residual_out, const T* x, const T* residual,
                       const W* weight, int64_t rows, int64_t H, double eps) {
  // Rows of H contiguous values. With a residual, residual_out = x + residual (in T) and
  // the norm reads that sum; without one, the norm reads x and residual_out is unused.
  // The weight W is T or float32 (Gemma 3's and gpt-oss's norms on bfloat16 activations).
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> h(H), r(H);
    for (int64_t t = begin; t < end; ++t) {
      widen(h.data(), x + t * H, H);
      if (residual) {
        widen(r.data(), residual + t * H, H);
#pragma omp simd
        for (int64_t e = 0; e < H; ++e) h[e] = round_to<T>(h[e] + r[e]);  // the stream, in T
#pragma omp simd
        for (int64_t e = 0; e < H; ++e) residual_out[t * H + e] = narrow<T>(h[e]);
      }
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t e = 0; e < H; ++e) ss += h[e] * h[e];
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(H) + feps);
      widen(r.data(), weight, H);
      // A float32 weight: T((x * inv) * w), one rounding; one in T: w * T(x * inv), as the
      // reference rounds (round_to<float> rounds nothing).
#pragma omp simd
      for (int64_t e = 0; e < H; ++e)
        normed[t * H + e] = narrow<T>(round_to<W>(h[e] * inv) * r[e]);
    }
  });
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x,
                                                 const std::optional<at::Tensor>& residual,
                                                 const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && weight.dim() == 1 &&
                  weight.size(0) == x.size(1) && weight.is_contiguous() &&
                  (weight.scalar_type() == x.scalar_type() || weight.scalar_type() == at::kFloat),
              "add_rms_norm: x must be contiguous [T, H], the weight [H] in x's dtype or float32");
  TORCH_CHECK(!residual.has_value() ||
                  (residual->sizes() == x.sizes() && residual->is_contiguous() &&
                   residual->scalar_type() == x.scalar_type()),
              "add_rms_norm: the residual must be contiguous and as x");
  at::Tensor normed = at::empty_like(x);
  at::Tensor residual_out = residual.has_value() ? at::empty_like(x) : x;
  dispatch(x.scalar_type(), [&](auto zero) {
    using scalar_t = decltype(zero);
    scalar_t* res_out = residual.has_value() ? residual_out.data_ptr<scalar_t>() : nullptr;
    const scalar_t* res = residual.has_value() ? residual->data_ptr<scalar_t>() : nullptr;
    if (weight.scalar_type() == at::kFloat)
      add_rms_norm_impl(normed.data_ptr<scalar_t>(), res_out, x.data_ptr<scalar_t>(), res,
                        weight.data_ptr<float>(), x.size(0), x.size(1), eps);
    else
      add_rms_norm_impl(normed.data_ptr<scalar_t>(), res_out, x.data_ptr<scalar_t>(), res,
                        weight.data_ptr<scalar_t>(), x.size(0), x.size(1), eps);
  });
  return {normed, residual_out};
}

template <typename T>
void rotary_impl(at::Tensor& t, const at::Tensor& cos, const at::Tensor& sin) {
  // t: [T, heads, hd] with head_dim contiguous (a view into the fused qkv is fine), rotated
  // in place as x * cos + rotate_half(x) * sin, each product and the sum rounded to T.
  // cos, sin: [T, hd] contiguous, each row's entry of the table.
  const int64_t rows = t.size(0), heads = t.size(1), hd = t.size(2), half = hd / 2;
  const int64_t s_row = t.stride(0), s_head = t.stride(1);
  T* tp = t.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> x(hd), c(hd), s(hd);
    for (int64_t r = begin; r < end; ++r) {
      widen(c.data(), cp + r * hd, hd);
      widen(s.data(), sp + r * hd, hd);
      for (int64_t h = 0; h < heads; ++h) {
        T* row = tp + r * s_row + h * s_head;
        widen(x.data(), row, hd);
        // First half: x * cos - x[half:] * sin; second half: x * cos + x[:half] * sin.
#pragma omp simd
        for (int64_t e = 0; e < half; ++e)
          row[e] = narrow<T>(round_to<T>(x[e] * c[e]) + round_to<T>(-x[e + half] * s[e]));
#pragma omp simd
        for (int64_t e = half; e < hd; ++e)
          row[e] = narrow<T>(round_to<T>(x[e] * c[e]) + round_to<T>(x[e - half] * s[e]));
      }
    }
  });
}

void rotary_(at::Tensor q, at::Tensor k, const at::Tensor& cos, const at::Tensor& sin) {
  dispatch(q.scalar_type(), [&](auto zero) {
    using scalar_t = decltype(zero);
    rotary_impl<scalar_t>(q, cos, sin);
    rotary_impl<scalar_t>(k, cos, sin);
  });
}

}  // namespace
