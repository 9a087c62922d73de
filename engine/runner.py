"""The model runner: the engine's device side.

It owns what lives on the device (the target's graph and weights, the KV
pools, the compiled step programs) and the set of shapes they are compiled
for. The engine loop hands it a `StepPlan` from the scheduler; the runner
packs it into a padded bucket, runs the one step program, and makes the
step's one device-to-host read. It never sees a request's bookkeeping beyond
what `pack` reads (tokens, block ids, sampling settings).

With a draft model (`engine.spec.draft.DraftModelProposer`), the draft's KV
pool sits beside the target's in `pools`: the same block tables index both,
so a block operation (copy-on-write, swap) applies to every pool at once; an
EAGLE head's KV pool and the target's features (`FeaturePool`) sit there the
same way (`Proposer.pools`). A host proposer (`engine.spec.ngram.NgramProposer`) has no pool; its
steps run the target and the verify alone.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable

import jax
import numpy as np

import cpu_kernels

from engine.compilation import MAPS_PER_PROGRAM, maps_left, memory_maps
from engine.config import EngineConfig
from engine.distributed import check_same_batch
from engine.spec.proposer import NoProposer, Proposer
from engine.programs import Programs
from engine.scoring import make_score_step
from engine.spec.programs import SpecBatch
from engine.step import (KVPool, cpu_paged_attention, Sampled, StepBatch, build_model, copy_blocks, gather_blocks,
                         make_step, replicate, scatter_blocks, tensor_parallel_mesh, to_device)
from pallas_kernels.reference import ragged_paged_attention_reference
from scheduler.packing import PackedBatch, bucket_for, pack, power_of_two_buckets, step_buckets
from scheduler.request import Request, SamplingParams
from scheduler.scheduler import ScheduledSeq, StepPlan

log = logging.getLogger(__name__)

PHASES = ("propose", "schedule", "block_ops", "pack", "to_device", "device", "update")


@dataclasses.dataclass
class StepTiming:
    """One engine step: the program it ran and its wall seconds by phase.

    `device` runs from dispatching the step program to its outputs being on
    the host (the XLA computation plus the read back); every other phase is
    host work. `propose` is the proposer's host work (the cost gate, a host
    proposer's lookups and proposals; a device proposer's draft passes run in
    `device`, inside the step program). `update` appends tokens, detokenizes
    and builds the outputs.
    """

    num_tokens: int = 0  # token bucket T (0: nothing ran)
    num_seqs: int = 0  # sequence bucket S
    spec_k: int | None = None  # None: target only; 0: the draft keeps its KV; G: draft + verify
    propose: float = 0.0
    schedule: float = 0.0
    block_ops: float = 0.0
    pack: float = 0.0
    to_device: float = 0.0
    device: float = 0.0
    update: float = 0.0

    @property
    def total(self) -> float:
        return sum(getattr(self, p) for p in PHASES)


@dataclasses.dataclass
class EngineStats:
    """Totals over an engine's life: steps that ran a program, draft tokens, seconds per phase.

    A verify is one row of one step that checked at least one draft token;
    `drafted_at[i]` / `accepted_at[i]` count the verifies that proposed /
    accepted a draft token at window position i (0-based).
    """

    num_steps: int = 0
    num_draft_tokens: int = 0  # proposed, all requests
    num_accepted_tokens: int = 0
    num_verifies: int = 0
    drafted_at: list[int] = dataclasses.field(default_factory=list)
    accepted_at: list[int] = dataclasses.field(default_factory=list)
    seconds: dict[str, float] = dataclasses.field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))

    def add(self, timing: StepTiming) -> None:
        for p in PHASES:
            self.seconds[p] += getattr(timing, p)

    def add_verify(self, num_draft: int, num_accepted: int) -> None:
        """One row's verify: `num_draft` proposed positions (a chain's tokens, a token tree's depth), the first
        `num_accepted` of them accepted."""
        grow = num_draft - len(self.drafted_at)
        if grow > 0:
            self.drafted_at += [0] * grow
            self.accepted_at += [0] * grow
        for i in range(num_draft):
            self.drafted_at[i] += 1
            self.accepted_at[i] += i < num_accepted
        self.num_verifies += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted / proposed draft tokens (None before any proposal)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def acceptance_length(self) -> float | None:
        """Mean tokens a verify emits: accepted draft tokens plus the correction or bonus token."""
        return 1 + self.num_accepted_tokens / self.num_verifies if self.num_verifies else None

    @property
    def position_acceptance(self) -> list[float]:
        """Per window position i: the fraction of verifies proposing a token there that accepted it."""
        return [a / d for a, d in zip(self.accepted_at, self.drafted_at)]

    @property
    def draft_share(self) -> float | None:
        """The proposer's host seconds (`StepTiming.propose`) over all step seconds (None before a step).
        A device proposer's draft passes run inside the step program, so they count as `device` time; their
        cost shows as the verify step's extra cost over a plain one (`benchmarks/speculative.py`, column c)."""
        total = sum(self.seconds.values())
        return self.seconds["propose"] / total if total else None

    @property
    def device_seconds(self) -> float:
        return self.seconds["device"]

    @property
    def host_seconds(self) -> float:
        return sum(self.seconds.values()) - self.seconds["device"]


