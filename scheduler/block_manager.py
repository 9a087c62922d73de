"""Fixed-size KV blocks: free list, reference counts, copy-on-write and a radix prefix cache (host only).

Sources: Kwon et al. 2023, PagedAttention (vLLM) §4.2-4.4 (block tables,
reference counts, copy-on-write for parallel sampling); Zheng et al. 2024,
SGLang §3 (RadixAttention: a radix tree of cached KV with LRU eviction).
Callers hold opaque `Allocation`s and never touch the free list, the counts
or the tree.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Hashable, Sequence

from scheduler.util import cdiv


NULL_BLOCK = 0  # the reserved block: padding writes land there, and it fills the table where a window passed


class NoFreeBlocksError(RuntimeError):
    """The pool has fewer free blocks than a request needs right now."""


class _Node:
    """A radix-tree node: one full block of tokens and the KV block holding it.

    A block's KV depends on every token before it, so a node's identity is its
    whole path from the root (the tokens of all earlier blocks) plus its own.
    """

    __slots__ = ("block", "children", "key", "parent")

    def __init__(self, key: tuple[int, ...] | None, block: int, parent: _Node | None):
        self.key = key
        self.block = block
        self.parent = parent
        self.children: dict[tuple[int, ...], _Node] = {}


class Allocation:
    """The blocks holding one sequence's KV, in order. Opaque to callers."""

    __slots__ = ("_blocks", "_node", "_num_cached", "_salt")

    def __init__(self, salt: Hashable = None):
        self._blocks: list[int] = []
        self._num_cached = 0  # leading blocks already in the prefix cache
        self._node: _Node | None = None  # the cache node of the last of those
        self._salt = salt

    @property
    def block_ids(self) -> tuple[int, ...]:
        return tuple(self._blocks)


@dataclasses.dataclass(frozen=True)
class BlockCopy:
    """Copy block `src` to block `dst` on the device before the step runs (copy-on-write)."""

    src: int
    dst: int


