// The projections of a decode step's few rows, streaming each weight once (backends/cpu/gemv.py): two kernels.
//
// int8_gemv: y[m, n] = scale[n] * sum_k w[n, k] * x[m, k], accumulated in float32, for several weights of one
// input. w: [N, K] int8, row-major; x: [M, K] and y: [M, N] in the activations' dtype (bfloat16 or float32);
// scale: [N] (bfloat16 or float32).
// bf16_gemv: y[m, n] = sum_k w[n, k] * x[m, k], accumulated in float32 and rounded to bfloat16 once, for several
// bfloat16 weights [N, K] of one bfloat16 input [M, K]; each weight row is read once for all M rows.
// Registered as the CPU kernels of `staticformers::int8_gemv` and `staticformers::bf16_gemv`, whose schemas and
// shape functions gemv.py defines.
//
// Why they are written this way: a decode step's projections are bound by the bytes of the weight, so the
// loop reads the weights as one forward stream (each row whole, rows in order, the rows of all the
// weights of a call split between threads in contiguous ranges, whose tails a thread done early takes from their
// end: `split_rows`), one cache line an iteration into independent float32 accumulators, and prefetches
// SF_PREFETCH bytes ahead. Reading several rows side by
// side instead, a few cache lines of each, is what ATen's int8 kernel does, and it defeats the hardware's
// stream prefetch once the weights no longer fit in cache (BENCHMARKS.md, weight-only int8). In bfloat16,
// inductor's reduction over the weight rows and oneDNN's GEMM both read a decode step's weights at well under
// the memory's rate (BENCHMARKS.md, "A streaming bf16 kernel"). These are C++ operators, not Python ones,
// because a decode step calls them about 33 times and the dispatch through Python cost several times the call
// of the kernel itself.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <algorithm>
#include <atomic>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <vector>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
// AMX's tiles and AVX512_BF16's dot products, where the compiler can target them per function (the library itself is
// built for inductor's ISA); each is picked at run time from CPUID
#if defined(__x86_64__) && defined(__AVX512F__) && \
    ((defined(__clang__) && __clang_major__ >= 14) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11))
#define SF_X86_TARGETS 1
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <cstdlib>
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

// f(begin, end) over the rows [0, total) of a call (K values a row), split between the threads. A small call runs
// on this thread alone (not worth waking the others). Otherwise each thread owns a contiguous share of the rows and
// streams it forward, and the last SF_TAIL_PARTS / (SF_TAIL_PARTS + SF_HEAD_PARTS) of each share is cut into
// chunks that the other threads may take from its end once their own share is done: a thread whose memory is
// slower in a call (the other one's stream ahead, or woken late) no longer keeps the others waiting at the call's
// end, and where the threads keep pace every share is still one forward stream.
#ifndef SF_TAIL_PARTS
#define SF_TAIL_PARTS 8
#endif
#ifndef SF_HEAD_PARTS
#define SF_HEAD_PARTS 24
#endif
template <typename F>
static inline void split_rows(const int64_t total, const int64_t K, F&& f) {
  const int64_t threads = at::get_num_threads();
  if (total * K < 65536 || threads == 1) return f(0, total);
  const int64_t share = (total + threads - 1) / threads, parts = SF_TAIL_PARTS;
  const int64_t chunk = std::max<int64_t>(1, share / (SF_TAIL_PARTS + SF_HEAD_PARTS));
  std::vector<std::atomic<bool>> taken(threads * parts);
  for (auto& t : taken) t.store(false, std::memory_order_relaxed);
  // thread t's chunk c: rows [tail(t) + c * chunk, ...), the last one up to the end of the share
  auto tail = [&](int64_t t) { return std::min(total, (t + 1) * share) - parts * chunk; };
  auto run_chunk = [&](int64_t t, int64_t c) {
    const int64_t b = std::max(tail(t) + c * chunk, t * share);
    const int64_t e = c == parts - 1 ? std::min(total, (t + 1) * share) : tail(t) + (c + 1) * chunk;
    if (b < e) f(b, e);
  };
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t first = t * share;
      if (first >= total) continue;
      if (tail(t) > first) f(first, tail(t));
      for (int64_t c = 0; c < parts; ++c)  // its own chunks, forward, until one was taken from the end
        if (taken[t * parts + c].exchange(true)) break;
        else run_chunk(t, c);
      for (int64_t o = 1; o < threads; ++o) {  // then the others' chunks, from their end, until their owner's
        const int64_t v = (t + o) % threads;
        if (v * share >= total) continue;
        for (int64_t c = parts - 1; c >= 0; --c)
          if (taken[v * parts + c].exchange(true)) break;
          else run_chunk(v, c);
      }
    }
  });
}

