"""Distils a small draft model from the target's own outputs, for speculative decoding.

  python -m training.distill --stage=all --workdir=/tmp/distill

Stages (each reads the previous one's files in `--workdir`, so each can be rerun):
  generate  the target (through `engine.LLM`) continues every prompt of the
            train split (greedy and sampled) and of the eval split (greedy);
            -> `continuations.jsonl` (`training.data.generate_continuations`).
            With `--synthetic_chat=N` it first writes N user turns of its
            own (`training.data.synthesize_chat_prompts`) and continues them
            too (greedy), as more chat training prompts
  targets   a dense forward of the target over prompt + continuation keeps the
            top-k log-probabilities at every position that predicts a
            continuation token; -> `targets.npz` (`training.data.compute_targets`)
  train     trains the draft (see `checkpoints.draft`) on the cross-entropy to
            the target's renormalised top-k distribution plus `--hard_weight`
            times the cross-entropy to the target's argmax, at continuation
            positions; -> `--out` (config.json + model.safetensors)
  eval      offline greedy speculation on the eval split: acceptance rate and
            tokens per target step for each K; -> `eval.json`

Knowledge distillation: Hinton et al. 2015; for drafts, Zhou et al. 2024
(DistillSpec) §3: on-policy data (the target's own continuations) and a
divergence to the target's distribution give the best acceptance.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

import numpy as np
from absl import app, flags, logging

from benchmarks import baselines  # noqa: F401  (defines --prompts_dir, shared with the benchmarks)
from training.data import SAMPLED, DataConfig, batches, compute_targets, dense_hidden, generate_continuations, \
    pad_batch, read_continuations

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAGS = flags.FLAGS
flags.DEFINE_enum("stage", "all", ["generate", "targets", "train", "eval", "all"], "What to run.")
flags.DEFINE_string("workdir", os.path.expanduser("~/.cache/jax-spec-engine/distill"),
                    "Where the generated data, soft targets and eval results go.")
flags.DEFINE_string("out", os.path.join(_ROOT, "checkpoints", "drafts", "smollm2-135m-draft"),
                    "Where the trained draft is saved.")
flags.DEFINE_integer("max_new_tokens", 160, "Continuation length for training data.")
flags.DEFINE_integer("eval_new_tokens", 128, "Greedy continuation length for the eval split.")
flags.DEFINE_integer("max_prompt_tokens", 640, "Longer prompts are skipped.")
flags.DEFINE_integer("generate_batch", 64, "Engine max_num_seqs for data generation.")
flags.DEFINE_integer("max_train_requests", 600, "Train requests (shortest prompts first); bounds the CPU time.")
flags.DEFINE_integer("synthetic_chat", 0, "Target-written chat prompts to make and train on besides the shared "
                     "ones (`training.data.synthesize_chat_prompts`; 0: none).")
flags.DEFINE_list("train_domains", None, "Domains of the train requests to generate (default: all; the synthetic "
                  "prompts are domain synthetic_chat).")
flags.DEFINE_integer("chunk", 384, "Requests per generate call (the file is appended after each).")
flags.DEFINE_integer("top_k_targets", 32, "Target log-probabilities kept per position.")
flags.DEFINE_integer("tokens_per_batch", 1024, "Padded tokens per batch in the targets and train stages.")
flags.DEFINE_list("init_layers", ["0", "1", "2", "3"],
                  "Target layers the draft starts from (at the target's width, with its embedding).")
flags.DEFINE_integer("head_vocab", 16384, "Tokens the draft's output head covers: the most frequent in the "
                     "training data, then the lowest ids (0: the whole vocabulary).")
flags.DEFINE_integer("epochs", 5, "Passes over the training sequences.")
flags.DEFINE_float("lr", 5e-3, "Peak AdamW learning rate (warmup, then cosine decay to 5%).")
flags.DEFINE_float("weight_decay", 0.01, "AdamW weight decay.")
flags.DEFINE_float("hard_weight", 0.5, "Weight of the cross-entropy to the target's argmax, next to the soft loss.")
flags.DEFINE_string("init_from", None, "A saved draft directory to continue training from (else --init_layers).")
flags.DEFINE_integer("seed", 0, "Initialisation and shuffling seed.")
flags.DEFINE_integer("log_every", 10, "Training steps between log lines.")
flags.DEFINE_list("eval_k", ["1", "2", "3", "4", "6", "8"], "Speculation lengths K to simulate.")

# The settings a saved draft's config.json records (its training command).
RECORDED_FLAGS = ("max_new_tokens", "eval_new_tokens", "max_prompt_tokens", "top_k_targets", "tokens_per_batch",
                  "init_layers", "head_vocab", "epochs", "lr", "weight_decay", "hard_weight", "init_from", "seed")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """The train and eval stages' settings (the flags of the same names)."""

    out: str
    init_layers: tuple[int, ...] = (0, 1, 2, 3)
    head_vocab: int = 16384
    epochs: int = 5
    lr: float = 5e-3
    weight_decay: float = 0.01
    hard_weight: float = 0.5
    init_from: str | None = None
    seed: int = 0
    log_every: int = 10
    eval_k: tuple[int, ...] = (1, 2, 3, 4, 6, 8)


