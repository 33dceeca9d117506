// Packed affine quantized matmul for MLX's CPU backend, as a custom primitive.
//
// out[m, n] = sum_k x[m, k] * (scale[n, g(k)] * q[n, k] + bias[n, g(k)])
//           = sum_g scale[n, g] * (x_g . q_g) + bias[n, g] * sum(x_g)
//
// w is MLX's affine packing with transpose=True (the layout of linear layers): row n of w holds
// the K integers of output n as a little-endian bit stream (element i at bits bits*i ..), so a
// group of group_size elements starts on a byte. The weight is read where it lies, one group at a
// time: nothing the size of the matrix is unpacked. The input rows are converted to float32 once
// per call (in the nibble order of the 4-bit SIMD path), with their per-group sums (the bias term).
//
// Threads: output rows are split in slices that a small pool of threads claims (set_num_threads,
// default the CPU count). The caller waits for the slices, not for the threads: on a shared
// machine a worker that has not been scheduled yet finds no work left instead of holding the
// call up (an OpenMP team's join waits for every thread and cost a scheduler tick per call here).
// Tiles: NB output rows x MB input rows per pass, so a weight group decoded into registers is used
// for MB input rows (prefill), and NB independent accumulators keep the FMA units busy (decode).
// Built with -march=native (-mcpu=native on arm64) on the machine that runs it: AVX-512, AVX2,
// NEON or plain C++ by the compiler's macros. The kernels are in qmm_kernels.h.

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"
#include "mlx/stream.h"
#include "mlx/device.h"

#include "qmm_kernels.h"

namespace nb = nanobind;
namespace mx = mlx::core;
using namespace nb::literals;

namespace mlxr {

// Offset (in elements) of element `index` of `a` in its buffer, for any strides (ops.cpp too).
size_t element_offset(const mx::array& a, size_t index) {
  size_t offset = 0;
  for (int d = a.ndim() - 1; d >= 0; --d) {
    const size_t extent = a.shape(d);
    offset += (index % extent) * a.strides()[d];
    index /= extent;
  }
  return offset;
}

}  // namespace mlxr

using mlxr::element_offset;

namespace {

int g_threads = 1;

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Slices [0, total) of one call, claimed one at a time by whichever thread comes.
struct Job {
  std::function<void(int)> run;
  int total = 0;
  std::atomic<int> next{0};
  std::atomic<int> done{0};

  void work() {
    for (int i = next.fetch_add(1); i < total; i = next.fetch_add(1)) {
      run(i);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

class Pool {
 public:
  ~Pool() {
    resize(0);
  }

  // Helper threads besides the caller.
  void resize(int helpers) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
      ++generation_;
    }
    wake_.notify_all();
    for (auto& thread : threads_) {
      thread.join();
    }
    threads_.clear();
    stop_ = false;
    for (int i = 0; i < helpers; ++i) {
      threads_.emplace_back([this] { loop(); });
    }
  }

  // Runs f(0) .. f(total - 1) on the caller and the helpers; returns when all are done.
  void run(int total, std::function<void(int)> f) {
    auto job = std::make_shared<Job>();
    job->run = std::move(f);
    job->total = total;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      job_ = job;
      generation_.fetch_add(1, std::memory_order_release);
    }
    wake_.notify_all();
    job->work();
    while (job->done.load(std::memory_order_acquire) < total) {
      cpu_relax();
    }
  }

 private:
  void loop() {
    uint64_t seen = generation_.load();
    while (true) {
      // Spin a little (the next call of a decode step comes within microseconds), then sleep:
      // on 2 shared cores a longer spin (20000 pauses, ~1 ms) took the core from the rest of the
      // step's graph (SmolLM2 step 103 vs 75 ms at load 5, bench/cpu_decode_split.py).
      for (int i = 0; i < 2000 && generation_.load(std::memory_order_acquire) == seen; ++i) {
        cpu_relax();
      }
      std::shared_ptr<Job> job;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return stop_ || generation_.load() != seen; });
        if (stop_) {
          return;
        }
        seen = generation_.load();
        job = job_;  // kept alive here even after its caller returned
      }
      if (job) {
        job->work();
      }
    }
  }

  std::mutex mutex_;
  std::condition_variable wake_;
  std::atomic<uint64_t> generation_{0};
  std::shared_ptr<Job> job_;
  std::vector<std::thread> threads_;
  bool stop_ = false;
};

Pool& pool() {
  static Pool instance;
  return instance;
}

