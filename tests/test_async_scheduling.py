"""Async scheduling (`Engine._step_ahead`): the next step is dispatched before this one's tokens are read back;
outputs, logprobs and block accounting equal the synchronous loop's exactly."""

import pytest

from engine import LLM, SamplingParams

PROMPTS = [list(range(3, 3 + n)) for n in (1, 15, 16, 17, 33, 40)]


def _engine(async_scheduling: bool, **kw) -> LLM:
    # 9 usable blocks of 8 tokens: the six requests cannot all stay resident, so some are preempted.
    args = dict(num_blocks=10, block_size=8, max_num_seqs=8, max_num_batched_tokens=16, kv_watermark=0.0,
                swap_threshold_tokens=1)
    args.update(kw)
    return LLM("tiny-llama", speculative=None, async_scheduling=async_scheduling, **args)


def _params(llm: LLM) -> list[SamplingParams]:
    # Greedy to the length limit, greedy with a stop token the model emits early (a row dispatched ahead is
    # dropped), seeded samples with logprobs, two samples of one prompt, a single-token request.
    greedy = llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
    return [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[greedy.token_ids[2]], ignore_eos=True),
            SamplingParams(temperature=0.9, seed=7, max_tokens=9, logprobs=2, ignore_eos=True),
            SamplingParams(temperature=0.9, seed=8, max_tokens=7, n=2, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=1),
            SamplingParams(temperature=0.5, top_k=5, seed=3, max_tokens=10, logprobs=0, ignore_eos=True)]


@pytest.mark.parametrize("swap", [False, True])
def test_async_equals_sync_under_preemption(swap):
    results = {}
    for mode in (False, True):
        llm = _engine(mode, swap_space_bytes=(1 << 20) * swap)
        outs = llm.generate(PROMPTS, _params(llm))
        sch = llm.engine.scheduler
        assert (sch.num_swapped > 0, sch.num_recomputed > 0) == (swap, not swap)
        assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_usable_blocks
        assert all(r.num_pending_tokens == 0 for r in sch.running + sch.waiting)
        results[mode] = [(o.token_ids, o.finish_reason, o.logprobs) for o in outs]
    assert results[True] == results[False]
    assert results[True][1][1] == "stop" and len(results[True][1][0]) == 3  # stopped at its third token


def test_the_next_step_is_dispatched_before_the_read_back(monkeypatch):
    llm = _engine(True)
    events = _record(monkeypatch, llm.engine.runner)
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    assert len(out.token_ids) == 4
    # Prefill and three decodes: each decode is dispatched before the step before it is read back, and the
    # last token's step dispatches nothing more (its max_tokens is known ahead).
    assert "".join(events) == "ddcdcdcc"


def _record(monkeypatch, runner) -> list[str]:
    events = []
    dispatch, collect = runner.dispatch, runner.collect
    monkeypatch.setattr(runner, "dispatch", lambda *a, **k: events.append("d") or dispatch(*a, **k))
    monkeypatch.setattr(runner, "collect", lambda *a, **k: events.append("c") or collect(*a, **k))
    return events


def test_ngram_runs_ahead_only_where_the_lookup_proposes_nothing(monkeypatch):
    # The gate off (min_acceptance 0): a decode drafts whenever its lookup matches, so which steps run ahead
    # depends on the tokens alone.
    from engine import Engine, EngineConfig
    from tests.test_ngram import NGRAM, PROMPTS as REPEATING
    from tests.test_speculative import _model, _run

    target = _model(scale=4.0)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    seeded = SamplingParams(temperature=0.8, seed=5, max_tokens=24, ignore_eos=True)
    outs = {}
    for mode in (False, True):
        engine = Engine(target, EngineConfig(num_blocks=96, block_size=16, max_num_seqs=4, max_num_batched_tokens=32,
                                             async_scheduling=mode), speculation=NGRAM)
        events = _record(monkeypatch, engine.runner)
        outs[mode] = [(o.token_ids, o.num_draft_tokens > 0) for o in _run(engine, REPEATING[:3], [greedy, seeded, greedy])]
        trace = "".join(events)
        assert ("ddc" in trace) == mode and engine.stats.num_draft_tokens > 0  # async: both kinds of step ran
    assert outs[True] == outs[False]


def test_abort_while_a_step_is_in_flight():
    llm = _engine(True, num_blocks=48)
    engine = llm.engine
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    alone = llm.generate([PROMPTS[3]], greedy)[0].token_ids
    keep = engine.add_request(PROMPTS[3], greedy)
    drop = engine.add_request(PROMPTS[4], greedy)
    while len(drop.output_token_ids) < 2:
        engine.step()
    assert engine._ahead is not None and drop.num_pending_tokens == 1  # its next token is being computed
    engine.abort(drop.request_id)
    while engine.has_unfinished():
        engine.step()
    assert keep.output_token_ids == alone
    assert len(drop.output_token_ids) == 2 and drop.finish_reason.value == "abort"
    engine.step()  # reads back the last step dispatched ahead, if any
    assert engine.blocks.num_free_blocks == engine.blocks.num_usable_blocks


def test_a_stop_string_found_while_the_next_step_is_in_flight():
    llm = _engine(True, num_blocks=48)
    engine = llm.engine
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = llm.generate([PROMPTS[3], PROMPTS[4]], greedy)
    text = alone[1].text
    # A character that first appears at position k >= 2 of the greedy text: the stop string ends the output there.
    k = next(k for k in range(2, len(text)) if text[k].isascii() and text[k].isprintable() and text[k] not in text[:k])
    keep = engine.add_request(PROMPTS[3], greedy)
    stopped = engine.add_request(PROMPTS[4], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                             stop=(text[k],)))
    ahead_when_stopped = None
    outs = {}
    while engine.has_unfinished():
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
            if out.request_id == stopped.request_id and out.finished:
                ahead_when_stopped = engine._ahead  # the step dispatched before this read-back
    assert ahead_when_stopped is not None and stopped.request_id in ahead_when_stopped[2]  # it had a row there
    final = outs[stopped.request_id][-1]
    assert final.finish_reason == "stop" and final.text == text[:k]
    assert "".join(o.delta_text for o in outs[stopped.request_id]) == text[:k]
    assert keep.output_token_ids == alone[0].token_ids
    engine.step()  # reads back the step dispatched ahead, if any
    assert engine.blocks.num_free_blocks == engine.blocks.num_usable_blocks
