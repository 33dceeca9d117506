// The packed affine matmul's kernels: SIMD layers (AVX-512, AVX2, NEON; plain C++ elsewhere),
// the decode tiles, the prefill panels, and the input's preparation. No MLX here: qmm.cpp runs
// them inside MLX's graph, and tests/plugins/kernels/native_kernels_check.cpp runs them alone,
// for this machine and, under an emulator, for arm64 (NEON).
//
// Layout (MLX's affine packing, transpose=True): row n of w holds the K integers of output n as
// a little-endian bit stream (element i at bits bits*i ..), so a group of group_size elements
// starts on a byte; out[m, n] = sum_g scale[n, g] * (x_g . q_g) + bias[n, g] * sum(x_g).

#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__) || defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif
#if defined(__aarch64__) && defined(__ARM_NEON)
#include <arm_neon.h>
#endif
#if defined(__AMX_TILE__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace mlxr::qmm {
#if defined(__AVX512F__)
#define MLXR_SIMD 1
constexpr const char* kIsa = "avx512";
#elif defined(__AVX2__)
#define MLXR_SIMD 1
constexpr const char* kIsa = "avx2";
#elif defined(__aarch64__) && defined(__ARM_NEON)
#define MLXR_SIMD 1
constexpr const char* kIsa = "neon";
#else
#define MLXR_SIMD 0
constexpr const char* kIsa = "scalar";
#endif
// Integer dot products for a decode step's int8 input (tile_q4_int8): AVX-512 VNNI.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define MLXR_INT8 1
#else
#define MLXR_INT8 0
#endif
constexpr bool kInt8 = MLXR_INT8;
// 5-bit weights too where bytes can be picked and bit fields cut from them in a register (VBMI).
#if MLXR_INT8 && defined(__AVX512VBMI__)
#define MLXR_INT8_FIVE 1
#else
#define MLXR_INT8_FIVE 0
#endif
constexpr bool kInt8Five = MLXR_INT8_FIVE;
// Many int8 input rows (a prompt) through AMX's tile products where the CPU has them (and the
// kernel lets the process use them: amx_ready()).
#if MLXR_INT8 && defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__linux__)
#define MLXR_AMX 1
#else
#define MLXR_AMX 0
#endif
constexpr bool kAmx = MLXR_AMX;
// Calls of this many input rows or more take the AMX path (amx_rows) when it is ready.
constexpr int kAmxRows = 16;
// The SIMD paths read a 4-bit block's low nibbles against the input's even elements and its high
// nibbles against the odd ones, so the input is stored evens first (prepare_input).
constexpr bool kNibbleOrder = MLXR_SIMD;

// The dtype of a model's scales and biases (MLX's float32, float16, bfloat16).
enum class ScaleType { f32, f16, bf16 };

inline size_t scale_bytes(ScaleType type) {
  return type == ScaleType::f32 ? 4 : 2;
}

// IEEE half -> float, without a hardware conversion (subnormals, infinities and NaN included).
inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#elif defined(__aarch64__)
  __fp16 value;
  std::memcpy(&value, &h, sizeof value);
  return float(value);
#else
  const uint32_t sign = uint32_t(h & 0x8000) << 16;
  uint32_t exponent = (h >> 10) & 0x1F;
  uint32_t mantissa = h & 0x3FF;
  uint32_t bits;
  if (exponent == 0x1F) {
    bits = sign | 0x7F800000u | (mantissa << 13);
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;
  } else {  // subnormal: normalize
    exponent = 113;
    while (!(mantissa & 0x400)) {
      mantissa <<= 1;
      --exponent;
    }
    bits = sign | (exponent << 23) | ((mantissa & 0x3FF) << 13);
  }
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
#endif
}

// Group scales or biases, [N, G] row-major, read where they lie in float32, float16 or bfloat16
// (a half-precision model's), not converted whole on every call: SmolLM2's packed layers with
// bfloat16 scales, one token's matmuls on 2 threads, 28.5 -> 15.9 ms (float32 scales: 14.1 ms).
struct Groups {
  const void* data;
  ScaleType dtype;

  float operator[](size_t i) const {
    if (dtype == ScaleType::f32) {
      return static_cast<const float*>(data)[i];
    }
    const uint16_t bits = static_cast<const uint16_t*>(data)[i];
    if (dtype == ScaleType::bf16) {
      const uint32_t widened = uint32_t(bits) << 16;
      float value;
      std::memcpy(&value, &widened, sizeof value);
      return value;
    }
    return half_to_float(bits);
  }

  Groups plus(size_t elements) const {
    return {static_cast<const char*>(data) + elements * scale_bytes(dtype), dtype};
  }

  // Groups g0 .. g0 + count - 1 of row n (of G) as float32: where they lie when float32, else
  // converted into dst, 16 (or 8) at a time where the SIMD layer converts.
  const float* chunk(int n, int G, int g0, int count, float* dst) const {
    const size_t first = size_t(n) * G + g0;
    if (dtype == ScaleType::f32) {
      return static_cast<const float*>(data) + first;
    }
    const uint16_t* src = static_cast<const uint16_t*>(data) + first;
    int g = 0;
    if (dtype == ScaleType::f16) {
#if defined(__AVX512F__)
      for (; g + 16 <= count; g += 16) {
        _mm512_storeu_ps(dst + g, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(src + g))));
      }
#elif defined(__F16C__)
      for (; g + 8 <= count; g += 8) {
        _mm256_storeu_ps(dst + g, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(src + g))));
      }
#elif defined(__aarch64__) && defined(__ARM_NEON)
      for (; g + 4 <= count; g += 4) {
        vst1q_f32(dst + g, vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(src + g))));
      }
#endif
    } else {  // bfloat16: the upper half of a float32
#if defined(__AVX512F__)
      for (; g + 16 <= count; g += 16) {
        const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(src + g)));
        _mm512_storeu_ps(dst + g, _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16)));
      }
#elif defined(__AVX2__)
      for (; g + 8 <= count; g += 8) {
        const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(src + g)));
        _mm256_storeu_ps(dst + g, _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16)));
      }
#elif defined(__aarch64__) && defined(__ARM_NEON)
      for (; g + 4 <= count; g += 4) {
        vst1q_f32(dst + g, vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(src + g), 16)));
      }
#endif
    }
    for (; g < count; ++g) {
      dst[g] = (*this)[first + g];
    }
    return dst;
  }
};