class BlockManager:
    """Hands out KV blocks of `block_size` tokens from a pool of `num_blocks`.

    Block 0 is reserved: padding tokens of a step write their KV there, and no
    sequence ever reads it. It also stands in a block table for the blocks a
    sliding window has passed (`release_before`): positions no layer reads.

    Prefix cache: every full block a sequence has computed is entered in a
    radix tree keyed on its tokens (one tree per cache salt, so tenants with
    different salts never share). A later sequence with the same leading
    blocks takes references on those blocks instead of recomputing them. A
    cached block nobody holds stays in the tree, evictable: whenever fewer
    than `watermark_blocks` blocks are on the free list, the least recently
    used evictable blocks (leaves first) are dropped from the tree and freed.

    Counts: `ref_count(b)` is the number of allocations holding block b.
    `num_free_blocks` counts the blocks an allocation can get now: the free
    list plus evictable cached blocks.
    """

    RESERVED = 1

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_cache: bool = True,
                 watermark: float = 0.1):
        if num_blocks <= self.RESERVED:
            raise ValueError(f"num_blocks must exceed {self.RESERVED}, got {num_blocks}")
        if not 0 <= watermark < 1:
            raise ValueError(f"watermark must be in [0, 1), got {watermark}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_cache = enable_prefix_cache
        self.watermark_blocks = int(watermark * (num_blocks - self.RESERVED))
        self._free = collections.deque(range(self.RESERVED, num_blocks))
        self._refs = [0] * num_blocks
        self._roots: dict[Hashable, _Node] = {}
        self._cached: dict[int, _Node] = {}  # block -> its tree node
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()  # LRU first
        self.num_evictions = 0

    # ---- counts -------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - self.RESERVED

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def ref_count(self, block: int) -> int:
        return self._refs[block]

    def blocks_needed(self, allocation: Allocation | None, num_tokens: int) -> int:
        """Extra blocks `allocation` needs to hold `num_tokens` tokens."""
        have = len(allocation._blocks) if allocation is not None else 0
        return max(0, cdiv(num_tokens, self.block_size) - have)

    # ---- allocation ---------------------------------------------------------------------

    def allocate(self, allocation: Allocation | None, num_tokens: int, salt: Hashable = None) -> Allocation:
        """Grows (or creates, with cache salt `salt`) an allocation to hold `num_tokens` tokens.

        Raises NoFreeBlocksError, changing nothing, if too few blocks are free.
        """
        allocation = allocation if allocation is not None else Allocation(salt)
        need = self.blocks_needed(allocation, num_tokens)
        if need > self.num_free_blocks:
            raise NoFreeBlocksError(f"need {need} blocks, {self.num_free_blocks} free")
        for _ in range(need):
            block = self._take()
            self._refs[block] = 1
            allocation._blocks.append(block)
        self._keep_watermark()
        return allocation

    def free(self, allocation: Allocation) -> None:
        """Drops the allocation's references; blocks nobody holds become free (or evictable if cached)."""
        # Tail blocks first, so they are older in the LRU order than the prefix they extend.
        for block in reversed(allocation._blocks):
            if block != NULL_BLOCK:
                self._release(block)
        allocation._blocks.clear()
        allocation._num_cached = 0
        allocation._node = None
        self._keep_watermark()

    def truncate(self, allocation: Allocation, num_tokens: int) -> None:
        """Frees the blocks past the first `num_tokens` tokens (rejected draft positions)."""
        keep = cdiv(num_tokens, self.block_size)
        while len(allocation._blocks) > keep:
            if (block := allocation._blocks.pop()) != NULL_BLOCK:
                self._release(block)
        self._keep_watermark()

    def release_before(self, allocation: Allocation, position: int) -> int:
        """Drops the allocation's references on its blocks that hold only positions before `position` (a
        sliding window has passed them: no layer reads them again), leaving `NULL_BLOCK` in their place in
        the block table; with the prefix cache on, only blocks already cached (they stay in the cache,
        evictable). Returns how many it dropped. vLLM's sliding-window manager does the same (its null block).
        """
        last = position // self.block_size  # blocks [0, last) end at or before `position`
        if self.enable_prefix_cache:
            last = min(last, allocation._num_cached)
        dropped = 0
        for i in range(min(last, len(allocation._blocks))):
            if (block := allocation._blocks[i]) != NULL_BLOCK:
                allocation._blocks[i] = NULL_BLOCK
                self._release(block)
                dropped += 1
        return dropped

    def fork(self, allocation: Allocation) -> Allocation:
        """A new allocation sharing every block of `allocation` (one more reference each).

        The first write into a shared block goes through `copy_on_write`.
        """
        child = Allocation(allocation._salt)
        child._blocks = list(allocation._blocks)
        child._num_cached, child._node = allocation._num_cached, allocation._node
        for block in child._blocks:
            if block != NULL_BLOCK:
                self._refs[block] += 1
        return child

    def copy_on_write(self, allocation: Allocation, position: int) -> BlockCopy | None:
        """Gives `allocation` a private copy of the block holding `position` if that block is shared.

        Returns the device copy to run before the write, or None if the block is
        already private. Raises NoFreeBlocksError, changing nothing, if no block is free.
        """
        i = position // self.block_size
        if i >= len(allocation._blocks) or self._refs[allocation._blocks[i]] == 1:
            return None
        src = allocation._blocks[i]
        if self.num_free_blocks == 0:
            raise NoFreeBlocksError("need 1 block for copy-on-write, 0 free")
        dst = self._take()
        self._refs[dst] = 1
        self._refs[src] -= 1  # was > 1: someone else still holds it
        allocation._blocks[i] = dst
        self._keep_watermark()
        return BlockCopy(src, dst)

    # ---- prefix cache -------------------------------------------------------------------

    def match_prefix(self, token_ids: Sequence[int], max_tokens: int, salt: Hashable = None) -> tuple[Allocation, int]:
        """A new allocation holding the longest cached run of full leading blocks of `token_ids`.

        At most `max_tokens` tokens are matched (callers leave the last prompt
        token out, since its logits are needed). Returns (allocation, number of
        cached tokens); the allocation holds a reference on every matched block.
        """
        allocation = Allocation(salt)
        if not self.enable_prefix_cache:
            return allocation, 0
        node = self._roots.get(salt)
        B = self.block_size
        for i in range(min(max_tokens, len(token_ids)) // B):
            node = node.children.get(tuple(token_ids[i * B:(i + 1) * B])) if node is not None else None
            if node is None:
                break
            self._hold(node.block)
            allocation._blocks.append(node.block)
            allocation._node = node
        allocation._num_cached = len(allocation._blocks)
        return allocation, len(allocation._blocks) * B

    def cache_blocks(self, allocation: Allocation, token_ids: Callable[[int, int], Sequence[int]],
                     num_computed_tokens: int) -> None:
        """Enters the allocation's fully computed blocks in the prefix cache.

        `token_ids(start, end)` returns the sequence's tokens `start:end`.
        A block whose tokens another sequence already cached is swapped for the
        cached one (same KV), and the duplicate is freed.
        """
        if not self.enable_prefix_cache:
            return
        B = self.block_size
        salt = allocation._salt
        parent = allocation._node or self._roots.get(salt)
        if parent is None:
            parent = self._roots[salt] = _Node(salt, -1, None)
        for i in range(allocation._num_cached, num_computed_tokens // B):
            key = tuple(token_ids(i * B, (i + 1) * B))
            block = allocation._blocks[i]
            node = parent.children.get(key)
            if node is None:
                node = parent.children[key] = _Node(key, block, parent)
                self._cached[block] = node
            elif node.block != block:
                self._hold(node.block)
                allocation._blocks[i] = node.block
                self._release(block)
            parent = node
            allocation._num_cached = i + 1
            allocation._node = node
        self._keep_watermark()

    def reset_prefix_cache(self) -> int:
        """Evicts every unreferenced cached block; returns how many were freed."""
        n = 0
        while self._evict_one():
            n += 1
        return n

    # ---- internals ----------------------------------------------------------------------

    def _take(self) -> int:
        if not self._free:
            self._evict_one()
        return self._free.popleft()

    def _hold(self, block: int) -> None:
        if self._refs[block] == 0:
            del self._evictable[block]
        self._refs[block] += 1

    def _release(self, block: int) -> None:
        if self._refs[block] <= 0:
            raise AssertionError(f"block {block} freed twice")
        self._refs[block] -= 1
        if self._refs[block] == 0:
            if block in self._cached:
                self._evictable[block] = None
            else:
                self._free.append(block)

    def _keep_watermark(self) -> None:
        while len(self._free) < self.watermark_blocks and self._evict_one():
            pass

    def _evict_one(self) -> bool:
        """Frees the least recently used evictable block that is a leaf of the tree."""
        for block in self._evictable:
            node = self._cached[block]
            if not node.children:
                del self._evictable[block], self._cached[block], node.parent.children[node.key]
                if node.parent.parent is None and not node.parent.children:
                    del self._roots[node.parent.key]  # an empty tree of a salt
                self._free.append(block)
                self.num_evictions += 1
                return True
        return False
