"""The OpenAI HTTP API under load beside gRPC: one engine in this process serving both, loopback only.

  python benchmarks/http_load.py [--num_clients=32] [--duration_s=30] [--max_tokens=64] [--repeats=3]
      [--model=smollm2-135m-instruct] [--prompts_dir=...]

`--num_clients` concurrent streaming clients run the closed loop of `benchmarks/grpc_load.py` (send a
request, read its stream to the end, send the next, until `--duration_s` has passed; the same chat prompts,
sampling and exactly `--max_tokens` tokens per request) over gRPC (`engine.serving.client.AsyncClient`)
and over HTTP (the `openai` package's `AsyncOpenAI`, `chat.completions.create(stream=True)`, the engine's
fields in `extra_body`), alternating protocol runs `--repeats` times on the same server and engine, so
both see about the same background load. Reported per protocol, medians over runs with the spread
(min-max): TTFT (send to the first chunk with text) and inter-token latency (gap between chunks with text,
divided by their tokens) p50 and p99, tokens/s, requests completed, errors and lost requests (a stream
that ended without a finish reason; both must be 0). The HTTP stream's chunks carry text, not token ids:
tokens are counted from the usage chunk (`stream_options.include_usage`), and a chunk's tokens for ITL as
the request's tokens over its text chunks. Every step bucket is compiled first (`--precompile`, the default
here) and every client runs one request over each protocol (warm-up); the XLA compilations during the timed
runs are printed and must be 0 (the exit status says so).
"""

from __future__ import annotations

import asyncio
import datetime
import itertools
import os
import platform
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import numpy as np
from absl import app, logging

from benchmarks.grpc_load import LoadResult, LocalServer, chat_prompts, run_load, sampling, warm_up
from engine.flags import FLAGS, llm_from_flags

# grpc_load's flags, with this script's defaults.
FLAGS.set_default("num_clients", 32)
FLAGS.set_default("duration_s", 30.0)
FLAGS.set_default("repeats", 3)
FLAGS.set_default("precompile", True)


def _openai_kwargs(index: int, max_tokens: int) -> dict:
    """`sampling(index)` as `chat.completions.create` arguments (OpenAI's fields, the engine's in extra_body)."""
    s = sampling(index, max_tokens)
    return {"temperature": s["temperature"], "top_p": s["top_p"], "seed": s["seed"], "max_tokens": s["max_tokens"],
            "extra_body": {"ignore_eos": s["ignore_eos"]}}


async def run_http_load(base_url: str, prompts: list, *, num_clients: int, duration_s: float,
                        max_tokens: int) -> LoadResult:
    """The closed loop of `run_load` over the OpenAI HTTP API."""
    import openai

    r = LoadResult(duration_s)
    index = itertools.count()
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600)

    async def one_client():
        while time.monotonic() < end:
            i = next(index)
            sent, times, finished, tokens = time.monotonic(), [], False, 0
            try:
                stream = await client.chat.completions.create(
                    model=FLAGS.model, messages=prompts[i % len(prompts)], stream=True,
                    stream_options={"include_usage": True}, **_openai_kwargs(i, max_tokens))
                async for chunk in stream:
                    if chunk.usage is not None:
                        tokens = chunk.usage.completion_tokens
                    for choice in chunk.choices:
                        if choice.delta.content:
                            times.append(time.monotonic())
                        finished = finished or choice.finish_reason is not None
            except openai.OpenAIError as e:
                r.errors += 1
                r.error_messages.append(f"{type(e).__name__}: {e}")
                continue
            if not finished:
                r.lost += 1
                continue
            r.completed += 1
            r.tokens += tokens
            r.window_tokens += tokens if times and times[-1] <= end else 0
            if times:
                r.ttft_s.append(times[0] - sent)
                per = tokens / len(times)  # tokens per text chunk
                r.itl_s.extend(np.repeat(np.diff(times) / per, round(per)).tolist())

    start = time.monotonic()
    end = start + duration_s
    await asyncio.gather(*(one_client() for _ in range(num_clients)))
    r.wall_s = time.monotonic() - start
    await client.close()
    return r


async def _warm_up_http(base_url: str, prompts: list, num_clients: int, max_tokens: int) -> None:
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600)
    await asyncio.gather(*(client.chat.completions.create(model=FLAGS.model, messages=prompts[i % len(prompts)],
                                                          **_openai_kwargs(i, max_tokens)) for i in range(num_clients)))
    await client.close()


def _median(values, fmt: str = "{:.1f}") -> str:
    return f"{fmt.format(float(np.median(values)))} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    logging.set_verbosity(logging.WARNING)
    from engine.compilation import compilation_count

    load_before = os.getloadavg()[0]
    prompts = chat_prompts()
    kwargs = {"num_clients": FLAGS.num_clients, "max_tokens": FLAGS.max_tokens}
    llm = llm_from_flags()
    if FLAGS.precompile:  # every step bucket, so no timed run compiles
        llm.engine.precompile()
    local = LocalServer(llm, http=True)
    runs: dict[str, list[LoadResult]] = {"gRPC": [], "HTTP": []}
    compiled = compilation_count()
    try:
        asyncio.run(warm_up(local.target, prompts, **kwargs))
        asyncio.run(_warm_up_http(local.base_url, prompts, FLAGS.num_clients, FLAGS.max_tokens))
        compiled = compilation_count()
        for _ in range(FLAGS.repeats):
            runs["gRPC"].append(asyncio.run(run_load(local.target, prompts, duration_s=FLAGS.duration_s, **kwargs)))
            runs["HTTP"].append(asyncio.run(run_http_load(local.base_url, prompts, duration_s=FLAGS.duration_s,
                                                          **kwargs)))
        compiled = compilation_count() - compiled
    finally:
        local.stop()
    print(f"# HTTP (OpenAI API) and gRPC under load, {datetime.date.today()}, {platform.machine()}, "
          f"{os.cpu_count()} CPUs, load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after")
    print(f"model {FLAGS.model}; {FLAGS.num_clients} streaming clients for {FLAGS.duration_s:g} s per run, "
          f"{FLAGS.repeats} runs per protocol alternating; {FLAGS.max_tokens} tokens per request; "
          f"compilations during the timed runs: {compiled}\n")
    print("| protocol | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | tokens/s | completed | errors | lost |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, results in runs.items():
        pct = lambda attr, q: [1e3 * float(np.percentile(getattr(r, attr), q)) for r in results]  # noqa: E731
        print(f"| {name} | {_median(pct('ttft_s', 50))} | {_median(pct('ttft_s', 99))} | {_median(pct('itl_s', 50))} | "
              f"{_median(pct('itl_s', 99))} | {_median([r.tokens_per_s for r in results])} | "
              f"{sum(r.completed for r in results)} | {sum(r.errors for r in results)} | "
              f"{sum(r.lost for r in results)} |")
    for message in [m for rs in runs.values() for r in rs for m in r.error_messages][:5]:
        print(f"error: {message}")
    ok = compiled == 0 and all(r.errors == 0 and r.lost == 0 for rs in runs.values() for r in rs)
    return 0 if ok else 1


if __name__ == "__main__":
    app.run(main)
