"""Which tokens run in the next forward pass.

One rule, as in vLLM v1: every sequence has tokens it still has to compute
(``num_tokens - num_computed_tokens``); a step hands out up to ``max_num_batched_tokens`` of
them. Running sequences (mostly decodes, one token each) are served first, then waiting ones,
whose prompts are chunked to what the budget leaves. So a long prompt never stalls the decodes
of other chats, and prefill and decode share one forward pass; beside running decodes, prompt
chunks also get only what keeps the step within its limit by a cost model fitted to step times
(``step_budget``: the cost grows with a chunk's position in its prompt), so that every step of
a long prefill costs about the same and the running chats' gaps stay bounded.

The scheduler is the one writer of a sequence's progress: ``schedule`` admits and preempts,
``update`` (after the forward pass) advances ``num_computed_tokens``, registers newly full
blocks in the prefix cache, appends sampled tokens and finishes sequences on eos, a stop
token or a length limit; ``finish`` ends one for any other reason (a stop string, an abort,
an error). Finishing frees the blocks at once.

Speculative decoding (``engine/spec_decode.py``), when configured: after the running decodes
are placed, each may take k proposed tokens from an n-gram lookup in its own tokens or from
the draft model (``drafter``, run here: proposals are part of the schedule) (k from
its measured acceptance and the measured cost of extra rows, 0 in batches above
``disable_by_batch_size`` sequences, counting the waiting ones that have a slot, never at the
cost of a preemption); ``append`` then takes the tokens the verification kept one at a time,
counting as computed only the positions of accepted tokens, and ``end_verify`` gives back the
blocks past them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import NamedTuple, Protocol

from localllm.engine.block_manager import BlockManager
from localllm.engine.sequence import Sequence, SequenceStatus
from localllm.engine.spec_decode import (
    PRIOR_DRAFT_ACCEPTANCE, PRIOR_DRAFT_COST, NgramIndex, SpecCosts, SpecState, SpeculativeConfig, choose_k, is_eligible,
)
from localllm.engine.step_budget import PrefillBudget


class ScheduledBatch(NamedTuple):
    """``seqs[i]`` computes ``num_new_tokens[i]`` tokens; decodes (one token) come first, then
    speculative decodes (``1 + len(seq.spec_token_ids)`` tokens: the last token and the
    proposals), then prompt chunks. ``block_copies``: (source, destination) KV blocks to copy
    before the forward pass (the partial-block prefix hits of newly admitted sequences)."""

    seqs: list[Sequence]
    num_new_tokens: list[int]
    num_decodes: int
    preempted: list[Sequence]
    block_copies: tuple[tuple[int, int], ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def num_draft_tokens(self) -> int:
        return sum(len(s.spec_token_ids) for s in self.seqs)

    @property
    def num_speculative(self) -> int:
        """Speculative decodes: the sequences after the ``num_decodes`` plain ones that verify
        proposals."""
        return sum(1 for s in self.seqs if s.spec_token_ids)


class DraftProposer(Protocol):
    """What the scheduler sees of a draft model (``engine/draft_model.py``): it keeps a KV
    cache of its own that mirrors the target's sequences."""

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        """Up to ``ks[i]`` tokens after ``seqs[i]``'s tokens (fewer where its pool is full), drawn
        greedily for greedy requests, else sampled with the distributions kept in
        ``seq.spec.draft_probs``."""
        ...

    def release(self, seq: Sequence) -> None:
        """Frees the draft KV mirroring ``seq`` (it finished or was preempted)."""
        ...

    def step_cost(self, rows: int) -> float | None:
        """Seconds one draft step of ``rows`` sequences takes, measured; None before."""
        ...


