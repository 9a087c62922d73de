"""Suffix decoding on repetitive (agentic-style) workloads and on ordinary traffic: real model, fp32, CPU, batch 1.

  python benchmarks/suffix.py [--configs=off,auto,suffix] [--repeats=3] [--max_tokens=64] [--prompts_dir=...]

Workloads, each request alone (greedy, `ignore_eos`), decode timed from its first token to its last:

* repeat: 4 chat prompts answered once untimed, then each sent again (timed): the answer exists only in
  earlier outputs.
* refine: self-refinement, 3 chat prompts and 1 code prompt: the answer (round 0), then 3 rounds of "revise
  your answer" with the previous answer in the conversation (rounds 1-3, each its own row).
* json: one JSON-extraction instruction after each of 10 summarization documents, in turn (all timed: the global trie
  learns the format as the pipeline runs).
* chat, code, summarization: 4 prompts each never sent before (ordinary traffic, where suffix decoding must
  not lose).

Each configuration runs in a process of its own, the order rotating over `--repeats` rounds, after compiling
every batch-1 step shape (each timed request asserts it compiled nothing). The table gives medians (min-max)
over rounds of decode tok/s, each configuration's ratio to the first one in the same round, tokens per
target step (decode) and the proposer's host milliseconds per step (`EngineStats.seconds["propose"]`: the
lookups and the cost gate). Greedy outputs are asserted equal to the first configuration's.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from absl import app, flags  # noqa: E402

from benchmarks.baselines import read_prompts, spawn_worker, spread  # noqa: E402  (defines --prompts_dir)

FLAGS = flags.FLAGS
flags.DEFINE_list("configs", ["off", "auto", "suffix"], "\"off\", \"auto\" (LLM's default) or a `speculative` kind.")
flags.DEFINE_integer("repeats", 3, "Rounds, each configuration in a process of its own.")
flags.DEFINE_integer("max_tokens", 64, "Tokens per request.")
flags.DEFINE_string("worker", None, "Internal: run one --configs entry, print its figures.")

REVISE = "Revise your answer: make it clearer and more concise, and keep everything that was correct."
# The instruction after the document: SmolLM2-135M follows a format shown last, and answers prose otherwise.
JSON_TASK = ("{document}\n\nExtract the key facts of the article above as JSON. Answer with JSON only, in this "
             "format:\n{{\"topic\": \"...\", \"people\": [\"...\"], \"places\": [\"...\"], \"summary\": \"...\"}}")


def _workloads():
    """[(workload, [first turn messages])] in the order the worker runs them (refine grows its own turns)."""
    chat = [r["prompt"] for r in read_prompts("chat")]
    code = [r["prompt"] for r in read_prompts("code")]
    docs = [r["prompt"].split("\n\n", 1)[1] for r in read_prompts("summarization")]
    summaries = [r["prompt"] for r in read_prompts("summarization")]
    user = lambda text: [{"role": "user", "content": text}]
    return {
        "repeat": [user(t) for t in chat[:4]],
        "refine": [user(t) for t in chat[4:7] + code[:1]],
        "json": [user(JSON_TASK.format(document=d)) for d in docs[:10]],
        "chat": [user(t) for t in chat[8:12]],
        "code": [user(t) for t in code[1:5]],
        "summarization": [user(t) for t in summaries[10:14]],
    }


def _worker(config: str) -> dict:
    """Every workload under one configuration: {row: {"tps", "per_step", "host_ms", "tokens"}}."""
    from engine import LLM, SamplingParams
    from engine.compilation import compilation_count

    llm = LLM(speculative=None if config == "off" else config)
    engine = llm.engine
    engine.precompile([(t, s) for t, s in engine.runner.buckets if s == 1])
    sp = SamplingParams(temperature=0, max_tokens=FLAGS.max_tokens, ignore_eos=True)

    def one(messages, timed=True):
        first = []
        on_output = lambda i, out: first or first.append(time.perf_counter())
        compiled, steps, propose = compilation_count(), engine.stats.num_steps, engine.stats.seconds["propose"]
        out = llm.generate([messages], sp, on_output=on_output)[0]
        seconds = time.perf_counter() - first[0]
        if timed and compilation_count() != compiled:
            raise AssertionError(f"a timed request compiled {compilation_count() - compiled} programs")
        host = (engine.stats.seconds["propose"] - propose) / max(1, engine.stats.num_steps - steps)
        return out, (len(out.token_ids) - 1, seconds, out.num_target_steps - 1, host)

    rows: dict[str, list] = {}
    work = _workloads()
    for messages in work["repeat"]:
        one(messages, timed=False)
    for name in ("chat", "code", "summarization"):  # before json and refine: nothing like them was seen
        rows[name] = [one(m) for m in work[name]]
    rows["repeat"] = [one(m) for m in work["repeat"]]
    rows["json"] = [one(m) for m in work["json"]]
    for messages in work["refine"]:
        for r in range(4):
            out, figures = one(messages)
            rows.setdefault(f"refine {r}", []).append((out, figures))
            messages = [*messages, {"role": "assistant", "content": out.text}, {"role": "user", "content": REVISE}]
    result = {}
    for name, runs in rows.items():
        tokens, seconds, steps, host = (sum(f[i] for _, f in runs) for i in range(4))
        result[name] = {"tps": tokens / seconds, "per_step": tokens / steps, "host_ms": 1e3 * host / len(runs),
                        "tokens": [out.token_ids for out, _ in runs]}
        print(f"{config} {name}: {tokens / seconds:.1f} tok/s, {tokens / steps:.2f} tokens/step", file=sys.stderr,
              flush=True)
    return result


def _spawn(config: str) -> dict:
    return spawn_worker(__file__, [*sys.argv[1:], f"--worker={config}"])


def main(argv):
    del argv
    if FLAGS.worker:
        print("RESULT " + json.dumps(_worker(FLAGS.worker)), flush=True)
        return
    import jax

    configs, runs = FLAGS.configs, {c: [] for c in FLAGS.configs}
    for r in range(FLAGS.repeats):
        for config in configs[r % len(configs):] + configs[:r % len(configs)]:
            t = time.perf_counter()
            runs[config].append(_spawn(config))
            print(f"round {r + 1}: {config} took {time.perf_counter() - t:.0f} s", file=sys.stderr, flush=True)
    base = configs[0]
    print(f"# Suffix decoding ({time.strftime('%Y-%m-%d')}, {jax.devices()[0].device_kind}, {os.cpu_count()} CPUs, "
          f"fp32, greedy, batch 1, {FLAGS.max_tokens} tokens/request, {FLAGS.repeats} rounds: median (min-max))\n")
    print("| workload | " + " | ".join(f"{c} tok/s" for c in configs) + " | "
          + " | ".join(f"{c} / {base}" for c in configs[1:]) + " | "
          + " | ".join(f"{c} tokens/step" for c in configs) + " | "
          + " | ".join(f"{c} host ms/step" for c in configs[1:]) + " |")
    print("|---|" + "---:|" * (4 * len(configs) - 2))
    for row in runs[base][0]:
        for c in configs[1:]:
            for got, want in zip(runs[c], runs[base]):
                if got[row]["tokens"] != want[row]["tokens"]:
                    raise AssertionError(f"{c} {row}: greedy output differs from {base}'s")
        tps = [spread([run[row]["tps"] for run in runs[c]], ".1f") for c in configs]
        ratios = [spread([run[row]["tps"] / ref[row]["tps"] for run, ref in zip(runs[c], runs[base])], ".2f")
                  for c in configs[1:]]
        steps = [f"{statistics.median(run[row]['per_step'] for run in runs[c]):.2f}" for c in configs]
        host = [f"{statistics.median(run[row]['host_ms'] for run in runs[c]):.2f}" for c in configs[1:]]
        print(f"| {row} | " + " | ".join(tps + ratios + steps + host) + " |", flush=True)


if __name__ == "__main__":
    app.run(main)
