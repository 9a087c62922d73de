"""Files of the batch job: the streaming input reader, the crash-safe output writer, resume state, merging.

Crash safety rests on three rules: a record is one line written with one
`write` and flushed at once; on start the output is read back, a torn last
line (no newline, or not JSON) is cut off, and the lines it holds are
skipped; nothing else ever rewrites the file.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import BinaryIO, Iterator

from engine.batch.formats import decode, duplicate_id_message, error_record, line_key, record_key, record_line


def record_text(record: dict) -> str:
    """One output line: the record as JSON (UTF-8 kept as is) and its newline."""
    return json.dumps(record, ensure_ascii=False) + "\n"


@dataclasses.dataclass
class Resume:
    """What an earlier run of the job already wrote: ids of lines that ran, and line numbers of error records."""

    done_keys: set = dataclasses.field(default_factory=set)
    done_lines: set = dataclasses.field(default_factory=set)  # lines with error records: the file has errors
    num_records: int = 0
    torn_bytes: int = 0  # cut from the end of the file


def read_resume(path: str) -> Resume:
    """Scans an existing output file and cuts a torn last line off it; a missing file is an empty state.

    Raises ValueError if a line other than the last is not a JSON object
    (the file was not written by this job, or was edited).
    """
    state = Resume()
    if not os.path.exists(path):
        return state
    good_end = 0
    with open(path, "rb") as f:
        for n, raw in enumerate(f, start=1):
            try:
                record = json.loads(raw) if raw.endswith(b"\n") else None
            except ValueError:
                record = None
            if not isinstance(record, dict):
                if f.read(1):
                    raise ValueError(f"{path}, line {n}, is not a JSON record; rerun with --overwrite to start over")
                break
            good_end += len(raw)
            state.num_records += 1
            line = record_line(record)
            if line is not None:
                state.done_lines.add(line)
            else:
                state.done_keys.add(record_key(record))
    size = os.path.getsize(path)
    if size > good_end:
        state.torn_bytes = size - good_end
        with open(path, "r+b") as f:
            f.truncate(good_end)
    return state


def read_lines(path: str, num_shards: int = 1, shard_index: int = 0,
               max_line_bytes: int | None = None) -> Iterator[tuple[int, str | None, int]]:
    """Yields (1-based line number, text, bytes read so far) for this shard's non-blank lines, streaming.

    Shard `i` of `n` takes lines `i + 1, i + 1 + n, ...`. A line longer than
    `max_line_bytes` yields text None: it is read past in pieces, never held whole.
    """
    with open(path, "rb") as f:
        yield from iter_lines(f, num_shards, shard_index, max_line_bytes)


def iter_lines(f: BinaryIO, num_shards: int = 1, shard_index: int = 0,
               max_line_bytes: int | None = None) -> Iterator[tuple[int, str | None, int]]:
    """`read_lines` over an open binary file (any object with `readline(size)`)."""
    limit = -1 if max_line_bytes is None else max_line_bytes + 1
    offset, n = 0, 0
    while raw := f.readline(limit):
        n += 1
        offset += len(raw)
        too_long = len(raw) == limit and not raw.endswith(b"\n")
        while too_long and (rest := f.readline(1 << 20)):
            offset += len(rest)
            if rest.endswith(b"\n"):
                break
        if (n - 1) % num_shards != shard_index:
            continue
        if too_long:
            yield n, None, offset
            continue
        text = raw.decode("utf-8", errors="replace")
        if text.strip():
            yield n, text, offset


class OutputError(OSError):
    """Writing the output failed (a full disk, an I/O error); `written` records of this run are in it."""

    def __init__(self, path: str, error: OSError, written: int):
        super().__init__(error.errno, f"writing {path}: {error.strerror or error}")
        self.written = written


class Writer:
    """Appends records to the output as complete lines, in input order (a reorder buffer) or as they come.

    `put(seq, record)`: `seq` numbers this run's records 0, 1, 2, ... in
    input order. Ordered, a record waits until every earlier one is written.
    Every line is flushed when written; fsync runs at most once a second and on close.
    """

    def __init__(self, path: str, ordered: bool, overwrite: bool = False):
        self._f = open(path, "w" if overwrite else "a", encoding="utf-8")
        self.ordered = ordered
        self._pending: dict[int, dict] = {}
        self._next = 0
        self.written = 0
        self._synced = time.monotonic()

    @property
    def num_waiting(self) -> int:
        """Records held back for order."""
        return len(self._pending)

    def put(self, seq: int, record: dict) -> None:
        if not self.ordered:
            self._write(record)
            return
        self._pending[seq] = record
        while self._next in self._pending:
            self._write(self._pending.pop(self._next))
            self._next += 1

    def _write(self, record: dict) -> None:
        try:
            self._f.write(record_text(record))
            self._f.flush()
            if time.monotonic() - self._synced > 1.0:
                os.fsync(self._f.fileno())
                self._synced = time.monotonic()
        except OSError as e:
            raise OutputError(self._f.name, e, self.written) from None
        self.written += 1

    def close(self) -> None:
        """Flushes and closes; raises `OutputError` if the last records could not be written."""
        try:
            self._f.flush()
            os.fsync(self._f.fileno())
        except OSError as e:
            raise OutputError(self._f.name, e, self.written) from None
        finally:
            try:
                self._f.close()
            except OSError:
                pass  # the flush above said why


class Discard:
    """The writer of a process other than 0 in a job over several processes: process 0 writes every record."""

    num_waiting = 0

    def put(self, seq: int, record: dict) -> None:
        pass

    def close(self) -> None:
        pass


def merge_shards(input_path: str, shard_paths: list[str], output_path: str,
                 max_line_bytes: int | None = None) -> tuple[int, int]:
    """Joins shard outputs (written in order, the default) into one file in input order.

    Line `n` of the input belongs to shard `(n - 1) % len(shard_paths)`; each
    shard's next record must be that line's (same id, or an error record of
    that line number). An id that an earlier line of another shard has gets
    the duplicate-id error record a single run would have written.
    Returns (records written, lines that ran in their shard but failed here as duplicates).
    Raises ValueError naming the first shard and line that do not match
    (a shard not finished, run with --unordered, or of another input), and
    when the output is the input or a shard.
    """
    target = os.path.abspath(output_path)
    if target in {os.path.abspath(p) for p in [input_path, *shard_paths]}:
        raise ValueError("--output must not be the input or a shard")
    n_shards = len(shard_paths)
    shards = [open(p, encoding="utf-8") for p in shard_paths]
    written = duplicates = 0
    claimed = set()
    try:
        with open(output_path, "w", encoding="utf-8") as out:
            for line, text, _ in read_lines(input_path, max_line_bytes=max_line_bytes):
                shard = (line - 1) % n_shards
                raw = shards[shard].readline()
                if not raw.endswith("\n"):
                    raise ValueError(f"{shard_paths[shard]} ends before input line {line}: is the shard finished?")
                record = json.loads(raw)
                key, openai = (None, False) if text is None else line_key(decode(text))
                if record_line(record) != line and (record_line(record) is not None or record_key(record) != key):
                    raise ValueError(f"{shard_paths[shard]}: the record for input line {line} (id {key!r}) is not "
                                     "next; shards must be complete and written in order (not --unordered)")
                if key is not None and key in claimed:
                    duplicates += record_line(record) is None
                    raw = record_text(error_record(line, key, duplicate_id_message(key), openai))
                claimed.add(key)
                out.write(raw)
                written += 1
            for path, f in zip(shard_paths, shards):
                if f.readline():
                    raise ValueError(f"{path} has records past the input's end: is it a shard of this input?")
    finally:
        for f in shards:
            f.close()
    return written, duplicates
