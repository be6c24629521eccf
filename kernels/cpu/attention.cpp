// The paged KV write and paged attention (attention.h says what they compute and the layouts).
#include "attention.h"

#include <vector>

#include "attention_kernels.h"
#include "common.h"

namespace localllm_cpu {

void store_kv(const float* k, int64_t k_stride, const float* v, int64_t v_stride, int64_t T, int64_t row,
              const int64_t* slots, int64_t num_slots, float* k_cache, float* v_cache) {
  for (int64_t t = 0; t < T; ++t) {
    if (slots[t] < 0) continue;
    LOCALLLM_CHECK(slots[t] < num_slots, "slot ", slots[t], " is outside the KV pool");
    std::memcpy(k_cache + slots[t] * row, k + t * k_stride, row * sizeof(float));
    std::memcpy(v_cache + slots[t] * row, v + t * v_stride, row * sizeof(float));
  }
}

namespace {

using attention_detail::AttendFn;
using attention_detail::MultiFn;

AttendFn pick_attend(int64_t g, int64_t d) {
  return d == 64 ? attention_detail::pick_attend_d64(g)
       : d == 128 ? attention_detail::pick_attend_d128(g)
       : d == 256 ? attention_detail::pick_attend_d256(g)
                  : attention_detail::pick_attend_generic(g);
}

MultiFn pick_multi(int64_t g, int64_t d) {  // nullptr: no fixed head_dim
  return d == 64 ? attention_detail::pick_multi_d64(g)
       : d == 128 ? attention_detail::pick_multi_d128(g)
       : d == 256 ? attention_detail::pick_multi_d256(g)
                  : nullptr;
}

}  // namespace

// Attention for every sequence whose query length is at most max_q (decodes, short
// extends over a cached prefix); the rows of longer sequences are left at zero for the
// caller's prefill path. A work item is one query token, one KV head and one slice of its
// keys: the query heads of that KV head share every key and value row it reads, once, from
// the block it lies in (no gather, no padding to the longest context in the batch). Long
// contexts split into slices when there are too few items for the threads (flash-decoding);
// the slices merge by their max and sum of exp.
void paged_attention(const PagedAttention& args, float* op) {
  const int64_t H = args.H, D = args.D, block_size = args.block_size, KVH = args.KVH, B = args.B, W = args.W;
  const int64_t G = H / KVH, row = KVH * D, max_q = args.max_q, max_splits = args.max_splits;
  const int64_t window = args.window;  // > 0: query at p sees keys p - window + 1 .. p
  const AttendFn attend = pick_attend(G, D);
  const MultiFn attend_multi = pick_multi(G, D);
  const int32_t* qs = args.query_start_loc;
  const int32_t* ls = args.seq_lens;
  const int32_t* tb = args.block_tables;
  const int64_t num_blocks = args.num_blocks;

  std::vector<int64_t> tok_seq, tok_j;  // one entry per (sequence, query token)
  std::vector<int64_t> item_seq, item_tok;  // per sequence attended here: its index, its first token's
  int64_t max_keys = 0;  // the longest key range a sequence's queries span together
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = qs[b + 1] - qs[b];
    if (n == 0 || n > max_q) continue;
    LOCALLLM_CHECK(ls[b] >= n && (ls[b] + block_size - 1) / block_size <= W, "seq_lens/block_tables mismatch");
    for (int64_t i = 0; i < (ls[b] + block_size - 1) / block_size; ++i) {
      const int32_t blk = tb[b * W + i];
      LOCALLLM_CHECK(blk >= 0 && blk < num_blocks, "block id ", blk, " is outside the KV pool");
    }
    max_keys = std::max<int64_t>(max_keys, window > 0 ? std::min<int64_t>(ls[b], window + n - 1) : ls[b]);
    item_seq.push_back(b);
    item_tok.push_back(static_cast<int64_t>(tok_seq.size()));
    for (int64_t j = 0; j < n; ++j) {
      tok_seq.push_back(b);
      tok_j.push_back(j);
    }
  }
  const int64_t num_toks = static_cast<int64_t>(tok_seq.size());
  if (num_toks == 0) return;
  const int64_t threads = num_threads();
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
  const float* qp = args.q;
  const float* kc = args.k_cache;
  const float* vc = args.v_cache;
  const float fscale = args.scale;
  // One slice (decodes of short contexts, most batches): a work item holds its rows' whole
  // softmax, so it writes the normalised rows itself and the merge pass is skipped.
  const bool direct = splits == 1;
  const float* sinks = args.sinks;
  // The softmax's denominator for head h of a row whose exps are taken against max m and sum
  // to l: with a sink, its exp joins the sum (std::exp: sink - m may be positive and large,
  // where fast_exp does not reach; a huge term gives weights of 0, the right limit).
  const auto denominator = [&](int64_t h, float m, float l) {
    return sinks == nullptr ? l : l + std::exp(sinks[h] - m);
  };
  const auto write_row = [&](int64_t b, int64_t j, int64_t kvh, const float* acc, int64_t acc_stride,
                             const float* m, const float* l) {
    float* orow = op + (qs[b] + j) * H * D + kvh * G * D;
    for (int64_t g = 0; g < G; ++g) {
      const float inv = 1.f / denominator(kvh * G + g, m[g], l[g]);
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) orow[g * D + d] = acc[g * acc_stride + d] * inv;
    }
  };

  parallel_for(0, num_seqs * KVH * splits, 1, [&](int64_t begin, int64_t end) {
    float acc[kMaxGroup][kMaxHeadDim];
    float p[kMaxGroup][kMaxBlock];
    std::vector<float> mm(max_q * G), ml(max_q * G), macc(max_q * G * D);
    for (int64_t it = begin; it < end; ++it) {
      const int64_t s = it / (KVH * splits), kvh = (it / splits) % KVH, sp = it % splits;
      const int64_t b = item_seq[s], t0 = item_tok[s], nq = qs[b + 1] - qs[b];
      const int64_t keys0 = ls[b] - nq + 1;  // causal: query j sees keys 0..keys0 + j - 1
      // a window: query j sees keys from keys0 + j - window on; the slices cover the span of
      // the whole chunk, from its first query's first key
      const int64_t lo = window > 0 ? std::max<int64_t>(0, keys0 - window) : 0;
      const int64_t k0 = lo + sp * slice, k1 = std::min(keys0 + nq - 1, k0 + slice);
      const float* q0 = qp + qs[b] * H * D + kvh * G * D;
      const auto part = [&](int64_t j) { return ((t0 + j) * KVH + kvh) * splits + sp; };
      if (nq > 1 && attend_multi != nullptr && window <= 0) {
        attend_multi(q0, H * D, nq, keys0, kc + kvh * D, vc + kvh * D, tb + b * W, k0, std::max(k0, k1),
                     block_size, row, fscale, mm.data(), ml.data(), macc.data());
        if (direct) {
          for (int64_t j = 0; j < nq; ++j) write_row(b, j, kvh, &macc[j * G * D], D, &mm[j * G], &ml[j * G]);
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
        const int64_t ki = window > 0 ? std::max(k0, keys0 + j - window) : k0;
        float* pm = &part_m[part(j) * G];
        float* pl = &part_l[part(j) * G];
        if (ki >= kj) {
          for (int64_t g = 0; g < G; ++g) pm[g] = -std::numeric_limits<float>::infinity(), pl[g] = 0.f;
          continue;
        }
        attend(q0 + j * H * D, kc + kvh * D, vc + kvh * D, tb + b * W, ki, kj, block_size, row, D, fscale, pm,
               pl, acc, p);
        if (direct) {
          write_row(b, j, kvh, acc[0], kMaxHeadDim, pm, pl);
          continue;
        }
        for (int64_t g = 0; g < G; ++g) std::copy(acc[g], acc[g] + D, &part_acc[(part(j) * G + g) * D]);
      }
    }
  });
  if (direct) return;
  parallel_for(0, num_toks * KVH, 1, [&](int64_t begin, int64_t end) {
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
        const float inv = 1.f / denominator(kvh * G + g, mx, total);
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) o[d] *= inv;
      }
    }
  });
}

}  // namespace localllm_cpu
