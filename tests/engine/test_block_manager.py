"""Block manager properties under random operations (no model)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from localllm.engine.block_manager import NO_HASH, BlockManager
from localllm.engine.sequence import SamplingParams, Sequence


def _seq(tokens: list[int], rid: str = "r") -> Sequence:
    return Sequence(rid, list(tokens), SamplingParams(), (), 10_000)


def _check(bm: BlockManager, live: list[Sequence]) -> None:
    refs = [0] * bm.num_blocks
    for s in live:
        for b in s.block_table:
            refs[b] += 1
    for block in bm.blocks:
        assert block.ref_count == refs[block.block_id] >= 0
        assert (block.ref_count == 0) == (block.block_id in bm.free_queue)
    # a hash never maps to a block whose content differs, and one physical block holds one content
    for h, b in bm.cached.items():
        assert bm.blocks[b].hash == h and bm.blocks[b].token_ids
    # every full computed block of a live sequence holds exactly that sequence's tokens
    for s in live:
        for i, b in enumerate(s.block_table[: s.num_computed_tokens // bm.block_size]):
            block = bm.blocks[b]
            if block.hash != NO_HASH:
                assert block.token_ids == tuple(s.token_ids[i * bm.block_size : (i + 1) * bm.block_size])


ops = st.lists(
    st.tuples(st.sampled_from(["new", "append", "fork", "free"]), st.integers(0, 7), st.integers(1, 40)),
    min_size=1, max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_random_operations_keep_invariants(operations: list[tuple[str, int, int]]) -> None:
    bm = BlockManager(num_blocks=24, block_size=4)
    live: list[Sequence] = []
    vocab = [1, 2, 3]  # a tiny vocabulary makes shared prefixes and hash hits common
    for op, pick, n in operations:
        if op == "new" or not live:
            tokens = [vocab[(pick * 7 + i * (pick % 3 + 1)) % 3] for i in range(n)]
            s = _seq(tokens, f"s{len(live)}")
            prefix = bm.match_prefix(s)
            if bm.allocate(s, s.num_tokens, prefix):
                s.num_computed_tokens = s.num_tokens
                bm.cache_full_blocks(s)
                live.append(s)
        elif op == "append":
            s = live[pick % len(live)]
            s.token_ids += [vocab[(pick + i) % 3] for i in range(n % 9 + 1)]
            if bm.allocate(s, s.num_tokens):
                s.num_computed_tokens = s.num_tokens
                bm.cache_full_blocks(s)
            else:
                s.token_ids = s.token_ids[: s.num_computed_tokens]
        elif op == "fork":  # a new request with the same prompt shares the cached full blocks
            parent = live[pick % len(live)]
            child = _seq(parent.token_ids[: parent.num_computed_tokens], f"f{len(live)}")
            prefix = bm.match_prefix(child)
            assert prefix.num_tokens == (child.num_tokens - 1) // bm.block_size * bm.block_size
            if bm.allocate(child, child.num_tokens, prefix):
                child.num_computed_tokens = child.num_tokens
                bm.cache_full_blocks(child)
                live.append(child)
        else:
            s = live.pop(pick % len(live))
            bm.free(s)
        _check(bm, live)
    for s in live:
        bm.free(s)
    assert bm.num_free_blocks == bm.num_blocks


def test_eviction_is_lru_and_tail_first() -> None:
    bm = BlockManager(num_blocks=6, block_size=2)
    a = _seq([1, 2, 3, 4, 5, 6, 7], "a")
    assert bm.allocate(a, a.num_tokens, bm.match_prefix(a))
    a.num_computed_tokens = a.num_tokens
    bm.cache_full_blocks(a)
    first, second, third, partial = a.block_table
    bm.free(a)
    # the partial (unhashed) block is reused first, then a's tail, and its prefix survives longest
    order = list(bm.free_queue)
    assert order.index(partial) < order.index(third) < order.index(second) < order.index(first)
    b = _seq([1, 2, 3, 4, 9, 9, 9], "b")
    hit = bm.match_prefix(b)
    assert hit.block_ids == [first, second] and hit.num_tokens == 4
