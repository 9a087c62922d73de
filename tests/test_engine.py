"""The engine loop on a tiny random-weight model: exact greedy tokens, finishing, errors, compilations."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine import LLM, InvalidRequestError, SamplingParams


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny-llama", num_blocks=48, block_size=16, max_num_seqs=8, max_num_batched_tokens=64)


def _dense_greedy(llm, prompt_ids, n, width=128):
    """Greedy tokens from the unpaged forward; right padding to `width` leaves causal logits unchanged."""
    from flax import nnx

    graphdef = llm.engine.runner.graphdef
    logits_at = jax.jit(lambda st, ids, i: nnx.merge(graphdef, st).dense_logits(ids[None])[0, i])
    ids = list(prompt_ids)
    for _ in range(n):
        padded = jnp.asarray(ids + [0] * (width - len(ids)), jnp.int32)
        ids.append(int(jnp.argmax(logits_at(llm.engine.runner.state.state(), padded, len(ids) - 1))))
    return ids[len(prompt_ids):]


PROMPTS = [list(range(3, 3 + n)) for n in (1, 15, 16, 17, 33, 70)]


def test_greedy_batch_equals_dense_forward(llm):
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outs = llm.generate(PROMPTS, greedy)
    for p, out in zip(PROMPTS, outs):
        assert out.token_ids == _dense_greedy(llm, p, 10)
        assert out.finish_reason == "length"
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_usable_blocks


@pytest.mark.parametrize("swap", [False, True])
def test_alone_equals_in_batch_and_under_preemption(swap):
    # 9 usable blocks of 8 tokens: five prompts cannot all stay resident, so requests get preempted,
    # by swap (every preempted sequence, threshold 1 token) or by recompute (no swap space).
    small = LLM("tiny-llama", num_blocks=10, block_size=8, max_num_seqs=8, max_num_batched_tokens=16,
                swap_space_bytes=(1 << 20) * swap, swap_threshold_tokens=1, kv_watermark=0.0)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    together = small.generate(PROMPTS[:5], greedy)
    sch = small.engine.scheduler
    assert (sch.num_swapped > 0, sch.num_recomputed > 0) == (swap, not swap)
    for p, out in zip(PROMPTS[:5], together):
        assert out.token_ids == small.generate([p], greedy)[0].token_ids
    assert small.engine.blocks.num_free_blocks == 9 and sch.swap_used_blocks == 0


def test_a_swapped_request_aborted_leaves_no_host_kv_behind():
    """The runner keeps swapped-out KV by request id: one copy per swapped request, dropped when it is
    aborted while swapped out, none left once every request is done."""
    small = LLM("tiny-llama", num_blocks=10, block_size=8, max_num_seqs=8, max_num_batched_tokens=16,
                swap_space_bytes=1 << 20, swap_threshold_tokens=1, kv_watermark=0.0)
    engine, greedy = small.engine, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for p in PROMPTS[:5]:
        engine.add_request(p, greedy)
    sch = engine.scheduler
    while not sch.swapped:
        engine.step()
    assert set(engine.runner.swapped_kv) == {r.request_id for r in sch.swapped}
    victim = sch.swapped[0]
    engine.abort(victim.request_id)
    assert victim.request_id not in engine.runner.swapped_kv
    while engine.has_unfinished():
        engine.step()
    assert engine.runner.swapped_kv == {} and sch.swap_used_blocks == 0 and engine.blocks.num_free_blocks == 9


def test_prefix_cache_hit_gives_same_tokens_and_salt_isolates(llm):
    engine = llm.engine
    prompt = list(range(200, 250))  # 50 tokens: 3 full blocks of 16 cacheable
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    def run(salt=None):
        engine.add_request(prompt, sp, cache_salt=salt)
        while True:
            for out in engine.step():
                if out.finished:
                    return out

    miss, hit, other_tenant = run(), run(), run("tenant-b")
    assert (miss.num_cached_tokens, hit.num_cached_tokens, other_tenant.num_cached_tokens) == (0, 48, 0)
    assert hit.token_ids == miss.token_ids == other_tenant.token_ids == _dense_greedy(llm, prompt, 6)
    with pytest.raises(InvalidRequestError, match="cache_salt"):
        engine.add_request(prompt, sp, cache_salt=3)


def test_n_samples_share_the_prompt_and_follow_their_seeds(llm):
    prompt = list(range(3, 23))  # 20 tokens: the forked last token lands in a shared partial block
    sp = SamplingParams(temperature=1.0, seed=77, max_tokens=8, ignore_eos=True, n=3)
    outs = llm.generate([prompt, PROMPTS[0]], [sp, SamplingParams(temperature=0, max_tokens=2)])
    assert len(outs) == 4 and [o.index for o in outs[:3]] == [0, 1, 2]
    for i, out in enumerate(outs[:3]):  # sample i is the n = 1 request with seed 77 + i
        single = SamplingParams(temperature=1.0, seed=77 + i, max_tokens=8, ignore_eos=True)
        assert out.token_ids == llm.generate([prompt], single)[0].token_ids
    assert len({tuple(o.token_ids) for o in outs[:3]}) == 3
    greedy = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, n=2))
    assert greedy[0].token_ids == greedy[1].token_ids == _dense_greedy(llm, prompt, 5)
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_usable_blocks
    with pytest.raises(InvalidRequestError, match="n=9 exceeds max_num_seqs"):
        llm.generate([prompt], SamplingParams(n=9))


def test_seeded_sampling_is_reproducible_and_batch_independent(llm):
    sp = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=8, ignore_eos=True)
    alone = llm.generate([PROMPTS[2]], sp)[0].token_ids
    mixed = llm.generate([PROMPTS[0], PROMPTS[2], PROMPTS[4]],
                         [SamplingParams(temperature=1.0, seed=1, max_tokens=3), sp,
                          SamplingParams(temperature=0, max_tokens=5)])
    assert mixed[1].token_ids == alone


def test_stop_token_ids_and_max_tokens(llm):
    free = llm.generate([PROMPTS[3]], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0]
    stop_at = free.token_ids[4]
    first = free.token_ids.index(stop_at)
    out = llm.generate([PROMPTS[3]], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop_at]))[0]
    assert out.token_ids == free.token_ids[:first + 1] and out.finish_reason == "stop"
    one = llm.generate([PROMPTS[3]], SamplingParams(temperature=0, max_tokens=1))[0]
    assert one.token_ids == free.token_ids[:1] and one.finish_reason == "length"


def test_stop_string_truncates_text_and_streams_consistently(llm):
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    free = llm.generate(["hello"], sp)[0]
    assert len(free.text) > 6
    stop = free.text[3:5]
    deltas = []
    out = llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop]),
                       on_output=lambda i, o: deltas.append(o.delta_text))[0]
    assert out.finish_reason == "stop"
    assert out.text == free.text[:free.text.index(stop)]
    assert "".join(deltas) == out.text


def test_context_limit_rule_rejects_each_bad_request_alone():
    """The rule: a prompt needs 1 to max_model_len - 1 tokens; generation ends with "length" at
    max_tokens or when the sequence reaches max_model_len. Bad requests arriving while others run
    are refused one by one; the running ones finish with unchanged tokens."""
    small = LLM("tiny-llama", num_blocks=48, block_size=16, max_model_len=40)
    eng = small.engine
    assert eng.max_model_len == 40
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    running = eng.add_request(PROMPTS[2], greedy)
    eng.step()
    for prompt, match in [([], "prompt is empty"), (list(range(3, 43)), "context limit is 40"),
                          (list(range(3, 44)), "context limit is 40")]:
        with pytest.raises(InvalidRequestError, match=match):
            eng.add_request(prompt, greedy)
    at_limit = eng.add_request(list(range(3, 42)), greedy)  # 39 + 1 = 40 tokens
    one = eng.add_request(PROMPTS[1], SamplingParams(temperature=0, max_tokens=1))
    done = {}
    while eng.has_unfinished():
        done.update({o.request_id: o for o in eng.step() if o.finished})
    assert done[running.request_id].token_ids == _dense_greedy(small, PROMPTS[2], 8)
    assert (len(done[at_limit.request_id].token_ids), done[at_limit.request_id].finish_reason) == (1, "length")
    assert done[one.request_id].token_ids == _dense_greedy(small, PROMPTS[1], 1)
    assert done[one.request_id].finish_reason == "length"


@pytest.mark.parametrize("prompt,params,match", [
    ("", SamplingParams(), "prompt is empty"),
    ("hi", SamplingParams(max_tokens=0), "max_tokens"),
    ("hi", SamplingParams(temperature=-1), "temperature"),
    ("hi", SamplingParams(top_p=0), "top_p"),
    ([5, 10_000], SamplingParams(), r"token ids must be in \[0, 256\)"),
    ([{"role": "user"}], SamplingParams(), "role"),
    (None, SamplingParams(), "got NoneType"),
    ([True, 5], SamplingParams(), "a list of token ids"),
    ("hi", SamplingParams(stop_token_ids=[-1]), "stop_token_ids"),
    ("hi", SamplingParams(temperature=True), "temperature"),
])
def test_bad_requests_are_rejected_and_nothing_else_breaks(llm, prompt, params, match):
    with pytest.raises(InvalidRequestError, match=match):
        llm.generate(["fine", prompt], params)
    assert not llm.engine.has_unfinished()
    ok = llm.generate(["fine"], SamplingParams(temperature=0, max_tokens=3))[0]
    assert len(ok.token_ids) >= 1


def test_bad_request_added_to_a_running_engine_leaves_others_running(llm):
    eng = llm.engine
    good = eng.add_request(PROMPTS[1], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    eng.step()
    with pytest.raises(InvalidRequestError):
        eng.add_request([], SamplingParams())
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    assert outs[-1].request_id == good.request_id and len(outs[-1].token_ids) == 6


def test_abort_frees_blocks(llm):
    eng = llm.engine
    free_before = eng.blocks.num_free_blocks
    r = eng.add_request(PROMPTS[4], SamplingParams(max_tokens=50, ignore_eos=True))
    eng.step()
    assert eng.blocks.num_free_blocks < free_before
    eng.abort(r.request_id)
    assert eng.blocks.num_free_blocks == free_before and not eng.has_unfinished()


def test_no_compilation_after_warmup():
    llm = LLM("tiny-llama", num_blocks=64, block_size=16, max_num_seqs=4, max_num_batched_tokens=32)
    eng = llm.engine
    assert len(eng.buckets) == 1 + 2 + 3 * 4  # T in {1..32}, S in {1, 2, 4}, S <= T
    eng.precompile()
    llm.generate(["warm"], SamplingParams(temperature=0.5, max_tokens=2))  # host-side helpers
    before = eng.compilation_count()
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 256, n).tolist() for n in (3, 9, 31, 45, 2, 17)]
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, max_tokens=m, seed=s)
              for t, k, p, m, s in [(0, 0, 1, 5, None), (0.7, 5, 0.9, 9, 1), (1.2, 0, 0.5, 3, 2),
                                    (0, 0, 1, 12, None), (1.0, 40, 1, 7, 3), (0.3, 0, 0.99, 4, 4)]]
    llm.generate(prompts, params)
    assert eng.compilation_count() == before


def test_precompile_and_compiles_stay_within_the_memory_map_limit(monkeypatch, caplog):
    """XLA:CPU holds hundreds of memory maps per step program (engine/compilation.py): precompile refuses
    programs that would pass the process's limit (it never drops programs it compiled), and a step that
    compiled near it drops the compiled programs."""
    from engine import compilation

    llm = LLM("tiny-llama", num_blocks=64, block_size=16, max_num_seqs=4, max_num_batched_tokens=32)
    eng = llm.engine
    asked = []
    monkeypatch.setattr("engine.runner.maps_left", lambda programs: asked.append(programs) or False)
    monkeypatch.setattr("engine.runner.memory_maps", lambda: (60_000, 65_530))
    before = eng.compilation_count()
    with pytest.raises(RuntimeError, match="vm.max_map_count"):
        eng.precompile()
    # 15 step shapes, 6 Score programs (token buckets 1..32), 5 block-op buckets (1..16); nothing compiled
    assert asked == [15 + 6 + 5] and eng.compilation_count() == before
    monkeypatch.undo()

    cleared = []
    monkeypatch.setattr(compilation.jax, "clear_caches", lambda: cleared.append(True))
    monkeypatch.setattr(compilation, "memory_maps", lambda: (60_000, 65_530))
    assert not compilation.maps_left(1) and compilation.maps_left(0) is False
    odd = LLM("tiny-llama", num_blocks=64, block_size=16, max_num_seqs=4, max_num_batched_tokens=40)
    before = eng.compilation_count()
    odd.generate([list(range(3, 3 + 35))], SamplingParams(temperature=0, max_tokens=1))  # token bucket 40: new
    assert eng.compilation_count() > before
    assert cleared and "dropping the compiled programs" in caplog.text
    monkeypatch.setattr(compilation, "memory_maps", lambda: (10_000, 65_530))
    assert compilation.maps_left(108) and not compilation.maps_left(109)  # 0.9 x 65530 = 58977 maps usable
    assert not compilation.release_if_near_limit(1)


def test_api_argument_forms(llm):
    ids = np.arange(3, 20)
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    assert llm.generate(ids, greedy)[0].token_ids == llm.generate([ids.tolist()], greedy)[0].token_ids
    with pytest.raises(InvalidRequestError, match="sampling_params"):
        llm.generate(["a"], {"temperature": 0})
    assert SamplingParams(stop="abc").stop == ("abc",) and SamplingParams(stop=None).stop == ()
    with pytest.raises(ValueError, match="max_model_len=1000 exceeds"):
        LLM("tiny-llama", num_blocks=48, max_model_len=1000)
    with pytest.raises(ValueError, match="max_model_len must be >= 2"):
        LLM("tiny-llama", num_blocks=48, max_model_len=0)
    with pytest.raises(InvalidRequestError, match="num_tree_nodes must be an integer >= 1"):
        SamplingParams(num_tree_nodes=0).validate()
    with pytest.raises(InvalidRequestError, match="no proposer"):
        llm.generate([3, 4], SamplingParams(num_tree_nodes=2))
    with pytest.raises(ValueError, match="num_tree_nodes=4 needs speculation"):
        LLM("tiny-llama", num_blocks=48, speculative=None, num_tree_nodes=4)
