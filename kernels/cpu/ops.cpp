// The one dispatch point: every op of torch.ops.localllm_cpu is declared and bound here, and
// this is the only file that sees at::Tensor. Each op checks its tensors (dtype, shape,
// layout), allocates its output and calls the raw-pointer kernel of its concern:
// attention.h, sampling.h, threads.h, gguf/gguf.h. Built by kernels/cpu_ops.py, which compiles
// each file of kernels/cpu/ on its own (in parallel, cached per file) and links them.
#include <ATen/EmptyTensor.h>
#include <torch/library.h>

#include <string>
#include <vector>

#include "attention.h"
#include "dense/linear.h"
#include "gguf/dispatch.h"
#include "gguf/gguf.h"
#include "sampling.h"
#include "threads.h"

namespace localllm_cpu {
namespace {

// Numbers in a check's message go through std::to_string, never an ostream: on a GPU machine
// (g++ 13.3, torch 2.11) the ostream integer insert this file instantiated called a codecvt
// facet's method in place of num_put's and segfaulted inside the failing check (cuda-gdb,
// 2026-12-04); string pieces were fine there.

// A new CPU tensor, uninitialised: at::detail::empty_cpu (what at::empty's CPU kernel calls)
// rather than at::empty, whose header (ATen/ops/empty.h, through ATen/Context.h) added ~0.6 s
// to this file's cold compile. Every caller writes the whole tensor.
at::Tensor empty(at::IntArrayRef size, at::ScalarType dtype) { return at::Tensor(at::detail::empty_cpu(size, dtype)); }

// ---- attention ----

void check_cache(const at::Tensor& cache, const char* name) {
  TORCH_CHECK(cache.dim() == 4 && cache.scalar_type() == at::kFloat && cache.is_contiguous(),
              name, " must be a contiguous fp32 [num_blocks, block_size, kv_heads, head_dim] tensor");
}

void store_kv_op(const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache, at::Tensor v_cache,
                 const at::Tensor& slot_mapping) {
  check_cache(k_cache, "k_cache");
  check_cache(v_cache, "v_cache");
  TORCH_CHECK(k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat, "k and v must be fp32");
  const int64_t row = k_cache.size(2) * k_cache.size(3);
  TORCH_CHECK(k.size(1) * k.size(2) == row && v.size(1) * v.size(2) == row, "k/v heads do not match the cache");
  TORCH_CHECK(k.stride(2) == 1 && k.stride(1) == k.size(2) && v.stride(2) == 1 && v.stride(1) == v.size(2),
              "k and v rows must be contiguous");
  const auto slots = slot_mapping.to(at::kLong).contiguous();
  store_kv(k.data_ptr<float>(), k.stride(0), v.data_ptr<float>(), v.stride(0), k.size(0), row,
           slots.data_ptr<int64_t>(), k_cache.size(0) * k_cache.size(1), k_cache.data_ptr<float>(),
           v_cache.data_ptr<float>());
}

at::Tensor paged_attention_op(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                              const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                              const at::Tensor& block_tables, double scale, int64_t max_q, int64_t max_splits,
                              int64_t window, const std::optional<at::Tensor>& sinks) {
  check_cache(k_cache, "k_cache");
  check_cache(v_cache, "v_cache");
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat, "q must be fp32 [T, H, D]");
  const int64_t H = q.size(1), D = q.size(2), block_size = k_cache.size(1), KVH = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && D <= kMaxHeadDim, "head_dim mismatch or above ", std::to_string(kMaxHeadDim));
  TORCH_CHECK(block_size <= kMaxBlock, "block_size above ", std::to_string(kMaxBlock));
  TORCH_CHECK(H % KVH == 0 && H / KVH <= kMaxGroup, "query heads must be a multiple of KV heads (at most 16 per KV head)");
  const auto qc = q.contiguous();
  const auto qsl = query_start_loc.to(at::kInt).contiguous();
  const auto lens = seq_lens.to(at::kInt).contiguous();
  const auto tables = block_tables.to(at::kInt).contiguous();
  at::Tensor sinks_f;
  if (sinks.has_value()) {
    sinks_f = sinks->to(at::kFloat).contiguous();
    TORCH_CHECK(sinks_f.dim() == 1 && sinks_f.size(0) == H, "sinks must be one logit per query head [H]");
  }
  auto out = empty(qc.sizes(), at::kFloat).zero_();
  PagedAttention args{qc.data_ptr<float>(), H, D, k_cache.data_ptr<float>(), v_cache.data_ptr<float>(),
                            k_cache.size(0), block_size, KVH, qsl.data_ptr<int32_t>(), lens.data_ptr<int32_t>(),
                            tables.data_ptr<int32_t>(), lens.size(0), tables.size(1), static_cast<float>(scale),
                            max_q, max_splits, window};
  if (sinks_f.defined()) args.sinks = sinks_f.data_ptr<float>();
  paged_attention(args, out.data_ptr<float>());
  return out;
}

