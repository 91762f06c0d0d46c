// Weight-only 4- and 8-bit matmuls for decode: the weights stay in their blocks in memory
// and are unpacked in registers; activations are quantized per row to int8 with one scale
// per group of 32 inputs (as llama.cpp's CPU path does), and each group's dot product is
// exact integer arithmetic (AVX512-VNNI where the CPU has it, plain loops elsewhere).
#pragma once

#include "activations.h"  // RowsQ8, quantize_rows: the activations' int8 groups
#include "lowbit_plain.h"  // level_at, half_sums and the plain loops
#include "lowbit_scales.h"

namespace {

// Weights: w[n, k] = d * level + m for the group of 32 inputs holding k, level in
// 0..2^bits - 1 (llama.cpp's Q4_0 / Q4_1 / Q4_K blocks are such grids; 8-bit levels hold
// any other weight to within 1/510 of its group's range). Per sixteen output channels and
// one group:
//   q [N/16, K/32, 512 * bits / 8] uint8, values ordered v = 64 j + 4 c + e for channel c's
//     input 4 j + e (a VNNI lane takes four inputs of one channel); at 4 bits byte p holds
//     value p in its low nibble and value p + 256 in its high one;
//   d, m [N/16, K/32, 16] float32, or float16 where the scales are float16 values (a
//     Q4_0 / Q4_1 file's are): a quarter fewer bytes a weight, the same arithmetic (the
//     scales are widened exactly); or uint8 in the K-quant form (a Q4_K file's: a group's
//     scale is a 6-bit factor times its 256-input super-block's float16 scale): per block
//     of sixteen channels K/32 x 16 factors, then K/256 x 16 float32 super scales, 24 bytes
//     a group of sixteen channels instead of 64. factor * super is exact in float32, so
//     the arithmetic is that of the float32 scales it stands for, for 0.59 bytes a 4-bit
//     weight instead of 0.75.
// Activations: row r's group g is xd[r, g] * xq[r, g, :] with xq in -127..127, and
// xs[r, g] = xd[r, g] * sum(xq[r, g, :]). Then
//   y[r, n] = sum over groups, in order, of fma(m, xs, fma(isum, d * xd, acc))
// with isum = sum(level * xq) exact: every row's result is the same whatever its batch, and
// the vector and plain paths give the same bits.
//
// MXFP4's scales may be held as the file has them, an exponent byte e a group and channel
// (float8_e8m0fnu): d = 2^(e - 128) and m = -12 d, both exact, so the arithmetic is that of
// the same scales in float16, for 0.53 bytes a weight instead of 0.625. Symmetric levels
// (Q8_0's and Q4_0's: w = d * (level - 2^(bits - 1))) hold their float16 d alone
// (SymmetricHalf, m empty): m = -2^(bits - 1) d is exact, so again the same arithmetic,
// for 1.0625 bytes an 8-bit weight instead of 1.125 and 0.5625 a 4-bit one instead of 0.625.
//
// 6 bits (llama.cpp's Q6_K as it is): w = d * (level - 32), level in 0..63, with a d for
// each sixteen inputs, a signed 8-bit factor times its 256-input super-block's float16
// scale (exact in float32). Per sixteen channels and group, q holds 384 bytes: the low
// nibbles as at 4 bits (256 bytes), then 128 bytes of high bit pairs, byte p holding those
// of values p, p + 128, p + 256 and p + 384 (bits 0-1, 2-3, 4-5, 6-7). The scales, int8
// per block of sixteen channels: K/32 x 32 factors (a group's first sixteen inputs', then
// its second sixteen's), then K/256 x 16 float32 super scales (40 bytes a group instead of
// 128), and no m. A group's halves are summed apart, each less 32 times its activations'
// sum (hs, exact):
//   acc = fma(isum_hi + hs_hi, d_hi * xd, fma(isum_lo + hs_lo, d_lo * xd, acc)), hs = -32 sum
// 0.83 bytes a weight, where 8-bit levels of the values took 1.25 and lost up to 1/510.

// Rows multiplied per pass over a block's weights (each pass unpacks them once).
constexpr int64_t kRowsAtOnce = 8;

#if defined(LUCEDESK_VNNI)
// Rows is a compile-time count so that each row's sums stay in registers.
template <int Bits, int Rows, typename S, int Parts = Rows == 1 ? 4 : Rows <= 4 ? 2 : 1>
void block_rows_vnni(const uint8_t* q, const S* d, const S* m, int64_t chunks,
                     const RowsQ8& x, int64_t row0, int64_t K, float* out, const uint8_t* lut) {
  constexpr int64_t kChunk = 512 * Bits / 8;
  const __m512i low_bits = _mm512_set1_epi8(0x0F);
  // The table in each 128-bit lane, for vpshufb (nibble -> level).
  const __m512i table =
      lut ? _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(lut)))
          : _mm512_setzero_si512();
  const int8_t* xq = x.q.data() + row0 * K;
  const float* xd = x.d.data() + row0 * chunks;
  const float* xs = x.s.data() + row0 * chunks;
  __m512 acc[Rows];
  for (int r = 0; r < Rows; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t c = 0; c < chunks; ++c) {
    const uint8_t* chunk = q + c * kChunk;
    // Sixteen groups ahead (into the next block of channels near the end of this one, which
    // is where a thread goes next): a decode reads each weight once, from memory, and a
    // short matmul ends before the hardware's prefetcher gets going. A prefetch past the
    // end of the weights is only a hint: it does not fault.
    for (int64_t t = 0; t < kChunk; t += 64)
      _mm_prefetch(reinterpret_cast<const char*>(chunk + 16 * kChunk + t), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(d + (c + 16) * 16), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(m + (c + 16) * 16), _MM_HINT_T0);
    __m512i w[8];
    if constexpr (Bits == 8) {
      for (int j = 0; j < 8; ++j) w[j] = _mm512_loadu_si512(chunk + 64 * j);
    } else {
      for (int t = 0; t < 4; ++t) {
        const __m512i v = _mm512_loadu_si512(chunk + 64 * t);
        w[t] = _mm512_and_si512(v, low_bits);
        w[t + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low_bits);
      }
      if (lut)
        for (int j = 0; j < 8; ++j) w[j] = _mm512_shuffle_epi8(table, w[j]);
    }
    // A row's eight quads go to `Parts` independent sums, added at the end: integer sums,
    // so the same value in any order, and with few rows the vpdpbusd chain no longer waits
    // on its own latency (one row's eight in a row took ~40 cycles a group).
    __m512i part[Rows][Parts], isum[Rows];
    for (int r = 0; r < Rows; ++r)
      for (int p = 0; p < Parts; ++p) part[r][p] = _mm512_setzero_si512();
    for (int j = 0; j < 8; ++j) {
      for (int r = 0; r < Rows; ++r) {
        int32_t quad;
        std::memcpy(&quad, xq + r * K + 32 * c + 4 * j, 4);
        part[r][j % Parts] =
            _mm512_dpbusd_epi32(part[r][j % Parts], w[j], _mm512_set1_epi32(quad));
      }
    }
    for (int r = 0; r < Rows; ++r) {
      isum[r] = part[r][0];
      for (int p = 1; p < Parts; ++p) isum[r] = _mm512_add_epi32(isum[r], part[r][p]);
    }
    const __m512 dw = load16(d, chunks, c), mw = load_offsets16<Bits>(m, chunks, c, dw);
    for (int r = 0; r < Rows; ++r) {
      const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(xd[r * chunks + c]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), scale, acc[r]);
      acc[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(xs[r * chunks + c]), acc[r]);
    }
  }
  for (int r = 0; r < Rows; ++r) _mm512_storeu_ps(out + 16 * r, acc[r]);
}

