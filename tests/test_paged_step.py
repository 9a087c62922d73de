"""The paged step against the dense (unpaged) forward, and the reference attention against naive attention."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from engine.step import KVPool, StepBatch, forward_logits
from model.config import get_preset
from model.llama import Llama
from pallas_kernels.reference import ragged_paged_attention_reference
from scheduler.block_manager import BlockManager
from scheduler.packing import pack, power_of_two_buckets
from scheduler.request import Request, SamplingParams
from scheduler.scheduler import ScheduledSeq, StepPlan

LENGTHS = [1, 15, 16, 17, 33]
BLOCK = 16


def _run_chunks(model, requests, chunk, seq_bucket_extra=0, token_bucket_extra=0, num_blocks=64):
    """Prefills every request in chunks of `chunk` tokens; returns last-position logits per request."""
    graphdef, state = nnx.split(model)
    step = jax.jit(lambda st, pool, b: forward_logits(nnx.merge(graphdef, st), pool, b,
                                                       ragged_paged_attention_reference))
    pool = KVPool.zeros(model.cfg, num_blocks, BLOCK)
    last = {}
    done = {r.request_id: 0 for r in requests}
    while any(done[r.request_id] < r.num_tokens for r in requests):
        seqs = []
        for r in requests:
            start = done[r.request_id]
            if start < r.num_tokens:
                n = min(chunk, r.num_tokens - start)
                seqs.append(ScheduledSeq(r, start, n, start + n == r.num_tokens))
        n_tok = sum(s.num_new_tokens for s in seqs)
        token_buckets = (n_tok + token_bucket_extra,) if token_bucket_extra else power_of_two_buckets(512)
        seq_buckets = (len(seqs) + seq_bucket_extra,)
        packed = pack(StepPlan(seqs, []), BLOCK, 8, token_buckets, seq_buckets,
                      {r.request_id: 0 for r in requests})
        logits, pool = step(state, pool, StepBatch.from_packed(packed))
        for i, s in enumerate(seqs):
            done[s.request.request_id] = s.start + s.num_new_tokens
            if s.sample:
                last[s.request.request_id] = np.asarray(logits[i])
    return [last[r.request_id] for r in requests]


def _requests(cfg, seed=0):
    rng = np.random.default_rng(seed)
    blocks = BlockManager(64, BLOCK)
    # Interleaved allocation so block tables are not contiguous.
    reqs = [Request(rng.integers(3, cfg.vocab_size, n).tolist(), SamplingParams(temperature=0)) for n in LENGTHS]
    for pos in range(0, max(LENGTHS), BLOCK):
        for r in reversed(reqs):
            if pos < r.num_tokens:
                r.allocation = blocks.allocate(r.allocation, min(pos + BLOCK, r.num_tokens))
    return reqs


@pytest.mark.parametrize("preset,chunk", [("tiny-llama", 1), ("tiny-llama", 7), ("tiny-llama", 512),
                                          ("tiny-qwen2", 7), ("tiny-qwen2", 512)])
def test_paged_step_equals_dense_forward(preset, chunk):
    cfg = get_preset(preset)
    model = Llama(cfg, rngs=nnx.Rngs(0))
    reqs = _requests(cfg)
    got = _run_chunks(model, reqs, chunk)
    for r, logits in zip(reqs, got):
        dense = np.asarray(model.dense_logits(jnp.asarray([r.prompt_token_ids]))[0, -1])
        np.testing.assert_allclose(logits, dense, atol=2e-5, rtol=0)


@pytest.mark.parametrize("chunk", [1, 512])
def test_bucket_padding_never_changes_logits(chunk):
    """Padding tokens and sequences are masked out exactly; only the summation
    order of XLA's reductions may change with the padded length (float32 rounding)."""
    cfg = get_preset("tiny-llama")
    model = Llama(cfg, rngs=nnx.Rngs(1))
    tight = _run_chunks(model, _requests(cfg, 1), chunk)
    padded = _run_chunks(model, _requests(cfg, 1), chunk, seq_bucket_extra=3, token_bucket_extra=37)
    for a, b in zip(tight, padded):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
        assert np.argmax(a) == np.argmax(b)


def test_bfloat16_paged_step_equals_bfloat16_dense_forward():
    cfg = get_preset("tiny-llama").replace(dtype="bfloat16")
    model = Llama(cfg, rngs=nnx.Rngs(2))
    reqs = _requests(cfg, 2)
    for r, logits in zip(reqs, _run_chunks(model, reqs, 7)):
        dense = np.asarray(model.dense_logits(jnp.asarray([r.prompt_token_ids]))[0, -1])
        np.testing.assert_allclose(logits, dense, atol=2e-2, rtol=0)


def _naive_attention(q, k_pages, v_pages, tables, seq_lens, qsl, layer):
    """Per-sequence dense causal attention over a contiguous copy of each sequence's KV."""
    T, H, D = q.shape
    B, K = k_pages.shape[2], k_pages.shape[3]
    out = np.zeros((T, H, D), np.float32)
    for s in range(len(seq_lens)):
        n_q = qsl[s + 1] - qsl[s]
        if n_q == 0:
            continue
        L = seq_lens[s]
        pos = np.arange(L)
        k = k_pages[layer][tables[s][pos // B], pos % B]  # [L, K, D]
        v = v_pages[layer][tables[s][pos // B], pos % B]
        for i in range(n_q):
            t = qsl[s] + i
            p_abs = L - n_q + i
            for h in range(H):
                kh = h // (H // K)
                sc = k[: p_abs + 1, kh] @ q[t, h] / np.sqrt(D)
                w = np.exp(sc - sc.max())
                out[t, h] = (w / w.sum()) @ v[: p_abs + 1, kh]
    return out


@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_reference_attention_matches_naive(group, block_size):
    rng = np.random.default_rng(group * 100 + block_size)
    K, D, P, L = 2, 16, 96, 2
    H = K * group
    q_lens = [1, 5, 1, 0, 3]
    kv_lens = [block_size, 3 * block_size + 1, 2 * block_size - 1, 0, 40]
    S = len(q_lens)
    max_blocks = 8
    perm = rng.permutation(np.arange(1, P))
    tables = np.zeros((S, max_blocks), np.int32)
    used = 0
    for s, n in enumerate(kv_lens):
        nb = -(-n // block_size)
        tables[s, :nb] = perm[used:used + nb]
        used += nb
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    T = 16  # padded
    q = rng.standard_normal((T, H, D)).astype(np.float32)
    kp = rng.standard_normal((L, P, block_size, K, D)).astype(np.float32)
    vp = rng.standard_normal((L, P, block_size, K, D)).astype(np.float32)
    seq_lens = np.asarray(kv_lens, np.int32)
    got = ragged_paged_attention_reference(jnp.asarray(q), jnp.asarray(kp), jnp.asarray(vp), jnp.asarray(tables),
                                           jnp.asarray(seq_lens), jnp.asarray(qsl), 1)
    want = _naive_attention(q, kp, vp, tables, seq_lens, qsl, 1)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5)
    assert not np.asarray(got)[qsl[-1]:].any()  # padding tokens get zeros
