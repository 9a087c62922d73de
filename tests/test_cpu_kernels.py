"""The native CPU kernels (`cpu_kernels`: skinny matmul, paged attention) against their jnp references, and the
engine with and without them."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cpu_kernels as ck
from flax import nnx
from engine import LLM, SamplingParams
from pallas_kernels.reference import ragged_paged_attention_reference
from tests.test_pallas_attention import TOL, make_batch, ragged_batches



def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return set(f.read().split())
    except OSError:
        return set()


def _cpu_has_avx2_fma() -> bool:
    return {"avx2", "fma"} <= _cpu_flags()


# Skipped only where the CPU cannot run it; a missing library (the install did not build it) fails.
pytestmark = pytest.mark.skipif(not _cpu_has_avx2_fma(), reason="the CPU has no AVX2+FMA")


def test_install_built_the_library():
    assert ck.available(), "cpu_kernels/_skinny_matmul*.so is missing: `pip install -e .` builds it"
    assert ck.cpu_features() in ("avx2", "avx512")

# Relative error bounds against jnp.dot on the same (packed, possibly rounded) weights: only the summation
# order differs, so fp32-level for every weight dtype (bf16 and int8 rounding is in `unpack`, on both sides).
RTOL = 1e-5


@settings(max_examples=40, deadline=None)
@given(T=st.integers(1, 32), K=st.sampled_from([16, 48, 64, 100, 576]), N=st.sampled_from([16, 37, 64, 200, 1000]),
       dtype=st.sampled_from(["float32", "bfloat16", "int8"]), seed=st.integers(0, 2**16))
def test_kernel_equals_reference_inside_jit(T, K, N, dtype, seed):
    rng = np.random.default_rng(seed)
    w = rng.normal(0, 0.05, (K, N)).astype(np.float32)
    x = jnp.asarray(rng.normal(0, 1, (T, K)).astype(np.float32))
    p = ck.pack(w, dtype)
    got = np.asarray(jax.jit(ck.skinny_matmul)(x, p))
    want = np.asarray(ck.skinny_matmul_reference(x, p))
    assert got.shape == (T, N)
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=RTOL * np.abs(want).max())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_kernel_rows_do_not_depend_on_batch_mates(dtype):
    """Batch invariance: a row's result is bitwise the same whatever rows share its step (so a seeded
    request samples the same tokens at any batch size)."""
    rng = np.random.default_rng(1)
    p = ck.pack(rng.normal(0, 0.05, (576, 100)).astype(np.float32), dtype)
    x = rng.normal(0, 1, (13, 576)).astype(np.float32)
    f = jax.jit(ck.skinny_matmul)
    full = np.asarray(f(x, p))
    for T in (1, 2, 5, 8):
        np.testing.assert_array_equal(np.asarray(f(x[:T], p)), full[:T])
    np.testing.assert_array_equal(np.asarray(f(x[7:8], p))[0], full[7])


@pytest.mark.parametrize("dtype,bound", [("float32", 0.0), ("bfloat16", 2.0**-8), ("int8", 0.5 / 127)])
def test_packing_rounds_within_the_dtype(dtype, bound):
    """The packed weight equals W up to the dtype's rounding: exact for fp32, half an ulp of bf16 (2**-8
    relative), half a quantization step for int8 (max|W[:, n]| / 254 per column)."""
    w = np.random.default_rng(0).normal(0, 1, (40, 70)).astype(np.float32)
    back = np.asarray(ck.unpack(ck.pack(w, dtype)))
    scale = np.abs(w).max(axis=0, keepdims=True) if dtype == "int8" else np.abs(w)
    assert np.all(np.abs(back - w) <= bound * scale + 1e-7)
    if dtype == "bfloat16":
        np.testing.assert_array_equal(back, w.astype(ml_dtypes.bfloat16).astype(np.float32))


def test_pack_rejects_bad_input():
    with pytest.raises(ValueError, match="dtype"):
        ck.pack(np.ones((4, 4)), "float16")
    with pytest.raises(ValueError, match="shape"):
        ck.pack(np.ones(4))


LIMITS = {"num_blocks": 48, "block_size": 16, "max_num_seqs": 8, "max_num_batched_tokens": 64}
PROMPTS = [list(range(3, 3 + n)) for n in (1, 15, 17, 40)]


def test_engine_with_kernel_equals_xla_dot_and_falls_back(monkeypatch):
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    xla = LLM("tiny-llama", matmul="xla", **LIMITS)
    kernel = LLM("tiny-llama", **LIMITS)
    assert xla.engine.runner.packed_bytes == 0 and kernel.engine.runner.packed_bytes > 0
    want = [o.token_ids for o in xla.generate(PROMPTS, greedy)]
    assert [o.token_ids for o in kernel.generate(PROMPTS, greedy)] == want
    monkeypatch.setattr(ck, "available", lambda: False)  # a machine where the library does not load
    fallback = LLM("tiny-llama", **LIMITS)
    assert fallback.engine.runner.packed_bytes == 0
    assert [o.token_ids for o in fallback.generate(PROMPTS, greedy)] == want


def test_kernel_logits_match_xla_dot_in_the_paged_step():
    """Decode-step logits (T <= 16: the kernel) against the same step with XLA's dot, fp32 and bf16 weights."""
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=5)
    for dtype in ("float32", "bfloat16"):
        a = LLM("tiny-qwen2", dtype=dtype, matmul="xla", **LIMITS).generate(PROMPTS[:2], sp)
        b = LLM("tiny-qwen2", dtype=dtype, **LIMITS).generate(PROMPTS[:2], sp)
        tol = 1e-4 if dtype == "float32" else 2e-2
        for x, y in zip(a, b):
            assert x.token_ids == y.token_ids
            for ex, ey in zip(x.logprobs, y.logprobs):
                common = sorted(set(ex) & set(ey))
                assert len(common) >= 4
                np.testing.assert_allclose([ex[t] for t in common], [ey[t] for t in common], atol=tol)


