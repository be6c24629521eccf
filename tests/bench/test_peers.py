"""bench/peers (the package bench/peers.py runs) without running a benchmark: TTFT at the first
chunk with content, read by the official openai client from SSE streams recorded from both
servers; medians, ratios and targets; llama-bench's JSON; finding llama.cpp and the skip and
error lines. Never timing."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.bench.scripts import ROOT, load_bench

load_bench("peers")  # as ``peers``: what the bench scripts import with bench/ on sys.path
from peers import build, cli, environment, processes  # noqa: E402
from peers import client as peer_client, report as peer_report  # noqa: E402

# Recorded from `localllm serve` (chat, max_tokens 3, ignore_eos, include_usage): a role-only
# first chunk whose content is "", three content chunks, then usage.
OURS_SSE = (
    'data: {"id":"chatcmpl-a95","object":"chat.completion.chunk","created":1796119163,"model":"smollm2-135m-instruct",'
    '"choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}],'
    '"usage":null}\n\n'
    'data: {"id":"chatcmpl-a95","object":"chat.completion.chunk","created":1796119163,"model":"smollm2-135m-instruct",'
    '"choices":[{"index":0,"delta":{"content":"Hello"},"logprobs":null,"finish_reason":null}],"usage":null}\n\n'
    'data: {"id":"chatcmpl-a95","object":"chat.completion.chunk","created":1796119163,"model":"smollm2-135m-instruct",'
    '"choices":[{"index":0,"delta":{"content":" there"},"logprobs":null,"finish_reason":null}],"usage":null}\n\n'
    'data: {"id":"chatcmpl-a95","object":"chat.completion.chunk","created":1796119163,"model":"smollm2-135m-instruct",'
    '"choices":[{"index":0,"delta":{"content":"!"},"logprobs":null,"finish_reason":"length","stop_reason":null}],'
    '"usage":null}\n\n'
    'data: {"id":"chatcmpl-a95","object":"chat.completion.chunk","created":1796119163,"model":"smollm2-135m-instruct",'
    '"choices":[],"usage":{"prompt_tokens":21,"completion_tokens":3,"total_tokens":24,'
    '"prompt_tokens_details":{"cached_tokens":0}}}\n\n'
    "data: [DONE]\n\n"
)

# Recorded from llama-server (same request): the role chunk's content is null, an empty delta
# carries finish_reason, and usage comes with llama.cpp's own timings.
_LS = ('"created":1796124093,"id":"chatcmpl-NAP","model":"SmolLM2-135M-Instruct.Q4_1.gguf",'
       '"system_fingerprint":"b1-0c1e570","object":"chat.completion.chunk"')
THEIRS_SSE = (
    'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"role":"assistant","content":null}}],' + _LS + "}\n\n"
    'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":"Hello"}}],' + _LS + "}\n\n"
    'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":" there"}}],' + _LS + "}\n\n"
    'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":"!"}}],' + _LS + "}\n\n"
    'data: {"choices":[{"finish_reason":"length","index":0,"delta":{}}],' + _LS + "}\n\n"
    'data: {"choices":[],' + _LS + ',"usage":{"completion_tokens":3,"prompt_tokens":21,"total_tokens":24,'
    '"prompt_tokens_details":{"cached_tokens":0}},"timings":{"cache_n":0,"prompt_n":21,"prompt_ms":1195.4,'
    '"predicted_n":3,"predicted_ms":194.1}}\n\n'
    "data: [DONE]\n\n"
)


def _client(sse: str, seen: list[dict[str, Any]]) -> Any:
    from openai import AsyncOpenAI

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=sse.encode())

    return AsyncOpenAI(base_url="http://peer.test/v1", api_key="x", max_retries=0,
                       http_client=httpx.AsyncClient(transport=httpx.MockTransport(handler)))


def _clock(times: list[float]) -> Callable[[], float]:
    it = iter(times)
    return lambda: next(it)


@pytest.mark.parametrize("sse", [OURS_SSE, THEIRS_SSE], ids=["localllm", "llama-server"])
async def test_ttft_is_the_first_chunk_with_content_not_the_role_chunk(sse: str) -> None:
    seen: list[dict[str, Any]] = []
    client = _client(sse, seen)
    # t0, then one reading per chunk: the role chunk lands at 5 ms, the first token at 250 ms
    times = [10.0, 10.005, 10.25, 10.30, 10.35, 10.36, 10.37]
    r = await peer_client.stream_chat(client, "m", [{"role": "user", "content": "Hi"}], 3, clock=_clock(times))
    assert r.first_chunk_s == pytest.approx(0.005)
    assert r.ttft_s == pytest.approx(0.25)
    assert r.end_s == pytest.approx((0.36 if sse is OURS_SSE else 0.37))
    assert (r.output_tokens, r.prompt_tokens, r.content_chunks, r.text) == (3, 21, 3, "Hello there!")
    # the request both servers get: streamed, greedy, a fixed token count, usage at the end
    body = seen[0]
    assert body["stream"] is True and body["ignore_eos"] is True and body["temperature"] == 0.0
    assert body["max_tokens"] == 3 and body["stream_options"] == {"include_usage": True}


async def test_the_sampled_measure_sends_the_same_sampler_settings_to_both() -> None:
    seen: list[dict[str, Any]] = []
    await peer_client.server_sequential(_client(OURS_SSE, seen), "m", 1, 3, "n0", peer_client.CHAT_SAMPLING)
    body = seen[0]
    assert (body["temperature"], body["top_p"], body["top_k"], body["min_p"]) == (0.8, 0.95, 40, 0.05)
    assert body["ignore_eos"] is True


async def test_without_usage_the_content_chunks_are_counted() -> None:
    no_usage = "".join(block + "\n\n" for block in OURS_SSE.split("\n\n") if block and '"usage":{' not in block)
    r = await peer_client.stream_chat(_client(no_usage, []), "m", [], 3, clock=_clock([0.0, 0.1, 0.2, 0.3, 0.4]))
    assert (r.output_tokens, r.prompt_tokens, r.ttft_s) == (3, None, pytest.approx(0.2))


def _result(tokens: int, ttft: float | None, prompt: int = 30) -> Any:
    return peer_client.StreamResult(ttft_s=ttft, first_chunk_s=0.001, end_s=1.0, output_tokens=tokens,
                              prompt_tokens=prompt, content_chunks=tokens, text="")


def test_aggregate_counts_tokens_over_the_whole_wall_and_flags_short_streams() -> None:
    a = peer_client.aggregate([_result(128, 0.2), _result(128, 0.4), _result(100, 0.3, prompt=31)], 4.0, 128)
    assert a["tok_s"] == pytest.approx(356 / 4.0)
    assert a["ttft_p50_s"] == pytest.approx(0.3)
    assert a["prompt_tokens"] == [30, 31] and a["short_streams"] == 1


def test_rows_take_medians_and_ratios_are_speeds() -> None:
    row = peer_report.Row("single", "decode", "tok/s", ours=[20.0, 18.0, 30.0], theirs=[75.0, 80.0, 70.0])
    s = row.summary()
    assert (s["ours"], s["theirs"], s["speed_ratio"]) == (20.0, 75.0, round(20 / 75, 3))
    assert s["target"] == 1.0 and s["met"] is False
    # a TTFT: lower is faster, so the ratio is theirs over ours
    hit = peer_report.Row("prefix_hit", "hit", "s", ours=[0.020], theirs=[0.034]).summary()
    assert hit["speed_ratio"] == pytest.approx(1.7) and hit["met"] is True
    assert peer_report.Row("server8", "x", "tok/s", ours=[60.0], theirs=[]).summary()["speed_ratio"] is None
    assert peer_report.speed_ratio(10.0, 0.0, "tok/s") is None


def test_report_table_names_the_machine_the_commands_and_the_notes() -> None:
    report = {
        "model": "/m/SmolLM2-135M-Instruct.Q4_1.gguf",
        "machine": {**environment.machine("model name\t: Test CPU\nflags\t\t: fpu avx2 avx512f amx_int8\n"),
                    "load_average_end": [1.0, 1.0, 1.0], "threads": 2},
        "localllm": {"dtype": "auto", "quant": None, "precision": "bfloat16"},
        "llama_cpp": {"bin_dir": "/b", "version": "0.5.0-dev (build 1, commit 0c1e570)"},
        "trials": 3,
        "rows": [peer_report.Row("server16", "server: 16 concurrent streams", "tok/s", ours=[250.0], theirs=[124.0]).summary()],
        "commands": {"servers": {"llama.cpp": "llama-server -m m.gguf -np 16"}},
        "notes": ["llama-cpp-python skipped: it is not installed"],
        "wall_s": 12.0,
    }
    text = peer_report.format_report(report)
    assert "CPU: Test CPU; amx_int8, avx2, avx512f" in text
    assert "250.0" in text and "124.0" in text and "2.02x" in text and ">= 2.0x: met" in text
    assert "servers / llama.cpp: llama-server -m m.gguf -np 16" in text and "llama-cpp-python skipped" in text


def test_llama_bench_json() -> None:
    out = json.dumps([{"n_prompt": 512, "n_gen": 0, "avg_ts": 260.5, "samples_ts": [260.5]}])
    assert processes.parse_llama_bench(out) == 260.5
    with pytest.raises(environment.PeerError, match="unexpected llama-bench output"):
        processes.parse_llama_bench("| model | size |")
    assert processes.llama_bench_cmd(Path("/b/llama-bench"), Path("/m.gguf"), 0, 128, 2) == [
        "/b/llama-bench", "-m", "/m.gguf", "-p", "0", "-n", "128", "-t", "2", "-r", "1", "-o", "json"]


def test_machine_keeps_only_the_vector_isa_flags() -> None:
    m = environment.machine("processor : 0\nmodel name : AMD EPYC 7B13\nflags : fpu sse4_2 avx avx2 fma\n")
    assert m["cpu"] == "AMD EPYC 7B13" and m["isa"] == ["avx2"]
    assert len(m["load_average"]) == 3 and m["date"].endswith("+00:00")
    assert "-DCMAKE_CXX_FLAGS=" + build.NO_AMX in build.build_flags(["amx_int8", "avx2"])
    assert not any("amx" in f for f in build.build_flags(["avx2"]))


def test_a_sigill_says_what_to_do() -> None:
    msg = str(environment.died("llama-bench", -signal.SIGILL, ""))
    assert "illegal instruction" in msg and "--build" in msg
    assert "exited with 1: boom" in str(environment.died("llama-server", 1, "boom"))


def _binary(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def test_find_llama_cpp_looks_in_the_dir_its_bin_and_build_bin(tmp_path: Path) -> None:
    empty = build.find_llama_cpp(tmp_path)
    assert (empty.bench, empty.server, empty.bin_dir) == (None, None, None)
    msg = empty.missing("llama-server")
    assert msg.startswith("llama.cpp skipped: no llama-server in ") and str(tmp_path / "build" / "bin") in msg
    assert "--build" in msg and build.ENV_DIR in msg and "\n" not in msg
    _binary(tmp_path / "build" / "bin" / "llama-bench")
    (tmp_path / "build" / "bin" / "llama-server").write_text("not executable")
    found = build.find_llama_cpp(tmp_path)
    assert found.bench == tmp_path / "build" / "bin" / "llama-bench" and found.server is None
    # the environment variable is the fallback for --llama-cpp-dir
    via_env = build.find_llama_cpp(None, env={build.ENV_DIR: str(tmp_path / "build")})
    assert via_env.bin_dir == tmp_path / "build" / "bin"


def test_only_keeps_the_documented_order_and_rejects_unknown_names() -> None:
    args = cli.build_parser().parse_args(["--only", "prefix,single", "--trials", "2"])
    assert args.only == ("single", "prefix") and args.trials == 2
    with pytest.raises(SystemExit) as e:
        cli.build_parser().parse_args(["--only", "single,bogus"])
    assert e.value.code == 2
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["--trials", "0"])


def test_no_llama_cpp_is_a_one_line_skip(tmp_path: Path, default_model_path: Path,
                                         capsys: pytest.CaptureFixture[str],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    if processes.llama_cpp_python_available() is None:
        pytest.skip("llama-cpp-python is installed here: there is a peer to measure")
    monkeypatch.delenv(build.ENV_DIR, raising=False)
    rc = cli.main(["--model", str(default_model_path), "--llama-cpp-dir", str(tmp_path), "--only", "single"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 0 and len(err) == 1 and err[0].startswith("peers: llama.cpp skipped: no llama-bench or llama-server")


def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--llama-cpp-dir", str(tmp_path / "nope")]) == 2
    assert capsys.readouterr().err.strip() == f"peers: error: --llama-cpp-dir {tmp_path / 'nope'}: no such folder"
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    assert cli.main(["--model", str(hf), "--llama-cpp-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not a .gguf file" in err[0]


def test_prompts_have_the_exact_token_counts(default_model_path: Path) -> None:
    tok = peer_client.load_tokenizer(default_model_path)
    assert len(peer_client.exact_ids(tok, 512, "abc123")) == 512
    messages = peer_client.prompt_of(tok, 1516, "abc123")
    assert len(tok.encode_chat(messages)) == 1516 and messages[0] == {"role": "system", "content": peer_client.SYSTEM}


def test_localllm_bench_help_points_at_peers(capsys: pytest.CaptureFixture[str]) -> None:
    from localllm.cli import main

    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    assert "bench/peers.py" in capsys.readouterr().out


def test_llama_cpp_runs_without_our_openmp_tuning(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(environment, "USER_OPENMP", {})
    monkeypatch.setenv("GOMP_SPINCOUNT", "50000")
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    assert not set(environment.OPENMP_VARS) & set(environment.llama_cpp_env())
    monkeypatch.setattr(environment, "USER_OPENMP", {"OMP_WAIT_POLICY": "ACTIVE"})
    assert environment.llama_cpp_env()["OMP_WAIT_POLICY"] == "ACTIVE"
    assert "GOMP_SPINCOUNT" not in environment.llama_cpp_env()
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"


def test_openmp_defaults_leave_the_users_choice_alone() -> None:
    from localllm.cli import GOMP_SPINCOUNT, set_openmp_defaults

    env: dict[str, str] = {}
    set_openmp_defaults(env)
    assert env == {"GOMP_SPINCOUNT": GOMP_SPINCOUNT}
    env = {"OMP_WAIT_POLICY": "PASSIVE"}
    set_openmp_defaults(env)
    assert env == {"OMP_WAIT_POLICY": "PASSIVE"}
    env = {"GOMP_SPINCOUNT": "7"}
    set_openmp_defaults(env)
    assert env == {"GOMP_SPINCOUNT": "7"}


def test_the_documented_command_runs_the_package() -> None:
    # bench/peers.py is a launcher beside the package bench/peers/, which `import peers` finds first
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "peers.py"), "--only", "nope"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and "unknown measure nope (choose from single, prefill" in r.stderr


def test_spec_is_named_to_run_and_turns_each_sides_ngram_speculation_on(tmp_path: Path) -> None:
    from peers import run as peer_run

    assert "spec" not in cli.build_parser().parse_args([]).only  # not in a default run
    assert cli.build_parser().parse_args(["--only", "spec,single"]).only == ("single", "spec")
    llama = build.LlamaCpp(bin_dir=tmp_path, bench=None, server=tmp_path / "llama-server", searched=())
    o = peer_run.Options(gguf=tmp_path / "m.gguf", only=("spec",), trials=1, threads=2, tokens=8, prefill_tokens=8,
                         prefix_tokens=8, dtype="auto", quant=None, ready_timeout_s=1.0, llama=llama,
                         say=lambda _: None)
    ours, theirs = peer_run.our_server_argv(o, 1, spec=True), peer_run.their_server_argv(o, 1, spec=True)
    assert ours[ours.index("--speculative-ngram") + 1] == str(peer_run.SPEC_K)
    assert theirs[theirs.index("--spec-type") + 1] == "ngram-simple"
    assert "--speculative-ngram" not in peer_run.our_server_argv(o, 1)
    assert "--spec-type" not in peer_run.their_server_argv(o, 1)
    # decode speed: the tokens after the first over the time after it
    r = peer_client.StreamResult(ttft_s=0.5, first_chunk_s=0.4, end_s=2.5, output_tokens=41, prompt_tokens=9,
                                 content_chunks=41, text="")
    assert peer_client.decode_rate(r) == pytest.approx(20.0)
    # three sides a trial: ours on against llama.cpp's, and ours on against ours off
    bench = peer_run.Bench(o)
    figures = {"localllm": (30.0, 12.0, 40.0), peer_run.SPEC_OFF_SIDE: (15.0, 12.5, 41.0), "llama.cpp": (20.0, 24.0, None)}
    for side, (code, prose, many) in figures.items():
        value = {"side": side, "code_tok_s": code, "prose_tok_s": prose, "prompt_tokens": [9]}
        bench._record("spec", side, value if many is None else {**value, "server16_tok_s": many})
    rows = {row.key: row.summary() for row in bench.rows.values()}
    assert (rows["spec_code"]["speed_ratio"], rows["spec_code"]["met"]) == (1.5, True)
    assert (rows["spec_code_self"]["speed_ratio"], rows["spec_code_self"]["met"]) == (2.0, True)
    assert (rows["spec_prose_self"]["speed_ratio"], rows["spec_prose_self"]["met"]) == (0.96, False)
    assert rows["spec_server16_self"]["ours_trials"] == [40.0] and rows["spec_server16_self"]["theirs_trials"] == [41.0]
    assert rows["spec_prose"]["peer"] == "llama.cpp" and rows["spec_prose_self"]["peer"] == "localllm, no speculation"


def test_our_server_is_measured_once_its_decode_graphs_are_in() -> None:
    """A server loads its saved decode graphs after its first step, eager meanwhile (a spec
    trial measured then read our prose decode at ~0.55x llama-server): the bench waits for
    ``localllm:decode_graphs_pending`` 0; a server without the gauge (llama-server) is ready."""
    row = 'localllm:decode_graphs_pending{model_name="m.gguf"} '
    assert processes._graphs_pending(f"# TYPE localllm:decode_graphs_pending gauge\n{row}1\n")
    assert not processes._graphs_pending(f"{row}0\n")
    assert not processes._graphs_pending("llamacpp:prompt_tokens_total 3\n")
