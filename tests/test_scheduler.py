"""Host-side scheduling: block accounting, the token budget, chunked prefill, preemption, bucket packing."""

import subprocess
import sys

import numpy as np
import pytest

from scheduler.block_manager import BlockCopy, BlockManager, NoFreeBlocksError
from scheduler.packing import bucket_for, pack, power_of_two_buckets, step_buckets, step_shape
from scheduler.request import FinishReason, Request, SamplingParams
from scheduler.scheduler import Scheduler, SchedulerConfig


def test_scheduler_package_never_imports_jax():
    code = "import sys, scheduler.scheduler, scheduler.packing, scheduler.block_manager; print('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_block_manager_counts_and_errors():
    bm = BlockManager(num_blocks=5, block_size=4)  # block 0 reserved: 4 usable
    a = bm.allocate(None, 5)  # 2 blocks
    assert len(a.block_ids) == 2 and 0 not in a.block_ids and bm.num_free_blocks == 2
    bm.allocate(a, 8)  # still 2 blocks
    assert bm.num_free_blocks == 2
    with pytest.raises(NoFreeBlocksError):
        bm.allocate(None, 9)  # 3 blocks needed, 2 free: nothing changes
    assert bm.num_free_blocks == 2
    bm.free(a)
    assert bm.num_free_blocks == 4 and a.block_ids == ()


def _cache(bm, tokens):
    """Allocates and computes `tokens` as one sequence, caches its full blocks, and frees it."""
    a, _ = bm.match_prefix(tokens, len(tokens) - 1)
    a = bm.allocate(a, len(tokens))
    bm.cache_blocks(a, lambda s, e: tokens[s:e], len(tokens))
    ids = a.block_ids
    bm.free(a)
    return ids


def test_prefix_cache_hit_reuses_full_blocks():
    bm = BlockManager(num_blocks=9, block_size=4, watermark=0.0)  # 8 usable
    prompt = list(range(10, 21))  # 11 tokens: 2 full blocks + 3
    first = _cache(bm, prompt)
    assert bm.num_cached_blocks == 2 and bm.num_free_blocks == 8  # cached blocks stay evictable
    a, cached = bm.match_prefix(prompt + [99], 11)
    assert cached == 8 and a.block_ids == first[:2]
    assert [bm.ref_count(b) for b in first[:2]] == [1, 1] and bm.num_free_blocks == 6
    b, cached_b = bm.match_prefix(prompt[:8], 7)  # the last token must be computed: 1 block only
    assert cached_b == 4 and b.block_ids == first[:1] and bm.ref_count(first[0]) == 2
    c, cached_c = bm.match_prefix([10, 11, 12, 99] + prompt[4:], 11)  # differs in block 0: no hit
    assert cached_c == 0 and c.block_ids == ()
    for x in (a, b):
        bm.free(x)
    assert bm.num_free_blocks == 8 and bm.num_cached_blocks == 2


def test_prefix_cache_salt_isolates_tenants():
    bm = BlockManager(9, 4, watermark=0.0)
    prompt = list(range(10, 19))
    _cache(bm, prompt)
    assert bm.match_prefix(prompt, 8, salt="tenant-b")[1] == 0
    a, cached = bm.match_prefix(prompt, 8, salt=None)
    assert cached == 8
    bm.free(a)


def test_prefix_cache_evicts_lru_leaves_at_the_watermark():
    bm = BlockManager(num_blocks=9, block_size=4, watermark=0.25)  # 8 usable; keep 2 on the free list
    old = _cache(bm, list(range(100, 108)))  # 2 blocks
    new = _cache(bm, list(range(200, 208)))
    assert bm.num_cached_blocks == 4 and bm.num_free_blocks == 8
    a = bm.allocate(None, 16)  # 4 blocks from the free list leaves 0 < 2: evict the 2 LRU blocks
    assert bm.num_cached_blocks == 2 and bm.num_evictions == 2
    assert bm.match_prefix(list(range(100, 109)), 8)[1] == 0  # the old prompt is gone
    hit, cached = bm.match_prefix(list(range(200, 209)), 8)
    assert cached == 8 and hit.block_ids == new
    assert not set(a.block_ids) & set(new + old) and bm.num_free_blocks == 2  # old's blocks: free list
    bm.free(hit)
    bm.free(a)
    assert bm.num_free_blocks == 8


