"""The Python API, with vLLM's names: ``LLM`` and ``SamplingParams``.

    from localllm import LLM, SamplingParams
    llm = LLM()                                   # the embedded default model
    out = llm.generate(["The sky is"], SamplingParams(max_tokens=20))
    print(out[0].outputs[0].text)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from localllm.engine.engine import (
    CompletionOutput,
    EngineConfig,
    LLMEngine,
    Prompt,
    RequestOutput,
)
from localllm.engine.sequence import SamplingParams
from localllm.tokenizer import Message

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]


class LLM:
    """Offline batched generation on the same engine the TUI and server use."""

    def __init__(
        self,
        model: str | None = None,
        *,
        progress: Callable[[str, int, int], None] | None = None,
        **engine_options: Any,
    ) -> None:
        """``engine_options`` are ``EngineConfig`` fields: dtype, device, quant, max_model_len,
        max_num_seqs, max_num_batched_tokens, block_size, num_kv_blocks, enable_prefix_caching,
        gpu_memory_utilization, use_cuda_graphs, kv_cache_dtype ("auto", "fp8"/"fp8_e4m3") and
        calculate_kv_scales (FP8 scales from a calibration prompt instead of 1.0)."""
        self.engine = LLMEngine(EngineConfig(model=model, **engine_options), progress)

    @property
    def tokenizer(self):  # noqa: ANN201 - localllm.tokenizer.Tokenizer
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """The model's sampling defaults (generation_config.json or its models.toml entry) over
        SamplingParams' own: what ``generate`` and ``chat`` use when given no params."""
        return SamplingParams(**self.engine.sampling_defaults)

    def _params(
        self, given: SamplingParams | Sequence[SamplingParams] | None
    ) -> SamplingParams | Sequence[SamplingParams]:
        return self.get_default_sampling_params() if given is None else given

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[list[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Text prompts are raw completions (no chat template); token-id lists go in as is."""
        if isinstance(prompts, str):
            prompts = [prompts]
        return self.engine.generate(list(prompts), self._params(sampling_params))

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """One conversation (a list of messages) or several; the chat template is applied."""
        if messages and isinstance(messages[0], dict):
            conversations: list[Prompt] = [list(messages)]  # type: ignore[list-item]
        else:
            conversations = [list(c) for c in messages]  # type: ignore[arg-type]
        return self.engine.generate(conversations, self._params(sampling_params))
