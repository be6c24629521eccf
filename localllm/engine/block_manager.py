"""Which physical KV blocks hold which tokens: allocation, ref counts and the prefix cache.

Design (vLLM's automatic prefix caching):
- Each full block is keyed by a chained hash ``hash((parent_hash, token_ids))``; a hit also
  compares the stored token ids, so a hash collision can never return wrong KV.
- A block whose ref count drops to zero goes to the tail of the free queue but keeps its hash:
  it stays a cache hit until the queue hands it out again from the head (LRU). Sequences free
  their blocks tail first, so a sequence's last blocks are evicted before its shared prefix.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple

from localllm.engine.sequence import Sequence

NO_HASH = -1


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash = NO_HASH
        self.token_ids: tuple[int, ...] = ()


class PrefixMatch(NamedTuple):
    block_ids: list[int]
    block_hashes: list[int]
    num_tokens: int


class BlockManager:
    """Invariants: every block is either referenced (ref_count > 0) or in ``free_queue``;
    ``cached`` maps a hash to a block holding exactly those tokens; the sum of all ref counts
    equals the number of block-table entries of live sequences."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        assert num_blocks > 0 and block_size > 0
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[int, int] = {}

    # ---- accounting ----

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_cached_free_blocks(self) -> int:
        return sum(1 for b in self.free_queue if self.blocks[b].hash != NO_HASH)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free_queue) / len(self.blocks)

    # ---- prefix cache ----

    def match_prefix(self, seq: Sequence) -> PrefixMatch:
        """Longest run of cached full blocks at the start of ``seq``. At least one token is
        always left to compute, because the last prompt token's logits are needed."""
        if not self.enable_prefix_caching:
            return PrefixMatch([], [], 0)
        bs = self.block_size
        max_blocks = (seq.num_tokens - 1) // bs
        ids: list[int] = []
        hashes: list[int] = []
        parent = NO_HASH
        tokens = seq.token_ids
        for i in range(max_blocks):
            chunk = tuple(tokens[i * bs : (i + 1) * bs])
            h = hash((parent, chunk))
            block_id = self.cached.get(h)
            if block_id is None or self.blocks[block_id].token_ids != chunk:
                break
            ids.append(block_id)
            hashes.append(h)
            parent = h
        return PrefixMatch(ids, hashes, len(ids) * bs)

    # ---- allocation ----

    def allocate(self, seq: Sequence, num_tokens: int, prefix: PrefixMatch | None = None) -> bool:
        """Makes ``seq.block_table`` cover ``num_tokens`` tokens, first taking the blocks of
        ``prefix`` (a fresh sequence's cache hit). Returns False, changing nothing, when the free
        queue is too short."""
        if prefix is not None and prefix.block_ids:
            assert not seq.block_table
            # Hit blocks sitting in the free queue stop being free once taken.
            reusable = sum(1 for b in prefix.block_ids if self.blocks[b].ref_count == 0)
            needed = -(-num_tokens // self.block_size) - len(prefix.block_ids)
            if needed + reusable > len(self.free_queue):
                return False
            for b in prefix.block_ids:
                block = self.blocks[b]
                if block.ref_count == 0:
                    del self.free_queue[b]
                block.ref_count += 1
            seq.block_table = list(prefix.block_ids)
            seq.block_hashes = list(prefix.block_hashes)
        needed = -(-num_tokens // self.block_size) - len(seq.block_table)
        if needed <= 0:
            return True
        if needed > len(self.free_queue):
            return False
        for _ in range(needed):
            seq.block_table.append(self._pop_free())
        return True

    def _pop_free(self) -> int:
        block_id, _ = self.free_queue.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash != NO_HASH:  # evict: its KV is about to be overwritten
            if self.cached.get(block.hash) == block_id:
                del self.cached[block.hash]
            block.hash, block.token_ids = NO_HASH, ()
        block.ref_count = 1
        return block_id

    def free(self, seq: Sequence) -> None:
        """Releases the sequence's blocks, tail first, so its prefix outlives its tail."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0
            if block.ref_count == 0:
                if block.hash == NO_HASH:
                    self.free_queue[block_id] = None
                    self.free_queue.move_to_end(block_id, last=False)  # worthless: reuse first
                else:
                    self.free_queue[block_id] = None
        seq.block_table = []
        seq.block_hashes = []

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Registers every block of ``seq`` that became full with computed tokens."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        num_full = seq.num_computed_tokens // bs
        tokens = seq.token_ids
        hashes = seq.block_hashes
        parent = hashes[-1] if hashes else NO_HASH
        for i in range(len(hashes), num_full):
            chunk = tuple(tokens[i * bs : (i + 1) * bs])
            h = hash((parent, chunk))
            hashes.append(h)
            parent = h
            block = self.blocks[seq.block_table[i]]
            if block.hash == NO_HASH:
                block.hash, block.token_ids = h, chunk
                # A duplicate (two sequences computed the same block at once) stays private.
                self.cached.setdefault(h, block.block_id)

    def reset_prefix_cache(self) -> None:
        for block_id in self.free_queue:
            block = self.blocks[block_id]
            block.hash, block.token_ids = NO_HASH, ()
        self.cached = {h: b for h, b in self.cached.items() if self.blocks[b].ref_count > 0}
