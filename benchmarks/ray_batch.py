"""The batch job's Ray runner against the single-process job: records per second on the same input and machine.

  python -m benchmarks.ray_batch [--num_prompts=256] [--max_tokens=32] [--rounds=3] [--prompts_dir=...]

Each configuration is a whole `python -m engine.batch` command in a process of
its own (the real model, greedy, `--num_prompts` real prompts as chat
messages), run once untimed to fill the compilation cache, then `--rounds`
times in turn, the order rotated each round:

* local: the single-process job on every core;
* ray-1: one actor on every core (`--ray_cpus_per_actor` = the cores);
* ray-2: two actors, one core each (on a 2-core host).

The Ray runs join one local Ray instance started before them (as a cluster
would be running), so its start is reported once and not in each run.
Printed per configuration: records/s over the whole command (model load, actor
start and all), the job's own wall time from its summary, and records/s over
that. Every run's records are asserted equal to the local job's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

from absl import app, flags

from benchmarks.baselines import spread
from benchmarks.batch_jobs import real_prompts

flags.DEFINE_integer("rounds", 3, "Timed rounds per configuration.")
flags.DEFINE_integer("batch_lines", 64, "--ray_batch_lines of the Ray runs.")
flags.DEFINE_list("configs", ["local", "ray-1", "ray-2"], "Configurations to run.")
FLAGS = flags.FLAGS
FLAGS.set_default("num_prompts", 256)  # --num_prompts and --max_tokens: benchmarks.batch_jobs' flags


def _command(config: str, src: str, out: str, summary: str, cache: str) -> list[str]:
    cores = len(os.sched_getaffinity(0))
    cmd = [sys.executable, "-m", "engine.batch", f"--input={src}", f"--output={out}", "--overwrite",
           f"--summary_json={summary}", f"--compilation_cache_dir={cache}"]
    if config == "ray-1":
        cmd += ["--runner=ray", "--ray_actors=1", f"--ray_cpus_per_actor={cores}"]
    elif config == "ray-2":
        cmd += ["--runner=ray", "--ray_actors=2", f"--ray_cpus_per_actor={cores // 2}"]
    cmd += [f"--ray_batch_lines={FLAGS.batch_lines}"] if config != "local" else []
    return cmd


def _records(path: str) -> list[dict]:
    """The records without what depends on the batch around a line (prefix-cache hits, drafts proposed and
    accepted), not on the line."""
    skip = ("num_cached_tokens", "num_draft_tokens", "num_accepted_tokens")
    with open(path) as f:
        return [{k: v for k, v in json.loads(line).items() if k not in skip} for line in f]


def main(argv):
    del argv
    lines = [{"id": i, "messages": [{"role": "user", "content": p}], "max_tokens": FLAGS.max_tokens,
              "temperature": 0.0} for i, p in enumerate(real_prompts(FLAGS.num_prompts))]
    work = tempfile.mkdtemp(prefix="ray_batch_")
    src, cache = os.path.join(work, "in.jsonl"), os.path.join(work, "cache")
    with open(src, "w") as f:
        f.writelines(json.dumps(line) + "\n" for line in lines)
    t = time.perf_counter()
    subprocess.run(["ray", "start", "--head", f"--num-cpus={len(os.sched_getaffinity(0))}",
                    "--include-dashboard=false"], check=True, capture_output=True)
    ray_start = time.perf_counter() - t
    env = dict(os.environ, RAY_ADDRESS="auto")
    results: dict[str, dict[str, list]] = {c: {"command": [], "job": []} for c in FLAGS.configs}
    reference = None
    try:
        for r in range(FLAGS.rounds + 1):
            order = FLAGS.configs[r % len(FLAGS.configs):] + FLAGS.configs[:r % len(FLAGS.configs)]
            for config in order:
                out, summary = os.path.join(work, f"{config}.jsonl"), os.path.join(work, f"{config}.json")
                t = time.perf_counter()
                done = subprocess.run(_command(config, src, out, summary, cache), env=env, capture_output=True,
                                      text=True)
                wall = time.perf_counter() - t
                if done.returncode:
                    raise RuntimeError(f"{config} exited {done.returncode}:\n{done.stderr[-3000:]}")
                got = _records(out)
                reference = reference or got
                assert got == reference, f"{config}'s tokens differ from the first run's"
                if r:  # round 0 fills the compilation cache
                    results[config]["command"].append(wall)
                    results[config]["job"].append(json.load(open(summary))["wall_s"])
                print(f"round {r} {config}: command {wall:.1f} s", file=sys.stderr)
    finally:
        subprocess.run(["ray", "stop", "--force"], capture_output=True)
    n = len(lines)
    print(f"\n{n} lines x {FLAGS.max_tokens} tokens (greedy, real chat/code/creative/math prompts), "
          f"{len(os.sched_getaffinity(0))} cores; local Ray instance started once in {ray_start:.1f} s; "
          f"medians (min-max) of {FLAGS.rounds} rounds\n")
    print("| configuration | command s | records/s (command) | job s | records/s (job) |")
    print("|---|---:|---:|---:|---:|")
    for config, res in results.items():
        print(f"| {config} | {spread(res['command'])} | {spread([n / w for w in res['command']])} | "
              f"{spread(res['job'])} | {spread([n / w for w in res['job']])} |")


if __name__ == "__main__":
    app.run(main)
