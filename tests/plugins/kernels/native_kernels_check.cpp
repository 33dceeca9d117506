// The packed matmul's kernels (plugins/kernels/native/qmm_kernels.h) alone, without MLX, against
// a plain double-precision sum over the same packed weights: every width MLX packs (2, 3, 4, 5,
// 6, 8 bits), groups of 32/64/128, float32/float16/bfloat16 scales and biases, 1-9 input rows
// (the decode tiles and the prefill panels), output row counts that leave remainders, and rows
// long enough (K = 8192) to span several of a tile's chunks of groups.
// Built once per SIMD layer by test_native_kernels.py: this machine's, x86-64 without AVX2 (the
// plain C++ path), AVX2, and arm64 (NEON) under an emulator where one is installed.
// Prints the layer and the cases run; exits 1 on the first mismatch.

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "qmm_kernels.h"

using namespace mlxr::qmm;

namespace {

// A half-precision number's bits and its value, worked out apart from the kernels' conversion.
struct Half {
  uint16_t bits;
  double value;
};

Half random_half(std::mt19937& rng) {
  const uint16_t sign = rng() & 1;
  const uint16_t exponent = 8 + rng() % 10;  // 2^-7 .. 2^2, normal numbers
  const uint16_t mantissa = rng() % 1024;
  const double value = (sign ? -1.0 : 1.0) * std::ldexp(1.0 + mantissa / 1024.0, exponent - 15);
  return {uint16_t(sign << 15 | exponent << 10 | mantissa), value};
}

// Group values in the given dtype: the buffer the kernels read and the values they stand for.
void random_groups(std::mt19937& rng, ScaleType type, size_t count, std::vector<uint8_t>& raw,
                   std::vector<double>& values) {
  std::uniform_real_distribution<float> uniform(-0.5f, 0.5f);
  raw.assign(count * scale_bytes(type), 0);
  values.resize(count);
  for (size_t i = 0; i < count; ++i) {
    if (type == ScaleType::f32) {
      const float v = uniform(rng);
      std::memcpy(raw.data() + 4 * i, &v, 4);
      values[i] = v;
    } else if (type == ScaleType::f16) {
      const Half h = random_half(rng);
      std::memcpy(raw.data() + 2 * i, &h.bits, 2);
      values[i] = h.value;
    } else {
      const float v = uniform(rng);
      uint32_t bits;
      std::memcpy(&bits, &v, 4);
      const uint16_t upper = uint16_t(bits >> 16);
      const uint32_t back = uint32_t(upper) << 16;
      float truncated;
      std::memcpy(&truncated, &back, 4);
      std::memcpy(raw.data() + 2 * i, &upper, 2);
      values[i] = truncated;
    }
  }
}

// Integers [N, K] (each < 2^bits) as MLX packs them: a little-endian bit stream per row.
std::vector<uint8_t> pack(const std::vector<unsigned>& q, int N, int K, int bits) {
  const size_t row_bytes = size_t(K) * bits / 8;
  std::vector<uint8_t> out(size_t(N) * row_bytes + 8, 0);  // slack: no kernel may read it
  for (int n = 0; n < N; ++n) {
    for (int k = 0; k < K; ++k) {
      for (int b = 0; b < bits; ++b) {
        if (q[size_t(n) * K + k] >> b & 1) {
          const size_t bit = size_t(k) * bits + b;
          out[n * row_bytes + bit / 8] |= uint8_t(1u << (bit % 8));
        }
      }
    }
  }
  return out;
}

// With int8 (4 and 8 bits, and 5 with VBMI; any number of rows, where the layer has integer dot
// products), the
// input is rounded to int8 per 32-element block (prepare_row_int8) and the sum is checked against
// the rounded input's (the bias term keeps the exact input's group sums).
int check(int bits, int group_size, ScaleType type, int M, int N, int K, std::mt19937& rng, bool int8 = false) {
  const int G = K / group_size;
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  std::vector<unsigned> q(size_t(N) * K);
  for (auto& v : q) v = rng() % (1u << bits);
  std::vector<float> x(size_t(M) * K);
  for (auto& v : x) v = uniform(rng);
  std::vector<uint8_t> scales_raw, biases_raw;
  std::vector<double> scales, biases;
  random_groups(rng, type, size_t(N) * G, scales_raw, scales);
  random_groups(rng, type, size_t(N) * G, biases_raw, biases);
  const std::vector<uint8_t> w = pack(q, N, K, bits);

  std::vector<float> xf(x.size()), xsum(size_t(M) * G), out(size_t(M) * N, NAN);
  prepare_input(x.data(), M, K, group_size, bits, xf.data(), xsum.data());
  std::vector<int8_t> xq(x.size());
  std::vector<float> xd(x.size() / 32), xb(x.size() / 32);
  std::vector<double> rounded(x.begin(), x.end());  // the input the scaled term sees
  if (int8) {
    for (int m = 0; m < M; ++m) {
      prepare_row_int8(x.data(), m, K, bits, group_size, xsum.data(), xq.data(), xd.data(), xb.data());
    }
    for (size_t blk = 0; blk < x.size() / 32; ++blk) {
      float top = 0.0f;
      for (int e = 0; e < 32; ++e) top = std::max(top, std::fabs(x[blk * 32 + e]));
      const float d = top / 127.0f, inverse = d > 0.0f ? 1.0f / d : 0.0f;
      for (int e = 0; e < 32; ++e) rounded[blk * 32 + e] = double(d) * std::nearbyint(x[blk * 32 + e] * inverse);
    }
  }
  const Problem p{xf.data(), xsum.data(), int8 ? xq.data() : nullptr, int8 ? xd.data() : nullptr,
                  int8 ? xb.data() : nullptr, w.data(),
                  Groups{scales_raw.data(), type},
                  Groups{biases_raw.data(), type}, out.data(), M, N, K, G, bits, group_size,
                  size_t(K) * bits / 8};
  run_rows(p, 0, N);

  for (int m = 0; m < M; ++m) {
    for (int n = 0; n < N; ++n) {
      double want = 0.0, scale = 0.0;
      for (int k = 0; k < K; ++k) {
        const size_t g = size_t(n) * G + k / group_size;
        const size_t at = size_t(m) * K + k;
        const double term = rounded[at] * scales[g] * q[size_t(n) * K + k] + x[at] * biases[g];
        want += term;
        scale += std::fabs(term);
      }
      const double got = out[size_t(m) * N + n];
      if (!(std::fabs(got - want) <= 1e-5 * scale + 1e-6)) {
        std::printf("MISMATCH %s%s bits=%d group=%d scales=%d M=%d N=%d K=%d at [%d, %d]: %.7g vs %.7g\n",
                    kIsa, int8 ? " int8" : "", bits, group_size, int(type), M, N, K, m, n, got, want);
        return 1;
      }
    }
  }
  return 0;
}

}  // namespace

