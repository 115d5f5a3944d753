// CPU kernels for the paged KV cache: writing new K/V into their slots, and
// decode attention.
//
// Decode attention:
//
// One query token per sequence attends to its first lens[b] cached tokens, read
// in place through the block table: no gathered copy of K/V is made. Work is
// split over (sequence, kv head, part of 512 tokens: see decode_vec); the G = num_heads / num_kv_heads query heads of
// a group share each K/V element they read. Inside a block the cache is head-major,
// so one (block, head) is one contiguous run of memory: K as [head_dim,
// block_size] (scores of a block accumulate as one vector, no horizontal sums),
// V as [block_size, head_dim]. Accumulation is in float32.
// the narrow headers, not <ATen/ATen.h> (every op's declaration): a first start compiles in a third of the time
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

#include "prompt_runs.h"
#include "vec.h"

// Element -> float, written so the compiler vectorises it (bf16 is the top half of a float).
template <typename T>
static inline float to_float(const T* p, int64_t i) { return static_cast<float>(p[i]); }
template <>
inline float to_float<c10::BFloat16>(const c10::BFloat16* p, int64_t i) {
  uint16_t bits;
  std::memcpy(&bits, p + i, 2);
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

constexpr int64_t kMaxD = 256, kMaxBS = 64, kMaxG = 16;

// Blocks sit at random places in the cache, beyond the hardware prefetcher's
// reach: ask for the block kAhead places on while this one is being used (a
// block is used for less time than a memory round trip takes).
constexpr int64_t kAhead = 16;
template <typename T>
static inline void prefetch(const T* p, int64_t n) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t off = 0; off < n * static_cast<int64_t>(sizeof(T)); off += 64) __builtin_prefetch(c + off);
}

// Raw pointers and sizes of one paged_decode call, shared by both implementations.
template <typename T>
struct DecodeArgs {
  int64_t B, Hq, D, Hkv, bs, G, max_blocks, block_stride, q_row;  // q_row: elements between sequences' q
  const T *q, *k, *v;
  const int64_t *tables, *lens;
  T* out;
  float scale;

  DecodeArgs(const at::Tensor& q_, const at::Tensor& kv, const at::Tensor& tables_, const at::Tensor& lens_,
             at::Tensor& out_, double scale_)
      : B(q_.size(0)), Hq(q_.size(1)), D(q_.size(2)), Hkv(kv.size(2)), bs(kv.size(3) / D), G(Hq / Hkv),
        max_blocks(tables_.size(1)), block_stride(bs * Hkv * D), q_row(q_.stride(0)), q(q_.data_ptr<T>()),
        k(kv.data_ptr<T>()),
        v(k + kv.stride(0)), tables(tables_.data_ptr<int64_t>()), lens(lens_.data_ptr<int64_t>()),
        out(out_.data_ptr<T>()), scale(static_cast<float>(scale_)) {}
};

