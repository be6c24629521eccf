"""A draft model for speculative decoding: a small model of the target's tokenizer, run by the
engine's own thread, that proposes the next k tokens of each decoding sequence.

It keeps a KV cache of its own (``KVCache`` from its own kv spec, through its own
``ModelRunner``) and a mirror of each target sequence it drafts for: the target's tokens, then
the drafts of the last proposal, with a block table of its own pool. Before a proposal the
mirror takes the target's tokens again: its KV stays valid for the common prefix (the tokens
before the proposal and the drafts the target kept), the rest is rolled back
(``BlockManager.trim``) and the new tokens computed with the first draft step (one extend).
So the draft's KV is rolled back with the target's, lazily, at the next proposal.

Which tokens to propose and how many, and what the target keeps, is decided in
``engine/spec_decode.py`` (``choose_k``, ``rejection_sample``); this module only runs the
draft.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from localllm.engine.block_manager import BlockManager
from localllm.engine.model_runner import ModelRunner
from localllm.engine.scheduler import ScheduledBatch
from localllm.engine.sampler import argmax_rows
from localllm.engine.sequence import SamplingParams, Sequence
from localllm.engine.spec_decode import MAX_SPECULATIVE_TOKENS, SpecState
from localllm.errors import LocalLLMError
from localllm.tokenizer import Tokenizer

if TYPE_CHECKING:
    from localllm.hardware.planner import Beside

# how fast the measured draft step time follows the machine's load
COST_WEIGHT = 0.2


def draft_beside(name: str, device: str | None, block_size: int, compile: bool) -> Beside:
    """What the draft ``name`` takes of its target's memory budget, from its own plan (made
    before the target's, on the same device; nothing is loaded): its weights, activations and
    graph pool, and its KV bytes per token, since its pool mirrors every block of the target's.
    The target's plan sizes its KV pool with this taken out (a GPU target took ~90% of the
    card and the draft's mirror of its pool did not fit)."""
    from localllm import store
    from localllm.hardware.planner import Beside
    from localllm.models.formats import open_checkpoint
    from localllm.models.loader import plan_checkpoint

    path = store.resolve(name)
    p = plan_checkpoint(open_checkpoint(path), path, name, device=device, chats=1, block_size=block_size,
                        compile=compile)
    return Beside(p.model, p.weight_bytes + p.workspace_bytes + p.runtime_bytes, p.kv_bytes_per_token)


