"""Reading checkpoints: HF folders (safetensors, sharded or not) and GGUF files.

Both produce a ``Checkpoint``: the config, the tokenizer, and a generator of HF-named tensors,
consumed one at a time so a shard (or a dequantized GGUF tensor) is the most that sits in RAM.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from localllm.errors import LocalLLMError
from localllm.models.llama import SUPPORTED_ARCHITECTURES, LlamaForCausalLM, ModelConfig
from localllm.tokenizer import Tokenizer

if TYPE_CHECKING:
    from localllm.hardware.planner import Plan

WeightIter = Iterator[tuple[str, torch.Tensor]]


@dataclass(slots=True)
class Checkpoint:
    path: Path
    format: str  # "hf" or "gguf"
    config: ModelConfig
    tokenizer: Tokenizer
    weights: Callable[..., WeightIter]  # (raw=(), head_from_embedding=False) for GGUF; () for HF
    num_tensors: int
    # GGUF only: HF tensor name -> GGML block type, so a CPU plan can keep the file's blocks
    block_types: dict[str, int] = field(default_factory=dict)


def open_checkpoint(path: Path) -> Checkpoint:
    if not path.exists():
        raise LocalLLMError(f"{path}: no such file or folder")
    if path.is_dir():
        return _open_hf_dir(path)
    if path.suffix == ".gguf":
        return _open_gguf(path)
    raise LocalLLMError(f"{path}: not a model (expected an HF folder with config.json, or a .gguf file)")


# ---------------------------------------------------------------- HF folder


def _open_hf_dir(path: Path) -> Checkpoint:
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise LocalLLMError(f"{path}: no config.json; is this an HF model folder?")
    try:
        raw = json.loads(cfg_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise LocalLLMError(f"{cfg_file}: not valid JSON ({e})") from e
    config = ModelConfig.from_hf(raw, str(cfg_file))
    tokenizer = Tokenizer.from_hf_dir(path)

    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise LocalLLMError(f"{index}: not a safetensors index ({e})") from e
        shards = sorted({path / f for f in weight_map.values()})
    else:
        shards = sorted(path.glob("*.safetensors"))
    if not shards:
        raise LocalLLMError(f"{path}: no *.safetensors weights")
    for shard in shards:
        if not shard.is_file():
            raise LocalLLMError(f"{shard}: listed in the index but missing")
    rename = _text_weight_name if config.wrapper else lambda name: name
    num_tensors = sum(rename(n) is not None for s in shards for n in _safetensors_header(s))

    def weights() -> WeightIter:
        from safetensors import safe_open

        for shard in shards:
            try:
                with safe_open(str(shard), framework="pt") as f:
                    for name in f.keys():
                        text_name = rename(name)
                        if text_name is not None:
                            yield text_name, f.get_tensor(name)
            except LocalLLMError:
                raise
            except Exception as e:  # safetensors raises its own error types for corrupt data
                raise LocalLLMError(f"{shard}: corrupt or truncated safetensors file ({e})") from e

    return Checkpoint(path, "hf", config, tokenizer, weights, num_tensors)


# Where multimodal wrappers keep their text model: transformers 5 (and 4.52+), older releases,
# and Idefics3/SmolVLM. The rest of such a checkpoint (vision tower, projector) is not loaded.
_TEXT_PREFIXES = (
    ("model.language_model.", "model."), ("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
    ("model.text_model.", "model."), ("text_model.", "model."), ("lm_head.", "lm_head."),
)


def _text_weight_name(name: str) -> str | None:
    """A multimodal checkpoint's tensor name as the text model's, or None for the others."""
    for prefix, to in _TEXT_PREFIXES:
        if name.startswith(prefix):
            return to + name[len(prefix):]
    return None


def _safetensors_header(path: Path) -> dict[str, Any]:
    """Validates the header and that every tensor lies inside the file (catches truncation
    before loading starts, instead of a crash halfway)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise LocalLLMError(f"{path}: truncated safetensors file (no header)")
        n = int.from_bytes(head, "little")
        if n <= 0 or n > size - 8:
            raise LocalLLMError(f"{path}: corrupt safetensors header (length {n}, file {size} bytes)")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise LocalLLMError(f"{path}: corrupt safetensors header ({e})") from e
    header.pop("__metadata__", None)
    end = max((t["data_offsets"][1] for t in header.values()), default=0)
    if 8 + n + end > size:
        raise LocalLLMError(f"{path}: truncated safetensors file ({size} bytes, tensors need {8 + n + end})")
    return header


