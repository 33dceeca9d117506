// The small ops of a decode step for MLX's CPU backend, one custom primitive each: RMS norm (alone
// and after a residual add), RoPE, attention of a few queries over a cache, and a gated MLP's
// activation.
//
// MLX's CPU backend runs mx.fast.rms_norm, rope and scaled_dot_product_attention as their composed
// fallbacks (a norm is ~5 primitives, RoPE ~20, attention ~13, plus MLX's work to build and
// schedule each), and a one-token step of a small model is made of them: on a 2-core x86-64 they
// cost SmolLM2-135M about as much per token as reading its packed weights
// (bench/cpu_decode_split.py). Here each is one primitive over float32 rows, single-threaded (the
// rows of a decode step are a few KB; a prompt's attention and activation split over the kernels'
// threads). The arithmetic follows MLX's fallbacks: float32 throughout, RoPE's angles as MLX forms
// them. The gated activation, whose cost is MLX's exp more than its primitives, also takes float16
// and bfloat16 (computed in float32).

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/device.h"
#include "mlx/primitives.h"
#include "mlx/stream.h"

#include "qmm_kernels.h"

namespace nb = nanobind;
namespace mx = mlx::core;
using namespace nb::literals;

namespace mlxr {
// qmm.cpp: offset (in elements) of element `index` of `a` in its buffer, for any strides; f(0) ..
// f(total - 1) on the kernels' threads; how many threads they use.
size_t element_offset(const mx::array& a, size_t index);
void parallel_for(int total, std::function<void(int)> f);
int num_threads();
}  // namespace mlxr

namespace {

using mlxr::element_offset;

// A float32 array's elements in row-major order: its buffer when row-contiguous, else a copy
// (a row at a time where the last axis is contiguous: a transposed view of heads, say).
const float* dense(const mx::array& a, std::vector<float>& scratch) {
  if (a.flags().row_contiguous) {
    return a.data<float>();
  }
  scratch.resize(a.size());
  const float* data = a.data<float>();
  const size_t last = a.ndim() > 0 ? a.shape(-1) : 1;
  if (a.ndim() > 0 && a.strides().back() == 1) {
    for (size_t row = 0; row * last < a.size(); ++row) {
      std::memcpy(scratch.data() + row * last, data + element_offset(a, row * last), last * sizeof(float));
    }
    return scratch.data();
  }
  for (size_t i = 0; i < a.size(); ++i) {
    scratch[i] = data[element_offset(a, i)];
  }
  return scratch.data();
}

// Sum of a[i] * b[i]: 16 independent partial sums, which the compiler keeps in a vector register
// (a single running sum could not be vectorized without reassociating it).
inline float dot(const float* a, const float* b, int n) {
  float partial[16] = {};
  int i = 0;
  for (; i + 16 <= n; i += 16) {
    for (int j = 0; j < 16; ++j) {
      partial[j] += a[i + j] * b[i + j];
    }
  }
  float sum = 0.0f;
  for (; i < n; ++i) {
    sum += a[i] * b[i];
  }
  for (int j = 0; j < 16; ++j) {
    sum += partial[j];
  }
  return sum;
}

inline float sum_of_squares(const float* a, int n) {
  return dot(a, a, n);
}

// The operands' dispatch as in MLX's own CPU primitives: inputs and outputs registered with the
// stream's encoder, the work run on the stream's thread. Outputs given a buffer already (an
// input's, donated) keep it; the others get one of their own.
template <class F>
void dispatch(mx::Stream stream, const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs, F&& work) {
  auto& encoder = mx::cpu::get_command_encoder(stream);
  for (const auto& in : inputs) {
    encoder.set_input_array(in);
  }
  for (auto& out : outputs) {
    if (out.data_shared_ptr() == nullptr) {
      out.set_data(mx::allocator::malloc(out.nbytes()));
    }
    encoder.set_output_array(out);
  }
  std::vector<mx::array> ins, outs;
  for (const auto& in : inputs) {
    ins.push_back(mx::array::unsafe_weak_copy(in));
  }
  for (const auto& out : outputs) {
    outs.push_back(mx::array::unsafe_weak_copy(out));
  }
  encoder.dispatch([ins = std::move(ins), outs = std::move(outs), work = std::forward<F>(work)]() mutable {
    work(ins, outs);
  });
}

// ---- RMS norm -------------------------------------------------------------------------------

// inputs: x [..., H], weight [H], and for the residual form r [..., H];
// outputs: the norm, or (h = x + r, the norm of h).
class RMSNorm : public mx::Primitive {
 public:
  RMSNorm(mx::Stream stream, float eps, bool residual)
      : mx::Primitive(stream), eps_(eps), residual_(residual) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    dispatch(stream(), inputs, outputs, [eps = eps_, residual = residual_](
                                            std::vector<mx::array>& in, std::vector<mx::array>& out) {
      std::vector<float> xs, ws, rs;
      const int H = in[0].shape(-1);
      const size_t rows = in[0].size() / H;
      const float* x = dense(in[0], xs);
      const float* w = dense(in[1], ws);
      const float* r = residual ? dense(in[2], rs) : nullptr;
      float* normed = out[residual ? 1 : 0].data<float>();
      float* h = residual ? out[0].data<float>() : nullptr;
      for (size_t row = 0; row < rows; ++row) {
        const float* src = x + row * H;
        if (residual) {
          float* sum = h + row * H;
          const float* add = r + row * H;
          for (int i = 0; i < H; ++i) {
            sum[i] = src[i] + add[i];
          }
          src = sum;
        }
        const float inverse = 1.0f / std::sqrt(sum_of_squares(src, H) / float(H) + eps);
        float* dst = normed + row * H;
        for (int i = 0; i < H; ++i) {
          dst[i] = w[i] * (src[i] * inverse);
        }
      }
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("[mlxr rms_norm] runs on the CPU only");
  }

  const char* name() const override {
    return residual_ ? "MlxrAddRMSNorm" : "MlxrRMSNorm";
  }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const RMSNorm&>(other);
    return eps_ == o.eps_ && residual_ == o.residual_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return std::vector<mx::Shape>(residual_ ? 2 : 1, inputs[0].shape());
  }

