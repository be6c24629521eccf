// The paged KV write and the attention that reads the paged pool where it lies (decodes and
// short extends over a cached prefix). Their torch references are paged_attention_ref and
// rotary_and_store_kv_ref in kernels/paged_attention.py and kernels/rotary_kv.py.
//
// Layouts are those of kernels/paged_attention.py: q [T, H, D]; caches
// [num_blocks, block_size, KVH, D] fp32, contiguous; query_start_loc [B + 1], seq_lens [B]
// and block_tables [B, W] int32. Query j of sequence b sits at position
// seq_lens[b] - q_len[b] + j and attends to keys 0..that position (with a window W > 0, to
// the last W of them: that position - W + 1 .. that position). With sinks, head h's softmax
// also spans the logit sinks[h], whose value row is zero (paged_attention_sinks_ref in
// kernels/paged_attention.py).
#pragma once

#include <cstdint>

namespace localllm_cpu {

constexpr int64_t kMaxHeadDim = 256;
constexpr int64_t kMaxGroup = 16;  // query heads per KV head
constexpr int64_t kMaxBlock = 64;  // tokens per KV block

// Writes k[t] and v[t] (rows of `row` floats, k_stride / v_stride apart) to slot slots[t] of
// the caches; a negative slot (a padding row) writes nothing.
void store_kv(const float* k, int64_t k_stride, const float* v, int64_t v_stride, int64_t T, int64_t row,
              const int64_t* slots, int64_t num_slots, float* k_cache, float* v_cache);

struct PagedAttention {
  const float* q;  // [T, H, D], contiguous
  int64_t H, D;
  const float* k_cache;  // [num_blocks, block_size, KVH, D]
  const float* v_cache;
  int64_t num_blocks, block_size, KVH;
  const int32_t* query_start_loc;  // [B + 1]
  const int32_t* seq_lens;         // [B]
  const int32_t* block_tables;     // [B, W]
  int64_t B, W;
  float scale;
  int64_t max_q, max_splits;
  int64_t window;  // 0: none
  // [H] one learned logit per query head that joins every softmax's denominator (its value
  // row is zero: gpt-oss's attention sinks); nullptr: none
  const float* sinks = nullptr;
};

// Attention for every sequence whose query length is at most max_q, into out (zeroed by the
// caller: the rows of longer sequences are left for the caller's prefill path).
void paged_attention(const PagedAttention& a, float* out);

}  // namespace localllm_cpu
