// CPU kernels that torch has no fast op for: the paged KV write, attention that reads the
// paged pool where it lies, the sampler's row kernels and top-k, and the GGUF block linear.
// Built once per machine by localllm/kernels/cpu_ops.py (with
// -march=native, so the loops below vectorise for the CPU at hand) and registered as
// torch.ops.localllm_cpu.*; their torch references are paged_attention_ref and
// rotary_and_store_kv_ref in the same folder.
//
// Layouts are those of kernels/paged_attention.py: q [T, H, D]; caches
// [num_blocks, block_size, KVH, D] fp32, contiguous; query_start_loc [B + 1], seq_lens [B]
// and block_tables [B, W] int32. Query j of sequence b sits at position
// seq_lens[b] - q_len[b] + j and attends to keys 0..that position.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#ifdef __linux__
#include <sched.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <utility>
#include <vector>

namespace {

constexpr int64_t kMaxHeadDim = 256;
constexpr int64_t kMaxGroup = 16;  // query heads per KV head
constexpr int64_t kMaxBlock = 64;  // tokens per KV block

void check_cache(const at::Tensor& cache, const char* name) {
  TORCH_CHECK(cache.dim() == 4 && cache.scalar_type() == at::kFloat && cache.is_contiguous(),
              name, " must be a contiguous fp32 [num_blocks, block_size, kv_heads, head_dim] tensor");
}

// Writes k[t] and v[t] ([T, KVH, D], rows contiguous) to slot slot_mapping[t]; a negative
// slot (a padding row) writes nothing.
void store_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache, at::Tensor v_cache,
              const at::Tensor& slot_mapping) {
  check_cache(k_cache, "k_cache");
  check_cache(v_cache, "v_cache");
  TORCH_CHECK(k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat, "k and v must be fp32");
  const int64_t T = k.size(0), row = k_cache.size(2) * k_cache.size(3);
  TORCH_CHECK(k.size(1) * k.size(2) == row && v.size(1) * v.size(2) == row, "k/v heads do not match the cache");
  TORCH_CHECK(k.stride(2) == 1 && k.stride(1) == k.size(2) && v.stride(2) == 1 && v.stride(1) == v.size(2),
              "k and v rows must be contiguous");
  const auto slots = slot_mapping.to(at::kLong).contiguous();
  const int64_t* s = slots.data_ptr<int64_t>();
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  float* kc = k_cache.data_ptr<float>();
  float* vc = v_cache.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) {
    if (s[t] < 0) continue;
    TORCH_CHECK(s[t] < num_slots, "slot ", s[t], " is outside the KV pool");
    std::memcpy(kc + s[t] * row, kp + t * k.stride(0), row * sizeof(float));
    std::memcpy(vc + s[t] * row, vp + t * v.stride(0), row * sizeof(float));
  }
}

// e^x for the softmax (x <= 0 there), written so the loops that call it vectorise: glibc's
// expf is scalar. Range reduction to r in [-ln2/2, ln2/2], a degree-6 polynomial, then the
// exponent by bit manipulation; relative error ~1e-7, and -inf gives ~1e-38 (not 0), which
// the callers only ever multiply by zeros.
inline float fast_exp(float x) {
  x = std::max(x, -87.f);
  const float n = std::floor(x * 1.44269504f + 0.5f);
  const float r = x - n * 0.693145752f - n * 1.42860677e-6f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  return p * __builtin_bit_cast(float, (static_cast<int32_t>(n) + 127) << 23);
}

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

using AttendFn = void (*)(const float*, const float*, const float*, const int32_t*, int64_t, int64_t, int64_t,
                          int64_t, int64_t, float, float*, float*, float (*)[kMaxHeadDim], float (*)[kMaxBlock]);

template <int... Gs>
AttendFn pick_attend(int64_t g, int64_t d, std::integer_sequence<int, Gs...>) {
  AttendFn fn = nullptr;
  ((fn = (g == Gs + 1) ? (d == 64 ? &attend_range_fixed<Gs + 1, 64>
                                  : d == 128 ? &attend_range_fixed<Gs + 1, 128> : &attend_range<Gs + 1>)
                       : fn), ...);
  return fn;
}

using MultiFn = void (*)(const float*, int64_t, int64_t, int64_t, const float*, const float*, const int32_t*,
                         int64_t, int64_t, int64_t, int64_t, float, float*, float*, float*);

template <int... Gs>
MultiFn pick_multi(int64_t g, int64_t d, std::integer_sequence<int, Gs...>) {  // nullptr: no fixed head_dim
  MultiFn fn = nullptr;
  ((fn = (g == Gs + 1) ? (d == 64 ? &attend_multi_fixed<Gs + 1, 64>
                                  : d == 128 ? &attend_multi_fixed<Gs + 1, 128> : nullptr)
                       : fn), ...);
  return fn;
}

