"""gpt-oss (20b: 24 layers, 32 experts, 4 per token; 120b: 36 layers, 128 experts): a mixture
of experts in every layer with biases on the router and the experts and transformers'
clamped SwiGLU (alpha 1.702, limit 7.0; models/moe.py), attention with q/k/v/o biases and a
learned sink logit per head (kernels/paged_attention.py), every other layer (the even ones)
attending through a 128-token window, YaRN RoPE. All of it is configuration (models/config.py)
but the names.

The HF checkpoint stores each layer's experts as ``gate_up_proj`` [E, H, 2I] with gate and
up interleaved column by column and ``down_proj`` [E, I, H] (input-major), the router as
``mlp.router``; llama.cpp's GGUF stacks them as the other MoE families do (``ffn_gate_exps``
[E, I, H], ``ffn_gate_inp`` the router, ``attn_sinks``), with the experts in MXFP4: a GGUF
plan keeps those blocks as stored, on the CPU (quant/gguf_experts.py) and on the GPU
(quant/gguf_experts_cuda.py); a float plan dequantizes them.

Chats are harmony messages (localllm/harmony.py renders them as openai-harmony does; replies
split into reasoning and answer by localllm/reasoning.py's ``HarmonyParser``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from localllm.models.qwen3_moe import MoECausalLM


class GptOssForCausalLM(MoECausalLM):
    def checkpoint_tensors(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            base, _, leaf = name.rpartition(".")
            if leaf == "gate_up_proj" and base.endswith(".mlp.experts"):  # [E, H, 2I], interleaved
                yield f"{base}.gate_exps.weight", tensor[:, :, 0::2].transpose(1, 2)
                yield f"{base}.up_exps.weight", tensor[:, :, 1::2].transpose(1, 2)
            elif leaf == "gate_up_proj_bias" and base.endswith(".mlp.experts"):
                yield f"{base}.gate_exps.bias", tensor[:, 0::2]
                yield f"{base}.up_exps.bias", tensor[:, 1::2]
            elif leaf == "down_proj" and base.endswith(".mlp.experts"):  # [E, I, H]
                yield f"{base}.down_exps.weight", tensor.transpose(1, 2)
            elif leaf == "down_proj_bias" and base.endswith(".mlp.experts"):
                yield f"{base}.down_exps.bias", tensor
            elif base.endswith(".mlp.router"):
                yield f"{base.removesuffix('.router')}.gate.{leaf}", tensor
            elif name.endswith(".self_attn.sinks.weight"):  # llama.cpp's attn_sinks
                yield base, tensor
            else:
                yield name, tensor
