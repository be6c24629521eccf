"""What ``--deterministic`` changes so that a token's numbers depend only on its own sequence:
the same prompt gives the same greedy tokens alone or in any batch, chunked in any way, with
or without a prefix-cache hit.

What varies with the batch otherwise, each chosen for speed, and what this mode runs instead:
- a float (fp32/bf16) linear goes through torch's BLAS, whose kernel and K split follow the
  number of rows (on this CPU 1, 2-15 and 16+ rows give three answers for one row; bf16 with
  64+ rows takes AMX tiles): every ``nn.Linear`` (the LM head included) and the MoE router run
  the C++ ``dense_linear`` op here, each output one fixed reduction over K
  (kernels/cpu/dense/linear.h);
- a GGUF linear expands its weight for a dense GEMM on long prompt chunks (bf16 activations
  there), the integer kernel elsewhere: every row takes the integer kernel here;
- the CPU attention sends prompt chunks longer than 16 tokens to SDPA, whose rows change with
  the chunk's length, and splits long contexts into as many key slices as keep the threads
  busy, which follows the batch: every chunk takes the in-place kernel, in one slice, here;
- the compiled decode step fuses norms and rotary, so its rows differ in the last bits from a
  decode row in an eager mixed step: the engine decodes eagerly here (``LLMEngine``).
The rest of a CPU step is per row already (measured: the norms, activations, rotary, the
sampler, and the top-8 recompute of a 16-bit head give a row the same bits at any batch size).

On CUDA (and in the Triton rehearsal on CPU tensors) the same switches take the Triton path:
the float linears one fixed-tile Triton GEMM (kernels/invariant_gemm.py: fixed BLOCK_K, no
split-K, no cuBLAS), the decode attention one key slice; norms, activations and rotary there
run one program per row already, and the engine captures no compiled step. Checked in the
rehearsal only, not yet on a GPU; there a 16-bit head's top-8 recompute (``compute_logits``'
einsum, cuBLAS) is not invariant by construction (an fp32 plan has none).

Covered: every CPU plan of fp32, bf16 and GGUF weights; float plans (fp32, bf16, fp16) on
CUDA. Refused in one line: other quantized plans (int8, FP8, AWQ linears; GGUF on CUDA),
float MoE experts (per-expert GEMMs of varying rows) and fp16 weights on the CPU.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from localllm.errors import LocalLLMError
from localllm.kernels import cpu_ops
from localllm.kernels._triton import use_triton
from localllm.kernels.invariant_gemm import invariant_gemm_triton
from localllm.models.llama import Attention
from localllm.models.moe import MoE, Router
from localllm.quant.gguf import GGUFLinear
from localllm.quant.linear import QuantLinear

FLOAT_DTYPES = (torch.float32, torch.bfloat16)


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     out_dtype: torch.dtype) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with every row's numbers independent of the other rows:
    on the Triton path the fixed-tile GEMM, else the C++ ``dense_linear``; both sum in fp32
    (a 16-bit weight takes x rounded to its dtype, as F.linear does), the result cast to
    ``out_dtype`` (elementwise, so per row too)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if use_triton(x2):
        y = invariant_gemm_triton(x2, weight, bias, out_dtype)
    else:
        y = torch.ops.localllm_cpu.dense_linear(x2, weight, bias).to(out_dtype)
    return y.reshape(*shape[:-1], weight.shape[0])


class InvariantLinear(nn.Linear):
    """An ``nn.Linear`` whose rows do not depend on the batch (``invariant_linear``); the class
    ``make_batch_invariant`` gives the model's float linears in place (same parameters, same
    output dtype, except ``out_dtype``: the LM head keeps its fp32 sums, unrounded)."""

    out_dtype: torch.dtype | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return invariant_linear(x, self.weight, self.bias, self.out_dtype or self.weight.dtype)


class InvariantRouter(Router):
    """The MoE router on ``invariant_linear``: a router logit that moved with the batch could
    pick another expert."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return invariant_linear(x, self.weight, self.bias, self.weight.dtype)


def _refusal(model: nn.Module, precision: str, gpu: bool) -> str | None:
    """Why this plan cannot be made invariant, in one line, or None."""
    quant = sorted({type(m).__name__ for m in model.modules()
                    if isinstance(m, QuantLinear) and (gpu or not isinstance(m, GGUFLinear))})
    if quant:
        covered = "fp32, bf16 and fp16 plans on a GPU" if gpu else "fp32, bf16 and GGUF plans"
        return (f"--deterministic covers {covered}; this plan ({precision}) has "
                f"{', '.join(quant)} layers: drop --deterministic or --quant")
    allowed = {*FLOAT_DTYPES, torch.float16} if gpu else set(FLOAT_DTYPES)
    dtypes = {m.weight.dtype for m in model.modules() if isinstance(m, (nn.Linear, Router))}
    if dtypes - allowed:
        names = ", ".join(sorted(str(d).removeprefix("torch.") for d in dtypes - allowed))
        return (f"--deterministic covers fp32, bf16 and GGUF plans; this plan has {names} weights: "
                "use --dtype float32 or bfloat16, or drop --deterministic")
    if any(isinstance(m, MoE) and m.experts is None for m in model.modules()):
        return ("--deterministic covers MoE models in their GGUF blocks only (float experts run GEMMs "
                "whose rows follow the batch): load the .gguf file without --dtype, or drop --deterministic")
    return None


def make_batch_invariant(model: nn.Module, device_type: str, precision: str) -> None:
    """Switches ``model``'s batch-dependent kernel choices off, or raises ``LocalLLMError``
    (one line) when its plan has layers this mode cannot make invariant. Idempotent."""
    weight = next(model.parameters())
    triton = use_triton(weight)  # CUDA, or the rehearsal's CPU tensors
    if device_type not in ("cpu", "cuda") or (device_type == "cuda" and not triton):
        raise LocalLLMError(f"--deterministic runs on the CPU, or on CUDA with Triton; this plan runs on "
                            f"{device_type}: drop --deterministic or add --device cpu")
    reason = _refusal(model, precision, triton)
    if reason is not None:
        raise LocalLLMError(reason)
    floats = any(type(m) is nn.Linear or type(m) is Router for m in model.modules())
    if floats and not triton and not cpu_ops.load():
        raise LocalLLMError("--deterministic needs the C++ CPU kernels for fp32/bf16 linears (no C++ compiler "
                            "here: install g++): drop --deterministic or load a .gguf file")
    head = getattr(model, "lm_head", None)
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = InvariantLinear
            if module is head:
                module.out_dtype = torch.float32  # type: ignore[union-attr]
        elif type(module) is Router:
            module.__class__ = InvariantRouter
        elif isinstance(module, GGUFLinear):
            module.dense_rows = sys.maxsize
        elif isinstance(module, Attention):
            module.batch_invariant = True
