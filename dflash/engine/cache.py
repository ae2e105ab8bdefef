"""Paged KV cache blocks: one allocator hands out block ids that index BOTH the target's and the
draft's cache tensors, since a sequence always has the same number of tokens in each."""

from __future__ import annotations


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one cache block of at least one token, got "
                             f"num_blocks={num_blocks}, block_size={block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free = list(range(num_blocks - 1, -1, -1))   # pop() hands out low ids first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def grow(self, table: list[int], tokens: int) -> bool:
        """Extend `table` to hold `tokens` tokens. All or nothing: False (table unchanged) when
        there are not enough free blocks."""
        needed = self.blocks_for(tokens) - len(table)
        if needed <= 0:
            return True
        if needed > len(self._free):
            return False
        table.extend(self._free.pop() for _ in range(needed))
        return True

    def free(self, table: list[int]) -> None:
        self._free.extend(reversed(table))
        table.clear()
