"""A gRPC server for tests: a `GenerationServer` on its own event-loop thread in the test process, with the
OpenAI-compatible HTTP API on the same worker if asked."""

import asyncio
import contextlib
import threading

from engine.serving.server import GenerationServer
from engine.serving.worker import EngineWorker


class ServerThread:
    """A GenerationServer on its own event loop thread."""

    def __init__(self, llm, http: bool = False, scrape_token: str | None = None, http_tls: tuple | None = None,
                 **kwargs):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = GenerationServer(EngineWorker(llm.engine), llm.tokenizer, model_name="tiny-llama", **kwargs)
        self.port = self.run(self.server.start())
        self.target = f"127.0.0.1:{self.port}"
        self.http = None
        if http:
            from engine.serving.openai_api import HttpServer

            certfile, keyfile = http_tls or (None, None)
            self.http = HttpServer(self.server, scrape_token=scrape_token, certfile=certfile, keyfile=keyfile)
            scheme = "https" if http_tls else "http"
            self.base_url = f"{scheme}://127.0.0.1:{self.run(self.http.start())}"

    def run(self, coro, timeout: float = 120):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def on_engine(self, fn):
        """fn(engine) on the engine thread; `LLM.generate` this way only while no gRPC request runs."""
        return self.run(self.server.worker.call(fn))

    @contextlib.contextmanager
    def steps_held(self, hold=lambda engine: True):
        """While inside, the engine runs no step while `hold(engine)` is true (asked on the engine thread before
        each step); its thread still applies adds, aborts and calls. What a test does meanwhile cannot race the
        requests' progress."""
        def install(engine):
            real = engine.has_unfinished
            engine.has_unfinished = lambda: real() and not hold(engine)

        self.on_engine(install)
        try:
            yield
        finally:
            self.on_engine(lambda engine: engine.__dict__.pop("has_unfinished"))

    def stop(self):
        self.run(self.server.stop(grace=1))
        if self.http is not None:
            self.run(self.http.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def scheduled(engine) -> list:
    """The requests the engine's scheduler holds: waiting, running and swapped out."""
    s = engine.scheduler
    return [*s.waiting, *s.running, *s.swapped]
