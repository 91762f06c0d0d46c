// Weight-only 4- and 8-bit matmuls for decode: the weights stay in their blocks in memory
// and are unpacked in registers; activations are quantized per row to int8 with one scale
// per group of 32 inputs (as llama.cpp's CPU path does), and each group's dot product is
// exact integer arithmetic (AVX512-VNNI where the CPU has it, plain loops elsewhere).
#pragma once

#include "int8.h"  // check_int8_inputs: the same activations and group scales

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define LUCEDESK_VNNI 1
#include <immintrin.h>
#endif

namespace {

// Weights: w[n, k] = d * level + m for the group of 32 inputs holding k, level in
// 0..2^bits - 1 (llama.cpp's Q4_0 / Q4_1 / Q4_K blocks are such grids; 8-bit levels hold
// any other weight to within 1/510 of its group's range). Per sixteen output channels and
// one group:
//   q [N/16, K/32, 512 * bits / 8] uint8, values ordered v = 64 j + 4 c + e for channel c's
//     input 4 j + e (a VNNI lane takes four inputs of one channel); at 4 bits byte p holds
//     value p in its low nibble and value p + 256 in its high one;
//   d, m [N/16, K/32, 16] float32.
// Activations: row r's group g is xd[r, g] * xq[r, g, :] with xq in -127..127, and
// xs[r, g] = xd[r, g] * sum(xq[r, g, :]). Then
//   y[r, n] = sum over groups, in order, of fma(m, xs, fma(isum, d * xd, acc))
// with isum = sum(level * xq) exact: every row's result is the same whatever its batch, and
// the vector and plain paths give the same bits.

// Rows multiplied per pass over a block's weights (each pass unpacks them once).
constexpr int64_t kRowsAtOnce = 8;

struct RowsQ8 {
  std::vector<int8_t> q;
  std::vector<float> d;  // xd
  std::vector<float> s;  // xs: xd times the sum of the group's levels
};

RowsQ8 quantize_rows(const c10::BFloat16* x, int64_t M, int64_t K) {
  const int64_t groups = K / 32;
  RowsQ8 out{std::vector<int8_t>(M * K), std::vector<float>(M * groups),
             std::vector<float>(M * groups)};
  at::parallel_for(0, M * groups, 64, [&](int64_t begin, int64_t end) {
    float v[32];
    for (int64_t g = begin; g < end; ++g) {
      widen(v, x + g * 32, 32);
      float amax = 0.f;
      for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(v[i]));
      const float inv = amax > 0.f ? 127.f / amax : 0.f;
      int32_t sum = 0;
      for (int i = 0; i < 32; ++i) {
        const int32_t level = static_cast<int32_t>(std::nearbyint(v[i] * inv));
        out.q[g * 32 + i] = static_cast<int8_t>(level);
        sum += level;
      }
      out.d[g] = amax / 127.f;
      out.s[g] = out.d[g] * static_cast<float>(sum);
    }
  });
  return out;
}

template <int Bits>
inline int level_at(const uint8_t* chunk, int64_t v) {
  if constexpr (Bits == 8) return chunk[v];
  return v < 256 ? chunk[v] & 0x0F : chunk[v - 256] >> 4;
}

// One block of sixteen channels for `rows` rows (at most kRowsAtOnce) -> out [rows, 16] float.
template <int Bits>
void block_rows_plain(const uint8_t* q, const float* d, const float* m, int64_t chunks,
                      const RowsQ8& x, int64_t row0, int64_t rows, int64_t K, float* out) {
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
            isum += level_at<Bits>(chunk, 64 * j + 4 * ch + e) * xr[32 * c + 4 * j + e];
        const float a = std::fma(static_cast<float>(isum), d[c * 16 + ch] * dx, acc[ch]);
        acc[ch] = std::fma(m[c * 16 + ch], sx, a);
      }
    }
    std::memcpy(out + 16 * r, acc, sizeof acc);
  }
}

