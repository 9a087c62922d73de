"""The Pallas ragged paged attention kernel against the jnp reference, its CUDA lowering, and end to end.

On CPU the kernel runs in Pallas interpret mode (slow), so shapes are small and
the hypothesis search is short and derandomised.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pallas_kernels.ragged_paged_attention import choose_block_q, ragged_paged_attention, tile_layout
from pallas_kernels.reference import ragged_paged_attention_reference

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


def make_batch(seed, q_lens, kv_lens, *, heads, kv_heads, head_dim, block_size, pad_seqs=0, pad_tokens=0,
               extra_cols=1, dtype=jnp.float32, num_layers=2):
    """A ragged batch with shuffled, non-contiguous block tables over a pool with spare (garbage) blocks."""
    rng = np.random.default_rng(seed)
    B = block_size
    q_lens = list(q_lens) + [0] * pad_seqs
    kv_lens = list(kv_lens) + [0] * pad_seqs
    S, T = len(q_lens), sum(q_lens) + pad_tokens
    need = [-(-k // B) for k in kv_lens]
    max_blocks = max(1, max(need)) + extra_cols
    P = sum(need) + 3
    ids = rng.permutation(P)
    bt = rng.integers(0, P, size=(S, max_blocks)).astype(np.int32)  # unused entries: arbitrary valid ids
    c = 0
    for s, n in enumerate(need):
        bt[s, :n] = ids[c:c + n]
        c += n
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = rng.standard_normal((T, heads, head_dim), np.float32)
    k = rng.standard_normal((num_layers, P, B, kv_heads, head_dim), np.float32)
    v = rng.standard_normal((num_layers, P, B, kv_heads, head_dim), np.float32)
    return (jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype), jnp.asarray(bt),
            jnp.asarray(kv_lens, jnp.int32), jnp.asarray(qsl))


@functools.partial(jax.jit, static_argnames=("layer", "block_q"))
def _kernel(q, k, v, bt, sl, qsl, layer, block_q=None):
    return ragged_paged_attention(q, k, v, bt, sl, qsl, layer, block_q=block_q)


@functools.partial(jax.jit, static_argnames=("layer",))
def _ref(q, k, v, bt, sl, qsl, layer):
    return ragged_paged_attention_reference(q, k, v, bt, sl, qsl, layer)


def check(args, layer=1, dtype=jnp.float32, block_q=None):
    out = _kernel(*args, layer=layer, block_q=block_q)
    ref = _ref(*args, layer=layer)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert np.all(np.isfinite(out))
    np.testing.assert_allclose(out, ref, atol=TOL[dtype], rtol=TOL[dtype])
    T = args[0].shape[0]
    n_valid = int(args[5][-1])
    assert np.all(out[n_valid:T] == 0)


# ---------------------------------------------------------------- hand-picked cases


@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_decode_batch(block_size):
    B = block_size
    kv = [1, B - 1, B, B + 1, 3 * B, 5]
    check(make_batch(0, [1] * len(kv), kv, heads=9, kv_heads=3, head_dim=16, block_size=B, pad_seqs=2, pad_tokens=2))


def test_chunked_prefill_and_verify_window_mixed():
    # prefix-cached chunk, fresh prefill, verify window (q_len 5) and decodes; bf16 pool.
    args = make_batch(1, [24, 40, 5, 1, 1], [24 + 57, 40, 5 + 100, 31, 1],
                      heads=8, kv_heads=1, head_dim=32, block_size=16, pad_seqs=1, pad_tokens=3, dtype=jnp.bfloat16)
    check(args, dtype=jnp.bfloat16)


def test_all_padding_and_tiny_head_dim():
    # Only padded sequences and tokens: zeros. Then head_dim 8 (tiny-qwen2), which avoids tl.dot.
    args = make_batch(2, [0, 0], [0, 0], heads=2, kv_heads=2, head_dim=16, block_size=8, pad_tokens=4)
    out = _kernel(*args, layer=0)
    assert np.all(np.asarray(out) == 0)
    check(make_batch(3, [3, 1], [10, 9], heads=6, kv_heads=2, head_dim=8, block_size=8, pad_tokens=1))


def test_explicit_block_q_and_traced_layer():
    args = make_batch(4, [33, 2], [70, 17], heads=4, kv_heads=2, head_dim=16, block_size=16)
    check(args, block_q=8)
    out = jax.jit(ragged_paged_attention)(*args, jnp.int32(1))  # layer as a traced scalar
    np.testing.assert_allclose(out, _ref(*args, layer=1), atol=1e-5, rtol=1e-5)


def test_tile_layout_covers_every_token_once():
    q_lens = np.array([5, 0, 17, 1, 0], np.int32)
    qsl = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    sl = jnp.asarray(q_lens + 3, jnp.int32)
    T, BQ = 30, 4
    seq, first, pos0, nq = map(np.asarray, tile_layout(qsl, sl, BQ, T))
    assert len(seq) == min(T // BQ + 5, T)
    covered = np.concatenate([np.arange(f, f + n) for f, n in zip(first, nq)])
    assert sorted(covered.tolist()) == list(range(int(q_lens.sum())))
    assert choose_block_q(8, 8, 3) * 4 >= 16 and choose_block_q(512, 1, 1) == 64


# ---------------------------------------------------------------- property test


@st.composite
def ragged_batches(draw):
    B = draw(st.sampled_from([8, 16, 32]))
    G = draw(st.sampled_from([1, 3, 8]))
    K = draw(st.sampled_from([1, 2]))
    D = draw(st.sampled_from([16, 32]))
    dtype = draw(st.sampled_from([jnp.float32, jnp.bfloat16]))
    n = draw(st.integers(1, 3))
    kv_len = st.one_of(
        st.integers(1, 512),
        st.builds(lambda m, d: min(512, max(1, m * B + d)), st.integers(1, 512 // B), st.sampled_from([-1, 0, 1])),
    )
    kv_lens = draw(st.lists(kv_len, min_size=n, max_size=n))
    q_lens = [min(k, draw(st.one_of(st.just(1), st.integers(1, 64)))) for k in kv_lens]
    pad_seqs = draw(st.integers(0, 2))
    pad_tokens = draw(st.integers(0, 3))
    seed = draw(st.integers(0, 2**16))
    args = make_batch(seed, q_lens, kv_lens, heads=G * K, kv_heads=K, head_dim=D, block_size=B,
                      pad_seqs=pad_seqs, pad_tokens=pad_tokens, extra_cols=draw(st.integers(0, 2)), dtype=dtype)
    return args, dtype


@settings(max_examples=24, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(ragged_batches())
def test_kernel_equals_reference(case):
    args, dtype = case
    check(args, layer=1, dtype=dtype)


# ---------------------------------------------------------------- CUDA lowering on CPU


@pytest.mark.parametrize("T,S,dtype,B", [(8, 8, jnp.bfloat16, 16), (512, 1, jnp.bfloat16, 16),
                                         (64, 4, jnp.float32, 16), (8, 8, jnp.bfloat16, 8), (32, 2, jnp.float32, 32)])
def test_lowers_to_triton_for_cuda(T, S, dtype, B, monkeypatch):
    H, K, D, L, P, max_blocks = 9, 3, 64, 30, 512, 128  # SmolLM2-135M
    # Keep the Triton module built by the lowering (private API: jax 0.10) and verify it.
    from jax._src.pallas.triton import pallas_call_registration as reg

    modules, lower = [], reg.lowering.lower_jaxpr_to_triton_module

    def keep(*a, **kw):
        result = lower(*a, **kw)
        modules.append(result.module)
        return result

    monkeypatch.setattr(reg.lowering, "lower_jaxpr_to_triton_module", keep)
    sds = jax.ShapeDtypeStruct
    args = (sds((T, H, D), dtype), sds((L, P, B, K, D), dtype), sds((L, P, B, K, D), dtype),
            sds((S, max_blocks), jnp.int32), sds((S,), jnp.int32), sds((S + 1,), jnp.int32))
    f = functools.partial(ragged_paged_attention, layer=7, backend="cuda")
    text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    targets = re.findall(r"custom_call @([\w$.]+)", text) + re.findall(r'call_target_name = "([^"]+)"', text)
    assert targets.count("__gpu$xla.gpu.triton") == 1, targets
    assert "mosaic" not in text.lower()
    # The Triton IR verifies, and every tt.dot has all dims >= 16 (fp32: IEEE, no tf32).
    (module,) = modules
    assert module.operation.verify()
    dots = [line for line in str(module).splitlines() if "tt.dot" in line]
    assert len(dots) == 2
    for line in dots:
        dims = [int(d) for shape in re.findall(r"tensor<(\d+)x(\d+)x", line) for d in shape]
        assert len(dims) == 6 and min(dims) >= 16, line
        if dtype == jnp.float32:
            assert "tf32" not in line, line  # IEEE is the default and not printed


# ---------------------------------------------------------------- end to end


def test_engine_greedy_pallas_equals_reference():
    from engine import LLM, SamplingParams

    prompts = [list(range(3, 3 + n)) for n in (1, 17, 40)]
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    kw = dict(num_blocks=24, block_size=8, max_num_seqs=4, max_num_batched_tokens=32)
    ref = LLM("tiny-llama", attention="reference", **kw).generate(prompts, greedy)
    pal = LLM("tiny-llama", attention="pallas", **kw).generate(prompts, greedy)
    assert [o.token_ids for o in pal] == [o.token_ids for o in ref]
