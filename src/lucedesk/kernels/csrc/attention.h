// Paged decode attention over the KV blocks in place (see ops.cpp).
#pragma once

#include "common.h"

namespace {

// An 8-bit cache's levels -> float (its scales are applied to the scores and the weights).
inline void widen(float* dst, const int8_t* src, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// The rows of one sequence that a decode task attends for: row i (of n) sees keys
// first[i]..end[i]-1 and its blocks are walked from begin[i] (first[i] rounded down to a
// block). Row 0 begins earliest and row n-1 ends last, so [begin[0], end[n-1]) covers all.
struct QueryRows {
  int64_t n;
  std::vector<int64_t> first, begin, end;
  // Does row i walk the block at key j0 (a block's first row)?
  bool walks(int64_t i, int64_t j0) const { return j0 >= begin[i] && j0 < end[i]; }
};

// Blocks a decode's key and value passes ask for ahead of the one they are on.
constexpr int64_t kPrefetchBlocks = 2;

// The rows of the block kPrefetchBlocks past the one holding key j0 into the cache, from
// the block table: a sequence's blocks lie anywhere in the pool, so the hardware
// prefetcher cannot see where the next one is, and a decode reads each of them once
// (16 sequences at 4k tokens: 2.2 -> 1.7 ms a layer, their K/V read cold).
template <typename C>
inline void prefetch_block(const C* cache, const int32_t* table, int64_t j0, int64_t len,
                           int64_t head, int64_t num_blocks, int64_t bs, int64_t hd) {
  const int64_t b = j0 / bs + kPrefetchBlocks;
  if (b * bs >= len) return;
  const char* block =
      reinterpret_cast<const char*>(cache + (head * num_blocks + table[b]) * bs * hd);
  for (int64_t t = 0; t < static_cast<int64_t>(bs * hd * sizeof(C)); t += 64)
    __builtin_prefetch(block + t, 0, 3);
}

#if defined(LUCEDESK_AVX512BF16)
// n (a multiple of 32) 8-bit levels as bf16, exactly (|level| <= 127 < 2^8).
inline void levels_to_bf16(c10::BFloat16* dst, const int8_t* src, int64_t n) {
  for (int64_t i = 0; i < n; i += 32) {
    const __m512 lo = _mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
    const __m512 hi = _mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 16))));
    _mm512_storeu_si512(dst + i, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
  }
}

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
// acc[k] += the first `rows` value rows of a block (one 32-wide slice) weighed by heads
// k < H's probability pairs (ph + k * half): (lo, hi) of head k at acc + k * step. Pairs of
// rows come interleaved in `inter`; a row count that ends mid-pair pairs its last row
// with zeros, as a one-row decode does at its context's end.
template <int H>
inline void weigh_value_pairs(float* acc, int64_t step, const int32_t* ph, int64_t half,
                              const int32_t* inter, const c10::BFloat16* vb, int64_t hd,
                              int64_t rows) {
  __m512 lo[H], hi[H];
#pragma GCC unroll 4
  for (int k = 0; k < H; ++k) {
    lo[k] = _mm512_loadu_ps(acc + k * step);
    hi[k] = _mm512_loadu_ps(acc + k * step + 16);
  }
  for (int64_t r = 0; r < rows; r += 2) {
    __m512i vlo, vhi;
    if (r + 1 < rows) {
      vlo = _mm512_loadu_si512(inter + r * 16);
      vhi = _mm512_loadu_si512(inter + (r + 1) * 16);
    } else {
      const __m512i a = _mm512_loadu_si512(vb + r * hd);
      vlo = _mm512_unpacklo_epi16(a, _mm512_setzero_si512());
      vhi = _mm512_unpackhi_epi16(a, _mm512_setzero_si512());
    }
#pragma GCC unroll 4
    for (int k = 0; k < H; ++k) {
      const __m512bh pp = (__m512bh)_mm512_set1_epi32(ph[k * half + r / 2]);
      lo[k] = _mm512_dpbf16_ps(lo[k], pp, (__m512bh)vlo);
      hi[k] = _mm512_dpbf16_ps(hi[k], pp, (__m512bh)vhi);
    }
  }
#pragma GCC unroll 4
  for (int k = 0; k < H; ++k) {
    _mm512_storeu_ps(acc + k * step, lo[k]);
    _mm512_storeu_ps(acc + k * step + 16, hi[k]);
  }
}