// ---- sampling ----

at::Tensor logits_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat, "logits must be fp32 [rows, vocab]");
  return logits.contiguous();
}

at::Tensor argmax_rows_op(const at::Tensor& logits) {
  const auto x = logits_rows(logits);
  auto out = empty({x.size(0)}, at::kLong);
  argmax_rows(x.data_ptr<float>(), x.size(0), x.size(1), out.data_ptr<int64_t>());
  return out;
}

at::Tensor topk_indices_op(const at::Tensor& logits, int64_t k) {
  const auto x = logits_rows(logits);
  TORCH_CHECK(k >= 1 && k <= x.size(1), "k must be in [1, vocab]");
  auto out = empty({x.size(0), k}, at::kLong);
  topk_indices(x.data_ptr<float>(), x.size(0), x.size(1), k, out.data_ptr<int64_t>());
  return out;
}

at::Tensor sample_rows_op(const at::Tensor& logits, at::ArrayRef<double> temps, at::ArrayRef<int64_t> top_ks,
                          at::ArrayRef<double> top_ps, at::ArrayRef<double> min_ps, at::ArrayRef<double> u) {
  const auto x = logits_rows(logits);
  const auto n = static_cast<size_t>(x.size(0));
  TORCH_CHECK(temps.size() == n && top_ks.size() == n && top_ps.size() == n && min_ps.size() == n && u.size() == n,
              "one sampling parameter per row");
  auto out = empty({x.size(0)}, at::kLong);
  sample_rows(x.data_ptr<float>(), x.size(0), x.size(1), temps.data(), top_ks.data(), top_ps.data(), min_ps.data(),
              u.data(), out.data_ptr<int64_t>());
  return out;
}

// ---- threads ----

std::vector<int64_t> bind_threads_op(at::IntArrayRef cpus) {
  return bind_threads(cpus.data(), static_cast<int64_t>(cpus.size()));
}

// ---- batch-invariant float linear ----

// y = x w^T (+ bias) in fp32, each row's numbers independent of the batch (dense/linear.h);
// bf16 weights take x rounded to bf16, as F.linear in that dtype would.
at::Tensor dense_linear_op(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.device().is_cpu() &&
                  (weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16),
              "weight must be a contiguous fp32 or bf16 [N, K] CPU tensor");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == weight.size(1), "x must be [M, K] with K = weight.size(1)");
  const int64_t M = x.size(0), K = weight.size(1), N = weight.size(0);
  at::Tensor b;
  if (bias.has_value()) {
    b = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(b.dim() == 1 && b.size(0) == N, "bias must be [N]");
  }
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  auto y = empty({M, N}, at::kFloat);
  if (weight.scalar_type() == at::kFloat) {
    const auto xc = x.to(at::kFloat).contiguous();
    dense::linear_f32(xc.data_ptr<float>(), K, M, K, weight.data_ptr<float>(), N, bp, y.data_ptr<float>());
  } else {
    const auto xc = x.to(at::kBFloat16).contiguous();
    dense::linear_bf16(reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>()), K, M, K,
                       reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>()), N, bp, y.data_ptr<float>());
  }
  return y;
}

