// The parts of a paged decode (attention.h): the rows a sequence's task attends for,
// prefetching blocks through the block table, the bf16 key scores, the softmax and the
// weighted sum of value rows.
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

// The cache lines of some rows of a block ahead, asked for through the block table: a
// sequence's blocks lie anywhere in the pool, so the hardware prefetcher cannot see where
// the next one is, and a decode reads each of them once (16 sequences at 4k tokens: 2.2 ->
// 1.7 ms a layer, their K/V read cold). The lines are asked for a few at a time, between
// the products of the rows before them: the 32 lines of a 64-column bf16 block asked for at
// once filled the misses a core keeps in flight, and the products behind them waited (one
// core dotting 20 heads with 4k keys read cold: 126 -> 80 us, 74 with the keys in cache).
// A pass over some of a row's columns asks for those only: the others are another thread's.
template <typename C>
class Ahead {
 public:
  // Rows j..j + rows - 1 (one block's) of KV head `head`, columns c_lo..c_hi - 1; none
  // where rows <= 0 (past the keys walked: the table holds no block there).
  void aim(const C* cache, const int32_t* table, int64_t j, int64_t rows, int64_t head,
           int64_t num_blocks, int64_t bs, int64_t hd, int64_t c_lo, int64_t c_hi) {
    left_ = 0;
    if (rows <= 0) return;
    row_ = reinterpret_cast<const char*>(
        cache + ((head * num_blocks + table[j / bs]) * bs + j % bs) * hd);
    stride_ = hd * static_cast<int64_t>(sizeof(C));
    from_ = c_lo * static_cast<int64_t>(sizeof(C)) / 64 * 64;  // the line holding c_lo
    to_ = c_hi * static_cast<int64_t>(sizeof(C));
    line_ = row_ + from_;
    left_ = rows * ((to_ - from_ + 63) / 64);
  }
  // Asks for 1 / calls of the lines not yet asked for: `calls` (>= 1) the times it will be
  // asked before the lines are read.
  void ask(int64_t calls) {
    for (int64_t n = (left_ + calls - 1) / calls; n > 0; --n, --left_) {
      __builtin_prefetch(line_, 0, 3);
      line_ += 64;
      if (line_ >= row_ + to_) row_ += stride_, line_ = row_ + from_;
    }
  }

 private:
  const char *row_ = nullptr, *line_ = nullptr;
  int64_t stride_ = 0, from_ = 0, to_ = 0, left_ = 0;
};

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
// Sixteen key rows at kb (hd apart) with their 128-bit quarters regrouped, for
// scores16_quartered: per 32-wide column chunk c and four keys 4j..4j+3, four vectors at
// out + ((c / 32 * 4 + j) * 4 + q) * 32, q = 0..3, the one for q holding quarter q of the
// chunk of key 4j + k in its quarter k (a 4 x 4 transpose of quarters). Rows past a
// sequence's end are regrouped too; their lanes never reach a stored score.
inline void quarter_keys(const c10::BFloat16* kb, int64_t hd, c10::BFloat16* out) {
  for (int64_t c = 0; c < hd; c += 32) {
    for (int j = 0; j < 4; ++j) {
      const c10::BFloat16* r = kb + 4 * j * hd + c;
      const __m512i r0 = _mm512_loadu_si512(r), r1 = _mm512_loadu_si512(r + hd);
      const __m512i r2 = _mm512_loadu_si512(r + 2 * hd), r3 = _mm512_loadu_si512(r + 3 * hd);
      const __m512i t0 = _mm512_shuffle_i64x2(r0, r1, 0x44), t1 = _mm512_shuffle_i64x2(r0, r1, 0xEE);
      const __m512i t2 = _mm512_shuffle_i64x2(r2, r3, 0x44), t3 = _mm512_shuffle_i64x2(r2, r3, 0xEE);
      c10::BFloat16* dst = out + (c / 32 * 4 + j) * 4 * 32;
      _mm512_storeu_si512(dst, _mm512_shuffle_i64x2(t0, t2, 0x88));
      _mm512_storeu_si512(dst + 32, _mm512_shuffle_i64x2(t0, t2, 0xDD));
      _mm512_storeu_si512(dst + 64, _mm512_shuffle_i64x2(t1, t3, 0x88));
      _mm512_storeu_si512(dst + 96, _mm512_shuffle_i64x2(t1, t3, 0xDD));
    }
  }
}