// Attention for every sequence whose query length is at most max_q (decodes, short
// extends over a cached prefix); the rows of longer sequences are left at zero for the
// caller's prefill path. A work item is one query token, one KV head and one slice of its
// keys: the query heads of that KV head share every key and value row it reads, once, from
// the block it lies in (no gather, no padding to the longest context in the batch). Long
// contexts split into slices when there are too few items for the threads (flash-decoding);
// the slices merge by their max and sum of exp.
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                           const at::Tensor& block_tables, double scale, int64_t max_q, int64_t max_splits) {
  check_cache(k_cache, "k_cache");
  check_cache(v_cache, "v_cache");
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat, "q must be fp32 [T, H, D]");
  const int64_t H = q.size(1), D = q.size(2);
  const int64_t block_size = k_cache.size(1), KVH = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && D <= kMaxHeadDim, "head_dim mismatch or above ", kMaxHeadDim);
  TORCH_CHECK(block_size <= kMaxBlock, "block_size above ", kMaxBlock);
  TORCH_CHECK(H % KVH == 0 && H / KVH <= kMaxGroup, "query heads must be a multiple of KV heads (at most 16 per KV head)");
  const int64_t G = H / KVH, row = KVH * D;
  const AttendFn attend = pick_attend(G, D, std::make_integer_sequence<int, kMaxGroup>{});
  const MultiFn attend_multi = pick_multi(G, D, std::make_integer_sequence<int, kMaxGroup>{});
  const auto qc = q.contiguous();
  const auto qsl = query_start_loc.to(at::kInt).contiguous();
  const auto lens = seq_lens.to(at::kInt).contiguous();
  const auto tables = block_tables.to(at::kInt).contiguous();
  const int64_t B = lens.size(0), W = tables.size(1);
  const int32_t* qs = qsl.data_ptr<int32_t>();
  const int32_t* ls = lens.data_ptr<int32_t>();
  const int32_t* tb = tables.data_ptr<int32_t>();
  const int64_t num_blocks = k_cache.size(0);

  std::vector<int64_t> tok_seq, tok_j;  // one entry per (sequence, query token)
  std::vector<int64_t> item_seq, item_tok;  // per sequence attended here: its index, its first token's
  int64_t max_keys = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = qs[b + 1] - qs[b];
    if (n == 0 || n > max_q) continue;
    TORCH_CHECK(ls[b] >= n && (ls[b] + block_size - 1) / block_size <= W, "seq_lens/block_tables mismatch");
    for (int64_t i = 0; i < (ls[b] + block_size - 1) / block_size; ++i) {
      const int32_t blk = tb[b * W + i];
      TORCH_CHECK(blk >= 0 && blk < num_blocks, "block id ", blk, " is outside the KV pool");
    }
    max_keys = std::max<int64_t>(max_keys, ls[b]);
    item_seq.push_back(b);
    item_tok.push_back(static_cast<int64_t>(tok_seq.size()));
    for (int64_t j = 0; j < n; ++j) {
      tok_seq.push_back(b);
      tok_j.push_back(j);
    }
  }
  auto out = at::zeros_like(qc);
  const int64_t num_toks = static_cast<int64_t>(tok_seq.size());
  if (num_toks == 0) return out;
  const int64_t threads = at::get_num_threads();
  // A work item is (sequence, KV head, key slice), all the sequence's query tokens at once.
  // Slices of at least 4 blocks, enough of them that every thread gets ~4 items.
  const int64_t num_seqs = static_cast<int64_t>(item_seq.size());
  const int64_t want = (4 * threads + num_seqs * KVH - 1) / (num_seqs * KVH);
  // max_splits > 0 caps the slices: at 1 a row's reduction order depends on its own keys only,
  // never on how many sequences share the batch or how long the longest is (--deterministic)
  const int64_t adaptive = std::max<int64_t>(1, std::min(want, max_keys / (4 * block_size)));
  const int64_t splits = max_splits > 0 ? std::min(adaptive, max_splits) : adaptive;
  const int64_t slice = (((max_keys + splits - 1) / splits + block_size - 1) / block_size) * block_size;

  // Partial results per (query token, KV head, slice): [.., G] max and sum, [.., G, D] accumulators.
  const int64_t num_parts = num_toks * KVH * splits;
  std::vector<float> part_m(num_parts * G), part_l(num_parts * G), part_acc(num_parts * G * D);
  const float* qp = qc.data_ptr<float>();
  const float* kc = k_cache.data_ptr<float>();
  const float* vc = v_cache.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  float* op = out.data_ptr<float>();
  // One slice (decodes of short contexts, most batches): a work item holds its rows' whole
  // softmax, so it writes the normalised rows itself and the merge pass is skipped.
  const bool direct = splits == 1;
  const auto write_row = [&](int64_t b, int64_t j, int64_t kvh, const float* acc, int64_t acc_stride,
                             const float* l) {
    float* orow = op + (qs[b] + j) * H * D + kvh * G * D;
    for (int64_t g = 0; g < G; ++g) {
      const float inv = 1.f / l[g];
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) orow[g * D + d] = acc[g * acc_stride + d] * inv;
    }
  };

  at::parallel_for(0, num_seqs * KVH * splits, 1, [&](int64_t begin, int64_t end) {
    float acc[kMaxGroup][kMaxHeadDim];
    float p[kMaxGroup][kMaxBlock];
    std::vector<float> mm(max_q * G), ml(max_q * G), macc(max_q * G * D);
    for (int64_t it = begin; it < end; ++it) {
      const int64_t s = it / (KVH * splits), kvh = (it / splits) % KVH, sp = it % splits;
      const int64_t b = item_seq[s], t0 = item_tok[s], nq = qs[b + 1] - qs[b];
      const int64_t keys0 = ls[b] - nq + 1;  // causal: query j sees keys 0..keys0 + j - 1
      const int64_t k0 = sp * slice, k1 = std::min(keys0 + nq - 1, k0 + slice);
      const float* q0 = qp + qs[b] * H * D + kvh * G * D;
      const auto part = [&](int64_t j) { return ((t0 + j) * KVH + kvh) * splits + sp; };
      if (nq > 1 && attend_multi != nullptr) {
        attend_multi(q0, H * D, nq, keys0, kc + kvh * D, vc + kvh * D, tb + b * W, k0, std::max(k0, k1),
                     block_size, row, fscale, mm.data(), ml.data(), macc.data());
        if (direct) {
          for (int64_t j = 0; j < nq; ++j) write_row(b, j, kvh, &macc[j * G * D], D, &ml[j * G]);
          continue;
        }
        for (int64_t j = 0; j < nq; ++j) {
          std::copy(&mm[j * G], &mm[j * G] + G, &part_m[part(j) * G]);
          std::copy(&ml[j * G], &ml[j * G] + G, &part_l[part(j) * G]);
          std::copy(&macc[j * G * D], &macc[j * G * D] + G * D, &part_acc[part(j) * G * D]);
        }
        continue;
      }
      for (int64_t j = 0; j < nq; ++j) {
        const int64_t kj = std::min(k1, keys0 + j);
        float* pm = &part_m[part(j) * G];
        float* pl = &part_l[part(j) * G];
        if (k0 >= kj) {
          for (int64_t g = 0; g < G; ++g) pm[g] = -std::numeric_limits<float>::infinity(), pl[g] = 0.f;
          continue;
        }
        attend(q0 + j * H * D, kc + kvh * D, vc + kvh * D, tb + b * W, k0, kj, block_size, row, D, fscale, pm,
               pl, acc, p);
        if (direct) {
          write_row(b, j, kvh, acc[0], kMaxHeadDim, pl);
          continue;
        }
        for (int64_t g = 0; g < G; ++g) std::copy(acc[g], acc[g] + D, &part_acc[(part(j) * G + g) * D]);
      }
    }
  });
  if (direct) return out;
  at::parallel_for(0, num_toks * KVH, 1, [&](int64_t begin, int64_t end) {
    for (int64_t tk = begin; tk < end; ++tk) {
      const int64_t t = tk / KVH, kvh = tk % KVH;
      float* orow = op + (qs[tok_seq[t]] + tok_j[t]) * H * D + kvh * G * D;
      for (int64_t g = 0; g < G; ++g) {
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t sp = 0; sp < splits; ++sp) mx = std::max(mx, part_m[(tk * splits + sp) * G + g]);
        float total = 0.f;
        float* o = orow + g * D;
        for (int64_t sp = 0; sp < splits; ++sp) {
          const int64_t it = tk * splits + sp;
          const float w = part_l[it * G + g] == 0.f ? 0.f : std::exp(part_m[it * G + g] - mx);
          total += w * part_l[it * G + g];
          const float* a = &part_acc[(it * G + g) * D];
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) o[d] += w * a[d];
        }
        const float inv = 1.f / total;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) o[d] *= inv;
      }
    }
  });
  return out;
}


// ---- sampling: one row of logits to one token ------------------------------------------
//
// The kernels of localllm/engine/sampler.py's sample_rows and argmax_rows (their torch
// reference and the semantics are there): a row is a temperature softmax whose top-k, top-p
// and min-p cuts are each a weight threshold, drawn by inverse CDF at a given u in (0, 1],
// in vocabulary order. Torch needs ~1 ms for that on a 49k vocabulary on a 2-core CPU (topk,
// softmax, cumsum: a pass and an allocation each); here it is a few vectorised passes, and
// the thresholds are found among the few tokens that can hold them.

