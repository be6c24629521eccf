"""Quantized checkpoint formats: reading ``quantization_config`` into per-linear modules, and
writing a quantized model as an HF folder in the same formats.

- AutoAWQ GEMM (``quant_method: awq``): the int4 methods, awq and rtn4.
- compressed-tensors (``quant_method: compressed-tensors``): 8-bit weights with per-channel
  or per-tensor scales, fp8 ("float-quantized") or int8 ("int-quantized"/"naive-quantized"),
  optionally with per-token dynamic or static per-tensor activation scales.

Either way the checkpoint keeps HF's un-fused names (``q_proj``, ``k_proj`` ...); the fused
modules load them as shards.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from localllm.errors import LocalLLMError
from localllm.models.llama import _STACKED, LlamaForCausalLM
from localllm.models.checkpoint import Checkpoint
from localllm.models.export import save_hf_folder
from localllm.quant.awq import AWQLinear, awq_config, check_awq_config
from localllm.quant.linear import QuantLinear, fused_sizes, iter_linears, replace_module
from localllm.quant.methods import make_quant_linear

_CT_FORMATS = ("float-quantized", "int-quantized", "naive-quantized")


def hf_shard_names(module_name: str, n_shards: int) -> list[str]:
    """Our (possibly fused) linear -> the HF module name of each shard, in shard order."""
    dotted = module_name + "."
    names = []
    for frag, (fused, idx) in _STACKED.items():
        if fused in dotted and idx < n_shards:
            names.append((idx, dotted.replace(fused, frag)[:-1]))
    if not names:
        return [module_name]
    return [n for _, n in sorted(names)]


# ---------------------------------------------------------------- reading


def prepare_for_checkpoint(model: nn.Module, quantization_config: dict[str, Any]) -> None:
    """Swaps linears for the modules that load ``quantization_config``'s checkpoint layout."""
    for name, module in plan_checkpoint_modules(model, quantization_config):
        replace_module(model, name, module)


def plan_checkpoint_modules(model: nn.Module, qcfg: dict[str, Any]) -> Iterator[tuple[str, QuantLinear]]:
    """(module name, replacement) for each linear a checkpoint with ``qcfg`` quantizes."""
    if not isinstance(qcfg, dict):
        raise LocalLLMError("config.json: quantization_config must be an object")
    method = str(qcfg.get("quant_method", "")).lower()
    if method == "awq":
        yield from _plan_awq(model, qcfg)
    elif method == "compressed-tensors":
        yield from _plan_compressed_tensors(model, qcfg)
    else:
        raise LocalLLMError(
            f"config.json: quantization method {method or '(none)'!r} is not supported; localllm loads "
            "awq (AutoAWQ GEMM) and compressed-tensors (fp8/int8) checkpoints"
        )


def _new_module(lin: nn.Linear, make: Callable[[int, int, list[int] | None, bool], QuantLinear]) -> QuantLinear:
    with torch.device(lin.weight.device):
        return make(lin.in_features, lin.out_features, fused_sizes(lin), lin.bias is not None)


def _plan_awq(model: nn.Module, qcfg: dict[str, Any]) -> Iterator[tuple[str, QuantLinear]]:
    group = check_awq_config(qcfg)
    skip = qcfg.get("modules_to_not_convert") or []
    for name, lin in list(iter_linears(model)):
        shards = hf_shard_names(name, len(fused_sizes(lin) or [0]))
        skipped = [any(key in s for key in skip) for s in shards]
        if all(skipped):
            continue
        if any(skipped):
            raise LocalLLMError(
                f"config.json: modules_to_not_convert keeps part of the fused {name} in float; not supported"
            )
        yield name, _new_module(lin, lambda i, o, sizes, b: AWQLinear(i, o, group, sizes, b))


def _matches(pattern: str, name: str) -> bool:
    if pattern == "Linear":
        return True
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return name == pattern or name.endswith("." + pattern)


def _ct_method(group_name: str, group: dict[str, Any], fmt: str | None) -> str:
    """The method of a config group; "fp8-weight-only" is FP8 weights without activation
    quantization (no ``input_activations``), loaded as ``fp8`` with float activations."""
    weights = group.get("weights") or {}
    acts = group.get("input_activations")
    where = f"config.json: compressed-tensors group {group_name!r}"
    fmt = group.get("format") or fmt
    if fmt is not None and fmt not in _CT_FORMATS:
        raise LocalLLMError(f"{where} uses format {fmt!r}; localllm loads {', '.join(_CT_FORMATS)}")
    if weights.get("num_bits") != 8 or weights.get("type") not in ("float", "int"):
        raise LocalLLMError(
            f"{where}: {weights.get('num_bits')}-bit {weights.get('type')} weights are not supported (8-bit float or int)"
        )
    if weights.get("strategy") not in ("channel", "tensor"):
        raise LocalLLMError(f"{where}: weight strategy {weights.get('strategy')!r} is not supported (channel, tensor)")
    if not weights.get("symmetric", True):
        raise LocalLLMError(f"{where}: asymmetric 8-bit weights are not supported")
    if acts is not None and acts.get("strategy") not in ("token", "tensor"):
        raise LocalLLMError(f"{where}: activation strategy {acts.get('strategy')!r} is not supported (token, tensor)")
    if weights["type"] == "float":
        return "fp8" if acts is not None else "fp8-weight-only"
    return "int8" if acts is None else "int8-w8a8"


