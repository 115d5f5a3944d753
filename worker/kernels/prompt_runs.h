// A prompt's tokens as rows of the paged decode kernel (``paged_kv.cpp``), walked as
// matrix tiles.
//
// In batch-invariant mode every token of a prompt is a row of its own: it attends to its
// prefix through the sequence's block table, exactly as it would when decoded, so its
// bits do not depend on how the prompt was cut or what ran beside it. Done row by row,
// every row re-reads its whole prefix, and a 512-token prompt at Llama-3.2-1B's heads
// ran at a third of the float32 FMA rate (12 ms a layer on the AMX Xeon, where PyTorch's
// flash SDPA, which tiles keys from the chunk's start and so is not invariant, takes 4).
//
// A run of consecutive tokens (one table, lengths one apart) is one kv head's R = tokens
// x G query rows at a time, in two register-tiled GEMMs with a softmax between:
//
//     scores [R, keys] = Q [R, D] . K [D, keys]     kQkRows rows x kBlk blocks a tile
//     out    [R, D]    = P [R, keys] . V [keys, D]  kPvRows rows x kPvVecs vectors a tile
//
// Every element is computed with the decode path's own sequence of operations — the same
// FMA chains over d (kChains of them, by d's parity, summed at the end), the same
// ``softmax_in_place`` over the row's own length, one FMA chain over the tokens in order —
// only the vector axis and the loads are shared differently. A fused multiply-add is exact
// per lane, so a row's bits are those of the row alone (tests/worker/test_prompt_runs.py
// holds it for every specialised shape, with and without parts).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "vec.h"

namespace kervan {

// exp(x - max) in place over n scores; returns their sum, and the max in *max_out.
inline float softmax_in_place(float* x, int64_t n, float* max_out) {
  Vec mv(-std::numeric_limits<float>::infinity());
  int64_t t = 0;
  for (; t + kW <= n; t += kW) mv = at::vec::maximum(mv, Vec::loadu(x + t));
  float mx = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, mv);
  for (; t < n; ++t) mx = std::max(mx, x[t]);
  *max_out = mx;
  const Vec mxv(mx);
  Vec sv(0.f);
  for (t = 0; t + kW <= n; t += kW) {
    const Vec e = (Vec::loadu(x + t) - mxv).exp_u20();
    e.store(x + t);
    sv = sv + e;
  }
  float sum = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, sv);
  for (; t < n; ++t) {
    x[t] = std::exp(x[t] - mx);
    sum += x[t];
  }
  return sum;
}

