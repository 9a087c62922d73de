"""The asyncio gRPC server: the `jaxspec.v1.Generation` service, gRPC health and server reflection.

Handlers validate requests, tokenize (with `engine.inputs`, as the offline
API does, on worker threads so that a large text never stalls the event
loop), and talk to the engine through an `EngineWorker` (the engine runs on
its own thread). A streaming `Generate` whose call is cancelled, or whose
deadline passes, aborts its request in the engine, which frees the
request's KV blocks before the next step; a cancelled `Score` is dropped
before its next chunk.

Requests are isolated by tenant (`engine.serving.auth`): the prefix cache is
salted with the caller's tenant, and a client's `request_id` is only a label
echoed back, never a handle on a request.

Status codes: INVALID_ARGUMENT for bad requests (the message names the field),
including requests over the size limits (`ServingLimits`) and messages that
do not parse; UNAUTHENTICATED for a missing or wrong token;
RESOURCE_EXHAUSTED when scoring finds too few free KV blocks; UNAVAILABLE for
every call while the server warms up (health NOT_SERVING; the message gives
the progress and trailing metadata `grpc-retry-pushback-ms` when to retry:
refused rather than held, so a caller learns at once, a load balancer keeps
traffic elsewhere, and no call holds a connection for minutes) and for a
Score during shutdown (a Generate then ends with FINISH_REASON_ABORT);
INTERNAL when an engine step fails.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import logging
import os
import sys
import threading

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from engine.inputs import encode_prompt
from engine.serving.auth import DEFAULT_TENANT, Tenants, TLSConfig, TokenAuthInterceptor
from engine.serving.convert import (BadRequest, check_request, checked_ids, encode_chat, lenient_parser, prompt_ids,
                                    response_from_output, sampling_from_proto)
from engine.serving.metrics import Metrics, Warmup
from engine.serving.protos import generate_pb2 as pb
from engine.serving.worker import EngineFailedError, EngineStoppedError, EngineWorker
from scheduler.block_manager import NoFreeBlocksError
from scheduler.request import MAX_LOGPROBS, InvalidRequestError

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name
MAX_REQUEST_ID_CHARS = 256
# After the grace period of a shutdown, the time calls get to send their last (abort) message.
_FINAL_MESSAGE_S = 2.0

__all__ = ["GenerationServer", "GenerationServicer", "ServingLimits", "TLSConfig", "Tenants"]


@dataclasses.dataclass(frozen=True)
class ServingLimits:
    """Per-call limits, checked before any work (INVALID_ARGUMENT).

    max_request_bytes: serialized size of one request message (text, chat,
      token ids); gRPC's own receive limit is set at 4x this (at least 8
      MiB), so a larger message still gets this server's error, and one
      past gRPC's limit RESOURCE_EXHAUSTED from gRPC.
    max_score_inputs: sequences in one Score call.
    max_score_tokens: tokens over all sequences of one Score call.
    """

    max_request_bytes: int = 1 << 20
    max_score_inputs: int = 64
    max_score_tokens: int = 1 << 16

    def __post_init__(self):
        if min(self.max_request_bytes, self.max_score_inputs, self.max_score_tokens) < 1:
            raise ValueError("serving limits must be >= 1")


def _lower_priority() -> None:
    """Lowers the calling thread's CPU priority (Linux: a thread is a task with a nice value of its own)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):  # not Linux: the thread keeps the process's priority
        pass


# ---- the service ---------------------------------------------------------------------------

