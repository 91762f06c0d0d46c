// Paged decode attention over the KV blocks in place (see ops.cpp).
#pragma once

#include "decode_parts.h"

namespace {

// Key columns per head that dots sixteen keys, from which regrouping them for
// scores16_quartered pays (a head of 128 columns: eight heads); heads of up to 64 columns,
// dotted two at a time, pay from fewer (64 columns: three heads, a one-row decode of
// SmolLM2: sixteen such decodes a call 0.75-0.95x the time, in cache or read cold, at 256
// and 4k tokens; two heads were as often slower as faster).
constexpr int64_t kRegroupColumns = 16, kRegroupColumnsInTwos = 22;

// One call's decode: q, out: [R, nh, hd] (head_dim contiguous), the query rows of S
// sequences; query_start: [S + 1] int32, sequence s owning rows query_start[s]..
// query_start[s + 1] - 1; caches: [kvh, num_blocks, bs, hd] contiguous; block_tables: [>=S,
// max_blocks] int32 contiguous; seq_lens: [>=S] int32. Row i of a sequence with n rows
// sees keys up to its causal end seq_len - (n - 1 - i), and of those the last `window` (0:
// all); sinks (nullable, [nh]) join each head's softmax denominator. A row's arithmetic is
// the same whatever the other rows of its sequence: the result of one sequence of n rows
// equals n sequences of one.
//
// C, the cache's type: T, or int8_t for an 8-bit cache whose float scales k_scales /
// v_scales ([kvh, num_blocks, bs], one per token and KV head) multiply each key's score
// and each value's weight (p_j * s_j), so the arithmetic stays in float.
template <typename T, typename C>
struct Decode {
  static constexpr bool kQuantized = std::is_same_v<C, int8_t>;
  // bf16 activations over a bf16 cache, or over an 8-bit one widened to bf16 block by
  // block: both products by vdpbf16ps.
  static constexpr bool kBf16Path =
      std::is_same_v<T, c10::BFloat16> && (std::is_same_v<C, T> || kQuantized);

  int64_t S, hd, kvh, num_blocks, bs, full, table_width;
  int64_t q_stride_row, q_stride_head, o_stride_row, o_stride_head, window;
  const T* qp;
  const C* kp;
  const C* vp;
  T* op;
  const int32_t *tables, *lens, *starts;
  float fscale;
  const float *sinks, *k_scales, *v_scales;

  // One sequence's KV head for `group` of its query heads (head * full + g0 + g): its rows,
  // their scores (scores[h * stride + j - origin] for key j, h = i * group + g: row i, query
  // head g of the group), and each head's 1 / denominator and output row.
  struct Task {
    int64_t seq, head, g0, group, row0, len, origin, stride, half;
    QueryRows rows;
    std::vector<float> scores, inv_sum;
    std::vector<int32_t> pairs;  // the bf16 path's probability pairs, half per head
    std::vector<T*> outs;
    int64_t heads() const { return rows.n * group; }
  };

  Decode(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
         const at::Tensor& v_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
         const at::Tensor& query_start, double scale, int64_t window, const float* sinks,
         const float* k_scales, const float* v_scales)
      : S(query_start.size(0) - 1), hd(q.size(2)), kvh(k_cache.size(0)),
        num_blocks(k_cache.size(1)), bs(k_cache.size(2)), full(q.size(1) / kvh),
        table_width(block_tables.size(1)), q_stride_row(q.stride(0)), q_stride_head(q.stride(1)),
        o_stride_row(out.stride(0)), o_stride_head(out.stride(1)), window(window),
        qp(q.data_ptr<T>()), kp(k_cache.data_ptr<C>()), vp(v_cache.data_ptr<C>()),
        op(out.data_ptr<T>()), tables(block_tables.data_ptr<int32_t>()),
        lens(seq_lens.data_ptr<int32_t>()), starts(query_start.data_ptr<int32_t>()),
        fscale(static_cast<float>(scale)), sinks(sinks), k_scales(k_scales),
        v_scales(v_scales) {}

  // Is the value pass the bf16 one (vdpbf16ps over 32-wide column slices), and the key
  // pass too (sixteen key rows at a time)? Only then can a task's keys and columns be
  // shared out.
  bool bf16_values() const {
#if defined(LUCEDESK_AVX512BF16)
    return kBf16Path && hd % 32 == 0;
#else
    return false;
#endif
  }
  bool bf16_passes() const { return bf16_values() && bs % 16 == 0; }