void set_threads(int n) {
  g_threads = std::max(1, n);
  pool().resize(g_threads - 1);
}

}  // namespace

namespace mlxr {

// f(0) .. f(total - 1) on the pool's threads and the caller (ops.cpp's larger calls).
void parallel_for(int total, std::function<void(int)> f) {
  if (g_threads == 1 || total == 1) {
    for (int i = 0; i < total; ++i) {
      f(i);
    }
    return;
  }
  pool().run(total, std::move(f));
}

// The threads the kernels use (set_num_threads).
int num_threads() {
  return g_threads;
}

}  // namespace mlxr

namespace {

using namespace mlxr::qmm;

// Every problem of one call (one, or one per expert row of the gather form; same N and K).
void run(const std::vector<Problem>& problems) {
  const Problem& first = problems.front();
  const size_t work = size_t(first.N) * first.row_bytes * std::max(1, first.M) * problems.size();
  // A small product is not worth waking the pool for.
  const int threads = work < (64u << 10) ? 1 : std::max(1, g_threads);
  if (threads == 1) {
    for (const auto& p : problems) {
      run_rows(p, 0, p.N);
    }
    return;
  }
  // Slices of output rows (a multiple of the 16-row panel) handed out as threads finish: on a
  // shared machine a thread that loses its core for a while does not hold the others up.
  const int per_problem = std::max(1, threads * 8 / int(problems.size()));
  const int slice = std::max(16, (first.N / per_problem + 15) / 16 * 16);
  const int slices = (first.N + slice - 1) / slice;
  pool().run(int(problems.size()) * slices, [&problems, slice, slices](int i) {
    const Problem& p = problems[i / slices];
    const int begin = (i % slices) * slice;
    run_rows(p, begin, std::min(p.N, begin + slice));
  });
}

template <class T>
float to_float(const void* data, size_t i) {
  return static_cast<float>(static_cast<const T*>(data)[i]);
}

// The kernels' name for a float32/float16/bfloat16 array's dtype.
ScaleType scale_type(const mx::array& a) {
  return a.dtype() == mx::float32 ? ScaleType::f32 : a.dtype() == mx::float16 ? ScaleType::f16 : ScaleType::bf16;
}

// Element i of a float32/float16/bfloat16 buffer as float.
float read_float(const mx::array& a, const void* data, size_t i) {
  switch (a.dtype()) {
    case mx::float32:
      return to_float<float>(data, i);
    case mx::float16:
      return to_float<mx::float16_t>(data, i);
    case mx::bfloat16:
      return to_float<mx::bfloat16_t>(data, i);
    default:
      throw std::runtime_error("[mlxr quantized_matmul] unsupported float dtype");
  }
}

// `a` as a dense float32 vector (any dtype of read_float, any strides).
void gather_floats(const mx::array& a, std::vector<float>& dst) {
  dst.resize(a.size());
  const void* data = a.data<void>();
  if (a.flags().row_contiguous) {
    if (a.dtype() == mx::float32) {
      std::memcpy(dst.data(), data, a.size() * sizeof(float));
      return;
    }
    for (size_t i = 0; i < a.size(); ++i) {
      dst[i] = read_float(a, data, i);
    }
    return;
  }
  for (size_t i = 0; i < a.size(); ++i) {
    dst[i] = read_float(a, data, element_offset(a, i));
  }
}

// inputs: x, w, scales, biases, and for the gather form (experts) the expert of each row.
class QuantizedMatmul : public mx::UnaryPrimitive {
 public:
  QuantizedMatmul(mx::Stream stream, int group_size, int bits, bool experts, bool int8)
      : mx::UnaryPrimitive(stream), group_size_(group_size), bits_(bits), experts_(experts), int8_(int8) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const auto& x = inputs[0];
    const auto& w = inputs[1];
    const auto& scales = inputs[2];
    const auto& biases = inputs[3];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    encoder.set_input_array(x);
    encoder.set_input_array(w);
    encoder.set_input_array(scales);
    encoder.set_input_array(biases);
    encoder.set_output_array(out);
    encoder.dispatch([x = mx::array::unsafe_weak_copy(x),
                      w = mx::array::unsafe_weak_copy(w),
                      scales = mx::array::unsafe_weak_copy(scales),
                      biases = mx::array::unsafe_weak_copy(biases),
                      indices = experts_ ? mx::array::unsafe_weak_copy(inputs[4]) : x,
                      out = mx::array::unsafe_weak_copy(out),
                      group_size = group_size_,
                      bits = bits_,
                      gather = experts_,
                      int8 = int8_]() mutable {
      compute(x, w, scales, biases, gather ? &indices : nullptr, out, group_size, bits, int8);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("[mlxr quantized_matmul] runs on the CPU only");
  }

  const char* name() const override {
    return experts_ ? "MlxrGatherQuantizedMatmul" : "MlxrQuantizedMatmul";
  }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const QuantizedMatmul&>(other);
    return group_size_ == o.group_size_ && bits_ == o.bits_ && experts_ == o.experts_ && int8_ == o.int8_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    auto shape = inputs[0].shape();
    shape.back() = inputs[1].shape(-2);
    return {shape};
  }

