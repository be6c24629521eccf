"""SentencePiece GGUF vocabularies (``tokenizer.ggml.model = "llama"``): a model trained here
with the ``sentencepiece`` package, written into a real GGUF file, must give sentencepiece's
own ids and text back through our ``tokenizers`` model."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from localllm.models.export import save_hf_folder

from localllm.models.formats import open_checkpoint
from localllm.tokenizer import IncrementalDetokenizer, Tokenizer
from tests.models.gguf_files import (
    EXTRA_CONTROL,
    EXTRA_USER_DEFINED,
    ZEPHYR_TEMPLATE,
    random_llama_weights,
    spm_vocab,
    train_sentencepiece,
    write_llama_gguf,
)

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world",  # 'H' is not in the training text: a byte
    " one leading space",
    "   three leading spaces",
    "double  space and triple   space",
    "trailing space ",
    "trailing spaces   ",
    " ",
    "   ",
    "new\nline\n\nblank line\n",
    "\nstarts with a newline",
    "\n",
    "tabs\tand\ttabs",
    "digits 1234567890, 3.14159 and 2024-12-01",
    "punctuation: !?.,;:'\"()[]{}<>/\\|@#$%^&*-_=+~`",
    "Grüße aus Köln, naïve café, déjà vu",
    "日本語のテキストと中文字符",
    "Привет, мир! Ελληνικά",
    "emoji 🎉🚀 and a skin tone 👍🏽 and a family 👨‍👩‍👧",
    "pieces and merges " * 20,
    "    Indented code: def main(): return x + 1  # a comment",
]

SPECIAL_TEXTS = [
    "<s>Hello</s> world",
    "<|user|>\nWhat is 2 + 2?</s>\n<|assistant|>\n",
    "text <s> text</s></s>",
    "call <tool>now<tool>",
    "<|system|>You are terse.</s><|user|> hi",
]


@pytest.fixture(scope="module", params=["bpe", "unigram"])
def spm_pair(request, tmp_path_factory) -> tuple[object, Tokenizer, Path]:
    """(sentencepiece processor, our tokenizer read from the GGUF file, the file)."""
    sp = train_sentencepiece(request.param)
    tokens, scores, types = spm_vocab(sp)
    path = tmp_path_factory.mktemp(request.param) / "tiny-spm.gguf"
    write_llama_gguf(path, tokens, scores, types, random_llama_weights(len(tokens)), chat_template=ZEPHYR_TEMPLATE)
    return sp, open_checkpoint(path).tokenizer, path


def sp_reference(sp, text: str, tok: Tokenizer) -> list[int]:  # noqa: ANN001
    """sentencepiece's ids with control and user-defined tokens matched as whole tokens the way
    llama.cpp matches them: each stretch of text between them is encoded on its own."""
    specials = sorted(["<s>", "</s>", *EXTRA_CONTROL, *EXTRA_USER_DEFINED], key=len, reverse=True)
    ids: list[int] = []
    for part in re.split("(" + "|".join(map(re.escape, specials)) + ")", text):
        if part in specials:
            ids.append(tok.backend.token_to_id(part))
        elif part:
            ids += sp.encode(part)
    return ids


def test_vocabulary_is_what_sentencepiece_trained(spm_pair) -> None:
    sp, tok, _ = spm_pair
    assert sp.get_piece_size() > 300  # a real vocabulary: bytes, control tokens and learnt pieces
    assert tok.vocab_size == sp.get_piece_size() + len(EXTRA_CONTROL) + len(EXTRA_USER_DEFINED)
    assert (tok.bos_token, tok.bos_token_id, tok.eos_token, tok.eos_token_ids) == ("<s>", 1, "</s>", (2,))


@pytest.mark.parametrize("text", TEXTS)
def test_ids_and_text_match_sentencepiece(spm_pair, text: str) -> None:
    sp, tok, _ = spm_pair
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == sp.encode(text), ([sp.id_to_piece(i) for i in sp.encode(text)], [sp.id_to_piece(i) for i in ids])
    assert tok.decode(ids) == sp.decode(ids) == text
    assert tok.encode(text) == [1, *ids]  # tokenizer.ggml.add_bos_token


def test_byte_fallback_is_used_and_streams_whole_characters(spm_pair) -> None:
    sp, tok, _ = spm_pair
    text = "emoji 🎉 日本 👍🏽"
    ids = tok.encode(text, add_special_tokens=False)
    assert any(sp.is_byte(i) for i in ids)
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.add([i]) for i in ids]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


@pytest.mark.parametrize("text", SPECIAL_TEXTS)
def test_special_tokens_are_single_ids(spm_pair, text: str) -> None:
    sp, tok, _ = spm_pair
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == sp_reference(sp, text, tok)
    # A reply decodes without its control tokens; user-defined ones are text.
    assert "</s>" not in tok.decode(ids) and "<|user|>" not in tok.decode(ids)
    assert ("<tool>" in tok.decode(ids)) == ("<tool>" in text)


def test_chat_template_from_the_gguf(spm_pair) -> None:
    sp, tok, _ = spm_pair
    chat = [{"role": "user", "content": "What is 2 + 2?"}]
    assert tok.template_note is None
    text = tok.apply_chat_template(chat)
    assert text == "<|user|>\nWhat is 2 + 2?</s>\n<|assistant|>\n"
    # The template writes no BOS; the model adds one (add_bos_token), as llama.cpp does.
    assert tok.encode_chat(chat) == [1, *sp_reference(sp, text, tok)]


def test_hf_export_keeps_the_ids(spm_pair, tmp_path: Path) -> None:
    _, tok, path = spm_pair
    save_hf_folder(open_checkpoint(path), tmp_path, tensors=iter([]))
    exported = Tokenizer.from_hf_dir(tmp_path)
    for text in TEXTS + SPECIAL_TEXTS:
        assert exported.encode(text) == tok.encode(text)
        assert exported.decode(tok.encode(text)) == tok.decode(tok.encode(text))


def test_no_chat_template_falls_back_to_plain_turns_with_a_note(tmp_path: Path) -> None:
    sp = train_sentencepiece("bpe")
    tokens, scores, types = spm_vocab(sp)
    path = tmp_path / "no-template.gguf"
    write_llama_gguf(path, tokens, scores, types, random_llama_weights(len(tokens)))
    tok = open_checkpoint(path).tokenizer
    assert tok.chat_template is None
    assert "no chat template" in (tok.template_note or "")
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert tok.apply_chat_template(chat) == "System: Be brief.\n\nUser: Hi\n\nAssistant:"
    assert tok.encode_chat(chat) == [1, *sp.encode("System: Be brief.\n\nUser: Hi\n\nAssistant:")]


def test_default_model_keeps_its_template(default_checkpoint) -> None:
    assert default_checkpoint.tokenizer.template_note is None
