"""Runs an `Engine` on its own thread and connects it to asyncio code (the gRPC server).

The engine is not thread-safe, so every call to it happens on the engine
thread. Other threads send commands (add, abort, score, call) through a
thread-safe queue; the engine thread applies all pending commands between
steps, blocks on the queue when it has nothing to run, and hands each step's
outputs to the requests' asyncio queues with one `call_soon_threadsafe` per
event loop. An abort is applied before the next step, so a cancelled
request's KV blocks are free within one step.

Request ids are the worker's own (a fresh uuid per request), so no caller
can name another caller's request; an abort names the `Stream` it ends.
Scoring runs one chunk (at most the token budget) per turn of the loop,
between generation steps, so a long Score never holds up the streams, and
a cancelled Score is dropped before its next chunk.

Over several processes (`engine.distributed`) the worker on process 0 leads:
each turn it broadcasts the commands it is about to apply (requests by id,
Score calls by id; `call` is refused, a function does not cross processes),
and every other process runs `follow()`, which applies the same commands to
its own engine with stand-in streams nobody reads, and steps in lockstep.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import jax

from engine.distributed import HEARTBEAT_S, broadcast_object
from engine.engine import Engine, ScoreJob
from engine.outputs import RequestOutput
from engine.scoring import ScoreOutput
from engine.serving.auth import DEFAULT_TENANT
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

    `queue` receives `RequestOutput`s, the last with `finished` set (with
    finish reason "abort" when the worker stops first), or one exception
    (`InvalidRequestError` when the engine refuses the request,
    `EngineFailedError`) after which nothing follows.
    """

    request_id: str
    queue: asyncio.Queue | None  # None on a following process: nobody reads its outputs
    loop: asyncio.AbstractEventLoop | None
    arrival: float  # time.monotonic() at submit
    request: Request | None = None  # set on the engine thread once the engine accepted it
    last_token_time: float | None = None
    tenant: str = DEFAULT_TENANT  # whose usage it counts as (`Metrics`)


