// Weight-only int8 matmuls: plain loops for any CPU, AMX tiles where present.
#pragma once

#include "common.h"

namespace {

// Weight-only int8 with one affine scale per group of 32 inputs: w[n, k] = d * q + m for the
// group holding k, q in [-128, 127]. A llama.cpp Q4_0/Q4_1/Q8_0/Q4_K group is exactly such
// a grid, so those weights come back as the values the loader dequantized; others lose at
// most (max - min) / 510 of their group's range. Every weight is widened to bf16 (as the
// bf16 model holds it) before the multiply, and each output accumulates over K in one fixed
// order whatever the number of rows: a row's result never depends on its batch.

void check_int8_inputs(const at::Tensor& x, const at::Tensor& d, const at::Tensor& m, int64_t N,
                       int64_t K) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16,
              "int8 linear: x must be contiguous bfloat16 [M, K]");
  TORCH_CHECK(x.size(1) == K, "int8 linear: x has ", x.size(1), " inputs, the weights ", K);
  TORCH_CHECK(d.scalar_type() == at::kFloat && m.scalar_type() == at::kFloat &&
                  d.is_contiguous() && m.is_contiguous() && d.numel() == N * (K / 32) &&
                  m.numel() == N * (K / 32),
              "int8 linear: group scales d and m must be float32, one per 32 inputs");
}

// Rows layout: q [N, K], d and m [N, K / 32]. Plain loops; any CPU.
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& d,
                       const at::Tensor& m) {
  TORCH_CHECK(q.dim() == 2 && q.is_contiguous() && q.scalar_type() == at::kChar,
              "int8 linear: q must be contiguous int8 [N, K]");
  const int64_t M = x.size(0), N = q.size(0), K = q.size(1), groups = K / 32;
  TORCH_CHECK(K % 32 == 0, "int8 linear: K must be a multiple of 32");
  check_int8_inputs(x, d, m, N, K);
  at::Tensor y = at::empty({M, N}, x.options());
  const c10::BFloat16* xp = x.data_ptr<c10::BFloat16>();
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* dp = d.data_ptr<float>();
  const float* mp = m.data_ptr<float>();
  c10::BFloat16* yp = y.data_ptr<c10::BFloat16>();
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> wf(K);
    for (int64_t n = begin; n < end; ++n) {
      for (int64_t k = 0; k < K; ++k) {
        const int64_t g = n * groups + k / 32;
        wf[k] = round_to<c10::BFloat16>(dp[g] * static_cast<float>(qp[n * K + k]) + mp[g]);
      }
      for (int64_t r = 0; r < M; ++r) {
        const c10::BFloat16* xr = xp + r * K;
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t k = 0; k < K; ++k) dot += load_f(xr[k]) * wf[k];
        yp[r * N + n] = static_cast<c10::BFloat16>(dot);
      }
    }
  });
  return y;
}

