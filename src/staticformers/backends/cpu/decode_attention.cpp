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
// softmax, one pass over the values. Built and loaded with gemv.cpp, by inductor's toolchain and vector ISA.
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
#include <vector>

using fvec = at::vec::Vectorized<float>;

static inline fvec load_float(const float* p) { return fvec::loadu(p); }
static inline fvec load_float(const at::BFloat16* p) {
  fvec out;
  at::vec::load_to_float<at::BFloat16>(p, out);
  return out;
}

// One (row, query head): its keys k (positions `ks` apart), values v (`vs` apart), mask (or null), into out.
template <typename T>
static void attend_one(const T* q, const T* k, const T* v, const int64_t ks, const int64_t vs, const bool* mask,
                       const int64_t L, const int64_t D, const int64_t Dv, const float scale, float* qf, float* scores,
                       float* acc, T* out) {
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
    const T* kr = k + s * ks;
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
  const int64_t Lw = L - L % W;
  fvec total(0.f);
  for (int64_t s = 0; s < Lw; s += W) {  // exp(-inf) is 0: a masked position weighs nothing
    const fvec p = (fvec::loadu(scores + s) - fvec(top)).exp();
    p.store(scores + s);
    total = total + p;
  }
  float sum = at::vec::vec_reduce_all<float>([](fvec& x, fvec& y) { return x + y; }, total);
  for (int64_t s = Lw; s < L; ++s) {
    scores[s] = std::exp(scores[s] - top);
    sum += scores[s];
  }
  for (int64_t s = 0; s < L; ++s) {
    const float p = scores[s];
    if (p == 0.f) continue;
    const T* vr = v + s * vs;
    const fvec pv(p);
    for (int64_t j = 0; j < Dvw; j += W) at::vec::fmadd(pv, load_float(vr + j), fvec::loadu(acc + j)).store(acc + j);
    for (int64_t j = Dvw; j < Dv; ++j) acc[j] += p * static_cast<float>(vr[j]);
  }
  const float inv = 1.f / sum;
  for (int64_t j = 0; j < Dv; ++j) out[j] = static_cast<T>(acc[j] * inv);
}

template <typename T>
static void attend_all(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor* mask,
                       const double scale, at::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(3), KVH = k.size(1), L = k.size(2), Dv = v.size(3);
  const int64_t g = H / KVH;
  const T* qp = q.const_data_ptr<T>();
  const T* kp = k.const_data_ptr<T>();
  const T* vp = v.const_data_ptr<T>();
  const bool* mp = mask != nullptr ? mask->const_data_ptr<bool>() : nullptr;
  T* op = out.data_ptr<T>();
  const int64_t grain = B * H * L * (D + Dv) >= 32768 ? 1 : B * H;  // a tiny step is not worth waking threads
  at::parallel_for(0, B * H, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(D), scores(L), acc(Dv);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t b = t / H, h = t % H, kh = h / g;
      attend_one<T>(qp + t * D, kp + b * k.stride(0) + kh * k.stride(1), vp + b * v.stride(0) + kh * v.stride(1),
                    k.stride(2), v.stride(2), mp != nullptr ? mp + b * L : nullptr, L, D, Dv,
                    static_cast<float>(scale), qf.data(), scores.data(), acc.data(), op + t * Dv);
    }
  });
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
  if (dtype == at::kFloat) attend_all<float>(q, k, v, mp, scale, out);
  else attend_all<at::BFloat16>(q, k, v, mp, scale, out);
  return out;
}

TORCH_LIBRARY_IMPL(staticformers, CPU, m) { m.impl("decode_attention", &decode_attention); }