int main() {
  std::mt19937 rng(1234);
  int cases = 0;
  for (int bits : {2, 3, 4, 5, 6, 8}) {
    for (int group_size : {32, 64, 128}) {
      for (ScaleType type : {ScaleType::f32, ScaleType::f16, ScaleType::bf16}) {
        for (int M : {1, 2, 3, 4, 5, 9}) {
          for (int N : {1, 7, 21}) {
            if (check(bits, group_size, type, M, N, 256, rng)) {
              return 1;
            }
            ++cases;
          }
        }
        // Rows of more groups than a tile converts at once (64): K = 8192 is 256 groups of 32.
        for (int M : {1, 5}) {
          if (check(bits, group_size, type, M, 5, 8192, rng)) {
            return 1;
          }
          ++cases;
        }
      }
    }
  }
  // int8 decode rows: whole 128-element chunks and 1-3 blocks after them, several chunks of groups.
  int int8_cases = 0;
  if (kInt8) {
    for (int bits : {4, 5, 8}) {
      if (bits == 5 && !kInt8Five) {
        continue;
      }
      for (int group_size : {32, 64, 128}) {
        for (ScaleType type : {ScaleType::f32, ScaleType::f16, ScaleType::bf16}) {
          for (int K : {128, 384, 576, 640, 8192}) {
            for (int M : {1, 3, 4, 7}) {  // tiles of 3 input rows and the 1-2 after them
              for (int N : {1, 7, 21}) {
                if (K % group_size == 0 && check(bits, group_size, type, M, N, K, rng, true)) {
                  return 1;
                }
                int8_cases += K % group_size == 0;
              }
            }
          }
        }
      }
    }
    for (int K : {32, 64, 96, 160, 224}) {  // shorter than a chunk, groups of 32
      for (int bits : {4, 5, 8}) {
        if (bits == 5 && !kInt8Five) {
          continue;
        }
        if (check(bits, 32, ScaleType::f32, 1, 9, K, rng, true)) {
          return 1;
        }
        ++int8_cases;
      }
    }
  }
  std::printf("%s: %d cases ok, %d int8 cases ok\n", kIsa, cases, int8_cases);
  return 0;
}