// The weights of one call and their outputs as raw pointers, read once before the threads start (a tensor's
// accessors are calls into c10, too slow to repeat for every weight row); `starts`: each weight's first row in the
// count of all the call's rows.
template <typename W, typename Y>
struct Parts {
  std::vector<const W*> w;
  std::vector<Y*> y;
  std::vector<int64_t> N, starts{0};
  Parts(const std::vector<at::Tensor>& weights, std::vector<at::Tensor>& outs) {
    for (size_t i = 0; i < weights.size(); ++i) {
      w.push_back(reinterpret_cast<const W*>(weights[i].const_data_ptr()));
      y.push_back(reinterpret_cast<Y*>(outs[i].data_ptr()));
      N.push_back(weights[i].size(0));
      starts.push_back(starts.back() + weights[i].size(0));
    }
  }
};

// The rows of every weight of one call, as one range split between threads.
template <typename act_t, typename scale_t>
static void project(const at::Tensor& x, const std::vector<at::Tensor>& weights, const std::vector<at::Tensor>& scales,
                    std::vector<at::Tensor>& outs) {
  const int64_t M = x.size(0), K = x.size(1);
  const act_t* xa = reinterpret_cast<const act_t*>(x.const_data_ptr());
  std::vector<float> xf(M * K);  // the activations in float32 once, not once per weight row
  for (int64_t i = 0; i < M * K; ++i) xf[i] = to_float(xa[i]);
  const float* xp = xf.data();
  const Parts<int8_t, act_t> parts(weights, outs);
  std::vector<const scale_t*> ss;
  for (const auto& s : scales) ss.push_back(reinterpret_cast<const scale_t*>(s.const_data_ptr()));
  split_rows(parts.starts.back(), K, [&](int64_t begin, int64_t end) {
    size_t p = 0;
    for (int64_t row = begin; row < end; ++row) {
      while (row >= parts.starts[p + 1]) ++p;
      const int64_t n = row - parts.starts[p], N = parts.N[p];
      const int8_t* wr = parts.w[p] + n * K;
      const float s = to_float(ss[p][n]);
      act_t* y = parts.y[p];
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

// ---- bfloat16 weights -------------------------------------------------------------------------------------------

#if defined(__AVX512F__)
static inline __m512 widen_bf16(const uint16_t* p) {  // 16 bfloat16 -> float32: the bits moved up by 16
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
#elif defined(__AVX2__)
static inline __m256 widen_bf16(const uint16_t* p) {  // 8 bfloat16 -> float32
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
#endif

// The dot products of one bfloat16 weight row with MB float32 activation rows (x: MB rows of K), into out[0, MB).
// One row keeps four accumulators (two cache lines an iteration); several rows keep two each, the weight's
// vectors widened once for all of them.
template <int MB>
static inline void bf16_rows_dot(const uint16_t* wr, const float* x, const int64_t K, float* out) {
  int64_t k = 0;
  float tail[MB];
  for (int m = 0; m < MB; ++m) tail[m] = 0.f;
#if defined(__AVX512F__) || defined(__AVX2__)
#if defined(__AVX512F__)
  using vec = __m512;
  constexpr int W = 16;
  auto zero = [] { return _mm512_setzero_ps(); };
  auto load = [](const float* p) { return _mm512_loadu_ps(p); };
  auto fma = [](vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); };
  auto add = [](vec a, vec b) { return _mm512_add_ps(a, b); };
  auto total = [](vec a) { return _mm512_reduce_add_ps(a); };
#else
  using vec = __m256;
  constexpr int W = 8;
  auto zero = [] { return _mm256_setzero_ps(); };
  auto load = [](const float* p) { return _mm256_loadu_ps(p); };
  auto fma = [](vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); };
  auto add = [](vec a, vec b) { return _mm256_add_ps(a, b); };
  auto total = [](vec a) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_shuffle_ps(h, h, 1));
    return _mm_cvtss_f32(h);
  };
#endif
  vec a0[MB], a1[MB];
  for (int m = 0; m < MB; ++m) a0[m] = a1[m] = zero();
  if (MB == 1) {  // one row: four independent chains, or the FMA's latency bounds the loop
    vec b0 = zero(), b1 = zero();
    for (; k + 4 * W <= K; k += 4 * W) {
      _mm_prefetch((const char*)(wr + k) + SF_PREFETCH, _MM_HINT_T0);
      _mm_prefetch((const char*)(wr + k) + SF_PREFETCH + 64, _MM_HINT_T0);
      a0[0] = fma(widen_bf16(wr + k), load(x + k), a0[0]);
      a1[0] = fma(widen_bf16(wr + k + W), load(x + k + W), a1[0]);
      b0 = fma(widen_bf16(wr + k + 2 * W), load(x + k + 2 * W), b0);
      b1 = fma(widen_bf16(wr + k + 3 * W), load(x + k + 3 * W), b1);
    }
    a0[0] = add(a0[0], b0);
    a1[0] = add(a1[0], b1);
  }
  for (; k + 2 * W <= K; k += 2 * W) {
    _mm_prefetch((const char*)(wr + k) + SF_PREFETCH, _MM_HINT_T0);
    const vec w0 = widen_bf16(wr + k), w1 = widen_bf16(wr + k + W);
    for (int m = 0; m < MB; ++m) {
      a0[m] = fma(w0, load(x + m * K + k), a0[m]);
      a1[m] = fma(w1, load(x + m * K + k + W), a1[m]);
    }
  }
  for (int m = 0; m < MB; ++m) tail[m] = total(add(a0[m], a1[m]));
#endif
  for (int m = 0; m < MB; ++m) {
    float sum = tail[m];
    for (int64_t j = k; j < K; ++j) sum += bf16_to_float(wr[j]) * x[m * K + j];
    out[m] = sum;
  }
}

// ---- bfloat16 weights on AVX512_BF16's dot products ----------------------------------------------------------
//
// Where the CPU has AVX512_BF16 but no AMX (AMD Zen 4 and later, Intel Cooper Lake), VDPBF16PS multiplies 32
// bfloat16 pairs and adds each two neighbours' products into 16 float32 sums, the activations kept in bfloat16: one
// instruction for what the loop above does in a widening and two FMAs per row. The products are exact (8-bit
// significands), the sums float32, rounded to bfloat16 once; a row's sums depend on nothing else in the call. The
// instruction treats bfloat16 subnormal inputs as zero (values below 1.2e-38, which change no float32 sum that
// holds a normal product). STATICFORMERS_BF16_DOT=0 turns it off (the widening loop runs instead).
#if SF_X86_TARGETS
static bool dot_available() {
  static const bool ok = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    return __get_cpuid_count(7, 1, &a, &b, &c, &d) && ((a >> 5) & 1u);  // CPUID.(7,1):EAX[5] AVX512_BF16
  }();
  return ok;
}

// Whether the environment variable `name` is "0" now (a path's off switch, read at each call).
static bool switched_off(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && std::strcmp(v, "0") == 0;
}

static bool dot_enabled() { return !switched_off("STATICFORMERS_BF16_DOT") && dot_available(); }

// The dot products of one weight row with MB bfloat16 activation rows (x: MB rows of K), into out[0, MB).
template <int MB>
__attribute__((target("avx512f,avx512bw,avx512bf16"))) static inline void bf16_rows_dp(const uint16_t* wr,
                                                                                         const uint16_t* x,
                                                                                         const int64_t K,
                                                                                         float* out) {
  __m512 a0[MB], a1[MB];
  for (int m = 0; m < MB; ++m) a0[m] = a1[m] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 64 <= K; k += 64) {  // two cache lines of the weight row an iteration, two chains a row
    _mm_prefetch((const char*)(wr + k) + SF_PREFETCH, _MM_HINT_T0);
    _mm_prefetch((const char*)(wr + k) + SF_PREFETCH + 64, _MM_HINT_T0);
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wr + k), w1 = (__m512bh)_mm512_loadu_si512(wr + k + 32);
    for (int m = 0; m < MB; ++m) {
      a0[m] = _mm512_dpbf16_ps(a0[m], w0, (__m512bh)_mm512_loadu_si512(x + m * K + k));
      a1[m] = _mm512_dpbf16_ps(a1[m], w1, (__m512bh)_mm512_loadu_si512(x + m * K + k + 32));
    }
  }
  if (k + 32 <= K) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wr + k);
    for (int m = 0; m < MB; ++m) a0[m] = _mm512_dpbf16_ps(a0[m], w0, (__m512bh)_mm512_loadu_si512(x + m * K + k));
    k += 32;
  }
  for (int m = 0; m < MB; ++m) {
    float sum = _mm512_reduce_add_ps(_mm512_add_ps(a0[m], a1[m]));
    for (int64_t j = k; j < K; ++j) sum += bf16_to_float(wr[j]) * bf16_to_float(x[m * K + j]);
    out[m] = sum;
  }
}

