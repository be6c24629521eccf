"""Activation-aware weight quantization (AWQ, Lin et al. 2023), on the float model in place.

Per decoder layer, on calibration activations that reach it through the float model:
1. Capture the inputs of the four linear groups that share an input: qkv (after
   input_layernorm), gate_up (after post_attention_layernorm), down (after silu*up) and o_proj
   (after attention).
2. For each group, grid-search the exponent ``alpha`` of per-input-channel scales
   ``s = mean|x|^alpha`` (normalised to geometric mean 1): scaling salient input channels up
   before int4 rounding shrinks their relative rounding error. The int4 weight is
   ``Q(W * s) / s``; the loss is the squared output error of the module around the group for
   qkv (attention, o_proj included) and gate_up (the MLP), as in AutoAWQ, and of the linear
   itself for down and o_proj.
3. Fold ``s`` into whatever produces the input: the RMSNorm weight (qkv, gate_up), the up
   rows of gate_up (down), the v rows of qkv (o_proj, only when there is one KV head per
   query head; with GQA the v outputs feed several heads, so o_proj is left unscaled).
4. Search a clipping ratio per (output row, group) that minimises the error of each
   group's partial output, skipping q and k, whose errors the softmax amplifies.

Linear-output losses come from the inputs' Gram matrix (see ``InputStats``), so they cost the
same whatever the calibration length; module losses run on the first ``BLOCK_TOKENS``. The
next layer's inputs come from this layer's float output, as in AutoAWQ. The result is a
float model whose weights ``quantize_model`` then rounds to nearest, in the AWQ layout.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from localllm.errors import LocalLLMError
from localllm.models.llama import DecoderLayer, LlamaForCausalLM
from localllm.quant.awq import fake_quant_int4
from localllm.quant.forward import BLOCK_SIZE, blocks_for, device_of, prefill_batch

N_GRID = 20  # alpha points in [0, 1]
CLIP_GRID = 20  # clip ratios 1 - i/20 ...
MAX_SHRINK = 0.5  # ... down to 0.55 of the group's range
CLIP_ROWS = 512  # output rows per clipping chunk (bounds memory)
BLOCK_TOKENS = 2048  # calibration tokens the attention/MLP output losses run on


@dataclass(slots=True)
class InputStats:
    """What the searches need of a linear's inputs X [T, K]: the mean magnitude per channel
    and the Gram matrix X^T X / T. Every loss below is ||X D^T||^2 / T for a weight error D,
    which equals the sum over rows d of d G d^T, so T never enters the search's cost and no
    activations are kept."""

    abs_mean: torch.Tensor  # [K]
    gram: torch.Tensor  # [K, K]

    def scaled(self, s: torch.Tensor) -> InputStats:
        """The statistics of X / s, the input once s is folded into the producer."""
        return InputStats(self.abs_mean / s, self.gram / torch.outer(s, s))


def _error(d: torch.Tensor, gram: torch.Tensor) -> float:
    return ((d @ gram) * d).sum().item()


@torch.no_grad()
def search_scale(stats: InputStats, w: torch.Tensor, group_size: int, n_grid: int = N_GRID) -> torch.Tensor:
    """Best per-input-channel scale ``[K]`` for weight ``w [N, K]``."""
    w = w.float()
    best_err, best = float("inf"), torch.ones_like(stats.abs_mean)
    for alpha in torch.linspace(0, 1, n_grid).tolist():
        s = stats.abs_mean.pow(alpha).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        err = _error(fake_quant_int4(w * s, group_size) / s - w, stats.gram)
        if err < best_err:
            best_err, best = err, s
    return best


@torch.no_grad()
def search_scale_block(
    stats: InputStats,
    linear: nn.Linear,
    block: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    group_size: int,
    n_grid: int = N_GRID,
) -> torch.Tensor:
    """``search_scale`` with the loss taken at the output of ``block`` (the attention or MLP
    module around ``linear``) on inputs ``x``: errors that the block amplifies (attention
    scores, the SiLU gate, down_proj) count for what they do to the layer's output."""
    w = linear.weight.detach().clone()
    ref = block(x).float()
    best_err, best = float("inf"), torch.ones_like(stats.abs_mean)
    try:
        for alpha in torch.linspace(0, 1, n_grid).tolist():
            s = stats.abs_mean.pow(alpha).clamp(min=1e-4)
            s = s / (s.max() * s.min()).sqrt()
            linear.weight.copy_((fake_quant_int4(w.float() * s, group_size) / s).to(w.dtype))
            err = (block(x).float() - ref).pow(2).mean().item()
            if err < best_err:
                best_err, best = err, s
    finally:
        linear.weight.copy_(w)
    return best


