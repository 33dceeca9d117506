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
// Built with -march=native on the machine that runs it: AVX-512, AVX2 or plain C++ by the
// compiler's macros.

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

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

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"
#include "mlx/stream.h"
#include "mlx/device.h"

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

#if defined(__AVX512F__)
constexpr const char* kIsa = "avx512";
constexpr bool kNibbleOrder = true;
#elif defined(__AVX2__)
constexpr const char* kIsa = "avx2";
constexpr bool kNibbleOrder = true;
#else
constexpr const char* kIsa = "scalar";
constexpr bool kNibbleOrder = false;
#endif

// Group scales or biases, [N, G] row-major, read where they lie in float32, float16 or bfloat16
// (a half-precision model's), not converted whole on every call: SmolLM2's packed layers with
// bfloat16 scales, one token's matmuls on 2 threads, 28.5 -> 15.9 ms (float32 scales: 14.1 ms).
struct Groups {
  const void* data;
  mx::Dtype dtype;

  float operator[](size_t i) const {
    if (dtype == mx::float32) {
      return static_cast<const float*>(data)[i];
    }
    const uint16_t bits = static_cast<const uint16_t*>(data)[i];
    if (dtype == mx::bfloat16) {
      const uint32_t widened = uint32_t(bits) << 16;
      float value;
      std::memcpy(&value, &widened, sizeof value);
      return value;
    }
#if defined(__F16C__)
    return _cvtsh_ss(bits);
#else
    return static_cast<float>(static_cast<const mx::float16_t*>(data)[i]);
#endif
  }

  Groups plus(size_t elements) const {
    return {static_cast<const char*>(data) + elements * mx::size_of(dtype), dtype};
  }

  // Row n's G values as float32: where they lie when float32, else converted into dst (a
  // conversion per value inside the tiles would cost more instructions than the weights do).
  const float* row(int n, int G, float* dst) const {
    const size_t first = size_t(n) * G;
    if (dtype == mx::float32) {
      return static_cast<const float*>(data) + first;
    }
    int g = 0;
    if (dtype == mx::float16) {
      const uint16_t* src = static_cast<const uint16_t*>(data) + first;
#if defined(__AVX512F__)
      for (; g + 16 <= G; g += 16) {
        _mm512_storeu_ps(dst + g, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(src + g))));
      }
#elif defined(__F16C__)
      for (; g + 8 <= G; g += 8) {
        _mm256_storeu_ps(dst + g, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(src + g))));
      }
#endif
    }
    for (; g < G; ++g) {
      dst[g] = (*this)[first + g];
    }
    return dst;
  }
};

// One call's operands, the input already float32 and reordered.
struct Problem {
  const float* x;      // [M, K]
  const float* xsum;   // [M, G]
  const uint8_t* w;    // [N, K * bits / 8]
  Groups scales;       // [N, G]
  Groups biases;       // [N, G]
  float* out;          // [M, N]
  int M, N, K, G, bits, group_size;
  size_t row_bytes;
};

// The scales and biases of output rows n0 .. n0 + NB - 1 as float32 (see Groups::row).
template <int NB>
struct RowGroups {
  const float* scales[NB];
  const float* biases[NB];

  RowGroups(const Problem& p, int n0) {
    thread_local std::vector<float> converted;  // one tile at a time per thread
    converted.resize(size_t(2 * NB) * p.G);
    for (int i = 0; i < NB; ++i) {
      scales[i] = p.scales.row(n0 + i, p.G, converted.data() + size_t(2 * i) * p.G);
      biases[i] = p.biases.row(n0 + i, p.G, converted.data() + size_t(2 * i + 1) * p.G);
    }
  }
};

// Decode reads each weight once, a few rows side by side: the hardware prefetcher alone left a
// thread waiting on memory (Gemma 3's 210 MB LM head at 5.1 GB/s on one thread and 10.1 on two,
// against 7.5 and 13.5 for plain sums). Asking for the bytes 4 KB ahead of each row's reads (the
// next rows: rows lie end to end) made it 7.9 and 14.4 GB/s; 2-16 KB measured alike.
constexpr size_t kPrefetchAhead = 4096;

