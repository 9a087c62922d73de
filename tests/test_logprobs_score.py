"""Per-token logprobs of generated tokens and scoring, against a numpy log-softmax of the dense forward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from engine import LLM, InvalidRequestError, SamplingParams
from scheduler.request import MAX_LOGPROBS


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny-llama", num_blocks=48, block_size=16, max_num_seqs=8, max_num_batched_tokens=32)


_dense_logits = jax.jit(lambda graphdef, st, x: nnx.merge(graphdef, st).dense_logits(x[None])[0], static_argnums=0)


def dense_log_softmax(engine, ids: list[int], width: int = 128) -> np.ndarray:
    """float64 `[n, V]` log-softmax of `engine`'s unpaged forward logits at every position of `ids` (n <= width;
    right padding to `width` leaves causal logits unchanged: one compiled shape)."""
    logits = _dense_logits(engine.runner.graphdef, engine.runner.state.state(),
                           jnp.asarray(ids + [0] * (width - len(ids)), jnp.int32))
    x = np.asarray(logits, np.float64)[:len(ids)]
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def test_generated_logprobs_match_dense_log_softmax(llm):
    prompt = list(range(40, 61))
    sp = SamplingParams(temperature=0.8, seed=7, max_tokens=6, ignore_eos=True, logprobs=5)
    out, plain = llm.generate([prompt, prompt], [sp, SamplingParams(temperature=0.8, seed=7, max_tokens=6,
                                                                       ignore_eos=True)])
    assert plain.logprobs is None and plain.token_ids == out.token_ids  # asking changes no token
    assert len(out.logprobs) == 6
    ref = dense_log_softmax(llm.engine, prompt + out.token_ids)
    for i, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        row = ref[len(prompt) - 1 + i]
        top5 = np.argsort(-row)[:5].tolist()
        assert list(entry)[:5] == top5  # most likely first
        assert set(entry) == set(top5) | {token}
        for t, v in entry.items():
            assert v == pytest.approx(row[t], abs=1e-4)


def test_logprobs_zero_gives_the_sampled_token_only_and_bounds_are_checked(llm):
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=0))[0]
    assert [list(e) for e in out.logprobs] == [[t] for t in out.token_ids]
    ref = dense_log_softmax(llm.engine, [5, 6, 7] + out.token_ids)
    assert out.logprobs[0][out.token_ids[0]] == pytest.approx(ref[2].max(), abs=1e-4)  # greedy: the argmax
    for bad in (-1, MAX_LOGPROBS + 1, 2.0):
        with pytest.raises(InvalidRequestError, match="logprobs"):
            llm.generate(["x"], SamplingParams(logprobs=bad))


def test_score_matches_dense_log_softmax_across_chunks(llm):
    # 70 tokens with a 32-token budget: three chunks, each reading the previous chunks' KV.
    rng = np.random.default_rng(3)
    ids = rng.integers(3, 256, 70).tolist()
    free = llm.engine.blocks.num_free_blocks
    text_out, ids_out = llm.score(["hello world", ids])
    ref = dense_log_softmax(llm.engine, ids)
    expected = ref[np.arange(69), ids[1:]]
    assert ids_out.token_ids == ids
    np.testing.assert_allclose(ids_out.token_logprobs, expected, atol=1e-4)
    assert ids_out.log_likelihood == pytest.approx(expected.sum(), abs=1e-3)
    np.testing.assert_array_equal(ids_out.token_is_greedy, ref[np.arange(69)].argmax(-1) == np.array(ids[1:]))
    np.testing.assert_array_equal(ids_out.top_token_ids, ref[np.arange(69)].argmax(-1))
    np.testing.assert_allclose(ids_out.top_logprobs, ref[np.arange(69)].max(-1), atol=1e-4)
    assert text_out.token_ids == list(b"hello world") and len(text_out.token_logprobs) == 10
    assert llm.engine.blocks.num_free_blocks == free  # borrowed blocks returned


def test_score_between_steps_leaves_running_requests_unchanged(llm):
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    alone = llm.generate([[9, 8, 7, 6]], sp)[0].token_ids
    eng = llm.engine
    r = eng.add_request([9, 8, 7, 6], sp)
    eng.step()
    single = llm.score([[1]])[0]
    assert single.token_logprobs == [] and single.log_likelihood == 0.0
    llm.score([list(range(3, 50))])
    while eng.has_unfinished():
        eng.step()
    assert r.output_token_ids == alone
    with pytest.raises(InvalidRequestError, match="text 1: text to score is empty"):
        llm.score(["a", ""])
    with pytest.raises(InvalidRequestError, match="context limit"):
        llm.score([[3] * (eng.max_model_len + 1)])
