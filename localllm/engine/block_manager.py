"""Which physical KV blocks hold which tokens: allocation, ref counts and the prefix cache.

Design (vLLM's automatic prefix caching):
- Each full block is keyed by a chained hash ``hash((parent_hash, token_ids))``; a hit also
  compares the stored token ids, so a hash collision can never return wrong KV.
- A block whose ref count drops to zero goes to the tail of the free queue but keeps its hash:
  it stays a cache hit until the queue hands it out again from the head (LRU). Sequences free
  their blocks tail first, so a sequence's last blocks are evicted before its shared prefix.
- Token-level reuse inside a block (SGLang's radix tree does this; vLLM recomputes the rest):
  ``tails`` maps a parent hash to the latest block that followed it, a full one or a finished
  sequence's partly written last block. A prompt that matches that block for k < block_size
  tokens (a repeated prompt, the next turn of a chat) gets a fresh block and the copy of the
  k slots, so only the tokens after them are computed: a repeated prompt computes one token.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple

from localllm.engine.sequence import Sequence

NO_HASH = -1


class Block:
    """``token_ids``: the tokens whose KV the block holds, recorded while that stays true (a
    hashed full block, or a ``tails`` entry); empty otherwise. ``parent``: the hash of the
    block before it, for its ``tails`` entry."""

    __slots__ = ("block_id", "ref_count", "hash", "parent", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash = NO_HASH
        self.parent = NO_HASH
        self.token_ids: tuple[int, ...] = ()


class PrefixMatch(NamedTuple):
    """Full cached blocks, then optionally the first ``num_tokens - len(block_ids) * block_size``
    slots of block ``copy_from``, which the sequence's next block gets a copy of."""

    block_ids: list[int]
    block_hashes: list[int]
    num_tokens: int
    copy_from: int = -1


class BlockManager:
    """Invariants: every block is either referenced (ref_count > 0) or in ``free_queue``;
    ``cached`` maps a hash to a block holding exactly those tokens; ``tails`` maps a parent hash
    to a block whose ``token_ids`` it holds the KV of; the sum of all ref counts equals the
    number of block-table entries of live sequences; ``num_cached_free_blocks`` counts the free
    blocks that have a hash (kept as each block enters or leaves the free queue: the engine
    reads it every step, and a count over a free queue of 10k+ blocks took 0.5 ms)."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        assert num_blocks > 0 and block_size > 0
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[int, int] = {}
        self.tails: dict[int, int] = {}
        self._cached_free = 0

    # ---- accounting ----

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_cached_free_blocks(self) -> int:
        return self._cached_free

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free_queue) / len(self.blocks)

    # ---- prefix cache ----

    def match_prefix(self, seq: Sequence) -> PrefixMatch:
        """Longest run of cached full blocks at the start of ``seq``, then the longest common
        start of the next block with the ``tails`` block after them. At least one token is
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
        start = len(ids) * bs
        tail = self.tails.get(parent)
        if tail is not None:
            stored = self.blocks[tail].token_ids
            k = 0
            for a, b in zip(stored, tokens[start : seq.num_tokens - 1]):
                if a != b:
                    break
                k += 1
            if k:
                return PrefixMatch(ids, hashes, start + k, tail)
        return PrefixMatch(ids, hashes, start)

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
                    self._cached_free -= 1  # a hit block has a hash
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
        if block.hash != NO_HASH:
            self._cached_free -= 1
        if block.token_ids:  # evict: its KV is about to be overwritten
            if self.cached.get(block.hash) == block_id:
                del self.cached[block.hash]
            if self.tails.get(block.parent) == block_id:
                del self.tails[block.parent]
            block.hash, block.parent, block.token_ids = NO_HASH, NO_HASH, ()
        block.ref_count = 1
        return block_id

    def free(self, seq: Sequence) -> None:
        """Releases the sequence's blocks, tail first, so its prefix outlives its tail. A
        partly computed last block is kept as a ``tails`` entry."""
        self._keep_tail(seq)
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0
            if block.ref_count == 0:
                if not block.token_ids:
                    self.free_queue[block_id] = None
                    self.free_queue.move_to_end(block_id, last=False)  # worthless: reuse first
                else:
                    self.free_queue[block_id] = None
                    self._cached_free += block.hash != NO_HASH
        seq.block_table = []
        seq.block_hashes = []

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Gives back the blocks of ``seq`` past the first ``num_tokens`` tokens: those a
        speculative step took for proposals that were rejected. They hold no hash (their
        tokens were never computed as accepted), so they go to the front of the free queue."""
        keep = -(-num_tokens // self.block_size)
        while len(seq.block_table) > max(keep, len(seq.block_hashes)):
            block = self.blocks[seq.block_table.pop()]
            block.ref_count -= 1
            assert block.ref_count == 0 and not block.token_ids, "a speculative block is private and unhashed"
            self.free_queue[block.block_id] = None
            self.free_queue.move_to_end(block.block_id, last=False)

    def _keep_tail(self, seq: Sequence) -> None:
        j, k = divmod(seq.num_computed_tokens, self.block_size)
        if not self.enable_prefix_caching or k == 0 or j >= len(seq.block_table) or len(seq.block_hashes) != j:
            return
        block = self.blocks[seq.block_table[j]]
        if block.ref_count != 1 or block.token_ids:
            return
        block.parent = seq.block_hashes[j - 1] if j else NO_HASH
        block.token_ids = tuple(seq.token_ids[j * self.block_size : seq.num_computed_tokens])
        self.tails[block.parent] = block.block_id

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
            parent_of = parent
            h = hash((parent, chunk))
            hashes.append(h)
            parent = h
            block = self.blocks[seq.block_table[i]]
            if block.hash == NO_HASH:
                block.hash, block.parent, block.token_ids = h, parent_of, chunk
                # A duplicate (two sequences computed the same block at once) stays private.
                self.cached.setdefault(h, block.block_id)
                self.tails[parent_of] = block.block_id

    def reset_prefix_cache(self) -> None:
        for block_id in self.free_queue:
            block = self.blocks[block_id]
            block.hash, block.parent, block.token_ids = NO_HASH, NO_HASH, ()
        self._cached_free = 0
        self.cached = {h: b for h, b in self.cached.items() if self.blocks[b].ref_count > 0}
        self.tails = {p: b for p, b in self.tails.items() if self.blocks[b].ref_count > 0}
