"""Paged KV cache bookkeeping: a free-block queue, per-sequence block tables, prefix reuse.

Block 0 is reserved as a scratch block (padding slots of CUDA-graph batches write there).
Full blocks are hashed by (previous block's hash, their tokens) as soon as their step is launched; a new sequence
whose prompt starts with the same full blocks shares them (reference-counted) instead of recomputing.
Freed blocks keep their hash until they are handed out again, so recently used prefixes survive.
"""

from collections import OrderedDict

from service.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 2:
            raise ValueError("the KV cache needs at least 2 blocks (one is reserved)")
        self.block_size = block_size
        self.num_usable_blocks = num_blocks - 1
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_count = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        # insertion order is eviction order: least recently freed first
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
        self.cached: dict[int, int] = {}  # block hash -> block id

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_usable_blocks - len(self.free)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_usable_blocks

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        total = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size)
        return max(0, total - len(seq.block_table))

    def allocate(self, seq: Sequence, num_new_tokens: int, reserve: int = 0) -> bool:
        """Give `seq` the blocks its next `num_new_tokens` tokens need, keeping `reserve` blocks free."""
        need = self.blocks_needed(seq, num_new_tokens)
        if need + reserve > len(self.free):
            return False
        for _ in range(need):
            seq.block_table.append(self._take_free_block())
        return True

    def match_prefix(self, seq: Sequence) -> None:
        """Point a newly admitted sequence at cached blocks holding its leading full blocks."""
        assert not seq.block_table
        seq.num_hashed_blocks = 0
        if self.enable_prefix_caching:
            tokens, block_size, h = seq.token_ids, self.block_size, None
            # at least one token must be computed, so that the step yields logits; and every position whose prompt
            # logprobs are still to come (the cache holds keys and values, not the logits)
            usable = len(tokens) - 1
            if seq.num_prompt_logprobs_missing:
                usable = min(usable, len(seq.prompt_logprobs))
            for i in range(usable // block_size):
                chunk = tuple(tokens[i * block_size:(i + 1) * block_size])
                h = hash((h, chunk))
                block = self.cached.get(h)
                if block is None or self.block_tokens[block] != chunk:
                    break
                if self.ref_count[block] == 0:
                    del self.free[block]
                self.ref_count[block] += 1
                seq.block_table.append(block)
            seq.num_hashed_blocks = len(seq.block_table)
        seq.num_computed_tokens = seq.num_cached_tokens = len(seq.block_table) * self.block_size

    def commit(self, seq: Sequence) -> None:
        """Register the sequence's full blocks in the prefix cache: those computed, or launched to be (a later step
        reads them after this one wrote them, in stream order), whose tokens the host knows. Most calls fill no
        block, and cost one comparison."""
        if not self.enable_prefix_caching:
            return
        block_size = self.block_size
        full = min(seq.num_computed_tokens, len(seq.token_ids)) // block_size
        if full <= seq.num_hashed_blocks:
            return
        h = self.block_hash[seq.block_table[seq.num_hashed_blocks - 1]] if seq.num_hashed_blocks else None
        for i in range(seq.num_hashed_blocks, full):
            chunk = tuple(seq.token_ids[i * block_size:(i + 1) * block_size])
            h = hash((h, chunk))
            block = seq.block_table[i]
            self.block_hash[block], self.block_tokens[block] = h, chunk
            self.cached.setdefault(h, block)
        seq.num_hashed_blocks = full

    def commit_all(self, seqs) -> None:
        """`commit` each of `seqs`."""
        for seq in seqs:
            self.commit(seq)

    def forget(self, seq: Sequence) -> None:
        """Take the sequence's blocks out of the prefix cache (their step failed: what they hold is not to be read)."""
        for block in seq.block_table:
            h = self.block_hash[block]
            if h is not None:
                if self.cached.get(h) == block:
                    del self.cached[h]
                self.block_hash[block] = self.block_tokens[block] = None
        seq.num_hashed_blocks = 0

    def free_sequence(self, seq: Sequence) -> None:
        for block in reversed(seq.block_table):
            self.ref_count[block] -= 1
            if self.ref_count[block] == 0:
                self.free[block] = None
        seq.block_table = []
        seq.num_hashed_blocks = 0

    def _take_free_block(self) -> int:
        block, _ = self.free.popitem(last=False)
        h = self.block_hash[block]
        if h is not None:
            if self.cached.get(h) == block:
                del self.cached[h]
            self.block_hash[block] = self.block_tokens[block] = None
        self.ref_count[block] = 1
        return block
