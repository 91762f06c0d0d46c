// Activations quantized to int8 for the low-bit matmuls: one scale per group of 32 inputs
// (as llama.cpp's CPU path does), sixteen groups at a time in AVX-512 registers where the CPU
// has VNNI, in a plain loop elsewhere, the same bits either way; and a gated MLP's
// act(gate) * up made and quantized in one pass.
#pragma once

#include "common.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define LUCEDESK_VNNI 1  // the intrinsics come with common.h's AVX-512 helpers
#endif

namespace {

// M rows of K activations as int8 groups of 32.
struct RowsQ8 {
  RowsQ8(int64_t M, int64_t K) : q(M * K), d(M * (K / 32)), s(M * (K / 32)) {}
  Scratch<int8_t> q;
  Scratch<float> d;  // xd
  Scratch<float> s;  // xs: xd times the sum of the group's levels
};

// One group of 32 activations -> levels q = nearbyint(x * 127 / amax) (to nearest, ties to
// even, in the default rounding mode; NaNs take no part in amax), with xd = amax / 127 and
// xs = xd * (the levels' sum). The vector path computes the same products and roundings
// lane by lane, sixteen groups at a time.
inline void quantize_group(const float* v, int8_t* q, float* xd, float* xs) {
  float amax = 0.f;
  for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(v[i]));
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  int32_t sum = 0;
  for (int i = 0; i < 32; ++i) {
    const int32_t level = static_cast<int32_t>(std::nearbyint(v[i] * inv));
    q[i] = static_cast<int8_t>(level);
    sum += level;
  }
  *xd = amax / 127.f;
  *xs = *xd * static_cast<float>(sum);
}

#ifdef LUCEDESK_VNNI
// Sixteen bfloat16 values widened to floats (exact).
inline __m512 widen16(const c10::BFloat16* x) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// Groups 0..n - 1 (n <= 16), group i's halves load(i, 0) and load(i, 1) -> levels at
// q + 32 i, xd[i], xs[i], as quantize_group makes them.
template <typename Load>
inline void quantize_sixteen(const Load& load, int64_t n, int8_t* q, float* xd, float* xs) {
  const __m512 zero = _mm512_setzero_ps();
  __m512 top[16];
  for (int64_t i = 0; i < 16; ++i)
    // max_ps returns its second operand where either is NaN: the running max, never a NaN.
    top[i] = i < n ? _mm512_max_ps(_mm512_abs_ps(load(i, 1)),
                                   _mm512_max_ps(_mm512_abs_ps(load(i, 0)), zero))
                   : zero;
  const __m512 amax = reduce16(top, max_ps);
  const __m512 inv = _mm512_maskz_div_ps(_mm512_cmp_ps_mask(amax, zero, _CMP_GT_OQ),
                                         _mm512_set1_ps(127.f), amax);
  __m512 sums[16];
  for (int64_t i = 0; i < 16; ++i) {
    if (i >= n) {
      sums[i] = zero;
      continue;
    }
    const __m512 scale = _mm512_permutexvar_ps(_mm512_set1_epi32(static_cast<int32_t>(i)), inv);
    const __m512i lo = _mm512_cvtps_epi32(_mm512_mul_ps(load(i, 0), scale));
    const __m512i hi = _mm512_cvtps_epi32(_mm512_mul_ps(load(i, 1), scale));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 32 * i), _mm512_cvtepi32_epi8(lo));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 32 * i + 16), _mm512_cvtepi32_epi8(hi));
    sums[i] = _mm512_castsi512_ps(_mm512_add_epi32(lo, hi));
  }
  const __m512i sum = _mm512_castps_si512(reduce16(sums, add_epi32));
  const __mmask16 groups = static_cast<__mmask16>((1u << n) - 1);
  const __m512 d = _mm512_div_ps(amax, _mm512_set1_ps(127.f));
  _mm512_mask_storeu_ps(xd, groups, d);
  _mm512_mask_storeu_ps(xs, groups, _mm512_mul_ps(d, _mm512_cvtepi32_ps(sum)));
}
#endif

RowsQ8 quantize_rows(const c10::BFloat16* x, int64_t M, int64_t K) {
  const int64_t groups = K / 32;
  RowsQ8 out(M, K);
  // ~6 ns a group and ~1 us a fork and join: below 256 groups one thread does them.
  at::parallel_for(0, M * groups, 256, [&](int64_t begin, int64_t end) {
#ifdef LUCEDESK_VNNI
    for (int64_t g = begin; g < end; g += 16) {
      const c10::BFloat16* v = x + g * 32;
      quantize_sixteen([v](int64_t i, int h) { return widen16(v + 32 * i + 16 * h); },
                       std::min<int64_t>(16, end - g), out.q.data() + g * 32, out.d.data() + g,
                       out.s.data() + g);
    }
#else
    float v[32];
    for (int64_t g = begin; g < end; ++g) {
      widen(v, x + g * 32, 32);
      quantize_group(v, out.q.data() + g * 32, out.d.data() + g, out.s.data() + g);
    }
#endif
  });
  return out;
}