#endif

// f(std::integral_constant<int, MB>) for a block of `rows` activation rows (1 to 8): the row count a template
// argument, so that each block's accumulators stay in registers.
template <typename F>
static inline void by_rows(const int64_t rows, F&& f) {
  switch (rows) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: return f(std::integral_constant<int, 3>{});
    case 4: return f(std::integral_constant<int, 4>{});
    case 5: return f(std::integral_constant<int, 5>{});
    case 6: return f(std::integral_constant<int, 6>{});
    case 7: return f(std::integral_constant<int, 7>{});
    default: return f(std::integral_constant<int, 8>{});
  }
}

// The vector loops' call: the rows of all the weights split between threads (`split_rows`), each weight row streamed
// once for every block of 8 activation rows; `block(wr, x0, rows, out)` computes one weight row's dot products with
// `rows` activation rows from x0 (xp's layout, K values a row).
template <typename X, typename Block>
static void stream_rows(const X* xp, const int64_t M, const int64_t K, const std::vector<at::Tensor>& weights,
                        std::vector<at::Tensor>& outs, Block&& block) {
  const Parts<uint16_t, uint16_t> parts(weights, outs);
  split_rows(parts.starts.back(), K, [&](int64_t begin, int64_t end) {
    size_t p = 0;
    float acc[8];
    for (int64_t row = begin; row < end; ++row) {
      while (row >= parts.starts[p + 1]) ++p;
      const int64_t n = row - parts.starts[p], N = parts.N[p];
      const uint16_t* wr = parts.w[p] + n * K;
      uint16_t* y = parts.y[p];
      for (int64_t m0 = 0; m0 < M; m0 += 8) {  // eight rows at a time: their accumulators stay in registers
        const int64_t rows = std::min<int64_t>(8, M - m0);
        block(wr, xp + m0 * K, rows, acc);
        for (int64_t m = 0; m < rows; ++m) y[(m0 + m) * N + n] = float_to_bf16(acc[m]);
      }
    }
  });
}


