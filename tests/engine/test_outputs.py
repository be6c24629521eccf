"""Request outputs without a model: O(1) views of growing lists, stop strings found across
token boundaries with text held back, and outputs whose cost does not grow with length."""

from __future__ import annotations

import tracemalloc

import pytest

from localllm.engine.outputs import Prefix, RequestMetrics, RequestState
from localllm.engine.sequence import SamplingParams, Sequence, SequenceStatus
from localllm.tokenizer import IncrementalDetokenizer, Tokenizer


@pytest.fixture(scope="module")
def tokenizer(default_checkpoint) -> Tokenizer:
    return default_checkpoint.tokenizer


def test_prefix_is_a_frozen_view_of_a_growing_list() -> None:
    items = [1, 2, 3]
    view = Prefix(items, 1)
    items += [4, 5]
    assert len(view) == 2 and list(view) == [2, 3] and view == [2, 3] and [2, 3] == view
    assert view[0] == 2 and view[-1] == 3 and view[1:] == [3] and view[::-1] == [3, 2] and view[5:] == []
    with pytest.raises(IndexError):
        view[2]
    assert Prefix(items, 0, 3) == Prefix([1, 2, 3]) and Prefix(items) != [1, 2]
    assert repr(view) == "[2, 3]"


def _state(tokenizer: Tokenizer, prompt: list[int], **params: object) -> RequestState:
    seq = Sequence("r", list(prompt), SamplingParams(**params), (), 100_000)  # type: ignore[arg-type]
    return RequestState(seq, None, IncrementalDetokenizer(tokenizer), RequestMetrics(0.0))


def _feed(state: RequestState, tokens: list[int]) -> tuple[list[str], str | None, int]:
    """Appends tokens one at a time as the engine does; stops at a stop string."""
    deltas: list[str] = []
    for i, t in enumerate(tokens):
        state.seq.token_ids.append(t)
        delta, stop = state.add_text(t)
        deltas.append(delta)
        if stop is not None:
            return deltas, stop, i
    return deltas, None, len(tokens)


def test_stop_string_across_tokens_and_held_back_text(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("Hello world, and the end of it.")  # Hello| world|,| and| the| end| of| it|.
    state = _state(tokenizer, [1], stop=["o w", "the end"])
    deltas, stop, at = _feed(state, ids)
    # up to 6 characters (the longest stop string but one) wait: they may begin a stop string
    assert deltas == ["", "Hell"] and stop == "o w" and at == 1
    assert "".join(state.text_pieces) == "Hell" and state.held == ""

    state = _state(tokenizer, [1], stop=["the end"])
    deltas, stop, at = _feed(state, ids)
    assert stop == "the end" and at == 5 and "".join(deltas) == "Hello world, and "


def test_without_a_stop_every_delta_goes_out_and_the_end_flushes(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("One two three")
    state = _state(tokenizer, [1], stop=["four"])
    deltas, stop, _ = _feed(state, ids)
    assert stop is None and state.held  # the tail might still become "four"
    state.seq.status = SequenceStatus.FINISHED  # e.g. max_tokens reached
    assert "".join(deltas) + state.flush() == "One two three"
    plain = _state(tokenizer, [1])
    assert "".join(_feed(plain, ids)[0]) == "One two three" and not plain.held


def test_finished_by_length_still_finds_a_stop_in_its_last_text(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("say STOP")
    state = _state(tokenizer, [1], stop=["STOP"])
    _feed(state, ids[:-1])
    state.seq.token_ids.append(ids[-1])
    state.seq.status = SequenceStatus.FINISHED
    delta, stop = state.add_text(ids[-1])
    assert stop == "STOP" and "".join(state.text_pieces) == "say "


def _bytes_of_outputs(tokenizer: Tokenizer, n_prompt: int, n_out: int) -> int:
    state = _state(tokenizer, list(range(5, 5 + n_prompt)), logprobs=1)
    for i in range(n_out):
        state.seq.token_ids.append(100 + i % 50)
        state.text_pieces.append("x")
        state.add_logprobs(100 + i % 50, -0.5, {3: -1.0})
    kept = []
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        for _ in range(20):
            out = state.output([7], "x")
            kept.append(out)
            assert len(out.prompt_token_ids) == n_prompt and len(out.outputs[0].token_ids) == n_out
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    return sum(s.size_diff for s in after.compare_to(before, "filename"))


def test_an_output_costs_the_same_at_any_length(tokenizer: Tokenizer) -> None:
    """What a step hands over is deltas and O(1) views: 20 outputs of a request with a
    50,000-token prompt and 20,000 output tokens hold no more memory than those of a short
    one (a copy of the ids alone would be 560 KB per output), but for the few bytes of the
    larger offsets the views hold (ints above 256 are objects of their own)."""
    short = _bytes_of_outputs(tokenizer, 5, 3)
    long = _bytes_of_outputs(tokenizer, 50_000, 20_000)
    assert long <= short + 20 * 256, (short, long)


def test_the_detokenizer_window_stays_small_on_tokens_that_never_make_text(tokenizer: Tokenizer,
                                                                           monkeypatch) -> None:
    sizes: list[int] = []
    real = Tokenizer.decode
    monkeypatch.setattr(Tokenizer, "decode", lambda self, ids, *a, **kw: sizes.append(len(ids)) or real(self, ids, *a, **kw))
    detok = IncrementalDetokenizer(tokenizer)
    special = tokenizer.eos_token_ids[0]  # decodes to nothing: skipped as a special token
    broken = [tokenizer.backend.token_to_id("©")]  # byte 0xA9 alone: a UTF-8 continuation, never a character
    for _ in range(100):
        detok.add([special])
    for _ in range(100):
        detok.add(broken)
    assert max(sizes) <= 2 * IncrementalDetokenizer.MAX_PENDING + 2, max(sizes)
    assert detok.add(tokenizer.encode(" fine")).endswith("fine")
