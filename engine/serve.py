"""Serve a model over gRPC (service `jaxspec.v1.Generation`, health, reflection) with Prometheus metrics.

  python -m engine.serve --model smollm2-135m-instruct --port 50051 --metrics_port 9464

Prints `serving <model> on <host>:<port>` (and the metrics address) once it
accepts calls. SIGTERM or SIGINT: stop accepting, give calls in flight
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
import time

from absl import app, flags, logging

from engine.flags import FLAGS, llm_from_flags

flags.DEFINE_string("host", "127.0.0.1", "Address to listen on (0.0.0.0 or [::] for every interface).")
flags.DEFINE_integer("port", 50051, "gRPC port; 0 picks a free one.")
flags.DEFINE_integer("metrics_port", 9464, "Prometheus /metrics HTTP port on --host; 0 picks a free one, "
                     "-1 disables.")
flags.DEFINE_string("tls_cert", None, "PEM certificate chain; serve TLS (needs --tls_key).")
flags.DEFINE_string("tls_key", None, "PEM private key of --tls_cert.")
flags.DEFINE_string("auth_token_file", None, "Token file: 'tenant token' lines (or one lone token, tenant "
                    "'default'); calls must then send metadata 'authorization: Bearer <token>' (health checks "
                    "are exempt), /metrics the same header. Tenants never share prefix-cache entries.")
flags.DEFINE_integer("max_request_bytes", 1 << 20, "Largest request message (text, chat, token ids), in bytes.")
flags.DEFINE_integer("max_score_inputs", 64, "Most sequences in one Score call.")
flags.DEFINE_integer("max_score_tokens", 1 << 16, "Most tokens over all sequences of one Score call.")
flags.DEFINE_float("grace_s", 10.0, "On SIGTERM, seconds calls in flight get to finish before they are aborted.")
flags.DEFINE_bool("precompile", True, "Compile every step shape before serving, so no call waits for a "
                  "compilation (takes minutes on CPU for the real model; --noprecompile skips it).")


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


async def _serve(server) -> None:
    """Runs `server` (an `engine.serving.server.GenerationServer`) until SIGTERM or SIGINT."""
    port = await server.start()
    http = None
    if FLAGS.metrics_port >= 0:
        http = server.metrics.serve(FLAGS.metrics_port, FLAGS.host, certfile=FLAGS.tls_cert, keyfile=FLAGS.tls_key,
                                    tenants=server.tenants)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"serving {FLAGS.model} on {FLAGS.host}:{port}"
          + (f", metrics on {'https' if FLAGS.tls_cert else 'http'}://{FLAGS.host}:{http.server_port}/metrics"
             if http else ""), flush=True)
    await stop.wait()
    print(f"shutting down (grace {FLAGS.grace_s:g} s)", flush=True)
    await server.stop(FLAGS.grace_s)
    if http is not None:
        http.shutdown()


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if bool(FLAGS.tls_cert) != bool(FLAGS.tls_key):
        raise app.UsageError("--tls_cert and --tls_key go together")
    logging.set_verbosity(logging.WARNING)  # keep jax's backend probing (e.g. "no TPU") off stderr
    from engine.serving.server import GenerationServer, ServingLimits, Tenants, TLSConfig
    from engine.serving.worker import EngineWorker

    tenants = None
    if FLAGS.auth_token_file:
        try:
            tenants = Tenants.parse(_read(FLAGS.auth_token_file).decode())
        except (ValueError, UnicodeDecodeError) as e:
            raise app.UsageError(f"--auth_token_file {FLAGS.auth_token_file}: {e}")
    tls = TLSConfig(_read(FLAGS.tls_cert), _read(FLAGS.tls_key)) if FLAGS.tls_cert else None
    try:
        limits = ServingLimits(FLAGS.max_request_bytes, FLAGS.max_score_inputs, FLAGS.max_score_tokens)
        llm = llm_from_flags()
    except (ValueError, KeyError, FileNotFoundError) as e:
        print(f"error: {e.args[0] if e.args else e}", file=sys.stderr)
        return 2
    if FLAGS.precompile:
        t = time.perf_counter()
        n = llm.engine.precompile()
        print(f"precompiled {n} step shapes in {time.perf_counter() - t:.1f} s", flush=True)
    from engine.distributed import is_leader

    if not is_leader():
        print(f"following process 0 (process {FLAGS.process_id} of {FLAGS.num_processes})", flush=True)
        EngineWorker(llm.engine).follow()
        return 0
    asyncio.run(_serve(GenerationServer(EngineWorker(llm.engine), llm.tokenizer, model_name=FLAGS.model,
                                        host=FLAGS.host, port=FLAGS.port, tenants=tenants, tls=tls, limits=limits)))
    return 0


if __name__ == "__main__":
    app.run(main)
