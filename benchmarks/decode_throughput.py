"""Decode throughput and prefill latency of the engine against the peers a CPU user would pick instead.

SmolLM2-135M-Instruct, greedy, the same prompt token ids for every program, each program in a process of
its own (its threads never share the cores with another's), processes alternating over `--rounds` rounds
(the order rotates each round), medians over rounds with the spread (min-max):

  python benchmarks/decode_throughput.py [--programs=engine,engine-bf16,llama.cpp-f32,llama.cpp-f16,transformers]
      [--batch_sizes=1,8,32] [--decode_tokens=64] [--prefill_len=512] [--rounds=3] [--repeats=3]

Programs:

* `engine` (fp32 kernel weights: the file's Q4_1 and Q8_0 blocks, exact, `cpu_kernels.blocks`),
  `engine-panels` (the same fp32 values in float32 panels, `JSE_WEIGHT_BLOCKS=0`), `engine-bf16`
  (`kernel_dtype="bfloat16"`): this engine, `speculative=None`, kernels as `--matmul` says (default: chosen
  by measurement, `engine.kernels`). Every batch size is
  warmed up twice with the very run it then times (the second warm-up already hits the prefix cache, as
  the timed runs do), and each timed run asserts that nothing compiled while it ran. The timed steps are
  whole `Engine.step()`s after every request has its first token: scheduling, packing, host-to-device
  copies, the jitted step, the read-back, detokenizing.
* `llama.cpp-f32`, `llama.cpp-f16`, `llama.cpp-q4_1`: llama.cpp through `llama-cpp-python` (`pip install -e
  '.[bench]'`; build it with `CMAKE_ARGS="-DGGML_NATIVE=ON"` for this CPU), on F32 and F16 GGUFs written once
  from the same Q4_1 file (`llama_model_quantize`, kept in the engine's cache folder) and on that file itself
  (its products quantize the activations to 8 bits, so its greedy output may part from the fp32 one); as
  many threads as CPUs; batch 1 and prefill only (its Python API decodes one sequence).
* `transformers`: Hugging Face transformers fp32 (`generate`, greedy, left-padded batch). Decode ms/step
  = (t(prefill + N tokens) - t(prefill + 1 token)) / (N - 1).

The roofline is batch-1 decode reading every weight once per token at the copy bandwidth (bytes read +
written by `np.copyto`, best of one thread and one per CPU) measured before every round: roofline tok/s =
BW / fp32 weight bytes (the tied embedding once, as the LM head). Prefill: time to the first token of one
`--prefill_len`-token prompt (long_context text), never from a cache. Greedy agreement: tokens before the
first divergence from the engine's fp32 output, per request.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from absl import app, flags  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.baselines import hf_batch, hf_setup, read_prompts, spread  # noqa: E402

FLAGS = flags.FLAGS
PROGRAMS = ["engine", "engine-panels", "engine-bf16", "llama.cpp-f32", "llama.cpp-f16", "llama.cpp-q4_1",
            "transformers"]
flags.DEFINE_list("programs", PROGRAMS, f"Programs to time, of {PROGRAMS}.")
flags.DEFINE_list("batch_sizes", ["1", "8", "32"], "Decode batch sizes (llama.cpp: batch 1 only).")
flags.DEFINE_integer("decode_tokens", 64, "Tokens generated per request (the first comes from prefill).")
flags.DEFINE_integer("prefill_len", 512, "Prompt length of the prefill (TTFT) measurement.")
flags.DEFINE_integer("rounds", 3, "Rounds; each runs every program once, in a process of its own.")
flags.DEFINE_integer("repeats", 3, "Timed repeats inside each process (its median is the round's value).")
flags.DEFINE_enum("matmul", "auto", ["auto", "amx", "avx512", "avx2", "xla"], "The engine's product kernels.")
flags.DEFINE_integer("copy_mb", 512, "Size of each array in the bandwidth measurement, MiB (>= 256).")
flags.DEFINE_string("worker", None, "Internal: run one program's measurement and print its JSON result.")
flags.DEFINE_string("inputs", None, "Internal: the JSON file of prompt token ids a worker reads.")

log = lambda *a: print(*a, file=sys.stderr, flush=True)  # noqa: E731


def read_texts(domain: str, n: int) -> list[str]:
    rows = read_prompts(domain)
    assert len(rows) >= n, f"{domain} has {len(rows)} prompts, {n} wanted"
    return [r["prompt"] for r in rows[:n]]


def copy_bandwidth(mib: int) -> float:
    """(bytes read + bytes written) / s of np.copyto, best of 1 thread and one thread per CPU, 8 copies each."""
    n = mib * (1 << 20) // 4
    src, dst = np.ones(n, np.float32), np.zeros(n, np.float32)  # dst touched: no page faults timed
    threads = os.cpu_count() or 1
    bounds = np.linspace(0, n, threads + 1).astype(np.int64)
    best = 0.0
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        def parallel():  # np.copyto releases the GIL
            list(pool.map(lambda i: np.copyto(dst[bounds[i]:bounds[i + 1]], src[bounds[i]:bounds[i + 1]]),
                          range(threads)))
        for fn in (lambda: np.copyto(dst, src), parallel):
            fn()
            for _ in range(8):
                t = time.perf_counter()
                fn()
                best = max(best, 2 * src.nbytes / (time.perf_counter() - t))
    return best


# ---- workers: one program each, in a process of its own ---------------------------------------------

def engine_worker(kernel_dtype: str, inputs: dict) -> dict:
    from engine import LLM, SamplingParams
    from engine.compilation import compilation_count

    N, R = inputs["decode_tokens"], inputs["repeats"]
    llm = LLM(speculative=None, kernel_dtype=kernel_dtype, matmul=inputs["matmul"],
              max_num_batched_tokens=max(512, len(inputs["long"])), max_num_seqs=max(64, *inputs["batch_sizes"]))
    engine = llm.engine
    greedy = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)

    def decode(ids: list[list[int]], timed: bool = True):
        reqs = [engine.add_request(p, greedy) for p in ids]
        while any(not r.output_token_ids for r in reqs):  # prefill, untimed
            engine.step()
        before, compiled = sum(len(r.output_token_ids) for r in reqs), compilation_count()
        steps, t = 0, time.perf_counter()
        while engine.has_unfinished():
            engine.step()
            steps += 1
        seconds = time.perf_counter() - t
        assert not timed or compilation_count() == compiled, "a timed decode run compiled"
        return seconds, steps, sum(len(r.output_token_ids) for r in reqs) - before, [r.output_token_ids for r in reqs]

    def ttft(salt: str) -> float:
        t = time.perf_counter()
        engine.add_request(inputs["long"], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
                           cache_salt=salt)
        while not engine.step():
            pass
        return time.perf_counter() - t

    out = {"decode": {}, "kernels": {"family": engine.kernel_choice.family, "how": engine.kernel_choice.how},
           "kernel_bytes": engine.runner.packed_bytes}
    for b in inputs["batch_sizes"]:
        ids = inputs["prompts"][:b]
        decode(ids, False), decode(ids, False)  # warm-up: the first compiles, the second meets prefix-cache hits
        runs = [decode(ids) for _ in range(R)]
        out["decode"][b] = {"ms": 1e3 * statistics.median(s / n for s, n, _, _ in runs),
                            "tps": statistics.median(k / s for s, _, k, _ in runs), "tokens": runs[0][3]}
    ttft(f"warm-{time.time_ns()}"), ttft(f"warm-{time.time_ns()}")
    compiled = compilation_count()
    out["ttft"] = statistics.median(ttft(f"ttft-{time.time_ns()}") for _ in range(R))
    assert compilation_count() == compiled, "a timed prefill compiled"
    return out


def llama_cpp_gguf(kind: str) -> str:
    """The default model's Q4_1 file, or an F32 or F16 GGUF written once from it into the cache folder."""
    import ctypes

    import llama_cpp

    from checkpoints import default_gguf_path
    from checkpoints.resolve import cache_dir
    if kind == "q4_1":
        return default_gguf_path()
    path = os.path.join(cache_dir(), "peers", f"smollm2-135m-instruct-{kind}.gguf")
    if not os.path.isfile(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = {"f32": llama_cpp.LLAMA_FTYPE_ALL_F32, "f16": llama_cpp.LLAMA_FTYPE_MOSTLY_F16}[kind]
        params.allow_requantize = True
        tmp = path + ".tmp"
        if llama_cpp.llama_model_quantize(default_gguf_path().encode(), tmp.encode(), ctypes.byref(params)):
            raise RuntimeError(f"llama_model_quantize failed writing {tmp}")
        os.replace(tmp, path)
    return path


def llama_cpp_worker(kind: str, inputs: dict) -> dict:
    import llama_cpp

    N, R, threads = inputs["decode_tokens"], inputs["repeats"], os.cpu_count() or 1
    llm = llama_cpp.Llama(llama_cpp_gguf(kind), n_ctx=2048, n_batch=2048, n_threads=threads,
                          n_threads_batch=threads, verbose=False)
    ids = inputs["prompts"][0]

    def decode():
        llm.reset()
        llm.eval(ids)
        tokens = [llm.sample(temp=0.0)]
        t = time.perf_counter()
        while len(tokens) < N:
            llm.eval(tokens[-1:])
            tokens.append(llm.sample(temp=0.0))
        return time.perf_counter() - t, tokens

    def ttft() -> float:
        llm.reset()
        t = time.perf_counter()
        llm.eval(inputs["long"])
        llm.sample(temp=0.0)
        return time.perf_counter() - t

    decode(), decode(), ttft()
    runs = [decode() for _ in range(R)]
    return {"decode": {1: {"ms": 1e3 * statistics.median(s for s, _ in runs) / (N - 1),
                           "tps": statistics.median((N - 1) / s for s, _ in runs), "tokens": [runs[0][1]]}},
            "ttft": statistics.median(ttft() for _ in range(R)), "threads": threads}


def transformers_worker(inputs: dict) -> dict:
    import torch
    from transformers import GenerationConfig

    from checkpoints import default_gguf_path
    N, R = inputs["decode_tokens"], inputs["repeats"]
    model = hf_setup(default_gguf_path())
    pad = model.generation_config.pad_token_id or 0

    def generate(ids, mask, n: int):
        gc = GenerationConfig(do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=pad,
                              eos_token_id=model.generation_config.eos_token_id, use_cache=True)
        with torch.inference_mode():
            t = time.perf_counter()
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=gc)
            return time.perf_counter() - t, out[:, ids.shape[1]:].tolist()

    def ttft() -> float:
        with torch.inference_mode():
            t = time.perf_counter()
            int(model(input_ids=torch.tensor([inputs["long"]]), logits_to_keep=1).logits[0, -1].argmax())
            return time.perf_counter() - t

    out = {"decode": {}, "threads": torch.get_num_threads()}
    for b in inputs["batch_sizes"]:
        batch = hf_batch(inputs["prompts"][:b], pad)
        generate(*batch, N)
        t1 = statistics.median(generate(*batch, 1)[0] for _ in range(R))
        runs = [generate(*batch, N) for _ in range(R)]
        per_step = (statistics.median(s for s, _ in runs) - t1) / (N - 1)
        out["decode"][b] = {"ms": 1e3 * per_step, "tps": b / per_step, "tokens": runs[0][1]}
    ttft()
    out["ttft"] = statistics.median(ttft() for _ in range(R))
    return out