@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
def test_narrow_panels_and_xla_dot_compute_one_model(dtype):
    """With bf16 or int8 panels, the 8 tokens the skinny kernel takes and the 32 that go to XLA's dot read the
    same weight values (`keep_packed` writes the panels' values back), so the first 8 rows agree to fp32
    rounding; over the original fp32 weights, XLA's rows were off by 1.6e-3 (bf16) and 5.9e-3 (int8)."""
    from checkpoints import load_model
    from model.llama import Llama
    from training.data import dense_hidden

    loaded = load_model("tiny-llama")
    model = Llama(loaded.config, params=loaded.params)
    model.pack_linears(dtype, max_rows=16)
    tokens = jnp.asarray(np.random.default_rng(0).integers(3, 250, (1, 32)), jnp.int32)
    short = model.logits(dense_hidden(model, tokens[:, :8])[0])  # every product on the skinny kernel
    long = model.logits(dense_hidden(model, tokens)[0])[:8]  # every product on XLA's dot
    np.testing.assert_allclose(np.asarray(short), np.asarray(long), rtol=0, atol=2e-4)
    layer = model.layers[0]
    np.testing.assert_array_equal(np.asarray(layer.wqkv[...]), np.asarray(
        ck.unpack(ck.PackedWeight(layer.wqkv_panels[...], layer.wqkv_scales[...], layer.wqkv.shape[1]))))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_skinny_matmul_layers_reads_the_indexed_layer(dtype):
    """The per-layer product inside a scan picks exactly `weights[layer]` (bitwise the plain kernel's result)
    and refuses an index outside the layers at run time."""
    rng = np.random.default_rng(3)
    weights = [ck.pack(rng.standard_normal((64, 40)).astype(np.float32), dtype) for _ in range(3)]
    x = jnp.asarray(rng.standard_normal((5, 64)), jnp.float32)
    fn = jax.jit(lambda x, layer: ck.skinny_matmul_layers(x, weights, layer))
    for layer in range(3):
        np.testing.assert_array_equal(np.asarray(fn(x, layer)), np.asarray(ck.skinny_matmul(x, weights[layer])))
    with pytest.raises(Exception, match="layer index out of range"):
        jax.block_until_ready(fn(x, 3))
    with pytest.raises(ValueError, match="one shape"):
        ck.skinny_matmul_layers(x, [weights[0], ck.pack(np.ones((64, 24), np.float32), dtype)], 0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_layer_scan_computes_what_the_unrolled_layers_do(dtype, monkeypatch):
    """With packed weights the layers run as one `lax.scan` (a step program compiles once per layer body, not
    per layer); its hidden states are those of the unrolled loop over the same kernels, to fp32 rounding (XLA
    fuses the dense attention's softmax differently inside a loop body; 4.8e-7 apart on this model)."""
    from checkpoints import load_model
    from model.llama import Llama
    from training.data import dense_hidden

    loaded = load_model("tiny-llama")
    model = Llama(loaded.config, params=loaded.params)
    model.pack_linears(dtype, max_rows=16)
    tokens = jnp.asarray(np.random.default_rng(0).integers(3, 250, (2, 8)), jnp.int32)
    assert "scan" in str(jax.make_jaxpr(lambda t: dense_hidden(model, t))(tokens))
    scanned = np.asarray(dense_hidden(model, tokens))
    monkeypatch.setattr(Llama, "_layer_products", lambda self, x: None)
    assert "scan" not in str(jax.make_jaxpr(lambda t: dense_hidden(model, t))(tokens))
    np.testing.assert_allclose(scanned, np.asarray(dense_hidden(model, tokens)), rtol=0, atol=1e-5)


def test_int8_draft_keeps_output_exact():
    """An int8-quantized draft changes acceptance only: the output is the target's (greedy)."""
    from checkpoints import load_model

    target = load_model("tiny-llama")
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    plain = LLM(target, speculative=None, **LIMITS).generate(PROMPTS, greedy)
    spec = LLM(target, speculative="draft", draft_model=target, num_speculative_tokens=3,
               draft_kernel_dtype="int8", **LIMITS)
    spec.engine.proposer.config.min_acceptance = 0.0  # every decode drafts, whatever this machine's step costs
    target_bytes = spec.engine.runner.packed_bytes - spec.engine.proposer.packed_bytes
    assert spec.engine.proposer.packed_bytes < target_bytes / 3  # int8 panels: a quarter of fp32
    outs = spec.generate(PROMPTS, greedy)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert sum(o.num_accepted_tokens for o in outs) > 0


# ---- AMX matmul ----------------------------------------------------------------------------------------


def _cpu_has_amx() -> bool:
    return {"amx_tile", "amx_bf16", "avx512_bf16"} <= _cpu_flags()


# Skipped only on CPUs without AMX; a library that does not offer it on an AMX CPU fails.
amx = pytest.mark.skipif(not _cpu_has_amx(), reason="the CPU has no AMX-BF16")


@amx
def test_amx_matmul_layers_reads_the_indexed_layer_and_the_layers_scan(monkeypatch):
    """On AMX tiles as on the skinny kernel: the per-layer product picks exactly `weights[layer]`, and a model
    packed for AMX runs its layers as a scan, to fp32 rounding of the unrolled loop."""
    from checkpoints import load_model
    from model.llama import Llama
    from training.data import dense_hidden

    rng = np.random.default_rng(4)
    weights = [ck.pack_amx(rng.standard_normal((64, 40)).astype(np.float32), 3) for _ in range(3)]
    x = jnp.asarray(rng.standard_normal((5, 64)), jnp.float32)
    fn = jax.jit(lambda x, layer: ck.amx_matmul_layers(x, weights, layer))
    for layer in range(3):
        np.testing.assert_array_equal(np.asarray(fn(x, layer)), np.asarray(ck.amx_matmul(x, weights[layer])))
    with pytest.raises(Exception, match="layer index out of range"):
        jax.block_until_ready(fn(x, -1))
    loaded = load_model("tiny-llama")
    model = Llama(loaded.config, params=loaded.params)
    model.pack_linears("float32", amx_passes=3)
    tokens = jnp.asarray(rng.integers(3, 250, (2, 8)), jnp.int32)
    assert "scan" in str(jax.make_jaxpr(lambda t: dense_hidden(model, t))(tokens))
    scanned = np.asarray(dense_hidden(model, tokens))
    monkeypatch.setattr(Llama, "_layer_products", lambda self, x: None)
    np.testing.assert_allclose(scanned, np.asarray(dense_hidden(model, tokens)), rtol=0, atol=1e-5)


@amx
def test_amx_is_available_on_an_amx_cpu():
    assert ck.amx_available(), "AMX CPU, but the kernel library does not offer AMX (OS permission? build?)"


@amx
@settings(max_examples=40, deadline=None)
@given(T=st.integers(1, 80), K=st.sampled_from([16, 48, 100, 576]), N=st.sampled_from([16, 37, 64, 200, 1000]),
       passes=st.sampled_from([2, 3]), seed=st.integers(0, 2**16))
def test_amx_equals_reference_and_the_f64_product(T, K, N, passes, seed):
    """Every shape (T, K and N off the 32-multiples included) against the reference (the same bf16 parts,
    summed by jnp.dot: fp32-level agreement), and against the exact product: 3 passes within 2**-15 of
    |x| @ |W| elementwise (each of x and W is kept to 2**-17 by its hi + lo parts), 2 passes within 2**-8
    (W rounded to bf16, 2**-9; x still kept to 2**-17)."""
    rng = np.random.default_rng(seed)
    w = rng.normal(0, 0.05, (K, N)).astype(np.float32)
    x = rng.normal(0, 1, (T, K)).astype(np.float32)
    p = ck.pack_amx(w, passes)
    got = np.asarray(jax.jit(ck.amx_matmul)(jnp.asarray(x), p))
    assert got.shape == (T, N)
    want = np.asarray(ck.amx_matmul_reference(jnp.asarray(x), p))
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=RTOL * np.abs(want).max())
    exact = x.astype(np.float64) @ w.astype(np.float64)
    scale = np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64)
    assert np.all(np.abs(got - exact) <= (2.0**-15 if passes == 3 else 2.0**-8) * scale + 1e-6)