// ---- GGUF block linear (on every CPU: gguf/dispatch.h picks the x86 or the generic kernels) ----

gguf::Layout checked_layout(int64_t type) {
  const gguf::Layout l = gguf::layout(type);
  TORCH_CHECK(l.block_weights > 0, "GGUF block type ", std::to_string(type), " has no CPU kernel");
  return l;
}

// The packed tensors of an [N, K] weight, as gguf_repack makes them.
std::vector<at::Tensor> empty_packed(int64_t type, int64_t N, int64_t K) {
  const gguf::Layout l = checked_layout(type);
  const int64_t tiles = N / 8, nb = K / 32;
  return {empty({tiles, nb, l.code_bytes}, at::kByte), empty({tiles, nb, l.hi_bytes}, at::kByte),
          empty({tiles, nb, l.scale_bytes}, at::kByte), empty({tiles, K / l.super, l.d_halves}, at::kHalf)};
}

gguf::Packed packed_view(const at::TensorList packed, int64_t type, int64_t& N, int64_t& K) {
  TORCH_CHECK(packed.size() == 4 && packed[0].dim() == 3, "pass the 4 tensors gguf_repack made");
  N = packed[0].size(0) * 8, K = packed[0].size(1) * 32;
  const gguf::Layout l = checked_layout(type);
  TORCH_CHECK(K % l.super == 0, "the packed tensors do not match the block type");
  const auto want = empty_packed(type, 0, 0);
  const int64_t sizes[4][3] = {{N / 8, K / 32, l.code_bytes}, {N / 8, K / 32, l.hi_bytes},
                               {N / 8, K / 32, l.scale_bytes}, {N / 8, K / l.super, l.d_halves}};
  for (size_t i = 0; i < 4; ++i) {
    const auto& t = packed[i];
    TORCH_CHECK(t.device().is_cpu() && t.is_contiguous() && t.scalar_type() == want[i].scalar_type() && t.dim() == 3 &&
                    t.size(0) == sizes[i][0] && t.size(1) == sizes[i][1] && t.size(2) == sizes[i][2],
                "packed tensor ", i, " does not match the block type or shape (pass what gguf_repack made)");
  }
  return {packed[0].data_ptr<uint8_t>(), packed[1].data_ptr<uint8_t>(), packed[2].data_ptr<uint8_t>(),
          reinterpret_cast<const uint16_t*>(packed[3].data_ptr<at::Half>())};
}

std::vector<at::Tensor> gguf_repack_op(const at::Tensor& weight, int64_t type, int64_t in_features) {
  TORCH_CHECK(weight.scalar_type() == at::kByte && weight.dim() == 2 && weight.is_contiguous(),
              "weight must be the contiguous uint8 [N, row_bytes] GGUF blocks");
  const gguf::Layout l = checked_layout(type);
  const int64_t N = weight.size(0), K = in_features;
  TORCH_CHECK(K % l.block_weights == 0 && K % l.super == 0 && weight.size(1) == K / l.block_weights * l.block_bytes,
              "GGUF row bytes do not match in_features");
  TORCH_CHECK(N % 8 == 0, "out_features must be a multiple of 8");
  auto packed = empty_packed(type, N, K);
  gguf::repack(weight.data_ptr<uint8_t>(), N, K, type, packed[0].data_ptr<uint8_t>(), packed[1].data_ptr<uint8_t>(),
               packed[2].data_ptr<uint8_t>(), reinterpret_cast<uint16_t*>(packed[3].data_ptr<at::Half>()));
  return packed;
}

at::Tensor gguf_linear_op(const at::Tensor& x, const at::TensorList packed, int64_t type, int64_t levels) {
  TORCH_CHECK(levels == 1 || levels == 2, "levels must be 1 or 2");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be fp32 [M, K]");
  int64_t N = 0, K = 0;
  const gguf::Packed w = packed_view(packed, type, N, K);
  TORCH_CHECK(x.size(1) == K, "x does not match the packed weight");
  const auto xc = x.contiguous();
  auto y = empty({x.size(0), N}, at::kFloat);
  gguf::run_linear(xc.data_ptr<float>(), x.size(0), K, w, N, type, levels, y.data_ptr<float>());
  return y;
}

