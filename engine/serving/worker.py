"""Runs an `Engine` on its own thread and connects it to asyncio code (the gRPC server).

The engine is not thread-safe, so every call to it happens on the engine
thread. Other threads send commands (add, abort, call) through a thread-safe
queue; the engine thread applies all pending commands between steps, blocks on
the queue when it has nothing to run, and hands each step's outputs to the
requests' asyncio queues with one `call_soon_threadsafe` per event loop.
An abort is applied before the next step, so a cancelled request's KV blocks
are free within one step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from engine.engine import Engine
from engine.outputs import RequestOutput
from engine.serving.metrics import Metrics
from scheduler.request import InvalidRequestError, Request, SamplingParams

log = logging.getLogger(__name__)


class EngineStoppedError(RuntimeError):
    """The worker stopped (server shutdown) before the request finished."""


class EngineFailedError(RuntimeError):
    """An engine step raised; every request in that step was aborted."""


@dataclasses.dataclass(eq=False)
class Stream:
    """One request's output channel.

    `queue` receives `RequestOutput`s, the last with `finished` set, or one
    exception (`InvalidRequestError` when the engine refuses the request,
    `EngineFailedError`, `EngineStoppedError`) after which nothing follows.
    """

    request_id: str
    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    arrival: float  # time.monotonic() at submit
    request: Request | None = None  # set on the engine thread once the engine accepted it
    last_token_time: float | None = None


class EngineWorker:
    """Owns an `Engine` and the thread that runs it.

    Args:
      engine: the engine; after `start()` only the engine thread touches it.
      metrics: updated after every step; None creates a fresh set.
    """

    def __init__(self, engine: Engine, metrics: Metrics | None = None):
        self.engine = engine
        self.metrics = metrics or Metrics()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, Stream] = {}  # engine thread only
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    # ---- any thread ------------------------------------------------------------------------

    def submit(self, prompt_token_ids: list[int], sampling: SamplingParams, *, priority: int = 0,
               request_id: str | None = None) -> Stream:
        """Queues a request; call from a running event loop, whose queue gets the outputs.

        Validation happens on the engine thread: an invalid request's stream
        receives the `InvalidRequestError`.
        """
        stream = Stream(request_id or uuid.uuid4().hex, asyncio.Queue(), asyncio.get_running_loop(),
                        time.monotonic())
        self._commands.put(("add", stream, list(prompt_token_ids), sampling, priority))
        return stream

    def abort(self, request_id: str) -> None:
        """Aborts a request before the next step; unknown or finished ids are ignored."""
        self._commands.put(("abort", request_id))

    async def call(self, fn: Callable[[Engine], Any]) -> Any:
        """Runs `fn(engine)` on the engine thread between steps; returns its result or raises its exception."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._commands.put(("call", fn, loop, future))
        return await future

    def stop(self, timeout: float | None = None) -> None:
        """Aborts every request (their streams get `EngineStoppedError`) and joins the engine thread."""
        if self._thread.is_alive():
            self._commands.put(("stop",))
            self._thread.join(timeout)

    # ---- engine thread ---------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            # Block only when idle; otherwise take what has arrived and step.
            commands = [] if self.engine.has_unfinished() else [self._commands.get()]
            while True:
                try:
                    commands.append(self._commands.get_nowait())
                except queue.Empty:
                    break
            for command in commands:
                if command[0] == "stop":
                    self._end_all(EngineStoppedError("the server is shutting down"))
                    return
                self._apply(command)
            if self.engine.has_unfinished():
                self._step()

    def _apply(self, command: tuple) -> None:
        kind = command[0]
        if kind == "add":
            _, stream, prompt, sampling, priority = command
            try:
                stream.request = self.engine.add_request(prompt, sampling, stream.request_id, priority)
            except InvalidRequestError as e:
                self.metrics.rejected.inc()
                _deliver(stream.loop, [(stream, e)])
                return
            except Exception as e:  # a bug must not kill the engine thread and hang every caller
                log.exception("add_request failed")
                _deliver(stream.loop, [(stream, EngineFailedError(f"add_request failed: {type(e).__name__}: {e}"))])
                return
            self._streams[stream.request_id] = stream
        elif kind == "abort":
            stream = self._streams.pop(command[1], None)
            if stream is not None:
                self.engine.abort(stream.request_id)
                self._record_finished(stream, "abort")
        elif kind == "call":
            _, fn, loop, future = command
            try:
                result, error = fn(self.engine), None
            except Exception as e:  # noqa: BLE001 -- handed to the caller, who decides
                result, error = None, e
            try:
                loop.call_soon_threadsafe(_settle, future, result, error)
            except RuntimeError:  # the caller's loop is closed
                pass
        self.metrics.record_engine_state(self.engine)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:
            log.exception("engine step failed; aborting its requests")
            self._end_all(EngineFailedError(f"engine step failed: {type(e).__name__}: {e}"))
            return
        now = time.monotonic()
        deliveries: dict[asyncio.AbstractEventLoop, list] = {}
        num_tokens = 0
        for out in outputs:
            num_tokens += len(out.delta_token_ids)
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue  # a request of a `call`er (e.g. LLM.generate)
            self._record_tokens(stream, out, now)
            if out.finished:
                del self._streams[out.request_id]
                self._record_finished(stream, out.finish_reason)
            deliveries.setdefault(stream.loop, []).append((stream, out))
        # Before delivery, so a client that saw its tokens sees them counted.
        self.metrics.record_step(self.engine, num_tokens)
        for loop, items in deliveries.items():
            _deliver(loop, items)

    def _end_all(self, error: Exception) -> None:
        """Aborts every request the worker tracks and hands `error` to their streams."""
        for stream in list(self._streams.values()):
            self.engine.abort(stream.request_id)
            self._record_finished(stream, "abort" if isinstance(error, EngineStoppedError) else "error")
            _deliver(stream.loop, [(stream, error)])
        self._streams.clear()

    def _record_tokens(self, stream: Stream, out: RequestOutput, now: float) -> None:
        if out.delta_token_ids:
            if stream.last_token_time is None:
                self.metrics.ttft.observe(now - stream.arrival)
            else:
                gap = (now - stream.last_token_time) / len(out.delta_token_ids)
                for _ in out.delta_token_ids:
                    self.metrics.itl.observe(gap)
        stream.last_token_time = now

    def _record_finished(self, stream: Stream, reason: str) -> None:
        if stream.request is not None:
            self.metrics.record_finished(reason, len(stream.request.prompt_token_ids),
                                         stream.request.num_cached_tokens)


def _deliver(loop: asyncio.AbstractEventLoop, items: list[tuple[Stream, RequestOutput | Exception]]) -> None:
    try:
        loop.call_soon_threadsafe(_put_all, items)
    except RuntimeError:  # the loop is closed: nobody is listening any more
        pass


def _put_all(items: list[tuple[Stream, RequestOutput | Exception]]) -> None:
    for stream, item in items:
        stream.queue.put_nowait(item)


def _settle(future: asyncio.Future, result: Any, error: Exception | None) -> None:
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
