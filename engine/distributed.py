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
need their requests on every process and run on one host (their
--num_processes above 1 is refused; the batch job fans out over hosts by
shards instead: `--num_shards` / `--shard_index`).
"""

from __future__ import annotations

import hashlib
import random
import secrets
from typing import Callable

import jax
import numpy as np


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