  // Sets t up for a sequence's KV head; false when the sequence has no rows this step. Keys
  // first[i]..end[i]-1 are seen by row i; its blocks are walked from the one holding
  // first[i], whose earlier rows get weight 0. Row 0 begins earliest: its block is origin.
  bool plan(Task& t, int64_t seq, int64_t head, int64_t g0, int64_t group) const {
    const int64_t row0 = starts[seq], n = starts[seq + 1] - row0, len = lens[seq];
    if (n <= 0) return false;
    t.seq = seq, t.head = head, t.g0 = g0, t.group = group, t.row0 = row0, t.len = len;
    QueryRows& r = t.rows;
    r.n = n;
    r.first.resize(n), r.begin.resize(n), r.end.resize(n);
    for (int64_t i = 0; i < n; ++i) {
      r.end[i] = len - (n - 1 - i);
      r.first[i] = window > 0 ? std::max<int64_t>(0, r.end[i] - window) : 0;
      r.begin[i] = r.first[i] / bs * bs;
    }
    t.origin = r.begin[0], t.stride = len - t.origin, t.half = (t.stride + 1) / 2;
    const int64_t heads = t.heads();
    t.scores.assign(heads * t.stride, 0.f);
    t.inv_sum.resize(heads), t.outs.resize(heads);
    if (bf16_values()) t.pairs.assign(heads * t.half, 0);
    for (int64_t h = 0; h < heads; ++h)
      t.outs[h] = op + (row0 + h / group) * o_stride_row + query_head(t, h) * o_stride_head;
    return true;
  }
  int64_t query_head(const Task& t, int64_t h) const {
    return t.head * full + t.g0 + h % t.group;
  }
  const T* q_of(const Task& t, int64_t h) const {  // row i = h / group
    return qp + (t.row0 + h / t.group) * q_stride_row + query_head(t, h) * q_stride_head;
  }