// The general case: any head_dim, block_size and group size within the limits
// below, scalar code the compiler vectorises as it can.
template <typename T>
static void decode_any(const DecodeArgs<T>& a) {
  const int64_t B = a.B, Hq = a.Hq, D = a.D, Hkv = a.Hkv, bs = a.bs, G = a.G;
  const int64_t block_stride = a.block_stride;
  const T* qp = a.q;
  const T* kp = a.k;
  const T* vp = a.v;
  const float fscale = a.scale;
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;  // [G, len]
    for (int64_t w = begin; w < end; ++w) {
      const int64_t b = w / Hkv, h = w % Hkv, len = a.lens[b], nblocks = (len + bs - 1) / bs;
      const int64_t* table = a.tables + b * a.max_blocks;
      const int64_t head0 = b * Hq + h * G;
      scores.resize(G * len);
      float* sc = scores.data();
      float qf[kMaxG * kMaxD];
      for (int64_t i = 0; i < G * D; ++i) qf[i] = to_float(qp + b * a.q_row + h * G * D, i) * fscale;
      for (int64_t j = 0; j < nblocks; ++j) {
        const T* kb = kp + table[j] * block_stride + h * D * bs;
        const int64_t t0 = j * bs, n = std::min(bs, len - t0);
        for (int64_t g = 0; g < G; ++g)
          for (int64_t i = 0; i < n; ++i) {
            float s = 0.f;
            for (int64_t d = 0; d < D; ++d) s += qf[g * D + d] * to_float(kb, d * bs + i);
            sc[g * len + t0 + i] = s;
          }
      }
      float inv[kMaxG];
      for (int64_t g = 0; g < G; ++g) {
        float* sg = sc + g * len;
        const float mx = *std::max_element(sg, sg + len);
        float sum = 0.f;
        for (int64_t t = 0; t < len; ++t) { sg[t] = std::exp(sg[t] - mx); sum += sg[t]; }
        inv[g] = 1.f / sum;
      }
      float acc[kMaxG * kMaxD];
      for (int64_t i = 0; i < G * D; ++i) acc[i] = 0.f;
      for (int64_t j = 0; j < nblocks; ++j) {
        const T* vb = vp + table[j] * block_stride + h * bs * D;
        const int64_t t0 = j * bs, n = std::min(bs, len - t0);
        for (int64_t i = 0; i < n; ++i)
          for (int64_t g = 0; g < G; ++g) {
            const float p = sc[g * len + t0 + i];
            for (int64_t d = 0; d < D; ++d) acc[g * D + d] += p * to_float(vb, i * D + d);
          }
      }
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d) a.out[(head0 + g) * D + d] = static_cast<T>(acc[g * D + d] * inv[g]);
    }
  });
}

using kervan::kW;
using kervan::load_floats;
using kervan::softmax_in_place;
using kervan::Vec;

// A split row of one head: its parts' outputs weighed by exp(part max - max), in part order,
// over the parts' sums weighed alike. Part p's output is at acc + p * step * D, its maximum and
// sum at mx[p * step] and sums[p * step]. The same code for a decode row's parts (combine_parts)
// and a prompt run's (decode_vec's whole-run items), so the two give the same bits.
template <typename T>
static void combine_row(int64_t D, int64_t parts, int64_t step, const float* acc, const float* mx, const float* sums,
                        std::vector<float>& out, T* dst) {
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t p = 0; p < parts; ++p) m = std::max(m, mx[p * step]);
  out.assign(D, 0.f);
  float total = 0.f;
  for (int64_t p = 0; p < parts; ++p) {
    const float weight = std::exp(mx[p * step] - m);
    total += sums[p * step] * weight;
    for (int64_t d = 0; d < D; ++d) out[d] += acc[p * step * D + d] * weight;
  }
  const float inv = 1.f / total;
  for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(out[d] * inv);
}

template <typename T>
static void combine_parts(const DecodeArgs<T>& a, int64_t D, const std::vector<int64_t>& first_part,
                          const std::vector<float>& acc, const std::vector<float>& mx, const std::vector<float>& sums) {
  at::parallel_for(0, a.B * a.Hq, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> out;
    for (int64_t w = begin; w < end; ++w) {
      const int64_t b = w / a.Hq, h = w % a.Hq, p0 = first_part[b], parts = first_part[b + 1] - p0;
      if (parts == 1) continue;  // written by its item
      const int64_t slot = p0 * a.Hq + h;
      combine_row(D, parts, a.Hq, acc.data() + slot * D, mx.data() + slot, sums.data() + slot, out,
                  a.out + (b * a.Hq + h) * D);
    }
  });
}

// The common shapes: head_dim kD, block_size kBS and kG query heads per kv head
// fixed at compile time, written with ATen's Vectorized (AVX2 or AVX-512, as the
// library was built) so that every accumulator stays in a register. One pass
// over a sequence's blocks serves all kG query heads of a group: each K/V element
// is loaded and converted once.
//
// A work item is a sequence with all its kv heads when there are enough
// sequences to keep every thread busy (a block's heads are one contiguous run of
// memory, read in one sweep), else one (sequence, kv head) pair; and a sequence
// longer than kPart tokens is walked in parts of kPart (flash-decoding): each part
// its own item, with its own softmax maximum and sum, combined in part order after
// (``combine_parts``). One sequence of 4,096 tokens on SmolLM2's 3 kv heads is then
// 24 items, not 3 for 2 threads. Where a row's parts fall depends on its length
// alone, never on the batch: the result is batch-invariant.
//
// A prompt's tokens come as rows of their own (every token attends to its prefix through
// the same block table, its length one more than the row before's): up to kRunMax such
// rows make one item. Up to kRowsMax of them share each K and V vector load here; longer
// runs go to ``attend_run`` (prompt_runs.h), one kv head's rows as two register-tiled
// GEMMs. Each row's sums run as they would alone — the same chains over d, its own softmax
// over its own length, its own chain over the tokens — so grouping changes the speed, never
// a row's bits. Where there are runs, items are taken longest first from a shared counter:
// a prompt's later tokens attend to more, and an even split of the item list left one
// thread three quarters of the work.
constexpr int64_t kPart = 512;
constexpr int64_t kRunMax = 16;

