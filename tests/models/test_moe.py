"""The mixture-of-experts families against transformers itself: a tiny random Qwen3-MoE and
gpt-oss made here by transformers, saved as safetensors and written as GGUF under llama.cpp's
names (experts stacked per layer) with the ``gguf`` package. fp32 logits equal transformers'
at every position; greedy tokens equal through the engine, batched, with a prefix-cache hit
and (gpt-oss) prompts past its window; the compiled CPU decode step runs the MoE block and the
sink attention in its one graph (gpt-oss only: one compile in CI).

The same models written with quantized experts (Q8_0, Q5_0, Q4_K, Q6_K for Qwen3-MoE; MXFP4 for
gpt-oss) load under the default GGUF plan with the experts kept as stored
(quant/gguf_experts.py) and match the model dequantized by the gguf package."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from localllm import LLM, SamplingParams
from localllm.errors import LocalLLMError
from localllm.models.config import ModelConfig
from localllm.models.loader import load_model
from localllm.models.registry import FAMILIES, model_class
from localllm.quant.forward import prefill_logits
from tests.tiers import matrix
from tests.models.test_families import (  # noqa: F401
    LLAMA_SERVER, PROMPTS, VOCAB, WINDOW, _hf_greedy, _hf_logits, family_tokenizer, llama_server_greedy)

transformers = pytest.importorskip("transformers")

NEW_TOKENS = 10
LLAMA_CPP_TOKENS = 8  # llama.cpp's one int8 level of activations may turn a near tie later on
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
        # experts 256 wide, so that ffn_down_exps takes K-quant blocks (256-weight rows)
        return transformers.Qwen3MoeConfig(**common, intermediate_size=96, moe_intermediate_size=256, num_experts=8,
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

    tensors: list[tuple[str, np.ndarray, Any]] = []
    for n, t in _gguf_tensors(name, sd, cfg):
        if mxfp4 and "_exps.weight" in n:  # as llama.cpp ships gpt-oss: experts in MXFP4
            kind = gguf.GGMLQuantizationType.MXFP4
            tensors.append((n, gguf.quants.quantize(t.float().contiguous().numpy(), kind), kind))
        else:
            tensors.append((n, t.float().contiguous().numpy(), None))
    _write_tensors(path, name, cfg, tensors, tokenizer_fields)


def _write_tensors(path: Path, name: str, cfg: Any, tensors: list[tuple[str, np.ndarray, Any]],
                   tokenizer_fields: dict) -> None:
    """A GGUF of ``tensors``: (name, array, ggml type of its blocks or None for a float array)."""
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
    for n, arr, kind in tensors:
        if kind is None:
            w.add_tensor(n, arr)
        else:
            w.add_tensor(n, arr, raw_shape=arr.shape, raw_dtype=kind)
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


# ---- experts kept as the file stores them (quant/gguf_experts.py) ----

# Per layer, the stored type of ffn_gate_exps, ffn_up_exps, ffn_down_exps: Qwen3-MoE as a
# Q4_K_M mixes them (K-quants need 256-wide rows: only down's, moe_intermediate_size, are here;
# layer 1's gate and up of different types take the unfused path); gpt-oss in MXFP4 as every
# llama.cpp file holds it. Every other matrix Q8_0, the router, norms, biases and sinks F32.
EXPERT_TYPES = {"qwen3_moe": [("Q8_0", "Q8_0", "Q4_K"), ("Q8_0", "Q5_0", "Q6_K")],
                "gpt_oss": [("MXFP4", "MXFP4", "MXFP4")] * 2}

# the experts' weights scaled up from transformers' init, so that their outputs steer the
# tiny models' greedy tokens (at init scale gpt-oss's repeat two tokens whatever the experts)
EXPERT_SCALE = 8.0


@dataclass(frozen=True, slots=True)
class QuantizedMoE:
    name: str
    quantized: Path  # experts in EXPERT_TYPES' blocks, the other matrices Q8_0
    reference: Path  # the same model with every block tensor as gguf.quants.dequantize gives it, in F32
    expert_bytes: int  # the stacked experts' bytes in the quantized file
    tensor_bytes: int  # every tensor's bytes in the quantized file


def _kquant_blocks(kind: str, shape: tuple[int, ...], gen: np.random.Generator) -> np.ndarray:
    """Random valid blocks of a K-quant the gguf package cannot quantize to, their fp16 super
    scales small enough for weights of about transformers' init scale."""
    from localllm.quant import gguf_formats as gf

    f = gf.fmt(kind)
    nblk = int(np.prod(shape)) // f.block_weights
    raw = gen.integers(0, 256, (nblk, f.block_bytes), dtype=np.uint8)
    if kind == "Q4_K":  # d, dmin first
        raw[:, :4] = gen.uniform(1e-4, 3e-4, (nblk, 2)).astype(np.float16).view(np.uint8)
    else:  # Q6_K: d last
        raw[:, 208:] = gen.uniform(1e-5, 3e-5, (nblk, 1)).astype(np.float16).view(np.uint8)
    return raw.reshape(*shape[:-1], shape[-1] // f.block_weights * f.block_bytes)


def _quantized_files(m: MoEModel, tokenizer_fields: dict, root: Path) -> QuantizedMoE:
    import gguf

    T = gguf.GGMLQuantizationType
    cfg = _config(m.name)
    sd = {k: v.detach() for k, v in m.model.state_dict().items()}
    gen = np.random.default_rng(11)
    quantized, reference, expert_bytes = [], [], 0
    for n, t in _gguf_tensors(m.name, sd, cfg):
        arr = t.float().contiguous().numpy()
        if "_exps.weight" in n:
            arr = arr * EXPERT_SCALE
            layer, part = int(n.split(".")[1]), ("gate", "up", "down").index(n.split(".")[2].split("_")[1])
            kind = EXPERT_TYPES[m.name][layer][part]
        elif n.endswith(".weight") and arr.ndim == 2 and "ffn_gate_inp" not in n:
            kind = "Q8_0"
        else:
            quantized.append((n, arr, None))
            reference.append((n, arr, None))
            continue
        blocks = _kquant_blocks(kind, arr.shape, gen) if kind in ("Q4_K", "Q6_K") else gguf.quants.quantize(arr, T[kind])
        quantized.append((n, blocks, T[kind]))
        reference.append((n, gguf.quants.dequantize(blocks, T[kind]).reshape(arr.shape), None))
        expert_bytes += blocks.nbytes if "_exps.weight" in n else 0
    q, ref = root / f"{m.name}-q.gguf", root / f"{m.name}-ref.gguf"
    _write_tensors(q, m.name, cfg, quantized, tokenizer_fields)
    _write_tensors(ref, m.name, cfg, reference, tokenizer_fields)
    return QuantizedMoE(m.name, q, ref, expert_bytes, sum(arr.nbytes for _, arr, _ in quantized))


@pytest.fixture(scope="session")
def quantized_moe(moe_model: MoEModel, family_tokenizer, tmp_path_factory) -> QuantizedMoE:  # noqa: F811
    return _quantized_files(moe_model, family_tokenizer[1], tmp_path_factory.mktemp(f"moe-q-{moe_model.name}"))


def test_gguf_experts_kept_as_stored(quantized_moe: QuantizedMoE) -> None:
    """A GGUF plan keeps every layer's experts in the file's blocks (no float expert matrix
    anywhere), in about the file's expert bytes, names their types in the plan's reason, and
    gives the logits of the same model with the blocks dequantized by the gguf package (what
    the kernels multiply, up to their int8 activations)."""
    from localllm.quant.gguf_experts import GGUFExperts

    loaded = load_model(str(quantized_moe.quantized), device="cpu", compile=False)
    assert loaded.precision.startswith("gguf-")
    layers = loaded.model.model.layers
    assert all(isinstance(layer.mlp.experts, GGUFExperts) and layer.mlp.w13 is None for layer in layers)
    assert not [n for n, _ in loaded.model.named_parameters() if ".mlp.w" in n]
    want = EXPERT_TYPES[quantized_moe.name]
    from localllm.quant import gguf_formats as gf

    for layer, (gate, up, down) in zip(layers, want):
        ex = layer.mlp.experts
        assert gf.type_name(ex.w13.block_type) == gate and gf.type_name(ex.w2.block_type) == down
        assert gf.type_name((ex.w3 or ex.w13).block_type) == up and (ex.w3 is None) == (gate == up)
    held = sum(b.numel() * b.element_size() for layer in layers for b in layer.mlp.experts.buffers())
    assert abs(held - quantized_moe.expert_bytes) <= 0.05 * quantized_moe.expert_bytes  # repacked, not expanded
    assert abs(loaded.plan.weight_bytes - quantized_moe.tensor_bytes) <= 0.01 * quantized_moe.tensor_bytes
    assert "stacked experts as stored" in " ".join(loaded.plan.reasons)
    for kind in {t for layer in want for t in layer}:
        assert kind in " ".join(loaded.plan.reasons)
    ref = load_model(str(quantized_moe.reference), dtype="float32", device="cpu", compile=False)
    got, exact = prefill_logits(loaded.model, PROMPTS[0]), prefill_logits(ref.model, PROMPTS[0])
    assert (got - exact).abs().max() < 0.02 * exact.abs().max()  # noqa: PLR2004


def test_gguf_experts_greedy_tokens_through_the_engine(quantized_moe: QuantizedMoE) -> None:
    """The engine on the quantized file (batched decode steps routing tokens to different
    experts in one call) gives the greedy tokens of the dequantized reference."""
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    ref = LLM(str(quantized_moe.reference), dtype="float32", device="cpu", max_model_len=128)
    want = [o.outputs[0].token_ids for o in ref.generate(PROMPTS, params)]
    llm = LLM(str(quantized_moe.quantized), device="cpu", max_model_len=128)
    assert llm.engine.runner.model.model.layers[0].mlp.experts is not None
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)] == want