#if defined(LUCEDESK_AMX)
// AMX: the tile registers need the kernel's permission once per process.
bool amx_permitted() {
  static const bool permitted = [] {
    constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return permitted;
}

struct TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles layout, per sixteen output channels and 32 inputs (one group):
//   q [N/16, K/32, 16, 16, 2]: tile row r holds each channel's inputs 2r and 2r + 1, the
//     pair layout TDPBF16PS multiplies;
//   d, m [N/16, K/32, 16]: the sixteen channels' group scales.
// Each block of sixteen channels is widened to bf16 once per call (d * q + m, rounded to
// bf16) and multiplied with the activations sixteen rows at a time.
void int8_linear_amx_rows(const c10::BFloat16* x, const int8_t* q, const float* d,
                          const float* mn, c10::BFloat16* y, int64_t M, int64_t N, int64_t K) {
  const int64_t chunks = K / 32;
  // Lane i of a pair-row belongs to channel i / 2 (low half) or 8 + i / 2 (high half).
  const __m512i pair_lo = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  const __m512i pair_hi =
      _mm512_setr_epi32(8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15);
  at::parallel_for(0, N / 16, 4, [&](int64_t begin, int64_t end) {
    std::vector<c10::BFloat16> bbuf(chunks * 16 * 32);
    alignas(64) float cbuf[16 * 16];
    int64_t configured_rows = -1;
    for (int64_t b = begin; b < end; ++b) {
      const int8_t* src = q + b * chunks * 512;
      if (b + 1 < end)  // the next block is on its way while this one computes
        for (int64_t off = 0; off < chunks * 512; off += 64)
          _mm_prefetch(reinterpret_cast<const char*>(src + chunks * 512 + off), _MM_HINT_T0);
      for (int64_t c = 0; c < chunks; ++c) {
        const __m512 dv = _mm512_loadu_ps(d + (b * chunks + c) * 16);
        const __m512 mv = _mm512_loadu_ps(mn + (b * chunks + c) * 16);
        const __m512 d_lo = _mm512_permutexvar_ps(pair_lo, dv), d_hi = _mm512_permutexvar_ps(pair_hi, dv);
        const __m512 m_lo = _mm512_permutexvar_ps(pair_lo, mv), m_hi = _mm512_permutexvar_ps(pair_hi, mv);
        for (int64_t r = 0; r < 16; ++r) {
          const int8_t* row = src + c * 512 + 32 * r;
          const __m512 lo = _mm512_cvtepi32_ps(
              _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row))));
          const __m512 hi = _mm512_cvtepi32_ps(
              _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16))));
          const __m512bh w = _mm512_cvtne2ps_pbh(_mm512_fmadd_ps(hi, d_hi, m_hi),
                                                 _mm512_fmadd_ps(lo, d_lo, m_lo));
          _mm512_storeu_si512(bbuf.data() + c * 512 + 32 * r, (__m512i)w);
        }
      }
      for (int64_t m0 = 0; m0 < M; m0 += 16) {
        const int64_t rows = std::min<int64_t>(16, M - m0);
        if (rows != configured_rows) {
          TileConfig cfg;
          cfg.rows[0] = rows, cfg.colsb[0] = 64;  // C: rows x 16 fp32
          cfg.rows[1] = rows, cfg.colsb[1] = 64;  // A: rows x 32 bf16
          cfg.rows[2] = 16, cfg.colsb[2] = 64;    // B: 16 pair-rows x 16 channels
          _tile_loadconfig(&cfg);
          configured_rows = rows;
        }
        _tile_zero(0);
        for (int64_t c = 0; c < chunks; ++c) {
          _tile_loadd(1, x + m0 * K + 32 * c, K * 2);
          _tile_loadd(2, bbuf.data() + c * 512, 64);
          _tile_dpbf16ps(0, 1, 2);
        }
        _tile_stored(0, cbuf, 64);
        for (int64_t r = 0; r < rows; ++r) {
          const __m256bh out = _mm512_cvtneps_pbh(_mm512_load_ps(cbuf + 16 * r));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + (m0 + r) * N + b * 16), (__m256i)out);
        }
      }
    }
    if (configured_rows >= 0) _tile_release();
  });
}
#endif

bool int8_amx_available() {
#if defined(LUCEDESK_AMX)
  return amx_permitted();
#else
  return false;
#endif
}

at::Tensor int8_linear_tiles(const at::Tensor& x, const at::Tensor& q, const at::Tensor& d,
                             const at::Tensor& m) {
  TORCH_CHECK(int8_amx_available(), "int8 linear: AMX tiles are not available here");
  TORCH_CHECK(q.dim() == 5 && q.is_contiguous() && q.scalar_type() == at::kChar &&
                  q.size(2) == 16 && q.size(3) == 16 && q.size(4) == 2,
              "int8 linear: tiled q must be int8 [N/16, K/32, 16, 16, 2]");
  const int64_t N = q.size(0) * 16, K = q.size(1) * 32;
  check_int8_inputs(x, d, m, N, K);
  at::Tensor y = at::empty({x.size(0), N}, x.options());
#if defined(LUCEDESK_AMX)
  int8_linear_amx_rows(x.data_ptr<c10::BFloat16>(), q.data_ptr<int8_t>(), d.data_ptr<float>(),
                       m.data_ptr<float>(), y.data_ptr<c10::BFloat16>(), x.size(0), N, K);
#endif
  return y;
}

}  // namespace
