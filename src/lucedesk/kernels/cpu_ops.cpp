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
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
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

// Round a float to T and back: the rounding a torch op in dtype T applies to its result.
template <typename T>
inline float round_to(float x) {
  return static_cast<float>(static_cast<T>(x));
}
template <>
inline float round_to<float>(float x) {
  return x;
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
      // block (bs x hd contiguous values) is widened to float once, then dotted.
      for (int64_t j0 = 0; j0 < len; j0 += bs) {
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
        for (int64_t e = 0; e < hd; ++e) dst[e] = static_cast<T>(acc[g * hd + e] * inv_sum[g]);
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
    std::vector<float> h(H);
    for (int64_t t = begin; t < end; ++t) {
      float ss = 0.f;
      for (int64_t e = 0; e < H; ++e) {
        float v = load_f(x[t * H + e]);
        if (residual) v = round_to<T>(v + load_f(residual[t * H + e]));
        h[e] = v;
        ss += v * v;
      }
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(H) + feps);
      for (int64_t e = 0; e < H; ++e) {
        if (residual) residual_out[t * H + e] = static_cast<T>(h[e]);
        // fp32: (x * inv) * w; narrower dtypes: w * T(x * inv), as the reference rounds.
        normed[t * H + e] = static_cast<T>(round_to<T>(h[e] * inv) * load_f(weight[e]));
      }
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
    std::vector<float> x(hd);
    for (int64_t r = begin; r < end; ++r) {
      const T* c = cp + r * hd;
      const T* s = sp + r * hd;
      for (int64_t h = 0; h < heads; ++h) {
        T* row = tp + r * s_row + h * s_head;
        for (int64_t e = 0; e < hd; ++e) x[e] = load_f(row[e]);
        for (int64_t e = 0; e < hd; ++e) {
          const float rot = e < half ? round_to<T>(-x[e + half]) : x[e - half];
          const float a = round_to<T>(x[e] * load_f(c[e]));
          const float b = round_to<T>(rot * load_f(s[e]));
          row[e] = static_cast<T>(a + b);
        }
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

#if defined(__AVX512BF16__)
// Lane i of the result = the sum of a[i]'s sixteen lanes: a fixed tree of shuffles and adds
// (the same for every output, whatever the batch).
//   level 1: 16 -> 8 vectors, each half a sum for two sources
//   level 2:  8 -> 4, each 128-bit quarter a 4-float partial of one source
//   level 3:  4 -> 1, lane 4q + j holding source 4j + q; a permute puts source i in lane i
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

// Sixteen output channels [n0, n0 + 16) for every row: their weight rows are widened to
// bf16 once (int8 is exact in bf16), then each row's activation slice is loaded once and
// dotted with all sixteen by vdpbf16ps.
void int8_block16(const c10::BFloat16* x, const int8_t* w, const float* scale,
                  c10::BFloat16* y, int64_t n0, int64_t M, int64_t N, int64_t K,
                  __m512bh* wbuf) {
  const int64_t chunks = K / 32;
  for (int64_t i = 0; i < 16; ++i) {
    const int8_t* wr = w + (n0 + i) * K;
    // The next block's rows are on their way while this one computes.
    if (n0 + 16 < N)
      for (int64_t b = 0; b < K; b += 64)
        _mm_prefetch(reinterpret_cast<const char*>(wr + 16 * K + b), _MM_HINT_T0);
    for (int64_t c = 0; c < chunks; ++c) {
      const __m512 lo = _mm512_cvtepi32_ps(
          _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + 32 * c))));
      const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + 32 * c + 16))));
      wbuf[c * 16 + i] = _mm512_cvtne2ps_pbh(hi, lo);  // lanes 0-15 from lo, 16-31 from hi
    }
  }
  const __m512 sc = _mm512_loadu_ps(scale + n0);
  for (int64_t m = 0; m < M; ++m) {
    const c10::BFloat16* xr = x + m * K;
    __m512 acc[16];
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t c = 0; c < chunks; ++c) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(xr + 32 * c);
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], xv, wbuf[c * 16 + i]);
    }
    const __m256bh out = _mm512_cvtneps_pbh(_mm512_mul_ps(sum16(acc), sc));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + m * N + n0), (__m256i)out);
  }
}
#endif

// Weight-only int8 linear: y[m, n] = scale[n] * sum_k x[m, k] * w[n, k], x bfloat16, w int8
// with one scale per output channel. Decode reads every weight once per step, so half the
// bytes of bf16 weights is up to half the time. Every output is computed in the same order
// whatever the number of rows M, so a row's result does not depend on its batch.
void int8_linear_rows(const c10::BFloat16* x, const int8_t* w, const float* scale,
                      c10::BFloat16* y, int64_t M, int64_t N, int64_t K) {
  int64_t blocked = 0;  // channels [0, blocked) go sixteen at a time
#if defined(__AVX512BF16__)
  if (K % 32 == 0) {
    blocked = N - N % 16;
    at::parallel_for(0, blocked / 16, 4, [&](int64_t begin, int64_t end) {
      std::vector<__m512bh> wbuf(K / 32 * 16);
      for (int64_t b = begin; b < end; ++b)
        int8_block16(x, w, scale, y, b * 16, M, N, K, wbuf.data());
    });
  }
#endif
  at::parallel_for(blocked, N, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> wf(K);
    for (int64_t n = begin; n < end; ++n) {
      for (int64_t k = 0; k < K; ++k) wf[k] = static_cast<float>(w[n * K + k]);
      for (int64_t m = 0; m < M; ++m) {
        const c10::BFloat16* xr = x + m * K;
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t k = 0; k < K; ++k) dot += load_f(xr[k]) * wf[k];
        y[m * N + n] = static_cast<c10::BFloat16>(dot * scale[n]);
      }
    }
  });
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16,
              "int8_linear: x must be contiguous bfloat16 [M, K]");
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.scalar_type() == at::kChar,
              "int8_linear: w must be contiguous int8 [N, K]");
  TORCH_CHECK(w.size(1) == x.size(1), "int8_linear: x and w differ in K");
  TORCH_CHECK(scale.dim() == 1 && scale.size(0) == w.size(0) && scale.is_contiguous() &&
                  scale.scalar_type() == at::kFloat,
              "int8_linear: scale must be float32 [N]");
  at::Tensor y = at::empty({x.size(0), w.size(0)}, x.options());
  int8_linear_rows(x.data_ptr<c10::BFloat16>(), w.data_ptr<int8_t>(), scale.data_ptr<float>(),
                   y.data_ptr<c10::BFloat16>(), x.size(0), w.size(0), x.size(1));
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
  m.def("int8_linear(Tensor x, Tensor w, Tensor scale) -> Tensor", &int8_linear);
  m.def("rotary_(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin) -> ()",
        &rotary_);
}
