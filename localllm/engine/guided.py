"""Structured output: a grammar per request, applied as a token bitmask in the batched sampler.

A request asks for one through ``SamplingParams`` (vLLM's names): ``guided_json`` (a JSON
schema), ``guided_regex``, ``guided_choice`` (one of a list of strings) or ``guided_grammar``
(a Lark grammar in llguidance's dialect, which can embed JSON schemas with ``%json``; the
server's forced tool calls use it). ``GrammarCompiler`` turns each distinct spec into a
compiled llguidance matcher once and caches it; every request gets its own copy
(``GrammarMatcher``), which advances with each token the engine accepts.

In a step, ``mask_logits`` fills one bitmask row per constrained request in a single
parallel call (llguidance drops the GIL), unpacks it and applies it to the logits with one
``masked_fill``; free requests in the same step get an all-ones row, so constrained and free
requests share one forward pass and one sampler call.

Why llguidance rather than xgrammar: it reads our ``tokenizers`` tokenizer (HF or built from a
GGUF vocab) directly from its JSON, where xgrammar's tokenizer import pulls in ``transformers``;
it has no dependencies; and its Lark dialect embeds JSON schemas, which the tool-call grammars
need. vLLM and llama.cpp use it.

Invariants: a matcher only ever sees tokens its own mask allowed (the sampler applies the mask
before choosing); once a matcher is complete or in error, its mask allows only EOS, and
``accept`` reports it so the engine ends the request. Mask rows past the tokenizer's vocabulary
(a model whose embedding is padded beyond it) are always 0.
"""

from __future__ import annotations

import json
import os
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from localllm.errors import LocalLLMError

if TYPE_CHECKING:
    from collections.abc import Sequence as Seq

    import llguidance

    from localllm.engine.sequence import SamplingParams
    from localllm.tokenizer import Tokenizer

# JSON is written the way json.dumps writes it: bounded whitespace, so a weak model cannot
# spend its tokens on blanks, and the shape chat templates use when they print tool calls.
# A schema's own "x-guidance" options override these.
JSON_DEFAULTS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CACHE_SIZE = 128


class GrammarError(LocalLLMError):
    """A grammar, schema or regex that the grammar engine cannot compile."""


def grammar_spec(params: SamplingParams) -> tuple[str, str] | None:
    """The request's grammar as (kind, canonical text), the cache key; None for free text."""
    if params.guided_json is not None:
        schema = params.guided_json
        if isinstance(schema, str):
            schema = json.loads(schema)  # SamplingParams checked that it parses
        # not sort_keys: property order is the order the output is written in
        return "json", json.dumps(schema, ensure_ascii=False)
    if params.guided_regex is not None:
        return "regex", params.guided_regex
    if params.guided_choice is not None:
        return "choice", json.dumps(list(params.guided_choice), ensure_ascii=False)
    if params.guided_grammar is not None:
        return "grammar", params.guided_grammar
    return None


def _llg_grammar(kind: str, text: str) -> str:
    import llguidance

    if kind == "json":
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(text, defaults=JSON_DEFAULTS)  # type: ignore[arg-type]
        except ValueError as e:
            raise GrammarError(f"the JSON schema cannot be compiled: {e}") from None
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(text)
    if kind == "choice":
        choices = json.loads(text)
        return llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices))
    return llguidance.LLMatcher.grammar_from_lark(text)


def _one_line(error: str) -> str:
    """llguidance's first line, plus the ``error:`` line of a multi-line regex report."""
    lines = [line.strip() for line in error.splitlines() if line.strip()]
    if not lines:
        return "unknown error"
    detail = next((line for line in lines[1:] if line.startswith("error:")), None)
    return lines[0] if detail is None else f"{lines[0].removesuffix(':')} ({detail})"


_WHAT = {"json": "the JSON schema", "regex": "the regex", "choice": "guided_choice", "grammar": "the grammar"}


class GrammarMatcher:
    """One request's position in its grammar. Written only by the engine thread (``accept``)
    and read by the sampler on the same thread."""

    __slots__ = ("matcher", "words", "error")

    def __init__(self, matcher: llguidance.LLMatcher, words: int) -> None:
        self.matcher = matcher
        self.words = words  # int32 words per bitmask row
        self.error: str | None = None

    def accept(self, token: int) -> bool:
        """Advances past ``token``; True when the grammar allows nothing more (it is complete,
        or the token broke it, which only a bypassed mask can cause)."""
        m = self.matcher
        if not m.consume_token(token) and self.error is None:
            self.error = m.get_error()
        return m.is_stopped() or m.is_error()

    @property
    def is_accepting(self) -> bool:
        return self.matcher.is_accepting()