// ---- bfloat16 weights on AMX ----------------------------------------------------------------------------------
//
// Where the CPU has AMX (bf16 tiles), the same products run as tile multiplies: the weight is the tiles' A operand
// as it lies in memory (16 weight rows x 32 values, a row's stride apart), the activations the B operand, packed
// once a call into pairs of k for 16 rows (zeros past the last row). The widening and the per-row FMAs that bound
// the vector loop at several rows are gone: eight rows cost what one does, and one row streams its weights as
// fast. Each output is still its K products summed in float32 (TDPBF16PS: pairs of exact bf16 products, denormal
// inputs read as zero), rounded to bfloat16 once; a row's sums depend on nothing else in the call (its column of
// the tile), and every call with K a multiple of 32 and weights of at least 16 rows takes this path, whatever its
// row count. STATICFORMERS_AMX=0 turns it off (the vector loop runs instead).
#if SF_X86_TARGETS
struct alignas(64) TileConfig {
  uint8_t palette_id, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Whether this CPU has AMX's tiles and bf16 products, and Linux lets this process use them (asked once).
static bool amx_available() {
  static const bool ok = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !((d >> 22) & 1u) || !((d >> 24) & 1u)) return false;
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
  }();
  return ok;
}

static bool amx_enabled() { return !switched_off("STATICFORMERS_AMX") && amx_available(); }

