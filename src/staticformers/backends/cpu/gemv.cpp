// A weight-only int8 projection of a few rows, streaming the int8 weight once (backends/cpu/int8_gemv.py).
//
// y[m, n] = scale[n] * sum_k w[n, k] * x[m, k], accumulated in float32, for several weights of one input.
// w: [N, K] int8, row-major; x: [M, K] and y: [M, N] in the activations' dtype (bfloat16 or float32);
// scale: [N] (bfloat16 or float32). Registered as the CPU kernel of `staticformers::int8_gemv`, whose
// schema and shape function int8_gemv.py defines.
//
// Why it is written this way: a decode step's projections are bound by the bytes of the weight, so the
// loop reads the weights as one forward stream (each row whole, rows in order, the rows of all the
// weights of a call split between threads in contiguous ranges), one cache line an iteration into four
// independent float32 accumulators, and prefetches SF_PREFETCH bytes ahead. Reading several rows side by
// side instead, a few cache lines of each, is what ATen's kernel does, and it defeats the hardware's
// stream prefetch once the weights no longer fit in cache (BENCHMARKS.md, weight-only int8). It is a C++
// operator, not a Python one, because a decode step calls it about 33 times and the dispatch through
// Python cost several times the call of the kernel itself.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#ifndef SF_PREFETCH
#define SF_PREFETCH 4096
#endif

static inline float bf16_to_float(uint16_t v) {
  uint32_t u = ((uint32_t)v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

static inline uint16_t float_to_bf16(float f) {  // round to nearest even, as torch rounds
  if (std::isnan(f)) return (uint16_t)0x7FC0;
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

static inline float to_float(float v) { return v; }
static inline float to_float(uint16_t v) { return bf16_to_float(v); }
static inline void store(float* p, float f) { *p = f; }
static inline void store(uint16_t* p, float f) { *p = float_to_bf16(f); }

#if defined(__AVX512F__)
static inline __m512 widen16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
}
#elif defined(__AVX2__)
static inline __m256 widen8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}
#endif

// The dot product of one weight row with one float32 activation row, over k in [0, K).
static inline float row_dot(const int8_t* wr, const float* xm, const int64_t K) {
  float sum = 0.f;
  int64_t k = 0;
#if defined(__AVX512F__)
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
  for (; k + 64 <= K; k += 64) {
    _mm_prefetch((const char*)(wr + k + SF_PREFETCH), _MM_HINT_T0);
    a0 = _mm512_fmadd_ps(widen16(wr + k), _mm512_loadu_ps(xm + k), a0);
    a1 = _mm512_fmadd_ps(widen16(wr + k + 16), _mm512_loadu_ps(xm + k + 16), a1);
    a2 = _mm512_fmadd_ps(widen16(wr + k + 32), _mm512_loadu_ps(xm + k + 32), a2);
    a3 = _mm512_fmadd_ps(widen16(wr + k + 48), _mm512_loadu_ps(xm + k + 48), a3);
  }
  sum = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
#elif defined(__AVX2__)
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
  for (; k + 32 <= K; k += 32) {
    _mm_prefetch((const char*)(wr + k + SF_PREFETCH), _MM_HINT_T0);
    a0 = _mm256_fmadd_ps(widen8(wr + k), _mm256_loadu_ps(xm + k), a0);
    a1 = _mm256_fmadd_ps(widen8(wr + k + 8), _mm256_loadu_ps(xm + k + 8), a1);
    a2 = _mm256_fmadd_ps(widen8(wr + k + 16), _mm256_loadu_ps(xm + k + 16), a2);
    a3 = _mm256_fmadd_ps(widen8(wr + k + 24), _mm256_loadu_ps(xm + k + 24), a3);
  }
  __m256 a = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_shuffle_ps(h, h, 1));
  sum = _mm_cvtss_f32(h);
#endif
  for (; k < K; ++k) sum += (float)wr[k] * xm[k];
  return sum;
}

