// Paged decode attention over the KV blocks in place (see ops.cpp).
#pragma once

#include "common.h"

namespace {

#if defined(LUCEDESK_AVX512BF16)
// scores[r] = scale * q . k_r for the `rows` (<= 16) key rows at kb, bf16 pairs multiplied
// by vdpbf16ps straight from the cache (no widening pass), one accumulator per key row.
inline void scores16_bf16(const c10::BFloat16* q, const c10::BFloat16* kb, int64_t rows,
                          int64_t hd, float scale, float* scores) {
  __m512 acc[16];
#pragma GCC unroll 16
  for (int r = 0; r < 16; ++r) acc[r] = _mm512_setzero_ps();
  if (rows == 16) {
    for (int64_t c = 0; c < hd; c += 32) {
      const __m512bh qv = (__m512bh)_mm512_loadu_si512(q + c);
#pragma GCC unroll 16
      for (int r = 0; r < 16; ++r)
        acc[r] = _mm512_dpbf16_ps(acc[r], qv, (__m512bh)_mm512_loadu_si512(kb + r * hd + c));
    }
  } else {
    for (int64_t c = 0; c < hd; c += 32) {
      const __m512bh qv = (__m512bh)_mm512_loadu_si512(q + c);
      for (int64_t r = 0; r < rows; ++r)
        acc[r] = _mm512_dpbf16_ps(acc[r], qv, (__m512bh)_mm512_loadu_si512(kb + r * hd + c));
    }
  }
  const __m512 s = _mm512_mul_ps(sum16(acc), _mm512_set1_ps(scale));
  _mm512_mask_storeu_ps(scores, static_cast<__mmask16>((1u << rows) - 1), s);
}
// out = inv_sum * sum_j p[j] v_j over a sequence's value rows, read in place: pairs of rows
// interleaved (v_j[e], v_j+1[e]) and multiplied with (p[j], p[j+1]) in bf16 by vdpbf16ps.
// Unpacking within 128-bit lanes leaves the accumulators in the order
//   lo: e 0-3, 8-11, 16-19, 24-27    hi: e 4-7, 12-15, 20-23, 28-31
// of each 32-wide slice; two permutes restore it at the end.
inline void weighted_values_bf16(const float* p, const c10::BFloat16* vp, const int32_t* table,
                                 int64_t head, int64_t num_blocks, int64_t bs, int64_t begin,
                                 int64_t len, int64_t hd, float inv_sum, c10::BFloat16* out) {
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second =
      _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  // (p[2i], p[2i + 1]) as one bf16 pair per 32 bits; blocks have an even number of rows,
  // so a pair never straddles two blocks.
  // `begin` (a block's first row, so even) is the first value row with a weight.
  std::vector<int32_t> pairs((len + 1) / 2);
  for (int64_t i = begin; i < len; i += 2) {
    const uint32_t upper = i + 1 < len ? c10::BFloat16(p[i + 1]).x : 0;
    pairs[i / 2] = static_cast<int32_t>(upper << 16 | c10::BFloat16(p[i]).x);
  }
  for (int64_t c = 0; c < hd; c += 32) {
    __m512 lo = _mm512_setzero_ps(), hi = _mm512_setzero_ps();
    for (int64_t j0 = begin; j0 < len; j0 += bs) {
      const c10::BFloat16* vb = vp + ((head * num_blocks + table[j0 / bs]) * bs) * hd + c;
      const int64_t rows = std::min(bs, len - j0);
      for (int64_t r = 0; r < rows; r += 2) {
        const __m512i a = _mm512_loadu_si512(vb + r * hd);
        const __m512i b =
            r + 1 < rows ? _mm512_loadu_si512(vb + (r + 1) * hd) : _mm512_setzero_si512();
        const __m512bh pp = (__m512bh)_mm512_set1_epi32(pairs[(j0 + r) / 2]);
        lo = _mm512_dpbf16_ps(lo, pp, (__m512bh)_mm512_unpacklo_epi16(a, b));
        hi = _mm512_dpbf16_ps(hi, pp, (__m512bh)_mm512_unpackhi_epi16(a, b));
      }
    }
    const __m512 scale = _mm512_set1_ps(inv_sum);
    const __m512 o0 = _mm512_mul_ps(_mm512_permutex2var_ps(lo, first, hi), scale);
    const __m512 o1 = _mm512_mul_ps(_mm512_permutex2var_ps(lo, second, hi), scale);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + c), (__m256i)_mm512_cvtneps_pbh(o0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + c + 16),
                        (__m256i)_mm512_cvtneps_pbh(o1));
  }
}
#endif

template <typename T>
void decode_attention(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                      const at::Tensor& v_cache, const at::Tensor& block_tables,
                      const at::Tensor& seq_lens, double scale, int64_t window,
                      const float* sinks) {
  // q, out: [D, nh, hd] (head_dim contiguous); caches: [kvh, num_blocks, bs, hd] contiguous;
  // block_tables: [>=D, max_blocks] int32 contiguous; seq_lens: [>=D] int32. A row sees the
  // last `window` keys (0: all); sinks (nullable, [nh]) join each head's softmax denominator.
  const int64_t D = q.size(0), nh = q.size(1), hd = q.size(2);
  const int64_t kvh = k_cache.size(0), num_blocks = k_cache.size(1), bs = k_cache.size(2);
  const int64_t group = nh / kvh;
  const int64_t table_width = block_tables.size(1);
  const int64_t q_stride_row = q.stride(0), q_stride_head = q.stride(1);
  const int64_t o_stride_row = out.stride(0), o_stride_head = out.stride(1);
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, D * kvh, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * hd), acc(group * hd), kf(bs * hd), inv_sum(group), scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t row = task / kvh, head = task % kvh;
      const int64_t len = lens[row];
      const int32_t* table = tables + row * table_width;
      // Keys first..len-1 are seen; blocks are walked from the one holding `first`, whose
      // earlier rows get weight 0.
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t block_start = first / bs * bs;
      scores.assign(group * len, 0.f);
      for (int64_t g = 0; g < group; ++g) {
        const T* src = qp + row * q_stride_row + (head * group + g) * q_stride_head;
        for (int64_t e = 0; e < hd; ++e) qf[g * hd + e] = load_f(src[e]) * fscale;
      }
      // Pass 1: scores[g, j] = q_g . k_j over this sequence's blocks, read in place. Each
      // block (bs x hd contiguous values) is widened to float once, then dotted; in bf16
      // with AVX512-BF16, dotted as stored, sixteen key rows at a time.
      bool scored = false;
