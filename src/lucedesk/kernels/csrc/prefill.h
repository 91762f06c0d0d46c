// Paged prefill attention: the rows of a step's prompt chunks against their sequences' keys,
// as flash attention (an online softmax over spans of 64 keys) with both products in bf16
// pairs by vdpbf16ps and float sums.
//
// Per call, each chunk's keys and values are read from their blocks once into pair tiles
// (the layout vdpbf16ps multiplies; an 8-bit cache's rows dequantized to bf16 on the way),
// then tasks of 32 query rows x heads of one KV head's group walk the spans their rows see:
// causal and windowed spans that no row of a task sees are skipped, so a windowed layer
// costs its window, not the prefix.
//
// Spans sit at multiples of 64 positions and a row skips every span where it sees no key,
// so a row's arithmetic depends on its query, its keys and values and its position only:
// the same bits whatever chunk it came in, and whatever else shares the step.
#pragma once

#include "common.h"

namespace {

bool prefill_attention_available() {
#if defined(LUCEDESK_AVX512BF16)
  return true;
#else
  return false;
#endif
}

#if defined(LUCEDESK_AVX512BF16)
constexpr int64_t kSpan = 64;      // keys per step of the online softmax (4 tiles of 16)
constexpr int64_t kTaskRows = 32;  // query rows (positions x heads of a group) per task

// exp_nonpositive (common.h) on sixteen lanes: the same steps, in fused multiply-adds.
inline __m512 exp_nonpositive16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 k = _mm512_roundscale_ps(
      _mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
      _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fmadd_ps(k, _mm512_set1_ps(2.12194440e-4f),
                                   _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), x));
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
  const __m512i bits =
      _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(k), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

// scores[r][k] = q_r . key k for 4 query rows (bf16 pairs [half][4]: pair c of row r at
// q[c * 4 + r]) and the span's 64 keys, stored as 4 tiles of [half][16] pairs: 16 sums in
// registers, one per row and tile, each over the pairs in order.
inline void span_scores(const uint32_t* q, const uint32_t* keys, int64_t half, float* scores) {
  __m512 acc[4][4];
#pragma GCC unroll 4
  for (int r = 0; r < 4; ++r)
#pragma GCC unroll 4
    for (int t = 0; t < 4; ++t) acc[r][t] = _mm512_setzero_ps();
  for (int64_t c = 0; c < half; ++c) {
    __m512bh k[4];
#pragma GCC unroll 4
    for (int t = 0; t < 4; ++t) k[t] = (__m512bh)_mm512_loadu_si512(keys + (t * half + c) * 16);
#pragma GCC unroll 4
    for (int r = 0; r < 4; ++r) {
      const __m512bh qq = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(q[c * 4 + r]));
#pragma GCC unroll 4
      for (int t = 0; t < 4; ++t) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], qq, k[t]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < 4; ++r)
#pragma GCC unroll 4
    for (int t = 0; t < 4; ++t) _mm512_storeu_ps(scores + r * kSpan + t * 16, acc[r][t]);
}

// out[r][e] += sum_j p[r][j] v_j[e] for 4 rows and E blocks of 16 dims: p as bf16 pairs
// (p_2j, p_2j+1), kSpan / 2 a row; values as the span's [hd / 16][kSpan / 2][16] pairs
// (v_2j[e], v_2j+1[e]) from the first of the E blocks, each block read in order.
template <int E>
inline void span_values(const uint32_t* p, const uint32_t* values, int64_t hd, float* out) {
  constexpr int64_t kBlock = kSpan / 2 * 16;
  __m512 acc[4][E];
#pragma GCC unroll 4
  for (int r = 0; r < 4; ++r)
#pragma GCC unroll 4
    for (int b = 0; b < E; ++b) acc[r][b] = _mm512_loadu_ps(out + r * hd + b * 16);
  for (int64_t j = 0; j < kSpan / 2; ++j) {
    __m512bh v[E];
#pragma GCC unroll 4
    for (int b = 0; b < E; ++b)
      v[b] = (__m512bh)_mm512_loadu_si512(values + b * kBlock + j * 16);
#pragma GCC unroll 4
    for (int r = 0; r < 4; ++r) {
      const __m512bh pp = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(p[r * kSpan / 2 + j]));
#pragma GCC unroll 4
      for (int b = 0; b < E; ++b) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], pp, v[b]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < 4; ++r)