// A MoE projection of all routed experts: x's rows sorted by expert, offsets [E + 1] their
// bounds; packed is the experts' stacked [E * N, K] weight -> y [rows, N].
at::Tensor gguf_linear_grouped_op(const at::Tensor& x, const at::TensorList packed, int64_t type, int64_t levels,
                                  const at::Tensor& offsets) {
  TORCH_CHECK(levels == 1 || levels == 2, "levels must be 1 or 2");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be fp32 [M, K]");
  TORCH_CHECK(offsets.dim() == 1 && offsets.numel() >= 2 && offsets.scalar_type() == at::kLong && offsets.device().is_cpu(),
              "offsets must be int64 [experts + 1]");
  int64_t N = 0, K = 0;
  const gguf::Packed w = packed_view(packed, type, N, K);
  const int64_t E = offsets.numel() - 1;
  TORCH_CHECK(N % (E * 8) == 0, "the packed rows do not split into ", std::to_string(E), " experts of whole 8-row tiles");
  TORCH_CHECK(x.size(1) == K, "x does not match the packed weight");
  const auto oc = offsets.contiguous();
  const int64_t* o = oc.data_ptr<int64_t>();
  TORCH_CHECK(o[0] == 0 && o[E] == x.size(0), "offsets must run from 0 to x's row count");
  for (int64_t e = 0; e < E; ++e) TORCH_CHECK(o[e] <= o[e + 1], "offsets must not decrease");
  const auto xc = x.contiguous();
  auto y = empty({x.size(0), N / E}, at::kFloat);
  gguf::run_linear_grouped(xc.data_ptr<float>(), x.size(0), K, w, E, N / E, o, type, levels, y.data_ptr<float>());
  return y;
}

// A GGUF mixture-of-experts block (gguf/experts.h's moe_experts): x [T, H] fp32, weights [T, k]
// fp32, ids [T, k] int64; w13 gate and up fused, or gate alone with up in w3 (empty: fused);
// w2 down; b13 [E, 2I], b2 [E, H] fp32 or none -> y [T, H].
at::Tensor gguf_moe_experts_op(const at::Tensor& x, const at::Tensor& weights, const at::Tensor& ids,
                               const at::TensorList w13, int64_t w13_type, const at::TensorList w3, int64_t w3_type,
                               const at::TensorList w2, int64_t w2_type, const std::optional<at::Tensor>& b13,
                               const std::optional<at::Tensor>& b2, double limit, double alpha, int64_t levels) {
  TORCH_CHECK(levels == 1 || levels == 2, "levels must be 1 or 2");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be fp32 [T, H]");
  TORCH_CHECK(ids.dim() == 2 && ids.size(0) == x.size(0) && ids.scalar_type() == at::kLong, "ids must be int64 [T, k]");
  TORCH_CHECK(weights.sizes() == ids.sizes() && weights.scalar_type() == at::kFloat, "weights must be fp32 [T, k]");
  int64_t N13 = 0, K13 = 0, N2 = 0, K2 = 0, N3 = 0, K3 = 0;
  const gguf::Projection p13{packed_view(w13, w13_type, N13, K13), w13_type};
  const gguf::Projection p2{packed_view(w2, w2_type, N2, K2), w2_type};
  const int64_t H = x.size(1), I = K2;
  TORCH_CHECK(K13 == H && N2 % H == 0, "the experts' packed weights do not match x");
  const int64_t E = N2 / H;
  gguf::Projection p3{};
  if (!w3.empty()) {
    p3 = {packed_view(w3, w3_type, N3, K3), w3_type};
    TORCH_CHECK(N13 == E * I && N3 == E * I && K3 == H, "gate and up do not match down");
  } else {
    TORCH_CHECK(N13 == E * 2 * I, "gate_up does not match down");
  }
  const auto check_bias = [&](const std::optional<at::Tensor>& b, int64_t n) -> const float* {
    if (!b.has_value()) return nullptr;
    TORCH_CHECK(b->scalar_type() == at::kFloat && b->is_contiguous() && b->numel() == E * n, "an expert bias must be fp32 [E, ", std::to_string(n), "]");
    return b->data_ptr<float>();
  };
  const float* b13p = check_bias(b13, 2 * I);
  const float* b2p = check_bias(b2, H);
  const auto xc = x.contiguous();
  const auto wc = weights.contiguous();
  const auto ic = ids.contiguous();
  auto y = empty({x.size(0), H}, at::kFloat);
  gguf::moe_experts(xc.data_ptr<float>(), x.size(0), H, wc.data_ptr<float>(), ic.data_ptr<int64_t>(), ids.size(1), E, I,
                    p13, w3.empty() ? nullptr : &p3, p2, b13p, b2p, static_cast<float>(limit), static_cast<float>(alpha),
                    levels, y.data_ptr<float>());
  return y;
}

