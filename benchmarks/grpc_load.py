"""Load test of the gRPC service on loopback, against the offline API on the same prompts.

  python benchmarks/grpc_load.py [--num_clients=64] [--duration_s=60] [--max_tokens=64]
      [--model=smollm2-135m-instruct] [--target=host:port --metrics_url=URL] [--skip_offline]

What is measured:

* gRPC: `--num_clients` concurrent streaming clients (one asyncio process,
  one channel), each sending a request, reading its stream to the end, and
  sending the next, until `--duration_s` has passed; requests in flight then
  run to completion. Prompts are the real chat prompts of
  `shared/data/prompts/chat.jsonl` (built-in ones if absent), sent as chat
  messages and cycled in order. Sampling: temperature 0.7, top_p 0.9, seed =
  the request's index, exactly `--max_tokens` tokens (ignore_eos) so both
  sides generate the same amount. Before the timed run every client runs one
  untimed request (warm-up).
  tokens/s = generated tokens received / wall time (first send to the end of
  the last stream: the same definition as offline, ramp-up and tail
  included); the window figure counts only tokens received in the first
  `--duration_s` (steady state when requests are short next to the window).
  requests/s = completed requests / wall time. TTFT = send to the first
  message with tokens; ITL = gap between messages with tokens, divided by
  their token count. errors = calls that ended with a non-OK status; lost =
  streams that ended OK without a finish reason (both must be 0).
* offline: `LLM.generate` on the first `2 * --num_clients` of the same
  prompts with the same sampling, in one call, after an untimed warm-up call
  on the first `--num_clients`; tokens/s = generated tokens / wall time.

With `--precompile` (default) both engines compile every step bucket before
anything is timed, so no compilation lands in a timed run (the second engine
reads the first one's programs from the persistent compilation cache); the
table reports the compilations that still happened. Without `--target`, the
offline run happens first in this process, then a server (`python -m
engine.serve`, same engine limits) starts as a subprocess and is stopped with
SIGTERM at the end (its exit status is reported). The 1-minute load average
before and after shows how busy the machine was.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import gc
import itertools
import json
import os
import platform
import signal
import subprocess
import sys
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import grpc
import numpy as np
from absl import app, flags, logging

from engine.client import AsyncClient

FLAGS = flags.FLAGS
flags.DEFINE_integer("num_clients", 64, "Concurrent streaming clients.")
flags.DEFINE_float("duration_s", 60.0, "Seconds during which clients send new requests.")
flags.DEFINE_integer("max_tokens", 64, "Tokens generated per request (exactly: ignore_eos).")
flags.DEFINE_string("model", "smollm2-135m-instruct", "Model for the server and the offline run.")
flags.DEFINE_string("target", None, "host:port of a running server; default: start one here.")
flags.DEFINE_string("metrics_url", None, "With --target: the server's /metrics URL (for its compilation count).")
flags.DEFINE_integer("max_prompt_chars", 0, "Drop prompts longer than this (0: keep all); for small-context "
                     "test models such as tiny-llama.")
flags.DEFINE_bool("precompile", True, "Compile every step bucket before timing (server and offline).")
flags.DEFINE_bool("skip_offline", False, "Skip the offline LLM.generate comparison.")
flags.DEFINE_integer("max_num_seqs", 64, "Engine limit (server and offline).")
flags.DEFINE_integer("max_num_batched_tokens", 512, "Engine token budget (server and offline).")

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


def chat_prompts() -> list[list[dict]]:
    """The prompts of shared/data/prompts/chat.jsonl (beside or inside the repository) as user messages."""
    texts = None
    for base in (os.path.dirname(ROOT), ROOT):
        path = os.path.join(base, "shared", "data", "prompts", "chat.jsonl")
        if os.path.isfile(path):
            with open(path) as f:
                texts = [json.loads(line)["prompt"] for line in f if line.strip()]
            break
    return [[{"role": "user", "content": t}] for t in texts or FALLBACK_PROMPTS]


def sampling(index: int, max_tokens: int) -> dict:
    """The sampling fields of request `index` (the same for gRPC and offline)."""
    return {"temperature": 0.7, "top_p": 0.9, "seed": index, "max_tokens": max_tokens, "ignore_eos": True}


@dataclasses.dataclass
class LoadResult:
    duration_s: float  # the window in which clients send new requests
    wall_s: float = 0.0  # first send to the end of the last stream
    completed: int = 0  # requests that ended with a finish reason
    errors: int = 0  # calls that ended with a non-OK status
    lost: int = 0  # calls that ended OK without a finish reason
    tokens: int = 0  # generated tokens received
    window_tokens: int = 0  # of which received within the window
    ttft_s: list[float] = dataclasses.field(default_factory=list)
    itl_s: list[float] = dataclasses.field(default_factory=list)
    error_messages: list[str] = dataclasses.field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s

    @property
    def window_tokens_per_s(self) -> float:
        return self.window_tokens / self.duration_s

    @property
    def requests_per_s(self) -> float:
        return self.completed / self.wall_s


async def warm_up(target: str, prompts: list, *, num_clients: int, max_tokens: int,
                  auth_token: str | None = None) -> None:
    """One untimed request per client, all at once."""
    async with AsyncClient(target, auth_token=auth_token) as client:
        await asyncio.gather(*(client.generate(prompts[i % len(prompts)], **sampling(i, max_tokens))
                               for i in range(num_clients)))


async def run_load(target: str, prompts: list, *, num_clients: int, duration_s: float, max_tokens: int,
                   auth_token: str | None = None) -> LoadResult:
    """Runs the closed-loop load described in the module docstring against `target`."""
    r = LoadResult(duration_s)
    index = itertools.count()
    async with AsyncClient(target, auth_token=auth_token) as client:

        async def one_client():
            while time.monotonic() < end:
                i = next(index)
                sent, last, finished = time.monotonic(), None, False
                try:
                    async for msg in client.generate_stream(prompts[i % len(prompts)], **sampling(i, max_tokens)):
                        now = time.monotonic()
                        if msg.token_ids:
                            if last is None:
                                r.ttft_s.append(now - sent)
                            else:
                                r.itl_s.extend([(now - last) / len(msg.token_ids)] * len(msg.token_ids))
                            last = now
                            r.tokens += len(msg.token_ids)
                            r.window_tokens += len(msg.token_ids) if now <= end else 0
                        finished = finished or msg.finish_reason != 0
                except grpc.RpcError as e:
                    r.errors += 1
                    r.error_messages.append(f"{e.code().name}: {e.details()}")
                    continue
                if finished:
                    r.completed += 1
                else:
                    r.lost += 1

        start = time.monotonic()
        end = start + duration_s
        await asyncio.gather(*(one_client() for _ in range(num_clients)))
        r.wall_s = time.monotonic() - start
    return r


def offline_tokens_per_s(model: str, prompts: list, n: int, max_tokens: int) -> tuple[float, int]:
    """(tokens/s, compilations during the timed call) of LLM.generate on n requests."""
    from engine import LLM, SamplingParams

    llm = LLM(model, max_num_seqs=FLAGS.max_num_seqs, max_num_batched_tokens=FLAGS.max_num_batched_tokens)
    if FLAGS.precompile:
        llm.engine.precompile()
    batch = [prompts[i % len(prompts)] for i in range(n)]
    params = [SamplingParams(**sampling(i, max_tokens)) for i in range(n)]
    llm.generate(batch[:FLAGS.num_clients], params[:FLAGS.num_clients])  # warm-up
    compilations = llm.engine.compilation_count()
    start = time.monotonic()
    outputs = llm.generate(batch, params)
    tokens_per_s = sum(len(o.token_ids) for o in outputs) / (time.monotonic() - start)
    return tokens_per_s, llm.engine.compilation_count() - compilations


def server_compilations(metrics_url: str | None) -> int | None:
    if not metrics_url:
        return None
    text = urllib.request.urlopen(metrics_url, timeout=30).read().decode()
    return int(float(next(line.split()[1] for line in text.splitlines() if line.startswith("engine_compilations "))))


def start_server() -> tuple[subprocess.Popen, str, str]:
    """`python -m engine.serve` on free ports; returns the process, its host:port and its metrics URL."""
    cmd = [sys.executable, "-m", "engine.serve", f"--model={FLAGS.model}", "--port=0", "--metrics_port=0",
           f"--max_num_seqs={FLAGS.max_num_seqs}", f"--max_num_batched_tokens={FLAGS.max_num_batched_tokens}",
           f"--precompile={FLAGS.precompile}"]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    for line in proc.stdout:
        if line.startswith("serving "):
            address, metrics = line.split(" on ", 1)[1].split(", metrics on ")
            return proc, address.strip(), metrics.strip()
    raise RuntimeError(f"the server exited with status {proc.wait()} before serving")


def percentiles_ms(values: list[float]) -> str:
    if not values:
        return "n/a"
    return " / ".join(f"{1e3 * v:.1f}" for v in np.percentile(values, [50, 90, 99]))


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    logging.set_verbosity(logging.WARNING)  # keep jax's backend probing (e.g. "no TPU") off stderr
    load_before = os.getloadavg()[0]
    prompts = [p for p in chat_prompts() if not FLAGS.max_prompt_chars or len(p[0]["content"]) <= FLAGS.max_prompt_chars]
    offline = None
    if not FLAGS.skip_offline:
        offline = offline_tokens_per_s(FLAGS.model, prompts, 2 * FLAGS.num_clients, FLAGS.max_tokens)
        gc.collect()
    proc, target, metrics_url = (None, FLAGS.target, FLAGS.metrics_url) if FLAGS.target else start_server()
    exit_status = None
    try:
        kwargs = {"num_clients": FLAGS.num_clients, "max_tokens": FLAGS.max_tokens}
        asyncio.run(warm_up(target, prompts, **kwargs))
        compilations = server_compilations(metrics_url)
        r = asyncio.run(run_load(target, prompts, duration_s=FLAGS.duration_s, **kwargs))
        if compilations is not None:
            compilations = server_compilations(metrics_url) - compilations
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            exit_status = proc.wait(timeout=120)
    print(f"# gRPC load test, {datetime.date.today()}, {platform.machine()}, {os.cpu_count()} CPUs, "
          f"load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after")
    print(f"model {FLAGS.model}; {FLAGS.num_clients} clients for {FLAGS.duration_s:g} s; {len(prompts)} chat "
          f"prompts; {FLAGS.max_tokens} tokens per request; max_num_seqs {FLAGS.max_num_seqs}, "
          f"max_num_batched_tokens {FLAGS.max_num_batched_tokens}; precompile {FLAGS.precompile}\n")
    rows = [("requests/s", f"{r.requests_per_s:.2f}"), ("tokens/s (gRPC)", f"{r.tokens_per_s:.1f}")]
    if offline is not None:
        rows += [("tokens/s (offline LLM.generate)", f"{offline[0]:.1f}"),
                 ("gRPC / offline", f"{r.tokens_per_s / offline[0]:.2f} (target >= 0.90)")]
    rows += [(f"tokens/s (gRPC, first {FLAGS.duration_s:g} s only)", f"{r.window_tokens_per_s:.1f}"),
             ("TTFT p50 / p90 / p99 ms", percentiles_ms(r.ttft_s)),
             ("ITL p50 / p90 / p99 ms", percentiles_ms(r.itl_s)),
             ("requests completed", str(r.completed)), ("errors", str(r.errors)), ("lost", str(r.lost)),
             ("wall s (first send to last stream end)", f"{r.wall_s:.1f}")]
    if compilations is not None:
        rows.append(("server compilations during the timed run", str(compilations)))
    if offline is not None:
        rows.append(("offline compilations during the timed run", str(offline[1])))
    if exit_status is not None:
        rows.append(("server exit status after SIGTERM", str(exit_status)))
    print("| metric | value |\n|---|---|")
    for name, value in rows:
        print(f"| {name} | {value} |")
    for message in r.error_messages[:5]:
        print(f"error: {message}")
    return 0 if r.errors == 0 and r.lost == 0 else 1


if __name__ == "__main__":
    app.run(main)