@dataclasses.dataclass(eq=False)
class ScoreCall:
    """One Score call on the engine thread: its sequences in order, scored one chunk per loop turn."""

    inputs: list[list[int]]
    loop: asyncio.AbstractEventLoop | None  # None on a following process
    future: asyncio.Future | None
    call_id: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex)
    results: list[ScoreOutput] = dataclasses.field(default_factory=list)
    job: ScoreJob | None = None  # the sequence being scored


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
        self._scores: collections.deque[ScoreCall] = collections.deque()  # engine thread only
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)

    def start(self) -> None:
        self.metrics.record_engine_state(self.engine)  # the gauges are right before the first step
        self._thread.start()

    # ---- any thread ------------------------------------------------------------------------

    def submit(self, prompt_token_ids: list[int], sampling: SamplingParams, *, priority: int = 0,
               cache_salt: str | None = None, tenant: str = DEFAULT_TENANT) -> Stream:
        """Queues a request under a fresh id; call from a running event loop, whose queue gets the outputs.

        Validation happens on the engine thread: an invalid request's stream
        receives the `InvalidRequestError`. `cache_salt`: see `Engine.add_request`. `tenant`: whose usage
        the metrics count it as.
        """
        stream = Stream(uuid.uuid4().hex, asyncio.Queue(), asyncio.get_running_loop(), time.monotonic(),
                        tenant=tenant)
        self._commands.put(("add", stream, list(prompt_token_ids), sampling, priority, cache_salt))
        return stream

    def abort(self, stream: Stream) -> None:
        """Aborts the stream's request before the next step; a finished or refused one is ignored."""
        self._commands.put(("abort", stream))

    async def score(self, inputs: list[list[int]]) -> list[ScoreOutput]:
        """Scores token sequences on the engine thread, interleaved with generation steps.

        Cancelling the awaiting task drops the call before its next chunk and
        frees its blocks. Raises `InvalidRequestError` (naming `inputs[i]`),
        `scheduler.block_manager.NoFreeBlocksError`, or `EngineStoppedError`.
        """
        loop = asyncio.get_running_loop()
        call = ScoreCall([list(ids) for ids in inputs], loop, loop.create_future())
        self._commands.put(("score", call))
        try:
            return await call.future
        except asyncio.CancelledError:
            self._commands.put(("cancel_score", call))
            raise

    @property
    def num_streams(self) -> int:
        """Requests running for callers of `submit` (read from any thread)."""
        return len(self._streams)

    @property
    def num_score_calls(self) -> int:
        """Score calls the engine thread holds (read from any thread)."""
        return len(self._scores)

    async def call(self, fn: Callable[[Engine], Any]) -> Any:
        """Runs `fn(engine)` on the engine thread between steps; returns its result or raises its exception."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._commands.put(("call", fn, loop, future))
        return await future

    def stop(self, timeout: float | None = None) -> None:
        """Aborts every request (each stream gets a last output with finish reason "abort"; each Score
        call `EngineStoppedError`) and joins the engine thread."""
        if self._thread.is_alive():
            self._commands.put(("stop",))
            self._thread.join(timeout)

    # ---- engine thread ---------------------------------------------------------------------

    def follow(self) -> None:
        """On a process other than 0 of several: applies the commands process 0's worker broadcasts and
        steps with it, on the calling thread, until process 0's worker stops."""
        self._loop(lead=False)

    def _run(self) -> None:
        self._loop(lead=True)

    def _loop(self, lead: bool) -> None:
        shared = jax.process_count() > 1
        while True:
            if lead:
                commands = self._take()
                if shared:
                    broadcast_object([_to_wire(c) for c in commands])
            else:
                commands = [c for c in map(self._from_wire, broadcast_object()) if c is not None]
            for command in commands:
                if command[0] == "stop":
                    self._end_all(EngineStoppedError("the server is shutting down"))
                    return
                self._apply(command)
            if self.engine.has_unfinished():
                self._step()
            if self._scores:
                self._score_chunk()

    def _take(self) -> list[tuple]:
        """The commands that arrived: blocks while idle (over several processes at most `HEARTBEAT_S`,
        so the followers hear from this process); calls are refused over several processes."""
        commands = []
        if not (self.engine.has_unfinished() or self._scores):
            try:
                commands.append(self._commands.get(timeout=HEARTBEAT_S if jax.process_count() > 1 else None))
            except queue.Empty:
                pass
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                break
        if jax.process_count() > 1:
            for _, fn, loop, future in (c for c in commands if c[0] == "call"):
                _settle_threadsafe(loop, future, None, RuntimeError(
                    "EngineWorker.call runs in one process only (a function cannot be sent to the others)"))
            commands = [c for c in commands if c[0] != "call"]
        return commands

    def _from_wire(self, wire: tuple) -> tuple | None:
        """A command broadcast by process 0 as this process's own; None if it names nothing held here."""
        kind = wire[0]
        if kind == "add":
            _, request_id, *rest = wire
            return ("add", Stream(request_id, None, None, time.monotonic()), *rest)
        if kind == "abort":
            stream = self._streams.get(wire[1])
            return ("abort", stream) if stream is not None else None
        if kind == "score":
            return ("score", ScoreCall(wire[2], None, None, call_id=wire[1]))
        if kind == "cancel_score":
            call = next((c for c in self._scores if c.call_id == wire[1]), None)
            return ("cancel_score", call) if call is not None else None
        return wire  # ("stop",)

    def _apply(self, command: tuple) -> None:
        kind = command[0]
        if kind == "add":
            _, stream, prompt, sampling, priority, cache_salt = command
            try:
                stream.request = self.engine.add_request(prompt, sampling, stream.request_id, priority, cache_salt)
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
            stream = command[1]
            if self._streams.get(stream.request_id) is stream:
                del self._streams[stream.request_id]
                self.engine.abort(stream.request_id)
                self._record_finished(stream, "abort")
        elif kind == "score":
            self._scores.append(command[1])
        elif kind == "cancel_score":
            call = command[1]
            if call in self._scores:
                self._scores.remove(call)
                self._drop_score(call)
        elif kind == "call":
            _, fn, loop, future = command
            try:
                result, error = fn(self.engine), None
            except Exception as e:  # noqa: BLE001 -- handed to the caller, who decides
                result, error = None, e
            _settle_threadsafe(loop, future, result, error)
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

    def _score_chunk(self) -> None:
        """Advances the oldest Score call by one chunk; settles it when its last sequence is scored."""
        call = self._scores[0]
        try:
            if call.job is None:
                i = len(call.results)
                try:
                    call.job = self.engine.start_score(call.inputs[i])
                except InvalidRequestError as e:
                    raise InvalidRequestError(f"inputs[{i}]: {e}") from None
            if self.engine.score_chunk(call.job):
                call.results.append(call.job.output())
                self.engine.end_score(call.job)
                call.job = None
                if len(call.results) == len(call.inputs):
                    self._scores.popleft()
                    _settle_threadsafe(call.loop, call.future, call.results, None)
        except Exception as e:  # noqa: BLE001 -- handed to the caller (bad input, no free blocks, a bug)
            self._scores.popleft()
            self._drop_score(call)
            _settle_threadsafe(call.loop, call.future, None, e)

    def _drop_score(self, call: ScoreCall) -> None:
        if call.job is not None:
            self.engine.end_score(call.job)
            call.job = None

    def _end_all(self, error: Exception) -> None:
        """Aborts everything the worker tracks: streams end with an "abort" output after a shutdown
        (`EngineStoppedError`), else get `error`; Score calls get `error`."""
        stopped = isinstance(error, EngineStoppedError)
        for stream in list(self._streams.values()):
            self.engine.abort(stream.request_id)
            self._record_finished(stream, "abort" if stopped else "error")
            _deliver(stream.loop, [(stream, _aborted(stream) if stopped else error)])
        self._streams.clear()
        while self._scores:
            call = self._scores.popleft()
            self._drop_score(call)
            _settle_threadsafe(call.loop, call.future, None, error)

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
                                         stream.request.num_cached_tokens, len(stream.request.output_token_ids),
                                         stream.tenant)


