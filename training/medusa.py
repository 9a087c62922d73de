"""Trains Medusa heads (`model.medusa.MedusaHeads`) on the target's own features, for token-tree speculation.

  python -m training.distill --stage=generate --workdir=W     # the target's continuations (shared data)
  python -m training.eagle --stage=features --workdir=W       # its final hidden states at every position
  python -m training.medusa --workdir=W

Medusa-1 (Cai et al. 2024, §2.1: the target frozen) with self-distillation
(§2.3.2: the target's own continuations, and its distribution as the
label): head k reads the feature f_i (the target's final hidden state at
position i, which predicts x_{i+1}) and learns x_{i+1+k}, with the
cross-entropy from the target's distribution there, softmax(head(f_{i+k})),
restricted to the heads' `head_ids` and renormalised, weighted 0.8^(k-1) as in
the paper. Only positions whose label is a continuation token (the target's
own output, not the user's prompt) are trained on. Each head's W starts at
zero, so each starts as the target's own next-token guess.

On the held-out sequences it measures `medusa_accuracy[k, r]`, how often head
k's rank-r candidate is the token the target produced, which sets the static
tree (`model.medusa.medusa_tree`), and saves the heads with
`checkpoints.draft.save_medusa`.
"""

from __future__ import annotations

import dataclasses
import os
import time

import numpy as np
from absl import app, flags, logging

from training.data import read_continuations

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAGS = flags.FLAGS
flags.DEFINE_string("workdir", os.path.expanduser("~/.cache/jax-spec-engine/distill"),
                    "Work directory (continuations.jsonl and the features from `training.eagle --stage=features`).")
flags.DEFINE_string("out", os.path.join(_ROOT, "checkpoints", "drafts", "smollm2-135m-medusa"),
                    "Where the trained heads are written.")
flags.DEFINE_integer("num_heads", 3, "Medusa heads (head k guesses the token k + 1 ahead).")
flags.DEFINE_integer("candidates", 4, "Top candidates per head whose accuracy is measured (the tree's width).")
flags.DEFINE_integer("head_vocab", 8192, "Tokens the heads can guess: the most frequent in the training sequences.")
flags.DEFINE_integer("epochs", 3, "Passes over the training positions.")
flags.DEFINE_float("lr", 1e-3, "Peak AdamW learning rate (warmup, then cosine decay to 5%).")
flags.DEFINE_integer("batch", 1024, "Positions per step.")
flags.DEFINE_integer("max_len", 1024, "Sequences are cut to this many tokens (as the features stage cut them).")
flags.DEFINE_integer("seed", 0, "Shuffling seed.")
flags.DEFINE_integer("log_every", 20, "Training steps between log lines.")


@dataclasses.dataclass(frozen=True)
class MedusaConfig:
    """The train stage's settings (the flags of the same names)."""

    out: str
    num_heads: int = 3
    candidates: int = 4
    head_vocab: int = 8192
    epochs: int = 3
    lr: float = 1e-3
    batch: int = 1024
    max_len: int = 1024
    seed: int = 0
    log_every: int = 20


def label_positions(lengths: np.ndarray, prompt_lengths: np.ndarray, num_heads: int) -> np.ndarray:
    """int64 `[N]`: the flat index i of every feature whose labels x_{i+1+k}, k = 1..num_heads, all lie in
    the same sequence's continuation (position >= its prompt length), for sequences of `lengths` tokens laid
    end to end."""
    out, offset = [], 0
    for n, p in zip(lengths, prompt_lengths):
        first = max(p - 2, 0)  # i + 2 >= p: head 1's label is a continuation token
        last = n - 2 - num_heads  # i + 1 + num_heads <= n - 1
        if last >= first:
            out.append(offset + np.arange(first, last + 1))
        offset += n
    return np.concatenate(out) if out else np.zeros(0, np.int64)


def _load(workdir: str, split: str, max_len: int):
    seqs = np.load(os.path.join(workdir, f"feature_seqs_{split}.npz"))
    lengths = seqs["lengths"]
    rows = read_continuations(workdir, split)  # the features stage's order
    prompts = np.array([min(len(r["prompt_ids"]), max_len) for r in rows])
    if len(prompts) != len(lengths):
        raise ValueError(f"{split}: {len(lengths)} feature sequences but {len(prompts)} continuations")
    feats = np.load(os.path.join(workdir, f"features_{split}.npy"), mmap_mode="r")
    return seqs["tokens"], lengths, prompts, feats