def test_copy_on_write_for_shared_partial_block():
    bm = BlockManager(9, 4, watermark=0.0)
    parent = bm.allocate(None, 6)  # blocks p0 (full), p1 (2 of 4 tokens)
    p0, p1 = parent.block_ids
    kids = [bm.fork(parent) for _ in range(3)]
    bm.free(parent)
    assert bm.ref_count(p0) == bm.ref_count(p1) == 3 and bm.num_free_blocks == 6
    # Position 3 is in the full shared block p0: a private copy into the free list's head (blocks are handed out
    # in order: parent took 1 and 2), p1 still shared.
    assert (p0, p1) == (1, 2) and bm.copy_on_write(kids[0], 3) == BlockCopy(src=p0, dst=3)
    assert kids[0].block_ids == (3, p1) and bm.ref_count(p0) == 2 and bm.ref_count(3) == 1
    assert bm.ref_count(p1) == 3 and bm.num_free_blocks == 5
    bm.free(kids[0])
    kids[0] = bm.fork(kids[1])
    c0 = bm.copy_on_write(kids[0], 6)  # writes at 6 go into p1, shared by 3: private copy
    c1 = bm.copy_on_write(kids[1], 6)
    assert c0.src == c1.src == p1 and c0.dst != c1.dst and bm.ref_count(p1) == 1
    assert bm.copy_on_write(kids[2], 6) is None  # the last holder writes in place
    assert [k.block_ids for k in kids] == [(p0, c0.dst), (p0, c1.dst), (p0, p1)]
    assert bm.ref_count(p0) == 3 and bm.num_free_blocks == 4
    for k in kids:
        bm.free(k)
    assert bm.num_free_blocks == 8


def test_fork_n_samples_share_prompt_blocks():
    bm = BlockManager(17, 4, watermark=0.0)
    sch = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64), bm)
    parent = _req(6, n=3)
    sch.add(parent)
    plan = sch.schedule()  # prefill of 5 tokens; the 6th runs once per sample
    assert [(s.request, s.start, s.num_new_tokens, s.sample) for s in plan.seqs] == [(parent, 0, 5, False)]
    sch.commit(plan)
    plan = sch.schedule()
    (_, kids), = plan.forks
    assert [k.index for k in kids] == [0, 1, 2] and parent.finished
    assert [(s.request, s.start, s.num_new_tokens, s.sample) for s in plan.seqs] == [(k, 5, 1, True) for k in kids]
    # Block 1 holds tokens 4-5: the first two samples copy it, the last writes in place.
    assert len(plan.copies) == 2 and bm.num_free_blocks == 16 - 2 - 2
    assert len({k.allocation.block_ids[0] for k in kids}) == 1


def test_swap_preemption_for_long_sequences():
    bm = BlockManager(5, 4, watermark=0.0)  # 4 usable blocks
    sch = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64,
                                    swap_threshold_tokens=5, swap_space_blocks=8), bm)
    short, long = _req(4), _req(8)
    sch.add(short)
    sch.add(long)
    sch.commit(sch.schedule())  # short: 1 block, long: 2 blocks
    for r in (short, long):
        r.append_token(7, 64)
    plan = sch.schedule()  # both need a block, one is free: `long` (8 computed >= 5) is swapped
    assert [s.request for s in plan.seqs] == [short] and plan.preempted == [long]
    assert plan.swap_out == [(long, long_blocks := plan.swap_out[0][1])] and len(long_blocks) == 2
    assert long.status.value == "swapped" and long.num_computed_tokens == 8 and sch.swap_used_blocks == 2
    sch.commit(plan)
    sch.finish(short, FinishReason.STOP)
    plan = sch.schedule()  # swapped back in ahead of anything waiting, then its decode token runs
    assert [b for _, b in plan.swap_in] == [long.allocation.block_ids[:2]] and sch.swap_used_blocks == 0
    assert [(s.request, s.start, s.num_new_tokens) for s in plan.seqs] == [(long, 8, 1)]


_first_token = iter(range(100, 10**6, 100))


def _req(length, max_tokens=4, **sampling):
    """A request whose prompt shares no block with other `_req`s (so the prefix cache stays out of the way)."""
    start = next(_first_token)
    return Request(list(range(start, start + length)), SamplingParams(temperature=0, max_tokens=max_tokens, **sampling))


def test_token_budget_and_chunked_prefill():
    bm = BlockManager(64, 16)
    sch = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=10, max_model_len=256), bm)
    long, short = _req(23), _req(3)
    sch.add(long)
    sch.add(short)
    plan = sch.schedule()
    assert [(s.request, s.start, s.num_new_tokens, s.sample) for s in plan.seqs] == [(long, 0, 10, False)]
    sch.commit(plan)
    plan = sch.schedule()
    assert [(s.start, s.num_new_tokens) for s in plan.seqs] == [(10, 10)]
    sch.commit(plan)
    plan = sch.schedule()  # the last 3 prompt tokens of `long`, then `short` is admitted with the rest
    assert [(s.request, s.start, s.num_new_tokens, s.sample) for s in plan.seqs] == [
        (long, 20, 3, True), (short, 0, 3, True)]
    assert plan.num_tokens == 6


