"""Trains an EAGLE head (`model.eagle.EagleHead`) on the target's own features, for speculative decoding.

  python -m training.distill --stage=generate --workdir=W     # the target's continuations (shared data)
  python -m training.eagle --stage=all --workdir=W

Stages (each reads the previous one's files in `--workdir`):
  features  a dense forward of the target over every train-split sequence
            (prompt + the target's own continuation, `continuations.jsonl`)
            keeps its final hidden state at every position; -> `features.npy`
            (float16 `[N, E]`) and `feature_seqs.npz` (tokens, sequence lengths)
  train     fits the head, teacher-forced on the target's features: at position
            i its input is (f_{i-1} + noise, x_i) and its output f-hat_i, with a
            smooth-L1 loss to f_i plus `--token_weight` times the cross-entropy
            from the target's distribution softmax(head(f_i)) to the head's
            softmax(head(f-hat_i)), both over the partial head's tokens (Li et al.
            2024, EAGLE §4.3, where the weight is 0.1 and the noise uniform).
            With `--unroll=2` a second pass feeds the head its own predictions
            (f-hat_{i-1}, x_i) and adds the same losses, and each further pass
            reads the one before: drafting past the first token reads predicted
            features, and a head trained on the target's alone accepts almost
            nothing there (a simplified form of EAGLE-3's training-time test,
            Li et al. 2025 §3); -> `--out`, a draft directory
            (`checkpoints.draft.save_draft`)

The head's layers (`--num_layers`) start as copies of the target's last ones,
`fc` as [0.5 I; 0.5 I]; the embedding and the LM head rows are the target's,
frozen. `--init_from` continues a saved head at its own depth, or deepened by
`model.eagle.deepen` when `--num_layers` asks for more layers than it has.
The held-out prompts (`training.data.split_prompts`) are never trained on;
`benchmarks/speculative.py --proposers=eagle` measures the head on them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

import numpy as np
from absl import app, flags, logging

from training.data import batches, dense_hidden, dense_rows, read_continuations

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAGS = flags.FLAGS
flags.DEFINE_enum("stage", "all", ["features", "train", "all"], "What to run.")
flags.DEFINE_string("workdir", os.path.expanduser("~/.cache/jax-spec-engine/distill"),
                    "Work directory (continuations.jsonl from `training.distill --stage=generate`).")
flags.DEFINE_string("out", os.path.join(_ROOT, "checkpoints", "drafts", "smollm2-135m-eagle"),
                    "Where the trained head is written.")
flags.DEFINE_integer("head_vocab", 8192, "Tokens the head's output covers: the most frequent in the training "
                     "sequences (the others get probability 0).")
flags.DEFINE_integer("num_layers", None, lower_bound=1,
                     help="Decoder layers of the head (default: 1, or an --init_from head's own). An --init_from "
                     "head with fewer gets layers appended whose output projections start at zero, so training "
                     "starts from the loaded head.")
flags.DEFINE_integer("epochs", 3, "Passes over the training sequences.")
flags.DEFINE_float("lr", 1e-3, "Peak AdamW learning rate (warmup, then cosine decay to 5%).")
flags.DEFINE_float("weight_decay", 0.0, "AdamW weight decay.")
flags.DEFINE_float("token_weight", 0.1, "Weight of the token (cross-entropy) loss next to the feature loss.")
flags.DEFINE_float("noise", 0.2, "Input features get uniform noise of +- this times their RMS.")
flags.DEFINE_integer("tokens_per_batch", 2048, "Padded tokens per batch.")
flags.DEFINE_integer("unroll", 2, lower_bound=1,
                     help="Passes per batch: 1 teacher-forced only; each further pass reads the previous pass's "
                     "predicted features, as drafting token 2, 3, ... does.")
flags.DEFINE_integer("max_len", 1024, "Sequences are cut to this many tokens.")
flags.DEFINE_string("init_from", None, "A saved head (directory or bundled name) to continue training from, "
                    "keeping its `head_ids`; else the head starts from the target's last layer.")
flags.DEFINE_integer("seed", 0, "Noise and shuffling seed.")
flags.DEFINE_integer("log_every", 20, "Training steps between log lines.")


@dataclasses.dataclass(frozen=True)
class EagleConfig:
    """The train stage's settings (the flags of the same names)."""

    out: str
    head_vocab: int = 8192
    num_layers: int | None = None  # None: 1, or the --init_from head's own
    epochs: int = 3
    lr: float = 1e-3
    weight_decay: float = 0.0
    token_weight: float = 0.1
    noise: float = 0.2
    tokens_per_batch: int = 2048
    unroll: int = 2
    max_len: int = 1024
    init_from: str | None = None
    seed: int = 0
    log_every: int = 20


