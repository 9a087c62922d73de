"""Distils a small draft model from the target's own outputs, for speculative decoding.

  PYTHONPATH=. python -m engine.distill --stage=all --workdir=/tmp/distill

Stages (each reads the previous one's files in `--workdir`, so each can be rerun):
  generate  the target (through `engine.LLM`) continues every prompt of the
            train split (greedy and sampled) and of the eval split (greedy);
            -> `continuations.jsonl`
  targets   a dense forward of the target over prompt + continuation keeps the
            top-k log-probabilities at every position that predicts a
            continuation token; -> `targets.npz`
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

import hashlib
import json
import os
import time

from absl import app, flags, logging

FLAGS = flags.FLAGS
flags.DEFINE_enum("stage", "all", ["generate", "targets", "train", "eval", "all"], "What to run.")
flags.DEFINE_string("workdir", os.path.expanduser("~/.cache/jax-spec-engine/distill"),
                    "Where the generated data, soft targets and eval results go.")
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
flags.DEFINE_string("prompts_dir", os.path.join(os.path.dirname(_ROOT), "shared", "data", "prompts"),
                    "Directory of the prompt `*.jsonl` files (fields `id`, `prompt`).")
flags.DEFINE_string("out", os.path.join(_ROOT, "checkpoints", "drafts", "smollm2-135m-draft"),
                    "Where the trained draft is saved.")
flags.DEFINE_integer("max_new_tokens", 160, "Continuation length for training data.")
flags.DEFINE_integer("eval_new_tokens", 128, "Greedy continuation length for the eval split.")
flags.DEFINE_integer("max_prompt_tokens", 640, "Longer prompts are skipped.")
flags.DEFINE_integer("generate_batch", 64, "Engine max_num_seqs for data generation.")
flags.DEFINE_integer("max_train_requests", 600, "Train requests (shortest prompts first); bounds the CPU time.")
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

_RECORDED_FLAGS = ("max_new_tokens", "eval_new_tokens", "max_prompt_tokens", "top_k_targets", "tokens_per_batch",
                   "init_layers", "head_vocab", "epochs", "lr", "weight_decay", "hard_weight", "init_from", "seed")

# Eval split: a prompt is held out when sha256(id) % 100 < percent; it is never trained on.
EVAL_PERCENT = {"chat": 20, "code": 20, "creative": 20, "math": 5, "summarization": 5}
EVAL_CAP = 24  # held-out prompts per domain actually evaluated (chat keeps all of its 20%)
TRAIN_CAP = {"chat": None, "code": None, "creative": None, "math": 240, "summarization": 160}
# (temperature, top_p) of the sampled continuations per training prompt, besides one greedy one.
SAMPLED = {"chat": [(0.7, 0.9), (1.0, 1.0)], "code": [(0.7, 0.9), (1.0, 1.0)],
           "creative": [(0.7, 0.9), (1.0, 1.0)], "math": [(0.8, 0.95)], "summarization": []}


def _hash(text: str) -> int:
    return int(hashlib.sha256(text.encode()).hexdigest()[:12], 16)


def split_prompts(prompts_dir: str) -> list[dict]:
    """Every used prompt as {domain, id, prompt, split}, deterministic (no randomness but id hashes).

    Within a domain, prompts are ordered by id hash; caps take the first ones.
    """
    rows = []
    for domain, percent in EVAL_PERCENT.items():
        with open(os.path.join(prompts_dir, f"{domain}.jsonl")) as f:
            items = sorted((json.loads(line) for line in f if line.strip()), key=lambda r: _hash(r["id"]))
        held = [r for r in items if _hash(r["id"]) % 100 < percent]
        train = [r for r in items if _hash(r["id"]) % 100 >= percent]
        held = held if domain == "chat" else held[:EVAL_CAP]
        train = train[:TRAIN_CAP[domain]] if TRAIN_CAP[domain] else train
        rows += [{"domain": domain, "id": r["id"], "prompt": r["prompt"], "split": "eval"} for r in held]
        rows += [{"domain": domain, "id": r["id"], "prompt": r["prompt"], "split": "train"} for r in train]
    return rows


def generate_jobs(rows: list[dict]) -> list[dict]:
    """One request per (prompt, sampling variant): greedy for all, sampled ones for training prompts."""
    jobs = []
    for r in rows:
        variants = [(0.0, 1.0)] + (SAMPLED[r["domain"]] if r["split"] == "train" else [])
        for v, (temperature, top_p) in enumerate(variants):
            jobs.append({**r, "key": f"{r['id']}#{v}", "temperature": temperature, "top_p": top_p,
                         "seed": _hash(f"{r['id']}#{v}") % 2**32})
    return jobs


def select_jobs(jobs: list[dict], max_prompt_tokens: int, max_train_requests: int) -> list[dict]:
    """The requests to run, in order: every eval job, then the train jobs with the shortest prompts
    (ties by key), at most `max_train_requests`; prompts over `max_prompt_tokens` are skipped.
    Jobs need `prompt_ids`. Similar lengths next to each other keep the engine's batch full."""
    jobs = [j for j in jobs if len(j["prompt_ids"]) <= max_prompt_tokens]
    by_length = lambda j: (len(j["prompt_ids"]), j["key"])
    train = sorted((j for j in jobs if j["split"] == "train"), key=by_length)[:max_train_requests]
    return sorted((j for j in jobs if j["split"] == "eval"), key=by_length) + train