@dataclasses.dataclass
class InFlight:
    """A dispatched step whose outputs are still on the device (`ModelRunner.dispatch`, `collect`)."""

    sampled: Sampled
    num_emitted: jax.Array | None
    path_rank: jax.Array | None
    num_tokens: int  # token bucket T
    num_seqs: int  # sequence bucket S
    want_logprobs: bool


@dataclasses.dataclass
class StepOutput:
    """A step's results on the host.

    tokens: int32 `[S, G+1]`, row `s` emits `tokens[s, :num_emitted[s]]`.
    num_emitted: int32 `[S]`.
    sampled: log-probabilities of each slot as a host `Sampled` with
      `[S, G+1]` leading dims, or None when no request asked for them.
    path_rank: int32 `[S, G]`, the rank of each accepted token-tree node among
      its row's candidates (-1 past the path; `engine.spec.eagle.make_eagle_tree_step`),
      or None (chains, host proposers).
    """

    tokens: np.ndarray
    num_emitted: np.ndarray
    sampled: Sampled | None
    path_rank: np.ndarray | None = None


def resolve_attention(name: str) -> Callable:
    """The paged attention function for `EngineConfig.attention`.

    "auto" is the Pallas kernel on GPU; on CPU, where Pallas only runs in
    interpret mode (an emulator several times slower), the native kernel for
    small steps when it loads (`cpu_paged_attention`), else the jnp reference.
    Raises ValueError for "native" where the native kernel does not load.
    """
    if name == "auto":
        if jax.default_backend() != "cpu":
            name = "pallas"
        else:
            name = "native" if cpu_kernels.available() else "reference"
    if name == "pallas":
        from pallas_kernels.ragged_paged_attention import ragged_paged_attention
        return ragged_paged_attention
    if name == "native":
        if jax.default_backend() != "cpu" or not cpu_kernels.available():
            raise ValueError("attention='native' needs the CPU backend and the compiled CPU kernels (pip install -e .)")
        return cpu_paged_attention
    return ragged_paged_attention_reference


