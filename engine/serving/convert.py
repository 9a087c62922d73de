"""gRPC messages to engine inputs and back, and the checks a request passes on the way in.

A request that fails a check raises `BadRequest` (or `InvalidRequestError` from the engine's own checks);
the server answers INVALID_ARGUMENT with the message, which names the field.
"""

from __future__ import annotations

import dataclasses

import jinja2
import numpy as np
from google.protobuf import message as protobuf_message
from google.protobuf import unknown_fields

from engine.inputs import encode_prompt
from engine.outputs import RequestOutput
from engine.serving.protos import generate_pb2 as pb
from scheduler.request import InvalidRequestError, SamplingParams


_FINISH_REASONS = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH, "abort": pb.FINISH_REASON_ABORT}


_OPTIONAL_SAMPLING = ("temperature", "top_k", "top_p", "min_p", "seed", "max_tokens", "logprobs")


class BadRequest(Exception):
    """A request that fails validation in the handler (INVALID_ARGUMENT)."""


@dataclasses.dataclass(frozen=True)
class Undecodable:
    """Stands in for a request message whose bytes did not parse, so the handler can refuse it clearly."""

    type_name: str
    error: str
    size: int

    def ByteSize(self) -> int:  # noqa: N802 -- the protobuf method name
        return self.size


def lenient_parser(message_type):
    """A request deserializer that returns `Undecodable` instead of raising (gRPC would answer UNKNOWN)."""

    def parse(data: bytes):
        try:
            return message_type.FromString(data)
        except protobuf_message.DecodeError as e:
            return Undecodable(message_type.DESCRIPTOR.name, str(e) or "malformed", len(data))

    return parse


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


def check_request(message) -> None:
    """Raises BadRequest for a message that did not parse (e.g. invalid UTF-8 in a string) or that
    carries fields this server's .proto does not define."""
    if isinstance(message, Undecodable):
        raise BadRequest(f"the request is not a valid {message.type_name} message ({message.error}); "
                          "string fields must be valid UTF-8")
    unknown = unknown_field_paths(message)
    if unknown:
        raise BadRequest(f"unknown fields {', '.join(unknown)}: the client's .proto is newer than this "
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


def checked_ids(token_ids, vocab_size: int) -> np.ndarray:
    """int64 `[N]` of a repeated int64 field; raises InvalidRequestError for an id outside [0, vocab_size)."""
    ids = np.array(token_ids, np.int64)
    bad = ids[(ids < 0) | (ids >= vocab_size)]
    if bad.size:
        raise InvalidRequestError(f"token ids must be in [0, {vocab_size}); got {bad[:5].tolist()}")
    return ids


def chat_messages(messages: pb.ChatMessages) -> list[dict]:
    if not messages.messages:
        raise BadRequest("chat has no messages")
    for i, m in enumerate(messages.messages):
        if not m.role:
            raise BadRequest(f"chat message {i} has an empty role")
    return [{"role": m.role, "content": m.content} for m in messages.messages]


def prompt_ids(tokenizer, message, oneof: str) -> list[int]:
    """Token ids of the text / token ids / chat set in `message`'s oneof `oneof`."""
    kind = message.WhichOneof(oneof)
    if kind is None:
        names = ", ".join(f.name for f in message.DESCRIPTOR.oneofs_by_name[oneof].fields)
        raise BadRequest(f"{oneof} is required: set one of {names}")
    if kind == "text":
        if not message.text:
            raise BadRequest(f"{oneof} is empty")
        return encode_prompt(tokenizer, message.text)
    if kind == "token_ids":
        return list(message.token_ids.ids)
    return encode_chat(tokenizer, message.chat)


def encode_chat(tokenizer, messages: pb.ChatMessages) -> list[int]:
    try:
        return encode_prompt(tokenizer, chat_messages(messages))
    except (ValueError, jinja2.TemplateError) as e:  # no chat template, or the template refused the messages
        raise BadRequest(f"chat: {e}") from None


def logprobs_of(out: RequestOutput, n: int) -> list[pb.Logprobs]:
    entries = out.logprobs[len(out.logprobs) - len(out.delta_token_ids):]
    return [pb.Logprobs(sampled=pb.TokenLogprob(token_id=t, logprob=entry[t]),
                        top=[pb.TokenLogprob(token_id=k, logprob=v) for k, v in list(entry.items())[:n]])
            for t, entry in zip(out.delta_token_ids, entries)]


def response_from_output(out: RequestOutput, request_id: str, num_logprobs: int | None) -> pb.GenerateResponse:
    """The streamed message for one engine output; the last one carries finish reason and usage."""
    msg = pb.GenerateResponse(request_id=request_id, text=out.delta_text, token_ids=out.delta_token_ids)
    if num_logprobs is not None:
        msg.logprobs.extend(logprobs_of(out, num_logprobs))
    if out.finished:
        msg.finish_reason = _FINISH_REASONS[out.finish_reason]
        msg.usage.CopyFrom(pb.Usage(prompt_tokens=len(out.prompt_token_ids), completion_tokens=len(out.token_ids),
                                    cached_prompt_tokens=out.num_cached_tokens, acceptance_rate=out.acceptance_rate))
    return msg