 private:
  float eps_;
  bool residual_;
};

mx::Stream cpu_stream(const char* op) {
  auto stream = mx::default_stream(mx::default_device());
  if (stream.device != mx::Device::cpu) {
    throw std::invalid_argument(std::string("[mlxr ") + op + "] runs on MLX's CPU device only");
  }
  return stream;
}

void require_float32(const char* op, std::initializer_list<const mx::array*> arrays) {
  for (const auto* a : arrays) {
    if (a->dtype() != mx::float32) {
      throw std::invalid_argument(std::string("[mlxr ") + op + "] takes float32 arrays");
    }
  }
}

void check_norm(const char* op, const mx::array& x, const mx::array& weight) {
  if (x.ndim() < 1 || weight.ndim() != 1 || weight.shape(0) != x.shape(-1)) {
    throw std::invalid_argument(std::string("[mlxr ") + op + "] expected x [..., H] and weight [H]");
  }
}

mx::array rms_norm(const mx::array& x, const mx::array& weight, float eps) {
  require_float32("rms_norm", {&x, &weight});
  check_norm("rms_norm", x, weight);
  return mx::array(x.shape(), mx::float32, std::make_shared<RMSNorm>(cpu_stream("rms_norm"), eps, false),
                   {x, weight});
}

std::vector<mx::array> add_rms_norm(const mx::array& x, const mx::array& residual, const mx::array& weight,
                                    float eps) {
  require_float32("add_rms_norm", {&x, &residual, &weight});
  check_norm("add_rms_norm", x, weight);
  if (residual.shape() != x.shape()) {
    throw std::invalid_argument("[mlxr add_rms_norm] x and residual must have one shape");
  }
  return mx::array::make_arrays({x.shape(), x.shape()}, {mx::float32, mx::float32},
                                std::make_shared<RMSNorm>(cpu_stream("add_rms_norm"), eps, true),
                                {x, weight, residual});
}

// ---- RoPE -----------------------------------------------------------------------------------

// inputs: x [B, N, T, D], offset (int32, one or one per B), and optionally freqs [dims / 2].
// Position of x[b, :, t] is (offset[b] + t) * scale; pair i turns by position / freqs[i], or by
// position * base^(-i / (dims / 2)) as MLX forms it (exp of -i * log(base) / (dims / 2)).
class Rope : public mx::UnaryPrimitive {
 public:
  Rope(mx::Stream stream, int dims, bool traditional, float base, float scale)
      : mx::UnaryPrimitive(stream), dims_(dims), traditional_(traditional), base_(base), scale_(scale) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& output) override {
    std::vector<mx::array> outputs{output};
    dispatch(stream(), inputs, outputs, [dims = dims_, traditional = traditional_, base = base_, scale = scale_](
                                            std::vector<mx::array>& in, std::vector<mx::array>& out) {
      std::vector<float> xs, fs;
      const mx::array& xa = in[0];
      const int B = xa.shape(0), N = xa.shape(1), T = xa.shape(2), D = xa.shape(3);
      const float* x = dense(xa, xs);
      const int32_t* offsets = in[1].data<int32_t>();
      const bool per_row = in[1].size() > 1;
      const int half = dims / 2;
      std::vector<float> inverse(half);
      if (in.size() == 3) {
        const float* freqs = dense(in[2], fs);
        for (int i = 0; i < half; ++i) {
          inverse[i] = 1.0f / freqs[i];
        }
      } else {
        const float step = std::log(base) / float(half);
        for (int i = 0; i < half; ++i) {
          inverse[i] = std::exp(float(-i) * step);
        }
      }
      std::vector<float> cosines(size_t(T) * half), sines(size_t(T) * half);
      float* y = out[0].data<float>();
      for (int b = 0; b < B; ++b) {
        if (b == 0 || per_row) {
          const float first = float(offsets[per_row ? element_offset(in[1], b) : 0]);
          for (int t = 0; t < T; ++t) {
            const float position = (float(t) + first) * scale;
            for (int i = 0; i < half; ++i) {
              const float theta = position * inverse[i];
              cosines[size_t(t) * half + i] = std::cos(theta);
              sines[size_t(t) * half + i] = std::sin(theta);
            }
          }
        }
        for (int n = 0; n < N; ++n) {
          for (int t = 0; t < T; ++t) {
            const size_t row = ((size_t(b) * N + n) * T + t) * D;
            const float* src = x + row;
            float* dst = y + row;
            const float* c = cosines.data() + size_t(t) * half;
            const float* s = sines.data() + size_t(t) * half;
            if (traditional) {
              for (int i = 0; i < half; ++i) {
                const float x1 = src[2 * i], x2 = src[2 * i + 1];
                dst[2 * i] = x1 * c[i] - x2 * s[i];
                dst[2 * i + 1] = x1 * s[i] + x2 * c[i];
              }
            } else {
              for (int i = 0; i < half; ++i) {
                const float x1 = src[i], x2 = src[half + i];
                dst[i] = x1 * c[i] - x2 * s[i];
                dst[half + i] = x1 * s[i] + x2 * c[i];
              }
            }
            std::memcpy(dst + dims, src + dims, sizeof(float) * (D - dims));
          }
        }
      }
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("[mlxr rope] runs on the CPU only");
  }

  const char* name() const override {
    return "MlxrRope";
  }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const Rope&>(other);
    return dims_ == o.dims_ && traditional_ == o.traditional_ && base_ == o.base_ && scale_ == o.scale_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

 private:
  int dims_;
  bool traditional_;
  float base_;
  float scale_;
};

mx::array rope(const mx::array& x, int dims, bool traditional, float base, float scale, const mx::array& offset,
               const std::optional<mx::array>& freqs) {
  require_float32("rope", {&x});
  if (x.ndim() != 4 || dims % 2 != 0 || dims < 2 || dims > x.shape(3)) {
    throw std::invalid_argument("[mlxr rope] expected x [B, N, T, D] and an even dims <= D");
  }
  if (offset.dtype() != mx::int32 || (offset.size() != 1 && (offset.ndim() != 1 || offset.shape(0) != x.shape(0)))) {
    throw std::invalid_argument("[mlxr rope] offset must be int32, one or one per row of x");
  }
  std::vector<mx::array> inputs{x, offset};
  if (freqs) {
    require_float32("rope", {&*freqs});
    if (freqs->ndim() != 1 || freqs->shape(0) != dims / 2) {
      throw std::invalid_argument("[mlxr rope] freqs must be [dims / 2]");
    }
    inputs.push_back(*freqs);
  }
  return mx::array(x.shape(), mx::float32,
                   std::make_shared<Rope>(cpu_stream("rope"), dims, traditional, base, scale), std::move(inputs));
}

// ---- exp --------------------------------------------------------------------------------------

// exp as a range reduction and a degree-7 polynomial (Cephes' expf: within 2 ulp of float32's exp
// over its range), one value or 8 or 16 lanes at a time: MLX's CPU exp costs 24-37 ns an element.
constexpr float kExpHi = 88.3762626647949f;  // exp of anything above is infinity
constexpr float kExpLo = -87.3365447504f;    // and of anything below, 0 next to the 1 it is added to
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f;
constexpr float kLn2Lo = -2.12194440e-4f;
constexpr float kExpP[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                            4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

inline float fast_exp(float x) {
  if (x > kExpHi) {
    return std::numeric_limits<float>::infinity();
  }
  x = std::max(x, kExpLo);
  const float n = std::nearbyint(x * kLog2e);
  const float r = (x - n * kLn2Hi) - n * kLn2Lo;
  float p = kExpP[0];
  for (int i = 1; i < 6; ++i) {
    p = p * r + kExpP[i];
  }
  p = p * r * r + r + 1.0f;
  int32_t bits = (int32_t(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

#if defined(__AVX512F__)
inline __m512 fast_exp(__m512 x) {
  const __mmask16 overflow = _mm512_cmp_ps_mask(x, _mm512_set1_ps(kExpHi), _CMP_GT_OQ);
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(kExpLo)), _mm512_set1_ps(kExpHi));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), r);
  __m512 p = _mm512_set1_ps(kExpP[0]);
  for (int i = 1; i < 6; ++i) {
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpP[i]));
  }
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  const __m512 result = _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
  return _mm512_mask_blend_ps(overflow, result, _mm512_set1_ps(std::numeric_limits<float>::infinity()));
}

