// The GGUF block linear (gguf.h): the activations quantized once, then work units of one
// register of weight tiles (two 8-row tiles with AVX-512 VNNI, the last of an odd count alone;
// one elsewhere) x one tile of activation rows, the row tiles innermost so a thread reuses
// its weight tiles (from cache) across them. On CPUs with AMX, from kAmxMinRows rows (a
// batch of decodes) a register pair's unit is all its rows on the tile unit instead
// (kernel.h's amx_kernel: the weights unpacked once per call, not once per 4 rows), with
// results bit for bit those of the row tiles.
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <vector>

#include "../common.h"
#include "kernel.h"

#ifdef LOCALLLM_GGUF_KERNELS
namespace localllm_cpu::gguf {

// Activation rows per kernel call: with 32 vector registers (AVX-512VL) 4 rows x 2 levels of
// integer chains fit beside the 8 weight registers; with 16, 2.
#if defined(__AVX512VL__)
constexpr int64_t kTileM = 4;
#else
constexpr int64_t kTileM = 2;
#endif

#ifdef LOCALLLM_GGUF_AMX
// From this many rows the AMX kernel takes a register pair's rows (below, the VNNI row tiles
// are as fast: measured on one Xeon thread, see docs/benchmarks.md 2026-12-04).
constexpr int64_t kAmxMinRows = 8;

int64_t amx_min_rows() {
  // ARCH_REQ_XCOMP_PERM (0x1023) for XFEATURE_XTILEDATA (18): once per process
  static const bool granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  const char* env = std::getenv("LOCALLLM_GGUF_AMX");  // read per call: a benchmark's A/B in one process
  const int64_t rows = env != nullptr && *env != 0 ? std::atoll(env) : kAmxMinRows;
  return granted ? rows : 0;
}
#endif

namespace {

// Row tiles of rows [begin, M): kTileM rows, then the tail as 2 and 1 (the kernels exist for
// 1, 2 and 4 rows), as (first row, kernel index).
std::vector<std::pair<int64_t, int>> row_tiles(int64_t begin, int64_t M) {
  std::vector<std::pair<int64_t, int>> out;
  for (int64_t m = begin; m < M;) {
    const int64_t left = M - m;
    const int64_t tm = left >= kTileM ? kTileM : (left >= 2 ? 2 : 1);
    out.emplace_back(m, tm == 4 ? 2 : (tm == 2 ? 1 : 0));
    m += tm;
  }
  return out;
}

}  // namespace

void linear(const float* x, int64_t M, int64_t K, const Packed& w, int64_t N, int64_t type, int64_t levels, float* y) {
  TileKernels kernels;
  LOCALLLM_CHECK(tile_kernels_legacy(type, kernels) || tile_kernels_kquant(type, kernels) ||
                     tile_kernels_table(type, kernels),
                 "GGUF block type ", type, " has no CPU kernel");
  const int64_t nb = K / 32, tiles = N / kTileN;
  const Activations a = quantize_rows(x, M, K, levels);
#ifdef LOCALLLM_GGUF_AVX512
  const int64_t pairs = tiles / 2;
#else
  const int64_t pairs = 0;
#endif
  const int64_t units = pairs + (tiles - 2 * pairs);
  const int lv = static_cast<int>(levels - 1);
  // from kAmxMinRows rows, all rows of each register pair go to the AMX kernel; a lone
  // tile's rows (and every row below kAmxMinRows, or without AMX) to the VNNI/AVX2 row tiles
  bool amx = false;
#ifdef LOCALLLM_GGUF_AMX
  const int64_t min_rows = amx_min_rows();
  amx = pairs > 0 && min_rows > 0 && M >= min_rows;
#endif
  const auto row_tile = row_tiles(0, M);
  const int64_t m_tiles = static_cast<int64_t>(row_tile.size());
  // work items: first the AMX pairs (one item each: all rows), then units x row tiles for the
  // units left (all of them without AMX), row tiles innermost
  const int64_t amx_units = amx ? pairs : 0;
  const int64_t items = amx_units + (units - amx_units) * m_tiles;
  parallel_for(0, items, amx ? 1 : 4, [&](int64_t begin, int64_t end) {
#ifdef LOCALLLM_GGUF_AMX
    thread_local std::vector<uint8_t> wbuf;
    bool configured = false;
#endif
    for (int64_t i = begin; i < end; ++i) {
      const bool on_amx = i < amx_units;
      const int64_t u = on_amx ? i : amx_units + (i - amx_units) / m_tiles;
      const bool is_pair = u < pairs;
      const int64_t t = is_pair ? 2 * u : 2 * pairs + (u - pairs);
#ifdef LOCALLLM_GGUF_AMX
      if (on_amx) {
        configured = true;
        if (wbuf.size() < static_cast<size_t>(nb * 512)) wbuf.resize(nb * 512);
        kernels.amx[lv](w, t, nb, a, y, N, wbuf.data());
        continue;
      }
#endif
      const auto [m0, tm] = row_tile[(i - amx_units) % m_tiles];
      kernels.fn[is_pair ? 1 : 0][tm][lv](w, t, nb, a, m0, y, N);
    }
#ifdef LOCALLLM_GGUF_AMX
    if (configured) _tile_release();  // the thread's tile state goes back (no save on each switch)
#endif
  });
}

}  // namespace localllm_cpu::gguf
#endif  // LOCALLLM_GGUF_KERNELS
