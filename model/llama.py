"""The Llama-family decoder (Llama 2/3, Qwen2, Mistral, SmolLM2) in Flax NNX.

Checkpoints declare layer weights stacked along a leading `L` axis
(`param_specs`); the module keeps one `Block` per layer. The forward pass reads and writes a paged KV pool through the attention function
given to it (paged in the engine, dense in tests).
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import cpu_kernels
from model.config import ModelConfig


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
    if cfg.qkv_bias:
        specs["bq"] = ((L, H * D), ("layers", "q_heads"))
        specs["bk"] = ((L, K * D), ("layers", "kv_heads"))
        specs["bv"] = ((L, K * D), ("layers", "kv_heads"))
    if not cfg.tie_word_embeddings:
        specs["lm_head"] = ((E, V), ("embed", "vocab"))
    if cfg.head_vocab_size:
        specs["head_ids"] = ((cfg.head_vocab_size,), ("head_vocab",))  # int32 token ids, ascending
    return specs


LAYER_PARAMS = ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down", "bq", "bk", "bv")


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Inverse RoPE frequencies, float32 `[D/2]`, with Llama-3 scaling if configured.

    Source: Su et al. 2021 (RoFormer) §3.4; Llama-3 scaling as in Meta's
    reference `apply_scaling` (Llama 3.1 release).
    """
    D = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, D, 2, dtype=np.float64) / D))
    s = cfg.rope_scaling
    if s is not None:
        low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
        high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / s.factor, inv)
        smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
            s.high_freq_factor - s.low_freq_factor)
        smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = np.where(medium, smoothed, scaled)
    return inv.astype(np.float32)


def rope_angles(positions: jax.Array, inv_freq: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos and sin of `positions [T] x inv_freq [D/2]`, each float32 `[T, 1, D/2]`.

    Computed once per step and shared by every layer (XLA does not merge the
    per-layer copies: 60 sin/cos evaluations per step otherwise).
    """
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    return jnp.cos(freqs)[:, None, :], jnp.sin(freqs)[:, None, :]


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotates `x [T, N, D]` by the angles of `rope_angles` (half-split layout, as HF Llama)."""
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * weight.astype(jnp.float32)).astype(x.dtype)


# attend(q [T,H,D], k [T,K,D], v [T,K,D], layer, cache) -> (out [T,H,D], cache)
AttendFn = Callable[[jax.Array, jax.Array, jax.Array, jax.Array, object], tuple[jax.Array, object]]


def keep_packed(owner, name: str, w: np.ndarray, dtype: str, amx_passes: int | None) -> int:
    """Stores `owner`'s weight `name` (`w` `[K, N]`) in the skinny kernel's panels (`{name}_panels`,
    `{name}_scales`) and, with `amx_passes`, in AMX tiles (`{name}_amx_hi`, `{name}_amx_lo`); returns their bytes."""
    p = cpu_kernels.pack(w, dtype)
    setattr(owner, f"{name}_panels", nnx.Variable(p.panels))
    setattr(owner, f"{name}_scales", nnx.Variable(p.scales))
    total = p.nbytes
    if amx_passes is not None:
        a = cpu_kernels.pack_amx(w, amx_passes)
        setattr(owner, f"{name}_amx_hi", nnx.Variable(a.hi))
        setattr(owner, f"{name}_amx_lo", nnx.Variable(a.lo))
        total += a.nbytes
    return total


class Block(nnx.Module):
    """One decoder layer's weights, sliced from the stacked `param_specs` arrays.

    Q, K and V (and gate and up) projections are stored concatenated, so a
    layer runs 4 matmuls instead of 7: fewer, larger dots keep XLA:CPU closer
    to memory bandwidth at decode batch sizes.
    """

    def __init__(self, w: dict[str, np.ndarray]):
        self.attn_norm = nnx.Param(jnp.asarray(w["attn_norm"]))
        self.wqkv = nnx.Param(jnp.asarray(np.concatenate([w["wq"], w["wk"], w["wv"]], axis=-1)))
        if "bq" in w:
            self.bqkv = nnx.Param(jnp.asarray(np.concatenate([w["bq"], w["bk"], w["bv"]], axis=-1)))
        self.wo = nnx.Param(jnp.asarray(w["wo"]))
        self.mlp_norm = nnx.Param(jnp.asarray(w["mlp_norm"]))
        self.w_gate_up = nnx.Param(jnp.asarray(np.concatenate([w["w_gate"], w["w_up"]], axis=-1)))
        self.w_down = nnx.Param(jnp.asarray(w["w_down"]))


