"""float32 weights that are exact GGUF Q4_1 / Q8_0 values, kept in those blocks (`cpu_kernels.blocks`): found
from the values, widened bit for bit, summed exactly as the float32 panels are; the real model's file blocks
read as such."""

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cpu_kernels as ck
from cpu_kernels import blocks
from engine import kernels

GGUF_TYPES = {"q4_1": gguf.GGMLQuantizationType.Q4_1, "q8_0": gguf.GGMLQuantizationType.Q8_0}

pytestmark = pytest.mark.skipif(not ck.available(), reason="the CPU kernels do not run here")


def gguf_values(w: np.ndarray, fmt: str) -> np.ndarray:
    """`w` `[K, N]` through gguf-py's quantize and dequantize of `fmt`, blocks along K (as a GGUF stores a
    projection: rows of `in` values)."""
    rows = np.ascontiguousarray(w.T, np.float32)
    return np.ascontiguousarray(gguf.quants.dequantize(gguf.quants.quantize(rows, GGUF_TYPES[fmt]),
                                                       GGUF_TYPES[fmt]).T, np.float32)


def awkward(K: int, N: int, seed: int) -> np.ndarray:
    """Random weights with the blocks that trip a naive recovery: constant, all zero, a large offset with a
    tiny spread (d near m's fp16 resolution), a single outlier."""
    rng = np.random.default_rng(seed)
    w = rng.normal(0, 0.05, (K, N)).astype(np.float32)
    w[:32, 0] = 0.25
    w[:32, 1 % N] = 0.0
    w[32 % K:32 % K + 32, 2 % N] = 7.0 + rng.normal(0, 1e-3, 32)
    w[5, 3 % N] = 40.0
    return w


@settings(max_examples=30, deadline=None)
@given(fmt=st.sampled_from(["q4_1", "q8_0"]), K=st.sampled_from([32, 64, 576]),
       N=st.sampled_from([1, 16, 37, 256, 300]), seed=st.integers(0, 2**16))
