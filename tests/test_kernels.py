"""The kernel family chosen by measurement (`engine.kernels`): the faster of two kernels wins when the
other is made slower, a forced `matmul` wins over any timing, the timing is cached per machine and model,
and a failed or disabled timing falls back to the instruction-set default."""

import time

import jax
import numpy as np
import pytest
from jax.experimental import io_callback

import cpu_kernels as ck
from engine import LLM, SamplingParams, kernels
from model.config import get_preset

SLEEP_S = 0.003  # per product: 9 products of tiny-llama make a step ~27 ms slower, its real cost is ~0.2 ms
avx512 = pytest.mark.skipif(ck.cpu_features() != "avx512", reason="needs both skinny paths (an AVX-512 CPU)")


@pytest.fixture(autouse=True)
def _timing_on(monkeypatch, tmp_path):
    monkeypatch.setenv("JSE_MEASURE_KERNELS", "1")  # conftest turns it off for the rest of the suite
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # a machine that has timed nothing yet


def _slow_down(monkeypatch, isa: str) -> list[str]:
    """Makes the skinny kernel's path `isa` sleep SLEEP_S after each product (the head's, and each layer's in
    the layers' scan); returns the paths traced."""
    traced = []

    def slowed(real, isa_of):
        def stub(x, p, *layer):
            traced.append(isa_of(p))
            y = real(x, p, *layer)
            if isa_of(p) != isa:
                return y
            return io_callback(lambda y: (time.sleep(SLEEP_S), np.asarray(y))[1], jax.ShapeDtypeStruct(y.shape, y.dtype),
                               y)
        return stub

    monkeypatch.setattr(ck, "skinny_matmul", slowed(ck.skinny_matmul, lambda p: p.isa))
    monkeypatch.setattr(ck, "skinny_matmul_layers", slowed(ck.skinny_matmul_layers, lambda ps: ps[0].isa))
    return traced


@avx512
@pytest.mark.parametrize("slow,fast", [("avx512", "avx2"), ("avx2", "avx512")])
def test_the_faster_of_two_kernels_is_chosen_when_the_other_is_made_slower(monkeypatch, slow, fast):
    monkeypatch.setattr(kernels, "families", lambda dtype="float32": ["avx512", "avx2"])
    traced = _slow_down(monkeypatch, slow)
    choice = kernels.choose(get_preset("tiny-llama"), "float32")
    assert {"avx512", "avx2"} <= set(traced)  # both were timed, each on its own path
    assert (choice.family, choice.how) == (fast, "measured")
    for i in range(len(kernels.MEASURE_TOKENS)):
        assert choice.seconds[slow][i] > choice.seconds[fast][i] + 5 * SLEEP_S


@avx512
def test_a_forced_family_wins_over_the_timing_and_runs_in_the_engine(monkeypatch):
    monkeypatch.setattr(kernels, "families", lambda dtype="float32": ["avx512", "avx2", "xla"])
    traced = _slow_down(monkeypatch, "avx2")
    llm = LLM("tiny-llama", matmul="avx2", num_blocks=32, max_num_seqs=4, max_num_batched_tokens=32)
    assert llm.engine.kernel_choice == kernels.KernelChoice("avx2", "forced")
    assert llm.engine.config.matmul == "avx2"
    llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert traced and set(traced) == {"avx2"}  # every product of the engine's steps on the forced path


def test_a_family_this_cpu_cannot_run_is_refused():
    missing = [f for f in kernels.FAMILIES if f not in kernels.families()]
    if not missing:
        pytest.skip("this CPU runs every family")
    with pytest.raises(ValueError, match=f"matmul='{missing[0]}' does not run here"):
        LLM("tiny-llama", matmul=missing[0], num_blocks=32)


def test_the_timing_is_cached_and_a_failure_falls_back_to_the_default(monkeypatch):
    cfg = get_preset("tiny-llama")
    first = kernels.choose(cfg, "float32")
    assert first.how == "measured" and set(first.seconds) == set(kernels.families())
    assert all(len(v) == len(kernels.MEASURE_TOKENS) and min(v) > 0 for v in first.seconds.values())

    def fail(*_):
        raise RuntimeError("the timing must not run again")

    monkeypatch.setattr(kernels, "measure", fail)
    again = kernels.choose(cfg, "float32")
    assert (again.family, again.how, again.seconds) == (first.family, "cached", first.seconds)
    other = kernels.choose(cfg, "bfloat16")  # another kernel dtype: not cached, and its timing fails
    assert other == kernels.KernelChoice(kernels.isa_default("bfloat16"), "default")
    monkeypatch.setenv("JSE_MEASURE_KERNELS", "0")
    assert kernels.choose(cfg, "float32") == kernels.KernelChoice(kernels.isa_default(), "default")


def test_int8_weights_never_choose_amx():
    assert "amx" not in kernels.families("int8")
    assert kernels.layout("amx", "int8")[2] is None  # an int8 draft under an AMX engine: the skinny kernel


@pytest.mark.parametrize("name", ["tiny-gemma", "tiny-moe"])
def test_every_family_is_timed(monkeypatch, name):
    """Windowed layers (cut with the layers the timing keeps: here the first only) and experts time like any
    model: measured, not the fallback of a failed timing."""
    monkeypatch.setattr(kernels, "MEASURE_BYTES", 1)
    choice = kernels.choose(get_preset(name), "float32")
    assert choice.how == "measured" and set(choice.seconds) == set(kernels.families())