#elif defined(__AVX2__)
inline __m256 fast_exp(__m256 x) {
  const __m256 overflow = _mm256_cmp_ps(x, _mm256_set1_ps(kExpHi), _CMP_GT_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(kExpLo)), _mm256_set1_ps(kExpHi));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), r);
  __m256 p = _mm256_set1_ps(kExpP[0]);
  for (int i = 1; i < 6; ++i) {
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpP[i]));
  }
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  const __m256 result = _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
  return _mm256_blendv_ps(result, _mm256_set1_ps(std::numeric_limits<float>::infinity()), overflow);
}

#endif

// ---- Attention ------------------------------------------------------------------------------

// inputs: q [B, Hq, L, D], k [B, Hkv, S, D], v [B, Hkv, S, Dv] (k and v read through their
// strides: views of a cache's buffers), and optionally a mask broadcastable to [B, Hq, L, S]
// (bool: false hides a key; float: added to the scores). Query l sits at position S - L + l;
// `causal` hides the keys after it. out [B, Hq, L, Dv].
//
// The query heads that share a key head (a group) are done together, so that each key and value
// row is read once for all of them: scores, their softmax (the exp above, 8 or 16 at a time), then
// the values' weighted sum with the group's sums held in registers. A call with enough work is
// split over the kernels' threads by group and, where there are fewer groups than threads (one
// decode step: one per key head), by ranges of positions whose partial softmax sums are merged
// after (each range's maximum, sum and weighted values; the split decoding of long contexts).
// Multiply-adds of q . k from which a call is split over the kernels' threads (one decode query
// over 160 positions, 9 heads of 64: 92K, under it).
constexpr size_t kThreadedWork = size_t(1) << 18;
// Positions a range of a split call holds at least.
constexpr int kMinRange = 64;
// Query heads a group's sums are held for at once (a larger group goes in parts).
constexpr int kGroupPart = 4;

constexpr float kHidden = -std::numeric_limits<float>::infinity();

// out[g * stride + s - s0] = scale * q[g] . k[s] for the range's positions s, GN query heads at
// once (each key row loaded once, GN independent sums).
template <int GN>
void group_scores(const float* const* q, const float* k, int64_t k_stride, int D, int s0, int s1, float scale,
                  float* out, int stride) {
  for (int s = s0; s < s1; ++s) {
    const float* row = k + s * k_stride;
    float sums[GN] = {};
    int d = 0;
#if MLXR_SIMD
    using namespace mlxr::qmm;
    Vec acc[GN];
    for (int g = 0; g < GN; ++g) {
      acc[g] = vzero();
    }
    for (; d + kLanes <= D; d += kLanes) {
      const Vec key = vload(row + d);
      for (int g = 0; g < GN; ++g) {
        acc[g] = vfma(vload(q[g] + d), key, acc[g]);
      }
    }
    for (int g = 0; g < GN; ++g) {
      sums[g] = vsum(acc[g]);
    }
#endif
    for (; d < D; ++d) {
      for (int g = 0; g < GN; ++g) {
        sums[g] += q[g][d] * row[d];
      }
    }
    for (int g = 0; g < GN; ++g) {
      out[g * stride + s - s0] = sums[g] * scale;
    }
  }
}

void group_scores(const float* const* q, int G, const float* k, int64_t k_stride, int D, int s0, int s1,
                  float scale, float* out, int stride) {
  for (int g0 = 0; g0 < G; g0 += kGroupPart) {
    const float* const* qg = q + g0;
    float* og = out + g0 * stride;
    switch (std::min(kGroupPart, G - g0)) {
      case 1: group_scores<1>(qg, k, k_stride, D, s0, s1, scale, og, stride); break;
      case 2: group_scores<2>(qg, k, k_stride, D, s0, s1, scale, og, stride); break;
      case 3: group_scores<3>(qg, k, k_stride, D, s0, s1, scale, og, stride); break;
      default: group_scores<4>(qg, k, k_stride, D, s0, s1, scale, og, stride); break;
    }
  }
}

