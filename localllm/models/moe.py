"""The mixture-of-experts block (Qwen3-MoE, gpt-oss): a router picks ``num_experts_per_tok``
of ``num_experts`` gated MLPs per token and sums their outputs by its weights.

The experts' weights are stacked per layer: ``w13`` [E, 2I, H] (gate rows, then up rows) and
``w2`` [E, H, I], and for gpt-oss their biases ``b13`` [E, 2I] and ``b2`` [E, H].

The expert matmuls run in one opaque op, ``localllm::moe_experts``: the tokens are sorted by
expert and each expert that got any runs one matmul over all of its rows (no loop over
tokens, no gathered copy of the weights). Which experts a batch hits is data, so the op's
body could not be traced; as a custom op with a fake (shape-only) form, the compiled CPU
decode step keeps one graph with the op in it, and the routing around it (router matmul,
top-k, softmax) compiles as usual. There is no branch on the batch's routing outside it.

A GGUF plan keeps the file's expert blocks instead (``MoE.experts``: on CPU a
``localllm.quant.gguf_experts.GGUFExperts``, on the GPU a ``gguf_experts_cuda.GGUFExpertsCUDA``,
which the loader's quant decision attaches, with no ``w13``/``w2`` left): the same routing,
biases and activation, their own kernels for the matmuls.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from localllm.errors import LocalLLMError
from localllm.kernels.opaque_op import opaque_op
from localllm.models.config import ModelConfig


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] fp32, expert ids [T, k]) from router logits [T, E]. With
    ``renormalize`` the weights are the softmax over the top-k logits, which is exactly
    transformers' softmax over all experts renormalised over the top k (Qwen3-MoE with
    norm_topk_prob) and its softmax of the top-k logits (gpt-oss); otherwise the plain
    softmax probabilities of the k experts (Qwen3-MoE without it)."""
    logits = logits.float()
    top, ids = torch.topk(logits, top_k, dim=-1)
    if renormalize:
        return torch.softmax(top, dim=-1), ids
    return torch.softmax(logits, dim=-1).gather(1, ids), ids


def activate(h: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
    """gate/up halves of ``h`` -> [rows, I]: SiLU(gate) * up, or with ``limit`` > 0 gpt-oss's
    clamped SwiGLU, (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit)."""
    gate, up = h.chunk(2, dim=-1)
    # in place on the fresh products only (h's halves are views): the same operations in the
    # same order, without a temporary per step
    if limit > 0:
        gate = gate.clamp(max=limit)
        return up.clamp(-limit, limit).add_(1).mul_(gate).mul_(torch.sigmoid(gate * alpha))
    return F.silu(gate).mul_(up)


@opaque_op("localllm::moe_experts")
def moe_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    b13: torch.Tensor | None,
    b2: torch.Tensor | None,
    limit: float,
    alpha: float,
) -> torch.Tensor:
    """sum_k weights[t, k] * expert_{ids[t, k]}(x[t]) for every token, [T, H] fp32.

    Grouped by expert: the T*k (token, slot) pairs are sorted by expert id, and each expert's
    rows run through its two matmuls at once, in the weights' dtype; the results go back to
    their tokens by one index_add. Under a CUDA graph capture, which forbids the host reading
    the counts, ``experts_gathered`` instead."""
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        return experts_gathered(x, weights, ids, w13, w2, b13, b2, limit, alpha)
    T, k = ids.shape
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    tokens = order // k
    rows = x.index_select(0, tokens).to(w13.dtype)
    out = torch.empty(T * k, w2.shape[1], dtype=torch.float32, device=x.device)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        h = F.linear(rows[start:start + n], w13[e], None if b13 is None else b13[e])
        h = activate(h.float(), limit, alpha).to(w2.dtype)
        out[start:start + n] = F.linear(h, w2[e], None if b2 is None else b2[e]).float()
        start += n
    out.mul_(weights.flatten().index_select(0, order).float().unsqueeze(1))
    return torch.zeros(T, w2.shape[1], dtype=torch.float32, device=x.device).index_add_(0, tokens, out)


def experts_gathered(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    b13: torch.Tensor | None,
    b2: torch.Tensor | None,
    limit: float,
    alpha: float,
) -> torch.Tensor:
    """``moe_experts`` with no host-side count: each (token, slot) gathers its expert's
    weights and runs a batched matmul. It copies T*k experts' weights, so it serves small
    decode batches only (a CUDA graph's buckets)."""
    T, k = ids.shape
    flat = ids.flatten()
    rows = x.repeat_interleave(k, dim=0).to(w13.dtype).unsqueeze(2)  # [T*k, H, 1]
    h = torch.bmm(w13.index_select(0, flat), rows).squeeze(2)  # [T*k, 2I]
    if b13 is not None:
        h = h + b13.index_select(0, flat)
    h = activate(h.float(), limit, alpha).to(w2.dtype).unsqueeze(2)
    out = torch.bmm(w2.index_select(0, flat), h).squeeze(2)
    if b2 is not None:
        out = out + b2.index_select(0, flat)
    return (out.float().view(T, k, -1) * weights.float().unsqueeze(2)).sum(1)


@moe_experts.register_fake
def _(x, weights, ids, w13, w2, b13, b2, limit, alpha):  # type: ignore[no-untyped-def]
    return x.new_empty(x.shape[0], w2.shape[1], dtype=torch.float32)


class Router(nn.Module):
    """The router's [E, H] matmul (and gpt-oss's bias). Not an ``nn.Linear``, so the
    quantization passes, which swap every linear, leave it in its float dtype: a rounded
    router logit may pick another expert."""

    def __init__(self, hidden: int, experts: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, hidden))
        self.bias = nn.Parameter(torch.empty(experts)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(self.weight.dtype), self.weight, self.bias)