def _aborted(stream: Stream) -> RequestOutput:
    """The last output of a stream whose request the worker aborted."""
    r = stream.request
    return RequestOutput(stream.request_id, r.prompt_token_ids, "", list(r.output_token_ids), "abort",
                         num_cached_tokens=r.num_cached_tokens, num_draft_tokens=r.num_draft_tokens,
                         num_accepted_tokens=r.num_accepted_tokens, num_target_steps=r.num_target_steps)


def _to_wire(command: tuple) -> tuple:
    """A command as process 0 broadcasts it: streams and Score calls by id."""
    kind = command[0]
    if kind == "add":
        _, stream, *rest = command
        return ("add", stream.request_id, *rest)
    if kind == "abort":
        return ("abort", command[1].request_id)
    if kind in ("score", "cancel_score"):
        return (kind, command[1].call_id) + ((command[1].inputs,) if kind == "score" else ())
    return command  # ("stop",)


def _deliver(loop: asyncio.AbstractEventLoop | None, items: list[tuple[Stream, RequestOutput | Exception]]) -> None:
    if loop is None:  # a following process's stand-in
        return
    try:
        loop.call_soon_threadsafe(_put_all, items)
    except RuntimeError:  # the loop is closed: nobody is listening any more
        pass


def _put_all(items: list[tuple[Stream, RequestOutput | Exception]]) -> None:
    for stream, item in items:
        stream.queue.put_nowait(item)


def _settle_threadsafe(loop: asyncio.AbstractEventLoop | None, future: asyncio.Future | None, result: Any,
                       error: Exception | None) -> None:
    if loop is None:  # a following process's stand-in
        return
    try:
        loop.call_soon_threadsafe(_settle, future, result, error)
    except RuntimeError:  # the caller's loop is closed
        pass


def _settle(future: asyncio.Future, result: Any, error: Exception | None) -> None:
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
