"""The asyncio gRPC server: the `jaxspec.v1.Generation` service, gRPC health and server reflection.

Handlers validate requests, tokenize (with `engine.inputs`, as the offline
API does), and talk to the engine through an `EngineWorker` (the engine runs
on its own thread). A streaming `Generate`
whose call is cancelled, or whose deadline passes, aborts its request in the
engine, which frees the request's KV blocks before the next step.

Status codes: INVALID_ARGUMENT for bad requests (the message names the field),
UNAUTHENTICATED for a missing or wrong token, RESOURCE_EXHAUSTED when scoring
finds too few free KV blocks, UNAVAILABLE during shutdown, INTERNAL when an
engine step fails.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging

import grpc
import jinja2
from google.protobuf import unknown_fields
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from engine.inputs import check_token_ids, encode_prompt
from engine.outputs import RequestOutput
from engine.serving.metrics import Metrics
from engine.serving.protos import generate_pb2 as pb
from engine.serving.protos import generate_pb2_grpc as pb_grpc
from engine.serving.worker import (
    EngineFailedError,
    EngineStoppedError,
    EngineWorker,
)
from scheduler.block_manager import NoFreeBlocksError
from scheduler.request import MAX_LOGPROBS, InvalidRequestError, SamplingParams

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name
_FINISH_REASONS = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH}
_OPTIONAL_SAMPLING = ("temperature", "top_k", "top_p", "min_p", "seed", "max_tokens", "logprobs")


class _BadRequest(Exception):
    """A request that fails validation in the handler (INVALID_ARGUMENT)."""


# ---- request conversion --------------------------------------------------------------------

def unknown_field_paths(message, prefix: str = "") -> list[str]:
    """Fields present on the wire that this server's .proto does not define, e.g. `sampling.#12`."""
    found = [f"{prefix}#{f.field_number}" for f in unknown_fields.UnknownFieldSet(message)]
    for field, value in message.ListFields():
        if field.message_type is None:
            continue
        values = value if field.is_repeated else [value]
        for i, sub in enumerate(values):
            index = f"[{i}]" if field.is_repeated else ""
            found += unknown_field_paths(sub, f"{prefix}{field.name}{index}.")
    return found


def _check_known_fields(message) -> None:
    unknown = unknown_field_paths(message)
    if unknown:
        raise _BadRequest(f"unknown fields {', '.join(unknown)}: the client's .proto is newer than this "
                          "server's or the message is malformed")


def sampling_from_proto(p: pb.SamplingParams) -> SamplingParams:
    """Engine sampling params from the proto; unset optional fields keep the engine's defaults.

    Raises InvalidRequestError naming the first bad field.
    """
    kwargs = {f: getattr(p, f) for f in _OPTIONAL_SAMPLING if p.HasField(f)}
    sampling = SamplingParams(stop=tuple(p.stop), stop_token_ids=tuple(p.stop_token_ids),
                              ignore_eos=p.ignore_eos, **kwargs)
    sampling.validate()
    return sampling


def _chat(messages: pb.ChatMessages) -> list[dict]:
    if not messages.messages:
        raise _BadRequest("chat has no messages")
    for i, m in enumerate(messages.messages):
        if not m.role:
            raise _BadRequest(f"chat message {i} has an empty role")
    return [{"role": m.role, "content": m.content} for m in messages.messages]


def _prompt(tokenizer, message, oneof: str) -> list[int]:
    """Token ids of the text / token ids / chat set in `message`'s oneof `oneof`."""
    kind = message.WhichOneof(oneof)
    if kind is None:
        names = ", ".join(f.name for f in message.DESCRIPTOR.oneofs_by_name[oneof].fields)
        raise _BadRequest(f"{oneof} is required: set one of {names}")
    if kind == "text":
        if not message.text:
            raise _BadRequest(f"{oneof} is empty")
        return encode_prompt(tokenizer, message.text)
    if kind == "token_ids":
        return list(message.token_ids.ids)
    return _encode_chat(tokenizer, message.chat)


def _encode_chat(tokenizer, messages: pb.ChatMessages) -> list[int]:
    try:
        return encode_prompt(tokenizer, _chat(messages))
    except (ValueError, jinja2.TemplateError) as e:  # no chat template, or the template refused the messages
        raise _BadRequest(f"chat: {e}") from None


def _logprobs(out: RequestOutput, n: int) -> list[pb.Logprobs]:
    entries = out.logprobs[len(out.logprobs) - len(out.delta_token_ids):]
    return [pb.Logprobs(sampled=pb.TokenLogprob(token_id=t, logprob=entry[t]),
                        top=[pb.TokenLogprob(token_id=k, logprob=v) for k, v in list(entry.items())[:n]])
            for t, entry in zip(out.delta_token_ids, entries)]


