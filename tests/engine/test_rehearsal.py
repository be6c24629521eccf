"""Rehearsal mode: the whole engine through the Triton kernels on CPU tensors, under the
interpreter (``LOCALLLM_TRITON_ON_CPU=1`` with ``TRITON_INTERPRET=1``; the tests flip the
switch per test), on tiny random 2-layer models, against the torch path.

Every test counts the kernel launches it caused and asserts that each kernel its engine path
needs ran at least once, so a dispatch that quietly falls back to torch fails here. Shapes are
tiny: the interpreter costs milliseconds per program.
"""

from __future__ import annotations

import importlib
import json
import os
import random
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from localllm.engine.engine import EngineConfig, LLMEngine
from localllm.engine.sequence import SamplingParams
from localllm.errors import LocalLLMError
from localllm.kernels import _triton
from tests.models.test_random_models import tokenizer_folder, write_random_model  # noqa: F401 - fixture

# By module path: localllm.kernels re-exports functions named like two of its modules.
activation_mod, awq_gemm_mod, int8_gemm_mod, paged_attention_mod, rmsnorm_mod, rotary_kv_mod = (
    importlib.import_module(f"localllm.kernels.{name}")
    for name in ("activation", "awq_gemm", "int8_gemm", "paged_attention", "rmsnorm", "rotary_kv")
)
pytestmark = pytest.mark.skipif(not (_triton.HAS_TRITON and _triton.INTERPRET),
                                reason="rehearsal needs Triton and TRITON_INTERPRET=1")

REPO = Path(__file__).resolve().parents[2]
# heads 4 over 2 KV heads (GQA packing), head dim 16, hidden 64, FFN 96, 2 layers, untied head
# (a tied random head mostly repeats the last token, which would hide wrong attention).
TINY = dict(heads=4, kv_heads=2, head_dim=16, hidden=64, tied=False)


# ---- launch counting ----


def _attention_label(args: tuple[Any, ...], kw: dict[str, Any]) -> list[str]:
    if kw["IS_DECODE"]:
        return ["attention decode split-K" if kw["NUM_SPLITS"] > 1 else "attention decode"]
    seq_lens, qsl = args[5], args[6]
    q_lens = qsl[1:] - qsl[:-1]
    labels = ["attention prefill"]
    if bool((seq_lens > q_lens).any()):  # some sequence attends to KV from earlier steps
        labels.append("attention prefill over cached KV")
    return labels + (["attention fp8 KV"] if kw["FP8_KV"] else [])


def _w8_label(args: tuple[Any, ...], kw: dict[str, Any]) -> list[str]:
    kind = "int8 w8a8" if kw["INT8_DOT"] else "fp8 w8a8" if kw["A8"] else "int8 w8a16"
    return [f"{kind} {'gemv split-K' if kw['SPLIT_K'] > 1 else 'gemm'}"]


_KERNELS: dict[str, tuple[Any, Callable[[tuple[Any, ...], dict[str, Any]], list[str]]]] = {
    "rotary": (rotary_kv_mod._rotary_and_store_kv_kernel,
               lambda a, kw: ["rotary+kv write"] + (["rotary fp8 KV write"] if kw["FP8_KV"] else [])),
    "attention": (paged_attention_mod._paged_attention_kernel, _attention_label),
    "reduce": (paged_attention_mod._reduce_splits_kernel, lambda a, kw: ["split-K reduce"]),
    "rmsnorm": (rmsnorm_mod._rms_norm_kernel,
                lambda a, kw: ["rmsnorm+residual" if kw["HAS_RESIDUAL"] else "rmsnorm"]),
    "silu": (activation_mod._silu_and_mul_kernel, lambda a, kw: ["silu*mul"]),
    "awq": (awq_gemm_mod._awq_gemm_kernel,
            lambda a, kw: [f"awq {'gemv split-K' if kw['SPLIT_K'] > 1 else 'gemm'}"]),
    "w8": (int8_gemm_mod._w8_gemm_kernel, _w8_label),
    "quant": (int8_gemm_mod._quant_per_token_kernel,
              lambda a, kw: ["int8 per-token quant" if kw["ROUND_INT"] else "fp8 per-token quant"]),
}

