// The decode-step matmul of ``quant_linear.cpp`` for bf16 activations on CPUs with
// AVX512_BF16 (Zen 4 and later, Cooper Lake, Sapphire Rapids and later): the codes become
// bf16 values in registers and ``vdpbf16ps`` multiplies 32 of them into 16 float32 lanes
// per instruction, twice the float32 FMA path's elements per instruction, with a fraction
// of its decode work (4-bit codes 128 at a time: the chunk kernel at the end). Only formats
// whose values are exact in bf16 take it: 4-bit codes whose table is (every int4, Q4_0,
// Q4_1 and e2m1 table is), int8 and float8 e4m3 codes. The activations are used as they
// come, never rounded: they are bf16 already. The products are exact in float32; each
// group's sum of products is then scaled once, in float32, as the float path does.
//
// What differs from the float path is only the order of the float32 additions
// (``vdpbf16ps`` adds two products to a lane at once, and flushes subnormal inputs and
// results to zero, as the instruction always does). Rows of x still never mix.
#pragma once

#if defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <vector>

#pragma GCC push_options
#pragma GCC target("avx512bf16")

namespace kervan::quant_bf16 {

inline bool available() {
  static const bool yes = __builtin_cpu_supports("avx512bf16");
  return yes;
}

// The lane sums of N accumulators into result[0..N), four at a time with shared shuffles;
// each sum in the same order whatever its neighbours ((x_i + x_i+8), then pairs, then
// halves), so a row's result does not depend on how many rows or features share the call.
template <int N>
__attribute__((always_inline)) inline void reduce_store(const __m512 (&acc)[N], float* result) {
#pragma GCC unroll 16
  for (int k = 0; k < N; k += 4) {
    __m256 h[4];
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const __m512 a = k + j < N ? acc[k + j] : _mm512_setzero_ps();
      h[j] = _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
    }
    const __m256 all = _mm256_hadd_ps(_mm256_hadd_ps(h[0], h[1]), _mm256_hadd_ps(h[2], h[3]));
    const __m128 sums = _mm_add_ps(_mm256_castps256_ps128(all), _mm256_extractf128_ps(all, 1));
    if (k + 4 <= N) {
      _mm_storeu_ps(result + k, sums);
    } else {
      alignas(16) float out[4];
      _mm_store_ps(out, sums);
      for (int j = 0; j < 4 && k + j < N; ++j) result[k + j] = out[j];
    }
  }
}

// Codes -> 32 bf16 values at a time. ``table``: the 16 values of a 4-bit code as bf16, twice
// (``vpermw`` reads an index's low 5 bits, so a low nibble needs no mask: the bit above it
// picks the table's second, identical half).
struct Table {
  __m512i table;

  explicit Table(const uint16_t* table16) {
    const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(table16));
    table = _mm512_inserti64x4(_mm512_castsi256_si512(half), half, 1);
  }
};

// what the block kernel's codes are (the chunk kernel below takes 4-bit codes)
enum Kind { kFourBit, kInt8Codes, kE4m3Codes };

// elements [32 * blk, 32 * blk + 32) of a row's codes as bf16: 4-bit (16 bytes a block,
// ``table``: their values), int8 or float8 e4m3 (32 bytes; ``table``: e4m3's subnormals)
template <int KIND>
inline __m512bh decode(const uint8_t* row, int64_t blk, const __m512i& table) {
  if constexpr (KIND == kFourBit) {
    const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + blk * 16)));
    const __m512i idx = _mm512_inserti64x4(_mm512_castsi256_si512(bytes), _mm256_srli_epi16(bytes, 4), 1);
    return reinterpret_cast<__m512bh>(_mm512_permutexvar_epi16(idx, table));
  } else if constexpr (KIND == kInt8Codes) {
    const __m128i* p = reinterpret_cast<const __m128i*>(row + blk * 32);
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p + 1)));
    return _mm512_cvtne2ps_pbh(hi, lo);  // exact: every int8 is a bf16
  } else {
    // e4m3 -> bf16, exactly: a normal code's exponent and mantissa shift into bf16's and its
    // exponent gains bf16's bias less e4m3's (127 - 7 = 120); a subnormal one (exponent 0:
    // m * 2^-9) is looked up by its mantissa; then the sign
    const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + blk * 32)));
    const __m512i normal = _mm512_add_epi16(_mm512_and_si512(_mm512_slli_epi16(v, 4), _mm512_set1_epi16(0x07F0)),
                                            _mm512_set1_epi16(120 << 7));
    const __mmask32 subnormal = _mm512_testn_epi16_mask(v, _mm512_set1_epi16(0x78));
    const __m512i magnitude = _mm512_mask_permutexvar_epi16(normal, subnormal, v, table);
    // magnitude | ((v << 8) & 0x8000)
    const __m512i bits = _mm512_ternarylogic_epi32(magnitude, _mm512_slli_epi16(v, 8), _mm512_set1_epi16(0x8000),
                                                   0xF8);
    return reinterpret_cast<__m512bh>(bits);
  }
}

