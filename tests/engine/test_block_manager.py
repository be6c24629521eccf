"""Block manager properties under random operations (no model)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from localllm.engine.block_manager import NO_HASH, BlockManager
from localllm.engine.sequence import SamplingParams, Sequence


def _seq(tokens: list[int], rid: str = "r") -> Sequence:
    return Sequence(rid, list(tokens), SamplingParams(), (), 10_000)


class _Pool:
    """What the KV pool would hold: the token id whose KV each slot has (None: garbage)."""

    def __init__(self, bm: BlockManager) -> None:
        self.bm = bm
        self.slots: list[list[int | None]] = [[None] * bm.block_size for _ in range(bm.num_blocks)]

    def admit(self, s: Sequence, prefix) -> bool:
        """The scheduler's admission and the runner's copy, then computing every token."""
        if not self.bm.allocate(s, s.num_tokens, prefix):
            return False
        if prefix.copy_from >= 0:
            dst = s.block_table[len(prefix.block_ids)]
            self.slots[dst] = list(self.slots[prefix.copy_from])
        s.num_computed_tokens = prefix.num_tokens
        self.compute(s)
        return True

    def compute(self, s: Sequence) -> None:
        bs = self.bm.block_size
        for pos in range(s.num_computed_tokens, s.num_tokens):
            self.slots[s.block_table[pos // bs]][pos % bs] = s.token_ids[pos]
        s.num_computed_tokens = s.num_tokens
        self.bm.cache_full_blocks(s)


def _check(bm: BlockManager, live: list[Sequence], pool: _Pool) -> None:
    refs = [0] * bm.num_blocks
    for s in live:
        for b in s.block_table:
            refs[b] += 1
    for block in bm.blocks:
        assert block.ref_count == refs[block.block_id] >= 0
        assert (block.ref_count == 0) == (block.block_id in bm.free_queue)
        # a block's recorded tokens are what its slots hold
        assert pool.slots[block.block_id][: len(block.token_ids)] == list(block.token_ids)
    assert bm.num_cached_free_blocks == sum(1 for b in bm.free_queue if bm.blocks[b].hash != NO_HASH)
    for h, b in bm.cached.items():
        assert bm.blocks[b].hash == h and len(bm.blocks[b].token_ids) == bm.block_size
    for p, b in bm.tails.items():
        assert bm.blocks[b].parent == p and bm.blocks[b].token_ids
    # every computed token of a live sequence has its own KV where its block table says
    for s in live:
        for pos in range(s.num_computed_tokens):
            assert pool.slots[s.block_table[pos // bm.block_size]][pos % bm.block_size] == s.token_ids[pos]


ops = st.lists(
    st.tuples(st.sampled_from(["new", "append", "fork", "free", "free", "reset"]), st.integers(0, 7), st.integers(1, 40)),
    min_size=1, max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(ops)
def test_random_operations_keep_invariants(operations: list[tuple[str, int, int]]) -> None:
    bm = BlockManager(num_blocks=24, block_size=4)
    pool = _Pool(bm)
    live: list[Sequence] = []
    vocab = [1, 2, 3]  # a tiny vocabulary makes shared prefixes and hash hits common
    for op, pick, n in operations:
        if op == "new" or not live:
            tokens = [vocab[(pick * 7 + i * (pick % 3 + 1)) % 3] for i in range(n)]
            s = _seq(tokens, f"s{len(live)}")
            if pool.admit(s, bm.match_prefix(s)):
                live.append(s)
        elif op == "append":
            s = live[pick % len(live)]
            s.token_ids += [vocab[(pick + i) % 3] for i in range(n % 9 + 1)]
            if bm.allocate(s, s.num_tokens):
                pool.compute(s)
            else:
                s.token_ids = s.token_ids[: s.num_computed_tokens]
        elif op == "fork":  # a new request with the same prompt shares the cached full blocks
            parent = live[pick % len(live)]
            child = _seq(parent.token_ids[: parent.num_computed_tokens], f"f{len(live)}")
            prefix = bm.match_prefix(child)
            assert prefix.num_tokens < child.num_tokens  # the last token is always computed
            if pool.admit(child, prefix):
                live.append(child)
        elif op == "reset":
            bm.reset_prefix_cache()
        else:
            s = live.pop(pick % len(live))
            bm.free(s)
        _check(bm, live, pool)
    for s in live:
        bm.free(s)
    assert bm.num_free_blocks == bm.num_blocks


def test_a_repeated_prompt_computes_one_token() -> None:
    """A finished request's partly written last block serves the same prompt again: the new
    sequence gets a copy of its slots, up to the one token whose logits are needed."""
    bm = BlockManager(num_blocks=8, block_size=4)
    pool = _Pool(bm)
    a = _seq([5, 6, 7, 8, 9, 10], "a")  # one full block, then 2 tokens of the second
    assert pool.admit(a, bm.match_prefix(a))
    a.token_ids.append(11)  # its sampled token: no KV yet when it finishes
    last = a.block_table[1]
    bm.free(a)
    b = _seq([5, 6, 7, 8, 9, 10], "b")
    hit = bm.match_prefix(b)
    assert hit.num_tokens == 5 and hit.copy_from == last
    assert pool.admit(b, hit)
    assert pool.slots[b.block_table[1]][:2] == [9, 10]
    # the next turn of the chat: the prompt goes on past the reply; the reply's last token has no KV
    bm.free(b)
    c = _seq([5, 6, 7, 8, 9, 10, 12, 13], "c")
    assert bm.match_prefix(c).num_tokens == 6
    # a diverging prompt reuses only the common part
    d = _seq([5, 6, 7, 8, 9, 4, 4], "d")
    assert bm.match_prefix(d).num_tokens == 5


def test_a_partial_hit_inside_a_full_cached_block() -> None:
    """The last prompt block of an earlier request filled up with its reply: a new prompt that
    ends inside that block still reuses the common part."""
    bm = BlockManager(num_blocks=8, block_size=4)
    pool = _Pool(bm)
    a = _seq([1, 2, 3, 4, 5, 6, 7, 8], "a")
    assert pool.admit(a, bm.match_prefix(a))
    bm.free(a)
    b = _seq([1, 2, 3, 4, 5, 6, 9], "b")
    hit = bm.match_prefix(b)
    assert hit.num_tokens == 6 and len(hit.block_ids) == 1 and bm.blocks[hit.copy_from].token_ids == (5, 6, 7, 8)
    assert pool.admit(b, hit)
    _check(bm, [b], pool)


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