  // Pass 1 over keys j_lo..j_hi - 1 (j_lo a block's first row): scores[h, j] = q_h . k_j,
  // each block read in place once for all rows that see any of it. In bf16 with
  // AVX512-BF16, dotted as stored, sixteen key rows at a time; otherwise each block
  // widened to float once, then dotted.
  void score(Task& t, int64_t j_lo, int64_t j_hi) const {
    const QueryRows& rows_of = t.rows;
    const int64_t n = rows_of.n, group = t.group, head = t.head;
    const int32_t* table = tables + t.seq * table_width;
#if defined(LUCEDESK_AVX512BF16)
    if constexpr (kBf16Path) {
      if (bf16_passes()) {
        std::vector<c10::BFloat16> kwide(kQuantized ? 16 * hd : 0);
        // Regrouping sixteen keys costs about as many shuffles as hd / 16 heads' sums save
        // (scores16_quartered; hd / 22 for heads of up to 64 columns, dotted in twos): it is
        // done where at least that many heads dot them. Either way the scores have the same
        // bits.
        const int64_t heads = t.heads();
        const bool in_twos = hd <= 64;  // 32 or 64 columns: regrouped heads go two at a time
        const int64_t columns = in_twos ? kRegroupColumnsInTwos : kRegroupColumns;
        const bool may_regroup = heads * columns >= hd;
        Scratch<c10::BFloat16> qq(may_regroup ? heads * hd * 4 : 0);
        Scratch<c10::BFloat16> kq(may_regroup ? 16 * hd : 0);
        Scratch<int64_t> dot_heads(heads), dot_rows(heads);
        for (int64_t h = 0; h < (may_regroup ? heads : 0); ++h)
          quarter_query(q_of(t, h), hd, qq.data() + h * hd * 4);
        Ahead<C> ahead;  // the keys kPrefetchBlocks blocks of sixteen on
        for (int64_t j0 = j_lo; j0 < j_hi; j0 += 16) {
          const int64_t next = j0 + kPrefetchBlocks * 16;
          ahead.aim(kp, table, next, std::min<int64_t>(16, j_hi - next), head, num_blocks, bs, hd,
                    0, hd);
          const int64_t key_row = (head * num_blocks + table[j0 / bs]) * bs + j0 % bs;
          const c10::BFloat16* kb;
          if constexpr (kQuantized) {  // sixteen keys' levels widened once for all rows
            levels_to_bf16(kwide.data(), kp + key_row * hd,
                           std::min<int64_t>(16, j_hi - j0) * hd);
            kb = kwide.data();
          } else {
            kb = kp + key_row * hd;
          }
          // The heads that dot some of these keys, and how many of the keys each sees.
          int64_t dotting = 0;
          for (int64_t i = 0; i < n; ++i) {
            if (!rows_of.walks(i, j0 / bs * bs)) continue;
            const int64_t rows = std::min<int64_t>(16, rows_of.end[i] - j0);
            for (int64_t h = i * group; h < (i + 1) * group && rows > 0; ++h)
              dot_heads[dotting] = h, dot_rows[dotting++] = rows;
          }
          const auto scores_of = [&](int64_t k) {
            return t.scores.data() + dot_heads[k] * t.stride + (j0 - t.origin);
          };
          const bool regroup = may_regroup && dotting * columns >= hd;
          // The calls below, each of which first asks for a share of the keys ahead.
          int64_t calls = regroup && in_twos ? (dotting + 1) / 2 : dotting, k = 0;
          if (regroup) {
            quarter_keys(kb, hd, kq.data());
            const auto q_quarters = [&](int64_t k) { return qq.data() + dot_heads[k] * hd * 4; };
            // Two at a time, their queries held in registers.
            const auto two_at_a_time = [&](auto chunks) {
              for (; k + 1 < dotting; k += 2) {
                ahead.ask(calls--);
                scores16_quartered_two<decltype(chunks)::value>(
                    q_quarters(k), q_quarters(k + 1), kq.data(), dot_rows[k], dot_rows[k + 1],
                    fscale, scores_of(k), scores_of(k + 1));
              }
            };
            if (hd == 64) two_at_a_time(std::integral_constant<int, 2>());
            if (hd == 32) two_at_a_time(std::integral_constant<int, 1>());
            for (; k < dotting; ++k) {
              ahead.ask(calls--);
              scores16_quartered(q_quarters(k), kq.data(), dot_rows[k], hd, fscale, scores_of(k));
            }
          }
          for (; k < dotting; ++k) {
            ahead.ask(calls--);
            scores16_bf16(q_of(t, dot_heads[k]), kb, dot_rows[k], hd, fscale, scores_of(k));
          }
          ahead.ask(1);  // where no head dotted these keys
          if constexpr (kQuantized)
            for (k = 0; k < dotting; ++k)
              for (int64_t r = 0; r < dot_rows[k]; ++r) scores_of(k)[r] *= k_scales[key_row + r];
        }
        return;
      }
    }
#endif
    const int64_t heads = t.heads();
    std::vector<float> qf(heads * hd), kf(bs * hd);
    for (int64_t h = 0; h < heads; ++h) {
      const T* src = q_of(t, h);
      for (int64_t e = 0; e < hd; ++e) qf[h * hd + e] = load_f(src[e]) * fscale;
    }
    for (int64_t j0 = j_lo; j0 < j_hi; j0 += bs) {
      const int64_t block_row = (head * num_blocks + table[j0 / bs]) * bs;
      widen(kf.data(), kp + block_row * hd, std::min(bs, j_hi - j0) * hd);
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
            t.scores[h * t.stride + j0 - t.origin + r] = s;
          }
        }
      }
    }
  }

  // The softmax of head h's scores, and in bf16 their probability pairs.
  void softmax(Task& t, int64_t h) const {
    const int64_t i = h / t.group;
    const float* sink = sinks ? sinks + query_head(t, h) : nullptr;
    float* sh = t.scores.data() + h * t.stride;
    t.inv_sum[h] = softmax_keys(sh, t.origin, t.rows.begin[i], t.rows.first[i], t.rows.end[i],
                                sink, kQuantized ? v_scales : nullptr,
                                tables + t.seq * table_width, t.head, num_blocks, bs);
#if defined(LUCEDESK_AVX512BF16)
    if (!t.pairs.empty())
      probability_pairs(sh, t.origin, t.rows.begin[i], t.rows.end[i],
                        t.pairs.data() + h * t.half);
#endif
  }

  // Pass 2 for columns c_lo..c_hi - 1 (multiples of 32 on the bf16 path; all of them
  // otherwise, which by_keys never asks for): out[h] = inv_sum[h] * sum_j p[h, j] v_j.
  void weigh(Task& t, int64_t c_lo, int64_t c_hi) const {
    const QueryRows& rows_of = t.rows;
    const int32_t* table = tables + t.seq * table_width;
#if defined(LUCEDESK_AVX512BF16)
    if constexpr (kBf16Path) {
      if (!t.pairs.empty()) {
        weighted_values_bf16(t.pairs.data(), t.half, t.origin, rows_of, t.group, vp, table,
                             t.head, num_blocks, bs, hd, c_lo, c_hi, t.inv_sum.data(),
                             t.outs.data());
        return;
      }
    }
#endif
    TORCH_CHECK(c_lo == 0 && c_hi == hd, "paged decode attention: only the bf16 value pass "
                "takes a share of the columns");
    const int64_t n = rows_of.n, group = t.group, heads = t.heads();
    std::vector<float> acc(heads * hd, 0.f), vf(bs * hd);
    for (int64_t j0 = t.origin; j0 < t.len; j0 += bs) {
      widen(vf.data(), vp + ((t.head * num_blocks + table[j0 / bs]) * bs) * hd,
            std::min(bs, t.len - j0) * hd);
      for (int64_t i = 0; i < n; ++i) {
        if (!rows_of.walks(i, j0)) continue;
        const int64_t rows = std::min(bs, rows_of.end[i] - j0);
        // Four rows per pass over the accumulator: one load and store of it per four
        // multiply-adds.
        for (int64_t h = i * group; h < (i + 1) * group; ++h) {
          const float* ph = t.scores.data() + h * t.stride + (j0 - t.origin);
          float* ah = acc.data() + h * hd;
          int64_t r = 0;
          for (; r + 4 <= rows; r += 4) {
            const float p0 = ph[r], p1 = ph[r + 1], p2 = ph[r + 2], p3 = ph[r + 3];
            const float* v0 = vf.data() + r * hd;
#pragma omp simd
            for (int64_t e = 0; e < hd; ++e)
              ah[e] += (p0 * v0[e] + p1 * v0[hd + e]) +
                       (p2 * v0[2 * hd + e] + p3 * v0[3 * hd + e]);
          }
          for (; r < rows; ++r) {
            const float p = ph[r];
            const float* v = vf.data() + r * hd;
#pragma omp simd
            for (int64_t e = 0; e < hd; ++e) ah[e] += p * v[e];
          }
        }
      }
    }
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t e = 0; e < hd; ++e) t.outs[h][e] = narrow<T>(acc[h * hd + e] * t.inv_sum[h]);
  }

  // Each task whole on one thread: one sequence's KV head for `group / parts` of its query
  // heads. One part while there are tasks enough for the threads; with fewer, the group is
  // split so that no thread waits, each part reading the blocks on its own. The costliest
  // tasks (query rows x keys) first, each taken by whichever thread is free: sequences'
  // drafted rows differ from step to step (one row, or eight), and an even split of the
  // tasks by count kept a thread waiting ~10% of the attention's time on an edit workload
  // at C4 (per-thread busy time against the calls' wall time).
  void by_tasks(int64_t parts) const {
    const int64_t count = S * kvh * parts;
    std::vector<int64_t> order(count), cost(S);
    for (int64_t s = 0; s < S; ++s)
      cost[s] = (starts[s + 1] - starts[s]) * (window > 0 ? std::min<int64_t>(lens[s], window)
                                                          : lens[s]);
    for (int64_t k = 0; k < count; ++k) order[k] = k;
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
      return cost[a / (kvh * parts)] > cost[b / (kvh * parts)];
    });
    take_in_turn(count, [&](auto take) {
      Task t;
      for (int64_t k = take(); k >= 0; k = take()) {
        const int64_t task = order[k];
        const int64_t seq = task / (kvh * parts), head = task / parts % kvh, part = task % parts;
        const int64_t g0 = part * full / parts, group = (part + 1) * full / parts - g0;
        if (!plan(t, seq, head, g0, group)) continue;
        score(t, t.origin, t.len);
        for (int64_t h = 0; h < t.heads(); ++h) softmax(t, h);
        weigh(t, 0, hd);
      }
    });
  }

  // Few tasks over many keys (one stream, or a few, on a model with few KV heads): each
  // sequence's KV head takes all its query heads, and the threads share out its keys for
  // the scores, then its heads for the softmax, then its columns for the weighted values,
  // so that every key and value row is read once, by one thread, where splitting the query
  // heads has each part read them all. Every score, softmax and column sum is the one
  // by_tasks computes, in the same order: the same bits.
  void by_keys(int64_t pieces, int64_t column_pieces) const {
    std::vector<Task> work(S * kvh);
    std::vector<std::array<int64_t, 3>> keys, heads, columns;  // (task, from, to)
    for (int64_t seq = 0; seq < S; ++seq) {
      for (int64_t head = 0; head < kvh; ++head) {
        const int64_t w = seq * kvh + head;
        if (!plan(work[w], seq, head, 0, full)) continue;
        const Task& t = work[w];
        const int64_t blocks = (t.len - t.origin + bs - 1) / bs;
        const int64_t cuts = std::min(pieces, blocks);
        for (int64_t p = 0; p < cuts; ++p) {
          const int64_t lo = t.origin + p * blocks / cuts * bs;
          keys.push_back({w, lo, std::min(t.len, t.origin + (p + 1) * blocks / cuts * bs)});
        }
        for (int64_t h = 0; h < t.heads(); ++h) heads.push_back({w, h, h + 1});
        const int64_t slices = hd / 32, cp = column_pieces;
        for (int64_t p = 0; p < cp; ++p)
          columns.push_back({w, p * slices / cp * 32, (p + 1) * slices / cp * 32});
      }
    }
    const auto each = [&](const std::vector<std::array<int64_t, 3>>& items, auto&& run) {
      at::parallel_for(0, items.size(), 1, [&](int64_t begin, int64_t end) {
        for (int64_t k = begin; k < end; ++k) run(work[items[k][0]], items[k][1], items[k][2]);
      });
    };
    each(keys, [&](Task& t, int64_t lo, int64_t hi) { score(t, lo, hi); });
    each(heads, [&](Task& t, int64_t h, int64_t) { softmax(t, h); });
    each(columns, [&](Task& t, int64_t lo, int64_t hi) { weigh(t, lo, hi); });
  }
};