// out[i, g] = inv_sum[i, g] * sum_j p[i, g, j] v_j for each row i and query head g of a
// sequence, its value rows read in place once for all of them (blocks outer, rows inner).
// p[i, g] starts at p + (i * group + g) * stride. Pairs of value rows interleaved
// (v_j[e], v_j+1[e]) are multiplied with (p[j], p[j+1]) in bf16 by vdpbf16ps. Unpacking
// within 128-bit lanes leaves the accumulators in the order
//   lo: e 0-3, 8-11, 16-19, 24-27    hi: e 4-7, 12-15, 20-23, 28-31
// of each 32-wide slice; two permutes restore it at the end. Each (i, g) sums its rows in
// the same order whatever the other rows are: a row's result does not depend on them.
// An 8-bit cache (C = int8_t) has each block's slice of levels widened to bf16 first (exact;
// its scales are already in p).
template <typename C>
void weighted_values_bf16(const float* p, int64_t stride, const QueryRows& rows_of,
                          int64_t group, const C* vp, const int32_t* table, int64_t head,
                          int64_t num_blocks, int64_t bs, int64_t hd, const float* inv_sum,
                          c10::BFloat16* const* outs) {
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second =
      _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  const int64_t n = rows_of.n, heads = n * group, half = (stride + 1) / 2;
  // (p[2i], p[2i + 1]) as one bf16 pair per 32 bits; blocks have an even number of rows,
  // so a pair never straddles two blocks. `begin` (a block's first row, so even) is the
  // first value row with a weight.
  // Thirty-two probabilities at a time rounded to bf16 (to nearest even, as c10 rounds),
  // a masked tail reading zeros past the end. A subnormal weight (a tiny probability
  // times an 8-bit value's scale) becomes 0 here where c10 would keep a subnormal bf16;
  // vdpbf16ps takes subnormal inputs as 0 either way, so the products are the same.
  std::vector<int32_t> pairs(heads * half);
  for (int64_t h = 0; h < heads; ++h) {
    const int64_t begin = rows_of.begin[h / group], len = rows_of.end[h / group];
    const float* ph = p + h * stride;
    for (int64_t i = begin; i < len; i += 32) {
      const int64_t left = std::min<int64_t>(32, len - i);
      const __mmask16 lo_mask = static_cast<__mmask16>(left >= 16 ? 0xFFFF : (1u << left) - 1);
      const __mmask16 hi_mask =
          static_cast<__mmask16>(left >= 32 ? 0xFFFF : left > 16 ? (1u << (left - 16)) - 1 : 0);
      const __m512 lo = _mm512_maskz_loadu_ps(lo_mask, ph + i);
      const __m512 hi = _mm512_maskz_loadu_ps(hi_mask, ph + i + 16);
      const __mmask16 store =
          static_cast<__mmask16>(left >= 32 ? 0xFFFF : (1u << ((left + 1) / 2)) - 1);
      _mm512_mask_storeu_epi32(pairs.data() + h * half + i / 2, store,
                               (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
  }
  // (lo, hi) of each row, head and 32-wide slice: acc + (h * slices + c / 32) * 32.
  const int64_t slices = hd / 32;
  std::vector<float> acc(heads * hd, 0.f);
  // A block's value rows interleaved in pairs once per slice, for every row and head that
  // weighs them: (lo, hi) of pair r / 2 of slice c at inter + c / 32 * span + r * 16 and
  // (r + 1) * 16, span room for an odd block's last pair. Each block is read once, all
  // its slices together.
  const int64_t span = (bs + 1) * 16;
  std::vector<int32_t> inter(slices * span);
  std::vector<c10::BFloat16> wide(std::is_same_v<C, int8_t> ? bs * 32 : 0);
  const int64_t stop = rows_of.end[n - 1];
  for (int64_t j0 = rows_of.begin[0]; j0 < stop; j0 += bs) {
    const int64_t block_rows = std::min(bs, stop - j0);
    prefetch_block(vp, table, j0, stop, head, num_blocks, bs, hd);
    for (int64_t c = 0; c < hd; c += 32) {
      const C* block = vp + ((head * num_blocks + table[j0 / bs]) * bs) * hd + c;
      int32_t* slice_inter = inter.data() + c / 32 * span;
      // The slice's rows as bf16, `row` apart: in place, or widened from 8-bit levels.
      const c10::BFloat16* vb;
      int64_t row;
      if constexpr (std::is_same_v<C, int8_t>) {
        for (int64_t r = 0; r < block_rows; ++r)
          levels_to_bf16(wide.data() + r * 32, block + r * hd, 32);
        vb = wide.data(), row = 32;
      } else {
        vb = block, row = hd;
      }
      for (int64_t r = 0; r < block_rows; r += 2) {
        const __m512i a = _mm512_loadu_si512(vb + r * row);
        const __m512i b =
            r + 1 < block_rows ? _mm512_loadu_si512(vb + (r + 1) * row) : _mm512_setzero_si512();
        _mm512_storeu_si512(slice_inter + r * 16, _mm512_unpacklo_epi16(a, b));
        _mm512_storeu_si512(slice_inter + (r + 1) * 16, _mm512_unpackhi_epi16(a, b));
      }
      for (int64_t i = 0; i < n; ++i) {
        if (!rows_of.walks(i, j0)) continue;
        const int64_t rows = std::min(bs, rows_of.end[i] - j0);
        // Up to four heads at once: their sums are independent chains of vdpbf16ps, each
        // in its own order, so interleaving them hides the instruction's latency.
        for (int64_t h = i * group; h < (i + 1) * group;) {
          const int64_t left = (i + 1) * group - h;
          const int32_t* ph = pairs.data() + h * half + j0 / 2;
          float* ah = acc.data() + (h * slices + c / 32) * 32;
          const int64_t step = slices * 32;  // from one head's slice to the next head's
          if (left >= 4) {
            weigh_value_pairs<4>(ah, step, ph, half, slice_inter, vb, row, rows);
          } else if (left == 3) {
            weigh_value_pairs<3>(ah, step, ph, half, slice_inter, vb, row, rows);
          } else if (left == 2) {
            weigh_value_pairs<2>(ah, step, ph, half, slice_inter, vb, row, rows);
          } else {
            weigh_value_pairs<1>(ah, step, ph, half, slice_inter, vb, row, rows);
          }
          h += std::min<int64_t>(left, 4);
        }
      }
    }
  }
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t c = 0; c < hd; c += 32) {
      const float* ah = acc.data() + (h * slices + c / 32) * 32;
      const __m512 lo = _mm512_loadu_ps(ah), hi = _mm512_loadu_ps(ah + 16);
      const __m512 scale = _mm512_set1_ps(inv_sum[h]);
      const __m512 o0 = _mm512_mul_ps(_mm512_permutex2var_ps(lo, first, hi), scale);
      const __m512 o1 = _mm512_mul_ps(_mm512_permutex2var_ps(lo, second, hi), scale);
      c10::BFloat16* out = outs[h] + c;
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), (__m256i)_mm512_cvtneps_pbh(o0));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 16), (__m256i)_mm512_cvtneps_pbh(o1));
    }
  }
}
#endif

