// The integer dot kernel of ``quant_int8.cpp``, included there once per instruction set
// (no include guard; everything it needs is included first): with KERVAN_Q8_VNNI 1, inside
// an ``avx512vnni`` target region, 16 features at a time in zmm registers and ``vpdpbusd``;
// with 0, 8 features in ymm registers and AVX2's ``vpmaddubsw`` + ``vpmaddwd``.
//
// The weight is packed for it (``worker/quant/int8_layout.py``) in tiles of kTile output
// features, each one stream of records, one per group of input features: the group's
// scales and zeros, then per 32-element block 4-byte steps of every feature side by side,
// so one register holds the same 4 codes of kTile features and one broadcast of 4 bytes
// of x multiplies all of them; the block's dot products land in kTile int32 lanes, one per
// feature, with no horizontal sums. 4-bit codes: a load holds two steps (low nibbles:
// codes 4l..4l+3, high: 16+4l..). Products and their sums are exact in int32.

#if KERVAN_Q8_VNNI
constexpr int64_t kTile = 16;
constexpr int64_t kRows = 4;  // rows of x at once: 2 accumulators each, of 32 registers
constexpr int64_t kPanelRows = 256;  // rows of x a pass of the weight's tiles takes (in L2)
using FVec = __m512;
using IVec = __m512i;
__attribute__((always_inline)) inline IVec load_i(const uint8_t* p) { return _mm512_loadu_si512(p); }
__attribute__((always_inline)) inline IVec bcast_i(const int8_t* p) {
  return _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(p));
}
__attribute__((always_inline)) inline IVec low_nibbles(IVec v) { return _mm512_and_si512(v, _mm512_set1_epi8(0x0F)); }
__attribute__((always_inline)) inline IVec high_nibbles(IVec v) {
  return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0F));
}
// acc + per lane the sum of 4 products: unsigned codes w, signed x
template <bool kSigned>
__attribute__((always_inline)) inline IVec dot_add(IVec acc, IVec w, IVec x) {
  static_assert(!kSigned, "the VNNI packing stores int8 codes shifted to unsigned");
  return _mm512_dpbusd_epi32(acc, w, x);
}
__attribute__((always_inline)) inline IVec zero_i() { return _mm512_setzero_si512(); }
__attribute__((always_inline)) inline IVec add_i(IVec a, IVec b) { return _mm512_add_epi32(a, b); }
__attribute__((always_inline)) inline FVec zero_f() { return _mm512_setzero_ps(); }
__attribute__((always_inline)) inline FVec to_float(IVec v) { return _mm512_cvtepi32_ps(v); }
__attribute__((always_inline)) inline FVec set_f(float v) { return _mm512_set1_ps(v); }
__attribute__((always_inline)) inline FVec fmadd(FVec a, FVec b, FVec c) { return _mm512_fmadd_ps(a, b, c); }
__attribute__((always_inline)) inline FVec mul(FVec a, FVec b) { return _mm512_mul_ps(a, b); }
__attribute__((always_inline)) inline void store_f(float* p, FVec v) { _mm512_storeu_ps(p, v); }
__attribute__((always_inline)) inline FVec load_params(const float* p) { return _mm512_loadu_ps(p); }
__attribute__((always_inline)) inline FVec load_params(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#else
constexpr int64_t kTile = 8;
constexpr int64_t kRows = 2;  // of 16 registers
constexpr int64_t kPanelRows = 128;  // rows of x a pass of the weight's tiles takes (in L2; Zen 3's is 512 KB)
using FVec = __m256;
using IVec = __m256i;
__attribute__((always_inline)) inline IVec load_i(const uint8_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}
__attribute__((always_inline)) inline IVec bcast_i(const int8_t* p) {
  return _mm256_set1_epi32(*reinterpret_cast<const int32_t*>(p));
}
__attribute__((always_inline)) inline IVec low_nibbles(IVec v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0F)); }
__attribute__((always_inline)) inline IVec high_nibbles(IVec v) {
  return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0F));
}
// vpmaddubsw sums pairs into int16: exact for 4-bit codes (15 * 127 * 2) and for int8 codes
// kept signed (|w| * 127 * 2, x taking w's sign); codes shifted to 0..255 would saturate it
template <bool kSigned>
__attribute__((always_inline)) inline IVec dot_add(IVec acc, IVec w, IVec x) {
  if constexpr (kSigned) {
    x = _mm256_sign_epi8(x, w);
    w = _mm256_abs_epi8(w);
  }
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
}
__attribute__((always_inline)) inline IVec zero_i() { return _mm256_setzero_si256(); }
__attribute__((always_inline)) inline IVec add_i(IVec a, IVec b) { return _mm256_add_epi32(a, b); }
__attribute__((always_inline)) inline FVec zero_f() { return _mm256_setzero_ps(); }
__attribute__((always_inline)) inline FVec to_float(IVec v) { return _mm256_cvtepi32_ps(v); }
__attribute__((always_inline)) inline FVec set_f(float v) { return _mm256_set1_ps(v); }
__attribute__((always_inline)) inline FVec fmadd(FVec a, FVec b, FVec c) { return _mm256_fmadd_ps(a, b, c); }
__attribute__((always_inline)) inline FVec mul(FVec a, FVec b) { return _mm256_mul_ps(a, b); }
__attribute__((always_inline)) inline void store_f(float* p, FVec v) { _mm256_storeu_ps(p, v); }
__attribute__((always_inline)) inline FVec load_params(const float* p) { return _mm256_loadu_ps(p); }
__attribute__((always_inline)) inline FVec load_params(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
#endif

// One tile of kTile features against R rows of x from row m0: out[r * ld + f], float32.
// ``tile`` is the tile's records, one per group: the group's kTile scales and kTile zeros
// (S: float or c10::Half), then its blocks' codes. Per block b of the rows' int8 values:
// dx * (scale * (codes . xq) + zero' * sum(xq)).
template <bool kFour, bool kSigned, int R, typename S>
inline void tile_rows(const QuantizedRows& x, int64_t m0, const uint8_t* tile, int64_t group, float* out,
                      int64_t ld) {
  const int64_t K = x.K, blocks = K / 32, per_group = group / 32, step_bytes = kTile * 4;
  const int64_t block_bytes = step_bytes * (kFour ? 4 : 8);
  const int64_t params_bytes = 2 * kTile * static_cast<int64_t>(sizeof(S));
  const int64_t record = params_bytes + per_group * block_bytes;
  FVec acc[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r] = zero_f();
  for (int64_t g = 0; g < blocks / per_group; ++g) {
    const uint8_t* rec = tile + g * record;
    // the stream a few records on, into cache while these compute: a decode step reads
    // its weights from DRAM, and calls too short for the hardware prefetcher to ramp up
    for (int64_t line = 0; line < record; line += 64) __builtin_prefetch(rec + kAheadBytes + line, 0, 1);
    const FVec s = load_params(reinterpret_cast<const S*>(rec));
    const FVec z = load_params(reinterpret_cast<const S*>(rec) + kTile);
    for (int64_t j = 0; j < per_group; ++j) {
      const int64_t b = g * per_group + j;
      const uint8_t* c = rec + params_bytes + j * block_bytes;
      IVec dot[R];
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) dot[r] = zero_i();
      if constexpr (kFour) {
        IVec dhi[R];  // the high nibbles' sums apart: two dependency chains, not one (int32: exact either way)
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) dhi[r] = zero_i();
#pragma GCC unroll 4
        for (int l = 0; l < 4; ++l) {
          const IVec v = load_i(c + l * step_bytes), lo = low_nibbles(v), hi = high_nibbles(v);
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r) {
            const int8_t* xr = x.q.data() + (m0 + r) * K + b * 32;
            dot[r] = dot_add<false>(dot[r], lo, bcast_i(xr + 4 * l));
            dhi[r] = dot_add<false>(dhi[r], hi, bcast_i(xr + 16 + 4 * l));
          }
        }
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) dot[r] = add_i(dot[r], dhi[r]);
      } else {
#pragma GCC unroll 8
        for (int l = 0; l < 8; ++l) {
          const IVec v = load_i(c + l * step_bytes);
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r)
            dot[r] = dot_add<kSigned>(dot[r], v, bcast_i(x.q.data() + (m0 + r) * K + b * 32 + 4 * l));
        }
      }
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const int64_t i = (m0 + r) * blocks + b;
        const FVec t = fmadd(z, set_f(x.sum[i]), mul(to_float(dot[r]), s));
        acc[r] = fmadd(t, set_f(x.d[i]), acc[r]);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) store_f(out + r * ld, acc[r]);
}