// One call's operands, the input already float32 and reordered.
struct Problem {
  const float* x;      // [M, K] (null where xq is set)
  const float* xsum;   // [M, G]
  // The input as int8 (see prepare_row_int8), or null: each 32-element block's integers [M, K]
  // and scale [M, K / 32], and per block the sum of its group's inputs where it starts the group,
  // else 0 [M, K / 32] (the bias term, added at the group's first block).
  const int8_t* xq;
  const float* xd;
  const float* xb;
  const uint8_t* w;    // [N, K * bits / 8]
  Groups scales;       // [N, G]
  Groups biases;       // [N, G]
  float* out;          // [M, N]
  int M, N, K, G, bits, group_size;
  size_t row_bytes;
  // The int8 input in AMX's order (prepare_amx_input), or null: per 16 input rows and block, the
  // block's integers as 8 rows of 16 x 4 bytes [ceil(M / 16), K / 32, 512], its scales and bias
  // terms [ceil(M / 16), K / 32, 16] (rows past M zero).
  const int8_t* xt = nullptr;
  const float* xdt = nullptr;
  const float* xbt = nullptr;
};

// The scales and biases of output rows n0 .. n0 + NB - 1 as float32, kChunk groups at a time
// (see Groups::chunk): a tile calls load(g) when g reaches the next chunk. Half-precision scales
// are converted into this stack buffer; a per-thread buffer of whole rows cost a TLS lookup and
// scalar bfloat16 conversions per tile (a 4-bit 32768 x 2048 matmul at one row: 2.8 ms with
// bfloat16 or float16 scales against 2.2 ms with float32, for 10% fewer bytes).
template <int NB>
struct RowGroups {
  static constexpr int kChunk = 64;
  const Problem& p;
  const int n0;
  int base = 0;  // the first group of the loaded chunk
  const float* s[NB];
  const float* b[NB];
  alignas(64) float buf[2 * NB][kChunk];

  RowGroups(const Problem& problem, int first_row) : p(problem), n0(first_row) {
    load(0);
  }

  void load(int g0) {
    base = g0;
    const int count = std::min(kChunk, p.G - g0);
    for (int i = 0; i < NB; ++i) {
      s[i] = p.scales.chunk(n0 + i, p.G, g0, count, buf[2 * i]);
      b[i] = p.biases.chunk(n0 + i, p.G, g0, count, buf[2 * i + 1]);
    }
  }

  // Group g's values (g in the loaded chunk, or the first of the next one, which loads it).
  void reach(int g) {
    if (g - base == kChunk) {
      load(g);
    }
  }
  float scale(int i, int g) const { return s[i][g - base]; }
  float bias(int i, int g) const { return b[i][g - base]; }
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
inline void vstore(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec vmul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline float vsum(Vec a) { return _mm512_reduce_add_ps(a); }
// 16 bytes -> 16 floats.
inline Vec bytes_to_floats(const uint8_t* q) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)q)));
}
// A 32-element 4-bit block (16 bytes) as floats: low nibbles, then high ones.
constexpr int kQ4Vecs = 2;
inline void q4_floats(const uint8_t* q, Vec out[kQ4Vecs]) {
  const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)q));
  out[0] = _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(0xF)));
  out[1] = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
}
#elif defined(__AVX2__)
using Vec = __m256;
constexpr int kLanes = 8;
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vset(float v) { return _mm256_set1_ps(v); }
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, Vec v) { _mm256_storeu_ps(p, v); }
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
constexpr int kQ4Vecs = 4;
inline void q4_floats(const uint8_t* q, Vec out[kQ4Vecs]) {
  const __m256i low = _mm256_set1_epi32(0xF);
  const __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)q));
  const __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(q + 8)));
  out[0] = _mm256_cvtepi32_ps(_mm256_and_si256(a, low));
  out[1] = _mm256_cvtepi32_ps(_mm256_and_si256(c, low));
  out[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(a, 4));
  out[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(c, 4));
}
#elif defined(__aarch64__) && defined(__ARM_NEON)
using Vec = float32x4_t;
constexpr int kLanes = 4;
inline Vec vzero() { return vdupq_n_f32(0.0f); }
inline Vec vset(float v) { return vdupq_n_f32(v); }
inline Vec vload(const float* p) { return vld1q_f32(p); }
inline void vstore(float* p, Vec v) { vst1q_f32(p, v); }
inline Vec vfma(Vec a, Vec b, Vec c) { return vfmaq_f32(c, a, b); }
inline Vec vmul(Vec a, Vec b) { return vmulq_f32(a, b); }
inline float vsum(Vec a) { return vaddvq_f32(a); }
// 4 bytes -> 4 floats.
inline Vec bytes_to_floats(const uint8_t* q) {
  uint32_t word;
  std::memcpy(&word, q, sizeof word);
  const uint16x8_t wide = vmovl_u8(vcreate_u8(word));
  return vcvtq_f32_u32(vmovl_u16(vget_low_u16(wide)));
}
// 16 bytes of nibbles -> 8 vectors: the low nibbles of bytes 0-3, 4-7, 8-11, 12-15, then the
// high nibbles of the same bytes.
constexpr int kQ4Vecs = 8;
inline void q4_floats(const uint8_t* q, Vec out[kQ4Vecs]) {
  const uint8x16_t v = vld1q_u8(q);
  const uint8x16_t halves[2] = {vandq_u8(v, vdupq_n_u8(0xF)), vshrq_n_u8(v, 4)};
  for (int h = 0; h < 2; ++h) {
    const uint16x8_t first = vmovl_u8(vget_low_u8(halves[h]));
    const uint16x8_t second = vmovl_u8(vget_high_u8(halves[h]));
    out[4 * h + 0] = vcvtq_f32_u32(vmovl_u16(vget_low_u16(first)));
    out[4 * h + 1] = vcvtq_f32_u32(vmovl_u16(vget_high_u16(first)));
    out[4 * h + 2] = vcvtq_f32_u32(vmovl_u16(vget_low_u16(second)));
    out[4 * h + 3] = vcvtq_f32_u32(vmovl_u16(vget_high_u16(second)));
  }
}
#endif

#if MLXR_SIMD

// A tile's running sums: NB output rows x MB input rows of scaled dot products (SIMD) and of the
// bias term (each group's bias times the input group's sum).
template <int NB, int MB>
struct Sums {
  Vec acc[NB][MB];
  float bias[NB][MB];

  Sums() {
    #pragma GCC unroll 8
    for (int i = 0; i < NB; ++i) {
      #pragma GCC unroll 8
      for (int j = 0; j < MB; ++j) {
        acc[i][j] = vzero();
        bias[i][j] = 0.0f;
      }
    }
  }

  void add_biases(const Problem& p, const RowGroups<NB>& groups, int m0, int g) {
    #pragma GCC unroll 8
    for (int i = 0; i < NB; ++i) {
      const float b = groups.bias(i, g);
      #pragma GCC unroll 8
      for (int j = 0; j < MB; ++j) {
        bias[i][j] += b * p.xsum[size_t(m0 + j) * p.G + g];
      }
    }
  }