 private:
  static void compute(
      const mx::array& x,
      const mx::array& w,
      const mx::array& scales,
      const mx::array& biases,
      const mx::array* indices,
      mx::array& out,
      int group_size,
      int bits,
      bool int8) {
    // Per-thread scratch, reused across calls: the float32 input, its group sums, the float32
    // scales and biases (when strided), the float32 output (when in another dtype), the int8
    // input and its block scales.
    thread_local std::vector<float> xin, xf, xsum, sf, bf, of, xd, xb, xdt, xbt;
    thread_local std::vector<int8_t> xq, xt;
    const int K = x.shape(-1);
    const int M = int(x.size() / K);
    const int N = w.shape(-2);
    const int G = K / group_size;
    // The input where it lies when float32 and dense, else gathered as float32.
    const float* xp = x.dtype() == mx::float32 && x.flags().row_contiguous ? x.data<float>() : nullptr;
    if (xp == nullptr) {
      gather_floats(x, xin);
      xp = xin.data();
    }
    // Every row as int8 where asked and the CPU has integer dot products (4- and 8-bit weights;
    // 5-bit where it also picks bytes in a register); the float copy only for the float tiles.
    const bool integer = int8 && kInt8 && (bits == 4 || bits == 8 || (bits == 5 && kInt8Five));
    xf.resize(integer ? 0 : size_t(M) * K);
    xsum.resize(size_t(M) * G);
    if (integer) {
      xq.resize(size_t(M) * K);
      xd.resize(size_t(M) * (K / 32));
      xb.resize(size_t(M) * (K / 32));
    }
    // Row by row (a prompt's rows on the pool's threads). Pointers, not the thread_local vectors:
    // a helper thread naming those would get its own.
    const auto row = [x = xp, f = integer ? nullptr : xf.data(), s = xsum.data(), q = xq.data(), d = xd.data(),
                      b = xb.data(), K, G, bits, group_size, integer](int m) {
      prepare_input(x + size_t(m) * K, 1, K, group_size, bits, f == nullptr ? nullptr : f + size_t(m) * K,
                    s + size_t(m) * G);
      if (integer) {
        prepare_row_int8(x, m, K, bits, group_size, s, q, d, b);
      }
    };
    if (M >= 16 && g_threads > 1) {
      pool().run(M, row);
    } else {
      for (int m = 0; m < M; ++m) {
        row(m);
      }
    }
    const int8_t* xqp = integer ? xq.data() : nullptr;
    const float* xdp = integer ? xd.data() : nullptr;
    const float* xbp = integer ? xb.data() : nullptr;
    // Row-contiguous scales and biases are read in place in their dtype; others are gathered.
    auto gather = [](const mx::array& a, std::vector<float>& dst) -> const void* {
      gather_floats(a, dst);
      return dst.data();
    };
    const Groups sp = scales.flags().row_contiguous ? Groups{scales.data<void>(), scale_type(scales)}
                                                    : Groups{gather(scales, sf), ScaleType::f32};
    const Groups bp = biases.flags().row_contiguous ? Groups{biases.data<void>(), scale_type(biases)}
                                                    : Groups{gather(biases, bf), ScaleType::f32};
    const bool direct = out.dtype() == mx::float32;
    if (!direct) {
      of.resize(size_t(M) * N);
    }
    const size_t row_bytes = size_t(K) * bits / 8;
    float* op = direct ? out.data<float>() : of.data();
    thread_local std::vector<Problem> problems;
    problems.clear();
    if (indices == nullptr) {
      problems.push_back({integer ? nullptr : xf.data(), xsum.data(), xqp, xdp, xbp, w.data<uint8_t>(), sp, bp, op, M, N, K, G,
                          bits, group_size, row_bytes});
    } else {
      // Row block r (M / R input rows) times expert indices[r]'s matrix.
      const size_t R = indices->size();
      const int rows = int(M / R);
      const int E = w.shape(0);
      for (size_t r = 0; r < R; ++r) {
        const uint32_t e = indices->data<uint32_t>()[element_offset(*indices, r)];
        if (int(e) >= E) {
          throw std::out_of_range("[mlxr gather_matmul] expert index out of range");
        }
        problems.push_back({integer ? nullptr : xf.data() + r * rows * K, xsum.data() + r * rows * G,
                            integer ? xqp + r * rows * K : nullptr, integer ? xdp + r * rows * (K / 32) : nullptr,
                            integer ? xbp + r * rows * (K / 32) : nullptr,
                            w.data<uint8_t>() + size_t(e) * N * row_bytes, sp.plus(size_t(e) * N * G),
                            bp.plus(size_t(e) * N * G), op + r * rows * N, rows, N, K, G, bits,
                            group_size, row_bytes});
      }
    }
    // A prompt's int8 rows (per expert row block in the gather form) through AMX where it runs.
    if (integer && problems.front().M >= kAmxRows && amx_ready()) {
      // Every problem has as many rows: problem k's tiles of 16 rows are k * per_problem onwards.
      const int blocks = K / 32;
      const int per_problem = (problems.front().M + 15) / 16;
      const size_t tiles = problems.size() * per_problem;
      xt.resize(tiles * blocks * 512);
      xdt.resize(tiles * blocks * 16);
      xbt.resize(tiles * blocks * 16);
      for (size_t k = 0; k < problems.size(); ++k) {
        const size_t first = k * per_problem;
        problems[k].xt = xt.data() + first * blocks * 512;
        problems[k].xdt = xdt.data() + first * blocks * 16;
        problems[k].xbt = xbt.data() + first * blocks * 16;
      }
      mlxr::parallel_for(int(tiles), [ps = problems.data(), per_problem, blocks, K, bits, t = xt.data(),
                                      d = xdt.data(), b = xbt.data()](int i) {
        const Problem& p = ps[i / per_problem];
        const size_t first = size_t(i - i % per_problem);
        prepare_amx_input(p.xq, p.xd, p.xb, p.M, K, bits, t + first * blocks * 512, d + first * blocks * 16,
                          b + first * blocks * 16, i % per_problem);
      });
    }
    run(problems);
    if (!direct) {
      const size_t n = size_t(M) * N;
      if (out.dtype() == mx::float16) {
        auto* o = out.data<mx::float16_t>();
        for (size_t i = 0; i < n; ++i) o[i] = mx::float16_t(of[i]);
      } else {
        auto* o = out.data<mx::bfloat16_t>();
        for (size_t i = 0; i < n; ++i) o[i] = mx::bfloat16_t(of[i]);
      }
    }
  }

