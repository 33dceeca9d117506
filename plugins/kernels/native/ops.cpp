// The small ops of a decode step for MLX's CPU backend, one custom primitive each: RMS norm (alone
// and after a residual add), RoPE, and attention of a few queries over a cache.
//
// MLX's CPU backend runs mx.fast.rms_norm, rope and scaled_dot_product_attention as their composed
// fallbacks (a norm is ~5 primitives, RoPE ~20, attention ~13, plus MLX's work to build and
// schedule each), and a one-token step of a small model is made of them: on a 2-core x86-64 they
// cost SmolLM2-135M about as much per token as reading its packed weights
// (bench/cpu_decode_split.py). Here each is one primitive over float32 rows, single-threaded (the
// rows of a decode step are a few KB). The arithmetic follows MLX's fallbacks: float32
// throughout, RoPE's angles as MLX forms them.

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
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
#include <vector>

#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/device.h"
#include "mlx/primitives.h"
#include "mlx/stream.h"

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
// stream's encoder, the work run on the stream's thread.
template <class F>
void dispatch(mx::Stream stream, const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs, F&& work) {
  auto& encoder = mx::cpu::get_command_encoder(stream);
  for (const auto& in : inputs) {
    encoder.set_input_array(in);
  }
  for (auto& out : outputs) {
    out.set_data(mx::allocator::malloc(out.nbytes()));
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

// ---- Attention ------------------------------------------------------------------------------

// inputs: q [B, Hq, L, D], k [B, Hkv, S, D], v [B, Hkv, S, Dv] (k and v read through their
// strides: views of a cache's buffers), and optionally a mask broadcastable to [B, Hq, L, S]
// (bool: false hides a key; float: added to the scores). Query l sits at position S - L + l;
// `causal` hides the keys after it. out [B, Hq, L, Dv].
// Multiply-adds of q . k from which a call's queries are split over the kernels' threads (one
// decode query over 160 positions, 9 heads of 64: 92K, under it).
constexpr size_t kThreadedWork = size_t(1) << 18;

class Attention : public mx::UnaryPrimitive {
 public:
  Attention(mx::Stream stream, float scale, bool causal)
      : mx::UnaryPrimitive(stream), scale_(scale), causal_(causal) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& output) override {
    std::vector<mx::array> outputs{output};
    dispatch(stream(), inputs, outputs, [scale = scale_, causal = causal_](
                                            std::vector<mx::array>& in, std::vector<mx::array>& out) {
      std::vector<float> qs;
      const mx::array& qa = in[0];
      const mx::array& ka = in[1];
      const mx::array& va = in[2];
      const int B = qa.shape(0), Hq = qa.shape(1), L = qa.shape(2), D = qa.shape(3);
      const int Hkv = ka.shape(1), S = ka.shape(2), Dv = va.shape(3);
      const int group = Hq / Hkv;
      const float* q = dense(qa, qs);
      const float* k = ka.data<float>();
      const float* v = va.data<float>();
      // Strides of a mask aligned to [B, Hq, L, S] from the right, 0 where it broadcasts.
      const mx::array* mask = in.size() == 4 ? &in[3] : nullptr;
      int64_t mask_strides[4] = {0, 0, 0, 0};
      if (mask != nullptr) {
        for (int d = 0; d < mask->ndim(); ++d) {
          const int at = 4 - mask->ndim() + d;
          mask_strides[at] = mask->shape(d) == 1 ? 0 : mask->strides()[d];
        }
      }
      const bool* mask_bool = mask != nullptr && mask->dtype() == mx::bool_ ? mask->data<bool>() : nullptr;
      const float* mask_add = mask != nullptr && mask->dtype() == mx::float32 ? mask->data<float>() : nullptr;
      const float hidden = -std::numeric_limits<float>::infinity();
      float* o = out[0].data<float>();
      // Queries (b, h, l) in slices over the kernels' threads where there is enough work (a
      // prompt's); one decode query over a short cache stays on this thread.
      const size_t queries = size_t(B) * Hq * L;
      const bool threaded = size_t(S) * D * queries >= kThreadedWork && mlxr::num_threads() > 1;
      const int slices = threaded ? int(std::min<size_t>(queries, size_t(mlxr::num_threads()) * 4)) : 1;
      mlxr::parallel_for(slices, [&](int slice) {
        std::vector<float> scores(S), acc(Dv);
        const size_t first = queries * slice / slices, last = queries * (slice + 1) / slices;
        for (size_t query = first; query < last; ++query) {
          const int l = int(query % L);
          const int h = int(query / L % Hq);
          const int b = int(query / L / Hq);
          const int kv = h / group;
          const float* kb = k + b * ka.strides()[0] + kv * ka.strides()[1];
          const float* vb = v + b * va.strides()[0] + kv * va.strides()[1];
          const float* qrow = q + query * D;
          const int visible = causal ? S - L + l + 1 : S;  // keys after it are hidden
          const int64_t mask_row = b * mask_strides[0] + h * mask_strides[1] + l * mask_strides[2];
          float top = hidden;
          for (int s = 0; s < visible; ++s) {
            float score = dot(qrow, kb + s * ka.strides()[2], D) * scale;
            if (mask_bool != nullptr && !mask_bool[mask_row + s * mask_strides[3]]) {
              score = hidden;
            } else if (mask_add != nullptr) {
              score += mask_add[mask_row + s * mask_strides[3]];
            }
            scores[s] = score;
            top = std::max(top, score);
          }
          std::fill(acc.begin(), acc.end(), 0.0f);
          float total = 0.0f;
          if (top != hidden) {  // a query that sees no key gives zeros
            for (int s = 0; s < visible; ++s) {
              if (scores[s] == hidden) {
                continue;
              }
              const float p = std::exp(scores[s] - top);
              total += p;
              const float* vrow = vb + s * va.strides()[2];
              for (int d = 0; d < Dv; ++d) {
                acc[d] += p * vrow[d];
              }
            }
          }
          float* dst = o + query * Dv;
          const float norm = total > 0.0f ? 1.0f / total : 0.0f;
          for (int d = 0; d < Dv; ++d) {
            dst[d] = acc[d] * norm;
          }
        }
      });
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
    if (mask->dtype() != mx::bool_ && mask->dtype() != mx::float32) {
      throw std::invalid_argument("[mlxr attention] the mask must be bool or float32");
    }
    if (mask->ndim() > 4) {
      throw std::invalid_argument("[mlxr attention] the mask must broadcast to [B, Hq, L, S]");
    }
    const int target[4] = {q.shape(0), q.shape(1), q.shape(2), k.shape(2)};
    for (int d = 0; d < mask->ndim(); ++d) {
      const int extent = mask->shape(d);
      if (extent != 1 && extent != target[4 - mask->ndim() + d]) {
        throw std::invalid_argument("[mlxr attention] the mask must broadcast to [B, Hq, L, S]");
      }
    }
    inputs.push_back(*mask);
  }
  auto shape = q.shape();
  shape.back() = v.shape(3);
  return mx::array(std::move(shape), mx::float32,
                   std::make_shared<Attention>(cpu_stream("attention"), scale, causal), std::move(inputs));
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
}