// x[i] = exp(x[i] - top) (0 where x[i] is hidden); returns their sum.
float exp_shifted(float* x, int n, float top) {
  int i = 0;
  float total = 0.0f;
#if defined(__AVX512F__)
  __m512 sum = _mm512_setzero_ps();
  const __m512 shift = _mm512_set1_ps(top);
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    const __mmask16 seen = _mm512_cmp_ps_mask(v, _mm512_set1_ps(kHidden), _CMP_NEQ_OQ);
    const __m512 p = _mm512_maskz_mov_ps(seen, fast_exp(_mm512_sub_ps(v, shift)));
    _mm512_storeu_ps(x + i, p);
    sum = _mm512_add_ps(sum, p);
  }
  total = _mm512_reduce_add_ps(sum);
#elif defined(__AVX2__)
  __m256 sum = _mm256_setzero_ps();
  const __m256 shift = _mm256_set1_ps(top);
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    const __m256 seen = _mm256_cmp_ps(v, _mm256_set1_ps(kHidden), _CMP_NEQ_OQ);
    const __m256 p = _mm256_and_ps(seen, fast_exp(_mm256_sub_ps(v, shift)));
    _mm256_storeu_ps(x + i, p);
    sum = _mm256_add_ps(sum, p);
  }
  float lanes[8];
  _mm256_storeu_ps(lanes, sum);
  for (float lane : lanes) {
    total += lane;
  }
#endif
  for (; i < n; ++i) {
    x[i] = x[i] == kHidden ? 0.0f : fast_exp(x[i] - top);
    total += x[i];
  }
  return total;
}

// acc[g * Dv + d] = sum over the range of p[g * stride + s - s0] * v[s][d], for GN query heads.
template <int GN>
void weighted_values(const float* p, int stride, const float* v, int64_t v_stride, int Dv, int s0, int s1,
                     float* acc) {
  int d = 0;
#if MLXR_SIMD
  using namespace mlxr::qmm;
  constexpr int kBlock = 4;  // vectors of a row held per query head
  for (; d + kBlock * kLanes <= Dv; d += kBlock * kLanes) {
    Vec sums[GN][kBlock];
    for (int g = 0; g < GN; ++g) {
      for (int j = 0; j < kBlock; ++j) {
        sums[g][j] = vzero();
      }
    }
    for (int s = s0; s < s1; ++s) {
      const float* row = v + s * v_stride + d;
      Vec values[kBlock];
      for (int j = 0; j < kBlock; ++j) {
        values[j] = vload(row + j * kLanes);
      }
      for (int g = 0; g < GN; ++g) {
        const Vec weight = vset(p[g * stride + s - s0]);
        for (int j = 0; j < kBlock; ++j) {
          sums[g][j] = vfma(weight, values[j], sums[g][j]);
        }
      }
    }
    for (int g = 0; g < GN; ++g) {
      for (int j = 0; j < kBlock; ++j) {
        vstore(acc + g * Dv + d + j * kLanes, sums[g][j]);
      }
    }
  }
#endif
  if (d < Dv) {  // what is left of the row (all of it without SIMD)
    for (int g = 0; g < GN; ++g) {
      std::fill(acc + g * Dv + d, acc + (g + 1) * Dv, 0.0f);
    }
    for (int s = s0; s < s1; ++s) {
      const float* row = v + s * v_stride;
      for (int g = 0; g < GN; ++g) {
        const float weight = p[g * stride + s - s0];
        float* a = acc + g * Dv;
        for (int e = d; e < Dv; ++e) {
          a[e] += weight * row[e];
        }
      }
    }
  }
}

void weighted_values(int G, const float* p, int stride, const float* v, int64_t v_stride, int Dv, int s0, int s1,
                     float* acc) {
  for (int g0 = 0; g0 < G; g0 += kGroupPart) {
    const float* pg = p + g0 * stride;
    float* ag = acc + g0 * Dv;
    switch (std::min(kGroupPart, G - g0)) {
      case 1: weighted_values<1>(pg, stride, v, v_stride, Dv, s0, s1, ag); break;
      case 2: weighted_values<2>(pg, stride, v, v_stride, Dv, s0, s1, ag); break;
      case 3: weighted_values<3>(pg, stride, v, v_stride, Dv, s0, s1, ag); break;
      default: weighted_values<4>(pg, stride, v, v_stride, Dv, s0, s1, ag); break;
    }
  }
}

// One attention call's operands: q [B, Hq, L, D] dense; k and v [B, Hkv, S, D|Dv] through their
// strides (axes 0-2; the last is contiguous); an optional bool or additive float mask through its
// strides aligned to [B, Hq, L, S] (0 where it broadcasts); out [B, Hq, L, Dv] dense.
struct Attend {
  const float* q;
  int B, Hq, L, D;
  const float* k;
  const float* v;
  int Hkv, S, Dv;
  int64_t k_strides[3], v_strides[3];
  const bool* mask_bool = nullptr;
  const float* mask_add = nullptr;
  int64_t mask_strides[4] = {0, 0, 0, 0};
  float scale;
  bool causal;
  float* out;
};

// The mask's part of an Attend (none when mask is null).
void set_mask(Attend& a, const mx::array* mask) {
  if (mask == nullptr) {
    return;
  }
  for (int d = 0; d < mask->ndim(); ++d) {
    const int at = 4 - mask->ndim() + d;
    a.mask_strides[at] = mask->shape(d) == 1 ? 0 : mask->strides()[d];
  }
  a.mask_bool = mask->dtype() == mx::bool_ ? mask->data<bool>() : nullptr;
  a.mask_add = mask->dtype() == mx::float32 ? mask->data<float>() : nullptr;
}

