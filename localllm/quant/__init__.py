"""Weight quantization: AWQ/RTN int4, INT8 (W8A16, W8A8) and FP8, three ways in.

- ``prepare_for_checkpoint(model, quantization_config)``: a published quantized checkpoint
  (AutoAWQ GEMM, compressed-tensors FP8/INT8). Swaps the meta-device model's linears for
  modules that own the checkpoint's packed layout, before the loader materialises it.
- ``prepare_online(model, method)``: a float checkpoint quantized as it streams in. Same swap
  point; each linear is quantized on its device as its last shard arrives (see ``linear``).
- ``quantize_model(model, method, ...)``: an already-loaded float model, in place; the only
  way to run AWQ proper, which needs calibration activations through the whole model.

``localllm quantize`` writes the result as a checkpoint the first path (and AutoAWQ/vLLM)
loads; ``localllm eval`` measures what each method costs in perplexity and speed.
"""

from __future__ import annotations

from typing import Any

# Importing the package must stay cheap: the CLI imports localllm.quant.cli to build its
# parser, and `localllm --help` should not pay for torch. The API loads on first use.
# public name -> the submodule that defines it
_API = {
    "METHODS": "methods",
    "QuantLinear": "methods",
    "check_method": "methods",
    "config_group_size": "methods",
    "int4_group_size": "methods",
    "make_quant_linear": "methods",
    "prepare_for_checkpoint": "checkpoint",
    "prepare_online": "methods",
    "quantize_model": "methods",
    "weight_bytes": "methods",
}

__all__ = list(_API)


def __getattr__(name: str) -> Any:
    if name in _API:
        from localllm.quant import checkpoint, methods

        return getattr({"methods": methods, "checkpoint": checkpoint}[_API[name]], name)
    raise AttributeError(f"module 'localllm.quant' has no attribute {name!r}")
