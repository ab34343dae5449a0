// bfloat16 rows in float32 vectors, shared by the kernels that read and write them (gemv.cpp's MLP block,
// decode_layers.cpp). Not a header the compiler finds: operators.build_library puts its text before each of those
// files' sources, which inductor's toolchain then builds as one library each.
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>

using fvec = at::vec::Vectorized<float>;
using bvec = at::vec::Vectorized<at::BFloat16>;

// n <= bvec::size() bfloat16 values from p as two float32 vectors (the lanes past n zeros), and back (rounded to
// nearest even, as torch rounds); the pointwise loops go bvec::size() values at a time
static inline std::tuple<fvec, fvec> load_bf16(const uint16_t* p, const int64_t n) {
  return at::vec::convert_to_float<at::BFloat16>(bvec::loadu(p, n));
}
static inline void store_bf16(uint16_t* p, const fvec& a, const fvec& b, const int64_t n) {
  at::vec::convert_from_float<at::BFloat16>(a, b).store(p, n);
}

// h = norm * bf16(x * rsqrt(mean(x^2) + eps)) for each of M rows of H values (the model's RMSNorm: float32, cast to
// bfloat16, then the weight; the squares summed in float32, each product rounded once).
static void rms_norm(const uint16_t* xp, const uint16_t* np, const int64_t M, const int64_t H, const double eps,
                     uint16_t* hp) {
  constexpr int64_t B = bvec::size();
  for (int64_t m = 0; m < M; ++m) {
    const int64_t o = m * H;
    fvec squares(0.f);
    for (int64_t j = 0; j < H; j += B) {
      const int64_t n = std::min(B, H - j);
      auto [v0, v1] = load_bf16(xp + o + j, n);
      squares = at::vec::fmadd(v1, v1, at::vec::fmadd(v0, v0, squares));
    }
    const float sum = at::vec::vec_reduce_all<float>([](fvec& a, fvec& b) { return a + b; }, squares);
    const fvec inv(1.f / std::sqrt(sum / static_cast<float>(H) + static_cast<float>(eps)));
    for (int64_t j = 0; j < H; j += B) {
      const int64_t n = std::min(B, H - j);
      uint16_t scaled[B];
      auto [v0, v1] = load_bf16(xp + o + j, n);
      store_bf16(scaled, v0 * inv, v1 * inv, n);
      auto [s0, s1] = load_bf16(scaled, n);
      auto [w0, w1] = load_bf16(np + j, n);
      store_bf16(hp + o + j, w0 * s0, w1 * s1, n);
    }
  }
}
