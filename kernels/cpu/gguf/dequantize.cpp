// The packed weight back as a dense matrix (gguf.h): for prefill-sized batches, where a
// blocked GEMM on the dense weight (oneDNN, AMX where present) beats integer dot products.
// Reads each block through the kernels' own unpacking (unpack.h), so what is multiplied and
// what is expanded cannot disagree; w = dv * q + cv rounds once, as the gguf package does.
#include "../common.h"
#include "unpack.h"

#ifdef LOCALLLM_GGUF_KERNELS
namespace localllm_cpu::gguf {
namespace {

template <class Fm>
void dequantize_type(const Packed& w, int64_t N, int64_t K, bool bf16, void* out) {
  const int64_t tiles = N / kTileN, nb = K / 32;
  float* of = bf16 ? nullptr : static_cast<float*>(out);
  uint16_t* ob = bf16 ? static_cast<uint16_t*>(out) : nullptr;
  parallel_for(0, tiles * nb, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t = i / nb, b = i % nb;
      const Tiles<Fm, Avx2> at_t(w, t, nb);
      __m256i wv[8];
      unpack_codes<Fm, Avx2>(at_t, b, wv);
      __m256 dv[2], cv[2];
      block_scales<Fm, Avx2>(at_t, b, dv, cv);
      alignas(32) uint8_t bytes[8][32];
      alignas(32) float dvs[2][8], cvs[2][8];
      for (int r = 0; r < 8; ++r) _mm256_store_si256(reinterpret_cast<__m256i*>(bytes[r]), wv[r]);
      for (int h = 0; h < 2; ++h) _mm256_store_ps(dvs[h], dv[h]), _mm256_store_ps(cvs[h], cv[h]);
      for (int64_t n = 0; n < kTileN; ++n) {
        uint8_t q[32];  // row n's codes in weight order
        for (int r = 0; r < 8; ++r) {
          const int first = Fm::codes == Codes::kInt8 ? 4 * r : 8 * (r / 2) + 4 * (r % 2);
          std::memcpy(q + first, &bytes[r][4 * n], 4);
        }
        // a code offset (Q4_0's -8, Q6_K's -32) goes on the code, as the reference does:
        // d * (q - 32) is exact where d * q + (-32 d) could round twice
        // (and a layout without an offset multiplies only: + 0 would turn a -0 weight into +0)
        constexpr bool centred = Fm::scale != Scale::kDM && Fm::scale != Scale::kKQuant;
        constexpr float code_off = Fm::scale == Scale::kD ? Fm::offset : Fm::scale == Scale::kK6 ? -32.f : 0.f;
        float wf[32];
#pragma omp simd
        for (int j = 0; j < 32; ++j) {
          const float qf = Fm::is_signed ? static_cast<float>(static_cast<int8_t>(q[j])) : static_cast<float>(q[j]);
          wf[j] = centred ? dvs[j / 16][n] * (qf + code_off) : dvs[j / 16][n] * qf + cvs[j / 16][n];
        }
        const int64_t off = (t * kTileN + n) * K + b * 32;
        if (!bf16) {
          std::memcpy(of + off, wf, sizeof(wf));
        } else {
          for (int j = 0; j < 32; ++j) {  // round to nearest even: add 0x7fff + the kept lowest bit, truncate
            uint32_t bits;
            std::memcpy(&bits, &wf[j], 4);
            ob[off + j] = static_cast<uint16_t>((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
          }
        }
      }
    }
  });
}

}  // namespace

void dequantize(const Packed& w, int64_t N, int64_t K, int64_t type, bool bf16, void* out) {
  const bool known = with_format(type, [&](auto fm) { dequantize_type<decltype(fm)>(w, N, K, bf16, out); });
  LOCALLLM_CHECK(known, "GGUF block type ", type, " has no CPU kernel");
}

}  // namespace localllm_cpu::gguf
#endif  // LOCALLLM_GGUF_KERNELS
