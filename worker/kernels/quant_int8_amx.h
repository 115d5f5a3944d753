// The int8-activation matmul of ``quant_int8.cpp`` on AMX tiles, for calls of many rows (a
// prompt's chunk): included there once, inside the ``vnni`` namespace (after
// ``quant_int8_kernel.h``, whose tile layout, parameter loads and float steps it shares), in an
// ``amx-tile,amx-int8`` target region. x's rows come padded to whole row tiles (``quantize_rows``:
// the rows past x.M zero, their scales 0).
//
// It computes the same bits as the VNNI kernel, so which of the two a call takes never shows:
// a block's dot product of x's int8 values and the codes is an exact int32 either way
// (``tdpbsud``: x signed, codes unsigned, 16 rows x 16 features x 32 k a tile product), and
// the float steps after it are the VNNI kernel's, in the same order: per block b,
//   t = zero' * sum(xq[b]) + scale * float(dot);   acc = t * xd[b] + acc   (two FMAs, a mul)
// The weight's 16-feature tiles are the VNNI layout, whose 4-byte steps are what a B tile's
// rows hold: int8 codes load as they are; 4-bit codes are split into their low and high
// nibbles (k 0-15, then 16-31) once per call into a buffer every row tile of the call reuses.
//
// AMX needs the kernel's permission for its tile state (``arch_prctl``); where it is refused,
// or ``ONEDNN_MAX_CPU_ISA`` caps the ISA below AMX, every call takes the VNNI kernel.

constexpr int64_t kAmxRows = 16;  // rows of x per tile product
constexpr int64_t kAmxBlock = 32;  // k per tile product: one block, one scale of x
constexpr int64_t kAhead = 3;      // tile products in flight beyond the block whose float steps run

struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

inline bool amx_allowed() {
  static const bool allowed = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24)) || !(d & (1u << 25))) return false;
    const char* cap = std::getenv("ONEDNN_MAX_CPU_ISA");
    if (cap != nullptr && *cap != '\0' && std::strstr(cap, "AMX") == nullptr && std::strcmp(cap, "ALL") != 0)
      return false;
    constexpr long kReqPerm = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kReqPerm, kTileData) == 0;
  }();
  return allowed;
}

// Tiles [t0, t1) of 16 features of the weight against every row of x: out[r * ld + f] for
// r < x.M, on the calling thread (as ``matmul_tiles``)
template <bool kFour, typename S>
void amx_tiles(const QuantizedRows& x, const uint8_t* data, int64_t tiles, int64_t group, float* out, int64_t t0,
               int64_t t1) {
  const int64_t K = x.K, blocks = K / kAmxBlock, per_group = group / kAmxBlock, ld = tiles * kTile;
  const int64_t block_bytes = kTile * (kFour ? 16 : 32), params_bytes = 2 * kTile * static_cast<int64_t>(sizeof(S));
  const int64_t record = params_bytes + per_group * block_bytes, tile_bytes = (blocks / per_group) * record;
  TileConfig config;
  for (int c = 0; c <= kAhead; ++c) config.rows[c] = kAmxRows, config.colsb[c] = kTile * 4;  // C: 16 x 16 int32
  config.rows[4] = kAmxRows, config.colsb[4] = kAmxBlock;  // A: 16 rows x 32 int8 of x
  config.rows[5] = kAmxBlock / 4, config.colsb[5] = kTile * 4;  // B: 8 steps x 16 features x 4 codes
  _tile_loadconfig(&config);
  std::vector<uint8_t> codes(kFour ? blocks * kAmxBlock * kTile : 0);  // a tile's 4-bit codes as bytes
  // by panels of x's rows that stay in L2 while the thread's tiles pass over them
  for (int64_t p0 = 0; p0 < x.M; p0 += kPanelRows)
  for (int64_t t = t0; t < t1; ++t) {
    const uint8_t* tile = data + t * tile_bytes;
    auto block_codes = [&](int64_t b) -> const uint8_t* {
      const uint8_t* c = tile + (b / per_group) * record + params_bytes + (b % per_group) * block_bytes;
      return kFour ? codes.data() + b * kAmxBlock * kTile : c;
    };
    if constexpr (kFour) {
      for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* c = tile + (b / per_group) * record + params_bytes + (b % per_group) * block_bytes;
        uint8_t* dst = codes.data() + b * kAmxBlock * kTile;
        for (int l = 0; l < 4; ++l) {
          const IVec v = load_i(c + l * kTile * 4);
          _mm512_storeu_si512(dst + l * kTile * 4, low_nibbles(v));
          _mm512_storeu_si512(dst + (4 + l) * kTile * 4, high_nibbles(v));
        }
      }
    }
    // a tile product's result reaches memory long after it is issued: the products of blocks
    // b + 1 .. b + kAhead are in flight (each in a C tile of its own, 0-3) while the float steps
    // of block b run on its dot products (a ring of buffers)
    alignas(64) int32_t dots[kAhead + 1][kAmxRows * kTile];
    for (int64_t m0 = p0; m0 < std::min(x.M, p0 + kPanelRows); m0 += kAmxRows) {
      const int8_t* xq = x.q.data() + m0 * K;
      auto issue = [&](int64_t b) {
        int32_t* d = dots[b % (kAhead + 1)];
        _tile_loadd(4, xq + b * kAmxBlock, K);
        _tile_loadd(5, block_codes(b), kTile * 4);
        switch (b % (kAhead + 1)) {
          case 0: _tile_zero(0); _tile_dpbsud(0, 4, 5); _tile_stored(0, d, kTile * 4); break;
          case 1: _tile_zero(1); _tile_dpbsud(1, 4, 5); _tile_stored(1, d, kTile * 4); break;
          case 2: _tile_zero(2); _tile_dpbsud(2, 4, 5); _tile_stored(2, d, kTile * 4); break;
          default: _tile_zero(3); _tile_dpbsud(3, 4, 5); _tile_stored(3, d, kTile * 4);
        }
      };
      FVec acc[kAmxRows];
      for (auto& a : acc) a = zero_f();
      for (int64_t b = 0; b < std::min(kAhead, blocks); ++b) issue(b);
      for (int64_t b = 0; b < blocks; ++b) {
        if (b + kAhead < blocks) issue(b + kAhead);
        const int32_t* d = dots[b % (kAhead + 1)];
        const uint8_t* rec = tile + (b / per_group) * record;
        const FVec s = load_params(reinterpret_cast<const S*>(rec));
        const FVec z = load_params(reinterpret_cast<const S*>(rec) + kTile);
#pragma GCC unroll 16
        for (int64_t r = 0; r < kAmxRows; ++r) {
          const int64_t i = (m0 + r) * blocks + b;
          const FVec t = fmadd(z, set_f(x.sum[i]), mul(to_float(_mm512_load_si512(d + r * kTile)), s));
          acc[r] = fmadd(t, set_f(x.d[i]), acc[r]);
        }
      }
      for (int64_t r = 0; r < std::min(kAmxRows, x.M - m0); ++r) store_f(out + (m0 + r) * ld + t * kTile, acc[r]);
    }
  }
  _tile_release();
}