@torch.no_grad()
def search_clip(stats: InputStats, w: torch.Tensor, group_size: int) -> torch.Tensor:
    """``w [N, K]`` clamped per (row, group) to the fraction of its [min, max] range that
    minimises the squared error of that group's contribution to the output."""
    n_out, k = w.shape
    groups = k // group_size
    # the diagonal G x G blocks of the Gram matrix: the group's inputs only
    idx = torch.arange(groups)
    blocks = stats.gram.reshape(groups, group_size, groups, group_size)[idx, :, idx, :]
    clipped = torch.empty_like(w, dtype=torch.float32)
    for r0 in range(0, n_out, CLIP_ROWS):
        wg = w[r0 : r0 + CLIP_ROWS].float()
        rows = wg.shape[0]
        wg = wg.reshape(rows, groups, group_size)
        w_max, w_min = wg.amax(-1, keepdim=True), wg.amin(-1, keepdim=True)
        best_err = torch.full((rows, groups), float("inf"))
        best_ratio = torch.ones(rows, groups)
        for i in range(int(MAX_SHRINK * CLIP_GRID)):
            ratio = 1 - i / CLIP_GRID
            cand = wg.clamp(w_min * ratio, w_max * ratio)
            d = fake_quant_int4(cand.reshape(rows, k), group_size).reshape(rows, groups, group_size) - wg
            # per (row, group): d G_g d^T, batched over groups
            err = (torch.bmm(d.transpose(0, 1), blocks) * d.transpose(0, 1)).sum(-1).t()
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_ratio = torch.where(better, torch.full_like(best_ratio, ratio), best_ratio)
        r = best_ratio.unsqueeze(-1)
        clipped[r0 : r0 + rows] = wg.clamp(w_min * r, w_max * r).reshape(rows, k)
    return clipped.to(w.dtype)


