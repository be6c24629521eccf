// The GGUF block types the kernels take, each as a packed layout: what gguf_repack makes of a
// file's blocks once at load, and how the kernels read it back. One struct per type (Format<T>)
// says which code planes, scales and offset it has; the linear (linear.cpp) and the dense
// expansion (dequantize.cpp) are templated on it, so a type is a few lines here, not a kernel.
//
// Every layout keeps the file's values: rows in tiles of 8 (the 8 lanes of a 256-bit register
// are 8 output features, so the integer sums need no horizontal adds), and per tile and
// 32-weight block b (K/32 of them):
//   codes  nibbles: 4 x 32 bytes; byte 4n + j of chunk p holds, for row n of the tile, weight
//          8p + j in its low nibble and weight 8p + 4 + j in its high nibble (two runs of 4
//          consecutive weights, the unit of one integer multiply-add per lane), so unpacked
//          "register" r in 0..7 holds weights first(r) = 8(r/2) + 4(r%2) .. +3 of each row;
//          int8: 8 x 32 bytes, byte 4n + j of chunk r = weight 4r + j of row n.
//   hi     the 5th (5-bit codes: 32 bytes, bit r of byte 4n + j) or 5th and 6th bits (6-bit
//          codes: 64 bytes, bits 2(r%4), 2(r%4)+1 of byte 32(r/4) + 4n + j) of register r's
//          code at (n, j): one shift and mask per register puts them in place.
//   scales 8-bit sub-block scales per lane, [S][8] (Q4_K/Q5_K: scale and min of the block;
//          Q6_K: the scales of its two 16-weight halves; IQ4_XS: scale - 32; MXFP4: exponent).
//   d      fp16 per lane and block (32 weights) or super-block (256): [F][8] (d; d and m; d
//          and dmin).
// A weight is w = dv * q + cv with q the code (or its table value), dv and cv per lane and
// block (or 16-weight half) in fp32, both exact products of the file's fields, so
// dequantize() reproduces the gguf package's values bit for bit and the linear sums
//   sum_i w_i x_i = dv dx sum q_i xq_i + cv (dx sum xq_i)
// on integer multiply-adds against int8 activations (activations.h).
#pragma once

#include <cstdint>

#include "gguf.h"

