// What every CPU kernel shares: loading and widening the activation dtypes to float,
// rounding and narrowing back as torch does, dtype dispatch, and vector helpers.
#pragma once

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
#include <array>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

// n values of T left unset, for a kernel that writes every one of them before reading it
// (std::vector would fill them with zeros first: a pass over memory for nothing).
template <typename T>
class Scratch {
 public:
  explicit Scratch(int64_t n) : data_(new T[n]) {}
  T* data() const { return data_.get(); }
  T& operator[](int64_t i) const { return data_[i]; }

 private:
  std::unique_ptr<T[]> data_;
};

// v as it is, hidden from the optimizer: the kernels build with -fassociative-math, which
// is free to regroup a product chain (a * b) * c as a * (b * c); a product passed through
// here rounds where the vector path rounds it.
inline float kept(float v) {
#if defined(__x86_64__)
  asm("" : "+x"(v));
#elif defined(__aarch64__)
  asm("" : "+w"(v));
#endif
  return v;
}

// Each thread runs worker(take), take() handing out 0, 1, ..., count - 1 once each to
// whichever thread asks first, then -1: items of uneven cost, put in order of cost, keep
// every thread busy where an even split by count would leave one waiting on another.
template <typename Worker>
void take_in_turn(int64_t count, Worker&& worker) {
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    worker([&]() -> int64_t {
      const int64_t k = next++;
      return k < count ? k : -1;
    });
  });
}

// Each thread runs worker(begin, end) over one run of the tasks 0..count - 1, the runs cut
// where the tasks' summed costs (cost(t) >= 1) are even: tasks of uneven cost keep their
// order, so a thread keeps its neighbouring weights, and neither thread waits long on the
// other (an even split by count left one idle for a tenth of a mixture's step).
template <typename Cost, typename Worker>
void split_by_cost(int64_t count, Cost&& cost, Worker&& worker) {
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), count);
  if (threads <= 1 || at::in_parallel_region()) {
    worker(0, count);
    return;
  }
  std::vector<int64_t> sum(count + 1, 0);
  for (int64_t t = 0; t < count; ++t) sum[t + 1] = sum[t] + cost(t);
  std::vector<int64_t> cut(threads + 1, count);
  for (int64_t i = 0; i < threads; ++i)
    cut[i] = std::lower_bound(sum.begin(), sum.end(), sum[count] * i / threads) - sum.begin();
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) worker(cut[i], cut[i + 1]);
  });
}

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

#if defined(__AVX512F__)
#include <immintrin.h>

inline __m512 add_ps(__m512 a, __m512 b) { return _mm512_add_ps(a, b); }
inline __m512 max_ps(__m512 a, __m512 b) { return _mm512_max_ps(a, b); }
inline __m512 add_epi32(__m512 a, __m512 b) {  // int32 lanes carried in a float vector
  return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(a), _mm512_castps_si512(b)));
}

// The last two stages of reduce16: c[j]'s 128-bit quarter k a 4-lane partial of source
// 4j + k -> lane i `op` over source i's partial (4 -> 1 with lane 4q + j holding source
// 4j + q, then a permute puts source i in lane i).
template <typename Op>
inline __m512 reduce4x4(const __m512* c, const Op& op) {
  const __m512 d0 = op(_mm512_unpacklo_ps(c[0], c[1]), _mm512_unpackhi_ps(c[0], c[1]));
  const __m512 d1 = op(_mm512_unpacklo_ps(c[2], c[3]), _mm512_unpackhi_ps(c[2], c[3]));
  const __m512 e = op(_mm512_shuffle_ps(d0, d1, _MM_SHUFFLE(1, 0, 1, 0)),
                      _mm512_shuffle_ps(d0, d1, _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, e);
}

// Lane i of the result = `op` (add_ps, max_ps, add_epi32) over a[i]'s sixteen lanes, by a
// fixed tree of shuffles (four rounds for sixteen sources, where one reduction each would
// take four rounds a source):
//   16 -> 8 vectors, each half a partial for two sources; 8 -> 4, each 128-bit quarter the
//   4-lane partial (A0 op A2) op (A1 op A3) of one source, A_q its quarter q; then
//   reduce4x4. The float sums' order is fixed: attention's bits depend on it.
template <typename Op>
inline __m512 reduce16(const __m512* a, const Op& op) {
  __m512 b[8], c[4];
  for (int i = 0; i < 8; ++i)
    b[i] = op(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
              _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
  for (int j = 0; j < 4; ++j)
    c[j] = op(_mm512_shuffle_f32x4(b[2 * j], b[2 * j + 1], 0x88),
              _mm512_shuffle_f32x4(b[2 * j], b[2 * j + 1], 0xDD));
  return reduce4x4(c, op);
}
inline __m512 sum4x4(const __m512* c) { return reduce4x4(c, add_ps); }
inline __m512 sum16(const __m512* a) { return reduce16(a, add_ps); }
#endif

// An attention op's optional inputs, checked (`op` names it in errors): sinks, float32
// [num_heads]; an 8-bit cache's scales, float32 [kvh, blocks, bs] for K and V, given exactly
// when the cache is int8. Returns the sinks' data, or null.
inline const float* attention_extras(const char* op, const at::Tensor& q,
                                     const at::Tensor& k_cache, const at::Tensor& v_cache,
                                     const std::optional<at::Tensor>& sinks,
                                     const std::optional<at::Tensor>& k_scale,
                                     const std::optional<at::Tensor>& v_scale) {
  const bool quantized = k_cache.scalar_type() == at::kChar;
  TORCH_CHECK(quantized == k_scale.has_value() && quantized == v_scale.has_value() &&
                  v_cache.scalar_type() == k_cache.scalar_type(),
              op, ": an int8 cache takes k_scale and v_scale, others none");
  if (quantized) {
    for (const at::Tensor& s : {*k_scale, *v_scale})
      TORCH_CHECK(s.scalar_type() == at::kFloat && s.is_contiguous() && s.dim() == 3 &&
                      s.size(0) == k_cache.size(0) && s.size(1) == k_cache.size(1) &&
                      s.size(2) == k_cache.size(2),
                  op, ": scales must be contiguous float32 [kvh, blocks, bs]");
  }
  if (!sinks.has_value()) return nullptr;
  TORCH_CHECK(sinks->scalar_type() == at::kFloat && sinks->is_contiguous() && sinks->dim() == 1 &&
                  sinks->size(0) == q.size(1),
              op, ": sinks must be contiguous float32 [num_heads]");
  return sinks->data_ptr<float>();
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

}  // namespace
