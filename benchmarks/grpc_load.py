"""Load test of the gRPC service on loopback, against the offline API on the same requests.

  python benchmarks/grpc_load.py [--num_clients=64] [--duration_s=60] [--max_tokens=64] [--repeats=2]
      [--model=smollm2-135m-instruct] [--target=host:port --metrics_url=URL] [--skip_offline]

What is measured:

* gRPC: `--num_clients` concurrent streaming clients (asyncio, one channel),
  each sending a request, reading its stream to the end, and sending the
  next, until `--duration_s` has passed; requests in flight then run to
  completion. Prompts are the real chat prompts of
  `--prompts_dir`'s chat.jsonl (`python -m benchmarks.prompts`), sent as chat
  messages and cycled in order. Sampling: temperature 0.7, top_p 0.9, seed =
  the request's index, exactly `--max_tokens` tokens (ignore_eos) so both
  sides generate the same amount.
  tokens/s = generated tokens received / wall time (first send to the end of
  the last stream: the offline definition, ramp-up and tail included); the
  window figure counts only tokens received in the first `--duration_s`
  (steady state when requests are short next to the window). requests/s =
  completed requests / wall time. TTFT = send to the first message with
  tokens; ITL = gap between messages with tokens, divided by their token
  count. errors = calls that ended with a non-OK status; lost = streams that
  ended OK without a finish reason (both must be 0).
* offline: right after each gRPC run, `LLM.generate` on the same requests
  (same prompts and seeds, the N the gRPC run completed) in one call;
  tokens/s = generated tokens / wall time. gRPC and offline runs alternate
  `--repeats` times so both see about the same background load on a shared
  machine; each pair's ratio is reported, and their median.
* tokens per CPU-second (without `--target`): generated tokens / CPU time of
  this whole process (engine, server, clients) during the run. Wall-clock
  rates on a shared machine follow the other tenants' load; this follows
  only the work done, so its gRPC / offline ratio is the steadier measure of
  the serving overhead (clients' work included).

Without `--target` the server (`engine.serving.server.GenerationServer`, what
`python -m engine.serve` runs) serves one engine in this process, on its own
event-loop and engine threads, and the offline runs use that same engine
(on its thread, while no gRPC request is in flight): the same compiled
programs and memory, and only one model in RAM. The clients share the
process (and the GIL) with the server, which, if anything, handicaps gRPC.
Before anything is timed, every client runs one request and the offline API
one call on `--num_clients` requests (warm-up; `--precompile` also compiles
every step bucket, which costs a few GB of compiled programs for a real
model). The table reports the XLA compilations during each timed run. The
1-minute load average before and after shows how busy the machine was.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import itertools
import os
import platform
import sys
import threading
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import grpc
import numpy as np
from absl import app, flags, logging

from engine.flags import FLAGS, llm_from_flags  # --model and the engine limits, for the server and offline
from engine.serving.client import AsyncClient
from benchmarks.baselines import read_prompts  # defines --prompts_dir

flags.DEFINE_integer("num_clients", 64, "Concurrent streaming clients.")
flags.DEFINE_float("duration_s", 60.0, "Seconds during which clients send new requests.")
flags.DEFINE_integer("max_tokens", 64, "Tokens generated per request (exactly: ignore_eos).")
flags.DEFINE_string("target", None, "host:port of a running server (same --model and engine limits); "
                    "default: serve one in this process.")
flags.DEFINE_string("metrics_url", None, "With --target: the server's /metrics URL, for its compilation count.")
flags.DEFINE_integer("max_prompt_chars", 0, "Drop prompts longer than this (0: keep all); for small-context "
                     "test models such as tiny-llama.")
flags.DEFINE_bool("precompile", False, "Compile every step bucket before timing.")
flags.DEFINE_bool("skip_offline", False, "Skip the offline LLM.generate comparison.")
flags.DEFINE_integer("repeats", 1, "gRPC runs, each followed by its offline run.")

def chat_prompts() -> list[list[dict]]:
    """The prompts of --prompts_dir's chat.jsonl as user messages."""
    return [[{"role": "user", "content": r["prompt"]}] for r in read_prompts("chat")]


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


def offline_run(llm, prompts: list, n: int, max_tokens: int) -> tuple[float, int, float]:
    """(tokens/s, XLA compilations, tokens per CPU-second of this process) of one `llm.generate`
    call on requests 0..n-1."""
    from engine import SamplingParams
    from engine.compilation import compilation_count

    batch = [prompts[i % len(prompts)] for i in range(n)]
    params = [SamplingParams(**sampling(i, max_tokens)) for i in range(n)]
    compilations = compilation_count()
    start, cpu = time.monotonic(), time.process_time()
    outputs = llm.generate(batch, params)
    tokens = sum(len(o.token_ids) for o in outputs)
    return (tokens / (time.monotonic() - start), compilation_count() - compilations,
            tokens / (time.process_time() - cpu))


