"""Serve a model over gRPC (service `jaxspec.v1.Generation`, health, reflection) with Prometheus metrics.

  python -m engine.serve --model smollm2-135m-instruct --port 50051 --metrics_port 9464

Prints `serving <model> on <host>:<port>` (and the metrics address) once it
accepts calls. SIGTERM or SIGINT: stop accepting, give calls in flight
`--grace_s` seconds, abort the rest, stop the engine thread, exit 0. Model, engine and
speculation flags are `engine.flags`'; the server itself is `engine.serving`.
"""

from __future__ import annotations

import asyncio
import signal
import sys

from absl import app, flags, logging

from engine.flags import FLAGS, llm_from_flags

flags.DEFINE_string("host", "127.0.0.1", "Address to listen on (0.0.0.0 or [::] for every interface).")
flags.DEFINE_integer("port", 50051, "gRPC port; 0 picks a free one.")
flags.DEFINE_integer("metrics_port", 9464, "Prometheus /metrics HTTP port on --host; 0 picks a free one, "
                     "-1 disables.")
flags.DEFINE_string("tls_cert", None, "PEM certificate chain; serve TLS (needs --tls_key).")
flags.DEFINE_string("tls_key", None, "PEM private key of --tls_cert.")
flags.DEFINE_string("auth_token_file", None, "File holding a shared token; calls must then send metadata "
                    "'authorization: Bearer <token>' (health checks are exempt).")
flags.DEFINE_float("grace_s", 10.0, "On SIGTERM, seconds calls in flight get to finish before they are aborted.")
flags.DEFINE_bool("precompile", False, "Compile every step bucket before serving (slow on CPU).")


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


async def _serve(server) -> None:
    """Runs `server` (an `engine.serving.server.GenerationServer`) until SIGTERM or SIGINT."""
    port = await server.start()
    http = server.metrics.serve(FLAGS.metrics_port, FLAGS.host) if FLAGS.metrics_port >= 0 else None
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"serving {FLAGS.model} on {FLAGS.host}:{port}"
          + (f", metrics on http://{FLAGS.host}:{http.server_port}/metrics" if http else ""), flush=True)
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
    from engine.serving.server import GenerationServer, TLSConfig
    from engine.serving.worker import EngineWorker

    auth_token = None
    if FLAGS.auth_token_file:
        auth_token = _read(FLAGS.auth_token_file).decode().strip()
        if not auth_token:
            raise app.UsageError(f"--auth_token_file {FLAGS.auth_token_file} is empty")
    tls = TLSConfig(_read(FLAGS.tls_cert), _read(FLAGS.tls_key)) if FLAGS.tls_cert else None
    try:
        llm = llm_from_flags()
    except (ValueError, KeyError, FileNotFoundError) as e:
        print(f"error: {e.args[0] if e.args else e}", file=sys.stderr)
        return 2
    if FLAGS.precompile:
        print(f"precompiled {llm.engine.precompile()} step shapes", flush=True)
    asyncio.run(_serve(GenerationServer(EngineWorker(llm.engine), llm.tokenizer, model_name=FLAGS.model,
                                        host=FLAGS.host, port=FLAGS.port, auth_token=auth_token, tls=tls)))
    return 0


if __name__ == "__main__":
    app.run(main)
