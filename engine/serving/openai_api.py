"""The OpenAI-compatible HTTP API, on the engine worker the gRPC server uses: one engine, both protocols.

  POST /v1/completions, POST /v1/chat/completions (streaming as server-sent events, `data: [DONE]` last),
  GET /v1/models, GET /health, GET /metrics; vLLM's POST /tokenize, POST /detokenize, GET /tokenizer_info
  (lm-evaluation-harness's remote tokenizer reads them)

FastAPI on uvicorn, run in the gRPC server's event loop (`HttpServer`): FastAPI because its request models
(pydantic) give each bad field a clear error for free, and uvicorn is the ASGI server people deploy it with.
Requests are checked on the same path as gRPC: the size limit (`ServingLimits.max_request_bytes`), then
the fields, then `SamplingParams.validate` and the engine's own checks (`Engine.validate`, on the engine
thread); a bad request is a 400 with OpenAI's error object naming the field (`param`). The same bearer
tokens authenticate (`Authorization: Bearer <token>`, 401 otherwise) and name the tenant, which salts the
prefix cache (and suffix decoding's memory) as over gRPC. While the server warms up or drains, calls get
503 with `Retry-After`. A client that disconnects aborts its requests, which frees their KV blocks before
the next step.

`echo` on completions returns the prompt before the completion and, with `logprobs`, the prompt tokens'
log-probabilities (the first token's is null), each with its position's argmax in `top_logprobs` (what
lm-evaluation-harness's loglikelihood requests read; `max_tokens` 0 scores the prompt alone). They come
from `Engine.score`'s pass, the one `LLM.score` and gRPC's Score run.

Sampling fields beyond OpenAI's, as vLLM takes them (top level of the body; the `openai` client sends
them through `extra_body`): `top_k`, `min_p`, `ignore_eos`, `stop_token_ids`, `priority`, `cache_salt`,
`num_speculative_tokens` (0: no speculation) and `num_tree_nodes`. `n` > 1 runs n requests with seeds
`seed`, `seed + 1`, ... (as `LLM.generate` samples them), sharing the prompt's KV through the prefix cache.

Source: the OpenAI API reference (Completions, Chat Completions, the streaming chunk objects).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
import time
import uuid
from typing import Any

import jinja2
import prometheus_client as prom
import pydantic
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse

from engine.inputs import encode_prompt
from engine.outputs import RequestOutput
from engine.serving.openai_protocol import (ApiError, ChatBody, CompletionBody, DetokenizeBody, SamplingBody,
                                            TokenizeBody, echoed_logprobs, engine_error, error_response,
                                            field_named, logprobs_object, sse, usage, validation_error)
from engine.serving.worker import EngineFailedError, EngineStoppedError
from scheduler.block_manager import NoFreeBlocksError
from scheduler.request import MAX_LOGPROBS, InvalidRequestError, SamplingParams

log = logging.getLogger(__name__)


# ---- the API -------------------------------------------------------------------------------

class OpenAIApi:
    """The endpoints over a `engine.serving.server.GenerationServer`'s state (worker, tokenizer, tenants,
    limits, metrics, warm-up and draining), read at each call: the HTTP API serves exactly when gRPC does.

    Args:
      frontend: the gRPC server whose engine worker this API shares.
      scrape_token: the operator's token for `/metrics` (as `Metrics.serve` takes it).
    """

    def __init__(self, frontend, scrape_token: str | None = None):
        self.frontend = frontend
        self.scrape_token = scrape_token
        self.app = FastAPI(title="jax-spec-engine", docs_url=None, redoc_url=None, openapi_url=None)
        self.app.add_exception_handler(ApiError, lambda _, e: error_response(e.status, e.message, e.param, e.kind, e.headers))
        self.app.add_exception_handler(RequestValidationError, lambda _, e: validation_error(e))
        self.app.post("/v1/completions")(self.completions)
        self.app.post("/v1/chat/completions")(self.chat_completions)
        self.app.get("/v1/models")(self.models)
        self.app.get("/health")(self.health)
        self.app.get("/metrics")(self.metrics)
        self.app.post("/tokenize")(self.tokenize)
        self.app.post("/detokenize")(self.detokenize)
        self.app.get("/tokenizer_info")(self.tokenizer_info)

    # ---- checks ----------------------------------------------------------------------------

    def _tenant(self, request: Request) -> str:
        """The caller's tenant from its bearer token; 401 without a known one (when the server has tokens)."""
        tenants = self.frontend.tenants
        if tenants is None:
            return "default"
        tenant = tenants.tenant_of([("authorization", request.headers.get("authorization", ""))])
        if tenant is None:
            raise ApiError(401, "missing or wrong API key: send 'Authorization: Bearer <token>'",
                           kind="authentication_error")
        return tenant

    def _worker(self):
        """The engine worker, or 503 while the server warms up or drains."""
        if self.frontend.draining:
            raise ApiError(503, "the server is shutting down: calls in flight finish, new ones go elsewhere",
                           kind="server_error", headers={"Retry-After": "5"})
        worker = self.frontend.worker
        if worker is None:
            done, total, left = self.frontend.metrics.warmup.progress()
            wait = 5.0 if left is None else min(max(left, 1.0), 60.0)
            raise ApiError(503, f"the server is warming up ({done} of {total} programs compiled); retry in "
                           f"{wait:.0f} s", kind="server_error", headers={"Retry-After": str(int(wait))})
        return worker

    async def _body(self, request: Request, model: type[pydantic.BaseModel]):
        """The body parsed as `model`, after the size limit (400 naming the limit, before any parsing)."""
        limit = self.frontend.limits.max_request_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise ApiError(400, f"the request is {declared} bytes; this server takes at most {limit} "
                           "(--max_request_bytes)")
        raw = await request.body()
        if len(raw) > limit:
            raise ApiError(400, f"the request is {len(raw)} bytes; this server takes at most {limit} "
                           "(--max_request_bytes)")
        try:
            return model.model_validate_json(raw)
        except pydantic.ValidationError as e:
            raise RequestValidationError(e.errors()) from None

    def _sampling(self, body: SamplingBody, num_logprobs: int | None, max_tokens: int | None) -> SamplingParams:
        """The body's sampling fields as `SamplingParams` (validated: 400 naming the field)."""
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(body, name):
                raise ApiError(400, f"{name} is not supported (only 0)", name)
        if body.stream_options is not None and not body.stream:
            raise ApiError(400, "stream_options needs stream: true", "stream_options")
        if body.n < 1 or body.n > self.frontend.worker.engine.config.max_num_seqs:
            raise ApiError(400, f"n must be in [1, {self.frontend.worker.engine.config.max_num_seqs}], got {body.n}",
                           "n")
        kwargs: dict[str, Any] = {k: v for k, v in {
            "temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k, "min_p": body.min_p,
            "seed": body.seed, "max_tokens": max_tokens, "logprobs": num_logprobs,
            "num_speculative_tokens": body.num_speculative_tokens, "num_tree_nodes": body.num_tree_nodes,
        }.items() if v is not None}
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or ())
        try:
            sampling = SamplingParams(stop=tuple(stop), stop_token_ids=tuple(body.stop_token_ids or ()),
                                      ignore_eos=body.ignore_eos, **kwargs)
            sampling.validate()
        except InvalidRequestError as e:
            raise ApiError(400, str(e), field_named(str(e))) from None
        return sampling

    # ---- endpoints -------------------------------------------------------------------------

    async def completions(self, request: Request):
        tenant = self._tenant(request)
        worker = self._worker()
        body: CompletionBody = await self._body(request, CompletionBody)
        if body.echo and body.stream:
            raise ApiError(400, "echo is not supported with stream", "echo")
        if body.max_tokens == 0 and not body.echo:
            raise ApiError(400, "max_tokens 0 needs echo: true (scoring the prompt alone)", "max_tokens")
        if body.logprobs is not None and not 0 <= body.logprobs <= MAX_LOGPROBS:
            raise ApiError(400, f"logprobs must be in [0, {MAX_LOGPROBS}], got {body.logprobs}", "logprobs")
        prompts = body.prompt if isinstance(body.prompt, list) and body.prompt and not isinstance(
            body.prompt[0], int) else [body.prompt]
        encoded = []
        for prompt in prompts:
            if isinstance(prompt, str) and not prompt:
                raise ApiError(400, "prompt is empty", "prompt")
            encoded.append(await self.frontend.prepare(encode_prompt, self.frontend.tokenizer, prompt)
                           if isinstance(prompt, str) else list(prompt))
        sampling = self._sampling(body, body.logprobs, body.max_tokens or None)
        if not body.echo:
            return await self._respond(request, worker, body, encoded, sampling, tenant, chat=False)
        try:
            scored = await worker.score([worker.engine.check_score_input(ids) for ids in encoded])
        except InvalidRequestError as e:
            raise ApiError(400, f"prompt: {e}", "prompt") from None
        except NoFreeBlocksError as e:
            raise ApiError(503, f"too few free KV blocks to score the prompt now ({e}); retry when the server "
                           "is less busy", kind="server_error", headers={"Retry-After": "1"}) from None
        if body.max_tokens == 0:
            response = {"id": "cmpl-" + uuid.uuid4().hex, "object": "text_completion", "created": int(time.time()),
                        "model": body.model or self.frontend.model_name, "choices": [
                            {"index": i * body.n + j, "text": "", "logprobs": None, "finish_reason": "length"}
                            for i in range(len(encoded)) for j in range(body.n)],
                        "usage": {"prompt_tokens": sum(map(len, encoded)), "completion_tokens": 0,
                                  "total_tokens": sum(map(len, encoded)), "prompt_tokens_details": {"cached_tokens": 0}}}
        else:
            response = await self._respond(request, worker, body, encoded, sampling, tenant, chat=False)
        for choice in response["choices"]:
            i = choice["index"] // body.n
            prompt_text = prompts[i] if isinstance(prompts[i], str) else self.frontend.tokenizer.decode(encoded[i])
            if body.logprobs is not None:
                choice["logprobs"] = echoed_logprobs(scored[i], self.frontend.tokenizer, choice["logprobs"])
            choice["text"] = prompt_text + choice["text"]
        return response

    async def chat_completions(self, request: Request):
        tenant = self._tenant(request)
        worker = self._worker()
        body: ChatBody = await self._body(request, ChatBody)
        if not body.messages:
            raise ApiError(400, "messages is empty", "messages")
        if body.top_logprobs is not None and not body.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        if body.top_logprobs is not None and not 0 <= body.top_logprobs <= MAX_LOGPROBS:
            raise ApiError(400, f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {body.top_logprobs}",
                           "top_logprobs")
        messages = [{"role": m.role, "content": m.content if isinstance(m.content, str)
                     else "".join(p.text for p in m.content)} for m in body.messages]
        try:
            ids = await self.frontend.prepare(encode_prompt, self.frontend.tokenizer, messages)
        except (ValueError, InvalidRequestError, jinja2.TemplateError) as e:  # no template, or it refused them
            raise ApiError(400, f"messages: {e}", "messages") from None
        limit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        if limit is None:  # chat's default: up to the context limit
            limit = max(1, worker.engine.max_model_len - len(ids))
        sampling = self._sampling(body, (body.top_logprobs or 0) if body.logprobs else None, limit)
        return await self._respond(request, worker, body, [ids], sampling, tenant, chat=True)

    async def models(self, request: Request):
        self._tenant(request)
        return {"object": "list", "data": [{"id": self.frontend.model_name, "object": "model", "created": 0,
                                            "owned_by": "jax-spec-engine"}]}

    async def tokenize(self, request: Request):
        """vLLM's: `{"prompt": text}` or `{"messages": [...]}` (through the chat template) -> token ids."""
        self._tenant(request)
        self._worker()
        body: TokenizeBody = await self._body(request, TokenizeBody)
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "give one of prompt and messages", "prompt")
        prompt = body.prompt if body.prompt is not None else body.messages
        try:
            ids = await self.frontend.prepare(encode_prompt, self.frontend.tokenizer, prompt)
        except (ValueError, InvalidRequestError, jinja2.TemplateError) as e:
            raise ApiError(400, f"{'prompt' if body.prompt is not None else 'messages'}: {e}",
                           "prompt" if body.prompt is not None else "messages") from None
        return {"tokens": ids, "count": len(ids), "max_model_len": self.frontend.worker.engine.max_model_len}

    async def detokenize(self, request: Request):
        """vLLM's: `{"tokens": [...]}` -> `{"prompt": text}` (400 for an id outside the vocabulary)."""
        self._tenant(request)
        worker = self._worker()
        body: DetokenizeBody = await self._body(request, DetokenizeBody)
        vocab = worker.engine.model_config.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise ApiError(400, f"token ids must be in [0, {vocab}); got {bad[:5]}", "tokens")
        return {"prompt": await self.frontend.prepare(self.frontend.tokenizer.decode, body.tokens)}

    async def tokenizer_info(self, request: Request):
        """vLLM's: the special tokens' texts, the chat template and the context limit."""
        self._tenant(request)
        worker = self._worker()
        tok = self.frontend.tokenizer
        return {"tokenizer_class": "jax-spec-engine", "eos_token": tok.eos_token, "bos_token": tok.bos_token,
                "pad_token": None, "chat_template": tok.chat_template, "model_max_length": worker.engine.max_model_len}

    async def health(self):
        """200 when serving, 503 while warming up or draining: the gRPC health service's readiness."""
        try:
            self._worker()
        except ApiError as e:
            return error_response(503, e.message, kind="server_error", headers=e.headers)
        return {"status": "ok"}

    async def metrics(self, request: Request):
        """The Prometheus page, for the operator's scrape token only when the server has tokens (as
        `Metrics.serve`): it counts every tenant's traffic."""
        sent = request.headers.get("authorization", "")
        tenants = self.frontend.tenants
        if self.scrape_token is not None or tenants is not None:
            ok = self.scrape_token is not None and hmac.compare_digest(sent.encode(), f"Bearer {self.scrape_token}".encode())
            if not ok:
                if tenants is not None and tenants.tenant_of([("authorization", sent)]) is not None:
                    return Response("a tenant's token does not read /metrics: scrape with the operator's token "
                                    "(--metrics_token_file)\n", 403, media_type="text/plain")
                return Response("missing or wrong scrape token\n", 401, media_type="text/plain",
                                headers={"WWW-Authenticate": "Bearer"})
        return Response(prom.generate_latest(self.frontend.metrics.registry), media_type=prom.CONTENT_TYPE_LATEST)

    # ---- responses -------------------------------------------------------------------------

    async def _respond(self, request: Request, worker, body: SamplingBody, prompts: list[list[int]],
                       sampling: SamplingParams, tenant: str, chat: bool):
        """Submits `body.n` samples of every prompt and answers with the whole response or an SSE stream."""
        streams = []
        for prompt in prompts:
            for i in range(body.n):
                seeded = sampling if sampling.seed is None else dataclasses.replace(sampling, seed=(sampling.seed + i) % 2**32)
                streams.append(worker.submit(prompt, seeded, priority=body.priority,
                                             cache_salt=f"{tenant}\x00{body.cache_salt or ''}", tenant=tenant))
        meta = {"id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex, "created": int(time.time()),
                "model": body.model or self.frontend.model_name}
        tokenizer = self.frontend.tokenizer
        if body.stream:
            include_usage = bool((body.stream_options or {}).get("include_usage"))
            return StreamingResponse(self._events(worker, streams, meta, chat, sampling.logprobs, tokenizer,
                                                  include_usage), media_type="text/event-stream")
        watcher = asyncio.ensure_future(_until_disconnected(request))
        try:
            gathered = asyncio.ensure_future(asyncio.gather(*(_last(s) for s in streams)))
            done, _ = await asyncio.wait([gathered, watcher], return_when=asyncio.FIRST_COMPLETED)
            if gathered not in done:
                gathered.cancel()
                return Response(status_code=499)
            outputs = gathered.result()
        except (InvalidRequestError, EngineFailedError, EngineStoppedError) as e:
            raise engine_error(e) from None
        finally:
            watcher.cancel()
            for s in streams:
                worker.abort(s)  # a finished one is ignored
        choices = []
        for index, out in enumerate(outputs):
            logprobs = logprobs_object(out, sampling.logprobs, tokenizer, chat) if sampling.logprobs is not None else None
            if chat:
                choices.append({"index": index, "message": {"role": "assistant", "content": out.text},
                                "logprobs": logprobs, "finish_reason": out.finish_reason})
            else:
                choices.append({"index": index, "text": out.text, "logprobs": logprobs,
                                "finish_reason": out.finish_reason})
        return {**meta, "object": "chat.completion" if chat else "text_completion", "choices": choices,
                "usage": usage(outputs, body.n)}

    async def _events(self, worker, streams, meta: dict, chat: bool, num_logprobs: int | None, tokenizer,
                      include_usage: bool):
        """Server-sent events: a chunk per engine output, the usage chunk if asked, `[DONE]`. Cancelled (the
        client went away) or ended, it aborts whatever is still running."""
        kind = "chat.completion.chunk" if chat else "text_completion"
        queue: asyncio.Queue = asyncio.Queue()
        pumps = [asyncio.ensure_future(_pump(i, s, queue)) for i, s in enumerate(streams)]
        finals: list[RequestOutput | None] = [None] * len(streams)
        try:
            if chat:
                for index in range(len(streams)):
                    yield sse({**meta, "object": kind, "choices": [
                        {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                         "finish_reason": None}]})
            left = len(streams)
            while left:
                index, item = await queue.get()
                if isinstance(item, Exception):
                    error = engine_error(item)
                    yield sse({"error": {"message": error.message, "type": error.kind, "param": error.param,
                                          "code": None}})
                    return
                lp = logprobs_object(item, num_logprobs, tokenizer, chat, delta=True) if num_logprobs is not None else None
                choice = ({"index": index, "delta": {"content": item.delta_text}} if chat
                          else {"index": index, "text": item.delta_text})
                choice.update(logprobs=lp, finish_reason=item.finish_reason)
                yield sse({**meta, "object": kind, "choices": [choice]})
                if item.finished:
                    finals[index] = item
                    left -= 1
            if include_usage:
                yield sse({**meta, "object": kind, "choices": [], "usage": usage(finals, 1)})
            yield "data: [DONE]\n\n"
        finally:
            for p in pumps:
                p.cancel()
            for s in streams:
                worker.abort(s)