inline void prefetch_ahead(const uint8_t* at) {
  __builtin_prefetch(at + kPrefetchAhead);
}

// Group g of row n as one byte per element: 8-bit rows are that already; other widths are read
// from the bit stream into buf.
inline const uint8_t* group_bytes(const Problem& p, int n, int g, uint8_t* buf) {
  const uint8_t* row = p.w + size_t(n) * p.row_bytes;
  const size_t first = size_t(g) * p.group_size;
  if (p.bits == 8) {
    return row + first;
  }
  const uint8_t* base = row + first * p.bits / 8;
  const unsigned mask = (1u << p.bits) - 1;
  for (int e = 0; e < p.group_size; ++e) {
    const unsigned bit = unsigned(e) * p.bits;
    unsigned word = base[bit / 8];
    if ((bit % 8) + p.bits > 8) {
      word |= unsigned(base[bit / 8 + 1]) << 8;
    }
    buf[e] = uint8_t((word >> (bit % 8)) & mask);
  }
  return buf;
}

#if defined(__AVX512F__)
using Vec = __m512;
constexpr int kLanes = 16;
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vset(float v) { return _mm512_set1_ps(v); }
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec vmul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline float vsum(Vec a) { return _mm512_reduce_add_ps(a); }
// 16 bytes -> 16 floats.
inline Vec bytes_to_floats(const uint8_t* q) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)q)));
}
#elif defined(__AVX2__)
using Vec = __m256;
constexpr int kLanes = 8;
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vset(float v) { return _mm256_set1_ps(v); }
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec vmul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline float vsum(Vec a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
// 8 bytes -> 8 floats.
inline Vec bytes_to_floats(const uint8_t* q) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)q)));
}
#endif

#if defined(__AVX2__) || defined(__AVX512F__)

// 4-bit: a 32-element block is 16 bytes, element 2j in the low nibble of byte j and 2j+1 in the
// high one. The input block is stored evens first, then odds, so the low nibbles of the bytes
// multiply x[0..16) and the high nibbles x[16..32) with no shuffle of the weight.
template <int NB, int MB>
inline void tile_q4(const Problem& p, int n0, int m0) {
  const RowGroups<NB> groups(p, n0);
  Vec acc[NB][MB];
  float bias_acc[NB][MB];
  #pragma GCC unroll 8
  for (int i = 0; i < NB; ++i) {
    #pragma GCC unroll 8
    for (int j = 0; j < MB; ++j) {
      acc[i][j] = vzero();
      bias_acc[i][j] = 0.0f;
    }
  }
  const uint8_t* rows[NB];
  #pragma GCC unroll 8
  for (int i = 0; i < NB; ++i) {
    rows[i] = p.w + size_t(n0 + i) * p.row_bytes;
  }
  const int blocks = p.group_size / 32;
  for (int g = 0; g < p.G; ++g) {
    Vec s[NB];
    #pragma GCC unroll 8
    for (int i = 0; i < NB; ++i) {
      s[i] = vset(groups.scales[i][g]);
    }
    for (int b = 0; b < blocks; ++b) {
      const int k = g * p.group_size + b * 32;
#if defined(__AVX512F__)
      const __m512i low = _mm512_set1_epi32(0xF);
      Vec lo[NB], hi[NB];
      #pragma GCC unroll 8
      for (int i = 0; i < NB; ++i) {
        prefetch_ahead(rows[i] + k / 2);
        const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(rows[i] + k / 2)));
        lo[i] = vmul(_mm512_cvtepi32_ps(_mm512_and_si512(v, low)), s[i]);
        hi[i] = vmul(_mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4)), s[i]);
      }
      #pragma GCC unroll 8
      for (int j = 0; j < MB; ++j) {
        const float* xk = p.x + size_t(m0 + j) * p.K + k;
        const Vec x0 = vload(xk), x1 = vload(xk + 16);
        #pragma GCC unroll 8
        for (int i = 0; i < NB; ++i) {
          acc[i][j] = vfma(hi[i], x1, vfma(lo[i], x0, acc[i][j]));
        }
      }
