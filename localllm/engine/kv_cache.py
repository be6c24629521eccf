"""The KV cache: the one place that builds a model's paged KV pool, gives it to the attention
layers, and turns block tables into the attention metadata.

The engine's runner, quantization's calibration and evaluation loops (quant/forward.py) and
the benchmark's plain loop all build their pools here, from the model's per-layer KV spec
(``model.kv_spec()``: heads, head_dim and window may differ from layer to layer). Block
tables are per sequence and shared by every layer (engine/block_manager.py), so every layer's
pool has the same number of blocks; a sliding-window layer keeps its whole pool too and masks
what it does not see.

Allocation costs nothing up front on a CPU: each tensor is an anonymous memory mapping, whose
pages read as zero by the kernel's guarantee until first written (zeroing the 5.6 GiB pool of
`serve --chats 16` was 14-19 s of page touching before /health answered).
``reserve_in_background`` then faults the pages in, without writing them, on a low-priority
thread, so the memory the planner sized is held soon after start and RSS shows it, as it did
when the pool was zeroed up front.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import mmap
import os
import sys
import threading
from collections.abc import Sequence as Seq

import torch

from localllm.models.kv_spec import LayerKVSpec
from localllm.models.layers import AttentionMetadata, CausalLM, kv_scale_tensor


class KVCache:
    """Per attention layer i, a K and a V tensor ``[num_blocks, block_size, specs[i].num_kv_heads,
    specs[i].head_dim]`` of ``dtype``, and the FP8 scales ``[2, layers, 1]`` fp32 (row 0 the
    k_scales, row 1 the v_scales; 1.0 unless given), which the pool stores ``K / k_scale`` with.

    Invariants: one tensor per layer and per K/V, never views of one base (torch.compile treats
    views of one base that an op mutates as a "synthetic base" and copies the whole base per
    layer: measured, the 1 GB pool copied 30 times a step); the tensors and scales are made
    once and never replaced (compiled graphs and CUDA graphs hold them); a slot never written
    reads as zero, so a masked or padding read (a padding row attends to one token of block 0)
    never meets NaN garbage: 0 x garbage would be NaN, 0 x 0 is 0.
    """

    def __init__(
        self, specs: Seq[LayerKVSpec], num_blocks: int, block_size: int, dtype: torch.dtype,
        device: torch.device, scales: Seq[tuple[float, float]] | None = None,
    ) -> None:
        assert specs and num_blocks >= 1 and block_size >= 1
        self.specs = tuple(specs)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        self.device = device
        shapes = [(num_blocks, block_size, s.num_kv_heads, s.head_dim) for s in self.specs]
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = [
            (zeroed(shape, dtype, device), zeroed(shape, dtype, device)) for shape in shapes
        ]
        self.scales = kv_scale_tensor(scales, len(self.specs), device)
        self._reserving: threading.Thread | None = None

    @classmethod
    def for_model(
        cls, model: CausalLM, num_blocks: int, block_size: int, dtype: torch.dtype | None = None,
        scales: Seq[tuple[float, float]] | None = None,
    ) -> KVCache:
        """The pool ``model.kv_spec()`` describes (``dtype`` None: the model's), attached to its
        attention layers."""
        cache = cls(model.kv_spec(), num_blocks, block_size, dtype or model.dtype, model.device, scales)
        cache.attach(model)
        return cache

    def attach(self, model: CausalLM) -> None:
        """Gives attention layer i its K and V tensors and 1-element views of its scales (read
        on the device, so graphs replay them)."""
        layers = model.attention_layers()
        assert len(layers) == len(self.layers), "one KV spec per attention layer"
        for i, (attn, (k, v)) in enumerate(zip(layers, self.layers)):
            attn.k_cache, attn.v_cache = k, v
            attn.k_scale, attn.v_scale = self.scales[0, i], self.scales[1, i]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for kv in self.layers for t in kv)

    def copy_blocks(self, copies: Seq[tuple[int, int]]) -> None:
        """Copies each (source, destination) block in every layer, in order (a source may be a
        destination of an earlier pair: the caller orders them)."""
        for src, dst in copies:
            if src != dst:
                for k, v in self.layers:
                    k[dst] = k[src]
                    v[dst] = v[src]

    def reserve_in_background(self) -> None:
        """Faults the pool's pages in on a low-priority daemon thread without writing them
        (Linux's MADV_POPULATE_WRITE: contents unchanged, so the engine may write meanwhile).
        Elsewhere, or on a GPU, or on an older kernel, pages come in on first write."""
        if self.device.type != "cpu" or self._reserving is not None or _madvise is None:
            return
        tensors = [t for kv in self.layers for t in kv]
        self._reserving = threading.Thread(target=_populate, args=(tensors,), name="localllm-kv-reserve", daemon=True)
        self._reserving.start()

    def wait_reserved(self, timeout: float | None = None) -> bool:
        """True once the background reservation (if any) has ended."""
        if self._reserving is not None:
            self._reserving.join(timeout)
            return not self._reserving.is_alive()
        return True


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor that costs nothing now on a CPU: an anonymous private mapping (zero pages
    by the kernel's guarantee, faulted in on first write; the tensor keeps the mapping alive).
    Elsewhere ``torch.zeros`` (a device memset is fast)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    nbytes = itemsize
    for n in shape:
        nbytes *= n
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    if sys.platform == "win32":
        buf = mmap.mmap(-1, nbytes)
    else:  # private: no shared-memory accounting, copy-on-write in a fork
        buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    storage = torch.frombuffer(buf, dtype=torch.uint8).untyped_storage()  # its deleter holds the mapping
    # a tensor of its own over the storage, not a view of the byte tensor: as torch.zeros makes
    return torch.empty(0, dtype=dtype).set_(storage, 0, shape)


# ---- reserving the pages (Linux) ----

MADV_POPULATE_WRITE = 23  # Linux 5.14+; mmap does not name it before Python 3.13
_CHUNK = 64 << 20  # bytes per madvise call: a stop at exit waits for at most one chunk


def _libc_madvise() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    fn = libc.madvise  # a CDLL call releases the GIL: the engine's threads run meanwhile
    fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    fn.restype = ctypes.c_int
    return fn


_madvise = _libc_madvise()


def _populate(tensors: list[torch.Tensor]) -> None:
    with contextlib.suppress(OSError, AttributeError):  # another OS: normal priority
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    page = mmap.PAGESIZE
    assert _madvise is not None
    for t in tensors:
        start = t.data_ptr()
        end = start + t.numel() * t.element_size()
        start -= start % page  # mappings are page-aligned; this only guards a foreign tensor
        while start < end:
            n = min(_CHUNK, end - start)
            if _madvise(start, n, MADV_POPULATE_WRITE) != 0:
                if ctypes.get_errno() in (errno.EINTR, errno.EAGAIN):
                    continue  # interrupted or a transient shortage: this chunk again, not a pool half held
                return  # EINVAL: a kernel before 5.14; pages then come in on first write
            start += n


# ---- attention metadata ----

def slot_mapping(block_tables: torch.Tensor, seq_index: torch.Tensor, positions: torch.Tensor,
                 block_size: int) -> torch.Tensor:
    """The cache slot of each token: row ``seq_index[t]`` of the block tables at
    ``positions[t]`` (int64)."""
    slots = block_tables[seq_index, positions // block_size].long() * block_size
    return slots + positions % block_size


def varlen_metadata(
    starts: Seq[int], counts: Seq[int], tables: Seq[Seq[int]], block_size: int, num_decodes: int,
    device: torch.device,
) -> tuple[torch.Tensor, AttentionMetadata]:
    """(positions, metadata) of a flat varlen batch: sequence i brings ``counts[i]`` new tokens
    at positions ``starts[i]..`` (the tokens before are in the pool), its block table
    ``tables[i]``; decodes first (``num_decodes``). Tables are padded with block 0 to the
    longest: attention reads only the blocks a sequence's length covers. Computed with tensor
    ops from per-sequence offsets, so the Python work is one pass over the sequences."""
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([list(t) + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    q_lens = torch.tensor(counts, dtype=torch.int32)
    starts_t = torch.tensor(starts, dtype=torch.int32)
    query_start_loc = torch.zeros(len(counts) + 1, dtype=torch.int32)
    torch.cumsum(q_lens, 0, out=query_start_loc[1:])
    seq_index = torch.repeat_interleave(torch.arange(len(counts)), q_lens)
    total = int(query_start_loc[-1])
    positions = torch.arange(total, dtype=torch.int64) - query_start_loc[seq_index] + starts_t[seq_index]
    slots = slot_mapping(block_tables, seq_index, positions, block_size)
    meta = AttentionMetadata(
        slot_mapping=slots.to(device, non_blocking=True),
        query_start_loc=query_start_loc.to(device, non_blocking=True),
        seq_lens=(starts_t + q_lens).to(device, non_blocking=True),
        block_tables=block_tables.to(device, non_blocking=True),
        num_decodes=num_decodes,
    )
    return positions.to(device, non_blocking=True), meta


def decode_metadata(
    context_lens: torch.Tensor, block_tables: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, AttentionMetadata]:
    """(positions, metadata) of a decode step on the device, no host sync: sequence i's one
    new token goes at position ``context_lens[i]`` (the tokens already in the pool)."""
    positions = context_lens.long()
    rows = torch.arange(positions.shape[0], device=positions.device)
    slots = slot_mapping(block_tables, rows, positions, block_size)
    qsl = torch.arange(positions.shape[0] + 1, dtype=torch.int32, device=positions.device)
    meta = AttentionMetadata(slots, qsl, (context_lens + 1).to(torch.int32), block_tables, positions.shape[0])
    return positions, meta


def contiguous_tables(capacities: Seq[int], block_size: int) -> list[list[int]]:
    """Block tables for fresh sequences laid out back to back in a private pool: sequence i
    gets the next ``ceil(capacities[i] / block_size)`` blocks."""
    tables, first = [], 0
    for n in capacities:
        nb = -(-n // block_size)
        tables.append(list(range(first, first + nb)))
        first += nb
    return tables