class ModelRunner:
    """The device state and programs of one engine.

    Args:
      model: a `checkpoints.LoadedModel` (the target).
      config: engine limits (block size, buckets, attention).
      num_blocks: KV pool size in blocks (block 0 is reserved for padding).
      max_blocks_per_seq: block-table width.
      proposer: the speculation proposer (`NoProposer`: none).
    """

    def __init__(self, model, config: EngineConfig, num_blocks: int, max_blocks_per_seq: int,
                 proposer: Proposer = NoProposer()):
        cfg = model.config
        self.model_config = cfg
        self.config = config
        self.proposer = proposer
        self.max_blocks_per_seq = max_blocks_per_seq
        self.mesh = tensor_parallel_mesh(config.tensor_parallel_size)
        self.graphdef, self.state, self.packed_bytes = build_model(model, config, config.kernel_dtype, self.mesh)
        self.packed_bytes += proposer.packed_bytes
        if proposer.on_device:
            proposer.state = replicate(proposer.state, self.mesh)
        if self.packed_bytes:
            log.info("CPU kernel weights: %.0f MB more for the packed copies", self.packed_bytes / 1e6)
        B = config.block_size
        # The target's KV pool, then the proposer's pools (a draft's KV; an EAGLE head's KV and features).
        self.pools: tuple = (KVPool.zeros(cfg, num_blocks, B, self.mesh),
                             *replicate(proposer.pools(num_blocks, B), self.mesh))
        # Host copies of swapped-out requests' KV blocks (every pool's), by request id, until swapped back in.
        self.swapped_kv: dict[str, tuple] = {}
        # The compiled shapes: every program is specialised to one of these.
        self.token_buckets = power_of_two_buckets(config.max_num_batched_tokens)
        self.seq_buckets = power_of_two_buckets(config.max_num_seqs)
        self.block_op_buckets = power_of_two_buckets(max(config.max_num_seqs, max_blocks_per_seq))
        self._attention = resolve_attention(config.attention)
        self._step = make_step(self.graphdef, self._attention)
        # The last plain step's sampled tokens, on the device (`make_step`'s feed; zeros before the first).
        self._fed = replicate(jax.device_put(np.zeros(self.seq_buckets[-1], np.int32)), self.mesh)
        # The speculative programs by G, looked up here: their makers' caches hash the model graphs, which
        # took ~4 ms of host time a step.
        self._spec_steps: dict[int, Callable] = {}
        self._score_step = make_score_step(self.graphdef, self._attention)
        # Programs by (G or "score", the batch layouts), called compiled: no tracing on a shape's first use.
        self.programs = Programs((cfg, config, getattr(self._attention, "__qualname__", self._attention),
                                  repr(self.graphdef), proposer.program_key))

    @property
    def buckets(self) -> list[tuple[int, int]]:
        """Every (token bucket, sequence bucket) shape the step can be compiled for."""
        return step_buckets(self.token_buckets, self.seq_buckets)

    @property
    def spec_ks(self) -> list[int | None]:
        """The step programs per shape: target only, each of the proposer's `program_ks`, and G = 0 with a
        device proposer (it keeps the draft's KV in step)."""
        return [None, *([0] if self.proposer.on_device else []), *self.proposer.program_ks]

    # ---- the step -------------------------------------------------------------------------

    def pack(self, plan: StepPlan, seeds: dict[str, int], spec_k: int | None = None,
             proposals: dict[str, list[int]] | None = None, parents: dict[str, list[int]] | None = None,
             pending: dict[str, int] | None = None) -> PackedBatch:
        """`plan` padded into its bucket (see `scheduler.packing.pack`)."""
        return pack(plan, self.config.block_size, self.max_blocks_per_seq, self.token_buckets, self.seq_buckets,
                    seeds, spec_k, proposals, parents, pending)

    def padding_batch(self, T: int, S: int, spec_k: int | None = None) -> PackedBatch:
        """A batch of shape (T, S) with no real tokens: it only writes to the reserved block."""
        return pack(StepPlan([], []), 1, self.max_blocks_per_seq, (T,), (S,), {}, spec_k)

    def execute(self, batch: StepBatch, spec: SpecBatch | None, spec_k: int | None,
                feed_index: np.ndarray) -> tuple[Sampled, jax.Array | None, jax.Array | None]:
        """Runs the step program on device inputs; returns device `(sampled, num_emitted int32 [S], path_rank)`
        (`StepOutput`).

        `spec_k` None runs the target alone (num_emitted is None: one token
        per row); otherwise the draft + verify program for that G
        (`engine.spec.draft.make_spec_step`), or the verify program of a host
        proposer (`make_verify_step`; `make_tree_verify_step` for token trees). The pools are donated and
        replaced.
        """
        key, fn, args = self._program(batch, spec, spec_k, feed_index)
        step = self.programs.get(key, fn, args)
        if spec_k is None:
            sampled, pool, self._fed = step(*args)
            self.pools = (pool, *self.pools[1:])
            return sampled, None, None
        if not self.proposer.on_device:
            sampled, num_emitted, pool = step(*args)
            self.pools = (pool,)
            return sampled, num_emitted, None
        sampled, num_emitted, path_rank, *pools = step(*args)
        self.pools = tuple(pools)
        return sampled, num_emitted, path_rank

    def _program(self, batch: StepBatch, spec: SpecBatch | None, spec_k: int | None,
                 feed_index: np.ndarray) -> tuple[tuple, Callable, tuple]:
        """The step program for `spec_k`: its key in `programs`, the jitted function and its arguments (see
        `execute`)."""
        key = (spec_k, batch.layout, None if spec is None else spec.layout)
        if spec_k is None:
            return key, self._step, (self.state, self.pools[0], batch, (self._fed, feed_index))
        step = self._spec_steps.get(spec_k)
        if step is None:
            step = self._spec_steps[spec_k] = self.proposer.step_program(self.graphdef, self._attention, spec_k)
        if not self.proposer.on_device:
            return key, step, (self.state, self.pools[0], batch, spec)
        return key, step, (self.state, self.proposer.state, *self.pools, batch, spec)

    def run(self, packed: PackedBatch, spec_k: int | None, timing: StepTiming | None = None) -> StepOutput:
        """Copies `packed` to the device, runs the step program and makes the step's one read back.

        Fills `timing`'s shape, `to_device` and `device` fields if given.
        """
        return self.collect(self.dispatch(packed, spec_k, timing), timing)

    def dispatch(self, packed: PackedBatch, spec_k: int | None, timing: StepTiming | None = None) -> InFlight:
        """Copies `packed` to the device and starts its step program; returns at once (JAX dispatches
        asynchronously). A plain step's `packed.feed_index` tokens come from the step dispatched before it."""
        t0 = time.perf_counter()
        check_same_batch(packed)
        batch = to_device(StepBatch, packed)
        spec = to_device(SpecBatch, packed.spec) if spec_k is not None else None
        t1 = time.perf_counter()
        sampled, num_emitted, path_rank = self.execute(batch, spec, spec_k, packed.feed_index)
        if timing is not None:
            timing.num_tokens, timing.num_seqs, timing.spec_k = packed.token_ids.shape[0], packed.seq_lens.shape[0], spec_k
            timing.to_device, timing.device = t1 - t0, time.perf_counter() - t1
        return InFlight(sampled, num_emitted, path_rank, packed.token_ids.shape[0], packed.seq_lens.shape[0],
                        bool(packed.want_logprobs.any()))

    def collect(self, flight: InFlight, timing: StepTiming | None = None) -> StepOutput:
        """Waits for a dispatched step and reads its outputs back (the step's one read back); adds the wait to
        `timing.device`."""
        t0 = time.perf_counter()
        S, num_emitted = flight.num_seqs, flight.num_emitted
        if num_emitted is None:
            num_emitted = np.ones(S, np.int32)
        if not flight.want_logprobs:
            tokens, num_emitted, path_rank = jax.device_get((flight.sampled.tokens, num_emitted, flight.path_rank))
            out = StepOutput(tokens.reshape(S, -1), num_emitted, None, path_rank)
        else:
            sampled, num_emitted, path_rank = jax.device_get((flight.sampled, num_emitted, flight.path_rank))
            sampled = jax.tree.map(lambda x: x.reshape(S, -1, *x.shape[1:]), sampled)
            out = StepOutput(sampled.tokens, num_emitted, sampled, path_rank)
        if timing is not None:
            timing.device += time.perf_counter() - t0
        return out

    # ---- block operations -----------------------------------------------------------------

    def apply_block_ops(self, plan: StepPlan) -> None:
        """Swap out, swap in, then copy-on-write copies, before the step writes anything."""
        for request, blocks in plan.swap_out:
            kv = self._block_op(gather_blocks, self.pools, self._block_ids(blocks))
            self.swapped_kv[request.request_id] = jax.tree.map(lambda x: np.asarray(x)[:, :len(blocks)], kv)
        for request, blocks in plan.swap_in:
            kv = self.swapped_kv.pop(request.request_id)
            ids = self._block_ids(blocks)
            pad = [(0, 0), (0, len(ids) - len(blocks))] + [(0, 0)] * 3
            self.pools = self._block_op(scatter_blocks, self.pools, ids, jax.tree.map(lambda x: np.pad(x, pad), kv))
        if plan.copies:
            src = self._block_ids([c.src for c in plan.copies])
            dst = self._block_ids([c.dst for c in plan.copies])
            self.pools = self._block_op(copy_blocks, self.pools, src, dst)

    def forget(self, request_id: str) -> None:
        """A request ended: drops its host copy of swapped-out KV, if any."""
        self.swapped_kv.pop(request_id, None)

    def _block_op(self, fn, pools, ids: np.ndarray, *rest):
        """`fn(pools, ids, *rest)` (`rest`: host arrays, as `ids`) through `programs`, kept with the step
        programs: one per block-op bucket."""
        args = (pools, ids, *rest)
        return self.programs.get((fn.__name__, ids.shape[0]), fn, args)(*args)

    def _block_ids(self, blocks) -> np.ndarray:
        """Block ids padded with the reserved block 0 to a block-op bucket."""
        ids = np.zeros(bucket_for(len(blocks), self.block_op_buckets), np.int32)
        ids[:len(blocks)] = blocks
        return ids

    # ---- scoring --------------------------------------------------------------------------

    def score_chunks(self, chunks: list[tuple[list[int], object, int, int]]) -> list[tuple[np.ndarray, ...]]:
        """Scores several sequences' next chunks in one step.

        `chunks`: (token_ids, allocation, start, m) per sequence: the
        log-probabilities of `token_ids[start + 1:start + 1 + m]`, each given
        the tokens before it; together at most the token budget and
        `max_num_seqs` sequences. Returns per sequence float32 `[m]` (the
        tokens' log-probabilities), int32 `[m]` (each position's argmax) and
        float32 `[m]` (the argmax's log-probability).

        Teacher forcing through the paged forward: a chunk's KV goes into its
        `allocation` (the block manager's, for `len(token_ids) - 1` tokens;
        the caller frees it) after the KV of the chunks before it. One program
        per token bucket (`precompile` compiles them all).
        """
        # Request objects only to reuse `pack`; they never enter the scheduler.
        seqs, targets = [], []
        for i, (token_ids, allocation, start, m) in enumerate(chunks):
            request = Request(token_ids, SamplingParams(), request_id=f"score-{i}", allocation=allocation)
            seqs.append(ScheduledSeq(request, start, m, sample=False))
            targets += token_ids[start + 1:start + 1 + m]
        # One sequence bucket for every Score step: a program per token bucket only (padding sequences cost
        # nothing here: every token's logits are computed anyway).
        packed = pack(StepPlan(seqs, []), self.config.block_size, self.max_blocks_per_seq, self.token_buckets,
                      (self._score_seqs,), {s.request.request_id: 0 for s in seqs})
        padded = np.zeros(packed.token_ids.shape[0], np.int32)
        padded[:len(targets)] = targets
        batch = to_device(StepBatch, packed)
        args = (self.state, self.pools[0], batch, padded)
        score = self.programs.get(("score", batch.layout), self._score_step, args)
        logprobs, argmax, top, pool = score(*args)
        self.pools = (pool, *self.pools[1:])
        logprobs, argmax, top = np.asarray(logprobs), np.asarray(argmax), np.asarray(top)
        out, t = [], 0
        for *_, m in chunks:
            out.append((logprobs[t:t + m], argmax[t:t + m], top[t:t + m]))
            t += m
        return out

    @property
    def _score_seqs(self) -> int:
        return self.seq_buckets[-1]

    # ---- compilation ----------------------------------------------------------------------

    def precompile(self, buckets: list[tuple[int, int]] | None = None,
                   progress: Callable[[int, int], None] | None = None) -> int:
        """Compiles the step for `buckets` (default: all) with all-padding batches; returns the shapes compiled.

        With the default, Score's programs (one per token bucket) and the block-op programs (copy-on-write
        and swap) are compiled too, so a server meets no compilation after it. `progress(done, total)` is
        called after each program. Raises RuntimeError where the programs would pass the process's memory-map
        limit (`engine.compilation`; BUILD.md says how to raise it): a server that dropped compiled programs
        under load would stall every stream while they compile again.
        """
        shapes = sorted(buckets or self.buckets)
        score = self.token_buckets if buckets is None else []
        block_ops = self.block_op_buckets if buckets is None else []
        total = len(shapes) * len(self.spec_ks) + len(score) + len(block_ops)
        if not maps_left(total):
            used, limit = memory_maps()
            raise RuntimeError(f"{total} programs would pass vm.max_map_count ({used} of {limit} memory maps in "
                               f"use, ~{MAPS_PER_PROGRAM} a program): raise it (BUILD.md) or lower "
                               "--max_num_batched_tokens / --max_num_seqs")
        done, lock = 0, threading.Lock()

        def tick():
            nonlocal done
            with lock:
                done += 1
                if progress is not None:
                    progress(done, total)

        # Compiled ahead of time (never run: a 512-token step takes ~0.6 s) on a thread per CPU (XLA compiles
        # without the GIL: ~1.3x faster on 2 CPUs), or loaded (`engine.programs`).
        def compile_ahead(job) -> None:
            T, S, G = job
            packed = self.padding_batch(T, S if G != "score" else self._score_seqs, None if G == "score" else G)
            batch = to_device(StepBatch, packed)
            if G == "score":
                key, fn, args = ("score", batch.layout), self._score_step, (self.state, self.pools[0], batch,
                                                                            np.zeros(T, np.int32))
            else:
                key, fn, args = self._program(batch, to_device(SpecBatch, packed.spec) if G is not None else None, G,
                                              packed.feed_index)
            self.programs.get(key, fn, args)
            tick()

        jobs = [(T, S, G) for T, S in shapes for G in self.spec_ks] + [(T, None, "score") for T in score]
        with concurrent.futures.ThreadPoolExecutor(min(os.cpu_count() or 1, 4)) as pool:
            list(pool.map(compile_ahead, jobs))
        for n in block_ops:
            ids = np.zeros(n, np.int32)
            self.pools = self._block_op(copy_blocks, self.pools, ids, ids)
            kv = jax.tree.map(np.asarray, self._block_op(gather_blocks, self.pools, ids))
            self.pools = self._block_op(scatter_blocks, self.pools, ids, kv)
            tick()
        jax.block_until_ready(self.pools)
        return len(shapes)