// A group's scale as a vector: lane i of a 32-element block's products holds elements 2i and
// 2i + 1, so with 16-element groups lanes 0-7 take the first group's scale and 8-15 the next.
template <bool SIXTEEN>
inline __m512 group_scale(const float* s) {
  if constexpr (SIXTEEN) return _mm512_insertf32x8(_mm512_set1_ps(s[0]), _mm256_set1_ps(s[1]), 1);
  return _mm512_set1_ps(s[0]);
}

// Output features rows[0..B) against rows [0, R) of x (bf16 bits, row stride ldx):
//   result[b * R + r] = sum over groups g of scale[b, g] * (sum over g of value * x)
//                       + zero[b, g] * xsum[r, g]   (where zeros are given)
// ``scale``, ``zero``: [B, groups] float32; ``xsum``: [R, groups], x summed over each group.
// A group is 16 elements (SIXTEEN) or whole 32-element blocks.
template <int KIND, bool SIXTEEN, int B, int R>
inline void dot_block(const uint16_t* x, int64_t ldx, int64_t K, const uint8_t* const* rows, const float* scale,
                      const float* zero, const float* xsum, int64_t group, const Table& t, float* result) {
  const int64_t groups = K / group, blocks_per_group = SIXTEEN ? 1 : group / 32;
  __m512 acc[B * R];  // [b * R + r]
  float zacc[B][R];
#pragma GCC unroll 16
  for (int b = 0; b < B; ++b)
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) acc[b * R + r] = _mm512_setzero_ps(), zacc[b][r] = 0.0f;
  const uint8_t* row[B];
#pragma GCC unroll 16
  for (int b = 0; b < B; ++b) row[b] = rows[b];
  for (int64_t blk0 = 0, g = 0; g < groups; blk0 += blocks_per_group, g += SIXTEEN ? 2 : 1) {
    __m512 part[B][R];
#pragma GCC unroll 16
    for (int b = 0; b < B; ++b)
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) part[b][r] = _mm512_setzero_ps();
    for (int64_t blk = blk0; blk < blk0 + blocks_per_group; ++blk) {
      __m512bh xv[R];
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r)
        xv[r] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(x + r * ldx + blk * 32));
#pragma GCC unroll 16
      for (int b = 0; b < B; ++b) {
        const __m512bh w = decode<KIND>(row[b], blk, t.table);
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) part[b][r] = _mm512_dpbf16_ps(part[b][r], w, xv[r]);
      }
    }
#pragma GCC unroll 16
    for (int b = 0; b < B; ++b) {
      const __m512 s = group_scale<SIXTEEN>(scale + b * groups + g);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) acc[b * R + r] = _mm512_fmadd_ps(part[b][r], s, acc[b * R + r]);
      if (zero != nullptr) {
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) {
          zacc[b][r] = std::fma(zero[b * groups + g], xsum[r * groups + g], zacc[b][r]);
          if constexpr (SIXTEEN) zacc[b][r] = std::fma(zero[b * groups + g + 1], xsum[r * groups + g + 1], zacc[b][r]);
        }
      }
    }
  }
  float sums[B * R];
  reduce_store<B * R>(acc, sums);
#pragma GCC unroll 16
  for (int k = 0; k < B * R; ++k) result[k] = sums[k] + zacc[k / R][k % R];
}

template <int KIND, bool SIXTEEN, int B>
inline void dot_rows_of(int64_t rows_x, const uint16_t* x, int64_t ldx, int64_t K, const uint8_t* const* rows,
                        const float* scale, const float* zero, const float* xsum, int64_t group, const Table& t,
                        float* result) {
  switch (rows_x) {
    case 4: return dot_block<KIND, SIXTEEN, B, 4>(x, ldx, K, rows, scale, zero, xsum, group, t, result);
    case 3: return dot_block<KIND, SIXTEEN, B, 3>(x, ldx, K, rows, scale, zero, xsum, group, t, result);
    case 2: return dot_block<KIND, SIXTEEN, B, 2>(x, ldx, K, rows, scale, zero, xsum, group, t, result);
    default: return dot_block<KIND, SIXTEEN, B, 1>(x, ldx, K, rows, scale, zero, xsum, group, t, result);
  }
}

