"""Start-up: a server that listens before its engine is ready (health NOT_SERVING, calls refused with a
retry hint), and the command-line server from launch to SIGTERM."""

import asyncio
import os
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request

import grpc
import openai
import pytest

from engine import LLM
from engine.serving.client import Client
from engine.serving.protos import generate_pb2 as pb
from engine.serving.server import SERVICE_NAME

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKEN = "s3cret-token"
LIMITS = {"num_blocks": 64, "block_size": 16, "max_num_seqs": 8, "max_num_batched_tokens": 64}


def test_a_warming_server_answers_health_and_refuses_calls_until_ready():
    """Listening before the engine exists (what `engine.serve` does while it loads and compiles): health says
    NOT_SERVING, every call gets UNAVAILABLE with gRPC's retry pushback and the progress, the warm-up gauges
    show it; after `ready` health says SERVING and calls are served."""
    from engine.serving.metrics import Metrics
    from engine.serving.server import GenerationServer
    from engine.serving.worker import EngineWorker

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    run = lambda coro: asyncio.run_coroutine_threadsafe(coro, loop).result(60)  # noqa: E731
    llm = LLM("tiny-llama", **LIMITS)  # its own engine: the module's server runs a worker on the shared one
    metrics = Metrics()
    server = GenerationServer(None, None, model_name="tiny-llama", metrics=metrics)
    try:
        port = run(server.start())
        metrics.warmup.update(3, 10)
        page = lambda: prometheus_text(metrics)  # noqa: E731
        assert "engine_ready 0.0" in page() and "engine_warmup_programs_compiled 3.0" in page()
        assert "engine_warmup_programs_total 10.0" in page()
        with Client(f"127.0.0.1:{port}") as c:
            assert c.health() == "NOT_SERVING" and c.health(SERVICE_NAME) == "NOT_SERVING"
            for call in (lambda: c.generate("hi", max_tokens=2), c.model_info, lambda: c.tokenize("hi"),
                         lambda: c.score(["hi"]), lambda: c.detokenize([104])):
                with pytest.raises(grpc.RpcError) as e:
                    call()
                assert e.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "warming up (3 of 10 programs compiled)" in e.value.details()
                pushback = dict(e.value.trailing_metadata())["grpc-retry-pushback-ms"]
                assert 1000 <= int(pushback) <= 60000
            run(server.ready(EngineWorker(llm.engine, metrics), llm.tokenizer))
            assert c.health() == "SERVING" and c.health(SERVICE_NAME) == "SERVING"
            assert "engine_ready 1.0" in page()
            assert len(c.generate("hi", max_tokens=3, ignore_eos=True).token_ids) == 3
    finally:
        run(server.stop(grace=1))
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def prometheus_text(metrics) -> str:
    import prometheus_client

    return prometheus_client.generate_latest(metrics.registry).decode()


def test_serve_exits_cleanly_on_sigterm(tmp_path):
    token_file, scrape_file = tmp_path / "token", tmp_path / "scrape"
    token_file.write_text(TOKEN + "\n")
    scrape_file.write_text("the-operators\n")
    cmd = [sys.executable, "-m", "engine.serve", "--model=tiny-llama", "--port=0", "--metrics_port=0", "--http_port=0",
           "--grace_s=60", f"--auth_token_file={token_file}", f"--metrics_token_file={scrape_file}", "--num_blocks=64", "--max_num_seqs=4",
           "--max_num_batched_tokens=32", f"--compilation_cache_dir={tmp_path / 'xla'}"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=ROOT))
    try:
        line = proc.stdout.readline()  # at once, before the model loads
        assert line.startswith("listening on 127.0.0.1:") and line.endswith(" (warming up)\n"), line + proc.stderr.read()
        target = line.split(" on ")[1].split(",")[0]
        api = line.split("OpenAI API on ")[1].split(",")[0]
        with pytest.raises(urllib.error.HTTPError) as e:  # the HTTP API refuses calls while warming up, as gRPC does
            urllib.request.urlopen(api.removesuffix("/v1") + "/health", timeout=10)
        assert e.value.code == 503
        metrics = urllib.request.Request(line.split("metrics on ")[1].split()[0],
                                         headers={"Authorization": "Bearer the-operators"})
        line = proc.stdout.readline()
        assert line.startswith("precompiled "), line + proc.stderr.read()  # --precompile is the default
        line = proc.stdout.readline()
        assert line.startswith(f"serving tiny-llama on {target}"), line + proc.stderr.read()
        page = urllib.request.urlopen(metrics, timeout=10).read().decode()
        total = float(next(line.split()[1] for line in page.splitlines()
                           if line.startswith("engine_warmup_programs_total ")))
        assert total > 0 and f"engine_warmup_programs_compiled {total}" in page and "engine_ready 1.0" in page
        with Client(target, auth_token=TOKEN) as c:
            assert c.generate("hi", max_tokens=3, ignore_eos=True).finish_reason == "length"
            # The same engine over HTTP, with the same token.
            openai_client = openai.OpenAI(base_url=api, api_key=TOKEN, max_retries=0)
            got = openai_client.completions.create(model="tiny-llama", prompt="hi", max_tokens=3, temperature=0,
                                                   extra_body={"ignore_eos": True})
            assert got.choices[0].text == c.generate("hi", max_tokens=3, ignore_eos=True, temperature=0).text
            assert "engine_generated_tokens_total 9.0" in urllib.request.urlopen(metrics, timeout=10).read().decode()
            stream = c.generate_stream(list(range(3, 20)), max_tokens=230, ignore_eos=True, temperature=0)
            messages = [next(stream)]
            proc.send_signal(signal.SIGTERM)
            # SIGTERM drains (docs/serving.md): the call in flight runs to its last token, well inside the grace
            # (the abort after the grace: test_serve_hostile's test_shutdown_ends_streams_with_finish_reason_abort).
            messages += list(stream)
            assert messages[-1].finish_reason == pb.FINISH_REASON_LENGTH
            assert sum(len(m.token_ids) for m in messages) == messages[-1].usage.completion_tokens == 230
        assert proc.wait(timeout=30) == 0  # once nothing is in flight, not at the grace's end
        assert "shutting down (grace 60 s)" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
