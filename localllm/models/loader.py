"""The load pipeline: resolve a model (pulling it if needed), open its checkpoint, plan
against this machine, build the model on its device and stream the weights in, swapping in
quantized or GGUF block linears on the way. The result is a ``LoadedModel``.

The formats themselves are read elsewhere (``models.formats``, ``models.hf``,
``models.gguf_file``) and written by ``models.export``; this file only decides and drives.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from localllm.errors import LocalLLMError
from localllm.kernels import cpu_build
from localllm.models.checkpoint import Checkpoint, WeightIter
from localllm.models.formats import open_checkpoint
from localllm.models import registry
from localllm.models.llama import LlamaForCausalLM
from localllm.tokenizer import Tokenizer

if TYPE_CHECKING:
    from localllm.hardware.planner import Beside, Plan
    from localllm.hardware.probe import Hardware
    from localllm.hardware.sizing import GGUFWeights
    from localllm.quant.gguf_modules import BlockKernels


def build_model(
    ckpt: Checkpoint,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    progress: Callable[[int, int], None] | None = None,
    quantize: Callable[[LlamaForCausalLM], None] | None = None,
    weight_options: dict[str, Any] | None = None,
) -> LlamaForCausalLM:
    """Materialises the model on ``device`` in ``dtype`` and streams the checkpoint into it.

    ``progress(done, total)`` is called after each tensor. ``quantize`` swaps linears for
    quantized ones before loading (checkpoints that are already quantized) — see localllm.quant.
    ``weight_options`` go to ``ckpt.weights`` (which GGUF tensors stay blocks).
    """
    with torch.device("meta"):
        model = registry.model_class(ckpt.config)(ckpt.config)
    if quantize is not None:
        quantize(model)
    _cast_on_meta(model, dtype)
    tied = ckpt.config.tie_word_embeddings and isinstance(model.lm_head, torch.nn.Linear)
    if tied:
        # to_empty visits a shared Parameter once per owner and would allocate it twice
        model.lm_head._parameters["weight"] = None
    # what to_empty does, without its empty_like of a meta tensor: that runs torch's Python
    # reference, which imports sympy and torch's symbolic shapes (~0.3-1 s of every start)
    model = model._apply(lambda t: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device))
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    done = 0

    def counted() -> WeightIter:
        nonlocal done
        for item in ckpt.weights(**(weight_options or {})):
            yield item
            done += 1
            if progress is not None:
                progress(done, ckpt.num_tensors)

    loaded = model.load_weights(counted())
    missing = sorted(model.expected_weights() - loaded)
    if missing:
        raise LocalLLMError(
            f"{ckpt.path}: checkpoint lacks {len(missing)} tensors, e.g. {missing[0].split('#')[0]!r}"
        )
    model.init_rope(max_positions)
    return model.eval()


def _cast_on_meta(model: LlamaForCausalLM, dtype: torch.dtype) -> None:
    """Gives every floating Parameter its final dtype while the model is still on the meta
    device, so that ``to_empty`` allocates each tensor once, as it will stay.

    Invariant: from ``to_empty`` on, the device holds the final weights and, while one streams
    in, that one checkpoint tensor (and the temporaries of quantizing one linear). Casting
    after ``to_empty`` would first materialise the whole model in fp32: 32 GB for an 8B model
    planned in bf16 on a 24 GB card. Buffers keep their dtypes (quantized codes, fp16 AWQ
    scales, fp32 weight scales)."""
    for p in model.parameters():
        if p.is_floating_point():
            p.data = p.data.to(dtype)
    # The final norm feeds the logits; in fp32 its output lets compute_logits refine the top
    # candidates exactly (see there). It is one vector.
    model.model.norm.weight.data = model.model.norm.weight.data.float()


@dataclass(slots=True)
class LoadedModel:
    """A model on its device and what it was built by: the planner's ``plan`` (immutable, the
    planner's reasons only) and ``notes``, one line per way loading departed from the plan (a
    KV pool size or method asked for outright, the rehearsal's KV dtype), which front ends show
    beside the plan's reasons."""

    name: str
    path: Path
    model: LlamaForCausalLM
    tokenizer: Tokenizer
    plan: Plan
    precision: str  # what the status bar shows: float32, bfloat16, fp8, int8, awq
    device: torch.device
    kv_dtype: torch.dtype
    max_model_len: int
    num_kv_blocks: int
    use_cuda_graphs: bool
    predicted_bytes: int
    notes: tuple[str, ...] = ()


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Plan KV dtype names -> torch storage dtypes ("fp8" is e4m3, as vLLM's "fp8").
_KV_DTYPES = {**_DTYPES, "fp8": torch.float8_e4m3fn}


def _release_loader_memory() -> None:
    """Hands the loader's freed buffers back to the OS. glibc raises its mmap threshold after
    large frees, so dequantization temporaries end up on the heap and stay in RSS (measured:
    64 MB on the default model) until trimmed."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass


def _notes_beyond(
    plan: Plan, kv_dtype: torch.dtype, max_len: int, max_context: int, blocks: int, method: str | None
) -> list[str]:
    """One line for each way the loaded model differs from ``plan``, which stays as the planner
    made it (the planner is a Plan's one writer)."""
    notes = []
    if kv_dtype != _KV_DTYPES[plan.kv_dtype]:
        notes.append(f"KV cache {str(kv_dtype).removeprefix('torch.')}, not the plan's {plan.kv_dtype}:"
                     " LOCALLLM_TRITON_ON_CPU=1 stores what a GPU would, the activation dtype")
    if max_len != plan.max_model_len:
        notes.append(f"max_model_len {max_len:,}, not the plan's {plan.max_model_len:,} (the model's context:"
                     f" {max_context:,})")
    if blocks != plan.num_kv_blocks:
        notes.append(f"KV pool {blocks:,} blocks as asked, not the plan's {plan.num_kv_blocks:,}")
    if method in ("rtn4", "int8-w8a8") and method != plan.quant:
        notes.append(f"{method} weights as asked, planned as {plan.quant} (they store alike)")
    return notes


def _gguf_kernels(triton: bool) -> BlockKernels:
    """Whose kernels run a GGUF plan's blocks: the GPU's Triton kernels (on CUDA, and in a
    rehearsal) or the CPU's."""
    from localllm.quant import gguf_modules

    if triton:
        from localllm.quant.gguf_cuda import TRITON

        return TRITON
    return gguf_modules.CPU


def gguf_plan_inputs(
    ckpt: Checkpoint, hw: Hardware, dtype: str = "auto", asked: bool = False
) -> tuple[str | None, str | None, GGUFWeights | None]:
    """What the planner gets for a GGUF checkpoint on ``hw``: ``(cpu_gguf, gpu_gguf, gguf)``,
    the reason line for the CPU's or the GPU's kernels (the one that will run the blocks) and
    the file's tensors sized as those kernels hold them; all None where no linear of the file
    has a kernel (then the file is dequantized and planned like a float checkpoint).

    The blocks run on the GPU's Triton kernels on a GPU plan (and in a rehearsal, which runs
    the GPU's code path on CPU tensors), else on the CPU's; a CPU plan computes in fp32, so
    there an asked dtype leaves the blocks. ``asked``: --quant gguf, which fails in one line
    where no linear can stay in its blocks. No timing decides: a start beside a busy program
    once measured bf16 faster and took it."""
    from localllm.kernels._triton import rehearsing
    from localllm.models.gguf_file import gguf_weights_from_file
    from localllm.quant import gguf_modules

    on_gpu = hw.gpu is not None
    if not (dtype == "auto" or on_gpu):
        return None, None, None
    kernels = _gguf_kernels(on_gpu or rehearsing())
    tied = ckpt.config.tie_word_embeddings
    if not gguf_modules.has_kept_linears(ckpt.block_types, tied, kernels):
        if asked:
            needs = ("Triton" if kernels.name == "triton"
                     else "localllm's CPU kernels (a C++ compiler)")
            raise LocalLLMError(f"--quant gguf needs {needs} and a file with linears in a type they take"
                                " (see docs/quantization.md)")
        return None, None, None
    from localllm.kernels import cpu_ops

    isa = cpu_ops.gguf_kernels() if kernels.name == "cpu" else None  # x86 or generic (kernels/cpu/gguf/dispatch.h)
    line = gguf_modules.reason_line(ckpt.block_types, tied, kernels, isa)
    weights = replace(gguf_weights_from_file(ckpt.path), kernels=kernels.name)
    return (None, line, weights) if on_gpu else (line, None, weights)


def kernel_needs(ckpt: Checkpoint) -> cpu_build.Needs:
    """What this checkpoint runs on the CPU kernels: its attention head dims, its GGUF block
    types and whether those include experts (what a first kernel build compiles first)."""
    gguf_types = frozenset(ckpt.block_types.values()) if ckpt.format == "gguf" else frozenset()
    return cpu_build.Needs(frozenset(s.head_dim for s in ckpt.config.kv_spec()), gguf_types,
                           bool(gguf_types) and ckpt.config.num_experts > 0)


def plan_checkpoint(
    ckpt: Checkpoint, path: Path, name: str, *, dtype: str = "auto", device: str | None = None,
    quant: str | None = None, context: int | None = None, chats: int = 4, block_size: int = 16,
    gpu_memory_utilization: float = 0.9, kv_cache_dtype: str = "auto", compile: bool = True,
    beside: Beside | None = None,
) -> Plan:
    """The plan ``load_model`` builds an opened checkpoint by, on this machine (``device``
    forced when given); nothing is loaded. ``quant`` is a checked method name or None."""
    from localllm.hardware.planner import plan as make_plan
    from localllm.hardware.probe import probe_hardware

    cfg = ckpt.config
    hw = probe_hardware()
    if device is not None and device not in ("cpu", "cuda"):
        raise LocalLLMError(f"--device {device!r}: use cpu or cuda")
    if device == "cuda" and hw.gpu is None:
        why = next((n.removeprefix("no NVIDIA GPU: ").removesuffix("; planning for the CPU") for n in hw.notes
                    if n.startswith("no NVIDIA GPU")), "no CUDA GPU is usable here")
        raise LocalLLMError(f"--device cuda: {why}; use --device cpu")
    if device == "cpu":
        hw = replace(hw, gpus=())
    pre_quant = (cfg.quantization or {}).get("quant_method")
    # The planner sizes memory for fp8/int8/awq; rtn4 stores like awq, int8-w8a8 like int8.
    plan_quant = {"rtn4": "awq", "int8-w8a8": "int8", "none": None}.get(quant, quant) if quant else None
    if pre_quant:
        plan_quant = "fp8" if pre_quant == "compressed-tensors" else pre_quant
    if quant == "gguf" and ckpt.format != "gguf":
        raise LocalLLMError(f"--quant gguf keeps a GGUF file's blocks, but {path.name} is not a .gguf file")
    cpu_gguf = gpu_gguf = gguf_weights = None
    if ckpt.format == "gguf" and not pre_quant and quant in (None, "gguf"):
        cpu_gguf, gpu_gguf, gguf_weights = gguf_plan_inputs(ckpt, hw, dtype, quant == "gguf")
    return make_plan(
        cfg, hw, context=context, chats=chats, quant=None if quant == "gguf" else plan_quant,
        dtype=None if dtype == "auto" else dtype, gpu_memory_utilization=gpu_memory_utilization,
        block_size=block_size, cpu_gguf=cpu_gguf, cpu_compile=compile, name=name,
        kv_cache_dtype=kv_cache_dtype, gguf=gguf_weights, gpu_gguf=gpu_gguf, beside=beside,
    )


def load_model(
    name: str | None,
    *,
    dtype: str = "auto",
    device: str | None = None,
    quant: str | None = None,
    max_model_len: int | None = None,
    context: int | None = None,
    chats: int = 4,
    num_kv_blocks: int | None = None,
    block_size: int = 16,
    gpu_memory_utilization: float = 0.9,
    kv_cache_dtype: str = "auto",
    progress: Callable[[str, int, int], None] | None = None,
    compile: bool = True,
    beside: Beside | None = None,
) -> LoadedModel:
    """Resolves (pulling if needed), plans against this machine, and loads. ``progress`` gets
    ``(stage, done, total)``. ``beside``: a draft model sharing the memory budget."""
    from localllm import store
    from localllm.kernels._triton import rehearsing

    if quant is not None:
        from localllm.quant import check_method

        quant = check_method(quant)  # an unknown method fails before the model is fetched
    path = store.resolve(name)
    ckpt = open_checkpoint(path)
    cfg = ckpt.config
    cpu_build.expect(kernel_needs(ckpt), progress)  # before any kernel call: a first build stages for it
    plan = plan_checkpoint(
        ckpt, path, name or store.DEFAULT_MODEL, dtype=dtype, device=device, quant=quant,
        context=max_model_len or context, chats=chats, block_size=block_size,
        gpu_memory_utilization=gpu_memory_utilization, kv_cache_dtype=kv_cache_dtype, compile=compile, beside=beside,
    )
    pre_quant = (cfg.quantization or {}).get("quant_method")
    dev = torch.device(plan.device)
    torch_dtype = _DTYPES[plan.weight_dtype]
    kv_dtype = _KV_DTYPES[plan.kv_dtype]
    if rehearsing() and dev.type == "cpu":
        if torch_dtype == torch.bfloat16:
            raise LocalLLMError(
                "LOCALLLM_TRITON_ON_CPU=1 runs the Triton kernels under the interpreter, which computes bf16"
                " wrongly: pass --dtype float32 or --dtype float16")
        if kv_dtype == torch.float32:
            kv_dtype = torch_dtype  # what a GPU would store: the activation dtype
    max_len = min(max_model_len or plan.max_model_len, cfg.max_context)
    blocks = num_kv_blocks or plan.num_kv_blocks
    # An explicit method wins over the plan's label (rtn4 and int8-w8a8 plan as awq and int8).
    method = pre_quant or (quant if quant not in (None, "none") else plan.quant)
    notes = _notes_beyond(plan, kv_dtype, max_len, cfg.max_context, blocks, method)

    swap = None
    weight_options: dict[str, Any] = {}
    if method == "gguf":
        from localllm.quant import gguf_modules

        kernels = _gguf_kernels(dev.type == "cuda" or rehearsing())
        raw: set[str] = set()  # filled by the swap, read when the weights start streaming

        def swap(m: LlamaForCausalLM) -> None:
            raw.update(gguf_modules.plan_gguf_modules(m, ckpt.block_types, cfg.tie_word_embeddings, kernels))

        weight_options = {"raw": raw, "head_from_embedding": cfg.tie_word_embeddings}
        method = gguf_modules.precision_label(ckpt.block_types, cfg.tie_word_embeddings, kernels)
    elif pre_quant:
        from localllm.quant import prepare_for_checkpoint

        swap = lambda m: prepare_for_checkpoint(m, cfg.quantization)  # noqa: E731
    elif method:
        # Online: each linear is quantized as its last shard arrives, so the 16-bit weights
        # never sit on the device whole.
        from localllm.quant import prepare_online

        swap = lambda m: prepare_online(m, method)  # noqa: E731
    report = (lambda d, t: progress("loading", d, t)) if progress else None
    model = build_model(ckpt, torch_dtype, dev, max_len, report, swap, weight_options)
    _release_loader_memory()
    return LoadedModel(
        name=name or store.DEFAULT_MODEL, path=path, model=model, tokenizer=ckpt.tokenizer, plan=plan,
        precision=method or plan.weight_dtype, device=dev, kv_dtype=kv_dtype,
        max_model_len=max_len, num_kv_blocks=blocks, use_cuda_graphs=plan.use_cuda_graphs,
        predicted_bytes=plan.expected_measured_bytes, notes=tuple(notes),
    )