constexpr int64_t kChunk = 256;  // the draw and the candidate search skip whole chunks

// The first index of the row's largest value (NaN is never the largest here; torch's argmax
// would return it, but a NaN row has no right answer anyway).
// The largest value of x[0..n) (-inf for none; NaN is skipped).
inline float row_max(const float* x, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
  for (int64_t i = 0; i < n; ++i) m = x[i] > m ? x[i] : m;  // std::max does not vectorise here
  return m;
}

int64_t argmax_row(const float* x, int64_t V) {
  const float m = row_max(x, V);
  for (int64_t c = 0; c < V; c += kChunk) {
    const int64_t e = std::min(V, c + kChunk);
    int hit = 0;
#pragma omp simd reduction(| : hit)
    for (int64_t i = c; i < e; ++i) hit |= x[i] == m;
    if (hit)
      for (int64_t i = c; i < e; ++i)
        if (x[i] == m) return i;
  }
  return 0;
}

struct SampleScratch {
  std::vector<float> w;          // the row's weights, exp((x - max) / T): the likeliest is 1
  std::vector<double> chunk_sum;
  std::vector<float> chunk_max;
  std::vector<float> vals;       // candidate weights
};

// The weights of w >= lo (and > 0) in the chunks whose largest weight reaches lo.
void gather(const SampleScratch& s, int64_t V, float lo, std::vector<float>& out) {
  out.resize(V);
  float* o = out.data();
  const float* w = s.w.data();
  int64_t n = 0;
  for (size_t c = 0; c < s.chunk_max.size(); ++c) {
    if (s.chunk_max[c] < lo || s.chunk_max[c] <= 0.f) continue;
    const int64_t e = std::min<int64_t>(V, (c + 1) * kChunk);
    for (int64_t i = c * kChunk; i < e; ++i) {  // branch-free: most tokens fail the test
      o[n] = w[i];
      n += w[i] >= lo && w[i] > 0.f;
    }
  }
  out.resize(n);
}

double mass_from(const std::vector<float>& vals, float v) {
  double acc = 0;
  const float* p = vals.data();
  const int64_t n = static_cast<int64_t>(vals.size());
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += p[i] >= v ? p[i] : 0.f;
  return acc;
}

// top-k: the k-th largest weight (0: fewer than k tokens have weight). At least k tokens
// lie in the k chunks of largest maxima, so the k-th largest chunk maximum bounds it below.
float kth_weight(SampleScratch& s, int64_t V, int64_t k) {
  float lo = 0.f;
  if (k <= static_cast<int64_t>(s.chunk_max.size())) {
    std::vector<float> maxima(s.chunk_max);
    std::nth_element(maxima.begin(), maxima.begin() + (k - 1), maxima.end(), std::greater<float>());
    lo = maxima[k - 1];
  }
  gather(s, V, lo, s.vals);
  if (static_cast<int64_t>(s.vals.size()) < k) return 0.f;
  std::nth_element(s.vals.begin(), s.vals.begin() + (k - 1), s.vals.end(), std::greater<float>());
  return s.vals[k - 1];
}

// top-p over the tokens of weight >= lo: the largest weight v whose tokens of weight >= v
// hold at least `want` (the weight of the first token, in likelihood order, whose running
// mass reaches it), by bisection on the bits of v (positive floats order as their bits).
float top_p_weight(SampleScratch& s, int64_t V, float lo, double want) {
  double mass = 0;
  for (float tau : {0x1p-8f, 0x1p-24f, 0.f}) {
    gather(s, V, std::max(tau, lo), s.vals);
    mass = mass_from(s.vals, 0.f);
    if (mass >= want) break;
  }
  if (s.vals.empty() || mass < want) return lo;  // rounding: everything is kept
  const auto [mn, mx] = std::minmax_element(s.vals.begin(), s.vals.end());
  int32_t a = __builtin_bit_cast(int32_t, *mn), b = __builtin_bit_cast(int32_t, *mx);
  while (a < b) {  // invariant: mass_from(bits a) >= want
    const int32_t mid = a + (b - a + 1) / 2;
    if (mass_from(s.vals, __builtin_bit_cast(float, mid)) >= want) {
      a = mid;
    } else {
      b = mid - 1;
    }
  }
  return __builtin_bit_cast(float, a);
}

int64_t sample_row(const float* x, int64_t V, double temp, int64_t k, double p, double min_p, double u,
                   SampleScratch& s) {
  if (temp <= 0) return argmax_row(x, V);
  const float m = row_max(x, V);
  if (!(m > -std::numeric_limits<float>::infinity()) || std::isinf(m)) return argmax_row(x, V);
  const int64_t nc = (V + kChunk - 1) / kChunk;
  s.w.resize(V);
  s.chunk_sum.resize(nc);
  s.chunk_max.resize(nc);
  float* w = s.w.data();
  const float inv = static_cast<float>(1.0 / temp);
  double total = 0;
  for (int64_t c = 0; c < nc; ++c) {
    const int64_t b = c * kChunk, e = std::min(V, b + kChunk);
    float cs = 0.f, cm = 0.f;
#pragma omp simd reduction(+ : cs) reduction(max : cm)
    for (int64_t i = b; i < e; ++i) {
      const float d = (x[i] - m) * inv;
      const float wi = d < -87.f ? 0.f : fast_exp(d);  // -inf (a masked token) gives exactly 0
      w[i] = wi;
      cs += wi;
      cm = wi > cm ? wi : cm;
    }
    s.chunk_sum[c] = cs;
    s.chunk_max[c] = cm;
    total += cs;
  }
  // every cut is a weight floor: top-k's k-th weight, top-p's, and min-p's (the likeliest
  // token weighs exactly 1, fast_exp(0))
  float thr = 0.f;
  if (k < V) thr = kth_weight(s, V, k);
  if (p < 1.0) {
    const double mass = thr > 0.f ? mass_from(s.vals, thr) : total;  // top-p's share is of top-k's tokens
    thr = top_p_weight(s, V, thr, p * mass);
  }
  thr = std::max(thr, static_cast<float>(min_p));
  if (thr > 0.f) {
    total = 0;
    for (int64_t c = 0; c < nc; ++c) {
      if (s.chunk_max[c] < thr) {
        s.chunk_sum[c] = 0;
        continue;
      }
      const int64_t b = c * kChunk, e = std::min(V, b + kChunk);
      float cs = 0.f;
#pragma omp simd reduction(+ : cs)
      for (int64_t i = b; i < e; ++i) {
        w[i] = w[i] >= thr ? w[i] : 0.f;
        cs += w[i];
      }
      s.chunk_sum[c] = cs;
      total += cs;
    }
  }
  // the draw: the first token whose running mass reaches u of the total, a chunk at a time
  const double target = u * total;
  double acc = 0;
  int64_t last = -1;
  for (int64_t c = 0; c < nc; ++c) {
    if (s.chunk_sum[c] <= 0) continue;
    last = c;
    if (acc + s.chunk_sum[c] < target) {
      acc += s.chunk_sum[c];
      continue;
    }
    const int64_t b = c * kChunk, e = std::min(V, b + kChunk);
    int64_t pos = -1;
    for (int64_t i = b; i < e; ++i) {
      if (w[i] <= 0.f) continue;
      acc += w[i];
      pos = i;
      if (acc >= target) return i;
    }
    return pos;  // rounding: the chunk's sum said it is here
  }
  for (int64_t i = std::min(V, (last + 1) * kChunk) - 1; i >= 0; --i)  // rounding past the end
    if (w[i] > 0.f) return i;
  return argmax_row(x, V);
}

