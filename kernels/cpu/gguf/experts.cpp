// The grouped GGUF linear of a mixture of experts (experts.h). At 16 decode streams routed
// top-8 over 64 experts each expert gets ~2 rows, so one gguf::linear call per expert paid
// the call, the activation quantization and the thread fork ~40 times per projection per
// layer. Here the rows are quantized once, and one parallel loop runs the work items of every
// expert that got rows: linear.cpp's items (a register of weight tiles x a row tile, or a
// register pair x all of the expert's rows on AMX), on the expert's own slice of the stack.
// The kernels and their row-invariant float part are linear()'s, so results match it bit for bit.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <vector>

#include "../common.h"
#include "dispatch.h"
#include "experts.h"
#include "kernel.h"

#ifdef LOCALLLM_GGUF_KERNELS
namespace localllm_cpu::gguf {
namespace {

// linear.cpp's row tile (the kernels exist for 1, 2 and 4 rows; 4 fit the registers of AVX-512VL)
#if defined(__AVX512VL__)
constexpr int64_t kRowTile = 4;
#else
constexpr int64_t kRowTile = 2;
#endif

// One expert that got rows: its activations, output rows and weight slice, and its first work item.
struct Group {
  Activations a;
  float* y;
  Packed w;
  int64_t first_item, amx_units, m_tiles;
};

// Rows [0, n) as row tiles of kRowTile, then 2 and 1: (first row, kernel index 2, 1, 0).
std::pair<int64_t, int> row_tile(int64_t n, int64_t index) {
  const int64_t full = n / kRowTile;
  if (index < full) return {index * kRowTile, kRowTile == 4 ? 2 : 1};
  int64_t m = full * kRowTile;
  const int64_t left = n - m;
  if (kRowTile == 4 && left >= 2) {
    if (index == full) return {m, 1};
    m += 2;
  }
  return {m, 0};
}

int64_t row_tile_count(int64_t n) {
  const int64_t left = n % kRowTile;
  return n / kRowTile + (kRowTile == 4 && left >= 2 ? 1 : 0) + (left % 2);
}

}  // namespace

void linear_grouped(const float* x, int64_t R, int64_t K, const Packed& w, int64_t E, int64_t N,
                    const int64_t* offsets, int64_t type, int64_t levels, float* y) {
  TileKernels kernels;
  LOCALLLM_CHECK(tile_kernels_legacy(type, kernels) || tile_kernels_kquant(type, kernels) ||
                     tile_kernels_table(type, kernels),
                 "GGUF block type ", type, " has no CPU kernel");
  if (R == 0) return;
  const Layout l = layout(type);
  const int64_t nb = K / 32, tiles = N / kTileN, d_row = K / l.super * l.d_halves;
  const Activations all = quantize_rows(x, R, K, levels);
#ifdef LOCALLLM_GGUF_AVX512
  const int64_t pairs = tiles / 2;
#else
  const int64_t pairs = 0;
#endif
  const int64_t units = pairs + (tiles - 2 * pairs);
  const int lv = static_cast<int>(levels - 1);
  int64_t min_rows = 0;
#ifdef LOCALLLM_GGUF_AMX
  min_rows = pairs > 0 ? amx_min_rows() : 0;
#endif
  // The kernels address level lv of row m at (lv * M + m): with two levels an expert's rows
  // need their own [levels, n] block, copied out of the one quantization (exact bytes).
  thread_local std::vector<int8_t> xq;
  thread_local std::vector<float> xd;
  if (levels > 1) {
    xq.resize(static_cast<size_t>(levels * R * K));
    xd.resize(static_cast<size_t>(levels * R * nb));
  }
  std::vector<Group> groups;
  int64_t items = 0;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t r0 = offsets[e], n = offsets[e + 1] - r0;
    if (n == 0) continue;
    Activations a{all.xq + r0 * K, all.xd + r0 * nb, all.xs + r0 * nb, all.xs16 + r0 * 2 * nb, n, K};
    if (levels > 1) {
      int8_t* q = xq.data() + levels * r0 * K;
      float* s = xd.data() + levels * r0 * nb;
      for (int64_t v = 0; v < levels; ++v) {
        std::memcpy(q + v * n * K, all.xq + (v * R + r0) * K, static_cast<size_t>(n * K));
        std::memcpy(s + v * n * nb, all.xd + (v * R + r0) * nb, static_cast<size_t>(n * nb) * sizeof(float));
      }
      a.xq = q, a.xd = s;
    }
    const int64_t t0 = e * tiles;
    const Packed we{w.codes + t0 * nb * l.code_bytes, w.hi + t0 * nb * l.hi_bytes, w.scales + t0 * nb * l.scale_bytes,
                    w.d + t0 * d_row};
    const int64_t amx_units = min_rows > 0 && n >= min_rows ? pairs : 0;
    const int64_t m_tiles = row_tile_count(n);
    groups.push_back({a, y + r0 * N, we, items, amx_units, m_tiles});
    items += amx_units + (units - amx_units) * m_tiles;
  }
  parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
#ifdef LOCALLLM_GGUF_AMX
    thread_local std::vector<uint8_t> wbuf;
    bool configured = false;
#endif
    // the group of item `begin`, then walked forward (items are in group order)
    size_t g = std::upper_bound(groups.begin(), groups.end(), begin,
                                [](int64_t i, const Group& gr) { return i < gr.first_item; }) -
               groups.begin() - 1;
    for (int64_t i = begin; i < end; ++i) {
      while (g + 1 < groups.size() && groups[g + 1].first_item <= i) ++g;
      const Group& gr = groups[g];
      const int64_t j = i - gr.first_item;
      const bool on_amx = j < gr.amx_units;
      const int64_t u = on_amx ? j : gr.amx_units + (j - gr.amx_units) / gr.m_tiles;
      const bool is_pair = u < pairs;
      const int64_t t = is_pair ? 2 * u : 2 * pairs + (u - pairs);
#ifdef LOCALLLM_GGUF_AMX
      if (on_amx) {
        configured = true;
        if (wbuf.size() < static_cast<size_t>(nb * 512)) wbuf.resize(nb * 512);
        kernels.amx[lv](gr.w, t, nb, gr.a, gr.y, N, wbuf.data());
        continue;
      }
#endif
      const auto [m0, tm] = row_tile(gr.a.M, (j - gr.amx_units) % gr.m_tiles);
      kernels.fn[is_pair ? 1 : 0][tm][lv](gr.w, t, nb, gr.a, m0, gr.y, N);
    }
#ifdef LOCALLLM_GGUF_AMX
    if (configured) _tile_release();
#endif
  });
}

}  // namespace localllm_cpu::gguf
#endif  // LOCALLLM_GGUF_KERNELS