  void store(const Problem& p, int n0, int m0) const {
    #pragma GCC unroll 8
    for (int i = 0; i < NB; ++i) {
      #pragma GCC unroll 8
      for (int j = 0; j < MB; ++j) {
        p.out[size_t(m0 + j) * p.N + n0 + i] = vsum(acc[i][j]) + bias[i][j];
      }
    }
  }
};

// 4-bit: a 32-element block is 16 bytes, element 2j in the low nibble of byte j and 2j+1 in the
// high one. The input block is stored evens first, then odds, so the low nibbles of the bytes
// multiply x[0..16) and the high nibbles x[16..32) with no shuffle of the weight.
template <int NB, int MB>
inline void tile_q4(const Problem& p, int n0, int m0) {
  RowGroups<NB> groups(p, n0);
  Sums<NB, MB> sums;
  auto& acc = sums.acc;
  const uint8_t* rows[NB];
  #pragma GCC unroll 8
  for (int i = 0; i < NB; ++i) {
    rows[i] = p.w + size_t(n0 + i) * p.row_bytes;
  }
  const int blocks = p.group_size / 32;
  for (int g = 0; g < p.G; ++g) {
    groups.reach(g);
    Vec s[NB];
    #pragma GCC unroll 8
    for (int i = 0; i < NB; ++i) {
      s[i] = vset(groups.scale(i, g));
    }
    for (int b = 0; b < blocks; ++b) {
      const int k = g * p.group_size + b * 32;
      Vec w[NB][kQ4Vecs];
      #pragma GCC unroll 8
      for (int i = 0; i < NB; ++i) {
        prefetch_ahead(rows[i] + k / 2);
        q4_floats(rows[i] + k / 2, w[i]);
        #pragma GCC unroll 8
        for (int v = 0; v < kQ4Vecs; ++v) {
          w[i][v] = vmul(w[i][v], s[i]);
        }
      }
      #pragma GCC unroll 8
      for (int j = 0; j < MB; ++j) {
        const float* xk = p.x + size_t(m0 + j) * p.K + k;
        Vec x[kQ4Vecs];
        #pragma GCC unroll 8
        for (int v = 0; v < kQ4Vecs; ++v) {
          x[v] = vload(xk + v * kLanes);
        }
        #pragma GCC unroll 8
        for (int i = 0; i < NB; ++i) {
          #pragma GCC unroll 8
          for (int v = 0; v < kQ4Vecs; ++v) {
            acc[i][j] = vfma(w[i][v], x[v], acc[i][j]);
          }
        }
      }
    }
    sums.add_biases(p, groups, m0, g);
  }
  sums.store(p, n0, m0);
}

#if defined(__AVX2__)
// x86's 5-bit path reads the bit stream in place; elsewhere 5 bits go through bytes (group_bytes).
constexpr bool kFiveBitsInPlace = true;


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
#else
constexpr bool kFiveBitsInPlace = false;
Vec five_bits_to_floats(const uint8_t* q);  // named by tile_bytes<..., 5>, which is never made
#endif

// Any other width, natural order: BITS 8 read in place, 5 by five_bits_to_floats, 0 (2/3/6
// bits) read into bytes first.
template <int NB, int MB, int BITS>
inline void tile_bytes(const Problem& p, int n0, int m0) {
  RowGroups<NB> groups(p, n0);
  Sums<NB, MB> sums;
  auto& acc = sums.acc;
  alignas(64) uint8_t buf[NB][128];
  for (int g = 0; g < p.G; ++g) {
    groups.reach(g);
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
      s[i] = vset(groups.scale(i, g));
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
    sums.add_biases(p, groups, m0, g);
  }
  sums.store(p, n0, m0);
}

#if MLXR_INT8
// Decode with an int8 input (llama.cpp's way on CPUs with integer dot products): each 32-element
// block of the input row is rounded to int8 with its own scale (max |x| / 127), and a block's dot
// product with the weight's integers is one instruction per 64 byte pairs (vpdpbusd: unsigned
// weight bytes times signed input bytes, summed in fours into 32-bit lanes) instead of converting
// the weight to floats. Each block's sum is then scaled by the weight's group scale times the
// input block's scale; the bias term stays exact (the float input's group sums).

// An int8 tile's operands and running sums: MB input rows' integers and block scales, NB weight
// rows, per (weight row, input row) a vector of scaled block sums and a float for the blocks after
// the last whole chunk. Every output is summed in the same order whatever MB is (a row's result
// does not depend on the rows beside it in the call).
template <int NB, int MB>
struct Int8Sums {
  const int8_t* xq[MB];
  const float* xd[MB];
  const float* xb[MB];
  const uint8_t* rows[NB];
  __m512 acc[NB][MB];
  float tail[NB][MB];

  Int8Sums(const Problem& p, int n0, int m0) {
    #pragma GCC unroll 8
    for (int j = 0; j < MB; ++j) {
      xq[j] = p.xq + size_t(m0 + j) * p.K;
      xd[j] = p.xd + size_t(m0 + j) * (p.K / 32);
      xb[j] = p.xb + size_t(m0 + j) * (p.K / 32);
    }
    #pragma GCC unroll 8
    for (int i = 0; i < NB; ++i) {
      rows[i] = p.w + size_t(n0 + i) * p.row_bytes;
      #pragma GCC unroll 8
      for (int j = 0; j < MB; ++j) {
        acc[i][j] = _mm512_setzero_ps();
        tail[i][j] = 0.0f;
      }
    }
  }

  // A block after the last whole chunk: its integer dot product times its combined scale, and its
  // bias term, each one rounding (explicit fused multiply-adds: the compiler may not contract
  // these differently for different MB).
  void add_tail(int i, int j, int dot, float scale, float bias, float xb) {
    tail[i][j] = std::fma(float(dot), scale, tail[i][j]);
    tail[i][j] = std::fma(bias, xb, tail[i][j]);
  }

  void store(const Problem& p, int n0, int m0) const {
    #pragma GCC unroll 8
    for (int j = 0; j < MB; ++j) {
      #pragma GCC unroll 8
      for (int i = 0; i < NB; ++i) {
        p.out[size_t(m0 + j) * p.N + n0 + i] = _mm512_reduce_add_ps(acc[i][j]) + tail[i][j];
      }
    }
  }
};