#else
      const __m256i low = _mm256_set1_epi32(0xF);
      Vec w[NB][4];  // evens 0..8, evens 8..16, odds 0..8, odds 8..16
      #pragma GCC unroll 8
      for (int i = 0; i < NB; ++i) {
        const uint8_t* q = rows[i] + k / 2;
        prefetch_ahead(q);
        const __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)q));
        const __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(q + 8)));
        w[i][0] = vmul(_mm256_cvtepi32_ps(_mm256_and_si256(a, low)), s[i]);
        w[i][1] = vmul(_mm256_cvtepi32_ps(_mm256_and_si256(c, low)), s[i]);
        w[i][2] = vmul(_mm256_cvtepi32_ps(_mm256_srli_epi32(a, 4)), s[i]);
        w[i][3] = vmul(_mm256_cvtepi32_ps(_mm256_srli_epi32(c, 4)), s[i]);
      }
      #pragma GCC unroll 8
      for (int j = 0; j < MB; ++j) {
        const float* xk = p.x + size_t(m0 + j) * p.K + k;
        const Vec x0 = vload(xk), x1 = vload(xk + 8), x2 = vload(xk + 16), x3 = vload(xk + 24);
        #pragma GCC unroll 8
        for (int i = 0; i < NB; ++i) {
          acc[i][j] = vfma(w[i][3], x3, vfma(w[i][2], x2, vfma(w[i][1], x1, vfma(w[i][0], x0, acc[i][j]))));
        }
      }
#endif
    }
    #pragma GCC unroll 8
    for (int i = 0; i < NB; ++i) {
      const float bias = groups.biases[i][g];
      #pragma GCC unroll 8
      for (int j = 0; j < MB; ++j) {
        bias_acc[i][j] += bias * p.xsum[size_t(m0 + j) * p.G + g];
      }
    }
  }
  #pragma GCC unroll 8
  for (int i = 0; i < NB; ++i) {
    #pragma GCC unroll 8
    for (int j = 0; j < MB; ++j) {
      p.out[size_t(m0 + j) * p.N + n0 + i] = vsum(acc[i][j]) + bias_acc[i][j];
    }
  }
}

// 5-bit: 8 elements are 5 bytes, element i at bits 5i..5i+4. Elements 0-1 are in the low 32
// bits and 2-7 in the 32 bits from bit 8: two 4-byte loads inside the 5 bytes (no read past
// them; assembling the 5 bytes on the stack instead cost two store-forwarding stalls per 8
// elements, 25x slower), two broadcasts, a blend, one variable shift, a mask.
inline __m256 five_bits_to_floats8(const uint8_t* q) {
  uint32_t first = 0, second = 0;
  std::memcpy(&first, q, 4);
  std::memcpy(&second, q + 1, 4);
  const __m256i low = _mm256_set1_epi32(int(first));
  const __m256i high = _mm256_set1_epi32(int(second));
  const __m256i both = _mm256_blend_epi32(high, low, 0b00000011);
  const __m256i shifted = _mm256_srlv_epi32(both, _mm256_setr_epi32(0, 5, 2, 7, 12, 17, 22, 27));
  return _mm256_cvtepi32_ps(_mm256_and_si256(shifted, _mm256_set1_epi32(31)));
}

// kLanes 5-bit elements from q (5 * kLanes / 8 bytes) as floats.
inline Vec five_bits_to_floats(const uint8_t* q) {
#if defined(__AVX512F__)
  return _mm512_insertf32x8(
      _mm512_castps256_ps512(five_bits_to_floats8(q)), five_bits_to_floats8(q + 5), 1);
#else
  return five_bits_to_floats8(q);
#endif
}

