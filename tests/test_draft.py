"""Draft models: the stored format (projected or shared embedding, partial output head) and the
offline acceptance simulation used to evaluate drafts."""

import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from checkpoints import load_model
from checkpoints.draft import DRAFTS_DIR, draft_names, draft_path, load_draft, save_draft
from checkpoints.resolve import random_params
from training.distill import simulate_greedy
from model.config import ModelConfig
from model.llama import LAYER_PARAMS, Llama

TINY_DRAFT = ModelConfig(name="tiny-draft", vocab_size=256, hidden_size=32, intermediate_size=64, num_layers=1,
                         num_heads=2, num_kv_heads=1, head_dim=16, tie_word_embeddings=True, eos_token_ids=(2,))


def _bf16(x):
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def test_projected_draft_round_trip(tmp_path):
    target = load_model("tiny-llama")
    params = random_params(TINY_DRAFT, seed=3)
    projection = np.random.default_rng(0).normal(0, 0.1, (target.config.hidden_size, 32)).astype(np.float32)
    save_draft(tmp_path, TINY_DRAFT, params, projection, target_name="tiny-llama")
    draft = load_draft(str(tmp_path), target)
    assert draft.config.hidden_size == 32 and draft.config.vocab_size == 256
    assert draft.tokenizer is target.tokenizer
    assert draft.config.eos_token_ids == target.config.eos_token_ids
    for name, value in params.items():
        if name != "embed":
            np.testing.assert_array_equal(draft.params[name], _bf16(value))
    np.testing.assert_allclose(draft.params["embed"], target.params["embed"] @ _bf16(projection), rtol=1e-5,
                               atol=1e-6)
    logits = Llama(draft.config, params=draft.params).dense_logits(jnp.asarray([[1, 5, 9]]))
    assert logits.shape == (1, 3, 256)


def test_same_width_draft_with_partial_head(tmp_path):
    """Target layers 0 and 1 as a draft: the target's own embedding, logits only for 40 token ids."""
    target = load_model("tiny-llama")
    cfg = target.config.replace(name="layers-0-1", num_layers=2, head_vocab_size=40, tie_word_embeddings=True)
    params = {k: (v[:2] if k in LAYER_PARAMS else v) for k, v in target.params.items() if k != "lm_head"}
    head_ids = np.random.default_rng(1).choice(target.config.vocab_size, 40, replace=False)
    save_draft(tmp_path, cfg, {**params, "head_ids": head_ids}, None, target_name="tiny-llama")
    draft = load_draft(str(tmp_path), target)
    assert draft.config.head_vocab_size == 40 and draft.config.num_layers == 2
    np.testing.assert_array_equal(draft.params["embed"], target.params["embed"])
    np.testing.assert_array_equal(draft.params["head_ids"], head_ids)
    tokens = jnp.asarray([[1, 5, 9, 17]])
    got = np.asarray(Llama(draft.config, params=draft.params).dense_logits(tokens))
    whole_head = {k: v for k, v in draft.params.items() if k != "head_ids"}
    full = np.asarray(Llama(cfg.replace(head_vocab_size=0), params=whole_head).dense_logits(tokens))
    np.testing.assert_allclose(got[..., head_ids], full[..., head_ids], rtol=1e-5, atol=1e-5)
    outside = np.setdiff1d(np.arange(cfg.vocab_size), head_ids)
    assert np.all(got[..., outside] == -1e30)
    assert np.all(np.asarray(jax.nn.softmax(got, -1))[..., outside] == 0)


def test_a_bf16_checkpoint_sets_the_kernels_dtype(tmp_path):
    """A draft stored in bf16 and computed in fp32 (the bundled heads) packs bf16 kernel weights by default:
    exactly its stored values, in half the bytes; fp32 storage keeps fp32."""
    import cpu_kernels
    from engine.config import EngineConfig
    from engine.step import build_model

    target = load_model("tiny-llama")
    params = random_params(TINY_DRAFT, seed=3)
    projection = np.random.default_rng(0).normal(0, 0.1, (target.config.hidden_size, 32)).astype(np.float32)
    packed = {}
    for storage in ("bfloat16", "float32"):
        save_draft(tmp_path / storage, TINY_DRAFT, params, projection, "tiny-llama", storage_dtype=storage)
        draft = load_draft(str(tmp_path / storage), target)
        assert draft.config.dtype == "float32"
        assert draft.stored_dtype == ("bfloat16" if storage == "bfloat16" else None)
        packed[storage] = build_model(draft, EngineConfig())[2]
    assert cpu_kernels.available()
    assert packed["bfloat16"] * 2 == packed["float32"] > 0


