"""The Llama-family decoder (Llama 2/3, Qwen2/3, Mistral, Phi-3, Gemma 2/3, Mixtral, Qwen3-MoE, SmolLM2) in Flax NNX;
its functional pieces (RoPE, norms, the attention contract) are in `model/ops.py`.

Checkpoints declare layer weights stacked along a leading `L` axis
(`param_specs`); the module keeps one `Block` per layer. The forward pass reads and writes a paged KV pool through the attention function
given to it (paged in the engine, dense in tests).
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec as P

import cpu_kernels
from model import numerics
from model.packed import keep_packed, packed_product, packed_weight
from model.config import ModelConfig
from model.ops import AttendFn, LayerAttention, apply_rope, dense_attention, rms_norm, rope_angles, rope_table, softcap


def param_specs(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], tuple[str | None, ...]]]:
    """Every weight declared once: name -> (shape, logical axes).

    Linear weights are stored `[in, out]` (activations @ weight). Layer weights
    carry a leading `layers` axis of size L.
    """
    E, F, L, H, K, D, V = (cfg.hidden_size, cfg.intermediate_size, cfg.num_layers,
                           cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size)
    specs = {
        "embed": ((V, E), ("vocab", "embed")),
        "attn_norm": ((L, E), ("layers", "embed")),
        "wq": ((L, E, H * D), ("layers", "embed", "q_heads")),
        "wk": ((L, E, K * D), ("layers", "embed", "kv_heads")),
        "wv": ((L, E, K * D), ("layers", "embed", "kv_heads")),
        "wo": ((L, H * D, E), ("layers", "q_heads", "embed")),
        "mlp_norm": ((L, E), ("layers", "embed")),
        "w_gate": ((L, E, F), ("layers", "embed", "mlp")),
        "w_up": ((L, E, F), ("layers", "embed", "mlp")),
        "w_down": ((L, F, E), ("layers", "mlp", "embed")),
        "final_norm": ((E,), ("embed",)),
    }
    if X := cfg.num_experts:  # every expert's MLP, and the router
        specs["w_gate"] = ((L, X, E, F), ("layers", "experts", "embed", "mlp"))
        specs["w_up"] = ((L, X, E, F), ("layers", "experts", "embed", "mlp"))
        specs["w_down"] = ((L, X, F, E), ("layers", "experts", "mlp", "embed"))
        specs["router"] = ((L, E, X), ("layers", "embed", "experts"))
    if cfg.qk_norm:
        specs["q_norm"] = ((L, D), ("layers", "head_dim"))
        specs["k_norm"] = ((L, D), ("layers", "head_dim"))
    if cfg.sandwich_norms:
        specs["post_attn_norm"] = ((L, E), ("layers", "embed"))
        specs["post_mlp_norm"] = ((L, E), ("layers", "embed"))
    if cfg.qkv_bias:
        specs["bq"] = ((L, H * D), ("layers", "q_heads"))
        specs["bk"] = ((L, K * D), ("layers", "kv_heads"))
        specs["bv"] = ((L, K * D), ("layers", "kv_heads"))
    if not cfg.tie_word_embeddings:
        specs["lm_head"] = ((E, V), ("embed", "vocab"))
    if cfg.head_vocab_size:
        specs["head_ids"] = ((cfg.head_vocab_size,), ("head_vocab",))  # int32 token ids, ascending
    return specs


LAYER_PARAMS = ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down", "bq", "bk", "bv",
                "q_norm", "k_norm", "post_attn_norm", "post_mlp_norm", "router")
# A layer's arrays besides the products a CPU kernel may take: its vectors (stacked along L in a scan over the
# layers) and a mixture of experts' router and experts (XLA's ragged dot; such models run the unrolled loop).
LAYER_VECTORS = ("attn_norm", "mlp_norm", "bqkv", "q_norm", "k_norm", "post_attn_norm", "post_mlp_norm", "router",
                 "experts_gate_up", "experts_down")


TP_AXIS = "tp"  # the mesh axis tensor parallelism splits over


def kv_heads_per_device(num_kv_heads: int, tp: int) -> int:
    """KV heads each of `tp` devices holds: K / tp, or 1 when K < tp (each KV head then lives on tp / K
    devices, beside the query heads that read it, as vLLM replicates them). Raises ValueError when neither
    count divides the other."""
    if num_kv_heads >= tp:
        if num_kv_heads % tp:
            raise ValueError(f"{num_kv_heads} KV heads do not split over tensor_parallel_size {tp}")
        return num_kv_heads // tp
    if tp % num_kv_heads:
        raise ValueError(f"tensor_parallel_size {tp} is not a multiple of the {num_kv_heads} KV heads")
    return 1


def check_tensor_parallel(cfg: ModelConfig, tp: int) -> None:
    """Raises ValueError unless `cfg` splits over `tp` devices: query heads and the intermediate size
    divide by `tp`, the KV heads as `kv_heads_per_device` needs, and no partial output head."""
    if tp < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tp}")
    if cfg.num_heads % tp or cfg.intermediate_size % tp:
        raise ValueError(f"{cfg.name}: {cfg.num_heads} heads and intermediate size {cfg.intermediate_size} "
                         f"must be multiples of tensor_parallel_size {tp}")
    kv_heads_per_device(cfg.num_kv_heads, tp)
    if tp > 1 and cfg.head_vocab_size:
        raise ValueError(f"{cfg.name}: a partial output head (head_vocab_size) runs on one device, not sharded")


def _np(a):
    """numpy for checkpoint and concrete arrays (host memory: a large model never sits whole on a device),
    jax.numpy for traced ones (`abstract_model`)."""
    return jnp if isinstance(a, jax.core.Tracer) else np


def _shard_major_qkv(q: np.ndarray, k: np.ndarray, v: np.ndarray, heads: tuple[int, int, int], tp: int) -> np.ndarray:
    """Concatenates Q, K and V projections (`[..., H*D]`, `[..., K*D]`, `[..., K*D]`) shard by shard: device i's
    columns are its H/tp query heads, then the KV heads they read (`kv_heads_per_device`), so a column split of
    the result gives each device a whole QKV projection of its own heads (Megatron-LM, Shoeybi et al. 2019, §3)."""
    H, K, D = heads
    if tp == 1:
        return _np(q).concatenate([q, k, v], axis=-1)
    hl, kl = H // tp, kv_heads_per_device(K, tp)
    parts = []
    for i in range(tp):
        first_kv = i * kl if K >= tp else i // (tp // K)
        kv_cols = slice(first_kv * D, (first_kv + kl) * D)
        parts += [q[..., i * hl * D:(i + 1) * hl * D], k[..., kv_cols], v[..., kv_cols]]
    return _np(q).concatenate(parts, axis=-1)


def _shard_major_pair(a: np.ndarray, b: np.ndarray, tp: int) -> np.ndarray:
    """Gate and up projections concatenated shard by shard (device i: its F/tp gate columns, then up's)."""
    n = a.shape[-1] // tp
    return _np(a).concatenate([x[..., i * n:(i + 1) * n] for i in range(tp) for x in (a, b)], axis=-1)


# How each weight splits over the TP axis (Megatron-LM §3): QKV and gate/up by output columns, o and down
# by input rows (their partial sums meet in one all-reduce each), the embedding and the output head by
# vocabulary; norms and RoPE are whole on every device.
# A mixture of experts splits every expert the same way (per-expert tensor parallelism: each device holds
# F / tp of every expert): the step's work stays even across devices whatever the router picks, and the
# partial sums meet in the all-reduce the dense MLP already has; expert parallelism would add an all-to-all
# and idle devices whose experts few tokens chose.
_TP_SPECS = {"wqkv": P(None, TP_AXIS), "bqkv": P(TP_AXIS), "w_gate_up": P(None, TP_AXIS), "wo": P(TP_AXIS, None),
             "w_down": P(TP_AXIS, None), "embed": P(TP_AXIS, None), "lm_head": P(None, TP_AXIS),
             "experts_gate_up": P(None, None, TP_AXIS), "experts_down": P(None, TP_AXIS, None)}


def tp_spec(name: str) -> P:
    """The `PartitionSpec` of weight `name` (a `Llama` attribute) under tensor parallelism."""
    return _TP_SPECS.get(name, P())


class Block(nnx.Module):
    """One decoder layer's weights, sliced from the stacked `param_specs` arrays.

    Q, K and V (and gate and up) projections are stored concatenated, so a
    layer runs 4 matmuls instead of 7: fewer, larger dots keep XLA:CPU closer
    to memory bandwidth at decode batch sizes. Under tensor parallelism over
    `tp` devices the concatenation is shard-major (`_shard_major_qkv`), and
    `put` places each array on the mesh.
    """

    def __init__(self, w: dict[str, np.ndarray], heads: tuple[int, int, int], tp: int = 1,
                 put: Callable[[str, np.ndarray], jax.Array] = lambda name, a: jnp.asarray(a)):
        self.attn_norm = nnx.Param(put("attn_norm", w["attn_norm"]))
        self.wqkv = nnx.Param(put("wqkv", _shard_major_qkv(w["wq"], w["wk"], w["wv"], heads, tp)))
        if "bq" in w:
            self.bqkv = nnx.Param(put("bqkv", _shard_major_qkv(w["bq"], w["bk"], w["bv"], heads, tp)))
        self.wo = nnx.Param(put("wo", w["wo"]))
        self.mlp_norm = nnx.Param(put("mlp_norm", w["mlp_norm"]))
        for name in ("q_norm", "k_norm", "post_attn_norm", "post_mlp_norm"):
            if name in w:
                setattr(self, name, nnx.Param(put(name, w[name])))
        if "router" in w:
            self.router = nnx.Param(put("router", w["router"]))
            self.experts_gate_up = nnx.Param(put("experts_gate_up", _shard_major_pair(w["w_gate"], w["w_up"], tp)))
            self.experts_down = nnx.Param(put("experts_down", w["w_down"]))
            return
        self.w_gate_up = nnx.Param(put("w_gate_up", _shard_major_pair(w["w_gate"], w["w_up"], tp)))
        self.w_down = nnx.Param(put("w_down", w["w_down"]))


class Llama(nnx.Module):
    """Weights of one Llama-family decoder and its forward pass.

    Build it with random weights (`Llama(cfg, rngs=nnx.Rngs(0))`) or from a
    checkpoint's arrays (`Llama(cfg, params={name: array})`, names and shapes
    from `param_specs`). Layers are separate modules run by an unrolled loop:
    on XLA:CPU, slicing stacked weights inside `lax.scan` copies every layer's
    weights each step (measured 2x slower decode).

    With `mesh` (a `Mesh` with a `TP_AXIS` axis of more than one device), the
    weights are split over it as `tp_spec` says, each device receiving only
    its shard, and the forward pass runs per device (`__call__`). Raises
    ValueError when the checkpoint does not match `cfg` or `cfg` does not
    split over the mesh (`check_tensor_parallel`).
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs | None = None,
                 params: dict[str, np.ndarray] | None = None, mesh: Mesh | None = None):
        self.cfg = cfg
        tp = 1 if mesh is None else mesh.shape[TP_AXIS]
        check_tensor_parallel(cfg, tp)
        self.mesh = mesh if tp > 1 else None
        dtype = jnp.dtype(cfg.dtype)
        specs = param_specs(cfg)
        if params is not None:
            missing = sorted(set(specs) - set(params))
            extra = sorted(set(params) - set(specs))
            if missing or extra:
                raise ValueError(f"checkpoint does not match {cfg.name}: missing {missing}, unexpected {extra}")
        elif rngs is None:
            raise ValueError("give either rngs (random init) or params (checkpoint arrays)")
        weights = {}
        for name, (shape, _) in specs.items():
            if name == "head_ids":
                value = np.arange(shape[0]) if params is None else np.asarray(params[name])
                if value.shape != shape or len(np.unique(value)) != shape[0] or not (
                        0 <= value.min() and value.max() < cfg.vocab_size):
                    raise ValueError(f"head_ids: need {shape[0]} distinct token ids below {cfg.vocab_size}")
                weights[name] = np.sort(value).astype(np.int32)
            elif params is not None:
                value = params[name]
                if tuple(value.shape) != shape:
                    raise ValueError(f"weight {name}: checkpoint shape {tuple(value.shape)} != expected {shape}")
                weights[name] = np.asarray(value, dtype)  # no copy when the loader gave this dtype
            elif name.endswith("norm"):
                weights[name] = np.ones(shape, dtype)
            else:
                weights[name] = (0.02 * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)
        if self.mesh is None:
            put = lambda name, a: jnp.asarray(a)
        elif isinstance(self.mesh, AbstractMesh):  # shapes only (`abstract_model`)
            put = lambda name, a: a
        else:  # each device receives only its shard
            put = lambda name, a: jax.device_put(a, NamedSharding(self.mesh, tp_spec(name)))
        vocab_pad = -cfg.vocab_size % tp  # the vocabulary split evenly; padded rows are never looked up
        pad = lambda a, widths: _np(a).pad(a, widths)
        self.embed = nnx.Param(put("embed", pad(weights["embed"], ((0, vocab_pad), (0, 0)))))
        self.final_norm = nnx.Param(put("final_norm", weights["final_norm"]))
        if not cfg.tie_word_embeddings:
            self.lm_head = nnx.Param(put("lm_head", pad(weights["lm_head"], ((0, 0), (0, vocab_pad)))))
        if cfg.head_vocab_size:  # frozen (not Params): the head rows are the embedding's at build time
            self.head_ids = nnx.Variable(jnp.asarray(weights["head_ids"]))
            head = weights["embed"] if cfg.tie_word_embeddings else weights["lm_head"].T
            self.head = nnx.Variable(jnp.asarray(head[weights["head_ids"]]))
        heads = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        self.layers = nnx.List([
            Block({n: weights[n][i] for n in LAYER_PARAMS if n in weights}, heads, tp, put)
            for i in range(cfg.num_layers)])
        self.rope = nnx.Variable(put("rope", rope_table(cfg)))
        if cfg.rope_local_theta:
            self.rope_local = nnx.Variable(put("rope", rope_table(cfg, local=True)))

    # ---- the CPU kernel for skinny products -------------------------------------------------

    LINEARS = ("wqkv", "wo", "w_gate_up", "w_down")

    def pack_linears(self, dtype: str, max_rows: int = 16, amx_passes: int | None = None, isa: str = "") -> int:
        """Keeps a copy of every projection and of the output head in the native CPU kernels' layouts; from
        then every product runs on the AMX kernel when `amx_passes` is given (`cpu_kernels.pack_amx`: 3
        passes, close to fp32; 2, bf16 weights), else products over at most `max_rows` tokens on the skinny
        kernel's path `isa` (`cpu_kernels.pack`, weights in `dtype`: "float32", "bfloat16" or "int8") and
        larger ones on XLA's dot over the same values (`keep_packed`; the choice is made at trace time from
        static shapes).

        Returns the bytes the packed copies take. Call before `nnx.split`. Raises ValueError on a tensor
        parallel model (the kernels take whole weights on one device).
        """
        if self.mesh is not None:
            raise ValueError("the CPU kernels' packed weights are for one device; tensor parallel runs use XLA's dot")
        total = 0
        for lp in self.layers:
            for name in (n for n in self.LINEARS if hasattr(lp, n)):  # experts run on XLA's ragged dot
                total += keep_packed(lp, name, np.asarray(getattr(lp, name)[...], np.float32), dtype, amx_passes,
                                     source=name, isa=isa)
        # A tied embedding keeps its own values: it is also the input lookup table.
        if self.cfg.head_vocab_size:
            head, source, transposed = np.asarray(self.head[...], np.float32).T, "head", True
        elif self.cfg.tie_word_embeddings:
            head, source, transposed = np.asarray(self.embed[...], np.float32).T, None, False
        else:
            head, source, transposed = np.asarray(self.lm_head[...], np.float32), "lm_head", False
        total += keep_packed(self, "head", head, dtype, amx_passes, source, transposed, isa)
        self.skinny_rows = 0 if amx_passes else max_rows
        return total

    def _out_width(self, owner, name: str) -> int:
        """Output columns of `owner`'s weight `name` (the head's: its vocabulary)."""
        return (self.cfg.head_vocab_size or self.cfg.vocab_size) if name == "head" else getattr(owner, name)[...].shape[-1]

    def _kernel_weight(self, owner, name: str, x: jax.Array):
        """`owner`'s packed weight `name` where x `[T, in]` takes a CPU kernel (an AMX copy at any T, the skinny
        panels up to `skinny_rows` tokens), else None."""
        weight = packed_weight(owner, name, self._out_width(owner, name))
        if isinstance(weight, cpu_kernels.PackedWeight) and not 0 < x.shape[0] <= self.skinny_rows:
            return None
        return weight

    def _linear(self, x: jax.Array, lp: Block, name: str) -> jax.Array:
        """x `[T, in]` @ the layer's weight `name` `[in, out]`: a CPU kernel where `_kernel_weight` gives one,
        else XLA's dot."""
        weight = self._kernel_weight(lp, name, x)
        if weight is not None:
            return packed_product(x, weight).astype(x.dtype)
        return x @ getattr(lp, name)[...]

    def to_params(self) -> dict[str, np.ndarray]:
        """The weights as `param_specs` arrays (numpy, the model's dtype): the inverse of `Llama(cfg, params=...)`.

        Splits the fused QKV and gate/up projections back into their parts. Raises ValueError on a tensor
        parallel model (its fused weights are in shard-major order).
        """
        if self.mesh is not None:
            raise ValueError("to_params: build the model on one device (tensor parallel weights are shard-major)")
        cfg = self.cfg
        q, kv, F = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
        stack = lambda name: np.stack([np.asarray(getattr(lp, name)[...]) for lp in self.layers])
        moe = "experts_" if cfg.num_experts else "w_"
        wqkv, gate_up = stack("wqkv"), stack(moe + "gate_up")
        params = {"embed": np.asarray(self.embed[...]), "final_norm": np.asarray(self.final_norm[...]),
                  "attn_norm": stack("attn_norm"), "mlp_norm": stack("mlp_norm"), "wo": stack("wo"),
                  "w_down": stack(moe + "down"), "wq": wqkv[..., :q], "wk": wqkv[..., q:q + kv],
                  "wv": wqkv[..., q + kv:], "w_gate": gate_up[..., :F], "w_up": gate_up[..., F:]}
        if cfg.qkv_bias:
            bqkv = stack("bqkv")
            params.update(bq=bqkv[..., :q], bk=bqkv[..., q:q + kv], bv=bqkv[..., q + kv:])
        for name in ("q_norm", "k_norm", "post_attn_norm", "post_mlp_norm", "router"):
            if hasattr(self.layers[0], name):
                params[name] = stack(name)
        if not cfg.tie_word_embeddings:
            params["lm_head"] = np.asarray(self.lm_head[...])
        if cfg.head_vocab_size:
            params["head_ids"] = np.asarray(self.head_ids[...])
        return params

    def __call__(self, token_ids: jax.Array, positions: jax.Array, attend: AttendFn,
                 cache: object, inputs_embeds: jax.Array | None = None) -> tuple[jax.Array, object]:
        """Runs all layers over a flattened batch.

        Args:
          token_ids: int32 `[T]`.
          positions: int32 `[T]`, each token's position in its sequence.
          attend: the attention function (see `AttendFn`); it owns the KV cache.
          cache: the KV cache pytree threaded through the layers (e.g. the KV pool). Under tensor
            parallelism every leaf is `[..., K, D]` and is split over its KV-head axis.
          inputs_embeds: `[T, E]` to feed the first layer instead of the token embeddings (the EAGLE head).
        Returns:
          (hidden states `[T, E]` after the final norm, updated cache).

        With a mesh, the layers run per device under `shard_map` (Megatron-LM, Shoeybi et al. 2019, §3):
        each device holds its query heads, the KV heads they read (its share of the pool) and its slice of
        the MLP, `attend` runs on those heads alone, and the o and down projections' partial sums meet in
        one all-reduce each; the hidden states come back whole on every device.
        """
        if self.mesh is None:
            return self._layers(token_ids, positions, attend, cache, inputs_embeds)
        graphdef, state = nnx.split(self)
        cache_specs = jax.tree.map(lambda c: P(*([None] * (c.ndim - 2)), TP_AXIS, None), cache)

        def body(state, token_ids, positions, cache, inputs_embeds):
            return nnx.merge(graphdef, state)._layers(token_ids, positions, attend, cache, inputs_embeds, TP_AXIS)

        # check_vma off: a Pallas kernel's outputs carry no record of how they vary over the mesh axis.
        return jax.shard_map(body, mesh=self.mesh, in_specs=(_state_specs(state), P(), P(), cache_specs, P()),
                             out_specs=(P(), cache_specs), check_vma=False)(
                                 state, token_ids, positions, cache, inputs_embeds)

    def _embed(self, token_ids: jax.Array, tp_axis: str | None) -> jax.Array:
        """Token embeddings `[T, E]`; on a device holding a slice of the vocabulary, rows outside it are zeros
        and the all-reduce fills them in (each row is nonzero on exactly one device, so the sum is exact)."""
        table = self.embed[...]
        if tp_axis is None:
            x = jnp.take(table, token_ids, axis=0)
        else:
            local = token_ids - jax.lax.axis_index(tp_axis) * table.shape[0]
            mine = (local >= 0) & (local < table.shape[0])
            rows = jnp.take(table, jnp.clip(local, 0, table.shape[0] - 1), axis=0)
            x = jax.lax.psum(jnp.where(mine[:, None], rows, jnp.zeros_like(rows)), tp_axis)
        if self.cfg.scale_embeddings:  # Gemma: the scale rounded to the dtype first, as transformers does
            x = x * jnp.asarray(math.sqrt(self.cfg.hidden_size), x.dtype)
        return x

    def _layers(self, token_ids, positions, attend, cache, inputs_embeds, tp_axis: str | None = None):
        """`__call__` on this device's weights; `tp_axis` names the mesh axis to all-reduce over (inside
        `shard_map`), None on one device.

        Where every product of the step runs on one CPU kernel (`_layer_products`), the layers are a
        `lax.scan` (one layer's code, compiled once: a step program then compiles ~3x faster and holds fewer
        memory maps) whose products pick their layer's weights by index, so no weight is sliced out of a
        stack; else an unrolled loop over the layers' own arrays (XLA's dot would copy a slice of stacked
        weights every step).
        """
        cfg = self.cfg
        tp = 1 if tp_axis is None else self.mesh.shape[TP_AXIS]
        H, K, D = cfg.num_heads // tp, kv_heads_per_device(cfg.num_kv_heads, tp), cfg.head_dim
        reduce = (lambda y: y) if tp_axis is None else (lambda y: jax.lax.psum(y, tp_axis))
        angles = rope_angles(positions, self.rope[...])
        local_angles = rope_angles(positions, self.rope_local[...]) if cfg.rope_local_theta else angles
        x = self._embed(token_ids, tp_axis) if inputs_embeds is None else inputs_embeds
        layer = functools.partial(self._layer, attend=attend, reduce=reduce, heads=(H, K, D))
        vectors = lambda lp: {n: getattr(lp, n)[...] for n in LAYER_VECTORS if hasattr(lp, n)}
        product = self._layer_products(x) if tp_axis is None else None
        if product is None:
            for index, lp in enumerate(self.layers):
                window = cfg.window(index)
                x, cache = layer(x, cache, index, vectors(lp), window, local_angles if window else angles,
                                 lambda h, name, lp=lp: self._linear(h, lp, name))
        else:
            def body(carry, xs):
                index, window, vecs = xs
                if cfg.rope_local_theta:
                    rope = tuple(jnp.where(window > 0, a_local, a) for a_local, a in zip(local_angles, angles))
                else:
                    rope = angles
                return layer(*carry, index, vecs, window if cfg.layer_windows else 0, rope,
                             lambda h, name: product(h, name, index)), None

            stacked = {n: jnp.stack([getattr(lp, n)[...] for lp in self.layers])
                       for n in LAYER_VECTORS if hasattr(self.layers[0], n)}
            windows = jnp.asarray([cfg.window(i) for i in range(len(self.layers))], jnp.int32)
            xs = (jnp.arange(len(self.layers), dtype=jnp.int32), windows, stacked)
            (x, cache), _ = jax.lax.scan(body, (x, cache), xs)
        return rms_norm(x, self.final_norm[...], cfg.rms_norm_eps, cfg.norm_offset), cache

    def _layer_products(self, x: jax.Array) -> Callable[[jax.Array, str, jax.Array], jax.Array] | None:
        """`product(h, name, layer)` over every layer's packed weights where all of x `[T, E]`'s products take
        one CPU kernel with the same shapes in every layer (`cpu_kernels.skinny_matmul_layers`,
        `amx_matmul_layers`), else None."""
        if len(self.layers) < 2 or self.cfg.num_experts:
            return None
        weights = {name: [self._kernel_weight(lp, name, x) for lp in self.layers] for name in self.LINEARS}
        for kind, product, shape in (
                (cpu_kernels.PackedWeight, cpu_kernels.skinny_matmul_layers,
                 lambda w: (w.panels.shape, w.scales.shape, w.format)),
                (cpu_kernels.AmxWeight, cpu_kernels.amx_matmul_layers, lambda w: (w.hi.shape, w.lo.shape))):
            if all(isinstance(w, kind) and shape(w) == shape(ws[0]) for ws in weights.values() for w in ws):
                return lambda h, name, layer: product(h, weights[name], layer).astype(h.dtype)
        return None

    def _layer(self, x, cache, index, vecs, window, rope, linear, *, attend, reduce, heads):
        """One decoder layer: x `[T, E]` -> (x, cache). `index`: the layer (int, or int32 `[]` in a scan);
        `vecs`: its `LAYER_VECTORS` (norm weights, QKV bias); `window`: its sliding window (0: global);
        `rope`: (cos, sin) of its RoPE base; `linear(h, name)`: its product `name`."""
        cfg = self.cfg
        (H, K, D), T = heads, x.shape[0]
        norm = lambda h, name: rms_norm(h, vecs[name], cfg.rms_norm_eps, cfg.norm_offset)
        with jax.named_scope("attention"):
            qkv = linear(norm(x, "attn_norm"), "wqkv")
            if "bqkv" in vecs:
                qkv = qkv + vecs["bqkv"]
            q, k, v = jnp.split(qkv, [H * D, (H + K) * D], axis=-1)
            q, k = q.reshape(T, H, D), k.reshape(T, K, D)
            if cfg.qk_norm:
                q, k = norm(q, "q_norm"), norm(k, "k_norm")
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
            spec = LayerAttention(window, cfg.sm_scale or 1.0 / math.sqrt(D), cfg.attn_softcap)
            out, cache = attend(q, k, v.reshape(T, K, D), index, cache, spec)
            h = reduce(linear(out.reshape(T, H * D).astype(x.dtype), "wo"))
            x = x + (norm(h, "post_attn_norm") if cfg.sandwich_norms else h)
        with jax.named_scope("mlp"):
            h = norm(x, "mlp_norm")
            if cfg.num_experts:
                h = reduce(self._experts(h, vecs))
            else:
                h = reduce(linear(self._act_gated(linear(h, "w_gate_up")), "w_down"))
            x = x + (norm(h, "post_mlp_norm") if cfg.sandwich_norms else h)
        return x, cache

    def _act_gated(self, gate_up: jax.Array) -> jax.Array:
        """act(gate) * up of the gated MLP's `[..., 2F]` projection (SwiGLU, or GeGLU with `gelu_tanh`)."""
        gate, up = jnp.split(gate_up, 2, axis=-1)
        act = numerics.silu(gate) if self.cfg.hidden_act == "silu" else jax.nn.gelu(gate, approximate=True)
        return act * up

    def _experts(self, h: jax.Array, vecs: dict) -> jax.Array:
        """A mixture of experts' output `[T, E]` for its input h `[T, E]` (Shazeer et al. 2017; Mixtral, Jiang et
        al. 2024, §2.1): the router's float32 softmax over the X experts, each token's top k (renormalized over
        them with `norm_topk_prob`), the (token, expert) pairs sorted by expert so each expert's rows are one
        contiguous group of a ragged dot (`jax.lax.ragged_dot`: T * k rows whatever the routing, so one compiled
        program serves every step), the weighted rows summed back per token."""
        T, k = h.shape[0], self.cfg.num_experts_per_tok
        probs = jax.nn.softmax((h @ vecs["router"]).astype(jnp.float32), axis=-1)  # [T, X]
        weights, experts = jax.lax.top_k(probs, k)  # [T, k]
        if self.cfg.norm_topk_prob:
            weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        flat = experts.reshape(-1)
        order = jnp.argsort(flat, stable=True)  # [T * k], expert by expert
        rows = h[order // k]
        sizes = jnp.bincount(flat, length=self.cfg.num_experts).astype(jnp.int32)
        act = self._act_gated(jax.lax.ragged_dot(rows, vecs["experts_gate_up"], sizes))
        out = jax.lax.ragged_dot(act.astype(h.dtype), vecs["experts_down"], sizes).astype(jnp.float32)
        out = out * weights.reshape(-1)[order][:, None]
        return jnp.zeros((T, h.shape[1]), jnp.float32).at[order // k].add(out).astype(h.dtype)

    def logits(self, hidden: jax.Array) -> jax.Array:
        """Projects hidden states `[N, E]` to float32 logits `[N, V]`.

        With `cfg.head_vocab_size`, only the `head_ids` columns are computed; the
        others are -1e30 (probability exactly 0 after softmax, finite under temperature).
        """
        out = self.head_logits(hidden)
        if not self.cfg.head_vocab_size:
            return out
        full = jnp.full((hidden.shape[0], self.cfg.vocab_size), -1e30, jnp.float32)
        return full.at[:, self.head_ids[...]].set(out, indices_are_sorted=True, unique_indices=True)

    def head_logits(self, hidden: jax.Array) -> jax.Array:
        """float32 logits `[N, Vh]` of hidden states `[N, E]` over the head's own columns: `head_ids` with
        `cfg.head_vocab_size` (Vh of them, in that order), else the whole vocabulary; soft-capped with
        `cfg.final_softcap`."""
        if self.mesh is not None:
            out = self._sharded_logits(hidden)
        elif (weight := self._kernel_weight(self, "head", hidden)) is not None:
            out = packed_product(hidden, weight)
        elif self.cfg.head_vocab_size:
            out = jax.lax.dot_general(hidden, self.head[...], (((1,), (1,)), ((), ()))).astype(jnp.float32)
        else:
            out = self._full_head_dot(hidden)
        return softcap(out, self.cfg.final_softcap)

    def _sharded_logits(self, hidden: jax.Array) -> jax.Array:
        """`logits` of a vocabulary split over the mesh: each device's slice of the head, gathered whole."""
        graphdef, state = nnx.split(self)

        def body(state, hidden):
            local = nnx.merge(graphdef, state)._full_head_dot(hidden)
            return jax.lax.all_gather(local, TP_AXIS, axis=1, tiled=True)

        # check_vma off: the tiled all_gather's result is the same on every device, which the check cannot see.
        logits = jax.shard_map(body, mesh=self.mesh, in_specs=(_state_specs(state), P()), out_specs=P(),
                               check_vma=False)(state, hidden)
        return logits[:, :self.cfg.vocab_size]

    def _full_head_dot(self, hidden: jax.Array) -> jax.Array:
        """float32 logits `[N, V]` of the whole vocabulary by XLA's dot."""
        if self.cfg.tie_word_embeddings:
            # Contract against the [V, E] embedding directly: `embed.T` makes
            # XLA:CPU take a slower path (measured 6.9 vs 4.3 ms at S=1).
            out = jax.lax.dot_general(hidden, self.embed[...], (((1,), (1,)), ((), ())))
        else:
            out = hidden @ self.lm_head[...]
        return out.astype(jnp.float32)

    def target_logprobs(self, hidden: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Scoring: float32 `[N]` log-softmax of the logits of hidden states `[N, E]` at int32 `targets` `[N]`,
        int32 `[N]` argmax of each row and float32 `[N]` the argmax's log-softmax. On the AMX path (full
        vocabulary) the head and the reduction are one kernel that never writes the `[N, V]` logits (run
        twice there, the second time at the argmax); else `logits` then `cpu_kernels.log_softmax_gather`
        (AVX-512) or its jnp reference."""
        weight = self._kernel_weight(self, "head", hidden)
        if isinstance(weight, cpu_kernels.AmxWeight) and not (self.cfg.head_vocab_size or self.cfg.final_softcap):
            logprobs, argmax = cpu_kernels.amx_head_log_softmax(hidden, weight, targets)
            return logprobs, argmax, cpu_kernels.amx_head_log_softmax(hidden, weight, argmax)[0]
        logits = self.logits(hidden)
        native = jax.default_backend() == "cpu" and cpu_kernels.cpu_features() == "avx512"
        reduce = cpu_kernels.log_softmax_gather if native else cpu_kernels.log_softmax_gather_reference
        return reduce(logits, targets)

    def dense_logits(self, token_ids: jax.Array) -> jax.Array:
        """Unpaged causal forward of a padded batch `[S, Lq]` -> float32 logits `[S, Lq, V]`.

        The reference the paged step is tested against; it keeps no cache.
        """
        S, Lq = token_ids.shape
        positions = jnp.tile(jnp.arange(Lq, dtype=jnp.int32), S)
        segments = jnp.repeat(jnp.arange(S, dtype=jnp.int32), Lq)
        hidden, _ = self(token_ids.reshape(-1), positions,
                         lambda q, k, v, _, c, spec: (dense_attention(q, k, v, positions, segments, spec), c), None)
        return self.logits(hidden).reshape(S, Lq, -1)


def abstract_model(cfg: ModelConfig, mesh: Mesh | AbstractMesh) -> tuple[nnx.GraphDef, object]:
    """The graphdef of `Llama(cfg)` split over `mesh` and its state as `jax.ShapeDtypeStruct`s carrying each
    weight's sharding, without allocating a weight: for lowering a large model's step programs where it
    does not fit (an `AbstractMesh` lowers for devices this host does not have)."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0), mesh=mesh)))
    specs = _state_specs(state)
    return graphdef, jax.tree.map(
        lambda x, spec: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec)), state, specs)


def _state_specs(state) -> object:
    """`state`'s structure with each weight's `tp_spec` (by its attribute name) at the leaves."""
    def spec(path, _):
        names = [getattr(k, "key", getattr(k, "name", None)) for k in path]
        return tp_spec(next((n for n in reversed(names) if isinstance(n, str) and n != "value"), ""))

    return jax.tree_util.tree_map_with_path(spec, state)
