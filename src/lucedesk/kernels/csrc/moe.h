// A mixture of experts' MLP as one call: the router (float32), the top k experts of every
// row and their weights, the selected experts' gate|up matmul (lowbit_moe_rows: each
// chosen expert's blocks read once for all the rows that chose it), the biases, the
// activation, the down matmul and each row's weighted sum in the order the router ranked
// its experts. The ATen ops and kernels are those models/moe.py's MoEBlock runs, or passes
// with their bits (the biases added and the weighted sum in loops rounding as they round;
// SiLU or the clamped SwiGLU and the product made and quantized for down in one pass where
// that has ATen's bits, as mlp_output does), in its order on its values, so the result has
// its bits; what the call saves is the Python and dispatch between ~25 small calls a
// layer, which at one decode row cost more than the experts' memory traffic.
#pragma once

#include "fused.h"  // LowBitArgs, Gate
#include "lowbit.h"

namespace {

// How the router's logits become the top k weights: softmax over every expert then the top
// k (Qwen3-MoE without norm_topk_prob), or the top k logits then their softmax (the same
// as renormalizing over the top k; gpt-oss).
struct MoEArgs {
  at::Tensor router;  // [E, H] float32
  std::optional<at::Tensor> router_bias, gate_up_bias, down_bias;  // [E], [E, 2I], [E, H]
  LowBitArgs gate_up, down;  // q [E, N/16, K/32, 64 bits], d and m as lowbit.h takes them
  int64_t top_k;
  bool softmax_first;
  Gate gate;
  double swiglu_limit, swiglu_alpha;
};

// gate|up [P, 2I] (gate first) -> [P, I], as models/moe.py's `gated`.
at::Tensor gated_pairs(const at::Tensor& gate_up, const MoEArgs& moe) {
  auto halves = gate_up.chunk(2, -1);
  at::Tensor gate = halves[0], up = halves[1];
  if (moe.gate == Gate::kSilu) return at::mul(at::silu(gate), up);
  if (moe.gate == Gate::kGeluTanh) return at::mul(at::gelu(gate, "tanh"), up);
  // swiglu_clamped: both halves clamped, up shifted by one
  gate = at::clamp(gate, std::nullopt, moe.swiglu_limit);
  up = at::clamp(up, -moe.swiglu_limit, moe.swiglu_limit);
  return at::mul(at::add(up, 1), at::mul(gate, at::sigmoid(at::mul(gate, moe.swiglu_alpha))));
}

#if defined(LUCEDESK_VNNI)
// The pairs' gate|up rows [P, 2I] (pair p's expert experts[p]) -> act(gate) * up, made and
// quantized for down in one pass with the bits of gated_pairs' ATen ops, the gate|up bias
// added first as pairs.add_ adds it (each op's result a bfloat16: computed in floats,
// rounded). The clamped SwiGLU: the limit a bfloat16 as ATen's clamp takes it, the
// sigmoid 1 / (1 + exp(-x)) with libtorch's Sleef exp as ATen's vector sigmoid computes it.
RowsQ8 quantize_gated_pairs(const at::Tensor& pairs, const int64_t* experts, const MoEArgs& moe) {
  const int64_t P = pairs.size(0), I = pairs.size(1) / 2;
  const c10::BFloat16* pp = pairs.data_ptr<c10::BFloat16>();
  const at::Tensor bias = moe.gate_up_bias.has_value() ? moe.gate_up_bias->contiguous() : at::Tensor();
  const c10::BFloat16* bp = bias.defined() ? bias.data_ptr<c10::BFloat16>() : nullptr;
  const auto half = [&](int64_t row, int64_t j) {  // gate's or up's sixteen, bias added
    const __m512 v = widen16(pp + row * 2 * I + j);
    return bp ? bf16_rounded(_mm512_add_ps(v, widen16(bp + experts[row] * 2 * I + j))) : v;
  };
  if (moe.gate == Gate::kSilu)
    return quantize_gated(P, I, [&](int64_t row, int64_t j) {
      return silu_times_up16(half(row, j), half(row, j + I));
    });
  TORCH_CHECK(moe.gate == Gate::kSwigluClamped, "moe mlp: no one pass for this activation");
  const float limit = static_cast<float>(c10::BFloat16(static_cast<float>(moe.swiglu_limit)));
  const __m512 high = _mm512_set1_ps(limit), low = _mm512_set1_ps(-limit);
  const __m512 alpha = _mm512_set1_ps(static_cast<float>(moe.swiglu_alpha));
  const __m512 one = _mm512_set1_ps(1.f);
  return quantize_gated(P, I, [&](int64_t row, int64_t j) {
    const __m512 gate = bf16_rounded(_mm512_min_ps(high, half(row, j)));
    const __m512 up = bf16_rounded(_mm512_min_ps(high, _mm512_max_ps(low, half(row, j + I))));
    const __m512 x = bf16_rounded(_mm512_mul_ps(gate, alpha));
    const __m512 sigmoid =
        bf16_rounded(_mm512_div_ps(one, _mm512_add_ps(one, exp_negated16(x))));
    const __m512 glu = bf16_rounded(_mm512_mul_ps(gate, sigmoid));
    return bf16_rounded(_mm512_mul_ps(bf16_rounded(_mm512_add_ps(up, one)), glu));
  });
}
#endif

void check_moe(const at::Tensor& h, const MoEArgs& moe) {
  TORCH_CHECK(h.dim() == 2 && h.is_contiguous() && h.scalar_type() == at::kBFloat16,
              "moe mlp: h must be contiguous bfloat16 [T, H]");
  const int64_t E = moe.router.size(0);
  TORCH_CHECK(moe.router.dim() == 2 && moe.router.scalar_type() == at::kFloat &&
                  moe.router.size(1) == h.size(1),
              "moe mlp: the router must be float32 [experts, H]");
  TORCH_CHECK(moe.top_k >= 1 && moe.top_k <= E, "moe mlp: top_k must be 1..experts");
  TORCH_CHECK(moe.gate_up.q.dim() == 4 && moe.down.q.dim() == 4 && moe.gate_up.q.size(0) == E &&
                  moe.down.q.size(0) == E,
              "moe mlp: gate|up and down hold one weight per expert");
  // Each bias as wide as its weight's outputs: the passes read them by row.
  const std::pair<const std::optional<at::Tensor>&, int64_t> biases[] = {
      {moe.gate_up_bias, moe.gate_up.q.size(1) * 16}, {moe.down_bias, moe.down.q.size(1) * 16}};
  for (const auto& [bias, outputs] : biases)
    TORCH_CHECK(!bias.has_value() || (bias->dim() == 2 && bias->size(0) == E &&
                                      bias->size(1) == outputs && bias->device().is_cpu() &&
                                      bias->scalar_type() == at::kBFloat16),
                "moe mlp: expert biases are bfloat16 [experts, outputs] on the CPU");
}

// h [T, H] (normed) -> the mixture's output [T, H].
at::Tensor moe_output(const at::Tensor& h, const MoEArgs& moe, bool vector) {
  check_moe(h, moe);
  const int64_t T = h.size(0), k = moe.top_k;
  const at::Tensor logits = at::linear(h.to(at::kFloat), moe.router, moe.router_bias);
  at::Tensor weights, ids;
  if (moe.softmax_first) {
    std::tie(weights, ids) = at::topk(at::softmax(logits, -1), k, -1);
  } else {
    at::Tensor top;
    std::tie(top, ids) = at::topk(logits, k, -1);
    weights = at::softmax(top, -1);
  }
  weights = weights.to(h.scalar_type()).contiguous();
  const at::Tensor flat = ids.reshape({-1}).contiguous();  // pair p: row p / k, expert flat[p]
  const int64_t P = flat.numel(), H = h.size(1);
  std::vector<int64_t> rows(P);
  for (int64_t p = 0; p < P; ++p) rows[p] = p / k;
  const LowBitArgs& gu = moe.gate_up;
  const auto normed = [&] { return quantize_rows(h.data_ptr<c10::BFloat16>(), T, H); };
  at::Tensor pairs = lowbit_moe_rows(normed, T, H, rows.data(), flat, gu.q, gu.d, gu.m, gu.bits,
                                     vector, gu.lut);
  const LowBitArgs& dn = moe.down;
  [[maybe_unused]] const int64_t I = pairs.size(1) / 2;  // the one pass's
  const int64_t* experts = flat.data_ptr<int64_t>();
  at::Tensor y;
#if defined(LUCEDESK_VNNI)
  if (gated_in_one_pass(vector, moe.gate, I)) {
    const auto gated = [&] { return quantize_gated_pairs(pairs, experts, moe); };
    y = lowbit_moe_rows(gated, P, I, nullptr, flat, dn.q, dn.d, dn.m, dn.bits, vector, dn.lut);
  }
#endif
  if (!y.defined()) {
    // index_select, not index: a few rows gathered without an iterator or a parallel region
    if (moe.gate_up_bias.has_value()) pairs.add_(moe.gate_up_bias->index_select(0, flat));
    y = lowbit_moe_linear(gated_pairs(pairs, moe).contiguous(), std::nullopt, flat, dn.q, dn.d,
                          dn.m, dn.bits, vector, dn.lut);
  }
  // Each row's weighted sum in rank order, whatever else is in the batch: one pass doing
  // what ATen's bfloat16 add of the down bias, mul and add do per element (each sum and
  // product in float, rounded to bfloat16), without their 2k + 1 calls.
  const at::Tensor bias = moe.down_bias.has_value() ? moe.down_bias->contiguous() : at::Tensor();
  const auto* bp = bias.defined() ? bias.data_ptr<c10::BFloat16>() : nullptr;
  at::Tensor out = at::empty({T, H}, y.options());
  const auto* yp = y.data_ptr<c10::BFloat16>();
  const auto* wp = weights.data_ptr<c10::BFloat16>();
  auto* op = out.data_ptr<c10::BFloat16>();
  at::parallel_for(0, T, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const c10::BFloat16* own = yp + t * k * H;  // the row's k pairs
      const c10::BFloat16* w = wp + t * k;
      const int64_t* chosen = experts + t * k;
      int64_t i = 0;
#ifdef LUCEDESK_VNNI
      // Sixteen outputs at a time, each sum and product rounded to bfloat16 as the scalar
      // ones below are (a prompt's rows spent a sixth of their time in the scalar loop).
      const auto pair = [&](int64_t j) {  // pair j's outputs i .. i + 15, its bias added
        const __m512 v = widen16(own + j * H + i);
        return bp ? bf16_rounded(_mm512_add_ps(v, widen16(bp + chosen[j] * H + i))) : v;
      };
      for (; i + 16 <= H; i += 16) {
        __m512 sum = bf16_rounded(_mm512_mul_ps(pair(0), _mm512_set1_ps(static_cast<float>(w[0]))));
        for (int64_t j = 1; j < k; ++j) {
          const __m512 term =
              bf16_rounded(_mm512_mul_ps(pair(j), _mm512_set1_ps(static_cast<float>(w[j]))));
          sum = bf16_rounded(_mm512_add_ps(sum, term));
        }
        const __m512i high = _mm512_srli_epi32(_mm512_castps_si512(sum), 16);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(op + t * H + i),
                            _mm512_cvtepi32_epi16(high));
      }
#endif
      const auto value = [&](int64_t j) {
        const c10::BFloat16 v = own[j * H + i];
        return bp ? v + bp[chosen[j] * H + i] : v;
      };
      for (; i < H; ++i) {
        c10::BFloat16 sum = value(0) * w[0];
        for (int64_t j = 1; j < k; ++j) sum = sum + value(j) * w[j];
        op[t * H + i] = sum;
      }
    }
  });
  return out;
}

