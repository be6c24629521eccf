// The GGUF block linear (gguf.h): the activations quantized once, then work units of one
// register of weight tiles (two 8-row tiles with AVX-512 VNNI, the last of an odd count alone;
// one elsewhere) x one tile of activation rows, the row tiles innermost so a thread reuses
// its weight tiles (from cache) across them.
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

void linear(const float* x, int64_t M, int64_t K, const Packed& w, int64_t N, int64_t type, int64_t levels, float* y) {
  TileKernels kernels;
  TORCH_CHECK(tile_kernels_legacy(type, kernels) || tile_kernels_kquant(type, kernels) ||
                  tile_kernels_table(type, kernels),
              "GGUF block type ", type, " has no CPU kernel");
  const int64_t nb = K / 32, tiles = N / kTileN;
  const Activations a = quantize_rows(x, M, K, levels);
  // row tiles: kTileM rows, then the tail as 2 and 1 (the kernels exist for 1, 2 and 4 rows)
  std::vector<std::pair<int64_t, int>> row_tiles;  // (first row, kernel index)
  for (int64_t m = 0; m < M;) {
    const int64_t left = M - m;
    const int64_t tm = left >= kTileM ? kTileM : (left >= 2 ? 2 : 1);
    row_tiles.emplace_back(m, tm == 4 ? 2 : (tm == 2 ? 1 : 0));
    m += tm;
  }
  const int64_t m_tiles = static_cast<int64_t>(row_tiles.size());
#ifdef LOCALLLM_GGUF_AVX512
  const int64_t pairs = tiles / 2;
#else
  const int64_t pairs = 0;
#endif
  const int64_t units = pairs + (tiles - 2 * pairs);
  const int lv = static_cast<int>(levels - 1);
  at::parallel_for(0, units * m_tiles, 4, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t u = i / m_tiles;
      const auto [m0, tm] = row_tiles[i % m_tiles];
      const bool is_pair = u < pairs;
      const int64_t t = is_pair ? 2 * u : 2 * pairs + (u - pairs);
      kernels.fn[is_pair ? 1 : 0][tm][lv](w, t, nb, a, m0, y, N);
    }
  });
}

}  // namespace localllm_cpu::gguf
#endif  // LOCALLLM_GGUF_KERNELS