// The row is split into one part per thread, in the order parallel_for hands out the columns
// of the head's gguf_linear that wrote it, so each thread reads what it wrote, from its own
// cache (one thread reading a whole 49k row fresh from the other core's: ~100 us, not ~10).
at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat, "logits must be fp32 [rows, vocab]");
  const auto x = logits.contiguous();
  const int64_t R = x.size(0), V = x.size(1);
  auto out = at::empty({R}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), V / 4096));
  std::vector<std::pair<float, int64_t>> best(R * parts);
  at::parallel_for(0, R * parts, 1, [&](int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t part = u / R, r = u % R, b = part * V / parts, e = (part + 1) * V / parts;
      const int64_t i = b + argmax_row(xp + r * V + b, e - b);
      best[u] = {xp[r * V + i], i};
    }
  });
  for (int64_t r = 0; r < R; ++r) {
    auto top = best[r];
    for (int64_t part = 1; part < parts; ++part)  // a later part wins only if strictly larger: first index
      if (best[part * R + r].first > top.first) top = best[part * R + r];
    op[r] = top.second;
  }
  return out;
}

// The indices of each row's k largest values, largest first (ties: the lower index first;
// NaN counts as the smallest). torch.topk takes ~300 us for k = 8 of a 49k row on a 2-core
// CPU; here the k-th largest chunk maximum bounds the k-th value from below, so only the
// tokens above it are sorted.
at::Tensor topk_indices(const at::Tensor& logits, int64_t k) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat, "logits must be fp32 [rows, vocab]");
  const auto x = logits.contiguous();
  const int64_t R = x.size(0), V = x.size(1);
  TORCH_CHECK(k >= 1 && k <= V, "k must be in [1, vocab]");
  auto out = at::empty({R, k}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  const int64_t nc = (V + kChunk - 1) / kChunk;
  at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
    std::vector<float> maxima(nc);
    std::vector<int32_t> cand(V);
    for (int64_t r = r0; r < r1; ++r) {
      const float* row = xp + r * V;
      const auto key = [row](int32_t i) {
        return std::isnan(row[i]) ? -std::numeric_limits<float>::infinity() : row[i];
      };
      for (int64_t c = 0; c < nc; ++c) maxima[c] = row_max(row + c * kChunk, std::min(V, (c + 1) * kChunk) - c * kChunk);
      float lo = -std::numeric_limits<float>::infinity();
      if (k <= nc) {
        std::vector<float> sorted(maxima);
        std::nth_element(sorted.begin(), sorted.begin() + (k - 1), sorted.end(), std::greater<float>());
        lo = sorted[k - 1];
      }
      int64_t n = 0;
      for (int64_t c = 0; c < nc; ++c) {
        if (!(maxima[c] >= lo)) continue;  // no token of this chunk reaches the bound
        const int64_t e = std::min(V, (c + 1) * kChunk);
        for (int64_t i = c * kChunk; i < e; ++i) {  // branch-free: most fail
          cand[n] = static_cast<int32_t>(i);
          n += row[i] >= lo;
        }
      }
      if (n < k) {  // NaNs fooled the bound: take every index
        for (int64_t i = 0; i < V; ++i) cand[i] = static_cast<int32_t>(i);
        n = V;
      }
      std::partial_sort(cand.begin(), cand.begin() + k, cand.begin() + n, [&](int32_t a, int32_t b) {
        const float ka = key(a), kb = key(b);
        return ka > kb || (ka == kb && a < b);
      });
      for (int64_t j = 0; j < k; ++j) op[r * k + j] = cand[j];
    }
  });
  return out;
}

// One value per row in each list; top_ks[r] >= the vocabulary size is no top-k cut.
at::Tensor sample_rows(const at::Tensor& logits, at::ArrayRef<double> temps, at::ArrayRef<int64_t> top_ks,
                       at::ArrayRef<double> top_ps, at::ArrayRef<double> min_ps, at::ArrayRef<double> u) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat, "logits must be fp32 [rows, vocab]");
  const auto x = logits.contiguous();
  const int64_t R = x.size(0), V = x.size(1);
  const auto n = static_cast<size_t>(R);
  TORCH_CHECK(temps.size() == n && top_ks.size() == n && top_ps.size() == n && min_ps.size() == n && u.size() == n,
              "one sampling parameter per row");
  auto out = at::empty({R}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
    thread_local SampleScratch scratch;
    for (int64_t r = r0; r < r1; ++r)
      op[r] = sample_row(xp + r * V, V, temps[r], std::max<int64_t>(top_ks[r], 1), top_ps[r], min_ps[r], u[r],
                         scratch);
  });
  return out;
}

// ---- GGUF block-quantized linear: y = x @ W^T with W in GGUF's own blocks -------------------
//
// W is [N, K] stored as GGUF lays it out, each row K/32 blocks of 32 weights:
//   Q4_0 (type 2): fp16 d, 16 bytes of nibbles        w = d * (q - 8)
//   Q4_1 (type 3): fp16 d, fp16 m, 16 bytes of nibbles w = d * q + m
//   Q8_0 (type 8): fp16 d, 32 int8                     w = d * q
// (nibble byte i holds weight i in its low half and weight i + 16 in its high half). The
// weights are never dequantized: x is quantized per 32-block to int8 (scale dx, code sum sx)
// and each block's dot product runs on integer multiply-adds (VNNI where the CPU has it),
//   sum_i w_i x_i = d dx sum q_i xq_i  (+ m dx sx for Q4_1; - 8 d dx sx for Q4_0),
// which reads 4.5-8.5 bits per weight instead of 32 and multiplies 32 pairs per instruction.

// The GGUF kernels need x86-64-v3 (AVX2, FMA, F16C); elsewhere only the attention ops are
// built and the loader keeps the torch path for GGUF weights.
#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#define LOCALLLM_GGUF_KERNELS 1
#include <immintrin.h>

inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }

enum GGUFType : int64_t { kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8 };

inline int64_t block_bytes(int64_t type) {
  switch (type) {
    case kQ4_0: return 18;
    case kQ4_1: return 20;
    case kQ8_0: return 34;
  }
  TORCH_CHECK(false, "unsupported GGUF block type ", type, " (Q4_0, Q4_1 and Q8_0 are)");
}

