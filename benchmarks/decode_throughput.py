"""Decode throughput, prefill latency and the memory-bandwidth roofline, real model, fp32, CPU.

Compares this engine with Hugging Face transformers on the same machine and
the same prompt token ids (SmolLM2-135M-Instruct, the Q4_1 GGUF dequantized to
float32 by both), and against a roofline measured in the same run.

  python benchmarks/decode_throughput.py [--batch_sizes=1,8] [--decode_tokens=64]
      [--prefill_len=512] [--repeats=3] [--skip_transformers] [--temperature=0.8]

What is measured (medians over --repeats, after a warm-up run so no
compilation is timed; each repeat runs the engine and transformers measurements
back to back so both see the same background load, which is also reported):

* engine decode: the requests are added, the step(s) that prefill them (and
  sample their first token) run untimed, then every following `Engine.step()`
  is timed with the wall clock until all requests have `decode_tokens` tokens.
  The timed steps are whole engine steps: scheduling, packing, host-to-device
  copies, the jitted forward + sampling, the token read-back, detokenizing.
  tok/s = tokens from the timed steps / time; ms/step = time / timed steps.
* transformers decode: greedy `generate` (min_new_tokens = max_new_tokens, so
  no early stop), inference_mode, left-padded batch with an attention mask.
  Decode-only time per step = (t(prefill + N tokens) - t(prefill + 1 token)) / (N - 1),
  each t the median over repeats.
* roofline: copy bandwidth BW = (bytes read + bytes written) / time of
  `np.copyto` between two preallocated --copy_mb arrays (the best of 1 thread and
  one thread per CPU, each over several repeats, at the start and the end of
  the run). Batch-1 decode must read every weight once per token, so
  roofline tok/s = BW / weight bytes, where weight bytes = all parameters in
  fp32, the tied embedding counted once (read as the LM head; the
  embedding-row lookup is negligible). KV-cache reads (~1% here) are ignored.
* prefill: time to first token of one --prefill_len-token prompt (real text from
  long_context.jsonl, truncated) in one engine step (max_num_batched_tokens >=
  prefill_len), vs a transformers forward on the same ids with logits_to_keep=1
  (what `generate` does for its prefill) plus the argmax.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import json
import os
import platform
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from absl import app, flags  # noqa: E402

from benchmarks.baselines import hf_batch, hf_setup, prompts_dir  # noqa: E402
import numpy as np  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_list("batch_sizes", ["1", "8"], "Decode batch sizes.")
flags.DEFINE_integer("decode_tokens", 64, "Tokens generated per request (the first comes from prefill).")
flags.DEFINE_integer("prefill_len", 512, "Prompt length of the prefill (TTFT) measurement.")
flags.DEFINE_integer("repeats", 3, "Timed repeats per measurement (medians are reported).")
flags.DEFINE_bool("skip_transformers", False, "Skip the Hugging Face transformers baseline.")
flags.DEFINE_integer("copy_mb", 512, "Size of each array in the bandwidth measurement, MiB (>= 256).")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Engine weight dtype (transformers stays fp32).")
flags.DEFINE_enum("matmul", "auto", ["auto", "xla"], "Engine products over few tokens: the CPU kernel or XLA's dot.")
flags.DEFINE_enum("kernel_dtype", None, ["float32", "bfloat16", "int8"],
                  "Weights the CPU kernel streams (default: the model's dtype).")
flags.DEFINE_enum("attention", "auto", ["auto", "reference", "native"], "Engine paged attention on CPU.")
flags.DEFINE_float("temperature", 0.0, "Engine sampling temperature (seeded, top-p 0.95 when > 0); 0 is greedy.")
flags.DEFINE_bool("breakdown", True, "Also time the pieces of an engine decode step (host vs device).")

FALLBACK_PROMPTS = [
    "Explain why the sky is blue in a few sentences.",
    "Write a short poem about the sea.",
    "What are three tips for staying productive when working from home?",
    "Summarize the plot of Romeo and Juliet.",
    "How does a refrigerator keep food cold?",
    "Give me a recipe for a simple tomato soup.",
    "What is the difference between a virus and a bacterium?",
    "Describe a sunrise over the mountains.",
]
FALLBACK_LONG = ("The history of computing spans centuries, from the abacus and mechanical calculators "
                 "to electronic computers, transistors, integrated circuits and networks. ") * 64


# ---- inputs --------------------------------------------------------------------------------

def read_jsonl(name: str, n: int) -> list[str] | None:
    d = prompts_dir()
    path = os.path.join(d, name) if d else None
    if not path or not os.path.isfile(path):
        return None
    out = []
    with open(path) as f:
        for line in f:
            if line.strip():
                out.append(json.loads(line)["prompt"])
            if len(out) == n:
                break
    return out if len(out) == n else None


# ---- roofline ------------------------------------------------------------------------------

def copy_bandwidth(mib: int, repeats: int) -> dict:
    """(bytes read + bytes written) / s of np.copyto, 1 thread and one per CPU; best of each."""
    n = mib * (1 << 20) // 4
    src = np.ones(n, np.float32)
    dst = np.zeros(n, np.float32)  # touched: no page faults in the timed copies
    threads = os.cpu_count() or 1
    pool = concurrent.futures.ThreadPoolExecutor(threads)
    bounds = np.linspace(0, n, threads + 1).astype(np.int64)

    def parallel_copy():  # np.copyto releases the GIL for plain dtypes
        list(pool.map(lambda i: np.copyto(dst[bounds[i]:bounds[i + 1]], src[bounds[i]:bounds[i + 1]]),
                      range(threads)))

    result = {}
    for name, fn in (("1 thread", lambda: np.copyto(dst, src)), (f"{threads} threads", parallel_copy)):
        fn()  # warm-up
        times = []
        for _ in range(max(5, repeats)):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        result[name] = 2 * src.nbytes / min(times)  # best: the machine's capability under noise
    pool.shutdown()
    return result


def gemv_read_bandwidth(mib: int, repeats: int) -> float:
    """Bytes read / s of a jitted fp32 matrix-vector product over a `mib` MiB matrix (XLA:CPU), best of repeats.

    What a batch-1 decode step does with each weight matrix, at a size no cache holds.
    """
    import jax
    import jax.numpy as jnp

    a = jnp.ones((mib * (1 << 20) // (4 * 4096), 4096), jnp.float32)
    v = jnp.ones((4096,), jnp.float32)
    gemv = jax.jit(lambda a, v: a @ v)
    gemv(a, v).block_until_ready()
    times = []
    for _ in range(max(5, repeats)):
        t = time.perf_counter()
        gemv(a, v).block_until_ready()
        times.append(time.perf_counter() - t)
    return a.nbytes / min(times)


class CpuMonitor:
    """CPU used by other processes since construction, in CPUs (from /proc/stat minus this process)."""

    def __init__(self):
        self.t, self.busy, self.own = time.perf_counter(), self._busy(), self._own()

    @staticmethod
    def _busy() -> float | None:
        try:
            with open("/proc/stat") as f:
                v = [int(x) for x in f.readline().split()[1:]]
        except OSError:
            return None
        return (sum(v[:8]) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait

    @staticmethod
    def _own() -> float:
        t = os.times()
        return t.user + t.system

    def other_cpus(self) -> float | None:
        busy = self._busy()
        if busy is None or self.busy is None:
            return None
        return max(0.0, (busy - self.busy) - (self._own() - self.own)) / (time.perf_counter() - self.t)


# ---- engine --------------------------------------------------------------------------------

def engine_decode(engine, prompt_ids: list[list[int]], n_tokens: int, on_prefilled=lambda: None):
    """Runs one batch; returns (decode seconds, decode steps, tokens from them, tokens per request).

    The step(s) until every request has its first token are untimed; when the
    prompts exceed one step's token budget, some requests start decoding there.
    """
    from engine import SamplingParams
    t = FLAGS.temperature
    sp = SamplingParams(temperature=t, top_p=0.95 if t > 0 else 1.0, seed=0 if t > 0 else None, max_tokens=n_tokens,
                        ignore_eos=True)
    reqs = [engine.add_request(ids, sp) for ids in prompt_ids]
    while any(len(r.output_token_ids) == 0 for r in reqs):  # prefill (untimed)
        engine.step()
    on_prefilled()
    before = sum(len(r.output_token_ids) for r in reqs)
    steps, total = 0, 0.0
    while engine.has_unfinished():
        t = time.perf_counter()
        engine.step()
        total += time.perf_counter() - t
        steps += 1
    tokens = sum(len(r.output_token_ids) for r in reqs) - before
    return total, steps, tokens, [list(r.output_token_ids) for r in reqs]


def engine_ttft(engine, ids: list[int]) -> float:
    """Seconds from submitting the prompt to its first token, never from the prefix cache (a fresh salt)."""
    from engine import SamplingParams
    t = time.perf_counter()
    engine.add_request(ids, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
                       cache_salt=f"ttft-{time.perf_counter_ns()}")
    while not engine.step():
        pass
    dt = time.perf_counter() - t
    assert not engine.has_unfinished()
    return dt


def engine_step_breakdown(engine, prompt_ids: list[list[int]], n_tokens: int) -> dict:
    """Per-decode-step milliseconds of the phases of Engine.step, from the engine's own `StepTiming`s.

    "jit step (device)" runs from dispatching the step program to its outputs
    on the host; everything else is host work.
    """
    rows = {"schedule": ("schedule", "block_ops"), "pack": ("pack",), "to_device": ("to_device",),
            "jit step (device)": ("device",), "append+detok": ("update",)}
    acc = dict.fromkeys(rows, 0.0)
    timings = []
    engine.on_step = timings.append
    try:
        total, steps, _, _ = engine_decode(engine, prompt_ids, n_tokens, on_prefilled=timings.clear)
    finally:
        engine.on_step = None
    for t in timings:
        for row, phases in rows.items():
            acc[row] += sum(getattr(t, p) for p in phases)
    out = {k: 1e3 * v / steps for k, v in acc.items()}
    out["other"] = 1e3 * total / steps - sum(out.values())
    out["total"] = 1e3 * total / steps
    return out


def pure_step_ms(engine, prompt_ids: list[list[int]], repeats: int) -> float:
    """Median ms of the jitted step alone on a fixed decode batch (inputs already on device)."""
    import jax
    from engine import SamplingParams
    from engine.step import StepBatch
    # max_tokens leaves room: no request may finish while a longer prompt is still prefilling.
    sp = SamplingParams(temperature=0, max_tokens=1024, ignore_eos=True)
    reqs = [engine.add_request(ids, sp) for ids in prompt_ids]
    while any(len(r.output_token_ids) == 0 for r in reqs):
        engine.step()
    plan = engine.scheduler.schedule()  # the decode step, planned but never committed
    assert len(plan.seqs) == len(reqs) and plan.num_tokens == len(reqs), "not a pure decode step"
    runner = engine.runner
    packed = runner.pack(plan, {r.request_id: 0 for r in reqs})  # greedy: seeds do not matter
    batch = jax.block_until_ready(StepBatch.from_packed(packed))
    times = []
    for _ in range(max(10, 3 * repeats)):
        t = time.perf_counter()
        jax.block_until_ready(runner.execute(batch, None, None))
        times.append(time.perf_counter() - t)
    for r in reqs:
        engine.abort(r.request_id)
    return 1e3 * statistics.median(times)


# ---- transformers --------------------------------------------------------------------------

def hf_generate(model, ids, mask, n: int, pad_id: int):
    import torch
    from transformers import GenerationConfig
    gc = GenerationConfig(do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=pad_id,
                          eos_token_id=model.generation_config.eos_token_id, use_cache=True)
    with torch.inference_mode():
        t = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=gc)
        dt = time.perf_counter() - t
    return dt, out[:, ids.shape[1]:].tolist()


def hf_prefill(model, ids: list[int]) -> float:
    import torch
    x = torch.tensor([ids])
    with torch.inference_mode():
        t = time.perf_counter()
        logits = model(input_ids=x, logits_to_keep=1).logits
        int(logits[0, -1].argmax())
        return time.perf_counter() - t


# ---- main ----------------------------------------------------------------------------------

def fmt(x, spec=".1f", suffix=""):
    return "n/a" if x is None else f"{x:{spec}}{suffix}"


def main(argv):
    del argv
    t_start = time.perf_counter()
    import jax
    import torch
    from checkpoints import default_gguf_path
    from engine import LLM

    batch_sizes = [int(b) for b in FLAGS.batch_sizes]
    N, R = FLAGS.decode_tokens, FLAGS.repeats
    if N < 2:
        raise app.UsageError("--decode_tokens must be >= 2 (the first token comes from prefill)")
    if FLAGS.copy_mb < 256:
        raise app.UsageError("--copy_mb must be >= 256")
    log = lambda *a: print(*a, file=sys.stderr, flush=True)  # noqa: E731

    # Inputs.
    chat = read_jsonl("chat.jsonl", max(batch_sizes))
    source = "chat.jsonl" if chat else "built-in list"
    chat = chat or [FALLBACK_PROMPTS[i % len(FALLBACK_PROMPTS)] for i in range(max(batch_sizes))]
    long_text = (read_jsonl("long_context.jsonl", 1) or [FALLBACK_LONG])[0]

    llm = LLM(dtype=FLAGS.dtype, matmul=FLAGS.matmul, kernel_dtype=FLAGS.kernel_dtype, attention=FLAGS.attention,
              max_num_batched_tokens=max(512, FLAGS.prefill_len),
              max_num_seqs=max(64, max(batch_sizes)))
    engine = llm.engine
    prompt_ids = [llm.encode([{"role": "user", "content": p}]) for p in chat]
    long_ids = llm.tokenizer.encode(long_text)[:FLAGS.prefill_len]
    if len(long_ids) < FLAGS.prefill_len:
        long_ids = (long_ids * (FLAGS.prefill_len // len(long_ids) + 1))[:FLAGS.prefill_len]
    # The weights a decode step reads once: the CPU kernel's packed copies when it runs (in their dtype), else
    # the model's own.
    weight_bytes = engine.runner.packed_bytes or sum(x.nbytes for x in jax.tree_util.tree_leaves(engine.runner.state))
    n_params = engine.model_config.num_params

    monitor = CpuMonitor()

    # Roofline.
    log("measuring copy bandwidth ...")
    bw_start = copy_bandwidth(FLAGS.copy_mb, R)

    model = None
    if not FLAGS.skip_transformers:
        log("loading transformers model ...")
        model = hf_setup(default_gguf_path())
        pad_id = model.generation_config.pad_token_id
        pad_id = pad_id if pad_id is not None else 0
        hf_inputs = {b: hf_batch(prompt_ids[:b], pad_id) for b in batch_sizes}

    # Warm-up (compilation, allocator, caches), untimed.
    log("warm-up ...")
    for b in batch_sizes:
        engine_decode(engine, prompt_ids[:b], N)  # compiles the prefill and decode shapes
        if model is not None:
            hf_generate(model, *hf_inputs[b], N, pad_id)
    engine_ttft(engine, long_ids)
    if model is not None:
        hf_prefill(model, long_ids)

    # Timed repeats, engine and transformers interleaved so both see the same background load.
    eng_runs = {b: [] for b in batch_sizes}
    hf_runs = {b: {"t1": [], "tN": []} for b in batch_sizes}
    eng_ttfts, hf_ttfts, hf_tokens, load = [], [], {}, []
    for r in range(R):
        log(f"repeat {r + 1}/{R} ...")
        m = CpuMonitor()
        for b in batch_sizes:
            eng_runs[b].append(engine_decode(engine, prompt_ids[:b], N))
            if model is not None:
                hf_runs[b]["t1"].append(hf_generate(model, *hf_inputs[b], 1, pad_id)[0])
                dt, toks = hf_generate(model, *hf_inputs[b], N, pad_id)
                hf_runs[b]["tN"].append(dt)
                hf_tokens.setdefault(b, toks)
        eng_ttfts.append(engine_ttft(engine, long_ids))
        if model is not None:
            hf_ttfts.append(hf_prefill(model, long_ids))
        load.append(m.other_cpus())

    eng, eng_tokens = {}, {}
    for b, runs in eng_runs.items():
        eng_tokens[b] = runs[0][3]
        eng[b] = {"ms": 1e3 * statistics.median(r[0] / r[1] for r in runs),
                  "tps": statistics.median(r[2] / r[0] for r in runs), "steps": runs[0][1],
                  "tokens": runs[0][2], "all_ms": [1e3 * r[0] / r[1] for r in runs]}
    eng_ttft = statistics.median(eng_ttfts)
    hf, hf_ttft, agree = {}, None, {}
    if model is not None:
        for b, runs in hf_runs.items():
            t1, tN = statistics.median(runs["t1"]), statistics.median(runs["tN"])
            per_step = (tN - t1) / (N - 1)
            hf[b] = {"ms": 1e3 * per_step, "tps": b / per_step, "t1": t1, "tN": tN,
                     "all_ms": [1e3 * (n - o) / (N - 1) for o, n in zip(runs["t1"], runs["tN"])]}
            if FLAGS.temperature > 0:
                continue
            # Greedy agreement: tokens before the first divergence, per request.
            agree[b] = [next((i for i, (x, y) in enumerate(zip(e, h)) if x != y), min(len(e), len(h)))
                        for e, h in zip(eng_tokens[b], hf_tokens[b])]
        hf_ttft = statistics.median(hf_ttfts)

    # Breakdown of an engine decode step (untimed in the table).
    breakdown, pure = {}, {}
    if FLAGS.breakdown:
        for b in batch_sizes:
            log(f"engine step breakdown, batch {b} ...")
            breakdown[b] = engine_step_breakdown(engine, prompt_ids[:b], N)
            pure[b] = pure_step_ms(engine, prompt_ids[:b], R)
    log("measuring copy bandwidth again ...")
    bw_end = copy_bandwidth(FLAGS.copy_mb, R)
    read_bw = gemv_read_bandwidth(FLAGS.copy_mb, R)
    background = monitor.other_cpus()
    # Bandwidth is shared with whatever else runs on the host; the best measured is the machine's capability.
    bw = {k: max(bw_start[k], bw_end[k]) for k in bw_start}
    bw_best = max(bw.values())
    roofline_tps = bw_best / weight_bytes

    # Report.
    runtime = time.perf_counter() - t_start
    cpus = os.cpu_count()
    print(f"# Decode throughput — SmolLM2-135M-Instruct {FLAGS.dtype}, matmul {FLAGS.matmul} "
          f"(kernel weights {FLAGS.kernel_dtype or FLAGS.dtype}), attention {FLAGS.attention} "
          f"({n_params / 1e6:.1f}M params), CPU")
    print()
    print(f"date {datetime.datetime.now().isoformat(timespec='seconds')} | host {platform.node()} | "
          f"{cpus} CPUs ({platform.processor() or platform.machine()}) | jax {jax.__version__} "
          f"({jax.default_backend()}) | torch {torch.__version__} | torch threads {torch.get_num_threads()} | "
          f"python {platform.python_version()}")
    t = FLAGS.temperature
    sampling = f"temperature {t}, top-p 0.95, seeded" if t > 0 else "greedy"
    print(f"prompts: first {max(batch_sizes)} of {source}, chat-templated, lengths "
          f"{[len(p) for p in prompt_ids]}; {sampling}, ignore_eos, {N} tokens/request "
          f"({N - 1} timed decode steps); prefill: {len(long_ids)} tokens of long_context text; "
          f"medians of {R} repeats after a warm-up, engine and transformers interleaved")
    print(f"background load: other processes used {fmt(background, '.2f')} of {cpus} CPUs on average during "
          f"this run (per timed repeat: {[fmt(x, '.2f') for x in load]}); timings on a shared machine are "
          "noisy, see per-repeat values below")
    print()
    print("| metric | engine | transformers | ratio | target |")
    print("|---|---|---|---|---|")
    targets = {1: 1.6, 8: 2.0}
    for b in batch_sizes:
        e, h = eng[b], hf.get(b)
        ratio = e["tps"] / h["tps"] if h else None
        tgt = targets.get(b)
        tgt_s = f"≥{tgt}x transformers: {'MET' if ratio >= tgt else 'NOT MET'}" if tgt and ratio else (
            f"≥{tgt}x transformers" if tgt else "—")
        print(f"| decode tok/s, batch {b} | {e['tps']:.1f} | {fmt(h and h['tps'])} | {fmt(ratio, '.2f', 'x')} "
              f"| {tgt_s} |")
        print(f"| decode ms/step, batch {b} | {e['ms']:.1f} | {fmt(h and h['ms'])} | "
              f"{fmt(h and h['ms'] / e['ms'], '.2f', 'x')} | — |")
        if b == 1:
            pct = e["tps"] / roofline_tps
            print(f"| decode batch 1, % of roofline ({roofline_tps:.1f} tok/s) | {100 * pct:.0f}% | "
                  f"{fmt(h and 100 * h['tps'] / roofline_tps, '.0f', '%')} | — | "
                  f"≥70%: {'MET' if pct >= 0.7 else 'NOT MET'} |")
    ratio = hf_ttft / eng_ttft if hf_ttft else None
    print(f"| prefill {len(long_ids)} tokens, TTFT ms | {1e3 * eng_ttft:.0f} | {fmt(hf_ttft and 1e3 * hf_ttft, '.0f')} "
          f"| {fmt(ratio, '.2f', 'x')} | ≥1x transformers"
          f"{(': MET' if ratio >= 1 else ': NOT MET') if ratio else ''} |")
    print(f"| prefill {len(long_ids)} tokens, tok/s | {len(long_ids) / eng_ttft:.0f} | "
          f"{fmt(hf_ttft and len(long_ids) / hf_ttft, '.0f')} | {fmt(ratio, '.2f', 'x')} | — |")
    print()
    print("ratio = engine speed / transformers speed (for ms rows: transformers ms / engine ms); > 1 means "
          "the engine is faster.")
    print()
    print("Roofline (measured in this run):")
    print(f"  copy bandwidth BW = (bytes read + bytes written) / t of np.copyto, {FLAGS.copy_mb} MiB arrays, "
          "best of several copies, measured at the start and at the end of the run: "
          + ", ".join(f"{k} {bw_start[k] / 1e9:.1f} / {bw_end[k] / 1e9:.1f} GB/s" for k in bw)
          + f" -> BW = {bw_best / 1e9:.1f} GB/s (the best)")
    read = (f"the CPU kernel's packed weights ({FLAGS.kernel_dtype or FLAGS.dtype}, every projection and the LM "
            "head, padded to panels of 16 columns)" if engine.runner.packed_bytes else
            f"all {n_params / 1e6:.2f}M parameters ({FLAGS.dtype}; tied embedding read once as LM head)")
    print(f"  weight bytes/token = {read} = {weight_bytes / 1e6:.1f} MB")
    print(f"  roofline tok/s (batch 1) = BW / weight bytes/token = {bw_best / 1e9:.1f} GB/s / "
          f"{weight_bytes / 1e6:.1f} MB = {roofline_tps:.1f} tok/s "
          f"(= {1e3 / roofline_tps:.1f} ms/step; batch b reads the weights once per step: b x that)")
    read_tps = read_bw / weight_bytes
    print(f"  for reference, not the target: read bandwidth of a jitted fp32 matrix-vector product over a "
          f"{FLAGS.copy_mb} MiB matrix (XLA:CPU, what decode does with each weight) {read_bw / 1e9:.1f} GB/s -> "
          f"{read_tps:.1f} tok/s; engine batch 1 at "
          + (f"{100 * eng[1]['tps'] / read_tps:.0f}% of it" if 1 in eng else "n/a"))
    print()
    print("Details:")
    for b in batch_sizes:
        print(f"  engine batch {b}: ms/step per repeat {[round(x, 1) for x in eng[b]['all_ms']]}, "
              f"{eng[b]['steps']} timed steps giving {eng[b]['tokens']} tokens")
        if b in hf:
            print(f"  transformers batch {b}: ms/step per repeat {[round(x, 1) for x in hf[b]['all_ms']]}; "
                  f"median generate(1 token) {1e3 * hf[b]['t1']:.0f} ms, generate({N} tokens) "
                  f"{1e3 * hf[b]['tN']:.0f} ms")
        if b in agree:
            print(f"  greedy agreement batch {b}: tokens identical before first divergence, per request "
                  f"(of {N}): {agree[b]}")
    for b in breakdown:
        parts = ", ".join(f"{k} {v:.2f}" for k, v in breakdown[b].items())
        print(f"  engine step breakdown batch {b} (ms/step): {parts}; jitted step alone on device-resident "
              f"inputs: {pure[b]:.1f} ms")
    print(f"  prefill TTFT ms per repeat: engine {[round(1e3 * x) for x in eng_ttfts]}, transformers "
          f"{[round(1e3 * x) for x in hf_ttfts]}")
    print()
    print(f"runtime {runtime:.0f} s")


if __name__ == "__main__":
    app.run(main)