// Any other width, natural order: BITS 8 read in place, 5 by five_bits_to_floats, 0 (2/3/6
// bits) read into bytes first.
template <int NB, int MB, int BITS>
inline void tile_bytes(const Problem& p, int n0, int m0) {
  const RowGroups<NB> groups(p, n0);
  Vec acc[NB][MB];
  float bias_acc[NB][MB];
  #pragma GCC unroll 8
  for (int i = 0; i < NB; ++i) {
    #pragma GCC unroll 8
    for (int j = 0; j < MB; ++j) {
      acc[i][j] = vzero();
      bias_acc[i][j] = 0.0f;
    }
  }
  alignas(64) uint8_t buf[NB][128];
  for (int g = 0; g < p.G; ++g) {
    const uint8_t* q[NB];
    Vec s[NB];
    #pragma GCC unroll 8
    for (int i = 0; i < NB; ++i) {
      if constexpr (BITS == 5) {
        q[i] = p.w + size_t(n0 + i) * p.row_bytes + size_t(g) * p.group_size * 5 / 8;
      } else {
        q[i] = group_bytes(p, n0 + i, g, buf[i]);
      }
      prefetch_ahead(p.w + size_t(n0 + i) * p.row_bytes + size_t(g) * p.group_size * p.bits / 8);
      s[i] = vset(groups.scales[i][g]);
    }
    for (int e = 0; e < p.group_size; e += kLanes) {
      Vec w[NB];
      #pragma GCC unroll 8
      for (int i = 0; i < NB; ++i) {
        if constexpr (BITS == 5) {
          w[i] = vmul(five_bits_to_floats(q[i] + e * 5 / 8), s[i]);
        } else {
          w[i] = vmul(bytes_to_floats(q[i] + e), s[i]);
        }
      }
      #pragma GCC unroll 8
      for (int j = 0; j < MB; ++j) {
        const Vec xv = vload(p.x + size_t(m0 + j) * p.K + size_t(g) * p.group_size + e);
        #pragma GCC unroll 8
        for (int i = 0; i < NB; ++i) {
          acc[i][j] = vfma(w[i], xv, acc[i][j]);
        }
      }
    }
    #pragma GCC unroll 8
    for (int i = 0; i < NB; ++i) {
      const float bias = groups.biases[i][g];
      #pragma GCC unroll 8
      for (int j = 0; j < MB; ++j) {
        bias_acc[i][j] += bias * p.xsum[size_t(m0 + j) * p.G + g];
      }
    }
  }
  #pragma GCC unroll 8
  for (int i = 0; i < NB; ++i) {
    #pragma GCC unroll 8
    for (int j = 0; j < MB; ++j) {
      p.out[size_t(m0 + j) * p.N + n0 + i] = vsum(acc[i][j]) + bias_acc[i][j];
    }
  }
}

template <int NB, int MB>
inline void tile(const Problem& p, int n0, int m0) {
  if (p.bits == 4) {
    tile_q4<NB, MB>(p, n0, m0);
  } else if (p.bits == 5) {
    tile_bytes<NB, MB, 5>(p, n0, m0);
  } else if (p.bits == 8) {
    tile_bytes<NB, MB, 8>(p, n0, m0);
  } else {
    tile_bytes<NB, MB, 0>(p, n0, m0);
  }
}

// Prefill (4 input rows or more): a slice of kPanel output rows is dequantized once into a float
// panel (w = scale * q + bias, in the input's order), then every block of 4 input rows is
// multiplied with it by a register-blocked kernel: the decoding is paid once per slice instead of
// once per 4 input rows, and the inner loop is loads and FMAs only.
constexpr int kPanel = 16;
#if defined(__AVX512F__)
constexpr int kMicroN = 4;  // 16 accumulators + 8 operands of 32 registers
#else
constexpr int kMicroN = 2;  // 8 accumulators + 6 operands of 16 registers
#endif

void dequantize_row(const Problem& p, int n, float* dst) {
  const uint8_t* row = p.w + size_t(n) * p.row_bytes;
  alignas(64) uint8_t buf[128];
  for (int g = 0; g < p.G; ++g) {
    const Vec s = vset(p.scales[size_t(n) * p.G + g]);
    const Vec b = vset(p.biases[size_t(n) * p.G + g]);
    float* out = dst + size_t(g) * p.group_size;
    if (p.bits == 4) {
      for (int blk = 0; blk < p.group_size; blk += 32) {
        const uint8_t* q = row + (size_t(g) * p.group_size + blk) / 2;
#if defined(__AVX512F__)
        const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)q));
        const __m512i low = _mm512_set1_epi32(0xF);
        _mm512_storeu_ps(out + blk, vfma(_mm512_cvtepi32_ps(_mm512_and_si512(v, low)), s, b));
        _mm512_storeu_ps(out + blk + 16, vfma(_mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4)), s, b));
