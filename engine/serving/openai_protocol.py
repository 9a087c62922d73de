"""The OpenAI API's request bodies, response objects and errors, for `engine.serving.openai_api`.

Request bodies are pydantic models that refuse unknown fields; `validation_error` and `ApiError` turn a bad
request into OpenAI's error object (400, `param` naming the field). Source: the OpenAI API reference
(Completions, Chat Completions, the logprobs and usage objects, errors).
"""

from __future__ import annotations

import json
from typing import Any, Literal

import pydantic
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from engine.outputs import RequestOutput
from engine.serving.worker import EngineStoppedError
from scheduler.request import InvalidRequestError


class ApiError(Exception):
    """An error answered with OpenAI's error object: `status`, a message, and the field it is about."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.headers = status, message, param, kind, headers


def error_response(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
           headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": None}}, status,
                        headers=headers)


class SamplingBody(pydantic.BaseModel):
    """Fields both endpoints take. Unknown fields are refused (a typo would otherwise be silently ignored);
    OpenAI fields this engine does not implement are taken only at their no-op values."""

    model_config = pydantic.ConfigDict(extra="forbid")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: dict[str, bool] | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # The engine's extensions (vLLM's names).
    top_k: int | None = None
    min_p: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    priority: int = 0
    cache_salt: str | None = None
    num_speculative_tokens: int | None = None
    num_tree_nodes: int | None = None


class CompletionBody(SamplingBody):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False


class TokenizeBody(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeBody(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[int]


class _TextPart(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class _Message(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    role: str
    content: str | list[_TextPart]
    name: str | None = None


class ChatBody(SamplingBody):
    messages: list[_Message]
    logprobs: bool = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def usage(outputs, n: int) -> dict:
    """OpenAI's usage over the choices: the prompt counted once per prompt (every n-th choice)."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs[::n] if o is not None)
    completion = sum(len(o.token_ids) for o in outputs if o is not None)
    cached = sum(o.num_cached_tokens for o in outputs[::n] if o is not None)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def logprobs_object(out: RequestOutput, n: int, tokenizer, chat: bool, delta: bool = False) -> dict:
    """OpenAI's logprobs object of `out`'s tokens (its new ones with `delta`): chat's `content` list, or the
    completions arrays (tokens, token_logprobs, top_logprobs, text_offset)."""
    ids = out.delta_token_ids if delta else out.token_ids
    entries = out.logprobs[len(out.logprobs) - len(ids):] if ids else []
    text = [tokenizer.decode([t], skip_special_tokens=False) for t in ids]
    tops = [[(tokenizer.decode([k], skip_special_tokens=False), v) for k, v in list(e.items())[:n]] for e in entries]
    if chat:
        return {"content": [{"token": s, "logprob": e[t], "bytes": list(s.encode()),
                             "top_logprobs": [{"token": k, "logprob": v, "bytes": list(k.encode())} for k, v in top]}
                            for s, t, e, top in zip(text, ids, entries, tops)]}
    offsets, at = [], len(out.text) - len(out.delta_text) if delta else 0
    for s in text:
        offsets.append(at)
        at += len(s)
    return {"tokens": text, "token_logprobs": [e[t] for t, e in zip(ids, entries)],
            "top_logprobs": [dict(top) for top in tops], "text_offset": offsets}


def echoed_logprobs(scored, tokenizer, completion: dict | None) -> dict:
    """Completions' logprobs of an echoed prompt (`ScoreOutput`) followed by the completion's (`completion`,
    None when nothing was generated): the first prompt token has none; each other's `top_logprobs` holds the
    token and its position's argmax (one entry when they are the same token)."""
    texts = [tokenizer.decode([t], skip_special_tokens=False) for t in scored.token_ids]
    tops = [None]
    for t, lp, top_id, top_lp in zip(scored.token_ids[1:], scored.token_logprobs, scored.top_token_ids,
                                     scored.top_logprobs):
        entry = {tokenizer.decode([t], skip_special_tokens=False): lp}
        entry[tokenizer.decode([int(top_id)], skip_special_tokens=False)] = lp if top_id == t else top_lp
        tops.append(entry)
    offsets, at = [], 0
    for s in texts:
        offsets.append(at)
        at += len(s)
    out = {"tokens": texts, "token_logprobs": [None, *scored.token_logprobs], "top_logprobs": tops,
           "text_offset": offsets}
    if completion is not None:
        out["tokens"] += completion["tokens"]
        out["token_logprobs"] += completion["token_logprobs"]
        out["top_logprobs"] += completion["top_logprobs"]
        out["text_offset"] += [at + o for o in completion["text_offset"]]
    return out


def engine_error(e: Exception) -> ApiError:
    if isinstance(e, InvalidRequestError):
        return ApiError(400, str(e), field_named(str(e)))
    if isinstance(e, EngineStoppedError):
        return ApiError(503, "the server is shutting down", kind="server_error", headers={"Retry-After": "5"})
    return ApiError(500, str(e), kind="server_error")


def field_named(message: str) -> str | None:
    """The request field an engine error message starts with ("top_p must be ..." -> "top_p")."""
    first = message.split(" ", 1)[0].split("=", 1)[0].rstrip(":")
    return first if first in CompletionBody.model_fields or first in ChatBody.model_fields else None


def validation_error(e: RequestValidationError) -> JSONResponse:
    """pydantic's first error as OpenAI's error object, naming the field (`param`)."""
    err = e.errors()[0]
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    message = f"{param}: {err.get('msg')}" if param else str(err.get("msg"))
    if err.get("type") == "extra_forbidden":
        message = f"unknown field {param}: this server does not take it"
    return error_response(400, message, param)
