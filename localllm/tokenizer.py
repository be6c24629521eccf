"""Tokenizer, chat template and incremental detokenizer.

Built either from an HF folder (tokenizer.json, tokenizer_config.json, generation_config.json)
or from a GGUF file's vocabulary: byte-level BPE (``tokenizer.ggml.model = "gpt2"``) from its
merges, SentencePiece (``"llama"``) from its scores, so both loads of the same model give the
same ids.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2 import Template, TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from localllm import harmony
from localllm.errors import LocalLLMError

Message = dict[str, Any]  # role and content, plus tool_calls / tool_call_id in tool conversations

# Used only when a model ships no template at all: ChatML where the vocabulary has its tokens,
# else plain "Role: text" turns, which any model can at least continue.
CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
PLAIN_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] | capitalize }}: {{ message['content'] + '\n\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)

# gpt-oss's harmony format: what a template that speaks it writes, the tokens that end a reply
# (the answer's <|return|>, a tool call's <|call|>) and the one that ends a message but not the
# reply (the reasoning's <|end|>; an eos that names it is dropped).
HARMONY_HEADER = "<|channel|>"
HARMONY_STOPS = ("<|return|>", "<|call|>")
HARMONY_MESSAGE_ENDS = ("<|end|>",)

# The variables the renderer sets itself; chat_template_kwargs may not replace them.
TEMPLATE_VARIABLES = frozenset({"messages", "add_generation_prompt", "tools", "bos_token", "eos_token",
                             "raise_exception", "strftime_now"})

# GGUF token types (llama.cpp's llama_token_type, gguf.TokenType); 5 is unused.
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _BYTE = 1, 2, 3, 4, 6
_SPACE = "\u2581"  # SentencePiece's visible space

# llama.cpp's pre-tokenizer names -> the split regex HF uses for that model family.
_GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# gpt-oss's o200k_harmony (tiktoken's o200k_base split; llama.cpp's "gpt-4o")
_O200K_REGEX = "|".join([
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}", r" ?[^\s\p{L}\p{N}]+[\r\n/]*", r"\s*[\r\n]+", r"\s+(?!\S)", r"\s+",
])
_QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _gguf_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre == "smollm":
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    if pre in ("llama-bpe", "llama3", "smaug-bpe"):
        split = pre_tokenizers.Split(Regex(_LLAMA3_REGEX), behavior="isolated")
        return pre_tokenizers.Sequence([split, byte_level])
    if pre in ("qwen2", "deepseek-r1-qwen"):
        split = pre_tokenizers.Split(Regex(_QWEN2_REGEX), behavior="isolated")
        return pre_tokenizers.Sequence([split, byte_level])
    if pre == "gpt-4o":
        split = pre_tokenizers.Split(Regex(_O200K_REGEX), behavior="isolated")
        return pre_tokenizers.Sequence([split, byte_level])
    if pre in ("gpt2", "gpt-2", "default", ""):
        return pre_tokenizers.ByteLevel(add_prefix_space=False)
    raise LocalLLMError(f"GGUF pre-tokenizer {pre!r} is not supported (smollm, gpt2, llama-bpe, qwen2, gpt-4o)")


def _gguf_bpe(tokens: list[str], fields: dict[str, Any]) -> HFTokenizer:
    """Byte-level BPE from the GGUF's merges (``tokenizer.ggml.model = "gpt2"``)."""
    merges = [tuple(m.split(" ", 1)) for m in fields["tokenizer.ggml.merges"]]
    vocab = {t: i for i, t in enumerate(tokens)}
    pre = fields.get("tokenizer.ggml.pre", "gpt2")
    # Llama 3's tokenizer emits a pre-token that is itself in the vocabulary without merging
    # (HF's ignore_merges, llama.cpp's too): some such tokens no merge sequence reaches.
    ignore_merges = pre in ("llama-bpe", "llama3", "gpt-4o")  # tiktoken's rule too
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False,
                                     ignore_merges=ignore_merges))
    backend.pre_tokenizer = _gguf_pre_tokenizer(pre)
    backend.decoder = decoders.ByteLevel()
    return backend