@amx
def test_amx_rows_do_not_depend_on_batch_mates():
    """A row's result is bitwise the same whatever rows share its call (and its 32-row tile block)."""
    rng = np.random.default_rng(2)
    p = ck.pack_amx(rng.normal(0, 0.05, (576, 100)).astype(np.float32))
    x = rng.normal(0, 1, (70, 576)).astype(np.float32)
    f = jax.jit(ck.amx_matmul)
    full = np.asarray(f(x, p))
    for T in (1, 17, 32, 33, 64):
        np.testing.assert_array_equal(np.asarray(f(x[:T], p)), full[:T])
    np.testing.assert_array_equal(np.asarray(f(x[40:41], p))[0], full[40])


def test_pack_amx_round_trip_and_bad_input():
    """hi + lo keep W to 2**-17 relative (3 passes); 2 passes keep W rounded to bf16 exactly, as 3 do for a W
    exact in bf16 (its lo part would be zeros)."""
    w = np.random.default_rng(0).normal(0, 1, (40, 70)).astype(np.float32)
    three = ck.pack_amx(w, 3)
    assert three.hi.shape == (96 // 16, 64 // 32, 16, 32) and three.lo.shape == three.hi.shape  # K, N padded to 32s
    assert np.all(np.abs(np.asarray(ck.unpack_amx(three, 40)) - w) <= 2.0**-17 * np.abs(w))
    one = ck.pack_amx(w, 2)
    assert one.lo.size == 0 and one.nbytes == three.nbytes // 2
    np.testing.assert_array_equal(np.asarray(ck.unpack_amx(one, 40)), w.astype(ml_dtypes.bfloat16).astype(np.float32))
    exact = w.astype(ml_dtypes.bfloat16).astype(np.float32)  # a checkpoint stored in bf16: no lo part to keep
    dropped = ck.pack_amx(exact, 3)
    assert dropped.lo.size == 0
    if ck.amx_available():
        x = np.random.default_rng(1).normal(0, 1, (5, 40)).astype(np.float32)
        np.testing.assert_array_equal(np.asarray(ck.amx_matmul(x, dropped)), np.asarray(ck.amx_matmul(x, one)))
    with pytest.raises(ValueError, match="passes"):
        ck.pack_amx(w, 1)
    with pytest.raises(ValueError, match="shape"):
        ck.pack_amx(np.ones(4))


@amx
def test_engine_runs_every_product_on_amx_and_avx512_switch_turns_it_off(monkeypatch):
    """The engine's step programs call the AMX kernel for every product (decode steps and prefill chunks)
    where it is available, and JSE_CPU_ISA=avx512 (a fresh process) keeps the skinny kernel and XLA's dot only."""
    import os
    import subprocess
    import sys
    traced = []  # row counts of the products traced into the AMX kernel
    real = ck.amx_matmul
    monkeypatch.setattr(ck, "amx_matmul", lambda x, p: traced.append(x.shape[0]) or real(x, p))
    llm = LLM("tiny-llama", **LIMITS)
    greedy = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    llm.generate([PROMPTS[3]], greedy)  # a 40-token prefill: the 64-token bucket
    assert {1, 64} <= set(traced)
    script = ("import cpu_kernels as ck\n"
              "assert ck.available() and not ck.amx_available()\n"
              "print('ok')\n")
    env = {**os.environ, "JSE_CPU_ISA": "avx512", "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-2000:]


@amx
def test_bf16_kernel_weights_run_every_product_on_amx(monkeypatch):
    """With bf16 kernel weights every product, a 1-token decode step's included, is an AMX product (a verify
    window then costs about a decode step) and no skinny copy is kept; the logits stay within bf16 rounding
    of the fp32 XLA-dot engine's."""
    traced = []
    real = ck.amx_matmul
    monkeypatch.setattr(ck, "amx_matmul", lambda x, p: traced.append(x.shape[0]) or real(x, p))
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=5)
    amx_llm = LLM("tiny-llama", kernel_dtype="bfloat16", **LIMITS)
    state = amx_llm.engine.runner.state.state()
    names = {str(k) for path, _ in nnx.to_flat_state(state) for k in path}
    assert "wqkv_amx_hi" in names and "head_amx_hi" in names and not any(n.endswith("_panels") for n in names)
    got = amx_llm.generate(PROMPTS[:2], sp)
    assert {2, 16} <= set(traced)  # the two prompts' decode steps, and their prefill (16 tokens)
    want = LLM("tiny-llama", matmul="xla", **LIMITS).generate(PROMPTS[:2], sp)
    for x, y in zip(got, want):
        assert x.token_ids == y.token_ids
        for ex, ey in zip(x.logprobs, y.logprobs):
            common = sorted(set(ex) & set(ey))
            assert len(common) >= 4
            np.testing.assert_allclose([ex[t] for t in common], [ey[t] for t in common], atol=2e-2)


# ---- scoring's log-softmax reduction --------------------------------------------------------------------


@pytest.mark.skipif(ck.cpu_features() != "avx512", reason="the kernel is AVX-512 only")
@pytest.mark.parametrize("T,V", [(1, 5), (7, 16), (33, 1003), (64, 49152)])
def test_log_softmax_gather_equals_reference(T, V):
    """Target log-probabilities within 2e-6 of jax.nn.logsumexp's (the argmax's within 1e-5), and the argmax exactly, ties
    (small integer logits) going to the lowest index and rows of -1e30 (a partial head's masked tokens)
    included."""
    rng = np.random.default_rng(T * V)
    logits = rng.normal(0, 4, (T, V)).astype(np.float32)
    logits[::3] = rng.integers(-2, 3, (len(logits[::3]), V))  # many ties at the max
    logits[1::4, : V // 2] = -1e30
    targets = rng.integers(0, V, T).astype(np.int32)
    got_lp, got_am, got_top = jax.jit(ck.log_softmax_gather)(jnp.asarray(logits), jnp.asarray(targets))
    want_lp, want_am, want_top = ck.log_softmax_gather_reference(jnp.asarray(logits), jnp.asarray(targets))
    np.testing.assert_array_equal(np.asarray(got_am), np.asarray(want_am))
    # The log of a float32 sum over up to 49,152 terms: ~1e-5 absolute where the top is near 0.
    np.testing.assert_allclose(np.asarray(got_top), np.asarray(want_top), rtol=2e-6, atol=1e-5)
    lp_at_argmax = ck.log_softmax_gather_reference(jnp.asarray(logits), want_am)[0]
    np.testing.assert_allclose(np.asarray(want_top), np.asarray(lp_at_argmax), rtol=1e-6, atol=1e-6)
    finite = np.asarray(want_lp) > -1e29
    np.testing.assert_allclose(np.asarray(got_lp)[finite], np.asarray(want_lp)[finite], rtol=2e-6, atol=2e-6)
    assert np.all(np.asarray(got_lp)[~finite] < -1e29)


@amx
@pytest.mark.parametrize("T,N,passes", [(17, 100, 3), (64, 2000, 3), (40, 49152, 2)])
def test_amx_head_log_softmax_equals_the_unfused_pair(T, N, passes):
    """The fused head + reduction equals the AMX product followed by the reduction kernel: the argmax exactly
    (the same logits, bitwise), the log-probabilities within 2e-6 (the vocabulary is summed in groups),
    ties and a target in every column group included."""
    rng = np.random.default_rng(N)
    x = jnp.asarray(rng.normal(0, 1, (T, 576)).astype(np.float32))
    w = rng.normal(0, 0.05, (576, N)).astype(np.float32)
    w[:, 7] = w[:, 3]  # a tie for the argmax in rows where column 3 wins
    p = ck.pack_amx(w, passes)
    targets = jnp.asarray(np.linspace(0, N - 1, T).astype(np.int32))
    got_lp, got_am = jax.jit(ck.amx_head_log_softmax)(x, p, targets)
    want_lp, want_am, _ = jax.jit(lambda x, p, t: ck.log_softmax_gather(ck.amx_matmul(x, p), t))(x, p, targets)
    np.testing.assert_array_equal(np.asarray(got_am), np.asarray(want_am))
    np.testing.assert_allclose(np.asarray(got_lp), np.asarray(want_lp), rtol=2e-6, atol=2e-6)
    with pytest.raises(Exception, match="target id out of range"):
        np.asarray(jax.jit(ck.amx_head_log_softmax)(x, p, targets.at[0].set(N)))


@pytest.mark.skipif(ck.cpu_features() != "avx512", reason="the kernel is AVX-512 only")
def test_log_softmax_gather_rejects_out_of_range_targets():
    with pytest.raises(Exception, match="target id out of range"):
        np.asarray(jax.jit(ck.log_softmax_gather)(jnp.zeros((2, 8)), jnp.asarray([1, 8], jnp.int32)))


# ---- paged attention ----------------------------------------------------------------------------------


@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=ragged_batches(), D=st.sampled_from([8, 16, 64, 128]))
def test_paged_attention_equals_reference_inside_jit(case, D):
    """Ragged decode / prefill / verify rows, padded tokens and sequences, GQA 1..8, f32 and bf16 pools: the native
    kernel equals the jnp reference (fp32 sums on both; bf16 only rounds the output, within 2e-2)."""
    (q, k, v, bt, sl, qsl), dtype = case
    rng = np.random.default_rng(int(sl.sum()))
    widen = lambda a: jnp.asarray(rng.standard_normal((*a.shape[:-1], D)), a.dtype)  # noqa: E731
    args = (widen(q), widen(k), widen(v), bt, sl, qsl)
    got = np.asarray(jax.jit(ck.paged_attention)(*args, jnp.int32(1)), np.float32)
    want = np.asarray(ragged_paged_attention_reference(*args, 1), np.float32)
    assert got.shape == want.shape and np.all(np.isfinite(got))
    np.testing.assert_allclose(got, want, atol=TOL[dtype], rtol=TOL[dtype])
    assert np.all(got[int(qsl[-1]):] == 0)  # padding tokens


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("D", [32, 64, 128])
def test_paged_attention_long_chunks_equal_reference(dtype, D):
    """Prefill chunks (runs of 32+ query tokens: 16-token tiles on AVX-512 CPUs, on the split path for head
    dims 64 and 128, else the transposed one) after a cached context, beside decode and verify rows and a
    padding token, SmolLM2's GQA (9 heads over 3)."""
    args = make_batch(7, [300, 1, 5, 64], [812, 20, 40, 64], heads=9, kv_heads=3, head_dim=D, block_size=16,
                      pad_tokens=1, dtype=dtype)
    got = np.asarray(jax.jit(ck.paged_attention)(*args, jnp.int32(1)), np.float32)
    want = np.asarray(ragged_paged_attention_reference(*args, 1), np.float32)
    np.testing.assert_allclose(got, want, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("pool", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("D", [64, 128])
def test_paged_attention_short_rows_equal_reference(D, pool):
    """Decode and verify rows over f32 and bf16 pools (the split path on AVX-512, bf16 rows as even/odd
    elements: one item per sequence over all KV heads once there are 8+ short tiles): float32 q against the
    reference within 1e-5, contexts ending on, before and after tile (32) and 16-position boundaries, beside
    a prefill chunk."""
    q_lens = [1] * 12 + [3, 4, 2, 40]
    kv_lens = [1, 15, 16, 17, 31, 32, 33, 47, 48, 63, 64, 250, 3, 70, 130, 90]
    q, k, v, bt, sl, qsl = make_batch(11, q_lens, kv_lens, heads=9, kv_heads=3, head_dim=D, block_size=16,
                                      pad_tokens=2, dtype=jnp.float32)
    k, v = k.astype(pool), v.astype(pool)
    for few in (False, True):  # 16 sequences; then 3 (one item per KV head)
        args = (q, k, v, bt, sl, qsl) if not few else (q[:3], k, v, bt[:3], sl[:3], qsl[:4])
        got = np.asarray(jax.jit(ck.paged_attention)(*args, jnp.int32(1)))
        want = np.asarray(ragged_paged_attention_reference(*args, 1))
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("D", [16, 64, 128])
def test_paged_attention_rows_do_not_depend_on_the_run_length(dtype, D):
    """Batch invariance: the last tokens of a sequence attend bitwise alike whether the step holds 40 of its
    tokens (a prefill chunk), 4 (a verify window) or 1 (decode), beside other sequences or alone."""
    q, k, v, bt, sl, qsl = make_batch(5, [40, 3], [70, 50], heads=6, kv_heads=2, head_dim=D, block_size=16,
                                      dtype=dtype)
    f = jax.jit(ck.paged_attention)
    full = np.asarray(f(q, k, v, bt, sl, qsl, jnp.int32(1)))[:40]
    for n in (4, 1):
        got = np.asarray(f(q[40 - n:40], k, v, bt[:1], sl[:1], jnp.array([0, n], jnp.int32), jnp.int32(1)))
        np.testing.assert_array_equal(got, full[40 - n:])


def test_paged_attention_rejects_out_of_range_tables():
    """A block id past the pool raises instead of reading outside it."""
    q, k, v, bt, sl, qsl = make_batch(0, [1, 2], [20, 9], heads=4, kv_heads=2, head_dim=16, block_size=8)
    bad = bt.at[0, 1].set(k.shape[1] + 5)
    with pytest.raises(Exception, match="block table entry out of range"):
        np.asarray(jax.jit(ck.paged_attention)(q, k, v, bad, sl, qsl, jnp.int32(0)))
    assert ck.paged_attention_supported(9, 3, 64) and not ck.paged_attention_supported(4, 2, 12)


def test_engine_native_attention_equals_reference():
    """Greedy tokens and logprobs with the native attention (decode, chunked prefill, prefix-cache hits)
    equal the jnp reference's."""
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3)
    prompts = PROMPTS + [PROMPTS[3] + [7, 8, 9]]  # a prefix-cache hit on PROMPTS[3]
    ref = LLM("tiny-llama", attention="reference", **LIMITS).generate(prompts, sp)
    native = LLM("tiny-llama", attention="native", **LIMITS).generate(prompts, sp)
    for a, b in zip(ref, native):
        assert a.token_ids == b.token_ids
        for ea, eb in zip(a.logprobs, b.logprobs):
            np.testing.assert_allclose([ea[t] for t in ea], [eb[t] for t in ea], atol=1e-5)


def test_avx2_path_equals_reference():
    """The AVX2 kernels, forced on an AVX-512 machine (JSE_CPU_ISA=avx2) in a fresh process: the skinny
    matmul at every row count of its chunks (1..6, then a second chunk) and weight dtype against the
    reference, batch-invariant; paged attention's decode, verify and prefill rows over f32 and bf16 pools."""
    import os
    import subprocess
    import sys
    script = (
        "import jax, numpy as np, cpu_kernels as ck\n"
        "assert ck.cpu_features() == 'avx2', ck.cpu_features()\n"
        "rng = np.random.default_rng(0)\n"
        "for T in range(1, 9):\n"
        "    for dtype in ('float32', 'bfloat16', 'int8'):\n"
        "        w = rng.normal(0, 0.05, (100, 37)).astype(np.float32)\n"
        "        x = rng.normal(0, 1, (T, 100)).astype(np.float32)\n"
        "        p = ck.pack(w, dtype)\n"
        "        got = np.asarray(jax.jit(ck.skinny_matmul)(x, p))\n"
        "        want = np.asarray(ck.skinny_matmul_reference(x, p))\n"
        f"        np.testing.assert_allclose(got, want, rtol={RTOL}, atol={RTOL} * np.abs(want).max())\n"
        "        one = np.asarray(jax.jit(ck.skinny_matmul)(x[-1:], p))\n"
        "        np.testing.assert_array_equal(one[0], got[-1])\n"
        "from pallas_kernels.reference import ragged_paged_attention_reference as ref\n"
        "from tests.test_pallas_attention import make_batch\n"
        "for dtype in ('float32', 'bfloat16'):\n"
        "    args = make_batch(3, [1, 4, 40], [33, 70, 90], heads=9, kv_heads=3, head_dim=64, block_size=16,\n"
        "                      pad_tokens=1, dtype=dtype)\n"
        "    got = np.asarray(jax.jit(ck.paged_attention)(*args, 1), np.float32)\n"
        "    want = np.asarray(ref(*args, 1), np.float32)\n"
        "    np.testing.assert_allclose(got, want, atol=2e-2 if dtype == 'bfloat16' else 1e-5, rtol=2e-2)\n"
        "print('ok')\n")
    env = {**os.environ, "JSE_CPU_ISA": "avx2", "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
