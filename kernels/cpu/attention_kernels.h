// The attention kernels' inner loops, as templates, for the files that instantiate them: one
// file per fixed head_dim (attention_d64.cpp, attention_d128.cpp, attention_d256.cpp) and one
// for any other head_dim (attention_generic.cpp), each for every group size 1..kMaxGroup, so
// that no translation unit holds all ~110 instantiations (the cold build's critical path).
// attention.cpp's driver picks one through the pick_* functions declared at the end.
#pragma once

#include <utility>

#include "attention.h"
#include "common.h"

namespace localllm_cpu::attention_detail {

// The online-softmax step of one head over a block of n scores p (in place: they become the
// block's weights): the running max m and sum l move on; returns the factor the accumulator
// is rescaled by (0 on the first block, where m = -inf).
inline float softmax_block(float* p, int64_t n, float& m, float& l) {
  float mx = m;
  for (int64_t i = 0; i < n; ++i) mx = std::max(mx, p[i]);
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) {
    p[i] = fast_exp(p[i] - mx);
    sum += p[i];
  }
  const float corr = fast_exp(m - mx);
  l = l * corr + sum;
  m = mx;
  return corr;
}

// One (query token, KV head, key range) of attention: the G query heads of the KV head
// read each key and value row once. Returns the running max and sum of exp; acc holds the
// unnormalised output. Templated on G so the per-key loops over the heads unroll.
template <int G>
void attend_range(const float* qrow, const float* kc, const float* vc, const int32_t* table,
                  int64_t key_begin, int64_t key_end, int64_t block_size, int64_t row, int64_t D,
                  float scale, float* m, float* l, float (*acc)[kMaxHeadDim], float (*p)[kMaxBlock]) {
  for (int g = 0; g < G; ++g) {
    m[g] = -std::numeric_limits<float>::infinity();
    l[g] = 0.f;
    std::fill(acc[g], acc[g] + D, 0.f);
  }
  for (int64_t start = key_begin; start < key_end;) {
    const int64_t blk = table[start / block_size], off = start % block_size;
    const int64_t n = std::min(block_size - off, key_end - start);
    const float* kb = kc + (blk * block_size + off) * row;
    const float* vb = vc + (blk * block_size + off) * row;
    for (int64_t i = 0; i < n; ++i) {
      const float* kr = kb + i * row;
      float s[G];
      for (int g = 0; g < G; ++g) {
        const float* qg = qrow + g * D;
        float a = 0.f;
#pragma omp simd reduction(+ : a)
        for (int64_t d = 0; d < D; ++d) a += qg[d] * kr[d];
        s[g] = a * scale;
      }
      for (int g = 0; g < G; ++g) p[g][i] = s[g];
    }
    for (int g = 0; g < G; ++g) {
      const float corr = softmax_block(p[g], n, m[g], l[g]);
      float* a = acc[g];
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) a[d] *= corr;
    }
    for (int64_t i = 0; i < n; ++i) {
      const float* vr = vb + i * row;
      for (int g = 0; g < G; ++g) {
        const float w = p[g][i];
        float* a = acc[g];
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) a[d] += w * vr[d];
      }
    }
    start += n;
  }
}

// The same for a head_dim known at compile time (64, 128: most models): each head's query
// and output accumulator live in vector registers across the whole key range (GCC vector
// types: AVX-512 registers where the CPU has them, pairs of AVX2 ones elsewhere), and each
// key row is loaded once for the G heads. The generic version above keeps them in memory
// with a runtime length, which measured ~50 cycles per (key, head) on AVX-512.
typedef float vf16 __attribute__((vector_size(64)));

