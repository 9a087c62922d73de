"""Batch invariance: a request's logits, log-probabilities and seeded samples are bitwise the same whatever
shares its steps (alone, beside other requests, after a prefix-cache hit, in prefill chunks of any size)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine import LLM, SamplingParams
from model import numerics
from model.ops import rms_norm


def _ulps(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return np.abs(got - want) / np.spacing(np.abs(want).astype(np.float32)).astype(np.float64)


def test_exp_and_log_are_within_two_ulp_of_float64():
    x = np.linspace(-87.3, 88.3, 300_001, dtype=np.float32)
    assert _ulps(numerics.exp(jnp.asarray(x)), np.exp(x.astype(np.float64))).max() <= 2
    y = np.concatenate([np.geomspace(numerics.LOG_MIN, 3e38, 200_001), np.linspace(0.5, 2, 100_001)]).astype(np.float32)
    want = np.log(y.astype(np.float64))
    far = np.abs(want) > 1e-3  # near 1, ln's ulp shrinks to nothing: bound the absolute error there
    got = np.asarray(numerics.log(jnp.asarray(y)), np.float64)
    assert _ulps(got[far], want[far]).max() <= 2 and np.abs(got - want)[~far].max() < 1e-7
    np.testing.assert_array_equal(numerics.exp(jnp.array([-jnp.inf, -90.0, 0.0])), [0.0, 0.0, 1.0])


def test_row_sum_and_softmax_match_float64():
    x = np.random.default_rng(0).standard_normal((3, 49_153)).astype(np.float32)
    np.testing.assert_allclose(numerics.row_sum(jnp.asarray(x)), x.astype(np.float64).sum(-1), rtol=0, atol=1e-3)
    x[1, ::2] = -np.inf
    want = np.exp(x.astype(np.float64) - x.max(-1, keepdims=True))
    got = np.asarray(numerics.softmax(jnp.asarray(x)))
    np.testing.assert_allclose(got, want / want.sum(-1, keepdims=True), rtol=1e-5, atol=1e-12)
    assert np.all(got[1, ::2] == 0)


@pytest.mark.parametrize("width", [64, 256, 576, 1536, 49_152])
def test_a_row_is_bitwise_the_same_in_arrays_of_any_height(width):
    """XLA:CPU's own sum and exp fail this at 256 (rows 1-8 of 32) and 49,152 (rows 1-3): the loops it emits
    depend on the array's height."""
    x = (3 * np.random.default_rng(width).standard_normal((32, width))).astype(np.float32)
    fns = {"row_sum": numerics.row_sum, "softmax": numerics.softmax, "silu": numerics.silu,
           "log": lambda a: numerics.log(jnp.abs(a) + 1e-3), "rms_norm": lambda a: rms_norm(a, a[0], 1e-5)}
    for name, fn in fns.items():
        f = jax.jit(fn)
        full = np.asarray(f(x))
        for n in (1, 2, 3, 4, 5, 8, 16, 17):
            np.testing.assert_array_equal(np.asarray(f(x[:n])), full[:n], err_msg=f"{name}, {n} rows")


LIMITS = {"num_blocks": 128, "block_size": 16, "max_num_seqs": 16, "max_num_batched_tokens": 128,
          "max_model_len": 256}


def _runs(model, vocab):
    """One request (a 37-token prompt: one prefill chunk takes the kernel's long tiles) run alone on a fresh
    engine, again (a 32-token prefix-cache hit), between seven other requests, and in 8-token chunks on an
    engine with an 8-token budget: its (token ids, logprobs) each time."""
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(3, vocab, 37)]
    sp = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=8, ignore_eos=True, seed=7, logprobs=5)
    mates = [[int(t) for t in rng.integers(3, vocab, n)] for n in (1, 5, 20, 33, 64, 90, 100)]
    mate_sp = [SamplingParams(temperature=t, max_tokens=10, ignore_eos=True, seed=i)
               for i, t in enumerate((0.0, 1.0, 0.7, 0.0, 1.0, 0.5, 0.0))]
    out = lambda o: (o.token_ids, o.logprobs)
    llm = LLM(model, speculative=None, **LIMITS)
    runs = [out(llm.generate([prompt], sp)[0]), out(llm.generate([prompt], sp)[0])]
    runs.append(out(llm.generate(mates[:3] + [prompt] + mates[3:], mate_sp[:3] + [sp] + mate_sp[3:])[3]))
    chunked = LLM(model, speculative=None, **{**LIMITS, "max_num_batched_tokens": 8, "enable_prefix_caching": False})
    runs.append(out(chunked.generate([prompt], sp)[0]))
    return runs


@pytest.mark.parametrize("model,vocab", [("tiny-llama", 256), ("smollm2-135m-instruct", 49_152)])
def test_a_seeded_request_is_bitwise_the_same_alone_beside_others_cached_and_chunked(model, vocab):
    """tiny-llama's head dim (16) takes the attention kernel's transposed path, SmolLM2's (64) the split one.
    While the path hung on the run's length (and XLA's sums and exps on the array's height), 24 of 142 logit
    rows of such requests changed between runs."""
    first, *others = _runs(model, vocab)
    for i, run in enumerate(others):
        assert run == first, f"run {i + 1} differs"
