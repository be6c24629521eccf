"""A plain reference forward pass, independent of the engine: full recompute, no KV cache,
explicit softmax attention, HF's rotate-half RoPE. Tests compare the engine against it."""

from __future__ import annotations

import torch

import math

from localllm.models.llama import ModelConfig


def _norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.float()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _yarn_blend(i: int, dim: int, theta: float, scaling: dict) -> float:
    """YaRN's share of the original frequency for pair i (1: kept, 0: divided by factor), one
    pair at a time: the pairs between the one that turns beta_fast times over the pretraining
    length and the one that turns beta_slow times ramp linearly (transformers' rounding)."""
    orig = scaling["original_max_position_embeddings"]

    def pair_turning(turns: float) -> float:  # solves orig / wavelength(pair) == turns for the pair
        return dim * math.log(orig / (turns * 2 * math.pi)) / (2 * math.log(theta))

    first, last = pair_turning(scaling.get("beta_fast") or 32), pair_turning(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        first, last = math.floor(first), math.ceil(last)
    first, last = max(first, 0), min(last, dim - 1)
    if first == last:
        last += 0.001
    ramp = min(max((i // 2 - first) / (last - first), 0.0), 1.0)
    return 1.0 - ramp


def _attention_factor(cfg: ModelConfig) -> float:
    scaling = cfg.rope_scaling or {}
    if scaling.get("rope_type") != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return scaling["attention_factor"]
    factor = scaling["factor"]
    if factor <= 1:
        return 1.0
    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return (0.1 * scaling["mscale"] * math.log(factor) + 1) / (0.1 * scaling["mscale_all_dim"] * math.log(factor) + 1)
    return 0.1 * math.log(factor) + 1


def _inv_freq(cfg: ModelConfig) -> list[float]:
    """Per-frequency, as the Llama 3.1 paper's and YaRN's scaling rules read (no tensor tricks)."""
    out = []
    scaling = cfg.rope_scaling or {}
    for i in range(0, cfg.head_dim, 2):
        f = 1.0 / cfg.rope_theta ** (i / cfg.head_dim)
        if scaling.get("rope_type") == "linear":
            f = f / scaling["factor"]
        elif scaling.get("rope_type") == "yarn":
            keep = _yarn_blend(i, cfg.head_dim, cfg.rope_theta, scaling)
            f = keep * f + (1 - keep) * f / scaling["factor"]
        elif scaling.get("rope_type") == "llama3":
            old, factor = scaling["original_max_position_embeddings"], scaling["factor"]
            low_wavelen = old / scaling["low_freq_factor"]
            high_wavelen = old / scaling["high_freq_factor"]
            wavelen = 2 * math.pi / f
            if wavelen > low_wavelen:
                f = f / factor
            elif wavelen >= high_wavelen:
                t = (old / wavelen - scaling["low_freq_factor"]) / (scaling["high_freq_factor"] - scaling["low_freq_factor"])
                f = (1 - t) * f / factor + t * f
        out.append(f)
    return out


@torch.no_grad()
def reference_logits(cfg: ModelConfig, sd: dict[str, torch.Tensor], token_ids: list[int]) -> torch.Tensor:
    """[len(token_ids), vocab] fp32 logits from HF-named weights ``sd``."""
    T = len(token_ids)
    H, KV, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    freqs = _inv_freq(cfg)
    angles = torch.arange(T, dtype=torch.float64)[:, None] * torch.tensor(freqs, dtype=torch.float64)[None, :]
    scale = _attention_factor(cfg)
    cos = (torch.cat([angles.cos()] * 2, dim=-1) * scale).float()[:, None, :]
    sin = (torch.cat([angles.sin()] * 2, dim=-1) * scale).float()[:, None, :]
    x = sd["model.embed_tokens.weight"][torch.tensor(token_ids)]
    mask = torch.full((T, T), float("-inf")).triu(1)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        h = _norm(x, sd[p + "input_layernorm.weight"], cfg.rms_norm_eps)
        q, k, v = (h @ sd[p + f"self_attn.{n}_proj.weight"].T for n in "qkv")
        if cfg.qkv_bias:
            q, k, v = q + sd[p + "self_attn.q_proj.bias"], k + sd[p + "self_attn.k_proj.bias"], v + sd[p + "self_attn.v_proj.bias"]
        q, k, v = q.view(T, H, D), k.view(T, KV, D), v.view(T, KV, D)
        if cfg.qk_norm:
            q = _norm(q, sd[p + "self_attn.q_norm.weight"], cfg.rms_norm_eps)
            k = _norm(k, sd[p + "self_attn.k_norm.weight"], cfg.rms_norm_eps)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        k = k.repeat_interleave(H // KV, dim=1)
        v = v.repeat_interleave(H // KV, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / D**0.5 + mask
        attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(T, H * D)
        x = x + attn @ sd[p + "self_attn.o_proj.weight"].T
        h = _norm(x, sd[p + "post_attention_layernorm.weight"], cfg.rms_norm_eps)
        gate, up = h @ sd[p + "mlp.gate_proj.weight"].T, h @ sd[p + "mlp.up_proj.weight"].T
        x = x + (torch.nn.functional.silu(gate) * up) @ sd[p + "mlp.down_proj.weight"].T
    x = _norm(x, sd["model.norm.weight"], cfg.rms_norm_eps)
    head = sd["lm_head.weight"] if "lm_head.weight" in sd else sd["model.embed_tokens.weight"]
    return x @ head.T


def reference_greedy_choices(cfg: ModelConfig, sd: dict[str, torch.Tensor], prompt: list[int],
                             tokens: list[int]) -> list[int]:
    """The reference's greedy choice after ``prompt + tokens[:i]``, for every i, in one pass
    (the model is causal: row ``len(prompt) - 1 + i`` sees exactly that prefix). It equals
    ``tokens`` exactly when ``tokens`` is ``reference_greedy(cfg, sd, prompt, len(tokens))``,
    without a forward pass per token."""
    logits = reference_logits(cfg, sd, list(prompt) + list(tokens[:-1]))
    return logits[len(prompt) - 1:].argmax(-1).tolist()


def hf_state_dict(ckpt) -> dict[str, torch.Tensor]:  # noqa: ANN001 - a loader Checkpoint
    return {k: v.float() for k, v in ckpt.weights()}


def reference_greedy(
    cfg: ModelConfig, sd: dict[str, torch.Tensor], prompt: list[int], n: int, eos: tuple[int, ...] = ()
) -> list[int]:
    ids = list(prompt)
    out: list[int] = []
    for _ in range(n):
        token = int(reference_logits(cfg, sd, ids)[-1].argmax())
        out.append(token)
        if token in eos:
            break
        ids.append(token)
    return out
