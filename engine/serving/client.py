"""A small client for the gRPC service (`engine.serve`), blocking and asyncio flavours.

  from engine.serving.client import Client
  with Client("127.0.0.1:50051") as c:
      for msg in c.generate_stream("The capital of France is", max_tokens=16, temperature=0):
          print(msg.text, end="", flush=True)

Its command line is `python -m engine.query`.

Sampling keywords are `SamplingParams` fields of the .proto (temperature,
top_k, top_p, min_p, seed, max_tokens, stop, stop_token_ids, logprobs,
ignore_eos); unset ones take the server's defaults. Errors raise
`grpc.RpcError` with the server's status code and message.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Self

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine.serving.protos import generate_pb2 as pb
from engine.serving.protos import generate_pb2_grpc as pb_grpc

# A prompt: text, token ids, or chat messages [{"role": ..., "content": ...}].
Prompt = str | Sequence[int] | Sequence[dict]
FINISH_REASONS = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_ABORT: "abort"}


def generate_request(prompt: Prompt, *, priority: int = 0, request_id: str = "", cache_salt: str = "",
                     speculation: bool | None = None, num_speculative_tokens: int = 0, speculation_kind: str = "",
                     num_tree_nodes: int = 0, **sampling) -> pb.GenerateRequest:
    """Builds a GenerateRequest; raises TypeError for an unknown sampling keyword or prompt type.

    `request_id`: a label the responses echo. `cache_salt`: share prefix-cache
    entries only with requests of the same salt (within the caller's tenant).
    `speculation`: None leaves it to the server; False turns it off; True asks
    for it (at most `num_speculative_tokens` draft tokens per step, 0 = the server's K; with a server
    verifying token trees, at most `num_tree_nodes` nodes, 0 = its tree), of `speculation_kind` if given (one
    of `ModelInfo.speculation_kinds`).
    """
    request = pb.GenerateRequest(sampling=pb.SamplingParams(**sampling), priority=priority, request_id=request_id,
                                 cache_salt=cache_salt)
    if speculation is not None:
        request.speculation.CopyFrom(pb.Speculation(enabled=speculation, num_speculative_tokens=num_speculative_tokens,
                                                  kind=speculation_kind, num_tree_nodes=num_tree_nodes))
    if isinstance(prompt, str):
        request.text = prompt
    elif prompt and all(isinstance(m, dict) for m in prompt):
        request.chat.messages.extend(pb.ChatMessage(role=m["role"], content=m["content"]) for m in prompt)
    elif all(isinstance(t, int) for t in prompt):
        request.token_ids.ids.extend(prompt)
    else:
        raise TypeError("a prompt is a string, a list of token ids or a list of chat messages")
    return request


def _score_request(texts: Sequence[str | Sequence[int]]) -> pb.ScoreRequest:
    return pb.ScoreRequest(inputs=[pb.ScoreInput(text=t) if isinstance(t, str)
                                   else pb.ScoreInput(token_ids=pb.TokenIds(ids=t)) for t in texts])


def _tokenize_request(prompt: str | Sequence[dict]) -> pb.TokenizeRequest:
    if isinstance(prompt, str):
        return pb.TokenizeRequest(text=prompt)
    return pb.TokenizeRequest(chat=pb.ChatMessages(messages=[pb.ChatMessage(**m) for m in prompt]))


@dataclasses.dataclass
class Completion:
    """A whole generation: the streamed messages joined."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" or "length"; None if the stream ended without one
    usage: pb.Usage | None
    logprobs: list[pb.Logprobs]

    @classmethod
    def join(cls, messages: Sequence[pb.GenerateResponse]) -> Completion:
        last = messages[-1] if messages else None
        return cls(last.request_id if last else "", "".join(m.text for m in messages),
                   [t for m in messages for t in m.token_ids], FINISH_REASONS.get(last.finish_reason) if last else None,
                   last.usage if last is not None and last.HasField("usage") else None,
                   [lp for m in messages for lp in m.logprobs])


def _channel(target: str, root_certificates: bytes | None, aio: bool):
    mod = grpc.aio if aio else grpc
    if root_certificates is not None:
        return mod.secure_channel(target, grpc.ssl_channel_credentials(root_certificates))
    return mod.insecure_channel(target)


def _metadata(auth_token: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {auth_token}"),) if auth_token else ()


class Client:
    """Blocking client.

    Args:
      target: "host:port" of the server.
      auth_token: sent as `authorization: Bearer <token>` when set.
      root_certificates: PEM CA certificates to verify a TLS server; None connects in plaintext.
    """

    def __init__(self, target: str = "127.0.0.1:50051", *, auth_token: str | None = None,
                 root_certificates: bytes | None = None):
        self.channel = _channel(target, root_certificates, aio=False)
        self.stub = pb_grpc.GenerationStub(self.channel)
        self.metadata = _metadata(auth_token)

    def generate_stream(self, prompt: Prompt, *, timeout: float | None = None, **kwargs) -> Iterator[pb.GenerateResponse]:
        """Streams the messages of one request (`kwargs`: see `generate_request`). Closing the
        iterator early (or its `cancel()`) cancels the call, which aborts the request."""
        return self.stub.Generate(generate_request(prompt, **kwargs), timeout=timeout, metadata=self.metadata)

    def generate(self, prompt: Prompt, *, timeout: float | None = None, **kwargs) -> Completion:
        return Completion.join(list(self.generate_stream(prompt, timeout=timeout, **kwargs)))

    def score(self, texts: Sequence[str | Sequence[int]]) -> list[pb.ScoreResult]:
        return list(self.stub.Score(_score_request(texts), metadata=self.metadata).results)

    def tokenize(self, prompt: str | Sequence[dict]) -> list[int]:
        return list(self.stub.Tokenize(_tokenize_request(prompt), metadata=self.metadata).token_ids)

    def detokenize(self, token_ids: Sequence[int], keep_special_tokens: bool = False) -> str:
        request = pb.DetokenizeRequest(token_ids=token_ids, keep_special_tokens=keep_special_tokens)
        return self.stub.Detokenize(request, metadata=self.metadata).text

    def model_info(self) -> pb.ModelInfoResponse:
        return self.stub.ModelInfo(pb.ModelInfoRequest(), metadata=self.metadata)

    def health(self, service: str = "") -> str:
        """The health status name ("SERVING", "NOT_SERVING", ...) of `service` ("" = the server)."""
        response = health_pb2_grpc.HealthStub(self.channel).Check(health_pb2.HealthCheckRequest(service=service))
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_) -> None:
        self.close()


class AsyncClient:
    """asyncio client (same arguments as `Client`); create and use it on one event loop."""

    def __init__(self, target: str = "127.0.0.1:50051", *, auth_token: str | None = None,
                 root_certificates: bytes | None = None):
        self.channel = _channel(target, root_certificates, aio=True)
        self.stub = pb_grpc.GenerationStub(self.channel)
        self.metadata = _metadata(auth_token)

    def generate_stream(self, prompt: Prompt, *, timeout: float | None = None,
                        **kwargs) -> AsyncIterator[pb.GenerateResponse]:
        """The call object: iterate it with `async for`; `cancel()` aborts the request."""
        return self.stub.Generate(generate_request(prompt, **kwargs), timeout=timeout, metadata=self.metadata)

    async def generate(self, prompt: Prompt, *, timeout: float | None = None, **kwargs) -> Completion:
        return Completion.join([m async for m in self.generate_stream(prompt, timeout=timeout, **kwargs)])

    async def score(self, texts: Sequence[str | Sequence[int]]) -> list[pb.ScoreResult]:
        return list((await self.stub.Score(_score_request(texts), metadata=self.metadata)).results)

    async def tokenize(self, prompt: str | Sequence[dict]) -> list[int]:
        return list((await self.stub.Tokenize(_tokenize_request(prompt), metadata=self.metadata)).token_ids)

    async def model_info(self) -> pb.ModelInfoResponse:
        return await self.stub.ModelInfo(pb.ModelInfoRequest(), metadata=self.metadata)

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *_) -> None:
        await self.close()