#pragma GCC unroll 4
    for (int b = 0; b < E; ++b) _mm512_storeu_ps(out + r * hd + b * 16, acc[r][b]);
}

// One chunk's keys and values from `start` (a multiple of kSpan) to the end of its last span,
// for one KV head, in the layouts above; positions at or past the sequence's end are zero.
struct PairTiles {
  int64_t start = 0, spans = 0;
  std::vector<uint32_t> keys;    // [spans * 4][half][16] pairs
  std::vector<uint16_t> values;  // [spans][hd / 16][32][16] pairs, as bf16 halves
};

// A cache row of one head as bf16 bits: as stored, or an 8-bit cache's levels times their
// scale rounded to bf16 (what its torch reference's gather gives).
inline void cache_row_bits(uint16_t* dst, const c10::BFloat16* row, int64_t hd, const float*) {
  std::memcpy(dst, row, hd * sizeof(uint16_t));
}
inline void cache_row_bits(uint16_t* dst, const int8_t* row, int64_t hd, const float* scale) {
  for (int64_t e = 0; e < hd; ++e) dst[e] = bf16_bits(static_cast<float>(row[e]) * *scale);
}

// C: c10::BFloat16 (scales unused), or int8_t with k_scales / v_scales [kvh, num_blocks, bs].
template <typename C>
void pack_pairs(PairTiles& tiles, const C* k_cache, const C* v_cache, const float* k_scales,
                const float* v_scales, const int32_t* table, int64_t head, int64_t num_blocks,
                int64_t bs, int64_t hd, int64_t len, int64_t tile_begin, int64_t tile_end) {
  const int64_t half = hd / 2;
  uint16_t* values = tiles.values.data();
  std::vector<uint16_t> krow(hd), vrow_bits(hd);
  for (int64_t tile = tile_begin; tile < tile_end; ++tile) {
    uint32_t* kt = tiles.keys.data() + tile * half * 16;
    for (int64_t k = 0; k < 16; ++k) {
      // Key j of the chunk's tiles is value pair j % kSpan / 2 of its span, half j % 2.
      const int64_t pos = tiles.start + tile * 16 + k, j = tile * 16 + k;
      uint16_t* vrow = values + ((j / kSpan * hd * kSpan / 2) + j % kSpan / 2 * 16) * 2 + j % 2;
      if (pos >= len) {
        std::fill(krow.begin(), krow.end(), 0), std::fill(vrow_bits.begin(), vrow_bits.end(), 0);
      } else {
        const int64_t row = (head * num_blocks + table[pos / bs]) * bs + pos % bs;
        cache_row_bits(krow.data(), k_cache + row * hd, hd, k_scales + row);
        cache_row_bits(vrow_bits.data(), v_cache + row * hd, hd, v_scales + row);
      }
      for (int64_t c = 0; c < half; ++c) std::memcpy(kt + c * 16 + k, krow.data() + 2 * c, 4);
      for (int64_t e = 0; e < hd; ++e) vrow[(e / 16 * kSpan / 2 * 16 + e % 16) * 2] = vrow_bits[e];
    }
  }
}

// A task: query rows v0..v0 + kTaskRows - 1 of a chunk's (position, head of the group)
// rows, v = i * group + g, for one KV head.
struct PrefillTask {
  int64_t chunk, head, v0, keys;  // keys: about how many it attends (for ordering)
};

