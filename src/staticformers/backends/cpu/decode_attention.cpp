// One query per row against a static KV cache, in C++ (backends/cpu/decode_attention.py): the CPU kernel of
// `staticformers::decode_attention`, whose schema and shape function decode_attention.py defines.
//
// out[b, h] = sum_s p[s] v[b, h / g, s] / sum_s p[s], p[s] = exp(scale * q[b, h] . k[b, h / g, s] - max) where
// mask[b, s], else 0 (g query heads per KV head). q: [B, H, 1, D]; k: [B, KVH, L, D] and v: [B, KVH, L, Dv] with
// their last dimension contiguous (a static cache's layer slice as it lies); mask: [B, 1, 1, L] bool or none;
// float32 or bfloat16, one dtype; sums in float32; out [B, H, 1, Dv] in q's dtype. A row with no position to
// attend gets zeros.
//
// Why it is written by hand: inductor's fused reductions for this (a decode step's attention in the "reduce"
// formulation) recompute the query's rotary embedding for every cached position and walk each head's keys with a
// horizontal sum per position; at batch 8 they were about a fifth of a bf16 decode step of a 30-layer model
// (BENCHMARKS.md, "A decode attention kernel"). Here each (row, head) is one task: its query once in float32, one
// pass over the positions its mask lets it attend (masked positions are skipped, not read), a vectorised
// softmax, one pass over the values. Where a head's keys and values are whole vectors, a task is a KV head and the
// query heads that read it (attend_group; split into fewer heads a task where the tasks would not keep every thread
// busy): each key row is widened once for all of them and the values' weighted sums stay in registers, in the same
// order as attend_one, so the same bits. `attend_paged` runs the same loops over a block pool, each row's positions
// through its block table; it is no operator of its own: decode_layers.cpp's one call, built after this file in one
// text, calls it on a block cache.
// Built and loaded with gemv.cpp, by inductor's toolchain and vector ISA.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

using fvec = at::vec::Vectorized<float>;

static inline fvec load_float(const float* p) { return fvec::loadu(p); }
static inline fvec load_float(const at::BFloat16* p) {
  fvec out;
  at::vec::load_to_float<at::BFloat16>(p, out);
  return out;
}

// scores[0, L) -> exp(score - top) in place (a masked position's -inf becomes 0); their sum.
static inline float exponentiate(float* scores, const int64_t L, const float top) {
  constexpr int64_t W = fvec::size();
  const int64_t Lw = L - L % W;
  fvec total(0.f);
  for (int64_t s = 0; s < Lw; s += W) {
    const fvec p = (fvec::loadu(scores + s) - fvec(top)).exp();
    p.store(scores + s);
    total = total + p;
  }
  float sum = at::vec::vec_reduce_all<float>([](fvec& x, fvec& y) { return x + y; }, total);
  for (int64_t s = Lw; s < L; ++s) {
    scores[s] = std::exp(scores[s] - top);
    sum += scores[s];
  }
  return sum;
}

// Where one row's key (or value) vector of one KV head lies for each position s:
// - Strided: a static cache's, `stride` apart from `base`;
// - Paged: a block pool's ([blocks, size, kv_heads, dim], `base` the head's first vector in block 0), through the row
//   of its block table: block `table[s / size]`, offset `s % size`, positions `stride` apart.
template <typename T>
struct Strided {
  const T* base;
  int64_t stride;
  const T* operator()(const int64_t s) const { return base + s * stride; }
};
template <typename T>
struct Paged {
  const T* base;
  const int64_t* table;
  int64_t size, stride;
  const T* operator()(const int64_t s) const { return base + (table[s / size] * size + s % size) * stride; }
};

