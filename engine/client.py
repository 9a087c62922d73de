"""A small client for the gRPC service (`engine.serve`), blocking and asyncio flavours, and a command line.

  from engine.client import Client
  with Client("127.0.0.1:50051") as c:
      for msg in c.generate_stream("The capital of France is", max_tokens=16, temperature=0):
          print(msg.text, end="", flush=True)

  python -m engine.client --prompt "What is the capital of France?" --chat --temperature 0
  python -m engine.client --info | --tokenize TEXT | --score TEXT

Sampling keywords are `SamplingParams` fields of the .proto (temperature,
top_k, top_p, min_p, seed, max_tokens, stop, stop_token_ids, logprobs,
ignore_eos); unset ones take the server's defaults. Errors raise
`grpc.RpcError` with the server's status code and message.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Self

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine.protos import generate_pb2 as pb
from engine.protos import generate_pb2_grpc as pb_grpc

# A prompt: text, token ids, or chat messages [{"role": ..., "content": ...}].
Prompt = str | Sequence[int] | Sequence[dict]
FINISH_REASONS = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length"}


def generate_request(prompt: Prompt, *, priority: int = 0, request_id: str = "", speculation: bool | None = None,
                     num_speculative_tokens: int = 0, **sampling) -> pb.GenerateRequest:
    """Builds a GenerateRequest; raises TypeError for an unknown sampling keyword or prompt type.

    `speculation`: None leaves it to the server; False turns it off; True asks
    for it (at most `num_speculative_tokens` draft tokens per step, 0 = the server's K).
    """
    request = pb.GenerateRequest(sampling=pb.SamplingParams(**sampling), priority=priority, request_id=request_id)
    if speculation is not None:
        request.speculation.CopyFrom(pb.Speculation(enabled=speculation, num_speculative_tokens=num_speculative_tokens))
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


# ---- command line --------------------------------------------------------------------------

def _define_flags(flags) -> None:
    # Defined only when run as a program, so importing the client registers no flags.
    flags.DEFINE_string("target", "127.0.0.1:50051", "Server host:port.")
    flags.DEFINE_string("prompt", None, "Prompt text to generate from.")
    flags.DEFINE_bool("chat", False, "Send --prompt as a user chat message.")
    flags.DEFINE_integer("max_tokens", 128, "Most tokens to generate.")
    flags.DEFINE_float("temperature", 0.7, "0 is greedy.")
    flags.DEFINE_float("top_p", 1.0, "Nucleus sampling mass, in (0, 1].")
    flags.DEFINE_integer("top_k", 0, "Keep the k most likely tokens; 0 disables.")
    flags.DEFINE_float("min_p", 0.0, "Drop tokens below min_p times the top probability.")
    flags.DEFINE_integer("seed", None, "Sampling seed.")
    flags.DEFINE_multi_string("stop", [], "A stop string (repeat for several).")
    flags.DEFINE_integer("logprobs", None, "Print each token's logprob and this many alternatives (0-20).")
    flags.DEFINE_integer("priority", 0, "Lower is served first.")
    flags.DEFINE_float("timeout_s", None, "Call deadline in seconds.")
    flags.DEFINE_bool("info", False, "Print the server's ModelInfo and health, and exit.")
    flags.DEFINE_string("tokenize", None, "Print the token ids of this text, and exit.")
    flags.DEFINE_string("score", None, "Print the per-token logprobs and log-likelihood of this text, and exit.")
    flags.DEFINE_string("auth_token_file", None, "File holding the server's shared token.")
    flags.DEFINE_string("tls_ca", None, "PEM CA certificate(s) of a TLS server.")


def _main(argv) -> int:
    from absl import flags

    FLAGS = flags.FLAGS
    if len(argv) > 1:
        print(f"error: unexpected arguments {argv[1:]}", file=sys.stderr)
        return 2
    token = None
    if FLAGS.auth_token_file:
        with open(FLAGS.auth_token_file) as f:
            token = f.read().strip()
    ca = None
    if FLAGS.tls_ca:
        with open(FLAGS.tls_ca, "rb") as f:
            ca = f.read()
    with Client(FLAGS.target, auth_token=token, root_certificates=ca) as client:
        try:
            if FLAGS.info:
                print(client.model_info(), end="")
                print(f"health: {client.health()}")
            elif FLAGS.tokenize is not None:
                print(client.tokenize(FLAGS.tokenize))
            elif FLAGS.score is not None:
                result = client.score([FLAGS.score])[0]
                for token_id, logprob in zip(result.token_ids[1:], result.token_logprobs):
                    print(f"{token_id}\t{logprob:.4f}\t{client.detokenize([token_id])!r}")
                print(f"log_likelihood {result.log_likelihood:.4f} over {len(result.token_logprobs)} tokens")
            elif FLAGS.prompt is not None:
                _generate(client, FLAGS)
            else:
                print("error: give --prompt, --info, --tokenize or --score", file=sys.stderr)
                return 2
        except grpc.RpcError as e:
            print(f"\nerror: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    return 0


def _generate(client: Client, FLAGS) -> None:
    prompt = [{"role": "user", "content": FLAGS.prompt}] if FLAGS.chat else FLAGS.prompt
    sampling = {"max_tokens": FLAGS.max_tokens, "temperature": FLAGS.temperature, "top_p": FLAGS.top_p,
                    "top_k": FLAGS.top_k, "min_p": FLAGS.min_p, "stop": FLAGS.stop, "logprobs": FLAGS.logprobs, "seed": FLAGS.seed}
    messages = []
    for msg in client.generate_stream(prompt, priority=FLAGS.priority, timeout=FLAGS.timeout_s,
                                      **{k: v for k, v in sampling.items() if v is not None}):
        messages.append(msg)
        print(msg.text, end="", flush=True)
    done = Completion.join(messages)
    print(f"\n[finish_reason={done.finish_reason} prompt_tokens={done.usage.prompt_tokens} "
          f"completion_tokens={done.usage.completion_tokens}]", file=sys.stderr)
    for token_id, lp in zip(done.token_ids, done.logprobs):
        alternatives = " ".join(f"{t.token_id}:{t.logprob:.3f}" for t in lp.top)
        print(f"{token_id}\t{lp.sampled.logprob:.4f}\t{alternatives}", file=sys.stderr)


if __name__ == "__main__":
    from absl import app, flags

    _define_flags(flags)
    app.run(_main)
