"""The quantization entry points (re-exported lazily by ``localllm.quant``): method names,
the quantized linear for a method, the swap for online loading, and in-place quantization.
A published checkpoint's swap is ``quant.checkpoint.prepare_for_checkpoint``."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

import torch
from torch import nn

from localllm.errors import LocalLLMError
from localllm.models.llama import ModelConfig
from localllm.hardware.sizing import linear_input_dims
from localllm.quant.awq import AWQLinear
from localllm.quant.fp8 import FP8Linear
from localllm.quant.groups import pick_group_size
from localllm.quant.int8 import Int8Linear, Int8W8A8Linear
from localllm.quant.linear import QuantLinear, fused_sizes, iter_linears, replace_module

# method -> what it does; "none" is accepted wherever a method is, and changes nothing
METHODS: dict[str, str] = {
    "int8": "INT8 weights per channel, float activations (W8A16)",
    "int8-w8a8": "INT8 weights per channel, INT8 activations per token (W8A8)",
    "fp8": "FP8 E4M3 weights per channel, activations per token where the GPU has FP8",
    "awq": "int4 group-wise with zero points, activation-aware scales and clipping (AutoAWQ GEMM)",
    "rtn4": "int4 group-wise with zero points, round to nearest (the AWQ baseline)",
    "gguf": "a GGUF file's Q4_0/Q4_1/Q8_0 blocks as stored, on localllm's CPU kernels (the CPU default for GGUF)",
}

_CLASSES: dict[str, type[QuantLinear]] = {
    "int8": Int8Linear,
    "int8-w8a8": Int8W8A8Linear,
    "fp8": FP8Linear,
    "awq": AWQLinear,
    "rtn4": AWQLinear,
}

ProgressFn = Callable[[int, int], None]

def check_method(method: str) -> str:
    m = method.strip().lower()
    if m not in METHODS and m != "none":
        raise LocalLLMError(f"unknown quantization method {method!r}; use one of none, {', '.join(METHODS)}")
    return m


def make_quant_linear(
    method: str,
    in_features: int,
    out_features: int,
    output_sizes: list[int] | None,
    bias: bool,
    *,
    group_size: int | None = None,
    online: bool = False,
) -> QuantLinear:
    """One quantized linear; int4 methods need the model's ``group_size`` (``int4_group_size``)."""
    cls = _CLASSES[check_method(method)]
    if cls is AWQLinear:
        if group_size is None:
            raise ValueError(f"{method} linears need the model's group size (int4_group_size)")
        return AWQLinear(in_features, out_features, group_size, output_sizes, bias, online)
    return cls(in_features, out_features, output_sizes, bias, online)


def config_group_size(cfg: ModelConfig, requested: int | None) -> int:
    """``int4_group_size`` from the config alone, to reject a bad --group-size before loading."""
    return pick_group_size(linear_input_dims(cfg), requested)


def int4_group_size(model: nn.Module, requested: int | None) -> int:
    """The group size for int4 on ``model``: ``requested`` if it divides every linear's input
    dim (else a one-line error), otherwise the largest of 128/64/32 that does."""
    return pick_group_size({name: lin.in_features for name, lin in iter_linears(model)}, requested)


def _swap(model: nn.Module, method: str, online: bool, group_size: int | None) -> None:
    g = int4_group_size(model, group_size) if _CLASSES[method] is AWQLinear else None
    for name, lin in list(iter_linears(model)):
        with torch.device(lin.weight.device):
            new = make_quant_linear(
                method, lin.in_features, lin.out_features, fused_sizes(lin), lin.bias is not None,
                group_size=g, online=online,
            )
        replace_module(model, name, new)


def prepare_online(model: nn.Module, method: str, group_size: int | None = None) -> None:
    """Swaps a meta-device model's linears for ones that quantize float shards as they load.

    Pass as ``build_model(..., quantize=lambda m: prepare_online(m, method))``. ``awq`` has no
    calibration data at load time, so it quantizes round-to-nearest (``rtn4``) in the AWQ
    layout; ``localllm quantize --method awq`` writes the activation-aware version.
    """
    method = check_method(method)
    if method == "none":
        return
    if method == "awq":
        _note_uncalibrated()
    _swap(model, method, online=True, group_size=group_size)


def _note_uncalibrated() -> None:
    print("localllm: note: awq without calibration text rounds to nearest (rtn4); "
          "`localllm quantize --method awq` makes the activation-aware checkpoint", file=sys.stderr)


def quantize_model(
    model: nn.Module,
    method: str,
    progress: ProgressFn | None = None,
    group_size: int | None = None,
    calib: Sequence[Sequence[int]] | torch.Tensor | None = None,
) -> None:
    """Quantizes a loaded float model in place, one linear at a time (each float weight is
    freed as its quantized replacement lands, so peak memory grows by one linear).

    ``awq`` first rescales and clips the float weights on activations from ``calib`` (token-id
    sequences); without ``calib`` it rounds to nearest, like ``prepare_online``, so a planner
    that picks awq for a float checkpoint still loads. ``progress(done, total)`` counts
    decoder layers for the search, then linears.
    """
    method = check_method(method)
    if method == "none":
        return
    g = int4_group_size(model, group_size) if _CLASSES[method] is AWQLinear else None
    if method == "awq" and (calib is None or len(calib) == 0):
        _note_uncalibrated()
    elif method == "awq":
        from localllm.quant.awq_search import awq_search

        assert g is not None
        awq_search(model, calib, g, progress)  # type: ignore[arg-type]
    names = [name for name, _ in iter_linears(model)]
    for i, name in enumerate(names):
        lin = model.get_submodule(name)
        assert isinstance(lin, nn.Linear)
        with torch.device(lin.weight.device):
            new = make_quant_linear(
                method, lin.in_features, lin.out_features, fused_sizes(lin), lin.bias is not None, group_size=g
            )
        with torch.no_grad():
            new.set_weight(lin.weight.detach())
            if lin.bias is not None and new.bias is not None:
                new.bias = nn.Parameter(lin.bias.detach().clone(), requires_grad=False)
        new.mark_loaded()
        replace_module(model, name, new)
        del lin  # the float weight goes now, not after the loop
        if progress is not None:
            progress(i + 1, len(names))


def weight_bytes(model: nn.Module) -> int:
    """Bytes of weights (parameters and quantized buffers; a tied tensor once; derived CPU
    layouts and the rotary table excluded): what the weights cost in a checkpoint."""
    seen: set[int] = set()
    total = 0
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if name.endswith("cos_sin") or t.data_ptr() in seen or t.device.type == "meta":
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    for m in model.modules():  # an absent static input scale is a placeholder, not a weight
        if isinstance(m, (Int8Linear, FP8Linear)) and not m.has_input_scale:
            total -= m.input_scale.numel() * m.input_scale.element_size()
    return total