// Keys a step's tasks walk in all, from which sharing a task's keys and columns out over
// the threads reads less than each thread reading them whole. Heads narrower than two
// column shares keep their value columns on one thread, and pay from more keys (SmolLM2's
// three KV heads of 64 columns, one stream on two threads, read cold, us a layer with
// whole heads vs shared keys: 1024 tokens 62 vs 71, 2048 138 vs 129, 4096 261 vs 244).
constexpr int64_t kKeysToShare = 1024, kKeysToShareNarrow = 4096;
// The fewest columns of a value row one thread's share may hold: 64 bf16 columns are two
// cache lines, so threads do not share a line or its prefetched neighbour. (A head of 64
// columns, split in two, ran slower than each thread reading the rows whole.)
constexpr int64_t kColumnsToShare = 64;

template <typename T, typename C>
void decode_attention(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                      const at::Tensor& v_cache, const at::Tensor& block_tables,
                      const at::Tensor& seq_lens, const at::Tensor& query_start, double scale,
                      int64_t window, const float* sinks, const float* k_scales,
                      const float* v_scales) {
  const Decode<T, C> d(out, q, k_cache, v_cache, block_tables, seq_lens, query_start, scale,
                       window, sinks, k_scales, v_scales);
  const int64_t tasks = d.S * d.kvh, wanted = 2 * static_cast<int64_t>(at::get_num_threads());
  // Shares a task's work takes: keys to every thread, value columns to as many as take at
  // least kColumnsToShare of them (one thread where the head is narrower).
  const int64_t pieces = tasks == 0 ? 1 : (wanted + tasks - 1) / tasks;
  const int64_t column_pieces =
      std::max<int64_t>(1, std::min(pieces, d.hd / kColumnsToShare));
  if (tasks > 0 && tasks < wanted && d.bf16_passes()) {
    int64_t keys = 0;
    for (int64_t s = 0; s < d.S; ++s)
      keys += window > 0 ? std::min<int64_t>(d.lens[s], window) : d.lens[s];
    if (keys * d.kvh >= (column_pieces >= 2 ? kKeysToShare : kKeysToShareNarrow))
      return d.by_keys(pieces, column_pieces);
  }
  // Whole tasks where they keep the threads about as busy as three keep two (the longest
  // thread a third over the mean): a group of query heads split in parts has each part
  // read its KV head's keys and values, and smaller groups dot them without regrouping.
  // With the narrow heads' shared keys above (SmolLM2, one stream on two threads, read
  // cold, us a layer against splitting the groups: 1024 tokens 83 -> 72, 4096 291 -> 251,
  // 16k 1918 -> 937; eight draft rows at 4096 627 -> 539; 256 tokens within the noise).
  const int64_t threads = wanted / 2, rounds = (tasks + threads - 1) / threads;
  const bool whole = 3 * rounds * threads <= 4 * tasks;
  d.by_tasks(whole ? 1 : std::clamp<int64_t>(pieces, 1, d.full));
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