class HttpServer:
    """uvicorn serving `OpenAIApi` in the running event loop (the gRPC server's).

    Args:
      frontend: the `GenerationServer` whose worker and settings the API shares.
      host, port: where to listen; port 0 picks a free one (`port` after `start`).
      certfile, keyfile: PEM paths to serve HTTPS.
      scrape_token: the operator's `/metrics` token.
    """

    def __init__(self, frontend, host: str = "127.0.0.1", port: int = 0, *, certfile: str | None = None,
                 keyfile: str | None = None, scrape_token: str | None = None):
        self.api = OpenAIApi(frontend, scrape_token)
        config = uvicorn.Config(self.api.app, host=host, port=port, log_level="warning", access_log=False,
                                ssl_certfile=certfile, ssl_keyfile=keyfile, lifespan="off")
        self._server = uvicorn.Server(config)
        self._task: asyncio.Task | None = None
        self.port: int | None = None

    async def start(self) -> int:
        """Starts listening; returns the bound port."""
        self._task = asyncio.ensure_future(self._server.serve())
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises why it could not start
                raise OSError("the HTTP server did not start")
            await asyncio.sleep(0.01)
        self.port = self._server.servers[0].sockets[0].getsockname()[1]
        return self.port

    async def stop(self) -> None:
        self._server.should_exit = True
        if self._task is not None:
            await self._task


# ---- helpers -------------------------------------------------------------------------------

async def _last(stream) -> RequestOutput:
    """The stream's last output (its finished one); raises the error it ends with."""
    while True:
        item = await stream.queue.get()
        if isinstance(item, Exception):
            raise item
        if item.finished:
            return item


async def _pump(index: int, stream, queue: asyncio.Queue) -> None:
    """Forwards one stream's outputs to `queue` tagged with its choice index, up to its last."""
    while True:
        item = await stream.queue.get()
        await queue.put((index, item))
        if isinstance(item, Exception) or item.finished:
            return


async def _until_disconnected(request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(0.1)


