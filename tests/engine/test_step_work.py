"""A decode step's Python work does not grow with the context or the reply: the real engine
on a tiny random-weight model (no trained model needed; the forward pass is negligible), a
short request against one with a 3,000-token prompt and hundreds of output tokens.

Measured without timing: the bytes the step keeps alive in its outputs, the peak of the
Python objects it allocates on the way, and the ids the detokenizer decodes per token."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

import pytest

from localllm.engine.engine import EngineConfig, LLMEngine, RequestOutput
from localllm.engine.sequence import SamplingParams
from localllm.tokenizer import Tokenizer
from tests.models.test_random_models import write_random_model

STEPS = 8


@pytest.fixture(scope="module")
def engine(tmp_path_factory, default_checkpoint) -> LLMEngine:
    from localllm.models.export import save_hf_folder

    tok = tmp_path_factory.mktemp("tok")
    save_hf_folder(default_checkpoint, tok, tensors=iter([]))
    path = write_random_model(tmp_path_factory.mktemp("m") / "tiny", "LlamaForCausalLM", tok, layers=1)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 8192}))
    return LLMEngine(EngineConfig(model=str(path), dtype="float32", device="cpu", max_model_len=4096, chats=2))


def _measure(engine: LLMEngine, prompt_len: int, warm_tokens: int, monkeypatch) -> tuple[int, int, int]:
    """(bytes kept by STEPS outputs, peak bytes allocated inside one step, most ids decoded at
    once) for a request decoding after ``prompt_len`` prompt and ``warm_tokens`` output tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=warm_tokens + STEPS + 10, ignore_eos=True, stop=["zzzz"])
    rid = engine.add_request(list(range(1000, 1000 + prompt_len)), params)
    while engine.requests[rid].seq.num_output_tokens < warm_tokens:
        engine.step()
    decoded: list[int] = []
    real_decode = Tokenizer.decode
    monkeypatch.setattr(Tokenizer, "decode", lambda self, ids, *a, **kw: decoded.append(len(ids)) or real_decode(self, ids, *a, **kw))
    kept: list[RequestOutput] = []
    peak = 0
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        for _ in range(STEPS):
            start, _ = tracemalloc.get_traced_memory()
            tracemalloc.reset_peak()
            kept += engine.step()
            peak = max(peak, tracemalloc.get_traced_memory()[1] - start)
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
        monkeypatch.undo()
    assert len(kept) == STEPS and not kept[-1].finished
    engine.abort_request(rid)
    retained = sum(s.size_diff for s in after.compare_to(before, "filename") if "localllm" in s.traceback[0].filename)
    return retained, peak, max(decoded)


def test_decode_step_work_is_independent_of_length(engine: LLMEngine, monkeypatch) -> None:
    short = _measure(engine, 8, 4, monkeypatch)
    long = _measure(engine, 3000, 400, monkeypatch)
    ids_bytes = 8 * 3400  # one copy of the long request's ids
    # Kept: deltas and O(1) views. What differs is the occasional resize of a growing list
    # (amortized O(1) per token); a copy of the ids per output would keep STEPS x ids_bytes.
    assert long[0] - short[0] < ids_bytes, (short, long)
    # Allocated on the way: the runner's block-table rows (context / 16 ints) are the one
    # part that grows with the context; a copy of the ids would be ids_bytes per step.
    assert long[1] - short[1] < ids_bytes // 2, (short, long)
    assert long[2] <= 8 and short[2] <= 8  # the detokenizer decodes a few ids, not the reply