// One (row, query head): its keys (`k(s)`), values (`v(s)`), mask (or null), into out.
template <typename T, typename Rows>
static void attend_one(const T* q, const Rows k, const Rows v, const bool* mask, const int64_t L, const int64_t D,
                       const int64_t Dv, const float scale, float* qf, float* scores, float* acc, T* out) {
  constexpr int64_t W = fvec::size();
  const int64_t Dw = D - D % W, Dvw = Dv - Dv % W;
  const float ninf = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < D; ++j) qf[j] = static_cast<float>(q[j]);
  float top = ninf;
  for (int64_t s = 0; s < L; ++s) {
    if (mask != nullptr && !mask[s]) {
      scores[s] = ninf;
      continue;
    }
    const T* kr = k(s);
    fvec a(0.f);
    for (int64_t j = 0; j < Dw; j += W) a = at::vec::fmadd(fvec::loadu(qf + j), load_float(kr + j), a);
    float dot = at::vec::vec_reduce_all<float>([](fvec& x, fvec& y) { return x + y; }, a);
    for (int64_t j = Dw; j < D; ++j) dot += qf[j] * static_cast<float>(kr[j]);
    scores[s] = dot * scale;
    top = std::max(top, scores[s]);
  }
  for (int64_t j = 0; j < Dv; ++j) acc[j] = 0.f;
  if (top == ninf) {  // nothing to attend (a padding row): zeros
    for (int64_t j = 0; j < Dv; ++j) out[j] = static_cast<T>(0.f);
    return;
  }
  const float sum = exponentiate(scores, L, top);
  for (int64_t s = 0; s < L; ++s) {
    const float p = scores[s];
    if (p == 0.f) continue;
    const T* vr = v(s);
    const fvec pv(p);
    for (int64_t j = 0; j < Dvw; j += W) at::vec::fmadd(pv, load_float(vr + j), fvec::loadu(acc + j)).store(acc + j);
    for (int64_t j = Dvw; j < Dv; ++j) acc[j] += p * static_cast<float>(vr[j]);
  }
  const float inv = 1.f / sum;
  for (int64_t j = 0; j < Dv; ++j) out[j] = static_cast<T>(acc[j] * inv);
}

// `hg` query heads that read one KV head, together: each key row loaded and widened once for all of them, and each
// head's weighted sum of the values kept in registers (NK, NV: the head's key and value vectors). The same sums in
// the same order as attend_one, so the same bits. q: hg rows of D; scores: hg rows of L; out: hg rows of Dv.
template <typename T, int NK, int NV, typename Rows>
static void attend_group(const T* q, const int64_t hg, const Rows k, const Rows v, const bool* mask, const int64_t L,
                         const float scale, float* qf, float* scores, float* tops, T* out) {
  constexpr int64_t W = fvec::size(), D = NK * W, Dv = NV * W;
  const float ninf = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < hg * D; ++j) qf[j] = static_cast<float>(q[j]);
  for (int64_t i = 0; i < hg; ++i) tops[i] = ninf;
  for (int64_t s = 0; s < L; ++s) {
    if (mask != nullptr && !mask[s]) {
      for (int64_t i = 0; i < hg; ++i) scores[i * L + s] = ninf;
      continue;
    }
    const T* kr = k(s);
    fvec kv[NK];
    for (int j = 0; j < NK; ++j) kv[j] = load_float(kr + j * W);
    for (int64_t i = 0; i < hg; ++i) {
      const float* qi = qf + i * D;
      fvec a(0.f);
      for (int j = 0; j < NK; ++j) a = at::vec::fmadd(fvec::loadu(qi + j * W), kv[j], a);
      const float score = at::vec::vec_reduce_all<float>([](fvec& x, fvec& y) { return x + y; }, a) * scale;
      scores[i * L + s] = score;
      tops[i] = std::max(tops[i], score);
    }
  }
  for (int64_t i = 0; i < hg; ++i) {
    T* o = out + i * Dv;
    float* sc = scores + i * L;
    const float top = tops[i];
    if (top == ninf) {  // nothing to attend (a padding row): zeros
      for (int64_t j = 0; j < Dv; ++j) o[j] = static_cast<T>(0.f);
      continue;
    }
    const float sum = exponentiate(sc, L, top);
    fvec acc[NV];
    for (int j = 0; j < NV; ++j) acc[j] = fvec(0.f);
    for (int64_t s = 0; s < L; ++s) {
      const float p = sc[s];
      if (p == 0.f) continue;
      const T* vr = v(s);
      const fvec pv(p);
      for (int j = 0; j < NV; ++j) acc[j] = at::vec::fmadd(pv, load_float(vr + j * W), acc[j]);
    }
    const float inv = 1.f / sum;
    alignas(64) float res[Dv];
    for (int j = 0; j < NV; ++j) acc[j].store(res + j * W);
    for (int64_t j = 0; j < Dv; ++j) o[j] = static_cast<T>(res[j] * inv);
  }
}

