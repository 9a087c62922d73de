"""The batch job on a Ray cluster: the input's lines through a pool of engine actors (Ray Data).

  python -m engine.batch --runner=ray --input=... --output=... [--ray_actors=N]

The input (a local path or any URI pyarrow opens: s3://, gs://, hdfs://)
is read by one streaming Ray Data read task (`JsonlLines`): it numbers the
lines, drops those an earlier run already wrote (resume), and marks lines
that repeat an earlier line's id, as the single-process job's reader does.
Blocks of `--ray_batch_lines` lines go to an actor pool (`EngineActor`,
each owning one `engine.LLM` on `--ray_cpus_per_actor` cores or
`--ray_gpus_per_actor` GPUs); each actor runs a whole block through the
same `BatchJob` as `python -m engine.batch` (same parser, validation,
records, error records), continuously batched. The driver writes the records
in input order (Ray Data's `preserve_order`) as blocks come back, so the
output equals the single-process job's on the same input and flags.

When an actor dies, Ray restarts it and retries its block (Ray Data's
defaults for actor pools: `max_restarts=-1`, `max_task_retries=-1`); a
block's records reach the driver only from the run that finished it, so no
line is lost or written twice. A killed driver leaves its records in order,
and rerunning the same command resumes after them, as the local job does.
"""

from __future__ import annotations

import dataclasses
import fcntl
import io
import os
from typing import Iterator

import pyarrow as pa
import ray
from ray.data.datasource.file_based_datasource import FileBasedDatasource

from engine.batch.formats import decode, line_key
from engine.batch.io import Resume, iter_lines, record_text

# Per-line counters an actor sends back with each record (`engine.batch.job.Summary` fields).
STATS = ("lines_ok", "lines_failed", "prompt_tokens", "cached_tokens", "generated_tokens", "scored_tokens",
         "draft_tokens", "accepted_tokens")
_CORE_LOCKS = "/tmp/jax-spec-engine-ray-cores"


class JsonlLines(FileBasedDatasource):
    """One JSONL file as blocks of (line, text, duplicate) rows, in file order, streaming.

    `line` is the 1-based line number, `text` None for a line longer than
    `max_line_bytes` (read past, never held whole: `engine.batch.io.iter_lines`),
    `duplicate` true where the line's id was claimed by an earlier line. Lines
    that `resume` says were written are left out, and claim their ids, exactly
    as `BatchJob` skips them.
    """

    def __init__(self, path: str, max_line_bytes: int, lines_per_block: int, resume: Resume):
        super().__init__(path)
        self.max_line_bytes = max_line_bytes
        self.lines_per_block = lines_per_block
        self.resume = resume

    def _read_stream(self, f, path: str) -> Iterator[pa.Table]:
        claimed: set = set()
        rows: dict[str, list] = {"line": [], "text": [], "duplicate": []}
        for line, text, _ in iter_lines(io.BufferedReader(f), max_line_bytes=self.max_line_bytes):
            key = None if text is None else line_key(decode(text))[0]
            if line in self.resume.done_lines or (key is not None and key in self.resume.done_keys
                                                  and key not in claimed):
                claimed.add(key)
                continue
            rows["line"].append(line)
            rows["text"].append(text)
            rows["duplicate"].append(key is not None and key in claimed)
            claimed.add(key)
            if len(rows["line"]) == self.lines_per_block:
                yield pa.table(rows)
                rows = {k: [] for k in rows}
        if rows["line"]:
            yield pa.table(rows)


