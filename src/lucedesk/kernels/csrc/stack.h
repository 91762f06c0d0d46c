// A model's decoder layers as one call a step (`LayerStack`, a torch class): each layer's
// norm and attention input (fused.h), the K/V write, paged attention (decode rows by
// attention.h, prompt chunks by prefill.h), the o projection, the gated MLP or the mixture
// of experts (moe.h), and where the family has them (Gemma 3) float32 norms and norms after
// attention and the MLP: the same functions in the same order on the same values as the
// per-layer calls from Python, so every result has their bits. What it saves is the Python
// between a step's ~150 calls (~400 with experts), which at one decode row costs about a
// fifth of a dense step and more than half of a mixture's.
#pragma once

#include <torch/custom_class.h>

#include <string>

#include "attention.h"
#include "fused.h"
#include "kv_write.h"
#include "moe.h"
#include "prefill.h"

namespace {

struct StackLayer {
  at::Tensor attn_norm, ffn_norm;
  LowBitArgs qkv, o;
  std::optional<LowBitArgs> gate_up, down;  // a dense MLP's, or
  std::optional<MoEArgs> moe;               // the experts', added by add_experts
  // out norms: on the o projection's output and on the MLP's, before each joins the stream
  std::optional<at::Tensor> qkv_bias, o_bias, q_norm, k_norm, sinks, attn_out_norm,
      ffn_out_norm;
  int64_t window;
  bool local;  // rotary from the local (sliding-window) table
};

struct LayerStack : torch::CustomClassHolder {
  double eps;
  int64_t num_heads, num_kv_heads;
  bool vector;
  Gate gate;
  std::vector<StackLayer> layers;

  LayerStack(double eps, int64_t num_heads, int64_t num_kv_heads, bool vector,
             const std::string& activation)
      : eps(eps), num_heads(num_heads), num_kv_heads(num_kv_heads), vector(vector) {
    TORCH_CHECK(num_kv_heads >= 1 && num_heads >= num_kv_heads && num_heads % num_kv_heads == 0,
                "layer stack: query heads must be a multiple of KV heads");
    gate = gate_named(activation);
  }

  void add_layer(at::Tensor attn_norm, at::Tensor ffn_norm, std::vector<at::Tensor> qkv,
                 std::vector<at::Tensor> o, std::vector<at::Tensor> gate_up,
                 std::vector<at::Tensor> down, std::vector<int64_t> bits,
                 c10::List<std::optional<at::Tensor>> luts,
                 c10::List<std::optional<at::Tensor>> extras, int64_t window, bool local) {
    // A layer of experts has no gate|up and down here: add_experts gives them next.
    const bool dense = !gate_up.empty();
    TORCH_CHECK(qkv.size() == 3 && o.size() == 3 && gate_up.size() == (dense ? 3u : 0u) &&
                    down.size() == gate_up.size() && bits.size() == (dense ? 4u : 2u) &&
                    luts.size() == bits.size() && extras.size() == 7,
                "layer stack: a layer is four weights (q, d, m each; two without a dense MLP), "
                "their bits and tables, and seven extras (qkv bias, o bias, q norm, k norm, "
                "sinks, attention and MLP out norms)");
    TORCH_CHECK(!dense || gate != Gate::kSwigluClamped,
                "layer stack: a dense MLP's activation is silu or gelu_tanh");
    TORCH_CHECK(layers.empty() || layers.back().gate_up.has_value() || layers.back().moe,
                "layer stack: the layer before has neither a dense MLP nor experts");
    TORCH_CHECK(window >= 0, "layer stack: window must be >= 0");
    TORCH_CHECK(extras.get(5).has_value() == extras.get(6).has_value(),
                "layer stack: the out norms come together");
    for (const auto& norm : {std::optional<at::Tensor>(attn_norm),
                             std::optional<at::Tensor>(ffn_norm), extras.get(5), extras.get(6)})
      TORCH_CHECK(!norm.has_value() ||
                      (norm->dim() == 1 && norm->size(0) == attn_norm.size(0) &&
                       norm->is_contiguous() &&
                       (norm->scalar_type() == at::kBFloat16 || norm->scalar_type() == at::kFloat)),
                  "layer stack: a norm weight is contiguous bfloat16 or float32 [H]");
    const auto weight = [&](const std::vector<at::Tensor>& w, int i) {
      return LowBitArgs{w[0], w[1], w[2], bits[i], luts.get(i)};
    };
    std::optional<LowBitArgs> mlp_in, mlp_out;
    if (dense) mlp_in = weight(gate_up, 2), mlp_out = weight(down, 3);
    layers.push_back(StackLayer{attn_norm, ffn_norm, weight(qkv, 0), weight(o, 1), mlp_in,
                                mlp_out, std::nullopt, extras.get(0),
                                extras.get(1), extras.get(2), extras.get(3), extras.get(4),
                                extras.get(5), extras.get(6), window, local});
  }

  // The last layer's mixture of experts (it was added without a dense MLP): the router
  // [E, H] float32, gate|up and down (q, d, m each), their bits and level tables, biases
  // (router, gate|up, down), how many experts a row takes and how their weights are made.
  void add_experts(at::Tensor router, std::vector<at::Tensor> gate_up,
                   std::vector<at::Tensor> down, std::vector<int64_t> bits,
                   c10::List<std::optional<at::Tensor>> luts,
                   c10::List<std::optional<at::Tensor>> biases, int64_t top_k,
                   bool softmax_first, double swiglu_limit, double swiglu_alpha) {
    TORCH_CHECK(!layers.empty() && !layers.back().gate_up && !layers.back().moe,
                "layer stack: experts follow a layer added without a dense MLP");
    TORCH_CHECK(router.dim() == 2 && router.size(1) == layers.back().attn_norm.size(0),
                "layer stack: the router must be [experts, H]");
    layers.back().moe = moe_args(router, gate_up, down, bits, luts, biases, top_k, softmax_first,
                                 gate, swiglu_limit, swiglu_alpha);
  }