// The weight's scales of blocks blk .. blk + 3 of row i (one per block: a group's repeated).
template <int NB>
inline __m128 weight_scales4(const Problem& p, const RowGroups<NB>& groups, int i, int blk) {
  const int g = blk * 32 / p.group_size;
  if (p.group_size == 32) {
    return _mm_loadu_ps(groups.s[i] + (g - groups.base));
  }
  if (p.group_size == 64) {
    const float s0 = groups.scale(i, g), s1 = groups.scale(i, g + 1);
    return _mm_setr_ps(s0, s0, s1, s1);
  }
  return _mm_set1_ps(groups.scale(i, g));
}

// The weight's bias of each of blocks blk .. blk + 3 of row i that starts a group, else 0.
template <int NB>
inline __m128 weight_biases4(const Problem& p, const RowGroups<NB>& groups, int i, int blk) {
  const int g = blk * 32 / p.group_size;
  if (p.group_size == 32) {
    return _mm_loadu_ps(groups.b[i] + (g - groups.base));
  }
  if (p.group_size == 64) {
    return _mm_setr_ps(groups.bias(i, g), 0.0f, groups.bias(i, g + 1), 0.0f);
  }
  return _mm_setr_ps(blk * 32 % p.group_size == 0 ? groups.bias(i, g) : 0.0f, 0.0f, 0.0f, 0.0f);
}

// The weight's bias for a block after the last whole chunk (0 unless the block starts a group).
template <int NB>
inline float block_bias(const Problem& p, const RowGroups<NB>& groups, int i, int blk) {
  return blk * 32 % p.group_size == 0 ? groups.bias(i, blk * 32 / p.group_size) : 0.0f;
}

// A 16-byte block pair's dot product (4 lanes) summed to one integer.
inline int sum4(__m128i dot) {
  dot = _mm_add_epi32(dot, _mm_shuffle_epi32(dot, 0x4E));
  dot = _mm_add_epi32(dot, _mm_shuffle_epi32(dot, 0xB1));
  return _mm_cvtsi128_si32(dot);
}

// Lanes 0, 4, 8, 12: one per block of a 4-block chunk (a block's bias term is added once).
constexpr __mmask16 kFirstLanes = 0x1111;

// 4-bit, NB output rows x MB input rows from m0. A 128-element chunk of the input is stored as its
// 64 even elements, then its 64 odd ones (prepare_row_int8), so the low nibbles of 64 weight
// bytes (4 blocks) multiply the first half and the high nibbles the second; a last 1-3 blocks are
// stored as 16 evens and 16 odds each and done 16 bytes at a time. The weight's nibbles are
// unpacked once for the MB input rows.
template <int NB, int MB>
inline void tile_q4_int8(const Problem& p, int n0, int m0) {
  RowGroups<NB> groups(p, n0);
  Int8Sums<NB, MB> sums(p, n0, m0);
  const __m512i spread = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  const int blocks = p.K / 32;
  int blk = 0;
  for (; blk + 4 <= blocks; blk += 4) {
    groups.reach(blk * 32 / p.group_size);
    __m512i low[NB], high[NB];
    __m512 ws[NB], wb[NB];
    #pragma GCC unroll 8
    for (int i = 0; i < NB; ++i) {
      prefetch_ahead(sums.rows[i] + blk * 16);
      const __m512i w = _mm512_loadu_si512(sums.rows[i] + blk * 16);
      low[i] = _mm512_and_si512(w, nibble);
      high[i] = _mm512_and_si512(_mm512_srli_epi16(w, 4), nibble);
      ws[i] = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(weight_scales4(p, groups, i, blk)));
      wb[i] = _mm512_maskz_permutexvar_ps(kFirstLanes, spread, _mm512_castps128_ps512(weight_biases4(p, groups, i, blk)));
    }
    #pragma GCC unroll 8
    for (int j = 0; j < MB; ++j) {
      const __m512i evens = _mm512_loadu_si512(sums.xq[j] + blk * 32);
      const __m512i odds = _mm512_loadu_si512(sums.xq[j] + blk * 32 + 64);
      const __m512 xs = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_loadu_ps(sums.xd[j] + blk)));
      const __m512 xb = _mm512_maskz_permutexvar_ps(kFirstLanes, spread, _mm512_castps128_ps512(_mm_loadu_ps(sums.xb[j] + blk)));
      #pragma GCC unroll 8
      for (int i = 0; i < NB; ++i) {
        __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), low[i], evens);
        dot = _mm512_dpbusd_epi32(dot, high[i], odds);
        sums.acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(ws[i], xs), sums.acc[i][j]);
        sums.acc[i][j] = _mm512_fmadd_ps(wb[i], xb, sums.acc[i][j]);
      }
    }
  }
  const __m128i nibble16 = _mm_set1_epi8(0x0F);
  for (; blk < blocks; ++blk) {
    const int g = blk * 32 / p.group_size;
    groups.reach(g);
    #pragma GCC unroll 8
    for (int i = 0; i < NB; ++i) {
      const __m128i w = _mm_loadu_si128((const __m128i*)(sums.rows[i] + blk * 16));
      const __m128i low = _mm_and_si128(w, nibble16), high = _mm_and_si128(_mm_srli_epi16(w, 4), nibble16);
      #pragma GCC unroll 8
      for (int j = 0; j < MB; ++j) {
        const __m128i evens = _mm_loadu_si128((const __m128i*)(sums.xq[j] + blk * 32));
        const __m128i odds = _mm_loadu_si128((const __m128i*)(sums.xq[j] + blk * 32 + 16));
        const __m128i dot = _mm_dpbusd_epi32(_mm_dpbusd_epi32(_mm_setzero_si128(), low, evens), high, odds);
        sums.add_tail(i, j, sum4(dot), groups.scale(i, g) * sums.xd[j][blk], block_bias(p, groups, i, blk), sums.xb[j][blk]);
      }
    }
  }
  sums.store(p, n0, m0);
}

#if MLXR_INT8_FIVE
// 5-bit weights through the int8 tiles: 64 elements (40 bytes) to bytes in three instructions.

// 64 5-bit elements from q (element i at bits 5i..5i+4; `bytes` of the 40 read, the rest 0) as 64
// bytes: each 8-byte lane gets the 5 bytes of its 8 elements, then each of its bytes the 8 bits
// from its element's offset (vpmultishiftqb), masked to 5.
inline __m512i five_bits_to_bytes(const uint8_t* q, __mmask64 bytes) {
  alignas(64) static const uint8_t pick[64] = {
      0,  1,  2,  3,  4,  4,  4,  4,  5,  6,  7,  8,  9,  9,  9,  9,  10, 11, 12, 13, 14, 14,
      14, 14, 15, 16, 17, 18, 19, 19, 19, 19, 20, 21, 22, 23, 24, 24, 24, 24, 25, 26, 27, 28,
      29, 29, 29, 29, 30, 31, 32, 33, 34, 34, 34, 34, 35, 36, 37, 38, 39, 39, 39, 39};
  const __m512i spread = _mm512_permutexvar_epi8(_mm512_load_si512(pick), _mm512_maskz_loadu_epi8(bytes, q));
  const __m512i offsets = _mm512_set1_epi64(int64_t(0x231E19140F0A0500));  // 0, 5, .. 35 per byte
  return _mm512_and_si512(_mm512_multishift_epi64_epi8(offsets, spread), _mm512_set1_epi8(0x1F));
}
#endif

