"""What every quantized linear shares: fused-shard bookkeeping for checkpoint loading, online
quantization as float shards stream in, and the CPU/CUDA dispatch switches.

A quantized linear replaces an ``nn.Linear`` of ``LlamaForCausalLM`` one for one, fused
modules included (``qkv_proj`` and ``gate_up_proj`` keep their ``output_sizes``), so the model
code never changes. Quantized data and scales are buffers, not Parameters: the loader casts
floating Parameters to the model dtype, and an fp16 AWQ scale or an fp32 weight scale must
keep its own dtype. Only a bias is a Parameter, since it should follow the model dtype.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from localllm.errors import LocalLLMError

# Loader name of a module's tensor: "<module>.<tensor>" for a plain linear, with "#<shard>"
# appended for one shard of a fused linear (as LlamaForCausalLM.expected_weights does).
ShardName = str


def cpu_backend(kind: str) -> str:
    """``LOCALLLM_QUANT_CPU_<KIND>=packed|dequant`` overrides the measured default per op, so
    bench/quant_cpu.py and the tests can reach both paths."""
    return os.environ.get(f"LOCALLLM_QUANT_CPU_{kind.upper()}", "")


class QuantLinear(nn.Module):
    """Base of the quantized linears. Subclasses define the checkpoint tensors of one shard,
    how to copy such a tensor into the fused buffers, how to quantize a float weight, and how
    to dequantize (the reference every fast path is tested against).

    Loading protocol (``LlamaForCausalLM.load_weights``): ``load_weight(name, tensor, shard)``
    per checkpoint tensor; ``expected_weight_names()`` lists the tensors still missing, so the
    loader's ``expected - loaded`` names exactly what a checkpoint lacks, whichever way it
    spells the loaded names. In online mode the checkpoint is a float one: each shard's
    ``weight`` is quantized into its rows as it arrives where the format's rows quantize
    independently (``row_wise``: every format here but GGUF's), so at most one float
    checkpoint tensor and its quantization temporaries exist at a time; otherwise shards are
    staged on the CPU and the whole module is quantized on its device when the last arrives.
    """

    method: ClassVar[str] = ""
    # Names of one shard's tensors in a checkpoint of this format; optional ones may be absent.
    shard_tensors: ClassVar[tuple[str, ...]] = ()
    optional_tensors: ClassVar[tuple[str, ...]] = ()
    # Output rows quantize independently (per-row scales, groups along the input): online
    # loading then quantizes each shard as it arrives instead of staging the fused weight.
    row_wise: ClassVar[bool] = False

    def __init__(
        self,
        in_features: int,
        out_features: int,
        output_sizes: list[int] | None = None,
        bias: bool = False,
        online: bool = False,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.fused = output_sizes is not None
        self.output_sizes = list(output_sizes) if output_sizes is not None else [out_features]
        assert sum(self.output_sizes) == out_features, "output_sizes must add up to out_features"
        self.online = online
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        names = ("weight",) if online else self.shard_tensors
        if bias:
            names = (*names, "bias")
        self._pending: set[tuple[str, int | None]] = {
            (n, s) for n in names for s in (range(len(self.output_sizes)) if self.fused else [None])
        }
        self._staging: torch.Tensor | None = None  # online mode: float shards waiting on the CPU

    # ---- subclass hooks ----

    def _load_shard(self, name: str, tensor: torch.Tensor, rows: slice, shard: int | None) -> None:
        """Copies one checkpoint tensor of output rows ``rows`` into the buffers."""
        raise NotImplementedError

    def set_weight(self, weight: torch.Tensor) -> None:
        """Quantizes a float ``[out, in]`` weight (any device) into this module's buffers."""
        if not self.row_wise:
            raise NotImplementedError
        self.set_weight_rows(weight, slice(0, self.out_features))

    def set_weight_rows(self, weight: torch.Tensor, rows: slice) -> None:
        """``row_wise`` formats: quantizes float output rows ``rows`` (``[n, in]``, any device)."""
        raise NotImplementedError

    def dequantize(self) -> torch.Tensor:
        """The effective float32 weight ``[out, in]``: what every fast path must compute with."""
        raise NotImplementedError

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x [M, in] @ dequantize().T`` on this format's fastest path for ``x``'s device (any
        float dtype out; ``forward`` casts back and adds the bias)."""
        raise NotImplementedError

    def shard_state(self, rows: slice) -> dict[str, torch.Tensor]:
        """Checkpoint tensors (this format's names) for output rows ``rows``, on the CPU."""
        raise NotImplementedError

    def _finish_loading(self) -> None:
        """Called once every tensor is in: derive device-specific layouts here."""

    # ---- loading ----

    def shard_rows(self, shard: int | None) -> slice:
        if shard is None:
            return slice(0, self.out_features)
        start = sum(self.output_sizes[:shard])
        return slice(start, start + self.output_sizes[shard])

    def load_weight(self, name: str, tensor: torch.Tensor, shard: int | None) -> None:
        if shard is not None and not self.fused:
            raise LocalLLMError(f"tensor {name!r} of shard {shard} given to an unfused {self.method} linear")
        if shard is None and self.fused and len(self.output_sizes) > 1:
            raise LocalLLMError(f"tensor {name!r} arrived for a fused {self.method} linear without a shard index")
        rows = self.shard_rows(shard)
        if name == "bias" and self.bias is not None:
            self._check_shape(name, tensor, (rows.stop - rows.start,))
            self.bias.data[rows].copy_(tensor)
        elif self.online and name == "weight" and self.row_wise:
            self._check_shape("weight", tensor, (rows.stop - rows.start, self.in_features))
            self.set_weight_rows(tensor, rows)
        elif self.online and name == "weight":
            self._stage(tensor, rows)
        elif name in self.shard_tensors or name in self.optional_tensors:
            self._load_shard(name, tensor, rows, shard)
        else:
            expected = "weight" if self.online else ", ".join(self.shard_tensors)
            raise LocalLLMError(
                f"checkpoint tensor {name!r} does not belong to a {self.method} linear (expected {expected})"
            )
        self._pending.discard((name, shard))
        if not self._pending:
            if self._staging is not None:
                self.set_weight(self._staging)
                self._staging = None
            self._finish_loading()

    def _stage(self, tensor: torch.Tensor, rows: slice) -> None:
        self._check_shape("weight", tensor, (rows.stop - rows.start, self.in_features))
        if not self.fused:  # the whole weight at once: no staging copy needed
            self._staging = tensor
            return
        if self._staging is None:
            self._staging = torch.empty(self.out_features, self.in_features, dtype=tensor.dtype)
        self._staging[rows].copy_(tensor)

    def expected_weight_names(self) -> list[ShardName]:
        return [n if s is None else f"{n}#{s}" for n, s in sorted(self._pending, key=str)]

    def _check_shape(self, name: str, tensor: torch.Tensor, shape: tuple[int, ...]) -> None:
        if tuple(tensor.shape) != shape:
            raise LocalLLMError(
                f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {shape} for a "
                f"{self.method} linear {self.in_features}->{self.out_features}; does config.json's "
                "quantization_config match the tensors?"
            )

    def mark_loaded(self) -> None:
        """For modules filled by ``set_weight`` outside the loader (in-place quantization)."""
        self._pending.clear()
        self._finish_loading()

    # ---- export / reporting ----

    def export(self) -> Iterator[tuple[int | None, dict[str, torch.Tensor]]]:
        """Per shard (None for an unfused linear): its checkpoint tensors, bias included."""
        shards: list[int | None] = list(range(len(self.output_sizes))) if self.fused else [None]
        for shard in shards:
            rows = self.shard_rows(shard)
            state = self.shard_state(rows)
            if self.bias is not None:
                state["bias"] = self.bias.detach()[rows].cpu().contiguous()
            yield shard, state

    # ---- compute ----

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._matmul(x.reshape(-1, self.in_features)).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.output_sizes}, method={self.method}, online={self.online}"


def fused_sizes(linear: nn.Module) -> list[int] | None:
    sizes = getattr(linear, "output_sizes", None)
    return list(sizes) if sizes is not None else None


def iter_linears(model: nn.Module, skip: tuple[str, ...] = ("lm_head",)) -> Iterator[tuple[str, nn.Linear]]:
    """The decoder's linears in model order. ``lm_head`` stays in the model dtype: it is tied
    to the embeddings in small models, and quantizing it costs the most quality per byte."""
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and not any(name == s or name.endswith("." + s) for s in skip):
            yield name, module


def replace_module(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


class ChannelScaledLinear(QuantLinear):
    """Base of the 8-bit linears: ``weight [out, in]`` in an 8-bit dtype and one float32 scale
    per output row (``w = weight * weight_scale``), the compressed-tensors "channel" layout.

    A per-tensor checkpoint scale (strategy "tensor") is broadcast over its shard's rows, so
    fused shards with different scales still share one per-row vector. An optional static
    ``input_scale`` (per tensor) is kept as the maximum over the fused shards.
    """

    shard_tensors = ("weight", "weight_scale")
    optional_tensors = ("input_scale",)
    storage_dtype: ClassVar[torch.dtype] = torch.int8
    row_wise = True  # one scale per output row

    def __init__(
        self,
        in_features: int,
        out_features: int,
        output_sizes: list[int] | None = None,
        bias: bool = False,
        online: bool = False,
    ) -> None:
        super().__init__(in_features, out_features, output_sizes, bias, online)
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=self.storage_dtype))
        self.register_buffer("weight_scale", torch.zeros(out_features, dtype=torch.float32))
        self.register_buffer("input_scale", torch.zeros(1, dtype=torch.float32))
        self.has_input_scale = False

    def _load_shard(self, name: str, tensor: torch.Tensor, rows: slice, shard: int | None) -> None:
        n = rows.stop - rows.start
        if name == "weight":
            self._check_shape(name, tensor, (n, self.in_features))
            if tensor.dtype != self.storage_dtype:
                raise LocalLLMError(
                    f"checkpoint tensor 'weight' is {tensor.dtype}, but a {self.method} linear stores "
                    f"{self.storage_dtype}; does quantization_config describe these tensors?"
                )
            self.weight[rows].copy_(tensor)
        elif name == "weight_scale":
            flat = tensor.reshape(-1)
            if flat.numel() not in (1, n):
                self._check_shape(name, tensor, (n, 1))
            self.weight_scale[rows].copy_(flat.float().expand(n))
        else:  # input_scale: one activation scale for the whole fused matmul
            value = tensor.reshape(-1).float().max().reshape(1)
            if self.has_input_scale:
                value = torch.maximum(value, self.input_scale.cpu())
            self.input_scale.copy_(value)
            self.has_input_scale = True

    @staticmethod
    def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``w [out, in]`` -> codes in ``storage_dtype`` and float32 scales ``[out]``."""
        raise NotImplementedError

    def set_weight_rows(self, weight: torch.Tensor, rows: slice) -> None:
        q, s = self.quantize(weight.to(self.weight.device))
        self.weight[rows].copy_(q)
        self.weight_scale[rows].copy_(s)

    def dequantize(self) -> torch.Tensor:
        return self.weight.float() * self.weight_scale[:, None]

    def _upcast(self, dtype: torch.dtype) -> torch.Tensor:
        return self.weight.to(dtype)

    def _dequant_matmul(self, x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``x @ dequantize().T`` computed in ``dtype`` (default x's). Scaling the [M, out]
        result is cheaper than scaling the [out, in] weight."""
        dtype = dtype or x.dtype
        return F.linear(x.to(dtype), self._upcast(dtype)) * self.weight_scale.to(dtype)

    def shard_state(self, rows: slice) -> dict[str, torch.Tensor]:
        state = {
            "weight": self.weight[rows].cpu().contiguous(),
            "weight_scale": self.weight_scale[rows].reshape(-1, 1).cpu().contiguous(),
        }
        if self.has_input_scale:
            state["input_scale"] = self.input_scale.cpu().clone()
        return state