class DraftModel:
    """Implements ``spec_decode.DraftProposer``. ``mirrors``: per target request id, the
    draft's sequence (its tokens: the target's, then the last proposal's drafts;
    ``num_computed_tokens``: the tokens whose KV its pool holds). Writer: the engine thread,
    through ``propose`` and ``release``."""

    def __init__(
        self, name: str, tokenizer: Tokenizer, vocab_size: int, *, num_blocks: int, block_size: int,
        max_model_len: int, dtype: str, device: str | None, max_num_seqs: int, compile: bool,
        compile_in_background: bool = True, decode_buckets: list[int] | None = None,
        progress: Callable[[str, int, int], None] | None = None,
    ) -> None:
        """Loads the draft ``name`` (a path or id, as for the target) with a pool of
        ``num_blocks`` blocks: as many as the target's, so every sequence the target holds
        fits. Raises ``LocalLLMError`` when its tokenizer is not the target's."""
        from localllm import store
        from localllm.models.formats import open_checkpoint
        from localllm.models.loader import load_model

        ckpt = open_checkpoint(store.resolve(name))  # its metadata: refused before its weights load
        mismatch = _vocab_mismatch(tokenizer, ckpt.tokenizer, vocab_size, ckpt.config.vocab_size)
        if mismatch is not None:
            raise LocalLLMError(f"draft model {name}: {mismatch}; a draft model must have the target's "
                                "tokenizer (the same family, e.g. a smaller model of it)")
        loaded = load_model(name, dtype=dtype, device=device, max_model_len=max_model_len,
                            num_kv_blocks=num_blocks, block_size=block_size, progress=progress, compile=compile)
        self.name = loaded.name
        self.block_manager = BlockManager(loaded.num_kv_blocks, block_size, enable_prefix_caching=False)
        self.runner = ModelRunner(
            loaded.model, loaded.num_kv_blocks, block_size, loaded.kv_dtype, loaded.max_model_len,
            max_graph_batch=max_num_seqs, compile_cpu=compile and loaded.device.type == "cpu",
            compile_in_background=compile_in_background, decode_buckets=decode_buckets, progress=progress,
        )
        self.mirrors: dict[str, Sequence] = {}
        self._times: dict[int, float] = {}

    # ---- DraftProposer ----

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in seqs]
        active: list[int] = []
        for i, (seq, k) in enumerate(zip(seqs, ks)):
            if k > 0 and seq.spec is not None and self._sync(seq, k):
                active.append(i)
        if not active:
            return out
        mirrors = [self.mirrors[seqs[i].request_id] for i in active]
        probs: list[list[torch.Tensor]] = [[] for _ in active]
        for step in range(max(ks[i] for i in active)):
            live = [j for j, i in enumerate(active) if step < ks[i]]
            # a first proposal prefills the prompt into the draft's pool: not what a step costs
            prefill = any(mirrors[j].num_tokens - mirrors[j].num_computed_tokens > MAX_SPECULATIVE_TOKENS + 1
                          for j in live)
            t0 = time.monotonic()
            logits = self._forward([mirrors[j] for j in live])
            for row, j in enumerate(live):
                seq, m = seqs[active[j]], mirrors[j]
                token, q = _draw(logits[row], seq)
                out[active[j]].append(token)
                if q is not None:
                    probs[j].append(q)
                m.token_ids.append(token)
            if not prefill:  # the first step also computes the tokens the target kept: rows of the same step
                self._observe(len(live), time.monotonic() - t0)
        for j, i in enumerate(active):
            m = mirrors[j]
            # the last draft's KV is not computed (nothing follows it): the mirror's tokens end there
            m.num_computed_tokens = m.num_tokens - 1
            spec = seqs[i].spec
            assert spec is not None
            spec.draft_probs = torch.stack(probs[j]) if probs[j] else None
        return out

    def release(self, seq: Sequence) -> None:
        m = self.mirrors.pop(seq.request_id, None)
        if m is not None:
            self.block_manager.free(m)

    def step_cost(self, rows: int) -> float | None:
        t = self._times
        if not t:
            return None
        return t.get(rows, t[min(t, key=lambda r: abs(r - rows))])

    # ---- the mirror ----

    def _sync(self, seq: Sequence, k: int) -> bool:
        """Makes ``seq``'s mirror hold its tokens, rolls the mirror's KV back to the tokens it
        still shares with them, and takes blocks for the ``k`` draft steps. False (no
        proposal this step) where the pool has no room."""
        m = self.mirrors.get(seq.request_id)
        if m is None:
            m = self.mirrors[seq.request_id] = Sequence(
                f"draft:{seq.request_id}", [], SamplingParams(max_tokens=1), (), seq.max_model_len)
        tokens, mine = seq.token_ids, m.token_ids
        # at least the target's last token is computed again: its logits give the first draft
        common = min(self._common(mine, tokens, m.num_computed_tokens), len(tokens) - 1)
        m.num_computed_tokens = common
        self.block_manager.trim(m, common)
        del mine[common:]
        mine.extend(tokens[common:])
        # the draft steps compute the new tokens and k - 1 drafts (the last one only comes out)
        if not self.block_manager.allocate(m, m.num_tokens + k - 1):
            return False
        return True

    @staticmethod
    def _common(mine: list[int], tokens: list[int], limit: int) -> int:
        """How many leading tokens the two lists share, at most ``limit``: the tokens before the
        last proposal are the target's by construction, so only its drafts are compared."""
        n = min(limit, len(mine), len(tokens))
        start = max(0, n - MAX_COMPARED)
        if mine[:start] != tokens[:start]:  # never expected: the mirror only ever takes the target's tokens
            start = 0
        for j in range(start, n):
            if mine[j] != tokens[j]:
                return j
        return n

    def _forward(self, mirrors: list[Sequence]) -> torch.Tensor:
        """One draft step: each mirror computes its tokens past ``num_computed_tokens`` (one for
        a draft step, more at a proposal's first), and the logits after its last token come
        back, a row per mirror in order. A few new tokens run as the target's verify steps
        do (decode rows over one block table, so through the compiled decode step); a long run
        of them (a new prompt) as a prompt chunk."""
        counts = [m.num_tokens - m.num_computed_tokens for m in mirrors]
        kind = [0 if c == 1 else 1 if c <= MAX_SPECULATIVE_TOKENS + 1 else 2 for c in counts]
        order = sorted(range(len(mirrors)), key=lambda i: kind[i])  # the runner's order: decodes first
        held: list[list[int]] = []
        for i in order:
            m = mirrors[i]
            extra: list[int] = []
            if kind[i] == 1:  # the tokens after the first ride as "proposals": a row each
                extra = m.token_ids[m.num_computed_tokens + 1 :]
                del m.token_ids[m.num_computed_tokens + 1 :]
                m.spec = SpecState(None, drafts=extra)
            held.append(extra)
        batch = ScheduledBatch([mirrors[i] for i in order], [counts[i] for i in order],
                               sum(1 for k in kind if k == 0), [])
        try:
            _, logits = self.runner.execute(batch)
        finally:
            for i, extra in zip(order, held):
                m = mirrors[i]
                if m.spec is not None:
                    m.token_ids.extend(extra)
                    m.spec = None
        assert logits is not None
        for m, n in zip(mirrors, counts):
            m.num_computed_tokens += n
        # a decode or prompt chunk yields one row, a multi-row one a row per token: its last
        ends = list(itertools.accumulate(counts[i] if kind[i] == 1 else 1 for i in order))
        rows = torch.empty(len(mirrors), dtype=torch.int64)
        rows[torch.tensor(order)] = torch.tensor(ends) - 1
        return logits.float()[rows]

    def _observe(self, rows: int, seconds: float) -> None:
        old = self._times.get(rows)
        self._times[rows] = seconds if old is None else old + COST_WEIGHT * (seconds - old)