namespace localllm_cpu::gguf {

enum GGUFType : int64_t {
  kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14, kIQ4_NL = 20,
  kIQ4_XS = 23, kMXFP4 = 39,
};

constexpr int64_t kTileN = 8;

enum class Codes { kNibble, kInt8, kTable };  // 4-bit (plus `hi_bits` planes), int8, 4-bit table index
enum class Scale {
  kD,       // dv = d (per block), cv = offset * d
  kDM,      // dv = d, cv = m (per block)
  kKQuant,  // dv = d * sc, cv = -dmin * m (d, dmin per super-block; sc, m per block)
  kK6,      // per 16-weight half h: dv = d * sc[h], cv = -32 dv (d per super-block)
  kIQ4XS,   // dv = d * (sc - 32) (d per super-block; sc - 32 stored signed)
  kE8M0,    // dv = 2^(e - 128) (GGML_E8M0_TO_FP32_HALF), per block
};

// kvalues_iq4nl and kvalues_mxfp4 of ggml (the second: E2M1 values doubled)
alignas(16) inline constexpr int8_t kIQ4Table[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                                     1,    13,   25,  38,  53,  69,  89,  113};
alignas(16) inline constexpr int8_t kMXFP4Table[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// A table with 128 added to every value (as bytes: value xor 0x80): the AVX-512 kernels'
// offset form of signed codes (isa.h) read straight from the lookup, without an xor per register.
template <const int8_t* T>
struct OffsetTable {
  alignas(16) static constexpr int8_t values[16] = {
      static_cast<int8_t>(T[0] ^ 0x80),  static_cast<int8_t>(T[1] ^ 0x80),  static_cast<int8_t>(T[2] ^ 0x80),
      static_cast<int8_t>(T[3] ^ 0x80),  static_cast<int8_t>(T[4] ^ 0x80),  static_cast<int8_t>(T[5] ^ 0x80),
      static_cast<int8_t>(T[6] ^ 0x80),  static_cast<int8_t>(T[7] ^ 0x80),  static_cast<int8_t>(T[8] ^ 0x80),
      static_cast<int8_t>(T[9] ^ 0x80),  static_cast<int8_t>(T[10] ^ 0x80), static_cast<int8_t>(T[11] ^ 0x80),
      static_cast<int8_t>(T[12] ^ 0x80), static_cast<int8_t>(T[13] ^ 0x80), static_cast<int8_t>(T[14] ^ 0x80),
      static_cast<int8_t>(T[15] ^ 0x80)};
};

// Format<type>: block_weights and block_bytes of the file; the packed layout (codes, hi_bits,
// scale, S sub-scales and F fp16 fields per lane, super: weights per d); offset: kD's code
// offset (Q4_0's -8); table: kTable's values.
template <int64_t T> struct Format;
#define LOCALLLM_FORMAT(T, BW, BB, CODES, HI, SCALE, S, F, SUPER, OFFSET, TABLE)                      \
  template <> struct Format<T> {                                                                  \
    static constexpr int64_t type_id = T, block_weights = BW, block_bytes = BB;                   \
    static constexpr Codes codes = Codes::CODES;                                                   \
    static constexpr int hi_bits = HI;                                                             \
    static constexpr Scale scale = Scale::SCALE;                                                   \
    static constexpr int S_ = S, F_ = F, super = SUPER, offset = OFFSET;                           \
    static constexpr const int8_t* table = TABLE;                                                  \
    static constexpr bool halves = scale == Scale::kK6;       /* two scales per 32-block */        \
    static constexpr bool is_signed = codes != Codes::kNibble; /* int8 codes after unpacking */    \
    static constexpr int64_t code_bytes = codes == Codes::kInt8 ? 256 : 128;                        \
    static constexpr int64_t hi_bytes = 32 * HI;                                                   \
  };
//              type     bw   bb   codes    hi scale    S  F  super offset table
LOCALLLM_FORMAT(kQ4_0,   32,  18,  kNibble, 0, kD,      0, 1, 32,   -8,    nullptr)
LOCALLLM_FORMAT(kQ4_1,   32,  20,  kNibble, 0, kDM,     0, 2, 32,   0,     nullptr)
LOCALLLM_FORMAT(kQ5_0,   32,  22,  kNibble, 1, kD,      0, 1, 32,   -16,   nullptr)
LOCALLLM_FORMAT(kQ5_1,   32,  24,  kNibble, 1, kDM,     0, 2, 32,   0,     nullptr)
LOCALLLM_FORMAT(kQ8_0,   32,  34,  kInt8,   0, kD,      0, 1, 32,   0,     nullptr)
LOCALLLM_FORMAT(kQ4_K,   256, 144, kNibble, 0, kKQuant, 2, 2, 256,  0,     nullptr)
LOCALLLM_FORMAT(kQ5_K,   256, 176, kNibble, 1, kKQuant, 2, 2, 256,  0,     nullptr)
LOCALLLM_FORMAT(kQ6_K,   256, 210, kNibble, 2, kK6,     2, 1, 256,  0,     nullptr)
LOCALLLM_FORMAT(kIQ4_NL, 32,  18,  kTable,  0, kD,      0, 1, 32,   0,     kIQ4Table)
LOCALLLM_FORMAT(kIQ4_XS, 256, 136, kTable,  0, kIQ4XS,  1, 1, 256,  0,     kIQ4Table)
LOCALLLM_FORMAT(kMXFP4,  32,  17,  kTable,  0, kE8M0,   1, 0, 32,   0,     kMXFP4Table)
#undef LOCALLLM_FORMAT

// Calls f(Format<T>{}) for the runtime type; false for a type without a layout.
template <class Fn>
bool with_format(int64_t type, Fn&& f) {
  switch (type) {
    case kQ4_0: f(Format<kQ4_0>{}); return true;
    case kQ4_1: f(Format<kQ4_1>{}); return true;
    case kQ5_0: f(Format<kQ5_0>{}); return true;
    case kQ5_1: f(Format<kQ5_1>{}); return true;
    case kQ8_0: f(Format<kQ8_0>{}); return true;
    case kQ4_K: f(Format<kQ4_K>{}); return true;
    case kQ5_K: f(Format<kQ5_K>{}); return true;
    case kQ6_K: f(Format<kQ6_K>{}); return true;
    case kIQ4_NL: f(Format<kIQ4_NL>{}); return true;
    case kIQ4_XS: f(Format<kIQ4_XS>{}); return true;
    case kMXFP4: f(Format<kMXFP4>{}); return true;
  }
  return false;
}

// The packed tensors of one tile (Packed's pointers advanced to tile t).
template <class Fm>
struct TileView {
  const uint8_t* codes;
  const uint8_t* hi;
  const uint8_t* scales;
  const uint16_t* d;
  TileView(const Packed& w, int64_t t, int64_t nb) {
    codes = w.codes + t * nb * Fm::code_bytes;
    hi = w.hi + t * nb * Fm::hi_bytes;
    scales = w.scales + t * nb * Fm::S_ * kTileN;
    d = w.d + t * (nb * 32 / Fm::super) * Fm::F_ * kTileN;
  }
};

}  // namespace localllm_cpu::gguf