#else
        const __m256i low = _mm256_set1_epi32(0xF);
        const __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)q));
        const __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(q + 8)));
        _mm256_storeu_ps(out + blk, vfma(_mm256_cvtepi32_ps(_mm256_and_si256(a, low)), s, b));
        _mm256_storeu_ps(out + blk + 8, vfma(_mm256_cvtepi32_ps(_mm256_and_si256(c, low)), s, b));
        _mm256_storeu_ps(out + blk + 16, vfma(_mm256_cvtepi32_ps(_mm256_srli_epi32(a, 4)), s, b));
        _mm256_storeu_ps(out + blk + 24, vfma(_mm256_cvtepi32_ps(_mm256_srli_epi32(c, 4)), s, b));
#endif
      }
    } else {
      const bool five = p.bits == 5;
      const uint8_t* q = five ? row + size_t(g) * p.group_size * 5 / 8 : group_bytes(p, n, g, buf);
      for (int e = 0; e < p.group_size; e += kLanes) {
        const Vec w = five ? five_bits_to_floats(q + e * 5 / 8) : bytes_to_floats(q + e);
#if defined(__AVX512F__)
        _mm512_storeu_ps(out + e, vfma(w, s, b));
#else
        _mm256_storeu_ps(out + e, vfma(w, s, b));
#endif
      }
    }
  }
}

// out[m0..m0+R, n..n+kMicroN] = x rows . panel rows (no bias term: the panel holds it).
template <int R>
inline void micro(const Problem& p, const float* panel, int panel_row, int n, int m0) {
  Vec acc[kMicroN][R];
  #pragma GCC unroll 8
  for (int i = 0; i < kMicroN; ++i) {
    #pragma GCC unroll 8
    for (int j = 0; j < R; ++j) {
      acc[i][j] = vzero();
    }
  }
  const float* w[kMicroN];
  #pragma GCC unroll 8
  for (int i = 0; i < kMicroN; ++i) {
    w[i] = panel + size_t(panel_row + i) * p.K;
  }
  const float* x[R];
  #pragma GCC unroll 8
  for (int j = 0; j < R; ++j) {
    x[j] = p.x + size_t(m0 + j) * p.K;
  }
  for (int k = 0; k < p.K; k += kLanes) {
    Vec wv[kMicroN];
    #pragma GCC unroll 8
    for (int i = 0; i < kMicroN; ++i) {
      wv[i] = vload(w[i] + k);
    }
    #pragma GCC unroll 8
    for (int j = 0; j < R; ++j) {
      const Vec xv = vload(x[j] + k);
      #pragma GCC unroll 8
      for (int i = 0; i < kMicroN; ++i) {
        acc[i][j] = vfma(wv[i], xv, acc[i][j]);
      }
    }
  }
  #pragma GCC unroll 8
  for (int i = 0; i < kMicroN; ++i) {
    #pragma GCC unroll 8
    for (int j = 0; j < R; ++j) {
      p.out[size_t(m0 + j) * p.N + n + i] = vsum(acc[i][j]);
    }
  }
}

