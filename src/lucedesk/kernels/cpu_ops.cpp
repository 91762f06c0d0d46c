// CPU kernels for lucedesk, built on first use by kernels/cpu.py and registered as
// torch.ops.lucedesk_cpu.*. Each has a torch reference (attention_torch.py, layers_torch.py)
// and the same numerics: fp32 arithmetic, rounding to the tensor dtype at the same points
// as the reference, so bf16 results match it to the last bit in the norms and rotary.
//
// Paged decode attention reads the KV blocks in place through the block table; one task
// per (sequence, KV head) handles all query heads of that GQA group, so each block is read
// once per KV head. Every row's result depends only on that row: batching cannot change it.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#if defined(__AVX512BF16__)
#define LUCEDESK_AVX512BF16 1
#include <immintrin.h>
#endif
#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512BF16__) && defined(__linux__)
#define LUCEDESK_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

inline float load_f(float x) { return x; }
inline float load_f(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline float load_f(c10::Half x) { return static_cast<float>(x); }

// n values of T -> float, in a loop the compiler vectorizes.
inline void widen(float* dst, const float* src, int64_t n) { std::memcpy(dst, src, n * 4); }
inline void widen(float* dst, const c10::BFloat16* src, int64_t n) {
  const uint16_t* raw = reinterpret_cast<const uint16_t*>(src);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = __builtin_bit_cast(float, uint32_t(raw[i]) << 16);
}
inline void widen(float* dst, const c10::Half* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// exp(x) for x <= 0 (softmax scores minus their max), within ~2 ulp, in plain arithmetic
// the compiler vectorizes (libm's expf is a scalar call): x = k ln2 + r, |r| <= ln2 / 2,
// exp(r) by Cephes' polynomial, 2^k built in the exponent bits.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);  // below this exp underflows; keeps 2^k a normal float
  const float k = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = (x - k * 0.693359375f) + k * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
  return p * __builtin_bit_cast(float, bits);
}

#if defined(LUCEDESK_AVX512BF16)
// Lane i of the result = the sum of a[i]'s sixteen lanes, by a fixed tree of shuffles:
//   16 -> 8 vectors, each half a sum for two sources; 8 -> 4, each 128-bit quarter a
//   4-float partial of one source; 4 -> 1 with lane 4q + j holding source 4j + q, then a
//   permute puts source i in lane i.
inline __m512 sum16(const __m512* a) {
  __m512 b[8], c[4];
  for (int i = 0; i < 8; ++i)
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
  for (int j = 0; j < 4; ++j)
    c[j] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * j], b[2 * j + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * j], b[2 * j + 1], 0xDD));
  const __m512 d0 = _mm512_add_ps(_mm512_unpacklo_ps(c[0], c[1]), _mm512_unpackhi_ps(c[0], c[1]));
  const __m512 d1 = _mm512_add_ps(_mm512_unpacklo_ps(c[2], c[3]), _mm512_unpackhi_ps(c[2], c[3]));
  const __m512 e = _mm512_add_ps(_mm512_shuffle_ps(d0, d1, _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm512_shuffle_ps(d0, d1, _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, e);
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
// out = inv_sum * sum_j p[j] v_j over a sequence's value rows, read in place: pairs of rows
// interleaved (v_j[e], v_j+1[e]) and multiplied with (p[j], p[j+1]) in bf16 by vdpbf16ps.
// Unpacking within 128-bit lanes leaves the accumulators in the order
//   lo: e 0-3, 8-11, 16-19, 24-27    hi: e 4-7, 12-15, 20-23, 28-31
// of each 32-wide slice; two permutes restore it at the end.
inline void weighted_values_bf16(const float* p, const c10::BFloat16* vp, const int32_t* table,
                                 int64_t head, int64_t num_blocks, int64_t bs, int64_t len,
                                 int64_t hd, float inv_sum, c10::BFloat16* out) {
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second =
      _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  // (p[2i], p[2i + 1]) as one bf16 pair per 32 bits; blocks have an even number of rows,
  // so a pair never straddles two blocks.
  std::vector<int32_t> pairs((len + 1) / 2);
  for (int64_t i = 0; i < len; i += 2) {
    const uint32_t upper = i + 1 < len ? c10::BFloat16(p[i + 1]).x : 0;
    pairs[i / 2] = static_cast<int32_t>(upper << 16 | c10::BFloat16(p[i]).x);
  }
  for (int64_t c = 0; c < hd; c += 32) {
    __m512 lo = _mm512_setzero_ps(), hi = _mm512_setzero_ps();
    for (int64_t j0 = 0; j0 < len; j0 += bs) {
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

// Calls f(T{}) for the activation dtypes the kernels take: float32, bfloat16, float16.
template <typename F>
void dispatch(at::ScalarType dtype, F&& f) {
  switch (dtype) {
    case at::kFloat: return f(float{});
    case at::kBFloat16: return f(c10::BFloat16{});
    case at::kHalf: return f(c10::Half{});
    default: TORCH_CHECK(false, "lucedesk CPU kernels take float32, bfloat16 or float16");
  }
}

// float -> bf16 bits, rounding to nearest even (as c10 does, NaN aside), in plain integer
// arithmetic the compiler vectorizes.
inline uint16_t bf16_bits(float x) {
  uint32_t u = __builtin_bit_cast(uint32_t, x);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// Round a float to T and back: the rounding a torch op in dtype T applies to its result.
template <typename T>
inline float round_to(float x) {
  return static_cast<float>(static_cast<T>(x));
}
template <>
inline float round_to<float>(float x) {
  return x;
}
template <>
inline float round_to<c10::BFloat16>(float x) {
  return __builtin_bit_cast(float, static_cast<uint32_t>(bf16_bits(x)) << 16);
}

// A float stored as T, rounded as torch rounds.
template <typename T>
inline T narrow(float x) {
  return static_cast<T>(x);
}
template <>
inline c10::BFloat16 narrow<c10::BFloat16>(float x) {
  return c10::BFloat16(bf16_bits(x), c10::BFloat16::from_bits());
}

template <typename T>
void decode_attention(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                      const at::Tensor& v_cache, const at::Tensor& block_tables,
                      const at::Tensor& seq_lens, double scale) {
  // q, out: [D, nh, hd] (head_dim contiguous); caches: [kvh, num_blocks, bs, hd] contiguous;
  // block_tables: [>=D, max_blocks] int32 contiguous; seq_lens: [>=D] int32.
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
          for (int64_t j0 = 0; j0 < len; j0 += 16) {
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
      for (int64_t j0 = 0; j0 < len && !scored; j0 += bs) {
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
        for (int64_t j = 0; j < len; ++j) mx = sg[j] > mx ? sg[j] : mx;
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < len; ++j) {
          sg[j] = exp_nonpositive(sg[j] - mx);
          sum += sg[j];
        }
        inv_sum[g] = 1.f / sum;
      }
#if defined(LUCEDESK_AVX512BF16)
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        if (hd % 32 == 0) {
          for (int64_t g = 0; g < group; ++g) {
            T* dst = op + row * o_stride_row + (head * group + g) * o_stride_head;
            weighted_values_bf16(scores.data() + g * len, vp, table, head, num_blocks, bs, len,
                                 hd, inv_sum[g], dst);
          }
          continue;
        }
      }
#endif
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j0 = 0; j0 < len; j0 += bs) {
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
                            const at::Tensor& seq_lens, double scale) {
  dispatch(q.scalar_type(), [&](auto zero) {
    using scalar_t = decltype(zero);
    decode_attention<scalar_t>(out, q, k_cache, v_cache, block_tables, seq_lens, scale);
  });
}

template <typename T>
void add_rms_norm_impl(T* normed, T* residual_out, const T* x, const T* residual,
                       const T* weight, int64_t rows, int64_t H, double eps) {
  // Rows of H contiguous values. With a residual, residual_out = x + residual (in T) and
  // the norm reads that sum; without one, the norm reads x and residual_out is unused.
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> h(H), r(H);
    for (int64_t t = begin; t < end; ++t) {
      widen(h.data(), x + t * H, H);
      if (residual) {
        widen(r.data(), residual + t * H, H);
#pragma omp simd
        for (int64_t e = 0; e < H; ++e) h[e] = round_to<T>(h[e] + r[e]);  // the stream, in T
#pragma omp simd
        for (int64_t e = 0; e < H; ++e) residual_out[t * H + e] = narrow<T>(h[e]);
      }
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t e = 0; e < H; ++e) ss += h[e] * h[e];
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(H) + feps);
      widen(r.data(), weight, H);
      // fp32: (x * inv) * w; narrower dtypes: w * T(x * inv), as the reference rounds.
#pragma omp simd
      for (int64_t e = 0; e < H; ++e)
        normed[t * H + e] = narrow<T>(round_to<T>(h[e] * inv) * r[e]);
    }
  });
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x,
                                                 const std::optional<at::Tensor>& residual,
                                                 const at::Tensor& weight, double eps) {
  at::Tensor normed = at::empty_like(x);
  at::Tensor residual_out = residual.has_value() ? at::empty_like(x) : x;
  dispatch(x.scalar_type(), [&](auto zero) {
    using scalar_t = decltype(zero);
    add_rms_norm_impl<scalar_t>(
        normed.data_ptr<scalar_t>(),
        residual.has_value() ? residual_out.data_ptr<scalar_t>() : nullptr,
        x.data_ptr<scalar_t>(), residual.has_value() ? residual->data_ptr<scalar_t>() : nullptr,
        weight.data_ptr<scalar_t>(), x.size(0), x.size(1), eps);
  });
  return {normed, residual_out};
}

template <typename T>
void rotary_impl(at::Tensor& t, const at::Tensor& cos, const at::Tensor& sin) {
  // t: [T, heads, hd] with head_dim contiguous (a view into the fused qkv is fine), rotated
  // in place as x * cos + rotate_half(x) * sin, each product and the sum rounded to T.
  // cos, sin: [T, hd] contiguous, each row's entry of the table.
  const int64_t rows = t.size(0), heads = t.size(1), hd = t.size(2), half = hd / 2;
  const int64_t s_row = t.stride(0), s_head = t.stride(1);
  T* tp = t.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> x(hd), c(hd), s(hd);
    for (int64_t r = begin; r < end; ++r) {
      widen(c.data(), cp + r * hd, hd);
      widen(s.data(), sp + r * hd, hd);
      for (int64_t h = 0; h < heads; ++h) {
        T* row = tp + r * s_row + h * s_head;
        widen(x.data(), row, hd);
        // First half: x * cos - x[half:] * sin; second half: x * cos + x[:half] * sin.
#pragma omp simd
        for (int64_t e = 0; e < half; ++e)
          row[e] = narrow<T>(round_to<T>(x[e] * c[e]) + round_to<T>(-x[e + half] * s[e]));
#pragma omp simd
        for (int64_t e = half; e < hd; ++e)
          row[e] = narrow<T>(round_to<T>(x[e] * c[e]) + round_to<T>(x[e - half] * s[e]));
      }
    }
  });
}

void rotary_(at::Tensor q, at::Tensor k, const at::Tensor& cos, const at::Tensor& sin) {
  dispatch(q.scalar_type(), [&](auto zero) {
    using scalar_t = decltype(zero);
    rotary_impl<scalar_t>(q, cos, sin);
    rotary_impl<scalar_t>(k, cos, sin);
  });
}

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

TORCH_LIBRARY(lucedesk_cpu, m) {
  m.def(
      "paged_decode_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, "
      "Tensor block_tables, Tensor seq_lens, float scale) -> ()",
      &paged_decode_attention);
  m.def("add_rms_norm(Tensor x, Tensor? residual, Tensor weight, float eps) -> (Tensor, Tensor)",
        &add_rms_norm);
  m.def("int8_linear(Tensor x, Tensor q, Tensor d, Tensor m) -> Tensor", &int8_linear);
  m.def("int8_linear_tiles(Tensor x, Tensor q, Tensor d, Tensor m) -> Tensor",
        &int8_linear_tiles);
  m.def("int8_amx_available() -> bool", &int8_amx_available);
  m.def("rotary_(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin) -> ()",
        &rotary_);
}
