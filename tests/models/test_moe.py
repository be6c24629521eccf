"""The mixture-of-experts families against transformers itself: a tiny random Qwen3-MoE and
gpt-oss made here by transformers, saved as safetensors and written as GGUF under llama.cpp's
names (experts stacked per layer) with the ``gguf`` package. fp32 logits equal transformers'
at every position; greedy tokens equal through the engine, batched, with a prefix-cache hit
and (gpt-oss) prompts past its window; the compiled CPU decode step runs the MoE block and the
sink attention in its one graph (gpt-oss only: one compile in CI)."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from localllm import LLM, SamplingParams
from localllm.errors import LocalLLMError
from localllm.models.config import ModelConfig
from localllm.models.loader import load_model
from localllm.models.registry import FAMILIES, model_class
from localllm.quant.forward import prefill_logits
from tests.tiers import matrix
from tests.models.test_families import PROMPTS, VOCAB, WINDOW, _hf_greedy, _hf_logits, family_tokenizer  # noqa: F401

transformers = pytest.importorskip("transformers")

NEW_TOKENS = 10
_CLASSES = {"qwen3_moe": "Qwen3MoeForCausalLM", "gpt_oss": "GptOssForCausalLM"}


@dataclass(frozen=True, slots=True)
class MoEModel:
    name: str
    hf: Path
    gguf: Path
    model: Any  # the transformers model, fp32, eval
    gguf_model: Any  # what the GGUF holds as transformers runs it (gpt-oss: llama.cpp's YaRN truncation)


def _config(name: str) -> Any:
    common = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  num_hidden_layers=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
                  pad_token_id=None, tie_word_embeddings=False, num_experts_per_tok=2)
    if name == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**common, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                                           norm_topk_prob=True)
    # a low swiglu_limit so that the clamps bite on random weights; YaRN as gpt-oss ships it
    return transformers.GptOssConfig(**common, intermediate_size=32, num_local_experts=8, sliding_window=WINDOW,
                                     swiglu_limit=0.3)


def _gguf_tensors(name: str, sd: dict[str, torch.Tensor], cfg: Any) -> list[tuple[str, torch.Tensor]]:
    """The state dict as llama.cpp's converters write it: experts stacked [E, out, in] per
    layer (gpt-oss's interleaved gate/up split apart), the router as ffn_gate_inp."""
    table = {hf: gg for gg, hf in FAMILIES[_CLASSES[name]].gguf_names.items()}
    out = [("token_embd.weight", sd["model.embed_tokens.weight"]), ("output_norm.weight", sd["model.norm.weight"]),
           ("output.weight", sd["lm_head.weight"])]
    for layer in range(cfg.num_hidden_layers):
        pre = f"model.layers.{layer}."
        for key, t in sd.items():
            if not key.startswith(pre):
                continue
            rest = key.removeprefix(pre)
            blk = f"blk.{layer}"
            if ".experts." in rest:
                leaf = rest.removeprefix("mlp.experts.")
                if name == "qwen3_moe":  # transformers 5 holds them fused: [E, 2I, H] and [E, H, I]
                    if leaf == "gate_up_proj":
                        gate, up = t.chunk(2, dim=1)
                        out += [(f"{blk}.ffn_gate_exps.weight", gate), (f"{blk}.ffn_up_exps.weight", up)]
                    else:
                        out.append((f"{blk}.ffn_down_exps.weight", t))
                    continue
                if leaf == "gate_up_proj":
                    out += [(f"{blk}.ffn_gate_exps.weight", t[:, :, 0::2].transpose(1, 2)),
                            (f"{blk}.ffn_up_exps.weight", t[:, :, 1::2].transpose(1, 2))]
                elif leaf == "gate_up_proj_bias":
                    out += [(f"{blk}.ffn_gate_exps.bias", t[:, 0::2]), (f"{blk}.ffn_up_exps.bias", t[:, 1::2])]
                elif leaf == "down_proj":
                    out.append((f"{blk}.ffn_down_exps.weight", t.transpose(1, 2)))
                else:
                    out.append((f"{blk}.ffn_down_exps.bias", t))
            elif rest.startswith(("mlp.gate.", "mlp.router.")):
                out.append((f"{blk}.ffn_gate_inp.{rest.rpartition('.')[2]}", t))
            elif rest == "self_attn.sinks":
                out.append((f"{blk}.attn_sinks.weight", t))
            elif name == "gpt_oss" and rest.startswith("post_attention_layernorm"):
                out.append((f"{blk}.post_attention_norm.weight", t))
            else:
                module, _, leaf = rest.rpartition(".")
                out.append((f"{blk}.{table[module]}.{leaf}", t))
    return out


def _write_gguf(path: Path, name: str, cfg: Any, sd: dict[str, torch.Tensor], tokenizer_fields: dict,
                mxfp4: bool = False) -> None:
    import gguf

    w = gguf.GGUFWriter(path, FAMILIES[_CLASSES[name]].gguf_architecture)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_expert_count(cfg.num_experts if name == "qwen3_moe" else cfg.num_local_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    if name == "qwen3_moe":
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    else:  # as convert_hf_to_gguf.py writes gpt-oss
        w.add_expert_feed_forward_length(cfg.intermediate_size)
        w.add_sliding_window(cfg.sliding_window)
        rope = cfg.rope_parameters
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    w.add_tokenizer_model(tokenizer_fields["tokenizer.ggml.model"])
    w.add_tokenizer_pre(tokenizer_fields["tokenizer.ggml.pre"])
    w.add_token_list(tokenizer_fields["tokenizer.ggml.tokens"])
    w.add_token_types(tokenizer_fields["tokenizer.ggml.token_type"])
    w.add_token_merges(tokenizer_fields["tokenizer.ggml.merges"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    for n, t in _gguf_tensors(name, sd, cfg):
        if mxfp4 and "_exps.weight" in n:  # as llama.cpp ships gpt-oss: experts in MXFP4
            blocks = gguf.quants.quantize(t.float().contiguous().numpy(), gguf.GGMLQuantizationType.MXFP4)
            w.add_tensor(n, blocks, raw_shape=blocks.shape, raw_dtype=gguf.GGMLQuantizationType.MXFP4)
        else:
            w.add_tensor(n, t.float().contiguous().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _make(name: str, tokenizer: tuple[Path, dict], root: Path) -> MoEModel:
    cfg = _config(name)
    torch.manual_seed({"qwen3_moe": 5, "gpt_oss": 6}[name])
    model = getattr(transformers, _CLASSES[name])(cfg).float().eval()
    with torch.no_grad():  # transformers initialises norms to 1, sinks and biases to 0: random ones test them
        for key, p in model.named_parameters():
            if "norm" in key:
                p.add_(torch.randn_like(p) * 0.2)
            elif "sinks" in key or "bias" in key:
                p.copy_(torch.randn_like(p) * (1.0 if "sinks" in key else 0.1))
    hf = root / name
    model.save_pretrained(hf)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer[0] / f, hf / f)
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    gguf_model = model
    if name == "gpt_oss":
        # what a GGUF cannot say, llama.cpp fixes: YaRN's ramp ends rounded to whole dimensions
        # (transformers' truncate=True; gpt-oss's config.json says False) and the SwiGLU limit 7
        cfg_gguf = transformers.GptOssConfig(**{**cfg.to_dict(), "swiglu_limit": 7.0,
                                                "rope_parameters": {**cfg.rope_parameters, "truncate": True}})
        gguf_model = transformers.GptOssForCausalLM(cfg_gguf).float().eval()
        gguf_model.load_state_dict(model.state_dict())
    path = root / f"{name}.gguf"
    _write_gguf(path, name, cfg, sd, tokenizer[1])
    return MoEModel(name, hf, path, model, gguf_model)


@pytest.fixture(scope="session", params=list(_CLASSES))
def moe_model(request, family_tokenizer, tmp_path_factory) -> MoEModel:  # noqa: F811
    return _make(request.param, family_tokenizer, tmp_path_factory.mktemp(f"moe-{request.param}"))


@pytest.mark.parametrize("fmt", ["hf", "gguf"])
def test_fp32_logits_equal_transformers(moe_model: MoEModel, fmt: str) -> None:
    loaded = load_model(str(moe_model.hf if fmt == "hf" else moe_model.gguf), dtype="float32", device="cpu",
                        compile=False)
    assert type(loaded.model) is FAMILIES[_CLASSES[moe_model.name]].model_class
    ids = PROMPTS[0]  # 40 tokens: five windows of gpt-oss's sliding layers
    got = prefill_logits(loaded.model, ids)
    want = _hf_logits(moe_model.model if fmt == "hf" else moe_model.gguf_model, ids)
    torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)
    windows = [s.sliding_window for s in loaded.model.kv_spec()]
    assert windows == ([WINDOW, None] if moe_model.name == "gpt_oss" else [None, None])


def test_greedy_tokens_through_the_engine(moe_model: MoEModel) -> None:
    """All prompts in one batch (decode steps of several sequences route their tokens to
    different experts in one call), then one that hits the first's cached prefix."""
    want = [_hf_greedy(moe_model.model, p, NEW_TOKENS) for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    llm = LLM(str(moe_model.hf), dtype="float32", device="cpu", max_model_len=128, block_size=16)
    first = llm.generate(PROMPTS[:3], params)
    again = llm.generate(PROMPTS[3:], params)
    assert [o.outputs[0].token_ids for o in first + again] == want
    assert llm.engine.stats().prefix_cache_hit_tokens >= 32  # noqa: PLR2004


@pytest.mark.compile
@pytest.mark.parametrize("moe_model", matrix(list(_CLASSES), ci=["gpt_oss"]), indirect=True)
def test_compiled_decode_runs_the_moe_block(moe_model: MoEModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """The compiled CPU decode step (one graph: routing, the expert op, the sink attention)
    is the path in use and gives the eager path's tokens. CI compiles gpt-oss, which holds
    both custom ops."""
    monkeypatch.delenv("LOCALLLM_NO_COMPILE", raising=False)
    params = [SamplingParams(temperature=0, max_tokens=NEW_TOKENS + 4 * i, ignore_eos=True) for i in range(3)]
    eager = LLM(str(moe_model.hf), dtype="float32", device="cpu", compile=False, max_model_len=128)
    compiled = LLM(str(moe_model.hf), dtype="float32", device="cpu", compile=True, compile_in_background=False,
                   max_model_len=128)
    assert compiled.engine.runner._decode_gives_logits  # compiled, not dropped to eager
    got = [o.outputs[0].token_ids for o in compiled.generate(PROMPTS[:3], params)]
    assert got == [o.outputs[0].token_ids for o in eager.generate(PROMPTS[:3], params)]


def test_a_bf16_plan_stays_close(moe_model: MoEModel) -> None:
    loaded = load_model(str(moe_model.hf), dtype="bfloat16", device="cpu", compile=False)
    assert loaded.model.model.layers[0].mlp.w13.dtype == torch.bfloat16
    assert loaded.model.model.layers[0].mlp.gate.weight.dtype == torch.bfloat16
    got = prefill_logits(loaded.model, PROMPTS[2])
    want = _hf_logits(moe_model.model, PROMPTS[2])
    assert (got - want).abs().max() < 0.1 * want.abs().max()


def test_param_counts_total_and_active(moe_model: MoEModel) -> None:
    """Total is every parameter the model holds; active counts k of the E experts (and the
    head, not the embedding); the planner's sizing agrees from the dims alone."""
    from localllm.hardware.sizing import decode_read_bytes, param_counts, weight_bytes

    cfg = ModelConfig.from_hf(json.loads((moe_model.hf / "config.json").read_text()))
    with torch.device("meta"):
        model = model_class(cfg)(cfg)
    total, active = model.param_counts()
    assert total == sum(p.numel() for p in model.parameters())
    mlp = model.model.layers[0].mlp
    per_expert = (mlp.w13.numel() + mlp.w2.numel()) // cfg.num_experts + (
        (mlp.b13.numel() + mlp.b2.numel()) // cfg.num_experts if mlp.b13 is not None else 0)
    skipped = cfg.num_layers * (cfg.num_experts - cfg.num_experts_per_tok) * per_expert
    assert active == total - skipped - model.model.embed_tokens.weight.numel()
    sizing = param_counts(cfg)
    assert abs(sizing.total - total) < 0.01 * total
    assert weight_bytes(cfg, "float32") == 4 * sizing.total  # memory: every expert
    # a decode step reads the k routed experts, the head, one row of the embedding
    assert abs(decode_read_bytes(cfg, "float32") - 4 * active) < 0.01 * 4 * active


def test_unrunnable_moe_settings_are_refused_in_one_line(moe_model: MoEModel) -> None:
    raw = json.loads((moe_model.hf / "config.json").read_text())
    if moe_model.name == "qwen3_moe":
        bad, key = {**raw, "mlp_only_layers": [0]}, "mlp_only_layers"
    else:
        bad, key = {**raw, "quantization_config": {"quant_method": "mxfp4"}}, "MXFP4"
    with pytest.raises(LocalLLMError) as e:
        ModelConfig.from_hf(bad, "config.json")
    assert key in str(e.value) and "\n" not in str(e.value)


def _mxfp4_round_trip(t: torch.Tensor) -> torch.Tensor:
    """``t`` [E, in, out] (transformers' layout of gpt-oss's experts) as MXFP4 holds it:
    each output row quantized along ``in``, as the GGUF stores it ([E, out, in])."""
    import gguf

    rows = t.transpose(1, 2).contiguous()
    kind = gguf.GGMLQuantizationType.MXFP4
    back = gguf.quants.dequantize(gguf.quants.quantize(rows.numpy(), kind), kind)
    return torch.from_numpy(back.copy()).reshape(rows.shape).transpose(1, 2)


def test_gpt_oss_gguf_with_mxfp4_experts(family_tokenizer, tmp_path: Path) -> None:  # noqa: F811
    """llama.cpp ships gpt-oss's experts in MXFP4: such a file loads (the experts
    dequantized; no MXFP4 expert kernel yet) and gives transformers' logits over the same
    rounded experts."""
    import gguf  # noqa: F401

    cfg = _config("gpt_oss")
    cfg = transformers.GptOssConfig(**{**cfg.to_dict(), "swiglu_limit": 7.0,
                                       "rope_parameters": {**cfg.rope_parameters, "truncate": True}})
    torch.manual_seed(7)
    model = transformers.GptOssForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for key, p in model.named_parameters():
            if key.endswith("experts.gate_up_proj") or key.endswith("experts.down_proj"):
                p.copy_(_mxfp4_round_trip(p))
    path = tmp_path / "gpt-oss-mxfp4.gguf"
    _write_gguf(path, "gpt_oss", cfg, {k: v.detach() for k, v in model.state_dict().items()}, family_tokenizer[1],
                mxfp4=True)
    loaded = load_model(str(path), dtype="float32", device="cpu", compile=False)
    torch.testing.assert_close(prefill_logits(loaded.model, PROMPTS[2]), _hf_logits(model, PROMPTS[2]),
                               atol=2e-4, rtol=2e-4)
    # the plan charges the experts at their float size, as they are held
    held = sum(p.numel() * 4 for n, p in loaded.model.named_parameters() if ".mlp.w" in n)
    assert loaded.plan.weight_bytes >= held


@pytest.mark.parametrize("bias", [False, True])
def test_gathered_experts_equal_the_grouped_op(bias: bool) -> None:
    """The CUDA-graph form of the expert op (gathered weights, no host-side counts) gives the
    grouped op's sums, routing with and without renormalised weights alike."""
    from localllm.models.moe import experts_gathered, moe_experts, route

    torch.manual_seed(0)
    E, H, I, T = 6, 32, 16, 5
    w13, w2 = torch.randn(E, 2 * I, H), torch.randn(E, H, I)
    b13, b2 = (torch.randn(E, 2 * I), torch.randn(E, H)) if bias else (None, None)
    x = torch.randn(T, H)
    for renormalize in (False, True):
        weights, ids = route(torch.randn(T, E), 3, renormalize)
        assert torch.allclose(weights.sum(1), torch.ones(T)) == renormalize
        for limit in (0.0, 0.5):
            got = experts_gathered(x, weights, ids, w13, w2, b13, b2, limit, 1.702)
            torch.testing.assert_close(got, moe_experts(x, weights, ids, w13, w2, b13, b2, limit, 1.702))


def test_graph_safe_sink_decode_equals_the_sequence_loop() -> None:
    """The CUDA-graph form of the sink attention (whole tables gathered, lengths masked on
    the device) gives the per-sequence form's rows, window or not."""
    from localllm.models.attention_sinks import decode_with_sinks, paged_attention_sinks

    torch.manual_seed(0)
    blocks, bs, kvh, h, d = 12, 4, 2, 4, 8
    k_cache, v_cache = torch.randn(blocks, bs, kvh, d), torch.randn(blocks, bs, kvh, d)
    lens = torch.tensor([3, 9, 14], dtype=torch.int32)
    tables = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]], dtype=torch.int32)
    q, sinks = torch.randn(3, h, d), torch.randn(h)
    qsl = torch.arange(4, dtype=torch.int32)
    for window in (0, 5):
        want = paged_attention_sinks(q, k_cache, v_cache, qsl, lens, tables, 0.3, sinks, window, None, None)
        got = decode_with_sinks(q, k_cache, v_cache, lens, tables, 0.3, sinks, window, None, None)
        torch.testing.assert_close(got, want)