FLOAT_PATH = {"rotary+kv write", "attention prefill", "attention prefill over cached KV", "attention decode",
              "attention decode split-K", "split-K reduce", "rmsnorm", "rmsnorm+residual", "silu*mul"}


class Launches:
    """Counts launches of every engine kernel by what they did (decode or prefill, split-K or
    not, GEMV or GEMM, ...), by wrapping each jitted kernel's ``run``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.counts: Counter[str] = Counter()
        for kernel, label in _KERNELS.values():
            original = kernel.run

            def run(*args: Any, _run: Any = original, _label: Any = label, **kw: Any) -> Any:
                self.counts.update(_label(args, kw))
                return _run(*args, **kw)

            monkeypatch.setattr(kernel, "run", run)

    def missing(self, wanted: set[str]) -> set[str]:
        return {w for w in wanted if self.counts[w] == 0}


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> Launches:
    return Launches(monkeypatch)


@pytest.fixture
def rehearse(monkeypatch: pytest.MonkeyPatch) -> Callable[[bool], None]:
    """rehearse(True) sends CPU tensors through the Triton path, as LOCALLLM_TRITON_ON_CPU=1
    does at import; the dispatchers read the switch on every call."""
    def switch(on: bool) -> None:
        monkeypatch.setattr(_triton, "REHEARSAL", on)

    return switch


# ---- tiny models ----


@pytest.fixture(scope="module")
def tiny_models(tokenizer_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:  # noqa: F811
    root = tmp_path_factory.mktemp("tiny")
    return {
        "llama": write_random_model(root / "llama", "LlamaForCausalLM", tokenizer_folder, **TINY),
        "qwen2": write_random_model(root / "qwen2", "Qwen2ForCausalLM", tokenizer_folder, seed=1, **TINY),
    }


def _engine(path: Path, **kw: Any) -> LLMEngine:
    # Blocks of 8: short prompts still fill cached blocks, and a 32-key tile gathers 4 blocks.
    cfg = dict(model=str(path), device="cpu", max_model_len=256, dtype="float32", block_size=8)
    return LLMEngine(EngineConfig(**{**cfg, **kw}))


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def _tokens(outs: list[Any]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def _float_workload(engine: LLMEngine) -> list[list[int]]:
    """With a 12-token step budget: a 20-token prompt alone (chunks of 12 and 8, the second
    attending to the first's KV, then batch-1 decodes: split-K), then eight prompts sharing
    its first two blocks (prefix-cache hits, prefills over cached KV) that decode as a batch
    of eight (8 x 2 KV heads: enough programs for no split)."""
    rng = random.Random(3)
    shared = [rng.randrange(100, 40000) for _ in range(20)]
    first = engine.generate([shared], _greedy(3))
    batch = [shared[:16] + [rng.randrange(100, 40000) for _ in range(rng.randint(1, 3))] for _ in range(8)]
    return _tokens(first) + _tokens(engine.generate(batch, _greedy(3)))


# ---- tests ----


@pytest.mark.parametrize("case", ["llama-fp32", "qwen2-fp16", "llama-fp32-fp8kv"])
def test_rehearsal_greedy_tokens_equal_the_torch_path(
    case: str, tiny_models: dict[str, Path], rehearse: Callable[[bool], None], launches: Launches,
) -> None:
    arch, dtype, *kv = case.split("-")
    kw = dict(dtype={"fp32": "float32", "fp16": "float16"}[dtype], max_num_batched_tokens=12,
              kv_cache_dtype="fp8" if kv else "auto", calculate_kv_scales=bool(kv))
    want = _float_workload(_engine(tiny_models[arch], **kw))
    assert not launches.counts, "the torch path launched Triton kernels"
    rehearse(True)
    engine = _engine(tiny_models[arch], **kw)
    # A GPU stores the KV in the activation dtype; the rehearsal does the same.
    kv_dtype = torch.float8_e4m3fn if kv else {"fp32": torch.float32, "fp16": torch.float16}[dtype]
    assert engine.runner.kv_caches[0][0].dtype == kv_dtype
    got = _float_workload(engine)
    assert got == want
    wanted = FLOAT_PATH | ({"rotary fp8 KV write", "attention fp8 KV"} if kv else set())
    assert not launches.missing(wanted), dict(launches.counts)
    assert engine.stats().prefix_cache_hit_tokens >= 8 * 16


@pytest.mark.parametrize("quant, kernels", [
    ("awq", {"awq gemv split-K", "awq gemm"}),
    ("int8", {"int8 w8a16 gemv split-K", "int8 w8a16 gemm"}),
    ("int8-w8a8", {"int8 w8a8 gemv split-K", "int8 w8a8 gemm", "int8 per-token quant"}),
    ("fp8", {"fp8 w8a8 gemv split-K", "fp8 w8a8 gemm", "fp8 per-token quant"}),
])
def test_rehearsal_quantized_gemms_equal_their_torch_references(
    quant: str, kernels: set[str], tiny_models: dict[str, Path], rehearse: Callable[[bool], None],
    launches: Launches, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Both runs are rehearsals; the reference pins the quantized GEMMs to their torch
    # references (LOCALLLM_GEMM_BACKEND=torch), which on a GPU compute what the kernels must
    # (FP8 W8A8 included, which the CPU path otherwise runs as W8A16).
    rehearse(True)
    prompts = [list(range(300, 315)), [7, 8, 9]]  # 18 rows: the GEMM tiles; then a GEMV decode of 2

    def run(backend: str) -> tuple[list[list[int]], list[list[float]]]:
        monkeypatch.setattr(_triton, "_FORCED", backend)
        engine = _engine(tiny_models["llama"], quant=quant)
        outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, logprobs=0))
        return _tokens(outs), [[next(iter(lp.values())) for lp in o.outputs[0].logprobs] for o in outs]

    want, want_lp = run("torch")
    assert launches.counts["attention prefill"] and launches.missing(kernels) == kernels  # torch GEMMs only
    launches.counts.clear()
    got, got_lp = run("auto")
    assert got == want
    assert torch.allclose(torch.tensor(got_lp), torch.tensor(want_lp), atol=1e-3)
    assert not launches.missing(kernels | {"rotary+kv write", "attention decode split-K"}), dict(launches.counts)


def test_rehearsal_batching_invariance_under_preemption_and_aborts(
    tiny_models: dict[str, Path], rehearse: Callable[[bool], None], launches: Launches,
) -> None:
    # 8 blocks x 8 tokens cannot hold every request at once, so the scheduler preempts; a
    # 16-token step budget mixes chunked prefills with decodes. Each request's batched tokens
    # (rehearsal) must equal its solo run on the torch path.
    engine = _engine(tiny_models["qwen2"], num_kv_blocks=8, max_num_batched_tokens=16)
    rng = random.Random(11)
    requests = []
    for i in range(8):
        prompt = [rng.randrange(100, 40000) for _ in range(rng.randint(3, 20))]
        params = _greedy(rng.randint(2, 7))
        arrival = rng.randint(0, 3)
        abort_at = arrival + rng.randint(1, 5) if i % 4 == 3 else None
        requests.append((f"r{i}", prompt, params, arrival, abort_at))

    rehearse(True)
    results: dict[str, list[int] | None] = {}
    for step in range(300):
        for rid, prompt, params, arrival, abort_at in requests:
            if arrival == step:
                engine.add_request(prompt, params, rid)
            if abort_at == step and rid in engine.requests:
                engine.abort_request(rid)
                results[rid] = None
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.outputs[0].token_ids
        if step > 5 and not engine.has_unfinished():
            break
    assert not engine.has_unfinished()
    assert engine.scheduler.num_preemptions > 0, "the pool was meant to force preemption"
    assert any(r is None for r in results.values()), "some request was meant to be aborted"
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks)
    assert not launches.missing(FLOAT_PATH - {"attention decode"}), dict(launches.counts)

    rehearse(False)
    for rid, prompt, params, _, abort_at in requests:
        if results.get(rid) is None:
            assert abort_at is not None
            continue
        assert results[rid] == _tokens(engine.generate([prompt], params))[0], rid


def test_rehearsal_refuses_bf16(tiny_models: dict[str, Path], rehearse: Callable[[bool], None]) -> None:
    rehearse(True)
    with pytest.raises(LocalLLMError, match="bf16"):
        _engine(tiny_models["llama"], dtype="bfloat16")


def test_the_environment_switch_rehearses_a_cli_run(tiny_models: dict[str, Path]) -> None:
    """``LOCALLLM_TRITON_ON_CPU=1 localllm run`` alone (it sets TRITON_INTERPRET=1 itself)
    gives the torch path's tokens, through the kernels."""
    path, prompt = tiny_models["llama"], "The quick brown fox"
    want = _tokens(_engine(path).generate([prompt], _greedy(3)))[0]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = """if True:
        import importlib, sys
        from localllm.kernels import _triton
        from localllm.cli import main
        assert _triton.rehearsing() and _triton.INTERPRET
        kernel = importlib.import_module("localllm.kernels.paged_attention")._paged_attention_kernel
        launches, run = [], kernel.run
        kernel.run = lambda *a, **kw: launches.append(1) or run(*a, **kw)
        rc = main(["run", "--model", sys.argv[1], "--raw", "--json", "--dtype", "float32", "--device", "cpu",
                   "--max-tokens", "3", "--temperature", "0", "--max-model-len", "256", sys.argv[2]])
        sys.exit(rc if launches else "no attention kernel launched")
    """
    result = subprocess.run([sys.executable, "-c", code, str(path), prompt], capture_output=True, text=True,
                            cwd=REPO, env={**env, "LOCALLLM_TRITON_ON_CPU": "1"}, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout)["output_token_ids"] == want


# ---- graph-capture safety, tuning progress and the tuning cache ----


class NoHostSync(TorchDispatchMode):
    """Rejects every op that would make a GPU wait for the host or the host for the GPU, which
    CUDA-graph capture forbids (or silently bakes in): reading a value (``.item()``, ``bool(t)``,
    ``int(t)``, ``.tolist()``: ``_local_scalar_dense``), ops whose output shape depends on the
    data (``nonzero``, ``masked_select``, ``unique``, boolean-mask indexing), whole-tensor
    comparisons answered on the host (``equal``, ``is_nonzero``), and tensors made from host
    data or copied across devices (``lift_fresh``: ``torch.tensor(...)`` inside the forward is
    a host-to-device copy on a GPU). On CPU all of these are cheap, which is why only this
    check catches them before a GPU does."""

    FORBIDDEN = {
        torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default,
        torch.ops.aten.masked_select.default, torch.ops.aten._unique2.default, torch.ops.aten.unique_dim.default,
        torch.ops.aten.unique_consecutive.default, torch.ops.aten.is_nonzero.default, torch.ops.aten.equal.default,
        torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default,
        torch.ops.aten.repeat_interleave.Tensor, torch.ops.aten.bincount.default,
    }  # fmt: skip

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        self.ops[str(func)] += 1
        if func in self.FORBIDDEN:
            raise AssertionError(f"host sync inside a graph bucket's forward: {func}")
        if func in (torch.ops.aten.index.Tensor, torch.ops.aten.index_put_.default, torch.ops.aten.index_put.default):
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] if i is not None):
                raise AssertionError(f"boolean-mask indexing (a nonzero) inside a graph bucket's forward: {func}")
        if func in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default):
            devices = {a.device for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)}
            target = kwargs.get("device")
            if len(devices | ({torch.device(target)} if target is not None else set())) > 1:
                raise AssertionError(f"a copy across devices inside a graph bucket's forward: {func}")
        return func(*args, **kwargs)