def _plan_compressed_tensors(model: nn.Module, qcfg: dict[str, Any]) -> Iterator[tuple[str, QuantLinear]]:
    groups = qcfg.get("config_groups") or {}
    if not groups:
        raise LocalLLMError("config.json: compressed-tensors quantization_config has no config_groups")
    if qcfg.get("kv_cache_scheme"):
        raise LocalLLMError("config.json: compressed-tensors kv_cache_scheme (KV-cache scales) is not supported")
    schemes = [(g.get("targets") or [], _ct_method(n, g, qcfg.get("format"))) for n, g in groups.items()]
    ignore = qcfg.get("ignore") or []
    for name, lin in list(iter_linears(model)):
        shards = hf_shard_names(name, len(fused_sizes(lin) or [0]))
        methods = set()
        for s in shards:
            if any(_matches(p, s) for p in ignore):
                methods.add(None)
                continue
            methods.add(next((m for targets, m in schemes if any(_matches(t, s) for t in targets)), None))
        if methods == {None}:
            continue
        if len(methods) > 1:
            raise LocalLLMError(f"config.json: the shards of {name} ({', '.join(shards)}) mix quantization schemes")
        (method,) = methods
        weight_only = method == "fp8-weight-only"
        module = _new_module(lin, lambda i, o, sizes, b, m="fp8" if weight_only else method:
                             make_quant_linear(m, i, o, sizes, b))
        if weight_only:
            module.weight_only = True  # type: ignore[attr-defined]
        yield name, module


# ---------------------------------------------------------------- writing


def checkpoint_config(method: str, group_size: int | None) -> dict[str, Any]:
    if method in ("awq", "rtn4"):
        assert group_size is not None
        return awq_config(group_size)
    weights = {"num_bits": 8, "type": "float" if method == "fp8" else "int", "strategy": "channel",
               "symmetric": True, "dynamic": False, "group_size": None}
    acts = None
    if method in ("fp8", "int8-w8a8"):
        acts = {"num_bits": 8, "type": weights["type"], "strategy": "token", "symmetric": True, "dynamic": True}
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized" if method == "fp8" else "int-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts}},
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
    }


def model_tensors(model: LlamaForCausalLM, float_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """HF-named, un-fused tensors of a (partly) quantized model, on the CPU."""
    out: dict[str, torch.Tensor] = {}
    tied = model.config.tie_word_embeddings
    handled: set[str] = set()
    for name, module in model.named_modules():
        if isinstance(module, QuantLinear):
            shards = hf_shard_names(name, len(module.output_sizes) if module.fused else 1)
            for shard, state in module.export():
                hf = shards[shard or 0]
                for t, v in state.items():
                    out[f"{hf}.{t}"] = v.to(float_dtype) if t == "bias" else v
            handled.update(f"{name}.{p}" for p, _ in module.named_parameters())
        elif isinstance(module, nn.Linear) and not (tied and name == "lm_head"):
            sizes = fused_sizes(module) or [module.out_features]
            shards = hf_shard_names(name, len(sizes))
            for t, v in (("weight", module.weight), ("bias", module.bias)):
                if v is None:
                    continue
                for hf, part in zip(shards, v.detach().split(sizes, dim=0)):
                    out[f"{hf}.{t}"] = part.to(float_dtype)
            handled.update(f"{name}.{p}" for p, _ in module.named_parameters())
    for name, p in model.named_parameters():
        if name not in handled and not (tied and name == "lm_head.weight"):
            out[name] = p.detach().to(float_dtype)
    return {k: v.cpu().contiguous() for k, v in out.items()}


def save_quantized(
    model: LlamaForCausalLM,
    ckpt: Checkpoint,
    out: Path,
    method: str,
    group_size: int | None,
    float_dtype: torch.dtype | None = None,
) -> Path:
    """Writes ``model`` (``ckpt`` quantized with ``method``) as an HF folder: config.json with
    its quantization_config, model.safetensors, and the tokenizer files. Float tensors are
    written in fp16 for AWQ (what AutoAWQ and vLLM's AWQ kernels expect), bf16 otherwise."""
    if float_dtype is None:
        float_dtype = torch.float16 if method in ("awq", "rtn4") else torch.bfloat16
    if out.exists() and not out.is_dir():
        raise LocalLLMError(f"{out}: exists and is not a folder; pick another -o")
    if out.is_dir() and any(out.iterdir()) and not (out / "config.json").is_file():
        raise LocalLLMError(f"{out}: folder is not empty and holds no model; pick an empty or new -o")
    if out.resolve() == ckpt.path.resolve():
        raise LocalLLMError(f"{out}: is the model being quantized; pick another -o")
    tensors = model_tensors(model, float_dtype)
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("*.safetensors*"):  # an earlier run's shards would be loaded too
        stale.unlink()
    extra = {"quantization_config": checkpoint_config(method, group_size),
             "torch_dtype": str(float_dtype).removeprefix("torch.")}
    save_hf_folder(ckpt, out, iter(tensors.items()), extra)
    return out
