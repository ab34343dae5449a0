// A bf16 decode step's decoder layers in one call (backends/cpu/decode_layers.py): the CPU kernel of
// `staticformers::bf16_decode_layers`, whose schema decode_layers.py defines.
//
// For each layer, over a few rows of one token each, in order: h = RMSNorm(x); q, k, v = the streamed
// projections of h (`bf16_gemv`; for int8 weights, `int8_gemv` with their scales), plus their biases where the layer
// has them (Qwen2; each sum rounded once), and q and k normalised per head where the layer norms them (Qwen3:
// RMSNorm over each head's values); RoPE on q and k (float32, each result rounded to bfloat16 once, as inductor's
// fused kernel of the layer region computes it); k and v written into the layer's static cache at each row's
// position; the attention of q over the cache (`decode_attention`); o = the streamed projection of the attention;
// then the MLP half (`bf16_mlp_block`, or gemv.cpp's `int8_mlp_block` for int8 weights: residual, norm, gate and up,
// SiLU, down, residual). x: [rows, hidden], bfloat16; cos, sin: [rows, head_dim] (each row's position's);
// positions: [rows] (int64); each mask [rows, 1, 1, L] bool; caches [rows, kv_heads, L, head_dim], written in
// place, or with a block table [rows, L / size] (int64) a block pool's layers [blocks, size, kv_heads, head_dim],
// each row's position written into, and its positions read from, the block its table row names (decode_attention.cpp's
// `attend_paged`); scales: none (bfloat16 weights) or 7 a layer, q k v o gate up down in order (int8 weights).
//
// Why it is written by hand: a compiled layer region made six calls a layer (two of inductor's kernels, the
// projections, the attention and the MLP block), each behind its host cost, thirty times a step on a 30-layer
// model, and the worker threads waited through every gap between them (BENCHMARKS.md, "A decode step's layers in
// one call"). Here the host calls each layer's operators from C++. The bf16 projections, the attention and the bf16
// MLP half are the operators the regions call (through the dispatcher), so over a static cache their bits are the
// regions' (over a block pool the regions gather and attend by inductor's reductions: the same math, other
// roundings); the int8
// projections are the kernel the regions' int8 layers call (`int8_gemv`, called directly: this file is built in
// one text after gemv.cpp), and the int8 MLP half rounds as the bf16 block does, which the regions' int8 layers,
// having no block, do not quite.
// Built and loaded after gemv.cpp and decode_attention.cpp, by inductor's toolchain and vector ISA.
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <tuple>
#include <vector>

// `fvec`, `bvec`, `load_bf16`, `store_bf16` and `rms_norm` are bf16_rows.h's, whose text operators.build_library puts
// before this file's.
static inline const uint16_t* bits(const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.const_data_ptr()); }
static inline uint16_t* bits_mut(at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr()); }

// y + b for each row of y ([M, N], a projection's output), b [N], each sum rounded to bfloat16 once, in place.
static void add_bias(uint16_t* y, const uint16_t* b, const int64_t M, const int64_t N) {
  constexpr int64_t B = bvec::size();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t j = 0; j < N; j += B) {
      const int64_t n = std::min(B, N - j);
      auto [y0, y1] = load_bf16(y + m * N + j, n);
      auto [b0, b1] = load_bf16(b + j, n);
      store_bf16(y + m * N + j, y0 + b0, y1 + b1, n);
    }
}

constexpr int64_t kMaxHeadDim = 1024;  // a head's values, on the stack while it rotates