def _flag_value(v) -> str:
    return ",".join(map(str, v)) if isinstance(v, (list, tuple)) else str(v)


def init_from_target(target, layers: list[int], head_vocab: int, token_counts, name: str):
    """The draft's start: `checkpoints.draft.early_exit_draft` of `layers` (named `name`), with an
    output head over `head_vocab` tokens (0: all) ranked by `token_counts` (int `[V]`), ties by id.

    Distillation then fits the early layers to the target's output.
    Returns (ModelConfig, params in `param_specs` layout).
    """

    from checkpoints.draft import early_exit_draft

    draft = early_exit_draft(target, layers, name=name)
    cfg, params = draft.config.replace(head_vocab_size=head_vocab), dict(draft.params)
    if head_vocab:
        order = np.lexsort((np.arange(len(token_counts)), -token_counts))  # most frequent first, then by id
        params["head_ids"] = np.sort(order[:head_vocab]).astype(np.int32)
    return cfg, params


def draft_agreement(model_fn, records, M: int, tokens_per_batch: int) -> dict:
    """Per-record boolean arrays: does the draft's argmax equal the recorded (greedy) continuation token?"""

    seqs = [r["prompt_ids"] + r["output_ids"] for r in records]
    starts = [len(r["prompt_ids"]) - 1 for r in records]
    out = {}
    for Lq, idx in batches([len(s) for s in seqs], tokens_per_batch):
        S = max(1, tokens_per_batch // Lq)
        tokens, where, _ = pad_batch([seqs[i] for i in idx], [starts[i] for i in idx], Lq, S, M)
        argmax = np.asarray(model_fn(tokens, where))
        for r, i in enumerate(idx):
            n = len(records[i]["output_ids"])
            out[records[i]["key"]] = argmax[r, :n] == np.asarray(records[i]["output_ids"])
    return out


def train(workdir: str, config: TrainConfig, data_config: DataConfig) -> None:
    """Distils the draft on `targets.npz`; saves it to `config.out`."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from checkpoints import load_model
    from checkpoints.draft import load_draft, save_draft
    from model.llama import Llama

    data = np.load(os.path.join(workdir, "targets.npz"))
    seq_ends = np.cumsum(data["seq_lens"])
    seqs = np.split(data["tokens"], seq_ends[:-1])
    starts = data["starts"]
    n_pred = data["seq_lens"] - 1 - starts
    pred_off = np.concatenate([[0], np.cumsum(n_pred)])
    top_lp, top_ids = data["topk_logprobs"], data["topk_ids"]
    eval_records = read_continuations(workdir, "eval")

    target = load_model()
    target_embed = jnp.asarray(target.params["embed"], jnp.float32)
    if config.init_from:  # continue training a saved draft
        loaded = load_draft(config.init_from, target)
        cfg, init = loaded.config, loaded.params
    else:
        counts = np.bincount(data["tokens"], minlength=target.config.vocab_size)
        cfg, init = init_from_target(target, list(config.init_layers), config.head_vocab, counts,
                                     name=os.path.basename(os.path.normpath(config.out)))
    if cfg.hidden_size != target.config.hidden_size:
        raise ValueError("distillation trains drafts of the target's width")
    # The embedding (the target's) and the head rows taken from it stay fixed.
    graphdef, embed_state, params, rest = nnx.split(Llama(cfg, params=init), nnx.PathContains("embed"),
                                                    nnx.Param, ...)
    trainable = {"layers": params}
    in_head = np.zeros(cfg.vocab_size, bool)
    in_head[np.asarray(init["head_ids"]) if cfg.head_vocab_size else slice(None)] = True
    fixed = {"embed": target_embed, "in_head": jnp.asarray(in_head)}
    M, k = data_config.max_new_tokens, top_lp.shape[1]
    tokens_per_batch = data_config.tokens_per_batch

    def merged(trainable, fixed):
        return nnx.merge(graphdef, jax.tree.map(lambda _: fixed["embed"], embed_state), trainable["layers"], rest)

    def loss_fn(trainable, fixed, tokens, where, valid, tgt_ids, tgt_lp):
        model = merged(trainable, fixed)
        hidden = jnp.take_along_axis(dense_hidden(model, tokens), where[..., None], axis=1)
        logp = jax.nn.log_softmax(model.logits(hidden.reshape(-1, cfg.hidden_size)), axis=-1)
        logp = logp.reshape(*where.shape, -1)  # [S, M, V]
        # The target's top-k renormalised over the tokens the draft's head covers (the draft gives
        # the others probability 0; their log-probabilities are about -1e30 and must not enter).
        covered = fixed["in_head"][tgt_ids]
        q = jax.nn.softmax(jnp.where(covered, tgt_lp, -1e9), axis=-1) * covered
        soft = -jnp.sum(q * jnp.where(covered, jnp.take_along_axis(logp, tgt_ids, axis=-1), 0.0), axis=-1)
        hard = -jnp.where(covered[..., 0], jnp.take_along_axis(logp, tgt_ids[..., :1], axis=-1)[..., 0], 0.0)
        w = valid.astype(jnp.float32)
        n = jnp.maximum(w.sum(), 1.0)
        agree = (jnp.argmax(logp, -1) == tgt_ids[..., 0]).astype(jnp.float32)
        loss = (jnp.sum(w * soft) + config.hard_weight * jnp.sum(w * covered[..., 0] * hard)) / n
        return loss, {"soft": jnp.sum(w * soft) / n, "hard": jnp.sum(w * hard) / n, "top1": jnp.sum(w * agree) / n}

    batches_per_epoch = len(batches([len(s) for s in seqs], tokens_per_batch))
    total = config.epochs * batches_per_epoch
    schedule = optax.warmup_cosine_decay_schedule(0.0, config.lr, min(30, total // 10), total, config.lr * 0.05)
    # b2 = 0.95: second moments that follow a short run's fast-changing gradients.
    opt = optax.chain(optax.clip_by_global_norm(1.0),
                      optax.adamw(schedule, b2=0.95, weight_decay=config.weight_decay))
    opt_state = opt.init(trainable)

    @jax.jit
    def train_step(trainable, opt_state, fixed, batch):
        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(trainable, fixed, *batch)
        updates, opt_state = opt.update(grads, opt_state, trainable)
        return optax.apply_updates(trainable, updates), opt_state, {"loss": loss, **metrics}

    @jax.jit
    def draft_argmax(trainable, fixed, tokens, where):
        model = merged(trainable, fixed)
        hidden = jnp.take_along_axis(dense_hidden(model, tokens), where[..., None], axis=1)
        return jnp.argmax(model.logits(hidden.reshape(-1, cfg.hidden_size)), -1).reshape(where.shape)

    def eval_agreement():
        agree = draft_agreement(lambda t, w: draft_argmax(trainable, fixed, t, w), eval_records,
                                data_config.eval_new_tokens, tokens_per_batch)
        return float(np.mean(np.concatenate(list(agree.values()))))

    history = []
    if config.init_from:
        with open(os.path.join(config.init_from, "config.json")) as f:
            history = json.load(f)["draft"].get("training", [])

    def save(path: str, steps: int) -> None:
        run = {"command": "python -m training.distill --stage=train " + " ".join(
            f"--{k}={_flag_value(v)}" for config_ in (data_config, config)
            for k, v in dataclasses.asdict(config_).items() if k in RECORDED_FLAGS), "steps": steps}
        params = {k: np.asarray(v, np.int32 if k == "head_ids" else np.float32)
                  for k, v in merged(trainable, fixed).to_params().items()}
        save_draft(path, cfg, params, None,
                   target_name="smollm2-135m-instruct", extra={"training": history + [run]})

    rng = np.random.default_rng(config.seed)
    step, t0 = 0, time.perf_counter()
    for epoch in range(config.epochs):
        for Lq, idx in batches([len(s) for s in seqs], tokens_per_batch, rng):
            S = max(1, tokens_per_batch // Lq)
            tokens, where, valid = pad_batch([seqs[i] for i in idx], [starts[i] for i in idx], Lq, S, M)
            tgt_ids = np.zeros((S, M, k), np.int32)
            tgt_lp = np.zeros((S, M, k), np.float32)
            for r, i in enumerate(idx):
                n = min(n_pred[i], M)
                tgt_ids[r, :n] = top_ids[pred_off[i]:pred_off[i] + n]
                tgt_lp[r, :n] = top_lp[pred_off[i]:pred_off[i] + n]
            trainable, opt_state, metrics = train_step(trainable, opt_state, fixed,
                                                          (tokens, where, valid, tgt_ids, tgt_lp))
            step += 1
            if step % config.log_every == 0 or step == total:
                m = {key: float(v) for key, v in metrics.items()}
                logging.info("train: epoch %d step %d/%d loss %.3f soft %.3f hard %.3f top1 %.3f (%.0f s)", epoch,
                             step, total, m["loss"], m["soft"], m["hard"], m["top1"], time.perf_counter() - t0)
        logging.info("train: epoch %d eval top-1 agreement %.4f (%.0f s)", epoch, eval_agreement(),
                     time.perf_counter() - t0)
        save(os.path.join(workdir, "draft_last_epoch"), step)  # survives an interrupted run
    save(config.out, step)
    logging.info("train: saved %s", config.out)


def simulate_greedy(matches, K: int) -> tuple[int, int, int]:
    """Offline greedy speculation over one target continuation (Leviathan et al. 2023, §3.1).

    `matches[i]`: the draft's argmax equals the target's token i, given the
    target's tokens before it. In each round the draft proposes
    k = min(K, tokens left - 1) tokens from the accepted context; the target
    accepts the leading matches and adds one token of its own. While the draft
    agrees its context is the target's, so one forward pass gives every round.
    Returns (accepted draft tokens, proposed draft tokens, target steps).
    """
    N, j, accepted, proposed, steps = len(matches), 0, 0, 0, 0
    while j < N:
        k = min(K, N - 1 - j)
        n = 0
        while n < k and matches[j + n]:
            n += 1
        accepted, proposed, steps, j = accepted + n, proposed + k, steps + 1, j + n + 1
    return accepted, proposed, steps


def _time_decode(loaded, prompt_ids: list[int], n_tokens: int) -> tuple[float, float]:
    """Median seconds per batch-1 greedy decode step through the engine: (whole step, jitted step alone)."""

    from engine import Engine, EngineConfig
    from scheduler.request import SamplingParams

    engine = Engine(loaded, EngineConfig(max_num_seqs=1, max_num_batched_tokens=512, max_model_len=1024))
    device = []
    engine.on_step = lambda timing: device.append(timing.device)
    whole = []
    for _ in range(2):  # the first run compiles
        device.clear()
        whole.clear()
        engine.add_request(prompt_ids, SamplingParams(temperature=0, max_tokens=n_tokens, ignore_eos=True))
        engine.step()  # prefill
        while engine.has_unfinished():
            t = time.perf_counter()
            engine.step()
            whole.append(time.perf_counter() - t)
    return float(np.median(whole)), float(np.median(device[1:]))


def evaluate(workdir: str, config: TrainConfig, data_config: DataConfig) -> None:
    """Greedy acceptance of the saved draft on the held-out prompts, and its cost relative to the target."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from checkpoints import load_model
    from checkpoints.draft import load_draft
    from model.llama import Llama

    target = load_model()
    draft = load_draft(config.out, target)
    graphdef, state = nnx.split(Llama(draft.config, params=draft.params))

    @jax.jit
    def draft_argmax(state, tokens, where):
        model = nnx.merge(graphdef, state)
        hidden = jnp.take_along_axis(dense_hidden(model, tokens), where[..., None], axis=1)
        return jnp.argmax(model.logits(hidden.reshape(-1, hidden.shape[-1])), -1).reshape(where.shape)

    records = read_continuations(workdir, "eval")
    matches = draft_agreement(lambda t, w: draft_argmax(state, t, w), records, data_config.eval_new_tokens,
                              data_config.tokens_per_batch)
    domains = sorted({r["domain"] for r in records})
    result = {"draft": config.out, "num_prompts": {d: sum(r["domain"] == d for r in records) for d in domains},
              "top1_agreement": {}, "acceptance": {}, "tokens_per_step": {}}
    for group in domains + ["all"]:
        keys = [r["key"] for r in records if group in ("all", r["domain"])]
        result["top1_agreement"][group] = float(np.mean(np.concatenate([matches[key] for key in keys])))
        for K in config.eval_k:
            a, p, s = np.sum([simulate_greedy(matches[key], K) for key in keys], axis=0)
            tokens = sum(len(matches[key]) for key in keys)
            result["acceptance"].setdefault(group, {})[K] = float(a / p)
            result["tokens_per_step"].setdefault(group, {})[K] = float(tokens / s)
    # Cost per draft token relative to a target step: batch-1 decode through the engine.
    prompt = records[0]["prompt_ids"]
    t_whole, t_device = _time_decode(target, prompt, 48)
    d_whole, d_device = _time_decode(draft, prompt, 48)
    result["decode_ms"] = {"target_step": 1e3 * t_whole, "target_jitted": 1e3 * t_device,
                           "draft_step": 1e3 * d_whole, "draft_jitted": 1e3 * d_device}
    result["cost_ratio_c"] = {"step": d_whole / t_whole, "jitted": d_device / t_device}
    result["num_params"] = {"target": target.config.num_params, "draft": draft.config.num_params,
                            "draft_without_embedding": draft.config.num_params - draft.config.vocab_size
                            * draft.config.hidden_size}
    with open(os.path.join(workdir, "eval.json"), "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2))


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    logging.set_verbosity(logging.INFO)
    if FLAGS.train_domains and not set(FLAGS.train_domains) <= set(SAMPLED):
        raise app.UsageError(f"--train_domains must be among {sorted(SAMPLED)}, got {FLAGS.train_domains}")
    os.makedirs(FLAGS.workdir, exist_ok=True)
    data = DataConfig(**{f.name: FLAGS[f.name].value for f in dataclasses.fields(DataConfig)
                         if f.name != "train_domains"},
                      train_domains=tuple(FLAGS.train_domains) if FLAGS.train_domains else None)
    config = TrainConfig(**{f.name: FLAGS[f.name].value for f in dataclasses.fields(TrainConfig)
                            if f.name not in ("init_layers", "eval_k")},
                         init_layers=tuple(int(i) for i in FLAGS.init_layers), eval_k=tuple(int(k) for k in FLAGS.eval_k))
    stages = {"generate": lambda: generate_continuations(FLAGS.workdir, data),
              "targets": lambda: compute_targets(FLAGS.workdir, data),
              "train": lambda: train(FLAGS.workdir, config, data),
              "eval": lambda: evaluate(FLAGS.workdir, config, data)}
    for stage in stages if FLAGS.stage == "all" else [FLAGS.stage]:
        t0 = time.perf_counter()
        stages[stage]()
        logging.info("stage %s took %.0f s", stage, time.perf_counter() - t0)


if __name__ == "__main__":
    app.run(main)
