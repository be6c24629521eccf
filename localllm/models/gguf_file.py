"""Reading a GGUF model: the header and tensors of one file or of every shard of a split
one, llama.cpp's tensor names as HF's, its metadata as an HF config, and its tensors as HF
weights (dequantized to float32, or as the file's blocks for the CPU block linears).

Tensor data stays memory-mapped until a tensor is dequantized or handed over as blocks.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from localllm.errors import LocalLLMError
from localllm.models.checkpoint import Checkpoint, WeightIter
from localllm.models import registry
from localllm.models.config import ModelConfig
from localllm.tokenizer import Tokenizer

if TYPE_CHECKING:
    from localllm.hardware.sizing import GGUFWeights


def gguf_hf_name(name: str, architecture: str = "LlamaForCausalLM") -> str | None:
    """llama.cpp's name for a tensor as HF's in ``architecture``'s family (models/registry.py),
    or None for one the model does not load."""
    return registry.gguf_tensor_name(architecture, name)


def unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp interleaves the two rotary halves of each Q/K head; restore HF's layout."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


@dataclass(slots=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # torch order: [out, in]
    tensor_type: Any  # gguf.GGMLQuantizationType
    data: np.ndarray  # raw bytes, one row per output row


def read_gguf(path: Path) -> tuple[dict[str, Any], dict[str, GGUFTensor]]:
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
    tensors: dict[str, GGUFTensor] = {}
    for name, dims, qtype, offset in infos:
        block, type_size = GGML_QUANT_SIZES[qtype]
        row_bytes = dims[0] // block * type_size
        rows = int(np.prod(dims[1:])) if len(dims) > 1 else 1
        begin = data_start + offset
        if begin + rows * row_bytes > len(buf):
            raise ValueError(f"tensor {name} runs past the end of the file (truncated?)")
        data = buf[begin : begin + rows * row_bytes].reshape(rows, row_bytes)
        tensors[name] = GGUFTensor(name, tuple(reversed(dims)), qtype, data)
    return fields, tensors


def _parse_gguf(path: Path) -> tuple[dict[str, Any], dict[str, GGUFTensor]]:
    try:
        return read_gguf(path)
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


def read_gguf_model(path: Path) -> tuple[dict[str, Any], dict[str, GGUFTensor]]:
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


def open_gguf(path: Path) -> Checkpoint:
    fields, tensors = read_gguf_model(path)

    arch = fields.get("general.architecture")
    if arch not in registry.GGUF_ARCHITECTURES:
        raise LocalLLMError(
            f"{path}: GGUF architecture {arch!r} is not supported; localllm runs "
            f"{', '.join(registry.GGUF_ARCHITECTURES)} (llama covers Llama 2/3, Mistral 7B, TinyLlama, SmolLM)"
        )
    hf_arch = registry.GGUF_ARCHITECTURES[arch]
    family = registry.family(hf_arch)

    def meta(key: str, default: Any = None) -> Any:
        value = fields.get(f"{arch}.{key}", default)
        if value is None:
            raise LocalLLMError(f"{path}: GGUF metadata lacks {arch}.{key}")
        return value

    heads = int(meta("attention.head_count"))
    hidden = int(meta("embedding_length"))
    hf_cfg: dict[str, Any] = {
        "architectures": [hf_arch],
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
        factors = dequantize(tensors["rope_freqs.weight"], path).flatten().tolist()
        hf_cfg["rope_scaling"] = {"rope_type": "freq_factors", "factors": factors}
    if family.gguf_config is not None:
        family.gguf_config(meta, hf_cfg)
    if "rope_factors_long.weight" in tensors and "rope_factors_short.weight" in tensors:
        # LongRoPE (Phi-3 128k): llama.cpp keeps the two factor lists as tensors
        hf_cfg["rope_scaling"] = {
            "rope_type": "longrope",
            "long_factor": dequantize(tensors["rope_factors_long.weight"], path).flatten().tolist(),
            "short_factor": dequantize(tensors["rope_factors_short.weight"], path).flatten().tolist(),
            "original_max_position_embeddings": int(meta("rope.scaling.original_context_length")),
            "attention_factor": float(meta("rope.scaling.attn_factor", 1.0)),
        }
    gguf_rope_scaling(fields, arch, hf_cfg, path)
    config = ModelConfig.from_hf(hf_cfg, str(path))
    try:
        tokenizer = Tokenizer.from_gguf_fields(fields, str(path))
    except KeyError as e:
        raise LocalLLMError(f"{path}: GGUF metadata lacks {e.args[0]}") from e

    permute = family.gguf_permute_qk  # llama.cpp permutes Q/K only for its llama architecture
    # Gemma's norms are stored as 1 + w (llama.cpp adds it at conversion); HF's hold w
    norm_offset = family.gguf_norm_offset
    kv_heads = config.num_kv_heads

    def weights(raw: Collection[str] = (), head_from_embedding: bool = False) -> WeightIter:
        """HF-named tensors, dequantized to float32, except those named in ``raw``, which come
        as the file's blocks (``GGUFBlocks``; rows permuted the same way). With
        ``head_from_embedding`` a tied model also gets ``lm_head.weight`` from token_embd,
        for a CPU plan that runs the head on its own blocks."""
        from localllm.quant.gguf import GGUFBlocks

        for name, t in tensors.items():
            hf_name = gguf_hf_name(name, hf_arch)
            if hf_name is None:
                continue
            names = [hf_name] + (["lm_head.weight"] if head_from_embedding and name == "token_embd.weight" else [])
            for out_name in names:
                if out_name in raw:
                    w = _mapped_blocks(t)
                else:
                    w = torch.from_numpy(dequantize(t, path))
                if permute and ".q_proj." in hf_name:
                    w = unpermute(w, heads)
                elif permute and ".k_proj." in hf_name:
                    w = unpermute(w, kv_heads)
                if norm_offset and hf_name.endswith("norm.weight") and out_name not in raw:
                    w = w - norm_offset
                yield out_name, (GGUFBlocks(int(t.tensor_type), w.contiguous()) if out_name in raw else w)

    block_types = {hf: int(t.tensor_type) for n, t in tensors.items() if (hf := gguf_hf_name(n, hf_arch)) is not None}
    return Checkpoint(path, "gguf", config, tokenizer, weights, len(tensors), block_types)


def gguf_rope_scaling(fields: dict[str, Any], arch: str, hf_cfg: dict[str, Any], path: Path) -> None:
    """llama.cpp's rope.* keys as HF rope_scaling: linear and yarn (whose defaults llama.cpp
    shares with HF); anything else would change the positions in a way not implemented here,
    so it is refused rather than ignored."""
    rope = {k.removeprefix(f"{arch}.rope."): v for k, v in fields.items() if k.startswith(f"{arch}.rope.")}
    dims = rope.get("dimension_count")
    if dims is not None and dims != hf_cfg["head_dim"]:
        # partial rotary (Phi-4-mini): the config reader refuses it where the family rotates whole
        # heads. As a factor that int(head_dim * factor) turns back into dims (the division may
        # land one ulp low: 30 / 44 * 44 < 30)
        factor = dims / hf_cfg["head_dim"]
        while int(hf_cfg["head_dim"] * factor) < dims:
            factor = math.nextafter(factor, 2.0)
        hf_cfg["partial_rotary_factor"] = factor
    kind = rope.get("scaling.type", "none")
    known = {"freq_base", "dimension_count", "scaling.type", "scaling.finetuned"}
    if (hf_cfg.get("rope_scaling") or {}).get("rope_type") == "longrope":
        known |= {"scaling.original_context_length", "scaling.attn_factor"}  # read with the factors
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


def dequantize(t: GGUFTensor, path: Path) -> np.ndarray:
    from gguf import quants

    try:
        arr = quants.dequantize(t.data, t.tensor_type)
    except NotImplementedError as e:
        raise LocalLLMError(f"{path}: tensor {t.name} uses {t.tensor_type.name}, which gguf cannot dequantize") from e
    except Exception as e:
        raise LocalLLMError(f"{path}: tensor {t.name} is corrupt or truncated ({e})") from e
    return np.require(arr, np.float32, ["C_CONTIGUOUS", "WRITEABLE"]).reshape(t.shape)


def _mapped_blocks(t: GGUFTensor) -> torch.Tensor:
    """A tensor's blocks as a read-only view of the file's memory map: no copy in the process's
    own memory (the block linear copies the rows it keeps), so an 8B file's 430 MB head is not
    held twice while it is repacked. Nothing writes to it (the Q/K row permutation copies)."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(t.data)


def gguf_weights_from_file(path: Path) -> GGUFWeights:
    """Each tensor's real type and stored bytes, from the header of ``path`` (and of every
    other shard of a split model), for the planner's sizing; the weights are not read.
    Raises LocalLLMError for a file that is not a readable GGUF."""
    from localllm.hardware.sizing import gguf_weights_from_tensors
    from localllm.quant.gguf_formats import type_name

    _, tensors = read_gguf_model(path)
    return gguf_weights_from_tensors(((t.name, type_name(int(t.tensor_type)), t.data.nbytes) for t in tensors.values()),
                                     f"the tensors of {path.name}")
