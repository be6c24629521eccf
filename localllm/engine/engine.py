"""The synchronous engine: requests in, one ``step()`` at a time, outputs out.

``LLMEngine`` owns tokenization, the scheduler, the block manager and the model runner; it is
driven by ``LLM.generate`` directly, and by ``AsyncEngine``'s background thread for the TUI and
the server. It never blocks on a consumer.

A step is one pipeline: ``Scheduler.schedule`` -> ``ModelRunner.execute`` (the forward pass)
-> sampling -> ``Scheduler.update`` (progress, prefix-cache hashing, finishing on tokens) ->
one ``RequestOutput`` per sampled request (detokenizing, stop strings, deltas). A failure in
sampling, detokenizing or a stop check fails only the request it belongs to; a failure of the
forward pass fails the requests of that batch; either way the blocks are freed and the next
step runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence as Seq
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from localllm.engine.block_manager import BlockManager
from localllm.engine.guided import GrammarCompiler
from localllm.engine.model_runner import ModelRunner
from localllm.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput, RequestState, joined
from localllm.engine.batch_invariant import make_batch_invariant
from localllm.engine.sampler import SamplerOutput, sample, skip_uniforms, target_probs, verify_drafts
from localllm.engine.scheduler import Scheduler
from localllm.engine.sequence import SamplingParams, Sequence, SequenceStatus, choice_seed
from localllm.engine.spec_decode import SpeculativeConfig, rejection_sample, speculative_config
from localllm.errors import LocalLLMError
from localllm.kernels import cpu_ops
from localllm.tokenizer import IncrementalDetokenizer, Message

if TYPE_CHECKING:
    from localllm.engine.draft_model import DraftModel
    from localllm.hardware.planner import Plan
    from localllm.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

Prompt = str | list[int] | list[Message]


@dataclass(slots=True)
class EngineConfig:
    model: str | None = None
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str | None = None  # None = cuda when available
    quant: str | None = None  # None = the plan's; "none" forces unquantized
    max_model_len: int | None = None
    context: int | None = None  # the context wanted per chat, for planning
    chats: int = 4  # concurrent chats wanted, for planning
    max_num_seqs: int | None = None  # None = the plan's
    max_num_batched_tokens: int | None = None  # None = the plan's
    block_size: int = 16
    num_kv_blocks: int | None = None  # override the plan (tests force preemption with it)
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.9
    use_cuda_graphs: bool = True
    compile: bool = True  # CPU decode through torch.compile; False (or LOCALLLM_NO_COMPILE=1) keeps eager
    # graphs missing from disk are built on a thread while the eager path answers; False: now
    compile_in_background: bool = True
    decode_buckets: list[int] | None = None  # rehearse the CUDA-graph bookkeeping eagerly (tests)
    kv_cache_dtype: str = "auto"  # auto | fp8 | fp8_e4m3 (vLLM's names); auto = the plan's
    calculate_kv_scales: bool = False  # FP8 cache: scales from a calibration prompt, not 1.0
    # the same tokens for a prompt alone or in any batch (engine/batch_invariant.py); decodes eagerly
    deterministic: bool = False
    # speculative decoding, vLLM's dict: {"method": "ngram", "num_speculative_tokens": 5,
    # "prompt_lookup_max": 4} or {"method": "draft_model", "model": ..., "num_speculative_tokens": 4}
    # (engine/spec_decode.py); None: off
    speculative_config: SpeculativeConfig | dict[str, int | str] | str | None = None


@dataclass(slots=True)
class EngineStats:
    model: str
    precision: str
    device: str
    num_running: int
    num_waiting: int
    batch_size: int  # sequences in the last step
    batch_tokens: int
    kv_blocks_total: int
    kv_blocks_used: int
    kv_blocks_cached: int  # free but still holding reusable prefix KV
    step_time_s: float
    generation_tokens_per_s: float
    num_preemptions: int
    prefix_cache_hit_tokens: int
    prompt_tokens: int
    max_batch_size_seen: int
    # most KV blocks held at once, and most sequences in a step, since the start or the last
    # ``reset_peaks`` (a step shorter than a poll still counts)
    kv_blocks_peak: int = 0
    batch_size_peak: int = 0
    compiling: bool = False  # the decode step is being optimized in the background (eager meanwhile)
    # the compiled decode step is not in use yet: being loaded from disk or built (eager meanwhile)
    preparing: bool = False
    # speculative decoding (vLLM's counters): verify steps, tokens proposed in them, kept
    spec_method: str | None = None  # None: off
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0

    @property
    def spec_acceptance_rate(self) -> float:
        """Share of proposed tokens kept."""
        return self.spec_num_accepted_tokens / self.spec_num_draft_tokens if self.spec_num_draft_tokens else 0.0

    @property
    def spec_mean_acceptance_length(self) -> float:
        """Tokens a verify step yielded on average (vLLM's "mean acceptance length")."""
        return 1.0 + self.spec_num_accepted_tokens / self.spec_num_drafts if self.spec_num_drafts else 0.0

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, progress: Callable[[str, int, int], None] | None = None):
        from localllm.models.loader import load_model
        from localllm.engine.sampling_defaults import sampling_defaults

        self.config = config = config or EngineConfig()
        # a bad speculative_config fails before the model loads
        self.speculative: SpeculativeConfig | None = speculative_config(config.speculative_config)
        # a draft model's share of the memory budget comes out before the target's KV pool is sized
        beside = None
        if self.speculative is not None and self.speculative.method == "draft_model":
            from localllm.engine.draft_model import draft_beside

            assert self.speculative.model is not None
            beside = draft_beside(self.speculative.model, config.device, config.block_size, self._compiles(config))
        loaded = load_model(
            config.model, dtype=config.dtype, device=config.device, quant=config.quant,
            max_model_len=config.max_model_len, context=config.context, chats=config.chats,
            num_kv_blocks=config.num_kv_blocks, block_size=config.block_size,
            gpu_memory_utilization=config.gpu_memory_utilization, kv_cache_dtype=config.kv_cache_dtype,
            progress=progress, compile=self._compiles(config), beside=beside,
        )
        self.model_name = loaded.name
        self.tokenizer: Tokenizer = loaded.tokenizer
        self.plan: Plan = loaded.plan
        self.load_notes: tuple[str, ...] = loaded.notes  # loading's decisions beyond the plan
        self.precision = loaded.precision
        self.device = loaded.device
        self.max_model_len = loaded.max_model_len
        # What the model asks for when a caller leaves a sampling field unset: only the keys the
        # model sets, by SamplingParams name (run, LLM.generate, the server and the TUI read it).
        self.sampling_defaults: dict[str, float | int] = sampling_defaults(loaded.path, loaded.name)
        self.kv_cache_dtype = loaded.kv_dtype
        # (k_scale, v_scale) per layer of an FP8 cache; None = 1.0 each, or not FP8.
        self.kv_scales: list[tuple[float, float]] | None = None
        if config.calculate_kv_scales and loaded.kv_dtype == torch.float8_e4m3fn:
            from localllm.quant.kv_cache import calibrate_kv_scales, calibration_prompt

            if progress is not None:
                progress("calibrating KV scales", 0, 1)
            self.kv_scales = calibrate_kv_scales(loaded.model, calibration_prompt(loaded.tokenizer))
            if progress is not None:
                progress("calibrating KV scales", 1, 1)
        if config.deterministic:
            make_batch_invariant(loaded.model, loaded.device.type, loaded.precision)
        self.block_manager = BlockManager(loaded.num_kv_blocks, config.block_size, config.enable_prefix_caching)
        self.runner = ModelRunner(
            loaded.model, loaded.num_kv_blocks, config.block_size, loaded.kv_dtype, loaded.max_model_len,
            use_cuda_graphs=config.use_cuda_graphs and loaded.use_cuda_graphs,
            max_graph_batch=self._graph_batch(config),
            compile_cpu=self._compiles(config),
            decode_buckets=config.decode_buckets, progress=progress, kv_scales=self.kv_scales,
            compile_in_background=config.compile_in_background,
        )
        self.scheduler = Scheduler(
            self.block_manager,
            config.max_num_batched_tokens or self.plan.max_num_batched_tokens,
            config.max_num_seqs or self.plan.max_num_seqs,
            speculative=self.speculative,
        )
        # the draft model (speculative method "draft_model"), made once and kept when switched off
        self.drafter: DraftModel | None = None
        if self.speculative is not None and self.speculative.method == "draft_model":
            self._load_drafter(self.speculative, progress)
        self.guided = GrammarCompiler(self.tokenizer, loaded.model.config.vocab_size)
        self.requests: dict[str, RequestState] = {}  # live requests only: a finished one leaves at once
        self._ids = itertools.count()
        self._last_step = 0.0
        self._last_batch = (0, 0)
        self._tok_rate = 0.0
        self._hit_tokens = 0
        self._prompt_tokens = 0
        self._max_batch = 0
        self._kv_peak = self._batch_peak = 0
        self._spec_counts = [0, 0, 0]  # verify steps, proposed tokens, accepted tokens

    def _graph_batch(self, config: EngineConfig) -> int:
        """The largest decode step the static-buffer path (CUDA graphs, the compiled CPU step)
        must hold: a batch of decodes, or a speculating batch's verify rows, which can be more
        (4 sequences of 1 + 5 rows each are 24): a step past the largest bucket runs eager."""
        seqs = config.max_num_seqs or self.plan.max_num_seqs
        return max(seqs, self.speculative.max_verify_rows(seqs)) if self.speculative is not None else seqs

    def _load_drafter(self, spec: SpeculativeConfig, progress: Callable[[str, int, int], None] | None = None) -> None:
        """Loads ``spec.model`` as the draft model, on the target's device with a pool of as
        many blocks (it mirrors every sequence), in its own plan's precision (a GGUF draft
        keeps its blocks: a draft is there to be fast); refused when its tokenizer differs."""
        from localllm.engine.draft_model import DraftModel

        assert spec.model is not None
        config = self.config
        self.drafter = DraftModel(
            spec.model, self.tokenizer, self.runner.model.config.vocab_size,
            num_blocks=self.block_manager.num_blocks, block_size=config.block_size, max_model_len=self.max_model_len,
            # the draft's own plan (dtype auto): its fastest, not the target's precision
            dtype="auto", device=str(self.device), max_num_seqs=self.scheduler.max_num_seqs,
            compile=self._compiles(config), compile_in_background=config.compile_in_background,
            decode_buckets=config.decode_buckets, progress=progress,
        )
        self.scheduler.drafter = self.drafter

    @staticmethod
    def _compiles(config: EngineConfig) -> bool:
        """Whether a CPU engine compiles its decode step (the planner sizes memory for it)."""
        # Inductor compiles C++ on CPU: without a compiler, eager at once (cpu_ops says so in one line)
        return (config.compile and not config.deterministic
                and os.environ.get("LOCALLLM_NO_COMPILE", "0") in ("", "0") and cpu_ops.can_compile())

    # ---- requests ----

    @property
    def context_limit(self) -> int:
        """Tokens one sequence may hold: the model's limit, or the whole KV pool if smaller."""
        return min(self.max_model_len, self.block_manager.num_blocks * self.block_manager.block_size)

    def encode_prompt(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if prompt and isinstance(prompt[0], dict):
            text = self.tokenizer.apply_chat_template(prompt)  # type: ignore[arg-type]
            return text, self.tokenizer.encode_rendered(text)
        ids = list(prompt)  # type: ignore[arg-type]
        vocab = self.runner.model.config.vocab_size
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids):
            raise LocalLLMError("prompt token ids must be ints inside the vocabulary")
        return None, ids

    def add_request(
        self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None
    ) -> str:
        params = params or SamplingParams()
        params.validate(self.runner.model.config.vocab_size)
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise LocalLLMError(f"request id {request_id!r} is already running")
        text, ids = self.encode_prompt(prompt)
        if not ids:
            raise LocalLLMError("the prompt is empty")
        limit = self.context_limit
        if len(ids) >= limit:
            raise LocalLLMError(
                f"the prompt is {len(ids)} tokens but the context limit is {limit}; "
                "shorten it or start with a larger --max-model-len"
            )
        grammar = self.guided.matcher(params) if params.guided else None  # a cache hit from AsyncEngine
        seq = Sequence(request_id, ids, params, () if params.ignore_eos else self.tokenizer.eos_token_ids, limit)
        self.requests[request_id] = RequestState(
            seq, text, IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens),
            RequestMetrics(time.monotonic()), grammar=grammar)
        self.scheduler.add(seq)
        return request_id

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Frees the request's blocks at once; returns its final (partial) output."""
        state = self.requests.get(request_id)
        if state is None:
            return None
        self.scheduler.finish(state.seq, "abort")
        return self._final(state, time.monotonic(), state.flush())

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the step ----

    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        if not batch.seqs:
            return []
        bm = self.block_manager
        self._kv_peak = max(self._kv_peak, bm.num_blocks - bm.num_free_blocks)
        self._batch_peak = max(self._batch_peak, len(batch.seqs))
        t0 = time.monotonic()
        for seq in batch.seqs:
            m = self.requests[seq.request_id].metrics
            if m.first_scheduled_time is None:
                m.first_scheduled_time = t0
                self._hit_tokens += max(seq.num_cached_tokens, 0)
                self._prompt_tokens += seq.num_prompt_tokens
        try:
            sampling_seqs, logits = self.runner.execute(batch)
        except Exception as e:  # noqa: BLE001 - the batch's requests fail; the engine goes on
            logger.exception("the forward pass failed; failing the %d requests of its batch", len(batch.seqs))
            error = _request_error(e, "the forward pass of its batch")
            outputs = [self._fail(self.requests[s.request_id], error, time.monotonic()) for s in batch.seqs]
            self._record_step(t0, batch.num_tokens, len(batch.seqs), 0)
            return outputs
        # read before the drafts are cleared (Scheduler.end_verify)
        spec_rows = sum(n for s, n in zip(batch.seqs, batch.num_new_tokens) if s.spec_token_ids)
        num_spec = batch.num_speculative
        # an n-gram verify's seeded draws are rewound (``_verify``); a draft model's are its own
        seeded = {s: s.generator.get_state() for s in sampling_seqs
                  if s.spec_token_ids and s.generator is not None and not s.params.greedy
                  and s.spec is not None and s.spec.draft_probs is None}
        sampled, failed = self._sample(sampling_seqs, logits)
        self.scheduler.update(batch, [(seq, out.token_ids[row]) for seq, out, row in sampled
                                      if not seq.spec_token_ids])
        now = time.monotonic()
        outputs = [self._fail(self.requests[seq.request_id], e, now) for seq, e in failed]
        num_sampled = 0
        for seq, out, row in sampled:
            state = self.requests[seq.request_id]
            try:
                if seq.spec_token_ids:
                    output, n = self._verify(state, out, row, now, seeded.get(seq))
                    outputs.append(output)
                    num_sampled += n
                else:
                    outputs.append(self._process(state, out, row, now))
                    num_sampled += 1
            except Exception as e:  # noqa: BLE001 - detokenizing or a stop check failed: this request only
                logger.exception("request %s failed after sampling", seq.request_id)
                outputs.append(self._fail(state, _request_error(e, "detokenizing its token"), now))
        self._record_step(t0, batch.num_tokens, len(batch.seqs), num_sampled)
        elapsed = time.monotonic() - t0
        if batch.num_tokens == batch.num_decodes + spec_rows:
            # decodes only (plain or speculative): what a verify step costs beside a plain one
            self.scheduler.spec_costs.observe(batch.num_tokens, elapsed)
        # a speculative decode is a decode here: its rows stretch the step as decodes do
        self.scheduler.prefill_budget.observe(elapsed, batch.num_tokens - batch.num_decodes - spec_rows,
                                              batch.num_decodes + num_spec)
        return outputs

    def _verify(
        self, state: RequestState, out: SamplerOutput, row: int, now: float, generator_state: torch.Tensor | None,
    ) -> tuple[RequestOutput, int]:
        """A speculative decode's output: the target's draws at rows ``row..row + k`` keep the
        leading proposals equal to them (``verify_drafts``), and each token yielded goes
        through what a plain step's token goes through (``Scheduler.append``, ``_process``:
        finishing on tokens, grammar, text, stop strings) until the request finishes. Returns
        one output carrying them all, and how many there were."""
        seq = state.seq
        drafts = list(seq.spec_token_ids)
        targets = out.token_ids[row : row + len(drafts) + 1]
        accepted = verify_drafts(targets, drafts)
        output: RequestOutput | None = None
        n = 0
        for j in range(accepted + 1):
            self.scheduler.append(seq, targets[j])
            step_output = self._process(state, out, row + j, now)
            output = step_output if output is None else joined(output, step_output)
            n += 1
            if seq.finished:
                break
        if generator_state is not None and seq.generator is not None:
            # keep the draws of the tokens yielded only: the rest are the next step's
            seq.generator.set_state(generator_state)
            skip_uniforms(seq.generator, n)
        if seq.spec is not None and seq.spec.drafts:
            self.scheduler.end_verify(seq, accepted)
        counts = self._spec_counts
        counts[0] += 1
        counts[1] += len(drafts)
        counts[2] += accepted
        assert output is not None
        return output, n

    def _sample(
        self, seqs: list[Sequence], logits: torch.Tensor | None
    ) -> tuple[list[tuple[Sequence, SamplerOutput, int]], list[tuple[Sequence, Exception]]]:
        """One batched sampler call; if it raises, each row again alone, so only the requests
        whose own sampling fails are failed. A seeded request's generator is rewound first,
        so a row sampled alone gets the token it would have had in the batch."""
        if logits is None:
            return [], []
        generators = [(s.generator, s.generator.get_state()) for s in seqs if s.generator is not None]
        grammars = [self.requests[s.request_id].grammar for s in seqs]
        counts = [1 + len(s.spec_token_ids) for s in seqs]  # a speculative decode has a row per position
        starts = list(itertools.accumulate(counts, initial=0))
        with torch.inference_mode():
            try:
                out = sample(logits, [s for s, c in zip(seqs, counts) for _ in range(c)],
                             [g for g, c in zip(grammars, counts) for _ in range(c)])
                for i, s in enumerate(seqs):
                    _reject_drafts(s, out, starts[i], logits[starts[i] : starts[i] + counts[i]])
                return [(s, out, starts[i]) for i, s in enumerate(seqs)], []
            except Exception:  # noqa: BLE001 - find out which rows it was
                logger.exception("batched sampling failed; sampling the %d rows one at a time", len(seqs))
            for g, state in generators:
                g.set_state(state)
            sampled: list[tuple[Sequence, SamplerOutput, int]] = []
            failed: list[tuple[Sequence, Exception]] = []
            for i, s in enumerate(seqs):
                try:
                    c = counts[i]
                    rows = logits[starts[i] : starts[i] + c]
                    out = sample(rows, [s] * c, [grammars[i]] * c)
                    _reject_drafts(s, out, 0, rows)
                    sampled.append((s, out, 0))
                except Exception as e:  # noqa: BLE001 - this request's own failure
                    failed.append((s, _request_error(e, "sampling its token")))
        return sampled, failed

    def _process(self, state: RequestState, out: SamplerOutput, row: int, now: float) -> RequestOutput:
        """The request's output for the token ``Scheduler.update`` just appended."""
        seq = state.seq
        token = seq.token_ids[-1]
        state.metrics.on_token(now)
        grammar_done = state.grammar is not None and state.grammar.accept(token)
        if out.logprobs is not None:
            state.add_logprobs(token, out.logprobs[row], out.top_logprobs[row] if out.top_logprobs else None)
        if seq.finished and seq.finish_reason == "stop":  # eos or a stop token: its text is not shown
            delta = state.flush()
        else:
            if grammar_done:  # the grammar is complete: nothing but EOS could follow (and "stop" beats "length")
                self.scheduler.finish(seq, "stop")
            delta, stop = state.add_text(token)
            if stop is not None:
                self.scheduler.finish(seq, "stop", stop)
        if seq.finished:
            return self._final(state, now, delta, [token])
        return state.output([token], delta)

    def _fail(self, state: RequestState, error: Exception, now: float) -> RequestOutput:
        self.scheduler.finish(state.seq, "error")
        return self._final(state, now, "", error=error)

    def _final(
        self, state: RequestState, now: float, delta: str, delta_ids: Seq[int] = (), error: Exception | None = None
    ) -> RequestOutput:
        self.requests.pop(state.seq.request_id, None)
        state.metrics.finished_time = now
        return state.output(list(delta_ids), delta, error)

    def _record_step(self, t0: float, num_tokens: int, num_seqs: int, num_sampled: int) -> None:
        self._last_step = time.monotonic() - t0
        self._last_batch = (num_seqs, num_tokens)
        self._max_batch = max(self._max_batch, num_seqs)
        rate = num_sampled / max(self._last_step, 1e-9)
        self._tok_rate = rate if self._tok_rate == 0 else 0.8 * self._tok_rate + 0.2 * rate

    # ---- the prefix cache and the pool's blocks, for benchmarks (on the engine's thread) ----

    def set_speculative(self, config: SpeculativeConfig | None) -> SpeculativeConfig | None:
        """Speculative decoding from the next step on with ``config`` (None: off); returns the
        config before. For benchmarks that compare both on one engine; call it on the thread
        that steps."""
        if config is not None and config.method == "draft_model" and self.drafter is None:
            self._load_drafter(config)
        before, self.speculative = self.speculative, config
        self.scheduler.speculative = config
        return before

    def reset_prefix_cache(self) -> None:
        """Forgets the cached prefixes of every free block (vLLM's name); running sequences keep
        theirs. Under ``AsyncEngine``, through ``call``: the block manager is the engine
        thread's."""
        self.block_manager.reset_prefix_cache()

    def set_prefix_caching(self, enabled: bool) -> bool:
        """Turns prefix caching on or off for the requests scheduled from now on (off when the
        engine was built without it); returns the previous setting, to restore."""
        before = self.block_manager.enable_prefix_caching
        self.block_manager.enable_prefix_caching = enabled and self.config.enable_prefix_caching
        return before

    @contextlib.contextmanager
    def borrowed_blocks(self, token_ids: list[int], num_tokens: int) -> Iterator[Sequence]:
        """A sequence of ``token_ids`` whose block table covers ``num_tokens`` tokens of the KV
        pool, its blocks freed (unhashed) on exit: for a loop that drives the runner's model
        directly (the benchmark's plain loop). The engine must be idle, and stays so meanwhile."""
        assert not self.has_unfinished(), "blocks are lent only while no request runs"
        seq = Sequence("borrowed-blocks", list(token_ids), SamplingParams(max_tokens=1), (), num_tokens + 1)
        if not self.block_manager.allocate(seq, num_tokens):
            raise LocalLLMError(f"the KV pool has no room for {num_tokens} tokens")
        try:
            yield seq
        finally:
            self.block_manager.free(seq)

    # ---- metrics ----

    def reset_peaks(self) -> None:
        """Starts ``EngineStats.kv_blocks_peak`` and ``batch_size_peak`` again from now (on the
        engine's thread: the step is their other writer)."""
        bm = self.block_manager
        self._kv_peak, self._batch_peak = bm.num_blocks - bm.num_free_blocks, 0

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            model=self.model_name,
            precision=self.precision,
            device=str(self.device),
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            batch_size=self._last_batch[0] if self.scheduler.has_unfinished() else 0,
            batch_tokens=self._last_batch[1] if self.scheduler.has_unfinished() else 0,
            kv_blocks_total=bm.num_blocks,
            kv_blocks_used=bm.num_blocks - bm.num_free_blocks,
            kv_blocks_cached=bm.num_cached_free_blocks,
            step_time_s=self._last_step,
            generation_tokens_per_s=self._tok_rate if self.scheduler.running else 0.0,
            num_preemptions=self.scheduler.num_preemptions,
            prefix_cache_hit_tokens=self._hit_tokens,
            prompt_tokens=self._prompt_tokens,
            max_batch_size_seen=self._max_batch,
            kv_blocks_peak=self._kv_peak,
            batch_size_peak=self._batch_peak,
            compiling=self.runner.compiling,
            preparing=self.runner.preparing,
            spec_method=self.speculative.method if self.speculative is not None else None,
            spec_num_drafts=self._spec_counts[0],
            spec_num_draft_tokens=self._spec_counts[1],
            spec_num_accepted_tokens=self._spec_counts[2],
        )

    def generate(
        self, prompts: Seq[Prompt], params: SamplingParams | Seq[SamplingParams] | None = None,
        on_output: Callable[[RequestOutput], None] | None = None,
    ) -> list[RequestOutput]:
        """Runs prompts to completion; results in prompt order. ``n > 1`` becomes n requests
        that share the prompt (and so its KV, through the prefix cache). A request that fails
        raises its error once every request has ended."""
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise LocalLLMError(f"{len(prompts)} prompts but {len(params)} sampling params; pass one, or one per prompt")
        ids: list[list[str]] = []
        try:
            for prompt, p in zip(prompts, params):
                ids.append([])
                p.validate()  # n before range(n); add_request checks each choice against the model
                for i in range(p.n):
                    sub = p if p.n == 1 else dataclasses.replace(p, n=1, seed=choice_seed(p.seed, i))
                    ids[-1].append(self.add_request(prompt, sub))
        except BaseException:
            # one bad prompt or parameter refuses the whole call: the ones added before it must
            # not stay queued and run with some later call
            for rid in (r for group in ids for r in group):
                self.abort_request(rid)
            raise
        final: dict[str, RequestOutput] = {}
        while self.has_unfinished():
            for out in self.step():
                if on_output is not None:
                    on_output(out)
                if out.finished:
                    final[out.request_id] = out
        error = next((o.error for o in final.values() if o.error is not None), None)
        if error is not None:
            raise error
        results = []
        for group in ids:
            first = final[group[0]]
            outs: list[CompletionOutput] = [final[r].outputs[0] for r in group]
            for i, o in enumerate(outs):
                o.index = i
            results.append(RequestOutput(first.request_id, first.prompt, first.prompt_token_ids, outs,
                                         True, first.num_cached_tokens, first.metrics))
        return results


