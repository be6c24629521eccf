"""Small GGUF files written by the tests: a SentencePiece vocabulary trained here with the
``sentencepiece`` package, around a tiny random llama model, written with the ``gguf`` package's
GGUFWriter under the keys llama.cpp's convert_hf_to_gguf.py writes (optionally split into
shards the way its --split-max-tensors does)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

# Llama's SentencePiece settings: no normalization, spaces kept as they are, a dummy prefix,
# digits split, unknown characters as bytes. Non-Latin scripts and emoji are left out of the
# training text so that encoding them exercises the byte fallback.
TRAIN_TEXT = """The quick brown fox jumps over the lazy dog. A tokenizer splits text into pieces.
Numbers like 12345 and 2024 appear; so do dates, e.g. 1999-12-31, and prices: $3.50!
Sentences end with periods, questions? and exclamations! Commas, semicolons; colons: all punctuation.
    Indented code: def main(): return x + 1  # a comment
Tokenizers learn merges from frequent pairs of characters and pieces in the training text.
The model reads words, spaces  and newlines, (brackets) [lists] {sets} <tags> "quotes" 'single'.
"""

# Tokens a GGUF converter appends from tokenizer_config.json's added_tokens_decoder.
EXTRA_CONTROL = ("<|system|>", "<|user|>", "<|assistant|>")
EXTRA_USER_DEFINED = ("<tool>",)

ZEPHYR_TEMPLATE = (  # TinyLlama-Chat's template: no BOS of its own
    "{% for message in messages %}{{ '<|' + message['role'] + '|>\n' + message['content'] + eos_token + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


def train_sentencepiece(model_type: str):  # noqa: ANN201 - a sentencepiece.SentencePieceProcessor
    import io

    import sentencepiece as spm

    out = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter((TRAIN_TEXT * 4).splitlines()), model_writer=out, model_type=model_type,
        vocab_size=400, hard_vocab_limit=False, byte_fallback=True, character_coverage=1.0,
        normalization_rule_name="identity", remove_extra_whitespaces=False, add_dummy_prefix=True,
        split_digits=True, allow_whitespace_only_pieces=True, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        minloglevel=2, num_threads=1,
    )
    return spm.SentencePieceProcessor(model_proto=out.getvalue())


def spm_vocab(sp) -> tuple[list[str], list[float], list[int]]:  # noqa: ANN001
    """Tokens, scores and token types as convert_hf_to_gguf.py's _create_vocab_sentencepiece
    derives them, plus the extra control and user-defined tokens at the end."""
    tokens, scores, types = [], [], []
    for i in range(sp.get_piece_size()):
        tokens.append(sp.id_to_piece(i))
        scores.append(sp.get_score(i))
        types.append(2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 5 if sp.is_unused(i)
                     else 6 if sp.is_byte(i) else 1)
    for extra, kind in [(t, 3) for t in EXTRA_CONTROL] + [(t, 4) for t in EXTRA_USER_DEFINED]:
        tokens.append(extra)
        scores.append(-1000.0)
        types.append(kind)
    return tokens, scores, types


HIDDEN, FFN, HEADS, KV_HEADS, LAYERS = 32, 64, 2, 1, 2
# Blocks of the types the gguf package cannot quantize, written by llama.cpp's quantizer
# (tests/fixtures/make_gguf_blocks.py): 16 rows of 512 weights per type.
BLOCKS_FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "gguf_blocks.gguf"


def llama_cpp_blocks(kind: str, rows: int, cols: int) -> np.ndarray:
    """A ``[rows, cols]`` matrix of ``kind`` (e.g. "Q4_K") as llama.cpp's quantizer writes it:
    the fixture's 512-weight rows repeated down the matrix and along each row (``cols`` a
    multiple of 512). Uint8 ``[rows, row bytes]``, for ``write_llama_gguf``'s ``encode``."""
    from localllm.models.gguf_file import read_gguf

    _, tensors = read_gguf(BLOCKS_FIXTURE)
    src = np.array(tensors[kind].data)  # [16, bytes of 512 weights]
    per_row = cols // 512
    assert per_row * 512 == cols, f"{cols} columns are not whole 512-weight fixture rows"
    pick = (np.arange(rows)[:, None] * per_row + np.arange(per_row)[None, :]) % src.shape[0]
    return np.ascontiguousarray(src[pick].reshape(rows, -1))


@dataclass(frozen=True, slots=True)
class LlamaDims:
    hidden: int = HIDDEN
    ffn: int = FFN
    heads: int = HEADS
    kv_heads: int = KV_HEADS
    layers: int = LAYERS