// C, the cache's type: T, or int8_t for an 8-bit cache whose float scales k_scales /
// v_scales ([kvh, num_blocks, bs], one per token and KV head) multiply each key's score
// and each value's weight (p_j * s_j), so the arithmetic stays in float.
template <typename T, typename C>
void decode_attention(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                      const at::Tensor& v_cache, const at::Tensor& block_tables,
                      const at::Tensor& seq_lens, const at::Tensor& query_start, double scale,
                      int64_t window, const float* sinks, const float* k_scales,
                      const float* v_scales) {
  constexpr bool kQuantized = std::is_same_v<C, int8_t>;
  // bf16 activations over a bf16 cache, or over an 8-bit one widened to bf16 block by block:
  // both products by vdpbf16ps.
  constexpr bool kBf16Path =
      std::is_same_v<T, c10::BFloat16> && (std::is_same_v<C, T> || kQuantized);
  // q, out: [R, nh, hd] (head_dim contiguous), the query rows of S sequences; query_start:
  // [S + 1] int32, sequence s owning rows query_start[s]..query_start[s + 1] - 1; caches:
  // [kvh, num_blocks, bs, hd] contiguous; block_tables: [>=S, max_blocks] int32 contiguous;
  // seq_lens: [>=S] int32. Row i of a sequence with n rows sees keys up to its causal end
  // seq_len - (n - 1 - i), and of those the last `window` (0: all); sinks (nullable, [nh])
  // join each head's softmax denominator. A row's arithmetic is the same whatever the other
  // rows of its sequence: the result of one sequence of n rows equals n sequences of one.
  const int64_t S = query_start.size(0) - 1, nh = q.size(1), hd = q.size(2);
  const int64_t kvh = k_cache.size(0), num_blocks = k_cache.size(1), bs = k_cache.size(2);
  const int64_t full = nh / kvh;  // query heads per KV head
  const int64_t table_width = block_tables.size(1);
  const int64_t q_stride_row = q.stride(0), q_stride_head = q.stride(1);
  const int64_t o_stride_row = out.stride(0), o_stride_head = out.stride(1);
  const T* qp = q.data_ptr<T>();
  const C* kp = k_cache.data_ptr<C>();
  const C* vp = v_cache.data_ptr<C>();
  T* op = out.data_ptr<T>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* starts = query_start.data_ptr<int32_t>();
  const float fscale = static_cast<float>(scale);

  // A task is one sequence's KV head for `group / parts` of its query heads (each query
  // head's arithmetic is its own: the same bits however the group is split). One part
  // while there are tasks enough for the threads; with fewer sequences, such as one
  // stream on a model with one or three KV heads, the group is split so that no thread
  // waits, each part reading the blocks on its own.
  const int64_t tasks = S * kvh, wanted = 2 * static_cast<int64_t>(at::get_num_threads());
  const int64_t parts =
      tasks == 0 ? 1 : std::clamp<int64_t>((wanted + tasks - 1) / tasks, 1, full);
  at::parallel_for(0, tasks * parts, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf, acc, kf(bs * hd), inv_sum, scores;
    std::vector<c10::BFloat16> kwide(kBf16Path && kQuantized ? 16 * hd : 0);
    std::vector<T*> outs;
    QueryRows rows_of;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t seq = task / (kvh * parts), head = task / parts % kvh, part = task % parts;
      // This task's query heads: g0..g0 + group - 1 of the KV head's `full` (query head
      // head * full + g0 + g).
      const int64_t g0 = part * full / parts, group = (part + 1) * full / parts - g0;
      const int64_t row0 = starts[seq], n = starts[seq + 1] - row0, len = lens[seq];
      if (n <= 0) continue;  // a sequence with no rows this step
      const int32_t* table = tables + seq * table_width;
      // Keys first[i]..end[i]-1 are seen by row i; its blocks are walked from the one holding
      // first[i], whose earlier rows get weight 0. Blocks outer, rows inner: each block is
      // read once for all rows that see any of it.
      rows_of.n = n;
      rows_of.first.resize(n), rows_of.begin.resize(n), rows_of.end.resize(n);
      for (int64_t i = 0; i < n; ++i) {
        rows_of.end[i] = len - (n - 1 - i);
        rows_of.first[i] = window > 0 ? std::max<int64_t>(0, rows_of.end[i] - window) : 0;
        rows_of.begin[i] = rows_of.first[i] / bs * bs;
      }
      const int64_t block_start = rows_of.begin[0], heads = n * group;
      // scores[h, j] for h = i * group + g (row i, query head g of the group), stride len.
      scores.assign(heads * len, 0.f);
      qf.resize(heads * hd), inv_sum.resize(heads), outs.resize(heads);
      const auto q_of = [&](int64_t h) {  // row i = h / group, query head g = h % group
        return qp + (row0 + h / group) * q_stride_row +
               (head * full + g0 + h % group) * q_stride_head;
      };
      for (int64_t h = 0; h < heads; ++h) {
        const T* src = q_of(h);
        for (int64_t e = 0; e < hd; ++e) qf[h * hd + e] = load_f(src[e]) * fscale;
        const int64_t row = row0 + h / group, qh = head * full + g0 + h % group;
        outs[h] = op + row * o_stride_row + qh * o_stride_head;
      }
      // Pass 1: scores[h, j] = q_h . k_j over this sequence's blocks, read in place. Each
      // block (bs x hd contiguous values) is widened to float once, then dotted; in bf16
      // with AVX512-BF16, dotted as stored, sixteen key rows at a time.
      bool scored = false;
#if defined(LUCEDESK_AVX512BF16)
      if constexpr (kBf16Path) {
        if (hd % 32 == 0 && bs % 16 == 0) {
          for (int64_t j0 = block_start; j0 < len; j0 += 16) {
            if (j0 % bs == 0) prefetch_block(kp, table, j0, len, head, num_blocks, bs, hd);
            const int64_t key_row = (head * num_blocks + table[j0 / bs]) * bs + j0 % bs;
            const c10::BFloat16* kb;
            if constexpr (kQuantized) {  // sixteen keys' levels widened once for all rows
              levels_to_bf16(kwide.data(), kp + key_row * hd, std::min<int64_t>(16, len - j0) * hd);
              kb = kwide.data();
            } else {
              kb = kp + key_row * hd;
            }
            for (int64_t i = 0; i < n; ++i) {
              if (!rows_of.walks(i, j0 / bs * bs)) continue;
              const int64_t rows = std::min<int64_t>(16, rows_of.end[i] - j0);
              if (rows <= 0) continue;
              for (int64_t h = i * group; h < (i + 1) * group; ++h) {
                float* sh = scores.data() + h * len + j0;
                scores16_bf16(q_of(h), kb, rows, hd, fscale, sh);
                if constexpr (kQuantized)
                  for (int64_t r = 0; r < rows; ++r) sh[r] *= k_scales[key_row + r];
              }
            }
          }
          scored = true;
        }
      }
#endif
      for (int64_t j0 = block_start; j0 < len && !scored; j0 += bs) {
        const int64_t block_row = (head * num_blocks + table[j0 / bs]) * bs;
        widen(kf.data(), kp + block_row * hd, std::min(bs, len - j0) * hd);
        for (int64_t i = 0; i < n; ++i) {
          if (!rows_of.walks(i, j0)) continue;
          const int64_t rows = std::min(bs, rows_of.end[i] - j0);
          for (int64_t r = 0; r < rows; ++r) {
            const float* krow = kf.data() + r * hd;
            for (int64_t h = i * group; h < (i + 1) * group; ++h) {
              const float* qh = qf.data() + h * hd;
              float s = 0.f;
#pragma omp simd reduction(+ : s)
              for (int64_t e = 0; e < hd; ++e) s += qh[e] * krow[e];
              if constexpr (kQuantized) s *= k_scales[block_row + r];
              scores[h * len + j0 + r] = s;
            }
          }
        }
      }
      // Softmax per row and query head, then pass 2: acc[h] = sum_j p[h, j] v_j.
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t i = h / group, first = rows_of.first[i], stop = rows_of.end[i];
        float* sh = scores.data() + h * len;
        float mx = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : mx)
        for (int64_t j = first; j < stop; ++j) mx = sh[j] > mx ? sh[j] : mx;
        const float sink = sinks ? sinks[head * full + g0 + h % group] : 0.f;
        if (sinks) mx = std::max(mx, sink);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = first; j < stop; ++j) {
          sh[j] = exp_nonpositive(sh[j] - mx);
          sum += sh[j];
        }
        if (sinks) sum += exp_nonpositive(sink - mx);
        std::fill(sh + rows_of.begin[i], sh + first, 0.f);
        inv_sum[h] = 1.f / sum;
        if constexpr (kQuantized) {  // each weight takes its value row's scale, block by block
          for (int64_t j0 = first / bs * bs; j0 < stop; j0 += bs) {
            const float* vs = v_scales + (head * num_blocks + table[j0 / bs]) * bs;
            const int64_t lo = std::max(first, j0), hi = std::min(stop, j0 + bs);
#pragma omp simd
            for (int64_t j = lo; j < hi; ++j) sh[j] *= vs[j - j0];
          }
        }
      }
