"""Picks the next token of every sequence in the batch with one set of tensor ops.

Order: grammar mask -> penalties -> temperature -> top-k -> top-p -> min-p -> sample. Sampling
is the exponential-race form of Gumbel-max (argmax of p / E, E ~ Exp(1)), which needs no sort and
no CUDA sync; a seeded request draws its E from its own generator, so its tokens do not depend on
what else is in the batch.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from localllm.engine.guided import mask_logits
from localllm.engine.sequence import Sequence

if TYPE_CHECKING:
    from localllm.engine.guided import GrammarMatcher


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[float] | None  # the sampled tokens' logprobs, when any request asked
    top_logprobs: list[dict[int, float]] | None


def _penalize(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    rows = len(seqs)
    vocab = logits.shape[-1]
    device = logits.device
    out_lens = [s.num_output_tokens for s in seqs]
    width = max(max(out_lens), 1)
    # Pad with an extra column index so padding lands outside the vocabulary.
    out_ids = torch.full((rows, width), vocab, dtype=torch.long)
    for r, s in enumerate(seqs):
        if out_lens[r]:
            out_ids[r, : out_lens[r]] = torch.tensor(s.output_token_ids)
    counts = torch.zeros(rows, vocab + 1, device=device)
    counts.scatter_add_(1, out_ids.to(device), torch.ones_like(out_ids, dtype=torch.float, device=device))
    counts = counts[:, :vocab]
    rep = torch.tensor([s.params.repetition_penalty for s in seqs], device=device)[:, None]
    if bool((rep != 1.0).any()):
        seen = counts > 0
        prompt_width = max(s.num_prompt_tokens for s in seqs)
        prompt_ids = torch.full((rows, prompt_width), vocab, dtype=torch.long)
        for r, s in enumerate(seqs):
            prompt_ids[r, : s.num_prompt_tokens] = torch.tensor(s.token_ids[: s.num_prompt_tokens])
        in_prompt = torch.zeros(rows, vocab + 1, dtype=torch.bool, device=device)
        in_prompt.scatter_(1, prompt_ids.to(device), True)
        seen |= in_prompt[:, :vocab]
        penalized = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen, penalized, logits)
    freq = torch.tensor([s.params.frequency_penalty for s in seqs], device=device)[:, None]
    pres = torch.tensor([s.params.presence_penalty for s in seqs], device=device)[:, None]
    return logits - freq * counts - pres * (counts > 0).float()


def sample(
    logits: torch.Tensor, seqs: list[Sequence], grammars: Seq[GrammarMatcher | None] = ()
) -> SamplerOutput:
    """logits: [len(seqs), vocab] fp32, row i for seqs[i]; ``grammars[i]``, when given, is row
    i's grammar (None: free text). ``logits`` is not modified."""
    params = [s.params for s in seqs]
    want_logprobs = any(p.logprobs is not None for p in params)
    raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None  # the model's, as vLLM reports
    logits = mask_logits(logits, grammars)  # structured output: only what each grammar allows next

    if all(p.greedy and not p.has_penalties for p in params):
        token_ids = logits.argmax(dim=-1)
    else:
        if any(p.has_penalties for p in params):
            logits = _penalize(logits, seqs)
        device = logits.device
        temps = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params], device=device)
        logits = logits / temps[:, None]
        vocab = logits.shape[-1]
        # top_k <= 0 (off) or >= the vocabulary keeps every token, so k - 1 is always a valid column.
        top_ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        if any(k < vocab for k in top_ks):
            k = torch.tensor(top_ks, device=device)
            kth = logits.sort(dim=-1, descending=True).values.gather(1, (k - 1)[:, None])
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = logits.softmax(dim=-1)
        top_ps = torch.tensor([p.top_p for p in params], device=device)
        if bool((top_ps < 1.0).any()):
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            # Keep the smallest set whose mass reaches top_p (the top token always survives).
            drop = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_ps[:, None]
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(1, order, sorted_probs)
        min_ps = torch.tensor([p.min_p for p in params], device=device)
        if bool((min_ps > 0).any()):
            probs = probs.masked_fill(probs < min_ps[:, None] * probs.max(dim=-1, keepdim=True).values, 0.0)
        noise = torch.empty_like(probs).exponential_()
        for r, s in enumerate(seqs):
            if s.generator is not None:
                noise[r] = torch.empty(probs.shape[-1]).exponential_(generator=s.generator).to(device)
        token_ids = (probs / noise).argmax(dim=-1)
        greedy_rows = [r for r, p in enumerate(params) if p.greedy]
        if greedy_rows:
            token_ids[greedy_rows] = probs[greedy_rows].argmax(dim=-1)

    ids = token_ids.tolist()
    if raw_logprobs is None:
        return SamplerOutput(ids, None, None)
    chosen = raw_logprobs.gather(1, token_ids[:, None]).squeeze(1).tolist()
    n_top = min(max(p.logprobs or 0 for p in params), raw_logprobs.shape[-1])
    tops: list[dict[int, float]] = []
    if n_top:
        values, indices = raw_logprobs.topk(n_top, dim=-1)
        for r, p in enumerate(params):
            k = p.logprobs or 0
            tops.append(dict(zip(indices[r, :k].tolist(), values[r, :k].tolist())))
    else:
        tops = [{} for _ in params]
    return SamplerOutput(ids, chosen, tops)