def _reject_drafts(seq: Sequence, out: SamplerOutput, row: int, logits: torch.Tensor) -> None:
    """A draft model's sampled proposals (``seq.spec.draft_probs``: the q each was drawn from):
    rows ``row..row + k`` of ``out`` become the tokens ``rejection_sample`` yields (the kept
    drafts, then the target's replacement or its own draw after the last), so that
    ``verify_drafts`` keeps exactly those; their logprobs follow. ``logits``: the target's
    rows of this sequence."""
    spec = seq.spec
    if spec is None or spec.draft_probs is None or not spec.drafts:
        return
    k = len(spec.drafts)
    p = target_probs(logits, [seq] * (k + 1))
    u = torch.rand(2 * k, dtype=torch.float64, generator=seq.generator).tolist()
    tokens, _ = rejection_sample(p, spec.draft_probs.to(p.device), spec.drafts, out.token_ids[row + k], u)
    raw = torch.log_softmax(logits, dim=-1) if out.logprobs is not None else None
    for j, token in enumerate(tokens):
        if out.token_ids[row + j] != token:
            out.token_ids[row + j] = token
            if raw is not None and out.logprobs is not None:
                out.logprobs[row + j] = float(raw[j, token])


def _request_error(e: Exception, stage: str) -> Exception:
    """What a failed request's consumer gets: our own errors as they are (they are written for
    users), anything else named with where it happened."""
    if isinstance(e, LocalLLMError):
        return e
    return RuntimeError(f"request failed in {stage}: {type(e).__name__}: {e}")


__all__ = [
    "CompletionOutput", "EngineConfig", "EngineStats", "LLMEngine", "Prompt", "RequestOutput", "SamplingParams",
    "SequenceStatus",
]