def train(workdir: str, config: MedusaConfig) -> None:
    import jax
    import jax.numpy as jnp
    import optax

    from checkpoints import load_model
    from checkpoints.draft import save_medusa
    from model import medusa

    K = config.num_heads
    tokens, lengths, prompts, feats = _load(workdir, "train", config.max_len)
    ev_tokens, ev_lengths, ev_prompts, ev_feats = _load(workdir, "eval", config.max_len)
    target = load_model()
    E = target.config.hidden_size
    counts = np.bincount(tokens, minlength=target.config.vocab_size)
    head_ids = np.sort(np.lexsort((np.arange(len(counts)), -counts))[:config.head_vocab]).astype(np.int32)
    rows = jnp.asarray(np.asarray(medusa.target_readout(target.config, target.params), np.float32)[head_ids])
    where = label_positions(lengths, prompts, K)
    ev_where = label_positions(ev_lengths, ev_prompts, K)
    logging.info("train: %d positions (%d sequences); eval %d; the heads' %d tokens cover %.3f of eval labels",
                 len(where), len(lengths), len(ev_where), config.head_vocab,
                 float(np.isin(ev_tokens[ev_where + 2], head_ids).mean()))
    feats_all = np.asarray(feats, np.float32)  # [N, E]; the train split fits in memory at this size
    weights = jnp.asarray(0.8 ** np.arange(K), jnp.float32)

    def loss_fn(params, f, teacher):
        """f `[n, E]` features f_i; teacher `[n, K, E]` features f_{i+k} (k = 1..K) whose distribution is the
        label of head k."""
        logits = medusa.medusa_logits(params["w"], params["b"], rows, f)  # [n, K, Vh]
        q = jax.nn.softmax(teacher @ rows.T, axis=-1)
        ce = -jnp.sum(q * jax.nn.log_softmax(logits, axis=-1), axis=-1).mean(0)  # [K]
        agree = (jnp.argmax(logits, -1) == jnp.argmax(q, -1)).mean(0)
        return jnp.sum(weights * ce), {"ce": ce, "top1": agree}

    params = {"w": jnp.zeros((K, E, E), jnp.float32), "b": jnp.zeros((K, E), jnp.float32)}
    per_epoch = -(-len(where) // config.batch)
    total = config.epochs * per_epoch
    schedule = optax.warmup_cosine_decay_schedule(0.0, config.lr, min(50, total // 10), total, config.lr * 0.05)
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, b2=0.95, weight_decay=0.0))
    opt_state = opt.init(params)

    @jax.jit
    def train_step(params, opt_state, f, teacher):
        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, f, teacher)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, {"loss": loss, **metrics}

    @jax.jit
    def ranks(params, f):
        return jax.lax.top_k(medusa.medusa_logits(params["w"], params["b"], rows, f), config.candidates)[1]

    def accuracy(params) -> np.ndarray:
        """[K, candidates]: how often head k's rank-r candidate is the target's own token x_{i+1+k}."""
        hits = np.zeros((K, config.candidates))
        for s in range(0, len(ev_where), 4096):
            idx = ev_where[s:s + 4096]
            cand = head_ids[np.asarray(ranks(params, jnp.asarray(np.asarray(ev_feats[idx], np.float32))))]
            labels = ev_tokens[idx[:, None] + 2 + np.arange(K)[None, :]]  # [n, K]
            hits += (cand == labels[:, :, None]).sum(0)
        return hits / max(len(ev_where), 1)

    offsets = np.arange(1, K + 1)
    rng = np.random.default_rng(config.seed)
    step, t0, history = 0, time.perf_counter(), []
    for epoch in range(config.epochs):
        order = rng.permutation(where)
        for s in range(0, len(order), config.batch):
            idx = order[s:s + config.batch]
            f, teacher = feats_all[idx], feats_all[idx[:, None] + offsets[None, :]]
            params, opt_state, metrics = train_step(params, opt_state, f, teacher)
            step += 1
            if step % config.log_every == 0 or step == total:
                logging.info("train: epoch %d step %d/%d loss %.3f top-1 agreement %s (%.0f s)", epoch, step, total,
                             float(metrics["loss"]), np.round(np.asarray(metrics["top1"]), 3),
                             time.perf_counter() - t0)
        acc = accuracy(params)
        history.append({"epoch": epoch, "steps": step, "eval_accuracy": np.round(acc, 4).tolist()})
        logging.info("train: epoch %d eval accuracy per head and rank\n%s (%.0f s)", epoch, np.round(acc, 3),
                     time.perf_counter() - t0)
    command = "python -m training.medusa " + " ".join(
        f"--{k}={v}" for k, v in dataclasses.asdict(config).items() if k != "out")
    save_medusa(config.out, {medusa.W: np.asarray(params["w"]), medusa.B: np.asarray(params["b"]),
                             medusa.ACCURACY: acc.astype(np.float32), medusa.HEAD_IDS: head_ids},
                target_name="smollm2-135m-instruct",
                extra={"training": {"command": command, "positions": int(len(where)), "sequences": int(len(lengths)),
                                    "epochs": history}})
    logging.info("train: saved %s", config.out)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    logging.set_verbosity(logging.INFO)
    config = MedusaConfig(**{f.name: FLAGS[f.name].value for f in dataclasses.fields(MedusaConfig)})
    train(FLAGS.workdir, config)


if __name__ == "__main__":
    app.run(main)
