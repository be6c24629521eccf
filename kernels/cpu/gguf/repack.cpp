// Repacking a GGUF weight into its packed layout, once at load (formats.h). Each file block
// is decoded to its 32-weight blocks' codes and fields (decode<T>), which are then written in
// the tile layout the kernels read; no value changes on the way.
#include "formats.h"

#include "../common.h"

namespace localllm_cpu::gguf {

Layout layout(int64_t type) {
  Layout out{};
  with_format(type, [&](auto fm) {
    using Fm = decltype(fm);
    out = {Fm::block_weights, Fm::block_bytes, Fm::code_bytes, Fm::hi_bytes, Fm::S_ * kTileN, Fm::super,
           Fm::F_ * kTileN};
  });
  return out;
}

}  // namespace localllm_cpu::gguf

// plain C++ (no intrinsics): built on every CPU, for the x86 and the generic kernels alike
namespace localllm_cpu::gguf {
namespace {

// One 32-weight block of a row, decoded: q the codes (unsigned up to 6 bits, table indices,
// or int8), s the block's 8-bit sub-scales, h the fp16 fields of its block or super-block.
struct Block {
  uint8_t q[32];
  uint8_t s[2];
  uint16_t h[2];
};

inline uint16_t u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

// 32 weights of 16 bytes of nibbles: byte j holds weight j (low) and j + 16 (high)
inline void nibbles(const uint8_t* qs, uint8_t* q) {
  for (int j = 0; j < 16; ++j) q[j] = qs[j] & 15, q[j + 16] = qs[j] >> 4;
}

// Q4_K/Q5_K's 6-bit scale and min of sub-block j from the 12 packed bytes (ggml's get_scale_min_k4)
inline void scale_min_k4(const uint8_t* s, int j, uint8_t& sc, uint8_t& m) {
  if (j < 4) {
    sc = s[j] & 63, m = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

template <int64_t T>
void decode(const uint8_t* blk, int sub, Block& o);  // blk: the file block; sub: 32-block within it

template <> void decode<kQ4_0>(const uint8_t* blk, int, Block& o) { o.h[0] = u16(blk), nibbles(blk + 2, o.q); }
template <> void decode<kQ4_1>(const uint8_t* blk, int, Block& o) {
  o.h[0] = u16(blk), o.h[1] = u16(blk + 2), nibbles(blk + 4, o.q);
}
template <> void decode<kIQ4_NL>(const uint8_t* blk, int, Block& o) { o.h[0] = u16(blk), nibbles(blk + 2, o.q); }
template <> void decode<kMXFP4>(const uint8_t* blk, int, Block& o) { o.s[0] = blk[0], nibbles(blk + 1, o.q); }
template <> void decode<kQ8_0>(const uint8_t* blk, int, Block& o) { o.h[0] = u16(blk), std::memcpy(o.q, blk + 2, 32); }

inline void fifth_bits(const uint8_t* qh4, uint8_t* q) {
  uint32_t qh;
  std::memcpy(&qh, qh4, 4);
  for (int j = 0; j < 32; ++j) q[j] |= ((qh >> j) & 1) << 4;
}
template <> void decode<kQ5_0>(const uint8_t* blk, int, Block& o) {
  o.h[0] = u16(blk), nibbles(blk + 6, o.q), fifth_bits(blk + 2, o.q);
}
template <> void decode<kQ5_1>(const uint8_t* blk, int, Block& o) {
  o.h[0] = u16(blk), o.h[1] = u16(blk + 2), nibbles(blk + 8, o.q), fifth_bits(blk + 4, o.q);
}

template <> void decode<kQ4_K>(const uint8_t* blk, int sub, Block& o) {
  o.h[0] = u16(blk), o.h[1] = u16(blk + 2);
  scale_min_k4(blk + 4, sub, o.s[0], o.s[1]);
  const uint8_t* qs = blk + 16 + 32 * (sub / 2);  // chunk of 32 bytes: sub-blocks 2g (low), 2g + 1 (high)
  for (int j = 0; j < 32; ++j) o.q[j] = sub % 2 ? qs[j] >> 4 : qs[j] & 15;
}
template <> void decode<kQ5_K>(const uint8_t* blk, int sub, Block& o) {
  o.h[0] = u16(blk), o.h[1] = u16(blk + 2);
  scale_min_k4(blk + 4, sub, o.s[0], o.s[1]);
  const uint8_t* qh = blk + 16;
  const uint8_t* qs = blk + 48 + 32 * (sub / 2);
  for (int j = 0; j < 32; ++j) o.q[j] = (sub % 2 ? qs[j] >> 4 : qs[j] & 15) | (((qh[j] >> sub) & 1) << 4);
}
template <> void decode<kQ6_K>(const uint8_t* blk, int sub, Block& o) {
  o.h[0] = u16(blk + 208);
  o.s[0] = blk[192 + 2 * sub], o.s[1] = blk[192 + 2 * sub + 1];  // int8 scales of the two 16-halves
  for (int j = 0; j < 32; ++j) {
    const int i = 32 * sub + j, h = i / 128, k = i % 128;  // half of 128 weights, index in it
    const uint8_t lo = k < 64 ? blk[64 * h + k] & 15 : blk[64 * h + k - 64] >> 4;
    const uint8_t hi = (blk[128 + 32 * h + k % 32] >> (2 * (k / 32))) & 3;
    o.q[j] = lo | (hi << 4);
  }
}
template <> void decode<kIQ4_XS>(const uint8_t* blk, int sub, Block& o) {
  o.h[0] = u16(blk);
  const int ls = ((blk[4 + sub / 2] >> (4 * (sub % 2))) & 15) | (((u16(blk + 2) >> (2 * sub)) & 3) << 4);
  o.s[0] = static_cast<uint8_t>(static_cast<int8_t>(ls - 32));
  nibbles(blk + 8 + 16 * sub, o.q);
}

template <class Fm>
constexpr int first_of(int r) {  // the first weight of register r (formats.h)
  return Fm::codes == Codes::kInt8 ? 4 * r : 8 * (r / 2) + 4 * (r % 2);
}

template <int64_t T>
void repack_type(const uint8_t* w, int64_t N, int64_t K, uint8_t* codes, uint8_t* hi, uint8_t* scales, uint16_t* d) {
  using Fm = Format<T>;
  const int64_t nb = K / 32, tiles = N / kTileN, row_bytes = K / Fm::block_weights * Fm::block_bytes;
  const int64_t per_block = Fm::block_weights / 32, per_super = Fm::super / 32, nsup = K / Fm::super;
  parallel_for(0, tiles * nb, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t = i / nb, b = i % nb;
      uint8_t* cp = codes + i * Fm::code_bytes;
      uint8_t* hp = hi + i * Fm::hi_bytes;
      if constexpr (Fm::hi_bytes > 0) std::memset(hp, 0, Fm::hi_bytes);
      for (int64_t n = 0; n < kTileN; ++n) {
        Block o{};
        decode<T>(w + (t * kTileN + n) * row_bytes + (b / per_block) * Fm::block_bytes,
                  static_cast<int>(b % per_block), o);
        for (int s = 0; s < Fm::S_; ++s) scales[(i * Fm::S_ + s) * kTileN + n] = o.s[s];
        if (b % per_super == 0)
          for (int f = 0; f < Fm::F_; ++f) d[((t * nsup + b / per_super) * Fm::F_ + f) * kTileN + n] = o.h[f];
        for (int r = 0; r < 8; ++r)
          for (int j = 0; j < 4; ++j) {
            const uint8_t q = o.q[first_of<Fm>(r) + j];
            if constexpr (Fm::codes == Codes::kInt8) {
              cp[32 * r + 4 * n + j] = q;
            } else {
              if (r % 2 == 0) {
                cp[32 * (r / 2) + 4 * n + j] = q & 15;
              } else {
                cp[32 * (r / 2) + 4 * n + j] |= (q & 15) << 4;
              }
              if constexpr (Fm::hi_bits == 1) hp[4 * n + j] |= ((q >> 4) & 1) << r;
              if constexpr (Fm::hi_bits == 2) hp[32 * (r / 4) + 4 * n + j] |= ((q >> 4) & 3) << (2 * (r % 4));
            }
          }
      }
    }
  });
}

}  // namespace

void repack(const uint8_t* w, int64_t N, int64_t K, int64_t type, uint8_t* codes, uint8_t* hi, uint8_t* scales,
            uint16_t* d) {
  const bool known = with_format(type, [&](auto fm) {
    repack_type<decltype(fm)::type_id>(w, N, K, codes, hi, scales, d);
  });
  LOCALLLM_CHECK(known, "GGUF block type ", type, " has no CPU kernel");
}

}  // namespace localllm_cpu::gguf