// B output features (4, or 1 for the last few) against up to 4 rows of x: result[b * rows_x + r]
template <int B>
inline void dot_rows(Kind kind, int64_t rows_x, const uint16_t* x, int64_t ldx, int64_t K,
                     const uint8_t* const* rows, const float* scale, const float* zero, const float* xsum,
                     int64_t group, const Table& t, float* result) {
#define KERVAN_BLOCK_ROWS(KIND)                                                                         \
  if (group == 16) return dot_rows_of<KIND, true, B>(rows_x, x, ldx, K, rows, scale, zero, xsum, group, t, result); \
  return dot_rows_of<KIND, false, B>(rows_x, x, ldx, K, rows, scale, zero, xsum, group, t, result);
  switch (kind) {
    case kFourBit: KERVAN_BLOCK_ROWS(kFourBit)
    case kInt8Codes: KERVAN_BLOCK_ROWS(kInt8Codes)
    default: KERVAN_BLOCK_ROWS(kE4m3Codes)
  }
#undef KERVAN_BLOCK_ROWS
}

// ---- 4-bit codes, 128 elements (four 32-element blocks, 64 bytes) at a time ----
//
// One 64-byte load holds 32 16-bit lanes of 4 nibbles each; the lane shifted right by 0, 4,
// 8 and 12 bits indexes ``vpermw``'s table with its low nibble, so four lookups and three
// shifts turn 128 codes into four vectors of 32 bf16 values, with no widening shuffle. Lane
// i of vector v holds element 2 (i % 8) + {0, 16, 1, 17}[v] of block i / 8: x is permuted
// to that order once per call (``ChunkX``), zero-padded to whole chunks. Float lane l of a
// ``vdpbf16ps`` result then sums elements of block l / 4 only, of its first 16 elements for
// vectors 0 and 2 and of its last 16 for 1 and 3: one permuted vector of scales per chunk
// serves every group size dividing 128 (or a multiple of it), 16-element groups taking two.
constexpr int64_t kChunk = 128;
constexpr int kOffset[4] = {0, 16, 1, 17};

// Whether a group size can take the chunk kernel: a chunk's groups must not straddle it.
inline bool chunk_group(int64_t group, int64_t K) {
  return group == K || kChunk % group == 0 || group % kChunk == 0;
}

// x's rows in the chunk order, zero-padded to whole chunks: [M, Kp] bf16 bits
struct ChunkX {
  int64_t chunks, Kp;
  std::vector<uint16_t> x;

  ChunkX(const uint16_t* x16, int64_t ldx, int64_t M, int64_t K)
      : chunks((K + kChunk - 1) / kChunk), Kp(chunks * kChunk), x(M * Kp, 0) {
    for (int64_t m = 0; m < M; ++m)
      for (int64_t c = 0; c < chunks; ++c)
        for (int v = 0; v < 4; ++v)
          for (int i = 0; i < 32; ++i) {
            const int64_t k = c * kChunk + (i / 8) * 32 + 2 * (i % 8) + kOffset[v];
            if (k < K) x[m * Kp + c * kChunk + v * 32 + i] = x16[m * ldx + k];
          }
  }
};

// Per call: which of a chunk's first group's neighbours each float lane's scale is
// (``first``: vectors 0 and 2, ``second``: 1 and 3), and the chunk's first group.
struct ChunkGroups {
  __m512i first, second;
  int64_t group, per_chunk;  // groups a chunk holds: 128 / group, or 0 for larger groups

  explicit ChunkGroups(int64_t group_) : group(group_), per_chunk(group_ <= kChunk ? kChunk / group_ : 0) {
    alignas(64) int32_t a[16], b[16];
    for (int l = 0; l < 16; ++l) {
      const int64_t block = l / 4;
      a[l] = group == 16 ? 2 * block : group < kChunk ? block * 32 / group : 0;
      b[l] = group == 16 ? 2 * block + 1 : a[l];
    }
    first = _mm512_load_si512(a);
    second = _mm512_load_si512(b);
  }

  inline int64_t base(int64_t c) const { return per_chunk ? c * per_chunk : c * kChunk / group; }
};