def stage_generate(workdir: str) -> None:
    from engine import LLM, SamplingParams

    path = os.path.join(workdir, "continuations.jsonl")
    done = set()
    if os.path.exists(path):
        with open(path) as f:
            done = {json.loads(line)["key"] for line in f}
    llm = LLM(max_num_seqs=FLAGS.generate_batch, kv_cache_bytes=3 << 30)
    jobs = [{**job, "prompt_ids": llm.encode([{"role": "user", "content": job["prompt"]}])}
            for job in generate_jobs(split_prompts(FLAGS.prompts_dir))]
    jobs = select_jobs(jobs, FLAGS.max_prompt_tokens, FLAGS.max_train_requests)
    jobs = [j for j in jobs if j["key"] not in done]
    logging.info("generate: %d requests to run (%d done before)", len(jobs), len(done))
    for start in range(0, len(jobs), FLAGS.chunk):
        chunk = jobs[start:start + FLAGS.chunk]
        t0 = time.perf_counter()
        params = [SamplingParams(temperature=j["temperature"], top_p=j["top_p"], seed=j["seed"],
                                 max_tokens=FLAGS.eval_new_tokens if j["split"] == "eval" else FLAGS.max_new_tokens)
                  for j in chunk]
        progress = {"tokens": 0}

        def on_output(_, out, progress=progress, t0=t0):
            progress["tokens"] += len(out.delta_token_ids)
            if progress["tokens"] % 4096 == 0:
                logging.info("generate: %d tokens in %.0f s", progress["tokens"], time.perf_counter() - t0)

        outs = llm.generate([j["prompt_ids"] for j in chunk], params, on_output=on_output)
        with open(path, "a") as f:
            for j, out in zip(chunk, outs):
                record = {k: v for k, v in j.items() if k != "prompt"}
                f.write(json.dumps({**record, "output_ids": out.token_ids, "finish_reason": out.finish_reason}) + "\n")
        n_new = sum(len(o.token_ids) for o in outs)
        dt = time.perf_counter() - t0
        logging.info("generate: %d/%d requests, %d tokens in %.0f s (%.0f tok/s)",
                     start + len(chunk), len(jobs), n_new, dt, n_new / dt)


