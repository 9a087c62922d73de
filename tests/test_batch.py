"""`python -m engine.batch` end to end on a tiny random model: formats, errors, order, resume after kills, merge."""

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from engine import LLM, SamplingParams
from engine.batch.job import rolling_windows

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIMITS = {"num_blocks": 256, "block_size": 16, "max_num_seqs": 16, "max_num_batched_tokens": 128,
          "max_model_len": 256}
FLAGS = ["--model=tiny-llama", "--speculative=off", *(f"--{k}={v}" for k, v in LIMITS.items())]
WORDS = "the cat sat on a mat and then it ran off to see what the dog was doing".split()


@pytest.fixture(scope="module", autouse=True)
def _compilation_cache(tmp_path_factory):
    """The jobs run as processes; a persistent compilation cache spares each one compiling every bucket."""
    env = {"JAX_COMPILATION_CACHE_DIR": str(tmp_path_factory.mktemp("jax_cache")),
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
    _ENV.update(os.environ, **env)
    yield
    _ENV.clear()


_ENV = {}


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny-llama", speculative=None, **LIMITS)


def _jsonl(lines) -> str:
    return "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines)


def _job(tmp_path, lines, *args, name="out.jsonl", check=True, wait=True):
    src = tmp_path / "in.jsonl"
    if lines is not None:
        src.unlink(missing_ok=True)  # a FIFO of `_held_input`
        src.write_text(_jsonl(lines))
    cmd = [sys.executable, "-m", "engine.batch", f"--input={src}", f"--output={tmp_path / name}", *FLAGS, *args]
    if not wait:
        return subprocess.Popen(cmd, cwd=ROOT, env=_ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out = subprocess.run(cmd, cwd=ROOT, env=_ENV, capture_output=True, text=True, timeout=600)
    if check and out.returncode not in (0, 1):
        raise AssertionError(out.stderr[-3000:])
    return out


def _records(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def _comparable(record):
    """A record without what may differ between runs: OpenAI's `created` time and prefix-cache hits."""
    body = (record.get("response") or {}).get("body") or {}
    body.pop("created", None)
    record.pop("num_cached_tokens", None)
    return record


def _text(rng, n):
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _generate_lines(n_good=279, seed=0):
    """Good lines of both formats (greedy and seeded, n > 1, stop strings) and bad lines of every kind."""
    rng = random.Random(seed)
    lines = []
    for i in range(n_good):
        sampling = {"max_tokens": rng.randint(1, 12)}
        if i % 3:
            sampling.update(temperature=rng.choice([0.7, 1.0]), seed=i, top_p=rng.choice([1.0, 0.9]))
        else:
            sampling["temperature"] = 0.0
        if i % 7 == 0:
            sampling["stop"] = [rng.choice("aeiou")]
        if i % 11 == 0:
            sampling["n"] = 2
        if i % 4 == 3:  # OpenAI batch format
            api = rng.choice(["chat", "completion"])
            body = {k: v for k, v in sampling.items()}
            if api == "chat":
                body["messages"] = [{"role": "user", "content": _text(rng, rng.randint(1, 8))}]
                url = "/v1/chat/completions"
            else:
                body["prompt"] = _text(rng, rng.randint(1, 8))
                url = "/v1/completions"
            lines.append({"custom_id": f"req-{i}", "method": "POST", "url": url, "body": body})
        elif i % 4 == 2:
            lines.append({"id": f"g{i}", "messages": [{"role": "user", "content": _text(rng, 3)}], **sampling})
        else:
            lines.append({"id": f"g{i}", "prompt": _text(rng, rng.randint(1, 10)), **sampling})
    bad = ['{"id": "broken", "prompt": ', "[1, 2, 3]", '{"id": "u1", "prompt": "x", "colour": "red"}',
           '{"id": "t1", "prompt": "x", "temperature": -1}', '{"id": "p1", "prompt": "x", "top_p": 0}',
           '{"id": "m1", "prompt": "x", "max_tokens": 0}', '{"id": "n1", "prompt": "x", "n": 0}',
           '{"id": "e1", "prompt": ""}', '{"id": "l1", "prompt": "' + "z " * 300 + '"}',
           '{"id": "g0", "prompt": "a duplicate id"}', '{"id": "two", "prompt": "x", "token_ids": [1]}',
           '{"id": "v1", "token_ids": [1, 99999]}', '{"id": [1], "prompt": "x"}',
           '{"custom_id": "o1", "method": "GET", "url": "/v1/completions", "body": {"prompt": "x"}}',
           '{"custom_id": "o2", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}}',
           '{"custom_id": "o3", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x", "best_of": 2}}',
           '{"custom_id": "o4", "method": "POST", "url": "/v1/chat/completions", "body": {"prompt": "x"}}',
           '{"custom_id": "o5", "method": "POST", "url": "/v1/completions", "body": {"prompt": ["a", "b"]}}',
           '{"custom_id": "req-3", "method": "POST", "url": "/v1/completions", "body": {"prompt": "dup"}}',
           '{"id": "s1", "messages": [{"role": "user"}]}', '[' * 100000 + ']' * 100000]
    for j, b in enumerate(bad):
        lines.insert(7 + j * (len(lines) // len(bad)), b)
    return lines


def _reference(llm, line):
    """What `LLM.generate` gives for a good line: (prompt ids, outputs)."""
    if "custom_id" in line:
        body = line["body"]
        prompt = body.get("messages", body.get("prompt"))
        sp = {k: body[k] for k in ("max_tokens", "temperature", "top_p", "seed", "n") if k in body}
        sp["stop"] = tuple(body.get("stop", ()))
    else:
        prompt = line.get("prompt", line.get("messages"))
        sp = {k: v for k, v in line.items() if k not in ("id", "prompt", "messages")}
    outs = llm.generate([prompt], SamplingParams(**sp))
    return llm.encode(prompt), outs


def test_mixed_generate_file_equals_llm_generate_and_bad_lines_get_error_records(tmp_path, llm):
    lines = _generate_lines()
    out = _job(tmp_path, lines, f"--summary_json={tmp_path / 's.json'}", "--max_inflight=64")
    assert out.returncode == 1, out.stderr[-2000:]  # some lines failed
    records = _records(tmp_path / "out.jsonl")
    assert len(records) == len(lines) == 300
    errors = [r for r in records if r.get("error")]
    assert len(errors) == 21
    summary = json.loads((tmp_path / "s.json").read_text())
    assert (summary["lines_ok"], summary["lines_failed"], summary["lines_skipped"]) == (279, 21, 0)
    assert "lines ok 279, failed 21" in out.stderr
    for n, (line, record) in enumerate(zip(lines, records), start=1):
        if isinstance(line, str):  # a bad line: its error record names it
            err = record["error"]
            assert (err["line"] if isinstance(err, dict) else record["line"]) == n
            if "custom_id" in line:
                assert record["response"]["status_code"] == 400
            continue
        ids, want = _reference(llm, line)
        if "custom_id" in line:
            assert record["custom_id"] == line["custom_id"] and record["error"] is None
            body = record["response"]["body"]
            assert record["response"]["status_code"] == 200
            texts = [c["message"]["content"] if "message" in c else c["text"] for c in body["choices"]]
            assert texts == [o.text for o in want]
            assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": sum(len(o.token_ids) for o in want),
                                     "total_tokens": len(ids) + sum(len(o.token_ids) for o in want)}
            assert [c["finish_reason"] for c in body["choices"]] == \
                   ["length" if o.finish_reason == "length" else "stop" for o in want]
        else:
            got = record["outputs"] if len(want) > 1 else [record]
            assert record["id"] == line["id"] and record["num_prompt_tokens"] == len(ids)
            assert [(g["token_ids"], g["text"], g["finish_reason"]) for g in got] == \
                   [(o.token_ids, o.text, o.finish_reason) for o in want]
    by_id = {r.get("custom_id", r.get("id")): r for r in errors}
    assert "unknown fields ['colour']" in by_id["u1"]["error"]
    assert "duplicate id 'g0'" in by_id["g0"]["error"] and by_id["g0"]["line"] > 1
    assert "context limit" in by_id["l1"]["error"]
    assert by_id["req-3"]["error"]["message"].startswith("duplicate id")


@contextlib.contextmanager
def _held_input(tmp_path, lines, first: int | None = None):
    """The job's input as a FIFO that a thread writes `lines[:first]` (all by default) to and holds open: the
    job, with no end of input, cannot finish before the test signals it. Calling what this yields writes the
    rest and closes the FIFO."""
    path = tmp_path / "in.jsonl"
    path.unlink(missing_ok=True)
    os.mkfifo(path)
    first = len(lines) if first is None else first
    release = threading.Event()

    def write():
        try:
            with open(path, "w") as f:  # once the job opens it
                f.write(_jsonl(lines[:first]))
                f.flush()
                release.wait()
                f.write(_jsonl(lines[first:]))
        except BrokenPipeError:  # the job is gone
            pass

    thread = threading.Thread(target=write, daemon=True)
    thread.start()
    try:
        yield release.set
    finally:
        release.set()
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a reader for what the job left unread
        try:
            while thread.is_alive():
                with contextlib.suppress(BlockingIOError):
                    os.read(fd, 1 << 16)
                thread.join(0.01)
        finally:
            os.close(fd)
            path.unlink()


def _kill_when(proc, path, n_records, timeout=300):
    t0 = time.time()
    while time.time() - t0 < timeout:
        if os.path.exists(path) and sum(1 for _ in open(path, "rb")) >= n_records:
            break
        if proc.poll() is not None:
            return False
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    return True


def test_sigkill_three_times_then_resume_equals_an_uninterrupted_run(tmp_path):
    lines = _generate_lines(n_good=140, seed=1)
    whole = tmp_path / "whole"
    whole.mkdir()
    _job(whole, lines, "--max_inflight=8")
    want = [_comparable(r) for r in _records(whole / "out.jsonl")]
    rng = random.Random(7)
    # The input held open, the job cannot end: it waits for more input with up to 8 lines in flight, the records
    # before them written (152 of these 161), so each count below is reached.
    for n_records in sorted(rng.sample(range(5, len(lines) - 16), 3)):
        with _held_input(tmp_path, lines):
            proc = _job(tmp_path, None, "--max_inflight=8", wait=False)
            assert _kill_when(proc, tmp_path / "out.jsonl", n_records), "the job ended before the kill"
    with open(tmp_path / "out.jsonl", "ab") as f:
        f.write(b'{"id": "torn')  # as if killed inside a write
    out = _job(tmp_path, lines, "--max_inflight=8")
    assert "resuming" in out.stderr and "torn last line" in out.stderr
    got = [_comparable(r) for r in _records(tmp_path / "out.jsonl")]
    keys = [(r.get("custom_id", r.get("id")), r.get("line") or (r.get("error") or {}).get("line")) for r in got]
    assert len(keys) == len(set(keys)) == len(lines)
    assert got == want


def test_sigterm_finishes_the_lines_in_flight_and_a_rerun_completes(tmp_path):
    lines = [{"id": i, "prompt": f"number {i}", "max_tokens": 20, "temperature": 0} for i in range(200)]
    path = tmp_path / "out.jsonl"
    # 40 lines until the signal, then one turn's room (16) at most: it cannot admit all 200.
    with _held_input(tmp_path, lines, first=40) as write_the_rest:
        proc = _job(tmp_path, None, "--max_inflight=16", wait=False)
        t0 = time.time()
        while not (path.exists() and path.read_text().count("\n") >= 10) and proc.poll() is None \
                and time.time() - t0 < 300:
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        write_the_rest()  # a read waiting for input at the signal returns
        _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 143, stderr[-2000:]
    first = _records(path)
    assert 10 <= len(first) <= 40 + 16 and [r["id"] for r in first] == list(range(len(first)))
    assert all(r.get("finish_reason") in ("length", "stop") for r in first)  # finished, not aborted
    assert "interrupted" in stderr
    assert _job(tmp_path, lines, "--max_inflight=16").returncode == 0
    assert [r["id"] for r in _records(path)] == list(range(200))


def test_unordered_output_holds_the_same_records_and_shards_merge_in_input_order(tmp_path):
    rng = random.Random(2)
    # Long lines first, so that finish order differs from input order.
    lines = [{"id": f"x{i}", "prompt": _text(rng, 3), "max_tokens": 40 - i if i < 8 else 2, "temperature": 0,
              "ignore_eos": True}
             for i in range(40)]
    lines.insert(5, "oops")
    _job(tmp_path, lines, "--max_inflight=16")
    ordered = _records(tmp_path / "out.jsonl")
    assert [r["id"] for r in ordered] == [line["id"] if isinstance(line, dict) else None for line in lines]
    _job(tmp_path, None, "--max_inflight=16", "--unordered", name="unordered.jsonl")
    unordered = _records(tmp_path / "unordered.jsonl")
    assert [r["id"] for r in unordered] != [r["id"] for r in ordered]  # finish order showed
    key = lambda r: json.dumps(r, sort_keys=True)
    assert sorted(map(key, unordered)) == sorted(map(key, ordered))
    shards = [f"shard{i}.jsonl" for i in range(3)]
    for i, name in enumerate(shards):
        _job(tmp_path, None, "--num_shards=3", f"--shard_index={i}", name=name)
    assert len(_records(tmp_path / shards[1])) == 14  # lines 2, 5, ..., 41
    merged = _job(tmp_path, None, "--merge=" + ",".join(str(tmp_path / s) for s in shards), name="merged.jsonl")
    assert merged.returncode == 0, merged.stderr[-2000:]
    assert _records(tmp_path / "merged.jsonl") == ordered
    bad = _job(tmp_path, None, f"--merge={tmp_path / shards[0]},{tmp_path / shards[1]}", name="m2.jsonl",
               check=False)
    assert bad.returncode == 2 and "not next" in bad.stderr


def test_score_mode_pairs_texts_and_rolling_windows_match_llm_score(tmp_path, llm):
    rng = random.Random(3)
    contexts = [_text(rng, rng.randint(2, 6)) + " " for _ in range(6)]
    # Continuations that are the model's own greedy text (is_greedy true), and others.
    greedy_pairs = []
    for c in contexts:
        out = llm.generate([c.rstrip()], SamplingParams(temperature=0, max_tokens=3))[0]
        if out.text.isascii() and out.text.isprintable() and out.text.strip() and llm.encode(
                c.rstrip() + out.text)[len(llm.encode(c.rstrip())):] == out.token_ids:
            greedy_pairs.append((c.rstrip(), out.text))
    assert greedy_pairs, "no context with a printable greedy continuation"
    long_text = _text(rng, 200)  # ~800 tokens: several windows of 256
    lines = [{"id": f"p{i}", "context": c, "continuation": w} for i, (c, w) in enumerate(greedy_pairs)]
    lines += [{"id": f"q{i}", "context": c, "continuation": "dog was doing"} for i, c in enumerate(contexts)]
    lines += [{"id": "t0", "text": "the cat sat on the mat"}, {"id": "t1", "token_ids": [7, 8, 9, 10]},
              {"id": "long", "text": long_text}, {"id": "bad", "context": "", "continuation": "x"},
              {"id": "short", "text": "a"}]
    out = _job(tmp_path, lines, "--mode=score", "--score_stride=100")
    assert out.returncode == 1, out.stderr[-2000:]
    records = {r["id"]: r for r in _records(tmp_path / "out.jsonl")}
    assert "error" in records["bad"] and "error" in records["short"]
    for line in lines:
        if "context" not in line or not line["context"]:
            continue
        context, continuation = line["context"], line["continuation"]
        spaces = len(context) - len(context.rstrip())
        context, continuation = context[:len(context) - spaces], context[len(context) - spaces:] + continuation
        whole, n_ctx = llm.encode(context + continuation), len(llm.encode(context))
        scored = llm.score([whole])[0]
        r = records[line["id"]]
        assert r["num_tokens"] == len(whole) - n_ctx
        assert abs(r["log_likelihood"] - sum(scored.token_logprobs[n_ctx - 1:])) < 1e-5
        greedy = llm.generate([whole[:n_ctx]], SamplingParams(temperature=0, max_tokens=len(whole) - n_ctx,
                                                               ignore_eos=True))[0]
        assert r["is_greedy"] == (greedy.token_ids == whole[n_ctx:])
    assert all(records[f"p{i}"]["is_greedy"] for i in range(len(greedy_pairs)))
    for key, text in (("t0", "the cat sat on the mat"), ("t1", [7, 8, 9, 10])):
        want = llm.score([text])[0]
        np.testing.assert_allclose(records[key]["token_logprobs"], want.token_logprobs, atol=1e-5)
        assert records[key]["num_tokens"] == len(want.token_ids)
        assert records[key]["perplexity"] == pytest.approx(np.exp(-want.log_likelihood / len(want.token_logprobs)))
    ids = llm.encode(long_text)
    windows = rolling_windows(len(ids), 256, 100)
    assert len(windows) >= 4 and sum(keep for _, _, keep in windows) == len(ids) - 1  # each token once
    want = []
    for start, end, keep in windows:
        lp = llm.score([ids[start:end]])[0].token_logprobs
        want += lp[len(lp) - keep:]
    got = records["long"]["token_logprobs"]
    assert len(got) == len(ids) - 1
    np.testing.assert_allclose(got, want, atol=1e-5)
    assert records["long"]["log_likelihood"] == pytest.approx(sum(want), abs=1e-3)


def test_rolling_windows_score_each_token_once_with_the_stated_context():
    assert rolling_windows(10, 16, 8) == [(0, 10, 9)]
    assert rolling_windows(40, 16, 8) == [(0, 16, 15), (8, 24, 8), (16, 32, 8), (24, 40, 8)]
    assert rolling_windows(35, 16, 8) == [(0, 16, 15), (8, 24, 8), (16, 32, 8), (19, 35, 3)]


def test_bad_flags_and_missing_input_exit_2(tmp_path):
    out = _job(tmp_path, [{"id": 1, "prompt": "x"}], "--shard_index=3", check=False)
    assert out.returncode == 2 and "shard_index" in out.stderr
    (tmp_path / "out.jsonl").write_text('{"id": 1}\nnot json\n{"id": 2}\n')
    out = _job(tmp_path, None, check=False)
    assert out.returncode == 2 and "--overwrite" in out.stderr


def test_data_parallel_workers_merge_to_the_single_process_output(tmp_path):
    rng = random.Random(4)
    lines = [{"id": f"d{i}", "prompt": _text(rng, 4), "max_tokens": 6, "temperature": 0} for i in range(12)]
    lines += [{"id": "s0", "prompt": _text(rng, 4), "max_tokens": 6, "temperature": 0.8, "seed": 7}, "not json"]
    lines.append({"id": "d1", "prompt": "again", "max_tokens": 2})  # line 15 (shard 0) repeats line 2's id (shard 1)
    single = _job(tmp_path, lines)
    assert single.returncode == 1  # the bad line and the duplicate
    assert "duplicate id 'd1'" in _records(tmp_path / "out.jsonl")[14]["error"]
    dp = _job(tmp_path, None, "--data_parallel_size=2", name="dp.jsonl")
    assert dp.returncode == 1, dp.stderr[-2000:]
    assert "merged 15 records from 2 shards" in dp.stderr and "1 lines repeat an id" in dp.stderr
    single_records = list(map(_comparable, _records(tmp_path / "out.jsonl")))
    assert list(map(_comparable, _records(tmp_path / "dp.jsonl"))) == single_records
    assert len(_records(tmp_path / "dp.jsonl.shard-1-of-2")) == 7  # lines 2, 4, ..., 14
    first = _records(tmp_path / "dp.jsonl")
    again = _job(tmp_path, None, "--data_parallel_size=2", name="dp.jsonl")  # each worker resumes: all done
    assert again.returncode == 1 and again.stderr.count("resuming: ") == 2  # the duplicate is found again
    assert _records(tmp_path / "dp.jsonl") == first
    bad = _job(tmp_path, None, "--data_parallel_size=2", "--unordered", name="dp2.jsonl", check=False)
    assert bad.returncode == 2 and "no --unordered" in bad.stderr
    same = _job(tmp_path, None, "--data_parallel_size=2", name="in.jsonl", check=False)
    assert same.returncode == 2 and "must not be the input" in same.stderr
    assert len((tmp_path / "in.jsonl").read_text().splitlines()) == 15  # the input is untouched


def test_output_problems_are_one_line_and_exit_74(tmp_path):
    """Issue 53: an output path that is a directory, a read-only folder and a full disk each printed a Python
    traceback and exited 1, like a run with bad lines. Each is now one line naming the path and the reason,
    exit 74; all but the full disk are found before the model loads."""
    lines = [{"id": i, "prompt": f"number {i}", "max_tokens": 3} for i in range(4)]
    (tmp_path / "adir").mkdir()
    cases = [("adir", "is a directory"), ("missing/out.jsonl", "no directory")]
    if os.geteuid() != 0:  # root writes into a read-only folder
        (tmp_path / "ro").mkdir(mode=0o555)
        cases.append(("ro/out.jsonl", "cannot be written: Permission denied"))
    for name, reason in cases:
        out = _job(tmp_path, lines, name=name, check=False)
        assert out.returncode == 74 and reason in out.stderr and "Traceback" not in out.stderr, out.stderr[-2000:]
    # A full disk mid-run: /dev/full opens, and every write fails with ENOSPC.
    out = _job(tmp_path, lines, "--overwrite", name="/dev/full", check=False)
    assert out.returncode == 74 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert "No space left on device; 0 records are safe in it" in out.stderr and "rerun" in out.stderr


def test_a_line_past_the_size_limit_is_an_error_record_and_never_held_whole(tmp_path):
    """Issue 53: a 50 MB line was tokenized whole before the length check (77 s, 7.8 GB RSS). Now it is read
    past in pieces and gets an error record; the lines around it run, and a rerun skips it (exit 1: the file
    holds an error record)."""
    import tracemalloc

    from engine.batch.io import read_lines

    big = tmp_path / "big.jsonl"
    with open(big, "w") as f:
        f.write('{"id": 0, "prompt": "a"}\n{"id": 1, "prompt": "' + "word " * 10_000_000 + '"}\n{"id": 2, "prompt": "b"}\n')
    tracemalloc.start()
    t0 = time.perf_counter()
    got = [(n, text is None) for n, text, _ in read_lines(big, max_line_bytes=1 << 20)]
    seconds, (_, peak) = time.perf_counter() - t0, tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert got == [(1, False), (2, True), (3, False)]
    assert seconds < 5 and peak < 8 << 20, (seconds, peak)  # 50 MB read past with at most ~2 MiB held
    lines = [{"id": 0, "prompt": "a b", "max_tokens": 2}, json.dumps({"id": 1, "prompt": "x" * 3_000_000}),
             {"id": 2, "prompt": "c d", "max_tokens": 2}]
    for run in range(2):
        out = _job(tmp_path, lines, "--max_line_bytes=1000000")
        assert out.returncode == 1, out.stderr[-2000:]
    records = _records(tmp_path / "out.jsonl")
    assert [r.get("line") for r in records] == [None, 2, None] and [r["id"] for r in records] == [0, None, 2]
    assert "longer than 1000000 bytes (--max_line_bytes)" in records[1]["error"]


def test_sigterm_gives_lines_in_flight_a_grace_then_leaves_them_for_the_rerun(tmp_path):
    """Issue 53: SIGTERM with every line in flight finished all of them (52 s) and exited 1, not 143. Now
    the lines in flight get --grace_s, then are aborted unwritten; the job exits 143 and a rerun writes them.
    A grace of 0 aborts them whatever the machine's speed (the grace given: the test above)."""
    lines = [{"id": 0, "prompt": "start", "max_tokens": 2, "temperature": 0}] + [
        {"id": i, "prompt": f"number {i}", "max_tokens": 240, "ignore_eos": True, "temperature": 0}
        for i in range(1, 12)]
    path = tmp_path / "out.jsonl"
    with _held_input(tmp_path, lines) as end_the_input:
        # All 12 in flight; once line 0 is written the job waits for input, the other 11 unfinished.
        proc = _job(tmp_path, None, "--max_inflight=12", "--grace_s=0", "--unordered", wait=False)
        t0 = time.time()
        while not (path.exists() and path.read_text().count("\n") >= 1) and proc.poll() is None \
                and time.time() - t0 < 300:
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        end_the_input()
        _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 143, stderr[-2000:]
    assert [r["id"] for r in _records(path)] == [0] and "interrupted" in stderr
    assert _job(tmp_path, lines, "--max_inflight=64", "--unordered").returncode == 0
    assert sorted(r["id"] for r in _records(path)) == list(range(12))
