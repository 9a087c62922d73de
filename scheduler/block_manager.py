"""Fixed-size KV blocks: a free list and reference counts (host only).

Source: Kwon et al. 2023, PagedAttention (vLLM) §4.2-4.3. Callers hold opaque
`Allocation`s and never touch the free list or the counts.
"""

from __future__ import annotations

import collections


class NoFreeBlocksError(RuntimeError):
    """The pool has fewer free blocks than a request needs right now."""


class Allocation:
    """The blocks holding one sequence's KV, in order. Opaque to callers."""

    __slots__ = ("_blocks",)

    def __init__(self):
        self._blocks: list[int] = []

    @property
    def block_ids(self) -> tuple[int, ...]:
        return tuple(self._blocks)


class BlockManager:
    """Hands out KV blocks of `block_size` tokens from a pool of `num_blocks`.

    Block 0 is reserved: padding tokens of a step write their KV there, and no
    sequence ever reads it.
    """

    RESERVED = 1

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks <= self.RESERVED:
            raise ValueError(f"num_blocks must exceed {self.RESERVED}, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free = collections.deque(range(self.RESERVED, num_blocks))
        self._refs = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - self.RESERVED

    def blocks_needed(self, allocation: Allocation, num_tokens: int) -> int:
        """Extra blocks `allocation` needs to hold `num_tokens` tokens."""
        return max(0, -(-num_tokens // self.block_size) - len(allocation._blocks))

    def allocate(self, allocation: Allocation | None, num_tokens: int) -> Allocation:
        """Grows (or creates) an allocation to hold `num_tokens` tokens.

        Raises NoFreeBlocksError, changing nothing, if the free list is too short.
        """
        allocation = allocation if allocation is not None else Allocation()
        need = self.blocks_needed(allocation, num_tokens)
        if need > len(self._free):
            raise NoFreeBlocksError(f"need {need} blocks, {len(self._free)} free")
        for _ in range(need):
            block = self._free.popleft()
            self._refs[block] = 1
            allocation._blocks.append(block)
        return allocation

    def free(self, allocation: Allocation) -> None:
        """Drops the allocation's references; blocks nobody holds return to the free list."""
        for block in reversed(allocation._blocks):
            if self._refs[block] <= 0:
                raise AssertionError(f"block {block} freed twice")
            self._refs[block] -= 1
            if self._refs[block] == 0:
                self._free.append(block)
        allocation._blocks.clear()

    def ref_count(self, block: int) -> int:
        return self._refs[block]
