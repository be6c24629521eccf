// The vector operations the GGUF kernels are written in, per ISA: Avx2 (one 8-row tile per
// 256-bit register) and Avx512 (two adjacent tiles per 512-bit register, lanes 0-7 tile t and
// 8-15 tile t + 1: one activation broadcast feeds 16 output rows, and one vpdpbusd does twice
// the 256-bit one's work at the same rate, measured). The kernels (kernel.h) and the layouts'
// unpacking (unpack.h) use only these, so a layout is written once for both.
#pragma once

#include <cstdint>

#include "gguf.h"

#ifdef LOCALLLM_GGUF_KERNELS
#include <immintrin.h>

namespace localllm_cpu::gguf {

struct Avx2 {
  static constexpr int kTiles = 1, kLanes = 8;
  // Signed codes take the sign trick (|w| against x with w's sign): maddubs and vpdpbusd
  // multiply unsigned by signed bytes.
  static constexpr bool kSignedByOffset = false;
  using VI = __m256i;
  using VF = __m256;
  static VI load(const uint8_t* const* p, int64_t off) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p[0] + off));
  }
  static VI set1(uint8_t v) { return _mm256_set1_epi8(static_cast<char>(v)); }
  static VI zero() { return _mm256_setzero_si256(); }
  static VI and_(VI a, VI b) { return _mm256_and_si256(a, b); }
  static VI or_(VI a, VI b) { return _mm256_or_si256(a, b); }
  static VI xor_(VI a, VI b) { return _mm256_xor_si256(a, b); }
  static VI srl16(VI a, int s) { return _mm256_srli_epi16(a, s); }
  static VI sll16(VI a, int s) { return _mm256_slli_epi16(a, s); }
  static VI add32(VI a, VI b) { return _mm256_add_epi32(a, b); }
  static VI table(VI idx, const int8_t* t) {  // 16-entry byte table, indices < 16
    return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(t))), idx);
  }
  // each lane: acc + sum of 4 products u8 w x s8 x
  static VI madd(VI acc, VI w, VI x) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, w, x);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, w, x);
#else
    // maddubs saturates int16 at 32767: fine for codes <= 63 (63 * 128 * 2), and signed codes
    // take the sign trick, so |w| <= 127 (127 * 128 * 2 = 32512)
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
#endif
  }
  static VI madd_signed(VI acc, VI w, VI x) { return madd(acc, _mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w)); }
  static VI bcast32(int32_t v) { return _mm256_set1_epi32(v); }
  static VF cvt(VI v) { return _mm256_cvtepi32_ps(v); }
  static VF fma(VF a, VF b, VF c) { return _mm256_fmadd_ps(a, b, c); }
  static VF set1f(float v) { return _mm256_set1_ps(v); }
  static VF half(const uint16_t* const* p, int64_t off) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p[0] + off)));
  }
  static VI u8to32(const uint8_t* const* p, int64_t off) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p[0] + off)));
  }
  static VI i8to32(const uint8_t* const* p, int64_t off) {
    return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p[0] + off)));
  }
  // 2^(e - 128) of E8M0 exponents (ggml's GGML_E8M0_TO_FP32_HALF, denormal below e = 2)
  static VF e8m0_half(VI e) {
    const VI normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
    const VI tiny = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
    return _mm256_castsi256_ps(_mm256_blendv_epi8(normal, tiny, _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e)));
  }
  static void store(float* y, VF v) { _mm256_storeu_ps(y, v); }
};

#if defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define LOCALLLM_GGUF_AVX512 1
struct Avx512 {
  static constexpr int kTiles = 2, kLanes = 16;
  // AVX-512 has no byte sign op: signed codes are offset, u = q + 128 (q xor 0x80), and
  // sum q x = sum u x - 128 sum x, the -128 dv joining the offset factor cv.
  static constexpr bool kSignedByOffset = true;
  using VI = __m512i;
  using VF = __m512;
  static VI load(const uint8_t* const* p, int64_t off) {
    return _mm512_inserti64x4(
        _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p[0] + off))),
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p[1] + off)), 1);
  }
  static VI set1(uint8_t v) { return _mm512_set1_epi8(static_cast<char>(v)); }
  static VI zero() { return _mm512_setzero_si512(); }
  static VI and_(VI a, VI b) { return _mm512_and_si512(a, b); }
  static VI or_(VI a, VI b) { return _mm512_or_si512(a, b); }
  static VI xor_(VI a, VI b) { return _mm512_xor_si512(a, b); }
  static VI srl16(VI a, int s) { return _mm512_srli_epi16(a, s); }
  static VI sll16(VI a, int s) { return _mm512_slli_epi16(a, s); }
  static VI add32(VI a, VI b) { return _mm512_add_epi32(a, b); }
  static VI table(VI idx, const int8_t* t) {
    return _mm512_shuffle_epi8(_mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(t))), idx);
  }
  static VI madd(VI acc, VI w, VI x) { return _mm512_dpbusd_epi32(acc, w, x); }
  static VI madd_signed(VI acc, VI w, VI x) = delete;  // kSignedByOffset
  static VI bcast32(int32_t v) { return _mm512_set1_epi32(v); }
  static VF cvt(VI v) { return _mm512_cvtepi32_ps(v); }
  static VF fma(VF a, VF b, VF c) { return _mm512_fmadd_ps(a, b, c); }
  static VF set1f(float v) { return _mm512_set1_ps(v); }
  static VF half(const uint16_t* const* p, int64_t off) {
    const __m256i h = _mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p[0] + off))),
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(p[1] + off)), 1);
    return _mm512_cvtph_ps(h);
  }
  static __m128i bytes16(const uint8_t* const* p, int64_t off) {
    return _mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p[0] + off)),
                              _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p[1] + off)));
  }
  static VI u8to32(const uint8_t* const* p, int64_t off) { return _mm512_cvtepu8_epi32(bytes16(p, off)); }
  static VI i8to32(const uint8_t* const* p, int64_t off) { return _mm512_cvtepi8_epi32(bytes16(p, off)); }
  static VF e8m0_half(VI e) {
    const VI normal = _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23);
    const VI tiny = _mm512_sllv_epi32(_mm512_set1_epi32(0x00200000), e);
    return _mm512_castsi512_ps(_mm512_mask_blend_epi32(_mm512_cmplt_epi32_mask(e, _mm512_set1_epi32(2)), normal, tiny));
  }
  static void store(float* y, VF v) { _mm512_storeu_ps(y, v); }
};
#endif

}  // namespace localllm_cpu::gguf
#endif  // LOCALLLM_GGUF_KERNELS