def test_preemption_recomputes_newest_request():
    bm = BlockManager(4, 4)  # 3 usable blocks of 4 tokens
    sch = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64), bm)
    old, new = _req(4), _req(4)
    sch.add(old)
    sch.add(new)
    plan = sch.schedule()
    assert len(plan.seqs) == 2
    sch.commit(plan)
    for r in (old, new):
        r.append_token(7, 64)
    plan = sch.schedule()  # each needs a second block; only one is free
    assert [s.request for s in plan.seqs] == [old] and plan.preempted == [new]
    assert new.num_computed_tokens == 0 and new.allocation.block_ids == ()
    assert bm.num_free_blocks == 1
    sch.finish(old, FinishReason.STOP)
    assert bm.num_free_blocks == 3


def test_long_steps_pad_their_sequences_to_powers_of_four():
    tokens, seqs = power_of_two_buckets(512), power_of_two_buckets(64)
    assert step_shape(100, 5, tokens, seqs) == (128, 16)
    assert step_shape(64, 5, tokens, seqs) == (64, 8)
    assert step_shape(300, 1, tokens, seqs) == (512, 1) and step_shape(129, 17, tokens, seqs) == (256, 64)
    # 1+2+...+7 shapes up to 64 tokens, then S in {1, 4, 16, 64} for each of 128, 256 and 512.
    assert len(step_buckets(tokens, seqs)) == 28 + 3 * 4
    assert step_shape(200, 40, tokens, power_of_two_buckets(48)) == (256, 48)


def test_packing_pads_to_buckets():
    assert power_of_two_buckets(48) == (1, 2, 4, 8, 16, 32, 48)
    assert bucket_for(5, (1, 2, 4, 8)) == 8
    bm = BlockManager(16, 4)
    sch = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64), bm)
    a, b = _req(6), _req(1)
    sch.add(a)
    sch.add(b)
    plan = sch.schedule()
    p = pack(plan, 4, 4, power_of_two_buckets(64), power_of_two_buckets(8), {a.request_id: 1, b.request_id: 2})
    assert p.token_ids.shape == (8,) and p.seq_lens.shape == (2,)
    np.testing.assert_array_equal(p.query_start_loc, [0, 6, 7])
    np.testing.assert_array_equal(p.positions[:7], [0, 1, 2, 3, 4, 5, 0])
    blocks_a = a.allocation.block_ids
    assert p.slot_mapping[5] == blocks_a[1] * 4 + 1 and p.slot_mapping[7] == 0  # padding -> reserved slot
    np.testing.assert_array_equal(p.logits_indices, [5, 6])


def test_priority_orders_admission_and_preemption():
    bm = BlockManager(4, 4)  # 3 usable blocks
    sch = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64), bm)
    low, high = _req(4), _req(4)
    low.priority, high.priority = 5, 0
    sch.add(low)
    sch.add(high)  # arrives later but admitted first
    plan = sch.schedule()
    assert [s.request for s in plan.seqs] == [high, low]
    sch.commit(plan)
    for r in (low, high):
        r.append_token(7, 64)
    plan = sch.schedule()  # one free block: the low-priority request is preempted
    assert [s.request for s in plan.seqs] == [high] and plan.preempted == [low]


from hypothesis import given, settings, strategies as st  # noqa: E402

_PREFIXES = ([], list(range(7, 19)), list(range(7, 15)) + [40, 41, 42, 43])  # shared system prompts


@settings(max_examples=80, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.integers(1, 40), st.integers(1, 12), st.integers(0, 2), st.integers(0, 9),
                          st.integers(0, 2), st.integers(1, 3), st.sampled_from([None, "a"])),
                min_size=1, max_size=12),
       st.integers(6, 24), st.sampled_from([4, 8]), st.integers(1, 32), st.integers(1, 4),
       st.integers(0, 12), st.sampled_from([0.0, 0.1, 0.3]), st.booleans())
