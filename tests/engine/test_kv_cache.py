"""The KV-cache owner (engine/kv_cache.py): the pool from per-layer specs, attached to the layers;
pages that cost nothing until written yet read as zero, so a padding row never meets NaN; the
background reservation holds the memory without changing what was written; the metadata."""

from __future__ import annotations

import gc

import pytest
import torch

from localllm.engine import kv_cache
from localllm.engine.kv_cache import KVCache, contiguous_tables, decode_metadata, varlen_metadata
from localllm.engine.sequence import SamplingParams
from localllm.models.kv_spec import LayerKVSpec
from localllm.models.llama import AttentionMetadata, LlamaForCausalLM, ModelConfig

CPU = torch.device("cpu")
BS = 4


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    cfg = ModelConfig("LlamaForCausalLM", vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=2,
                      num_heads=2, num_kv_heads=1, head_dim=8, tie_word_embeddings=True)
    torch.manual_seed(0)
    m = LlamaForCausalLM(cfg).eval()
    m.init_rope(64)
    return m


def test_one_tensor_per_layer_and_kv_shaped_by_each_layers_spec() -> None:
    specs = [LayerKVSpec(2, 8), LayerKVSpec(1, 16, sliding_window=4), LayerKVSpec(4, 4)]
    cache = KVCache(specs, num_blocks=3, block_size=BS, dtype=torch.float32, device=CPU,
                    scales=[(0.5, 0.25), (1.0, 2.0), (3.0, 4.0)])
    assert [tuple(k.shape) for k, _ in cache.layers] == [(3, BS, 2, 8), (3, BS, 1, 16), (3, BS, 4, 4)]
    tensors = [t for kv in cache.layers for t in kv]
    # no views of one base: torch.compile would copy a shared base per layer ("synthetic base")
    assert all(t._base is None and t.is_contiguous() for t in tensors)
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == len(tensors)
    assert cache.nbytes == sum(3 * BS * s.num_kv_heads * s.head_dim * 4 * 2 for s in specs)
    assert cache.scales[:, :, 0].tolist() == [[0.5, 1.0, 3.0], [0.25, 2.0, 4.0]]


def test_for_model_attaches_the_pool_and_scales_to_every_attention_layer(model: LlamaForCausalLM) -> None:
    cache = KVCache.for_model(model, num_blocks=5, block_size=BS, dtype=torch.float8_e4m3fn,
                              scales=[(0.5, 0.25), (2.0, 4.0)])
    assert len(cache.layers) == 2
    for i, attn in enumerate(model.attention_layers()):
        k, v = cache.layers[i]
        assert attn.k_cache is k and attn.v_cache is v and k.dtype == torch.float8_e4m3fn
        assert attn.k_scale.data_ptr() == cache.scales[0, i].data_ptr()  # a view, read on the device
        assert float(attn.v_scale) == [0.25, 4.0][i]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_a_fresh_pool_reads_zero_and_keeps_what_is_written(dtype: torch.dtype) -> None:
    cache = KVCache([LayerKVSpec(3, 64)], num_blocks=8, block_size=16, dtype=dtype, device=CPU)
    k, v = cache.layers[0]
    gc.collect()  # the mapping lives as long as the tensor's storage, not as the Python object that made it
    assert torch.count_nonzero(k.float()) == 0 and torch.count_nonzero(v.float()) == 0
    k[3, 5] = 1.5
    cache.copy_blocks([(3, 6), (2, 2)])
    assert float(k[6, 5, 2, 63]) == 1.5 and torch.count_nonzero(k.float()) == 2 * 3 * 64


def test_padding_rows_read_zeros_where_garbage_would_give_nan(model: LlamaForCausalLM) -> None:
    """A padded decode batch's extra rows write nowhere (slot -1) and attend to one token of
    block 0, which nothing wrote: the pool's zero pages keep them finite. The same rows over a
    pool of NaN garbage (what torch.empty may hand back) turn NaN: the test can fail."""
    cache = KVCache.for_model(model, num_blocks=4, block_size=BS, dtype=torch.float32)
    n = 3
    meta = AttentionMetadata(torch.full((n,), -1, dtype=torch.int64), torch.arange(n + 1, dtype=torch.int32),
                             torch.ones(n, dtype=torch.int32), torch.zeros(n, 2, dtype=torch.int32), n)
    ids, pos = torch.zeros(n, dtype=torch.int64), torch.zeros(n, dtype=torch.int64)
    with torch.inference_mode():
        out = model(ids, pos, meta)
        assert torch.isfinite(out).all()
        assert all(torch.count_nonzero(t) == 0 for kv in cache.layers for t in kv)  # wrote nowhere
        for k, v in cache.layers:
            k.fill_(float("nan"))
            v.fill_(float("nan"))
        assert torch.isnan(model(ids, pos, meta)).all()