// Units [begin, end) of a call: a unit is 32 rows of one weight (two tiles; a weight's last unit overlaps the
// rows before it rather than read past its end), against every 16-row chunk of the packed activations xv
// ([chunks][K / 2][16][2]).
__attribute__((target("amx-tile,amx-bf16"))) static void amx_units(
    const std::vector<const uint16_t*>& ws, const std::vector<uint16_t*>& ys, const std::vector<int64_t>& Ns,
    const std::vector<int64_t>& starts, const int64_t K, const uint16_t* xv, const int64_t M, const int64_t begin,
    const int64_t end) {
  TileConfig cfg{};
  cfg.palette_id = 1;
  for (int t = 0; t < 5; ++t) {  // 0, 1: sums (16 weight rows x 16 float32); 2, 3: weights; 4: activations
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
  alignas(64) float c0[16 * 16], c1[16 * 16];
  size_t p = 0;
  for (int64_t u = begin; u < end; ++u) {
    while (u >= starts[p + 1]) ++p;
    const int64_t N = Ns[p], n0 = std::min<int64_t>((u - starts[p]) * 32, N - 16), n1 = std::min(n0 + 16, N - 16);
    const uint16_t* a0 = ws[p] + n0 * K;
    const uint16_t* a1 = ws[p] + n1 * K;
    uint16_t* y = ys[p];
    for (int64_t m0 = 0; m0 < M; m0 += 16) {
      const uint16_t* xc = xv + m0 * K;
      _tile_zero(0);
      _tile_zero(1);
      for (int64_t k = 0; k < K; k += 32) {
        _tile_loadd(4, xc + k * 16, 64);
        _tile_loadd(2, a0 + k, K * 2);
        _tile_loadd(3, a1 + k, K * 2);
        _tile_dpbf16ps(0, 2, 4);
        _tile_dpbf16ps(1, 3, 4);
      }
      _tile_stored(0, c0, 64);
      _tile_stored(1, c1, 64);
      const int64_t rows = std::min<int64_t>(16, M - m0);
      for (int64_t m = 0; m < rows; ++m) {
        for (int64_t i = 0; i < 16; ++i) {
          y[(m0 + m) * N + n0 + i] = float_to_bf16(c0[i * 16 + m]);
          y[(m0 + m) * N + n1 + i] = float_to_bf16(c1[i * 16 + m]);
        }
      }
    }
  }
  _tile_release();
}

// The call on AMX; false (nothing done) where it does not take that path.
static bool bf16_gemv_amx(const uint16_t* xa, const int64_t M, const int64_t K, const std::vector<at::Tensor>& weights,
                          std::vector<at::Tensor>& outs) {
  if (K % 32 != 0 || !amx_enabled()) return false;
  std::vector<const uint16_t*> ws;
  std::vector<uint16_t*> ys;
  std::vector<int64_t> Ns, starts{0};
  for (size_t i = 0; i < weights.size(); ++i) {
    const int64_t N = weights[i].size(0);
    if (N < 16) return false;
    ws.push_back(reinterpret_cast<const uint16_t*>(weights[i].const_data_ptr()));
    ys.push_back(reinterpret_cast<uint16_t*>(outs[i].data_ptr()));
    Ns.push_back(N);
    starts.push_back(starts.back() + (N + 31) / 32);
  }
  const int64_t chunks = (M + 15) / 16;
  std::vector<uint16_t> xv(chunks * K * 16, 0);  // [chunks][K / 2][16][2]: row m's pair (2r, 2r + 1) at [r][m]
  for (int64_t m = 0; m < M; ++m) {
    uint16_t* xc = xv.data() + (m / 16) * K * 16;
    for (int64_t r = 0; r < K / 2; ++r) {
      xc[(r * 16 + m % 16) * 2] = xa[m * K + 2 * r];
      xc[(r * 16 + m % 16) * 2 + 1] = xa[m * K + 2 * r + 1];
    }
  }
  const int64_t units = starts.back();
  const int64_t grain = units * 32 * K >= 65536 ? 1 : units;  // a small weight is not worth waking the other threads
  at::parallel_for(0, units, grain, [&](int64_t begin, int64_t end) {
    amx_units(ws, ys, Ns, starts, K, xv.data(), M, begin, end);
  });
  return true;
}
#endif

static std::vector<at::Tensor> bf16_gemv(const at::Tensor& x_in, at::TensorList weights_in) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kBFloat16, "bf16_gemv: x must be bfloat16 [rows, in], got ",
              x_in.scalar_type(), " ", x_in.sizes());
  TORCH_CHECK(!weights_in.empty(), "bf16_gemv: at least one weight");
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  std::vector<at::Tensor> weights, outs;
  for (size_t i = 0; i < weights_in.size(); ++i) {
    const auto& w = weights_in[i];
    TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.dim() == 2 && w.size(1) == K, "bf16_gemv: weight ", i,
                " must be bfloat16 [out, ", K, "], got ", w.scalar_type(), " ", w.sizes());
    weights.push_back(w.contiguous());
    outs.push_back(at::empty({M, w.size(0)}, x.options()));
  }
  const uint16_t* xa = reinterpret_cast<const uint16_t*>(x.const_data_ptr());
