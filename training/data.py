"""Distillation data: the prompt split, the target's own continuations, its top-k soft targets, batching.

Files in the work directory: `continuations.jsonl` (one record per request:
its key, domain, split, prompt ids, sampling, output ids) and `targets.npz`
(the train split's tokens and the target's top-k log-probabilities at every
position that predicts a continuation token).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time

import numpy as np
from absl import logging

from scheduler.util import cdiv

# Eval split: a prompt is held out when sha256(id) % 100 < percent; it is never trained on.
EVAL_PERCENT = {"chat": 20, "code": 20, "creative": 20, "math": 5, "summarization": 5}
EVAL_CAP = 24  # held-out prompts per domain actually evaluated (chat keeps all of its 20%)
TRAIN_CAP = {"chat": None, "code": None, "creative": None, "math": 240, "summarization": 160}
# (temperature, top_p) of the sampled continuations per training prompt, besides one greedy one.
# Chat, code and creative have few prompts, so each gets more samples.
_OPEN = [(0.7, 0.9), (1.0, 1.0), (0.8, 0.95), (0.9, 0.9), (0.6, 1.0), (1.0, 0.9)]
SAMPLED = {"chat": _OPEN, "code": _OPEN, "creative": _OPEN, "math": [(0.8, 0.95), (1.0, 0.9)], "summarization": [],
           "synthetic_chat": []}
SYNTHETIC = "synthetic_prompts.jsonl"  # the work directory's target-written user turns (train split only)


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """How much data the generate and targets stages make (the distillation app's flags of the same names)."""

    prompts_dir: str
    max_new_tokens: int = 160  # continuation length of training requests
    eval_new_tokens: int = 128  # greedy continuation length of eval requests
    max_prompt_tokens: int = 640  # longer prompts are skipped
    generate_batch: int = 64  # engine max_num_seqs while generating
    max_train_requests: int = 600  # train requests, shortest prompts first
    synthetic_chat: int = 0  # target-written user turns to make before generating (0: none)
    train_domains: tuple[str, ...] | None = None  # domains of the train requests (None: all)
    chunk: int = 384  # requests per generate call (the file is appended after each)
    top_k_targets: int = 32  # target log-probabilities kept per position
    tokens_per_batch: int = 1024  # padded tokens per batch in the targets, train and eval stages


def prompt_hash(text: str) -> int:
    """A stable 48-bit hash of a prompt id (the split and the seeds derive from it)."""
    return int(hashlib.sha256(text.encode()).hexdigest()[:12], 16)


def split_prompts(prompts_dir: str, synthetic: str | None = None) -> list[dict]:
    """Every used prompt as {domain, id, prompt, split}, deterministic (no randomness but id hashes).

    Raises FileNotFoundError, saying how to build the files, if `prompts_dir` lacks one.
    Within a domain, prompts are ordered by id hash; caps take the first ones. The rows of the
    `synthetic` file (`synthesize_chat_prompts`), if given, follow as domain `synthetic_chat`, all train.
    """
    from benchmarks.prompts import require

    require(prompts_dir, tuple(EVAL_PERCENT))
    rows = []
    for domain, percent in EVAL_PERCENT.items():
        with open(os.path.join(prompts_dir, f"{domain}.jsonl")) as f:
            items = sorted((json.loads(line) for line in f if line.strip()), key=lambda r: prompt_hash(r["id"]))
        held = [r for r in items if prompt_hash(r["id"]) % 100 < percent]
        train = [r for r in items if prompt_hash(r["id"]) % 100 >= percent]
        held = held if domain == "chat" else held[:EVAL_CAP]
        train = train[:TRAIN_CAP[domain]] if TRAIN_CAP[domain] else train
        rows += [{"domain": domain, "id": r["id"], "prompt": r["prompt"], "split": "eval"} for r in held]
        rows += [{"domain": domain, "id": r["id"], "prompt": r["prompt"], "split": "train"} for r in train]
    if synthetic:
        with open(synthetic) as f:
            rows += [{**json.loads(line), "domain": "synthetic_chat", "split": "train"} for line in f]
    return rows


def synthesize_chat_prompts(llm, path: str, n: int, max_tokens: int = 64, batch: int = 256) -> None:
    """Target-written user turns: the chat template up to the user's turn, sampled (temperature 1, top-p
    0.95) until the turn ends; -> `path` ({id, prompt} per line), until it holds `n` distinct prompts.
    Raises RuntimeError when a round of `batch` samples adds no new one.

    Turns cut at `max_tokens` are dropped. The target is instruction-tuned, so the text it puts in the
    user's place reads as requests of its own chat data (Xu et al. 2024, *Magpie*, §2.1). The held-out
    prompts stay unseen, and its answers to these widen the draft's chat data beyond ~90 human prompts.
    """
    from engine import SamplingParams

    # The user's turn starts where the encodings of two different user turns part.
    a, b = llm.encode([{"role": "user", "content": "A"}]), llm.encode([{"role": "user", "content": "B"}])
    prefix = a[:next(j for j, (x, y) in enumerate(zip(a, b)) if x != y)]
    seen = set()
    if os.path.exists(path):
        with open(path) as f:
            seen = {json.loads(line)["prompt"] for line in f}
        if len(seen) >= n:
            return
        os.remove(path)  # seeds restart at 0: a partial file is made again
        seen = set()
    attempt = 0
    while len(seen) < n:
        params = [SamplingParams(temperature=1.0, top_p=0.95, max_tokens=max_tokens,
                                 seed=prompt_hash(f"magpie#{attempt + j}") % 2**32) for j in range(batch)]
        attempt += batch
        outs = llm.generate([prefix] * batch, params)
        before = len(seen)
        with open(path, "a") as f:
            for out in outs:
                text = llm.tokenizer.decode(out.token_ids).strip()
                if out.finish_reason == "stop" and text and text not in seen and len(seen) < n:
                    seen.add(text)
                    f.write(json.dumps({"id": f"magpie-{len(seen) - 1}", "prompt": text}) + "\n")
        logging.info("synthetic chat prompts: %d/%d after %d samples", len(seen), n, attempt)
        if len(seen) == before:
            raise RuntimeError(f"{attempt} samples gave only {len(seen)} distinct finished user turns, not {n}")


def generate_jobs(rows: list[dict]) -> list[dict]:
    """One request per (prompt, sampling variant): greedy for all, sampled ones for training prompts."""
    jobs = []
    for r in rows:
        variants = [(0.0, 1.0)] + (SAMPLED[r["domain"]] if r["split"] == "train" else [])
        for v, (temperature, top_p) in enumerate(variants):
            jobs.append({**r, "key": f"{r['id']}#{v}", "temperature": temperature, "top_p": top_p,
                         "seed": prompt_hash(f"{r['id']}#{v}") % 2**32})
    return jobs


def select_jobs(jobs: list[dict], max_prompt_tokens: int, max_train_requests: int,
                train_domains: tuple[str, ...] | None = None) -> list[dict]:
    """The requests to run, in order: every eval job, then the train jobs of `train_domains` (None: all) with
    the shortest prompts (ties by key), at most `max_train_requests`; prompts over `max_prompt_tokens` are
    skipped. Jobs need `prompt_ids`. Similar lengths next to each other keep the engine's batch full."""
    jobs = [j for j in jobs if len(j["prompt_ids"]) <= max_prompt_tokens]
    by_length = lambda j: (len(j["prompt_ids"]), j["key"])
    wanted = lambda j: j["split"] == "train" and (train_domains is None or j["domain"] in train_domains)
    train = sorted(filter(wanted, jobs), key=by_length)[:max_train_requests]
    return sorted((j for j in jobs if j["split"] == "eval"), key=by_length) + train


def generate_continuations(workdir: str, config: DataConfig) -> None:
    """The target (through `engine.LLM`) continues every selected job; appends to `continuations.jsonl`.

    Jobs already in the file are skipped, so an interrupted run resumes.
    """
    from engine import LLM, SamplingParams

    path = os.path.join(workdir, "continuations.jsonl")
    done = set()
    if os.path.exists(path):
        with open(path) as f:
            done = {json.loads(line)["key"] for line in f}
    llm = LLM(max_num_seqs=config.generate_batch, kv_cache_bytes=3 << 30)
    synthetic = os.path.join(workdir, SYNTHETIC) if config.synthetic_chat else None
    if synthetic:
        synthesize_chat_prompts(llm, synthetic, config.synthetic_chat, batch=config.generate_batch)
    jobs = [{**job, "prompt_ids": llm.encode([{"role": "user", "content": job["prompt"]}])}
            for job in generate_jobs(split_prompts(config.prompts_dir, synthetic))]
    jobs = select_jobs(jobs, config.max_prompt_tokens, config.max_train_requests, config.train_domains)
    jobs = [j for j in jobs if j["key"] not in done]
    logging.info("generate: %d requests to run (%d done before)", len(jobs), len(done))
    for start in range(0, len(jobs), config.chunk):
        chunk = jobs[start:start + config.chunk]
        t0 = time.perf_counter()
        params = [SamplingParams(temperature=j["temperature"], top_p=j["top_p"], seed=j["seed"],
                                 max_tokens=config.eval_new_tokens if j["split"] == "eval" else config.max_new_tokens)
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


def read_continuations(workdir: str, split: str) -> list[dict]:
    with open(os.path.join(workdir, "continuations.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return sorted((r for r in rows if r["split"] == split), key=lambda r: r["key"])


def dense_rows(S: int, Lq: int):
    """(positions int32 `[S * Lq]`, an `AttendFn`) for `S` right-padded rows of `Lq` tokens flattened:
    causal attention within each row, no cache."""
    import jax
    import jax.numpy as jnp

    from model.ops import dense_attention

    pos = jnp.arange(Lq, dtype=jnp.int32)
    seg = jnp.zeros(Lq, jnp.int32)
    rows = lambda x: x.reshape(S, Lq, *x.shape[1:])

    def attend(q, k, v, _, cache, spec):
        out = jax.vmap(lambda q, k, v: dense_attention(q, k, v, pos, seg, spec))(rows(q), rows(k), rows(v))
        return out.reshape(q.shape), cache

    return jnp.tile(pos, S), attend


def dense_hidden(model, tokens):
    """Final hidden states `[S, Lq, E]` of a right-padded batch `tokens [S, Lq]`, causal per row."""
    S, Lq = tokens.shape
    positions, attend = dense_rows(S, Lq)
    hidden, _ = model(tokens.reshape(-1), positions, attend, None)
    return hidden.reshape(S, Lq, -1)


def batches(lengths: list[int], tokens_per_batch: int, rng=None) -> list[tuple[int, list[int]]]:
    """Groups sequence indices into (padded length Lq, indices) batches of about `tokens_per_batch`
    tokens; Lq is a multiple of 128 (few compiled shapes). Shuffled when `rng` is given."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    by_length: dict[int, list[int]] = {}
    for i in order:
        by_length.setdefault(cdiv(lengths[i], 128) * 128, []).append(i)
    out = []
    for Lq, idx in sorted(by_length.items()):
        if rng is not None:
            idx = [idx[j] for j in rng.permutation(len(idx))]
        S = max(1, tokens_per_batch // Lq)
        out += [(Lq, idx[j:j + S]) for j in range(0, len(idx), S)]
    if rng is not None:
        out = [out[j] for j in rng.permutation(len(out))]
    return out


def pad_batch(seqs: list[list[int]], starts: list[int], Lq: int, S: int, M: int):
    """Right-padded tokens int32 `[S, Lq]`, loss positions int32 `[S, M]` (a row's slot m is position
    start + m) and their validity `[S, M]`; missing rows are all padding."""
    tokens = np.zeros((S, Lq), np.int32)
    where = np.zeros((S, M), np.int32)
    valid = np.zeros((S, M), bool)
    for r, (seq, start) in enumerate(zip(seqs, starts)):
        tokens[r, :len(seq)] = seq
        n = min(len(seq) - 1 - start, M)
        where[r, :n] = start + np.arange(n)
        valid[r, :n] = True
    return tokens, where, valid


def compute_targets(workdir: str, config: DataConfig) -> None:
    """Top-k log-probabilities of the target at every position that predicts a continuation token;
    -> `targets.npz`."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from checkpoints import load_model
    from model.llama import Llama

    records = read_continuations(workdir, "train")
    target = load_model()
    graphdef, state = nnx.split(Llama(target.config, params=target.params))
    M, k = config.max_new_tokens, config.top_k_targets

    @jax.jit
    def top_logprobs(state, tokens, where):
        model = nnx.merge(graphdef, state)
        hidden = jnp.take_along_axis(dense_hidden(model, tokens), where[..., None], axis=1)  # [S, M, E]
        logprobs = jax.nn.log_softmax(model.logits(hidden.reshape(-1, hidden.shape[-1])), axis=-1)
        values, ids = jax.lax.top_k(logprobs, k)
        return values.reshape(*where.shape, k), ids.reshape(*where.shape, k)

    seqs = [r["prompt_ids"] + r["output_ids"] for r in records]
    starts = [len(r["prompt_ids"]) - 1 for r in records]
    values = [None] * len(seqs)
    ids = [None] * len(seqs)
    t0, done = time.perf_counter(), 0
    for Lq, idx in batches([len(s) for s in seqs], config.tokens_per_batch):
        S = max(1, config.tokens_per_batch // Lq)
        tokens, where, _ = pad_batch([seqs[i] for i in idx], [starts[i] for i in idx], Lq, S, M)
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