template <typename Cache>
void prefill_attention_bf16(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_tables,
                            const at::Tensor& seq_lens, const at::Tensor& query_start,
                            double scale, int64_t window, const float* sinks,
                            const float* k_scales, const float* v_scales) {
  const int64_t C = query_start.size(0) - 1, nh = q.size(1), hd = q.size(2);
  const int64_t kvh = k_cache.size(0), num_blocks = k_cache.size(1), bs = k_cache.size(2);
  const int64_t group = nh / kvh, half = hd / 2, table_width = block_tables.size(1);
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* starts = query_start.data_ptr<int32_t>();
  const auto* qp = q.data_ptr<c10::BFloat16>();
  auto* op = out.data_ptr<c10::BFloat16>();
  const Cache* kp = k_cache.data_ptr<Cache>();
  const Cache* vp = v_cache.data_ptr<Cache>();
  const float fscale = static_cast<float>(scale);

  // A chunk of n rows ends at len: row i sits at len - n + i and sees keys from
  // first_key(pos) to pos. Its tiles start at the span holding the first key any row sees.
  const auto first_key = [&](int64_t pos) {
    return window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
  };
  std::vector<PairTiles> tiles(C * kvh);
  std::vector<int64_t> tile_offset(C * kvh + 1, 0);  // 16-key tiles before each (chunk, head)
  std::vector<PrefillTask> tasks;
  for (int64_t s = 0; s < C; ++s) {
    const int64_t n = starts[s + 1] - starts[s], len = lens[s];
    const int64_t start = first_key(len - n) / kSpan * kSpan;
    const int64_t spans = (len - start + kSpan - 1) / kSpan;
    for (int64_t h = 0; h < kvh; ++h) {
      PairTiles& t = tiles[s * kvh + h];
      t.start = start, t.spans = n > 0 ? spans : 0;
      t.keys.resize(t.spans * kSpan * half);
      t.values.resize(t.spans * kSpan * hd);
      tile_offset[s * kvh + h + 1] = tile_offset[s * kvh + h] + t.spans * 4;
      for (int64_t v0 = 0; v0 < n * group; v0 += kTaskRows) {
        const int64_t last = std::min(n * group, v0 + kTaskRows) - 1;
        const int64_t pos = len - n + last / group;
        tasks.push_back({s, h, v0, pos + 1 - first_key(pos)});
      }
    }
  }
  at::parallel_for(0, tile_offset.back(), 16, [&](int64_t begin, int64_t end) {
    for (int64_t th = 0; th < C * kvh; ++th) {
      const int64_t lo = std::max(begin, tile_offset[th]), hi = std::min(end, tile_offset[th + 1]);
      if (lo >= hi) continue;
      const int64_t s = th / kvh;
      pack_pairs(tiles[th], kp, vp, k_scales, v_scales, tables + s * table_width, th % kvh,
                 num_blocks, bs, hd, lens[s], lo - tile_offset[th], hi - tile_offset[th]);
    }
  });
  // The longest tasks first, taken one at a time by whichever thread is free: causal rows
  // late in a chunk see many more keys than early ones.
  std::stable_sort(tasks.begin(), tasks.end(),
                   [](const PrefillTask& a, const PrefillTask& b) { return a.keys > b.keys; });
  take_in_turn(static_cast<int64_t>(tasks.size()), [&](auto take) {
    std::vector<uint32_t> qbuf(kTaskRows * half), pbuf(kTaskRows * kSpan / 2);
    std::vector<float> scores(kTaskRows * kSpan), o(kTaskRows * hd), m(kTaskRows), l(kTaskRows);
    std::vector<int64_t> pos(kTaskRows), lo(kTaskRows);
    for (int64_t t = take(); t >= 0; t = take()) {
      const PrefillTask& task = tasks[t];
      const int64_t s = task.chunk, head = task.head;
      const int64_t n = starts[s + 1] - starts[s], len = lens[s];
      const int64_t rows = std::min(kTaskRows, n * group - task.v0);
      const PairTiles& kv = tiles[s * kvh + head];
      // The task's query rows as bf16 pairs (padding rows zero), their positions and heads.
      std::fill(qbuf.begin(), qbuf.end(), 0u);
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t v = task.v0 + r, i = v / group, qh = head * group + v % group;
        pos[r] = len - n + i, lo[r] = first_key(pos[r]);
        const uint32_t* src = reinterpret_cast<const uint32_t*>(
            qp + (starts[s] + i) * q.stride(0) + qh * q.stride(1));
        uint32_t* dst = qbuf.data() + (r / 4) * half * 4 + r % 4;
        for (int64_t c = 0; c < half; ++c) dst[c * 4] = src[c];
      }
      std::fill(o.begin(), o.end(), 0.f);
      std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.end(), 0.f);
      const int64_t first_span = (lo[0] - kv.start) / kSpan;
      const int64_t end_span = (pos[rows - 1] - kv.start) / kSpan + 1;
      const int64_t quads = (rows + 3) / 4;
      for (int64_t sp = first_span; sp < end_span; ++sp) {
        const int64_t k0 = kv.start + sp * kSpan;
        const uint32_t* keys = kv.keys.data() + sp * kSpan * half;
        const uint32_t* values =  // read by vector loads only
            reinterpret_cast<const uint32_t*>(kv.values.data()) + sp * kSpan * half;
        for (int64_t r = 0; r < quads * 4; r += 4)
          span_scores(qbuf.data() + r * half, keys, half, scores.data() + r * kSpan);
        // The online softmax: each row's running max m and sum l, its output rescaled when
        // the max grows; keys a row does not see weigh exactly 0.
        for (int64_t r = 0; r < quads * 4; ++r) {
          uint32_t* pr = pbuf.data() + r * kSpan / 2;
          const int64_t a = r < rows ? std::max(lo[r], k0) - k0 : 0;
          const int64_t b = r < rows ? std::min(pos[r] + 1, k0 + kSpan) - k0 : 0;
          if (a >= b) {
            std::fill(pr, pr + kSpan / 2, 0u);
            continue;
          }
          // Keys a..b-1 of the span are the row's: a lane mask per sixteen.
          const uint64_t seen = (b == kSpan ? ~0ull : (1ull << b) - 1) & ~((1ull << a) - 1);
          const float* sr = scores.data() + r * kSpan;
          __m512 x[4];
          __m512 top = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
#pragma GCC unroll 4
          for (int v = 0; v < 4; ++v) {
            x[v] = _mm512_mul_ps(_mm512_loadu_ps(sr + 16 * v), _mm512_set1_ps(fscale));
            top = _mm512_mask_max_ps(top, static_cast<__mmask16>(seen >> 16 * v), top, x[v]);
          }
          const float m_new = std::max(m[r], _mm512_reduce_max_ps(top));
          __m512 total = _mm512_setzero_ps();
#pragma GCC unroll 4
          for (int v = 0; v < 4; ++v) {
            const __m512 shifted = _mm512_sub_ps(x[v], _mm512_set1_ps(m_new));
            x[v] = _mm512_maskz_mov_ps(static_cast<__mmask16>(seen >> 16 * v),
                                       exp_nonpositive16(shifted));
            total = _mm512_add_ps(total, x[v]);
          }
          const float sum = _mm512_reduce_add_ps(total);
          if (m[r] == -std::numeric_limits<float>::infinity()) {
            l[r] = sum;
          } else {
            const float alpha = exp_nonpositive(m[r] - m_new);
            l[r] = l[r] * alpha + sum;
            if (alpha != 1.f) {
              float* orow = o.data() + r * hd;
              for (int64_t e = 0; e < hd; e += 16)
                _mm512_storeu_ps(orow + e, _mm512_mul_ps(_mm512_loadu_ps(orow + e),
                                                         _mm512_set1_ps(alpha)));
            }
          }
          m[r] = m_new;
          // Pairs (p_2j, p_2j+1), each rounded to bf16 to nearest even.
          _mm512_storeu_si512(pr, (__m512i)_mm512_cvtne2ps_pbh(x[1], x[0]));
          _mm512_storeu_si512(pr + 16, (__m512i)_mm512_cvtne2ps_pbh(x[3], x[2]));
        }
        for (int64_t r = 0; r < quads * 4; r += 4) {
          const uint32_t* pq = pbuf.data() + r * kSpan / 2;
          float* oq = o.data() + r * hd;
          int64_t e = 0;
          for (; e + 64 <= hd; e += 64) span_values<4>(pq, values + e * kSpan / 2, hd, oq + e);
          for (; e < hd; e += 16) span_values<1>(pq, values + e * kSpan / 2, hd, oq + e);
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t v = task.v0 + r, i = v / group, qh = head * group + v % group;
        float norm = 1.f / l[r];
        if (sinks) {  // the sink's logit joins the denominator: max and sum move to it
          const float top = std::max(m[r], sinks[qh]);
          const float kept = exp_nonpositive(m[r] - top);
          norm = kept / (l[r] * kept + exp_nonpositive(sinks[qh] - top));
        }
        c10::BFloat16* dst = op + (starts[s] + i) * out.stride(0) + qh * out.stride(1);
        const float* orow = o.data() + r * hd;
        for (int64_t e = 0; e < hd; ++e) dst[e] = narrow<c10::BFloat16>(orow[e] * norm);
      }
    }
  });
}
#endif