#if defined(LUCEDESK_AVX512BF16)
      if constexpr (kBf16Path) {
        if (hd % 32 == 0) {
          weighted_values_bf16(scores.data(), len, rows_of, group, vp, table, head, num_blocks,
                               bs, hd, inv_sum.data(), outs.data());
          continue;
        }
      }
#endif
      acc.assign(heads * hd, 0.f);
      for (int64_t j0 = block_start; j0 < len; j0 += bs) {
        widen(kf.data(), vp + ((head * num_blocks + table[j0 / bs]) * bs) * hd,
              std::min(bs, len - j0) * hd);
        for (int64_t i = 0; i < n; ++i) {
          if (!rows_of.walks(i, j0)) continue;
          const int64_t rows = std::min(bs, rows_of.end[i] - j0);
          // Four rows per pass over the accumulator: one load and store of it per four
          // multiply-adds.
          for (int64_t h = i * group; h < (i + 1) * group; ++h) {
            const float* ph = scores.data() + h * len + j0;
            float* ah = acc.data() + h * hd;
            int64_t r = 0;
            for (; r + 4 <= rows; r += 4) {
              const float p0 = ph[r], p1 = ph[r + 1], p2 = ph[r + 2], p3 = ph[r + 3];
              const float* v0 = kf.data() + r * hd;
#pragma omp simd
              for (int64_t e = 0; e < hd; ++e)
                ah[e] += (p0 * v0[e] + p1 * v0[hd + e]) +
                         (p2 * v0[2 * hd + e] + p3 * v0[3 * hd + e]);
            }
            for (; r < rows; ++r) {
              const float p = ph[r];
              const float* v = kf.data() + r * hd;
#pragma omp simd
              for (int64_t e = 0; e < hd; ++e) ah[e] += p * v[e];
            }
          }
        }
      }
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t e = 0; e < hd; ++e) outs[h][e] = narrow<T>(acc[h * hd + e] * inv_sum[h]);
    }
  });
}

