"""Turns a scheduled batch into one forward pass over the paged KV cache.

The batch is flat (varlen): the new tokens of every sequence back to back, decodes first,
described by ``AttentionMetadata`` (engine/kv_cache.py makes it, and owns the KV pool the
runner steps over), so the Python work per step is one short loop over sequences.
Pure-decode steps run on static input buffers (the batch padded to a size bucket, padding
rows writing nowhere), which the step writes row by row through numpy views: on CUDA they
replay CUDA graphs captured per bucket; on CPU they call the forward compiled by
torch.compile (Inductor's C++ backend), which removes the per-op dispatch of ~2,500 small
ops a step and fuses norm, rotary and SiLU-mul. Prefill and mixed steps run eager: their
matmuls dwarf the dispatch.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import importlib
import inspect
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from pathlib import Path

import torch

from localllm.engine.kv_cache import KVCache, varlen_metadata
from localllm.engine.scheduler import ScheduledBatch
from localllm.engine.sequence import Sequence
from localllm.hardware.probe import cpus_for_threads
from localllm.kernels import cpu_ops
from localllm.models import forward_context
from localllm.models.llama import AttentionMetadata, LlamaForCausalLM

logger = logging.getLogger(__name__)

GRAPH_BATCH_SIZES = [1, 2, 4, 8] + list(range(16, 257, 16))
# _capture_graphs' progress stages (TUI status line, CLI bar)
CAPTURE_STAGE = "capturing CUDA graphs"
TUNING_STAGE = "tuning kernels for this GPU (first run only)"


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # rows of the hidden states that need the next token
    sampling_seqs: list[Sequence]


def _kernel_interface() -> str:
    """The C++ ops' schemas and their shape functions: all a saved graph knows of the CPU
    kernels. A graph calls each op through the dispatcher by name, so a kernel whose body
    changes (a faster AMX path, a lighter header) runs in the old graph unchanged; keying graphs
    by the kernels' whole source made every such change cost each model a multi-minute compile."""
    cpu_ops.load()  # built and loaded already wherever a graph is made; a no-op then
    ops = sorted(n for n in torch._C._dispatch_get_all_op_names() if n.startswith("localllm_cpu::"))
    schemas = "\n".join(str(torch._C._get_schema(n, "")) for n in ops)
    return schemas + "\0" + inspect.getsource(cpu_ops._register_fakes)