class GrammarCompiler:
    """Compiles and caches grammars for one tokenizer. Thread-safe: the server compiles on
    worker threads (``asyncio.to_thread``) so the engine thread only ever finds a cache hit."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        # the logits' width: the model's vocabulary, which may be padded past the tokenizer's
        self.vocab_size = max(vocab_size, tokenizer.vocab_size)
        self._llg_tokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[tuple[str, str], llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def words(self) -> int:
        return (self.vocab_size + 31) // 32

    def _tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._llg_tokenizer is None:  # about 1 s for a 50k vocabulary: once per engine
                import llguidance

                self._llg_tokenizer = llguidance.LLTokenizer(
                    self.tokenizer.backend.to_str(), n_vocab=self.vocab_size,
                    eos_token=list(self.tokenizer.eos_token_ids) or None,
                )
            return self._llg_tokenizer

    def warm(self) -> None:
        """Builds llguidance's tokenizer now. Its constructor holds the GIL throughout (measured:
        0.8-0.9 s of a 0.9 s build for a 49k vocabulary), so a server calls this before it takes
        requests: built by the first structured request, it stalled every running stream."""
        self._tokenizer()

    def compile(self, params: SamplingParams) -> llguidance.LLMatcher | None:
        """The compiled template for ``params``' grammar (None without one); raises
        ``GrammarError`` with the grammar engine's reason when it cannot be compiled."""
        spec = grammar_spec(params)
        if spec is None:
            return None
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                return hit
        import llguidance

        tokenizer = self._tokenizer()
        matcher = llguidance.LLMatcher(tokenizer, _llg_grammar(*spec), log_level=0)
        if matcher.is_error():
            raise GrammarError(f"{_WHAT[spec[0]]} cannot be compiled: {_one_line(matcher.get_error())}")
        with self._lock:
            self._cache[spec] = matcher
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return matcher

    def matcher(self, params: SamplingParams) -> GrammarMatcher | None:
        template = self.compile(params)
        return None if template is None else GrammarMatcher(template.deep_copy(), self.words)


_executor: llguidance.LLExecutor | None = None
_shifts: dict[torch.device, torch.Tensor] = {}


def _llg_executor() -> llguidance.LLExecutor:
    global _executor
    if _executor is None:
        import llguidance

        _executor = llguidance.LLExecutor(max(1, min(os.cpu_count() or 1, 8)))
    return _executor


def mask_logits(logits: torch.Tensor, grammars: Seq[GrammarMatcher | None]) -> torch.Tensor:
    """logits: [rows, vocab], ``grammars[r]`` row r's grammar (None, or a row past the end of
    ``grammars``: free). Constrained rows keep only the tokens their grammar allows next; free
    rows are unchanged. ``logits`` itself is left as it is: when a batch's sampling fails, the
    engine samples its rows again from the same logits."""
    rows = [(g, r) for r, g in enumerate(grammars) if g is not None]
    if not rows:
        return logits
    n = logits.shape[0]
    words = rows[0][0].words
    bitmask = np.full((n, words), -1, dtype=np.int32)
    _llg_executor().unsafe_compute_mask_ptr([(g.matcher, r) for g, r in rows], bitmask.ctypes.data, words * 4, n)
    vocab = logits.shape[-1]
    if logits.device.type == "cpu":
        allowed = unpack_bitmask(bitmask, vocab)
    else:  # ship the packed mask (32x smaller) and unpack on the device
        allowed = unpack_bitmask_torch(torch.from_numpy(bitmask).to(logits.device, non_blocking=True), vocab)
    return logits.masked_fill(allowed.logical_not_(), float("-inf"))


def unpack_bitmask(bitmask: np.ndarray, vocab: int) -> torch.Tensor:
    """[rows, words] int32 (bit j of word w = token 32w + j) -> [rows, vocab] bool; ids past
    the mask's width are never allowed."""
    bits = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, :vocab]
    if bits.shape[1] < vocab:
        bits = np.pad(bits, ((0, 0), (0, vocab - bits.shape[1])))
    return torch.from_numpy(np.ascontiguousarray(bits)).view(torch.bool)


def unpack_bitmask_torch(packed: torch.Tensor, vocab: int) -> torch.Tensor:
    """``unpack_bitmask`` with tensor ops, for a mask already on an accelerator."""
    shifts = _shifts.get(packed.device)
    if shifts is None:
        shifts = _shifts[packed.device] = torch.arange(32, dtype=torch.int32, device=packed.device)
    bits = ((packed[:, :, None] >> shifts) & 1).view(packed.shape[0], -1)[:, :vocab].bool()
    if bits.shape[1] < vocab:
        bits = torch.nn.functional.pad(bits, (0, vocab - bits.shape[1]), value=False)
    return bits