// f(integral_constant<int, N>) for a head of N vectors (1, 2, 4, 8 or 16); false for any other size.
template <typename F>
static bool by_vectors(const int64_t n, F&& f) {
  switch (n) {
    case 1: f(std::integral_constant<int, 1>{}); return true;
    case 2: f(std::integral_constant<int, 2>{}); return true;
    case 4: f(std::integral_constant<int, 4>{}); return true;
    case 8: f(std::integral_constant<int, 8>{}); return true;
    case 16: f(std::integral_constant<int, 16>{}); return true;
    default: return false;
  }
}

// Every (row, query head) of q [B, H, 1, D] over L positions, keys and values where `rows(b, kv_head, keys?)` says
// (a Strided or Paged), each row's mask [L] (or none), into out [B, H, 1, Dv].
template <typename T, typename RowsOf>
static void attend_all(const at::Tensor& q, const int64_t KVH, const int64_t L, const int64_t Dv, RowsOf&& rows,
                       const at::Tensor* mask, const double scale, at::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(3);
  const int64_t g = H / KVH;
  const T* qp = q.const_data_ptr<T>();
  const bool* mp = mask != nullptr ? mask->const_data_ptr<bool>() : nullptr;
  T* op = out.data_ptr<T>();
  constexpr int64_t W = fvec::size();
  const bool tiny = B * H * L * (D + Dv) < 32768;  // a tiny step is not worth waking threads
  // a KV head's query heads together where the key and value rows are whole vectors: all of them in one task where
  // there are tasks enough for every thread twice, else split into `parts` (a divisor of g) until there are, or one
  // head a task; the same sums whatever the split
  if (D == Dv && D % W == 0) {
    const int64_t threads = at::get_num_threads();
    int64_t parts = 1;
    while (!tiny && parts < g && (B * KVH * parts < 2 * threads || g % parts != 0)) ++parts;
    const int64_t hg = g / parts, tasks = B * KVH * parts;
    const bool done = by_vectors(D / W, [&](auto n) {
      constexpr int N = decltype(n)::value;
      at::parallel_for(0, tasks, tiny ? tasks : 1, [&](int64_t begin, int64_t end) {
        std::vector<float> qf(hg * D), scores(hg * L), tops(hg);
        for (int64_t t = begin; t < end; ++t) {
          const int64_t b = t / (KVH * parts), kh = t / parts % KVH, h0 = b * H + kh * g + t % parts * hg;
          attend_group<T, N, N>(qp + h0 * D, hg, rows(b, kh, true), rows(b, kh, false),
                                mp != nullptr ? mp + b * L : nullptr, L, static_cast<float>(scale), qf.data(),
                                scores.data(), tops.data(), op + h0 * Dv);
        }
      });
    });
    if (done) return;
  }
  const int64_t grain = tiny ? B * H : 1;
  at::parallel_for(0, B * H, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(D), scores(L), acc(Dv);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t b = t / H, h = t % H, kh = h / g;
      attend_one<T>(qp + t * D, rows(b, kh, true), rows(b, kh, false), mp != nullptr ? mp + b * L : nullptr, L, D,
                    Dv, static_cast<float>(scale), qf.data(), scores.data(), acc.data(), op + t * Dv);
    }
  });
}