template <typename T, int64_t kD, int64_t kBS, int64_t kG>
static void decode_vec(const DecodeArgs<T>& a) {
  static_assert(kBS % kW == 0 && kD % kW == 0, "a block row and a head must be whole vectors");
  static_assert(kPart % kBS == 0, "a part must be whole blocks");
  constexpr int64_t kCols = kBS / kW;                   // vectors per K row: one block's scores of a head
  constexpr int64_t kChains = kG * kCols <= 4 ? 2 : 1;  // independent FMA chains the registers can hold
  constexpr int64_t kChunk = std::min<int64_t>(kD, kW * std::max<int64_t>(1, 8 / kG));  // V columns a pass
  constexpr int64_t kChunkVecs = kChunk / kW;
  constexpr int64_t kSpan = kD * kBS;  // elements of one (block, head)
  constexpr int64_t kPartBlocks = kPart / kBS;
  // rows of one sequence an item takes: as many as keep their accumulators in registers
  constexpr int64_t kRegs = kW == 16 ? 24 : 12;
  constexpr int64_t kRowsMax = std::max<int64_t>(
      1, std::min<int64_t>(4, kRegs / std::max(kChains * kG * kCols, kG * kChunkVecs)));
  const int64_t heads = a.B >= 2 * at::get_num_threads() ? a.Hkv : 1;  // kv heads per work item
  const int64_t items_per_seq = a.Hkv / heads, rows = heads * kG;      // rows: query heads per item
  // where each row's parts start, and the items: (first row, rows, part) of a run of rows of one
  // sequence (the same table, lengths one apart, as many parts)
  std::vector<int64_t> first_part(a.B + 1, 0);
  struct Item {
    int64_t row, count, part;
  };
  constexpr int64_t kWhole = -1;  // a run's item: all its parts, combined in the item
  std::vector<Item> items;
  auto parts_of = [&](int64_t b) { return std::max<int64_t>(1, (a.lens[b] + kPart - 1) / kPart); };
  for (int64_t b = 0; b < a.B;) {
    int64_t n = 1;
    const int64_t* table = a.tables + b * a.max_blocks;
    while (n < kRunMax && b + n < a.B && a.lens[b + n] == a.lens[b] + n && parts_of(b + n) == parts_of(b) &&
           std::memcmp(table, a.tables + (b + n) * a.max_blocks, a.max_blocks * sizeof(int64_t)) == 0)
      ++n;
    // a prompt's run: one item walks its parts and combines them (kWhole), so the prompt's parts
    // need no shared buffer (42 MB for 2,048 tokens at Llama-3.2-1B's heads)
    const bool whole = n > kRowsMax;
    for (int64_t r = b; r < b + n; ++r) first_part[r + 1] = first_part[r] + (whole ? 1 : parts_of(r));
    if (whole) items.push_back({b, n, kWhole});
    for (int64_t p = 0; p < parts_of(b) && !whole; ++p) items.push_back({b, n, p});
    b += n;
  }
  const int64_t total_parts = first_part[a.B];
  // a split sequence's parts: unnormalised outputs [part, head, kD], and each row's maximum and sum
  const bool split = total_parts > a.B;
  std::vector<float> part_acc(split ? total_parts * a.Hq * kD : 0), part_max(split ? total_parts * a.Hq : 0),
      part_sum(split ? total_parts * a.Hq : 0);
  const int64_t num_work = static_cast<int64_t>(items.size()) * items_per_seq;
  // with prompt runs, work (item, kv heads) goes costliest first from a shared counter; decode rows
  // alone keep the even split, whose contiguous items walk a block's heads front to back (one long
  // row's parts and heads taken alternately by two threads decoded 15% slower)
  const bool has_runs = std::any_of(items.begin(), items.end(), [](const Item& i) { return i.part == kWhole; });
  std::vector<int64_t> order(has_runs ? num_work : 0);
  std::iota(order.begin(), order.end(), 0);
  auto cost = [&](int64_t w) {
    const Item& item = items[w / items_per_seq];
    const int64_t last = a.lens[item.row + item.count - 1];
    return item.count * (item.part == kWhole ? last : std::min(last, (item.part + 1) * kPart) - item.part * kPart);
  };
  if (has_runs)
    std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) {  // a part's items together: its K/V stay in cache
      const int64_t cx = cost(x), cy = cost(y);
      return cx != cy ? cx > cy : items[x / items_per_seq].part < items[y / items_per_seq].part;
    });
  std::atomic<int64_t> next{0};
  const int64_t tasks = has_runs ? std::min<int64_t>(num_work, at::get_num_threads()) : num_work;
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    // per row of the item: [rows, kD], [rows, part blocks * kBS], [rows, kD], [rows] x 2
    std::vector<float> qf, scores, acc, mx, sums, combined;
    auto take = [&, i = begin]() mutable { return has_runs ? next++ : i < end ? i++ : num_work; };
    for (int64_t taken = take(); taken < num_work; taken = take()) {
      const int64_t w = has_runs ? order[taken] : taken;
      const Item item = items[w / items_per_seq];
      const int64_t h0 = w % items_per_seq * heads, part = item.part;
      auto part_tokens = [&](int64_t r, int64_t p) { return std::min(a.lens[item.row + r], (p + 1) * kPart) - p * kPart; };
      qf.resize(item.count * rows * kD);
      for (int64_t r = 0; r < item.count; ++r) {
        const T* q = a.q + (item.row + r) * a.q_row + h0 * kG * kD;  // this item's query heads are adjacent
        for (int64_t i = 0; i < rows * kD; ++i) qf[r * rows * kD + i] = to_float(q, i) * a.scale;
      }
      // a run's part p, every kv head of the item, into acc_p [count, rows, kD], mx_p and sums_p [count, rows]
      auto attend_part = [&](int64_t p, float* acc_p, float* mx_p, float* sums_p) {
        int64_t slot[kRunMax * kG], len[kRunMax * kG], longest = 0;  // one kv head's rows, token-major
        for (int64_t r = 0; r < item.count; ++r) longest = std::max(longest, part_tokens(r, p));
        const int64_t* table_p = a.tables + item.row * a.max_blocks + p * kPartBlocks;
        for (int64_t hh = 0; hh < heads; ++hh) {
          for (int64_t r = 0; r < item.count; ++r)
            for (int64_t g = 0; g < kG; ++g) {
              slot[r * kG + g] = r * rows + hh * kG + g;
              len[r * kG + g] = part_tokens(r, p);
            }
          const int64_t offset = (h0 + hh) * kSpan;
          kervan::attend_run<T, kD, kBS, kChains>(
              item.count * kG, slot, len, (longest + kBS - 1) / kBS, qf.data(), acc_p, mx_p, sums_p,
              [&](int64_t j) { return a.k + table_p[j] * a.block_stride + offset; },
              [&](int64_t j) { return a.v + table_p[j] * a.block_stride + offset; }, scores);
        }
      };
      if (part == kWhole) {
        const int64_t parts = parts_of(item.row), step = item.count * rows;
        acc.assign(parts * step * kD, 0.f);
        mx.resize(parts * step);
        sums.resize(parts * step);
        for (int64_t p = 0; p < parts; ++p)
          attend_part(p, acc.data() + p * step * kD, mx.data() + p * step, sums.data() + p * step);
        for (int64_t i = 0; i < step; ++i)
          combine_row(kD, parts, step, acc.data() + i * kD, mx.data() + i, sums.data() + i, combined,
                      a.out + (item.row * a.Hq + h0 * kG) * kD + (i / rows * a.Hq + i % rows) * kD);
        continue;
      }
      const int64_t j0 = part * kPartBlocks;  // this part's first block
      int64_t n_tokens[kRunMax], nblocks = 0;
      for (int64_t r = 0; r < item.count; ++r) {
        n_tokens[r] = part_tokens(r, part);
        nblocks = std::max(nblocks, (n_tokens[r] + kBS - 1) / kBS);
      }
      const int64_t stride = nblocks * kBS, span = rows * stride;
      const int64_t* table = a.tables + item.row * a.max_blocks + j0;
      scores.resize(item.count * span);  // whole blocks, so every store is a whole vector
      acc.assign(item.count * rows * kD, 0.f);
      mx.resize(item.count * rows);
      sums.resize(item.count * rows);
      float* __restrict__ sc = scores.data();
      auto k_at = [&](int64_t j) { return a.k + table[j] * a.block_stride + h0 * kSpan; };
      auto v_at = [&](int64_t j) { return a.v + table[j] * a.block_stride + h0 * kSpan; };
      for (int64_t j = 0; j < std::min(nblocks, kAhead); ++j) {
        prefetch(k_at(j), heads * kSpan);
        prefetch(v_at(j), heads * kSpan);
      }
      auto score_rows = [&]<int64_t kN>() {
        // scores: K is [head_dim, block_size] per (block, head), so a block's scores for
        // one query head accumulate as kCols vectors, d by d
        for (int64_t j = 0; j < nblocks; ++j) {
          if (j + kAhead < nblocks) {
            prefetch(k_at(j + kAhead), heads * kSpan);
            prefetch(v_at(j + kAhead), heads * kSpan);  // ready for the V pass
          }
          for (int64_t hh = 0; hh < heads; ++hh) {
            const T* __restrict__ kb = k_at(j) + hh * kSpan;
            Vec s[kN][kChains][kG][kCols];
            for (auto& row : s)
              for (auto& chain : row)
                for (auto& g : chain)
                  for (auto& x : g) x = Vec(0.f);
            // unrolled (32 steps of d), so the accumulators live in registers: GCC otherwise keeps them on the
            // stack. Unrolled whole, the file took twice as long to compile for no gain on a cold KV walk
#pragma GCC unroll 32
            for (int64_t d = 0; d < kD; d += kChains) {
#pragma GCC unroll 4
              for (int64_t ch = 0; ch < kChains; ++ch) {
                Vec krow[kCols];
#pragma GCC unroll 8
                for (int64_t c = 0; c < kCols; ++c) krow[c] = load_floats(kb + (d + ch) * kBS + c * kW);
#pragma GCC unroll 4
                for (int64_t r = 0; r < kN; ++r) {
                  const float* qh = qf.data() + (r * rows + hh * kG) * kD;
#pragma GCC unroll 16
                  for (int64_t g = 0; g < kG; ++g) {
                    const Vec qv(qh[g * kD + d + ch]);
#pragma GCC unroll 8
                    for (int64_t c = 0; c < kCols; ++c) s[r][ch][g][c] = at::vec::fmadd(qv, krow[c], s[r][ch][g][c]);
                  }
                }
              }
            }
            for (int64_t r = 0; r < kN; ++r)
              for (int64_t g = 0; g < kG; ++g)
                for (int64_t c = 0; c < kCols; ++c) {
                  Vec total = s[r][0][g][c];
                  if constexpr (kChains == 2) total = total + s[r][1][g][c];
                  total.store(sc + r * span + (hh * kG + g) * stride + j * kBS + c * kW);
                }
          }
        }
        for (int64_t r = 0; r < kN; ++r)
          for (int64_t h = 0; h < rows; ++h)
            sums[r * rows + h] = softmax_in_place(sc + r * span + h * stride, n_tokens[r], &mx[r * rows + h]);
        // values: V is [block_size, head_dim] per (block, head); kChunk columns of the
        // output at a time stay in registers over a block's tokens, a row's tokens in order
        for (int64_t j = 0; j < nblocks; ++j) {
          const int64_t t0 = j * kBS;
          for (int64_t hh = 0; hh < heads; ++hh) {
            const T* __restrict__ vb = v_at(j) + hh * kSpan;
            for (int64_t c0 = 0; c0 < kD; c0 += kChunk) {
              Vec part_v[kN][kG][kChunkVecs];
              for (int64_t r = 0; r < kN; ++r)
                for (int64_t g = 0; g < kG; ++g)
                  for (int64_t u = 0; u < kChunkVecs; ++u)
                    part_v[r][g][u] = Vec::loadu(acc.data() + (r * rows + hh * kG + g) * kD + c0 + u * kW);
              for (int64_t i = 0; i < kBS && t0 + i < n_tokens[kN - 1]; ++i) {
                Vec v[kChunkVecs];
                for (int64_t u = 0; u < kChunkVecs; ++u) v[u] = load_floats(vb + i * kD + c0 + u * kW);
#pragma GCC unroll 4
                for (int64_t r = 0; r < kN; ++r) {
                  if (t0 + i >= n_tokens[r]) continue;  // past this row's own length
                  const float* p_h = sc + r * span + hh * kG * stride + t0;
                  for (int64_t g = 0; g < kG; ++g) {
                    const Vec p(p_h[g * stride + i]);
                    for (int64_t u = 0; u < kChunkVecs; ++u) part_v[r][g][u] = at::vec::fmadd(p, v[u], part_v[r][g][u]);
                  }
                }
              }
              for (int64_t r = 0; r < kN; ++r)
                for (int64_t g = 0; g < kG; ++g)
                  for (int64_t u = 0; u < kChunkVecs; ++u)
                    part_v[r][g][u].store(acc.data() + (r * rows + hh * kG + g) * kD + c0 + u * kW);
            }
          }
        }
      };
      switch (item.count) {  // rows of a run come in length order: the last is the longest
        case 4: if constexpr (kRowsMax >= 4) { score_rows.template operator()<4>(); break; } [[fallthrough]];
        case 3: if constexpr (kRowsMax >= 3) { score_rows.template operator()<3>(); break; } [[fallthrough]];
        case 2: if constexpr (kRowsMax >= 2) { score_rows.template operator()<2>(); break; } [[fallthrough]];
        default: score_rows.template operator()<1>();
      }
      for (int64_t r = 0; r < item.count; ++r) {
        const int64_t b = item.row + r, parts = first_part[b + 1] - first_part[b];
        const float* acc_r = acc.data() + r * rows * kD;
        if (parts == 1) {  // the whole sequence: normalise in place
          T* out = a.out + (b * a.Hq + h0 * kG) * kD;
          for (int64_t h = 0; h < rows; ++h) {
            const float inv = 1.f / sums[r * rows + h];
            for (int64_t d = 0; d < kD; ++d) out[h * kD + d] = static_cast<T>(acc_r[h * kD + d] * inv);
          }
        } else {
          const int64_t slot = (first_part[b] + part) * a.Hq + h0 * kG;
          std::copy(acc_r, acc_r + rows * kD, part_acc.begin() + slot * kD);
          std::copy(mx.begin() + r * rows, mx.begin() + (r + 1) * rows, part_max.begin() + slot);
          std::copy(sums.begin() + r * rows, sums.begin() + (r + 1) * rows, part_sum.begin() + slot);
        }
      }
    }
  });
  if (split) combine_parts(a, kD, first_part, part_acc, part_max, part_sum);
}