void attend(const Attend& a) {
  const int B = a.B, Hq = a.Hq, L = a.L, D = a.D, Hkv = a.Hkv, S = a.S, Dv = a.Dv;
  const int G = Hq / Hkv;
  const float* q = a.q;
  const float* k = a.k;
  const float* v = a.v;
  const int64_t k_stride = a.k_strides[2], v_stride = a.v_strides[2];
  const int64_t* mask_strides = a.mask_strides;
  const bool* mask_bool = a.mask_bool;
  const float* mask_add = a.mask_add;
  const bool has_mask = mask_bool != nullptr || mask_add != nullptr;
  const float scale = a.scale;
  const bool causal = a.causal;
  float* o = a.out;

  // Work units: a group (b, key head, l) over a range of positions.
  const int groups = B * Hkv * L;
  const bool threaded = size_t(S) * D * B * Hq * L >= kThreadedWork && mlxr::num_threads() > 1;
  int ranges = 1;
  if (threaded && groups < mlxr::num_threads() * 4) {
    ranges = std::max(1, std::min((mlxr::num_threads() * 4 + groups - 1) / groups, S / kMinRange));
  }
  // Each unit's partial softmax: per query head its maximum and sum, then its weighted values.
  const int part = 2 + Dv;
  std::vector<float> partials(ranges > 1 ? size_t(groups) * ranges * G * part : 0);
  const int units = groups * ranges;
  const int slices = threaded ? std::min(units, mlxr::num_threads() * 4) : 1;
  mlxr::parallel_for(slices, [&](int slice) {
    std::vector<float> scores, acc(size_t(G) * Dv), top(G), total(G);
    std::vector<const float*> qrows(G);
    for (int unit = units * slice / slices; unit < units * (slice + 1) / slices; ++unit) {
      const int group = unit / ranges, range = unit % ranges;
      const int l = group % L, kv = group / L % Hkv, b = group / L / Hkv;
      const int visible = causal ? S - L + l + 1 : S;  // keys after it are hidden
      const int s0 = int(int64_t(visible) * range / ranges), s1 = int(int64_t(visible) * (range + 1) / ranges);
      const int n = s1 - s0;
      scores.resize(size_t(G) * std::max(n, 1));
      for (int g = 0; g < G; ++g) {
        qrows[g] = q + ((size_t(b) * Hq + kv * G + g) * L + l) * D;
      }
      const float* kb = k + b * a.k_strides[0] + kv * a.k_strides[1];
      const float* vb = v + b * a.v_strides[0] + kv * a.v_strides[1];
      group_scores(qrows.data(), G, kb, k_stride, D, s0, s1, scale, scores.data(), n);
      for (int g = 0; g < G; ++g) {
        float* row = scores.data() + size_t(g) * n;
        if (has_mask) {
          const int64_t mask_row = b * mask_strides[0] + (kv * G + g) * mask_strides[1] + l * mask_strides[2];
          for (int s = s0; s < s1; ++s) {
            const int64_t at = mask_row + s * mask_strides[3];
            if (mask_bool != nullptr && !mask_bool[at]) {
              row[s - s0] = kHidden;
            } else if (mask_add != nullptr) {
              row[s - s0] += mask_add[at];
            }
          }
        }
        top[g] = kHidden;
        for (int s = 0; s < n; ++s) {
          top[g] = std::max(top[g], row[s]);
        }
        if (top[g] == kHidden) {  // every key hidden: weights of zero
          std::fill(row, row + n, 0.0f);
          total[g] = 0.0f;
        } else {
          total[g] = exp_shifted(row, n, top[g]);
        }
      }
      weighted_values(G, scores.data(), n, vb, v_stride, Dv, s0, s1, acc.data());
      if (ranges == 1) {
        for (int g = 0; g < G; ++g) {
          float* dst = o + ((size_t(b) * Hq + kv * G + g) * L + l) * Dv;
          const float norm = total[g] > 0.0f ? 1.0f / total[g] : 0.0f;
          for (int d = 0; d < Dv; ++d) {
            dst[d] = acc[size_t(g) * Dv + d] * norm;
          }
        }
      } else {
        float* dst = partials.data() + size_t(unit) * G * part;
        for (int g = 0; g < G; ++g) {
          dst[g * part] = top[g];
          dst[g * part + 1] = total[g];
          std::memcpy(dst + g * part + 2, acc.data() + size_t(g) * Dv, Dv * sizeof(float));
        }
      }
    }
  });
  if (ranges == 1) {
    return;
  }
  // The ranges' partial sums, each rescaled to the group's maximum.
  for (int group = 0; group < groups; ++group) {
    const int l = group % L, kv = group / L % Hkv, b = group / L / Hkv;
    for (int g = 0; g < G; ++g) {
      float top = kHidden;
      for (int range = 0; range < ranges; ++range) {
        top = std::max(top, partials[(size_t(group) * ranges + range) * G * part + g * part]);
      }
      float* dst = o + ((size_t(b) * Hq + kv * G + g) * L + l) * Dv;
      std::fill(dst, dst + Dv, 0.0f);
      float total = 0.0f;
      if (top != kHidden) {
        for (int range = 0; range < ranges; ++range) {
          const float* src = partials.data() + (size_t(group) * ranges + range) * G * part + g * part;
          if (src[0] == kHidden) {
            continue;
          }
          const float weight = fast_exp(src[0] - top);
          total += weight * src[1];
          for (int d = 0; d < Dv; ++d) {
            dst[d] += weight * src[2 + d];
          }
        }
      }
      const float norm = total > 0.0f ? 1.0f / total : 0.0f;
      for (int d = 0; d < Dv; ++d) {
        dst[d] *= norm;
      }
    }
  }
}

class Attention : public mx::UnaryPrimitive {
 public:
  Attention(mx::Stream stream, float scale, bool causal)
      : mx::UnaryPrimitive(stream), scale_(scale), causal_(causal) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& output) override {
    std::vector<mx::array> outputs{output};
    dispatch(stream(), inputs, outputs, [scale = scale_, causal = causal_](
                                            std::vector<mx::array>& in, std::vector<mx::array>& out) {
      std::vector<float> qs;
      const mx::array &q = in[0], &k = in[1], &v = in[2];
      Attend a{dense(q, qs), q.shape(0), q.shape(1), q.shape(2), q.shape(3), k.data<float>(), v.data<float>(),
               k.shape(1), k.shape(2), v.shape(3),
               {k.strides()[0], k.strides()[1], k.strides()[2]}, {v.strides()[0], v.strides()[1], v.strides()[2]}};
      a.scale = scale;
      a.causal = causal;
      a.out = out[0].data<float>();
      set_mask(a, in.size() == 4 ? &in[3] : nullptr);
      attend(a);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("[mlxr attention] runs on the CPU only");
  }

  const char* name() const override {
    return "MlxrAttention";
  }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const Attention&>(other);
    return scale_ == o.scale_ && causal_ == o.causal_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    auto shape = inputs[0].shape();
    shape.back() = inputs[2].shape(3);
    return {shape};
  }

 private:
  float scale_;
  bool causal_;
};

