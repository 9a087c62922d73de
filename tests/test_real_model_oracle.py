"""SmolLM2-135M-Instruct through the engine's default path (paged KV pool, chunked prefill across block and chunk
edges, a prefix-cache hit, each CPU kernel family this machine runs, bf16 kernel weights, the native and the
reference attention) against transformers' float32 forward of the same GGUF: per-token logprobs of generation and
of `LLM.score`, and greedy tokens.

Tolerance, from the dtype of the products' inputs: `4096 * u`, u the unit roundoff (float32: 2**-24, so 2.4e-4
in a logprob; AMX splits activations and weights into bf16 hi + lo parts, about 16 significant bits: 2**-17,
3.1e-2). Measured on a 2-core AMD EPYC (AVX-512, no AMX): at most 6.3e-5 over the xla, avx2 and avx512 families
and the reference attention. Kernel weights in bfloat16 are compared with transformers' forward over the same
bf16-rounded weights (round to nearest even, as `cpu_kernels.pack` rounds) in float32 arithmetic, so they take
the float32 tolerance too; against the float32 weights they differ by up to 8e-2. Greedy tokens must equal
transformers' argmax wherever its top-2 margin exceeds twice the tolerance (near-ties may go either way).
"""

import os

import numpy as np
import pytest

from engine import LLM, SamplingParams, kernels
from tests.prompts import chat_messages, prompts

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

BLOCK_SIZE = 16
BUDGET = 40  # chunks of 40 tokens end inside a 16-token block
NEW_TOKENS = 64
TOP = 5


def _tolerance(family: str) -> float:
    return 4096 * (2.0 ** -17 if family == "amx" else 2.0 ** -24)


@pytest.fixture(scope="module")
def hf():
    from checkpoints import default_gguf_path

    path = default_gguf_path()
    return transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32).eval()


def _bf16_weights(hf):
    """A copy of `hf` whose projections and output head are rounded to bfloat16 (the embedding lookup is not:
    the engine keeps a tied embedding's own values for it)."""
    import copy

    model = copy.deepcopy(hf)
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and name != "lm_head":
                module.weight.copy_(module.weight.to(torch.bfloat16).float())
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().to(torch.bfloat16).float())
    return model


def _log_softmax(model, ids: list[int]) -> np.ndarray:
    """float64 `[len(ids), V]` log-softmax of `model`'s logits at every position."""
    with torch.no_grad():
        x = model(torch.as_tensor([ids])).logits[0].double().numpy()
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def _decided(rows: np.ndarray, tol: float) -> np.ndarray:
    """bool `[n]`: rows whose argmax leads the runner-up by more than 2 * tol."""
    top2 = -np.sort(-rows, axis=-1)[:, :2]
    return top2[:, 0] - top2[:, 1] > 2 * tol


def _check_generated(out, ref: np.ndarray, tol: float) -> None:
    """`out`'s tokens and logprobs against the oracle's log-softmax rows `ref` over its prompt + output."""
    n = len(out.prompt_token_ids)
    assert len(out.token_ids) == NEW_TOKENS and len(out.logprobs) == NEW_TOKENS
    rows = ref[n - 1:n - 1 + NEW_TOKENS]
    decided = _decided(rows, tol)
    assert decided.mean() > 0.9  # the greedy check below covers most positions
    np.testing.assert_array_equal(np.asarray(out.token_ids)[decided], rows.argmax(-1)[decided])
    for i, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        top = np.argsort(-rows[i])[:TOP]
        assert len(entry) in (TOP, TOP + 1) and token in entry
        ids = list(entry)
        np.testing.assert_allclose([entry[t] for t in ids], rows[i, ids], atol=tol, rtol=0)
        assert set(ids[:TOP]) == set(top.tolist()) or rows[i, top[TOP - 1]] - rows[i, top[TOP]] <= 2 * tol


# (kernel family, kernel weights' dtype, attention): "auto" attention is the native kernel for steps of up to
# 512 tokens, the jnp reference above; "reference" runs the reference on every step.
ENGINES = ([(family, "float32", "auto") for family in kernels.FAMILIES]
           + [(kernels.isa_default("bfloat16"), "bfloat16", "auto"), (kernels.isa_default(), "float32", "reference")])


@pytest.mark.parametrize("family,kernel_dtype,attention", ENGINES, ids=["-".join(e) for e in ENGINES])
def test_logprobs_and_greedy_tokens_equal_transformers(hf, family, kernel_dtype, attention):
    if family not in kernels.families(kernel_dtype):
        pytest.skip(f"this CPU does not run the {family} kernels")
    tol = _tolerance(family)
    oracle = _bf16_weights(hf) if kernel_dtype == "bfloat16" else hf
    llm = LLM(speculative=None, matmul=family, kernel_dtype=kernel_dtype, attention=attention, block_size=BLOCK_SIZE,
              num_blocks=64, max_num_seqs=4, max_num_batched_tokens=BUDGET)
    assert llm.engine.kernel_choice.family == family
    texts = [prompts("summarization")[0], chat_messages(1)[0], prompts("code")[0]]
    sp = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=TOP)
    outs = llm.generate(texts, sp)
    assert len(outs[0].prompt_token_ids) > BUDGET + BLOCK_SIZE  # prefill in chunks, across blocks
    refs = [_log_softmax(oracle, o.prompt_token_ids + o.token_ids) for o in outs]
    for out, ref in zip(outs, refs):
        _check_generated(out, ref, tol)

    again = llm.generate(texts[:1], sp)[0]  # the prompt's full blocks from the prefix cache
    assert again.num_cached_tokens == (len(again.prompt_token_ids) - 1) // BLOCK_SIZE * BLOCK_SIZE > 0
    _check_generated(again, _log_softmax(oracle, again.prompt_token_ids + again.token_ids), tol)

    for out, ref, score in zip(outs, refs, llm.score([o.prompt_token_ids + o.token_ids for o in outs])):
        ids = np.asarray(score.token_ids)
        n = len(ids) - 1
        assert len(score.token_logprobs) == len(score.top_logprobs) == len(score.top_token_ids) == n
        rows = ref[:n]
        np.testing.assert_allclose(score.token_logprobs, rows[np.arange(n), ids[1:]], atol=tol, rtol=0)
        np.testing.assert_allclose(score.top_logprobs, rows.max(-1), atol=tol, rtol=0)
        decided = _decided(rows, tol)
        np.testing.assert_array_equal(np.asarray(score.top_token_ids)[decided], rows.argmax(-1)[decided])