class ModelRunner:
    """Steps the model over its KV pool (``kv_cache``, a ``KVCache``: per layer a K and a V
    ``[num_blocks, block_size, kv_heads, head_dim]`` and for an FP8 pool the K and V scales,
    which never change after start-up).

    Invariant: after ``execute`` returns, the KV of every scheduled token is in the pool at the
    slot its sequence's block table gives for its position.
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        num_blocks: int,
        block_size: int,
        kv_dtype: torch.dtype,
        max_model_len: int,
        use_cuda_graphs: bool = False,
        max_graph_batch: int = 256,
        compile_cpu: bool = False,
        decode_buckets: list[int] | None = None,
        progress: Callable[[str, int, int], None] | None = None,
        kv_scales: Seq[tuple[float, float]] | None = None,
        compile_in_background: bool = False,
    ) -> None:
        """``compile_cpu``: decode through torch.compile on a CPU device. ``decode_buckets``
        forces the static-buffer decode path with these batch buckets and no capture or
        compile (the CUDA-graph bookkeeping, rehearsed eagerly; tests use it). ``kv_scales``:
        (k_scale, v_scale) per layer for an FP8 pool; default 1.0 (vLLM's).
        ``compile_in_background``: decode graphs missing from disk are built on a thread while
        the eager path serves (``_compile_decode``)."""
        self.model = model
        self.device = model.device
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        # the pool, built from the model's per-layer KV spec and attached to its attention
        # layers by its one owner; its pages are held soon after, off this thread
        self.kv_cache = KVCache.for_model(model, num_blocks, block_size, kv_dtype, kv_scales)
        self.kv_cache.reserve_in_background()
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # The static-buffer decode path: batch buckets and the callable that runs one bucket.
        self.buckets: list[int] = []
        self._decode_call: Callable[[int], torch.Tensor] | None = None
        self._decode_gives_logits = False  # the compiled path folds compute_logits in
        self._unguarded: dict[int, Callable[..., torch.Tensor]] = {}  # 1: batch 1, 2: larger
        self.graphs_compiled = 0  # decode graphs compiled in this process, not loaded from disk
        # "" (no compiled path), "loading" or "compiling" (the saved graphs, the missing ones: in
        # the background, the eager path serving meanwhile), "done", "failed" (decoding stays
        # eager); written by the compile thread, then by _use_graphs
        self.compile_state = ""
        self._compile_thread: threading.Thread | None = None
        self._compile_done = threading.Event()  # the compile thread has ended
        self._built: dict[int, Callable[..., torch.Tensor]] | None = None  # built, not yet switched to
        self._cancelled = False  # stop_compile() was called: the compile thread stops at its next graph
        # the first step has begun / has ended (the compile thread waits for them)
        self._stepping = threading.Event()
        self._stepped = threading.Event()
        # the CPUs the forward's OpenMP threads are bound to, one per core (None: the OS places them)
        self.thread_cpus = _thread_cpus() if self.device.type == "cpu" else None
        self._bound_for_good: threading.Thread | None = None  # the thread keep_threads_bound bound
        if use_cuda_graphs and self.device.type == "cuda":
            self._capture_graphs(max_graph_batch, progress)
        elif decode_buckets:
            self._init_static_buffers(sorted(decode_buckets))
            self._decode_call = self._run_bucket_eager
        elif compile_cpu and self.device.type == "cpu":
            # every batch size is its own bucket: CPU steps cost by rows, so padding would be
            # waste, and Inductor's dynamic shapes serve all sizes from two graphs (1 and >1)
            self._init_static_buffers(list(range(1, max_graph_batch + 1)))
            self._compile_decode(progress, compile_in_background)

    @property
    def kv_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's (K, V) pool tensors (``KVCache.layers``)."""
        return self.kv_cache.layers

    @property
    def kv_scales(self) -> torch.Tensor:
        """The FP8 scales ``[2, layers, 1]`` (``KVCache.scales``)."""
        return self.kv_cache.scales

    @property
    def kv_bytes(self) -> int:
        return self.kv_cache.nbytes

    # ---- inputs ----

    def prepare(self, batch: ScheduledBatch) -> StepInputs:
        seqs, counts = batch.seqs, batch.num_new_tokens
        input_ids: list[int] = []
        starts: list[int] = []
        tables: list[list[int]] = []
        sampling: list[Sequence] = []
        logits_rows: list[int] = []
        row = 0
        for seq, n in zip(seqs, counts):
            start = seq.num_computed_tokens
            drafts = seq.spec_token_ids  # a speculative decode: its last token, then the proposals
            input_ids += seq.token_ids[start : start + n - len(drafts)]
            input_ids += drafts
            starts.append(start)
            tables.append(seq.block_table)
            row += n
            if start + n - len(drafts) == seq.num_tokens:  # the prompt is done: this row yields a token
                sampling.append(seq)
                logits_rows.extend(range(row - 1 - len(drafts), row))  # and each proposal's row one
        dev = self.device
        positions, meta = varlen_metadata(starts, counts, tables, self.block_size, batch.num_decodes, dev)
        return StepInputs(
            torch.tensor(input_ids, dtype=torch.int64).to(dev, non_blocking=True),
            positions,
            meta,
            torch.tensor(logits_rows, dtype=torch.int64).to(dev, non_blocking=True),
            sampling,
        )

    # ---- execution ----

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> tuple[list[Sequence], torch.Tensor | None]:
        """The forward pass: the sequences that yield a token this step, and their logits
        (None when every sequence is mid-prefill): one row per sequence, in order, but
        ``1 + len(seq.spec_token_ids)`` consecutive rows for a speculative decode (its next
        position's, then each proposal's). Sampling is the engine's, so that one request's
        sampling failure stays that request's.

        On a CPU the calling thread's OpenMP team runs bound to ``thread_cpus``; the calling
        thread gets its own affinity back afterwards unless ``keep_threads_bound`` made it
        the engine's own (it may be the caller's, whose later threads would inherit it)."""
        if not self._stepping.is_set():
            self._stepping.set()
        try:
            with self._bound_threads():
                return self._execute(batch)
        finally:
            if not self._stepped.is_set():
                self._stepped.set()

    def keep_threads_bound(self) -> None:
        """Binds the calling thread's team for good: for a thread that only runs the engine.
        Giving the thread its affinity back after each step let the scheduler move it between
        steps, and 16 streams through the server ran ~9% slower (median of 6 trials each)."""
        if self.thread_cpus is not None:
            cpu_ops.bind_threads(self.thread_cpus)
            self._bound_for_good = threading.current_thread()

    @contextlib.contextmanager
    def _bound_threads(self) -> Iterator[None]:
        if self.thread_cpus is None or threading.current_thread() is self._bound_for_good:
            yield
            return
        mask = os.sched_getaffinity(0)
        cpu_ops.bind_threads(self.thread_cpus)
        try:
            yield
        finally:
            os.sched_setaffinity(0, mask)

    def _execute(self, batch: ScheduledBatch) -> tuple[list[Sequence], torch.Tensor | None]:
        if self._built is not None:
            self._switch()
        self.kv_cache.copy_blocks(batch.block_copies)
        # a speculative decode's positions are decode rows too (``_stage_decode``)
        n = batch.num_tokens
        if (self._decode_call is not None and batch.num_decodes + batch.num_speculative == len(batch.seqs)
                and n <= self.buckets[-1]):
            b = self._stage_decode(batch.seqs, n)
            out = self._decode_call(b)  # hidden states, or logits (compiled)
            if b != n:  # padding rows; a CPU bucket is its batch size (a slice here was 50 us, cold after the forward)
                out = out[:n]
            return batch.seqs, out if self._decode_gives_logits else self.model.compute_logits(out)
        inputs = self.prepare(batch)
        with forward_context.batch_rows(batch.num_decodes, batch.num_new_tokens[batch.num_decodes :]):
            hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta)
        if not inputs.sampling_seqs:
            return [], None
        return inputs.sampling_seqs, self.model.compute_logits(hidden[inputs.logits_indices])

    # ---- CUDA graphs (decode only) ----

    def decode_logits(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Logits of a decode batch through the same forward the engine's decode steps take
        (the compiled one on CPU when compiling), without the static buffers: for benchmarks
        that drive the model from a plain loop."""
        with self._bound_threads():  # as execute() runs
            if self._built is not None:
                self._switch()
            if self._decode_gives_logits:
                fn = self._unguarded[min(input_ids.shape[0], 2)]
                return _refined(fn(self.model, self.model.cos_sin, input_ids, positions, meta.slot_mapping,
                                   meta.query_start_loc, meta.seq_lens, meta.block_tables))
            return self.model.compute_logits(self.model(input_ids, positions, meta))

    def _init_static_buffers(self, sizes: list[int]) -> None:
        """Input buffers for the largest bucket; a bucket b uses their first b rows. Padding
        rows write nowhere (slot -1) and attend to one token of block 0; their outputs are
        discarded."""
        dev = self.device
        self.buckets = sizes
        top = sizes[-1]
        self._g_input_ids = torch.zeros(top, dtype=torch.int64, device=dev)
        self._g_positions = torch.zeros(top, dtype=torch.int64, device=dev)
        self._g_slots = torch.full((top,), -1, dtype=torch.int64, device=dev)
        self._g_seq_lens = torch.ones(top, dtype=torch.int32, device=dev)
        self._g_tables = torch.zeros(top, max(2, self.max_blocks_per_seq), dtype=torch.int32, device=dev)
        self._g_qsl = torch.arange(top + 1, dtype=torch.int32, device=dev)
        # the host side that _stage_decode writes: the buffers themselves on a CPU, pinned
        # copies for a GPU (a step's copies are done before the next step writes: it syncs on
        # its sampled tokens)
        self._host_tensors: tuple[torch.Tensor, ...] | None = None
        host = self._device_buffers()
        if dev.type != "cpu":
            self._host_tensors = host = tuple(t.cpu().pin_memory() for t in host)
        self._host = tuple(t.numpy() for t in host)
        # each bucket's views of the buffers, made once: a step then makes no tensor to call
        # the graph (seven slices were ~60 us of a batch-1 step, cold after the forward)
        self._bucket_args = {
            b: (self._g_input_ids[:b], self._g_positions[:b], self._g_slots[:b], self._g_qsl[: b + 1],
                self._g_seq_lens[:b], self._g_tables[:b])
            for b in sizes
        }  # fmt: skip

    def _bucket_meta(self, b: int) -> AttentionMetadata:
        _, _, slots, qsl, lens, tables = self._bucket_args[b]
        return AttentionMetadata(slots, qsl, lens, tables, b)

    def _run_bucket_eager(self, b: int) -> torch.Tensor:
        ids, pos = self._bucket_args[b][:2]
        return self.model(ids, pos, self._bucket_meta(b))

    def _run_bucket_compiled(self, b: int) -> torch.Tensor:
        return _refined(self._unguarded[min(b, 2)](self.model, self.model.cos_sin, *self._bucket_args[b]))

    def _compile_decode(self, progress: Callable[[str, int, int], None] | None, background: bool) -> None:
        """The decode step compiled for batch 1 and for any larger batch (one graph whose batch
        size is dynamic). Each graph is compiled ahead of time (``torch.compile(...).aot_compile``)
        and saved under our cache folder: a later start loads it (seconds) instead of tracing
        the model again (Dynamo's trace alone was ~15 s a graph at every start, on top of
        Inductor's own cache). With ``background``, the graphs on disk are loaded (seconds) and
        the missing ones built (minutes: the first start on a machine, a new torch or model) on
        a low-priority thread while the static-buffer eager path serves, and the engine thread
        switches to the compiled graphs between two steps (``_switch``); without, it is all
        done now."""
        # cpp_wrapper: the graph's ~30 x 25 kernel calls run from generated C++, not from a
        # generated Python function (measured: median step 36 -> 24 ms under load)
        cpp_wrapper = os.environ.get("LOCALLLM_CPP_WRAPPER", "1") != "0"
        sizes = [b for b in (1, 2) if b <= self.buckets[-1]]
        key = self._graph_key(cpp_wrapper)
        paths = {b: _graphs_dir() / f"decode-{key}-{'1' if b == 1 else 'n'}.bin" for b in sizes}
        self._decode_call = self._run_bucket_eager  # until the graphs are in
        missing = [b for b in sizes if not paths[b].is_file()]
        # "compiling" from the start when a graph will be built: `run` waits for it to save it
        # for the next start, /health says "optimizing" (the thread imports Inductor first)
        self.compile_state = "compiling" if missing else "loading"
        work = (cpp_wrapper, sizes, paths, progress)
        if not background:
            self._prepare_graphs(*work)
            self._switch()
            return
        # daemon: a process that exits (the TUI's ctrl+q, a finished `run`) never waits on it
        self._compile_thread = threading.Thread(target=self._compile_in_background, args=work,
                                                name="localllm-compile", daemon=True)
        _COMPILE_THREADS.add(self._compile_thread)
        _stop_compilers_at_exit()
        if missing and progress is not None:  # told now, before the first answer streams, not in the middle of it
            progress(COMPILING_STAGE, 0, len(missing))
        self._compile_thread.start()

    def _compile_in_background(
        self, cpp_wrapper: bool, sizes: list[int], paths: dict[int, Path],
        progress: Callable[[str, int, int], None] | None,
    ) -> None:
        """The compile thread: ``_prepare_graphs``, then off the list of running compiles."""
        try:
            self._prepare_graphs(cpp_wrapper, sizes, paths, progress)
        finally:
            _COMPILE_THREADS.discard(threading.current_thread())
            self._compile_done.set()

    def _prepare_graphs(
        self, cpp_wrapper: bool, sizes: list[int], paths: dict[int, Path],
        progress: Callable[[str, int, int], None] | None,
    ) -> None:
        """Loads the graphs saved on disk (~5 s for the default model's two: a warm start's
        largest cost, so off the first answer's path too), then builds those missing."""
        background = threading.current_thread() is self._compile_thread
        if background:
            _lower_priority()
            # Importing Inductor and loading the graphs (seconds of Python, holding the GIL)
            # would slow the eager first answer: start once the first step is done, however long
            # it takes (a loaded machine: seconds), or after a second with no step begun (a
            # server or chat with no request yet: nothing to slow down)
            if self._stepping.wait(FIRST_STEP_GRACE_S):
                self._stepped.wait()
            if self._cancelled:  # shut down meanwhile
                self.compile_state = "failed"
                return
        # Imports Inductor, and Dynamo with it (~1-4 s), on this thread, after the first step: the
        # eager path never imports them (custom ops are called as plain functions there:
        # kernels/opaque_op.py), so no other thread imports torch's modules meanwhile (two at once
        # handed the graph loader half-initialised ones: a saved graph then failed to load)
        _use_our_inductor_cache()
        report = progress if progress is not None and not background else None  # seconds: no bar mid-answer
        graphs: dict[int, Callable[..., torch.Tensor]] = {}
        on_disk = [b for b in sizes if paths[b].is_file()]
        for i, b in enumerate(on_disk):
            if report is not None:
                report(LOADING_STAGE, i, len(on_disk))
            fn = _load_graph(paths[b], self.model, (self.model.cos_sin, *self._bucket_args[b]))
            if fn is not None:
                graphs[b] = fn
        if on_disk and report is not None:
            report(LOADING_STAGE, len(on_disk), len(on_disk))
        missing = [b for b in sizes if b not in graphs]
        if not missing:
            self._built = graphs
            self.compile_state = "done"
            return
        self.compile_state = "compiling"
        self._build_graphs(cpp_wrapper, missing, paths, graphs, progress)

    def _build_graphs(
        self, cpp_wrapper: bool, missing: list[int], paths: dict[int, Path],
        graphs: dict[int, Callable[..., torch.Tensor]], progress: Callable[[str, int, int], None] | None,
    ) -> None:
        """Compiles and saves the graphs of the buckets in ``missing``; on the compile thread,
        the only writer of ``_built`` and ``compile_state``. Tracing runs on fake tensors in
        this thread's own grad and dispatch modes (thread-local), reads the model and never
        writes it, so the engine thread may run the eager forward meanwhile."""
        background = threading.current_thread() is self._compile_thread
        compiler = torch.compile(_decode_logits, fullgraph=True, dynamic=None, options={"cpp_wrapper": cpp_wrapper})
        stage = COMPILING_STAGE if background else "optimizing for this CPU (first run only)"
        for i, b in enumerate(missing):
            if self._cancelled:
                self.compile_state = "failed"
                return
            if progress is not None:
                progress(stage, i, len(missing))
            self._mark_dynamic(b)
            try:
                # No duck sizing: two sizes equal at trace time must not become one symbol, or
                # the graph (called without its guards) would assume them equal later. Dynamic
                # exactly where marked: Dynamo's automatic dynamism would carry what earlier
                # compiles of this process saw (another model's eps became a symbolic float,
                # which aot_compile cannot take).
                with (torch.inference_mode(), torch.fx.experimental._config.patch(use_duck_shape=False),
                      torch._dynamo.config.patch(automatic_dynamic_shapes=False, specialize_float=True)):
                    fn = compiler.aot_compile(((self.model, self.model.cos_sin, *self._bucket_args[b]), {}))
            except Exception as e:  # noqa: BLE001 - a model the compiler cannot take still runs
                if not self._cancelled:
                    logger.warning("compiling the decode step failed (%s: %s); decoding without it",
                                   type(e).__name__, str(e).splitlines()[0] if str(e) else "")
                self.compile_state = "failed"
                if progress is not None:
                    progress(stage, len(missing), len(missing))
                return
            self.graphs_compiled += 1
            try:
                fn.save_compiled_function(str(paths[b]))
                _prune_graphs(paths[b].parent)
            except (OSError, RuntimeError) as e:  # no cache this time: the next start compiles again
                logger.warning("could not save the compiled decode step to %s: %s", paths[b], e)
            graphs[b] = fn
        self._built = graphs
        self.compile_state = "done"
        if progress is not None:
            progress(stage, len(missing), len(missing))

    def _switch(self) -> None:
        """On the thread that steps (between two steps): takes the graphs the compile thread
        has built, if it has."""
        graphs, self._built = self._built, None
        if graphs is not None:
            self._use_graphs(graphs)

    def _use_graphs(self, graphs: dict[int, Callable[..., torch.Tensor]]) -> None:
        for fn in graphs.values():
            # the key and the check at load cover what the guards would: call without them
            # (a guarded call checked ~500 tensors, 3.5 ms of a 15 ms batch-1 step)
            fn.disable_guard_check()
        self._unguarded = graphs
        self._decode_call = self._run_bucket_compiled
        self._decode_gives_logits = True
        self.compile_state = "done"

    @property
    def compiling(self) -> bool:
        """True while the decode graphs are being built in the background."""
        return self.compile_state == "compiling"

    @property
    def preparing(self) -> bool:
        """True while the background thread loads or builds the decode graphs."""
        return self.compile_state in ("loading", "compiling")

    def stop_compile(self) -> None:
        """Abandons a background compile (an engine shut down mid-compile): its compiler
        processes end now, and the thread ends with the step it is in, saving nothing."""
        if self.preparing:
            self._cancelled = True
            self._stepping.set()  # a compile thread waiting for the first step goes on, to stop
            self._stepped.set()
            stop_compilers()

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """Waits for a background compile to end (built, saved, or failed); True when none is
        running any more. The next step switches to the graphs. Joins in short slices: a
        ctrl+c that the kernel hands to another thread of the process leaves a plain join
        asleep, and the slices let the main thread see it (KeyboardInterrupt) at once. Not
        ``Thread.join``: one that ctrl+c interrupts marks the thread stopped while it runs on
        (CPython 3.11), so ``is_alive()`` lies after it."""
        if self._compile_thread is None:
            return True
        end = None if timeout is None else time.monotonic() + timeout
        while not self._compile_done.is_set():
            left = JOIN_SLICE_S if end is None else min(JOIN_SLICE_S, end - time.monotonic())
            if left <= 0:
                break
            self._compile_done.wait(left)
        return self._compile_done.is_set()

    def _mark_dynamic(self, b: int) -> None:
        """Makes the sizes that do not change the math dynamic dimensions of the graph traced
        for bucket ``b``: the KV pool's block count, the rotary table's length (max_model_len),
        the block tables' width, and for the graph of every batch from 2 up the batch. A new
        pool size, context limit or chat count then reuses the saved graph (``_graph_key``
        leaves them out). Dynamo would specialize a size of 0 or 1: the pool and the table
        width are made at least 2 (``__init__``, ``_init_static_buffers``)."""
        mark = torch._dynamo.mark_dynamic
        for k, v in self.kv_caches:
            mark(k, 0)
            mark(v, 0)
        mark(self.model.cos_sin, 0)
        args = self._bucket_args[b]
        mark(args[5], 1)  # block tables: [batch, blocks per sequence]
        if b > 1:  # one graph for every batch size from 2 up
            for a in args:
                mark(a, 0)

    def _graph_key(self, cpp_wrapper: bool) -> str:
        """What a saved decode graph was made for: this CPU, torch, Python, the CPU kernels'
        interface (``_kernel_interface``: not their bodies), the model's structure and every
        tensor the graph reads (names, shapes, dtypes), the KV pool's block shape and dtype. Not the sizes ``_mark_dynamic`` makes dynamic (the
        pool's block count, max_model_len, the batch buckets). The source of the traced code is
        checked at load. The thread count too: Dynamo guards it, so one key for two counts made a
        1-thread run and a 2-thread server overwrite each other's graph and recompile each start."""
        h = hashlib.sha256()
        for part in ("dynamic-sizes-4", f"threads={torch.get_num_threads()}", cpu_ops.cpu_signature(),
                     torch.__version__, sys.version, str(cpp_wrapper),
                     _kernel_interface(), type(self.model).__qualname__, repr(self.model.config)):
            h.update(part.encode() + b"\0")
        for name, t in self.model.state_dict(keep_vars=True).items():
            h.update(f"{name}:{tuple(t.shape)}:{t.dtype}\0".encode())
        k = self.kv_caches[0][0]
        h.update(f"{tuple(k.shape[1:])}:{k.dtype}:{self.model.cos_sin.dtype}:{tuple(self.kv_scales.shape)}\0".encode())
        h.update(f"{[t.dtype for t in self._bucket_args[1]]}:{len(self.kv_caches)}\0".encode())
        return h.hexdigest()[:24]

    def _capture_graphs(self, max_batch: int, progress: Callable[[str, int, int], None] | None = None) -> None:
        """Captures one graph per batch bucket over the static input buffers, largest first so
        smaller graphs reuse its memory pool. Each bucket first runs twice outside the capture:
        every shape-dependent choice (Triton's autotune, the GEMM backend) is made then, since
        timing inside a capture would break it. Reports "capturing CUDA graphs" b/N through
        ``progress``, and "tuning kernels for this GPU (first run only)" while choices are
        measured (they persist on disk: ``localllm.kernels.tuning``), each stage ending at N/N.

        Off CUDA (a rehearsal's tests call it on CPU tensors) it runs the same warm-ups and
        progress and keeps the buckets eager: there is nothing to capture."""
        from localllm.kernels import tuning

        # the smallest size that holds max_batch closes the list: a batch between two sizes
        # pads up to the next one rather than running eager
        top = next((b for b in GRAPH_BATCH_SIZES if b >= max_batch), GRAPH_BATCH_SIZES[-1])
        self._init_static_buffers([b for b in GRAPH_BATCH_SIZES if b <= top])
        capture = self.device.type == "cuda"
        self._g_hidden: dict[int, torch.Tensor] = {}
        total = len(self.buckets)
        tuned_at = -1  # the last bucket whose warm-up tuned something
        report = progress or (lambda stage, done, n: None)
        pool = None
        for i, b in enumerate(reversed(self.buckets)):
            def on_tune(i: int = i) -> None:  # once per bucket that tunes
                nonlocal tuned_at
                if tuned_at < 0:
                    logger.info("tuning kernels for this GPU (first run only)")
                if tuned_at < i:
                    tuned_at = i
                    report(TUNING_STAGE, i, total)

            with tuning.reporting(on_tune):
                for _ in range(2):  # warm up: Triton compiles and autotunes outside the capture
                    # the logits too, at this bucket's rows (they run after the replay, outside
                    # the graph): a GGUF head's kernel compiled at a step's first use of a row
                    # bucket, 3-6 s each on an H200
                    self.model.compute_logits(self._run_bucket_eager(b))
            report(CAPTURE_STAGE, i, total)
            if not capture:
                continue
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._g_hidden[b] = self._run_bucket_eager(b)
            pool = graph.pool()
            self.graphs[b] = graph
        if tuned_at >= 0:
            report(TUNING_STAGE, total, total)
        report(CAPTURE_STAGE, total, total)
        if not capture:
            self._decode_call = self._run_bucket_eager
            return
        torch.cuda.synchronize()
        self._decode_call = lambda b: (self.graphs[b].replay(), self._g_hidden[b])[1]

    def _stage_decode(self, seqs: list[Sequence], n: int) -> int:
        """Writes a pure-decode batch of ``n`` rows straight into the static buffers' first n
        rows (through numpy views of their host side: no tensor is made per step, where
        ``prepare`` makes ~15) and pads to the smallest bucket that holds it; returns the
        bucket. Rows past a table's length keep stale block ids: attention reads only the
        blocks its sequence length covers.

        A speculative decode takes one row per position (its last token, then each proposal),
        each a one-token query over the same block table whose length ends at its own
        position: every layer writes the step's K and V before attending, so that is the
        causal attention of a ``1 + k``-token extend, run by the decode graph and kernels."""
        bs = self.block_size
        b = next(s for s in self.buckets if s >= n)
        ids, pos, slots, lens, tables = self._host
        i = 0
        for seq in seqs:
            p = seq.num_computed_tokens
            table = seq.block_table
            for j, token in enumerate((seq.token_ids[p], *seq.spec_token_ids)):
                q = p + j
                ids[i] = token
                pos[i] = q
                slots[i] = table[q // bs] * bs + q % bs
                lens[i] = q + 1
                tables[i, : len(table)] = table
                i += 1
        slots[n:b] = -1
        lens[n:b] = 1
        if self._host_tensors is not None:  # a device elsewhere: one copy per buffer
            for dst, src in zip(self._device_buffers(), self._host_tensors):
                dst[:b].copy_(src[:b], non_blocking=True)
        return b

    def _device_buffers(self) -> tuple[torch.Tensor, ...]:
        return self._g_input_ids, self._g_positions, self._g_slots, self._g_seq_lens, self._g_tables


LOADING_STAGE = "loading the decode step optimized for this CPU"
# How long the background compile thread waits for a first step to begin before it starts
# anyway (a server or chat with no request yet: nothing to slow down); a step begun, it waits
# for its end
FIRST_STEP_GRACE_S = 1.0
COMPILING_STAGE = "optimizing for this CPU in the background (first run only)"


# The background compile threads of this process still at work (each takes itself off at its
# end), for the exit hooks. Not Thread.is_alive(): see wait_compiled.
_COMPILE_THREADS: set[threading.Thread] = set()
_exit_hook_set = False
JOIN_SLICE_S = 0.2


def compile_running() -> bool:
    """Whether a background compile thread of this process is still at work."""
    return bool(_COMPILE_THREADS)


def stop_compilers() -> None:
    """Ends this process's child processes: Inductor's compile workers and the compilers they
    run, which a background compile started. Called only while one runs (nothing else here
    starts children then), so that quitting mid-compile leaves no compiler running."""
    import psutil

    try:
        children = psutil.Process().children(recursive=True)
    except psutil.Error:
        return
    for child in children:
        with contextlib.suppress(psutil.Error):
            child.terminate()
    _, alive = psutil.wait_procs(children, timeout=2)
    for child in alive:
        with contextlib.suppress(psutil.Error):
            child.kill()


def _stop_compilers_at_exit() -> None:
    """Registers, once, the exit hook that ends the compilers of a background compile still
    running at exit. On threading's own exit hooks, which run before Python joins threads
    and before the ``atexit`` hooks (Inductor's pool waits there on its busy workers)."""
    global _exit_hook_set
    if _exit_hook_set:
        return
    _exit_hook_set = True

    def hook() -> None:
        if compile_running():
            stop_compilers()

    register = getattr(threading, "_register_atexit", None)
    try:
        register(hook) if register is not None else atexit.register(hook)
    except RuntimeError:  # the interpreter is already shutting down
        atexit.register(hook)


def _lower_priority() -> None:
    """The calling thread, and the compiler processes it starts (they inherit it), yield the
    CPUs to the engine's threads: nice 10. Linux sets a nice value per thread."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (OSError, AttributeError):  # another OS: the compile competes at normal priority
        pass


def _thread_cpus() -> list[int] | None:
    """Where the forward's threads go: one per core (``cpus_for_threads``) unless
    ``LOCALLLM_BIND_THREADS=0`` leaves them to the OS or the C++ ops (which bind) are missing."""
    if os.environ.get("LOCALLLM_BIND_THREADS", "1") == "0" or not cpu_ops.load():
        return None
    return cpus_for_threads(torch.get_num_threads())


def _decode_logits(
    model: LlamaForCausalLM,
    cos_sin: torch.Tensor,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
) -> torch.Tensor:
    """One decode step, every row a one-token sequence, through to the logits (as
    ``logits_parts``: the caller refines them, ``_refined``): the function
    torch.compile traces on CPU (the metadata is rebuilt inside, so no Python object is a
    graph input). The rotary table is an input, not read from the model's buffer: Dynamo
    keeps a module buffer's shape static, and its length is max_model_len, which must stay a
    dynamic size (``ModelRunner._mark_dynamic``)."""
    meta = AttentionMetadata(slots, query_start_loc, seq_lens, block_tables, input_ids.shape[0])
    return model.logits_parts(model.model(input_ids, positions, cos_sin, meta))


def _refined(parts: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]) -> torch.Tensor:
    """A compiled step's logits with their exact top rows written in, outside the graph: a
    [T, 8] scatter here, where inside the graph it cost a copy of all the logits
    (``CausalLM.logits_parts``)."""
    logits, top, exact = parts
    return logits if top is None or exact is None else logits.scatter_(1, top, exact)


def _use_our_inductor_cache() -> None:
    """Points Inductor's on-disk cache at ours (``compiled_cache_dir()/inductor``) unless the
    user chose one. Importing Dynamo fills ``TORCHINDUCTOR_CACHE_DIR`` with torch's default,
    a folder in /tmp that a reboot empties, so that default is replaced too: a cold cache
    costs the first start minutes of compiling."""
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir

        torch_default = os.path.abspath(default_cache_dir())
    except ImportError:
        torch_default = None
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR") in (None, torch_default):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cpu_ops.compiled_cache_dir() / "inductor")
    cpu_ops.path_free_inductor_keys()  # one cache for every install (venv, pipx) of this torch


def _graphs_dir() -> Path:
    path = cpu_ops.compiled_cache_dir() / "graphs"
    path.mkdir(parents=True, exist_ok=True)
    return path


# Saved decode graphs kept, the most recently used first: a pair per model shape and CPU,
# ~5 MB each for the default model, so eight models' pairs in ~80 MB.
MAX_SAVED_GRAPHS = 16


def _prune_graphs(directory: Path, keep: int = MAX_SAVED_GRAPHS) -> None:
    """Deletes all but the ``keep`` most recently used graphs in ``directory`` (a load touches
    its file): those of other models, other torch versions or other CPU kernels accumulate."""
    graphs = []
    for path in directory.glob("decode-*.bin"):
        try:
            graphs.append((path.stat().st_mtime, path))
        except OSError:  # deleted meanwhile by another start
            continue
    for _, path in sorted(graphs, reverse=True)[keep:]:
        path.unlink(missing_ok=True)


def _load_graph(
    path: Path, model: LlamaForCausalLM, args: tuple[torch.Tensor, ...]
) -> Callable[..., torch.Tensor] | None:
    """The decode graph saved at ``path``, or None (and the caller compiles it anew) when
    there is none, it does not load (another torch, a damaged file), its guards reject
    these inputs, or the source of code it traced has changed since."""
    if not path.is_file():
        return None
    try:
        with open(path, "rb") as f:
            fn = torch.compiler.load_compiled_function(f)
        fresh = all(inspect.getsource(importlib.import_module(src.module)) == src.content
                    for src in fn.source_info().inlined_sources)
        # grad off, as when it was compiled (inference mode would also hide the autograd keys the guards check)
        with torch.no_grad():
            if fresh and fn.guard_check(model, *args):
                os.utime(path)  # in use: the last file _prune_graphs would delete
                return fn
            if not fresh:
                logger.info("the saved decode step %s was traced from code changed since; compiling it again",
                            path.name)
            else:  # a size that should be dynamic was not: say which, for whoever debugs it
                reason = fn._artifacts.guard_manager.check_verbose(fn.prepare_f_locals(model, *args))
                logger.warning("the saved decode step %s does not take these inputs (%s); compiling it again",
                               path.name, "; ".join(reason.verbose_code_parts))
    except Exception as e:  # noqa: BLE001 - any failure here only means "compile it again"
        logger.warning("the saved decode step %s does not load (%s: %s); compiling it again", path.name,
                       type(e).__name__, e)
    return None