// A mask must be bool or float32 and broadcast to [B, Hq, L, S].
void check_mask(const mx::array& mask, const mx::array& q, int S) {
  if (mask.dtype() != mx::bool_ && mask.dtype() != mx::float32) {
    throw std::invalid_argument("[mlxr attention] the mask must be bool or float32");
  }
  if (mask.ndim() > 4) {
    throw std::invalid_argument("[mlxr attention] the mask must broadcast to [B, Hq, L, S]");
  }
  const int target[4] = {q.shape(0), q.shape(1), q.shape(2), S};
  for (int d = 0; d < mask.ndim(); ++d) {
    const int extent = mask.shape(d);
    if (extent != 1 && extent != target[4 - mask.ndim() + d]) {
      throw std::invalid_argument("[mlxr attention] the mask must broadcast to [B, Hq, L, S]");
    }
  }
}

mx::array attention(const mx::array& q, const mx::array& k, const mx::array& v, float scale, bool causal,
                    const std::optional<mx::array>& mask) {
  require_float32("attention", {&q, &k, &v});
  if (q.ndim() != 4 || k.ndim() != 4 || v.ndim() != 4 || k.shape(0) != q.shape(0) || v.shape(0) != q.shape(0) ||
      k.shape(3) != q.shape(3) || v.shape(1) != k.shape(1) || v.shape(2) != k.shape(2) || k.shape(1) == 0 ||
      q.shape(1) % k.shape(1) != 0 || k.shape(2) < q.shape(2)) {
    throw std::invalid_argument(
        "[mlxr attention] expected q [B, Hq, L, D], k [B, Hkv, S, D], v [B, Hkv, S, Dv] with Hq a multiple "
        "of Hkv and S >= L");
  }
  std::vector<mx::array> inputs{q, k, v};
  if (mask) {
    check_mask(*mask, q, k.shape(2));
    inputs.push_back(*mask);
  }
  auto shape = q.shape();
  shape.back() = v.shape(3);
  return mx::array(std::move(shape), mx::float32,
                   std::make_shared<Attention>(cpu_stream("attention"), scale, causal), std::move(inputs));
}

// `in`'s elements (any strides) into the row-contiguous `out` of its shape.
void copy_dense(const mx::array& in, mx::array& out) {
  float* dst = out.data<float>();
  if (in.flags().row_contiguous) {
    std::memcpy(dst, in.data<float>(), out.nbytes());
    return;
  }
  std::vector<float> scratch;
  std::memcpy(dst, dense(in, scratch), out.nbytes());
}

// A decode step's cache write and attention as one primitive. inputs: q [B, Hq, L, D], the new
// keys and values k [B, Hkv, L, D], v [B, Hkv, L, Dv] (any strides), a layer cache's buffers
// k_cache [B, Hkv, C, D], v_cache [B, Hkv, C, Dv] (C >= start + L), optionally a
// mask for [B, Hq, L, start + L]; outputs: attention over the first start + L positions after k and
// v are written at [start, start + L), and the two buffers, written in place where MLX may donate
// them (the cache holds them alone, as a slice update's), else copied first. Instead of two slice
// updates, two slices and the attention: 4 primitives fewer per layer and token.
class CacheAttention : public mx::Primitive {
 public:
  CacheAttention(mx::Stream stream, int start, float scale, bool causal)
      : mx::Primitive(stream), start_(start), scale_(scale), causal_(causal) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    // Each output holds a copy of the inputs (MLX's siblings), so a buffer would never look
    // donatable: drop the copies held by the outputs not being evaluated (MLX detaches every
    // sibling's inputs after this call anyway); the buffers are then donated when the cache held
    // them alone, as a slice update's are.
    for (auto& out : outputs) {
      if (&out.inputs() != &inputs) {
        out.inputs().clear();
      }
    }
    bool donated[2];
    for (int c = 0; c < 2; ++c) {
      const mx::array& buffer = inputs[3 + c];
      donated[c] = buffer.is_donatable() && buffer.flags().row_contiguous;
      if (donated[c]) {
        outputs[1 + c].copy_shared_buffer(buffer);
      }
    }
    dispatch(stream(), inputs, outputs, [start = start_, scale = scale_, causal = causal_, copy_k = !donated[0],
                                         copy_v = !donated[1]](std::vector<mx::array>& ins,
                                                               std::vector<mx::array>& outs) {
      const mx::array &q = ins[0], &k = ins[1], &v = ins[2];
      mx::array &kc = outs[1], &vc = outs[2];
      if (copy_k) {
        copy_dense(ins[3], kc);
      }
      if (copy_v) {
        copy_dense(ins[4], vc);
      }
      const int B = q.shape(0), Hkv = k.shape(1), L = q.shape(2), D = k.shape(3), Dv = v.shape(3);
      const int C = kc.shape(2);
      // The new positions into the buffers, a row of D or Dv floats at a time (dense: k and v may
      // be views of a projection's heads).
      std::vector<float> k_rows, v_rows;
      const float* ks = dense(k, k_rows);
      const float* vs = dense(v, v_rows);
      for (int bh = 0; bh < B * Hkv; ++bh) {
        std::memcpy(kc.data<float>() + (size_t(bh) * C + start) * D, ks + size_t(bh) * L * D, size_t(L) * D * sizeof(float));
        std::memcpy(vc.data<float>() + (size_t(bh) * C + start) * Dv, vs + size_t(bh) * L * Dv,
                    size_t(L) * Dv * sizeof(float));
      }
      std::vector<float> qs;
      Attend a{dense(q, qs), B, q.shape(1), L, q.shape(3), kc.data<float>(), vc.data<float>(), Hkv, start + L, Dv,
               {int64_t(Hkv) * C * D, int64_t(C) * D, D}, {int64_t(Hkv) * C * Dv, int64_t(C) * Dv, Dv}};
      a.scale = scale;
      a.causal = causal;
      a.out = outs[0].data<float>();
      set_mask(a, ins.size() == 6 ? &ins[5] : nullptr);
      attend(a);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("[mlxr attention_into_cache] runs on the CPU only");
  }

  const char* name() const override {
    return "MlxrCacheAttention";
  }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const CacheAttention&>(other);
    return start_ == o.start_ && scale_ == o.scale_ && causal_ == o.causal_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    auto shape = inputs[0].shape();
    shape.back() = inputs[2].shape(3);
    return {shape, inputs[3].shape(), inputs[4].shape()};
  }

