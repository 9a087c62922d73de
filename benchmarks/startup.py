"""How soon `python -m engine.serve` answers and serves, cold and with its compilation cache warm, and whether
anything compiles after it says SERVING.

  python benchmarks/startup.py [--rounds=2] [--mixed] [-- extra engine.serve flags]

Each round launches the server twice with a fresh, empty `--compilation_cache_dir` (cold), then again on
that folder (warm: a restart). From launch, gRPC health is polled every 0.1 s over loopback; reported are
the seconds to the first health answer (any status) and to SERVING, the programs compiled
(`engine_warmup_programs_total`) and the memory maps the server holds (/proc). With `--mixed`, once
SERVING a mixed workload runs (greedy and sampled, prefix-cache hits, logprobs, per-request draft lengths,
prompts of every token bucket's size, Score calls of several sizes) and `engine_compilations` from /metrics
must not move. Medians over rounds, with the spread; the machine is named.
"""

from __future__ import annotations

import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

from absl import app, flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

flags.DEFINE_integer("rounds", 2, "Cold + warm launches, alternating.")
flags.DEFINE_bool("mixed", True, "After SERVING, run the mixed workload and check that nothing compiles.")
flags.DEFINE_float("timeout_s", 900, "Give up on a launch after this long.")
FLAGS = flags.FLAGS


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            name = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        name = platform.processor()
    return f"{name}, {os.cpu_count()} CPUs"


def metric(url: str, name: str) -> float:
    page = urllib.request.urlopen(url, timeout=10).read().decode()
    return float(next(line.split()[1] for line in page.splitlines() if line.startswith(name + " ")))


def maps_of(pid: int) -> int:
    with open(f"/proc/{pid}/maps", "rb") as f:
        return sum(1 for _ in f)


def mixed_workload(target: str) -> int:
    """Requests that together meet every kind of program the server runs; returns how many calls were made."""
    from engine.serving.client import Client

    calls = 0
    with Client(target) as c:
        limit = c.model_info().max_num_batched_tokens
        words = "the quick brown fox jumps over the lazy dog and keeps running far away " * 80
        for n in [1, 3, 9, 20, 40, 70, 130, 260, limit, 2 * limit]:  # prompt lengths over the token buckets
            ids = c.tokenize(words)[:n]
            c.generate(ids, max_tokens=4, temperature=0, ignore_eos=True)
            c.generate(ids, max_tokens=4, temperature=0.8, top_p=0.9, seed=n, ignore_eos=True)  # a prefix hit
            calls += 2
        c.generate("Write a haiku about the sea.", max_tokens=8, temperature=0.7, seed=1, logprobs=5)
        c.generate("List three colours.", max_tokens=8, temperature=0, speculation=True, num_speculative_tokens=2)
        c.generate("List three colours.", max_tokens=8, temperature=0, speculation=False)
        for k in (1, 5, 17, 60):  # Score calls of several sizes
            c.score([words[:10 * k]] * min(k, 8))
        calls += 7
    return calls


def launch(cache: str, extra: list[str]) -> dict:
    cmd = [sys.executable, "-m", "engine.serve", "--port=0", "--metrics_port=0", f"--compilation_cache_dir={cache}",
           *extra]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env=dict(os.environ, PYTHONPATH=ROOT))
    from engine.serving.client import Client

    try:
        line = proc.stdout.readline()
        if not line.startswith("listening on "):
            raise RuntimeError(f"engine.serve said {line!r}")
        target = line.split(" on ")[1].split(",")[0]
        url = line.split("metrics on ")[1].split()[0]
        first = serving = None
        with Client(target) as c:
            while serving is None:
                if time.monotonic() - t0 > FLAGS.timeout_s or proc.poll() is not None:
                    raise RuntimeError("the server did not become SERVING")
                try:
                    status = c.health()
                except Exception:  # noqa: BLE001 -- not answering yet
                    status = None
                now = time.monotonic() - t0
                if status is not None and first is None:
                    first = now
                if status == "SERVING":
                    serving = now
                time.sleep(0.1)
        out = {"health_s": first, "serving_s": serving, "programs": metric(url, "engine_warmup_programs_total"),
               "maps": maps_of(proc.pid)}
        if FLAGS.mixed:
            before = metric(url, "engine_compilations")
            out["calls"] = mixed_workload(target)
            out["compiled_after"] = metric(url, "engine_compilations") - before
        return out
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def main(argv):
    extra = argv[1:]
    results = {"cold": [], "warm": []}
    for r in range(FLAGS.rounds):
        cache = tempfile.mkdtemp(prefix="jse-xla-")
        try:
            for kind in ("cold", "warm"):
                res = launch(cache, extra)
                results[kind].append(res)
                print(f"round {r + 1} {kind}: {res}", file=sys.stderr, flush=True)
        finally:
            shutil.rmtree(cache, ignore_errors=True)
    med = lambda xs: f"{statistics.median(xs):.1f} ({min(xs):.1f}-{max(xs):.1f})"  # noqa: E731
    print(f"\nMachine: {cpu_name()}. `engine.serve` {' '.join(extra) or '(default flags)'}; {FLAGS.rounds} rounds, "
          "medians (min-max).\n")
    print("| launch | health answers, s | SERVING, s | programs | memory maps | compiled after SERVING |")
    print("|---|---:|---:|---:|---:|---:|")
    for kind, rows in results.items():
        after = ", ".join(str(int(x["compiled_after"])) for x in rows) if FLAGS.mixed else "not run"
        print(f"| {kind} | {med([x['health_s'] for x in rows])} | {med([x['serving_s'] for x in rows])} | "
              f"{int(rows[0]['programs'])} | {int(statistics.median(x['maps'] for x in rows))} | {after} |")


if __name__ == "__main__":
    app.run(main)