class Llama(nnx.Module):
    """Weights of one Llama-family decoder and its forward pass.

    Build it with random weights (`Llama(cfg, rngs=nnx.Rngs(0))`) or from a
    checkpoint's arrays (`Llama(cfg, params={name: array})`, names and shapes
    from `param_specs`). Layers are separate modules run by an unrolled loop:
    on XLA:CPU, slicing stacked weights inside `lax.scan` copies every layer's
    weights each step (measured 2x slower decode).
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs | None = None,
                 params: dict[str, np.ndarray] | None = None):
        self.cfg = cfg
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
                weights[name] = np.asarray(value).astype(dtype)
            elif name.endswith("norm"):
                weights[name] = np.ones(shape, dtype)
            else:
                weights[name] = np.asarray(0.02 * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)
        self.embed = nnx.Param(jnp.asarray(weights["embed"]))
        self.final_norm = nnx.Param(jnp.asarray(weights["final_norm"]))
        if not cfg.tie_word_embeddings:
            self.lm_head = nnx.Param(jnp.asarray(weights["lm_head"]))
        if cfg.head_vocab_size:  # frozen (not Params): the head rows are the embedding's at build time
            self.head_ids = nnx.Variable(jnp.asarray(weights["head_ids"]))
            head = weights["embed"] if cfg.tie_word_embeddings else weights["lm_head"].T
            self.head = nnx.Variable(jnp.asarray(head[weights["head_ids"]]))
        self.layers = nnx.List([
            Block({n: weights[n][i] for n in LAYER_PARAMS if n in weights})
            for i in range(cfg.num_layers)])
        self.inv_freq = nnx.Variable(jnp.asarray(rope_inv_freq(cfg)))

    # ---- the CPU kernel for skinny products -------------------------------------------------

    LINEARS = ("wqkv", "wo", "w_gate_up", "w_down")

    def pack_linears(self, dtype: str, max_rows: int = 16, amx_passes: int | None = None) -> int:
        """Keeps a copy of every projection and of the output head in the native CPU kernels' layouts; from
        then on products over at most `max_rows` tokens use the skinny kernel (`cpu_kernels.pack`, weights
        in `dtype`: "float32", "bfloat16" or "int8"), larger ones the AMX kernel when `amx_passes` is given
        (`cpu_kernels.pack_amx`: 3 passes, close to fp32; 1, bf16), else XLA's dot on the original weights
        (the choice is made at trace time from static shapes).

        Returns the bytes the packed copies take. Call before `nnx.split`.
        """
        total = 0
        for lp in self.layers:
            for name in self.LINEARS:
                total += keep_packed(lp, name, np.asarray(getattr(lp, name)[...], np.float32), dtype, amx_passes)
        if self.cfg.head_vocab_size:
            head = np.asarray(self.head[...], np.float32).T
        elif self.cfg.tie_word_embeddings:
            head = np.asarray(self.embed[...], np.float32).T
        else:
            head = np.asarray(self.lm_head[...], np.float32)
        total += keep_packed(self, "head", head, dtype, amx_passes)
        self.skinny_rows = max_rows
        return total

    def _skinny(self, x: jax.Array) -> bool:
        return 0 < x.shape[0] <= getattr(self, "skinny_rows", 0)

    def _out_width(self, owner, name: str) -> int:
        """Output columns of `owner`'s weight `name` (the head's: its vocabulary)."""
        return (self.cfg.head_vocab_size or self.cfg.vocab_size) if name == "head" else getattr(owner, name)[...].shape[-1]

    def _packed(self, owner, name: str) -> cpu_kernels.PackedWeight:
        panels = getattr(owner, f"{name}_panels")[...]
        return cpu_kernels.PackedWeight(panels, getattr(owner, f"{name}_scales")[...], self._out_width(owner, name))

    def _amx(self, owner, name: str) -> cpu_kernels.AmxWeight | None:
        """The AMX copy of `owner`'s weight `name`, or None where there is none."""
        if not hasattr(owner, f"{name}_amx_hi"):
            return None
        return cpu_kernels.AmxWeight(getattr(owner, f"{name}_amx_hi")[...], getattr(owner, f"{name}_amx_lo")[...],
                                     self._out_width(owner, name))

    def _linear(self, x: jax.Array, lp: Block, name: str) -> jax.Array:
        """x `[T, in]` @ the layer's weight `name` `[in, out]`: the skinny CPU kernel for skinny x, else the AMX
        kernel where the weight has an AMX copy, else XLA's dot."""
        if self._skinny(x):
            return cpu_kernels.skinny_matmul(x, self._packed(lp, name)).astype(x.dtype)
        amx = self._amx(lp, name)
        if amx is not None:
            return cpu_kernels.amx_matmul(x, amx).astype(x.dtype)
        return x @ getattr(lp, name)[...]

    def to_params(self) -> dict[str, np.ndarray]:
        """The weights as `param_specs` arrays (numpy, the model's dtype): the inverse of `Llama(cfg, params=...)`.

        Splits the fused QKV and gate/up projections back into their parts.
        """
        cfg = self.cfg
        q, kv, F = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
        stack = lambda name: np.stack([np.asarray(getattr(lp, name)[...]) for lp in self.layers])
        wqkv, gate_up = stack("wqkv"), stack("w_gate_up")
        params = {"embed": np.asarray(self.embed[...]), "final_norm": np.asarray(self.final_norm[...]),
                  "attn_norm": stack("attn_norm"), "mlp_norm": stack("mlp_norm"), "wo": stack("wo"),
                  "w_down": stack("w_down"), "wq": wqkv[..., :q], "wk": wqkv[..., q:q + kv], "wv": wqkv[..., q + kv:],
                  "w_gate": gate_up[..., :F], "w_up": gate_up[..., F:]}
        if cfg.qkv_bias:
            bqkv = stack("bqkv")
            params.update(bq=bqkv[..., :q], bk=bqkv[..., q:q + kv], bv=bqkv[..., q + kv:])
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
          cache: the KV cache pytree threaded through the layers (e.g. the KV pool).
          inputs_embeds: `[T, E]` to feed the first layer instead of the token embeddings (the EAGLE head).
        Returns:
          (hidden states `[T, E]` after the final norm, updated cache).
        """
        cfg = self.cfg
        H, K, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        T = token_ids.shape[0]
        cos, sin = rope_angles(positions, self.inv_freq[...])
        x = jnp.take(self.embed[...], token_ids, axis=0) if inputs_embeds is None else inputs_embeds
        for index, lp in enumerate(self.layers):
            with jax.named_scope("attention"):
                h = rms_norm(x, lp.attn_norm[...], cfg.rms_norm_eps)
                qkv = self._linear(h, lp, "wqkv")
                if cfg.qkv_bias:
                    qkv = qkv + lp.bqkv[...]
                q, k, v = jnp.split(qkv, [H * D, (H + K) * D], axis=-1)
                q = apply_rope(q.reshape(T, H, D), cos, sin)
                k = apply_rope(k.reshape(T, K, D), cos, sin)
                out, cache = attend(q, k, v.reshape(T, K, D), index, cache)
                x = x + self._linear(out.reshape(T, H * D).astype(x.dtype), lp, "wo")
            with jax.named_scope("mlp"):
                h = rms_norm(x, lp.mlp_norm[...], cfg.rms_norm_eps)
                gate, up = jnp.split(self._linear(h, lp, "w_gate_up"), 2, axis=-1)
                x = x + self._linear(jax.nn.silu(gate) * up, lp, "w_down")
        return rms_norm(x, self.final_norm[...], cfg.rms_norm_eps), cache

    def logits(self, hidden: jax.Array) -> jax.Array:
        """Projects hidden states `[N, E]` to float32 logits `[N, V]`.

        With `cfg.head_vocab_size`, only the `head_ids` columns are computed; the
        others are -1e30 (probability exactly 0 after softmax, finite under temperature).
        """
        amx = self._amx(self, "head")
        if self._skinny(hidden):
            out = cpu_kernels.skinny_matmul(hidden, self._packed(self, "head"))
        elif amx is not None:
            out = cpu_kernels.amx_matmul(hidden, amx)
        elif self.cfg.head_vocab_size:
            out = jax.lax.dot_general(hidden, self.head[...], (((1,), (1,)), ((), ()))).astype(jnp.float32)
        else:
            return self._full_head_dot(hidden)
        if not self.cfg.head_vocab_size:
            return out
        full = jnp.full((hidden.shape[0], self.cfg.vocab_size), -1e30, jnp.float32)
        return full.at[:, self.head_ids[...]].set(out, indices_are_sorted=True, unique_indices=True)

    def _full_head_dot(self, hidden: jax.Array) -> jax.Array:
        """float32 logits `[N, V]` of the whole vocabulary by XLA's dot."""
        if self.cfg.tie_word_embeddings:
            # Contract against the [V, E] embedding directly: `embed.T` makes
            # XLA:CPU take a slower path (measured 6.9 vs 4.3 ms at S=1).
            out = jax.lax.dot_general(hidden, self.embed[...], (((1,), (1,)), ((), ())))
        else:
            out = hidden @ self.lm_head[...]
        return out.astype(jnp.float32)

    def target_logprobs(self, hidden: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Scoring: float32 `[N]` log-softmax of the logits of hidden states `[N, E]` at int32 `targets` `[N]`,
        and int32 `[N]` argmax of each row. On the AMX path (full vocabulary) the head and the reduction are
        one kernel that never writes the `[N, V]` logits; else `logits` then `cpu_kernels.log_softmax_gather`
        (AVX-512) or its jnp reference."""
        amx = self._amx(self, "head")
        if amx is not None and not self.cfg.head_vocab_size and not self._skinny(hidden):
            return cpu_kernels.amx_head_log_softmax(hidden, amx, targets)
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
                         lambda q, k, v, _, c: (dense_attention(q, k, v, positions, segments), c), None)
        return self.logits(hidden).reshape(S, Lq, -1)


def dense_attention(q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array,
                    segments: jax.Array) -> jax.Array:
    """Causal attention over `[T, *, D]` tokens, masked to the same segment."""
    T, H, D = q.shape
    G = H // k.shape[1]
    qg = q.reshape(T, k.shape[1], G, D).astype(jnp.float32)
    s = jnp.einsum("tkgd,ukd->kgtu", qg, k.astype(jnp.float32)) / math.sqrt(D)
    mask = (segments[:, None] == segments[None, :]) & (positions[None, :] <= positions[:, None])
    p = jax.nn.softmax(jnp.where(mask, s, -jnp.inf), axis=-1)
    return jnp.einsum("kgtu,ukd->tkgd", p, v.astype(jnp.float32)).reshape(T, H, D).astype(q.dtype)