def run_worker(name: str, inputs: dict) -> dict:
    if name == "engine-panels":
        os.environ["JSE_WEIGHT_BLOCKS"] = "0"
    if name.startswith("engine"):
        return engine_worker("bfloat16" if name == "engine-bf16" else "float32", inputs)
    if name.startswith("llama.cpp-"):
        return llama_cpp_worker(name.split("-")[1], inputs)
    return transformers_worker(inputs)


# ---- the orchestrator ---------------------------------------------------------------------------------

def make_inputs(path: str) -> dict:
    from checkpoints import load_model
    from engine.inputs import encode_prompt

    batch_sizes = [int(b) for b in FLAGS.batch_sizes]
    chat = read_texts("chat", max(batch_sizes))
    source = "chat.jsonl"
    loaded = load_model()
    tokenizer = loaded.tokenizer
    long_ids = tokenizer.encode(read_texts("long_context", 1)[0])[:FLAGS.prefill_len]
    long_ids = (long_ids * (FLAGS.prefill_len // len(long_ids) + 1))[:FLAGS.prefill_len]
    inputs = {"prompts": [encode_prompt(tokenizer, [{"role": "user", "content": p}]) for p in chat],
              "long": long_ids, "batch_sizes": batch_sizes, "decode_tokens": FLAGS.decode_tokens,
              "repeats": FLAGS.repeats, "matmul": FLAGS.matmul, "source": source,
              "weight_bytes": 4 * loaded.config.num_params}
    with open(path, "w") as f:
        json.dump(inputs, f)
    return inputs


def spawn(name: str, inputs_path: str) -> dict | None:
    cmd = [sys.executable, os.path.abspath(__file__), f"--worker={name}", f"--inputs={inputs_path}"]
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    if done.returncode or not lines:
        log(f"  {name} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
        return None
    return json.loads(lines[-1][len("RESULT "):])


def agreement(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main(argv):
    del argv
    if FLAGS.worker:
        with open(FLAGS.inputs) as f:
            inputs = json.load(f)
        print("RESULT " + json.dumps(run_worker(FLAGS.worker, inputs)), flush=True)
        return
    unknown = set(FLAGS.programs) - set(PROGRAMS)
    if unknown:
        raise app.UsageError(f"unknown --programs {sorted(unknown)}; known: {PROGRAMS}")
    if FLAGS.decode_tokens < 2 or FLAGS.rounds < 1 or FLAGS.repeats < 1 or FLAGS.copy_mb < 256:
        raise app.UsageError("need --decode_tokens >= 2, --rounds >= 1, --repeats >= 1, --copy_mb >= 256")
    t_start = time.perf_counter()
    os.makedirs(os.path.join(ROOT, ".cache"), exist_ok=True)
    inputs_path = os.path.join(ROOT, ".cache", "decode_throughput_inputs.json")
    inputs = make_inputs(inputs_path)
    programs = list(FLAGS.programs)
    results: dict[str, list[dict]] = {p: [] for p in programs}
    bandwidths = []
    for r in range(FLAGS.rounds):
        bandwidths.append(copy_bandwidth(FLAGS.copy_mb))
        order = programs[r % len(programs):] + programs[:r % len(programs)]
        for name in order:
            log(f"round {r + 1}/{FLAGS.rounds}: {name} ...")
            res = spawn(name, inputs_path)
            if res is not None:
                results[name].append(res)

    bw = max(bandwidths)
    weight_bytes = inputs["weight_bytes"]
    roofline = bw / weight_bytes
    ref = results.get("engine") or []
    print(f"# Decode throughput: SmolLM2-135M-Instruct, greedy, {FLAGS.decode_tokens} tokens/request, CPU")
    print()
    print(f"date {datetime.datetime.now().isoformat(timespec='seconds')} | {os.cpu_count()} CPUs "
          f"({cpu_model()}) | python {platform.python_version()} | {FLAGS.rounds} rounds x {FLAGS.repeats} repeats, "
          f"one process per program and round, alternating | prompts: first {max(inputs['batch_sizes'])} of "
          f"{inputs['source']}, chat-templated | prefill {len(inputs['long'])} tokens")
    if ref:
        print(f"engine kernels (chosen in each process): {sorted({json.dumps(x['kernels']) for x in ref})}")
    print()
    batch_sizes = inputs["batch_sizes"]
    print("| program | " + " | ".join(f"batch {b} tok/s" for b in batch_sizes) + " | batch 1 ms/step | "
          f"prefill {len(inputs['long'])} TTFT ms |")
    print("|---|" + "---:|" * (len(batch_sizes) + 2))
    for name in programs:
        runs = results[name]
        if not runs:
            print(f"| {name} | " + " | ".join("failed" for _ in range(len(batch_sizes) + 2)) + " |")
            continue
        cells = [spread([x["decode"][str(b)]["tps"] for x in runs]) if str(b) in runs[0]["decode"] else "—"
                 for b in batch_sizes]
        ms = spread([x["decode"]["1"]["ms"] for x in runs], ".2f") if "1" in runs[0]["decode"] else "—"
        print(f"| {name} | " + " | ".join(cells) + f" | {ms} | {spread([1e3 * x['ttft'] for x in runs], '.0f')} |")
    print()
    print("Values: median over rounds (min-max). Ratios of medians:")
    med = lambda name, b: statistics.median(x["decode"][str(b)]["tps"] for x in results[name])  # noqa: E731
    have = lambda name, b: results.get(name) and str(b) in results[name][0]["decode"]  # noqa: E731
    for a, b_name in (("engine", "llama.cpp-f32"), ("engine-bf16", "llama.cpp-f16"), ("engine", "llama.cpp-q4_1"),
                      ("engine", "engine-panels"), ("engine", "transformers"), ("engine-bf16", "transformers")):
        ratios = [f"batch {b} {med(a, b) / med(b_name, b):.2f}x" for b in batch_sizes if have(a, b) and have(b_name, b)]
        if ratios:
            print(f"  {a} / {b_name}: " + ", ".join(ratios))
    print(f"  roofline: copy bandwidth {bw / 1e9:.1f} GB/s (best before each round: "
          f"{[round(x / 1e9, 1) for x in bandwidths]}) / {weight_bytes / 1e6:.0f} MB of fp32 weights = "
          f"{roofline:.1f} tok/s at batch 1")
    for name in programs:
        if have(name, 1):
            own = results[name][0].get("kernel_bytes")  # an engine's: what its kernels stream per token
            mine = f"; {100 * med(name, 1) * own / bw:.0f}% of the roofline of its own {own / 1e6:.0f} MB" if own else ""
            print(f"    {name}: {100 * med(name, 1) / roofline:.0f}% of it{mine}")
    if ref:
        print("Greedy agreement with the engine (fp32), tokens before the first divergence (first round):")
        for name in programs:
            if name != "engine" and results[name]:
                for b, got in results[name][0]["decode"].items():
                    want = ref[0]["decode"][b]["tokens"]
                    print(f"  {name} batch {b}: {[agreement(x, y) for x, y in zip(got['tokens'], want)]} "
                          f"of {FLAGS.decode_tokens}")
    print()
    print(f"runtime {time.perf_counter() - t_start:.0f} s")


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            name = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
        with open("/proc/cpuinfo") as f:
            flags_line = next(ln for ln in f if ln.startswith("flags"))
        isa = "AMX" if "amx_bf16" in flags_line else "AVX-512" if "avx512f" in flags_line else "AVX2"
        return f"{name}, {isa}"
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


if __name__ == "__main__":
    app.run(main)