  // x [T, H] (the embeddings) -> the last layer's x + residual [T, H]. cos/sin [T, hd] for
  // global layers, local_cos/local_sin for local ones; one cache (k, v, and for an 8-bit
  // cache its scales) per layer; the step's attention metadata, its first num_decodes
  // sequences decodes, the rest prompt chunks.
  at::Tensor forward(at::Tensor x, at::Tensor cos, at::Tensor sin, at::Tensor local_cos,
                     at::Tensor local_sin, std::vector<at::Tensor> k_caches,
                     std::vector<at::Tensor> v_caches,
                     c10::List<std::optional<at::Tensor>> k_scales,
                     c10::List<std::optional<at::Tensor>> v_scales, at::Tensor slot_mapping,
                     at::Tensor block_tables, at::Tensor seq_lens, at::Tensor query_start,
                     int64_t num_decodes, double scale) const {
    const int64_t L = static_cast<int64_t>(layers.size());
    TORCH_CHECK(static_cast<int64_t>(k_caches.size()) == L &&
                    static_cast<int64_t>(v_caches.size()) == L &&
                    static_cast<int64_t>(k_scales.size()) == L &&
                    static_cast<int64_t>(v_scales.size()) == L,
                "layer stack: one cache per layer");
    const int64_t S = query_start.size(0) - 1;
    TORCH_CHECK(query_start.scalar_type() == at::kInt && query_start.dim() == 1 && S >= 0 &&
                    num_decodes >= 0 && num_decodes <= S,
                "layer stack: query_start must be int32 [S + 1], num_decodes <= S");
    TORCH_CHECK(query_start.is_contiguous() && seq_lens.scalar_type() == at::kInt &&
                    seq_lens.dim() == 1 && seq_lens.size(0) >= S &&
                    block_tables.dim() == 2 && block_tables.size(0) >= S,
                "layer stack: seq_lens and block_tables must hold a row per sequence");
    const int32_t* starts = query_start.data_ptr<int32_t>();
    const int64_t T = x.size(0), decode_rows = starts[num_decodes];
    TORCH_CHECK(x.dim() == 2 && starts[0] == 0 && starts[S] == T,
                "layer stack: the step's sequences hold ", starts[S], " rows, x ", T);
    TORCH_CHECK(x.is_contiguous() && x.scalar_type() == at::kBFloat16 &&
                    (L == 0 || x.size(1) == layers[0].attn_norm.size(0)),
                "layer stack: x must be contiguous bfloat16 [T, H]");
    TORCH_CHECK(L == 0 || layers.back().gate_up || layers.back().moe,
                "layer stack: the last layer has neither a dense MLP nor experts");
    std::optional<at::Tensor> residual;
    for (int64_t i = 0; i < L; ++i) {
      const StackLayer& layer = layers[i];
      const bool quantized = k_caches[i].scalar_type() == at::kChar;
      const std::optional<at::Tensor> k_scale = k_scales.get(i), v_scale = v_scales.get(i);
      TORCH_CHECK(quantized == (k_scale.has_value() && v_scale.has_value()),
                  "layer stack: layer ", i, ": an int8 cache takes k and v scales, others none");
      std::optional<at::Tensor> k_cache, v_cache, slots;
      if (!quantized) k_cache = k_caches[i], v_cache = v_caches[i], slots = slot_mapping;
      auto [h, res] = add_rms_norm(x, residual, layer.attn_norm, eps);
      auto [q, k, v] = attention_qkv(
          h, layer.qkv, vector, layer.qkv_bias, layer.q_norm, layer.k_norm, eps, num_heads,
          num_kv_heads, layer.local ? local_cos : cos, layer.local ? local_sin : sin, k_cache,
          v_cache, slots);
      if (quantized)
        write_kv_int8(k, v, k_caches[i], v_caches[i], *k_scale, *v_scale, slot_mapping);
      at::Tensor o = at::empty(q.sizes(), q.options());
      if (num_decodes > 0)
        paged_decode_attention(o.narrow(0, 0, decode_rows), q.narrow(0, 0, decode_rows),
                               k_caches[i], v_caches[i], block_tables, seq_lens,
                               query_start.narrow(0, 0, num_decodes + 1), scale, layer.window,
                               layer.sinks, k_scale, v_scale);
      if (num_decodes < S) {
        const int64_t chunks = S - num_decodes;
        paged_prefill_attention(o, q, k_caches[i], v_caches[i],
                                block_tables.narrow(0, num_decodes, chunks),
                                seq_lens.narrow(0, num_decodes, chunks),
                                query_start.narrow(0, num_decodes, chunks + 1), scale,
                                layer.window, layer.sinks, k_scale, v_scale);
      }
      at::Tensor y = layer.o.times(o.reshape({T, -1}), vector);
      if (layer.o_bias.has_value()) y = at::add(y, *layer.o_bias);
      if (layer.attn_out_norm.has_value())
        y = std::get<0>(add_rms_norm(y, {}, *layer.attn_out_norm, eps));
      auto [h2, res2] = add_rms_norm(y, res, layer.ffn_norm, eps);
      x = layer.moe ? moe_output(h2, *layer.moe, vector)
                    : mlp_output(h2, *layer.gate_up, *layer.down, vector, gate);
      if (layer.ffn_out_norm.has_value())
        x = std::get<0>(add_rms_norm(x, {}, *layer.ffn_out_norm, eps));
      residual = res2;
    }
    return residual.has_value() ? at::add(x, *residual) : x;
  }
};

}  // namespace
