"""Several hosts, one mesh: `jax.distributed` and the host scheduler's design across processes.

Design (multi-controller SPMD, as JAX runs every multi-host program): each
process runs the same command, builds the same engine, and runs the same host
scheduler over the same requests. The scheduler is deterministic (no clocks,
no thread races in what it packs), so every process packs the same batch at
every step and calls the same step program; XLA's collectives join the
devices, and each process reads the replicated sampled tokens back from its
own devices. Nothing but XLA's collectives crosses between processes: no RPC
of our own, and no broadcast of batches, which would put one host's
packing and a transfer on every step's critical path.

The one input that is not the same everywhere is time: speculation's cost
model prices proposals from measured step times. Each step's time is agreed
(the slowest process's, `agree_on_timing`) before the model sees it, and so
are the seeds of unseeded requests (`seed_source`). What the design relies on
is checked, not assumed: before each step every process compares a digest of
the packed batch with the others (`check_same_batch`, one small all-gather),
and a mismatch stops the step with an error instead of running collectives
over different programs.

Offline generation (`LLM.generate`, `python -m engine.generate`) runs this way,
with every process given the same prompts. The gRPC server and the batch job
take their inputs on process 0 alone (the port it listens on, the files it
reads and writes), so there process 0 leads: once per turn of its loop, before
the step, it broadcasts the inputs that arrived since the last turn (new and
aborted requests, Score calls, input lines admitted, a stop) with
`broadcast_object`, and the other processes apply the same inputs in the same
order and step with it. The scheduler then does the rest, as above. An idle
server broadcasts an empty turn every `HEARTBEAT_S` seconds so the followers'
collective never waits long enough to time out.
"""

from __future__ import annotations

import hashlib
import pickle
import random
import secrets
from typing import Callable

import jax
import numpy as np

HEARTBEAT_S = 5.0  # most seconds between broadcasts of an idle leader


def initialize(coordinator_address: str | None, num_processes: int, process_id: int,
               local_cpu_devices: int = 1) -> None:
    """Starts `jax.distributed` for process `process_id` of `num_processes`, before any jax computation.

    On CPU each process shows `local_cpu_devices` devices and the processes' collectives go over gloo
    (TCP). Raises ValueError for a missing coordinator or an id out of range.
    """
    if not coordinator_address:
        raise ValueError("several processes need --coordinator_address=host:port (process 0's)")
    if not 0 <= process_id < num_processes:
        raise ValueError(f"process_id must be in [0, {num_processes}), got {process_id}")
    jax.config.update("jax_num_cpu_devices", max(local_cpu_devices, jax.config.jax_num_cpu_devices))
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                               process_id=process_id)


def seed_source() -> Callable[[], int]:
    """Draws the 32-bit sampling seeds of requests that give none: unpredictable in one process; over
    several, from a generator whose seed process 0 draws and shares, so every process packs the same seeds."""
    if jax.process_count() == 1:
        return lambda: secrets.randbits(32)
    from jax.experimental import multihost_utils

    shared = multihost_utils.broadcast_one_to_all(np.array(secrets.randbits(31), np.int32))
    rng = random.Random(int(shared))
    return lambda: rng.getrandbits(32)


def is_leader() -> bool:
    """True on process 0 (and in one process): the one that owns the server's port or the batch job's files."""
    return jax.process_index() == 0


def broadcast_object(obj=None):
    """Process 0's `obj` on every process (the others' argument is ignored); `obj` itself in one process.

    Sent pickled (every process runs this same program, so nothing untrusted is
    unpickled) over XLA's collectives: its length, then its bytes padded to a
    power of two (at least 256), so the broadcast compiles once per size bucket.
    """
    if jax.process_count() == 1:
        return obj
    from jax.experimental import multihost_utils

    data = pickle.dumps(obj) if is_leader() else b""
    n = int(multihost_utils.broadcast_one_to_all(np.array(len(data), np.int32)))
    buf = np.zeros(max(256, 1 << (n - 1).bit_length()), np.uint8)
    buf[:len(data)] = np.frombuffer(data, np.uint8)
    buf = multihost_utils.broadcast_one_to_all(buf)
    return pickle.loads(np.asarray(buf, np.uint8)[:n].tobytes())


def agree_on_timing(seconds: float, compiled: bool) -> tuple[float, bool]:
    """A step's seconds and whether it compiled a program, made the same on every process (the slowest
    process's seconds; compiled on any): speculation's cost model prices proposals from them, and each
    process must take the same decisions. Unchanged in one process."""
    if jax.process_count() == 1:
        return seconds, compiled
    from jax.experimental import multihost_utils

    both = multihost_utils.process_allgather(np.array([seconds, float(compiled)]))
    return float(both[:, 0].max()), bool(both[:, 1].any())


def batch_digest(packed) -> np.ndarray:
    """uint32 `[4]`: a digest of every array of a packed batch (`scheduler.packing.PackedBatch`)."""
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(vars(packed)):
        value = getattr(packed, name)
        if isinstance(value, np.ndarray):
            h.update(name.encode())
            h.update(np.ascontiguousarray(value).tobytes())
        elif value is not None and hasattr(value, "__dict__"):  # the speculation arrays
            h.update(batch_digest(value).tobytes())
    return np.frombuffer(h.digest(), np.uint32).copy()


def check_same_batch(packed) -> None:
    """Raises RuntimeError unless every process packed the same batch (a no-op in one process)."""
    if jax.process_count() == 1:
        return
    from jax.experimental import multihost_utils

    digests = multihost_utils.process_allgather(batch_digest(packed))
    if not (digests == digests[0]).all():
        raise RuntimeError("the processes' schedulers packed different batches: they were given different "
                           "requests (every process must run the same command on the same inputs)")
