"""Offline batch jobs (`engine.batch`): throughput against the bare engine and transformers, and memory.

  python -m benchmarks.batch_jobs [--num_prompts=512] [--max_tokens=32] [--score_texts=128]
      [--memory_lines=200000] [--skip_transformers]

Tables printed:

* generation, real model, greedy, `--num_prompts` real prompts (chat, code,
  creative, math in turn) as chat messages: the batch job over a JSONL file
  (parsing, tokenizing, JSON records, ordered writes) against the bare engine
  on the same pre-tokenized requests (`Engine.add_request` / `step`), and
  against transformers' batched `generate` with left padding on the same
  token ids (batch `--hf_batch`, greedy, `max_new_tokens` forced);
* scoring: `--score_texts` summarization articles, tokens scored per second
  by the job (score mode) against transformers forward passes (batch 1,
  log-softmax at every position);
* memory: resident set size over a `--memory_lines` input on the tiny model
  (max_tokens 1), sampled as the job reads it.

The engine runs are timed after a warm-up run that compiles every bucket;
the prefix cache (on, the engine's default) is emptied before each.
"""

from __future__ import annotations

import json
import os
import tempfile
import time

from absl import app, flags

from benchmarks.baselines import hf_batch, hf_setup, prompts_dir

flags.DEFINE_integer("num_prompts", 512, "Generation prompts.")
flags.DEFINE_integer("max_tokens", 32, "Tokens generated per prompt.")
flags.DEFINE_integer("max_inflight", 256, "The job's --max_inflight.")
flags.DEFINE_integer("max_num_seqs", 128, "Engine batch size (engine.batch's default).")
flags.DEFINE_integer("hf_batch", 32, "transformers generate batch size.")
flags.DEFINE_integer("score_texts", 128, "Texts scored (summarization articles).")
flags.DEFINE_integer("memory_lines", 200_000, "Lines of the memory run (tiny model); 0 skips it.")
flags.DEFINE_bool("skip_transformers", False, "Skip the transformers baselines.")
flags.DEFINE_bool("prefix_caching", True, "The engine's prefix cache (reset before each timed run).")
flags.DEFINE_bool("score", True, "Run the scoring comparison.")
flags.DEFINE_enum("kernel_dtype", None, ["float32", "bfloat16"], "The engine's kernel_dtype (bfloat16: one AMX pass).")
flags.DEFINE_enum("hf_dtype", "float32", ["float32", "bfloat16"], "transformers' dtype.")
FLAGS = flags.FLAGS

DOMAINS = ("chat", "code", "creative", "math")