// `heads` heads of D values from src (row stride `stride`), rotated by each row's cos and sin (rotate_half: the
// first half's partner is minus the second's), each value computed in float32 and rounded once, into dst: dst's
// row m, head h at dst + m * dst_row + h * dst_head.
static void rope(const uint16_t* src, const int64_t stride, const int64_t M, const int64_t heads, const int64_t D,
                 const uint16_t* cosp, const uint16_t* sinp, uint16_t* dst, const int64_t dst_row,
                 const int64_t dst_head) {
  const int64_t half = D / 2;
  constexpr int64_t B = bvec::size();
  uint16_t partner[kMaxHeadDim];
  for (int64_t m = 0; m < M; ++m) {
    const uint16_t* c = cosp + m * D;
    const uint16_t* s = sinp + m * D;
    for (int64_t h = 0; h < heads; ++h) {
      const uint16_t* x = src + m * stride + h * D;
      for (int64_t j = 0; j < half; ++j) {
        partner[j] = x[j + half] ^ 0x8000u;  // -x2: the sign bit flipped, exact
        partner[j + half] = x[j];
      }
      uint16_t* y = dst + m * dst_row + h * dst_head;
      for (int64_t j = 0; j < D; j += B) {
        const int64_t n = std::min(B, D - j);
        auto [x0, x1] = load_bf16(x + j, n);
        auto [p0, p1] = load_bf16(partner + j, n);
        auto [c0, c1] = load_bf16(c + j, n);
        auto [s0, s1] = load_bf16(s + j, n);
        store_bf16(y + j, x0 * c0 + p0 * s0, x1 * c1 + p1 * s1, n);
      }
    }
  }
}