 private:
  int start_;
  float scale_;
  bool causal_;
};

std::vector<mx::array> attention_into_cache(const mx::array& q, const mx::array& k, const mx::array& v,
                                            const mx::array& k_cache, const mx::array& v_cache, int start,
                                            float scale, bool causal, const std::optional<mx::array>& mask) {
  require_float32("attention_into_cache", {&q, &k, &v, &k_cache, &v_cache});
  const bool shapes_ok = q.ndim() == 4 && k.ndim() == 4 && v.ndim() == 4 && k_cache.ndim() == 4 &&
                         v_cache.ndim() == 4 && k.shape(0) == q.shape(0) && v.shape(0) == q.shape(0) &&
                         k.shape(2) == q.shape(2) && v.shape(2) == q.shape(2) && k.shape(3) == q.shape(3) &&
                         v.shape(1) == k.shape(1) && k.shape(1) > 0 && q.shape(1) % k.shape(1) == 0 &&
                         k_cache.shape(0) == q.shape(0) && k_cache.shape(1) == k.shape(1) &&
                         k_cache.shape(3) == k.shape(3) && v_cache.shape(0) == q.shape(0) &&
                         v_cache.shape(1) == k.shape(1) && v_cache.shape(3) == v.shape(3) &&
                         v_cache.shape(2) == k_cache.shape(2);
  if (!shapes_ok || start < 0 || start + q.shape(2) > k_cache.shape(2)) {
    throw std::invalid_argument(
        "[mlxr attention_into_cache] expected q [B, Hq, L, D], k [B, Hkv, L, D], v [B, Hkv, L, Dv] and caches "
        "[B, Hkv, C, D|Dv] with start + L <= C");
  }
  std::vector<mx::array> inputs{q, k, v, k_cache, v_cache};
  if (mask) {
    check_mask(*mask, q, start + q.shape(2));
    inputs.push_back(*mask);
  }
  auto out = q.shape();
  out.back() = v.shape(3);
  return mx::array::make_arrays({out, k_cache.shape(), v_cache.shape()}, {mx::float32, mx::float32, mx::float32},
                                std::make_shared<CacheAttention>(cpu_stream("attention_into_cache"), start, scale,
                                                                 causal),
                                std::move(inputs));
}


// ---- Gated activations ----------------------------------------------------------------------

// A gated MLP's activation, silu(gate) * up (SwiGLU) or gelu_tanh(gate) * up (GeGLU), over rows of
// a last axis that is contiguous in both inputs (gate and up may be the two halves of one fused
// projection's output: read where they lie, through their row strides), with the exp above.
//   silu(g) = g / (1 + exp(-g)),   gelu_tanh(g) = 0.5 g (1 + tanh(y)) = g / (1 + exp(-2y)),
//   y = sqrt(2 / pi) (g + 0.044715 g^3).
enum class Gate { silu = 0, gelu_tanh = 1 };

constexpr float kGeluScale = 1.5957691216057308f;  // 2 sqrt(2 / pi)
constexpr float kGeluCube = 0.044715f;

// The denominator's exponent: -g (silu) or -2y (gelu_tanh).
template <Gate kind>
inline float gate_exponent(float g) {
  if constexpr (kind == Gate::silu) {
    return -g;
  } else {
    return -kGeluScale * (g + kGeluCube * g * g * g);
  }
}

#if defined(__AVX512F__)
template <Gate kind>
inline __m512 gated(__m512 g, __m512 u) {
  __m512 e;
  if constexpr (kind == Gate::silu) {
    e = _mm512_sub_ps(_mm512_setzero_ps(), g);
  } else {
    const __m512 inner = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(kGeluCube), g), _mm512_mul_ps(g, g), g);
    e = _mm512_mul_ps(_mm512_set1_ps(-kGeluScale), inner);
  }
  const __m512 denominator = _mm512_add_ps(_mm512_set1_ps(1.0f), fast_exp(e));
  return _mm512_div_ps(_mm512_mul_ps(g, u), denominator);
}
#elif defined(__AVX2__)
template <Gate kind>
inline __m256 gated(__m256 g, __m256 u) {
  __m256 e;
  if constexpr (kind == Gate::silu) {
    e = _mm256_sub_ps(_mm256_setzero_ps(), g);
  } else {
    const __m256 inner = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(kGeluCube), g), _mm256_mul_ps(g, g), g);
    e = _mm256_mul_ps(_mm256_set1_ps(-kGeluScale), inner);
  }
  const __m256 denominator = _mm256_add_ps(_mm256_set1_ps(1.0f), fast_exp(e));
  return _mm256_div_ps(_mm256_mul_ps(g, u), denominator);
}
#endif

// out[i] = act(g[i]) * u[i] for one row of float32.
template <Gate kind>
void gated_row(const float* g, const float* u, float* out, int n) {
  int i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) {
    _mm512_storeu_ps(out + i, gated<kind>(_mm512_loadu_ps(g + i), _mm512_loadu_ps(u + i)));
  }
  if (i < n) {  // the row's tail under a mask: no scalar loop, the same arithmetic
    const __mmask16 tail = __mmask16((1u << (n - i)) - 1);
    const __m512 result = gated<kind>(_mm512_maskz_loadu_ps(tail, g + i), _mm512_maskz_loadu_ps(tail, u + i));
    _mm512_mask_storeu_ps(out + i, tail, result);
    i = n;
  }
#elif defined(__AVX2__)
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(out + i, gated<kind>(_mm256_loadu_ps(g + i), _mm256_loadu_ps(u + i)));
  }
#endif
  for (; i < n; ++i) {
    out[i] = g[i] * u[i] / (1.0f + fast_exp(gate_exponent<kind>(g[i])));
  }
}