// Output features rows[0..B) against rows [m0, m0 + R) of the permuted x: result[b * R + r],
// as ``dot_block``'s. ``scale``/``zero``: [B, groups] float32, readable 16 floats past each
// row's last group (the caller pads them); ``xsum``: [R, groups], x summed over each group.
// UINT: the codes' values are 0..15, made bf16 without the table: a code ORed into 0x4300
// is the bf16 of 128 + code, exactly; the extra 128 * scale * sum(x) leaves with the zeros'
// term, whose zero becomes zero - 128 * scale (float32 sums keep ~20 of their 24 bits
// through that: far below a bf16 output's rounding).
template <bool UINT, bool SIXTEEN, int B, int R>
inline void dot_chunks(const ChunkX& cx, int64_t m0, int64_t K, const uint8_t* const* rows, const float* scale,
                       const float* zero, const float* xsum, int64_t groups, const ChunkGroups& cg,
                       const __m512i& table, float* result) {
  constexpr int P = SIXTEEN ? 2 : 1;  // partial sums per (feature, row): one per scale vector
  const uint16_t* xp = cx.x.data() + m0 * cx.Kp;
  const int64_t Kp = cx.Kp, chunks = cx.chunks;
  const __m512i low = _mm512_set1_epi16(0x000F), exponent = _mm512_set1_epi16(0x4300);
  __m512 acc[B * R];  // [b * R + r]
#pragma GCC unroll 16
  for (int k = 0; k < B * R; ++k) acc[k] = _mm512_setzero_ps();
  for (int64_t c = 0; c < chunks; ++c) {
    // all 64 bytes, or 32 for the last chunk of a K that is 64 past a multiple of 128
    const __mmask32 bytes = (c + 1) * kChunk > K ? 0xFFFF : 0xFFFFFFFF;
    __m512i lanes[B];
#pragma GCC unroll 16
    for (int b = 0; b < B; ++b) lanes[b] = _mm512_maskz_loadu_epi16(bytes, rows[b] + c * 64);
    __m512 part[B][R][P];
#pragma GCC unroll 16
    for (int b = 0; b < B; ++b)
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
        for (int q = 0; q < P; ++q) part[b][r][q] = _mm512_setzero_ps();
#pragma GCC unroll 4
    for (int v = 0; v < 4; ++v) {
      __m512bh xv[R];
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r)
        xv[r] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(xp + r * Kp + c * kChunk + v * 32));
#pragma GCC unroll 16
      for (int b = 0; b < B; ++b) {
        const __m512i idx = v == 0 ? lanes[b] : _mm512_srli_epi16(lanes[b], 4 * v);
        // UINT: (idx & 0x000F) | 0x4300, one ternary-logic op; else the table's entry
        const __m512i bits = UINT ? _mm512_ternarylogic_epi32(idx, low, exponent, 0xEA)
                                  : _mm512_permutexvar_epi16(idx, table);
        const __m512bh w = reinterpret_cast<__m512bh>(bits);
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) part[b][r][v % P] = _mm512_dpbf16_ps(part[b][r][v % P], w, xv[r]);
      }
    }
    const int64_t g0 = cg.base(c);
#pragma GCC unroll 16
    for (int b = 0; b < B; ++b) {
      const __m512 sv = _mm512_loadu_ps(scale + b * groups + g0);
      const __m512 s0 = _mm512_permutexvar_ps(cg.first, sv);
      const __m512 s1 = SIXTEEN ? _mm512_permutexvar_ps(cg.second, sv) : s0;
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        acc[b * R + r] = _mm512_fmadd_ps(part[b][r][0], s0, acc[b * R + r]);
        if constexpr (SIXTEEN) acc[b * R + r] = _mm512_fmadd_ps(part[b][r][P - 1], s1, acc[b * R + r]);
      }
    }
  }
  // the zeros' terms, 16 groups at a time: sum over g of zero[b, g] * xsum[r, g]
  if (UINT || zero != nullptr) {
    for (int64_t g = 0; g < groups; g += 16) {
      const __mmask16 m = groups - g >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (groups - g)) - 1);