// Every input row (4 or more) for output rows [n_begin, n_end): blocks of 4, then the last 1-3
// rows through the same panel (not the packed tiles: a pass over the weight per row).
void prefill_rows(const Problem& p, int n_begin, int n_end) {
  const int m_full = p.M - p.M % 4;
  thread_local std::vector<float> panel;
  panel.resize(size_t(kPanel) * p.K);
  for (int n0 = n_begin; n0 < n_end; n0 += kPanel) {
    const int rows = std::min(kPanel, n_end - n0);
    for (int i = 0; i < rows; ++i) {
      dequantize_row(p, n0 + i, panel.data() + size_t(i) * p.K);
    }
    const int full = rows - rows % kMicroN;
    for (int i = 0; i < full; i += kMicroN) {
      for (int m = 0; m < m_full; m += 4) {
        micro<4>(p, panel.data(), i, n0 + i, m);
      }
      switch (p.M - m_full) {
        case 3: micro<3>(p, panel.data(), i, n0 + i, m_full); break;
        case 2: micro<2>(p, panel.data(), i, n0 + i, m_full); break;
        case 1: micro<1>(p, panel.data(), i, n0 + i, m_full); break;
        default: break;
      }
    }
    for (int i = full; i < rows; ++i) {  // a last output row or few: the packed tiles
      for (int m = 0; m < m_full; m += 4) {
        tile<1, 4>(p, n0 + i, m);
      }
      for (int m = m_full; m < p.M; ++m) {
        tile<1, 1>(p, n0 + i, m);
      }
    }
  }
}

#else  // no SIMD: plain loops the compiler may vectorize

template <int NB, int MB>
inline void tile(const Problem& p, int n0, int m0) {
  const RowGroups<NB> groups(p, n0);
  float acc[NB][MB] = {};
  uint8_t buf[NB][128];
  for (int g = 0; g < p.G; ++g) {
    #pragma GCC unroll 8
    for (int i = 0; i < NB; ++i) {
      const uint8_t* q = group_bytes(p, n0 + i, g, buf[i]);
      const float s = groups.scales[i][g];
      const float bias = groups.biases[i][g];
      #pragma GCC unroll 8
      for (int j = 0; j < MB; ++j) {
        const float* xg = p.x + size_t(m0 + j) * p.K + size_t(g) * p.group_size;
        float dot = 0.0f;
        for (int e = 0; e < p.group_size; ++e) {
          dot += float(q[e]) * xg[e];
        }
        acc[i][j] += s * dot + bias * p.xsum[size_t(m0 + j) * p.G + g];
      }
    }
  }
  #pragma GCC unroll 8
  for (int i = 0; i < NB; ++i) {
    #pragma GCC unroll 8
    for (int j = 0; j < MB; ++j) {
      p.out[size_t(m0 + j) * p.N + n0 + i] = acc[i][j];
    }
  }
}

void prefill_rows(const Problem& p, int n_begin, int n_end) {
  const int m_full = p.M - p.M % 4;
  for (int n = n_begin; n < n_end; ++n) {
    for (int m = 0; m < m_full; m += 4) {
      tile<1, 4>(p, n, m);
    }
    for (int m = m_full; m < p.M; ++m) {
      tile<1, 1>(p, n, m);
    }
  }
}

#endif