#if SF_X86_TARGETS
  if (bf16_gemv_amx(xa, M, K, weights, outs)) return outs;
  if (dot_enabled()) {
    stream_rows(xa, M, K, weights, outs, [K](const uint16_t* wr, const uint16_t* x0, int64_t rows, float* out) {
      by_rows(rows, [&](auto mb) { bf16_rows_dp<decltype(mb)::value>(wr, x0, K, out); });
    });
    return outs;
  }
#endif
  std::vector<float> xf(M * K);  // the activations in float32 once, not once per weight row
  for (int64_t i = 0; i < M * K; ++i) xf[i] = bf16_to_float(xa[i]);
  stream_rows(xf.data(), M, K, weights, outs, [K](const uint16_t* wr, const float* x0, int64_t rows, float* out) {
    by_rows(rows, [&](auto mb) { bf16_rows_dot<decltype(mb)::value>(wr, x0, K, out); });
  });
  return outs;
}


// ---- the MLP half of a decoder layer ----------------------------------------------------------------------------
//
// bf16_mlp_block: for a few bfloat16 rows, r = x + attn (the attention's residual), h = norm * rmsnorm(r) (float32,
// cast to bfloat16 before the weight, as the model's RMSNorm does), g, u = the streamed gate and up projections of
// h, a = silu(g) * u (float32, rounded once), and returns r + down(a) (rounded once). A compiled decode step made
// five calls of this (two projections and three small kernels), each with its own host cost, 30 times a step on a
// 30-layer model; here it is one. Each named result is rounded to bfloat16 once: r, the normalised r before the
// weight, h, the activation and the output. Eager rounds the activation twice (SiLU, then the product), and
// inductor's fused kernels may keep some of these in float32, so the block matches neither bit for bit; the tests
// bound the difference against this math. `load_bf16`, `store_bf16` and `rms_norm` are bf16_rows.h's, whose text
// operators.build_library puts before this file's.