def real_prompts(n: int) -> list[str]:
    by_domain = []
    for d in DOMAINS:
        with open(os.path.join(prompts_dir(), f"{d}.jsonl")) as f:
            by_domain.append([json.loads(line)["prompt"] for line in f if line.strip()])
    out, i = [], 0
    while len(out) < n:  # round robin over the domains
        pool = by_domain[i % len(by_domain)]
        if i // len(by_domain) < len(pool):
            out.append(pool[i // len(by_domain)])
        i += 1
    return out


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def run_job(llm, path: str, out_path: str, mode: str = "generate", progress=None) -> tuple[float, object]:
    from engine.batch.io import Resume, Writer, read_lines
    from engine.batch.job import BatchJob

    writer = Writer(out_path, ordered=True, overwrite=True)
    job = BatchJob(llm, mode, writer, FLAGS.max_inflight, None, "smollm2")
    t = time.perf_counter()
    summary = job.run(read_lines(path), Resume(), progress)
    writer.close()
    return time.perf_counter() - t, summary


def bare_engine(engine, prompt_ids: list[list[int]], sp) -> tuple[float, int]:
    t = time.perf_counter()
    for ids in prompt_ids:
        engine.add_request(ids, sp)
    n = 0
    while engine.has_unfinished():
        n += sum(len(o.delta_token_ids) for o in engine.step())
    return time.perf_counter() - t, n


def hf_generate_all(model, prompt_ids, n: int, pad_id: int) -> float:
    import torch
    from transformers import GenerationConfig
    gc = GenerationConfig(do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=pad_id,
                          eos_token_id=model.generation_config.eos_token_id, use_cache=True)
    order = sorted(range(len(prompt_ids)), key=lambda i: len(prompt_ids[i]))  # less padding: kinder to it
    t = time.perf_counter()
    with torch.inference_mode():
        for s in range(0, len(order), FLAGS.hf_batch):
            ids, mask = hf_batch([prompt_ids[i] for i in order[s:s + FLAGS.hf_batch]], pad_id)
            model.generate(input_ids=ids, attention_mask=mask, generation_config=gc)
    return time.perf_counter() - t


def hf_score_all(model, seqs: list[list[int]]) -> float:
    import torch
    t = time.perf_counter()
    with torch.inference_mode():
        for ids in seqs:
            x = torch.tensor([ids])
            logits = model(input_ids=x).logits[0, :-1]
            torch.log_softmax(logits, dim=-1).gather(-1, x[0, 1:, None]).sum().item()
    return time.perf_counter() - t


class _RssProbe:
    """A stand-in for the tqdm bar that records (bytes read, RSS MiB) as the job reads its input."""

    def __init__(self, total: int, points: int = 10):
        self.total, self.step, self.read, self.samples = total, total / points, 0, [(0, rss_mib())]

    def update(self, n):
        self.read += n
        if self.read >= len(self.samples) * self.step:
            self.samples.append((self.read, rss_mib()))

    def set_postfix(self, **_):
        pass


def memory_run(n_lines: int, tmp: str) -> list[tuple[int, float]]:
    from engine import LLM
    llm = LLM("tiny-llama", speculative=None, num_blocks=1024, max_num_seqs=64, max_num_batched_tokens=256)
    path = os.path.join(tmp, "memory.jsonl")
    with open(path, "w") as f:
        for i in range(n_lines):
            f.write(json.dumps({"id": i, "prompt": f"line {i} of the memory run", "max_tokens": 1,
                                "temperature": 0}) + "\n")
    probe = _RssProbe(os.path.getsize(path))
    dt, summary = run_job(llm, path, os.path.join(tmp, "memory.out.jsonl"), progress=probe)
    probe.samples.append((probe.read, rss_mib()))
    print(f"\nmemory: {n_lines} lines (tiny model, max_tokens 1) in {dt:.0f} s, {summary.lines_ok} ok")
    print("| input read | RSS (MiB) |\n|---:|---:|")
    for read, rss in probe.samples:
        print(f"| {read / probe.total:.0%} | {rss:.0f} |")
    return probe.samples


def main(argv):
    del argv
    from checkpoints import default_gguf_path
    from engine import LLM, SamplingParams

    tmp = tempfile.mkdtemp(prefix="batch_bench_")
    llm = LLM(speculative=None, max_num_seqs=FLAGS.max_num_seqs, kv_cache_bytes=3 << 30,
              enable_prefix_caching=FLAGS.prefix_caching, kernel_dtype=FLAGS.kernel_dtype)
    prompts = real_prompts(FLAGS.num_prompts)
    path = os.path.join(tmp, "gen.jsonl")
    with open(path, "w") as f:
        for i, p in enumerate(prompts):
            f.write(json.dumps({"id": i, "messages": [{"role": "user", "content": p}], "max_tokens": FLAGS.max_tokens,
                                "temperature": 0, "ignore_eos": True}) + "\n")
    prompt_ids = [llm.encode([{"role": "user", "content": p}]) for p in prompts]
    sp = SamplingParams(temperature=0, max_tokens=FLAGS.max_tokens, ignore_eos=True)
    n_prompt = sum(map(len, prompt_ids))
    print(f"{len(prompts)} prompts ({n_prompt} prompt tokens, mean {n_prompt / len(prompts):.0f}), "
          f"{FLAGS.max_tokens} tokens each, greedy; engine max_num_seqs {FLAGS.max_num_seqs}", flush=True)
    run_job(llm, path, os.path.join(tmp, "warm.jsonl"))  # compiles every bucket the job meets
    llm.engine.blocks.reset_prefix_cache()  # each timed run starts with an empty cache
    job_s, summary = run_job(llm, path, os.path.join(tmp, "gen.out.jsonl"))
    llm.engine.blocks.reset_prefix_cache()
    bare_s, n_bare = bare_engine(llm.engine, prompt_ids, sp)
    if summary.as_dict()["prefix_cache_hit_rate"] is not None:
        print(f"prefix cache hits in the job: {summary.as_dict()['prefix_cache_hit_rate']:.1%} of prompt tokens "
              "(the chat template's system prompt)")
    n_gen = summary.generated_tokens
    rows = [("batch job (engine.batch)", job_s, n_gen), ("bare engine (add_request / step)", bare_s, n_bare)]
    hf_s = model = None
    if not FLAGS.skip_transformers:
        model = hf_setup(default_gguf_path(), FLAGS.hf_dtype)
        pad = llm.tokenizer.eos_token_ids[0]
        hf_generate_all(model, prompt_ids[:FLAGS.hf_batch], 2, pad)  # warm-up
        hf_s = hf_generate_all(model, prompt_ids, FLAGS.max_tokens, pad)
        rows.append((f"transformers generate ({FLAGS.hf_dtype}, batch {FLAGS.hf_batch}, left padding)", hf_s,
                     FLAGS.max_tokens * len(prompts)))
    print("\n| generation | wall s | generated tok/s | job ÷ this |\n|---|---:|---:|---:|")
    for name, s, n in rows:
        print(f"| {name} | {s:.1f} | {n / s:.1f} | {s / job_s:.2f}x |")
    print(f"\njob vs bare engine: {bare_s / job_s:.3f}x (target >= 0.95x)"
          + (f"; vs transformers: {hf_s / job_s:.2f}x (target >= 3x)" if hf_s else ""))

    if FLAGS.score:
        score_table(llm, tmp, None if FLAGS.skip_transformers else model)
    if FLAGS.memory_lines:
        memory_run(FLAGS.memory_lines, tmp)


def score_table(llm, tmp: str, model) -> None:
    with open(os.path.join(prompts_dir(), "summarization.jsonl")) as f:
        texts = [json.loads(line)["prompt"] for line in f if line.strip()][:FLAGS.score_texts]
    spath = os.path.join(tmp, "score.jsonl")
    with open(spath, "w") as f:
        for i, t in enumerate(texts):
            f.write(json.dumps({"id": i, "text": t}) + "\n")
    run_job(llm, spath, os.path.join(tmp, "score.warm.jsonl"), "score")
    score_s, ssum = run_job(llm, spath, os.path.join(tmp, "score.out.jsonl"), "score")
    print(f"\n| scoring ({len(texts)} texts, {ssum.scored_tokens} tokens) | wall s | tokens/s |\n|---|---:|---:|")
    print(f"| batch job, score mode | {score_s:.1f} | {ssum.scored_tokens / score_s:.0f} |")
    if model is not None:
        seqs = [llm.encode(t)[:llm.engine.max_model_len] for t in texts]
        hf_score_all(model, seqs[:2])
        hf_score = hf_score_all(model, seqs)
        print(f"| transformers forward ({FLAGS.hf_dtype}, batch 1) | {hf_score:.1f} | {ssum.scored_tokens / hf_score:.0f} |")
        print(f"\nscoring vs transformers: {hf_score / score_s:.2f}x (target >= 1.5x)")


if __name__ == "__main__":
    app.run(main)
