"""The CPU decode paths that replace the plain eager step: the forward compiled by
torch.compile, and the static-buffer bucket path CUDA graphs replay (run eagerly here). Each
must give the plain path's greedy tokens."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch

from localllm import LLM, SamplingParams
from localllm.kernels import cpu_ops
from tests.models.test_random_models import tokenizer_folder, write_random_model  # noqa: F401 (fixture)
from tests.tiers import matrix

PROMPTS = ["The history of Paris", "Write a haiku about the sea.", "1, 2, 3, 4,"]


def _tokens(llm: LLM, n: int = 16) -> list[list[int]]:
    # three prompts at once, then one alone: decode batches of 3, 2 and 1 as requests finish;
    # 16 + 8i tokens after 4-8 prompt tokens cross the 16- and 32-token block boundaries
    params = [SamplingParams(temperature=0, max_tokens=n + 8 * i, ignore_eos=True) for i in range(3)]
    outs = llm.generate(PROMPTS, params)
    alone = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs + alone]


@pytest.fixture
def compiling(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LOCALLLM_NO_COMPILE", raising=False)


@pytest.mark.skipif(not cpu_ops.has_gguf_kernels(), reason="the GGUF plan needs the CPU kernels")
def test_default_model_compiled_matches_eager(default_model_path: Path, compiling: None) -> None:
    eager = LLM(str(default_model_path), device="cpu", compile=False)
    assert eager.engine.precision.startswith("gguf")  # the CPU default for a GGUF file
    compiled = LLM(str(default_model_path), device="cpu", compile=True, compile_in_background=False)
    assert compiled.engine.runner._decode_gives_logits  # the compiled decode path is in use
    assert set(compiled.engine.runner._unguarded) == {1, 2}  # called without Dynamo's guards
    # the compiled graphs are kept in our cache folder, not in torch's default under /tmp
    inductor = cpu_ops.compiled_cache_dir() / "inductor"
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(inductor) and any(inductor.rglob("*.so"))
    assert _tokens(compiled) == _tokens(eager)


# CI's compiled float models are Gemma 3 (QK norm, tied head, windows: tests/models/test_families.py
# test_gemma3_compiled_decode_keeps_the_windows) and gpt-oss (tests/models/test_moe.py), beside the
# default model's GGUF path above and the untied llama of the background-compile test below;
# these architectures' compiles run with LOCALLLM_FULL_MATRIX=1 (their eager paths run in CI)
@pytest.mark.parametrize("arch", matrix(["Qwen2ForCausalLM", "Qwen3ForCausalLM", "LlamaForCausalLM"], ci=[]))
def test_random_models_compiled_match_eager(arch: str, tmp_path: Path, tokenizer_folder: Path,  # noqa: F811
                                            compiling: None) -> None:
    path = write_random_model(tmp_path / arch, arch, tokenizer_folder, tied=arch != "LlamaForCausalLM")
    eager = LLM(str(path), dtype="float32", device="cpu", compile=False)
    compiled = LLM(str(path), dtype="float32", device="cpu", compile=True, compile_in_background=False)
    assert compiled.engine.runner._decode_gives_logits
    assert _tokens(compiled, 12) == _tokens(eager, 12)


def test_bucketed_static_buffers_match_plain(default_model_path: Path, llm: LLM) -> None:
    """The CUDA-graph bookkeeping (static buffers, buckets, padding rows with slot -1), run
    eagerly: batches of 3 and 2 miss the buckets and are padded to 4, 1 hits one; contexts
    grow across block boundaries as the tokens come."""
    plain = llm  # the session's fp32 engine: the plain eager step (LOCALLLM_NO_COMPILE)
    assert not plain.engine.runner.buckets and not plain.engine.runner._decode_gives_logits
    buckets = LLM(str(default_model_path), dtype="float32", device="cpu", compile=False, decode_buckets=[1, 4])
    assert buckets.engine.runner.buckets == [1, 4]
    assert _tokens(buckets) == _tokens(plain)


def test_answers_first_then_switches_and_later_starts_of_any_size_load_the_graphs(
    tmp_path: Path, tokenizer_folder: Path, compiling: None, monkeypatch: pytest.MonkeyPatch, caplog,  # noqa: F811, ANN001
) -> None:
    """One compile for the whole story. A start with no saved graphs answers at once on the
    eager path while the graphs are built in the background (held back here until the first
    answers are in: a state, not a race), then switches between two steps, same tokens. The
    graphs are saved under our cache folder; a later start on the same model loads both,
    whatever its KV pool size, context limit and chat count (they are dynamic sizes, not
    part of the key): no compile. A damaged file is compiled again with a warning."""
    from localllm.engine import model_runner

    graphs = tmp_path / "graphs"
    graphs.mkdir()
    monkeypatch.setattr(model_runner, "_graphs_dir", lambda: graphs)  # empty: this start must compile
    gate = threading.Event()
    build = model_runner.ModelRunner._build_graphs

    def held(self, *args):  # noqa: ANN001, ANN202
        if gate.wait(timeout=600):  # a failed test leaves it closed: build nothing then
            build(self, *args)

    monkeypatch.setattr(model_runner.ModelRunner, "_build_graphs", held)
    loads: list[tuple[str, bool]] = []
    real = model_runner._load_graph

    def spy(path, model, args):  # noqa: ANN001, ANN202
        fn = real(path, model, args)
        loads.append((path.name, fn is not None))
        return fn

    monkeypatch.setattr(model_runner, "_load_graph", spy)
    path = write_random_model(tmp_path / "llama", "LlamaForCausalLM", tokenizer_folder, tied=False)
    eager = _tokens(LLM(str(path), dtype="float32", device="cpu", compile=False), 8)

    first = LLM(str(path), dtype="float32", device="cpu", compile=True, num_kv_blocks=64, max_model_len=256,
                max_num_seqs=8)
    runner = first.engine.runner
    assert runner.preparing  # looking for saved graphs, then compiling: held at its start by the gate
    while runner.compile_state == "loading":
        runner.wait_compiled(timeout=0.05)
    assert runner.compiling and first.engine.stats().compiling
    assert _tokens(first, 8) == eager  # answered while the compile has not even begun
    assert runner.compiling and not runner._decode_gives_logits
    gate.set()
    assert runner.wait_compiled(timeout=600) and runner.compile_state == "done"
    assert runner.graphs_compiled == 2 and not first.engine.stats().compiling
    assert _tokens(first, 8) == eager  # the first of these steps switched to the graphs
    assert runner._decode_gives_logits and set(runner._unguarded) == {1, 2}

    for sizes in (dict(num_kv_blocks=100, max_model_len=400, max_num_seqs=5),
                  dict(num_kv_blocks=37, max_model_len=100, max_num_seqs=16)):
        loads.clear()
        later = LLM(str(path), dtype="float32", device="cpu", compile=True, **sizes)  # loads in the background
        assert later.engine.runner.wait_compiled(timeout=600)
        assert [ok for _, ok in loads] == [True, True], sizes  # batch 1 and the dynamic batch: both from disk
        assert later.engine.runner.graphs_compiled == 0 and later.engine.runner.num_blocks == sizes["num_kv_blocks"]
        assert _tokens(later, 8) == eager
        assert later.engine.runner._decode_gives_logits  # switched to at the first step

    saved = graphs / loads[0][0]
    saved.write_bytes(b"not a graph")
    loads.clear()
    third = LLM(str(path), dtype="float32", device="cpu", compile=True, compile_in_background=False)
    assert [ok for _, ok in loads] == [False, True]
    assert "does not load" in caplog.text and saved.stat().st_size > 1000  # compiled again and saved
    assert third.engine.runner.graphs_compiled == 1
    assert _tokens(third, 8) == eager


def test_saved_graphs_beyond_the_limit_go_least_recently_used_first(tmp_path: Path) -> None:
    from localllm.engine import model_runner

    names = [f"decode-{i:024x}-1.bin" for i in range(5)]
    for i, name in enumerate(names):
        (tmp_path / name).write_bytes(b"graph")
        os.utime(tmp_path / name, (1_000 + i, 1_000 + i))
    os.utime(tmp_path / names[0], (2_000, 2_000))  # the oldest, but loaded last
    (tmp_path / "notes.txt").write_text("not ours to delete")
    model_runner._prune_graphs(tmp_path, keep=3)
    assert sorted(p.name for p in tmp_path.glob("decode-*.bin")) == [names[0], names[3], names[4]]
    assert (tmp_path / "notes.txt").read_text() == "not ours to delete"


def test_a_process_that_exits_mid_compile_leaves_no_compiler_running() -> None:
    """A background compile still running at exit (the TUI's ctrl+q, ctrl+c on `run`) is
    abandoned with its compiler processes: a child standing in for g++ must not outlive us."""
    import subprocess
    import sys

    import psutil

    script = (
        "import subprocess, sys, threading, time\n"
        "from localllm.engine import model_runner\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        "print(child.pid, flush=True)\n"
        "compile = threading.Thread(target=time.sleep, args=(600,), daemon=True)\n"
        "model_runner._COMPILE_THREADS.add(compile)\n"
        "model_runner._stop_compilers_at_exit()\n"
        "compile.start()\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    pid = int(out.stdout.split()[0])
    try:
        psutil.Process(pid).wait(timeout=10)  # gone, or a zombie about to be reaped
    except psutil.NoSuchProcess:
        pass
    except psutil.TimeoutExpired:
        psutil.Process(pid).kill()
        raise AssertionError("the stand-in compiler outlived the process") from None
