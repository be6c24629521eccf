"""The FP8 KV cache's key rotation (models/llama.py, ``key_rotation``) and calibrated key
offsets: the rotation is orthogonal, both bring FP8 logits closer to the fp32 cache's on a
model whose keys have RoPE-style outlier channels, and neither is used by a 16-bit or fp32
cache."""

from __future__ import annotations

import pytest
import torch

from localllm.models.llama import LlamaForCausalLM, ModelConfig, key_rotation
from localllm.quant.forward import KVSpec, greedy_generate, prefill_logits
from localllm.quant.kv_cache import calibrate_kv_scales

HEAD_DIM = 32
PROMPT = [(7 * i + 3) % 120 for i in range(48)]  # crosses three 16-token blocks


@pytest.mark.parametrize("head_dim", [64, 128, 96, 80, 16])
def test_key_rotation_is_orthogonal_and_spreads_every_channel(head_dim: int) -> None:
    r = key_rotation(head_dim, torch.device("cpu"))
    assert r.shape == (head_dim, head_dim) and r.dtype == torch.float32
    torch.testing.assert_close(r @ r.t(), torch.eye(head_dim), atol=1e-6, rtol=0)
    block = head_dim & -head_dim  # Hadamard blocks of the largest power of two dividing head_dim
    nonzero = (r != 0).sum(dim=1)
    assert bool((nonzero == block).all())
    assert torch.allclose(r[r != 0].abs(), torch.tensor(block**-0.5))


def _outlier_model(seed: int) -> LlamaForCausalLM:
    """A random 2-layer model whose queries and keys are large on the two lowest-frequency
    rotary pairs of every head, as trained Llamas' are (SmolLM2's keys reach ~20 there), the
    keys mostly by a steady offset (a k bias there), as theirs are."""
    cfg = ModelConfig("LlamaForCausalLM", vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=HEAD_DIM, rope_theta=10000.0, qkv_bias=True)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02 if p.dim() > 1 else 0).add_(0 if p.dim() > 1 else 1)  # norms: weight 1
        for layer in model.model.layers:
            layer.self_attn.qkv_proj.bias.zero_()
        model.model.embed_tokens.weight.normal_(0, 1)
        half = HEAD_DIM // 2
        outliers = torch.tensor([half - 2, half - 1, HEAD_DIM - 2, HEAD_DIM - 1])
        for layer in model.model.layers:
            attn = layer.self_attn
            w = attn.qkv_proj.weight
            w[: attn.q_size] *= 4
            w[attn.q_size :] *= 4
            for h in range(cfg.num_heads):
                w[h * HEAD_DIM + outliers] *= 6
            for h in range(cfg.num_kv_heads):
                w[attn.q_size + h * HEAD_DIM + outliers] *= 6
                attn.qkv_proj.bias[attn.q_size + h * HEAD_DIM + outliers] = 8.0
    model.init_rope(128)
    return model


def _set_rotation(model: LlamaForCausalLM, rotation: torch.Tensor, offset: torch.Tensor | None = None) -> None:
    for layer in model.model.layers:
        layer.self_attn.k_rotation = rotation
        if offset is not None:
            layer.self_attn.k_offset = offset


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rotated_fp8_keys_give_logits_closer_to_the_fp32_cache(seed: int) -> None:
    model = _outlier_model(seed)
    exact = prefill_logits(model, PROMPT, KVSpec(torch.float32))
    rotated = prefill_logits(model, PROMPT, KVSpec(torch.float8_e4m3fn))
    _set_rotation(model, torch.eye(HEAD_DIM))  # the cache as it was before: keys as they are
    plain = prefill_logits(model, PROMPT, KVSpec(torch.float8_e4m3fn))
    err_rotated = (rotated - exact).abs().mean().item()
    err_plain = (plain - exact).abs().mean().item()
    assert 0 < err_rotated < 0.7 * err_plain, (err_rotated, err_plain)


@pytest.mark.parametrize("seed", [0, 1])
def test_calibrated_key_offsets_bring_fp8_logits_closer_still(seed: int) -> None:
    """Calibration centres each layer's rotated keys on their mean over the calibration
    prompt; softmax ignores the shift, and the smaller numbers round with smaller errors."""
    model = _outlier_model(seed)
    exact = prefill_logits(model, PROMPT, KVSpec(torch.float32))
    calib = [(5 * i + 1) % 120 for i in range(64)]  # another text than PROMPT
    scales = calibrate_kv_scales(model, calib)
    attn = model.model.layers[0].self_attn
    assert attn.k_offset.shape == (2, HEAD_DIM) and attn.k_offset.abs().max() > 0.1
    centred = prefill_logits(model, PROMPT, KVSpec(torch.float8_e4m3fn, scales))
    _set_rotation(model, attn.k_rotation, torch.zeros(2, HEAD_DIM))
    uncentred = prefill_logits(model, PROMPT, KVSpec(torch.float8_e4m3fn, scales))
    err_centred = (centred - exact).abs().mean().item()
    err_uncentred = (uncentred - exact).abs().mean().item()
    assert 0 < err_centred < 0.8 * err_uncentred, (err_centred, err_uncentred)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_full_precision_caches_never_use_the_rotation(kv_dtype: torch.dtype) -> None:
    """A 16-bit or fp32 cache gives the same logits and greedy tokens, bit for bit, whatever
    the rotation holds; the same NaN rotation poisons an FP8 cache (so it would show)."""
    model = _outlier_model(0)
    logits = prefill_logits(model, PROMPT, KVSpec(kv_dtype))
    tokens = greedy_generate(model, [PROMPT[:20], PROMPT[5:30]], 12, KVSpec(kv_dtype)).tokens
    _set_rotation(model, torch.full((HEAD_DIM, HEAD_DIM), float("nan")), torch.full((2, HEAD_DIM), float("nan")))
    assert torch.equal(prefill_logits(model, PROMPT, KVSpec(kv_dtype)), logits)
    assert greedy_generate(model, [PROMPT[:20], PROMPT[5:30]], 12, KVSpec(kv_dtype)).tokens == tokens
    assert prefill_logits(model, PROMPT, KVSpec(torch.float8_e4m3fn)).isnan().all()