// Row `row` of a [rows, n] array as float32: in place for float32 rows with a contiguous last axis
// (row-contiguous, or a strided view such as half of a fused projection's output), else converted
// or gathered into `scratch` (n floats).
template <class T>
const float* float_row(const mx::array& a, size_t row, int n, std::vector<float>& scratch) {
  const T* base = a.data<T>();
  if (a.flags().row_contiguous || a.strides().back() == 1) {
    const T* data = base + (a.flags().row_contiguous ? row * n : element_offset(a, row * n));
    if constexpr (std::is_same_v<T, float>) {
      return data;
    }
    for (int i = 0; i < n; ++i) {
      scratch[i] = static_cast<float>(data[i]);
    }
    return scratch.data();
  }
  for (int i = 0; i < n; ++i) {
    scratch[i] = static_cast<float>(base[element_offset(a, row * n + i)]);
  }
  return scratch.data();
}

// Rows of work from which a call is split over the kernels' threads: ~64K elements (a prompt's
// MLP; a decode row of a few thousand stays on this thread).
constexpr size_t kThreadedElements = size_t(1) << 16;

template <class T>
void gated_rows(const mx::array& gate, const mx::array& up, mx::array& out, Gate kind) {
  const int n = gate.shape(-1);
  const size_t rows = n > 0 ? gate.size() / n : 0;
  T* o = out.data<T>();
  const bool threaded = gate.size() >= kThreadedElements && mlxr::num_threads() > 1;
  const int slices = threaded ? int(std::min<size_t>(rows, size_t(mlxr::num_threads()) * 4)) : 1;
  mlxr::parallel_for(slices, [&](int slice) {
    std::vector<float> gs(n), us(n), os(std::is_same_v<T, float> ? 0 : n);
    for (size_t row = rows * slice / slices; row < rows * (slice + 1) / slices; ++row) {
      const float* g = float_row<T>(gate, row, n, gs);
      const float* u = float_row<T>(up, row, n, us);
      float* dst = std::is_same_v<T, float> ? reinterpret_cast<float*>(o + row * n) : os.data();
      if (kind == Gate::silu) {
        gated_row<Gate::silu>(g, u, dst, n);
      } else {
        gated_row<Gate::gelu_tanh>(g, u, dst, n);
      }
      if constexpr (!std::is_same_v<T, float>) {
        for (int i = 0; i < n; ++i) {
          o[row * n + i] = static_cast<T>(os[i]);
        }
      }
    }
  });
}

// inputs: gate and up, one shape [..., n], one dtype (float32, float16 or bfloat16), any strides
// (rows with a contiguous last axis are read in place); out: act(gate) * up, row-contiguous, in
// their dtype.
class GatedActivation : public mx::UnaryPrimitive {
 public:
  GatedActivation(mx::Stream stream, Gate kind) : mx::UnaryPrimitive(stream), kind_(kind) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& output) override {
    std::vector<mx::array> outputs{output};
    dispatch(stream(), inputs, outputs, [kind = kind_](std::vector<mx::array>& in, std::vector<mx::array>& out) {
      switch (in[0].dtype()) {
        case mx::float16:
          gated_rows<mx::float16_t>(in[0], in[1], out[0], kind);
          break;
        case mx::bfloat16:
          gated_rows<mx::bfloat16_t>(in[0], in[1], out[0], kind);
          break;
        default:
          gated_rows<float>(in[0], in[1], out[0], kind);
      }
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("[mlxr gated_activation] runs on the CPU only");
  }

  const char* name() const override {
    return kind_ == Gate::silu ? "MlxrSwiGLU" : "MlxrGeGLU";
  }

  bool is_equivalent(const mx::Primitive& other) const override {
    return kind_ == static_cast<const GatedActivation&>(other).kind_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

 private:
  Gate kind_;
};

mx::array gated_activation(const mx::array& gate, const mx::array& up, const std::string& activation) {
  Gate kind;
  if (activation == "silu") {
    kind = Gate::silu;
  } else if (activation == "gelu_tanh") {
    kind = Gate::gelu_tanh;
  } else {
    throw std::invalid_argument("[mlxr gated_activation] activation must be 'silu' or 'gelu_tanh', not '" +
                                activation + "'");
  }
  const auto dtype = gate.dtype();
  if (up.dtype() != dtype || (dtype != mx::float32 && dtype != mx::float16 && dtype != mx::bfloat16)) {
    throw std::invalid_argument("[mlxr gated_activation] gate and up must share one dtype: float32, float16 or "
                                "bfloat16");
  }
  if (gate.ndim() < 1 || up.shape() != gate.shape()) {
    throw std::invalid_argument("[mlxr gated_activation] gate and up must have one shape [..., n]");
  }
  return mx::array(gate.shape(), dtype, std::make_shared<GatedActivation>(cpu_stream("gated_activation"), kind),
                   {gate, up});
}

}  // namespace

void register_ops(nb::module_& m) {
  m.def("rms_norm", &rms_norm, "x"_a, "weight"_a, "eps"_a, "x / rms(x) * weight over the last axis (float32).");
  m.def("add_rms_norm", &add_rms_norm, "x"_a, "residual"_a, "weight"_a, "eps"_a,
        "[h, rms_norm(h)] with h = x + residual (float32).");
  m.def("rope", &rope, "x"_a, "dims"_a, "traditional"_a, "base"_a, "scale"_a, "offset"_a, "freqs"_a = nb::none(),
        "mx.fast.rope of x [B, N, T, D] at int32 offset (one, or one per row) (float32).");
  m.def("attention", &attention, "q"_a, "k"_a, "v"_a, "scale"_a, "causal"_a, "mask"_a = nb::none(),
        "Softmax attention of q over k, v (GQA), bottom-right causal or masked (float32).");
  m.def("attention_into_cache", &attention_into_cache, "q"_a, "k"_a, "v"_a, "k_cache"_a, "v_cache"_a, "start"_a,
        "scale"_a, "causal"_a, "mask"_a = nb::none(),
        "k and v written into the caches at start, then attention over their first start + L positions: "
        "(out, k_cache, v_cache), the caches updated in place where MLX donates them (float32).");
  m.def("gated_activation", &gated_activation, "gate"_a, "up"_a, "activation"_a,
        "act(gate) * up, act 'silu' or 'gelu_tanh' (float32, float16, bfloat16; strided rows read in place).");
}