static at::Tensor bf16_decode_layers(const at::Tensor& x_in, const at::Tensor& cos_in, const at::Tensor& sin_in,
                                     const at::Tensor& positions_in, at::TensorList masks,
                                     at::TensorList input_norms, at::TensorList qw, at::TensorList kw,
                                     at::TensorList vw, at::TensorList ow, at::TensorList post_norms,
                                     at::TensorList gates, at::TensorList ups, at::TensorList downs,
                                     at::TensorList key_caches, at::TensorList value_caches, at::TensorList q_norms,
                                     at::TensorList k_norms, at::TensorList q_biases, at::TensorList k_biases,
                                     at::TensorList v_biases, at::TensorList scales,
                                     const std::optional<at::Tensor>& table_in, double eps, double scale) {
  static const auto gemv =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("staticformers::bf16_gemv", "")
          .typed<std::vector<at::Tensor>(const at::Tensor&, at::TensorList)>();
  static const auto mlp_block =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("staticformers::bf16_mlp_block", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, double, const at::Tensor&,
                            const at::Tensor&, const at::Tensor&)>();
  static const auto attend =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("staticformers::decode_attention", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                            double)>();
  const size_t L = input_norms.size();
  TORCH_CHECK(L > 0 && masks.size() == L && qw.size() == L && kw.size() == L && vw.size() == L && ow.size() == L &&
                  post_norms.size() == L && gates.size() == L && ups.size() == L && downs.size() == L &&
                  key_caches.size() == L && value_caches.size() == L,
              "bf16_decode_layers: every list must hold one tensor per layer (", L, " layers)");
  const bool normed = !q_norms.empty(), biased = !q_biases.empty();
  TORCH_CHECK((!normed || (q_norms.size() == L && k_norms.size() == L)) &&
                  (!biased || (q_biases.size() == L && k_biases.size() == L && v_biases.size() == L)),
              "bf16_decode_layers: q/k norms and q/k/v biases must be one per layer (", L, " layers), or none");
  const bool quantized = !scales.empty();  // int8 weights, each with its scales: 7 a layer (q k v o gate up down)
  TORCH_CHECK(!quantized || scales.size() == 7 * L, "bf16_decode_layers: int8 weights take 7 scales a layer (q, k, v, ",
              "o, gate, up, down: ", 7 * L, "), got ", scales.size());
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kBFloat16,
              "bf16_decode_layers: x must be bfloat16 [rows, hidden], got ", x_in.scalar_type(), " ", x_in.sizes());
  const int64_t M = x_in.size(0), H = x_in.size(1);
  // a static cache's layer: [M, kv_heads, L, head_dim]; a block pool's: [blocks, size, kv_heads, head_dim], each row's
  // positions through its row of the table [M, L / size]
  const bool paged = table_in.has_value();
  TORCH_CHECK(key_caches[0].dim() == 4, "bf16_decode_layers: the caches must be 4-dimensional, got ",
              key_caches[0].sizes());
  const int64_t KVH = key_caches[0].size(paged ? 2 : 1), D = key_caches[0].size(3);
  TORCH_CHECK(cos_in.numel() == M * D && sin_in.numel() == M * D && cos_in.scalar_type() == at::kBFloat16 &&
                  sin_in.scalar_type() == at::kBFloat16 && D % 2 == 0,
              "bf16_decode_layers: cos and sin must be bfloat16, one row of ", D, " values per row");
  TORCH_CHECK(D <= kMaxHeadDim, "bf16_decode_layers: heads of ", D, " values; at most ", kMaxHeadDim);
  TORCH_CHECK(positions_in.numel() == M && positions_in.scalar_type() == at::kLong,
              "bf16_decode_layers: positions must be int64, one per row");
  const at::Tensor cos = cos_in.contiguous(), sin = sin_in.contiguous(), positions = positions_in.contiguous();
  const int64_t* pos = positions.const_data_ptr<int64_t>();
  const int64_t size = paged ? key_caches[0].size(1) : 0;  // a block's positions
  at::Tensor table;
  const int64_t* tp = nullptr;  // the table's entries, row after row
  int64_t Lc;  // every row's positions (every layer's cache has the first's shape, checked below)
  if (paged) {
    table = table_in->contiguous();
    TORCH_CHECK(table.dim() == 2 && table.size(0) == M && table.scalar_type() == at::kLong,
                "bf16_decode_layers: the block table must be int64 [", M, ", blocks a row], one row per row of x, got ",
                table.scalar_type(), " ", table.sizes());
    Lc = table.size(1) * size;
    const int64_t blocks = key_caches[0].size(0);
    tp = table.const_data_ptr<int64_t>();
    for (int64_t i = 0; i < table.numel(); ++i)
      TORCH_CHECK(tp[i] >= 0 && tp[i] < blocks, "bf16_decode_layers: the block table names block ", tp[i],
                  ", outside the pool's ", blocks);
  } else {
    TORCH_CHECK(key_caches[0].size(0) == M,
                "bf16_decode_layers: the caches must be [", M, ", kv_heads, L, head_dim], one row per row of x");
    Lc = key_caches[0].size(2);
  }
  for (int64_t m = 0; m < M; ++m)
    TORCH_CHECK(pos[m] >= 0 && pos[m] < Lc, "bf16_decode_layers: position ", pos[m], " is outside the cache");
  at::Tensor x = x_in.contiguous();
  for (size_t l = 0; l < L; ++l) {
    at::Tensor kc = key_caches[l], vc = value_caches[l];
    const int64_t NH = qw[l].size(0) / D;
    TORCH_CHECK(kc.is_contiguous() && vc.is_contiguous() && kc.scalar_type() == at::kBFloat16 &&
                    vc.sizes() == kc.sizes() && kc.sizes() == key_caches[0].sizes() &&
                    kw[l].size(0) == KVH * D && vw[l].size(0) == KVH * D && qw[l].size(0) == NH * D,
                "bf16_decode_layers: layer ", l, "'s caches must be contiguous bfloat16, of the first layer's shape, ",
                "with ", KVH, " KV heads of ", D, " values, and its projections fit them");
    TORCH_CHECK(NH >= KVH && NH % KVH == 0, "bf16_decode_layers: layer ", l, " has ", NH,
                " query heads, which must be a multiple of its ", KVH, " KV heads");
    TORCH_CHECK(masks[l].scalar_type() == at::kBool && masks[l].numel() == M * Lc,
                "bf16_decode_layers: layer ", l, "'s mask must be bool [", M, ", 1, 1, ", Lc, "]");
    at::Tensor h = at::empty({M, H}, x.options());
    rms_norm(bits(x), bits(input_norms[l].contiguous()), M, H, eps, bits_mut(h));
    const auto s = [&](const int64_t i) { return scales[7 * l + i]; };
    std::vector<at::Tensor> qkv = quantized ? int8_gemv(h, std::vector<at::Tensor>{qw[l], kw[l], vw[l]},
                                                        std::vector<at::Tensor>{s(0), s(1), s(2)})
                                            : gemv.call(h, {qw[l], kw[l], vw[l]});
    if (biased) {
      add_bias(bits_mut(qkv[0]), bits(q_biases[l].contiguous()), M, NH * D);
      add_bias(bits_mut(qkv[1]), bits(k_biases[l].contiguous()), M, KVH * D);
      add_bias(bits_mut(qkv[2]), bits(v_biases[l].contiguous()), M, KVH * D);
    }
    if (normed) {  // each head's D values as a row of its own
      at::Tensor qn = at::empty({M, NH * D}, x.options()), kn = at::empty({M, KVH * D}, x.options());
      rms_norm(bits(qkv[0]), bits(q_norms[l].contiguous()), M * NH, D, eps, bits_mut(qn));
      rms_norm(bits(qkv[1]), bits(k_norms[l].contiguous()), M * KVH, D, eps, bits_mut(kn));
      qkv[0] = qn;
      qkv[1] = kn;
    }
    at::Tensor q = at::empty({M, NH, 1, D}, x.options());
    rope(bits(qkv[0]), NH * D, M, NH, D, bits(cos), bits(sin), bits_mut(q), NH * D, D);
    // k (rotated) and v into each row's position: row m, head g at kc[m, g, pos[m], :], or in a pool at
    // kc[table[m, pos[m] / size], pos[m] % size, g, :]
    uint16_t* kp = bits_mut(kc);
    uint16_t* vp = bits_mut(vc);
    for (int64_t m = 0; m < M; ++m) {
      const uint16_t* km = bits(qkv[1]) + m * KVH * D;
      const uint16_t* v = bits(qkv[2]) + m * KVH * D;
      if (paged) {
        const int64_t at_pos = (tp[m * table.size(1) + pos[m] / size] * size + pos[m] % size) * KVH * D;
        rope(km, KVH * D, 1, KVH, D, bits(cos) + m * D, bits(sin) + m * D, kp + at_pos, 0, D);
        std::memcpy(vp + at_pos, v, KVH * D * sizeof(uint16_t));
        continue;
      }
      const int64_t at_pos = m * KVH * Lc * D + pos[m] * D;
      rope(km, KVH * D, 1, KVH, D, bits(cos) + m * D, bits(sin) + m * D, kp + at_pos, 0, Lc * D);
      for (int64_t g = 0; g < KVH; ++g) std::memcpy(vp + at_pos + g * Lc * D, v + g * D, D * sizeof(uint16_t));
    }
    at::Tensor out;
    if (paged) {  // decode_attention.cpp's kernel over the pool, through the table (checked above)
      out = at::empty({M, NH, 1, D}, x.options());
      const at::Tensor mask = masks[l].contiguous();
      attend_paged<at::BFloat16>(q, kc, vc, table, &mask, scale, out);
    } else {
      out = attend.call(q, kc, vc, masks[l], scale);
    }
    const at::Tensor heads = out.view({M, NH * D});
    const at::Tensor o = quantized ? int8_gemv(heads, std::vector<at::Tensor>{ow[l]}, std::vector<at::Tensor>{s(3)})[0]
                                   : gemv.call(heads, {ow[l]})[0];
    x = quantized ? int8_mlp_block(x, o, post_norms[l], eps, gates[l], ups[l], downs[l], s(4), s(5), s(6))
                  : mlp_block.call(x, o, post_norms[l], eps, gates[l], ups[l], downs[l]);
  }
  return x;
}

TORCH_LIBRARY_IMPL(staticformers, CPU, m) { m.impl("bf16_decode_layers", &bf16_decode_layers); }