// One kv head's rows of a run. Row i: its scaled query qf + slot[i] * kD, its length len[i]
// (tokens of this part), its unnormalised output to acc + slot[i] * kD (zeros on entry), its
// maximum and sum to mx[slot[i]] and sums[slot[i]]. k_at(j) / v_at(j): block j of the part,
// this head's [kD, kBS] keys and [kBS, kD] values; nblocks: the longest row's blocks.
template <typename T, int64_t kD, int64_t kBS, int64_t kChains, typename KAt, typename VAt>
void attend_run(int64_t R, const int64_t* slot, const int64_t* len, int64_t nblocks, const float* qf, float* acc,
                float* mx, float* sums, KAt k_at, VAt v_at, std::vector<float>& scratch) {
  constexpr int64_t kCols = kBS / kW;                   // vectors per block of scores
  constexpr int64_t kBudget = kW == 16 ? 24 : 12;       // accumulators the registers hold beside the loads
  constexpr int64_t kBlk = kCols == 1 ? 2 : 1;          // blocks a score tile spans
  constexpr int64_t kQkRows = std::max<int64_t>(1, kBudget / (kBlk * kChains * kCols));
  constexpr int64_t kPvVecs = std::min<int64_t>(4, kD / kW);
  constexpr int64_t kPvRows = std::max<int64_t>(1, kBudget / kPvVecs);
  constexpr int64_t kTileBlocks = std::max<int64_t>(1, 64 / kBS);  // blocks of values a tile of tokens spans
  static_assert(kD % (kPvVecs * kW) == 0, "a head must be whole value tiles");
  const int64_t stride = (nblocks + kBlk - 1) / kBlk * kBlk * kBS;
  scratch.resize((R + 1) * stride + kD);  // R score rows, a spare one and a spare output for padded tile rows
  float* sc = scratch.data();
  float* spare_row = sc + R * stride;
  float* spare_out = spare_row + stride;

  // 16-bit keys and values are converted to float32 a tile at a time (exactly), once for all the
  // row tiles that read it, not once per row tile: in the FMA loops the conversions took the
  // FMA ports a quarter of the time. A tile stays in L1 (a whole part converted did not).
  constexpr bool kConvert = !std::is_same_v<T, float>;
  alignas(64) float k_tile[kConvert ? kBlk * kD * kBS : 1];
  alignas(64) float v_tile[kConvert ? kTileBlocks * kBS * kPvVecs * kW : 1];

  // scores: rows past R repeat the last row and store to the spare row
  for (int64_t j0 = 0; j0 < nblocks; j0 += kBlk) {
    const float* kb[kBlk];
    for (int64_t b = 0; b < kBlk; ++b) {
      const T* src = k_at(std::min(j0 + b, nblocks - 1));
      if constexpr (kConvert) {
        for (int64_t e = 0; e < kD * kBS; e += kW) load_floats(src + e).store(k_tile + b * kD * kBS + e);
        kb[b] = k_tile + b * kD * kBS;
      } else {
        kb[b] = src;
      }
    }
    for (int64_t i0 = 0; i0 < R; i0 += kQkRows) {
      const float* q[kQkRows];
      float* dst[kQkRows];
      for (int64_t m = 0; m < kQkRows; ++m) {
        q[m] = qf + slot[std::min(i0 + m, R - 1)] * kD;
        dst[m] = (i0 + m < R ? sc + (i0 + m) * stride : spare_row) + j0 * kBS;
      }
      Vec s[kQkRows][kBlk][kChains][kCols];
      for (auto& row : s)
        for (auto& blk : row)
          for (auto& chain : blk)
            for (auto& x : chain) x = Vec(0.f);
#pragma GCC unroll 8
      for (int64_t d = 0; d < kD; d += kChains) {
#pragma GCC unroll 2
        for (int64_t ch = 0; ch < kChains; ++ch) {
          Vec krow[kBlk][kCols];
          for (int64_t b = 0; b < kBlk; ++b)
            for (int64_t c = 0; c < kCols; ++c) krow[b][c] = Vec::loadu(kb[b] + (d + ch) * kBS + c * kW);
#pragma GCC unroll 24
          for (int64_t m = 0; m < kQkRows; ++m) {
            const Vec qv(q[m][d + ch]);
            for (int64_t b = 0; b < kBlk; ++b)
              for (int64_t c = 0; c < kCols; ++c) s[m][b][ch][c] = at::vec::fmadd(qv, krow[b][c], s[m][b][ch][c]);
          }
        }
      }
      for (int64_t m = 0; m < kQkRows; ++m)
        for (int64_t b = 0; b < kBlk; ++b)
          for (int64_t c = 0; c < kCols; ++c) {
            Vec total = s[m][b][0][c];
            if constexpr (kChains == 2) total = total + s[m][b][1][c];
            total.store(dst[m] + b * kBS + c * kW);
          }
    }
  }
  for (int64_t i = 0; i < R; ++i) sums[slot[i]] = softmax_in_place(sc + i * stride, len[i], &mx[slot[i]]);

  // values: one chain over the tokens per output element, kTileBlocks blocks of tokens at a time
  // (their values stay in L1 across the row tiles; the partial sums wait in acc, exactly), every
  // row up to the tile's shortest length, then each row up to its own
  for (int64_t e = 0; e < kD; ++e) spare_out[e] = 0.f;
  for (int64_t c0 = 0; c0 < kD; c0 += kPvVecs * kW) {
    for (int64_t j0 = 0; j0 < nblocks; j0 += kTileBlocks) {
      const int64_t t_lo = j0 * kBS, t_hi = std::min(nblocks, j0 + kTileBlocks) * kBS;
      constexpr int64_t kTileCols = kPvVecs * kW;
      if constexpr (kConvert)
        for (int64_t t = t_lo; t < t_hi; ++t)
          for (int64_t u = 0; u < kPvVecs; ++u)
            load_floats(v_at(t / kBS) + t % kBS * kD + c0 + u * kW).store(v_tile + (t - t_lo) * kTileCols + u * kW);
      auto v_row = [&](int64_t t) -> const float* {  // token t's kTileCols values from column c0
        if constexpr (kConvert) return v_tile + (t - t_lo) * kTileCols;
        else return v_at(t / kBS) + t % kBS * kD + c0;
      };
      for (int64_t i0 = 0; i0 < R; i0 += kPvRows) {
        const float* p[kPvRows];
        float* dst[kPvRows];
        int64_t n[kPvRows], lo = std::numeric_limits<int64_t>::max(), hi = 0;
        for (int64_t m = 0; m < kPvRows; ++m) {
          const int64_t i = std::min(i0 + m, R - 1);
          p[m] = sc + i * stride;
          n[m] = len[i];
          dst[m] = (i0 + m < R ? acc + slot[i] * kD : spare_out) + c0;
          lo = std::min(lo, n[m]);
          hi = std::max(hi, n[m]);
        }
        if (hi <= t_lo) continue;  // every row of the tile ended before these tokens
        Vec o[kPvRows][kPvVecs];
        for (int64_t m = 0; m < kPvRows; ++m)
          for (int64_t u = 0; u < kPvVecs; ++u) o[m][u] = Vec::loadu(dst[m] + u * kW);
        for (int64_t t = t_lo; t < std::min(hi, t_hi); ++t) {
          const float* vt = v_row(t);
          Vec v[kPvVecs];
          for (int64_t u = 0; u < kPvVecs; ++u) v[u] = Vec::loadu(vt + u * kW);
          if (t < lo) {
#pragma GCC unroll 24
            for (int64_t m = 0; m < kPvRows; ++m) {
              const Vec pv(p[m][t]);
              for (int64_t u = 0; u < kPvVecs; ++u) o[m][u] = at::vec::fmadd(pv, v[u], o[m][u]);
            }
          } else {
            for (int64_t m = 0; m < kPvRows; ++m) {
              if (t >= n[m]) continue;  // past this row's own length
              const Vec pv(p[m][t]);
              for (int64_t u = 0; u < kPvVecs; ++u) o[m][u] = at::vec::fmadd(pv, v[u], o[m][u]);
            }
          }
        }
        for (int64_t m = 0; m < kPvRows; ++m)
          for (int64_t u = 0; u < kPvVecs; ++u) o[m][u].store(dst[m] + u * kW);
      }
    }
  }
}

}  // namespace kervan
