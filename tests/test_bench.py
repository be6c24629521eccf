"""``localllm bench`` on a tiny scale: the report's bookkeeping (request and token counts,
modes, ratios, cache figures), locally and against ``localllm serve`` over HTTP. Never
timing: these machines are shared and noisy."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from localllm.bench import BenchOptions, chat_lengths, format_report, percentile, run_bench, step_bounds
from localllm.cli import main
from localllm.engine.async_engine import AsyncEngine
from localllm.engine.engine import EngineConfig, LLMEngine


@pytest.fixture(scope="module")
def engine(default_model_path: Path) -> Iterator[AsyncEngine]:
    eng = AsyncEngine(LLMEngine(EngineConfig(model=str(default_model_path), device="cpu", max_model_len=1024,
                                             chats=2, max_num_seqs=8)))
    yield eng
    eng.shutdown()


def test_lengths_and_percentiles() -> None:
    straggler = chat_lengths(16, "straggler", rounds=2, scale=1.0)
    assert len(straggler) == 32 and straggler.count(2000) == 2 and straggler.count(50) == 30
    assert chat_lengths(1, "straggler", rounds=4, scale=1.0) == [2000, 50, 50, 50]
    assert chat_lengths(4, "straggler", rounds=1, scale=0.01) == [20, 4, 4, 4]  # floor of 4 tokens
    mixed = chat_lengths(4, "mixed", rounds=3, scale=1.0)
    assert sorted(mixed) == sorted([32, 64, 128, 256, 512, 1024] * 2) and mixed == chat_lengths(4, "mixed", 3, 1.0)
    # one straggler per batch: static pads every batch to it; continuous refills the other
    # chats from the queue, so only the last straggler's chat runs long
    assert step_bounds([8, 1, 1, 1, 8, 1, 1, 1], 4) == {"continuous": 9, "static": 16, "sequential": 22}
    assert step_bounds([5, 3], 1) == {"continuous": 8, "static": 8, "sequential": 8}
    assert step_bounds([2, 7], 4) == {"continuous": 7, "static": 7, "sequential": 9}  # more chats than requests
    assert percentile([], 50) is None
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5 and percentile([5.0], 99) == 5.0


async def test_local_bench_report(engine: AsyncEngine) -> None:
    opts = BenchOptions(chats=(3,), compare=("static", "sequential", "nocache"), rounds=1, scale=0.01,
                        rag_tokens=200, questions=2, turns=3, plain_tokens=6)
    r = await run_bench(engine, opts)

    b1 = r["batch1_decode"]
    assert b1["plain_tok_s"] > 0 and b1["engine_tok_s"] > 0 and b1["plain_over_engine"] > 0
    assert b1["same_tokens"], "the engine's greedy tokens differ from the plain loop's"

    rows = r["chats"]
    assert [(row["n"], row["mix"]) for row in rows] == [(3, "mixed"), (3, "straggler")]
    for row in rows:
        lengths = chat_lengths(row["n"], row["mix"], 1, 0.01)
        assert set(row["modes"]) == {"continuous", "static", "sequential"}
        assert set(row["ratios"]) == set(row["step_bound_ratios"]) == {"continuous/static", "continuous/sequential"}
        for m in row["modes"].values():
            assert m["requests"] == len(lengths) == row["requests"]
            assert m["output_tokens"] == sum(lengths)  # ignore_eos: every reply has its exact length
            assert m["output_tok_s"] > 0 and m["ttft_p50_s"] > 0 and m["ttft_p99_s"] >= m["ttft_p50_s"]
            assert m["itl_p99_s"] >= m["itl_p50_s"] > 0
            assert 0 < m["peak_kv_usage"] <= 1 and m["peak_kv_blocks"] > 0
            assert 0 <= m["prefix_hit_rate"] < 1 and m["preemptions"] == 0
        assert 0 < row["modes"]["static"]["slot_utilization"] <= 1
        assert row["modes"]["continuous"]["max_batch"] > 1 and row["modes"]["sequential"]["max_batch"] == 1

    rag = r["rag"]["modes"]
    assert set(rag) == {"continuous", "nocache"}
    assert rag["continuous"]["system_prompt_tokens"] >= 200
    # both questions share the system prompt: the second finds it cached, nocache never does
    assert rag["continuous"]["cached_tokens"] >= 192 and rag["nocache"]["cached_tokens"] == 0
    assert rag["continuous"]["ttft_later_over_first"] > 0

    turns = r["multiturn"]["modes"]["continuous"]
    assert len(turns["ttft_by_turn_s"]) == 3 and turns["ttft_last_over_turn2"] > 0
    prompts, cached = turns["prompt_tokens_by_turn"], turns["cached_tokens_by_turn"]
    assert prompts == sorted(prompts) and cached[2] > cached[1] > 0  # each turn reuses the last one's KV
    assert r["multiturn"]["modes"]["nocache"]["cached_tokens"] == 0

    text = format_report(r)
    assert "chats N=3 straggler" in text and "continuous =" in text and "later/first" in text
    json.dumps(r)  # --json must be able to print all of it


def test_bench_endpoint_cli(engine: AsyncEngine, capsys: pytest.CaptureFixture[str]) -> None:
    from localllm.server.app import create_app
    from localllm.server.serving import start_server_thread

    server = start_server_thread(create_app(engine))
    try:
        code = main(["bench", "--endpoint", f"{server.url}/v1", "--workload", "chats,multiturn", "--chats", "2",
                     "--mix", "straggler", "--rounds", "2", "--scale", "0.01", "--turns", "2",
                     "--compare", "static", "--json"])
    finally:
        server.stop()
    assert code == 0
    r: dict[str, Any] = json.loads(capsys.readouterr().out)
    assert r["device"] == "remote" and r["endpoint"] == f"{server.url}/v1" and "batch1_decode" not in r
    (row,) = r["chats"]
    for m in row["modes"].values():
        assert m["requests"] == 4 and m["output_tokens"] == sum(chat_lengths(2, "straggler", 2, 0.01))
        assert m["peak_kv_usage"] is not None  # scraped from the server's /metrics
        assert m["prefix_hit_rate"] is not None and m["ttft_p50_s"] > 0
    assert row["ratios"]["continuous/static"] > 0
    assert r["multiturn"]["modes"]["continuous"]["cached_tokens_by_turn"][1] > 0  # from usage.cached_tokens


@pytest.mark.parametrize("argv", [["--chats", "0"], ["--workload", "chat"], ["--compare", "fast"]])
def test_bench_bad_arguments(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["bench", *argv])
    assert e.value.code == 2 and "error" in capsys.readouterr().err


async def test_guided_bench_runs_both_modes_at_both_batch_sizes(engine: AsyncEngine) -> None:
    from localllm.bench import GUIDED_BATCHES

    r = await run_bench(engine, BenchOptions(workloads=("guided",), plain_tokens=0, scale=0.04))
    rows = r["guided"]
    assert [row["n"] for row in rows] == list(GUIDED_BATCHES) == [1, 16]
    for row in rows:
        for mode in ("free", "guided"):
            m = row[mode]
            # every constrained request decoded all its tokens: the schema cannot end sooner
            assert m["requests"] == row["n"] and m["output_tokens"] == row["n"] * row["tokens"], (mode, m)
        assert row["itl_guided_over_free"] > 0 and row["throughput_guided_over_free"] > 0
    assert "guided N=16" in format_report(r)