// A query row with each 128-bit quarter of each 32-wide chunk broadcast to a whole vector,
// for scores16_quartered: out + (c / 32 * 4 + q) * 32 holds quarter q of chunk c four times.
inline void quarter_query(const c10::BFloat16* q, int64_t hd, c10::BFloat16* out) {
  for (int64_t c = 0; c < hd; c += 32) {
    const __m512i v = _mm512_loadu_si512(q + c);
    c10::BFloat16* dst = out + c / 32 * 4 * 32;
    _mm512_storeu_si512(dst, _mm512_shuffle_i64x2(v, v, 0x00));
    _mm512_storeu_si512(dst + 32, _mm512_shuffle_i64x2(v, v, 0x55));
    _mm512_storeu_si512(dst + 64, _mm512_shuffle_i64x2(v, v, 0xAA));
    _mm512_storeu_si512(dst + 96, _mm512_shuffle_i64x2(v, v, 0xFF));
  }
}

// (v0 + v2) + (v1 + v3): the sum sum16's first two stages make of a key's four quarters.
inline __m512 quarters_sum(__m512 v0, __m512 v1, __m512 v2, __m512 v3) {
  __m512 even = _mm512_add_ps(v0, v2), odd = _mm512_add_ps(v1, v3);
  // The kernels build with -fassociative-math, which would be free to sum the four as a
  // chain in another order; hiding the two halves from it keeps sum16's.
  asm("" : "+v"(even), "+v"(odd));
  return _mm512_add_ps(even, odd);
}

// scores16_bf16's scores, to the bit, from keys regrouped by quarter_keys and a query by
// quarter_query: each lane makes the same vdpbf16ps products of the same pairs, chunk after
// chunk, as key row 4j + k's accumulator's lanes 4q..4q+3 do there (v[j][q]'s quarter k),
// and (v0 + v2) + (v1 + v3) is the sum sum16's first two stages make with shuffles. The
// regrouping is done once for all the heads that dot a block, so where many do (a drafted
// row's positions, a model's many query heads) each skips those stages' 24 shuffles.
inline void scores16_quartered(const c10::BFloat16* qq, const c10::BFloat16* kq, int64_t rows,
                               int64_t hd, float scale, float* scores) {
  __m512 v[4][4];
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j)
#pragma GCC unroll 4
    for (int q = 0; q < 4; ++q) v[j][q] = _mm512_setzero_ps();
  for (int64_t c = 0; c < hd; c += 32) {
    const c10::BFloat16* kc = kq + c / 32 * 16 * 32;
#pragma GCC unroll 4
    for (int q = 0; q < 4; ++q) {
      const __m512bh qv = (__m512bh)_mm512_loadu_si512(qq + (c / 32 * 4 + q) * 32);
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j)
        v[j][q] = _mm512_dpbf16_ps(v[j][q], qv,
                                   (__m512bh)_mm512_loadu_si512(kc + (j * 4 + q) * 32));
    }
  }
  __m512 c4[4];
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) c4[j] = quarters_sum(v[j][0], v[j][1], v[j][2], v[j][3]);
  const __m512 s = _mm512_mul_ps(sum4x4(c4), _mm512_set1_ps(scale));
  _mm512_mask_storeu_ps(scores, static_cast<__mmask16>((1u << rows) - 1), s);
}