@pytest.mark.skipif(not LLAMA_SERVER.is_file(), reason="needs llama-server (bench/peers.py --build)")
def test_gguf_experts_greedy_tokens_as_llama_cpp(quantized_moe: QuantizedMoE) -> None:
    """The engine's greedy tokens on the quantized file are llama.cpp's on the same model
    dequantized (its float path: no activation rounding), token for token; and llama.cpp on
    the quantized file itself starts every continuation as the engine does. Measured: gpt-oss
    (MXFP4) 32 of 32 tokens equal on the quantized file; Qwen3-MoE 2 of 4 prompts equal
    throughout, the others until a near tie at token 3 and 5, where llama.cpp's one int8 level
    of activations (the engine keeps two) departs from its own float answer."""
    params = SamplingParams(temperature=0, max_tokens=LLAMA_CPP_TOKENS, ignore_eos=True)
    llm = LLM(str(quantized_moe.quantized), device="cpu", max_model_len=128)
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    assert got == llama_server_greedy(quantized_moe.reference, PROMPTS, LLAMA_CPP_TOKENS)
    theirs = llama_server_greedy(quantized_moe.quantized, PROMPTS, LLAMA_CPP_TOKENS)
    assert all(a[:2] == b[:2] for a, b in zip(got, theirs))
    if quantized_moe.name == "gpt_oss":
        assert got == theirs