// 64 weight elements of a row (BITS 8: 64 bytes; 5: 40 bytes) as bytes.
template <int BITS>
inline __m512i weight_bytes(const uint8_t* row, int element) {
#if MLXR_INT8_FIVE
  if constexpr (BITS == 5) {
    return five_bits_to_bytes(row + element * 5 / 8, (__mmask64(1) << 40) - 1);
  }
#endif
  return _mm512_loadu_si512(row + element);
}

// 8- or 5-bit, NB output rows x MB input rows from m0: the input in its own order, 64 elements (2
// blocks) a step.
template <int NB, int MB, int BITS>
inline void tile_bytes_int8(const Problem& p, int n0, int m0) {
  RowGroups<NB> groups(p, n0);
  Int8Sums<NB, MB> sums(p, n0, m0);
  const __m512i first = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  const __m512i second = _mm512_setr_epi32(2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
  const int blocks = p.K / 32;
  int blk = 0;
  for (; blk + 4 <= blocks; blk += 4) {
    groups.reach(blk * 32 / p.group_size);
    __m512i w0[NB], w1[NB];
    __m512 ws0[NB], ws1[NB], wb[NB];
    #pragma GCC unroll 8
    for (int i = 0; i < NB; ++i) {
      prefetch_ahead(sums.rows[i] + blk * 32 * BITS / 8);
      w0[i] = weight_bytes<BITS>(sums.rows[i], blk * 32);
      w1[i] = weight_bytes<BITS>(sums.rows[i], blk * 32 + 64);
      const __m512 scales = _mm512_castps128_ps512(weight_scales4(p, groups, i, blk));
      ws0[i] = _mm512_permutexvar_ps(first, scales);
      ws1[i] = _mm512_permutexvar_ps(second, scales);
      wb[i] = _mm512_zextps128_ps512(weight_biases4(p, groups, i, blk));
    }
    #pragma GCC unroll 8
    for (int j = 0; j < MB; ++j) {
      const __m512i x0 = _mm512_loadu_si512(sums.xq[j] + blk * 32);
      const __m512i x1 = _mm512_loadu_si512(sums.xq[j] + blk * 32 + 64);
      const __m512 d = _mm512_castps128_ps512(_mm_loadu_ps(sums.xd[j] + blk));
      const __m512 xs0 = _mm512_permutexvar_ps(first, d), xs1 = _mm512_permutexvar_ps(second, d);
      const __m512 xb = _mm512_maskz_loadu_ps(0x000F, sums.xb[j] + blk);
      #pragma GCC unroll 8
      for (int i = 0; i < NB; ++i) {
        const __m512i d0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w0[i], x0);
        const __m512i d1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w1[i], x1);
        sums.acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d0), _mm512_mul_ps(ws0[i], xs0), sums.acc[i][j]);
        sums.acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d1), _mm512_mul_ps(ws1[i], xs1), sums.acc[i][j]);
        sums.acc[i][j] = _mm512_fmadd_ps(wb[i], xb, sums.acc[i][j]);
      }
    }
  }
  for (; blk < blocks; ++blk) {
    const int g = blk * 32 / p.group_size;
    groups.reach(g);
    #pragma GCC unroll 8
    for (int i = 0; i < NB; ++i) {
      __m256i w;
#if MLXR_INT8_FIVE
      if constexpr (BITS == 5) {  // one block: 20 bytes, 32 elements
        w = _mm512_castsi512_si256(five_bits_to_bytes(sums.rows[i] + blk * 20, (__mmask64(1) << 20) - 1));
      } else {
        w = _mm256_loadu_si256((const __m256i*)(sums.rows[i] + blk * 32));
      }
#else
      w = _mm256_loadu_si256((const __m256i*)(sums.rows[i] + blk * 32));
#endif
      #pragma GCC unroll 8
      for (int j = 0; j < MB; ++j) {
        const __m256i x = _mm256_loadu_si256((const __m256i*)(sums.xq[j] + blk * 32));
        const __m256i dot = _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x);
        const int total = sum4(_mm_add_epi32(_mm256_castsi256_si128(dot), _mm256_extracti128_si256(dot, 1)));
        sums.add_tail(i, j, total, groups.scale(i, g) * sums.xd[j][blk], block_bias(p, groups, i, blk), sums.xb[j][blk]);
      }
    }
  }
  sums.store(p, n0, m0);
}
#endif

#if MLXR_AMX
// A prompt's int8 rows through AMX (Sapphire Rapids and later), whose tile product multiplies 16
// rows of bytes by 16 columns of bytes, 16 x 16 x 32 multiply-adds an instruction here. Each
// product is one 32-element block: 16 weight rows (unsigned bytes, tile A) times the block of 16
// input rows (tile B: their bytes in groups of 4, the 16 rows side by side), giving the exact
// 32-bit block sum of every (weight row, input row). AVX-512 then scales each block's sums by the
// weight's group scale times the input block's scale and adds the bias term at a group's first
// block, in block order: every output is summed the same way whatever the call's other rows (the
// decode tiles above sum each block's lanes apart: their results differ from these by float
// rounding, not by the rounded inputs or the integer sums).

// Whether this process may use the tile registers (Linux gives them to a process that asks).
inline bool amx_ready() {
  static const bool ready = [] {
    constexpr long kRequestPermission = 0x1023;  // ARCH_REQ_XCOMP_PERM
    constexpr long kTileData = 18;               // XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
  return ready;
}

// Tiles 0-1: block sums (16 x 16 int32); 2-3: weight bytes (16 rows x 32); 4-5: an input block (8
// rows of 16 x 4 bytes).
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {64, 64, 32, 32, 64, 64};
  uint8_t rows[16] = {16, 16, 16, 16, 8, 8};
};

// Where bytes 4r .. 4r + 3 of block blk lie in an int8 row (prepare_row_int8's order), taking a
// 4-bit block's bytes as its 16 even elements, then its 16 odd ones (amx_weight_bytes's order).
inline int amx_offset(int bits, int K, int blk, int r) {
  if (bits != 4 || blk >= K / 128 * 4) {  // natural order, or a 4-bit block stored evens, odds
    return blk * 32 + 4 * r;
  }
  const int chunk = blk / 4 * 128, i = blk % 4;
  return r < 4 ? chunk + 16 * i + 4 * r : chunk + 64 + 16 * i + 4 * (r - 4);
}

