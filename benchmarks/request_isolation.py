"""Does one heavy but valid request stall the others? A stream's inter-token gaps beside heavy neighbours.

  python benchmarks/request_isolation.py [--rounds=3] [--max_tokens=128] [--model=smollm2-135m-instruct]

A server over one engine runs in this process (`benchmarks.grpc_load.LocalServer`). The probe is one greedy
stream of `--max_tokens` tokens; its gaps are the times between its messages. Each round runs, in turn:

* alone: the probe only;
* + 4 plain: the probe beside 4 requests generating as many tokens (the batch is 5 rows: the baseline for
  the next case, which differs only in its stop strings);
* + 4 at the stop limit: the same 4 requests, each with the server's most stop strings of its most characters
  (`--max_stop_strings` x `--max_stop_chars`), which the engine thread matches every step;
* + Tokenize/Detokenize: beside the probe, back to back until it ends, a Tokenize of a text and a Detokenize of
  token ids, each as large as `--max_request_bytes` allows.

Reported: the probe's p50 and p99 gap per case (medians over rounds, min-max), and the p99 ratios that issue 53
bounds (stop limit / 4 plain, Tokenize-Detokenize / alone: at most 1.5). Every shape is compiled before timing
(`Engine.precompile`, then a warm-up round), and the engine's compilation count must not move during the
timed rounds.
"""

from __future__ import annotations

import asyncio
import os
import platform
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import numpy as np
from absl import app, flags, logging  # noqa: I001

from benchmarks.grpc_load import LocalServer  # noqa: E402 -- also defines --prompts_dir and the engine flags
from engine.flags import FLAGS, llm_from_flags
from engine.serving.client import AsyncClient

flags.DEFINE_integer("rounds", 3, "Timed rounds (each runs every case).")
FLAGS.set_default("max_tokens", 128)  # grpc_load's flag: the tokens the probe and its neighbours generate

PROBE = "Write a short story about a lighthouse keeper who finds a message in a bottle."
NEIGHBOUR = "List ten facts about the moon, one per line."
CASES = ("alone", "+ 4 plain", "+ 4 at the stop limit", "+ Tokenize/Detokenize")


async def _probe(client: AsyncClient) -> list[float]:
    gaps, last = [], None
    call = client.stub.Generate(_request(PROBE, FLAGS.max_tokens), metadata=client.metadata)
    async for message in call:
        now = time.monotonic()
        if last is not None and message.token_ids:
            gaps.append(now - last)
        if message.token_ids:
            last = now
    return gaps


def _request(prompt: str, max_tokens: int, stop: list[str] | None = None):
    from engine.serving.client import generate_request

    return generate_request([{"role": "user", "content": prompt}], temperature=0, max_tokens=max_tokens,
                            ignore_eos=True, stop=stop or [])


async def _case(target: str, case: str, limits: dict) -> list[float]:
    """The probe's gaps (s) in `case`."""
    async with AsyncClient(target) as client:
        probe = asyncio.ensure_future(_probe(client))
        neighbours = []
        if case in ("+ 4 plain", "+ 4 at the stop limit"):
            stop = None
            if case == "+ 4 at the stop limit":
                # Strings the text will not contain, so that every one is searched for every step.
                stop = [f"{i:02d}" + "\u2603" * (limits["max_stop_chars"] - 2) for i in range(limits["max_stop_strings"])]
            for _ in range(4):
                call = client.stub.Generate(_request(NEIGHBOUR, FLAGS.max_tokens, stop), metadata=client.metadata)
                neighbours.append(asyncio.ensure_future(_drain(call)))
        elif case == "+ Tokenize/Detokenize":
            neighbours.append(asyncio.ensure_future(_tokenizer_load(client, probe, limits["max_request_bytes"])))
        gaps = await probe
        await asyncio.gather(*neighbours)
    return gaps


async def _drain(call) -> None:
    async for _ in call:
        pass


async def _tokenizer_load(client: AsyncClient, probe: asyncio.Future, max_bytes: int) -> None:
    text = ("the quick brown fox jumps over the lazy dog " * (max_bytes // 44))[:max_bytes - 16]
    ids = list(range(128, 228)) * ((max_bytes // 2 - 1000) // 100)  # 2-byte varints
    from engine.serving.protos import generate_pb2 as pb

    while not probe.done():
        await client.stub.Tokenize(pb.TokenizeRequest(text=text), metadata=client.metadata)
        await client.stub.Detokenize(pb.DetokenizeRequest(token_ids=ids), metadata=client.metadata)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return platform.processor()


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    logging.set_verbosity(logging.WARNING)
    from engine.compilation import compilation_count
    from engine.serving.server import ServingLimits

    llm = llm_from_flags()
    llm.engine.precompile()  # every program the server runs, as `engine.serve` does (loaded when cached)
    server = LocalServer(llm)
    config = llm.engine.config
    limits = {"max_stop_strings": config.max_stop_strings, "max_stop_chars": config.max_stop_chars,
              "max_request_bytes": ServingLimits().max_request_bytes}
    results = {case: [] for case in CASES}
    try:
        for case in CASES:  # warm-up: every shape the cases take
            asyncio.run(_case(server.target, case, limits))
        compiled = compilation_count()
        for r in range(FLAGS.rounds):
            for case in CASES:
                gaps = asyncio.run(_case(server.target, case, limits))
                results[case].append((np.percentile(gaps, 50), np.percentile(gaps, 99)))
                print(f"round {r + 1} {case}: p50 {1e3 * results[case][-1][0]:.1f} ms, "
                      f"p99 {1e3 * results[case][-1][1]:.1f} ms", file=sys.stderr, flush=True)
        assert compilation_count() == compiled, "a timed round compiled"
    finally:
        server.stop()

    def med(case, i):
        values = [1e3 * v[i] for v in results[case]]
        return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"

    print(f"\nMachine: {_cpu_name()}, {os.cpu_count()} CPUs. {FLAGS.model}, probe of {FLAGS.max_tokens} greedy "
          f"tokens; {FLAGS.rounds} rounds, medians (min-max).\n")
    print("| case | probe gap p50, ms | probe gap p99, ms |\n|---|---:|---:|")
    for case in CASES:
        print(f"| {case} | {med(case, 0)} | {med(case, 1)} |")
    p99 = {case: statistics.median(v[1] for v in results[case]) for case in CASES}
    print(f"\np99 ratios: stop limit / 4 plain {p99['+ 4 at the stop limit'] / p99['+ 4 plain']:.2f}, "
          f"Tokenize-Detokenize / alone {p99['+ Tokenize/Detokenize'] / p99['alone']:.2f} (issue 53: <= 1.5)")


if __name__ == "__main__":
    app.run(main)