Gate gate_named(const std::string& activation) {
  if (activation == "silu") return Gate::kSilu;
  if (activation == "gelu_tanh") return Gate::kGeluTanh;
  TORCH_CHECK(activation == "swiglu_clamped", "an MLP's activation is silu, gelu_tanh or ",
              "swiglu_clamped, not ", activation);
  return Gate::kSwigluClamped;
}

// The experts' weights as lists from Python: (q, d, m) for gate|up then down, their bits and
// level tables, the biases (router, gate|up, down).
MoEArgs moe_args(at::Tensor router, std::vector<at::Tensor> gate_up, std::vector<at::Tensor> down,
                 std::vector<int64_t> bits, c10::List<std::optional<at::Tensor>> luts,
                 c10::List<std::optional<at::Tensor>> biases, int64_t top_k, bool softmax_first,
                 Gate gate, double swiglu_limit, double swiglu_alpha) {
  TORCH_CHECK(gate_up.size() == 3 && down.size() == 3 && bits.size() == 2 && luts.size() == 2 &&
                  biases.size() == 3,
              "moe mlp: two weights (q, d, m each), their bits and tables, and three biases "
              "(router, gate|up, down)");
  return MoEArgs{router,
                 biases.get(0),
                 biases.get(1),
                 biases.get(2),
                 LowBitArgs{gate_up[0], gate_up[1], gate_up[2], bits[0], luts.get(0)},
                 LowBitArgs{down[0], down[1], down[2], bits[1], luts.get(1)},
                 top_k,
                 softmax_first,
                 gate,
                 swiglu_limit,
                 swiglu_alpha};
}

at::Tensor moe_mlp(const at::Tensor& h, at::Tensor router, std::vector<at::Tensor> gate_up,
                   std::vector<at::Tensor> down, std::vector<int64_t> bits,
                   c10::List<std::optional<at::Tensor>> luts,
                   c10::List<std::optional<at::Tensor>> biases, int64_t top_k, bool softmax_first,
                   std::string activation, double swiglu_limit, double swiglu_alpha,
                   bool vector) {
  return moe_output(h,
                    moe_args(router, gate_up, down, bits, luts, biases, top_k, softmax_first,
                             gate_named(activation), swiglu_limit, swiglu_alpha),
                    vector);
}

}  // namespace