class _Capture:
    """Forward pre-hooks that reduce the inputs of named linears to ``InputStats``, and keep
    the first ``keep_rows`` input rows of the linears named in ``keep`` for block losses."""

    def __init__(self, modules: dict[str, nn.Module], keep: tuple[str, ...], keep_rows: int) -> None:
        self.stats: dict[str, InputStats] = {}
        self.kept: dict[str, torch.Tensor] = {}
        self.keep, self.keep_rows = keep, keep_rows
        self.handles = [m.register_forward_pre_hook(self._hook(n)) for n, m in modules.items()]

    def _hook(self, name: str) -> Callable[[nn.Module, tuple[torch.Tensor, ...]], None]:
        def hook(_: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            x = args[0].detach().reshape(-1, args[0].shape[-1])
            if name in self.keep:
                self.kept[name] = x[: self.keep_rows].clone()
            x = x.float()
            self.stats[name] = InputStats(x.abs().mean(0), (x.t() @ x) / x.shape[0])

        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


@torch.no_grad()
def _quantize_layer(
    layer: DecoderLayer,
    feats: dict[str, InputStats],
    kept: dict[str, torch.Tensor],
    attend: Callable[[torch.Tensor], torch.Tensor],
    group_size: int,
) -> None:
    attn, mlp = layer.self_attn, layer.mlp
    qkv, o, gate_up, down = attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj
    inter = down.in_features
    v_rows = slice(attn.q_size + attn.kv_size, attn.q_size + 2 * attn.kv_size)

    s = search_scale_block(feats["qkv"], qkv, attend, kept["qkv"], group_size)
    layer.input_layernorm.weight.div_(s.to(layer.input_layernorm.weight.dtype))
    qkv.weight.mul_(s.to(qkv.weight.dtype))
    feats["qkv"] = feats["qkv"].scaled(s)

    if attn.q_size == attn.kv_size:  # MHA: o_proj's input channels are v's output rows
        s = search_scale(feats["o"], o.weight, group_size)
        qkv.weight[v_rows].div_(s[:, None].to(qkv.weight.dtype))
        if qkv.bias is not None:
            qkv.bias[v_rows].div_(s.to(qkv.bias.dtype))
        o.weight.mul_(s.to(o.weight.dtype))
        feats["o"] = feats["o"].scaled(s)

    s = search_scale_block(feats["gate_up"], gate_up, mlp, kept["gate_up"], group_size)
    layer.post_attention_layernorm.weight.div_(s.to(layer.post_attention_layernorm.weight.dtype))
    gate_up.weight.mul_(s.to(gate_up.weight.dtype))
    feats["gate_up"] = feats["gate_up"].scaled(s)

    s = search_scale(feats["down"], down.weight, group_size)
    gate_up.weight[inter:].div_(s[:, None].to(gate_up.weight.dtype))
    down.weight.mul_(s.to(down.weight.dtype))
    feats["down"] = feats["down"].scaled(s)

    qkv.weight[v_rows] = search_clip(feats["qkv"], qkv.weight[v_rows], group_size)
    o.weight.copy_(search_clip(feats["o"], o.weight, group_size))
    gate_up.weight.copy_(search_clip(feats["gate_up"], gate_up.weight, group_size))
    down.weight.copy_(search_clip(feats["down"], down.weight, group_size))


@torch.no_grad()
def awq_search(
    model: LlamaForCausalLM,
    calib: Sequence[Sequence[int]],
    group_size: int,
    progress: Callable[[int, int], None] | None = None,
) -> None:
    """Rescales and clips ``model``'s float linears (and RMSNorm weights) for int4 with
    ``group_size``, layer by layer, on the calibration token sequences ``calib``. Llama's
    block only (two norms, SiLU MLP, plain embeddings): other families are refused."""
    cfg = model.config
    if not isinstance(model, LlamaForCausalLM):
        raise LocalLLMError(f"AWQ's scale search runs Llama-shaped blocks only, not {cfg.architecture}; "
                            "use --quant rtn4 (round to nearest) or int8")
    dev = device_of(model)
    dtype = model.dtype
    limit = model.cos_sin.shape[0]  # rotary table rows: the longest sequence the model can run
    batch = prefill_batch([list(s)[:limit] for s in calib], dev)
    # One layer's KV pool, handed from layer to layer: only one layer runs at a time.
    pool = torch.zeros(2, blocks_for(batch.lengths), BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim,
                       dtype=dtype, device=dev)
    # Block losses run on the first sequences, up to BLOCK_TOKENS: attention needs whole ones.
    lengths = batch.lengths
    n_block = max(1, next((i for i in range(len(lengths)) if sum(lengths[: i + 1]) > BLOCK_TOKENS), len(lengths)))
    sub = prefill_batch([list(s)[:limit] for s in calib[:n_block]], dev)
    keep_rows = sum(sub.lengths)
    x = model.model.embed_tokens(batch.input_ids)
    residual: torch.Tensor | None = None
    layers = model.model.layers
    for i, layer in enumerate(layers):
        attn = layer.self_attn
        attn.k_cache, attn.v_cache = pool[0], pool[1]
        cap = _Capture({"qkv": attn.qkv_proj, "o": attn.o_proj, "gate_up": layer.mlp.gate_up_proj,
                        "down": layer.mlp.down_proj}, keep=("qkv", "gate_up"), keep_rows=keep_rows)
        try:
            x, residual = layer(x, residual, batch.positions, model.cos_sin, batch.meta)
        finally:
            cap.remove()

        def attend(h: torch.Tensor, attn: nn.Module = attn) -> torch.Tensor:
            return attn(h, sub.positions, model.cos_sin, sub.meta)

        _quantize_layer(layer, cap.stats, cap.kept, attend, group_size)
        attn.k_cache = attn.v_cache = torch.empty(0)
        if progress is not None:
            progress(i + 1, len(layers))