class Scheduler:
    def __init__(
        self, block_manager: BlockManager, max_num_batched_tokens: int, max_num_seqs: int,
        speculative: SpeculativeConfig | None = None,
    ) -> None:
        self.block_manager = block_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # prompt tokens a step may take beside decodes, from the engine's step times
        self.prefill_budget = PrefillBudget()
        self.speculative = speculative
        self.spec_costs = SpecCosts()  # written by the engine after each decode-only step
        self.drafter: DraftProposer | None = None  # the draft model (method "draft_model"), set by the engine

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        budget = self.max_num_batched_tokens
        chosen: list[tuple[Sequence, int]] = []
        preempted: list[Sequence] = []
        copies: list[tuple[int, int]] = []

        # beside running decodes, prompt chunks take what the measured cost of a step allows
        prompts = self.prefill_budget
        prompts.begin(sum(1 for s in self.running if s.num_tokens - s.num_computed_tokens == 1))

        # running first: decodes and the remaining chunks of partly prefilled prompts
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            remaining = seq.num_tokens - seq.num_computed_tokens
            n = min(remaining, budget) if remaining == 1 else prompts.fit(seq.num_computed_tokens, remaining, budget)
            if n == 0:  # a prompt chunk with no room left this step: it waits for the next
                i += 1
                continue
            while not self.block_manager.allocate(seq, seq.num_computed_tokens + n):
                victim = self.running.pop()  # the newest request gives way
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break
            chosen.append((seq, n))
            budget -= n
            if remaining > 1:
                prompts.take(seq.num_computed_tokens, n)
            i += 1

        budget -= self._propose(chosen, budget)

        # then waiting requests, first come first served, while blocks and budget allow; two or
        # more short prompts waiting are a burst, admitted whole (``PrefillBudget.fit_burst``)
        short = prompts.burst_tokens
        burst = sum(1 for s in self.waiting if s.num_tokens - s.num_computed_tokens <= short) >= 2
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not preempted:
            seq = self.waiting[0]
            prefix = self.block_manager.match_prefix(seq)
            want = seq.num_tokens - prefix.num_tokens
            n = prompts.fit_burst(prefix.num_tokens, want, budget) if burst else 0
            n = n or prompts.fit(prefix.num_tokens, want, budget)
            if n == 0 or not self.block_manager.allocate(seq, prefix.num_tokens + n, prefix):
                break
            self.waiting.popleft()
            if prefix.copy_from >= 0:
                # the source may be handed out again in this very step: the copy runs first
                copies.append((prefix.copy_from, seq.block_table[len(prefix.block_ids)]))
            seq.num_computed_tokens = prefix.num_tokens
            if seq.num_cached_tokens < 0:
                seq.num_cached_tokens = prefix.num_tokens
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            chosen.append((seq, n))
            budget -= n
            prompts.take(prefix.num_tokens, n)

        # stable: decodes first, then speculative decodes, then prompt chunks, order kept
        chosen.sort(key=lambda item: 0 if item[1] == 1 else 1 if item[0].spec_token_ids else 2)
        num_decodes = sum(1 for _, n in chosen if n == 1)
        return ScheduledBatch([s for s, _ in chosen], [n for _, n in chosen], num_decodes, preempted, tuple(copies))

    def _propose(self, chosen: list[tuple[Sequence, int]], budget: int) -> int:
        """Proposals for the decodes in ``chosen`` (n-gram lookup in each one's own tokens),
        as many as ``choose_k`` finds worth their cost, the blocks and ``budget`` allow; their
        entries in ``chosen`` grow by them. Returns the tokens added."""
        for seq, _ in chosen:
            if seq.spec is not None:
                seq.spec.drafts = []
        config = self.speculative
        if config is None or self._batch_size() > config.disable_by_batch_size:
            return 0  # a large batch: its steps are compute-bound (the index catches up later)
        decodes = [i for i, (seq, n) in enumerate(chosen) if n == 1 and seq.num_computed_tokens == seq.num_tokens - 1]
        if not decodes:
            return 0
        if config.method == "draft_model":
            return self._propose_drafts(chosen, decodes, budget, config)
        proposals: list[list[int]] = []
        for i in decodes:
            seq = chosen[i][0]
            proposal = self._shadow(seq, config)
            proposals.append(proposal[: self._room(seq, config.num_speculative_tokens)])
        states = [chosen[i][0].spec for i in decodes]
        ks = choose_k([s.acceptance if s is not None else 0.0 for s in states],
                      [len(p) for p in proposals], self.spec_costs)
        added = 0
        for i, proposal, k in zip(decodes, proposals, ks):
            seq = chosen[i][0]
            k = min(k, budget - added)
            if k <= 0 or seq.spec is None:
                continue
            if not self.block_manager.allocate(seq, seq.num_tokens + k):
                continue  # no blocks to spare for speculation: a plain decode, nobody preempted
            seq.spec.drafts = proposal[:k]
            seq.spec.shadow = None  # verified, not watched
            chosen[i] = (seq, 1 + k)
            added += k
        return added

    def _batch_size(self) -> int:
        """The sequences the batch holds for ``disable_by_batch_size``: the running ones and the
        waiting ones that have a slot (vLLM counts enqueued requests). Counting the running ones
        alone let the first request of a burst verify proposals in the very step the rest joined
        (the bench's 16 streams: 1 running, 15 waiting)."""
        return min(len(self.running) + len(self.waiting), self.max_num_seqs)

    def _propose_drafts(self, chosen: list[tuple[Sequence, int]], decodes: list[int], budget: int,
                        config: SpeculativeConfig) -> int:
        """``_propose`` with a draft model: k first (``choose_k``, the draft's measured step
        counted in), then the draft runs for the sequences that take some. A sequence that
        takes none makes no proposal, so it has no shadow to check: its measured acceptance
        drifts back toward the prior (``SpecState.drift``) and it tries again later."""
        drafter = self.drafter
        if drafter is None:
            return 0
        seqs = [chosen[i][0] for i in decodes]
        for seq in seqs:
            if seq.spec is None and is_eligible(seq.params.guided, seq.params.has_penalties):
                seq.spec = SpecState(None, acceptance=PRIOR_DRAFT_ACCEPTANCE, prior=PRIOR_DRAFT_ACCEPTANCE)
        n = len(seqs)
        draft_s, plain_s = drafter.step_cost(n), self.spec_costs.time(n)
        draft_cost = draft_s / plain_s if draft_s is not None and plain_s else PRIOR_DRAFT_COST
        ks = choose_k([s.spec.acceptance if s.spec is not None else 0.0 for s in seqs],
                      [self._room(s, config.num_speculative_tokens) if s.spec is not None else 0 for s in seqs],
                      self.spec_costs, draft_cost)
        added = 0
        for j, seq in enumerate(seqs):
            ks[j] = min(ks[j], budget - added)
            if ks[j] > 0 and not self.block_manager.allocate(seq, seq.num_tokens + ks[j]):
                ks[j] = 0  # no blocks to spare for speculation: a plain decode, nobody preempted
            added += max(ks[j], 0)
        proposals = drafter.propose(seqs, [max(k, 0) for k in ks]) if any(k > 0 for k in ks) else [[] for _ in seqs]
        added = 0
        for i, seq, proposal in zip(decodes, seqs, proposals):
            if seq.spec is None:
                continue
            if not proposal:
                seq.spec.drift()
                seq.spec.draft_probs = None
                self.block_manager.trim(seq, seq.num_tokens)  # blocks taken for drafts the pool could not make
                continue
            seq.spec.drafts = proposal
            chosen[i] = (seq, 1 + len(proposal))
            added += len(proposal)
        return added

    def _shadow(self, seq: Sequence, config: SpeculativeConfig) -> list[int]:
        """The sequence's proposal for this step (its spec state made on first use), noted as
        the shadow guess that ``update`` checks against the token that comes."""
        if seq.spec is None:
            if not is_eligible(seq.params.guided, seq.params.has_penalties):
                return []
            seq.spec = SpecState(NgramIndex(config.prompt_lookup_min, config.prompt_lookup_max))
        elif seq.spec.index is None:  # it drafted with a model until the method changed
            seq.spec.index = NgramIndex(config.prompt_lookup_min, config.prompt_lookup_max)
        proposal = seq.spec.index.propose(seq.token_ids, config.num_speculative_tokens)
        seq.spec.shadow = proposal[0] if proposal else None
        return proposal

    @staticmethod
    def _room(seq: Sequence, k: int) -> int:
        """Drafts the sequence may verify: a step yields up to k + 1 tokens, which must stay
        within ``max_tokens`` and the context limit."""
        left = seq.max_model_len - seq.num_tokens
        if seq.params.max_tokens is not None:
            left = min(left, seq.params.max_tokens - seq.num_output_tokens)
        return max(0, min(k, left - 1))

    def _preempt(self, seq: Sequence) -> None:
        """Recompute-style preemption: drop the KV, keep the tokens, requeue at the front.
        The freed blocks stay in the prefix cache, so the recompute is mostly cache hits."""
        self.block_manager.free(seq)
        if self.drafter is not None:
            self.drafter.release(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def update(self, batch: ScheduledBatch, sampled: Iterable[tuple[Sequence, int]]) -> None:
        """After ``batch``'s forward pass: every scheduled token is computed, and each sequence
        in ``sampled`` gets its new token. A sequence that hits eos, one of its stop token ids,
        ``max_tokens`` or its context limit is finished here (and its blocks freed).

        A speculative decode's progress is not counted here: only ``append`` knows which of
        its positions were accepted."""
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            if seq.spec_token_ids:
                continue
            seq.num_computed_tokens += n
            self.block_manager.cache_full_blocks(seq)
        for seq, token in sampled:
            self.append(seq, token)

    def append(self, seq: Sequence, token: int) -> None:
        """Appends one sampled token to ``seq`` and finishes it on eos, a stop token id,
        ``max_tokens`` or its context limit. For a speculative decode (called once per token
        it yields, in order, until it finishes), every token before the new one is then
        computed: the last token and the accepted proposals."""
        spec = seq.spec
        if spec is not None and spec.drafts:
            seq.num_computed_tokens = seq.num_tokens  # the tokens before this one
            self.block_manager.cache_full_blocks(seq)
        elif spec is not None and spec.shadow is not None:
            spec.observe(token == spec.shadow)
            spec.shadow = None
        seq.token_ids.append(token)
        params = seq.params
        if token in seq.eos_token_ids:
            self.finish(seq, "stop")
        elif token in (params.stop_token_ids or ()):
            self.finish(seq, "stop", token)
        elif (params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens
              or seq.num_tokens >= seq.max_model_len):
            self.finish(seq, "length")

    def end_verify(self, seq: Sequence, accepted: int) -> None:
        """After a speculative decode's tokens were appended: ``accepted`` of its proposals
        were kept. Records the acceptance and gives back the blocks past its tokens."""
        spec = seq.spec
        assert spec is not None and spec.drafts
        spec.record(len(spec.drafts), accepted)
        spec.drafts = []
        spec.draft_probs = None
        if not seq.finished:
            self.block_manager.trim(seq, seq.num_tokens)

    def finish(self, seq: Sequence, reason: str, stop_reason: str | int | None = None) -> None:
        """Ends ``seq`` for ``reason`` and frees its blocks at once. Finishing a finished
        sequence again only replaces the reason: a stop string found in the text of the token
        that also reached ``max_tokens`` makes it "stop", not "length"."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        if self.drafter is not None:
            self.drafter.release(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason, seq.stop_reason = reason, stop_reason
