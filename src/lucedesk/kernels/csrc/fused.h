// A dense decoder layer's two halves around attention, each one call from Python: the same
// kernels the separate calls run (add_rms_norm, lowbit_linear, rotary_, ATen's silu or gelu
// and mul, or one pass with their bits), in the same order on the same values, so the
// results are bit for bit those of the separate calls. What a fused call saves is the
// Python and dispatch between ~10 small calls a layer, which at one decode row cost as much
// as the matmuls' memory traffic.
#pragma once

#include <ATen/Version.h>  // get_cpu_capability: which kernels ATen dispatches

#include "layers.h"
#include "lowbit.h"

namespace {

void check_activations(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                       const at::Tensor& norm) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16,
              "fused layer: x must be contiguous bfloat16 [T, H]");
  TORCH_CHECK(norm.dim() == 1 && norm.size(0) == x.size(1) && norm.is_contiguous() &&
                  norm.scalar_type() == at::kBFloat16,
              "fused layer: the norm weight must be contiguous bfloat16 [H]");
  if (residual.has_value())
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->is_contiguous() &&
                    residual->scalar_type() == at::kBFloat16,
                "fused layer: the residual must be contiguous bfloat16 like x");
}

// K and V rows of this step [T, kvh, hd] (views into qkv) -> cache rows slot[t] of
// caches [kvh, num_blocks, bs, hd], as write_kv_torch places them.
void write_kv_rows(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache,
                   at::Tensor& v_cache, const at::Tensor& slots) {
  const int64_t T = k.size(0), kvh = k.size(1), hd = k.size(2);
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() &&
                  k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.scalar_type() == k.scalar_type() &&
                  v_cache.scalar_type() == k.scalar_type() && k_cache.size(0) == kvh &&
                  k_cache.size(3) == hd,
              "fused layer: caches must be contiguous [kv_heads, blocks, block_size, head_dim] "
              "in the activations' dtype");
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == T && slots.scalar_type() == at::kLong &&
                  slots.is_contiguous(),
              "fused layer: slot_mapping must be contiguous int64 [T]");
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1, "fused layer: k and v rows must be dense");
  const int64_t rows = k_cache.size(1) * k_cache.size(2);
  const int64_t* sp = slots.data_ptr<int64_t>();
  auto* kc = k_cache.data_ptr<c10::BFloat16>();
  auto* vc = v_cache.data_ptr<c10::BFloat16>();
  const auto* kp = k.data_ptr<c10::BFloat16>();
  const auto* vp = v.data_ptr<c10::BFloat16>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(sp[t] >= 0 && sp[t] < rows, "fused layer: slot ", sp[t], " out of range");
    for (int64_t h = 0; h < kvh; ++h) {
      const int64_t src = t * k.stride(0) + h * k.stride(1), dst = (h * rows + sp[t]) * hd;
      std::memcpy(kc + dst, kp + src, hd * sizeof(c10::BFloat16));
      std::memcpy(vc + dst, vp + t * v.stride(0) + h * v.stride(1), hd * sizeof(c10::BFloat16));
    }
  }
}

// Each head's row of q or k [T, heads, hd] normed over head_dim by the add_rms_norm
// kernel, as the Python path's q and k norms (a copy first where the rows are not dense:
// views into the fused qkv with T > 1).
at::Tensor rms_norm_heads(const at::Tensor& x, const at::Tensor& weight, double eps) {
  at::Tensor rows = x.contiguous().view({-1, x.size(2)});
  return std::get<0>(add_rms_norm(rows, {}, weight, eps)).view(x.sizes());
}

// A low-bit weight as lowbit_linear takes it.
struct LowBitArgs {
  at::Tensor q, d, m;
  int64_t bits;
  std::optional<at::Tensor> lut;
  at::Tensor times(const at::Tensor& x, bool vector) const {  // x @ weight.T
    return lowbit_linear(x, q, d, m, bits, vector, lut);
  }
  at::Tensor times(const RowsQ8& x, int64_t rows, int64_t inputs, bool vector) const {
    const int64_t K = check_lowbit_weight(q, d, m, bits, vector, lut).second;
    TORCH_CHECK(inputs == K, "lowbit linear: x has ", inputs, " inputs, the weights ", K);
    return lowbit_rows(x, rows, q, d, m, bits, vector, lut);
  }
};

// h [T, H] (normed) -> (q [T, nh, hd], k and v [T, kvh, hd]): the qkv matmul (+ bias),
// q/k norms where given, rotary on q and k; with caches, k and v are also written to their
// slots. q, k and v may be views into one [T, (nh + 2 kvh) hd] tensor.
std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_qkv(
    const at::Tensor& h, const LowBitArgs& weight, bool vector,
    const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& q_norm,
    const std::optional<at::Tensor>& k_norm, double eps, int64_t num_heads,
    int64_t num_kv_heads, const at::Tensor& cos, const at::Tensor& sin,
    std::optional<at::Tensor> k_cache, std::optional<at::Tensor> v_cache,
    const std::optional<at::Tensor>& slot_mapping) {
  at::Tensor qkv = weight.times(h, vector);
  if (bias.has_value()) qkv = at::add(qkv, *bias);  // as y + bias
  const int64_t T = h.size(0), hd = qkv.size(1) / (num_heads + 2 * num_kv_heads);
  TORCH_CHECK(hd * (num_heads + 2 * num_kv_heads) == qkv.size(1) && hd % 2 == 0,
              "fused layer: the qkv weight's outputs are not (heads + 2 kv heads) x head_dim");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.dim() == 2 && cos.size(0) == T &&
                  cos.size(1) == hd && cos.is_contiguous() && sin.is_contiguous() &&
                  cos.scalar_type() == at::kBFloat16 && sin.scalar_type() == at::kBFloat16,
              "fused layer: cos/sin must be contiguous bfloat16 [T, head_dim]");
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "fused layer: q and k norms come together");
  at::Tensor qh = qkv.narrow(1, 0, num_heads * hd).view({T, num_heads, hd});
  at::Tensor kh = qkv.narrow(1, num_heads * hd, num_kv_heads * hd).view({T, num_kv_heads, hd});
  at::Tensor vh =
      qkv.narrow(1, (num_heads + num_kv_heads) * hd, num_kv_heads * hd).view({T, num_kv_heads, hd});
  if (q_norm.has_value()) {
    qh = rms_norm_heads(qh, *q_norm, eps);
    kh = rms_norm_heads(kh, *k_norm, eps);
  }
  rotary_(qh, kh, cos, sin);
  TORCH_CHECK(k_cache.has_value() == v_cache.has_value() &&
                  k_cache.has_value() == slot_mapping.has_value(),
              "fused layer: k_cache, v_cache and slot_mapping come together");
  if (k_cache.has_value()) write_kv_rows(kh, vh, *k_cache, *v_cache, *slot_mapping);
  return {qh, kh, vh};
}