#pragma GCC unroll 16
      for (int b = 0; b < B; ++b) {
        __m512 z = zero != nullptr ? _mm512_maskz_loadu_ps(m, zero + b * groups + g) : _mm512_setzero_ps();
        if constexpr (UINT) z = _mm512_fnmadd_ps(_mm512_set1_ps(128.0f), _mm512_maskz_loadu_ps(m, scale + b * groups + g), z);
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r)
          acc[b * R + r] = _mm512_fmadd_ps(z, _mm512_maskz_loadu_ps(m, xsum + r * groups + g), acc[b * R + r]);
      }
    }
  }
  reduce_store<B * R>(acc, result);
}

// NB features (4, or 1 for the last few) against rows_x (1-4) rows, in pieces whose
// accumulators fit the 32 registers: result[b * rows_x + r]
template <bool UINT, bool SIXTEEN, int B, int R>
inline void chunk_piece(int64_t b0, const ChunkX& cx, int64_t m0, int64_t K, const uint8_t* const* rows,
                        const float* scale, const float* zero, const float* xsum, int64_t groups,
                        const ChunkGroups& cg, const __m512i& table, float* result) {
  dot_chunks<UINT, SIXTEEN, B, R>(cx, m0, K, rows + b0, scale + b0 * groups,
                                  zero == nullptr ? nullptr : zero + b0 * groups, xsum, groups, cg, table,
                                  result + b0 * R);
}

// the most features (4, 2 or 1) whose registers fit in 28 of the 32: per feature and row an
// accumulator and P partial sums, per feature its codes' lanes, per row its x
constexpr int piece_features(int R, int P) {
  for (int B = 4; B > 1; B /= 2)
    if (B * R * (1 + P) + B + R <= 28) return B;
  return 1;
}

template <bool UINT, bool SIXTEEN, int NB, int R>
inline void chunk_rows_of(const ChunkX& cx, int64_t m0, int64_t K, const uint8_t* const* rows, const float* scale,
                          const float* zero, const float* xsum, int64_t groups, const ChunkGroups& cg,
                          const __m512i& table, float* result) {
  constexpr int B = NB == 1 ? 1 : piece_features(R, SIXTEEN ? 2 : 1);
  for (int64_t b0 = 0; b0 < NB; b0 += B)
    chunk_piece<UINT, SIXTEEN, B, R>(b0, cx, m0, K, rows, scale, zero, xsum, groups, cg, table, result);
}

template <bool UINT, bool SIXTEEN, int NB>
inline void chunk_rows(int64_t rows_x, const ChunkX& cx, int64_t m0, int64_t K, const uint8_t* const* rows,
                       const float* scale, const float* zero, const float* xsum, int64_t groups,
                       const ChunkGroups& cg, const __m512i& table, float* result) {
  switch (rows_x) {
    case 4: return chunk_rows_of<UINT, SIXTEEN, NB, 4>(cx, m0, K, rows, scale, zero, xsum, groups, cg, table, result);
    case 3: return chunk_rows_of<UINT, SIXTEEN, NB, 3>(cx, m0, K, rows, scale, zero, xsum, groups, cg, table, result);
    case 2: return chunk_rows_of<UINT, SIXTEEN, NB, 2>(cx, m0, K, rows, scale, zero, xsum, groups, cg, table, result);
    default: return chunk_rows_of<UINT, SIXTEEN, NB, 1>(cx, m0, K, rows, scale, zero, xsum, groups, cg, table, result);
  }
}

// NB features (4, or 1 for the last few) against rows_x (1-4) rows: result[b * rows_x + r].
// uint_codes: the values are the codes 0..15 (int4, Q4_1), else the table's.
template <int NB>
inline void dot_rows_chunks(bool uint_codes, int64_t rows_x, const ChunkX& cx, int64_t m0, int64_t K,
                            const uint8_t* const* rows, const float* scale, const float* zero, const float* xsum,
                            int64_t groups, const ChunkGroups& cg, const Table& t, float* result) {
  const bool sixteen = cg.group == 16;
  if (uint_codes && sixteen)
    return chunk_rows<true, true, NB>(rows_x, cx, m0, K, rows, scale, zero, xsum, groups, cg, t.table, result);
  if (uint_codes) return chunk_rows<true, false, NB>(rows_x, cx, m0, K, rows, scale, zero, xsum, groups, cg, t.table, result);
  if (sixteen) return chunk_rows<false, true, NB>(rows_x, cx, m0, K, rows, scale, zero, xsum, groups, cg, t.table, result);
  return chunk_rows<false, false, NB>(rows_x, cx, m0, K, rows, scale, zero, xsum, groups, cg, t.table, result);
}

}  // namespace kervan::quant_bf16

#pragma GCC pop_options
#endif