  int group_size_;
  int bits_;
  bool experts_;
  bool int8_;
};

bool is_float(mx::Dtype t) {
  return t == mx::float32 || t == mx::float16 || t == mx::bfloat16;
}

// Checks the operands of either form (w [N, ...] or a stack [E, N, ...]); returns the stream.
mx::Stream check_operands(
    const mx::array& x,
    const mx::array& w,
    const mx::array& scales,
    const mx::array& biases,
    int group_size,
    int bits,
    int weight_ndim) {
  auto fail = [](const std::string& what) {
    throw std::invalid_argument("[mlxr quantized_matmul] " + what);
  };
  if (bits != 2 && bits != 3 && bits != 4 && bits != 5 && bits != 6 && bits != 8) {
    fail("bits must be 2, 3, 4, 5, 6 or 8, got " + std::to_string(bits));
  }
  if (group_size != 32 && group_size != 64 && group_size != 128) {
    fail("group_size must be 32, 64 or 128, got " + std::to_string(group_size));
  }
  if (x.ndim() < 1 || w.ndim() != weight_ndim || scales.ndim() != weight_ndim ||
      biases.ndim() != weight_ndim) {
    fail(weight_ndim == 2
             ? "expected x [..., K], w [N, K*bits/32], scales and biases [N, K/group_size]"
             : "expected x [..., M, K], w [E, N, K*bits/32], scales and biases [E, N, K/group_size]");
  }
  if (w.dtype() != mx::uint32 || !w.flags().row_contiguous) {
    fail("w must be a row-contiguous uint32 array");
  }
  if (!is_float(x.dtype()) || !is_float(scales.dtype()) || !is_float(biases.dtype())) {
    fail("x, scales and biases must be float32, float16 or bfloat16");
  }
  const int K = x.shape(-1);
  const int N = w.shape(-2);
  if (K % group_size != 0 || int64_t(w.shape(-1)) * 32 != int64_t(K) * bits) {
    fail("x's last axis (" + std::to_string(K) + ") does not match w's packed width (" +
         std::to_string(w.shape(-1)) + " words of " + std::to_string(bits) + "-bit)");
  }
  if (scales.shape(-2) != N || scales.shape(-1) != K / group_size ||
      biases.shape() != scales.shape() || (weight_ndim == 3 && scales.shape(0) != w.shape(0))) {
    fail("scales and biases must be [N, K/group_size] per matrix");
  }
  auto stream = mx::default_stream(mx::default_device());
  if (stream.device != mx::Device::cpu) {
    fail("runs on MLX's CPU device only");
  }
  return stream;
}

mx::array quantized_matmul(
    const mx::array& x,
    const mx::array& w,
    const mx::array& scales,
    const mx::array& biases,
    int group_size,
    int bits,
    bool int8) {
  auto stream = check_operands(x, w, scales, biases, group_size, bits, 2);
  auto shape = x.shape();
  shape.back() = w.shape(0);
  return mx::array(
      std::move(shape),
      x.dtype(),
      std::make_shared<QuantizedMatmul>(stream, group_size, bits, false, int8),
      {x, w, scales, biases});
}

// x [..., M, K] (batch dims equal to indices' shape) times expert indices[...]'s matrix of the
// stack w [E, N, Kp]: [..., M, N].
mx::array gather_matmul(
    const mx::array& x,
    const mx::array& w,
    const mx::array& scales,
    const mx::array& biases,
    const mx::array& indices,
    int group_size,
    int bits,
    bool int8) {
  auto stream = check_operands(x, w, scales, biases, group_size, bits, 3);
  if (indices.dtype() != mx::uint32 || x.ndim() != indices.ndim() + 2 ||
      !std::equal(indices.shape().begin(), indices.shape().end(), x.shape().begin())) {
    throw std::invalid_argument(
        "[mlxr gather_matmul] expected uint32 indices [...] and x [..., M, K] with the same batch "
        "dims");
  }
  auto shape = x.shape();
  shape.back() = w.shape(1);
  return mx::array(
      std::move(shape),
      x.dtype(),
      std::make_shared<QuantizedMatmul>(stream, group_size, bits, true, int8),
      {x, w, scales, biases, indices});
}

}  // namespace

