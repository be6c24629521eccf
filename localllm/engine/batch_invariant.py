"""What ``--deterministic`` changes so that a token's numbers depend only on its own sequence:
the same prompt gives the same greedy tokens alone or in any batch, chunked in any way, with
or without a prefix-cache hit.

Three things vary with the batch otherwise, each chosen for speed:
- a GGUF linear expands its weight for a dense GEMM on long prompt chunks (bf16 activations
  there), the integer kernel elsewhere: every row takes the integer kernel here;
- the CPU attention sends prompt chunks longer than 16 tokens to SDPA, whose rows change with
  the chunk's length, and splits long contexts into as many key slices as keep the threads
  busy, which follows the batch: every chunk takes the in-place kernel, in one slice, here;
- the compiled decode step fuses norms and rotary, so its rows differ in the last bits from a
  decode row in an eager mixed step: the engine decodes eagerly here (``LLMEngine``).
Covered: GGUF block plans on the CPU (the default plan of a GGUF file). Other plans are refused
in one line rather than run without the guarantee: a float matmul's rows change with the
number of rows on this CPU's BLAS (1, 2-15 and 16+ rows take three kernels).
"""

from __future__ import annotations

import sys

from torch import nn

from localllm.errors import LocalLLMError
from localllm.models.llama import Attention
from localllm.quant.gguf import GGUFLinear
from localllm.quant.linear import QuantLinear


def make_batch_invariant(model: nn.Module, device_type: str, precision: str) -> None:
    """Switches ``model``'s batch-dependent kernel choices off, or raises when its plan has
    layers this mode cannot make invariant."""
    if device_type != "cpu":
        raise LocalLLMError(f"--deterministic covers the CPU's GGUF plans; this plan runs on {device_type}: "
                            "drop --deterministic or add --device cpu")
    others = sorted({type(m).__name__ for m in model.modules()
                     if isinstance(m, (nn.Linear, QuantLinear)) and not isinstance(m, GGUFLinear)})
    if others:
        raise LocalLLMError(f"--deterministic covers GGUF block plans; this plan ({precision}) has "
                            f"{', '.join(others)} layers: drop --deterministic, or load a .gguf file without --dtype/--quant")
    for module in model.modules():
        if isinstance(module, GGUFLinear):
            module.dense_rows = sys.maxsize
        elif isinstance(module, Attention):
            module.batch_invariant = True