// Over a static cache: k [B, KVH, L, D] and v [B, KVH, L, Dv], their last dimension contiguous.
template <typename T>
static void attend_strided(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor* mask,
                           const double scale, at::Tensor& out) {
  const T* kp = k.const_data_ptr<T>();
  const T* vp = v.const_data_ptr<T>();
  attend_all<T>(
      q, k.size(1), k.size(2), v.size(3),
      [&](const int64_t b, const int64_t kh, const bool keys) {
        return keys ? Strided<T>{kp + b * k.stride(0) + kh * k.stride(1), k.stride(2)}
                    : Strided<T>{vp + b * v.stride(0) + kh * v.stride(1), v.stride(2)};
      },
      mask, scale, out);
}

// Over a block pool (decode_layers.cpp's one call on a block cache): k and v contiguous [blocks, size, KVH, D], each
// row's positions through its row of table [B, width] (int64, contiguous; every entry a block of the pool, checked by
// the caller), L = width * size positions, mask [B, L] (or none). Positions the mask hides are not read.
template <typename T>
static void attend_paged(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& table,
                         const at::Tensor* mask, const double scale, at::Tensor& out) {
  const int64_t size = k.size(1), KVH = k.size(2), D = k.size(3), Dv = v.size(3), width = table.size(1);
  const T* kp = k.const_data_ptr<T>();
  const T* vp = v.const_data_ptr<T>();
  const int64_t* tp = table.const_data_ptr<int64_t>();
  attend_all<T>(
      q, KVH, width * size, Dv,
      [&](const int64_t b, const int64_t kh, const bool keys) {
        return keys ? Paged<T>{kp + kh * D, tp + b * width, size, KVH * D}
                    : Paged<T>{vp + kh * Dv, tp + b * width, size, KVH * Dv};
      },
      mask, scale, out);
}

static at::Tensor decode_attention(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                                   const std::optional<at::Tensor>& mask_in, double scale) {
  TORCH_CHECK(q_in.dim() == 4 && q_in.size(2) == 1, "decode_attention: q must be [batch, heads, 1, dim], got ",
              q_in.sizes());
  TORCH_CHECK(k_in.dim() == 4 && v_in.dim() == 4 && k_in.size(0) == q_in.size(0) && v_in.size(0) == q_in.size(0) &&
                  k_in.size(1) == v_in.size(1) && k_in.size(2) == v_in.size(2) && k_in.size(3) == q_in.size(3) &&
                  k_in.size(1) > 0 && q_in.size(1) % k_in.size(1) == 0,
              "decode_attention: k and v must be [batch, kv_heads, positions, dim] with heads a multiple of kv_heads, "
              "got q ", q_in.sizes(), ", k ", k_in.sizes(), ", v ", v_in.sizes());
  const auto dtype = q_in.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && k_in.scalar_type() == dtype &&
                  v_in.scalar_type() == dtype,
              "decode_attention: q, k and v must all be float32 or all bfloat16, got ", dtype, ", ",
              k_in.scalar_type(), ", ", v_in.scalar_type());
  const at::Tensor q = q_in.contiguous();
  const at::Tensor k = k_in.stride(3) == 1 ? k_in : k_in.contiguous();
  const at::Tensor v = v_in.stride(3) == 1 ? v_in : v_in.contiguous();
  at::Tensor mask;
  if (mask_in.has_value()) {
    TORCH_CHECK(mask_in->scalar_type() == at::kBool && mask_in->numel() == q.size(0) * k.size(2),
                "decode_attention: mask must be bool [batch, 1, 1, positions], got ", mask_in->scalar_type(), " ",
                mask_in->sizes());
    mask = mask_in->contiguous();
  }
  at::Tensor out = at::empty({q.size(0), q.size(1), 1, v.size(3)}, q.options());
  const at::Tensor* mp = mask_in.has_value() ? &mask : nullptr;
  if (dtype == at::kFloat) attend_strided<float>(q, k, v, mp, scale, out);
  else attend_strided<at::BFloat16>(q, k, v, mp, scale, out);
  return out;
}

TORCH_LIBRARY_IMPL(staticformers, CPU, m) { m.impl("decode_attention", &decode_attention); }