// Rows 16t .. 16t + 15 of M int8 rows (xq, xd, xb as prepare_row_int8 left them) in AMX's order
// (Problem::xt, xdt, xbt).
inline void prepare_amx_input(const int8_t* xq, const float* xd, const float* xb, int M, int K, int bits, int8_t* xt,
                              float* xdt, float* xbt, int t) {
  const int blocks = K / 32;
  const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i row_starts = _mm512_mullo_epi32(lanes, _mm512_set1_epi32(K));
  const __m512i block_rows = _mm512_mullo_epi32(lanes, _mm512_set1_epi32(blocks));
  {
    const __mmask16 valid = __mmask16((1u << std::min(16, M - t * 16)) - 1);
    const int8_t* rows = xq + size_t(t) * 16 * K;
    for (int blk = 0; blk < blocks; ++blk) {
      const size_t at = size_t(t) * blocks + blk;
      for (int r = 0; r < 8; ++r) {
        const __m512i bytes = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), valid, row_starts,
                                                          rows + amx_offset(bits, K, blk, r), 1);
        _mm512_storeu_si512(xt + at * 512 + 64 * r, bytes);
      }
      const size_t first = size_t(t) * 16 * blocks + blk;
      _mm512_storeu_ps(xdt + at * 16, _mm512_mask_i32gather_ps(_mm512_setzero_ps(), valid, block_rows, xd + first, 4));
      _mm512_storeu_ps(xbt + at * 16, _mm512_mask_i32gather_ps(_mm512_setzero_ps(), valid, block_rows, xb + first, 4));
    }
  }
}

// 16 weight rows from n0 as bytes, K a row (rows past N zero), each 4-bit block as its 16 low
// nibbles (the even elements), then its 16 high ones.
inline void amx_weight_bytes(const Problem& p, int n0, uint8_t* dst) {
  const int blocks = p.K / 32;
  for (int i = 0; i < 16; ++i) {
    uint8_t* out = dst + size_t(i) * p.K;
    if (n0 + i >= p.N) {
      std::memset(out, 0, size_t(p.K));
      continue;
    }
    const uint8_t* row = p.w + size_t(n0 + i) * p.row_bytes;
    int blk = 0;
    if (p.bits == 8) {
      std::memcpy(out, row, size_t(p.K));
    } else if (p.bits == 4) {
      const __m512i nibble = _mm512_set1_epi8(0x0F);
      const __m512i first = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11);
      const __m512i second = _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15);
      for (; blk + 4 <= blocks; blk += 4) {
        const __m512i w = _mm512_loadu_si512(row + blk * 16);
        const __m512i low = _mm512_and_si512(w, nibble), high = _mm512_and_si512(_mm512_srli_epi16(w, 4), nibble);
        _mm512_storeu_si512(out + blk * 32, _mm512_permutex2var_epi64(low, first, high));
        _mm512_storeu_si512(out + blk * 32 + 64, _mm512_permutex2var_epi64(low, second, high));
      }
      const __m128i nibble16 = _mm_set1_epi8(0x0F);
      for (; blk < blocks; ++blk) {
        const __m128i w = _mm_loadu_si128((const __m128i*)(row + blk * 16));
        _mm_storeu_si128((__m128i*)(out + blk * 32), _mm_and_si128(w, nibble16));
        _mm_storeu_si128((__m128i*)(out + blk * 32 + 16), _mm_and_si128(_mm_srli_epi16(w, 4), nibble16));
      }
    } else {
#if MLXR_INT8_FIVE  // 5 bits: 2 blocks (40 bytes) at a time
      for (; blk + 2 <= blocks; blk += 2) {
        _mm512_storeu_si512(out + blk * 32, five_bits_to_bytes(row + blk * 20, (__mmask64(1) << 40) - 1));
      }
      if (blk < blocks) {
        _mm256_storeu_si256((__m256i*)(out + blk * 32),
                            _mm512_castsi512_si256(five_bits_to_bytes(row + blk * 20, (__mmask64(1) << 20) - 1)));
      }
#endif
    }
  }
}

// Block blk's product (weight bytes through tile A, the input through tile B) into tile SUMS, then
// out to sums: amx_product_even with tiles 2, 4 and 0; amx_product_odd with 3, 5 and 1, for the
// next block while one is scaled. (A macro: GCC's tile intrinsics paste literal tile numbers into
// the instruction's text.)
#define MLXR_AMX_PRODUCT(NAME, SUMS, A, B)                                                                \
  inline void NAME(const uint8_t* weights, int K, const int8_t* xt, int blk, int32_t (&sums)[16][16]) { \
    _tile_loadd(A, weights + blk * 32, K);                                                                \
    _tile_loadd(B, xt + size_t(blk) * 512, 64);                                                           \
    _tile_zero(SUMS);                                                                                     \
    _tile_dpbusd(SUMS, A, B);                                                                             \
    _tile_stored(SUMS, sums, 64);                                                                         \
  }
MLXR_AMX_PRODUCT(amx_product_even, 0, 2, 4)
MLXR_AMX_PRODUCT(amx_product_odd, 1, 3, 5)
#undef MLXR_AMX_PRODUCT

// One block's sums [16 weight rows][16 input rows] into the running outputs (acc[i]: weight row
// i's outputs for the 16 input rows); ws, wb: the block's group's scale and bias of the first
// weight row, the next row's `stride` further.
inline __attribute__((always_inline)) void amx_scale(__m512 (&acc)[16], const int32_t (&sums)[16][16], const float* xd,
                                                     const float* xb, const float* ws, const float* wb, int stride,
                                                     bool starts_group) {
  const __m512 d = _mm512_loadu_ps(xd);
  #pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) {
    const __m512 total = _mm512_cvtepi32_ps(_mm512_load_si512(sums[i]));
    acc[i] = _mm512_fmadd_ps(total, _mm512_mul_ps(d, _mm512_set1_ps(ws[i * stride])), acc[i]);
  }
  if (starts_group) {
    const __m512 b = _mm512_loadu_ps(xb);
    #pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) {
      acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(wb[i * stride]), b, acc[i]);
    }
  }
}