def test_gguf_values_are_found_and_widened_bit_for_bit(fmt, K, N, seed):
    w = gguf_values(awkward(K, N, seed), fmt)
    found = blocks.find_blocks(w)
    assert found is not None and found[0] == fmt
    panels = found[1]
    assert panels.dtype == np.uint8 and panels.shape == (-(-N // 16), K // 32, blocks.BLOCK_BYTES[fmt])
    np.testing.assert_array_equal(blocks.unpack_blocks(fmt, panels, N), w)


def test_values_that_are_not_blocks_are_refused():
    rng = np.random.default_rng(0)
    w = gguf_values(rng.normal(0, 0.05, (64, 40)).astype(np.float32), "q4_1")
    assert blocks.find_blocks(rng.normal(0, 0.05, (64, 40)).astype(np.float32)) is None
    nudged = w.copy()
    nudged[17, 33] = np.nextafter(nudged[17, 33], np.float32(1))  # one value off by one ulp
    assert blocks.find_blocks(nudged) is None
    assert blocks.find_blocks(w[:48]) is None  # K not a multiple of 32
    broken = w.copy()
    broken[0, 0] = np.nan
    assert blocks.find_blocks(broken) is None
    assert ck.pack(nudged).format == "" and ck.pack(w).format == "q4_1"
    assert ck.pack(w, "bfloat16").format == ""  # narrower panels round the values: never blocks


def test_weight_blocks_off_keeps_float32_panels(monkeypatch):
    w = gguf_values(np.random.default_rng(1).normal(0, 0.05, (64, 40)).astype(np.float32), "q8_0")
    monkeypatch.setenv("JSE_WEIGHT_BLOCKS", "0")
    p = ck.pack(w)
    assert p.format == "" and p.panels.dtype == jnp.float32


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_block_panels_sum_as_the_float32_panels_do(monkeypatch, fmt):
    """Every token count from 1 to 17 (chunks of 1 to 8 rows, a partial last panel), on each path this CPU
    runs: the same float32 sums, bit for bit, from the blocks as from the float32 panels."""
    rng = np.random.default_rng(2)
    w = gguf_values(awkward(576, 200, 3), fmt)
    fast = ck.pack(w)
    monkeypatch.setenv("JSE_WEIGHT_BLOCKS", "0")
    plain = ck.pack(w)
    assert fast.format == fmt and plain.format == ""
    for isa in ck.skinny_isas():
        a = ck.PackedWeight(fast.panels, fast.scales, fast.n, isa, fast.format)
        b = ck.PackedWeight(plain.panels, plain.scales, plain.n, isa)
        for T in range(1, 18):
            x = jnp.asarray(rng.normal(0, 1, (T, 576)).astype(np.float32))
            got = np.asarray(jax.jit(ck.skinny_matmul)(x, a))
            np.testing.assert_array_equal(got, np.asarray(jax.jit(ck.skinny_matmul)(x, b)))
        want = np.asarray(ck.skinny_matmul_reference(x, b))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_the_layer_loop_reads_the_indexed_layers_blocks():
    rng = np.random.default_rng(4)
    weights = [ck.pack(gguf_values(rng.normal(0, 0.05, (64, 40)).astype(np.float32), "q4_1")) for _ in range(3)]
    assert {w.format for w in weights} == {"q4_1"}
    x = jnp.asarray(rng.normal(0, 1, (3, 64)).astype(np.float32))
    fn = jax.jit(lambda x, layer: ck.skinny_matmul_layers(x, weights, layer))
    for layer in range(3):
        np.testing.assert_array_equal(np.asarray(fn(x, layer)), np.asarray(ck.skinny_matmul(x, weights[layer])))
    mixed = [weights[0], ck.pack(gguf_values(rng.normal(0, 0.05, (64, 40)).astype(np.float32), "q8_0"))]
    with pytest.raises(ValueError, match="format"):
        ck.skinny_matmul_layers(x, mixed, 0)


def test_the_kernel_timing_uses_weights_of_the_targets_formats():
    """`weight_formats` reads the formats off layer 0's weights; the timed random weights are rounded to them
    (`_as_blocks`), so they pack as the target's will."""
    from checkpoints.resolve import random_params
    from model.config import get_preset

    cfg = get_preset("tiny-llama")
    params = random_params(cfg)
    params["w_up"] = kernels._as_blocks(params["w_up"], "q4_1", along_last=False)
    params["embed"] = kernels._as_blocks(params["embed"], "q8_0", along_last=True)
    assert not cfg.tie_word_embeddings  # so the head is lm_head, and the embedding is not a kernel weight
    assert kernels.weight_formats(params, "float32") == {"w_up": "q4_1"}
    params["lm_head"] = kernels._as_blocks(params["lm_head"], "q8_0", along_last=False)
    assert kernels.weight_formats(params, "float32") == {"w_up": "q4_1", "lm_head": "q8_0"}
    assert kernels.weight_formats(params, "bfloat16") == {}
    del params["lm_head"]  # a tied head reads the embedding transposed
    assert kernels.weight_formats(params, "float32") == {"w_up": "q4_1", "embed": "q8_0"}
    assert ck.pack(np.asarray(params["w_up"][1])).format == "q4_1"
    assert ck.pack(np.asarray(params["embed"]).T).format == "q8_0"


def test_the_real_model_streams_its_file_blocks_and_computes_the_float32_model(monkeypatch):
    """SmolLM2-135M's Q4_1 projections and Q8_0 embedding stay in the file's blocks (96.4 MB against 537.9 MB
    of float32 panels) and the step's logits equal those over the float32 panels bit for bit."""
    from checkpoints import load_model
    from engine.kernels import ALL_ROWS
    from model.llama import Llama
    from training.data import dense_hidden

    loaded = load_model()
    tokens = jnp.asarray([[1, 504, 3458, 282, 4649, 314, 9, 2, 17]], jnp.int32)

    def logits(blocks_on: bool):
        monkeypatch.setenv("JSE_WEIGHT_BLOCKS", "1" if blocks_on else "0")
        model = Llama(loaded.config, params=loaded.params)
        nbytes = model.pack_linears("float32", ALL_ROWS, None, ck.skinny_isas()[0])
        return model, nbytes, np.asarray(model.logits(dense_hidden(model, tokens)[0]))

    model, nbytes, fast = logits(True)
    assert {getattr(lp, f"{n}_format") for lp in model.layers for n in model.LINEARS} == {"q4_1"}
    assert model.head_format == "q8_0"
    cfg = loaded.config
    E, F, V, L = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_layers
    q4, q8 = blocks.BLOCK_BYTES["q4_1"], blocks.BLOCK_BYTES["q8_0"]
    qkv = E + 2 * cfg.num_kv_heads * cfg.head_dim
    per_layer = (qkv // 16 * E // 32 + E // 16 * E // 32 + 2 * F // 16 * E // 32 + E // 16 * F // 32) * q4
    assert nbytes == L * per_layer + V // 16 * E // 32 * q8 == 96_436_224
    _, plain_bytes, plain = logits(False)
    assert plain_bytes == 537_919_488
    np.testing.assert_array_equal(fast, plain)