// scores16_quartered for two heads (a and b) of C * 32 <= 64 columns at once: both queries'
// quarters held in registers and each load of the regrouped keys dotted with both, four keys
// at a time, where one head's sixteen accumulators left a load per product (the scores of a
// drafted row took twice the weighted values' time for the same products). Each lane makes
// the same products and sums in the same order as there: the same bits.
template <int C>
inline void scores16_quartered_two(const c10::BFloat16* qa, const c10::BFloat16* qb,
                                   const c10::BFloat16* kq, int64_t rows_a, int64_t rows_b,
                                   float scale, float* sa, float* sb) {
  __m512bh a[C][4], b[C][4];
#pragma GCC unroll 2
  for (int c = 0; c < C; ++c)
#pragma GCC unroll 4
    for (int q = 0; q < 4; ++q) {
      a[c][q] = (__m512bh)_mm512_loadu_si512(qa + (c * 4 + q) * 32);
      b[c][q] = (__m512bh)_mm512_loadu_si512(qb + (c * 4 + q) * 32);
    }
  __m512 ca[4], cb[4];
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) {
    __m512 va[4], vb[4];
#pragma GCC unroll 4
    for (int q = 0; q < 4; ++q) va[q] = vb[q] = _mm512_setzero_ps();
#pragma GCC unroll 2
    for (int c = 0; c < C; ++c)
#pragma GCC unroll 4
      for (int q = 0; q < 4; ++q) {
        const __m512bh k = (__m512bh)_mm512_loadu_si512(kq + (c * 16 + j * 4 + q) * 32);
        va[q] = _mm512_dpbf16_ps(va[q], a[c][q], k);
        vb[q] = _mm512_dpbf16_ps(vb[q], b[c][q], k);
      }
    ca[j] = quarters_sum(va[0], va[1], va[2], va[3]);
    cb[j] = quarters_sum(vb[0], vb[1], vb[2], vb[3]);
  }
  const __m512 s = _mm512_set1_ps(scale);
  _mm512_mask_storeu_ps(sa, static_cast<__mmask16>((1u << rows_a) - 1),
                        _mm512_mul_ps(sum4x4(ca), s));
  _mm512_mask_storeu_ps(sb, static_cast<__mmask16>((1u << rows_b) - 1),
                        _mm512_mul_ps(sum4x4(cb), s));
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
#endif

// The softmax of row i = h / group's scores for query head h, in place (sh[j - origin] for
// keys j): exp(s_j - max) over the keys it sees (first..end - 1), 0 over the block's rows
// before them (begin..first - 1); sink (when given) joins the max and the denominator. An
// 8-bit cache's value scales then weigh each probability. Returns 1 / the denominator.
inline float softmax_keys(float* sh, int64_t origin, int64_t begin, int64_t first, int64_t stop,
                          const float* sink, const float* v_scales, const int32_t* table,
                          int64_t head, int64_t num_blocks, int64_t bs) {
  float* s = sh + (first - origin);  // s[j - first]: key j's score, for j from first
  const int64_t m = stop - first;
  float mx = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : mx)
  for (int64_t j = 0; j < m; ++j) mx = s[j] > mx ? s[j] : mx;
  if (sink) mx = std::max(mx, *sink);
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < m; ++j) {
    s[j] = exp_nonpositive(s[j] - mx);
    sum += s[j];
  }
  if (sink) sum += exp_nonpositive(*sink - mx);
  std::fill(sh + (begin - origin), s, 0.f);
  if (v_scales) {  // each weight takes its value row's scale, block by block
    for (int64_t j0 = first / bs * bs; j0 < stop; j0 += bs) {
      const float* vs = v_scales + (head * num_blocks + table[j0 / bs]) * bs;
      const int64_t lo = std::max(first, j0), hi = std::min(stop, j0 + bs);
#pragma omp simd
      for (int64_t j = lo; j < hi; ++j) sh[j - origin] *= vs[j - j0];
    }
  }
  return 1.f / sum;
}