class MoE(nn.Module):
    """The MLP of a mixture-of-experts layer: ``DecoderLayer`` builds it in place of ``MLP``
    when the config has experts. Parameters: ``gate`` (the router), ``w13``, ``w2`` and, with
    ``expert_bias``, ``b13`` and ``b2``. Returns fp32, as the residual stream is.

    ``experts``: None, or the module that holds the experts' matrices in a quantized form
    in place of ``w13``/``w2`` (then None), called as ``experts(x, weights, ids, b13, b2,
    limit, alpha)``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        E, H, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.top_k, self.renormalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.limit, self.alpha = cfg.swiglu_limit or 0.0, cfg.swiglu_alpha
        self.gate = Router(H, E, cfg.expert_bias)
        self.w13 = nn.Parameter(torch.empty(E, 2 * I, H))
        self.w2 = nn.Parameter(torch.empty(E, H, I))
        self.b13 = nn.Parameter(torch.empty(E, 2 * I)) if cfg.expert_bias else None
        self.b2 = nn.Parameter(torch.empty(E, H)) if cfg.expert_bias else None
        self.experts: nn.Module | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.top_k, self.renormalize)
        if self.experts is not None:  # the GGUF file's blocks (quant/gguf_experts.py)
            return self.experts(x, weights, ids, self.b13, self.b2, self.limit, self.alpha)
        return moe_experts(x, weights, ids, self.w13, self.w2, self.b13, self.b2, self.limit, self.alpha)


def load_expert_weight(moe: MoE, name: str, tensor: torch.Tensor, expert: int | None, shard: int | None) -> None:
    """Copies one checkpoint tensor into ``moe``'s stacked parameter ``name`` (w13, w2, b13,
    b2): all experts at once (``expert`` None) or one, and of w13/b13 the gate half (``shard``
    0), the up half (1) or both (None). Raises ValueError naming the shapes on a mismatch.
    Matrices of an ``experts`` module go to its ``load_weight`` (all experts at once)."""
    if moe.experts is not None and name in ("w13", "w2"):
        if expert is not None:
            raise ValueError("one expert's slice, but GGUF experts load stacked ([E, out, in]) only")
        moe.experts.load_weight(name, tensor, shard)
        return
    target = getattr(moe, name).data
    if expert is not None:
        target = target[expert]
    if shard is not None:
        half = target.shape[-2 if name == "w13" else -1] // 2
        target = target.narrow(-2 if name == "w13" else -1, shard * half, half)
    if tuple(target.shape) != tuple(tensor.shape):
        raise ValueError(f"shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")
    target.copy_(tensor)


def moe_param_counts(cfg: ModelConfig) -> tuple[int, int]:
    """(total, active per token) of the expert layers' MLPs beyond what a dense count holds:
    the router and all experts, of which a token runs ``num_experts_per_tok``."""
    E, k, H, I = cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size
    expert = 3 * H * I + ((2 * I + H) if cfg.expert_bias else 0)
    router = E * H + (E if cfg.expert_bias else 0)
    return cfg.num_layers * (router + E * expert), cfg.num_layers * (router + k * expert)


# The experts' tensors as the family files hand them to ``place_experts``: one expert's
# (``mlp.experts.3.up_proj.weight``, [I, H]) or every expert's stacked (``mlp.experts.up_exps.weight``,
# [E, I, H], llama.cpp's layout), torch's [out, in] order either way; biases alike.
_EXPERT_TENSOR = re.compile(
    r"(?P<mlp>.+\.mlp)\.experts\.(?:(?P<expert>\d+)\.)?(?P<part>gate|up|down)_(?:proj|exps)\.(?P<kind>weight|bias)")
_PARAM = {("gate", "weight"): ("w13", 0), ("up", "weight"): ("w13", 1), ("down", "weight"): ("w2", None),
          ("gate", "bias"): ("b13", 0), ("up", "bias"): ("b13", 1), ("down", "bias"): ("b2", None)}


def place_experts(
    model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], written: dict[str, int]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Copies the expert tensors among ``weights`` into their stacked parameters and yields
    the rest. ``written`` counts the elements each stacked parameter got (by its name), so the
    caller can report as loaded only the ones a checkpoint filled completely."""
    for name, tensor in weights:
        m = _EXPERT_TENSOR.fullmatch(name)
        if m is None:
            yield name, tensor
            continue
        param, shard = _PARAM[m["part"], m["kind"]]
        try:
            moe = model.get_submodule(m["mlp"])
            if not isinstance(moe, MoE):
                raise AttributeError(m["mlp"])
            load_expert_weight(moe, param, tensor, None if m["expert"] is None else int(m["expert"]), shard)
        except (AttributeError, IndexError, TypeError) as e:
            raise LocalLLMError(f"checkpoint tensor {name!r} has no place in this model ({e})") from None
        except ValueError as e:
            raise LocalLLMError(f"checkpoint tensor {name!r} has {e}") from None
        if moe.experts is not None and param in ("w13", "w2"):
            continue  # the experts module tracks its own tensors (expected_weight_names)
        key = f"{m['mlp']}.{param}"
        written[key] = written.get(key, 0) + tensor.numel()


def complete_experts(model: nn.Module, written: dict[str, int]) -> set[str]:
    """The stacked parameters among ``written`` that got every element."""
    sizes = {name: p.numel() for name, p in model.named_parameters()}
    return {name for name, n in written.items() if n == sizes.get(name)}