// c[j] = lane j of every r[i] (a 16 x 16 transpose in registers: 64 shuffles).
inline __attribute__((always_inline)) void transpose16(const __m512 (&r)[16], __m512 (&c)[16]) {
  __m512 t[16], u[16];
  #pragma GCC unroll 8
  for (int k = 0; k < 8; ++k) {  // per 128-bit lane: rows 2k, 2k + 1 interleaved
    t[2 * k] = _mm512_unpacklo_ps(r[2 * k], r[2 * k + 1]);
    t[2 * k + 1] = _mm512_unpackhi_ps(r[2 * k], r[2 * k + 1]);
  }
  #pragma GCC unroll 4
  for (int q = 0; q < 4; ++q) {  // u[4q + j], lane L: rows 4q .. 4q + 3 of column 4L + j
    const __m512d a = _mm512_castps_pd(t[4 * q]), b = _mm512_castps_pd(t[4 * q + 1]);
    const __m512d c2 = _mm512_castps_pd(t[4 * q + 2]), d = _mm512_castps_pd(t[4 * q + 3]);
    u[4 * q] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c2));
    u[4 * q + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c2));
    u[4 * q + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
    u[4 * q + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
  }
  #pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) {  // the 128-bit lanes gathered by column
    const __m512 v0 = _mm512_shuffle_f32x4(u[j], u[4 + j], 0x88), v1 = _mm512_shuffle_f32x4(u[j], u[4 + j], 0xDD);
    const __m512 v2 = _mm512_shuffle_f32x4(u[8 + j], u[12 + j], 0x88);
    const __m512 v3 = _mm512_shuffle_f32x4(u[8 + j], u[12 + j], 0xDD);
    c[j] = _mm512_shuffle_f32x4(v0, v2, 0x88);
    c[8 + j] = _mm512_shuffle_f32x4(v0, v2, 0xDD);
    c[4 + j] = _mm512_shuffle_f32x4(v1, v3, 0x88);
    c[12 + j] = _mm512_shuffle_f32x4(v1, v3, 0xDD);
  }
}

// Output rows [n_begin, n_end) (n_begin a multiple of 16) for every input row, through the tiles.
inline void amx_rows(const Problem& p, int n_begin, int n_end) {
  static const TileConfig config;
  _tile_loadconfig(&config);
  const int blocks = p.K / 32;
  const int group_shift = p.group_size == 32 ? 0 : p.group_size == 64 ? 1 : 2;  // blocks a group: 1 << shift
  thread_local std::vector<uint8_t> weight_buffer;
  thread_local std::vector<float> scale_buffer;  // [16][G] scales, then [16][G] biases of the 16 rows
  weight_buffer.resize(size_t(16) * p.K);
  scale_buffer.resize(size_t(32) * p.G);
  uint8_t* const weights = weight_buffer.data();
  float* const ws = scale_buffer.data();
  float* const wb = ws + size_t(16) * p.G;
  alignas(64) int32_t sums[2][16][16];
  for (int n0 = n_begin; n0 < n_end; n0 += 16) {
    amx_weight_bytes(p, n0, weights);
    for (int i = 0; i < 16; ++i) {
      float* s = ws + size_t(i) * p.G;
      float* b = wb + size_t(i) * p.G;
      if (n0 + i >= p.N) {
        std::fill(s, s + p.G, 0.0f);
        std::fill(b, b + p.G, 0.0f);
        continue;
      }
      const float* from = p.scales.chunk(n0 + i, p.G, 0, p.G, s);
      if (from != s) {
        std::memcpy(s, from, size_t(p.G) * sizeof(float));
      }
      from = p.biases.chunk(n0 + i, p.G, 0, p.G, b);
      if (from != b) {
        std::memcpy(b, from, size_t(p.G) * sizeof(float));
      }
    }
    // GCC's _tile_loadd does not tell the compiler it reads memory: the weight bytes just written
    // must not be reordered past the tile loads below.
    asm volatile("" ::: "memory");
    for (int t = 0; t * 16 < p.M; ++t) {
      __m512 acc[16];
      #pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) {
        acc[i] = _mm512_setzero_ps();
      }
      const int8_t* xt = p.xt + size_t(t) * blocks * 512;
      const float* xd = p.xdt + size_t(t) * blocks * 16;
      const float* xb = p.xbt + size_t(t) * blocks * 16;
      // Each block's product is stored a block before its sums are read (a tile store is not
      // forwarded to vector loads: reading it right away waited for the store).
      amx_product_even(weights, p.K, xt, 0, sums[0]);
      for (int blk = 0; blk < blocks; blk += 2) {
        const bool second = blk + 1 < blocks;
        if (second) {
          amx_product_odd(weights, p.K, xt, blk + 1, sums[1]);
        }
        const int g = blk >> group_shift;
        amx_scale(acc, sums[0], xd + blk * 16, xb + blk * 16, ws + g, wb + g, p.G,
                  (blk & ((1 << group_shift) - 1)) == 0);
        if (second) {
          if (blk + 2 < blocks) {
            amx_product_even(weights, p.K, xt, blk + 2, sums[0]);
          }
          const int g1 = (blk + 1) >> group_shift;
          amx_scale(acc, sums[1], xd + (blk + 1) * 16, xb + (blk + 1) * 16, ws + g1, wb + g1, p.G,
                    ((blk + 1) & ((1 << group_shift) - 1)) == 0);
        }
      }
      // Transposed, so that each input row's 16 outputs are one store (scattering the columns
      // into the output's rows wrote every cache line 16 times: 2.6x slower in all).
      __m512 rows[16];
      transpose16(acc, rows);
      const __mmask16 columns = __mmask16((1u << std::min(16, p.N - n0)) - 1);
      for (int m = 0; m < 16 && t * 16 + m < p.M; ++m) {
        _mm512_mask_storeu_ps(p.out + size_t(t * 16 + m) * p.N + n0, columns, rows[m]);
      }
    }
  }
  _tile_release();
}
#else
inline bool amx_ready() {
  return false;
}
inline void prepare_amx_input(const int8_t*, const float*, const float*, int, int, int, int8_t*, float*, float*, int) {}
#endif