template <int Bits, typename S>
void block_rows_vnni(const uint8_t* q, const S* d, const S* m, int64_t chunks,
                     const RowsQ8& x, int64_t row0, int64_t rows, int64_t K, float* out,
                     const uint8_t* lut) {
  switch (rows) {
    case 1: return block_rows_vnni<Bits, 1, S>(q, d, m, chunks, x, row0, K, out, lut);
    case 2: return block_rows_vnni<Bits, 2, S>(q, d, m, chunks, x, row0, K, out, lut);
    case 3: return block_rows_vnni<Bits, 3, S>(q, d, m, chunks, x, row0, K, out, lut);
    case 4: return block_rows_vnni<Bits, 4, S>(q, d, m, chunks, x, row0, K, out, lut);
    case 5: return block_rows_vnni<Bits, 5, S>(q, d, m, chunks, x, row0, K, out, lut);
    case 6: return block_rows_vnni<Bits, 6, S>(q, d, m, chunks, x, row0, K, out, lut);
    case 7: return block_rows_vnni<Bits, 7, S>(q, d, m, chunks, x, row0, K, out, lut);
    default: return block_rows_vnni<Bits, 8, S>(q, d, m, chunks, x, row0, K, out, lut);
  }
}

// At 6 bits (see the top): each half's sums in `Parts` independent chains, as above. A
// group's halves are taken one after the other (four quads each), so that eight rows'
// sums, a half's four weight registers and the rows' float sums fit the 32 registers (both
// halves' sums at once spilled them: a third of the 4-bit kernel's speed at 8 rows).
template <int Rows, int Parts = Rows == 1 ? 2 : 1>
void block_rows_vnni6(const uint8_t* q, const int8_t* s, int64_t chunks, const RowsQ8& x,
                      const int32_t* hs, int64_t row0, int64_t K, float* out) {
  const __m512i low_bits = _mm512_set1_epi8(0x0F), pair = _mm512_set1_epi8(0x30);
  const int8_t* xq = x.q.data() + row0 * K;
  const float* xd = x.d.data() + row0 * chunks;
  const int32_t* hr = hs + row0 * (K / 16);
  const float* supers = reinterpret_cast<const float*>(s + chunks * 32);
  __m512 acc[Rows];
  for (int r = 0; r < Rows; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t c = 0; c < chunks; ++c) {
    const uint8_t* chunk = q + c * 384;
    for (int64_t t = 0; t < 384; t += 64)
      _mm_prefetch(reinterpret_cast<const char*>(chunk + 16 * 384 + t), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(s + (c + 16) * 32), _MM_HINT_T0);
    const __m512 super = _mm512_loadu_ps(supers + (c / 8) * 16);
    for (int h = 0; h < 2; ++h) {
      // Quads 4h..4h + 3: the low nibbles (h = 0) or high ones (h = 1) of the first 256
      // bytes, each with its bit pair (k of a byte of the last 128) moved to bits 4-5 by
      // one 16-bit shift (what crosses into the next byte is masked off), then
      // (nibble & 0x0F) | pair in one ternary op (0xEA: (a & b) | c).
      __m512i w[4];
      for (int t = 0; t < 4; ++t) {
        const __m512i v = _mm512_loadu_si512(chunk + 64 * t);
        const __m512i high = _mm512_loadu_si512(chunk + 256 + 64 * (t % 2));
        const int k = 2 * h + t / 2;
        const __m512i moved = k == 0   ? _mm512_slli_epi16(high, 4)
                              : k == 1 ? _mm512_slli_epi16(high, 2)
                              : k == 2 ? high
                                       : _mm512_srli_epi16(high, 2);
        w[t] = _mm512_ternarylogic_epi32(h ? _mm512_srli_epi16(v, 4) : v, low_bits,
                                         _mm512_and_si512(moved, pair), 0xEA);
      }
      __m512i part[Rows][Parts];
      for (int r = 0; r < Rows; ++r)
        for (int p = 0; p < Parts; ++p) part[r][p] = _mm512_setzero_si512();
      for (int t = 0; t < 4; ++t) {
        for (int r = 0; r < Rows; ++r) {
          int32_t quad;
          std::memcpy(&quad, xq + r * K + 32 * c + 4 * (4 * h + t), 4);
          __m512i& sum = part[r][t % Parts];
          sum = _mm512_dpbusd_epi32(sum, w[t], _mm512_set1_epi32(quad));
        }
      }
      const __m512i factors = _mm512_cvtepi8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + c * 32 + h * 16)));
      const __m512 scale = _mm512_mul_ps(_mm512_cvtepi32_ps(factors), super);
      for (int r = 0; r < Rows; ++r) {
        __m512i isum = _mm512_set1_epi32(hr[r * (K / 16) + 2 * c + h]);
        for (int p = 0; p < Parts; ++p) isum = _mm512_add_epi32(isum, part[r][p]);
        const __m512 dw = _mm512_mul_ps(scale, _mm512_set1_ps(xd[r * chunks + c]));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), dw, acc[r]);
      }
    }
  }
  for (int r = 0; r < Rows; ++r) _mm512_storeu_ps(out + 16 * r, acc[r]);
}

