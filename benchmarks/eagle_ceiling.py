"""How far token trees can take an EAGLE head: the acceptance length of oracle trees, per domain.

  python benchmarks/eagle_ceiling.py [--eagle_head=NAME] [--domains=chat,code,math,creative,summarization]
      [--max_tokens=128] [--widths=1,2,4,8,16] [--depth=4]

The target writes greedy answers to each domain's held-out prompts (`training.data.split_prompts`, chat
template, no speculation). A dense pass of the target over prompt + answer gives its features, and the head
then runs `--depth` dense passes over them, as `training.eagle` evaluates it: pass 1 reads the target's
feature before each token, pass d + 1 the head's own pass-d prediction, which is what drafting depth d + 1
from a root d tokens earlier reads. Two tables per domain:

* coverage: how often the head's top-w tokens at pass d hold the target's greedy next token, over the
  answer tokens;
* oracle tree: the acceptance length (accepted drafts + the bonus token, per verify) of a tree that
  expands the head's top w tokens at every node down to `--depth` levels: w + w^2 + ... + w^depth
  nodes, far more than a verify window holds. No tree of that depth made from this head's rankings
  accepts more, so a target above this row needs a better head, not a bigger tree.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from absl import app, flags  # noqa: E402

from benchmarks.baselines import prompts_dir  # noqa: E402  (defines --prompts_dir)

FLAGS = flags.FLAGS
flags.DEFINE_string("eagle_head", None, "EAGLE head: a directory or a bundled name (default: the model's own).")
flags.DEFINE_list("domains", ["chat", "code", "math", "creative", "summarization"],
                  "Prompt domains of --prompts_dir (their held-out split).")
flags.DEFINE_integer("max_tokens", 128, "Greedy answer tokens per prompt.")
flags.DEFINE_list("widths", ["1", "2", "4", "8", "16"], "Tokens a tree expands per node (w).")
flags.DEFINE_integer("depth", 4, "Levels of the oracle trees (head passes).", lower_bound=1)
flags.register_validator("widths", lambda ws: all(w.isdigit() and int(w) > 0 for w in ws),
                         "--widths: positive integers")


def main(argv):
    del argv
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from checkpoints import load_model
    from checkpoints.draft import DEFAULT_EAGLE, load_draft
    from engine import LLM, SamplingParams
    from engine.spec.acceptance import oracle_tree_acceptance
    from model.eagle import EagleHead
    from model.llama import Llama
    from training.data import dense_hidden, dense_rows, split_prompts

    widths = [int(w) for w in FLAGS.widths]
    target = load_model()
    name = FLAGS.eagle_head or DEFAULT_EAGLE
    loaded = load_draft(name, target)
    target_def, target_state = nnx.split(Llama(target.config, params=target.params))
    head_def, head_state = nnx.split(EagleHead(loaded.config, loaded.params))  # as engine.step builds it
    W, D = max(widths), FLAGS.depth

    @jax.jit
    def hits(target_state, head_state, tokens):
        """bool `[D, L, W]`: pass d's top-w tokens at position i hold the target's greedy token after i."""
        head = nnx.merge(head_def, head_state)
        model = nnx.merge(target_def, target_state)
        f = dense_hidden(model, tokens[None])[0]
        want = jnp.argmax(model.logits(f), axis=-1)  # the target's own head, tied or not
        positions, attend = dense_rows(1, tokens.shape[0])
        prev, out = f, []
        for _ in range(D):
            prev = jnp.concatenate([jnp.zeros_like(prev[:1]), prev[:-1]])
            pred, _ = head(tokens, prev, positions, attend, None)
            top = head.top_k(pred, W)[1]
            out.append(jnp.cumsum(top == want[:, None], axis=1) > 0)
            prev = pred
        return jnp.stack(out)

    llm = LLM(target, speculative=None, max_num_seqs=8)
    rows = split_prompts(prompts_dir())
    print(f"# EAGLE head {name}: oracle trees ({time.strftime('%Y-%m-%d')}, {jax.devices()[0].device_kind}, "
          f"greedy, {FLAGS.max_tokens} tokens/answer, held-out prompts)\n")
    table = []
    for domain in FLAGS.domains:
        prompts = [llm.encode([{"role": "user", "content": r["prompt"]}])
                   for r in rows if r["domain"] == domain and r["split"] == "eval"]
        if not prompts:
            raise ValueError(f"no held-out prompts for domain {domain!r}")
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=FLAGS.max_tokens))
        per_seq = []
        for p, out in zip(prompts, outs):
            seq = p + list(out.token_ids)
            L = -(-len(seq) // 128) * 128  # few compiled shapes
            h = np.asarray(hits(target_state, head_state, jnp.asarray(seq + [0] * (L - len(seq)), jnp.int32)))
            per_seq.append(h[:, len(p):len(seq) - 1])  # roots: the answer's tokens but its last
        coverage = np.concatenate(per_seq, axis=1).mean(axis=1)  # [D, W]
        oracle = np.mean(np.concatenate([oracle_tree_acceptance(h) for h in per_seq]), axis=0)  # [W]
        table.append((domain, len(prompts), sum(h.shape[1] for h in per_seq), coverage, oracle))

    print("Coverage: the head's top-w tokens at depth d hold the target's token\n")
    print("| domain | prompts | roots | depth | " + " | ".join(f"top-{w}" for w in widths) + " |")
    print("|---|---:|---:|---:|" + "---:|" * len(widths))
    for domain, n, roots, coverage, _ in table:
        for d in range(D):
            print(f"| {domain} | {n} | {roots} | {d + 1} | " + " | ".join(f"{coverage[d, w - 1]:.3f}" for w in widths)
                  + " |")
    print(f"\nAcceptance length of oracle trees (top-w at every node, {D} levels)\n")
    print("| domain | " + " | ".join(f"w={w} ({sum(w ** (d + 1) for d in range(D))} nodes)" for w in widths) + " |")
    print("|---|" + "---:|" * len(widths))
    for domain, _, _, _, oracle in table:
        print(f"| {domain} | " + " | ".join(f"{oracle[w - 1]:.2f}" for w in widths) + " |")


if __name__ == "__main__":
    app.run(main)
