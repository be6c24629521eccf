"""The CPU decode paths that replace the plain eager step: the forward compiled by
torch.compile, and the static-buffer bucket path CUDA graphs replay (run eagerly here). Each
must give the plain path's greedy tokens."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from localllm import LLM, SamplingParams
from localllm.kernels import cpu_ops
from tests.models.test_random_models import tokenizer_folder, write_random_model  # noqa: F401 (fixture)

PROMPTS = ["The history of Paris", "Write a haiku about the sea.", "1, 2, 3, 4,"]


def _tokens(llm: LLM, n: int = 24) -> list[list[int]]:
    # three prompts at once, then one alone: decode batches of 3, 2 and 1 as requests finish
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
    compiled = LLM(str(default_model_path), device="cpu", compile=True)
    assert compiled.engine.runner._decode_gives_logits  # the compiled decode path is in use
    assert set(compiled.engine.runner._unguarded) == {1, 2}  # called without Dynamo's guards
    # the compiled graphs are kept in our cache folder, not in torch's default under /tmp
    inductor = cpu_ops.compiled_cache_dir() / "inductor"
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(inductor) and any(inductor.rglob("*.so"))
    assert _tokens(compiled) == _tokens(eager)


@pytest.mark.parametrize("arch", ["Qwen2ForCausalLM", "Qwen3ForCausalLM", "LlamaForCausalLM"])
def test_random_models_compiled_match_eager(arch: str, tmp_path: Path, tokenizer_folder: Path,  # noqa: F811
                                            compiling: None) -> None:
    path = write_random_model(tmp_path / arch, arch, tokenizer_folder, tied=arch != "LlamaForCausalLM")
    eager = LLM(str(path), dtype="float32", device="cpu", compile=False)
    compiled = LLM(str(path), dtype="float32", device="cpu", compile=True)
    assert _tokens(compiled, 12) == _tokens(eager, 12)


def test_bucketed_static_buffers_match_plain(default_model_path: Path) -> None:
    """The CUDA-graph bookkeeping (static buffers, buckets, padding rows with slot -1), run
    eagerly: batches of 3 and 2 miss the buckets and are padded to 4, 1 hits one; contexts
    grow across block boundaries as the tokens come."""
    plain = LLM(str(default_model_path), dtype="float32", device="cpu", compile=False)
    buckets = LLM(str(default_model_path), dtype="float32", device="cpu", compile=False, decode_buckets=[1, 4])
    assert buckets.engine.runner.buckets == [1, 4]
    assert _tokens(buckets) == _tokens(plain)


def test_a_later_start_loads_the_saved_graphs_and_a_damaged_one_is_rebuilt(
    tmp_path: Path, tokenizer_folder: Path, compiling: None, monkeypatch: pytest.MonkeyPatch, caplog,  # noqa: F811, ANN001
) -> None:
    """The compiled decode graphs are saved under our cache folder; the next engine on the same
    model (same shapes, same code) loads both instead of compiling, and gets the same tokens.
    A damaged file is compiled again with a warning, never a failure."""
    from localllm.engine import model_runner

    loads: list[tuple[str, bool]] = []
    real = model_runner._load_graph

    def spy(path, model, args):  # noqa: ANN001, ANN202
        fn = real(path, model, args)
        loads.append((path.name, fn is not None))
        return fn

    monkeypatch.setattr(model_runner, "_load_graph", spy)
    path = write_random_model(tmp_path / "llama", "LlamaForCausalLM", tokenizer_folder, tied=False)
    eager = _tokens(LLM(str(path), dtype="float32", device="cpu", compile=False), 8)
    first = LLM(str(path), dtype="float32", device="cpu", compile=True)  # compiles, or loads an earlier run's
    assert _tokens(first, 8) == eager
    loads.clear()
    second = LLM(str(path), dtype="float32", device="cpu", compile=True)
    assert [ok for _, ok in loads] == [True, True]  # batch 1 and the dynamic batch: both from disk
    assert _tokens(second, 8) == eager

    saved = model_runner._graphs_dir() / loads[0][0]
    saved.write_bytes(b"not a graph")
    loads.clear()
    third = LLM(str(path), dtype="float32", device="cpu", compile=True)
    assert [ok for _, ok in loads] == [False, True]
    assert "does not load" in caplog.text and saved.stat().st_size > 1000  # compiled again and saved
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