// q: [B, Hq, D]; kv: [2, num_blocks, Hkv, block_size * D] (K half [D, block_size], V half [block_size, D]); tables: [B, max_blocks] int64; lens: [B] int64
at::Tensor paged_decode(at::Tensor q, at::Tensor kv, at::Tensor tables, at::Tensor lens,
                           double scale) {
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2), "q must be [tokens, heads, head_dim] with dense heads");
  TORCH_CHECK(kv.is_contiguous() && tables.is_contiguous() && lens.is_contiguous());
  TORCH_CHECK(q.scalar_type() == kv.scalar_type(), "q and kv cache dtypes differ");
  TORCH_CHECK(q.size(2) <= kMaxD && q.size(2) % 2 == 0, "head_dim must be a multiple of 2, at most ", kMaxD);
  TORCH_CHECK(kv.size(3) / q.size(2) <= kMaxBS, "block_size must be at most ", kMaxBS);
  TORCH_CHECK(q.size(1) % kv.size(2) == 0 && q.size(1) / kv.size(2) <= kMaxG, "at most ", kMaxG,
              " query heads per kv head");
  auto out = at::empty(q.sizes(), q.options());
  const int64_t D = q.size(2), bs = kv.size(3) / D, G = q.size(1) / kv.size(2);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::BFloat16, at::ScalarType::Half, q.scalar_type(), "paged_decode", [&] {
    const DecodeArgs<scalar_t> args(q, kv, tables, lens, out, scale);
    if constexpr (std::is_same_v<scalar_t, double>) {
      decode_any<scalar_t>(args);
    } else if (bs == 16 && D == 64 && G == 1) decode_vec<scalar_t, 64, 16, 1>(args);
    else if (bs == 16 && D == 64 && G == 2) decode_vec<scalar_t, 64, 16, 2>(args);
    else if (bs == 16 && D == 64 && G == 3) decode_vec<scalar_t, 64, 16, 3>(args);  // SmolLM2-135M/360M
    else if (bs == 16 && D == 64 && G == 4) decode_vec<scalar_t, 64, 16, 4>(args);
    else if (bs == 16 && D == 64 && G == 8) decode_vec<scalar_t, 64, 16, 8>(args);
    else if (bs == 16 && D == 128 && G == 1) decode_vec<scalar_t, 128, 16, 1>(args);
    else if (bs == 16 && D == 128 && G == 2) decode_vec<scalar_t, 128, 16, 2>(args);
    else if (bs == 16 && D == 128 && G == 3) decode_vec<scalar_t, 128, 16, 3>(args);
    else if (bs == 16 && D == 128 && G == 4) decode_vec<scalar_t, 128, 16, 4>(args);
    else if (bs == 16 && D == 128 && G == 8) decode_vec<scalar_t, 128, 16, 8>(args);
    else decode_any<scalar_t>(args);
  });
  return out;
}

