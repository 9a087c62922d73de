"""Serve a model over gRPC (service `jaxspec.v1.Generation`, health, reflection) with Prometheus metrics.

  python -m engine.serve --model smollm2-135m-instruct --port 50051 --metrics_port 9464

Listens within seconds, before the model is loaded: prints `listening on
<host>:<port>` (and the metrics address); gRPC health says NOT_SERVING and
every call gets UNAVAILABLE with a retry hint while the engine loads and
compiles every program it can run (progress on stderr and in the
`engine_warmup_*` gauges; compiled programs are kept in
`--compilation_cache_dir`, so a restart loads them). Then it prints
`precompiled ...` and `serving <model> on <host>:<port>`, and health turns
SERVING. SIGTERM or SIGINT: stop accepting, give calls in flight
`--grace_s` seconds, abort the rest, stop the engine thread, exit 0. Model, engine and
speculation flags are `engine.flags`'; the server itself is `engine.serving`.

Over several processes (`--num_processes`, every process runs this same
command with its own `--process_id`) process 0 serves and the others follow
its engine (`engine.distributed`); they print `following process 0` and exit
when process 0 stops.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import threading
import time

from absl import app, flags, logging

from engine.flags import FLAGS, llm_from_flags

flags.DEFINE_string("host", "127.0.0.1", "Address to listen on (0.0.0.0 or [::] for every interface).")
flags.DEFINE_integer("port", 50051, "gRPC port; 0 picks a free one.")
flags.DEFINE_integer("http_port", -1, "OpenAI-compatible HTTP API port on --host (/v1/completions, "
                     "/v1/chat/completions, /v1/models, /health, /metrics), on the same engine as gRPC; 0 picks a "
                     "free one, -1 (the default) disables it.")
flags.DEFINE_integer("metrics_port", 9464, "Prometheus /metrics HTTP port on --host; 0 picks a free one, "
                     "-1 disables.")
flags.DEFINE_string("tls_cert", None, "PEM certificate chain; serve TLS (needs --tls_key).")
flags.DEFINE_string("tls_key", None, "PEM private key of --tls_cert.")
flags.DEFINE_string("auth_token_file", None, "Token file: 'tenant token' lines (or one lone token, tenant "
                    "'default'); calls must then send metadata 'authorization: Bearer <token>' (health checks "
                    "are exempt). Tenants never share prefix-cache entries. A tenant's token does not read /metrics "
                    "(403): see --metrics_token_file.")
flags.DEFINE_string("metrics_token_file", None, "File holding the operator's scrape token: /metrics then needs "
                    "'Authorization: Bearer <token>' (401 else) and carries per-tenant usage. With --auth_token_file "
                    "and without this, /metrics answers no one.")
flags.DEFINE_integer("max_request_bytes", 1 << 20, "Largest request message (text, chat, token ids), in bytes.")
flags.DEFINE_integer("max_score_inputs", 64, "Most sequences in one Score call.")
flags.DEFINE_integer("max_score_tokens", 1 << 16, "Most tokens over all sequences of one Score call.")
flags.DEFINE_bool("precompile", True, "Compile every step shape before serving, so no call waits for a "
                  "compilation (takes minutes on CPU for the real model; --noprecompile skips it).")


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


class _Progress:
    """Start-up progress lines on stderr: programs compiled of the total, elapsed, an estimate of what is left
    (at most one line every `every_s` seconds, and the last)."""

    def __init__(self, warmup, every_s: float = 5.0):
        self.warmup, self.every_s, self.last = warmup, every_s, 0.0

    def __call__(self, done: int, total: int) -> None:
        self.warmup.update(done, total)
        now = time.monotonic()
        if done < total and now - self.last < self.every_s:
            return
        self.last = now
        _, _, left = self.warmup.progress()
        print(f"warm-up: {done} of {total} programs compiled, {now - self.warmup.started:.0f} s elapsed"
              + (f", ~{left:.0f} s left" if left is not None and done < total else ""), file=sys.stderr, flush=True)


def _load(metrics):
    """The engine worker, its LLM loaded and (with --precompile) every program compiled; runs off the event loop."""
    from engine.serving.worker import EngineWorker

    llm = llm_from_flags()
    if FLAGS.precompile:
        t = time.perf_counter()
        n = llm.engine.precompile(progress=_Progress(metrics.warmup))
        print(f"precompiled {n} step shapes ({metrics.warmup.total} programs) in {time.perf_counter() - t:.1f} s",
              flush=True)
    return llm, EngineWorker(llm.engine, metrics)


async def _serve(server, scrape_token: str | None) -> int:
    """Listens at once, loads and warms the engine up (unless the server already has its worker), then serves
    until SIGTERM or SIGINT; returns the exit status."""
    port = await server.start()
    http = api = None
    if FLAGS.metrics_port >= 0:
        http = server.metrics.serve(FLAGS.metrics_port, FLAGS.host, certfile=FLAGS.tls_cert, keyfile=FLAGS.tls_key,
                                    tenants=server.tenants, scrape_token=scrape_token)
    if FLAGS.http_port >= 0:
        from engine.serving.openai_api import HttpServer

        api = HttpServer(server, FLAGS.host, FLAGS.http_port, certfile=FLAGS.tls_cert, keyfile=FLAGS.tls_key,
                         scrape_token=scrape_token)
        await api.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    scheme = "https" if FLAGS.tls_cert else "http"
    where = f"{FLAGS.host}:{port}" + (
        f", OpenAI API on {scheme}://{FLAGS.host}:{api.port}/v1" if api else "") + (
        f", metrics on {scheme}://{FLAGS.host}:{http.server_port}/metrics" if http else "")
    status = 0
    if server.worker is None:
        print(f"listening on {where} (warming up)", flush=True)
        status = await _warm_up(server, stop)
    if status == 0 and not stop.is_set():
        print(f"serving {FLAGS.model} on {where}", flush=True)
        await stop.wait()
    if status == 0:
        print(f"shutting down (grace {FLAGS.grace_s:g} s)", flush=True)
    await server.stop(FLAGS.grace_s)
    if api is not None:
        await api.stop()
    if http is not None:
        http.shutdown()
    return status


async def _warm_up(server, stop: asyncio.Event) -> int:
    """Loads the engine on a thread of its own and hands it to `server`, unless `stop` comes first; returns 0,
    or 2 when the model or the flags are refused (the error printed)."""
    loop = asyncio.get_running_loop()
    loaded = loop.create_future()

    def load():  # a daemon thread, not the loop's executor: a SIGTERM during warm-up exits without waiting
        try:
            result, error = _load(server.metrics), None
        except Exception as e:  # noqa: BLE001 -- handed to the loop
            result, error = None, e
        loop.call_soon_threadsafe(lambda: loaded.done() or (
            loaded.set_exception(error) if error else loaded.set_result(result)))

    threading.Thread(target=load, name="warm-up", daemon=True).start()
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait([loaded, stopping], return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    if not loaded.done():
        return 0
    try:
        llm, worker = loaded.result()
    except (ValueError, KeyError, FileNotFoundError, RuntimeError) as e:
        print(f"error: {e.args[0] if e.args else e}", file=sys.stderr)
        return 2
    await server.ready(worker, llm.tokenizer)
    return 0


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if bool(FLAGS.tls_cert) != bool(FLAGS.tls_key):
        raise app.UsageError("--tls_cert and --tls_key go together")
    logging.set_verbosity(logging.WARNING)  # keep jax's backend probing (e.g. "no TPU") off stderr
    from engine.serving.metrics import Metrics
    from engine.serving.server import GenerationServer, ServingLimits, Tenants, TLSConfig

    tenants = None
    if FLAGS.auth_token_file:
        try:
            tenants = Tenants.parse(_read(FLAGS.auth_token_file).decode())
        except (ValueError, UnicodeDecodeError) as e:
            raise app.UsageError(f"--auth_token_file {FLAGS.auth_token_file}: {e}")
    scrape_token = None
    if FLAGS.metrics_token_file:
        scrape_token = _read(FLAGS.metrics_token_file).decode(errors="replace").strip()
        if not scrape_token or any(c.isspace() for c in scrape_token):
            raise app.UsageError(f"--metrics_token_file {FLAGS.metrics_token_file}: want one token, no spaces")
        if tenants is not None and tenants.tenant_of([("authorization", f"Bearer {scrape_token}")]) is not None:
            raise app.UsageError("--metrics_token_file: the scrape token must differ from every tenant's token")
    tls = TLSConfig(_read(FLAGS.tls_cert), _read(FLAGS.tls_key)) if FLAGS.tls_cert else None
    try:
        limits = ServingLimits(FLAGS.max_request_bytes, FLAGS.max_score_inputs, FLAGS.max_score_tokens)
    except ValueError as e:
        print(f"error: {e.args[0] if e.args else e}", file=sys.stderr)
        return 2
    from engine.distributed import is_leader

    if FLAGS.num_processes > 1:
        # Every process loads and compiles before process 0 serves: the followers step with it.
        try:
            llm, worker = _load(Metrics())
        except (ValueError, KeyError, FileNotFoundError, RuntimeError) as e:
            print(f"error: {e.args[0] if e.args else e}", file=sys.stderr)
            return 2
        if not is_leader():
            print(f"following process 0 (process {FLAGS.process_id} of {FLAGS.num_processes})", flush=True)
            worker.follow()
            return 0
        server = GenerationServer(worker, llm.tokenizer, model_name=FLAGS.model, host=FLAGS.host, port=FLAGS.port,
                                  tenants=tenants, tls=tls, limits=limits)
        return asyncio.run(_serve(server, scrape_token))
    server = GenerationServer(None, None, model_name=FLAGS.model, host=FLAGS.host, port=FLAGS.port, tenants=tenants,
                              tls=tls, limits=limits, metrics=Metrics())
    return asyncio.run(_serve(server, scrape_token))


if __name__ == "__main__":
    app.run(main)
