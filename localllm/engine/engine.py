"""The synchronous engine: requests in, one ``step()`` at a time, outputs out.

``LLMEngine`` owns tokenization, the scheduler, the block manager and the model runner; it is
driven by ``LLM.generate`` directly, and by ``AsyncEngine``'s background thread for the TUI and
the server. It never blocks on a consumer.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable, Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

import torch

from localllm.engine.block_manager import BlockManager
from localllm.engine.guided import GrammarCompiler
from localllm.engine.model_runner import ModelRunner
from localllm.engine.scheduler import Scheduler
from localllm.engine.sequence import RequestMetrics, SamplingParams, Sequence, SequenceStatus, choice_seed
from localllm.errors import LocalLLMError
from localllm.tokenizer import IncrementalDetokenizer, Message

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
    decode_buckets: list[int] | None = None  # rehearse the CUDA-graph bookkeeping eagerly (tests)
    kv_cache_dtype: str = "auto"  # auto | fp8 | fp8_e4m3 (vLLM's names); auto = the plan's
    calculate_kv_scales: bool = False  # FP8 cache: scales from a calibration prompt, not 1.0


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None
    stop_reason: str | int | None = None
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int
    metrics: RequestMetrics


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

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, progress: Callable[[str, int, int], None] | None = None):
        from localllm.models.loader import load_model
        from localllm.engine.sampling_defaults import sampling_defaults

        self.config = config = config or EngineConfig()
        loaded = load_model(
            config.model, dtype=config.dtype, device=config.device, quant=config.quant,
            max_model_len=config.max_model_len, context=config.context, chats=config.chats,
            num_kv_blocks=config.num_kv_blocks, block_size=config.block_size,
            gpu_memory_utilization=config.gpu_memory_utilization, kv_cache_dtype=config.kv_cache_dtype,
            progress=progress, compile=self._compiles(config),
        )
        self.model_name = loaded.name
        self.tokenizer = loaded.tokenizer
        self.plan = loaded.plan
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
        self.block_manager = BlockManager(loaded.num_kv_blocks, config.block_size, config.enable_prefix_caching)
        self.runner = ModelRunner(
            loaded.model, loaded.num_kv_blocks, config.block_size, loaded.kv_dtype, loaded.max_model_len,
            use_cuda_graphs=config.use_cuda_graphs and loaded.use_cuda_graphs,
            max_graph_batch=config.max_num_seqs or self.plan.max_num_seqs,
            compile_cpu=self._compiles(config),
            decode_buckets=config.decode_buckets, progress=progress, kv_scales=self.kv_scales,
        )
        self.scheduler = Scheduler(
            self.block_manager,
            config.max_num_batched_tokens or self.plan.max_num_batched_tokens,
            config.max_num_seqs or self.plan.max_num_seqs,
        )
        self.guided = GrammarCompiler(self.tokenizer, loaded.model.config.vocab_size)
        self.requests: dict[str, Sequence] = {}
        self._prompt_text: dict[str, str | None] = {}
        self._ids = itertools.count()
        self._last_step = 0.0
        self._last_batch = (0, 0)
        self._tok_rate = 0.0
        self._hit_tokens = 0
        self._prompt_tokens = 0
        self._max_batch = 0

    @staticmethod
    def _compiles(config: EngineConfig) -> bool:
        """Whether a CPU engine compiles its decode step (the planner sizes memory for it)."""
        return config.compile and os.environ.get("LOCALLLM_NO_COMPILE", "0") in ("", "0")

    # ---- requests ----

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
        limit = min(self.max_model_len, self.block_manager.num_blocks * self.block_manager.block_size)
        if len(ids) >= limit:
            raise LocalLLMError(
                f"the prompt is {len(ids)} tokens but the context limit is {limit}; "
                "shorten it or start with a larger --max-model-len"
            )
        grammar = self.guided.matcher(params) if params.guided else None  # a cache hit from AsyncEngine
        seq = Sequence(
            request_id, ids, params, IncrementalDetokenizer(self.tokenizer),
            () if params.ignore_eos else self.tokenizer.eos_token_ids, limit, grammar=grammar,
        )
        self._prompt_text[request_id] = text
        self.requests[request_id] = seq
        self.scheduler.add(seq)
        return request_id

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Frees the request's blocks at once; returns its final (partial) output."""
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return None
        self.scheduler.finish(seq)
        seq.finish_reason = "abort"
        seq.metrics.finished_time = time.monotonic()
        return self._output(seq, [], "")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the step ----

    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        if not batch.seqs:
            return []
        t0 = time.monotonic()
        sampled_seqs, sampled = self.runner.execute(batch)
        now = time.monotonic()
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = t0
                self._hit_tokens += max(seq.num_cached_tokens, 0)
                self._prompt_tokens += seq.num_prompt_tokens
            seq.num_computed_tokens += n
            self.block_manager.cache_full_blocks(seq)
        outputs = []
        if sampled is not None:
            for i, seq in enumerate(sampled_seqs):
                outputs.append(self._append_token(seq, sampled.token_ids[i], sampled, i, now))
        self._last_step = now - t0
        self._last_batch = (len(batch.seqs), batch.num_tokens)
        self._max_batch = max(self._max_batch, len(batch.seqs))
        rate = len(sampled_seqs) / max(self._last_step, 1e-9)
        self._tok_rate = rate if self._tok_rate == 0 else 0.8 * self._tok_rate + 0.2 * rate
        return outputs

    def _append_token(self, seq: Sequence, token: int, sampled: Any, row: int, now: float) -> RequestOutput:
        m = seq.metrics
        if m.first_token_time is None:
            m.first_token_time = now
        elif m.last_token_time is not None:
            m.inter_token_latencies.append(now - m.last_token_time)
        m.last_token_time = now
        seq.token_ids.append(token)
        grammar_done = seq.grammar is not None and seq.grammar.accept(token)
        if sampled.logprobs is not None:
            seq.cumulative_logprob += sampled.logprobs[row]
            if seq.params.logprobs is not None:
                top = dict(sampled.top_logprobs[row])
                top.setdefault(token, sampled.logprobs[row])
                seq.logprobs.append(top)
        params = seq.params
        stopped_on_token = token in seq.eos_token_ids or token in params.stop_token_ids
        if stopped_on_token:
            seq.finish_reason = "stop"
            seq.stop_reason = None if token in seq.eos_token_ids else token
        else:
            seq.output_text += seq.detokenizer.add([token])
            if params.stop:
                self._check_stop_strings(seq)
        if seq.finish_reason is None:
            if grammar_done:  # the grammar is complete: nothing but EOS could follow
                seq.finish_reason = "stop"
            elif params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens:
                seq.finish_reason = "length"
            elif seq.num_tokens >= seq.max_model_len:
                seq.finish_reason = "length"
        finished = seq.finish_reason is not None
        if finished:
            self.scheduler.finish(seq)
            self.requests.pop(seq.request_id, None)
            m.finished_time = now
        # Hold back text that may be the start of a stop string still being generated.
        hold = 0 if finished or not params.stop else max(len(s) for s in params.stop) - 1
        end = max(seq.num_emitted_chars, len(seq.output_text) - hold)
        delta = seq.output_text[seq.num_emitted_chars : end]
        seq.num_emitted_chars = end
        return self._output(seq, [token], delta)

    @staticmethod
    def _check_stop_strings(seq: Sequence) -> None:
        assert isinstance(seq.params.stop, list)
        longest = max(len(s) for s in seq.params.stop)
        window_start = max(0, seq.num_emitted_chars - longest)
        best = -1
        for s in seq.params.stop:
            at = seq.output_text.find(s, window_start)
            if at != -1 and (best == -1 or at < best):
                best, seq.stop_reason = at, s
        if best != -1:
            seq.output_text = seq.output_text[:best]
            seq.finish_reason = "stop"

    def _output(self, seq: Sequence, new_ids: list[int], delta: str) -> RequestOutput:
        completion = CompletionOutput(
            index=0,
            text=seq.output_text,
            token_ids=seq.output_token_ids,
            cumulative_logprob=seq.cumulative_logprob if seq.params.logprobs is not None else None,
            logprobs=seq.logprobs if seq.params.logprobs is not None else None,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            delta_text=delta,
            delta_token_ids=new_ids,
        )
        prompt = self._prompt_text.pop(seq.request_id, None) if seq.finish_reason else self._prompt_text.get(seq.request_id)
        return RequestOutput(
            seq.request_id, prompt, seq.token_ids[: seq.num_prompt_tokens], [completion],
            seq.finish_reason is not None, max(seq.num_cached_tokens, 0), seq.metrics,
        )

    # ---- metrics ----

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
        )

    def generate(
        self, prompts: Seq[Prompt], params: SamplingParams | Seq[SamplingParams] | None = None,
        on_output: Callable[[RequestOutput], None] | None = None,
    ) -> list[RequestOutput]:
        """Runs prompts to completion; results in prompt order. ``n > 1`` becomes n requests
        that share the prompt (and so its KV, through the prefix cache)."""
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
                    sub = p if p.n == 1 else _replace(p, n=1, seed=choice_seed(p.seed, i))
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
        results = []
        for group in ids:
            first = final[group[0]]
            outs = [final[r].outputs[0] for r in group]
            for i, o in enumerate(outs):
                o.index = i
            results.append(RequestOutput(first.request_id, first.prompt, first.prompt_token_ids, outs,
                                         True, first.num_cached_tokens, first.metrics))
        return results


def _replace(p: SamplingParams, **changes: Any) -> SamplingParams:
    values = {f: getattr(p, f) for f in SamplingParams.__dataclass_fields__}
    values.update(changes)
    return SamplingParams(**values)


__all__ = [
    "CompletionOutput", "EngineConfig", "EngineStats", "LLMEngine", "RequestOutput", "SamplingParams",
    "SequenceStatus",
]
