"""Offline batch jobs: generate for, or score, a JSONL file of requests.

  python -m engine.batch --input=requests.jsonl --output=results.jsonl [--mode=generate|score]

One output record per input line (formats: `engine.batch.formats`), in
input order unless --unordered. Rerunning the same command resumes: lines
already in the output are skipped, a torn last line is redone. A bad line
(one longer than --max_line_bytes included, refused unparsed) gets an error
record and the job goes on. SIGTERM or Ctrl-C stops admitting lines; the
lines in flight get --grace_s seconds, then are aborted and left, with the
rest, for a rerun. Exit codes: 0 every line ran; 1 the output holds error
records (this run's or a resumed run's); 2 bad flags, input or model; 74 the
output cannot be written (checked before the model loads: a directory, a
missing or read-only folder, no permission; or mid-run: a full disk, where
the records written stay and a rerun resumes); 143 stopped by a signal with
lines left for a rerun.
Sharding: run `--num_shards=N --shard_index=i` per machine, then
`--merge=out0.jsonl,out1.jsonl,... --input=... --output=...`. On one host,
`--data_parallel_size=N` does both: N worker processes, worker i on device
i (or the i-th slice of the CPU cores) writing `OUTPUT.shard-i-of-N`, then
the merge; the shard files stay, so a rerun resumes each worker (each
writes its own summary, `--summary_json` gets the same suffix).
Over several processes (`--num_processes`, one engine over every process's
devices; each runs this command with its own `--process_id`) process 0 reads
the input and writes the output and the others follow it
(`engine.distributed`); only process 0 needs the files.
Model, engine and speculation flags are `engine.flags`'.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time

from absl import app, flags, logging

from engine.flags import FLAGS, llm_from_flags

flags.DEFINE_string("input", None, "Input JSONL file.")
flags.DEFINE_string("output", None, "Output JSONL file (appended to on a rerun, unless --overwrite).")
flags.DEFINE_enum("mode", "generate", ["generate", "score"], "generate: one completion per line; score: "
                  "log-likelihoods of texts or of continuations given contexts.")
flags.DEFINE_integer("max_inflight", 256, "Most lines in the engine at once.")
flags.DEFINE_bool("unordered", False, "Write records as lines finish instead of in input order.")
flags.DEFINE_bool("overwrite", False, "Start over instead of resuming from the existing output.")
flags.DEFINE_integer("score_stride", None, "Score mode, texts longer than the context: new tokens per window "
                     "(the rest of the window is context). Default: half the context.")
flags.DEFINE_string("summary_json", None, "Also write the run's summary here as JSON.")
flags.DEFINE_integer("num_shards", 1, "Split the input into this many shards (line i goes to shard i mod n).")
flags.DEFINE_integer("shard_index", 0, "The shard this run takes, in [0, num_shards).")
flags.DEFINE_integer("data_parallel_size", 1, "Run this many shard workers on this host, one engine each on "
                     "its own device group (GPU i, or a slice of the CPU cores), then merge their outputs.")
flags.DEFINE_integer("max_line_bytes", 1 << 20, "Longest input line in bytes: a longer one gets an error record "
                     "without being parsed or tokenized.")
flags.DEFINE_enum("runner", "local", ["local", "ray"], "local: this process (or --data_parallel_size workers); "
                  "ray: an actor pool on the Ray cluster `ray.init()` finds (a local one when there is none), "
                  "one engine per actor (pip install -e '.[ray]'; docs/batch.md).")
flags.DEFINE_string("ray_address", None, "--runner=ray: the cluster to join (ray.init's address; default "
                    "$RAY_ADDRESS, else a running local cluster, else a new one).")
flags.DEFINE_integer("ray_actors", 1, "--runner=ray: engine actors (each holds one model).")
flags.DEFINE_float("ray_cpus_per_actor", 1.0, "--runner=ray: CPUs each actor reserves (on a CPU host, the cores "
                   "its kernels run on).")
flags.DEFINE_float("ray_gpus_per_actor", 0.0, "--runner=ray: GPUs each actor reserves.")
flags.DEFINE_integer("ray_batch_lines", 256, "--runner=ray: lines per block handed to an actor (it runs a block "
                     "to the end, continuously batched; a dead actor's block is retried whole).")
flags.DEFINE_list("merge", None, "Shard outputs, in shard order, to join into --output in --input order "
                  "(nothing is generated).")

# Offline jobs want throughput: at 64 sequences, requests of like lengths run in waves whose decode-only
# steps cost 2.5x a mixed step's per-token time (benchmarks/RESULTS.md, 2026-12-04).
FLAGS.set_default("max_num_seqs", 128)

EXIT_FAILED_LINES, EXIT_USAGE, EXIT_IO, EXIT_STOPPED = 1, 2, 74, 128 + signal.SIGTERM  # 74: sysexits' EX_IOERR


def _fail_usage(message: str, code: int = EXIT_USAGE) -> int:
    print(f"error: {message}", file=sys.stderr)
    return code


def _output_problem(path: str, resuming: bool) -> str | None:
    """Why the job could not write `path`, found before the model loads; None if it can."""
    if os.path.isdir(path):
        return f"--output {path} is a directory"
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        return f"--output {path}: no directory {folder}"
    if resuming and os.path.exists(path) and not os.path.isfile(path):
        return f"--output {path} is not a regular file, so it cannot be resumed from (--overwrite writes it anew)"
    try:
        with open(path, "ab"):  # creates it (empty) where it is missing
            pass
    except OSError as e:
        return f"--output {path} cannot be written: {e.strerror or e}"
    return None


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    logging.set_verbosity(logging.WARNING)
    if not FLAGS.input or not FLAGS.output:
        return _fail_usage("--input and --output are required")
    lead = FLAGS.process_id == 0  # the process that reads and writes the files
    if FLAGS.runner == "ray":
        return _ray()
    if lead and not os.path.exists(FLAGS.input):
        return _fail_usage(f"no input file {FLAGS.input}")
    from engine.batch.io import Discard, OutputError, Resume, Writer, read_lines, read_resume
    from engine.batch.job import BatchJob

    if os.path.abspath(FLAGS.input) == os.path.abspath(FLAGS.output):
        return _fail_usage("--output must not be the input file")
    if FLAGS.max_line_bytes < 1:
        return _fail_usage("--max_line_bytes must be >= 1")
    problem = _output_problem(FLAGS.output, resuming=not FLAGS.overwrite) if lead and not FLAGS.merge and \
        FLAGS.data_parallel_size == 1 else None
    if problem:
        return _fail_usage(problem, EXIT_IO)
    if FLAGS.num_processes > 1 and (FLAGS.merge or FLAGS.data_parallel_size != 1):
        return _fail_usage("--merge and --data_parallel_size run in one process (--num_processes spans one "
                           "engine over several)")
    if FLAGS.merge:
        if FLAGS.data_parallel_size != 1:
            return _fail_usage("--merge joins finished shards; --data_parallel_size runs them")
        return _merge(FLAGS.merge)
    if not 0 <= FLAGS.shard_index < FLAGS.num_shards:
        return _fail_usage(f"--shard_index must be in [0, {FLAGS.num_shards})")
    if FLAGS.max_inflight < 1:
        return _fail_usage("--max_inflight must be >= 1")
    if FLAGS.data_parallel_size != 1:
        return _data_parallel()
    try:
        resume = read_resume(FLAGS.output) if lead and not FLAGS.overwrite else None
    except ValueError as e:
        return _fail_usage(str(e))
    try:
        llm = llm_from_flags()
    except (ValueError, KeyError, FileNotFoundError) as e:
        return _fail_usage(str(e.args[0] if e.args else e))
    if resume is None:
        resume = Resume()
    elif resume.num_records:
        print(f"resuming: {resume.num_records} records in {FLAGS.output}"
              + (f" (cut a torn last line of {resume.torn_bytes} bytes)" if resume.torn_bytes else ""),
              file=sys.stderr)
    writer = Writer(FLAGS.output, ordered=not FLAGS.unordered, overwrite=FLAGS.overwrite) if lead else Discard()
    job = BatchJob(llm, FLAGS.mode, writer, FLAGS.max_inflight, FLAGS.score_stride, FLAGS.model,
                   FLAGS.max_line_bytes, FLAGS.grace_s)

    def stop(signum, frame):  # finish what is in flight; a second signal ends the process at once
        job.stopping = True
        signal.signal(signum, signal.SIG_DFL)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    from tqdm import tqdm

    progress = tqdm(total=os.path.getsize(FLAGS.input) if lead else 0, unit="B", unit_scale=True, desc="input",
                    disable=None if lead else True, file=sys.stderr)
    lines = read_lines(FLAGS.input, FLAGS.num_shards, FLAGS.shard_index, FLAGS.max_line_bytes) if lead else iter(())
    try:
        try:
            summary = job.run(lines, resume, progress)
        except BaseException:
            job.abandon()
            raise
        finally:
            progress.close()
            writer.close()
    except OutputError as e:
        safe = resume.num_records + e.written
        return _fail_usage(f"{e.strerror}; {safe} records are safe in it: make room and rerun the same command to "
                           "resume", EXIT_IO)
    if not lead:
        print(f"followed process 0: {summary.line()}", file=sys.stderr)
    else:
        print(summary.line(), file=sys.stderr)
    if FLAGS.summary_json and lead:
        with open(FLAGS.summary_json, "w") as f:
            json.dump(summary.as_dict(), f, indent=2)
    if summary.interrupted:
        return EXIT_STOPPED
    return EXIT_FAILED_LINES if summary.lines_failed or resume.done_lines else 0


def _ray() -> int:
    """Runs the job on a Ray cluster (`engine.batch.ray_runner`): same records, in input order; resumes a local
    output as the local job does."""
    if FLAGS.num_shards != 1 or FLAGS.data_parallel_size != 1 or FLAGS.merge or FLAGS.num_processes > 1 or \
            FLAGS.unordered:
        return _fail_usage("--runner=ray spreads the lines over its actors itself, in input order (no --num_shards, "
                           "--data_parallel_size, --merge, --num_processes or --unordered)")
    for name in ("ray_actors", "ray_batch_lines", "max_inflight", "max_line_bytes"):
        if FLAGS[name].value < 1:
            return _fail_usage(f"--{name} must be >= 1")
    if FLAGS.ray_cpus_per_actor < 0 or FLAGS.ray_gpus_per_actor < 0:
        return _fail_usage("--ray_cpus_per_actor and --ray_gpus_per_actor must be >= 0")
    try:
        import ray

        from engine.batch import ray_runner
    except ImportError as e:
        return _fail_usage(f"--runner=ray needs Ray Data ({e}): pip install -e '.[ray]'")
    from engine.batch.io import Resume, read_resume
    from engine.batch.job import Summary
    from engine.flags import llm_kwargs

    local_output = "://" not in FLAGS.output
    if "://" not in FLAGS.input and os.path.abspath(FLAGS.input) == os.path.abspath(FLAGS.output):
        return _fail_usage("--output must not be the input file")
    try:
        if not ray_runner.input_exists(FLAGS.input):
            return _fail_usage(f"no input file {FLAGS.input}")
    except (OSError, ValueError) as e:
        return _fail_usage(f"--input {FLAGS.input}: {e}")
    problem = _output_problem(FLAGS.output, resuming=not FLAGS.overwrite) if local_output else None
    if problem:
        return _fail_usage(problem, EXIT_IO)
    try:
        resume = read_resume(FLAGS.output) if local_output and not FLAGS.overwrite else Resume()
    except ValueError as e:
        return _fail_usage(str(e))
    if resume.num_records:
        print(f"resuming: {resume.num_records} records in {FLAGS.output}"
              + (f" (cut a torn last line of {resume.torn_bytes} bytes)" if resume.torn_bytes else ""),
              file=sys.stderr)
    options = ray_runner.RayOptions(FLAGS.ray_actors, FLAGS.ray_cpus_per_actor, FLAGS.ray_gpus_per_actor,
                                    FLAGS.ray_batch_lines)
    ray.init(address=FLAGS.ray_address, logging_level="warning", configure_logging=True)
    ds = ray_runner.dataset(FLAGS.input, resume, options, llm_kwargs(), FLAGS.mode, FLAGS.max_inflight,
                            FLAGS.score_stride, FLAGS.model, FLAGS.max_line_bytes, FLAGS.compilation_cache_dir)
    summary = Summary(lines_skipped=resume.num_records)

    def stop(signum, frame):  # the records written stay, in order; a rerun resumes after them
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    t0 = time.perf_counter()
    try:
        out = ray_runner.open_output(FLAGS.output, append=local_output and not FLAGS.overwrite)
    except OSError as e:
        return _fail_usage(f"--output {FLAGS.output} cannot be written: {e}", EXIT_IO)
    try:
        with out:
            ray_runner.run(ds, out, summary)
    except KeyboardInterrupt:
        summary.interrupted = True
    except OSError as e:
        return _fail_usage(f"writing {FLAGS.output}: {e}; the records written are safe in it: make room and rerun "
                           "the same command to resume", EXIT_IO)
    except ray.exceptions.RayError as e:  # an actor that cannot start (a bad model or limits): say why in one line
        raised = [line for line in str(e).splitlines() if re.match(r"\w+(Error|Exception): ", line)]
        return _fail_usage(f"the Ray job failed: {(raised or str(e).splitlines() or [type(e).__name__])[-1]}")
    summary.wall_s = time.perf_counter() - t0
    print(summary.line(), file=sys.stderr)
    if FLAGS.summary_json:
        with open(FLAGS.summary_json, "w") as f:
            json.dump(summary.as_dict(), f, indent=2)
    if summary.interrupted:
        return EXIT_STOPPED
    return EXIT_FAILED_LINES if summary.lines_failed or resume.done_lines else 0


def _merge(shards: list[str]) -> int:
    """Joins finished shard outputs into --output; 1 when ids repeated across shards became error records."""
    from engine.batch.io import merge_shards
    try:
        records, duplicates = merge_shards(FLAGS.input, shards, FLAGS.output, FLAGS.max_line_bytes)
    except (ValueError, OSError) as e:
        return _fail_usage(str(e))
    print(f"merged {records} records from {len(shards)} shards into {FLAGS.output}"
          + (f"; {duplicates} lines repeat an id of another shard's line: error records now" if duplicates else ""),
          file=sys.stderr)
    return EXIT_FAILED_LINES if duplicates else 0


# Flags a worker gets from the data-parallel parent instead of the user's.
_WORKER_OWN = ("data_parallel_size", "num_shards", "shard_index", "output", "summary_json", "unordered")


def _data_parallel() -> int:
    """Runs `--data_parallel_size` shard workers (this module, in child processes) and merges their outputs.

    Worker i sees device i (`CUDA_VISIBLE_DEVICES`, from the parent's list when set) and runs on the i-th
    contiguous slice of the parent's CPU cores. SIGTERM / Ctrl-C reach every worker, which finish what is in
    flight. Returns the first worker's exit code that is not 0 or 1 (no merge then), else the merge's, or 1
    when any line failed.
    """
    import ctypes
    import subprocess

    n = FLAGS.data_parallel_size
    if n < 1:
        return _fail_usage("--data_parallel_size must be >= 1")
    if FLAGS.num_shards != 1 or FLAGS.shard_index != 0 or FLAGS.unordered:
        return _fail_usage("--data_parallel_size shards the input itself (no --num_shards / --shard_index) and "
                           "merges in input order (no --unordered)")
    passed = [FLAGS[name].serialize() for name in FLAGS if FLAGS[name].present and name not in _WORKER_OWN]
    cpus = sorted(os.sched_getaffinity(0))
    gpus = os.environ.get("CUDA_VISIBLE_DEVICES")
    if gpus and len(gpus.split(",")) < n:
        return _fail_usage(f"--data_parallel_size {n} wants {n} devices; CUDA_VISIBLE_DEVICES lists "
                           f"{len(gpus.split(','))}")
    if not gpus and n > len(cpus):
        return _fail_usage(f"--data_parallel_size {n} is more than the {len(cpus)} CPU cores (and no "
                           "CUDA_VISIBLE_DEVICES lists devices)")
    gpus = gpus.split(",") if gpus else [str(i) for i in range(n)]
    libc = ctypes.CDLL(None, use_errno=True)

    def start_worker(cores):  # in the child: its cores, and SIGTERM when the parent dies (even by SIGKILL)
        os.sched_setaffinity(0, cores)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    shards = [f"{FLAGS.output}.shard-{i}-of-{n}" for i in range(n)]
    workers = []
    for i, shard in enumerate(shards):
        mine = cpus[i * len(cpus) // n:(i + 1) * len(cpus) // n]
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=gpus[i])
        cmd = [sys.executable, "-m", "engine.batch", *passed, f"--num_shards={n}", f"--shard_index={i}",
               f"--output={shard}"] + ([f"--summary_json={FLAGS.summary_json}.shard-{i}-of-{n}"]
                                       if FLAGS.summary_json else [])
        workers.append(subprocess.Popen(cmd, env=env, preexec_fn=lambda cores=mine: start_worker(cores)))

    def forward(signum, frame):
        for w in workers:
            w.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    codes = [w.wait() for w in workers]
    for code in codes:
        if code not in (0, EXIT_FAILED_LINES):
            code = 128 - code if code < 0 else code  # killed by a signal: the shell's convention
            print(f"a worker exited {code}" + ("" if code == EXIT_USAGE else "; rerun the same command to resume"),
                  file=sys.stderr)
            return code
    merged = _merge(shards)
    return merged if merged != 0 else (EXIT_FAILED_LINES if EXIT_FAILED_LINES in codes else 0)


if __name__ == "__main__":
    app.run(main)