class LocalServer:
    """A GenerationServer over `llm` on its own event-loop thread in this process; with `http`, the
    OpenAI-compatible HTTP API on the same worker too (`base_url`)."""

    def __init__(self, llm, http: bool = False):
        from engine.serving.server import GenerationServer
        from engine.serving.worker import EngineWorker

        self.llm = llm
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = GenerationServer(EngineWorker(llm.engine), llm.tokenizer, model_name=FLAGS.model)
        self.target = f"127.0.0.1:{self._run(self.server.start())}"
        self.http = None
        if http:
            from engine.serving.openai_api import HttpServer

            self.http = HttpServer(self.server)
            self.base_url = f"http://127.0.0.1:{self._run(self.http.start())}/v1"

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def offline(self, prompts: list, n: int, max_tokens: int) -> tuple[float, int, float]:
        """`offline_run` on the engine thread; call only while no gRPC request is in flight."""
        return self._run(self.server.worker.call(lambda _: offline_run(self.llm, prompts, n, max_tokens)))

    def stop(self) -> None:
        self._run(self.server.stop(grace=5))
        if self.http is not None:
            self._run(self.http.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()


def server_compilations(metrics_url: str) -> int:
    text = urllib.request.urlopen(metrics_url, timeout=30).read().decode()
    return int(float(next(line.split()[1] for line in text.splitlines() if line.startswith("engine_compilations "))))


def percentiles_ms(values: list[float]) -> str:
    if not values:
        return "n/a"
    return " / ".join(f"{1e3 * v:.1f}" for v in np.percentile(values, [50, 90, 99]))


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    logging.set_verbosity(logging.WARNING)  # keep jax's backend probing (e.g. "no TPU") off stderr
    from engine.compilation import compilation_count

    load_before = os.getloadavg()[0]
    prompts = [p for p in chat_prompts() if not FLAGS.max_prompt_chars or len(p[0]["content"]) <= FLAGS.max_prompt_chars]
    kwargs = {"num_clients": FLAGS.num_clients, "max_tokens": FLAGS.max_tokens}
    llm = local = None
    if not (FLAGS.target and FLAGS.skip_offline):
        llm = llm_from_flags()
        if FLAGS.precompile:
            llm.engine.precompile()
    if FLAGS.target:
        target = FLAGS.target
        count = (lambda: server_compilations(FLAGS.metrics_url)) if FLAGS.metrics_url else None
        offline = None if FLAGS.skip_offline else (lambda n: offline_run(llm, prompts, n, FLAGS.max_tokens))
    else:
        local = LocalServer(llm)
        target, count = local.target, compilation_count
        offline = None if FLAGS.skip_offline else (lambda n: local.offline(prompts, n, FLAGS.max_tokens))
    runs = []  # (LoadResult, compilations during it, tokens per CPU-s, offline_run's result)
    try:
        asyncio.run(warm_up(target, prompts, **kwargs))
        if offline:
            offline(FLAGS.num_clients)
        for _ in range(FLAGS.repeats):
            before, cpu = count() if count else None, time.process_time()
            r = asyncio.run(run_load(target, prompts, duration_s=FLAGS.duration_s, **kwargs))
            per_cpu_s = r.tokens / (time.process_time() - cpu)
            compiled = count() - before if count else None
            runs.append((r, compiled, per_cpu_s, offline(r.completed) if offline else None))
    finally:
        if local is not None:
            local.stop()
    print(f"# gRPC load test, {datetime.date.today()}, {platform.machine()}, {os.cpu_count()} CPUs, "
          f"load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after")
    print(f"model {FLAGS.model}; {FLAGS.num_clients} clients for {FLAGS.duration_s:g} s; {len(prompts)} chat "
          f"prompts; {FLAGS.max_tokens} tokens per request; max_num_seqs {FLAGS.max_num_seqs}, "
          f"max_num_batched_tokens {FLAGS.max_num_batched_tokens}; precompile {FLAGS.precompile}\n")
    rows = {"requests/s": [f"{r.requests_per_s:.2f}" for r, *_ in runs],
            "tokens/s (gRPC)": [f"{r.tokens_per_s:.1f}" for r, *_ in runs]}
    if offline:
        rows["tokens/s (offline LLM.generate, same requests, right after)"] = [f"{o[0]:.1f}" for *_, o in runs]
        rows["gRPC / offline, tokens/s (target >= 0.90)"] = [f"{r.tokens_per_s / o[0]:.2f}" for r, *_, o in runs]
    if local:
        rows["tokens per CPU-s, gRPC / offline"] = [
            f"{c:.1f} / {o[2]:.1f} = {c / o[2]:.2f}" if o else f"{c:.1f}" for _, _, c, o in runs]
    rows.update({
        f"tokens/s (gRPC, first {FLAGS.duration_s:g} s only)": [f"{r.window_tokens_per_s:.1f}" for r, *_ in runs],
        "TTFT p50 / p90 / p99 ms": [percentiles_ms(r.ttft_s) for r, *_ in runs],
        "ITL p50 / p90 / p99 ms": [percentiles_ms(r.itl_s) for r, *_ in runs],
        "requests completed": [str(r.completed) for r, *_ in runs],
        "errors": [str(r.errors) for r, *_ in runs],
        "lost": [str(r.lost) for r, *_ in runs],
        "wall s (first send to last stream end)": [f"{r.wall_s:.1f}" for r, *_ in runs],
        "gRPC-run compilations": [str(c) for _, c, *_ in runs]})
    if offline:
        rows["offline-run compilations"] = [str(o[1]) for *_, o in runs]
    print("| metric | " + " | ".join(f"run {i + 1}" for i in range(len(runs))) + " |")
    print("|---|" + "---|" * len(runs))
    for name, values in rows.items():
        print(f"| {name} | " + " | ".join(values) + " |")
    if offline:
        print(f"\nmedian gRPC / offline: tokens/s "
              f"{float(np.median([r.tokens_per_s / o[0] for r, *_, o in runs])):.2f}"
              + (f", tokens per CPU-s {float(np.median([c / o[2] for _, _, c, o in runs])):.2f}" if local else "")
              + " (target >= 0.90)")
    for message in [m for r, *_ in runs for m in r.error_messages][:5]:
        print(f"error: {message}")
    return 0 if all(r.errors == 0 and r.lost == 0 for r, *_ in runs) else 1


if __name__ == "__main__":
    app.run(main)
