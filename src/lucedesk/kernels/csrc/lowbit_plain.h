// The low-bit kernels' plain loops (lowbit.h's layouts and arithmetic, its top describes
// them): a weight's level at a value's place, the 6-bit activations' half sums, and one
// block of sixteen channels for a few rows at 4, 6 or 8 bits, where the CPU has no
// AVX512-VNNI. The vector kernels give the same bits (tests compare them).
#pragma once

#include "lowbit_scales.h"  // activations.h (RowsQ8), the scales' layouts

namespace {

// At 4 bits a nibble is the level itself, or with a table (`lut`, 16 entries) an index into
// it: MXFP4's sixteen codes are the levels 12 + {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, ..., -12}.
template <int Bits>
inline int level_at(const uint8_t* chunk, int64_t v, const uint8_t* lut) {
  if constexpr (Bits == 8) return chunk[v];
  const int nibble = v < 256 ? chunk[v] & 0x0F : chunk[v - 256] >> 4;
  if constexpr (Bits == 6) return nibble | ((chunk[256 + (v & 127)] >> (2 * (v >> 7))) & 3) << 4;
  return lut ? lut[nibble] : nibble;
}

// At 6 bits: each row's activations summed per sixteen inputs, times -32 (the levels'
// offset): hs, [M, K / 16], what a half's integer sum starts from.
std::vector<int32_t> half_sums(const RowsQ8& x, int64_t M, int64_t K) {
  std::vector<int32_t> out(M * K / 16);
  const int8_t* q = x.q.data();
  for (int64_t i = 0; i < M * K / 16; ++i) {
    int32_t sum = 0;
    for (int64_t e = 0; e < 16; ++e) sum += q[16 * i + e];
    out[i] = -32 * sum;
  }
  return out;
}

// At 6 bits, one block of sixteen channels for `rows` rows -> out [rows, 16] float.
void block_rows_plain6(const uint8_t* q, const int8_t* s, int64_t chunks, const RowsQ8& x,
                       const int32_t* hs, int64_t row0, int64_t rows, int64_t K, float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    float acc[16] = {};
    const int8_t* xr = x.q.data() + (row0 + r) * K;
    const int32_t* hr = hs + (row0 + r) * (K / 16);
    for (int64_t c = 0; c < chunks; ++c) {
      const uint8_t* chunk = q + c * 384;
      const float dx = x.d[(row0 + r) * chunks + c];
      for (int64_t ch = 0; ch < 16; ++ch) {
        int32_t isum[2] = {hr[2 * c], hr[2 * c + 1]};
        for (int64_t j = 0; j < 8; ++j)
          for (int64_t e = 0; e < 4; ++e)
            isum[j / 4] += level_at<6>(chunk, 64 * j + 4 * ch + e, nullptr) *
                           xr[32 * c + 4 * j + e];
        const float a = std::fma(static_cast<float>(isum[0]),
                                 six_bit_scale(s, chunks, c, 0, ch) * dx, acc[ch]);
        acc[ch] = std::fma(static_cast<float>(isum[1]), six_bit_scale(s, chunks, c, 1, ch) * dx,
                           a);
      }
    }
    std::memcpy(out + 16 * r, acc, sizeof acc);
  }
}

// One block of sixteen channels for `rows` rows (at most eight) -> out [rows, 16] float.
template <int Bits, typename S>
void block_rows_plain(const uint8_t* q, const S* d, const S* m, int64_t chunks,
                      const RowsQ8& x, int64_t row0, int64_t rows, int64_t K, float* out,
                      const uint8_t* lut) {
  constexpr int64_t kChunk = 512 * Bits / 8;
  for (int64_t r = 0; r < rows; ++r) {
    float acc[16] = {};
    const int8_t* xr = x.q.data() + (row0 + r) * K;
    for (int64_t c = 0; c < chunks; ++c) {
      const uint8_t* chunk = q + c * kChunk;
      const float dx = x.d[(row0 + r) * chunks + c];
      const float sx = x.s[(row0 + r) * chunks + c];
      for (int64_t ch = 0; ch < 16; ++ch) {
        int32_t isum = 0;
        for (int64_t j = 0; j < 8; ++j)
          for (int64_t e = 0; e < 4; ++e)
            isum += level_at<Bits>(chunk, 64 * j + 4 * ch + e, lut) * xr[32 * c + 4 * j + e];
        const float dv = scale_at(d, chunks, c, ch);
        const float a = std::fma(static_cast<float>(isum), dv * dx, acc[ch]);
        acc[ch] = std::fma(offset_at<Bits>(m, chunks, c, ch, dv), sx, a);
      }
    }
    std::memcpy(out + 16 * r, acc, sizeof acc);
  }
}

}  // namespace
