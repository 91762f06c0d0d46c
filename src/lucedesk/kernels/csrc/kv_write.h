// The KV write into an 8-bit cache (kv_storage.py's layout): each new token's row of each
// KV head quantized on its own, as kv_storage.quantize_rows does it in torch, to the bit for
// finite rows: scale = absmax / 127 (0 for an all-zero row), level = floor(x / scale + 0.5)
// in -127..127. (A row holding NaN or infinity is garbage either way; its levels may differ.)
#pragma once

#include "common.h"

namespace {

template <typename T>
void quantize_row(const T* x, int64_t hd, int8_t* levels, float* scale) {
  float amax = 0.f;
  for (int64_t e = 0; e < hd; ++e) amax = std::max(amax, std::fabs(load_f(x[e])));
  const float s = amax / 127.0f;
  const float safe = s > 0.f ? s : 1.f;
  for (int64_t e = 0; e < hd; ++e) {
    const float level = std::floor(load_f(x[e]) / safe + 0.5f);
    levels[e] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, level)));
  }
  *scale = s;
}

// k, v [T, kvh, hd] (rows dense) -> levels in k_cache / v_cache [kvh, blocks, bs, hd] int8 at
// slot_mapping[t], scales in k_scale / v_scale [kvh, blocks, bs] float32.
void write_kv_int8(const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache,
                   at::Tensor v_cache, at::Tensor k_scale, at::Tensor v_scale,
                   const at::Tensor& slots) {
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes() && k.scalar_type() == v.scalar_type() &&
                  k.stride(2) == 1 && v.stride(2) == 1,
              "int8 kv write: k and v must be [tokens, kv_heads, head_dim], rows dense");
  const int64_t T = k.size(0), kvh = k.size(1), hd = k.size(2);
  TORCH_CHECK(k_cache.scalar_type() == at::kChar && v_cache.scalar_type() == at::kChar &&
                  k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 4 &&
                  k_cache.sizes() == v_cache.sizes() && k_cache.size(0) == kvh &&
                  k_cache.size(3) == hd,
              "int8 kv write: caches must be contiguous int8 [kv_heads, blocks, bs, head_dim]");
  for (const at::Tensor& s : {k_scale, v_scale})
    TORCH_CHECK(s.scalar_type() == at::kFloat && s.is_contiguous() && s.dim() == 3 &&
                    s.size(0) == kvh && s.size(1) == k_cache.size(1) &&
                    s.size(2) == k_cache.size(2),
                "int8 kv write: scales must be contiguous float32 [kv_heads, blocks, bs]");
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == T && slots.scalar_type() == at::kLong &&
                  slots.is_contiguous(),
              "int8 kv write: slot_mapping must be contiguous int64 [tokens]");
  const int64_t rows = k_cache.size(1) * k_cache.size(2);
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(sp[t] >= 0 && sp[t] < rows, "int8 kv write: slot ", sp[t], " out of range");
  int8_t* kc = k_cache.data_ptr<int8_t>();
  int8_t* vc = v_cache.data_ptr<int8_t>();
  float* ks = k_scale.data_ptr<float>();
  float* vs = v_scale.data_ptr<float>();
  dispatch(k.scalar_type(), [&](auto zero) {
    using T_ = decltype(zero);
    const T_* kp = k.data_ptr<T_>();
    const T_* vp = v.data_ptr<T_>();
    at::parallel_for(0, T * kvh, 64, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t t = i / kvh, h = i % kvh, dst = h * rows + sp[t];
        quantize_row(kp + t * k.stride(0) + h * k.stride(1), hd, kc + dst * hd, ks + dst);
        quantize_row(vp + t * v.stride(0) + h * v.stride(1), hd, vc + dst * hd, vs + dst);
      }
    });
  });
}

}  // namespace
