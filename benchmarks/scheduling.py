"""Scheduler benchmarks on the real model (SmolLM2-135M-Instruct, fp32, CPU): four tables.

  python benchmarks/scheduling.py [--num_requests=48] [--batch=16] [--parts=batching,memory,ttft,host]

Workload: real chat prompts (chat template applied), greedy, `ignore_eos`,
output lengths drawn from a geometric distribution with mean --mean_output
clipped to [1, --max_output] (seed --seed).

* batching: the same requests with continuous batching (`LLM.generate` of
  all of them, at most --batch running at once, new ones admitted as others
  finish) and with static batching (groups of --batch in arrival order; each
  group runs to its longest output, as a pad-to-longest batch would, and the
  next group starts when it ends). Throughput counts only requested tokens.
  Every bucket is compiled before timing.
* memory: concurrent sequences the engine's KV pool (default 1 GiB) holds,
  paged (peak running sequences of the scheduler driven through the whole
  workload with --memory_requests requests, host-only simulation with the real
  prompt lengths) vs contiguous allocation of `max_model_len` per request
  (pool tokens // max_model_len).
* ttft: time to first token of prompts that start with the same 512-token
  system prompt (real text) followed by a different question, with the prefix
  cache on (after one request warmed it) and off; medians over --ttft_requests.
* host: --host_running requests decoding together (16-token prompts); host
  time per step (scheduling, packing, block ops, outputs and detokenizing)
  against the whole step, over steps where all of them run.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

from benchmarks.baselines import read_prompts  # noqa: E402  (defines --prompts_dir)

FLAGS = flags.FLAGS
flags.DEFINE_list("parts", ["batching", "memory", "ttft", "host"], "Which tables to print.")
flags.DEFINE_integer("num_requests", 48, "Requests in the batching comparison.")
flags.DEFINE_integer("batch", 16, "Running requests at once (continuous) and group size (static).")
flags.DEFINE_integer("mean_output", 64, "Mean of the geometric output length.")
flags.DEFINE_integer("max_output", 512, "Output length cap.")
flags.DEFINE_integer("memory_requests", 2000, "Requests in the host-only memory simulation.")
flags.DEFINE_integer("ttft_requests", 8, "Timed requests per TTFT setting.")
flags.DEFINE_integer("host_running", 256, "Running requests in the host-overhead measurement.")
flags.DEFINE_integer("seed", 0, "Workload seed.")

def _read(domain):
    return [r["prompt"] for r in read_prompts(domain)]


def _lengths(n, rng):
    return np.minimum(rng.geometric(1 / FLAGS.mean_output, n), FLAGS.max_output).tolist()


def batching(model, prompts, rng):
    from engine import LLM, SamplingParams

    lengths = _lengths(FLAGS.num_requests, rng)
    ids = [prompts[i % len(prompts)] for i in range(FLAGS.num_requests)]
    llm = LLM(model, max_num_seqs=FLAGS.batch, max_num_batched_tokens=256)
    llm.engine.precompile()

    def params(n):
        return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)

    t = time.perf_counter()
    outs = llm.generate(ids, [params(n) for n in lengths])
    continuous = time.perf_counter() - t
    assert [len(o.token_ids) for o in outs] == lengths
    t = time.perf_counter()
    for g in range(0, len(ids), FLAGS.batch):
        group = ids[g:g + FLAGS.batch]
        llm.generate(group, params(max(lengths[g:g + FLAGS.batch])))
    static = time.perf_counter() - t
    useful = sum(lengths)
    print(f"\n## Continuous vs static batching ({FLAGS.num_requests} requests, at most {FLAGS.batch} at once, "
          f"output mean {np.mean(lengths):.1f} max {max(lengths)})\n")
    print("| batching | time (s) | requested tokens/s |")
    print("|---|---:|---:|")
    print(f"| continuous | {continuous:.1f} | {useful / continuous:.1f} |")
    print(f"| static (pad to longest) | {static:.1f} | {useful / static:.1f} |")
    print(f"\ncontinuous / static throughput: **{static / continuous:.2f}x**")


def memory(model, prompts, rng):
    from engine import EngineConfig
    from scheduler.block_manager import BlockManager
    from scheduler.request import Request, SamplingParams
    from scheduler.scheduler import Scheduler, SchedulerConfig

    cfg, ec = model.config, EngineConfig()
    bytes_per_block = 2 * cfg.num_layers * ec.block_size * cfg.num_kv_heads * cfg.head_dim * 4
    num_blocks = ec.kv_cache_bytes // bytes_per_block
    bm = BlockManager(num_blocks, ec.block_size, enable_prefix_cache=False)
    max_model_len = cfg.max_position_embeddings
    sch = Scheduler(SchedulerConfig(max_num_seqs=10**6, max_num_batched_tokens=1 << 20,
                                    max_model_len=max_model_len), bm)
    lengths = _lengths(FLAGS.memory_requests, rng)
    for i, n in enumerate(lengths):
        sch.add(Request(prompts[i % len(prompts)], SamplingParams(max_tokens=n, ignore_eos=True)))
    peak = 0
    while sch.has_unfinished():
        plan = sch.schedule()
        peak = max(peak, len(sch.running))
        sch.commit(plan)
        for s in plan.seqs:
            if s.sample and (reason := s.request.append_token(5, max_model_len)) is not None:
                sch.finish(s.request, reason)
    contiguous = (bm.num_usable_blocks * ec.block_size) // max_model_len
    print(f"\n## Concurrent sequences in a {ec.kv_cache_bytes / 2**30:.0f} GiB KV pool "
          f"({bm.num_usable_blocks} blocks of {ec.block_size} tokens, max_model_len {max_model_len})\n")
    print("| allocation | concurrent sequences |")
    print("|---|---:|")
    print(f"| paged (peak running, {FLAGS.memory_requests} requests) | {peak} |")
    print(f"| contiguous, max_model_len each | {contiguous} |")
    print(f"\npaged / contiguous: **{peak / max(contiguous, 1):.0f}x**")


def ttft(model, rng):
    from engine import LLM, SamplingParams

    tok = model.tokenizer
    system = tok.encode(" ".join(_read("long_context")[:3]))[:512]
    questions = [tok.encode(f"\n\nQuestion: {q}\nAnswer:") for q in _read("chat")[:FLAGS.ttft_requests + 1]]
    results = {}
    for cached in (False, True):
        llm = LLM(model, max_num_seqs=4, max_num_batched_tokens=1024, enable_prefix_caching=cached)
        engine = llm.engine
        engine.precompile([(t, 1) for t in engine.runner.token_buckets])
        times, hits = [], []
        for i, q in enumerate(questions):
            t = time.perf_counter()
            engine.add_request(system + q, SamplingParams(temperature=0, max_tokens=1))
            out = []
            while not out:
                out = engine.step()
            if i > 0:  # the first request (with the cache on) fills the cache
                times.append(time.perf_counter() - t)
                hits.append(out[0].num_cached_tokens)
        results[cached] = (statistics.median(times), statistics.mean(hits))
    print(f"\n## TTFT with a shared 512-token system prompt (median of {FLAGS.ttft_requests})\n")
    print("| prefix cache | TTFT (ms) | cached prompt tokens |")
    print("|---|---:|---:|")
    for cached, (t, h) in results.items():
        print(f"| {'on' if cached else 'off'} | {t * 1e3:.0f} | {h:.0f} |")
    print(f"\ncached / uncached TTFT: **{results[True][0] / results[False][0]:.2f}**")


def host(model, rng):
    from engine import LLM, SamplingParams

    n = FLAGS.host_running
    llm = LLM(model, max_num_seqs=n, max_num_batched_tokens=512)
    engine = llm.engine
    prompts = [rng.integers(100, 40000, 16).tolist() for _ in range(n)]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for p in prompts:
        engine.add_request(p, sp)
    while len(engine.scheduler.running) < n or engine.scheduler.waiting or any(
            r.num_computed_tokens < r.num_tokens - 1 for r in engine.scheduler.running):
        engine.step()  # prefill (and compile)
    engine.step()  # compile the decode bucket
    host0, dev0, steps = engine.stats.host_seconds, engine.stats.device_seconds, 0
    while len(engine.scheduler.running) == n and steps < 16:
        engine.step()
        steps += 1
    h, d = (engine.stats.host_seconds - host0) / steps, (engine.stats.device_seconds - dev0) / steps
    while engine.has_unfinished():
        engine.step()
    print(f"\n## Host overhead at {n} running requests ({steps} decode steps)\n")
    print("| host ms/step | device ms/step | host share of the step |")
    print("|---:|---:|---:|")
    print(f"| {h * 1e3:.1f} | {d * 1e3:.1f} | **{h / (h + d):.1%}** |")


def main(argv):
    del argv
    from checkpoints import load_model

    model = load_model()
    rng = np.random.default_rng(FLAGS.seed)
    prompts = [model.tokenizer.encode(model.tokenizer.apply_chat_template(
        [{"role": "user", "content": p}], add_generation_prompt=True)) for p in _read("chat")]
    print(f"# Scheduler benchmarks ({time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPUs, real model fp32)")
    for part in FLAGS.parts:
        if part == "batching":
            batching(model, prompts, rng)
        elif part == "memory":
            memory(model, prompts, rng)
        elif part == "ttft":
            ttft(model, rng)
        elif part == "host":
            host(model, rng)
        else:
            raise app.UsageError(f"unknown part {part!r}")


if __name__ == "__main__":
    app.run(main)