#if defined(LUCEDESK_AVX512BF16)
// ph[(j - origin) / 2] = (p[j], p[j + 1]) as one bf16 pair per 32 bits for keys j from
// begin (a block's first row, so even, as origin is) to end - 1, p indexed p[j - origin];
// blocks have an even number of rows, so a pair never straddles two blocks. Thirty-two
// probabilities at a time rounded to bf16 (to nearest even, as c10 rounds), a masked tail
// reading zeros past the end. A subnormal weight (a tiny probability times an 8-bit value's
// scale) becomes 0 here where c10 would keep a subnormal bf16; vdpbf16ps takes subnormal
// inputs as 0 either way, so the products are the same.
inline void probability_pairs(const float* p, int64_t origin, int64_t begin, int64_t end,
                              int32_t* ph) {
  for (int64_t i = begin; i < end; i += 32) {
    const int64_t left = std::min<int64_t>(32, end - i);
    const __mmask16 lo_mask = static_cast<__mmask16>(left >= 16 ? 0xFFFF : (1u << left) - 1);
    const __mmask16 hi_mask =
        static_cast<__mmask16>(left >= 32 ? 0xFFFF : left > 16 ? (1u << (left - 16)) - 1 : 0);
    const __m512 lo = _mm512_maskz_loadu_ps(lo_mask, p + i - origin);
    const __m512 hi = _mm512_maskz_loadu_ps(hi_mask, p + i - origin + 16);
    const __mmask16 store =
        static_cast<__mmask16>(left >= 32 ? 0xFFFF : (1u << ((left + 1) / 2)) - 1);
    _mm512_mask_storeu_epi32(ph + (i - origin) / 2, store, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
  }
}

// out[i, g][c_lo..c_hi) = inv_sum[i, g] * sum_j p[i, g, j] v_j[c_lo..c_hi) for each row i
// and query head g of a sequence, its value rows read in place once for all of them
// (blocks outer, rows inner), 32 columns at a time (c_lo and c_hi multiples of 32).
// The probability pairs of (i, g) start at pairs + (i * group + g) * half, key j's at
// (j - origin) / 2. Pairs of value rows interleaved (v_j[e], v_j+1[e]) are multiplied with
// (p[j], p[j+1]) in bf16 by vdpbf16ps. Unpacking within 128-bit lanes leaves the
// accumulators in the order
//   lo: e 0-3, 8-11, 16-19, 24-27    hi: e 4-7, 12-15, 20-23, 28-31
// of each 32-wide slice; two permutes restore it at the end. Each (i, g) and column sums
// its rows in the same order whatever the other rows and columns are: a row's result does
// not depend on them, nor on how the columns are shared out. An 8-bit cache (C = int8_t)
// has each block's slice of levels widened to bf16 first (exact; its scales are already in
// p).
template <typename C>
void weighted_values_bf16(const int32_t* pairs, int64_t half, int64_t origin,
                          const QueryRows& rows_of, int64_t group, const C* vp,
                          const int32_t* table, int64_t head, int64_t num_blocks, int64_t bs,
                          int64_t hd, int64_t c_lo, int64_t c_hi, const float* inv_sum,
                          c10::BFloat16* const* outs) {
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second =
      _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  const int64_t n = rows_of.n, heads = n * group;
  // (lo, hi) of each row, head and 32-wide slice: acc + (h * slices + (c - c_lo) / 32) * 32.
  const int64_t slices = (c_hi - c_lo) / 32;
  std::vector<float> acc(heads * slices * 32, 0.f);
  // A block's value rows interleaved in pairs once per slice, for every row and head that
  // weighs them: (lo, hi) of pair r / 2 of slice c at inter + (c - c_lo) / 32 * span +
  // r * 16 and (r + 1) * 16, span room for an odd block's last pair. Each block is read
  // once, all its slices together.
  const int64_t span = (bs + 1) * 16;
  std::vector<int32_t> inter(slices * span);
  std::vector<c10::BFloat16> wide(std::is_same_v<C, int8_t> ? bs * 32 : 0);
  const int64_t stop = rows_of.end[n - 1];
  Ahead<C> ahead;  // the block kPrefetchBlocks on, a share before each weigh_value_pairs
  for (int64_t j0 = rows_of.begin[0]; j0 < stop; j0 += bs) {
    const int64_t block_rows = std::min(bs, stop - j0), next = j0 + kPrefetchBlocks * bs;
    int64_t calls = 0;
    for (int64_t i = 0; i < n; ++i)
      if (rows_of.walks(i, j0)) calls += slices * ((group + 3) / 4);
    ahead.aim(vp, table, next, std::min(bs, stop - next), head, num_blocks, bs, hd, c_lo, c_hi);
    for (int64_t c = c_lo; c < c_hi; c += 32) {
      const C* block = vp + ((head * num_blocks + table[j0 / bs]) * bs) * hd + c;
      int32_t* slice_inter = inter.data() + (c - c_lo) / 32 * span;
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
          const int32_t* ph = pairs + h * half + (j0 - origin) / 2;
          float* ah = acc.data() + (h * slices + (c - c_lo) / 32) * 32;
          const int64_t step = slices * 32;  // from one head's slice to the next head's
          ahead.ask(calls--);
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
    ahead.ask(1);  // where no row weighed this block
  }
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t c = c_lo; c < c_hi; c += 32) {
      const float* ah = acc.data() + (h * slices + (c - c_lo) / 32) * 32;
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

}  // namespace
