"""Checkpoint loading against transformers as the reference implementation."""

import os
import subprocess
import sys

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from checkpoints import (DEFAULT_MODEL, Tokenizer, default_gguf_path, load_gguf, load_hf_dir, load_model,  # noqa: E402
                         load_orbax, save_hf_dir, save_orbax)
from checkpoints.gguf_loader import unpermute_qk  # noqa: E402
from model.config import RopeScaling  # noqa: E402
from model.llama import Llama  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

def _hf_config(kind: str, rope_original_context: int = 64):
    common = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_key_value_heads=2,
                  max_position_embeddings=256, bos_token_id=1, eos_token_id=2, dtype="float32")
    if kind == "llama":
        return transformers.LlamaConfig(num_attention_heads=4, head_dim=16, rms_norm_eps=1e-5,
                                        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                         "original_max_position_embeddings": rope_original_context},
                                        **common)
    return transformers.Qwen2Config(num_attention_heads=8, rms_norm_eps=1e-6, tie_word_embeddings=True,
                                    rope_parameters={"rope_type": "default", "rope_theta": 1e6}, **common)


def _hf_model(kind: str, **config):
    """A random transformers model whose weights are far from init, so a wrong mapping shows.

    Values are rounded to float16 so that a GGUF written in F16 holds them exactly.
    """
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_hf_config(kind, **config)).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.rand_like(p) + 0.5 if "norm" in name else 0.15 * torch.randn_like(p))
            p.copy_(p.half().float())
    return model


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def hf_dir(request, tmp_path_factory):
    model = _hf_model(request.param)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return str(path), model


TOKENS = np.random.default_rng(0).integers(0, 320, size=(2, 12)).astype(np.int32)


def _hf_logits(model, tokens):
    with torch.no_grad():
        return model(torch.as_tensor(tokens, dtype=torch.long)).logits.numpy()


def _our_logits(cfg, params, tokens):
    return np.asarray(Llama(cfg, params=params).dense_logits(jnp.asarray(tokens)))


def test_hf_dir_matches_transformers(hf_dir):
    path, model = hf_dir
    cfg, params = load_hf_dir(path)
    assert cfg.num_params == sum(p.numel() for p in model.parameters())
    np.testing.assert_allclose(_our_logits(cfg, params, TOKENS), _hf_logits(model, TOKENS), atol=1e-4, rtol=0)