def _gguf_spm(tokens: list[str], scores: list[float], types: list[int], add_space_prefix: bool) -> HFTokenizer:
    """A SentencePiece vocabulary (``tokenizer.ggml.model = "llama"``) as a ``tokenizers`` model
    whose ids equal the ``sentencepiece`` library's.

    SentencePiece's BPE encoder starts from characters and repeatedly merges the adjacent pair
    whose concatenation is a normal piece with the highest score (leftmost on a tie); HF's BPE
    merges the pair of lowest rank (leftmost on a tie), so ranking every split of every normal
    piece by that piece's score reproduces it. Its BPE trainer scores the i-th piece -i, so
    whole-number scores mean a BPE model; a unigram model's scores are log-probabilities and
    its encoder is a Viterbi search, which HF's Unigram model runs on the same scores. (llama.cpp
    applies the BPE rule to both; for a unigram model that departs from the ids it was trained on.)

    Text is not normalized beyond SentencePiece's escaping (GGUF does not record a normalization
    rule; Llama-family models use none): spaces become U+2581 and, with ``add_space_prefix``,
    each stretch of text between special tokens gets one in front, as llama.cpp does (and HF's
    LlamaTokenizerFast in its legacy mode). Characters outside the vocabulary fall back to
    ``<0xNN>`` byte tokens.
    """
    normal = [i for i, t in enumerate(types) if t == _NORMAL]
    unk_id = next((i for i, t in enumerate(types) if t == _UNKNOWN), None)
    byte_fallback = _BYTE in types
    if all(float(scores[i]).is_integer() for i in normal):
        vocab: dict[str, int] = {}
        for i, token in enumerate(tokens):
            vocab.setdefault(token, i)
        # Only normal pieces are merge results and operands: control, byte and unused pieces are
        # never formed from text. Equal scores (a vocabulary without them) fall back to id order.
        mergeable = {tokens[i] for i in normal}
        merges = [
            (piece[:k], piece[k:])
            for piece in (tokens[i] for i in sorted(normal, key=lambda i: (-scores[i], i)))
            for k in range(1, len(piece))
            if piece[:k] in mergeable and piece[k:] in mergeable
        ]
        unk = tokens[unk_id] if unk_id is not None else None
        model: models.Model = models.BPE(
            vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=byte_fallback
        )
    else:
        model = models.Unigram(list(zip(tokens, map(float, scores))), unk_id=unk_id, byte_fallback=byte_fallback)
    backend = HFTokenizer(model)
    steps: list[decoders.Decoder] = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        backend.normalizer = normalizers.Sequence([normalizers.Prepend(_SPACE), normalizers.Replace(" ", _SPACE)])
        steps.append(decoders.Strip(" ", 1, 0))  # the prefix space is not part of the text
    else:
        backend.normalizer = normalizers.Replace(" ", _SPACE)
    backend.decoder = decoders.Sequence(steps)
    return backend

_SURROGATE = re.compile("[\ud800-\udfff]")


def lone_surrogate(text: str) -> int | None:
    """Where ``text`` holds a lone UTF-16 surrogate (JSON's ``"\\ud800"``, or undecodable bytes
    under Python's surrogateescape), or None. Such a string has no UTF-8 form: the tokenizer
    cannot encode it, and no reply can contain it."""
    m = _SURROGATE.search(text)
    return None if m is None else m.start()