// x [M, K] -> int8 codes and per-block scales (round-to-nearest, like ggml's Q8), in
// `levels` levels: level 2 quantizes what level 1 left over, so the pair carries ~14 bits
// per activation (measured on the default model: max logit error 2.2 with one level, 0.007
// with two, against fp32 activations on the same weights). Layout [levels, M, ...]; xs [M, nb]
// is sum over levels of scale x code sum, the factor of the weights' per-block offset c.
void quantize_rows(const float* x, int64_t M, int64_t K, int64_t levels, int8_t* xq, float* xd, float* xs) {
  const int64_t nb = K / 32;
  at::parallel_for(0, M * nb, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float r[32];
      std::memcpy(r, x + (i / nb) * K + (i % nb) * 32, sizeof(r));
      float offset = 0.f;
      for (int64_t lv = 0; lv < levels; ++lv) {
        float amax = 0.f;
        for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(r[j]));
        const float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
        int8_t* q = xq + lv * M * K + (i / nb) * K + (i % nb) * 32;
        int32_t sum = 0;
        for (int j = 0; j < 32; ++j) {
          const int v = static_cast<int>(std::nearbyint(r[j] * inv));
          q[j] = static_cast<int8_t>(v);
          sum += v;
          r[j] -= static_cast<float>(v) * d;
        }
        xd[lv * M * nb + i] = d;
        offset += d * static_cast<float>(sum);
      }
      xs[i] = offset;
    }
  });
}

// The repacked layout the kernel reads, made once at load by gguf_repack: rows in tiles of 8
// (the 8 lanes of a 256-bit register are 8 output features, so no horizontal sums), and per
// tile and 32-block:
//   codes  4-bit: 4 x 32 bytes; byte 4n + j of chunk p holds, for row n of the tile, weight
//          8p + j in its low nibble and weight 8p + 4 + j in its high nibble (two runs of 4
//          consecutive weights, the unit of one integer multiply-add per lane);
//          8-bit: 8 x 32 bytes, byte 4n + j of chunk p = weight 4p + j of row n (int8);
//   d, c   fp16 [8]: the block scale, and the factor of the activation code sum:
//          Q4_1 m, Q4_0 -8d, Q8_0 0 (its codes are signed already).
// sum_i w_i x_i = d dx sum q_i xq_i + c dx sx, per row, per block.
constexpr int64_t kTileN = 8;

inline int64_t code_bytes(int64_t type) { return type == kQ8_0 ? 256 : 128; }  // per tile and block

std::vector<at::Tensor> gguf_repack(const at::Tensor& weight, int64_t type, int64_t in_features) {
  TORCH_CHECK(weight.scalar_type() == at::kByte && weight.dim() == 2 && weight.is_contiguous(),
              "weight must be the contiguous uint8 [N, row_bytes] GGUF blocks");
  const int64_t N = weight.size(0), K = in_features, nb = K / 32, bpb = block_bytes(type);
  TORCH_CHECK(K % 32 == 0 && weight.size(1) == nb * bpb, "GGUF row bytes do not match in_features");
  TORCH_CHECK(N % kTileN == 0, "out_features must be a multiple of 8");
  const int64_t tiles = N / kTileN;
  auto codes = at::empty({tiles, nb, code_bytes(type)}, at::kByte);
  auto d = at::empty({tiles, nb, kTileN}, at::kHalf);
  auto c = at::empty({tiles, nb, kTileN}, at::kHalf);
  const uint8_t* w = weight.data_ptr<uint8_t>();
  uint8_t* cp = codes.data_ptr<uint8_t>();
  uint16_t* dp = reinterpret_cast<uint16_t*>(d.data_ptr<at::Half>());
  uint16_t* cc = reinterpret_cast<uint16_t*>(c.data_ptr<at::Half>());
  at::parallel_for(0, tiles * nb, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t = i / nb, b = i % nb;
      uint8_t* out = cp + i * code_bytes(type);
      for (int64_t n = 0; n < kTileN; ++n) {
        const uint8_t* blk = w + (t * kTileN + n) * nb * bpb + b * bpb;
        uint8_t q[32];
        const uint16_t dh = *reinterpret_cast<const uint16_t*>(blk);
        dp[i * kTileN + n] = dh;
        if (type == kQ8_0) {
          std::memcpy(q, blk + 2, 32);
          cc[i * kTileN + n] = 0;
        } else {
          const uint8_t* qs = blk + (type == kQ4_1 ? 4 : 2);
          for (int j = 0; j < 16; ++j) q[j] = qs[j] & 15, q[j + 16] = qs[j] >> 4;
          if (type == kQ4_1) {
            cc[i * kTileN + n] = *reinterpret_cast<const uint16_t*>(blk + 2);
          } else {  // -8 d, exact in fp16 (a power-of-two multiple)
            const float m8 = -8.f * half_to_float(dh);
            cc[i * kTileN + n] = static_cast<uint16_t>(_cvtss_sh(m8, 0));
          }
        }
        if (type == kQ8_0) {
          for (int p = 0; p < 8; ++p)
            for (int j = 0; j < 4; ++j) out[p * 32 + 4 * n + j] = q[4 * p + j];
        } else {
          for (int p = 0; p < 4; ++p)
            for (int j = 0; j < 4; ++j) out[p * 32 + 4 * n + j] = q[8 * p + j] | (q[8 * p + 4 + j] << 4);
        }
      }
    }
  });
  return {codes, d, c};
}

// Activation rows sharing one unpacked weight block. The integer sums of (level, row) pairs
// are independent chains of multiply-adds, interleaved so their latency overlaps; with 32
// vector registers (AVX-512VL) 4 rows x 2 levels fit beside the 8 weight registers.
#if defined(__AVX512VL__)
constexpr int64_t kTileM = 4;
#else
constexpr int64_t kTileM = 2;
#endif

// Integer multiply-add of 8 lanes: each lane sums 4 u8 x s8 products into int32.
inline __m256i madd_u8s8(__m256i acc, __m256i w, __m256i x) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, w, x);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, w, x);
#else
  // maddubs saturates int16 at 32767: fine for u8 <= 15 (15 * 128 * 2), and 8-bit codes take
  // the sign trick below, so |u8| <= 127 (127 * 128 * 2 = 32512).
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
#endif
}

// How far ahead of the block being multiplied its weight stream is prefetched: the layer
// matrices are small (0.2-1 MB) and separate, so the hardware prefetcher, which stops at each
// 4 KB page, would restart cold on every one of them.
constexpr int64_t kPrefetchBytes = 1024;

// The float part of one block, for either register width (GCC's vector operators; a * b + c
// contracts to an FMA): per row, d (sum over levels of dx * codes dot) + c (sum over levels
// of dx * code sum), into the row's accumulator.
template <int TM, int L, int A, class VI32, class VI, class VF>
inline void finish_block(const VI (&isum)[TM * L][A], const float* const (&dxrow)[TM * L], const float* xs, int64_t nb,
                         int64_t b, VF dv, VF cv, VF (&acc)[TM]) {
  for (int m = 0; m < TM; ++m) {
    VF f = {};
    for (int lv = 0; lv < L; ++lv) {
      const int r = lv * TM + m;
      VI32 sum = reinterpret_cast<const VI32&>(isum[r][0]);
      for (int a = 1; a < A; ++a) sum += reinterpret_cast<const VI32&>(isum[r][a]);
      f = __builtin_convertvector(sum, VF) * dxrow[r][b] + f;
    }
    acc[m] = f * dv + acc[m];
    acc[m] = cv * xs[m * nb + b] + acc[m];
  }
}