def test_hf_round_trip(hf_dir, tmp_path):
    cfg, params = load_hf_dir(hf_dir[0])
    save_hf_dir(tmp_path, cfg, params)
    cfg2, params2 = load_hf_dir(tmp_path)
    assert cfg2 == cfg
    assert params2.keys() == params.keys()
    for name in params:
        np.testing.assert_array_equal(params2[name], params[name], err_msg=name)
    # transformers reads what we wrote, and computes the same function.
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    np.testing.assert_allclose(_hf_logits(theirs, TOKENS), _hf_logits(hf_dir[1], TOKENS), atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_orbax_round_trip(hf_dir, tmp_path, dtype):
    cfg, params = load_hf_dir(hf_dir[0], dtype=dtype)
    save_orbax(tmp_path / "ckpt", cfg, params)
    cfg2, params2 = load_orbax(tmp_path / "ckpt")
    assert cfg2 == cfg
    for name in params:
        assert params2[name].dtype == params[name].dtype == np.dtype(dtype)
        np.testing.assert_array_equal(params2[name], params[name], err_msg=name)
    with pytest.raises(FileExistsError):
        save_orbax(tmp_path / "ckpt", cfg, params)


def _permute(w, n_head):
    # llama.cpp's convert_hf_to_gguf.LlamaModel.permute, as the converter applies it.
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_unpermute_inverts_converter():
    w = np.arange(6 * 8 * 5, dtype=np.float32).reshape(6 * 8, 5)
    np.testing.assert_array_equal(unpermute_qk(_permute(w, 6), 6), w)
    assert not np.array_equal(_permute(w, 6), w)


def test_gguf_written_like_llama_cpp_matches_transformers(tmp_path):
    """A Llama with GQA and Llama-3 rope scaling, written as convert_hf_to_gguf would: Q/K rows
    permuted, matrices F16, norms F32, scaling baked into `rope_freqs.weight` (with the
    converter's original context of 8192)."""
    model = _hf_model("llama", rope_original_context=8192)
    c = model.config
    sd = {k: v.numpy() for k, v in model.state_dict().items()}
    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "llama")
    w.add_name("Tiny Llama Test")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    w.add_eos_token_id(2)
    D = c.head_dim
    inv = 1.0 / 10000.0 ** (np.arange(0, D, 2) / D)
    wavelen = 2 * np.pi / inv
    smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0)
    factors = np.where(wavelen < 8192 / 4.0, 1.0, np.where(wavelen > 8192, 8.0, 1 / ((1 - smooth) / 8.0 + smooth)))
    assert 1 < factors[-2] < 8 and factors[-1] == 8 and factors[0] == 1  # all three regimes
    w.add_tensor("rope_freqs.weight", factors.astype(np.float32))
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"].astype(np.float16))
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.add_tensor("output.weight", sd["lm_head.weight"].astype(np.float16))
    hf_names = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj"}
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        w.add_tensor(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"])
        w.add_tensor(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        for ours, theirs in hf_names.items():
            t = sd[p + theirs + ".weight"]
            if ours in ("attn_q", "attn_k"):
                t = _permute(t, c.num_attention_heads if ours == "attn_q" else c.num_key_value_heads)
            w.add_tensor(f"blk.{i}.{ours}.weight", t.astype(np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    cfg, params = load_gguf(tmp_path / "m.gguf")
    assert cfg.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 8192)
    assert cfg.name == "tiny-llama-test" and not cfg.tie_word_embeddings and cfg.eos_token_ids == (2,)
    np.testing.assert_allclose(_our_logits(cfg, params, TOKENS), _hf_logits(model, TOKENS), atol=1e-4, rtol=0)


# --- the real model: SmolLM2-135M-Instruct Q4_1 ---------------------------------------------------

PROMPTS = ["What is the capital of France?",
           "Janet has nine oranges and Sharon has seven oranges. How many oranges do they have together?",
           "Write a haiku about the sea."]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def smollm2():
    ours = load_model(DEFAULT_MODEL)
    path = default_gguf_path()
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32).eval()
    return ours, theirs


def test_smollm2_config(smollm2):
    cfg = smollm2[0].config
    assert cfg.name == "smollm2-135m" and cfg.dtype == "float32" and cfg.tie_word_embeddings
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (30, 9, 3, 64)
    assert cfg.rms_norm_eps == 1e-5 and cfg.rope_theta == 100000.0
    assert cfg.bos_token_id == 1 and cfg.eos_token_ids == (2, 0) == smollm2[0].tokenizer.eos_token_ids


def test_smollm2_greedy_matches_transformers(smollm2):
    ours, theirs = smollm2
    tok = ours.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}])) for p in PROMPTS]
    graphdef, state = nnx.split(Llama(ours.config, params=ours.params))
    logits_fn = jax.jit(lambda state, ids: nnx.merge(graphdef, state).dense_logits(ids))
    # Right-padded to one width: causal attention makes a position's logits independent of what
    # follows, so one compiled shape serves every step.
    width = max(map(len, prompts)) + NEW_TOKENS
    seqs = [list(p) for p in prompts]
    for step in range(NEW_TOKENS + 1):
        batch = np.zeros((len(seqs), width), np.int32)
        for row, s in zip(batch, seqs):
            row[:len(s)] = s
        logits = np.asarray(logits_fn(state, jnp.asarray(batch)))
        if step < NEW_TOKENS:
            for b, s in enumerate(seqs):
                s.append(int(logits[b, len(s) - 1].argmax()))
    answers = [tok.decode(s[len(p):]) for s, p in zip(seqs, prompts)]
    assert "Paris" in answers[0], answers
    for b, (s, p) in enumerate(zip(seqs, prompts)):
        # Teacher-forced: transformers' argmax at every generated position is our token, i.e. its
        # greedy decoding (without stopping at eos) yields the same continuation.
        ref = _hf_logits(theirs, [s])[0]
        assert ref[len(p) - 1:-1].argmax(-1).tolist() == s[len(p):]
        np.testing.assert_allclose(logits[b, :len(s)], ref, atol=2e-3, rtol=0)


def test_convert_cli_orbax(tmp_path):
    dst = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), JAX_PLATFORMS="cpu")
    subprocess.run([sys.executable, "-m", "checkpoints.convert", "--src=tiny-llama", f"--dst={dst}",
                    "--format=orbax"], check=True, cwd=tmp_path, env=env, capture_output=True)
    back, ref = load_model(str(dst)), load_model("tiny-llama")
    assert back.config == ref.config
    for name, value in ref.params.items():
        np.testing.assert_array_equal(back.params[name], value, err_msg=name)
    assert back.tokenizer.encode("héllo") == ref.tokenizer.encode("héllo") == list("héllo".encode())


def test_load_model_resolution(hf_dir):
    cfg, params = load_hf_dir(hf_dir[0])
    loaded = load_model(hf_dir[0], dtype="bfloat16")
    assert loaded.config == cfg.replace(dtype="bfloat16")
    assert loaded.params["wq"].dtype == np.dtype("bfloat16")
    assert isinstance(loaded.tokenizer, Tokenizer) and loaded.tokenizer.vocab_size == 320
    preset = load_model("tiny-qwen2")
    again = load_model("tiny-qwen2")
    for name, value in preset.params.items():
        np.testing.assert_array_equal(again.params[name], value)  # seeded: deterministic
    with pytest.raises(ValueError, match="preset"):
        load_model("no-such-model")