def test_no_host_sync_rejects_what_a_capture_cannot_hold() -> None:
    x = torch.arange(6.0)
    for bad in (lambda: x.sum().item(), lambda: x[x > 2], lambda: torch.nonzero(x), lambda: torch.tensor([1, 2]),
                lambda: bool(x.any()), lambda: x.unique()):
        with pytest.raises(AssertionError, match="graph bucket"), NoHostSync():
            bad()
    with NoHostSync() as mode:  # what a decode does: shape-static tensor ops
        (x * 2).index_select(0, torch.zeros(2, dtype=torch.long)).softmax(0)
    assert mode.ops


def _autotuned_keys() -> set[tuple[Any, ...]]:
    keys: set[tuple[Any, ...]] = set()
    for mod in (awq_gemm_mod, int8_gemm_mod):
        for name, tuner in mod._tuned.items():
            keys |= {(mod.__name__, name, k) for k in dict.keys(tuner.cache)}
    return keys


def test_capture_warms_each_bucket_reports_progress_and_tunes_once_per_machine(
    tiny_models: dict[str, Path], rehearse: Callable[[bool], None], monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    """``_capture_graphs`` in a rehearsal (AWQ: autotuned GEMVs, dispatcher GEMM choices): the
    warm-up makes every shape-dependent choice, with "tuning kernels" and "capturing CUDA
    graphs" progress each ending at N/N; each bucket's forward then runs again, as a capture
    would, with no host sync and without adding a single autotune key or GEMM choice; and a
    second start on the same cache folder tunes nothing (the picks come from disk)."""
    from localllm.engine import model_runner
    from localllm.kernels import tuning

    rehearse(True)
    # the tuning store in a fresh folder (not LOCALLLM_CACHE_DIR: the CPU kernels' build lives there too)
    monkeypatch.setattr(tuning, "compiled_cache_dir", lambda: tmp_path)

    def start() -> tuple[Any, list[tuple[str, int, int]]]:
        # a new process: no autotuner, GEMM choice or store in memory yet
        monkeypatch.setattr(awq_gemm_mod, "_tuned", {})
        monkeypatch.setattr(_triton, "_CHOICES", {})
        monkeypatch.setattr(tuning, "_stores", {})
        runner = _engine(tiny_models["llama"], quant="awq", max_num_seqs=2).runner
        calls: list[tuple[str, int, int]] = []
        runner._capture_graphs(2, lambda stage, done, total: calls.append((stage, done, total)))
        return runner, calls

    runner, calls = start()
    assert runner.buckets == [1, 2]
    capture = [c for c in calls if c[0] == model_runner.CAPTURE_STAGE]
    assert capture == [(model_runner.CAPTURE_STAGE, 0, 2), (model_runner.CAPTURE_STAGE, 1, 2),
                       (model_runner.CAPTURE_STAGE, 2, 2)]  # fmt: skip
    tuned = [c for c in calls if c[0] == model_runner.TUNING_STAGE]
    assert tuned == [(model_runner.TUNING_STAGE, 0, 2), (model_runner.TUNING_STAGE, 1, 2),
                     (model_runner.TUNING_STAGE, 2, 2)]  # both buckets tuned (their own M), once each
    keys, choices = _autotuned_keys(), dict(_triton.gemm_choices())
    assert keys and choices, "the AWQ decode made no shape-dependent choice"
    assert {k[0] for k in choices} == {"awq"} and {k[1] for k in choices} == {1, 2}  # both buckets' M

    with NoHostSync() as mode:
        outs = {b: runner._decode_call(b).clone() for b in runner.buckets}
    assert mode.ops["aten.embedding.default"] == 2  # each bucket's forward ran under the check
    assert all(o.shape[0] == b and torch.isfinite(o).all() for b, o in outs.items())
    assert _autotuned_keys() == keys and _triton.gemm_choices() == choices

    assert len(list(tmp_path.glob("tuning/*.json"))) == 1
    _, calls = start()
    assert not [c for c in calls if c[0] == model_runner.TUNING_STAGE], calls
    assert _autotuned_keys() == keys  # the same picks, read from the file