def _resident_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of these tensors' pages in RAM (mincore on their own ranges: the process's RSS
    also moves with whatever the rest of a long test run frees meanwhile)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    total = 0
    for t in tensors:
        start = t.data_ptr() // page * page
        length = t.data_ptr() + t.numel() * t.element_size() - start
        pages = -(-length // page)
        vec = (ctypes.c_ubyte * pages)()
        assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vec) == 0, ctypes.get_errno()
        total += sum(b & 1 for b in vec) * page
    return total


def test_allocation_touches_no_page_and_the_reservation_keeps_the_contents() -> None:
    if kv_cache._madvise is None:
        pytest.skip("populating without writing needs Linux")
    cache = KVCache([LayerKVSpec(4, 64)] * 2, num_blocks=2048, block_size=16, dtype=torch.float32, device=CPU)
    size = cache.nbytes  # 128 MiB
    pool = [t for kv in cache.layers for t in kv]
    k, v = cache.layers[1]
    k[100, 3] = 7.0  # one page written before the reservation
    assert _resident_bytes(pool) < size // 8
    cache.reserve_in_background()
    assert cache.wait_reserved(timeout=120)
    assert _resident_bytes(pool) > 0.9 * size  # held now, as the planner sized it
    assert float(k[100, 3, 2, 5]) == 7.0 and torch.count_nonzero(k) == 4 * 64
    assert torch.count_nonzero(v) == 0


def test_varlen_metadata_of_a_decode_and_a_prompt_chunk() -> None:
    # a decode at position 5 (table [7, 2]) and a chunk of 3 tokens from position 4 (table [1, 3, 0])
    pos, meta = varlen_metadata([5, 4], [1, 3], [[7, 2], [1, 3, 0]], BS, 1, CPU)
    assert pos.tolist() == [5, 4, 5, 6]
    assert meta.slot_mapping.tolist() == [2 * BS + 1, 3 * BS + 0, 3 * BS + 1, 3 * BS + 2]
    assert meta.query_start_loc.tolist() == [0, 1, 4] and meta.seq_lens.tolist() == [6, 7]
    assert meta.block_tables.tolist() == [[7, 2, 0], [1, 3, 0]] and meta.num_decodes == 1


def test_decode_metadata_matches_the_varlen_one() -> None:
    tables = contiguous_tables([6, 9], BS)
    assert tables == [[0, 1], [2, 3, 4]]
    _, ref = varlen_metadata([5, 8], [1, 1], tables, BS, 2, CPU)
    pos, meta = decode_metadata(torch.tensor([5, 8], dtype=torch.int32), ref.block_tables, BS)
    assert pos.tolist() == [5, 8]
    for name in ("slot_mapping", "query_start_loc", "seq_lens", "block_tables"):
        assert getattr(meta, name).tolist() == getattr(ref, name).tolist(), name
    assert meta.num_decodes == 2


def test_the_engine_lends_blocks_and_switches_prefix_caching_on_its_own_terms(llm) -> None:  # noqa: ANN001
    """What the benchmark drives through the engine's API (on its thread, via AsyncEngine.call)
    rather than through the block manager: lent blocks come back, the switch is restored."""
    engine = llm.engine
    bm = engine.block_manager
    free = bm.num_free_blocks
    with engine.borrowed_blocks([1, 2, 3], 40) as seq:
        assert len(seq.block_table) == -(-40 // bm.block_size) and bm.num_free_blocks == free - len(seq.block_table)
        slots = engine.runner.kv_cache.layers[0][0].shape[0]
        assert all(0 <= b < slots for b in seq.block_table)
    assert bm.num_free_blocks == free and seq.block_table == []
    before = engine.set_prefix_caching(False)
    assert before is True and bm.enable_prefix_caching is False
    assert engine.set_prefix_caching(before) is False and bm.enable_prefix_caching is True
    engine.generate([list(range(1000, 1040))], SamplingParams(temperature=0, max_tokens=1))
    assert bm.num_cached_free_blocks > 0  # the finished prompt's full blocks stay cached
    engine.reset_prefix_cache()
    assert bm.num_cached_free_blocks == 0