TINY = LlamaDims()


def random_llama_weights(vocab: int, seed: int = 0, dims: LlamaDims = TINY) -> dict[str, torch.Tensor]:
    """HF-named fp32 weights of a tiny (or ``dims``-shaped) untied llama model."""
    g = torch.Generator().manual_seed(seed)
    HIDDEN, FFN, HEADS, KV_HEADS, LAYERS = dims.hidden, dims.ffn, dims.heads, dims.kv_heads, dims.layers  # noqa: N806
    head_dim = HIDDEN // HEADS

    def rand(*shape: int, scale: float = 0.1) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    sd = {"model.embed_tokens.weight": rand(vocab, HIDDEN, scale=0.5), "model.norm.weight": 1 + rand(HIDDEN),
          "lm_head.weight": rand(vocab, HIDDEN, scale=0.3)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = 1 + rand(HIDDEN)
        sd[p + "self_attn.q_proj.weight"] = rand(HEADS * head_dim, HIDDEN, scale=0.4)
        sd[p + "self_attn.k_proj.weight"] = rand(KV_HEADS * head_dim, HIDDEN, scale=0.4)
        sd[p + "self_attn.v_proj.weight"] = rand(KV_HEADS * head_dim, HIDDEN)
        sd[p + "self_attn.o_proj.weight"] = rand(HIDDEN, HEADS * head_dim)
        sd[p + "post_attention_layernorm.weight"] = 1 + rand(HIDDEN)
        sd[p + "mlp.gate_proj.weight"] = rand(FFN, HIDDEN)
        sd[p + "mlp.up_proj.weight"] = rand(FFN, HIDDEN)
        sd[p + "mlp.down_proj.weight"] = rand(HIDDEN, FFN)
    return sd


_GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def _gguf_tensors(sd: dict[str, torch.Tensor], dims: LlamaDims = TINY) -> list[tuple[str, torch.Tensor]]:
    """llama.cpp's names, with Q and K rows permuted into its interleaved rotary layout."""
    HEADS, KV_HEADS, LAYERS = dims.heads, dims.kv_heads, dims.layers  # noqa: N806
    out = [("token_embd.weight", sd["model.embed_tokens.weight"]), ("output_norm.weight", sd["model.norm.weight"]),
           ("output.weight", sd["lm_head.weight"])]
    for i in range(LAYERS):
        for hf, name in _GGUF_NAMES.items():
            w = sd[f"model.layers.{i}.{hf}.weight"]
            heads = {"attn_q": HEADS, "attn_k": KV_HEADS}.get(name)
            if heads is not None:
                w = w.reshape(heads, 2, w.shape[0] // heads // 2, w.shape[1]).transpose(1, 2).reshape(w.shape)
            out.append((f"blk.{i}.{name}.weight", w))
    return out


def write_llama_gguf(
    path: Path, tokens: list[str], scores: list[float], types: list[int], weights: dict[str, torch.Tensor], *,
    arch: str = "llama", chat_template: str | None = None, split_max_tensors: int = 0,
    dims: LlamaDims = TINY, block_type: int | None = None,
    encode: Callable[[str, torch.Tensor], tuple[np.ndarray, int] | None] | None = None,
) -> list[Path]:
    """Writes the model (one file, or shards of at most ``split_max_tensors`` tensors) and returns
    the paths written, first to last. Matrices are F32, or ``block_type`` blocks (a
    GGMLQuantizationType value, e.g. 8 for Q8_0) quantized by gguf's reference code, or what
    ``encode(gguf name, float tensor)`` gives: (uint8 blocks ``[rows, row bytes]``, type), per
    tensor (None: the default)."""
    import gguf

    HIDDEN, FFN, HEADS, KV_HEADS, LAYERS = dims.hidden, dims.ffn, dims.heads, dims.kv_heads, dims.layers  # noqa: N806

    path.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(path, arch, split_max_tensors=split_max_tensors)
    w.add_name("tiny-spm")
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_block_count(LAYERS)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    for name, t in _gguf_tensors(weights, dims):
        custom = encode(name, t) if encode is not None and t.dim() == 2 else None
        if custom is not None:
            blocks, kind = custom
            w.add_tensor(name, blocks, raw_dtype=gguf.GGMLQuantizationType(kind))
        elif block_type is None or t.dim() < 2:
            w.add_tensor(name, t.contiguous().numpy())
        else:
            kind = gguf.GGMLQuantizationType(block_type)
            w.add_tensor(name, gguf.quants.quantize(t.contiguous().numpy(), kind), raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return w.format_shard_names(path)