namespace localllm_cpu::gguf {

// The block around the grouped calls: at one decode stream the torch ops that sorted, gathered,
// activated and summed (~12 of them) cost ~40% of a layer's experts (each op's dispatch, and
// caches cold after the weights' stream); here they are loops over T * k rows.
void moe_experts(const float* x, int64_t T, int64_t H, const float* weights, const int64_t* ids, int64_t k,
                 int64_t E, int64_t I, const Projection& w13, const Projection* w3, const Projection& w2,
                 const float* b13, const float* b2, float limit, float alpha, int64_t levels, float* y) {
  const int64_t R = T * k;
  std::fill(y, y + T * H, 0.f);
  if (R == 0) return;
  // a stable counting sort of the (token, slot) pairs by expert: order[p] = the pair in row p
  thread_local std::vector<int64_t> offsets, cursor;
  offsets.assign(E + 1, 0);
  for (int64_t i = 0; i < R; ++i) {
    LOCALLLM_CHECK(ids[i] >= 0 && ids[i] < E, "expert id ", ids[i], " outside [0, ", E, ")");
    ++offsets[ids[i] + 1];
  }
  for (int64_t e = 0; e < E; ++e) offsets[e + 1] += offsets[e];
  cursor.assign(offsets.begin(), offsets.end() - 1);
  const std::unique_ptr<int64_t[]> order(new int64_t[R]);
  for (int64_t i = 0; i < R; ++i) order[cursor[ids[i]]++] = i;
  // scratch of the call only (a prefill's rows would otherwise stay held), uninitialised: each
  // is written whole before it is read
  const std::unique_ptr<float[]> rows(new float[R * H]), h(new float[R * 2 * I]), act(new float[R * I]);
  for (int64_t p = 0; p < R; ++p) std::memcpy(&rows[p * H], x + order[p] / k * H, H * sizeof(float));
  if (w3 == nullptr) {
    run_linear_grouped(rows.get(), R, H, w13.w, E, 2 * I, offsets.data(), w13.type, levels, h.get());
  } else {  // gate and up of two block types: two calls, their halves side by side as one would give
    float* up = act.get();  // free until the activation
    run_linear_grouped(rows.get(), R, H, w13.w, E, I, offsets.data(), w13.type, levels, up);
    for (int64_t p = 0; p < R; ++p) std::memcpy(&h[p * 2 * I], &up[p * I], I * sizeof(float));
    run_linear_grouped(rows.get(), R, H, w3->w, E, I, offsets.data(), w3->type, levels, up);
    for (int64_t p = 0; p < R; ++p) std::memcpy(&h[p * 2 * I + I], &up[p * I], I * sizeof(float));
  }
  int64_t e = 0;  // row p's expert, walked forward (rows are in expert order)
  for (int64_t p = 0; p < R; ++p) {
    while (offsets[e + 1] <= p) ++e;
    float* hp = &h[p * 2 * I];
    if (b13 != nullptr)
      for (int64_t j = 0; j < 2 * I; ++j) hp[j] += b13[e * 2 * I + j];
    float* ap = &act[p * I];
    if (limit > 0) {
      for (int64_t j = 0; j < I; ++j) {
        const float g = std::min(hp[j], limit);
        const float u = std::min(std::max(hp[I + j], -limit), limit) + 1.f;
        const float s = 1.f / (1.f + std::exp(-(g * alpha)));
        ap[j] = u * g * s;
      }
    } else {
      for (int64_t j = 0; j < I; ++j) {
        const float g = hp[j];
        ap[j] = g / (1.f + std::exp(-g)) * hp[I + j];
      }
    }
  }
  float* out = rows.get();  // x's gathered rows are done with; down's rows are as long (H)
  run_linear_grouped(act.get(), R, I, w2.w, E, H, offsets.data(), w2.type, levels, out);
  e = 0;
  for (int64_t p = 0; p < R; ++p) {
    while (offsets[e + 1] <= p) ++e;
    float* op = &out[p * H];
    if (b2 != nullptr)
      for (int64_t j = 0; j < H; ++j) op[j] += b2[e * H + j];
    const float wt = weights[order[p]];
    for (int64_t j = 0; j < H; ++j) op[j] *= wt;
  }
  // a second pass, so the product above is rounded before the sum (as the torch ops did)
  for (int64_t p = 0; p < R; ++p) {
    float* yt = y + order[p] / k * H;
    const float* op = &out[p * H];
    for (int64_t j = 0; j < H; ++j) yt[j] += op[j];
  }
}

}  // namespace localllm_cpu::gguf