// The block's math around its projections: gate_up(h) -> {g, u} and down(a) -> d, bfloat16 [rows, out] each, are
// bf16_mlp_block's streamed bf16 projections or int8_mlp_block's streamed int8 ones. x, attn: contiguous bfloat16
// [M, H]; norm: contiguous bfloat16 [H].
template <typename GateUp, typename Down>
static at::Tensor mlp_half(const at::Tensor& x, const at::Tensor& attn, const at::Tensor& norm, const double eps,
                           const int64_t I, GateUp&& gate_up, Down&& down) {
  const int64_t M = x.size(0), H = x.size(1);
  at::Tensor r = at::empty({M, H}, x.options()), h = at::empty({M, H}, x.options());
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.const_data_ptr());
  const uint16_t* ap = reinterpret_cast<const uint16_t*>(attn.const_data_ptr());
  const uint16_t* np = reinterpret_cast<const uint16_t*>(norm.const_data_ptr());
  uint16_t* rp = reinterpret_cast<uint16_t*>(r.data_ptr());
  uint16_t* hp = reinterpret_cast<uint16_t*>(h.data_ptr());
  constexpr int64_t B = bvec::size();
  for (int64_t i = 0; i < M * H; i += B) {  // r = x + attn, rounded
    const int64_t n = std::min(B, M * H - i);
    auto [x0, x1] = load_bf16(xp + i, n);
    auto [a0, a1] = load_bf16(ap + i, n);
    store_bf16(rp + i, x0 + a0, x1 + a1, n);
  }
  rms_norm(rp, np, M, H, eps, hp);  // h = norm * bf16(r * rsqrt(mean(r^2) + eps)), from the rounded r
  const std::vector<at::Tensor> gu = gate_up(h);
  at::Tensor a = at::empty({M, I}, x.options());
  const uint16_t* gp = reinterpret_cast<const uint16_t*>(gu[0].const_data_ptr());
  const uint16_t* upp = reinterpret_cast<const uint16_t*>(gu[1].const_data_ptr());
  uint16_t* act = reinterpret_cast<uint16_t*>(a.data_ptr());
  const fvec one(1.f);
  // a = silu(g) * u = g / (1 + exp(-g)) * u, rounded once; split between the threads past a few rows' worth
  const int64_t vectors = (M * I + B - 1) / B;
  at::parallel_for(0, vectors, 8192 / B, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin * B; i < std::min(end * B, M * I); i += B) {
      const int64_t n = std::min(B, M * I - i);
      auto [g0, g1] = load_bf16(gp + i, n);
      auto [u0, u1] = load_bf16(upp + i, n);
      store_bf16(act + i, g0 * (one / (one + g0.neg().exp())) * u0, g1 * (one / (one + g1.neg().exp())) * u1, n);
    }
  });
  const at::Tensor d = down(a);
  const uint16_t* dp = reinterpret_cast<const uint16_t*>(d.const_data_ptr());
  for (int64_t i = 0; i < M * H; i += B) {  // r + down(a), rounded once, in r's place (each value read, then written)
    const int64_t n = std::min(B, M * H - i);
    auto [r0, r1] = load_bf16(rp + i, n);
    auto [d0, d1] = load_bf16(dp + i, n);
    store_bf16(rp + i, r0 + d0, r1 + d1, n);
  }
  return r;
}

