// How a low-bit weight's group scales are held (the layouts lowbit.h's top describes) and
// read: one group and channel's d and m as floats (scale_at, offset_at), sixteen channels'
// at once in AVX-512 (load16, load_offsets16), where a block's scales start, their checks,
// and the call that hands a kernel the scales' pointers in their type (with_scales).
#pragma once

#include <type_traits>

#include "activations.h"  // common.h, and LUCEDESK_VNNI where the CPU has it

namespace {

// At 6 bits: group c's half h (its first or second sixteen inputs), channel ch's d.
inline __attribute__((always_inline)) float six_bit_scale(const int8_t* s, int64_t chunks,
                                                          int64_t c, int h, int64_t ch) {
  float super;
  std::memcpy(&super, s + chunks * 32 + ((c / 8) * 16 + ch) * 4, 4);
  return kept(static_cast<float>(s[c * 32 + h * 16 + ch]) * super);
}

// A block's scale for group c, channel ch, as a float (`chunks`: the groups a channel has).
inline __attribute__((always_inline)) float scale_at(const float* s, int64_t, int64_t c,
                                                     int64_t ch) {
  return s[c * 16 + ch];
}
inline __attribute__((always_inline)) float scale_at(const c10::Half* s, int64_t, int64_t c,
                                                     int64_t ch) {
  return static_cast<float>(s[c * 16 + ch]);
}
inline __attribute__((always_inline)) float scale_at(const uint8_t* s, int64_t chunks, int64_t c,
                                                     int64_t ch) {
  float super;
  std::memcpy(&super, s + chunks * 16 + ((c / 8) * 16 + ch) * 4, 4);
  return kept(static_cast<float>(s[c * 16 + ch]) * super);
}

// MXFP4's exponent scales (see the top): d = 2^(e - 128).
inline __attribute__((always_inline)) float scale_at(const c10::Float8_e8m0fnu* s, int64_t,
                                                     int64_t c, int64_t ch) {
  return std::ldexp(1.f, static_cast<int>(s[c * 16 + ch].x) - 128);
}

// A group's m for channel ch, whose d is `d`: held beside d, or for exponent scales -12 d.
template <int Bits, typename S>
inline __attribute__((always_inline)) float offset_at(const S* m, int64_t chunks, int64_t c,
                                                      int64_t ch, float) {
  return scale_at(m, chunks, c, ch);
}
template <int Bits>
inline __attribute__((always_inline)) float offset_at(const c10::Float8_e8m0fnu*, int64_t,
                                                      int64_t, int64_t, float d) {
  return -12.f * d;
}

// Symmetric levels' float16 d, whose m is implied (see the top).
struct SymmetricHalf {
  c10::Half d;
};
static_assert(sizeof(SymmetricHalf) == sizeof(c10::Half), "d's side by side, as float16 scales");
inline __attribute__((always_inline)) float scale_at(const SymmetricHalf* s, int64_t chunks,
                                                     int64_t c, int64_t ch) {
  return scale_at(&s->d, chunks, c, ch);  // d's are laid out as float16 scales are
}
template <int Bits>
inline __attribute__((always_inline)) float offset_at(const SymmetricHalf*, int64_t, int64_t,
                                                      int64_t, float d) {
  return -static_cast<float>(1 << (Bits - 1)) * d;
}

// Where block b's scales start, in elements of S.
template <typename S>
inline int64_t block_scales_offset(int64_t b, int64_t chunks) {
  if constexpr (std::is_same_v<S, int8_t>) return b * chunks * 40;
  return std::is_same_v<S, uint8_t> ? b * chunks * 24 : b * chunks * 16;
}

#if defined(LUCEDESK_VNNI)
// Group c's sixteen scales (scale_at's values).
inline __m512 load16(const float* s, int64_t, int64_t c) { return _mm512_loadu_ps(s + c * 16); }
inline __m512 load16(const c10::Half* s, int64_t, int64_t c) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + c * 16)));
}
inline __m512 load16(const c10::Float8_e8m0fnu* s, int64_t, int64_t c) {
  const __m512i e = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + c * 16)));
  return _mm512_scalef_ps(_mm512_set1_ps(1.f),
                          _mm512_cvtepi32_ps(_mm512_sub_epi32(e, _mm512_set1_epi32(128))));
}
inline __m512 load16(const SymmetricHalf* s, int64_t chunks, int64_t c) {
  return load16(&s->d, chunks, c);
}
inline __m512 load16(const uint8_t* s, int64_t chunks, int64_t c) {
  const __m512 factors = _mm512_cvtepi32_ps(
      _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + c * 16))));
  const float* supers = reinterpret_cast<const float*>(s + chunks * 16);
  return _mm512_mul_ps(factors, _mm512_loadu_ps(supers + (c / 8) * 16));
}