void paged_prefill_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache,
                             const at::Tensor& v_cache, const at::Tensor& block_tables,
                             const at::Tensor& seq_lens, const at::Tensor& query_start,
                             double scale, int64_t window, const std::optional<at::Tensor>& sinks,
                             const std::optional<at::Tensor>& k_scale,
                             const std::optional<at::Tensor>& v_scale) {
  TORCH_CHECK(prefill_attention_available(), "paged prefill attention: no AVX512-BF16 here");
  TORCH_CHECK(window >= 0, "paged prefill attention: window must be >= 0");
  const bool quantized = k_cache.scalar_type() == at::kChar;
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16 &&
                  (quantized || k_cache.scalar_type() == at::kBFloat16) &&
                  v_cache.scalar_type() == k_cache.scalar_type(),
              "paged prefill attention: q and out must be bfloat16, the caches bfloat16 or int8");
  const float* sink_ptr = attention_extras("paged prefill attention", q, k_cache, v_cache,
                                           sinks, k_scale, v_scale);
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && out.sizes() == q.sizes() &&
                  out.stride(2) == 1 && q.size(2) % 16 == 0,
              "paged prefill attention: q and out [rows, heads, head_dim], head_dim a multiple "
              "of 16 and contiguous");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 4 &&
                  k_cache.sizes() == v_cache.sizes() && k_cache.size(3) == q.size(2) &&
                  q.size(1) % k_cache.size(0) == 0,
              "paged prefill attention: caches must be contiguous [kvh, blocks, bs, head_dim]");
  TORCH_CHECK(query_start.scalar_type() == at::kInt && query_start.is_contiguous() &&
                  query_start.dim() == 1 && query_start.size(0) >= 1,
              "paged prefill attention: query_start must be contiguous int32 [C + 1]");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous() &&
                  seq_lens.size(0) >= query_start.size(0) - 1,
              "paged prefill attention: seq_lens must be contiguous int32 [>= C]");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.is_contiguous() &&
                  block_tables.dim() == 2 && block_tables.size(0) >= query_start.size(0) - 1,
              "paged prefill attention: block_tables must be contiguous int32 [>= C, blocks]");
  // Each chunk's rows lie in q, it fits its sequence, and the blocks it reads are the pool's.
  const int32_t* starts = query_start.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t chunks = query_start.size(0) - 1, bs = k_cache.size(2);
  TORCH_CHECK(starts[0] >= 0 && starts[chunks] <= q.size(0),
              "paged prefill attention: query_start runs past q's rows");
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t n = starts[c + 1] - starts[c], len = lens[c];
    TORCH_CHECK(n >= 0 && n <= len && len <= block_tables.size(1) * bs,
                "paged prefill attention: chunk ", c, " has ", n, " rows of ", len,
                " tokens, which its block table cannot hold");
    for (int64_t b = 0; b < (len + bs - 1) / bs; ++b) {
      const int32_t block = tables[c * block_tables.size(1) + b];
      TORCH_CHECK(block >= 0 && block < k_cache.size(1), "paged prefill attention: block ",
                  block, " out of range");
    }
  }
#if defined(LUCEDESK_AVX512BF16)
  if (quantized)
    prefill_attention_bf16<int8_t>(out, q, k_cache, v_cache, block_tables, seq_lens, query_start,
                                   scale, window, sink_ptr, k_scale->data_ptr<float>(),
                                   v_scale->data_ptr<float>());
  else
    prefill_attention_bf16<c10::BFloat16>(out, q, k_cache, v_cache, block_tables, seq_lens,
                                          query_start, scale, window, sink_ptr, nullptr, nullptr);
#endif
}

}  // namespace
