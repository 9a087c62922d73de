"""Line formats of the batch job: parsing input lines into jobs, and the output records.

Two input formats, told apart by `custom_id`:

- this engine's own: `id`, one of `prompt` / `messages` / `token_ids`, the
  `SamplingParams` fields by name, optional `priority` and `request_class`;
  in score mode `id` and one of `text` / `token_ids` / `context` +
  `continuation`;
- the OpenAI batch format (`custom_id`, `method` POST, `url`
  `/v1/chat/completions` or `/v1/completions`, `body`), as `vllm run-batch`
  reads it (https://platform.openai.com/docs/api-reference/batch/request-input),
  answered with the batch output records (`id`, `custom_id`, `response`
  with `status_code`, `request_id` and a chat.completion / completion
  `body` with `usage`, `error`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import time
from typing import TYPE_CHECKING, Any

from engine.outputs import RequestOutput
from scheduler.request import InvalidRequestError, SamplingParams

if TYPE_CHECKING:
    from engine.scoring import ScoreOutput

SAMPLING_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams))
_GENERATE_FIELDS = {"id", "prompt", "messages", "token_ids", "priority", "request_class", *SAMPLING_FIELDS}
_SCORE_FIELDS = {"id", "text", "token_ids", "context", "continuation"}
_OPENAI_FIELDS = {"custom_id", "method", "url", "body"}
_OPENAI_URLS = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}
# Body fields understood; top_k and min_p are the extensions vLLM also accepts.
_OPENAI_BODY = {
    "chat": {"model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p",
             "seed", "stop", "n", "logprobs", "top_logprobs", "stream", "user"},
    "completion": {"model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "n",
                   "logprobs", "stream", "user"},
}


class LineError(Exception):
    """A line that cannot run; becomes an error record. `key` is its id when one could be read."""

    def __init__(self, message: str, key: Any = None, openai: bool = False):
        super().__init__(message)
        self.key = key
        self.openai = openai


@dataclasses.dataclass
class Job:
    """One input line, parsed.

    kind: "generate" (prompt + sampling), "score" (a text's log-likelihood,
    scored in windows when longer than the context) or "pair" (a
    continuation's log-likelihood given a context).
    api: "engine", or "chat" / "completion" for OpenAI lines.
    """

    line: int
    key: Any
    kind: str
    api: str = "engine"
    prompt: Any = None  # text, token ids or chat messages (generate, score)
    sampling: SamplingParams | None = None
    priority: int = 0
    request_class: str = "default"
    context: str | None = None  # pair
    continuation: str | None = None
    top_logprobs: int | None = None  # OpenAI chat: logprobs were asked for with this many alternatives
    fill_context: bool = False  # OpenAI chat without max_tokens: generate up to the context limit

    @property
    def openai(self) -> bool:
        return self.api != "engine"


def decode(raw: str) -> Any:
    """The JSON value of a line, or the `LineError` that says why it has none (each line is decoded once)."""
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as e:  # RecursionError: nesting deeper than the parser goes
        return LineError(f"invalid JSON: {e}")


def line_key(obj: Any) -> tuple[Any, bool]:
    """(the id a decoded line names, whether it is an OpenAI line) without validating it; (None, False) if none."""
    if not isinstance(obj, dict):
        return None, False
    if "custom_id" in obj:
        return _hashable(obj["custom_id"]), True
    return _hashable(obj.get("id")), False


def _hashable(key: Any) -> Any:
    return key if isinstance(key, (str, int)) and not isinstance(key, bool) else None


def parse_line(obj: Any, line: int, mode: str) -> Job:
    """The job of one decoded input line (`decode`; 1-based `line`). Raises LineError naming the problem."""
    if isinstance(obj, LineError):
        raise obj
    if not isinstance(obj, dict):
        raise LineError(f"a line must be a JSON object, got {type(obj).__name__}")
    if "custom_id" in obj:
        return _parse_openai(obj, line, mode)
    key = obj.get("id")
    if _hashable(key) is None:
        raise LineError(f"'id' must be a string or an integer, got {key!r}")
    fields = _SCORE_FIELDS if mode == "score" else _GENERATE_FIELDS
    unknown = sorted(set(obj) - fields)
    if unknown:
        raise LineError(f"unknown fields {unknown} in {mode} mode", key)
    if mode == "score":
        return _parse_score(obj, line, key)
    given = [f for f in ("prompt", "messages", "token_ids") if f in obj]
    if len(given) != 1:
        raise LineError(f"a line needs exactly one of 'prompt', 'messages', 'token_ids', got {given}", key)
    sampling = {f: obj[f] for f in SAMPLING_FIELDS if f in obj}
    try:
        params = SamplingParams(**sampling)
        params.validate()
    except (InvalidRequestError, TypeError) as e:
        raise LineError(str(e), key) from None
    priority = obj.get("priority", 0)
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise LineError(f"priority must be an integer, got {priority!r}", key)
    request_class = obj.get("request_class", "default")
    if not isinstance(request_class, str):
        raise LineError(f"request_class must be a string, got {request_class!r}", key)
    return Job(line, key, "generate", prompt=obj[given[0]], sampling=params, priority=priority,
               request_class=request_class)


def _parse_score(obj: dict, line: int, key: Any) -> Job:
    given = [f for f in ("text", "token_ids", "context") if f in obj]
    if given == ["context"]:
        context, continuation = obj["context"], obj.get("continuation")
        if not isinstance(context, str) or not isinstance(continuation, str) or not context or not continuation:
            raise LineError("'context' and 'continuation' must be non-empty strings", key)
        return Job(line, key, "pair", context=context, continuation=continuation)
    if "continuation" in obj or len(given) != 1:
        raise LineError("a score line needs exactly one of 'text', 'token_ids', or 'context' with 'continuation'",
                        key)
    return Job(line, key, "score", prompt=obj[given[0]])


def _parse_openai(obj: dict, line: int, mode: str) -> Job:
    key = _hashable(obj["custom_id"])
    if key is None:
        raise LineError(f"'custom_id' must be a string or an integer, got {obj['custom_id']!r}", None, True)
    fail = lambda message: LineError(message, key, True)
    if mode != "generate":
        raise fail("OpenAI batch lines are generation requests; score mode takes this engine's format")
    unknown = sorted(set(obj) - _OPENAI_FIELDS)
    if unknown:
        raise fail(f"unknown fields {unknown}")
    if obj.get("method", "POST") != "POST":
        raise fail(f"method must be POST, got {obj.get('method')!r}")
    api = _OPENAI_URLS.get(obj.get("url"))
    if api is None:
        raise fail(f"url must be one of {sorted(_OPENAI_URLS)}, got {obj.get('url')!r}")
    body = obj.get("body")
    if not isinstance(body, dict):
        raise fail("'body' must be a JSON object")
    unknown = sorted(set(body) - _OPENAI_BODY[api])
    if unknown:
        raise fail(f"unknown body fields {unknown} for {obj['url']}")
    if body.get("stream"):
        raise fail("stream is not supported in a batch")
    prompt_field = "messages" if api == "chat" else "prompt"
    if prompt_field not in body:
        raise fail(f"body needs '{prompt_field}'")
    prompt = body[prompt_field]
    if api == "completion" and isinstance(prompt, list) and prompt and not all(isinstance(t, int) for t in prompt):
        raise fail("one prompt per line: 'prompt' must be a string or a list of token ids")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    sampling = {"temperature": body.get("temperature", 1.0), "top_p": body.get("top_p", 1.0),
                "top_k": body.get("top_k", 0), "min_p": body.get("min_p", 0.0), "seed": body.get("seed"),
                "stop": body.get("stop") or (), "n": body.get("n", 1)}
    if api == "completion" and max_tokens is None:
        max_tokens = 16  # the completions API's default; chat runs to the context limit
    if max_tokens is not None:
        sampling["max_tokens"] = max_tokens
    top_logprobs = None
    if api == "chat" and body.get("logprobs"):
        top_logprobs = body.get("top_logprobs") or 0
        sampling["logprobs"] = top_logprobs
    elif api == "completion" and body.get("logprobs") is not None:
        sampling["logprobs"] = body["logprobs"]
    if isinstance(sampling["stop"], str):
        sampling["stop"] = (sampling["stop"],)
    try:
        params = SamplingParams(**sampling)
        params.validate()
    except (InvalidRequestError, TypeError) as e:
        raise fail(str(e)) from None
    return Job(line, key, "generate", api=api, prompt=prompt, sampling=params, top_logprobs=top_logprobs,
               fill_context=max_tokens is None)


# ---- output records ------------------------------------------------------------------------


def duplicate_id_message(key: Any) -> str:
    return f"duplicate id {key!r} (an earlier line has it)"


def error_record(line: int, key: Any, message: str, openai: bool) -> dict:
    """The record of a line that failed: its line number, id and the reason."""
    if not openai:
        return {"id": key, "line": line, "error": message}
    return {"id": _batch_request_id(line, key), "custom_id": key,
            "response": {"status_code": 400, "request_id": _request_id(line, key),
                         "body": {"error": {"message": message, "type": "invalid_request_error"}}},
            "error": {"code": "invalid_request", "message": message, "line": line}}


def record_line(record: dict) -> int | None:
    """The input line an error record names; None for a record of a line that ran."""
    error = record.get("error")
    if isinstance(error, dict):
        return error.get("line")
    return record.get("line") if error is not None else None


def record_key(record: dict) -> Any:
    return _hashable(record.get("custom_id", record.get("id")))


def generate_record(job: Job, prompt_ids: list[int], outs: list[RequestOutput], model_name: str,
                    tokenizer) -> dict:
    """The record of a finished generation line (`outs`: one `RequestOutput` per sample, by index)."""
    if job.openai:
        return _openai_record(job, prompt_ids, outs, model_name, tokenizer)
    samples = [_sample(o) for o in outs]
    record = {"id": job.key}
    if len(outs) == 1:
        record.update(samples[0])
    else:
        record["outputs"] = [{"index": o.index, **s} for o, s in zip(outs, samples)]
    record.update(num_prompt_tokens=len(prompt_ids), num_generated_tokens=sum(len(o.token_ids) for o in outs),
                  num_cached_tokens=outs[0].num_cached_tokens)
    drafted = sum(o.num_draft_tokens for o in outs)
    if drafted:
        record.update(num_draft_tokens=drafted, num_accepted_tokens=sum(o.num_accepted_tokens for o in outs))
    return record


def _sample(out: RequestOutput) -> dict:
    sample = {"text": out.text, "token_ids": out.token_ids, "finish_reason": out.finish_reason}
    if out.logprobs is not None:
        # [token id, log-probability] pairs: the top alternatives (most likely first), the chosen token last.
        sample["logprobs"] = [[[t, lp] for t, lp in entry.items()] for entry in out.logprobs]
    return sample


def _openai_record(job: Job, prompt_ids: list[int], outs: list[RequestOutput], model_name: str, tokenizer) -> dict:
    completion = sum(len(o.token_ids) for o in outs)
    choices = []
    for o in outs:
        finish = "length" if o.finish_reason == "length" else "stop"
        choice = {"index": o.index}
        if job.api == "chat":
            choice["message"] = {"role": "assistant", "content": o.text}
            choice["logprobs"] = _chat_logprobs(o, job.top_logprobs, tokenizer) if o.logprobs is not None else None
        else:
            choice["text"] = o.text
            choice["logprobs"] = _completion_logprobs(o, tokenizer) if o.logprobs is not None else None
        choice["finish_reason"] = finish
        choices.append(choice)
    body = {"id": ("chatcmpl-" if job.api == "chat" else "cmpl-") + _request_id(job.line, job.key),
            "object": "chat.completion" if job.api == "chat" else "text_completion",
            "created": int(time.time()), "model": model_name, "choices": choices,
            "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": completion,
                      "total_tokens": len(prompt_ids) + completion}}
    return {"id": _batch_request_id(job.line, job.key), "custom_id": job.key,
            "response": {"status_code": 200, "request_id": _request_id(job.line, job.key), "body": body},
            "error": None}


def _chat_logprobs(out: RequestOutput, top: int, tokenizer) -> dict:
    content = []
    for token, entry in zip(out.token_ids, out.logprobs):
        piece = tokenizer.decode([token])
        alternatives = [(t, lp) for t, lp in entry.items()][:top]
        content.append({"token": piece, "logprob": _finite(entry[token]), "bytes": list(piece.encode()),
                        "top_logprobs": [{"token": tokenizer.decode([t]), "logprob": _finite(lp),
                                          "bytes": list(tokenizer.decode([t]).encode())} for t, lp in alternatives]})
    return {"content": content}


def _completion_logprobs(out: RequestOutput, tokenizer) -> dict:
    tokens, offsets, top, offset = [], [], [], 0
    for token, entry in zip(out.token_ids, out.logprobs):
        piece = tokenizer.decode([token])
        tokens.append(piece)
        offsets.append(offset)
        offset += len(piece)
        top.append({tokenizer.decode([t]): _finite(lp) for t, lp in entry.items()})
    return {"tokens": tokens, "token_logprobs": [_finite(e[t]) for t, e in zip(out.token_ids, out.logprobs)],
            "top_logprobs": top, "text_offset": offsets}


def _finite(x: float) -> float:
    return x if math.isfinite(x) else -9999.0  # JSON has no -inf; OpenAI clients read -9999 as impossible


def _request_id(line: int, key: Any) -> str:
    return hashlib.sha256(f"{line}\0{key}".encode()).hexdigest()[:24]


def _batch_request_id(line: int, key: Any) -> str:
    return "batch_req_" + _request_id(line, key)


def score_record(job: Job, out: ScoreOutput, num_context: int = 0) -> dict:
    """The record of a scored line.

    For a text: total log-likelihood (natural log) of every token after the
    first, per-token log-probabilities, the token count and perplexity
    `exp(-log_likelihood / scored tokens)`. For a context + continuation
    pair: the continuation's log-likelihood and `is_greedy` (greedy decoding
    from the context would produce exactly the continuation), as
    lm-evaluation-harness's `loglikelihood` requests need.
    """
    if job.kind == "pair":
        logprobs = out.token_logprobs[num_context - 1:]
        return {"id": job.key, "log_likelihood": math.fsum(logprobs),
                "is_greedy": all(out.token_is_greedy[num_context - 1:]),
                "num_context_tokens": num_context, "num_tokens": len(logprobs)}
    ll = math.fsum(out.token_logprobs)
    scored = len(out.token_logprobs)
    return {"id": job.key, "log_likelihood": ll, "token_logprobs": out.token_logprobs,
            "num_tokens": len(out.token_ids), "perplexity": math.exp(-ll / scored) if scored else None}