// The block's inputs checked (x, attn, norm; gate and up [I, H], down [H, I]), contiguous.
static std::tuple<at::Tensor, at::Tensor, at::Tensor> mlp_inputs(const char* name, const at::Tensor& x_in,
                                                                 const at::Tensor& attn_in, const at::Tensor& norm_in,
                                                                 const at::Tensor& gate, const at::Tensor& up,
                                                                 const at::Tensor& down) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kBFloat16 && attn_in.sizes() == x_in.sizes() &&
                  attn_in.scalar_type() == at::kBFloat16,
              name, ": x and attn must be bfloat16 [rows, hidden] of one shape, got ", x_in.sizes(), " and ",
              attn_in.sizes());
  const int64_t H = x_in.size(1);
  TORCH_CHECK(norm_in.numel() == H && norm_in.scalar_type() == at::kBFloat16, name, ": norm must be bfloat16 [", H,
              "]");
  TORCH_CHECK(gate.dim() == 2 && up.sizes() == gate.sizes() && down.dim() == 2 && down.size(0) == H &&
                  down.size(1) == gate.size(0),
              name, ": gate and up must be [inner, ", H, "] and down [", H, ", inner], got ", gate.sizes(), ", ",
              up.sizes(), " and ", down.sizes());
  return {x_in.contiguous(), attn_in.contiguous(), norm_in.contiguous()};
}

static at::Tensor bf16_mlp_block(const at::Tensor& x_in, const at::Tensor& attn_in, const at::Tensor& norm_in,
                                 double eps, const at::Tensor& gate, const at::Tensor& up, const at::Tensor& down) {
  const auto [x, attn, norm] = mlp_inputs("bf16_mlp_block", x_in, attn_in, norm_in, gate, up, down);
  const std::vector<at::Tensor> gate_up{gate, up}, down_only{down};
  return mlp_half(
      x, attn, norm, eps, gate.size(0), [&](const at::Tensor& h) { return bf16_gemv(h, gate_up); },
      [&](const at::Tensor& a) { return bf16_gemv(a, down_only)[0]; });
}

// int8_mlp_block: bf16_mlp_block's math over int8 gate, up and down weights, each projection int8_gemv's (its
// output rounded to bfloat16 once, as the int8 layers' own calls round it), for the bfloat16 rows int8_gemv streams.
// Not an operator of its own: decode_layers.cpp, built in this library's text, calls it for an int8 model's layers.
static at::Tensor int8_mlp_block(const at::Tensor& x_in, const at::Tensor& attn_in, const at::Tensor& norm_in,
                                 double eps, const at::Tensor& gate, const at::Tensor& up, const at::Tensor& down,
                                 const at::Tensor& gate_scale, const at::Tensor& up_scale,
                                 const at::Tensor& down_scale) {
  const auto [x, attn, norm] = mlp_inputs("int8_mlp_block", x_in, attn_in, norm_in, gate, up, down);
  const std::vector<at::Tensor> gate_up{gate, up}, gate_up_scales{gate_scale, up_scale}, down_only{down},
      down_scales{down_scale};
  return mlp_half(
      x, attn, norm, eps, gate.size(0), [&](const at::Tensor& h) { return int8_gemv(h, gate_up, gate_up_scales); },
      [&](const at::Tensor& a) { return int8_gemv(a, down_only, down_scales)[0]; });
}

// The vector path this library was built with: 512 (AVX-512), 256 (AVX2), 0 (none: scalar loops).
static int64_t gemv_isa() {
#if defined(__AVX512F__)
  return 512;
#elif defined(__AVX2__)
  return 256;
#else
  return 0;
#endif
}

// Whether bf16_gemv runs its calls (K a multiple of 32, weights of 16 rows or more) on AMX here, now.
static bool gemv_amx() {
#if SF_X86_TARGETS
  return amx_enabled();
#else
  return false;
#endif
}

// Whether bf16_gemv's calls that AMX does not take run on AVX512_BF16's dot products here, now.
static bool gemv_dot() {
#if SF_X86_TARGETS
  return dot_enabled();
#else
  return false;
#endif
}

TORCH_LIBRARY_FRAGMENT(staticformers_native, m) {
  m.def("gemv_isa() -> int", &gemv_isa);
  m.def("gemv_amx() -> bool", &gemv_amx);
  m.def("gemv_dot() -> bool", &gemv_dot);
}

TORCH_LIBRARY_IMPL(staticformers, CPU, m) {
  m.impl("int8_gemv", &int8_gemv);
  m.impl("bf16_gemv", &bf16_gemv);
  m.impl("bf16_mlp_block", &bf16_mlp_block);
}