def test_scheduler_invariants(specs, num_blocks, block_size, budget, max_seqs, swap_blocks, watermark, spec):
    """Random arrivals, lengths, shared prefixes, n > 1 samples, salts, priorities, aborts and
    speculative decoding (draft tokens, some accepted) on tiny pools, with swap and recompute
    preemption. A fake KV pool stores each slot's token id; the test
    applies the plan's swaps and copies and this step's writes exactly as the engine would.

    After every step: every scheduled sequence reads back its own tokens at every position through
    its block table (so prefix-cache hits, copy-on-write and swaps moved the right data), no block
    is leaked or held twice (reference counts equal holders), budget and max_num_seqs hold, within
    a priority tier requests are first admitted in arrival order, and every request ends."""
    bm = BlockManager(num_blocks, block_size, watermark=watermark)
    max_len = min(64, bm.num_usable_blocks * block_size)
    sch = Scheduler(SchedulerConfig(max_seqs, budget, max_len, swap_threshold_tokens=6,
                                    swap_space_blocks=swap_blocks), bm)
    pool = np.full((num_blocks, block_size), -1)
    host = {}
    pending = []
    for n, max_tokens, prio, abort_at, prefix, n_samples, salt in specs:
        prompt = (_PREFIXES[prefix] + list(range(50, 50 + n)))[:max_len - 1]
        r = Request(prompt, SamplingParams(max_tokens=max_tokens, n=min(n_samples, max_seqs)), cache_salt=salt)
        r.priority = prio
        pending.append((r, abort_at))
    live, first_admitted = [], {}
    for step in range(3000):
        if pending and step % 2 == 0:  # arrivals over time
            r, abort_at = pending.pop(0)
            sch.add(r)
            live.append((r, step + abort_at if abort_at < 3 else None))
        for r, abort_step in live:
            if abort_step == step and not r.finished:
                sch.finish(r, FinishReason.ABORT)
        def wanted(r, step=step):
            return (step + r.index) % 3 if spec else 0

        plan = sch.schedule(wanted)
        for parent, children in plan.forks:
            live.extend((c, None) for c in children)
        for r, blocks in plan.swap_out:
            host[r.request_id] = pool[list(blocks)].copy()
        for r, blocks in plan.swap_in:
            pool[list(blocks)] = host.pop(r.request_id)
        for c in plan.copies:
            pool[c.dst] = pool[c.src]
        assert plan.num_tokens <= budget and len(plan.seqs) <= max_seqs and len(sch.running) <= max_seqs
        assert sch.swap_used_blocks <= swap_blocks
        emitted = []  # per seq: accepted draft tokens, then one sampled token
        for i, s in enumerate(plan.seqs):
            r = s.request
            first_admitted.setdefault(r.parent or r, step)
            end = s.start + s.num_new_tokens
            real_end = end - s.num_draft
            assert s.num_draft <= wanted(r) and s.start + s.num_new_tokens <= max_len
            table = r.allocation.block_ids
            assert len(table) * block_size >= end
            drafts = [5 + (step + j) % 4 for j in range(s.num_draft)]
            for pos in range(s.start, end):
                token = r.token_ids(pos, pos + 1)[0] if pos < real_end else drafts[pos - real_end]
                pool[table[pos // block_size], pos % block_size] = token
            kv = [pool[table[p // block_size], p % block_size] for p in range(real_end)]
            assert kv == r.token_ids(0, real_end), f"{r.request_id} reads wrong KV"
            accepted = (step * 7 + i) % (s.num_draft + 1)
            emitted.append(drafts[:accepted] + [5 + (step + r.index) % 3])
        sch.commit(plan, [len(e) - 1 for e in emitted])
        for s, tokens in zip(plan.seqs, emitted):
            if s.sample:
                for token in tokens:
                    reason = s.request.append_token(token, max_len)
                    if reason is not None:
                        sch.finish(s.request, reason)
                        break
            if not s.request.finished:  # rejected draft positions hold no blocks
                assert len(s.request.allocation.block_ids) == -(-s.request.num_computed_tokens // block_size)
        holders = {}
        for r, _ in live:
            for b in (r.allocation.block_ids if r.allocation else ()):
                holders[b] = holders.get(b, 0) + 1
            if r.finished:
                assert not r.allocation or r.allocation.block_ids == ()
        assert all(bm.ref_count(b) == c for b, c in holders.items())
        assert bm.num_free_blocks + len(holders) == bm.num_usable_blocks
        if not pending and not sch.has_unfinished():
            break
    assert not pending and all(r.finished for r, _ in live)
    assert bm.num_free_blocks == bm.num_usable_blocks and sch.swap_used_blocks == 0
    tops = [r for r, _ in live if r.parent is None and r in first_admitted]
    for a in tops:
        for b in tops:
            if a.priority == b.priority and a.arrival < b.arrival and b.num_preemptions == 0:
                assert first_admitted[a] <= first_admitted[b], "a later request of the same tier went first"