// Group c's sixteen m's (offset_at's values), d's being dw.
template <int Bits, typename S>
inline __m512 load_offsets16(const S* m, int64_t chunks, int64_t c, __m512) {
  return load16(m, chunks, c);
}
template <int Bits>
inline __m512 load_offsets16(const c10::Float8_e8m0fnu*, int64_t, int64_t, __m512 dw) {
  return _mm512_mul_ps(dw, _mm512_set1_ps(-12.f));
}
template <int Bits>
inline __m512 load_offsets16(const SymmetricHalf*, int64_t, int64_t, __m512 dw) {
  return _mm512_mul_ps(dw, _mm512_set1_ps(-static_cast<float>(1 << (Bits - 1))));
}
#endif

// Group scales for `weights` weights of [N, K]: float32 or float16 one per 32 inputs, or
// uint8 in the K-quant form (K a multiple of 256), or MXFP4's exponent bytes (m empty); at
// 6 bits int8 in theirs, m empty.
void check_scales(const at::Tensor& d, const at::Tensor& m, int64_t N, int64_t K,
                  int64_t weights, int64_t bits) {
  const auto type = d.scalar_type();
  if (bits == 6) {
    TORCH_CHECK(type == at::kChar && d.is_contiguous() && K % 256 == 0 &&
                    d.numel() == weights * N / 16 * (K / 32) * 40 && m.numel() == 0,
                "lowbit linear: 6-bit scales are int8, 40 bytes per sixteen channels and 32 "
                "inputs, K a multiple of 256, and no m");
    return;
  }
  TORCH_CHECK(m.scalar_type() == type && d.is_contiguous() && m.is_contiguous(),
              "lowbit linear: group scales d and m must be contiguous, of one dtype");
  if (type == at::kHalf && m.numel() == 0) {
    TORCH_CHECK(d.numel() == weights * N * (K / 32),
                "lowbit linear: symmetric scales are float16, one per 32 inputs, and no m");
    return;
  }
  if (type == at::kFloat8_e8m0fnu) {
    TORCH_CHECK(d.is_contiguous() && d.numel() == weights * N * (K / 32) && m.numel() == 0,
                "lowbit linear: exponent scales are one byte per 32 inputs, and no m");
    return;
  }
  if (type == at::kByte) {
    TORCH_CHECK(K % 256 == 0 && d.numel() == weights * N / 16 * (K / 32) * 24 &&
                    m.numel() == d.numel(),
                "lowbit linear: K-quant scales are 24 bytes per sixteen channels and 32 "
                "inputs, K a multiple of 256");
    return;
  }
  TORCH_CHECK((type == at::kHalf || type == at::kFloat) && d.numel() == weights * N * (K / 32) &&
                  m.numel() == d.numel(),
              "lowbit linear: group scales d and m must be float32 or float16, one per 32 "
              "inputs");
}

// Whether with_scales hands out a 6-bit weight's scales (the pointer type P is int8's).
template <typename P>
constexpr bool is_six_bit_scales = std::is_same_v<std::remove_cv_t<std::remove_pointer_t<P>>, int8_t>;

// run(d, m) with the scales' pointers in their type.
template <typename Run>
void with_scales(const at::Tensor& d, const at::Tensor& m, const Run& run) {
  if (d.scalar_type() == at::kChar)  // 6 bits: no m
    run(d.data_ptr<int8_t>(), d.data_ptr<int8_t>());
  else if (d.scalar_type() == at::kFloat8_e8m0fnu) {  // m is -12 d
    const auto* e = static_cast<const c10::Float8_e8m0fnu*>(d.data_ptr());
    run(e, e);
  } else if (d.scalar_type() == at::kHalf && m.numel() == 0) {  // m is -2^(bits - 1) d
    const auto* s = static_cast<const SymmetricHalf*>(d.data_ptr());
    run(s, s);
  } else if (d.scalar_type() == at::kHalf)
    run(d.data_ptr<c10::Half>(), m.data_ptr<c10::Half>());
  else if (d.scalar_type() == at::kByte)
    run(d.data_ptr<uint8_t>(), m.data_ptr<uint8_t>());
  else
    run(d.data_ptr<float>(), m.data_ptr<float>());
}

}  // namespace
