"""The batch job on a Ray cluster: the input's lines through a pool of engine actors (Ray Data).

  python -m engine.batch --runner=ray --input=... --output=... [--ray_actors=N]

The input (a local path or any URI pyarrow opens: s3://, gs://, hdfs://)
is a Ray Data datasource (`JsonlLines`): one pass over it on the driver
numbers the lines, drops those an earlier run already wrote (resume), marks
lines that repeat an earlier line's id, as the single-process job does, and
cuts it into byte ranges of `--ray_batch_lines` lines, each read by a task
of its own. The blocks go to an actor pool (`EngineActor`,
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
import functools
import io
import os

import pyarrow as pa
import ray
from ray.data.block import BlockMetadata
from ray.data.datasource import Datasource, ReadTask

from engine.batch.formats import decode, line_key
from engine.batch.io import Resume, iter_lines, record_text

# Per-line counters an actor sends back with each record (`engine.batch.job.Summary` fields).
STATS = ("lines_ok", "lines_failed", "prompt_tokens", "cached_tokens", "generated_tokens", "scored_tokens",
         "draft_tokens", "accepted_tokens")
_CORE_LOCKS = "/tmp/jax-spec-engine-ray-cores"


@dataclasses.dataclass(frozen=True)
class _Chunk:
    """A byte range of the input holding one block's lines: `first_line` is the number of the line before it."""

    start: int
    end: int
    first_line: int
    num_rows: int
    skip: frozenset  # lines an earlier run wrote (resume)
    duplicates: frozenset  # lines whose id an earlier line claimed


class JsonlLines(Datasource):
    """One JSONL file as blocks of `lines_per_block` (line, text, duplicate) rows, one read task per block.

    `line` is the 1-based line number, `text` None for a line longer than
    `max_line_bytes` (read past, never held whole: `engine.batch.io.iter_lines`),
    `duplicate` true where the line's id was claimed by an earlier line. Lines
    that `resume` says were written are left out, and claim their ids, exactly
    as `BatchJob` skips them. Finding the blocks' byte ranges, duplicates and
    skips takes one sequential pass over the file here (ids are claimed in file
    order); the read tasks then read their ranges independently.
    """

    def __init__(self, path: str, max_line_bytes: int, lines_per_block: int, resume: Resume):
        super().__init__()
        self.path, self.max_line_bytes = path, max_line_bytes
        self.chunks: list[_Chunk] = []
        claimed: set = set()
        start = before = rows = 0
        skip, duplicates = set(), set()
        with _open_input(path) as f:
            for line, text, end in iter_lines(f, max_line_bytes=max_line_bytes):
                key = None if text is None else line_key(decode(text))[0]
                if line in resume.done_lines or (key is not None and key in resume.done_keys and key not in claimed):
                    skip.add(line)
                else:
                    rows += 1
                    if key is not None and key in claimed:
                        duplicates.add(line)
                claimed.add(key)
                if rows == lines_per_block:
                    self.chunks.append(_Chunk(start, end, before, rows, frozenset(skip), frozenset(duplicates)))
                    start, before, rows, skip, duplicates = end, line, 0, set(), set()
        if rows:
            self.chunks.append(_Chunk(start, end, before, rows, frozenset(skip), frozenset(duplicates)))

    def estimate_inmemory_data_size(self) -> int:
        return sum(c.end - c.start for c in self.chunks)

    def get_read_tasks(self, parallelism: int, per_task_row_limit=None, data_context=None) -> list[ReadTask]:
        return [ReadTask(functools.partial(self._read, c), BlockMetadata(c.num_rows, c.end - c.start, None, None,
                                                                         input_files=(self.path,)))
                for c in self.chunks]

    def _read(self, chunk: _Chunk) -> list[pa.Table]:
        rows: dict[str, list] = {"line": [], "text": [], "duplicate": []}
        with _open_input(self.path, chunk.start) as f:
            for n, text, _ in iter_lines(_Prefix(f, chunk.end - chunk.start), max_line_bytes=self.max_line_bytes):
                line = chunk.first_line + n
                if line in chunk.skip:
                    continue
                rows["line"].append(line)
                rows["text"].append(text)
                rows["duplicate"].append(line in chunk.duplicates)
        return [pa.table(rows, schema=_LINES)]


_LINES = pa.schema([("line", pa.int64()), ("text", pa.string()), ("duplicate", pa.bool_())])


class _Prefix(io.RawIOBase):
    """The first `n` bytes of a binary stream (a chunk's range)."""

    def __init__(self, f, n: int):
        self._f, self._left = f, n

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        data = self._f.read(min(len(b), self._left))
        b[:len(data)] = data
        self._left -= len(data)
        return len(data)


def _open_input(path: str, offset: int = 0):
    """A buffered binary reader of `path` (a local path or a URI pyarrow opens) from byte `offset`."""
    if "://" not in path:
        f = open(path, "rb")
        f.seek(offset)
        return f
    import pyarrow.fs

    fs, inner = pyarrow.fs.FileSystem.from_uri(path)
    raw = fs.open_input_file(inner)
    raw.seek(offset)
    return io.BufferedReader(raw)


def _claim_cores(n: int) -> list[int] | None:
    """Pins this process to a free slice of `n` of its cores, held (by a file lock released when the process
    ends) against the other actors on this host; None (unpinned) when every slice is taken or the lock folder
    cannot be used (another user's). Ray reserves CPU counts, not cores: without this, two actors' thread pools
    would each span every core."""
    cores = sorted(os.sched_getaffinity(0))
    for i in range(len(cores) // n):
        try:
            os.makedirs(_CORE_LOCKS, exist_ok=True)
            fd = os.open(os.path.join(_CORE_LOCKS, f"slice-{n}-{i}"), os.O_CREAT | os.O_RDWR, 0o666)
        except OSError:
            return None
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
    # One read task at a time, reserving no CPU: reading is light next to generating, each read task running at
    # once is a worker process to start, and where the actors hold every CPU a read task that asks for one never
    # starts.
    lines = ray.data.read_datasource(JsonlLines(input_path, max_line_bytes, options.batch_lines, resume), num_cpus=0,
                                     concurrency=1)
    cores = int(options.cpus_per_actor) if not options.gpus_per_actor and options.cpus_per_actor >= 1 else 0
    return lines.map_batches(
        EngineActor, batch_size=options.batch_lines, batch_format="pyarrow",
        # One block at a time per actor: an actor that starts first would otherwise queue blocks that an actor
        # still loading its model could run. With one block at a time there is nothing to overlap a call with, so
        # the engine steps on the actor's main thread, where it was built (not Ray Data's second thread).
        compute=ray.data.ActorPoolStrategy(size=options.actors, max_tasks_in_flight_per_actor=1,
                                           enable_true_multi_threading=True),
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
    """Whether `path` (a local path or a URI pyarrow opens) is a file."""
    if "://" not in path:
        return os.path.isfile(path)
    import pyarrow.fs

    fs, inner = pyarrow.fs.FileSystem.from_uri(path)
    return fs.get_file_info(inner).type == pyarrow.fs.FileType.File