# drafts compared at a re-sync (the most a step proposes, with room to spare)
MAX_COMPARED = 64


def _draw(logits: torch.Tensor, seq: Sequence) -> tuple[int, torch.Tensor | None]:
    """A draft token for ``seq`` from the draft's logits: the argmax for a greedy request,
    else a draw from softmax(logits / temperature), whose distribution comes back (the q the
    target's rejection sampling needs; any q keeps the output exact, a closer one keeps more)."""
    params = seq.params
    if params.greedy:
        return int(argmax_rows(logits[None])[0]), None
    q = torch.softmax(logits.double() / params.temperature, dim=-1)
    token = int(torch.multinomial(q, 1, generator=seq.generator).item())
    return token, q


def _vocab_mismatch(target: Tokenizer, draft: Tokenizer, target_vocab: int, draft_vocab: int) -> str | None:
    """Why the draft's tokens are not the target's (None: they are): token ids must mean the
    same text, and the logits cover the same ids."""
    if draft_vocab != target_vocab:
        return f"its vocabulary has {draft_vocab} tokens, the target's {target_vocab}"
    mine, theirs = draft.backend.get_vocab(with_added_tokens=True), target.backend.get_vocab(with_added_tokens=True)
    if mine != theirs:
        differ = sorted(set(mine.items()) ^ set(theirs.items()), key=lambda item: item[1])
        return f"its tokenizer differs from the target's ({len(differ)} token ids differ)"
    if draft.eos_token_ids != target.eos_token_ids:
        return "its end-of-sequence tokens differ from the target's"
    return None


__all__ = ["DraftModel"]
