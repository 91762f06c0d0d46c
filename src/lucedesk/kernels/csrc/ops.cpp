// CPU kernels for lucedesk, built on first use by kernels/cpu_build.py (this file with the headers
// beside it, one translation unit) and registered as torch.ops.lucedesk_cpu.*. Each has a
// torch reference (attention_torch.py, layers_torch.py) and the same numerics: fp32
// arithmetic, rounding to the tensor dtype where the reference rounds, so bf16 results
// match it to the last bit in the rotary and the residual add.
//
// Paged decode attention reads the KV blocks in place through the block table; one task
// per (sequence, KV head) handles all query heads of that GQA group and all query rows of
// the sequence (a decode with a draft has one per position, each with its own causal end),
// so each block is read once per KV head. Every row's result depends only on that row and
// its causal end: batching, or the other rows of its sequence, cannot change it. Prompt
// chunks in bf16 take the flash kernel in prefill.h, with the same property.
//
// Greedy rows take each row's first maximum (sampling.h), torch.argmax's choice, NaN included.

#include "attention.h"
#include "fused.h"
#include "int8.h"
#include "kv_write.h"
#include "layers.h"
#include "lowbit.h"
#include "moe.h"
#include "prefill.h"
#include "sampling.h"
#include "stack.h"

TORCH_LIBRARY(lucedesk_cpu, m) {
  m.def(
      "paged_decode_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, "
      "Tensor block_tables, Tensor seq_lens, Tensor query_start, float scale, int window, "
      "Tensor? sinks, Tensor? k_scale, Tensor? v_scale) -> ()",
      &paged_decode_attention);
  m.def(
      "paged_prefill_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, "
      "Tensor block_tables, Tensor seq_lens, Tensor query_start, float scale, int window, "
      "Tensor? sinks, Tensor? k_scale, Tensor? v_scale) -> ()",
      &paged_prefill_attention);
  m.def("prefill_attention_available() -> bool", &prefill_attention_available);
  m.def(
      "write_kv_int8(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, "
      "Tensor(c!) k_scale, Tensor(d!) v_scale, Tensor slot_mapping) -> ()",
      &write_kv_int8);
  m.def("add_rms_norm(Tensor x, Tensor? residual, Tensor weight, float eps) -> (Tensor, Tensor)",
        &add_rms_norm);
  m.def("int8_linear(Tensor x, Tensor q, Tensor d, Tensor m) -> Tensor", &int8_linear);
  m.def("int8_linear_tiles(Tensor x, Tensor q, Tensor d, Tensor m) -> Tensor",
        &int8_linear_tiles);
  m.def("int8_amx_available() -> bool", &int8_amx_available);
  m.def(
      "lowbit_linear(Tensor x, Tensor q, Tensor d, Tensor m, int bits, bool vector, "
      "Tensor? lut) -> Tensor",
      &lowbit_linear);
  m.def(
      "lowbit_moe_linear(Tensor x, Tensor? rows, Tensor experts, Tensor q, Tensor d, Tensor m, "
      "int bits, bool vector, Tensor? lut) -> Tensor",
      &lowbit_moe_linear);
  m.def("lowbit_vector_available() -> bool", &lowbit_vector_available);
  m.def("greedy_tokens(Tensor logits) -> Tensor", &greedy_tokens);
  m.def("rotary_(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin) -> ()",
        &rotary_);
  m.def(
      "attention_input(Tensor x, Tensor? residual, Tensor norm, float eps, Tensor q, Tensor d, "
      "Tensor m, int bits, bool vector, Tensor? lut, Tensor? bias, Tensor? q_norm, "
      "Tensor? k_norm, int num_heads, int num_kv_heads, Tensor cos, Tensor sin, "
      "Tensor(a!)? k_cache, Tensor(b!)? v_cache, Tensor? slot_mapping) "
      "-> (Tensor, Tensor, Tensor, Tensor)",
      &attention_input);
  m.def(
      "gated_mlp(Tensor x, Tensor residual, Tensor norm, float eps, Tensor gu_q, Tensor gu_d, "
      "Tensor gu_m, int gu_bits, Tensor? gu_lut, Tensor down_q, Tensor down_d, Tensor down_m, "
      "int down_bits, Tensor? down_lut, bool vector) -> (Tensor, Tensor)",
      &gated_mlp);
  m.def(
      "moe_mlp(Tensor h, Tensor router, Tensor[] gate_up, Tensor[] down, int[] bits, "
      "Tensor?[] luts, Tensor?[] biases, int top_k, bool softmax_first, str activation, "
      "float swiglu_limit, float swiglu_alpha, bool vector) -> Tensor",
      &moe_mlp);
  m.class_<LayerStack>("LayerStack")
      .def(torch::init<double, int64_t, int64_t, bool, std::string>())
      .def("add_layer", &LayerStack::add_layer)
      .def("add_experts", &LayerStack::add_experts)
      .def("forward", &LayerStack::forward);
}