@pytest.mark.compile
@pytest.mark.parametrize("moe_model", matrix(list(_CLASSES), ci=["qwen3_moe"]), indirect=True)
def test_compiled_decode_runs_gguf_experts(moe_model: MoEModel, quantized_moe: QuantizedMoE,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A GGUF file's default CPU plan compiles its decode step with the experts' op in the one
    graph (not dropped to eager) and gives the eager path's tokens. CI compiles Qwen3-MoE: its
    experts take both the fused and the unfused gate/up path."""
    monkeypatch.delenv("LOCALLLM_NO_COMPILE", raising=False)
    params = [SamplingParams(temperature=0, max_tokens=NEW_TOKENS + 4 * i, ignore_eos=True) for i in range(3)]
    eager = LLM(str(quantized_moe.quantized), device="cpu", compile=False, max_model_len=128)
    compiled = LLM(str(quantized_moe.quantized), device="cpu", compile=True, compile_in_background=False,
                   max_model_len=128)
    assert compiled.engine.runner._decode_gives_logits  # compiled, not dropped to eager
    got = [o.outputs[0].token_ids for o in compiled.generate(PROMPTS[:3], params)]
    assert got == [o.outputs[0].token_ids for o in eager.generate(PROMPTS[:3], params)]


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


@pytest.mark.parametrize("model_id", ["qwen3-30b-a3b", "gpt-oss-20b"])
def test_gguf_sizing_charges_experts_as_stored(model_id: str) -> None:
    """A GGUF plan on the CPU holds the experts' blocks: the catalog's Q4_K_M weighs its file
    (gpt-oss's experts MXFP4, as every llama.cpp file keeps them), the reason names the
    experts' types; the GPU's Triton kernels hold them as stored too."""
    from dataclasses import replace

    from localllm.catalog import get_entry
    from localllm.hardware.sizing import decode_read_bytes, gguf_catalog_weights, weight_bytes

    entry = get_entry(model_id)
    g = gguf_catalog_weights(entry)
    assert weight_bytes(entry, "float32", "gguf", g) == g.tensor_bytes
    kinds = dict(g.expert_types)
    assert set(kinds) == ({"MXFP4"} if model_id == "gpt-oss-20b" else {"Q4_K", "Q6_K"})
    assert all(k in g.expert_label for k in kinds) and g.expert_label.endswith("as stored")
    # one token reads its k experts' blocks, not all E
    skipped = g.expert_memory(4) * (entry.num_experts - entry.num_experts_per_tok) // entry.num_experts
    assert decode_read_bytes(entry, "float32", "gguf", g) == g.tensor_bytes - skipped - g.embedding_bytes
    on_gpu = replace(g, kernels="triton")  # the GPU's kernels hold them as stored too (gguf_experts_cuda.py)
    assert weight_bytes(entry, "bfloat16", "gguf", on_gpu) == g.tensor_bytes
    assert on_gpu.expert_label.endswith("as stored")


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
    """llama.cpp ships gpt-oss's experts in MXFP4: such a file loads in a float32 plan (the
    experts dequantized; a GGUF plan keeps them, test_gguf_experts_kept_as_stored) and gives
    transformers' logits over the same rounded experts."""
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
            # different summation orders (a gathered bmm against per-expert mm): fp32 rounding of
            # sums of ~10 (unscaled random weights), 1.9e-5 apart on a Zen 4
            torch.testing.assert_close(got, moe_experts(x, weights, ids, w13, w2, b13, b2, limit, 1.702),
                                       rtol=2e-5, atol=5e-5)