void paged_decode_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_tables,
                            const at::Tensor& seq_lens, const at::Tensor& query_start,
                            double scale, int64_t window, const std::optional<at::Tensor>& sinks,
                            const std::optional<at::Tensor>& k_scale,
                            const std::optional<at::Tensor>& v_scale) {
  TORCH_CHECK(window >= 0, "paged decode attention: window must be >= 0");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && k_cache.size(0) >= 1 &&
                  q.size(1) % k_cache.size(0) == 0 && q.size(1) >= k_cache.size(0),
              "paged decode attention: query heads must be a multiple of KV heads");
  TORCH_CHECK(query_start.scalar_type() == at::kInt && query_start.is_contiguous() &&
                  query_start.dim() == 1 && query_start.size(0) >= 1,
              "paged decode attention: query_start must be contiguous int32 [S + 1]");
  const float* sink_ptr = attention_extras("paged decode attention", q, k_cache, v_cache, sinks,
                                           k_scale, v_scale);
  const bool quantized = k_cache.scalar_type() == at::kChar;
  dispatch(q.scalar_type(), [&](auto zero) {
    using scalar_t = decltype(zero);
    if (quantized) {
      decode_attention<scalar_t, int8_t>(out, q, k_cache, v_cache, block_tables, seq_lens,
                                         query_start, scale, window, sink_ptr,
                                         k_scale->data_ptr<float>(), v_scale->data_ptr<float>());
    } else {
      decode_attention<scalar_t, scalar_t>(out, q, k_cache, v_cache, block_tables, seq_lens,
                                           query_start, scale, window, sink_ptr, nullptr,
                                           nullptr);
    }
  });
}

}  // namespace