def _sequences(workdir: str, split: str, max_len: int) -> list[list[int]]:
    return [(r["prompt_ids"] + r["output_ids"])[:max_len] for r in read_continuations(workdir, split)]


def _pad(seqs: list[list[int]], Lq: int, S: int) -> np.ndarray:
    tokens = np.zeros((S, Lq), np.int32)
    for r, s in enumerate(seqs):
        tokens[r, :len(s)] = s
    return tokens


def compute_features(workdir: str, config: EagleConfig) -> None:
    """The target's final hidden states at every position of every train and eval sequence."""
    import jax
    from flax import nnx

    from checkpoints import load_model
    from model.llama import Llama

    target = load_model()
    graphdef, state = nnx.split(Llama(target.config, params=target.params))
    hidden_fn = jax.jit(lambda state, tokens: dense_hidden(nnx.merge(graphdef, state), tokens))
    for split in ("train", "eval"):
        seqs = _sequences(workdir, split, config.max_len)
        lengths = np.array([len(s) for s in seqs], np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        out = np.lib.format.open_memmap(os.path.join(workdir, f"features_{split}.npy"), mode="w+",
                                        dtype=np.float16, shape=(int(offsets[-1]), target.config.hidden_size))
        t0, done = time.perf_counter(), 0
        for Lq, idx in batches(lengths.tolist(), config.tokens_per_batch):
            S = max(1, config.tokens_per_batch // Lq)
            h = np.asarray(hidden_fn(state, _pad([seqs[i] for i in idx], Lq, S)), np.float32)
            for r, i in enumerate(idx):
                out[offsets[i]:offsets[i + 1]] = h[r, :lengths[i]]
            done += len(idx)
            logging.info("features %s: %d/%d sequences, %.0f s", split, done, len(seqs), time.perf_counter() - t0)
        out.flush()
        np.savez(os.path.join(workdir, f"feature_seqs_{split}.npz"), tokens=np.concatenate(seqs).astype(np.int32),
                 lengths=lengths)


def init_head(target, head_vocab: int, token_counts: np.ndarray, name: str, num_layers: int = 1):
    """The head's start: the target's last `num_layers` layers and final norm, `fc` = [0.5 I; 0.5 I], an output
    head over the `head_vocab` most frequent tokens of `token_counts` (int `[V]`; ties by id). Returns (cfg, params)."""
    from checkpoints.draft import early_exit_draft
    from model.eagle import FC

    n = target.config.num_layers
    base = early_exit_draft(target, list(range(n - num_layers, n)), name=name)
    E = target.config.hidden_size
    params = dict(base.params)
    params[FC] = np.concatenate([0.5 * np.eye(E), 0.5 * np.eye(E)]).astype(np.float32)
    order = np.lexsort((np.arange(len(token_counts)), -token_counts))
    params["head_ids"] = np.sort(order[:head_vocab]).astype(np.int32)
    return base.config.replace(head_vocab_size=head_vocab), params


def train(workdir: str, config: EagleConfig) -> None:
    """Fits the head on `features_train.npy`; reports teacher-forced top-1 agreement on the eval split;
    saves to `config.out`."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from checkpoints import load_model
    from checkpoints.draft import draft_path, load_draft, save_draft
    from model.eagle import FC, EagleHead, deepen

    def load(split):
        seqs = np.load(os.path.join(workdir, f"feature_seqs_{split}.npz"))
        lengths = seqs["lengths"]
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        return seqs["tokens"], lengths, offsets, np.load(os.path.join(workdir, f"features_{split}.npy"), mmap_mode="r")

    tokens_all, lengths, offsets, feats = load("train")
    ev_tokens, ev_lengths, ev_offsets, ev_feats = load("eval")
    target = load_model()
    E = target.config.hidden_size
    counts = np.bincount(tokens_all, minlength=target.config.vocab_size)
    if config.init_from:
        loaded = load_draft(config.init_from, target)
        if FC not in loaded.params:
            raise ValueError(f"{config.init_from} is not an EAGLE head")
        cfg, init = loaded.config, {k: np.asarray(v, np.int32 if k == "head_ids" else np.float32)
                                    for k, v in loaded.params.items()}
        with open(os.path.join(draft_path(config.init_from), "config.json")) as f:
            parent_training = json.load(f)["draft"].get("training")
        cfg, init = deepen(cfg, init, target, cfg.num_layers if config.num_layers is None else config.num_layers)
    else:
        cfg, init = init_head(target, config.head_vocab, counts, os.path.basename(os.path.normpath(config.out)),
                              1 if config.num_layers is None else config.num_layers)
    ev_cover = float(np.isin(ev_tokens, init["head_ids"]).mean())
    logging.info("train: %d sequences, %d tokens; the head's %d tokens cover %.3f of the eval tokens",
                 len(lengths), len(tokens_all), len(init["head_ids"]), ev_cover)
    head_rows = jnp.asarray(np.asarray(target.params["embed"], np.float32)[init["head_ids"]])  # [N, E], frozen
    graphdef, embed_state, params, rest = nnx.split(EagleHead(cfg, init), nnx.PathContains("embed"), nnx.Param, ...)
    fixed_embed = jnp.asarray(target.params["embed"], jnp.float32)

    def merged(params):
        return nnx.merge(graphdef, jax.tree.map(lambda _: fixed_embed, embed_state), params, rest)

    def predict(params, tokens, prev):
        """Dense causal head over right-padded rows: tokens `[S, Lq]`, prev features `[S, Lq, E]`."""
        S, Lq = tokens.shape
        positions, attend = dense_rows(S, Lq)
        out, _ = merged(params)(tokens.reshape(-1), prev.reshape(-1, E), positions, attend, None)
        return out.reshape(S, Lq, E)

    def loss_fn(params, tokens, feats, valid, key, noise):
        # Input at i: (f_{i-1} + noise, x_i); target f_i. Position 0 has no f_{-1} (zeros, as in the engine).
        prev = jnp.concatenate([jnp.zeros_like(feats[:, :1]), feats[:, :-1]], axis=1)
        rms = jnp.sqrt(jnp.mean(prev * prev, axis=-1, keepdims=True))
        prev = prev + noise * rms * jax.random.uniform(key, prev.shape, minval=-1.0, maxval=1.0)
        w = valid.astype(jnp.float32)
        n = jnp.maximum(w.sum(), 1.0)
        logq = jax.nn.log_softmax(feats @ head_rows.T, axis=-1)  # the target's next-token distribution
        loss, metrics = 0.0, {}
        for u in range(config.unroll):
            pred = predict(params, tokens, prev)
            feat_loss = jnp.sum(w * jnp.mean(optax.huber_loss(pred, feats), axis=-1)) / n
            logp = jax.nn.log_softmax(pred @ head_rows.T, axis=-1)
            token_loss = jnp.sum(w * -jnp.sum(jnp.exp(logq) * logp, axis=-1)) / n
            agree = jnp.sum(w * (jnp.argmax(logp, -1) == jnp.argmax(logq, -1))) / n
            loss = loss + feat_loss + config.token_weight * token_loss
            tag = "" if u == 0 else str(u + 1)
            metrics.update({f"feat{tag}": feat_loss, f"token{tag}": token_loss, f"top1{tag}": agree})
            # The next pass reads this one's predictions, as drafting does after its first token.
            prev = jnp.concatenate([jnp.zeros_like(pred[:, :1]), jax.lax.stop_gradient(pred[:, :-1])], axis=1)
        return loss, metrics

    def batch_arrays(tokens_src, lengths_, offsets_, feats_src, idx, Lq, S):
        tokens = np.zeros((S, Lq), np.int32)
        f = np.zeros((S, Lq, E), np.float32)
        valid = np.zeros((S, Lq), bool)
        for r, i in enumerate(idx):
            n = int(lengths_[i])
            tokens[r, :n] = tokens_src[offsets_[i]:offsets_[i + 1]]
            f[r, :n] = feats_src[offsets_[i]:offsets_[i + 1]]
            valid[r, 1:n] = True  # position 0's input has no feature
        return tokens, f, valid

    per_epoch = len(batches(lengths.tolist(), config.tokens_per_batch))
    total = config.epochs * per_epoch
    schedule = optax.warmup_cosine_decay_schedule(0.0, config.lr, min(50, total // 10), total, config.lr * 0.05)
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, b2=0.95, weight_decay=config.weight_decay))
    opt_state = opt.init(params)

    @jax.jit
    def train_step(params, opt_state, tokens, f, valid, key):
        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, tokens, f, valid, key,
                                                                           config.noise)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, {"loss": loss, **metrics}

    @jax.jit
    def eval_step(params, tokens, f, valid):
        return loss_fn(params, tokens, f, valid, jax.random.key(0), 0.0)[1]  # the target's features, no noise

    def evaluate(params) -> dict[str, float]:
        """Top-1 agreement with the target on the eval split, per pass (pass 2: from predicted features)."""
        hits, n = {}, 0.0
        for Lq, idx in batches(ev_lengths.tolist(), config.tokens_per_batch):
            S = max(1, config.tokens_per_batch // Lq)
            tokens, f, valid = batch_arrays(ev_tokens, ev_lengths, ev_offsets, ev_feats, idx, Lq, S)
            m = eval_step(params, tokens, f, valid)
            for k, v in m.items():
                if k.startswith("top1"):
                    hits[k] = hits.get(k, 0.0) + float(v) * valid.sum()
            n += valid.sum()
        return {k: round(v / max(n, 1), 4) for k, v in hits.items()}

    # The recorded command names the head actually trained (an --init_from head keeps its own size and depth).
    recorded = dataclasses.replace(config, head_vocab=len(init["head_ids"]), num_layers=cfg.num_layers)
    command = "python -m training.eagle --stage=train " + " ".join(
        f"--{k}={v}" for k, v in dataclasses.asdict(recorded).items() if k != "out")
    record = {"command": command, "sequences": int(len(lengths)), "tokens": int(len(tokens_all)),
              "eval_token_coverage": round(ev_cover, 4)}
    if config.init_from:  # how the starting head was made
        record["init_from"] = {"name": config.init_from, "training": parent_training}

    def save(params, history):
        head = merged(params)
        out = {k: np.asarray(v, np.int32 if k == "head_ids" else np.float32) for k, v in head.body.to_params().items()}
        out[FC] = np.asarray(head.fc[...], np.float32)
        save_draft(config.out, cfg, out, None, target_name="smollm2-135m-instruct",
                   extra={"training": {**record, "epochs": history}})
        logging.info("train: saved %s", config.out)

    rng = np.random.default_rng(config.seed)
    key = jax.random.key(config.seed)
    step, t0, history = 0, time.perf_counter(), []
    for epoch in range(config.epochs):
        for Lq, idx in batches(lengths.tolist(), config.tokens_per_batch, rng):
            S = max(1, config.tokens_per_batch // Lq)
            key, sub = jax.random.split(key)
            params, opt_state, metrics = train_step(params, opt_state,
                                                    *batch_arrays(tokens_all, lengths, offsets, feats, idx, Lq, S), sub)
            step += 1
            if step % config.log_every == 0 or step == total:
                m = {k: float(v) for k, v in metrics.items()}
                logging.info("train: epoch %d step %d/%d %s (%.0f s)", epoch, step, total,
                             " ".join(f"{k} {v:.3f}" for k, v in m.items()), time.perf_counter() - t0)
        agree = evaluate(params)
        history.append({"epoch": epoch, "steps": step, "eval": agree})
        logging.info("train: epoch %d eval top-1 agreement with the target %s (%.0f s)", epoch, agree,
                     time.perf_counter() - t0)
        save(params, history)  # after every epoch: a run stopped early keeps its last one


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    logging.set_verbosity(logging.INFO)
    config = EagleConfig(**{f.name: FLAGS[f.name].value for f in dataclasses.fields(EagleConfig)})
    stages = {"features": lambda: compute_features(FLAGS.workdir, config),
              "train": lambda: train(FLAGS.workdir, config)}
    for stage in stages if FLAGS.stage == "all" else [FLAGS.stage]:
        t0 = time.perf_counter()
        stages[stage]()
        logging.info("stage %s took %.0f s", stage, time.perf_counter() - t0)


if __name__ == "__main__":
    app.run(main)
