"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (q/k RMSNorm) and, in every
layer, a mixture of experts in place of the MLP (models/moe.py): 128 experts, 8 per token,
their weights renormalised over the 8 (norm_topk_prob).

Checkpoints name each expert's matrices (``mlp.experts.N.gate_proj.weight``), transformers 5
may save them fused (``mlp.experts.gate_up_proj`` [E, 2I, H], ``mlp.experts.down_proj``), and
llama.cpp stacks them per layer (``ffn_gate_exps`` [E, I, H]); all land in the stacked
parameters. The router is ``mlp.gate``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import replace

import torch

from localllm.models.layers import CausalLM, dense_param_counts
from localllm.models.moe import complete_experts, moe_param_counts, place_experts


class MoECausalLM(CausalLM):
    """The shared decoder whose layers hold ``MoE`` blocks; the experts' tensors are placed
    by ``place_experts`` before the shared loader sees the rest."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        written: dict[str, int] = {}
        loaded = super().load_weights(place_experts(self, self.checkpoint_tensors(weights), written))
        return loaded | complete_experts(self, written)

    def param_counts(self) -> tuple[int, int]:
        """(total, active per token): the dense count without its MLP, plus the router and
        every expert (total) or ``num_experts_per_tok`` of them (active)."""
        cfg = self.config
        total, active = dense_param_counts(replace(cfg, intermediate_size=0))
        extra = cfg.num_layers * (cfg.hidden_size if cfg.o_bias else 0) + (
            cfg.num_layers * cfg.num_heads if cfg.attention_sinks else 0)
        moe_total, moe_active = moe_param_counts(cfg)
        return total + extra + moe_total, active + extra + moe_active


class Qwen3MoeForCausalLM(MoECausalLM):
    def checkpoint_tensors(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            if name.endswith(".mlp.experts.gate_up_proj"):  # transformers 5's fused form, [E, 2I, H]
                gate, up = tensor.chunk(2, dim=1)
                yield name.replace("gate_up_proj", "gate_exps.weight"), gate
                yield name.replace("gate_up_proj", "up_exps.weight"), up
            elif name.endswith(".mlp.experts.down_proj"):
                yield name.replace("down_proj", "down_exps.weight"), tensor
            else:
                yield name, tensor