inline vf16 load16(const float* p) {
  vf16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline float hsum16(vf16 v) {
  const vf16 a = v + __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  const vf16 b = a + __builtin_shufflevector(a, a, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  const vf16 c = b + __builtin_shufflevector(b, b, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  return c[0] + c[1];
}

// One block of n keys (kb, vb: its first K and V rows) for the G heads of one query, whose
// scaled query q and accumulator acc are vector arrays the caller keeps (in registers when
// the caller is a loop over blocks, as below).
template <int G, int C>
inline void attend_block_fixed(const vf16 (&q)[G][C], vf16 (&acc)[G][C], const float* kb, const float* vb,
                               int64_t n, int64_t row, float* m, float* l, float (*p)[kMaxBlock]) {
  for (int64_t i = 0; i < n; ++i) {
    vf16 k[C];
    for (int c = 0; c < C; ++c) k[c] = load16(kb + i * row + 16 * c);
    for (int g = 0; g < G; ++g) {
      vf16 t = q[g][0] * k[0];
      for (int c = 1; c < C; ++c) t += q[g][c] * k[c];
      p[g][i] = hsum16(t);
    }
  }
  for (int g = 0; g < G; ++g) {
    const float corr = softmax_block(p[g], n, m[g], l[g]);
    for (int c = 0; c < C; ++c) acc[g][c] *= corr;
  }
  for (int64_t i = 0; i < n; ++i) {
    vf16 v[C];
    for (int c = 0; c < C; ++c) v[c] = load16(vb + i * row + 16 * c);
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < C; ++c) acc[g][c] += p[g][i] * v[c];
  }
}

template <int G, int D>
void attend_range_fixed(const float* qrow, const float* kc, const float* vc, const int32_t* table,
                        int64_t key_begin, int64_t key_end, int64_t block_size, int64_t row, int64_t,
                        float scale, float* m, float* l, float (*acc_out)[kMaxHeadDim], float (*p)[kMaxBlock]) {
  constexpr int C = D / 16;
  vf16 q[G][C], acc[G][C];
  for (int g = 0; g < G; ++g) {
    m[g] = -std::numeric_limits<float>::infinity();
    l[g] = 0.f;
    for (int c = 0; c < C; ++c) q[g][c] = load16(qrow + g * D + 16 * c) * scale, acc[g][c] = vf16{};
  }
  for (int64_t start = key_begin; start < key_end;) {
    const int64_t blk = table[start / block_size], off = start % block_size;
    const int64_t n = std::min(block_size - off, key_end - start);
    const int64_t first = (blk * block_size + off) * row;
    attend_block_fixed<G, C>(q, acc, kc + first, vc + first, n, row, m, l, p);
    start += n;
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) std::memcpy(acc_out[g] + 16 * c, &acc[g][c], sizeof(vf16));
}

// nq consecutive query tokens of one sequence (a short extend over a cached prefix): query
// j sees keys [0, keys0 + j). Each key block is read from memory once for all of them (then
// from L1), where one item per query token read the whole context once per token. The
// running max, sum and accumulator of each (query, head) live in m, l [nq, G] and acc
// [nq, G, D] between blocks.
template <int G, int D>
void attend_multi_fixed(const float* q0, int64_t q_stride, int64_t nq, int64_t keys0, const float* kc,
                        const float* vc, const int32_t* table, int64_t key_begin, int64_t key_end,
                        int64_t block_size, int64_t row, float scale, float* m, float* l, float* acc) {
  constexpr int C = D / 16;
  for (int64_t i = 0; i < nq * G; ++i) m[i] = -std::numeric_limits<float>::infinity(), l[i] = 0.f;
  std::fill(acc, acc + nq * G * D, 0.f);
  float p[G][kMaxBlock];
  for (int64_t start = key_begin; start < key_end;) {
    const int64_t blk = table[start / block_size], off = start % block_size;
    const int64_t n = std::min(block_size - off, key_end - start);
    const int64_t first = (blk * block_size + off) * row;
    for (int64_t j = 0; j < nq; ++j) {
      const int64_t nj = std::min<int64_t>(n, keys0 + j - start);  // causal: this block's keys query j sees
      if (nj <= 0) continue;
      vf16 q[G][C], a[G][C];
      float* aj = acc + j * G * D;
      for (int g = 0; g < G; ++g)
        for (int c = 0; c < C; ++c) {
          q[g][c] = load16(q0 + j * q_stride + g * D + 16 * c) * scale;
          a[g][c] = load16(aj + g * D + 16 * c);
        }
      attend_block_fixed<G, C>(q, a, kc + first, vc + first, nj, row, m + j * G, l + j * G, p);
      for (int g = 0; g < G; ++g)
        for (int c = 0; c < C; ++c) std::memcpy(aj + g * D + 16 * c, &a[g][c], sizeof(vf16));
    }
    start += n;
  }
}

// One query token's attention for one KV head over keys [key_begin, key_end): see attend_range.
using AttendFn = void (*)(const float*, const float*, const float*, const int32_t*, int64_t, int64_t, int64_t,
                          int64_t, int64_t, float, float*, float*, float (*)[kMaxHeadDim], float (*)[kMaxBlock]);
// nq consecutive query tokens of one sequence: see attend_multi_fixed.
using MultiFn = void (*)(const float*, int64_t, int64_t, int64_t, const float*, const float*, const int32_t*,
                         int64_t, int64_t, int64_t, int64_t, float, float*, float*, float*);

// The kernels for group size g (1..kMaxGroup) at head_dim D (64, 128, 256), and the generic
// one for any head_dim; pick_multi has no generic form (nullptr: attend token by token).
AttendFn pick_attend_d64(int64_t g);
AttendFn pick_attend_d128(int64_t g);
AttendFn pick_attend_d256(int64_t g);
AttendFn pick_attend_generic(int64_t g);
MultiFn pick_multi_d64(int64_t g);
MultiFn pick_multi_d128(int64_t g);
MultiFn pick_multi_d256(int64_t g);

// fn<G> of each kernel, for pick_group
template <int D>
struct Fixed {
  template <int G>
  struct Range {
    static constexpr AttendFn fn = &attend_range_fixed<G, D>;
  };
  template <int G>
  struct Multi {
    static constexpr MultiFn fn = &attend_multi_fixed<G, D>;
  };
};
template <int G>
struct Generic {
  static constexpr AttendFn fn = &attend_range<G>;
};
using Groups = std::make_integer_sequence<int, kMaxGroup>;

// The table of fn<G> for G = 1..kMaxGroup, indexed by g - 1 (what the pick_* functions return).
template <typename Fn, template <int> class Of, int... Gs>
Fn pick_group(int64_t g, std::integer_sequence<int, Gs...>) {
  static constexpr Fn table[] = {Of<Gs + 1>::fn...};
  return g >= 1 && g <= static_cast<int64_t>(sizeof...(Gs)) ? table[g - 1] : nullptr;
}

}  // namespace localllm_cpu::attention_detail
