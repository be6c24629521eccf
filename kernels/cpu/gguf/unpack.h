// Reading one 32-weight block of a packed layout (formats.h) back into registers, for either
// ISA (isa.h): the 8 code registers and the per-lane scale dv and offset factor cv of each
// 16-weight half (equal halves except for Q6_K). The linear and the dense expansion share it.
#pragma once

#include "formats.h"
#include "isa.h"

#ifdef LOCALLLM_GGUF_KERNELS
namespace localllm_cpu::gguf {

// Pointers to the Isa::kTiles tiles a register covers.
template <class Fm, class Isa>
struct Tiles {
  const uint8_t* codes[Isa::kTiles];
  const uint8_t* hi[Isa::kTiles];
  const uint8_t* scales[Isa::kTiles];
  const uint16_t* d[Isa::kTiles];
  Tiles(const Packed& w, int64_t t, int64_t nb) {
    for (int i = 0; i < Isa::kTiles; ++i) {
      const TileView<Fm> v(w, t + i, nb);
      codes[i] = v.codes, hi[i] = v.hi, scales[i] = v.scales, d[i] = v.d;
    }
  }
};

// wv[r]: the codes of register r (weights first(r)..+3 of each row, formats.h): unsigned
// 0..63 for nibble codes, signed int8 for int8 and table codes (Offset: table codes + 128,
// as unsigned bytes, the kernels' offset form; int8 codes are left to the caller).
template <class Fm, class Isa, bool Offset = false>
inline void unpack_codes(const Tiles<Fm, Isa>& t, int64_t b, typename Isa::VI (&wv)[8]) {
  using VI = typename Isa::VI;
  if constexpr (Fm::codes == Codes::kInt8) {
    for (int r = 0; r < 8; ++r) wv[r] = Isa::load(t.codes, b * 256 + 32 * r);
    return;
  } else {
    const VI mask = Isa::set1(0x0f);
    for (int p = 0; p < 4; ++p) {
      const VI raw = Isa::load(t.codes, b * 128 + 32 * p);
      wv[2 * p] = Isa::and_(raw, mask);
      wv[2 * p + 1] = Isa::and_(Isa::srl16(raw, 4), mask);
    }
    if constexpr (Fm::hi_bits == 1) {  // bit r of the plane -> bit 4 (16-bit shifts: no byte shift exists)
      const VI h = Isa::load(t.hi, b * 32), bit = Isa::set1(0x10);
      for (int r = 0; r < 8; ++r)
        wv[r] = Isa::or_(wv[r], Isa::and_(r <= 4 ? Isa::sll16(h, 4 - r) : Isa::srl16(h, r - 4), bit));
    } else if constexpr (Fm::hi_bits == 2) {  // bits 2(r%4), +1 of plane r/4 -> bits 4, 5
      const VI h0 = Isa::load(t.hi, b * 64), h1 = Isa::load(t.hi, b * 64 + 32), bits = Isa::set1(0x30);
      for (int r = 0; r < 8; ++r) {
        const VI h = r < 4 ? h0 : h1;
        const int s = 2 * (r % 4);
        wv[r] = Isa::or_(wv[r], Isa::and_(s <= 4 ? Isa::sll16(h, 4 - s) : Isa::srl16(h, s - 4), bits));
      }
    }
    if constexpr (Fm::codes == Codes::kTable)
      for (int r = 0; r < 8; ++r) wv[r] = Isa::table(wv[r], Offset ? OffsetTable<Fm::table>::values : Fm::table);
  }
}

// dv[h], cv[h]: w = dv * q + cv for the weights of half h of block b (fp32, exact products
// of the file's fields, so dv * q + cv rounds once, as the gguf package's reference does).
template <class Fm, class Isa>
inline void block_scales(const Tiles<Fm, Isa>& t, int64_t b, typename Isa::VF (&dv)[2], typename Isa::VF (&cv)[2]) {
  using VF = typename Isa::VF;
  constexpr int64_t per_super = Fm::super / 32;
  const int64_t sb = b / per_super;
  if constexpr (Fm::scale == Scale::kD) {
    dv[0] = Isa::half(t.d, b * 8);
    cv[0] = dv[0] * static_cast<float>(Fm::offset);
  } else if constexpr (Fm::scale == Scale::kDM) {
    dv[0] = Isa::half(t.d, b * 16);
    cv[0] = Isa::half(t.d, b * 16 + 8);
  } else if constexpr (Fm::scale == Scale::kKQuant) {
    const VF d = Isa::half(t.d, sb * 16), dmin = Isa::half(t.d, sb * 16 + 8);
    dv[0] = d * Isa::cvt(Isa::u8to32(t.scales, b * 16));
    cv[0] = -(dmin * Isa::cvt(Isa::u8to32(t.scales, b * 16 + 8)));
  } else if constexpr (Fm::scale == Scale::kK6) {
    const VF d = Isa::half(t.d, sb * 8);
    dv[0] = d * Isa::cvt(Isa::i8to32(t.scales, b * 16));
    dv[1] = d * Isa::cvt(Isa::i8to32(t.scales, b * 16 + 8));
    cv[0] = dv[0] * -32.f;
    cv[1] = dv[1] * -32.f;
  } else if constexpr (Fm::scale == Scale::kIQ4XS) {
    dv[0] = Isa::half(t.d, sb * 8) * Isa::cvt(Isa::i8to32(t.scales, b * 8));
    cv[0] = VF{};
  } else if constexpr (Fm::scale == Scale::kE8M0) {
    dv[0] = Isa::e8m0_half(Isa::u8to32(t.scales, b * 8));
    cv[0] = VF{};
  }
  if constexpr (!Fm::halves) dv[1] = dv[0], cv[1] = cv[0];
}

}  // namespace localllm_cpu::gguf
#endif  // LOCALLLM_GGUF_KERNELS