# ---------------------------------------------------------------- GGUF

_GGUF_ARCH = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}

_GGUF_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


def _gguf_hf_name(name: str) -> str | None:
    if name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if name == "output_norm.weight":
        return "model.norm.weight"
    if name == "output.weight":
        return "lm_head.weight"
    parts = name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _GGUF_NAMES:
        return f"model.layers.{parts[1]}.{_GGUF_NAMES[parts[2]]}.{parts[3]}"
    return None


def _unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp interleaves the two rotary halves of each Q/K head; restore HF's layout."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


@dataclass(slots=True)
class _GGUFTensor:
    name: str
    shape: tuple[int, ...]  # torch order: [out, in]
    tensor_type: Any  # gguf.GGMLQuantizationType
    data: np.ndarray  # raw bytes, one row per output row


def _read_gguf(path: Path) -> tuple[dict[str, Any], dict[str, _GGUFTensor]]:
    """Parses a GGUF v2/v3 header straight from a memory map. gguf.GGUFReader builds a numpy
    view per array element, which took 3.4 s for SmolLM2's 98k-entry vocab; this takes ~0.1 s.
    Tensor data stays memory-mapped until each tensor is dequantized."""
    import struct

    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    buf = np.memmap(path, dtype=np.uint8, mode="r")
    mv = memoryview(buf)
    pos = 0

    def take(fmt: str) -> Any:
        nonlocal pos
        value = struct.unpack_from(fmt, mv, pos)[0]
        pos += struct.calcsize(fmt)
        return value

    def string() -> str:
        nonlocal pos
        n = take("<Q")
        if pos + n > len(mv):
            raise ValueError("string runs past the end of the file")
        value = bytes(mv[pos : pos + n]).decode("utf-8", errors="replace")
        pos += n
        return value

    def value(kind: int) -> Any:
        nonlocal pos
        if kind == 8:
            return string()
        if kind == 9:
            elem, count = take("<I"), take("<Q")
            if elem == 8:
                return [string() for _ in range(count)]
            fmt = _GGUF_SCALARS[elem]
            size = struct.calcsize(fmt)
            arr = np.frombuffer(mv, dtype=np.dtype(fmt), count=count, offset=pos)
            pos += size * count
            return arr.tolist()
        return take(_GGUF_SCALARS[kind])

    if take("<I") != 0x46554747:  # b"GGUF" little-endian
        raise ValueError("not a GGUF file (bad magic)")
    version = take("<I")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} is not supported (2 or 3)")
    n_tensors, n_kv = take("<Q"), take("<Q")
    fields: dict[str, Any] = {}
    for _ in range(n_kv):
        key = string()
        fields[key] = value(take("<I"))
    infos = []
    for _ in range(n_tensors):
        name = string()
        dims = [take("<Q") for _ in range(take("<I"))]
        infos.append((name, dims, GGMLQuantizationType(take("<I")), take("<Q")))
    align = int(fields.get("general.alignment", 32))
    data_start = -(-pos // align) * align
    tensors: dict[str, _GGUFTensor] = {}
    for name, dims, qtype, offset in infos:
        block, type_size = GGML_QUANT_SIZES[qtype]
        row_bytes = dims[0] // block * type_size
        rows = int(np.prod(dims[1:])) if len(dims) > 1 else 1
        begin = data_start + offset
        if begin + rows * row_bytes > len(buf):
            raise ValueError(f"tensor {name} runs past the end of the file (truncated?)")
        data = buf[begin : begin + rows * row_bytes].reshape(rows, row_bytes)
        tensors[name] = _GGUFTensor(name, tuple(reversed(dims)), qtype, data)
    return fields, tensors


def _parse_gguf(path: Path) -> tuple[dict[str, Any], dict[str, _GGUFTensor]]:
    try:
        return _read_gguf(path)
    except Exception as e:  # struct.error, ValueError, KeyError on unknown types: all mean a bad file
        raise LocalLLMError(f"{path}: corrupt or truncated GGUF file ({type(e).__name__}: {e})") from e


_SHARD_NAME = re.compile(r"(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf")


def gguf_shards(path: Path) -> list[Path]:
    """The files of the GGUF model ``path`` is part of, first to last: all the shards of a split
    model, named ``<name>-00001-of-0000N.gguf`` as gguf-split and the gguf package write them, or
    just ``path``."""
    m = _SHARD_NAME.fullmatch(path.name)
    if m is None:
        return [path]
    count = int(m["count"])
    return [path.with_name(f"{m['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]


def _read_gguf_model(path: Path) -> tuple[dict[str, Any], dict[str, _GGUFTensor]]:
    """The metadata and tensors of a GGUF model, given its file or any shard of a split one.

    Invariant of a split model: shard K (0-based ``split.no``) of ``split.count`` holds a disjoint
    part of the ``split.tensors.count`` tensors, and only the first carries the model's metadata.
    """
    fields, tensors = _parse_gguf(path)
    count = int(fields.get("split.count", 1))
    if count <= 1:
        return fields, tensors
    shards = gguf_shards(path)
    if len(shards) != count:
        raise LocalLLMError(
            f"{path}: a shard of a GGUF split into {count} files, but not named <name>-0000K-of-{count:05d}.gguf; "
            "give the shards back the names gguf-split wrote"
        )
    meta, merged = fields, {}
    for no, shard in enumerate(shards):
        if shard == path:
            part_fields, part = fields, tensors
        elif not shard.is_file():
            raise LocalLLMError(
                f"{shard}: missing; {path.name} is one of {count} shards that must all sit in one folder"
            )
        else:
            part_fields, part = _parse_gguf(shard)
        got = (part_fields.get("split.no"), part_fields.get("split.count"))
        if got != (no, count):
            raise LocalLLMError(
                f"{shard}: its split.no/split.count are {got[0]}/{got[1]}, expected {no}/{count}; "
                "the shards come from different splits"
            )
        if no == 0:
            meta = part_fields
        twice = merged.keys() & part.keys()
        if twice:
            raise LocalLLMError(
                f"{shard}: tensor {min(twice)} is also in an earlier shard; the shards come from different splits"
            )
        merged.update(part)
    expected = int(meta.get("split.tensors.count", len(merged)))
    if len(merged) != expected:
        raise LocalLLMError(
            f"{path}: the {count} shards hold {len(merged)} tensors, but split.tensors.count says {expected}"
        )
    return meta, merged


def _open_gguf(path: Path) -> Checkpoint:
    fields, tensors = _read_gguf_model(path)

    arch = fields.get("general.architecture")
    if arch not in _GGUF_ARCH:
        raise LocalLLMError(
            f"{path}: GGUF architecture {arch!r} is not supported; localllm runs {', '.join(_GGUF_ARCH)} "
            "(llama covers Llama 2/3, Mistral 7B, TinyLlama, SmolLM)"
        )

    def meta(key: str, default: Any = None) -> Any:
        value = fields.get(f"{arch}.{key}", default)
        if value is None:
            raise LocalLLMError(f"{path}: GGUF metadata lacks {arch}.{key}")
        return value

    heads = int(meta("attention.head_count"))
    hidden = int(meta("embedding_length"))
    hf_cfg: dict[str, Any] = {
        "architectures": [_GGUF_ARCH[arch]],
        "vocab_size": len(fields["tokenizer.ggml.tokens"]),
        "hidden_size": hidden,
        "intermediate_size": int(meta("feed_forward_length")),
        "num_hidden_layers": int(meta("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta("attention.head_count_kv", heads)),
        "head_dim": int(meta("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(meta("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(meta("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(meta("context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
    }
    if "rope_freqs.weight" in tensors:
        # llama.cpp bakes Llama 3.1 rope scaling into per-frequency divisors.
        factors = _dequantize(tensors["rope_freqs.weight"], path).flatten().tolist()
        hf_cfg["rope_scaling"] = {"rope_type": "freq_factors", "factors": factors}
    _gguf_rope_scaling(fields, arch, hf_cfg, path)
    config = ModelConfig.from_hf(hf_cfg, str(path))
    try:
        tokenizer = Tokenizer.from_gguf_fields(fields, str(path))
    except KeyError as e:
        raise LocalLLMError(f"{path}: GGUF metadata lacks {e.args[0]}") from e

    permute = arch == "llama"  # llama.cpp permutes Q/K only for its llama architecture
    kv_heads = config.num_kv_heads

    def weights(raw: Collection[str] = (), head_from_embedding: bool = False) -> WeightIter:
        """HF-named tensors, dequantized to float32, except those named in ``raw``, which come
        as the file's blocks (``GGUFBlocks``; rows permuted the same way). With
        ``head_from_embedding`` a tied model also gets ``lm_head.weight`` from token_embd,
        for a CPU plan that runs the head on its own blocks."""
        from localllm.quant.gguf import GGUFBlocks

        for name, t in tensors.items():
            hf_name = _gguf_hf_name(name)
            if hf_name is None:
                continue
            names = [hf_name] + (["lm_head.weight"] if head_from_embedding and name == "token_embd.weight" else [])
            for out_name in names:
                if out_name in raw:
                    w = torch.from_numpy(np.array(t.data))
                else:
                    w = torch.from_numpy(_dequantize(t, path))
                if permute and ".q_proj." in hf_name:
                    w = _unpermute(w, heads)
                elif permute and ".k_proj." in hf_name:
                    w = _unpermute(w, kv_heads)
                yield out_name, (GGUFBlocks(int(t.tensor_type), w.contiguous()) if out_name in raw else w)

    block_types = {hf: int(t.tensor_type) for n, t in tensors.items() if (hf := _gguf_hf_name(n)) is not None}
    return Checkpoint(path, "gguf", config, tokenizer, weights, len(tensors), block_types)


def _gguf_rope_scaling(fields: dict[str, Any], arch: str, hf_cfg: dict[str, Any], path: Path) -> None:
    """llama.cpp's rope.* keys as HF rope_scaling: linear and yarn (whose defaults llama.cpp
    shares with HF); anything else would change the positions in a way not implemented here,
    so it is refused rather than ignored."""
    rope = {k.removeprefix(f"{arch}.rope."): v for k, v in fields.items() if k.startswith(f"{arch}.rope.")}
    dims = rope.get("dimension_count")
    if dims is not None and dims != hf_cfg["head_dim"]:
        raise LocalLLMError(f"{path}: rope over {dims} of {hf_cfg['head_dim']} head dimensions is not supported")
    kind = rope.get("scaling.type", "none")
    known = {"freq_base", "dimension_count", "scaling.type", "scaling.finetuned"}
    if kind in ("none", ""):
        known |= {k for k in rope if k.startswith("scaling.")}  # no scaling: its settings do not apply
    elif kind in ("linear", "yarn"):
        if "rope_scaling" in hf_cfg:
            raise LocalLLMError(f"{path}: rope_freqs and rope.scaling.type {kind!r} together are not supported")
        factor = rope.get("scaling.factor")
        if not isinstance(factor, (int, float)) or not factor > 0:
            raise LocalLLMError(f"{path}: rope.scaling.factor {factor!r} must be a positive number")
        hf_cfg["rope_scaling"] = {"rope_type": kind, "factor": float(factor)}
        if kind == "yarn":
            hf_cfg["rope_scaling"]["original_max_position_embeddings"] = int(
                rope.get("scaling.original_context_length") or hf_cfg["max_position_embeddings"])
        known |= {"scaling.factor", "scaling.original_context_length"}
    else:
        raise LocalLLMError(f"{path}: rope.scaling.type {kind!r} is not supported (none, linear, yarn)")
    extra = sorted(k for k in rope if k not in known)
    if extra:
        raise LocalLLMError(f"{path}: GGUF rope setting {arch}.rope.{extra[0]} is not supported")


def _dequantize(t: Any, path: Path) -> np.ndarray:
    from gguf import quants

    try:
        arr = quants.dequantize(t.data, t.tensor_type)
    except NotImplementedError as e:
        raise LocalLLMError(f"{path}: tensor {t.name} uses {t.tensor_type.name}, which gguf cannot dequantize") from e
    except Exception as e:
        raise LocalLLMError(f"{path}: tensor {t.name} is corrupt or truncated ({e})") from e
    return np.require(arr, np.float32, ["C_CONTIGUOUS", "WRITEABLE"]).reshape(t.shape)


# ---------------------------------------------------------------- model construction


def build_model(
    ckpt: Checkpoint,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    progress: Callable[[int, int], None] | None = None,
    quantize: Callable[[LlamaForCausalLM], None] | None = None,
    weight_options: dict[str, Any] | None = None,
) -> LlamaForCausalLM:
    """Materialises the model on ``device`` in ``dtype`` and streams the checkpoint into it.

    ``progress(done, total)`` is called after each tensor. ``quantize`` swaps linears for
    quantized ones before loading (checkpoints that are already quantized) — see localllm.quant.
    ``weight_options`` go to ``ckpt.weights`` (which GGUF tensors stay blocks).
    """
    with torch.device("meta"):
        model = LlamaForCausalLM(ckpt.config)
    if quantize is not None:
        quantize(model)
    _cast_on_meta(model, dtype)
    tied = ckpt.config.tie_word_embeddings and isinstance(model.lm_head, torch.nn.Linear)
    if tied:
        # to_empty visits a shared Parameter once per owner and would allocate it twice
        model.lm_head._parameters["weight"] = None
    model = model.to_empty(device=device)
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    done = 0

    def counted() -> WeightIter:
        nonlocal done
        for item in ckpt.weights(**(weight_options or {})):
            yield item
            done += 1
            if progress is not None:
                progress(done, ckpt.num_tensors)

    loaded = model.load_weights(counted())
    missing = sorted(model.expected_weights() - loaded)
    if missing:
        raise LocalLLMError(
            f"{ckpt.path}: checkpoint lacks {len(missing)} tensors, e.g. {missing[0].split('#')[0]!r}"
        )
    model.init_rope(max_positions)
    return model.eval()


def _cast_on_meta(model: LlamaForCausalLM, dtype: torch.dtype) -> None:
    """Gives every floating Parameter its final dtype while the model is still on the meta
    device, so that ``to_empty`` allocates each tensor once, as it will stay.

    Invariant: from ``to_empty`` on, the device holds the final weights and, while one streams
    in, that one checkpoint tensor (and the temporaries of quantizing one linear). Casting
    after ``to_empty`` would first materialise the whole model in fp32: 32 GB for an 8B model
    planned in bf16 on a 24 GB card. Buffers keep their dtypes (quantized codes, fp16 AWQ
    scales, fp32 weight scales)."""
    for p in model.parameters():
        if p.is_floating_point():
            p.data = p.data.to(dtype)
    # The final norm feeds the logits; in fp32 its output lets compute_logits refine the top
    # candidates exactly (see there). It is one vector.
    model.model.norm.weight.data = model.model.norm.weight.data.float()


@dataclass(slots=True)
class LoadedModel:
    name: str
    path: Path
    model: LlamaForCausalLM
    tokenizer: Tokenizer
    plan: Plan
    precision: str  # what the status bar shows: float32, bfloat16, fp8, int8, awq
    device: torch.device
    kv_dtype: torch.dtype
    max_model_len: int
    num_kv_blocks: int
    use_cuda_graphs: bool
    predicted_bytes: int


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Plan KV dtype names -> torch storage dtypes ("fp8" is e4m3, as vLLM's "fp8").
_KV_DTYPES = {**_DTYPES, "fp8": torch.float8_e4m3fn}


def _release_loader_memory() -> None:
    """Hands the loader's freed buffers back to the OS. glibc raises its mmap threshold after
    large frees, so dequantization temporaries end up on the heap and stay in RSS (measured:
    64 MB on the default model) until trimmed."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass


def load_model(
    name: str | None,
    *,
    dtype: str = "auto",
    device: str | None = None,
    quant: str | None = None,
    max_model_len: int | None = None,
    context: int | None = None,
    chats: int = 4,
    num_kv_blocks: int | None = None,
    block_size: int = 16,
    gpu_memory_utilization: float = 0.9,
    kv_cache_dtype: str = "auto",
    progress: Callable[[str, int, int], None] | None = None,
    compile: bool = True,
) -> LoadedModel:
    """Resolves (pulling if needed), plans against this machine, and loads. ``progress`` gets
    ``(stage, done, total)``."""
    from localllm import store
    from localllm.hardware.planner import plan as make_plan
    from localllm.hardware.probe import probe_hardware
    from localllm.kernels._triton import rehearsing

    if quant is not None:
        from localllm.quant import check_method

        quant = check_method(quant)  # an unknown method fails before the model is fetched
    path = store.resolve(name)
    ckpt = open_checkpoint(path)
    cfg = ckpt.config
    hw = probe_hardware()
    if device is not None and device not in ("cpu", "cuda"):
        raise LocalLLMError(f"--device {device!r}: use cpu or cuda")
    if device == "cuda" and hw.gpu is None:
        why = next((n.removeprefix("no NVIDIA GPU: ").removesuffix("; planning for the CPU") for n in hw.notes
                    if n.startswith("no NVIDIA GPU")), "no CUDA GPU is usable here")
        raise LocalLLMError(f"--device cuda: {why}; use --device cpu")
    if device == "cpu":
        hw = replace(hw, gpus=())
    pre_quant = (cfg.quantization or {}).get("quant_method")
    # The planner sizes memory for fp8/int8/awq; rtn4 stores like awq, int8-w8a8 like int8.
    plan_quant = {"rtn4": "awq", "int8-w8a8": "int8", "none": None}.get(quant, quant) if quant else None
    if pre_quant:
        plan_quant = "fp8" if pre_quant == "compressed-tensors" else pre_quant
    cpu_gguf = None
    if quant == "gguf" and ckpt.format != "gguf":
        raise LocalLLMError(f"--quant gguf keeps a GGUF file's blocks, but {path.name} is not a .gguf file")
    if ckpt.format == "gguf" and not pre_quant and quant in (None, "gguf") and dtype == "auto" and device != "cuda":
        from localllm.quant.gguf import measure_cpu_choice

        cpu_gguf = measure_cpu_choice(ckpt.block_types)
        if quant == "gguf" and cpu_gguf is None:
            raise LocalLLMError("--quant gguf needs localllm's CPU kernels (an x86-64-v3 CPU and a C++ compiler)")
    plan = make_plan(
        cfg, hw, context=max_model_len or context, chats=chats, quant=None if quant == "gguf" else plan_quant,
        dtype=None if dtype == "auto" else dtype, gpu_memory_utilization=gpu_memory_utilization,
        block_size=block_size, cpu_gguf=cpu_gguf, cpu_compile=compile, name=name or store.DEFAULT_MODEL,
        kv_cache_dtype=kv_cache_dtype,
    )
    dev = torch.device(plan.device)
    torch_dtype = _DTYPES[plan.weight_dtype]
    kv_dtype = _KV_DTYPES[plan.kv_dtype]
    if rehearsing() and dev.type == "cpu":
        if torch_dtype == torch.bfloat16:
            raise LocalLLMError(
                "LOCALLLM_TRITON_ON_CPU=1 runs the Triton kernels under the interpreter, which computes bf16"
                " wrongly: pass --dtype float32 or --dtype float16")
        if kv_dtype == torch.float32:
            kv_dtype = torch_dtype  # what a GPU would store: the activation dtype
    max_len = min(max_model_len or plan.max_model_len, cfg.max_context)
    blocks = num_kv_blocks or plan.num_kv_blocks
    # An explicit method wins over the plan's label (rtn4 and int8-w8a8 plan as awq and int8).
    method = pre_quant or (quant if quant not in (None, "none") else plan.quant)

    swap = None
    weight_options: dict[str, Any] = {}
    if method == "gguf":
        from localllm.quant.gguf import TYPE_NAMES, plan_gguf_modules

        raw: set[str] = set()  # filled by the swap, read when the weights start streaming

        def swap(m: LlamaForCausalLM) -> None:
            names, requantized = plan_gguf_modules(m, ckpt.block_types, cfg.tie_word_embeddings)
            raw.update(names)
            if requantized:
                plan.reasons.append(f"requantized to Q8_0 (not Q4_0/Q4_1/Q8_0 in the file): {', '.join(requantized)}")

        weight_options = {"raw": raw, "head_from_embedding": cfg.tie_word_embeddings}
        kinds = sorted({TYPE_NAMES[t] for t in ckpt.block_types.values() if t in TYPE_NAMES})
        method = "gguf-" + "/".join(kinds).lower()
    elif pre_quant:
        from localllm.quant import prepare_for_checkpoint

        swap = lambda m: prepare_for_checkpoint(m, cfg.quantization)  # noqa: E731
    elif method:
        # Online: each linear is quantized as its last shard arrives, so the 16-bit weights
        # never sit on the device whole.
        from localllm.quant import prepare_online

        swap = lambda m: prepare_online(m, method)  # noqa: E731
    report = (lambda d, t: progress("loading", d, t)) if progress else None
    model = build_model(ckpt, torch_dtype, dev, max_len, report, swap, weight_options)
    _release_loader_memory()
    return LoadedModel(
        name=name or store.DEFAULT_MODEL, path=path, model=model, tokenizer=ckpt.tokenizer, plan=plan,
        precision=method or plan.weight_dtype, device=dev, kv_dtype=kv_dtype,
        max_model_len=max_len, num_kv_blocks=blocks, use_cuda_graphs=plan.use_cuda_graphs,
        predicted_bytes=plan.expected_measured_bytes,
    )


def save_hf_folder(
    ckpt: Checkpoint, out: Path, tensors: WeightIter | None = None, extra_config: dict[str, Any] | None = None
) -> None:
    """Writes an HF folder (config.json, model.safetensors, tokenizer files) that
    ``open_checkpoint`` and transformers both read. ``tensors`` defaults to the checkpoint's
    own weights (a GGUF becomes a plain fp32 HF export); quantizers pass their packed tensors
    and ``extra_config`` (e.g. ``quantization_config``)."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    cfg = ckpt.config
    hf = {
        "architectures": [cfg.architecture],
        "model_type": SUPPORTED_ARCHITECTURES[cfg.architecture],
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim, "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling, "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings, "attention_bias": cfg.qkv_bias,
        "hidden_act": "silu", "torch_dtype": "float32",
        # a window is written so that both readers cap the context there (see ModelConfig)
        "sliding_window": cfg.sliding_window, "use_sliding_window": cfg.sliding_window is not None,
        "max_window_layers": 0,
        "bos_token_id": ckpt.tokenizer.bos_token_id,
        "eos_token_id": list(ckpt.tokenizer.eos_token_ids),
    }
    hf.update(extra_config or {})
    hf["dtype"] = hf["torch_dtype"]  # transformers 5 reads dtype; older ones torch_dtype
    (out / "config.json").write_text(json.dumps(hf, indent=2))
    tok = ckpt.tokenizer
    tok.backend.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": tok.chat_template, "bos_token": tok.bos_token, "eos_token": tok.eos_token,
        "add_bos_token": tok.add_bos, "add_eos_token": tok.add_eos,
    }, indent=2))
    (out / "generation_config.json").write_text(json.dumps({
        "bos_token_id": tok.bos_token_id, "eos_token_id": list(tok.eos_token_ids),
    }, indent=2))
    state = {name: t.contiguous() for name, t in (tensors if tensors is not None else ckpt.weights())}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    # safetensors creates the file 0600; give it the mode any file written here gets
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(out / "model.safetensors", 0o666 & ~umask)
