"""The unified jitted step: prefill chunks and decode tokens in one flattened batch.

Selective batching (Yu et al. 2022, Orca §4.2): projections and MLPs see all
`T` tokens at once; attention is per sequence, through the paged KV pool
(Kwon et al. 2023, PagedAttention §4.1).
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

import cpu_kernels
from engine import kernels
from engine.sampler import sample
from model import numerics
from model.config import ModelConfig
from pallas_kernels.reference import ragged_paged_attention_reference
from model.eagle import FC, EagleHead
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from model.llama import TP_AXIS, Llama, kv_heads_per_device
from model.ops import LayerAttention
from scheduler.request import MAX_LOGPROBS


# The skinny kernel's AVX2 path takes products over at most this many tokens; larger ones (prefill chunks)
# go to XLA's dot, 2.3x faster there (SmolLM2's layers at 512 tokens, AMD EPYC). The AVX-512 path takes
# every size (`engine.kernels.layout`).
SKINNY_MAX_ROWS = 64
# Where the CPU has AMX, every product runs on it (tiles of 16 rows for up to 16 tokens): SmolLM2-135M's
# whole step over T tokens of one sequence (AMX Xeon, 2 cores, ms at T = 1 / 2 / 4 / 8 / 16), fp32 skinny
# 22.8 / 24.9 / 27.0 / 33.0 / 42.2, AMX 3 passes 22.1 / 22.6 / 22.6 / 23.1 / 23.4; bf16 skinny 16.4 / 19.5 /
# 21.0 / 26.7 / 34.8, AMX 2 passes 14.3 / 15.6 / 14.7 / 15.3 / 15.6. A 16-token verify window then costs
# about one decode step.


# Steps of at most this many tokens (the default token budget) use the native CPU attention kernel; larger
# ones the jnp reference. Measured (30 layers, SmolLM2 heads, one sequence), the kernel's time over the
# reference's: 0.57x at T = 16 over a 16-token context, 0.76x at T = 64, 1.01x at T = 128; a 512-token
# chunk 1.1x with no context before it but 0.43x after 512 cached tokens (the reference gathers the
# context's KV once per query token), so a long prompt's later chunks prefill 2.3x faster.
NATIVE_ATTENTION_MAX_TOKENS = 512


def cpu_paged_attention(q, k_pages, v_pages, block_tables, seq_lens, query_start_loc, layer, *, sm_scale=None,
                        softcap=0.0, sliding_window=0, tree_mask=None):
    """Paged attention on CPU, chosen at trace time from static shapes: the native kernel
    (`cpu_kernels.paged_attention`) for steps of at most `NATIVE_ATTENTION_MAX_TOKENS` tokens with head shapes it
    takes, else `ragged_paged_attention_reference`. Same contract as both."""
    T, H, D = q.shape
    args = (q, k_pages, v_pages, block_tables, seq_lens, query_start_loc, layer)
    kw = dict(sm_scale=sm_scale, softcap=softcap, sliding_window=sliding_window, tree_mask=tree_mask)
    if T <= NATIVE_ATTENTION_MAX_TOKENS and cpu_kernels.paged_attention_supported(H, k_pages.shape[3], D):
        return cpu_kernels.paged_attention(*args, **kw)
    return ragged_paged_attention_reference(*args, **kw)


@jax.tree_util.register_pytree_node_class
class Weights:
    """A model's `nnx.State`, flattened once: every jitted call otherwise re-flattens its ~400 `nnx.Variable`s
    in Python (about 1 ms of host time per step at this model's size). A program made with `step_program`
    gets the `nnx.State` back (`state`); the pytree stays a `Weights`, so a compiled program's input
    structure is the one it is called with."""

    def __init__(self, leaves, treedef):
        self.leaves, self.treedef = leaves, treedef

    @classmethod
    def of(cls, state: nnx.State) -> "Weights":
        return cls(*jax.tree.flatten(state))

    def tree_flatten(self):
        return self.leaves, self.treedef

    @classmethod
    def tree_unflatten(cls, treedef, leaves):
        return cls(list(leaves), treedef)

    def state(self) -> nnx.State:
        return jax.tree.unflatten(self.treedef, self.leaves)


def kernel_layout(config, dtype: str) -> tuple[str, int, int | None, str] | None:
    """How a model's products run under `config` (an `EngineConfig`) with kernel weights in `dtype`: the
    arguments of `Llama.pack_linears` (dtype, skinny kernel rows, AMX passes, skinny path) for the kernel
    family `config.matmul` names (`engine.kernels`; "auto" here is the instruction-set default, the engine
    resolves it by measurement first), or None for XLA's dot (not on CPU, "xla", or the kernel library
    missing)."""
    if jax.default_backend() != "cpu" or not cpu_kernels.available():
        return None
    return kernels.layout(kernels.isa_default(dtype) if config.matmul == "auto" else config.matmul, dtype)


def build_model(loaded, config, kernel_dtype: str | None = None, mesh: Mesh | None = None):
    """`nnx.split` of the `Llama` (or, with `model.eagle.FC` in its params, the `EagleHead`) for `loaded`
    (a `LoadedModel`), with the CPU kernels' packed weights for the family `config.matmul` (an `EngineConfig`)
    names (`kernel_layout`; `kernel_dtype`: their dtype, default `loaded.stored_dtype`, else the model's):
    AMX copies alone for "amx", else the skinny kernel's. With `mesh` (a target under tensor parallelism)
    the `Llama`'s weights are split over it and XLA's dot runs the products.
    Returns (graphdef, `Weights` of the state, bytes of the packed copies)."""
    model = (EagleHead(loaded.config, loaded.params) if FC in loaded.params
             else Llama(loaded.config, params=loaded.params, mesh=mesh))
    dtype = kernel_dtype or loaded.stored_dtype or loaded.config.dtype
    layout = None if mesh is not None else kernel_layout(config, dtype)
    packed = model.pack_linears(*layout) if layout else 0
    graphdef, state = nnx.split(model)
    return graphdef, Weights.of(state), packed


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, tp: int = 1) -> int:
    """Bytes of one KV block over all of `cfg`'s layers (K and V) on each of `tp` devices."""
    heads = kv_heads_per_device(cfg.num_kv_heads, tp) if tp > 1 else cfg.num_kv_heads
    return 2 * cfg.num_layers * block_size * heads * cfg.head_dim * jnp.dtype(cfg.dtype).itemsize


def tensor_parallel_mesh(tp: int) -> Mesh | None:
    """A one-axis (`TP_AXIS`) mesh over the first `tp` devices, or None for `tp` 1. Raises ValueError when
    fewer devices are visible."""
    if tp == 1:
        return None
    devices = jax.devices()
    if len(devices) < tp:
        raise ValueError(f"tensor_parallel_size {tp} needs {tp} devices; {len(devices)} visible ({devices[0].platform})")
    return Mesh(np.array(devices[:tp]), (TP_AXIS,))


def replicate(tree, mesh: Mesh | None):
    """`tree`'s arrays copied whole onto every device of `mesh` (unchanged without one): the draft and its
    pools beside a tensor parallel target."""
    return tree if mesh is None else jax.device_put(tree, NamedSharding(mesh, P()))


@struct.dataclass
class KVPool:
    """Every layer's K and V blocks."""

    k: jax.Array  # [L, P, B, K, D]
    v: jax.Array  # [L, P, B, K, D]

    @classmethod
    def zeros(cls, cfg: ModelConfig, num_blocks: int, block_size: int, mesh: Mesh | None = None) -> "KVPool":
        """An empty pool; with `mesh`, split over its KV-head axis (`K` = `kv_heads_per_device` x the axis
        size: a KV head replicated over several devices has a copy on each), each device allocating its own."""
        if mesh is None:
            shape = (cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
            return cls(jnp.zeros(shape, cfg.dtype), jnp.zeros(shape, cfg.dtype))
        tp = mesh.shape[TP_AXIS]
        shape = (cfg.num_layers, num_blocks, block_size, kv_heads_per_device(cfg.num_kv_heads, tp) * tp, cfg.head_dim)
        zeros = jax.jit(lambda: jnp.zeros(shape, cfg.dtype),
                        out_shardings=NamedSharding(mesh, P(None, None, None, TP_AXIS, None)))
        return cls(zeros(), zeros())


@struct.dataclass
class StepBatch:
    """Device copy of `scheduler.packing.PackedBatch` (same fields and shapes)."""

    token_ids: jax.Array  # int32 [T]
    positions: jax.Array  # int32 [T]
    slot_mapping: jax.Array  # int32 [T]
    query_start_loc: jax.Array  # int32 [S+1]
    seq_lens: jax.Array  # int32 [S]
    block_tables: jax.Array  # int32 [S, max_blocks_per_seq]
    logits_indices: jax.Array  # int32 [S]
    temperature: jax.Array  # float32 [S]
    top_k: jax.Array  # int32 [S]
    top_p: jax.Array  # float32 [S]
    min_p: jax.Array  # float32 [S]
    seeds: jax.Array  # uint32 [S]
    want_logprobs: jax.Array  # bool [S]

    @classmethod
    def from_packed(cls, packed) -> "StepBatch":
        """On the device, field by field (step programs take `to_device(StepBatch, packed)` instead)."""
        return to_device(cls, packed).unpack()


def to_device(cls, host) -> "Packed":
    """`host`'s fields named as `cls`'s (a `struct.dataclass` of int32, uint32, float32 and bool arrays) as one
    `Packed` int32 buffer: a program made with `step_program` takes it in one transfer and unpacks it inside
    (a copy per field took ~0.5 ms at batch 1 on CPU, a separate splitting program ~0.1-0.3 ms)."""
    arrays = [np.asarray(getattr(host, name)) for name in cls.__dataclass_fields__]
    layout = tuple((name, a.shape, a.dtype.str) for name, a in zip(cls.__dataclass_fields__, arrays))
    flat = np.concatenate([(a.astype(np.int32) if a.dtype == np.bool_ else a.view(np.int32)).ravel() for a in arrays])
    return Packed(cls, layout, flat)


@jax.tree_util.register_pytree_node_class
class Packed:
    """A `cls` instance as one int32 array `flat` and its static `layout` ((name, shape, dtype) per field)."""

    def __init__(self, cls, layout: tuple[tuple[str, tuple[int, ...], str], ...], flat):
        self.cls, self.layout, self.flat = cls, layout, flat

    def tree_flatten(self):
        return (self.flat,), (self.cls, self.layout)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*aux, children[0])

    def unpack(self):
        """The `cls` instance (inside a program: slices of the traced buffer)."""
        fields, start = {}, 0
        for name, shape, dtype in self.layout:
            size = int(np.prod(shape))
            x, start = self.flat[start:start + size].reshape(shape), start + size
            dtype = np.dtype(dtype)
            fields[name] = (x != 0 if dtype == np.bool_ else x if dtype == np.int32
                            else jax.lax.bitcast_convert_type(x, dtype))
        return self.cls(**fields)


def step_program(donate_argnums: tuple[int, ...] = ()):
    """`jax.jit` for a step program whose batch arguments may come as `Packed` and weights as `Weights` (both
    unpacked inside)."""
    def wrap(fn):
        @functools.wraps(fn)
        def unpacked(*args):
            return fn(*(a.unpack() if isinstance(a, Packed) else a.state() if isinstance(a, Weights) else a
                        for a in args))
        return jax.jit(unpacked, donate_argnums=donate_argnums)
    return wrap


@struct.dataclass
class Sampled:
    """A step's draws, one row per sequence; the log-probabilities are zeros unless some row wants them."""

    tokens: jax.Array  # int32 [S]
    logprobs: jax.Array  # float32 [S], of `tokens` under the raw (temperature-free) distribution
    top_ids: jax.Array  # int32 [S, N], most likely first; N = min(MAX_LOGPROBS, V)
    top_logprobs: jax.Array  # float32 [S, N]


def token_logprobs(logits: jax.Array, tokens: jax.Array, want: jax.Array) -> Sampled:
    """Raw log-softmax of `logits` float32 `[S, V]` at `tokens` int32 `[S]` and its top N entries.

    Skipped (zeros) unless `want` bool `[S]` has a set row: the top-k over
    `[S, V]` costs about 12 ms at S=64, V=49152 on CPU. The log-sum-exp is
    batch-invariant (`model.numerics`): a row's log-probabilities are bitwise
    the same whatever rows share its step.
    """
    S, N = logits.shape[0], min(MAX_LOGPROBS, logits.shape[1])

    def compute():
        row_max = jnp.max(logits, axis=-1)
        lse = row_max + numerics.log(numerics.row_sum(numerics.exp(logits - row_max[:, None])))
        top, top_ids = jax.lax.top_k(logits, N)
        chosen = jnp.take_along_axis(logits, tokens[:, None], axis=-1)[:, 0]
        return chosen - lse, top_ids.astype(jnp.int32), top - lse[:, None]

    def skip():
        return jnp.zeros(S, jnp.float32), jnp.zeros((S, N), jnp.int32), jnp.zeros((S, N), jnp.float32)

    return Sampled(tokens, *jax.lax.cond(jnp.any(want), compute, skip))


def paged_attend(batch: StepBatch, attention: Callable, tree_mask: jax.Array | None = None):
    """An `AttendFn` that writes this step's K/V at `slot_mapping` and reads through the block table.

    `tree_mask` (int32 `[T]`, `pallas_kernels.reference.tree_visible`) makes verify windows token trees:
    each window token then sees its ancestors only (`engine.spec.tree_verify`)."""
    extra = {} if tree_mask is None else {"tree_mask": tree_mask}

    def attend(q, k, v, layer, pool: KVPool, spec: LayerAttention):
        B = pool.k.shape[2]
        blk, off = batch.slot_mapping // B, batch.slot_mapping % B
        pool = KVPool(pool.k.at[layer, blk, off].set(k.astype(pool.k.dtype)),
                      pool.v.at[layer, blk, off].set(v.astype(pool.v.dtype)))
        out = attention(q, pool.k, pool.v, batch.block_tables, batch.seq_lens, batch.query_start_loc, layer,
                        sm_scale=spec.sm_scale, softcap=spec.softcap, sliding_window=spec.window, **extra)
        return out, pool

    return attend


def forward_logits(model, pool: KVPool, batch: StepBatch, attention: Callable):
    """Logits float32 `[S, V]` at `batch.logits_indices`, and the updated pool."""
    hidden, pool = model(batch.token_ids, batch.positions, paged_attend(batch, attention), pool)
    return model.logits(hidden[batch.logits_indices]), pool


@functools.cache
def make_step(graphdef: nnx.GraphDef, attention: Callable):
    """Returns the jitted `step(state, pool, batch, feed=None) -> (Sampled, pool)`, or `(Sampled, pool, fed)`
    with a feed.

    The weights (`state`) are an argument, not a constant; the pool is donated
    so KV writes happen in place. Cached on (graphdef, attention), so engines
    of the same model in one process share compiled programs.

    `feed`: (int32 `[F]` tokens sampled by the step before, still on the device; int32 `[T]` index into them
    per token, -1 to keep `batch.token_ids`), so a step can be dispatched before the host has seen the step
    before it (async scheduling). `fed`: this step's tokens in the same `[F]` form (zeros past its S rows).
    """

    @step_program(donate_argnums=(1,))
    def step(state, pool: KVPool, batch: StepBatch, feed=None):
        model = nnx.merge(graphdef, state)
        if feed is not None:
            prev, index = feed
            batch = batch.replace(token_ids=jnp.where(index >= 0, prev[jnp.maximum(index, 0)], batch.token_ids))
        logits, pool = forward_logits(model, pool, batch, attention)
        tokens = sample(logits, batch.temperature, batch.top_k, batch.top_p, batch.min_p, batch.seeds,
                        batch.seq_lens)
        sampled = token_logprobs(logits, tokens, batch.want_logprobs)
        if feed is None:
            return sampled, pool
        return sampled, pool, jnp.zeros_like(feed[0]).at[:tokens.shape[0]].set(tokens)

    return step


# ---- block operations (copy-on-write, swap), run before a step -------------------------------
# Each takes `pools`, any pytree of `KVPool`s (the target's, and the draft's beside it): one block
# table indexes them all, so a block operation applies to every pool alike.


@functools.partial(jax.jit, donate_argnums=(0,))
def copy_blocks(pools, src: jax.Array, dst: jax.Array):
    """Copies blocks `src[i]` to `dst[i]` in every layer of every pool (int32 `[N]`; padding copies 0 -> 0)."""
    return jax.tree.map(lambda x: x.at[:, dst].set(x[:, src]), pools)


@jax.jit
def gather_blocks(pools, blocks: jax.Array):
    """The K and V of `blocks` (int32 `[N]`): `pools`' structure with `[L, N, B, K, D]` leaves (swap out)."""
    return jax.tree.map(lambda x: x[:, blocks], pools)


@functools.partial(jax.jit, donate_argnums=(0,))
def scatter_blocks(pools, blocks: jax.Array, values):
    """Writes `values` (as `gather_blocks` returns them) into `blocks` (int32 `[N]`) of every pool (swap in)."""
    return jax.tree.map(lambda x, v: x.at[:, blocks].set(v.astype(x.dtype)), pools, values)