def _claim_cores(n: int) -> list[int] | None:
    """Pins this process to a free slice of `n` of its cores, held (by a file lock released when the process
    ends) against the other actors on this host; None (unpinned) when every slice is taken. Ray reserves CPU
    counts, not cores: without this, two actors' thread pools would each span every core."""
    cores = sorted(os.sched_getaffinity(0))
    os.makedirs(_CORE_LOCKS, exist_ok=True)
    for i in range(len(cores) // n):
        fd = os.open(os.path.join(_CORE_LOCKS, f"slice-{n}-{i}"), os.O_CREAT | os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        mine = cores[i * n:(i + 1) * n]
        os.sched_setaffinity(0, mine)
        return mine  # fd stays open: the lock lives as long as the process
    return None


class _BlockRecords:
    """The `BatchJob` writer of one block: each record with the summary counters it added (every counter
    update precedes its record's `put`)."""

    num_waiting = 0

    def __init__(self, summary):
        self.summary = summary
        self.records: dict[int, tuple[dict, dict]] = {}
        self._seen = {k: 0 for k in STATS}

    def put(self, seq: int, record: dict) -> None:
        now = {k: getattr(self.summary, k) for k in STATS}
        self.records[seq] = record, {k: now[k] - self._seen[k] for k in STATS}
        self._seen = now

    def close(self) -> None:
        pass


class EngineActor:
    """One engine in the pool: runs each block of lines to the end and returns their records in line order.

    Args:
      llm_kwargs: `engine.LLM` arguments (`engine.flags.llm_kwargs`).
      mode, max_inflight, score_stride, model_name, max_line_bytes: as `engine.batch.job.BatchJob`'s.
      cores: on a CPU host, the cores this actor pins itself to (`_claim_cores`); 0 leaves it unpinned.
      compilation_cache_dir: the `--compilation_cache_dir` flag's value ("default", a folder, or "" for none),
        so a restarted actor loads its programs instead of compiling them.
    """

    def __init__(self, llm_kwargs: dict, mode: str, max_inflight: int, score_stride: int | None, model_name: str,
                 max_line_bytes: int, cores: int, compilation_cache_dir: str):
        if cores:
            _claim_cores(cores)  # before jax starts: XLA sizes its thread pool from the affinity
        if compilation_cache_dir:
            from engine.compilation import use_persistent_cache

            use_persistent_cache(None if compilation_cache_dir == "default" else compilation_cache_dir)
        from engine import LLM

        self.llm = LLM(**llm_kwargs)
        self.job_args = (mode, max_inflight, score_stride, model_name, max_line_bytes)

    def __call__(self, batch: pa.Table) -> pa.Table:
        from engine.batch.job import BatchJob

        rows = batch.to_pylist()
        mode, max_inflight, score_stride, model_name, max_line_bytes = self.job_args
        job = BatchJob(self.llm, mode, None, max_inflight, score_stride, model_name, max_line_bytes)
        job.writer = writer = _BlockRecords(job.summary)
        job.duplicates = {r["line"] for r in rows if r["duplicate"]}
        try:
            job.run(iter([(r["line"], r["text"], 0) for r in rows]), Resume())
        except BaseException:
            job.abandon()
            raise
        out = [writer.records[seq] for seq in range(len(rows))]
        columns = {"line": [r["line"] for r in rows], "record": [record_text(rec) for rec, _ in out]}
        columns.update({k: [stats[k] for _, stats in out] for k in STATS})
        return pa.table(columns)


@dataclasses.dataclass
class RayOptions:
    """How the job runs on Ray (the `--ray_*` flags)."""

    actors: int = 1
    cpus_per_actor: float = 1.0
    gpus_per_actor: float = 0.0
    batch_lines: int = 256


def dataset(input_path: str, resume: Resume, options: RayOptions, llm_kwargs: dict, mode: str, max_inflight: int,
            score_stride: int | None, model_name: str, max_line_bytes: int,
            compilation_cache_dir: str) -> "ray.data.Dataset":
    """The job as a Ray Data pipeline: records (`line`, `record` JSON text and `STATS` columns) in input order.
    Call after `ray.init`."""
    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True
    # The read task reserves no CPU: it is light, and where the actors hold every CPU it would never start.
    lines = ray.data.read_datasource(JsonlLines(input_path, max_line_bytes, options.batch_lines, resume), num_cpus=0)
    cores = int(options.cpus_per_actor) if not options.gpus_per_actor and options.cpus_per_actor >= 1 else 0
    return lines.map_batches(
        EngineActor, batch_size=options.batch_lines, batch_format="pyarrow",
        compute=ray.data.ActorPoolStrategy(size=options.actors),
        fn_constructor_kwargs=dict(llm_kwargs=llm_kwargs, mode=mode, max_inflight=max_inflight,
                                   score_stride=score_stride, model_name=model_name, max_line_bytes=max_line_bytes,
                                   cores=cores, compilation_cache_dir=compilation_cache_dir),
        num_cpus=options.cpus_per_actor, num_gpus=options.gpus_per_actor or None)


def run(ds: "ray.data.Dataset", out, summary) -> None:
    """Writes every record of `ds` to the text stream `out`, in order, one flushed line each, adding its
    counters to `summary` (`engine.batch.job.Summary`)."""
    for batch in ds.iter_batches(batch_format="pyarrow", batch_size=None):
        cols = batch.to_pydict()
        for i, text in enumerate(cols["record"]):
            out.write(text)
            out.flush()
            for k in STATS:
                setattr(summary, k, getattr(summary, k) + cols[k][i])


def open_output(path: str, append: bool):
    """A text stream for the output: a local file (appended to when resuming) or any URI pyarrow writes."""
    if "://" not in path:
        return open(path, "a" if append else "w", encoding="utf-8")
    import pyarrow.fs

    fs, inner = pyarrow.fs.FileSystem.from_uri(path)
    return io.TextIOWrapper(fs.open_output_stream(inner), encoding="utf-8")


def input_exists(path: str) -> bool:
    if "://" not in path:
        return os.path.isfile(path)
    import pyarrow.fs

    fs, inner = pyarrow.fs.FileSystem.from_uri(path)
    return fs.get_file_info(inner).type == pyarrow.fs.FileType.File