// Output tile [tile t] x activation rows [m0, m0 + TM), in L levels: R = L * TM chains, each
// split in A accumulators (even and odd chunks when there are few chains) so that at least
// ~4 multiply-add chains are in flight.
template <int TM, int L, bool Q8>
void gguf_tile(const uint8_t* codes, const uint16_t* dh, const uint16_t* ch, int64_t nb, const int8_t* xq,
               const float* xd, const float* xs, int64_t K, int64_t M, int64_t m0, float* y, int64_t N,
               int64_t n0) {
  constexpr int R = TM * L;
  constexpr int A = R >= 4 ? 1 : (R >= 2 ? 2 : 4);
  constexpr int64_t cb = Q8 ? 256 : 128;
  __m256 acc[TM];
  for (int m = 0; m < TM; ++m) acc[m] = _mm256_setzero_ps();
  const int8_t* xrow[R];
  const float* dxrow[R];
  for (int r = 0; r < R; ++r) {  // r = level * TM + row
    const int64_t lv = r / TM, m = m0 + r % TM;
    xrow[r] = xq + lv * M * K + m * K;
    dxrow[r] = xd + lv * M * nb + m * nb;
  }
  const __m256i mask = _mm256_set1_epi8(0x0f);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* cp = codes + b * cb;
    _mm_prefetch(reinterpret_cast<const char*>(cp + kPrefetchBytes), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(cp + kPrefetchBytes + 64), _MM_HINT_T0);
    if constexpr (Q8) {
      _mm_prefetch(reinterpret_cast<const char*>(cp + kPrefetchBytes + 128), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(cp + kPrefetchBytes + 192), _MM_HINT_T0);
    }
    if ((b & 3) == 0) {
      _mm_prefetch(reinterpret_cast<const char*>(dh + (b + 16) * kTileN), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(ch + (b + 16) * kTileN), _MM_HINT_T0);
    }
    __m256i wv[8];
    if constexpr (Q8) {
      for (int p = 0; p < 8; ++p) wv[p] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cp + 32 * p));
    } else {
      for (int p = 0; p < 4; ++p) {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cp + 32 * p));
        wv[2 * p] = _mm256_and_si256(raw, mask);
        wv[2 * p + 1] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
      }
    }
    __m256i isum[R][A];
    for (int r = 0; r < R; ++r)
      for (int a = 0; a < A; ++a) isum[r][a] = _mm256_setzero_si256();
    for (int p = 0; p < 8; ++p) {
      // 8-bit: chunk p holds weights 4p..4p+3; 4-bit: register p is chunk p/2's low (even p)
      // or high (odd p) nibbles, weights 8(p/2)..+3 and 8(p/2)+4..+7
      const int first = Q8 ? 4 * p : 8 * (p / 2) + 4 * (p % 2);
      const __m256i w = Q8 ? _mm256_sign_epi8(wv[p], wv[p]) : wv[p];  // 8-bit: |w|, x takes w's sign
      for (int r = 0; r < R; ++r) {
        int32_t x4;
        std::memcpy(&x4, xrow[r] + b * 32 + first, 4);
        __m256i xv = _mm256_set1_epi32(x4);
        if constexpr (Q8) xv = _mm256_sign_epi8(xv, wv[p]);
        isum[r][p % A] = madd_u8s8(isum[r][p % A], w, xv);
      }
    }
    const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dh + b * kTileN)));
    const __m256 cv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ch + b * kTileN)));
    finish_block<TM, L, A, __v8si>(isum, dxrow, xs + m0 * nb, nb, b, dv, cv, acc);
  }
  for (int m = 0; m < TM; ++m) _mm256_storeu_ps(y + (m0 + m) * N + n0, acc[m]);
}

using TileFn = void (*)(const uint8_t*, const uint16_t*, const uint16_t*, int64_t, const int8_t*, const float*,
                        const float*, int64_t, int64_t, int64_t, float*, int64_t, int64_t);

template <int TM>
TileFn pick_tile(int64_t levels, bool q8) {
  if (levels == 1) return q8 ? &gguf_tile<TM, 1, true> : &gguf_tile<TM, 1, false>;
  return q8 ? &gguf_tile<TM, 2, true> : &gguf_tile<TM, 2, false>;
}

template <int... Ms>
TileFn pick_tile_rows(int64_t tm, int64_t levels, bool q8, std::integer_sequence<int, Ms...>) {
  TileFn fn = nullptr;
  ((fn = (tm == Ms + 1) ? pick_tile<Ms + 1>(levels, q8) : fn), ...);
  return fn;
}


#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define LOCALLLM_GGUF_PAIRS 1
// Two adjacent 8-row tiles in one 512-bit register (lanes 0-7 tile t, 8-15 tile t + 1): the
// same block and chunk of both, so each activation broadcast feeds 16 output rows, and one
// vpdpbusd does twice the work of the 256-bit one at the same rate (measured). Tile t + 1's
// outputs follow tile t's, so one store writes both. 8-bit codes use the offset form, as
// AVX-512 has no byte sign op: u = q + 128 (q xor 0x80), sum q x = sum u x - 128 sum x, and
// the -128 d joins the offset factor c.
template <int TM, int L, bool Q8>
void gguf_tile_pair(const uint8_t* codes, const uint16_t* dh, const uint16_t* ch, int64_t nb, const int8_t* xq,
                    const float* xd, const float* xs, int64_t K, int64_t M, int64_t m0, float* y, int64_t N,
                    int64_t n0) {
  constexpr int R = TM * L;
  constexpr int A = R >= 4 ? 1 : (R >= 2 ? 2 : 4);
  constexpr int64_t cb = Q8 ? 256 : 128;
  const uint8_t* codes1 = codes + nb * cb;  // tile t + 1
  const uint16_t* dh1 = dh + nb * kTileN;
  const uint16_t* ch1 = ch + nb * kTileN;
  __m512 acc[TM];
  for (int m = 0; m < TM; ++m) acc[m] = _mm512_setzero_ps();
  const int8_t* xrow[R];
  const float* dxrow[R];
  for (int r = 0; r < R; ++r) {  // r = level * TM + row
    const int64_t lv = r / TM, m = m0 + r % TM;
    xrow[r] = xq + lv * M * K + m * K;
    dxrow[r] = xd + lv * M * nb + m * nb;
  }
  const __m512i mask = _mm512_set1_epi8(0x0f), flip = _mm512_set1_epi8(static_cast<char>(0x80));
  const auto both = [](const uint8_t* a, const uint8_t* b) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a))),
                              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)), 1);
  };
  const auto halves = [](const uint16_t* a, const uint16_t* b) {
    const __m256i h = _mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a))),
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(b)), 1);
    return _mm512_cvtph_ps(h);
  };
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* cp = codes + b * cb;
    const uint8_t* cp1 = codes1 + b * cb;
    for (int64_t o = 0; o < cb; o += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(cp + kPrefetchBytes + o), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(cp1 + kPrefetchBytes + o), _MM_HINT_T0);
    }
    if ((b & 3) == 0) {
      _mm_prefetch(reinterpret_cast<const char*>(dh + (b + 16) * kTileN), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(ch + (b + 16) * kTileN), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(dh1 + (b + 16) * kTileN), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(ch1 + (b + 16) * kTileN), _MM_HINT_T0);
    }
    __m512i wv[8];
    if constexpr (Q8) {
      for (int p = 0; p < 8; ++p) wv[p] = _mm512_xor_si512(both(cp + 32 * p, cp1 + 32 * p), flip);
    } else {
      for (int p = 0; p < 4; ++p) {
        const __m512i raw = both(cp + 32 * p, cp1 + 32 * p);
        wv[2 * p] = _mm512_and_si512(raw, mask);
        wv[2 * p + 1] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), mask);
      }
    }
    __m512i isum[R][A];
    for (int r = 0; r < R; ++r)
      for (int a = 0; a < A; ++a) isum[r][a] = _mm512_setzero_si512();
    for (int p = 0; p < 8; ++p) {
      const int first = Q8 ? 4 * p : 8 * (p / 2) + 4 * (p % 2);  // as in gguf_tile
      for (int r = 0; r < R; ++r) {
        int32_t x4;
        std::memcpy(&x4, xrow[r] + b * 32 + first, 4);
        isum[r][p % A] = _mm512_dpbusd_epi32(isum[r][p % A], wv[p], _mm512_set1_epi32(x4));
      }
    }
    const __m512 dv = halves(dh + b * kTileN, dh1 + b * kTileN);
    __m512 cv = halves(ch + b * kTileN, ch1 + b * kTileN);
    if constexpr (Q8) cv = _mm512_fmadd_ps(dv, _mm512_set1_ps(-128.f), cv);
    finish_block<TM, L, A, __v16si>(isum, dxrow, xs + m0 * nb, nb, b, dv, cv, acc);
  }
  for (int m = 0; m < TM; ++m) _mm512_storeu_ps(y + (m0 + m) * N + n0, acc[m]);
}