#if defined(LUCEDESK_VNNI)
// Rows is a compile-time count so that each row's sums stay in registers.
template <int Bits, int Rows>
void block_rows_vnni(const uint8_t* q, const float* d, const float* m, int64_t chunks,
                     const RowsQ8& x, int64_t row0, int64_t K, float* out) {
  constexpr int64_t kChunk = 512 * Bits / 8;
  const __m512i low_bits = _mm512_set1_epi8(0x0F);
  const int8_t* xq = x.q.data() + row0 * K;
  const float* xd = x.d.data() + row0 * chunks;
  const float* xs = x.s.data() + row0 * chunks;
  __m512 acc[Rows];
  for (int r = 0; r < Rows; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t c = 0; c < chunks; ++c) {
    const uint8_t* chunk = q + c * kChunk;
    __m512i w[8];
    if constexpr (Bits == 8) {
      for (int j = 0; j < 8; ++j) w[j] = _mm512_loadu_si512(chunk + 64 * j);
    } else {
      for (int t = 0; t < 4; ++t) {
        const __m512i v = _mm512_loadu_si512(chunk + 64 * t);
        w[t] = _mm512_and_si512(v, low_bits);
        w[t + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low_bits);
      }
    }
    __m512i isum[Rows];
    for (int r = 0; r < Rows; ++r) isum[r] = _mm512_setzero_si512();
    for (int j = 0; j < 8; ++j) {
      for (int r = 0; r < Rows; ++r) {
        int32_t quad;
        std::memcpy(&quad, xq + r * K + 32 * c + 4 * j, 4);
        isum[r] = _mm512_dpbusd_epi32(isum[r], w[j], _mm512_set1_epi32(quad));
      }
    }
    const __m512 dw = _mm512_loadu_ps(d + c * 16), mw = _mm512_loadu_ps(m + c * 16);
    for (int r = 0; r < Rows; ++r) {
      const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(xd[r * chunks + c]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), scale, acc[r]);
      acc[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(xs[r * chunks + c]), acc[r]);
    }
  }
  for (int r = 0; r < Rows; ++r) _mm512_storeu_ps(out + 16 * r, acc[r]);
}

template <int Bits>
void block_rows_vnni(const uint8_t* q, const float* d, const float* m, int64_t chunks,
                     const RowsQ8& x, int64_t row0, int64_t rows, int64_t K, float* out) {
  switch (rows) {
    case 1: return block_rows_vnni<Bits, 1>(q, d, m, chunks, x, row0, K, out);
    case 2: return block_rows_vnni<Bits, 2>(q, d, m, chunks, x, row0, K, out);
    case 3: return block_rows_vnni<Bits, 3>(q, d, m, chunks, x, row0, K, out);
    case 4: return block_rows_vnni<Bits, 4>(q, d, m, chunks, x, row0, K, out);
    case 5: return block_rows_vnni<Bits, 5>(q, d, m, chunks, x, row0, K, out);
    case 6: return block_rows_vnni<Bits, 6>(q, d, m, chunks, x, row0, K, out);
    case 7: return block_rows_vnni<Bits, 7>(q, d, m, chunks, x, row0, K, out);
    default: return block_rows_vnni<Bits, 8>(q, d, m, chunks, x, row0, K, out);
  }
}
#endif

bool lowbit_vector_available() {
#if defined(LUCEDESK_VNNI)
  return true;
#else
  return false;
#endif
}

template <int Bits>
void lowbit_rows(const RowsQ8& x, const uint8_t* q, const float* d, const float* m,
                 c10::BFloat16* y, int64_t M, int64_t N, int64_t K, bool vector) {
  const int64_t chunks = K / 32, block_bytes = chunks * 512 * Bits / 8;
  at::parallel_for(0, N / 16, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float out[kRowsAtOnce * 16];
    for (int64_t b = begin; b < end; ++b) {
      const uint8_t* qb = q + b * block_bytes;
      const float* db = d + b * chunks * 16;
      const float* mb = m + b * chunks * 16;
      for (int64_t r0 = 0; r0 < M; r0 += kRowsAtOnce) {
        const int64_t rows = std::min<int64_t>(kRowsAtOnce, M - r0);
#if defined(LUCEDESK_VNNI)
        if (vector)
          block_rows_vnni<Bits>(qb, db, mb, chunks, x, r0, rows, K, out);
        else
#endif
          block_rows_plain<Bits>(qb, db, mb, chunks, x, r0, rows, K, out);
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t ch = 0; ch < 16; ++ch)
            y[(r0 + r) * N + b * 16 + ch] = narrow<c10::BFloat16>(out[16 * r + ch]);
      }
    }
  });
}

at::Tensor lowbit_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& d,
                         const at::Tensor& m, int64_t bits, bool vector) {
  TORCH_CHECK(bits == 4 || bits == 8, "lowbit linear: bits must be 4 or 8");
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && q.scalar_type() == at::kByte &&
                  q.size(2) == 64 * bits,
              "lowbit linear: q must be uint8 [N/16, K/32, 64 * bits]");
  const int64_t N = q.size(0) * 16, K = q.size(1) * 32, M = x.size(0);
  check_int8_inputs(x, d, m, N, K);
  TORCH_CHECK(!vector || lowbit_vector_available(), "lowbit linear: no AVX512-VNNI here");
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const RowsQ8 xq = quantize_rows(x.data_ptr<c10::BFloat16>(), M, K);
  const uint8_t* qp = q.data_ptr<uint8_t>();
  c10::BFloat16* yp = y.data_ptr<c10::BFloat16>();
  if (bits == 4)
    lowbit_rows<4>(xq, qp, d.data_ptr<float>(), m.data_ptr<float>(), yp, M, N, K, vector);
  else
    lowbit_rows<8>(xq, qp, d.data_ptr<float>(), m.data_ptr<float>(), yp, M, N, K, vector);
  return y;
}

}  // namespace