#if defined(LUCEDESK_AVX512BF16)
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        if (hd % 32 == 0 && bs % 16 == 0) {
          for (int64_t j0 = block_start; j0 < len; j0 += 16) {
            const T* kb = kp + ((head * num_blocks + table[j0 / bs]) * bs + j0 % bs) * hd;
            for (int64_t g = 0; g < group; ++g) {
              const T* qg = qp + row * q_stride_row + (head * group + g) * q_stride_head;
              scores16_bf16(qg, kb, std::min<int64_t>(16, len - j0), hd, fscale,
                            scores.data() + g * len + j0);
            }
          }
          scored = true;
        }
      }
#endif
      for (int64_t j0 = block_start; j0 < len && !scored; j0 += bs) {
        const int64_t rows = std::min(bs, len - j0);
        widen(kf.data(), kp + ((head * num_blocks + table[j0 / bs]) * bs) * hd, rows * hd);
        for (int64_t r = 0; r < rows; ++r) {
          const float* krow = kf.data() + r * hd;
          for (int64_t g = 0; g < group; ++g) {
            const float* qg = qf.data() + g * hd;
            float s = 0.f;
#pragma omp simd reduction(+ : s)
            for (int64_t e = 0; e < hd; ++e) s += qg[e] * krow[e];
            scores[g * len + j0 + r] = s;
          }
        }
      }
      // Softmax per query head, then pass 2: acc[g] = sum_j p[g, j] v_j.
      for (int64_t g = 0; g < group; ++g) {
        float* sg = scores.data() + g * len;
        float mx = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : mx)
        for (int64_t j = first; j < len; ++j) mx = sg[j] > mx ? sg[j] : mx;
        const float sink = sinks ? sinks[head * group + g] : 0.f;
        if (sinks) mx = std::max(mx, sink);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = first; j < len; ++j) {
          sg[j] = exp_nonpositive(sg[j] - mx);
          sum += sg[j];
        }
        if (sinks) sum += exp_nonpositive(sink - mx);
        std::fill(sg + block_start, sg + first, 0.f);
        inv_sum[g] = 1.f / sum;
      }
#if defined(LUCEDESK_AVX512BF16)
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        if (hd % 32 == 0) {
          for (int64_t g = 0; g < group; ++g) {
            T* dst = op + row * o_stride_row + (head * group + g) * o_stride_head;
            weighted_values_bf16(scores.data() + g * len, vp, table, head, num_blocks, bs,
                                 block_start, len, hd, inv_sum[g], dst);
          }
          continue;
        }
      }
#endif
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j0 = block_start; j0 < len; j0 += bs) {
        const int64_t rows = std::min(bs, len - j0);
        widen(kf.data(), vp + ((head * num_blocks + table[j0 / bs]) * bs) * hd, rows * hd);
        // Four rows per pass over the accumulator: one load and store of it per four
        // multiply-adds.
        for (int64_t g = 0; g < group; ++g) {
          const float* pg = scores.data() + g * len + j0;
          float* ag = acc.data() + g * hd;
          int64_t r = 0;
          for (; r + 4 <= rows; r += 4) {
            const float p0 = pg[r], p1 = pg[r + 1], p2 = pg[r + 2], p3 = pg[r + 3];
            const float* v0 = kf.data() + r * hd;
#pragma omp simd
            for (int64_t e = 0; e < hd; ++e)
              ag[e] += (p0 * v0[e] + p1 * v0[hd + e]) + (p2 * v0[2 * hd + e] + p3 * v0[3 * hd + e]);
          }
          for (; r < rows; ++r) {
            const float p = pg[r];
            const float* v = kf.data() + r * hd;
#pragma omp simd
            for (int64_t e = 0; e < hd; ++e) ag[e] += p * v[e];
          }
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        T* dst = op + row * o_stride_row + (head * group + g) * o_stride_head;
        for (int64_t e = 0; e < hd; ++e) dst[e] = narrow<T>(acc[g * hd + e] * inv_sum[g]);
      }
    }
  });
}

void paged_decode_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_tables,
                            const at::Tensor& seq_lens, double scale, int64_t window,
                            const std::optional<at::Tensor>& sinks) {
  TORCH_CHECK(window >= 0, "paged decode attention: window must be >= 0");
  const float* sink_ptr = nullptr;
  if (sinks.has_value()) {
    TORCH_CHECK(sinks->scalar_type() == at::kFloat && sinks->is_contiguous() &&
                    sinks->dim() == 1 && sinks->size(0) == q.size(1),
                "paged decode attention: sinks must be contiguous float32 [num_heads]");
    sink_ptr = sinks->data_ptr<float>();
  }
  dispatch(q.scalar_type(), [&](auto zero) {
    using scalar_t = decltype(zero);
    decode_attention<scalar_t>(out, q, k_cache, v_cache, block_tables, seq_lens, scale, window,
                               sink_ptr);
  });
}

}  // namespace
