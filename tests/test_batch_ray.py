"""`python -m engine.batch --runner=ray` on a local 2-CPU Ray instance: the same records as the single-process job
(both formats, both modes, error records), resume after a killed driver, no line lost or doubled when an actor dies."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

ray = pytest.importorskip("ray")

from tests.test_batch import (FLAGS, ROOT, _comparable, _generate_lines, _jsonl, _records,  # noqa: E402
                              _text)

RAY = ["--runner=ray", "--ray_actors=2", "--ray_cpus_per_actor=1"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """One local Ray instance (2 CPUs) for the module; the jobs join it as drivers of their own."""
    info = ray.init(num_cpus=2, include_dashboard=False, logging_level="warning")
    cache = tmp_path_factory.mktemp("executables")
    env = dict(os.environ, RAY_ADDRESS=info.address_info["address"])
    yield env, f"--compilation_cache_dir={cache}"
    ray.shutdown()


def _run(env, cache, folder, lines, *args, name="out.jsonl", wait=True):
    src = folder / "in.jsonl"
    if lines is not None:
        src.write_text(_jsonl(lines))
    cmd = [sys.executable, "-m", "engine.batch", f"--input={src}", f"--output={folder / name}", *FLAGS, cache, *args]
    if not wait:
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode in (0, 1), out.stderr[-3000:]
    return out


def _same(folder, a, b):
    got, want = (_records(folder / n) for n in (a, b))
    assert len(got) == len(want)
    assert [_comparable(r) for r in got] == [_comparable(r) for r in want]
    return got


def test_generate_both_formats_equals_the_single_process_job(tmp_path, cluster):
    env, cache = cluster
    lines = _generate_lines(n_good=139, seed=2)  # both formats, greedy and seeded, n > 1, every kind of bad line
    local = _run(env, cache, tmp_path, lines, f"--summary_json={tmp_path / 'local.json'}", name="local.jsonl")
    out = _run(env, cache, tmp_path, None, *RAY, "--ray_batch_lines=16", f"--summary_json={tmp_path / 'ray.json'}")
    assert out.returncode == local.returncode == 1  # some lines failed
    records = _same(tmp_path, "out.jsonl", "local.jsonl")
    assert len(records) == len(lines) == 160
    assert sum(bool(r.get("error")) for r in records) == 21
    by_id = {r.get("custom_id", r.get("id")): r for r in records if r.get("error")}
    assert "duplicate id 'g0'" in by_id["g0"]["error"]  # g0's first line is in another block than its repeat
    summary, local_summary = (json.loads((tmp_path / n).read_text()) for n in ("ray.json", "local.json"))
    for k in ("lines_ok", "lines_failed", "lines_skipped", "prompt_tokens", "generated_tokens"):
        assert summary[k] == local_summary[k], k
    assert (summary["lines_ok"], summary["lines_failed"]) == (139, 21)


def test_score_mode_equals_the_single_process_job(tmp_path, cluster):
    env, cache = cluster
    lines = [{"id": f"p{i}", "context": f"the cat number {i} ", "continuation": "sat on the mat"} for i in range(12)]
    lines += [{"id": "long", "text": " ".join(["the dog was doing what it did"] * 60)},
              {"id": "t1", "token_ids": [7, 8, 9, 10]}, {"id": "bad", "context": "", "continuation": "x"},
              {"id": "short", "text": "a"}, '{"id": "broken"', {"id": "p3", "text": "a duplicate id"}]
    _run(env, cache, tmp_path, lines, "--mode=score", "--score_stride=100", name="local.jsonl")
    out = _run(env, cache, tmp_path, None, "--mode=score", "--score_stride=100", *RAY, "--ray_batch_lines=4")
    assert out.returncode == 1
    records = _same(tmp_path, "out.jsonl", "local.jsonl")
    assert [bool(r.get("error")) for r in records] == [False] * 14 + [True] * 4
    assert records[12]["num_tokens"] > 256  # scored in windows


def _pids(pattern: str) -> list[int]:
    found = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout.split()
    return [int(p) for p in found]


def _wait_for_records(proc, path, n, timeout=300) -> int:
    t0 = time.time()
    while time.time() - t0 < timeout and proc.poll() is None:
        if os.path.exists(path) and (count := sum(1 for _ in open(path, "rb"))) >= n:
            return count
        time.sleep(0.05)
    raise AssertionError(f"the job ended or stalled before {n} records: {proc.poll()}")


def _long_lines(n):
    return [{"id": i, "prompt": f"number {i} " + _text(__import__("random").Random(i), 4), "max_tokens": 48,
             "temperature": 0.0 if i % 2 else 0.9, "seed": i, "ignore_eos": True} for i in range(n)]


def test_a_killed_actor_loses_and_doubles_no_line(tmp_path, cluster):
    env, cache = cluster
    lines = _long_lines(400)
    _run(env, cache, tmp_path, lines, name="local.jsonl")
    proc = _run(env, cache, tmp_path, None, *RAY, "--ray_batch_lines=16", wait=False)
    written = _wait_for_records(proc, tmp_path / "out.jsonl", 1)
    workers = _pids(r"ray::MapWorker\(MapBatches\(EngineActor\)\)")
    assert len(workers) == 2, workers
    os.kill(workers[0], signal.SIGKILL)
    assert written < len(lines)
    assert proc.wait(timeout=600) == 0, proc.stderr.read()[-3000:]
    records = _same(tmp_path, "out.jsonl", "local.jsonl")
    assert [r["id"] for r in records] == list(range(len(lines)))  # each line once, in input order
    assert workers[0] not in _pids(r"ray::MapWorker\(MapBatches\(EngineActor\)\)")


def test_a_killed_driver_resumes_where_it_stopped(tmp_path, cluster):
    env, cache = cluster
    lines = _long_lines(240)
    _run(env, cache, tmp_path, lines, name="local.jsonl")
    proc = _run(env, cache, tmp_path, None, *RAY, "--ray_batch_lines=16", wait=False)
    _wait_for_records(proc, tmp_path / "out.jsonl", 20)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    with open(tmp_path / "out.jsonl", "ab") as f:
        f.write(b'{"id": "torn')  # as if killed inside a write
    done = len(_records_whole(tmp_path / "out.jsonl"))
    assert 20 <= done < len(lines)
    out = _run(env, cache, tmp_path, None, *RAY, "--ray_batch_lines=16")
    assert f"resuming: {done} records" in out.stderr and "torn last line" in out.stderr
    assert out.returncode == 0
    _same(tmp_path, "out.jsonl", "local.jsonl")


def test_an_actor_that_cannot_start_ends_the_job_with_the_reason(tmp_path, cluster):
    env, cache = cluster
    src = tmp_path / "in.jsonl"
    src.write_text('{"id": 1, "prompt": "x"}\n')
    cmd = [sys.executable, "-m", "engine.batch", f"--input={src}", f"--output={tmp_path / 'o.jsonl'}", *FLAGS, cache,
           *RAY, "--model=no-such-model"]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr[-3000:]
    assert any(line.startswith("error: the Ray job failed: ValueError: cannot load model 'no-such-model'")
               for line in out.stderr.splitlines()), out.stderr[-3000:]


def _records_whole(path):
    return [line for line in open(path, "rb") if line.endswith(b"\n")]


def test_ray_runner_refuses_flags_it_cannot_honour(tmp_path):
    (tmp_path / "in.jsonl").write_text('{"id": 1, "prompt": "x"}\n')
    base = [sys.executable, "-m", "engine.batch", f"--input={tmp_path / 'in.jsonl'}", f"--output={tmp_path / 'o'}",
            *FLAGS, "--runner=ray"]
    for bad, message in [("--num_shards=2", "--runner=ray spreads the lines"), ("--ray_actors=0", "--ray_actors must"),
                         ("--ray_gpus_per_actor=-1", "must be >= 0"), ("--unordered", "--runner=ray spreads")]:
        out = subprocess.run([*base, bad], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert out.returncode == 2 and message in out.stderr, (bad, out.stderr[-2000:])
    out = subprocess.run([*base[:3], f"--input={tmp_path / 'missing.jsonl'}", *base[4:]], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "no input file" in out.stderr