template <int TM>
TileFn pick_pair(int64_t levels, bool q8) {
  if (levels == 1) return q8 ? &gguf_tile_pair<TM, 1, true> : &gguf_tile_pair<TM, 1, false>;
  return q8 ? &gguf_tile_pair<TM, 2, true> : &gguf_tile_pair<TM, 2, false>;
}

template <int... Ms>
TileFn pick_pair_rows(int64_t tm, int64_t levels, bool q8, std::integer_sequence<int, Ms...>) {
  TileFn fn = nullptr;
  ((fn = (tm == Ms + 1) ? pick_pair<Ms + 1>(levels, q8) : fn), ...);
  return fn;
}
#endif

at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d, const at::Tensor& c,
                       int64_t type, int64_t levels) {
  TORCH_CHECK(levels == 1 || levels == 2, "levels must be 1 or 2");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be fp32 [M, K]");
  TORCH_CHECK(codes.dim() == 3 && codes.is_contiguous() && d.is_contiguous() && c.is_contiguous(),
              "pass the tensors gguf_repack made");
  const int64_t M = x.size(0), K = x.size(1), tiles = codes.size(0), nb = codes.size(1), N = tiles * kTileN;
  TORCH_CHECK(K == nb * 32 && codes.size(2) == code_bytes(type), "x does not match the packed weight");
  const auto xc = x.contiguous();
  // The quantized activations live in per-thread scratch that only grows: a decode step makes
  // ~120 of these calls, and three tensor allocations each were ~0.3 ms of it.
  thread_local std::vector<int8_t> xq_buf;
  thread_local std::vector<float> xf_buf;
  xq_buf.resize(std::max<size_t>(xq_buf.size(), levels * M * K));
  xf_buf.resize(std::max<size_t>(xf_buf.size(), (levels + 1) * M * nb));
  int8_t* xqp = xq_buf.data();
  float* xdp = xf_buf.data();
  float* xsp = xdp + levels * M * nb;
  quantize_rows(xc.data_ptr<float>(), M, K, levels, xqp, xdp, xsp);
  auto y = at::empty({M, N}, at::kFloat);
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const uint16_t* dp = reinterpret_cast<const uint16_t*>(d.data_ptr<at::Half>());
  const uint16_t* ccp = reinterpret_cast<const uint16_t*>(c.data_ptr<at::Half>());
  const bool q8 = type == kQ8_0;
  const int64_t m_tiles = (M + kTileM - 1) / kTileM, tail = M - (m_tiles - 1) * kTileM;
  const TileFn full = pick_tile_rows(kTileM, levels, q8, std::make_integer_sequence<int, kTileM>{});
  const TileFn last = pick_tile_rows(tail, levels, q8, std::make_integer_sequence<int, kTileM>{});
  float* yp = y.data_ptr<float>();
  // Work units: pairs of tiles where the CPU has 512-bit VNNI (the last tile of an odd count
  // alone), else single tiles; m tiles innermost, so a thread reuses its weight tiles (from
  // cache) across the activation rows.
  const int64_t cb = code_bytes(type);
#ifdef LOCALLLM_GGUF_PAIRS
  const int64_t pairs = tiles / 2, units = pairs + tiles % 2;
  const TileFn pair_full = pick_pair_rows(kTileM, levels, q8, std::make_integer_sequence<int, kTileM>{});
  const TileFn pair_last = pick_pair_rows(tail, levels, q8, std::make_integer_sequence<int, kTileM>{});
#else
  const int64_t pairs = 0, units = tiles;
  const TileFn pair_full = nullptr, pair_last = nullptr;
#endif
  at::parallel_for(0, units * m_tiles, 4, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t u = i / m_tiles, mt = i % m_tiles;
      const bool is_pair = u < pairs, last_rows = mt == m_tiles - 1;
      const int64_t t = is_pair ? 2 * u : pairs * 2 + (u - pairs);
      const TileFn fn = is_pair ? (last_rows ? pair_last : pair_full) : (last_rows ? last : full);
      fn(cp + t * nb * cb, dp + t * nb * kTileN, ccp + t * nb * kTileN, nb, xqp, xdp, xsp, K, M, mt * kTileM, yp, N,
         t * kTileN);
    }
  });
  return y;
}