#ifdef LUCEDESK_VNNI
// libtorch's own exp (Sleef's, 1 ulp): the one ATen's vectorized silu and sigmoid take on
// this CPU. Weak: a libtorch that does not export it loads the kernels all the same, and
// sleef_exp_available() says the one pass is not to be taken.
extern "C" __m512 Sleef_expf16_u10(__m512) __attribute__((weak));
inline bool sleef_exp_available() { return Sleef_expf16_u10 != nullptr; }

// Floats rounded to bfloat16 as ATen's vector conversion rounds them (to nearest, ties to
// even, as bf16_bits; a NaN becomes 0xFFFF), widened back.
inline __m512 bf16_rounded(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i up = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  const __m512i rounded = _mm512_and_si512(up, _mm512_set1_epi32(int32_t(0xFFFF0000u)));
  const __mmask16 numbers = _mm512_cmp_ps_mask(v, v, _CMP_ORD_Q);
  return _mm512_castsi512_ps(
      _mm512_mask_blend_epi32(numbers, _mm512_set1_epi32(int32_t(0xFFFF0000u)), rounded));
}

// Rows of gate|up [M, 2I] (gate first) -> act(gate) * up, quantized as quantize_rows
// quantizes rows, in one pass over the rows instead of a pass for each ATen op:
// product(row, j) gives the sixteen products of row's columns j .. j + 15, each the
// bfloat16 ATen's ops give, widened. Where an op's AVX-512 loop and its scalar tail may
// differ in the last bit (an exp), the values of a row, or of a thread's share of the rows,
// past its last multiple of 64 take the tail: the callers take this pass where I is a
// multiple of 64 (gated_in_one_pass), and ATen's result for a value can still depend on how
// a big batch is split between threads; this pass gives a row the same bits whatever its
// batch.
template <typename Product>
RowsQ8 quantize_gated(int64_t M, int64_t I, const Product& product) {
  const int64_t groups = I / 32;
  RowsQ8 out(M, I);
  at::parallel_for(0, M * groups, 128, [&](int64_t begin, int64_t end) {  // ~20 ns a group
    alignas(64) float products[16 * 32];  // sixteen groups' products, quantized together
    for (int64_t g0 = begin; g0 < end; g0 += 16) {
      const int64_t n = std::min<int64_t>(16, end - g0);
      for (int64_t i = 0; i < 2 * n; ++i) {
        const int64_t g = g0 + i / 2;
        _mm512_store_ps(products + 16 * i, product(g / groups, g % groups * 32 + i % 2 * 16));
      }
      quantize_sixteen(
          [&](int64_t i, int h) { return _mm512_load_ps(products + 32 * i + 16 * h); }, n,
          out.q.data() + g0 * 32, out.d.data() + g0, out.s.data() + g0);
    }
  });
  return out;
}

// exp(-x) with libtorch's Sleef exp, as ATen's vector silu and sigmoid compute it.
inline __m512 exp_negated16(__m512 x) {
  return Sleef_expf16_u10(_mm512_xor_ps(x, _mm512_castsi512_ps(_mm512_set1_epi32(INT32_MIN))));
}

// silu(x) * up as ATen's vector silu and mul give it: x / (1 + exp(-x)) in floats, rounded
// to bfloat16, times up (exact in a float), rounded.
inline __m512 silu_times_up16(__m512 x, __m512 up) {
  const __m512 act = bf16_rounded(_mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.f),
                                                                 exp_negated16(x))));
  return bf16_rounded(_mm512_mul_ps(act, up));
}

// Rows of gate|up [M, 2I] bfloat16 -> silu(gate) * up in one pass (ATen's own silu takes
// libm's exp past a row's last multiple of 64).
RowsQ8 quantize_silu_times_up(const c10::BFloat16* gate_up, int64_t M, int64_t I) {
  return quantize_gated(M, I, [&](int64_t row, int64_t j) {
    const c10::BFloat16* gate = gate_up + row * 2 * I + j;
    return silu_times_up16(widen16(gate), widen16(gate + I));
  });
}
#endif

}  // namespace