class GenerationServicer:
    """Implements `jaxspec.v1.Generation` over an `EngineWorker`.

    Args:
      worker: the started worker; its engine is used only through it (but for
        ModelInfo's fields, fixed at construction).
      tokenizer: the model's tokenizer, used on worker threads.
      model_name: reported by ModelInfo.
      limits: per-call limits.
      tenants: the tokens and their tenants (None: every caller is tenant "default").
    """

    def __init__(self, worker: EngineWorker | None, tokenizer, model_name: str, limits: ServingLimits = ServingLimits(),
                 tenants: Tenants | None = None, metrics: Metrics | None = None, warmup: Warmup | None = None):
        self.worker = worker  # None while the server warms up (`GenerationServer.ready` sets it)
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.limits = limits
        self.tenants = tenants
        self.metrics = metrics or worker.metrics  # counts the Generate requests refused here too
        self.warmup = warmup
        self.draining = False  # set by `GenerationServer.stop`: new calls are refused, calls in flight run on
        # Tokenizing, templating, checking and detokenizing run here, at a lower CPU priority than the engine's
        # threads: a megabyte of input takes a core for half a second, and the steps of every stream would wait.
        self._prep = concurrent.futures.ThreadPoolExecutor(4, "request-prep", initializer=_lower_priority)

    async def _prepare(self, fn, *args):
        """`fn(*args)` on a request-preparation thread."""
        return await asyncio.get_running_loop().run_in_executor(self._prep, fn, *args)

    async def _refuse_unless_serving(self, context: grpc.aio.ServicerContext) -> None:
        """UNAVAILABLE while the server drains; until the engine is ready, UNAVAILABLE with gRPC's retry
        pushback (`grpc-retry-pushback-ms`, honoured by clients with a retry policy) and the progress."""
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                "the server is shutting down: calls in flight finish, new ones go elsewhere")
        if self.worker is not None:
            return
        done, total, left = self.warmup.progress() if self.warmup else (0, 0, None)
        wait = 5.0 if left is None else min(max(left, 1.0), 60.0)
        await context.abort(grpc.StatusCode.UNAVAILABLE,
                            f"the server is warming up ({done} of {total} programs compiled); retry in {wait:.0f} s",
                            trailing_metadata=(("grpc-retry-pushback-ms", str(int(wait * 1000))),))

    def _tenant(self, context: grpc.aio.ServicerContext) -> str:
        if self.tenants is None:
            return DEFAULT_TENANT
        return self.tenants.tenant_of(context.invocation_metadata()) or DEFAULT_TENANT  # the interceptor checked

    def _check(self, request) -> None:
        """The size limit first (before any work), then parse errors and unknown fields."""
        size = request.ByteSize()
        if size > self.limits.max_request_bytes:
            raise BadRequest(f"the request is {size} bytes; this server takes at most "
                              f"{self.limits.max_request_bytes} (--max_request_bytes)")
        check_request(request)

    def _speculation_kinds(self) -> list[str]:
        engine = self.worker.engine
        return [engine.proposer.kind] if engine.gate.enabled else []

    def _speculation(self, spec: pb.Speculation) -> dict:
        """The request's `num_speculative_tokens` and `num_tree_nodes` (None: the engine's choice), as
        SamplingParams fields; raises BadRequest."""
        if not spec.enabled:
            return {"num_speculative_tokens": 0}
        kinds = self._speculation_kinds()
        if not kinds:
            raise BadRequest("speculation is not available for this model: the server has no proposer "
                              "(ModelInfo.speculation_kinds is empty)")
        if spec.kind and spec.kind not in kinds:
            raise BadRequest(f"speculation kind {spec.kind!r} is not available; this server has {kinds}")
        if spec.num_speculative_tokens < 0:
            raise BadRequest(f"speculation.num_speculative_tokens must be >= 0, got {spec.num_speculative_tokens}")
        if spec.num_tree_nodes < 0:
            raise BadRequest(f"speculation.num_tree_nodes must be >= 0, got {spec.num_tree_nodes}")
        return {"num_speculative_tokens": spec.num_speculative_tokens or None,
                "num_tree_nodes": spec.num_tree_nodes or None}

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        await self._refuse_unless_serving(context)
        try:
            self._check(request)
            if len(request.request_id) > MAX_REQUEST_ID_CHARS:
                raise BadRequest(f"request_id has {len(request.request_id)} characters; at most "
                                  f"{MAX_REQUEST_ID_CHARS}")
            sampling = sampling_from_proto(request.sampling)
            if request.HasField("speculation"):
                sampling = dataclasses.replace(sampling, **self._speculation(request.speculation))
            prompt = await self._prepare(prompt_ids, self.tokenizer, request, "prompt")
        except (BadRequest, InvalidRequestError) as e:
            self.metrics.rejected.inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        tenant = self._tenant(context)
        stream = self.worker.submit(prompt, sampling, priority=request.priority,
                                    cache_salt=f"{tenant}\x00{request.cache_salt}", tenant=tenant)
        label = request.request_id or stream.request_id
        finished = False
        try:
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, Exception):
                    finished = True  # the engine holds nothing for it any more
                    await context.abort(*_status(item))
                finished = item.finished
                yield response_from_output(item, label, sampling.logprobs)
        finally:
            if not finished:  # cancelled, deadline passed or the client went away
                self.worker.abort(stream)

    async def Score(self, request: pb.ScoreRequest, context: grpc.aio.ServicerContext) -> pb.ScoreResponse:
        await self._refuse_unless_serving(context)
        limits = self.limits
        try:
            self._check(request)
            if not request.inputs:
                raise BadRequest("inputs is empty: give at least one text or token id list to score")
            if len(request.inputs) > limits.max_score_inputs:
                raise BadRequest(f"{len(request.inputs)} inputs; this server scores at most "
                                  f"{limits.max_score_inputs} per call (--max_score_inputs)")
            encoded = await self._prepare(self._encode_score_inputs, request)
            total = sum(len(ids) for ids in encoded)
            if total > limits.max_score_tokens:
                raise BadRequest(f"the inputs have {total} tokens; this server scores at most "
                                  f"{limits.max_score_tokens} per call (--max_score_tokens)")
            results = await self.worker.score(encoded)
        except (BadRequest, InvalidRequestError) as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except NoFreeBlocksError as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"too few free KV blocks to score now ({e}); retry when the server is less busy")
        except EngineStoppedError as e:
            await context.abort(*_status(e))
        return pb.ScoreResponse(results=[
            pb.ScoreResult(token_ids=r.token_ids, token_logprobs=r.token_logprobs, log_likelihood=r.log_likelihood)
            for r in results])

    def _encode_score_inputs(self, request: pb.ScoreRequest) -> list[list[int]]:
        """Every input encoded and checked (`Engine.check_score_input`) before any is scored."""
        encoded = []
        for i, item in enumerate(request.inputs):
            try:
                encoded.append(self.worker.engine.check_score_input(prompt_ids(self.tokenizer, item, "input")))
            except (BadRequest, InvalidRequestError) as e:
                raise BadRequest(f"inputs[{i}]: {e}") from None
        return encoded

    async def Tokenize(self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:
        await self._refuse_unless_serving(context)
        try:
            self._check(request)
            kind = request.WhichOneof("input")
            if kind is None:
                raise BadRequest("input is required: set one of text, chat")
            if kind == "text":
                ids = await self._prepare(encode_prompt, self.tokenizer, request.text)
            else:
                ids = await self._prepare(encode_chat, self.tokenizer, request.chat)
        except (BadRequest, InvalidRequestError) as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return pb.TokenizeResponse(token_ids=ids)

    async def Detokenize(self, request: pb.DetokenizeRequest,
                         context: grpc.aio.ServicerContext) -> pb.DetokenizeResponse:
        await self._refuse_unless_serving(context)
        try:
            self._check(request)
            # Off the event loop, in numpy: a megabyte of ids is ~500k of them.
            ids = await self._prepare(checked_ids, request.token_ids, self.worker.engine.model_config.vocab_size)
        except (BadRequest, InvalidRequestError) as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        text = await self._prepare(self.tokenizer.decode, ids, not request.keep_special_tokens)
        return pb.DetokenizeResponse(text=text)

    async def ModelInfo(self, request: pb.ModelInfoRequest, context: grpc.aio.ServicerContext) -> pb.ModelInfoResponse:
        await self._refuse_unless_serving(context)
        try:
            self._check(request)
        except BadRequest as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        engine = self.worker.engine  # read-only fields fixed at construction
        cfg, proposer = engine.model_config, engine.proposer
        return pb.ModelInfoResponse(
            model_name=self.model_name, max_model_len=engine.max_model_len, vocab_size=cfg.vocab_size,
            eos_token_ids=engine.eos_token_ids, dtype=cfg.dtype,
            config_json=json.dumps(dataclasses.asdict(cfg), sort_keys=True),
            speculation_kinds=self._speculation_kinds(),
            max_logprobs=MAX_LOGPROBS, has_chat_template=bool(self.tokenizer.chat_template),
            block_size=engine.config.block_size, num_blocks=engine.blocks.num_blocks,
            max_num_seqs=engine.config.max_num_seqs, max_num_batched_tokens=engine.config.max_num_batched_tokens,
            num_speculative_tokens=proposer.config.num_speculative_tokens,
            num_tree_nodes=proposer.config.tree_nodes,
            max_stop_strings=engine.config.max_stop_strings, max_stop_chars=engine.config.max_stop_chars)


def _status(error: Exception) -> tuple[grpc.StatusCode, str]:
    if isinstance(error, InvalidRequestError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(error)
    if isinstance(error, EngineStoppedError):
        return grpc.StatusCode.UNAVAILABLE, f"{error}; the call was aborted"
    if isinstance(error, EngineFailedError):
        return grpc.StatusCode.INTERNAL, str(error)
    return grpc.StatusCode.UNKNOWN, f"{type(error).__name__}: {error}"


def _method_handlers(servicer: GenerationServicer) -> dict[str, grpc.RpcMethodHandler]:
    """The service's handlers, as the generated `add_GenerationServicer_to_server` builds them but
    with lenient request deserializers (see `lenient_parser`)."""
    service = pb.DESCRIPTOR.services_by_name["Generation"]
    handlers = {}
    for method in service.methods:
        request, response = (getattr(pb, m.name) for m in (method.input_type, method.output_type))
        kind = "unary_stream" if method.server_streaming else "unary_unary"
        handlers[method.name] = getattr(grpc, f"{kind}_rpc_method_handler")(
            getattr(servicer, method.name), request_deserializer=lenient_parser(request),
            response_serializer=response.SerializeToString)
    return handlers


# ---- the server ----------------------------------------------------------------------------

class GenerationServer:
    """The gRPC server around one model: the Generation service, health and reflection.

    Args:
      worker: the worker that owns the engine (not started yet; `start()` starts it), or None to start
        listening before the model is loaded and compiled: health then says NOT_SERVING and every call gets
        UNAVAILABLE with a retry hint until `ready(worker, tokenizer)`.
      tokenizer: the model's tokenizer (None with worker None).
      model_name: reported by ModelInfo.
      host, port: where to listen; port 0 picks a free port (see `start()`).
      tenants: if set, calls must carry `authorization: Bearer <token>` of one of its tokens.
      tls: serve TLS with this certificate and key; None serves plaintext.
      limits: per-call limits.
      metrics: the metrics to serve (default the worker's; give them with worker None).

    `metrics` are the worker's Prometheus metrics (served by `engine.serve`); `metrics.warmup` is the
    start-up progress.
    """

    def __init__(self, worker: EngineWorker | None, tokenizer, *, model_name: str, host: str = "127.0.0.1",
                 port: int = 0, tenants: Tenants | None = None, tls: TLSConfig | None = None,
                 limits: ServingLimits = ServingLimits(), metrics: Metrics | None = None):
        self.worker = worker
        self.tokenizer = tokenizer
        self.metrics: Metrics = metrics or worker.metrics
        self.model_name = model_name
        self.tenants = tenants
        self.limits = limits
        self._address = f"{host}:{port}"
        self._tls = tls
        self._server: grpc.aio.Server | None = None
        self._servicer: GenerationServicer | None = None
        self._health: health.aio.HealthServicer | None = None
        self.port: int | None = None

    async def start(self) -> int:
        """Starts the server (and the engine thread, if the worker was given); returns the bound port. Call
        on the serving event loop."""
        # A thread in a Python loop (a large request's conversions, say) hands the GIL on within 1 ms, not
        # Python's 5: the engine thread's next step and the event loop wait less (benchmarks/request_isolation.py).
        sys.setswitchinterval(min(sys.getswitchinterval(), 0.001))
        interceptors = [TokenAuthInterceptor(self.tenants)] if self.tenants else []
        # gRPC's receive limit sits well above ours, so oversized requests get this server's clear error
        # (parsing a message costs milliseconds; what follows it is what the limit protects).
        receive = max(8 << 20, 4 * self.limits.max_request_bytes)
        self._server = grpc.aio.server(interceptors=interceptors, options=[("grpc.max_receive_message_length", receive)])
        self._servicer = GenerationServicer(None, None, self.model_name, self.limits, self.tenants, self.metrics,
                                            self.metrics.warmup)
        handlers = _method_handlers(self._servicer)
        self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
        self._server.add_registered_method_handlers(SERVICE_NAME, handlers)
        self._health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME),
                                            self._server)
        if self._tls:
            credentials = grpc.ssl_server_credentials([(self._tls.private_key, self._tls.certificate_chain)])
            self.port = self._server.add_secure_port(self._address, credentials)
        else:
            self.port = self._server.add_insecure_port(self._address)
        if self.port == 0:
            raise OSError(f"cannot listen on {self._address}")
        await self._server.start()
        for service in ("", SERVICE_NAME):
            await self._health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        if self.worker is not None:
            await self.ready(self.worker, self.tokenizer)
        return self.port

    @property
    def draining(self) -> bool:
        """Whether `stop` began: new calls are refused, calls in flight run on."""
        return self._servicer is not None and self._servicer.draining

    async def prepare(self, fn, *args):
        """`fn(*args)` on a request-preparation thread (tokenizing, templating), at a lower CPU priority than
        the engine's: what the HTTP API shares with the gRPC handlers."""
        return await self._servicer._prepare(fn, *args)

    async def ready(self, worker: EngineWorker, tokenizer) -> None:
        """Starts `worker`'s engine thread and serves through it: health turns SERVING."""
        self.worker, self.tokenizer = worker, tokenizer
        worker.start()
        self._servicer.tokenizer, self._servicer.worker = tokenizer, worker
        self.metrics.warmup.ready = True
        for service in ("", SERVICE_NAME):
            await self._health.set(service, health_pb2.HealthCheckResponse.SERVING)

    async def stop(self, grace: float) -> None:
        """Drains, then shuts down. At once health turns NOT_SERVING and new calls get UNAVAILABLE, while the
        port stays open (a load balancer sees draining, not a dead server); requests and Score calls in flight
        get `grace` seconds to finish; then the engine thread stops, so the rest end with a last message with
        FINISH_REASON_ABORT (a Score in flight gets UNAVAILABLE), and the port closes."""
        await self._health.enter_graceful_shutdown()
        self._servicer.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        while self.worker is not None and (self.worker.num_streams or self.worker.num_score_calls) and \
                loop.time() < deadline:
            await asyncio.sleep(0.05)
        if self.worker is not None:
            await asyncio.to_thread(self.worker.stop)
        await self._server.stop(_FINAL_MESSAGE_S)
        log.info("server stopped")

    async def wait_for_termination(self) -> None:
        await self._server.wait_for_termination()