// Tiles [t0, t1) of out (float32 [M, tiles * kTile], the padded features too) on the calling
// thread; ``data``: the tiles' records
template <bool kFour, bool kSigned, typename S>
void matmul_tiles(const QuantizedRows& x, const uint8_t* data, int64_t tiles, int64_t group, float* out, int64_t t0,
                  int64_t t1) {
  const int64_t K = x.K, ld = tiles * kTile;
  const int64_t tile_bytes = (K / group) * 2 * kTile * static_cast<int64_t>(sizeof(S)) +
                             (K / 32) * kTile * (kFour ? 16 : 32);
  // by panels of x's rows that stay in L2 while the thread's tiles pass over them
  for (int64_t p0 = 0; p0 < x.M; p0 += kPanelRows)
    for (int64_t t = t0; t < t1; ++t) {
      const uint8_t* tile = data + t * tile_bytes;
      for (int64_t m0 = p0; m0 < std::min(x.M, p0 + kPanelRows); m0 += kRows) {
        float* o = out + m0 * ld + t * kTile;
        switch (std::min(kRows, x.M - m0)) {
#if KERVAN_Q8_VNNI
          case 4: tile_rows<kFour, kSigned, 4, S>(x, m0, tile, group, o, ld); break;
          case 3: tile_rows<kFour, kSigned, 3, S>(x, m0, tile, group, o, ld); break;
#endif
          case 2: tile_rows<kFour, kSigned, 2, S>(x, m0, tile, group, o, ld); break;
          default: tile_rows<kFour, kSigned, 1, S>(x, m0, tile, group, o, ld);
        }
      }
    }
}