def response_from_output(out: RequestOutput, num_logprobs: int | None) -> pb.GenerateResponse:
    """The streamed message for one engine output; the last one carries finish reason and usage."""
    msg = pb.GenerateResponse(request_id=out.request_id, text=out.delta_text, token_ids=out.delta_token_ids)
    if num_logprobs is not None:
        msg.logprobs.extend(_logprobs(out, num_logprobs))
    if out.finished:
        msg.finish_reason = _FINISH_REASONS[out.finish_reason]
        msg.usage.CopyFrom(pb.Usage(prompt_tokens=len(out.prompt_token_ids), completion_tokens=len(out.token_ids),
                                    cached_prompt_tokens=out.num_cached_tokens,
                                    acceptance_rate=out.acceptance_rate))
    return msg


# ---- the service ---------------------------------------------------------------------------

class GenerationServicer(pb_grpc.GenerationServicer):
    """Implements `jaxspec.v1.Generation` over an `EngineWorker`.

    Args:
      worker: the started worker; its engine is used only through it (but for
        ModelInfo's fields, fixed at construction).
      tokenizer: the model's tokenizer, used on the event loop.
      model_name: reported by ModelInfo.
    """

    def __init__(self, worker: EngineWorker, tokenizer, model_name: str):
        self.worker = worker
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.metrics = worker.metrics  # counts the Generate requests refused here too

    def _speculation_kinds(self) -> list[str]:
        return ["draft"] if self.worker.engine.drafter is not None else []

    def _speculation(self, spec: pb.Speculation) -> int | None:
        """The request's `num_speculative_tokens` (None: the engine's choice); raises _BadRequest."""
        if not spec.enabled:
            return 0
        kinds = self._speculation_kinds()
        if not kinds:
            raise _BadRequest("speculation is not available for this model: the server has no draft model "
                              "(ModelInfo.speculation_kinds is empty)")
        if spec.kind and spec.kind not in kinds:
            raise _BadRequest(f"speculation kind {spec.kind!r} is not available; this server has {kinds}")
        if spec.num_speculative_tokens < 0:
            raise _BadRequest(f"speculation.num_speculative_tokens must be >= 0, got {spec.num_speculative_tokens}")
        return spec.num_speculative_tokens or None

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        try:
            _check_known_fields(request)
            sampling = sampling_from_proto(request.sampling)
            if request.HasField("speculation"):
                sampling = dataclasses.replace(sampling, num_speculative_tokens=self._speculation(request.speculation))
            prompt = _prompt(self.tokenizer, request, "prompt")
        except (_BadRequest, InvalidRequestError) as e:
            self.metrics.rejected.inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        stream = self.worker.submit(prompt, sampling, priority=request.priority,
                                    request_id=request.request_id or None)
        finished = False
        try:
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, Exception):
                    finished = True  # the engine holds nothing for it any more
                    await context.abort(*_status(item))
                finished = item.finished
                yield response_from_output(item, sampling.logprobs)
        finally:
            if not finished:  # cancelled, deadline passed or the client went away
                self.worker.abort(stream.request_id)

    async def Score(self, request: pb.ScoreRequest, context: grpc.aio.ServicerContext) -> pb.ScoreResponse:
        try:
            _check_known_fields(request)
            if not request.inputs:
                raise _BadRequest("inputs is empty: give at least one text or token id list to score")
            encoded = []
            for i, item in enumerate(request.inputs):
                try:
                    encoded.append(_prompt(self.tokenizer, item, "input"))
                except (_BadRequest, InvalidRequestError) as e:
                    raise _BadRequest(f"inputs[{i}]: {e}") from None
            results = await self.worker.call(lambda engine: _score_all(engine, encoded))
        except (_BadRequest, InvalidRequestError) as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except NoFreeBlocksError as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"too few free KV blocks to score now ({e}); retry when the server is less busy")
        return pb.ScoreResponse(results=[
            pb.ScoreResult(token_ids=r.token_ids, token_logprobs=r.token_logprobs, log_likelihood=r.log_likelihood)
            for r in results])

    async def Tokenize(self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:
        try:
            _check_known_fields(request)
            kind = request.WhichOneof("input")
            if kind is None:
                raise _BadRequest("input is required: set one of text, chat")
            ids = encode_prompt(self.tokenizer, request.text) if kind == "text" else _encode_chat(self.tokenizer, request.chat)
        except (_BadRequest, InvalidRequestError) as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return pb.TokenizeResponse(token_ids=ids)

    async def Detokenize(self, request: pb.DetokenizeRequest,
                         context: grpc.aio.ServicerContext) -> pb.DetokenizeResponse:
        try:
            _check_known_fields(request)
            check_token_ids(request.token_ids, self.worker.engine.model_config.vocab_size, "token ids")
        except (_BadRequest, InvalidRequestError) as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        text = self.tokenizer.decode(request.token_ids, skip_special_tokens=not request.keep_special_tokens)
        return pb.DetokenizeResponse(text=text)

    async def ModelInfo(self, request: pb.ModelInfoRequest, context: grpc.aio.ServicerContext) -> pb.ModelInfoResponse:
        engine = self.worker.engine  # read-only fields fixed at construction
        cfg = engine.model_config
        return pb.ModelInfoResponse(
            model_name=self.model_name, max_model_len=engine.max_model_len, vocab_size=cfg.vocab_size,
            eos_token_ids=engine.eos_token_ids, dtype=cfg.dtype,
            config_json=json.dumps(dataclasses.asdict(cfg), sort_keys=True),
            speculation_kinds=self._speculation_kinds(),
            max_logprobs=MAX_LOGPROBS, has_chat_template=bool(self.tokenizer.chat_template),
            block_size=engine.config.block_size, num_blocks=engine.blocks.num_blocks,
            max_num_seqs=engine.config.max_num_seqs, max_num_batched_tokens=engine.config.max_num_batched_tokens)


def _score_all(engine, encoded: list[list[int]]):
    results = []
    for i, ids in enumerate(encoded):
        try:
            results.append(engine.score(ids))
        except InvalidRequestError as e:
            raise InvalidRequestError(f"inputs[{i}]: {e}") from None
    return results


def _status(error: Exception) -> tuple[grpc.StatusCode, str]:
    if isinstance(error, InvalidRequestError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(error)
    if isinstance(error, EngineStoppedError):
        return grpc.StatusCode.UNAVAILABLE, f"{error}; the request was aborted"
    if isinstance(error, EngineFailedError):
        return grpc.StatusCode.INTERNAL, str(error)
    return grpc.StatusCode.UNKNOWN, f"{type(error).__name__}: {error}"


# ---- auth ----------------------------------------------------------------------------------

class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """Requires metadata `authorization: Bearer <token>` on every call except gRPC health checks
    (load balancers probe without credentials); others get UNAUTHENTICATED."""

    def __init__(self, token: str):
        if not token:
            raise ValueError("the auth token must not be empty")
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or details.method.startswith(f"/{health.SERVICE_NAME}/"):
            return handler
        sent = dict(details.invocation_metadata or ()).get("authorization", "")
        if isinstance(sent, str) and hmac.compare_digest(sent.encode(), self._expected):
            return handler
        return _denying(handler, "missing or wrong auth token: send metadata 'authorization: Bearer <token>'")


def _denying(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that fails with UNAUTHENTICATED."""

    async def deny(_request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    for kind in ("unary_unary", "unary_stream", "stream_unary", "stream_stream"):
        if getattr(handler, kind) is not None:
            return getattr(grpc, f"{kind}_rpc_method_handler")(
                deny, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)
    raise TypeError(f"unknown handler kind: {handler!r}")


# ---- the server ----------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class TLSConfig:
    certificate_chain: bytes  # PEM
    private_key: bytes  # PEM


class GenerationServer:
    """The gRPC server around one model: the Generation service, health and reflection.

    Args:
      worker: the worker that owns the engine (not started yet; `start()` starts it).
      tokenizer: the model's tokenizer.
      model_name: reported by ModelInfo.
      host, port: where to listen; port 0 picks a free port (see `start()`).
      auth_token: if set, calls must carry `authorization: Bearer <token>`.
      tls: serve TLS with this certificate and key; None serves plaintext.

    `metrics` are the worker's Prometheus metrics (served by `engine.serve`).
    """

    def __init__(self, worker: EngineWorker, tokenizer, *, model_name: str, host: str = "127.0.0.1", port: int = 0,
                 auth_token: str | None = None, tls: TLSConfig | None = None):
        self.worker = worker
        self.tokenizer = tokenizer
        self.metrics: Metrics = worker.metrics
        self.model_name = model_name
        self._address = f"{host}:{port}"
        self._auth_token = auth_token
        self._tls = tls
        self._server: grpc.aio.Server | None = None
        self._health: health.aio.HealthServicer | None = None
        self.port: int | None = None

    async def start(self) -> int:
        """Starts the engine thread and the server; returns the bound port. Call on the serving event loop."""
        interceptors = [TokenAuthInterceptor(self._auth_token)] if self._auth_token else []
        self._server = grpc.aio.server(interceptors=interceptors)
        pb_grpc.add_GenerationServicer_to_server(
            GenerationServicer(self.worker, self.tokenizer, self.model_name), self._server)
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
        self.worker.start()
        await self._server.start()
        for service in ("", SERVICE_NAME):
            await self._health.set(service, health_pb2.HealthCheckResponse.SERVING)
        return self.port

    async def stop(self, grace: float) -> None:
        """Graceful shutdown: health turns NOT_SERVING, new calls are refused, calls in flight get
        `grace` seconds to finish and are then cancelled (aborting their requests); then the engine
        thread stops."""
        await self._health.enter_graceful_shutdown()
        await self._server.stop(grace)
        await asyncio.to_thread(self.worker.stop)
        log.info("server stopped")

    async def wait_for_termination(self) -> None:
        await self._server.wait_for_termination()