// The packed weight as a dense [N, K] matrix (fp32 or bf16): for prefill-sized batches, where a
// blocked GEMM on the dense weight (oneDNN, AMX where present) beats integer dot products.
at::Tensor gguf_dequantize(const at::Tensor& codes, const at::Tensor& d, const at::Tensor& c, int64_t type,
                           at::ScalarType dtype) {
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "dequantize to float32 or bfloat16");
  const int64_t tiles = codes.size(0), nb = codes.size(1), N = tiles * kTileN, K = nb * 32;
  TORCH_CHECK(codes.size(2) == code_bytes(type), "codes do not match the block type");
  auto out = at::empty({N, K}, dtype);
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const uint16_t* dp = reinterpret_cast<const uint16_t*>(d.data_ptr<at::Half>());
  const uint16_t* ccp = reinterpret_cast<const uint16_t*>(c.data_ptr<at::Half>());
  const bool q8 = type == kQ8_0, bf16 = dtype == at::kBFloat16;
  float* of = bf16 ? nullptr : out.data_ptr<float>();
  uint16_t* ob = bf16 ? reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()) : nullptr;
  at::parallel_for(0, tiles * nb, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t = i / nb, b = i % nb;
      const uint8_t* blk = cp + i * code_bytes(type);
      // row n's 8 consecutive codes of each step, as bytes in the low 64 bits of a lane pair
      __m128i rows[kTileN][4];
      if (q8) {
        for (int p = 0; p < 8; p += 2) {  // chunks p, p+1: weights 4p..4p+7 of every row
          const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32 * p));
          const __m256i c2 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32 * (p + 1)));
          const __m256i lo = _mm256_unpacklo_epi32(a, c2), hi = _mm256_unpackhi_epi32(a, c2);
          // lo: rows 0,1 | 4,5; hi: rows 2,3 | 6,7 (64 bits each)
          rows[0][p / 2] = _mm256_castsi256_si128(lo);
          rows[1][p / 2] = _mm_srli_si128(_mm256_castsi256_si128(lo), 8);
          rows[2][p / 2] = _mm256_castsi256_si128(hi);
          rows[3][p / 2] = _mm_srli_si128(_mm256_castsi256_si128(hi), 8);
          rows[4][p / 2] = _mm256_extracti128_si256(lo, 1);
          rows[5][p / 2] = _mm_srli_si128(_mm256_extracti128_si256(lo, 1), 8);
          rows[6][p / 2] = _mm256_extracti128_si256(hi, 1);
          rows[7][p / 2] = _mm_srli_si128(_mm256_extracti128_si256(hi, 1), 8);
        }
      } else {
        const __m256i mask = _mm256_set1_epi8(0x0f);
        for (int p = 0; p < 4; ++p) {  // chunk p: weights 8p..8p+3 (low nibbles), 8p+4..8p+7 (high)
          const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32 * p));
          const __m256i a = _mm256_and_si256(raw, mask), c2 = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
          const __m256i lo = _mm256_unpacklo_epi32(a, c2), hi = _mm256_unpackhi_epi32(a, c2);
          rows[0][p] = _mm256_castsi256_si128(lo);
          rows[1][p] = _mm_srli_si128(_mm256_castsi256_si128(lo), 8);
          rows[2][p] = _mm256_castsi256_si128(hi);
          rows[3][p] = _mm_srli_si128(_mm256_castsi256_si128(hi), 8);
          rows[4][p] = _mm256_extracti128_si256(lo, 1);
          rows[5][p] = _mm_srli_si128(_mm256_extracti128_si256(lo, 1), 8);
          rows[6][p] = _mm256_extracti128_si256(hi, 1);
          rows[7][p] = _mm_srli_si128(_mm256_extracti128_si256(hi, 1), 8);
        }
      }
      for (int64_t n = 0; n < kTileN; ++n) {
        const __m256 dn = _mm256_set1_ps(half_to_float(dp[i * kTileN + n]));
        const __m256 cn = _mm256_set1_ps(half_to_float(ccp[i * kTileN + n]));
        const int64_t off = (t * kTileN + n) * K + b * 32;
        for (int s8 = 0; s8 < 4; ++s8) {
          const __m256i qi = q8 ? _mm256_cvtepi8_epi32(rows[n][s8]) : _mm256_cvtepu8_epi32(rows[n][s8]);
          const __m256 w = _mm256_fmadd_ps(_mm256_cvtepi32_ps(qi), dn, cn);
          if (!bf16) {
            _mm256_storeu_ps(of + off + 8 * s8, w);
          } else {  // round to nearest even: add 0x7fff + the kept lowest bit, then truncate
            const __m256i bits = _mm256_castps_si256(w);
            const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
            const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7fff)), lsb), 16);
            const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
            _mm_storeu_si128(reinterpret_cast<__m128i*>(ob + off + 8 * s8), packed);
          }
        }
      }
    }
  });
  return out;
}

#endif  // LOCALLLM_GGUF_KERNELS

// Binds thread i of the calling thread's OpenMP team to CPU cpus[i] and returns, per team
// thread, the one CPU its affinity now allows (-1: not bound to exactly one). Only a thread can
// bind itself through this API, and the team's threads are reachable only inside a parallel
// region: hence the region. Teams belong to the thread that opens them, so each thread that
// runs the forward binds its own. Each index of a region over get_num_threads() items with
// grain 1 runs on its own team thread, the same thread in every later region of that size.
std::vector<int64_t> bind_threads(at::IntArrayRef cpus) {
  const int64_t n = std::min<int64_t>(static_cast<int64_t>(cpus.size()), at::get_num_threads());
  std::vector<int64_t> bound(std::max<int64_t>(n, 0), -1);
#ifdef __linux__
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      if (cpus[i] < 0 || cpus[i] >= CPU_SETSIZE) continue;
      cpu_set_t want;
      CPU_ZERO(&want);
      CPU_SET(static_cast<int>(cpus[i]), &want);
      cpu_set_t now;
      // skip the call when already bound: re-binding every step costs nothing then
      if (sched_getaffinity(0, sizeof(now), &now) != 0 || !CPU_EQUAL(&now, &want))
        sched_setaffinity(0, sizeof(want), &want);
      if (sched_getaffinity(0, sizeof(now), &now) == 0 && CPU_EQUAL(&now, &want)) bound[i] = cpus[i];
    }
  });
#endif
  return bound;
}

}  // namespace

TORCH_LIBRARY(localllm_cpu, m) {
  m.def("store_kv(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) -> ()");
  m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor query_start_loc, Tensor seq_lens, "
        "Tensor block_tables, float scale, int max_q, int max_splits=0) -> Tensor");
  m.def("argmax_rows(Tensor logits) -> Tensor");
  m.def("topk_indices(Tensor logits, int k) -> Tensor");
  m.def("sample_rows(Tensor logits, float[] temps, int[] top_ks, float[] top_ps, float[] min_ps, float[] u) -> Tensor");
  m.def("bind_threads(int[] cpus) -> int[]", &bind_threads);  // no tensor to dispatch on: a catch-all kernel
#ifdef LOCALLLM_GGUF_KERNELS
  m.def("gguf_repack(Tensor weight, int type, int in_features) -> Tensor[]");
  m.def("gguf_linear(Tensor x, Tensor codes, Tensor d, Tensor c, int type, int levels) -> Tensor");
  m.def("gguf_dequantize(Tensor codes, Tensor d, Tensor c, int type, ScalarType dtype) -> Tensor");
#endif
}

TORCH_LIBRARY_IMPL(localllm_cpu, CPU, m) {
  m.impl("store_kv", &store_kv);
  m.impl("paged_attention", &paged_attention);
  m.impl("argmax_rows", &argmax_rows);
  m.impl("topk_indices", &topk_indices);
  m.impl("sample_rows", &sample_rows);
#ifdef LOCALLLM_GGUF_KERNELS
  m.impl("gguf_repack", &gguf_repack);
  m.impl("gguf_linear", &gguf_linear);
  m.impl("gguf_dequantize", &gguf_dequantize);
#endif
}