// x [T, H] (+ residual) -> (q [T, nh, hd], k and v [T, kvh, hd], x + residual):
// add_rms_norm, then attention_qkv.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_input(
    const at::Tensor& x, const std::optional<at::Tensor>& residual, const at::Tensor& norm,
    double eps, const at::Tensor& q, const at::Tensor& d, const at::Tensor& m, int64_t bits,
    bool vector, const std::optional<at::Tensor>& lut, const std::optional<at::Tensor>& bias,
    const std::optional<at::Tensor>& q_norm, const std::optional<at::Tensor>& k_norm,
    int64_t num_heads, int64_t num_kv_heads, const at::Tensor& cos, const at::Tensor& sin,
    std::optional<at::Tensor> k_cache, std::optional<at::Tensor> v_cache,
    const std::optional<at::Tensor>& slot_mapping) {
  check_activations(x, residual, norm);
  auto [h, residual_out] = add_rms_norm(x, residual, norm, eps);
  auto [qh, kh, vh] = attention_qkv(h, LowBitArgs{q, d, m, bits, lut}, vector, bias, q_norm,
                                    k_norm, eps, num_heads, num_kv_heads, cos, sin, k_cache,
                                    v_cache, slot_mapping);
  return {qh, kh, vh, residual_out};
}

// The activations a gated MLP takes: F.silu(gate) * up, F.gelu(gate, approximate="tanh") * up,
// and (experts only, moe.h) gpt-oss's clamped SwiGLU.
enum class Gate : int64_t { kSilu = 0, kGeluTanh = 1, kSwigluClamped = 2 };

#if defined(LUCEDESK_VNNI)
// Whether act(gate) * up of gate|up rows (I outputs a half) is made and quantized for the
// down matmul in one pass (quantize_gated) with the bits of ATen's ops: SiLU or the clamped
// SwiGLU on the vector kernels, I a multiple of 64, ATen's ops their AVX-512 vector loops
// and libtorch exporting the exp those loops call.
inline bool gated_in_one_pass(bool vector, Gate gate, int64_t I) {
  static const bool available = at::get_cpu_capability() == "AVX512" && sleef_exp_available();
  return vector && gate != Gate::kGeluTanh && I % 64 == 0 && available;
}
#endif

// h [T, H] (normed) -> down(act(gate) * up) [T, H], gate|up one matmul of 2I outputs (gate
// first), with the values of the ATen ops the model's Python runs. With the vector kernels
// silu(gate) * up is made and quantized for `down` in one pass over the rows
// (quantize_silu_times_up: the bits of ATen's vector silu and mul). Each weight has its own
// bit width and level table.
at::Tensor mlp_output(const at::Tensor& h, const LowBitArgs& gate_up_weight,
                      const LowBitArgs& down_weight, bool vector, Gate gate) {
  at::Tensor gate_up = gate_up_weight.times(h, vector);
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "fused layer: gate|up has an odd number of outputs");
  const int64_t I = gate_up.size(1) / 2;
#if defined(LUCEDESK_VNNI)
  if (gate == Gate::kSilu && gated_in_one_pass(vector, gate, I))
    return down_weight.times(
        quantize_silu_times_up(gate_up.data_ptr<c10::BFloat16>(), h.size(0), I), h.size(0), I,
        vector);
#endif
  auto halves = gate_up.chunk(2, -1);
  at::Tensor act = gate == Gate::kSilu ? at::silu(halves[0]) : at::gelu(halves[0], "tanh");
  return down_weight.times(at::mul(act, halves[1]), vector);
}

// x [T, H] + residual -> (down(silu(gate) * up) [T, H], x + residual): add_rms_norm, then
// mlp_output.
std::tuple<at::Tensor, at::Tensor> gated_mlp(
    const at::Tensor& x, const at::Tensor& residual, const at::Tensor& norm, double eps,
    const at::Tensor& gu_q, const at::Tensor& gu_d, const at::Tensor& gu_m, int64_t gu_bits,
    const std::optional<at::Tensor>& gu_lut, const at::Tensor& down_q, const at::Tensor& down_d,
    const at::Tensor& down_m, int64_t down_bits, const std::optional<at::Tensor>& down_lut,
    bool vector) {
  check_activations(x, residual, norm);
  auto [h, residual_out] = add_rms_norm(x, residual, norm, eps);
  return {mlp_output(h, LowBitArgs{gu_q, gu_d, gu_m, gu_bits, gu_lut},
                     LowBitArgs{down_q, down_d, down_m, down_bits, down_lut}, vector, Gate::kSilu),
          residual_out};
}

}  // namespace