// ops.cpp: RMS norm, RoPE and attention.
void register_ops(nb::module_& m);

NB_MODULE(_mlxr_qmm, m) {
  nb::module_::import_("mlx.core");
  m.doc() = "mlxr's packed affine quantized matmul for MLX's CPU backend";
  m.def("quantized_matmul", &quantized_matmul, "x"_a, "w"_a, "scales"_a, "biases"_a,
        "group_size"_a, "bits"_a, "int8"_a = false,
        "x [..., K] @ dequantize(w).T for MLX affine packing (transpose=True), on the CPU; with int8, "
        "the rows are rounded to int8 per 32-element block where the CPU has integer dot products "
        "(int8_decode()), for 4 and 8 bits.");
  m.def("gather_matmul", &gather_matmul, "x"_a, "w"_a, "scales"_a, "biases"_a, "indices"_a,
        "group_size"_a, "bits"_a, "int8"_a = false,
        "x [..., M, K] @ dequantize(w[indices[...]]).T per batch entry, on the CPU (int8: as "
        "quantized_matmul's).");
  m.def("set_num_threads", &set_threads, "n"_a);
  m.def("num_threads", []() { return g_threads; });
  m.def("isa", []() { return std::string(kIsa); });
  m.def("int8_decode", []() { return kInt8; }, "Whether int8=True takes effect on this CPU.");
  m.def("int8_amx", []() { return amx_ready(); },
        "Whether int8=True takes calls of int8_amx_rows() rows or more through AMX's tiles here.");
  m.def("int8_amx_rows", []() { return kAmxRows; });
  m.def(
      "int8_bits",
      []() { return kInt8 ? (kInt8Five ? std::vector<int>{4, 5, 8} : std::vector<int>{4, 8}) : std::vector<int>{}; },
      "The weight widths int8=True takes effect for on this CPU.");
  register_ops(m);
}