template <int NB, int MB>
inline void tile(const Problem& p, int n0, int m0) {
#if MLXR_INT8
  if (p.xq != nullptr) {
    if (p.bits == 4) {
      tile_q4_int8<NB, MB>(p, n0, m0);
    } else if (p.bits == 5) {
      tile_bytes_int8<NB, MB, 5>(p, n0, m0);
    } else {
      tile_bytes_int8<NB, MB, 8>(p, n0, m0);
    }
    return;
  }
#endif
  if (p.bits == 4) {
    tile_q4<NB, MB>(p, n0, m0);
  } else if (p.bits == 5 && kFiveBitsInPlace) {
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
#if defined(__AVX512F__) || defined(__aarch64__)
constexpr int kMicroN = 4;  // 16 accumulators + 8 operands of 32 registers
#else
constexpr int kMicroN = 2;  // 8 accumulators + 6 operands of 16 registers
#endif

inline void dequantize_row(const Problem& p, int n, float* dst) {
  const uint8_t* row = p.w + size_t(n) * p.row_bytes;
  alignas(64) uint8_t buf[128];
  for (int g = 0; g < p.G; ++g) {
    const Vec s = vset(p.scales[size_t(n) * p.G + g]);
    const Vec b = vset(p.biases[size_t(n) * p.G + g]);
    float* out = dst + size_t(g) * p.group_size;
    if (p.bits == 4) {
      for (int blk = 0; blk < p.group_size; blk += 32) {
        Vec q[kQ4Vecs];
        q4_floats(row + (size_t(g) * p.group_size + blk) / 2, q);
        #pragma GCC unroll 8
        for (int v = 0; v < kQ4Vecs; ++v) {
          vstore(out + blk + v * kLanes, vfma(q[v], s, b));
        }
      }
    } else {
      const bool five = p.bits == 5 && kFiveBitsInPlace;
      const uint8_t* q = five ? row + size_t(g) * p.group_size * 5 / 8 : group_bytes(p, n, g, buf);
      for (int e = 0; e < p.group_size; e += kLanes) {
        const Vec w = five ? five_bits_to_floats(q + e * 5 / 8) : bytes_to_floats(q + e);
        vstore(out + e, vfma(w, s, b));
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
inline void prefill_rows(const Problem& p, int n_begin, int n_end) {
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
  RowGroups<NB> groups(p, n0);
  float acc[NB][MB] = {};
  uint8_t buf[NB][128];
  for (int g = 0; g < p.G; ++g) {
    groups.reach(g);
    #pragma GCC unroll 8
    for (int i = 0; i < NB; ++i) {
      const uint8_t* q = group_bytes(p, n0 + i, g, buf[i]);
      const float s = groups.scale(i, g);
      const float bias = groups.bias(i, g);
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

inline void prefill_rows(const Problem& p, int n_begin, int n_end) {
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
#if MLXR_INT8
// NB output rows from n for every input row, 3 input rows a tile (its registers' worth).
template <int NB>
inline void int8_rows(const Problem& p, int n) {
  int m = 0;
  for (; m + 3 <= p.M; m += 3) {
    tile<NB, 3>(p, n, m);
  }
  if (p.M - m == 2) {
    tile<NB, 2>(p, n, m);
  } else if (p.M - m == 1) {
    tile<NB, 1>(p, n, m);
  }
}
#endif

inline void run_rows(const Problem& p, int n_begin, int n_end) {
#if MLXR_AMX
  if (p.xt != nullptr) {  // a prompt's int8 rows in AMX's order
    amx_rows(p, n_begin, n_end);
    return;
  }
#endif
#if MLXR_INT8
  if (p.xq != nullptr) {  // int8 inputs: the same tiles for any number of rows
    int n = n_begin;
    for (; n + 4 <= n_end; n += 4) {
      int8_rows<4>(p, n);
    }
    for (; n < n_end; ++n) {
      int8_rows<1>(p, n);
    }
    return;
  }
#endif
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

// x [M, K] float32 -> xf (the kernels' input order: each 32-element block of a 4-bit problem
// evens first, then odds, when kNibbleOrder; none when xf is null) and xsum [M, K / group_size] (each group's sum, for
// the bias term).
inline void prepare_input(const float* x, int M, int K, int group_size, int bits, float* xf, float* xsum) {
  const int G = K / group_size;
  for (int m = 0; m < M; ++m) {
    const float* src = x + size_t(m) * K;
    float* dst = xf + size_t(m) * K;
    for (int g = 0; g < G; ++g) {
      float sum = 0.0f;
      for (int e = 0; e < group_size; ++e) {
        sum += src[g * group_size + e];
      }
      xsum[size_t(m) * G + g] = sum;
    }
    if (xf == nullptr) {  // the int8 tiles read their own copy (prepare_row_int8)
      continue;
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
}

// Input row m of x [M, K] float32 (K a multiple of 32) -> its int8 form (Problem::xq, xd, xb):
// each 32-element block rounded to int8 with the scale max |x| / 127 (to nearest, ties to even).
// For 4 bits each whole 128-element chunk is stored as its 64 even elements, then its 64 odd ones,
// and each block after the last whole chunk as 16 evens, then 16 odds (tile_q4_int8's order);
// other widths in their own order. xsum: the row's group sums (prepare_input).
inline void prepare_row_int8(const float* x, int m, int K, int bits, int group_size, const float* xsum, int8_t* xq,
                             float* xd, float* xb) {
  const int blocks = K / 32;
  const float* src = x + size_t(m) * K;
  int8_t* dst = xq + size_t(m) * K;
  alignas(64) int8_t q[128];
  for (int blk = 0; blk < blocks; ++blk) {
    const float* in = src + blk * 32;
    int8_t* out = q + (blk % 4) * 32;
#if MLXR_INT8
    const __m512 a = _mm512_loadu_ps(in), b = _mm512_loadu_ps(in + 16);
    const float top = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
#else
    float top = 0.0f;
    for (int e = 0; e < 32; ++e) {
      top = std::max(top, std::abs(in[e]));
    }
#endif
    const float d = top / 127.0f;
    const float inverse = d > 0.0f ? 1.0f / d : 0.0f;
#if MLXR_INT8
    const __m512 scale = _mm512_set1_ps(inverse);
    _mm_storeu_si128((__m128i*)out, _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(a, scale))));
    _mm_storeu_si128((__m128i*)(out + 16), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(b, scale))));
#else
    for (int e = 0; e < 32; ++e) {
      out[e] = int8_t(std::nearbyint(in[e] * inverse));
    }
#endif
    const size_t at = size_t(m) * blocks + blk;
    xd[at] = d;
    xb[at] = blk * 32 % group_size == 0 ? xsum[size_t(m) * (K / group_size) + blk * 32 / group_size] : 0.0f;
    if (bits != 4) {
      std::memcpy(dst + blk * 32, out, 32);
    } else if (blk % 4 == 3) {  // a whole 128-element chunk: its evens, then its odds
      int8_t* chunk = dst + (blk - 3) * 32;
      for (int j = 0; j < 64; ++j) {
        chunk[j] = q[2 * j];
        chunk[64 + j] = q[2 * j + 1];
      }
    } else if (blk == blocks - 1) {  // the blocks after the last whole chunk, one by one
      for (int c = blk - blk % 4; c <= blk; ++c) {
        const int8_t* block = q + (c % 4) * 32;
        for (int j = 0; j < 16; ++j) {
          dst[c * 32 + j] = block[2 * j];
          dst[c * 32 + 16 + j] = block[2 * j + 1];
        }
      }
    }
  }
}

}  // namespace mlxr::qmm
