"""Reading an HF model folder: config.json, the tokenizer files and safetensors weights,
sharded (``model.safetensors.index.json``) or not, and the text model inside a multimodal
wrapper.

Every shard's header is checked against its file size before loading starts, so a truncated
download fails with one line up front instead of halfway through the weights.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from localllm.errors import LocalLLMError
from localllm.models.checkpoint import Checkpoint, WeightIter
from localllm.models.llama import ModelConfig
from localllm.tokenizer import Tokenizer


def open_hf_dir(path: Path) -> Checkpoint:
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
