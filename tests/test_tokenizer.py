"""Chat template and incremental detokenization on the default model's tokenizer."""

from __future__ import annotations

import pytest

from localllm.errors import LocalLLMError
from localllm.tokenizer import IncrementalDetokenizer


def test_chat_template_adds_generation_prompt(default_checkpoint) -> None:
    tok = default_checkpoint.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text.endswith("<|im_start|>assistant\n")
    assert "<|im_start|>system\nYou are a helpful AI assistant named SmolLM" in text
    ids = tok.encode_chat([{"role": "user", "content": "Hi"}])
    assert ids[0] == tok.backend.token_to_id("<|im_start|>")  # special tokens map to single ids


def test_template_is_sandboxed(default_checkpoint) -> None:
    from dataclasses import replace

    tok = replace(default_checkpoint.tokenizer, chat_template="{{ ''.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(LocalLLMError, match="unsafe"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])
    bad = replace(default_checkpoint.tokenizer, chat_template="{{ raise_exception('only user/assistant roles') }}")
    with pytest.raises(LocalLLMError, match="only user/assistant roles"):
        bad.apply_chat_template([{"role": "user", "content": "x"}])


@pytest.mark.parametrize("text", ["Grüße, 世界! 🎉🎉 naïve café", "def f(x):\n    return x ** 2  # ok", "  spaces   and\ttabs"])
def test_incremental_detokenizer_streams_exact_text(default_checkpoint, text: str) -> None:
    tok = default_checkpoint.tokenizer
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.add([i]) for i in ids]
    assert "".join(pieces) == tok.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)  # never a broken UTF-8 sequence


@pytest.mark.parametrize(("pre", "pieces"), [("llama-bpe", ["abc"]), ("gpt2", ["ab", "c"])])
def test_llama3_bpe_takes_whole_vocabulary_words_before_merging(pre: str, pieces: list[str]) -> None:
    """Llama 3's tokenizer (HF ignore_merges, llama.cpp's too) emits a pre-token found in the
    vocabulary as is, even when no merge sequence reaches it ("ĠViá»ĩt" in its vocabulary)."""
    from localllm.tokenizer import Tokenizer

    tokens = ["a", "b", "c", "ab", "abc"]
    fields = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
              "tokenizer.ggml.merges": ["a b"]}
    tok = Tokenizer.from_gguf_fields(fields, "test.gguf")
    assert [tokens[i] for i in tok.encode("abc")] == pieces

# llava-hf/llava-1.5-7b-hf's template, in short: it renders only content *parts* of type text.
PARTS_TEMPLATE = (
    "{% for message in messages %}{{ message['role'].upper() + ': ' }}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ content['text'] + ' ' }}"
    "{% endfor %}{% endfor %}{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)


def test_a_template_that_wants_content_parts_still_gets_the_text(default_checkpoint) -> None:
    from dataclasses import replace

    tok = replace(default_checkpoint.tokenizer, chat_template=PARTS_TEMPLATE)
    text = tok.apply_chat_template([{"role": "system", "content": "Be brief."},
                                    {"role": "user", "content": "What is the capital of France?"}])
    assert text == "SYSTEM: Be brief. USER: What is the capital of France? ASSISTANT:"
    drops = replace(default_checkpoint.tokenizer, chat_template="{% for m in messages %}{{ m['role'] }}{% endfor %}")
    with pytest.raises(LocalLLMError, match="leaves the user's message out"):
        drops.apply_chat_template([{"role": "user", "content": "hello"}])


def test_lone_surrogates_are_refused_by_name(default_checkpoint) -> None:
    tok = default_checkpoint.tokenizer
    with pytest.raises(LocalLLMError, match=r"the prompt holds a lone surrogate \(U\+D800\) at character 1"):
        tok.encode("a\ud800b")
    with pytest.raises(LocalLLMError, match="chat message's content"):
        tok.encode_chat([{"role": "user", "content": "\udcff"}])  # what surrogateescape makes of byte 0xff