template <typename T>
static void write_impl(at::Tensor& kv, const at::Tensor& k, const at::Tensor& v,
                       const at::Tensor& slots) {
  const int64_t N = k.size(0), Hkv = k.size(1), D = k.size(2), bs = kv.size(3) / D;
  const int64_t block_stride = Hkv * bs * D, half = kv.stride(0);
  T* kc = kv.data_ptr<T>();
  T* vc = kc + half;
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  const int64_t k_row = k.stride(0), v_row = v.stride(0);  // views into one qkv output: strided rows
  const int64_t* sp = slots.data_ptr<int64_t>();
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t blk = sp[t] / bs, off = sp[t] % bs;
      for (int64_t h = 0; h < Hkv; ++h) {
        T* kdst = kc + blk * block_stride + h * D * bs + off;  // K: [head_dim, block_size]
        T* vdst = vc + blk * block_stride + (h * bs + off) * D;  // V: [block_size, head_dim]
        const T* ks = kp + t * k_row + h * D;
        const T* vs = vp + t * v_row + h * D;
        for (int64_t d = 0; d < D; ++d) kdst[d * bs] = ks[d];
        std::memcpy(vdst, vs, D * sizeof(T));
      }
    }
  });
}

// Store new tokens' K/V ([N, Hkv, D] each, rows may be strided) at slots (block_id * block_size + offset).
void write_kv(at::Tensor kv, at::Tensor k, at::Tensor v, at::Tensor slots) {
  TORCH_CHECK(kv.is_contiguous() && slots.is_contiguous());
  for (const at::Tensor* t : {&k, &v})
    TORCH_CHECK(t->dim() == 3 && t->stride(2) == 1 && t->stride(1) == t->size(2),
                "k and v must be [tokens, kv_heads, head_dim] with dense heads");
  TORCH_CHECK(k.scalar_type() == kv.scalar_type() && v.scalar_type() == kv.scalar_type());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::BFloat16, at::ScalarType::Half, kv.scalar_type(), "write_kv",
                                  [&] { write_impl<scalar_t>(kv, k, v, slots); });
}

TORCH_LIBRARY(kervan, m) {
  m.def("write_kv(Tensor(a!) kv, Tensor k, Tensor v, Tensor slots) -> ()", &write_kv);
  m.def("paged_decode(Tensor q, Tensor kv, Tensor tables, Tensor lens, float scale) -> Tensor", &paged_decode);
}