def test_draft_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no draft"):
        load_draft(str(tmp_path / "missing"), load_model("tiny-llama"))
    save_draft(tmp_path, TINY_DRAFT, random_params(TINY_DRAFT), np.zeros((64, 32), np.float32), "tiny-llama")
    with pytest.raises(ValueError, match="hidden size 64"):
        load_draft(str(tmp_path), load_model("tiny-qwen2"))  # E_t = 48
    cfg = TINY_DRAFT.replace(head_vocab_size=4)
    with pytest.raises(ValueError, match="head_ids: need 4 distinct token ids below 256"):
        Llama(cfg, params={**random_params(TINY_DRAFT), "head_ids": np.array([1, 1, 2, 3])})


def test_draft_path_resolves_bundled_names_before_directories():
    assert "smollm2-135m-eagle" in draft_names()
    assert draft_path("smollm2-135m-eagle") == os.path.join(DRAFTS_DIR, "smollm2-135m-eagle")
    assert draft_path("~/heads/mine") == os.path.join(os.path.expanduser("~"), "heads", "mine")


def test_simulated_speculation_counts():
    assert simulate_greedy([True] * 10, 4) == (8, 8, 2)  # 5 tokens per step: 4 drafts + 1 bonus
    # Nothing matches: one target step per token; the last step has no room for drafts.
    assert simulate_greedy([False] * 10, 4) == (0, 4 * 6 + 3 + 2 + 1, 10)
    # Round 1 accepts 2 then the target corrects; round 2 accepts all 3 proposed (one left to emit).
    assert simulate_greedy([True, True, False, True, True, True, True], 3) == (5, 6, 2)




@pytest.mark.parametrize("cfg", [load_model("tiny-llama").config, load_model("tiny-qwen2").config,
                                 TINY_DRAFT.replace(head_vocab_size=40, tie_word_embeddings=False)],
                         ids=["llama", "qwen2-bias", "untied-partial-head"])
def test_to_params_inverts_the_fused_layout(cfg):
    params = random_params(cfg, seed=5)
    if cfg.head_vocab_size:
        params["head_ids"] = np.arange(0, 2 * cfg.head_vocab_size, 2, dtype=np.int32)
    back = Llama(cfg, params=params).to_params()
    assert sorted(back) == sorted(params)
    for name, value in params.items():
        np.testing.assert_array_equal(back[name], value, err_msg=name)


def test_synthetic_chat_prompts_are_distinct_finished_user_turns(tmp_path):
    """`synthesize_chat_prompts` samples from the template's start of a user turn, keeps turns the target
    ended itself, once each, up to n; a finished file is kept, and its rows join the train split."""
    import json

    from training.data import split_prompts, synthesize_chat_prompts

    class Out:
        def __init__(self, ids, reason):
            self.token_ids, self.finish_reason = ids, reason

    class FakeLLM:
        """Chat template: [9, 9, <user>, *content, 8]; the 'target' writes turn `seed % 5` (turn 4 is cut)."""
        tokenizer = type("T", (), {"decode": staticmethod(lambda ids: "".join(map(chr, ids)))})()

        def __init__(self):
            self.prompts = []

        def encode(self, prompt):
            return [9, 9, 7] + [ord(c) for c in prompt[0]["content"]] + [8]

        def generate(self, prompts, params):
            self.prompts += prompts
            return [Out([ord(c) for c in f" turn {p.seed % 5} "], "length" if p.seed % 5 == 4 else "stop")
                    for p in params]

    llm, path = FakeLLM(), str(tmp_path / "synthetic.jsonl")
    synthesize_chat_prompts(llm, path, n=3, batch=8)
    rows = [json.loads(line) for line in open(path)]
    assert [r["id"] for r in rows] == ["magpie-0", "magpie-1", "magpie-2"]
    assert len({r["prompt"] for r in rows}) == 3 and all(r["prompt"] in {"turn 0", "turn 1", "turn 2", "turn 3"}
                                                          for r in rows)
    assert llm.prompts and all(p == [9, 9, 7] for p in llm.prompts)
    synthesize_chat_prompts(llm, path, n=3, batch=8)  # already made: no new samples
    assert len(llm.prompts) == 8
    with pytest.raises(RuntimeError, match="4 distinct"):  # a round that adds none ends it
        synthesize_chat_prompts(FakeLLM(), str(tmp_path / "more.jsonl"), n=5, batch=8)

    prompts_dir = tmp_path / "prompts"
    prompts_dir.mkdir()
    for domain in ("chat", "code", "creative", "math", "summarization"):
        (prompts_dir / f"{domain}.jsonl").write_text(json.dumps({"id": f"{domain}-0", "prompt": "hi"}) + "\n")
    split = split_prompts(str(prompts_dir), path)
    assert [(r["domain"], r["split"]) for r in split[-3:]] == [("synthetic_chat", "train")] * 3
