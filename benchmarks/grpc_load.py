"""Load test of the gRPC service on loopback, against the offline API on the same prompts.

  python benchmarks/grpc_load.py [--num_clients=64] [--duration_s=60] [--max_tokens=64]
      [--model=smollm2-135m-instruct] [--target=host:port] [--skip_offline]

What is measured:

* gRPC: `--num_clients` concurrent streaming clients (one asyncio process,
  one channel), each sending a request, reading its stream to the end, and
  sending the next, until `--duration_s` has passed; requests in flight then
  run to completion. Prompts are the real chat prompts of
  `shared/data/prompts/chat.jsonl` (built-in ones if absent), sent as chat
  messages and cycled in order. Sampling: temperature 0.7, top_p 0.9, seed =
  the request's index, exactly `--max_tokens` tokens (ignore_eos) so both
  sides generate the same amount. Before the timed window every client runs
  one untimed request (compilation warm-up).
  tokens/s = generated tokens / wall time (first send to last stream end);
  requests/s = completed requests / wall time; TTFT = send to the first
  message with tokens; ITL = gap between messages with tokens, divided by
  their token count. errors = calls that ended with a non-OK status; lost =
  streams that ended OK without a finish reason (both must be 0).
* offline: `LLM.generate` on the first `2 * --num_clients` of the same
  prompts with the same sampling, in one call, after an untimed warm-up call;
  tokens/s = generated tokens / wall time.

Without `--target`, the offline run happens first in this process, then a
server (`python -m engine.serve`, same engine limits) starts as a subprocess
and is stopped with SIGTERM at the end (its exit status is reported).
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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import grpc
import numpy as np
from absl import app, flags

from engine.client import AsyncClient

FLAGS = flags.FLAGS
flags.DEFINE_integer("num_clients", 64, "Concurrent streaming clients.")
flags.DEFINE_float("duration_s", 60.0, "Seconds during which clients send new requests.")
flags.DEFINE_integer("max_tokens", 64, "Tokens generated per request (exactly: ignore_eos).")
flags.DEFINE_string("model", "smollm2-135m-instruct", "Model for the server and the offline run.")
flags.DEFINE_string("target", None, "host:port of a running server; default: start one here.")
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
    wall_s: float
    completed: int
    errors: int
    lost: int
    tokens: int
    ttft_s: list[float]
    itl_s: list[float]
    error_messages: list[str]

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s

    @property
    def requests_per_s(self) -> float:
        return self.completed / self.wall_s


async def run_load(target: str, prompts: list, *, num_clients: int, duration_s: float, max_tokens: int,
                   auth_token: str | None = None, warmup: bool = True) -> LoadResult:
    """Runs the closed-loop load described in the module docstring against `target`."""
    async with AsyncClient(target, auth_token=auth_token) as client:
        index = itertools.count()
        if warmup:
            await asyncio.gather(*(client.generate(prompts[i % len(prompts)], **sampling(i, max_tokens))
                                   for i in range(num_clients)))
        r = LoadResult(0.0, 0, 0, 0, 0, [], [], [])

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


def offline_tokens_per_s(model: str, prompts: list, n: int, max_tokens: int) -> float:
    from engine import LLM, SamplingParams

    llm = LLM(model, max_num_seqs=FLAGS.max_num_seqs, max_num_batched_tokens=FLAGS.max_num_batched_tokens)
    batch = [prompts[i % len(prompts)] for i in range(n)]
    params = [SamplingParams(**sampling(i, max_tokens)) for i in range(n)]
    llm.generate(batch[:FLAGS.num_clients], params[:FLAGS.num_clients])  # warm-up: compilation
    start = time.monotonic()
    outputs = llm.generate(batch, params)
    return sum(len(o.token_ids) for o in outputs) / (time.monotonic() - start)


def start_server() -> tuple[subprocess.Popen, str]:
    """`python -m engine.serve` on a free port; returns the process and its host:port."""
    cmd = [sys.executable, "-m", "engine.serve", f"--model={FLAGS.model}", "--port=0", "--metrics_port=-1",
           f"--max_num_seqs={FLAGS.max_num_seqs}", f"--max_num_batched_tokens={FLAGS.max_num_batched_tokens}"]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    for line in proc.stdout:
        if line.startswith("serving "):
            return proc, line.split(" on ", 1)[1].split(",")[0].strip()
    raise RuntimeError(f"the server exited with status {proc.wait()} before serving")


def percentiles_ms(values: list[float]) -> str:
    if not values:
        return "n/a"
    return " / ".join(f"{1e3 * v:.1f}" for v in np.percentile(values, [50, 90, 99]))


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    prompts = chat_prompts()
    offline = None
    if not FLAGS.skip_offline:
        offline = offline_tokens_per_s(FLAGS.model, prompts, 2 * FLAGS.num_clients, FLAGS.max_tokens)
        gc.collect()
    proc, target = (None, FLAGS.target) if FLAGS.target else start_server()
    try:
        r = asyncio.run(run_load(target, prompts, num_clients=FLAGS.num_clients, duration_s=FLAGS.duration_s,
                                 max_tokens=FLAGS.max_tokens))
    finally:
        exit_status = None
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            exit_status = proc.wait(timeout=120)
    print(f"# gRPC load test, {datetime.date.today()}, {platform.machine()}, {os.cpu_count()} CPUs")
    print(f"model {FLAGS.model}; {FLAGS.num_clients} clients for {FLAGS.duration_s:g} s; {len(prompts)} chat "
          f"prompts; {FLAGS.max_tokens} tokens per request; max_num_seqs {FLAGS.max_num_seqs}, "
          f"max_num_batched_tokens {FLAGS.max_num_batched_tokens}\n")
    rows = [("requests/s", f"{r.requests_per_s:.2f}"), ("tokens/s (gRPC)", f"{r.tokens_per_s:.1f}")]
    if offline is not None:
        rows += [("tokens/s (offline LLM.generate)", f"{offline:.1f}"),
                 ("gRPC / offline", f"{r.tokens_per_s / offline:.2f} (target >= 0.90)")]
    rows += [("TTFT p50 / p90 / p99 ms", percentiles_ms(r.ttft_s)),
             ("ITL p50 / p90 / p99 ms", percentiles_ms(r.itl_s)),
             ("requests completed", str(r.completed)), ("errors", str(r.errors)), ("lost", str(r.lost)),
             ("wall s (incl. requests in flight at the end)", f"{r.wall_s:.1f}")]
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
