"""The batch job's loop: input lines into one engine, continuously batched, records out as lines finish.

At most `max_inflight` lines are in the engine at once (generation
requests, and sequences being scored chunk by chunk between decode steps);
the input is read only as fast as lines are admitted, so memory does not
grow with the file.

Over several processes (`engine.distributed`) process 0 reads the input and
the resume state and writes the output; each turn of the loop it broadcasts
the lines it admitted and whether it is stopping, and the other processes
admit the same lines and step in lockstep, writing nothing.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from typing import Any, Iterator

import jax
import jinja2

from engine.batch.formats import (Job, LineError, decode, duplicate_id_message, error_record, generate_record,
                                  line_key, parse_line, score_record)
from engine.batch.io import Resume, Writer
from engine.distributed import broadcast_object, is_leader
from engine.inputs import check_token_ids, encode_prompt
from engine.outputs import RequestOutput
from engine.scoring import ScoreOutput
from scheduler.block_manager import NoFreeBlocksError
from scheduler.request import InvalidRequestError


@dataclasses.dataclass
class Summary:
    """Totals of one run (lines resumed from an earlier run count as skipped only)."""

    lines_ok: int = 0
    lines_failed: int = 0
    lines_skipped: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    scored_tokens: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    wall_s: float = 0.0
    interrupted: bool = False

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["generated_tokens_per_s"] = self.generated_tokens / self.wall_s if self.wall_s else 0.0
        d["tokens_per_s"] = (self.prompt_tokens + self.generated_tokens + self.scored_tokens) / self.wall_s \
            if self.wall_s else 0.0
        d["prefix_cache_hit_rate"] = self.cached_tokens / self.prompt_tokens if self.prompt_tokens else None
        d["acceptance_rate"] = self.accepted_tokens / self.draft_tokens if self.draft_tokens else None
        return d

    def line(self) -> str:
        d = self.as_dict()
        parts = [f"lines ok {self.lines_ok}", f"failed {self.lines_failed}", f"skipped {self.lines_skipped}",
                 f"prompt tokens {self.prompt_tokens}", f"generated {self.generated_tokens}"]
        if self.scored_tokens:
            parts.append(f"scored {self.scored_tokens}")
        parts += [f"{self.wall_s:.1f} s", f"{d['tokens_per_s']:.1f} tok/s"]
        if d["prefix_cache_hit_rate"] is not None:
            parts.append(f"prefix cache hits {d['prefix_cache_hit_rate']:.1%}")
        if d["acceptance_rate"] is not None:
            parts.append(f"acceptance rate {d['acceptance_rate']:.2f}")
        return ", ".join(parts) + (" (interrupted: rerun to finish)" if self.interrupted else "")


@dataclasses.dataclass(eq=False)
class _Generation:
    seq: int
    job: Job
    prompt_ids: list[int]
    outs: list[RequestOutput | None]


@dataclasses.dataclass(eq=False)
class _Scoring:
    """A line scored window by window: `windows` are (token ids, how many of its last log-probs to keep)."""

    seq: int
    job: Job
    token_ids: list[int]
    windows: deque
    num_context: int = 0
    logprobs: list = dataclasses.field(default_factory=list)
    greedy: list = dataclasses.field(default_factory=list)
    current: Any = None  # the engine's ScoreJob of the window being scored
    keep: int = 0


def rolling_windows(n: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """(start, end, keep) windows scoring each of `n` tokens' positions 1..n-1 exactly once.

    The first window scores tokens 1..window-1; each later one scores the
    next `stride` tokens with the `window - stride` tokens before them as
    context (lm-evaluation-harness's `loglikelihood_rolling`, with a stride).
    `keep` is how many of the window's last log-probabilities are new.
    """
    if n <= window:
        return [(0, n, n - 1)]
    windows = [(0, window, window - 1)]
    scored = window  # tokens 0..scored-1 done (token 0 has no log-prob)
    while scored < n:
        end = min(scored + stride, n)
        windows.append((end - window, end, end - scored))
        scored = end
    return windows


class BatchJob:
    """Runs a file's lines through `llm.engine` and writes one record per line.

    Args:
      llm: an `engine.LLM`.
      mode: "generate" or "score".
      writer: where records go (`engine.batch.io.Writer`).
      max_inflight: most lines in the engine at once.
      score_stride: new tokens per window when a text is longer than the context.
      model_name: the `model` field of OpenAI records.
      max_line_bytes: the input's line-size limit (named in the error record of a longer line).
      grace_s: once `stopping` is set, seconds the lines in flight get before they are aborted (and left,
        unwritten, for a rerun).
    """

    def __init__(self, llm, mode: str, writer: Writer, max_inflight: int, score_stride: int | None,
                 model_name: str, max_line_bytes: int | None = None, grace_s: float = float("inf")):
        self.engine = llm.engine
        self.tokenizer = llm.tokenizer
        self.mode = mode
        self.writer = writer
        self.max_inflight = max_inflight
        window = self.engine.max_model_len
        self.score_window = window
        self.score_stride = min(score_stride or window // 2, window - 1)
        self.model_name = model_name
        self.max_line_bytes = max_line_bytes
        self.grace_s = grace_s
        self.summary = Summary()
        self.stopping = False  # set by a signal handler: admit nothing more, finish what is in flight
        self._generating: dict[str, _Generation] = {}
        self._scoring: deque[_Scoring] = deque()
        self._claimed: set = set()
        self.duplicates: set[int] = set()  # lines known to repeat an id of a line another process admitted
        self._seq = 0

    # ---- admission -----------------------------------------------------------------------

    def _room(self) -> bool:
        in_flight = len(self._generating) + len(self._scoring)
        return in_flight < self.max_inflight and self.writer.num_waiting < 8 * self.max_inflight

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq - 1

    def _fail(self, seq: int, line: int, key: Any, message: str, openai: bool) -> None:
        self.summary.lines_failed += 1
        self.writer.put(seq, error_record(line, key, message, openai))

    def _admit(self, line: int, text: str | None, resume: Resume) -> None:
        if text is None:  # past the line-size limit (`read_lines`): refused unparsed
            if line in resume.done_lines:
                self.summary.lines_skipped += 1
            else:
                self._fail(self._next_seq(), line, None, f"the line is longer than {self.max_line_bytes} bytes "
                           "(--max_line_bytes); it was not parsed", False)
            return
        obj = decode(text)
        key, openai = line_key(obj)
        if line in resume.done_lines or (key is not None and key in resume.done_keys and key not in self._claimed):
            self._claimed.add(key)
            self.summary.lines_skipped += 1
            return
        seq = self._next_seq()
        if line in self.duplicates or (key is not None and key in self._claimed):
            self._fail(seq, line, key, duplicate_id_message(key), openai)
            return
        self._claimed.add(key)
        try:
            job = parse_line(obj, line, self.mode)
            if job.kind == "generate":
                self._start_generation(seq, job)
            else:
                self._start_scoring(seq, job)
        except LineError as e:
            self._fail(seq, line, e.key, str(e), e.openai)
        except (InvalidRequestError, ValueError, jinja2.TemplateError) as e:  # chat template, engine limits
            self._fail(seq, line, key, str(e.args[0] if e.args else e), openai)

    def _start_generation(self, seq: int, job: Job) -> None:
        ids = encode_prompt(self.tokenizer, job.prompt)
        sampling = job.sampling
        if job.api == "chat" and job.fill_context and len(ids) < self.engine.max_model_len:
            sampling = dataclasses.replace(sampling, max_tokens=self.engine.max_model_len - len(ids))
        request = self.engine.add_request(ids, sampling, request_id=f"line-{job.line}", priority=job.priority,
                                          request_class=job.request_class)
        self._generating[request.request_id] = _Generation(seq, job, ids, [None] * sampling.n)

    def _start_scoring(self, seq: int, job: Job) -> None:
        num_context = 0
        if job.kind == "pair":
            context, continuation = job.context, job.continuation
            spaces = len(context) - len(context.rstrip())
            if spaces:  # lm-evaluation-harness moves trailing whitespace to the continuation
                context, continuation = context[:-spaces], context[-spaces:] + continuation
            whole = self.tokenizer.encode(context + continuation)
            num_context = len(self.tokenizer.encode(context))
            if num_context == 0 or num_context >= len(whole):
                raise LineError("context and continuation must each give at least one token", job.key)
            cut = max(0, len(whole) - self.score_window)  # drop the context's start, as the harness does
            if cut >= num_context:
                raise LineError(f"continuation has {len(whole) - num_context} tokens; the context limit is "
                                f"{self.score_window}", job.key)
            ids, num_context = whole[cut:], num_context - cut
            windows = [(0, len(ids), len(ids) - 1)]
        else:
            ids = encode_prompt(self.tokenizer, job.prompt)
            if len(ids) < 2:
                raise LineError(f"a text to score needs at least 2 tokens, got {len(ids)}", job.key)
            windows = rolling_windows(len(ids), self.score_window, self.score_stride)
        check_token_ids(ids, self.engine.model_config.vocab_size, "token ids")
        self._scoring.append(_Scoring(seq, job, ids, deque(windows), num_context))

    # ---- the loop ------------------------------------------------------------------------

    def run(self, lines: Iterator[tuple[int, str, int]], resume: Resume, progress=None) -> Summary:
        """Runs every line; returns the totals. Stops admitting when `stopping` is set.

        Over several processes only process 0's `lines`, `resume` and `stopping` count (the others'
        are ignored).
        """
        t0 = time.perf_counter()
        shared, lead = jax.process_count() > 1, is_leader()
        resume = broadcast_object(resume)
        source = iter(lines)
        exhausted = given_up = False
        offset = 0
        stop_at = None
        while True:
            stopping = self.stopping  # once per turn: what the followers are told is what this process does
            if stopping and stop_at is None:
                stop_at = time.monotonic() + self.grace_s
            give_up = stopping and time.monotonic() >= stop_at and bool(self._generating or self._scoring)
            if lead:
                admitted = []
                while not exhausted and not stopping and self._room():
                    item = next(source, None)
                    if item is None:
                        exhausted = True
                        break
                    line, text, end = item
                    self._admit(line, text, resume)
                    admitted.append((line, text))
                    if progress is not None:
                        progress.update(end - offset)
                    offset = end
                if shared:
                    broadcast_object((admitted, exhausted, stopping, give_up))
            else:
                admitted, exhausted, stopping, give_up = broadcast_object()
                for line, text in admitted:
                    self._admit(line, text, resume)
            if give_up:  # the grace is over: what is in flight is aborted, unwritten, for a rerun
                self.abandon()
                given_up = True
                break
            worked = False
            if self._scoring:
                worked = self._score_step()
            if self.engine.has_unfinished():
                self._collect(self.engine.step())
                worked = True
            if not worked and not self._scoring and not self._generating and (exhausted or stopping):
                break
            if progress is not None:
                progress.set_postfix(ok=self.summary.lines_ok, failed=self.summary.lines_failed,
                                     tok_s=f"{self.summary.generated_tokens / (time.perf_counter() - t0):.0f}",
                                     refresh=False)
        self.summary.wall_s = time.perf_counter() - t0
        self.summary.interrupted = stopping and (given_up or not exhausted)
        return self.summary

    def _collect(self, outs: list[RequestOutput]) -> None:
        for out in outs:
            gen = self._generating.get(out.request_id)
            if gen is None or not out.finished:
                continue
            gen.outs[out.index] = out
            if any(o is None for o in gen.outs):
                continue
            del self._generating[out.request_id]
            if any(o.finish_reason == "abort" for o in gen.outs):
                self._fail(gen.seq, gen.job.line, gen.job.key, "the engine aborted the request", gen.job.openai)
                continue
            s = self.summary
            s.lines_ok += 1
            s.prompt_tokens += len(gen.prompt_ids)
            s.cached_tokens += gen.outs[0].num_cached_tokens
            s.generated_tokens += sum(len(o.token_ids) for o in gen.outs)
            s.draft_tokens += sum(o.num_draft_tokens for o in gen.outs)
            s.accepted_tokens += sum(o.num_accepted_tokens for o in gen.outs)
            self.writer.put(gen.seq, generate_record(gen.job, gen.prompt_ids, gen.outs, self.model_name,
                                                     self.tokenizer))

    def _score_step(self) -> bool:
        """Scores the next chunks of the oldest scoring lines, packed into one step; False if no KV blocks
        are free for any of them right now."""
        active = []
        for task in list(self._scoring)[:self.engine.config.max_num_seqs]:
            if task.current is None:
                start, end, keep = task.windows[0]
                try:
                    task.current = self.engine.start_score(task.token_ids[start:end])
                except NoFreeBlocksError:
                    break
                task.windows.popleft()
                task.keep = keep
            active.append(task)
        if not active:
            if self.engine.has_unfinished():
                return False  # decode steps free blocks as requests finish
            task = self._scoring.popleft()
            self._fail(task.seq, task.job.line, task.job.key, "too few free KV blocks to score this text", False)
            return True
        for task, done in zip(active, self.engine.score_chunks([t.current for t in active])):
            if done:
                self._end_window(task)
        return True

    def _end_window(self, task: _Scoring) -> None:
        window = task.current.output()
        self.engine.end_score(task.current)
        task.current = None
        task.logprobs += window.token_logprobs[len(window.token_logprobs) - task.keep:]
        task.greedy += window.token_is_greedy[len(window.token_is_greedy) - task.keep:]
        if task.windows:
            return
        self._scoring.remove(task)
        self.summary.lines_ok += 1
        self.summary.scored_tokens += len(task.logprobs)
        out = ScoreOutput(task.token_ids, task.logprobs, task.greedy)
        self.writer.put(task.seq, score_record(task.job, out, task.num_context))

    def abandon(self) -> None:
        """Frees what is in flight (after an error, or when the grace after a stop is over): nothing more is
        written for it."""
        for request_id in list(self._generating):
            self.engine.abort(request_id)
        for task in self._scoring:
            if task.current is not None:
                self.engine.end_score(task.current)
        self._generating.clear()
        self._scoring.clear()