at::Tensor gguf_dequantize_op(const at::TensorList packed, int64_t type, at::ScalarType dtype) {
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "dequantize to float32 or bfloat16");
  int64_t N = 0, K = 0;
  const gguf::Packed w = packed_view(packed, type, N, K);
  auto out = empty({N, K}, dtype);
  gguf::run_dequantize(w, N, K, type, dtype == at::kBFloat16, out.data_ptr());
  return out;
}

std::string gguf_kernels_op() { return gguf::kernels_name(); }

}  // namespace
}  // namespace localllm_cpu

TORCH_LIBRARY(localllm_cpu, m) {
  m.def("store_kv(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) -> ()");
  m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor query_start_loc, Tensor seq_lens, "
        "Tensor block_tables, float scale, int max_q, int max_splits=0, int window=0, Tensor? sinks=None) -> Tensor");
  m.def("argmax_rows(Tensor logits) -> Tensor");
  m.def("topk_indices(Tensor logits, int k) -> Tensor");
  m.def("sample_rows(Tensor logits, float[] temps, int[] top_ks, float[] top_ps, float[] min_ps, float[] u) -> Tensor");
  m.def("dense_linear(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor");
  // no tensor to dispatch on: a catch-all kernel
  m.def("bind_threads(int[] cpus) -> int[]", &localllm_cpu::bind_threads_op);
  m.def("gguf_kernels() -> str", &localllm_cpu::gguf_kernels_op);  // which kernels a GGUF op called now runs
  m.def("gguf_repack(Tensor weight, int type, int in_features) -> Tensor[]");
  m.def("gguf_linear(Tensor x, Tensor[] packed, int type, int levels) -> Tensor");
  m.def("gguf_dequantize(Tensor[] packed, int type, ScalarType dtype) -> Tensor");
  m.def("gguf_linear_grouped(Tensor x, Tensor[] packed, int type, int levels, Tensor offsets) -> Tensor");
  m.def("gguf_moe_experts(Tensor x, Tensor weights, Tensor ids, Tensor[] w13, int w13_type, Tensor[] w3, int w3_type, "
        "Tensor[] w2, int w2_type, Tensor? b13, Tensor? b2, float limit, float alpha, int levels) -> Tensor");
}

TORCH_LIBRARY_IMPL(localllm_cpu, CPU, m) {
  m.impl("store_kv", &localllm_cpu::store_kv_op);
  m.impl("paged_attention", &localllm_cpu::paged_attention_op);
  m.impl("argmax_rows", &localllm_cpu::argmax_rows_op);
  m.impl("topk_indices", &localllm_cpu::topk_indices_op);
  m.impl("sample_rows", &localllm_cpu::sample_rows_op);
  m.impl("dense_linear", &localllm_cpu::dense_linear_op);
  m.impl("gguf_repack", &localllm_cpu::gguf_repack_op);
  m.impl("gguf_linear", &localllm_cpu::gguf_linear_op);
  m.impl("gguf_dequantize", &localllm_cpu::gguf_dequantize_op);
  m.impl("gguf_linear_grouped", &localllm_cpu::gguf_linear_grouped_op);
  m.impl("gguf_moe_experts", &localllm_cpu::gguf_moe_experts_op);
}