// The rows of every weight of one call, as one range split between threads.
template <typename act_t, typename scale_t>
static void project(const at::Tensor& x, const std::vector<at::Tensor>& weights, const std::vector<at::Tensor>& scales,
                    std::vector<at::Tensor>& outs) {
  const int64_t M = x.size(0), K = x.size(1);
  const act_t* xa = reinterpret_cast<const act_t*>(x.const_data_ptr());
  std::vector<float> xf(M * K);  // the activations in float32 once, not once per weight row
  for (int64_t i = 0; i < M * K; ++i) xf[i] = to_float(xa[i]);
  const float* xp = xf.data();
  std::vector<int64_t> starts{0};
  for (const auto& w : weights) starts.push_back(starts.back() + w.size(0));
  const int64_t total = starts.back();
  // a small weight is not worth waking the other threads
  const int64_t grain = total * K >= 65536 ? 1 : total;
  at::parallel_for(0, total, grain, [&](int64_t begin, int64_t end) {
    size_t p = 0;
    for (int64_t row = begin; row < end; ++row) {
      while (row >= starts[p + 1]) ++p;
      const int64_t n = row - starts[p], N = weights[p].size(0);
      const int8_t* wr = reinterpret_cast<const int8_t*>(weights[p].const_data_ptr()) + n * K;
      const float s = to_float(reinterpret_cast<const scale_t*>(scales[p].const_data_ptr())[n]);
      act_t* y = reinterpret_cast<act_t*>(outs[p].data_ptr());
      for (int64_t m = 0; m < M; ++m) store(y + m * N + n, row_dot(wr, xp + m * K, K) * s);
    }
  });
}

static std::vector<at::Tensor> int8_gemv(const at::Tensor& x_in, at::TensorList weights_in, at::TensorList scales_in) {
  TORCH_CHECK(x_in.dim() == 2, "int8_gemv: x must be [rows, in], got ", x_in.sizes());
  TORCH_CHECK(weights_in.size() == scales_in.size() && !weights_in.empty(),
              "int8_gemv: one scale tensor per weight, at least one weight");
  const auto act = x_in.scalar_type();
  TORCH_CHECK(act == at::kBFloat16 || act == at::kFloat, "int8_gemv: x must be bfloat16 or float32, got ", act);
  const auto sdt = scales_in[0].scalar_type();
  TORCH_CHECK(sdt == at::kBFloat16 || sdt == at::kFloat, "int8_gemv: scales must be bfloat16 or float32, got ", sdt);
  const at::Tensor x = x_in.contiguous();
  std::vector<at::Tensor> weights, scales, outs;
  for (size_t i = 0; i < weights_in.size(); ++i) {
    const auto& w = weights_in[i];
    TORCH_CHECK(w.scalar_type() == at::kChar && w.dim() == 2 && w.size(1) == x.size(1),
                "int8_gemv: weight ", i, " must be int8 [out, ", x.size(1), "], got ", w.scalar_type(), " ", w.sizes());
    TORCH_CHECK(scales_in[i].scalar_type() == sdt && scales_in[i].numel() == w.size(0),
                "int8_gemv: scale ", i, " must be ", sdt, " [", w.size(0), "]");
    weights.push_back(w.contiguous());
    scales.push_back(scales_in[i].contiguous());
    outs.push_back(at::empty({x.size(0), w.size(0)}, x.options()));
  }
  if (act == at::kBFloat16 && sdt == at::kBFloat16) project<uint16_t, uint16_t>(x, weights, scales, outs);
  else if (act == at::kBFloat16) project<uint16_t, float>(x, weights, scales, outs);
  else if (sdt == at::kBFloat16) project<float, uint16_t>(x, weights, scales, outs);
  else project<float, float>(x, weights, scales, outs);
  return outs;
}

// The vector path this library was built with: 512 (AVX-512), 256 (AVX2), 0 (none: scalar loops).
static int64_t int8_gemv_isa() {
#if defined(__AVX512F__)
  return 512;
#elif defined(__AVX2__)
  return 256;
#else
  return 0;
#endif
}

TORCH_LIBRARY_FRAGMENT(staticformers_native, m) {
  m.def("int8_gemv_isa() -> int", &int8_gemv_isa);
}

TORCH_LIBRARY_IMPL(staticformers, CPU, m) {
  m.impl("int8_gemv", &int8_gemv);
}