void block_rows_vnni6(const uint8_t* q, const int8_t* s, int64_t chunks, const RowsQ8& x,
                      const int32_t* hs, int64_t row0, int64_t rows, int64_t K, float* out) {
  switch (rows) {
    case 1: return block_rows_vnni6<1>(q, s, chunks, x, hs, row0, K, out);
    case 2: return block_rows_vnni6<2>(q, s, chunks, x, hs, row0, K, out);
    case 3: return block_rows_vnni6<3>(q, s, chunks, x, hs, row0, K, out);
    case 4: return block_rows_vnni6<4>(q, s, chunks, x, hs, row0, K, out);
    case 5: return block_rows_vnni6<5>(q, s, chunks, x, hs, row0, K, out);
    case 6: return block_rows_vnni6<6>(q, s, chunks, x, hs, row0, K, out);
    case 7: return block_rows_vnni6<7>(q, s, chunks, x, hs, row0, K, out);
    default: return block_rows_vnni6<8>(q, s, chunks, x, hs, row0, K, out);
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

// Rows row0..row0 + M - 1 of x times one weight's block b of sixteen channels, into y
// (row stride N) at the same rows, or with `to` at rows to[row0]..to[row0 + M - 1]. Each
// row's arithmetic depends on its own values only.
// At 6 bits S is int8_t, m is not read and hs holds x's half_sums.
template <int Bits, typename S>
void lowbit_block(const RowsQ8& x, const uint8_t* q, const S* d, const S* m,
                  c10::BFloat16* y, int64_t row0, int64_t M, int64_t N, int64_t K, int64_t b,
                  bool vector, const uint8_t* lut, const int32_t* hs = nullptr,
                  const int64_t* to = nullptr) {
  const int64_t chunks = K / 32, block_bytes = chunks * 512 * Bits / 8;
  const uint8_t* qb = q + b * block_bytes;
  const S* db = d + block_scales_offset<S>(b, chunks);
  const S* mb = Bits == 6 ? m : m + block_scales_offset<S>(b, chunks);
  alignas(64) float out[kRowsAtOnce * 16];
  for (int64_t r0 = row0; r0 < row0 + M; r0 += kRowsAtOnce) {
    const int64_t rows = std::min<int64_t>(kRowsAtOnce, row0 + M - r0);
    if constexpr (Bits == 6) {
#if defined(LUCEDESK_VNNI)
      if (vector)
        block_rows_vnni6(qb, db, chunks, x, hs, r0, rows, K, out);
      else
#endif
        block_rows_plain6(qb, db, chunks, x, hs, r0, rows, K, out);
    } else {
#if defined(LUCEDESK_VNNI)
      if (vector)
        block_rows_vnni<Bits>(qb, db, mb, chunks, x, r0, rows, K, out, lut);
      else
#endif
        block_rows_plain<Bits>(qb, db, mb, chunks, x, r0, rows, K, out, lut);
    }
    for (int64_t r = 0; r < rows; ++r) {
      c10::BFloat16* yr = y + (to ? to[r0 + r] : r0 + r) * N + b * 16;
      for (int64_t ch = 0; ch < 16; ++ch) yr[ch] = narrow<c10::BFloat16>(out[16 * r + ch]);
    }
  }
}

void check_lowbit_args(int64_t bits, bool vector, const std::optional<at::Tensor>& lut) {
  TORCH_CHECK(bits == 4 || bits == 6 || bits == 8, "lowbit linear: bits must be 4, 6 or 8");
  TORCH_CHECK(!vector || lowbit_vector_available(), "lowbit linear: no AVX512-VNNI here");
  if (lut.has_value())
    TORCH_CHECK(bits == 4 && lut->scalar_type() == at::kByte && lut->numel() == 16 &&
                    lut->is_contiguous(),
                "lowbit linear: a level table is 16 uint8 values, for 4-bit weights");
}

// The weight's (N, K), checked.
std::pair<int64_t, int64_t> check_lowbit_weight(const at::Tensor& q, const at::Tensor& d,
                                                const at::Tensor& m, int64_t bits, bool vector,
                                                const std::optional<at::Tensor>& lut) {
  check_lowbit_args(bits, vector, lut);
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && q.scalar_type() == at::kByte &&
                  q.size(2) == 64 * bits,
              "lowbit linear: q must be uint8 [N/16, K/32, 64 * bits]");
  const int64_t N = q.size(0) * 16, K = q.size(1) * 32;
  check_scales(d, m, N, K, 1, bits);
  return {N, K};
}

// M rows already quantized (xq, K inputs each) times a checked weight -> y [M, N] bfloat16.
at::Tensor lowbit_rows(const RowsQ8& xq, int64_t M, const at::Tensor& q, const at::Tensor& d,
                       const at::Tensor& m, int64_t bits, bool vector,
                       const std::optional<at::Tensor>& lut) {
  const int64_t N = q.size(0) * 16, K = q.size(1) * 32;
  at::Tensor y = at::empty({M, N}, q.options().dtype(at::kBFloat16));
  if (M == 0) return y;
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const uint8_t* table = lut.has_value() ? lut->data_ptr<uint8_t>() : nullptr;
  c10::BFloat16* yp = y.data_ptr<c10::BFloat16>();
  const std::vector<int32_t> hs = bits == 6 ? half_sums(xq, M, K) : std::vector<int32_t>();
  const auto run = [&](const auto* dp, const auto* mp) {
    at::parallel_for(0, N / 16, 1, [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b) {
        if constexpr (is_six_bit_scales<decltype(dp)>)
          lowbit_block<6>(xq, qp, dp, mp, yp, 0, M, N, K, b, vector, table, hs.data());
        else if (bits == 4)
          lowbit_block<4>(xq, qp, dp, mp, yp, 0, M, N, K, b, vector, table);
        else
          lowbit_block<8>(xq, qp, dp, mp, yp, 0, M, N, K, b, vector, table);
      }
    });
  };
  with_scales(d, m, run);
  return y;
}