def _read_continuations(workdir: str, split: str) -> list[dict]:
    with open(os.path.join(workdir, "continuations.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return sorted((r for r in rows if r["split"] == split), key=lambda r: r["key"])


def _dense_hidden(model, tokens):
    """Final hidden states `[S, Lq, E]` of a right-padded batch `tokens [S, Lq]`, causal per row."""
    import jax
    import jax.numpy as jnp

    from model.llama import dense_attention

    S, Lq = tokens.shape
    pos = jnp.arange(Lq, dtype=jnp.int32)
    seg = jnp.zeros(Lq, jnp.int32)
    rows = lambda x: x.reshape(S, Lq, *x.shape[1:])

    def attend(q, k, v, _, cache):
        out = jax.vmap(lambda q, k, v: dense_attention(q, k, v, pos, seg))(rows(q), rows(k), rows(v))
        return out.reshape(q.shape), cache

    hidden, _ = model(tokens.reshape(-1), jnp.tile(pos, S), attend, None)
    return hidden.reshape(S, Lq, -1)


def _batches(lengths: list[int], tokens_per_batch: int, rng=None) -> list[tuple[int, list[int]]]:
    """Groups sequence indices into (padded length Lq, indices) batches of about `tokens_per_batch`
    tokens; Lq is a multiple of 128 (few compiled shapes). Shuffled when `rng` is given."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    buckets: dict[int, list[int]] = {}
    for i in order:
        buckets.setdefault(-(-lengths[i] // 128) * 128, []).append(i)
    out = []
    for Lq, idx in sorted(buckets.items()):
        if rng is not None:
            idx = [idx[j] for j in rng.permutation(len(idx))]
        S = max(1, tokens_per_batch // Lq)
        out += [(Lq, idx[j:j + S]) for j in range(0, len(idx), S)]
    if rng is not None:
        out = [out[j] for j in rng.permutation(len(out))]
    return out


def _pad_batch(seqs: list[list[int]], starts: list[int], Lq: int, S: int, M: int):
    """Right-padded tokens int32 `[S, Lq]`, loss positions int32 `[S, M]` (a row's slot m is position
    start + m) and their validity `[S, M]`; missing rows are all padding."""
    import numpy as np

    tokens = np.zeros((S, Lq), np.int32)
    where = np.zeros((S, M), np.int32)
    valid = np.zeros((S, M), bool)
    for r, (seq, start) in enumerate(zip(seqs, starts)):
        tokens[r, :len(seq)] = seq
        n = min(len(seq) - 1 - start, M)
        where[r, :n] = start + np.arange(n)
        valid[r, :n] = True
    return tokens, where, valid


def stage_targets(workdir: str) -> None:
    """Top-k log-probabilities of the target at every position that predicts a continuation token."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from checkpoints import load_model
    from model.llama import Llama

    records = _read_continuations(workdir, "train")
    target = load_model()
    graphdef, state = nnx.split(Llama(target.config, params=target.params))
    M, k = FLAGS.max_new_tokens, FLAGS.top_k_targets

    @jax.jit
    def top_logprobs(state, tokens, where):
        model = nnx.merge(graphdef, state)
        hidden = jnp.take_along_axis(_dense_hidden(model, tokens), where[..., None], axis=1)  # [S, M, E]
        logprobs = jax.nn.log_softmax(model.logits(hidden.reshape(-1, hidden.shape[-1])), axis=-1)
        values, ids = jax.lax.top_k(logprobs, k)
        return values.reshape(*where.shape, k), ids.reshape(*where.shape, k)

    seqs = [r["prompt_ids"] + r["output_ids"] for r in records]
    starts = [len(r["prompt_ids"]) - 1 for r in records]
    values = [None] * len(seqs)
    ids = [None] * len(seqs)
    t0, done = time.perf_counter(), 0
    for Lq, idx in _batches([len(s) for s in seqs], FLAGS.tokens_per_batch):
        S = max(1, FLAGS.tokens_per_batch // Lq)
        tokens, where, _ = _pad_batch([seqs[i] for i in idx], [starts[i] for i in idx], Lq, S, M)
        v, t = jax.device_get(top_logprobs(state, tokens, where))
        for r, i in enumerate(idx):
            n = len(seqs[i]) - 1 - starts[i]
            values[i], ids[i] = v[r, :n].astype(np.float16), t[r, :n].astype(np.uint16)
        done += len(idx)
        logging.info("targets: %d/%d sequences, %.0f s", done, len(seqs), time.perf_counter() - t0)
    np.savez(os.path.join(workdir, "targets.npz"),
             tokens=np.concatenate(seqs).astype(np.int32), seq_lens=np.array([len(s) for s in seqs], np.int32),
             starts=np.array(starts, np.int32), topk_logprobs=np.concatenate(values),
             topk_ids=np.concatenate(ids), keys=np.array([r["key"] for r in records]))


def init_from_target(target, layers: list[int], head_vocab: int, token_counts):
    """The draft's start: `checkpoints.draft.early_exit_draft` of `layers`, with an output head
    over `head_vocab` tokens (0: all) ranked by `token_counts` (int `[V]`), ties by id.

    Distillation then fits the early layers to the target's output.
    Returns (ModelConfig, params in `param_specs` layout).
    """
    import numpy as np

    from checkpoints.draft import early_exit_draft

    draft = early_exit_draft(target, layers, name=os.path.basename(os.path.normpath(FLAGS.out)))
    cfg, params = draft.config.replace(head_vocab_size=head_vocab), dict(draft.params)
    if head_vocab:
        order = np.lexsort((np.arange(len(token_counts)), -token_counts))  # most frequent first, then by id
        params["head_ids"] = np.sort(order[:head_vocab]).astype(np.int32)
    return cfg, params


def _params_from_module(model) -> dict:
    """`param_specs` arrays (numpy float32) from a `Llama` module (splits the fused projections)."""
    import numpy as np

    cfg = model.cfg
    H, K, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    stack = lambda f: np.stack([np.asarray(f(lp), np.float32) for lp in model.layers])
    wqkv = stack(lambda lp: lp.wqkv[...])
    gate_up = stack(lambda lp: lp.w_gate_up[...])
    return {"embed": np.asarray(model.embed[...], np.float32),
            "final_norm": np.asarray(model.final_norm[...], np.float32),
            "attn_norm": stack(lambda lp: lp.attn_norm[...]), "mlp_norm": stack(lambda lp: lp.mlp_norm[...]),
            "wq": wqkv[..., :H * D], "wk": wqkv[..., H * D:(H + K) * D], "wv": wqkv[..., (H + K) * D:],
            "wo": stack(lambda lp: lp.wo[...]), "w_gate": gate_up[..., :cfg.intermediate_size],
            "w_up": gate_up[..., cfg.intermediate_size:], "w_down": stack(lambda lp: lp.w_down[...]),
            **({"head_ids": np.asarray(model.head_ids[...])} if cfg.head_vocab_size else {})}


def _draft_agreement(model_fn, records, M: int) -> dict:
    """Per-record boolean arrays: does the draft's argmax equal the recorded (greedy) continuation token?"""
    import numpy as np

    seqs = [r["prompt_ids"] + r["output_ids"] for r in records]
    starts = [len(r["prompt_ids"]) - 1 for r in records]
    out = {}
    for Lq, idx in _batches([len(s) for s in seqs], FLAGS.tokens_per_batch):
        S = max(1, FLAGS.tokens_per_batch // Lq)
        tokens, where, _ = _pad_batch([seqs[i] for i in idx], [starts[i] for i in idx], Lq, S, M)
        argmax = np.asarray(model_fn(tokens, where))
        for r, i in enumerate(idx):
            n = len(records[i]["output_ids"])
            out[records[i]["key"]] = argmax[r, :n] == np.asarray(records[i]["output_ids"])
    return out


def stage_train(workdir: str) -> None:
    """Distils the draft on `targets.npz`; saves it to `--out`."""
    import jax
    import jax.numpy as jnp
    import numpy as np
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
    eval_records = [r for r in _read_continuations(workdir, "eval")]

    target = load_model()
    target_embed = jnp.asarray(target.params["embed"], jnp.float32)
    if FLAGS.init_from:  # continue training a saved draft
        loaded = load_draft(FLAGS.init_from, target)
        cfg, init = loaded.config, loaded.params
    else:
        counts = np.bincount(data["tokens"], minlength=target.config.vocab_size)
        cfg, init = init_from_target(target, [int(i) for i in FLAGS.init_layers], FLAGS.head_vocab, counts)
    if cfg.hidden_size != target.config.hidden_size:
        raise ValueError("distillation trains drafts of the target's width")
    # The embedding (the target's) and the head rows taken from it stay fixed.
    graphdef, embed_state, params, rest = nnx.split(Llama(cfg, params=init), nnx.PathContains("embed"),
                                                    nnx.Param, ...)
    trainable = {"layers": params}
    in_head = np.zeros(cfg.vocab_size, bool)
    in_head[np.asarray(init["head_ids"]) if cfg.head_vocab_size else slice(None)] = True
    fixed = {"embed": target_embed, "in_head": jnp.asarray(in_head)}
    M, k = FLAGS.max_new_tokens, top_lp.shape[1]

    def merged(trainable, fixed):
        return nnx.merge(graphdef, jax.tree.map(lambda _: fixed["embed"], embed_state), trainable["layers"], rest)

    def loss_fn(trainable, fixed, tokens, where, valid, tgt_ids, tgt_lp):
        model = merged(trainable, fixed)
        hidden = jnp.take_along_axis(_dense_hidden(model, tokens), where[..., None], axis=1)
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
        loss = (jnp.sum(w * soft) + FLAGS.hard_weight * jnp.sum(w * covered[..., 0] * hard)) / n
        return loss, {"soft": jnp.sum(w * soft) / n, "hard": jnp.sum(w * hard) / n, "top1": jnp.sum(w * agree) / n}

    batches_per_epoch = len(_batches([len(s) for s in seqs], FLAGS.tokens_per_batch))
    total = FLAGS.epochs * batches_per_epoch
    schedule = optax.warmup_cosine_decay_schedule(0.0, FLAGS.lr, min(30, total // 10), total, FLAGS.lr * 0.05)
    # b2 = 0.95: second moments that follow a short run's fast-changing gradients.
    opt = optax.chain(optax.clip_by_global_norm(1.0),
                      optax.adamw(schedule, b2=0.95, weight_decay=FLAGS.weight_decay))
    opt_state = opt.init(trainable)

    @jax.jit
    def train_step(trainable, opt_state, fixed, batch):
        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(trainable, fixed, *batch)
        updates, opt_state = opt.update(grads, opt_state, trainable)
        return optax.apply_updates(trainable, updates), opt_state, {"loss": loss, **metrics}

    @jax.jit
    def draft_argmax(trainable, fixed, tokens, where):
        model = merged(trainable, fixed)
        hidden = jnp.take_along_axis(_dense_hidden(model, tokens), where[..., None], axis=1)
        return jnp.argmax(model.logits(hidden.reshape(-1, cfg.hidden_size)), -1).reshape(where.shape)

    def eval_agreement():
        agree = _draft_agreement(lambda t, w: draft_argmax(trainable, fixed, t, w), eval_records, FLAGS.eval_new_tokens)
        return float(np.mean(np.concatenate(list(agree.values()))))

    history = []
    if FLAGS.init_from:
        with open(os.path.join(FLAGS.init_from, "config.json")) as f:
            history = json.load(f)["draft"].get("training", [])

    def save(path: str, steps: int) -> None:
        run = {"command": "python -m engine.distill --stage=train " + " ".join(
            f"--{name}={FLAGS[name].value}" for name in _RECORDED_FLAGS), "steps": steps}
        save_draft(cfg, _params_from_module(merged(trainable, fixed)), None, path,
                   target_name="smollm2-135m-instruct", extra={"training": history + [run]})

    rng = np.random.default_rng(FLAGS.seed)
    step, t0 = 0, time.perf_counter()
    for epoch in range(FLAGS.epochs):
        for Lq, idx in _batches([len(s) for s in seqs], FLAGS.tokens_per_batch, rng):
            S = max(1, FLAGS.tokens_per_batch // Lq)
            tokens, where, valid = _pad_batch([seqs[i] for i in idx], [starts[i] for i in idx], Lq, S, M)
            tgt_ids = np.zeros((S, M, k), np.int32)
            tgt_lp = np.zeros((S, M, k), np.float32)
            for r, i in enumerate(idx):
                n = min(n_pred[i], M)
                tgt_ids[r, :n] = top_ids[pred_off[i]:pred_off[i] + n]
                tgt_lp[r, :n] = top_lp[pred_off[i]:pred_off[i] + n]
            trainable, opt_state, metrics = train_step(trainable, opt_state, fixed,
                                                          (tokens, where, valid, tgt_ids, tgt_lp))
            step += 1
            if step % FLAGS.log_every == 0 or step == total:
                m = {key: float(v) for key, v in metrics.items()}
                logging.info("train: epoch %d step %d/%d loss %.3f soft %.3f hard %.3f top1 %.3f (%.0f s)", epoch,
                             step, total, m["loss"], m["soft"], m["hard"], m["top1"], time.perf_counter() - t0)
        logging.info("train: epoch %d eval top-1 agreement %.4f (%.0f s)", epoch, eval_agreement(),
                     time.perf_counter() - t0)
        save(os.path.join(workdir, "draft_last_epoch"), step)  # survives an interrupted run
    save(FLAGS.out, step)
    logging.info("train: saved %s", FLAGS.out)


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
    import jax
    import numpy as np

    from engine.engine import Engine, EngineConfig
    from scheduler.request import SamplingParams

    engine = Engine(loaded, EngineConfig(max_num_seqs=1, max_num_batched_tokens=512, max_model_len=1024))
    device = []
    jitted = engine._step

    def timed(*args):
        t = time.perf_counter()
        out = jax.block_until_ready(jitted(*args))
        device.append(time.perf_counter() - t)
        return out

    engine._step = timed
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


def stage_eval(workdir: str) -> None:
    """Greedy acceptance of the saved draft on the held-out prompts, and its cost relative to the target."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from checkpoints import load_model
    from checkpoints.draft import load_draft
    from model.llama import Llama

    target = load_model()
    draft = load_draft(FLAGS.out, target)
    graphdef, state = nnx.split(Llama(draft.config, params=draft.params))

    @jax.jit
    def draft_argmax(state, tokens, where):
        model = nnx.merge(graphdef, state)
        hidden = jnp.take_along_axis(_dense_hidden(model, tokens), where[..., None], axis=1)
        return jnp.argmax(model.logits(hidden.reshape(-1, hidden.shape[-1])), -1).reshape(where.shape)

    records = _read_continuations(workdir, "eval")
    matches = _draft_agreement(lambda t, w: draft_argmax(state, t, w), records, FLAGS.eval_new_tokens)
    domains = sorted({r["domain"] for r in records})
    result = {"draft": FLAGS.out, "num_prompts": {d: sum(r["domain"] == d for r in records) for d in domains},
              "top1_agreement": {}, "acceptance": {}, "tokens_per_step": {}}
    for group in domains + ["all"]:
        keys = [r["key"] for r in records if group in ("all", r["domain"])]
        result["top1_agreement"][group] = float(np.mean(np.concatenate([matches[key] for key in keys])))
        for K in map(int, FLAGS.eval_k):
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
    os.makedirs(FLAGS.workdir, exist_ok=True)
    stages = ["generate", "targets", "train", "eval"] if FLAGS.stage == "all" else [FLAGS.stage]
    for stage in stages:
        t0 = time.perf_counter()
        globals()[f"stage_{stage}"](FLAGS.workdir)
        logging.info("stage %s took %.0f s", stage, time.perf_counter() - t0)


if __name__ == "__main__":
    app.run(main)