// Output rows [n_begin, n_end) for every input row: 4 input rows or more through a dequantized
// panel (prefill_rows); fewer one at a time from the packed weight, 4 output rows at a time (the
// decode shape).
void run_rows(const Problem& p, int n_begin, int n_end) {
  if (p.M >= 4) {
    prefill_rows(p, n_begin, n_end);
    return;
  }
  int n = n_begin;
  for (; n + 4 <= n_end; n += 4) {
    for (int m = 0; m < p.M; ++m) {
      tile<4, 1>(p, n, m);
    }
  }
  for (; n < n_end; ++n) {
    for (int m = 0; m < p.M; ++m) {
      tile<1, 1>(p, n, m);
    }
  }
}

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
  QuantizedMatmul(mx::Stream stream, int group_size, int bits, bool experts)
      : mx::UnaryPrimitive(stream), group_size_(group_size), bits_(bits), experts_(experts) {}

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
                      gather = experts_]() mutable {
      compute(x, w, scales, biases, gather ? &indices : nullptr, out, group_size, bits);
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
    return group_size_ == o.group_size_ && bits_ == o.bits_ && experts_ == o.experts_;
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
      int bits) {
    // Per-thread scratch, reused across calls: the float32 input, its group sums, the float32
    // scales and biases (when strided), the float32 output (when in another dtype).
    thread_local std::vector<float> xin, xf, xsum, sf, bf, of;
    const int K = x.shape(-1);
    const int M = int(x.size() / K);
    const int N = w.shape(-2);
    const int G = K / group_size;
    gather_floats(x, xin);
    xf.resize(size_t(M) * K);
    xsum.resize(size_t(M) * G);
    for (int m = 0; m < M; ++m) {
      const float* src = xin.data() + size_t(m) * K;
      float* dst = xf.data() + size_t(m) * K;
      for (int g = 0; g < G; ++g) {
        float sum = 0.0f;
        for (int e = 0; e < group_size; ++e) {
          sum += src[g * group_size + e];
        }
        xsum[size_t(m) * G + g] = sum;
      }
      if (kNibbleOrder && bits == 4) {
        for (int k = 0; k < K; k += 32) {
          for (int j = 0; j < 16; ++j) {
            dst[k + j] = src[k + 2 * j];
            dst[k + 16 + j] = src[k + 2 * j + 1];
          }
        }
      } else {
        std::memcpy(dst, src, size_t(K) * sizeof(float));
      }
    }
    // Row-contiguous scales and biases are read in place in their dtype; others are gathered.
    auto gather = [](const mx::array& a, std::vector<float>& dst) -> const void* {
      gather_floats(a, dst);
      return dst.data();
    };
    const Groups sp = scales.flags().row_contiguous ? Groups{scales.data<void>(), scales.dtype()}
                                                    : Groups{gather(scales, sf), mx::float32};
    const Groups bp = biases.flags().row_contiguous ? Groups{biases.data<void>(), biases.dtype()}
                                                    : Groups{gather(biases, bf), mx::float32};
    const bool direct = out.dtype() == mx::float32;
    if (!direct) {
      of.resize(size_t(M) * N);
    }
    const size_t row_bytes = size_t(K) * bits / 8;
    float* op = direct ? out.data<float>() : of.data();
    thread_local std::vector<Problem> problems;
    problems.clear();
    if (indices == nullptr) {
      problems.push_back({xf.data(), xsum.data(), w.data<uint8_t>(), sp, bp, op, M, N, K, G, bits,
                          group_size, row_bytes});
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
        problems.push_back({xf.data() + r * rows * K, xsum.data() + r * rows * G,
                            w.data<uint8_t>() + size_t(e) * N * row_bytes, sp.plus(size_t(e) * N * G),
                            bp.plus(size_t(e) * N * G), op + r * rows * N, rows, N, K, G, bits,
                            group_size, row_bytes});
      }
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
    int bits) {
  auto stream = check_operands(x, w, scales, biases, group_size, bits, 2);
  auto shape = x.shape();
  shape.back() = w.shape(0);
  return mx::array(
      std::move(shape),
      x.dtype(),
      std::make_shared<QuantizedMatmul>(stream, group_size, bits, false),
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
    int bits) {
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
      std::make_shared<QuantizedMatmul>(stream, group_size, bits, true),
      {x, w, scales, biases, indices});
}

}  // namespace

// ops.cpp: RMS norm, RoPE and attention.
void register_ops(nb::module_& m);

NB_MODULE(_mlxr_qmm, m) {
  nb::module_::import_("mlx.core");
  m.doc() = "mlxr's packed affine quantized matmul for MLX's CPU backend";
  m.def("quantized_matmul", &quantized_matmul, "x"_a, "w"_a, "scales"_a, "biases"_a,
        "group_size"_a, "bits"_a,
        "x [..., K] @ dequantize(w).T for MLX affine packing (transpose=True), on the CPU.");
  m.def("gather_matmul", &gather_matmul, "x"_a, "w"_a, "scales"_a, "biases"_a, "indices"_a,
        "group_size"_a, "bits"_a,
        "x [..., M, K] @ dequantize(w[indices[...]]).T per batch entry, on the CPU.");
  m.def("set_num_threads", &set_threads, "n"_a);
  m.def("num_threads", []() { return g_threads; });
  m.def("isa", []() { return std::string(kIsa); });
  register_ops(m);
}