at::Tensor lowbit_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& d,
                         const at::Tensor& m, int64_t bits, bool vector,
                         const std::optional<at::Tensor>& lut) {
  const int64_t K = check_lowbit_weight(q, d, m, bits, vector, lut).second;
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16,
              "lowbit linear: x must be contiguous bfloat16 [M, K]");
  TORCH_CHECK(x.size(1) == K, "lowbit linear: x has ", x.size(1), " inputs, the weights ", K);
  const int64_t M = x.size(0);
  return lowbit_rows(quantize_rows(x.data_ptr<c10::BFloat16>(), M, K), M, q, d, m, bits, vector,
                     lut);
}

// Mixture of experts: pair p multiplies row rp[p] of R rows of K inputs (row p without `rp`)
// by expert experts[p]'s weight (q [E, N/16, K/32, 64 * bits], d and m [E, ...]) -> y
// [P, N], in pair order; quantized() gives the rows as RowsQ8 once the arguments are
// checked. The pairs are grouped by expert here (a counting sort, in pair order within an
// expert), a row is quantized once however many pairs share it, and one pass runs the tasks
// (expert with pairs, block of sixteen channels): each selected expert's weights are read
// once. A pair's result is what its expert's weight alone gives its row.
template <typename Quantized>
at::Tensor lowbit_moe_rows(const Quantized& quantized, int64_t R, int64_t K, const int64_t* rp,
                           const at::Tensor& experts, const at::Tensor& q, const at::Tensor& d,
                           const at::Tensor& m, int64_t bits, bool vector,
                           const std::optional<at::Tensor>& lut) {
  check_lowbit_args(bits, vector, lut);
  TORCH_CHECK(q.dim() == 4 && q.is_contiguous() && q.scalar_type() == at::kByte &&
                  q.size(3) == 64 * bits,
              "lowbit moe linear: q must be uint8 [E, N/16, K/32, 64 * bits]");
  const int64_t E = q.size(0), N = q.size(1) * 16;
  TORCH_CHECK(q.size(2) * 32 == K, "lowbit moe linear: x has ", K, " inputs, the weights ",
              q.size(2) * 32);
  TORCH_CHECK(experts.dim() == 1 && experts.scalar_type() == at::kLong &&
                  experts.is_contiguous() && experts.device().is_cpu(),
              "lowbit moe linear: experts must be int64 [P] on the CPU");
  const int64_t P = experts.size(0);
  check_scales(d, m, N, K, E, bits);
  TORCH_CHECK(rp || R == P, "lowbit moe linear: without rows, x has one row per pair");
  const int64_t* ep = experts.data_ptr<int64_t>();
  // Group the pairs by expert: starts[e] .. starts[e + 1] of `order`.
  std::vector<int64_t> starts(E + 1, 0), order(P);
  for (int64_t p = 0; p < P; ++p) {
    TORCH_CHECK(ep[p] >= 0 && ep[p] < E, "lowbit moe linear: expert ", ep[p], " out of range");
    TORCH_CHECK(!rp || (rp[p] >= 0 && rp[p] < R), "lowbit moe linear: row out of range");
    ++starts[ep[p] + 1];
  }
  for (int64_t e = 0; e < E; ++e) starts[e + 1] += starts[e];
  {
    std::vector<int64_t> next(starts.begin(), starts.end() - 1);
    for (int64_t p = 0; p < P; ++p) order[next[ep[p]]++] = p;
  }
  at::Tensor y = at::empty({P, N}, at::TensorOptions().dtype(at::kBFloat16));
  if (P == 0) return y;
  // The rows laid out in the grouped order.
  const RowsQ8 xq = quantized();
  const int64_t groups = K / 32;
  RowsQ8 grouped(P, K);
  at::parallel_for(0, P, 256, [&](int64_t begin, int64_t end) {  // a prompt's, not a decode's
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = rp ? rp[order[i]] : order[i];
      std::memcpy(grouped.q.data() + i * K, xq.q.data() + r * K, K);
      std::memcpy(grouped.d.data() + i * groups, xq.d.data() + r * groups, groups * 4);
      std::memcpy(grouped.s.data() + i * groups, xq.s.data() + r * groups, groups * 4);
    }
  });
  std::vector<int64_t> active;  // the experts with pairs
  for (int64_t e = 0; e < E; ++e)
    if (starts[e + 1] > starts[e]) active.push_back(e);
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const uint8_t* table = lut.has_value() ? lut->data_ptr<uint8_t>() : nullptr;
  c10::BFloat16* yp = y.data_ptr<c10::BFloat16>();  // pair order[i]'s row from grouped row i
  const int64_t blocks = N / 16, q_expert = q.numel() / E, s_expert = d.numel() / E;
  const std::vector<int32_t> hs = bits == 6 ? half_sums(grouped, P, K) : std::vector<int32_t>();
  // A task, one expert's block of sixteen channels, costs its rows, or reading its weights
  // where that takes longer: about eight rows' arithmetic.
  const auto cost = [&](int64_t t) {
    const int64_t e = active[t / blocks];
    return std::max<int64_t>(starts[e + 1] - starts[e], 8);
  };
  with_scales(d, m, [&](const auto* dp, const auto* mp) {
    split_by_cost(static_cast<int64_t>(active.size()) * blocks, cost,
                  [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const int64_t e = active[t / blocks], b = t % blocks;
        const int64_t first = starts[e], count = starts[e + 1] - starts[e];
        const uint8_t* qe = qp + e * q_expert;
        const auto *de = dp + e * s_expert, *me = mp + e * s_expert;
        if constexpr (is_six_bit_scales<decltype(dp)>)
          lowbit_block<6>(grouped, qe, de, me, yp, first, count, N, K, b, vector, table,
                          hs.data(), order.data());
        else if (bits == 4)
          lowbit_block<4>(grouped, qe, de, me, yp, first, count, N, K, b, vector, table,
                          nullptr, order.data());
        else
          lowbit_block<8>(grouped, qe, de, me, yp, first, count, N, K, b, vector, table,
                          nullptr, order.data());
      }
    });
  });
  return y;
}

// lowbit_moe_rows on bfloat16 rows x [R, K], pair p taking row rows[p] (row p without
// `rows`).
at::Tensor lowbit_moe_linear(const at::Tensor& x, const std::optional<at::Tensor>& rows,
                             const at::Tensor& experts, const at::Tensor& q,
                             const at::Tensor& d, const at::Tensor& m, int64_t bits,
                             bool vector, const std::optional<at::Tensor>& lut) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16,
              "lowbit moe linear: x must be contiguous bfloat16 [M, K]");
  const int64_t R = x.size(0), K = x.size(1);
  const int64_t* rp = nullptr;
  if (rows.has_value()) {
    TORCH_CHECK(rows->dim() == 1 && rows->size(0) == experts.numel() &&
                    rows->scalar_type() == at::kLong && rows->is_contiguous() &&
                    rows->device().is_cpu(),
                "lowbit moe linear: rows must be int64 [P] on the CPU, one per expert");
    rp = rows->data_ptr<int64_t>();
  }
  const auto quantized = [&] { return quantize_rows(x.data_ptr<c10::BFloat16>(), R, K); };
  return lowbit_moe_rows(quantized, R, K, rp, experts, q, d, m, bits, vector, lut);
}

}  // namespace