def check_text(text: str, what: str) -> None:
    """Refuses text the tokenizer cannot encode, with a message naming ``what``."""
    if (at := lone_surrogate(text)) is not None:
        raise LocalLLMError(f"{what} holds a lone surrogate (U+{ord(text[at]):04X}) at character {at}, which is "
                            "not valid Unicode text; send UTF-8 text")


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@dataclass(slots=True)
class Tokenizer:
    """Invariant: ``eos_token_ids`` holds every id that ends a reply (eos plus e.g. <|im_end|>)."""

    backend: HFTokenizer
    chat_template: str | None
    bos_token: str | None
    eos_token: str | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    add_bos: bool
    add_eos: bool = False
    _template: Template | None = field(default=None, repr=False, init=False)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        check_text(text, "the prompt")
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            if not ids or ids[0] != self.bos_token_id:
                ids = [self.bos_token_id, *ids]
        eos_id = self.backend.token_to_id(self.eos_token) if self.add_eos and self.eos_token else None
        if add_special_tokens and eos_id is not None and (not ids or ids[-1] != eos_id):
            ids = [*ids, eos_id]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def is_special_token(self, text: str) -> bool:
        """Whether ``text`` is one token that decoding with ``skip_special_tokens`` drops."""
        return self.special_token_id(text) is not None

    def special_token_id(self, text: str) -> int | None:
        """The id of ``text`` where it is one special token (``is_special_token``), else None."""
        tid = self.backend.token_to_id(text)
        if tid is None:
            return None
        added = self.backend.get_added_tokens_decoder().get(tid)
        return tid if added is not None and added.special else None

    @property
    def speaks_harmony(self) -> bool:
        """Whether chats are gpt-oss's harmony messages (localllm/harmony.py renders them)."""
        return _speaks_harmony(self.backend, self.chat_template)

    @property
    def supports_tools(self) -> bool:
        """Whether the chat template reads a ``tools`` variable, which is how HF hands it the
        tool list; a template without one cannot tell the model about tools. Harmony (gpt-oss)
        conversations are rendered with their tools by localllm/harmony.py, template or not."""
        if self.speaks_harmony:
            return True
        from jinja2 import TemplateSyntaxError, meta

        try:
            ast = ImmutableSandboxedEnvironment().parse(self.chat_template or self._fallback_template())
        except TemplateSyntaxError:
            return False
        return "tools" in meta.find_undeclared_variables(ast)

    def apply_chat_template(
        self, messages: Sequence[Message], add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None, template_kwargs: Mapping[str, object] | None = None,
    ) -> str:
        """Renders in a sandbox: a template is code shipped by whoever published the model.
        ``tools`` (OpenAI's shape) reach the template as HF passes them; ``template_kwargs``
        (vLLM's ``chat_template_kwargs``: ``enable_thinking``, ``reasoning_effort``...) as
        further variables, which a template that does not read them ignores. An assistant
        message's ``reasoning_content`` reaches the template under that name and as
        ``thinking`` (gpt-oss's name): the template decides whether earlier reasoning goes
        back into the prompt (Qwen3's and gpt-oss's leave it out of past turns)."""
        extra = dict(template_kwargs or {})
        reserved = sorted(set(extra) & TEMPLATE_VARIABLES)
        if reserved:
            raise LocalLLMError(f"chat template variable {reserved[0]!r} is set by localllm itself; "
                                "leave it out of chat_template_kwargs")
        if self._template is None:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(
                x, indent=indent, ensure_ascii=ensure_ascii
            )
            env.globals["raise_exception"] = _raise_exception
            env.globals["strftime_now"] = _strftime_now
            self._template = env.from_string(self.chat_template or self._fallback_template())
        for m in messages:
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise LocalLLMError(f"chat message {m!r} needs 'role' and 'content'")
            for key, value in m.items():
                if isinstance(value, str):
                    check_text(value, f"a chat message's {key}")
        messages = [{**m, "thinking": m["reasoning_content"]}
                    if isinstance(m.get("reasoning_content"), str) and "thinking" not in m else m for m in messages]
        if self.speaks_harmony and harmony.renders(messages):
            # as openai-harmony renders it (vLLM's prompt), not the shipped template (localllm/harmony.py)
            return harmony.render(messages, add_generation_prompt, extra, tools=tools)
        rendered = self._render(messages, add_generation_prompt, tools, extra)
        last = next((m["content"].strip() for m in reversed(messages)
                     if m["role"] == "user" and isinstance(m["content"], str) and m["content"].strip()), None)
        if last is None or last in rendered:
            return rendered
        # Multimodal templates loop over content parts, and a string has none: they render
        # without the text. The same conversation as text parts is what they expect.
        parts = [{**m, "content": [{"type": "text", "text": m["content"]}]} if isinstance(m["content"], str) else m
                 for m in messages]
        rendered = self._render(parts, add_generation_prompt, tools, extra)
        if last not in rendered:
            raise LocalLLMError("the model's chat template leaves the user's message out of the prompt; "
                                "send a raw prompt instead (--raw, or /v1/completions)")
        return rendered

    def _render(
        self, messages: list[Any], add_generation_prompt: bool, tools: list[dict[str, Any]] | None,
        extra: dict[str, object],
    ) -> str:
        try:
            return self._template.render(
                **extra,
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except TemplateError as e:
            raise LocalLLMError(f"the model's chat template rejected the conversation: {e}") from e

    def encode_chat(
        self, messages: Sequence[Message], add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None, template_kwargs: Mapping[str, object] | None = None,
    ) -> list[int]:
        return self.encode_rendered(self.apply_chat_template(messages, add_generation_prompt, tools, template_kwargs))

    def encode_rendered(self, text: str) -> list[int]:
        """Ids of a rendered chat prompt. Most templates write the BOS token themselves; one that
        does not (TinyLlama's, the plain fallback) gets it here when the model adds one, as
        llama.cpp does and as such models were fine-tuned. Never an EOS: the reply comes next."""
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if self.add_bos and self.bos_token_id is not None and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id, *ids]
        return ids

    @property
    def template_note(self) -> str | None:
        """Set when the model ships no chat template, saying what renders chats instead."""
        if self.chat_template:
            return None
        if self.speaks_harmony:
            return "the model ships no chat template; chats use gpt-oss's harmony format, which its vocabulary has tokens for"
        if self._fallback_template() is CHATML_TEMPLATE:
            return "the model ships no chat template; chats use ChatML, which its vocabulary has tokens for"
        return ("the model ships no chat template; chats use plain 'User: ...' / 'Assistant:' turns, which it "
                "may not follow (for a plain completion: `localllm run --raw`, or /v1/completions)")

    def _fallback_template(self) -> str:
        chatml = all(self.backend.token_to_id(t) is not None for t in ("<|im_start|>", "<|im_end|>"))
        return CHATML_TEMPLATE if chatml else PLAIN_TEMPLATE

    # ---- construction ----

    @classmethod
    def from_hf_dir(cls, path: Path) -> Tokenizer:
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise LocalLLMError(f"{tok_file}: missing; an HF model folder needs tokenizer.json")
        try:
            backend = HFTokenizer.from_file(str(tok_file))
        except Exception as e:
            raise LocalLLMError(f"{tok_file}: cannot be read as a tokenizers file ({e})") from e
        cfg = _read_json(path / "tokenizer_config.json")
        gen = _read_json(path / "generation_config.json")

        def token_text(value: Any) -> str | None:
            return value.get("content") if isinstance(value, dict) else value

        bos, eos = token_text(cfg.get("bos_token")), token_text(cfg.get("eos_token"))
        template = cfg.get("chat_template")
        if isinstance(template, list):  # several named templates: take the default
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if template is None and (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text()
        eos_ids: list[int] = []
        gen_eos = gen.get("eos_token_id")
        eos_ids += gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else []
        if eos is not None and backend.token_to_id(eos) is not None:
            eos_ids.append(backend.token_to_id(eos))
        bos_id = backend.token_to_id(bos) if bos else gen.get("bos_token_id")
        add_bos = bool(cfg.get("add_bos_token", False))
        add_eos = bool(cfg.get("add_eos_token", False))
        return cls._finish(backend, template, bos, eos, bos_id, eos_ids, add_bos, add_eos)

    @classmethod
    def from_gguf_fields(cls, fields: dict[str, Any], source: str) -> Tokenizer:
        """The tokenizer a GGUF file describes. Missing optional keys take llama.cpp's defaults:
        a SentencePiece vocabulary adds BOS, has bos 1 and eos 2, and prefixes a space."""
        model_kind = fields.get("tokenizer.ggml.model")
        tokens: list[str] = fields["tokenizer.ggml.tokens"]
        types: list[int] = fields.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
        if len(types) != len(tokens):
            raise LocalLLMError(f"{source}: GGUF has {len(tokens)} tokens but {len(types)} token types")
        spm = model_kind == "llama"
        if model_kind == "gpt2":
            backend = _gguf_bpe(tokens, fields)
        elif spm:
            scores: list[float] = fields.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
            if len(scores) != len(tokens):
                raise LocalLLMError(f"{source}: GGUF has {len(tokens)} tokens but {len(scores)} token scores")
            backend = _gguf_spm(tokens, scores, types, bool(fields.get("tokenizer.ggml.add_space_prefix", True)))
        else:
            raise LocalLLMError(
                f"{source}: GGUF tokenizer model {model_kind!r} is not supported (gpt2 BPE, llama SentencePiece); "
                "use the model's HF folder instead"
            )
        # Control and unknown tokens (<s>, <|im_end|>) and user-defined ones must match as whole
        # tokens; the first two are special, so decoding a reply skips them.
        added = [AddedToken(tokens[i], special=types[i] != _USER_DEFINED, normalized=False)
                 for i in range(len(tokens)) if types[i] in (_UNKNOWN, _CONTROL, _USER_DEFINED)]
        backend.add_tokens([t for t in added if not t.special])
        backend.add_special_tokens([t for t in added if t.special])

        def token_id(key: str, default: int | None) -> int | None:
            value = fields.get(f"tokenizer.ggml.{key}", default)
            return value if value is not None and 0 <= value < len(tokens) else None

        bos_id = token_id("bos_token_id", 1 if spm else None)
        eos_id = token_id("eos_token_id", 2 if spm else None)
        # End-of-turn and end-of-message tokens end a reply too, as llama.cpp stops on them.
        eos_ids = [i for i in (eos_id, token_id("eot_token_id", None), token_id("eom_token_id", None)) if i is not None]
        bos = tokens[bos_id] if bos_id is not None else None
        eos = tokens[eos_id] if eos_id is not None else None
        add_bos = bool(fields.get("tokenizer.ggml.add_bos_token", spm))
        add_eos = bool(fields.get("tokenizer.ggml.add_eos_token", False))
        return cls._finish(backend, fields.get("tokenizer.chat_template"), bos, eos, bos_id, eos_ids, add_bos, add_eos)

    @classmethod
    def _finish(
        cls,
        backend: HFTokenizer,
        template: str | None,
        bos: str | None,
        eos: str | None,
        bos_id: int | None,
        eos_ids: list[int],
        add_bos: bool,
        add_eos: bool = False,
    ) -> Tokenizer:
        # A chat model's turn terminator also ends the reply, even where the config names only
        # the document eos (SmolLM2's GGUF lists <|endoftext|> but the reply ends with <|im_end|>).
        # Harmony (gpt-oss) is the exception: <|end|> closes each message, the reasoning too, and
        # the reply ends at <|return|> (the answer) or <|call|> (a tool call), as vLLM stops it.
        harmony = _speaks_harmony(backend, template)
        ends = HARMONY_STOPS if harmony else ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")
        if harmony:
            eos_ids = [i for i in eos_ids if backend.id_to_token(i) not in HARMONY_MESSAGE_ENDS]
        for end in ends:
            tid = backend.token_to_id(end)
            if tid is not None and (harmony or template and end in template):
                eos_ids.append(tid)
        return cls(backend, template, bos, eos, bos_id, tuple(dict.fromkeys(eos_ids)), add_bos, add_eos)


def _speaks_harmony(backend: HFTokenizer, template: str | None) -> bool:
    """gpt-oss's format: a template that writes harmony headers, or none and a vocabulary of
    harmony's tokens."""
    if template:
        return HARMONY_HEADER in template
    return all(backend.token_to_id(t) is not None for t in harmony.TOKENS)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise LocalLLMError(f"{path}: not valid JSON ({e})") from e


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Invariant: the concatenation of all deltas equals ``decode(all ids)`` except for a trailing
    incomplete UTF-8 sequence, which is held back (never emitted as U+FFFD) until the bytes that
    complete it arrive. Decoding a small window that starts a few tokens back keeps merged
    pieces (leading spaces, multi-byte characters) intact at a constant cost per token.
    The window never holds more than ``MAX_PENDING`` undecided tokens: a character is at most
    four bytes, so text still incomplete after that many is invalid bytes (or a run of tokens
    that decode to nothing), handed out as it decodes rather than let each token's cost grow.
    """

    __slots__ = ("tokenizer", "ids", "prefix_offset", "read_offset", "skip_special_tokens")
    MAX_PENDING = 8

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        # False keeps control tokens in the text (gpt-oss's <|channel|>: the reasoning parser reads them)
        self.skip_special_tokens = skip_special_tokens

    def add(self, new_ids: Sequence[int]) -> str:
        self.ids.extend(new_ids)
        decode, skip = self.tokenizer.decode, self.skip_special_tokens
        prefix_text = decode(self.ids[self.prefix_offset : self.read_offset], skip)
        new_text = decode(self.ids[self.prefix_offset :], skip)
        complete = len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd")
        if complete or len(self.ids) - self.read_offset > self.MAX_PENDING:
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return new_text[len(prefix_text) :]
        return ""
