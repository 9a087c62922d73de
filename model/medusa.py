"""Medusa heads: residual blocks on the target's last hidden state, each guessing a token further ahead.

Source: Cai et al. 2024, *Medusa: Simple LLM Inference Acceleration Framework
with Multiple Decoding Heads*, §2.1 (Medusa-1: the target stays frozen).
Head k (1..G) reads the target's final hidden state h_t (after the final norm,
what its LM head reads) at the position whose logits gave the pending token
x_{t+1}, and guesses x_{t+1+k}:

    z_k = h_t + SiLU(h_t @ W_k + b_k)        (W_k `[E, E]`, zero at initialisation)
    logits_k = z_k @ head.T                  (the target's tied embedding rows at `head_ids`)

Each head's top-n tokens are its candidates; a static sparse tree
(`medusa_tree`, §2.1.2 and Appendix: the nodes of highest estimated accept
probability from each head's measured top-i accuracy) combines them into one
token tree verified in a single target pass. The candidates are a
deterministic function of h_t, so the coupled tree verify keeps the output
exactly the target's (`engine.spec.tree_verify.verify_tree_coupled`).
"""

from __future__ import annotations

import heapq

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from model.config import ModelConfig
from model.packed import keep_packed, packed_product, packed_weight

W = "medusa_w"  # float `[G, E, E]`
B = "medusa_b"  # float `[G, E]`
ACCURACY = "medusa_accuracy"  # float32 `[G, n]`: P(head k's rank-i token is the target's), held-out
HEAD_IDS = "head_ids"  # int32 `[Vh]`, ascending: the tokens the heads can guess
READOUT = "medusa_readout"  # `[V, E]`: the target's output head (not stored: `target_readout`)


def target_readout(cfg: ModelConfig, params: dict[str, np.ndarray]) -> np.ndarray:
    """The target's output head as `[V, E]` rows: its embedding when tied, else `lm_head` `[E, V]` transposed."""
    return params["embed"] if cfg.tie_word_embeddings else np.asarray(params["lm_head"]).T


class MedusaHeads(nnx.Module):
    """G Medusa heads for one target.

    Args:
      cfg: the target's config (width, dtype).
      params: `W`, `B`, `ACCURACY`, `HEAD_IDS` and `READOUT` (`target_readout`).
    Raises:
      ValueError: a missing tensor or one of the wrong shape.
    """

    def __init__(self, cfg: ModelConfig, params: dict[str, np.ndarray]):
        E = cfg.hidden_size
        missing = [n for n in (W, B, ACCURACY, HEAD_IDS, READOUT) if n not in params]
        if missing:
            raise ValueError(f"Medusa heads need {missing}")
        w, b, ids = np.asarray(params[W]), np.asarray(params[B]), np.asarray(params[HEAD_IDS])
        G = w.shape[0]
        if w.shape != (G, E, E) or b.shape != (G, E) or np.asarray(params[ACCURACY]).shape[0] != G:
            raise ValueError(f"Medusa heads of width {E}: {W} {w.shape}, {B} {b.shape}, "
                             f"{ACCURACY} {np.asarray(params[ACCURACY]).shape}")
        if ids.ndim != 1 or len(np.unique(ids)) != len(ids) or ids.min() < 0 or ids.max() >= cfg.vocab_size:
            raise ValueError(f"{HEAD_IDS}: need distinct token ids below {cfg.vocab_size}")
        dtype = jnp.dtype(cfg.dtype)
        self.cfg = cfg
        self.w = nnx.Param(jnp.asarray(w.astype(dtype)))
        self.b = nnx.Param(jnp.asarray(b.astype(dtype)))
        ids = np.sort(ids).astype(np.int32)
        self.head_ids = nnx.Variable(jnp.asarray(ids))
        self.head = nnx.Variable(jnp.asarray(np.asarray(params[READOUT])[ids].astype(dtype)))

    @property
    def num_heads(self) -> int:
        return self.w.shape[0]

    def pack_linears(self, dtype: str, max_rows: int, amx_passes: int | None, isa: str = "") -> int:
        """Keeps the heads' projections (as one `[E, G E]` weight) and their readout (`[E, Vh]`) in the native
        CPU kernels' layouts (`engine.step.kernel_layout`'s arguments: AMX tiles with `amx_passes`, else the
        skinny kernel's panels in `dtype`), so `logits` runs its two products there instead of XLA's dot (1.3 ms
        a step for SmolLM2's 8,192-token readout). Returns the bytes the copies take."""
        G, E = self.w.shape[:2]
        proj = np.asarray(self.w[...], np.float32).transpose(1, 0, 2).reshape(E, G * E)
        self.kernel_rows = 0 if amx_passes else max_rows
        return (keep_packed(self, "proj", proj, dtype, amx_passes, isa=isa)
                + keep_packed(self, "readout", np.asarray(self.head[...], np.float32).T, dtype, amx_passes, isa=isa))

    def _product(self, x: jax.Array, name: str, n: int) -> jax.Array:
        """x `[T, in]` @ the packed weight `name` (`n` output columns)."""
        return packed_product(x, packed_weight(self, name, n))

    def logits(self, hidden: jax.Array) -> jax.Array:
        """float32 `[N, G, Vh]`: each head's logits over `head_ids` from hidden states `[N, E]`."""
        N, (G, E) = hidden.shape[0], self.w.shape[:2]
        rows = getattr(self, "kernel_rows", None)  # 0: AMX, any row count
        if rows is None or N * G > rows > 0:
            return medusa_logits(self.w[...], self.b[...], self.head[...], hidden)
        h = hidden.astype(jnp.float32)
        z = h[:, None, :] + jax.nn.silu(self._product(h, "proj", G * E).reshape(N, G, E) + self.b[...][None])
        return self._product(z.reshape(N * G, E), "readout", self.head.shape[0]).reshape(N, G, -1)

    def candidates(self, hidden: jax.Array, n: int) -> jax.Array:
        """int32 `[N, G, n]`: each head's `n` most likely tokens, most likely first."""
        _, idx = jax.lax.top_k(self.logits(hidden), n)
        return self.head_ids[...][idx]


def medusa_logits(w: jax.Array, b: jax.Array, head: jax.Array, hidden: jax.Array) -> jax.Array:
    """float32 `[N, G, Vh]` = (h + SiLU(h W_k + b_k)) @ head.T for weights `w` `[G, E, E]`, `b` `[G, E]`,
    readout rows `head` `[Vh, E]` and hidden states `hidden` `[N, E]` (the training loss uses it too)."""
    h = hidden.astype(w.dtype)
    z = h[:, None, :] + jax.nn.silu(jnp.einsum("ne,kef->nkf", h, w) + b[None])
    return jnp.einsum("nkf,vf->nkv", z, head).astype(jnp.float32)


def medusa_tree(accuracy: np.ndarray, num_nodes: int) -> tuple[list[int], list[int], list[int]]:
    """The static sparse tree of `num_nodes` nodes with the highest estimated probability of acceptance.

    A node is a path of candidate ranks (r_1, ..., r_d): head 1's rank-r_1 token,
    then head 2's rank-r_2 token, ...; its estimated probability is the product of
    `accuracy[k, r_k]` (head k's rank-r token is the target's, measured on held-out
    data), as Medusa builds its trees (Cai et al. 2024, §2.1.2). Nodes are taken
    best-first, so every prefix of the list is itself a tree (parents come first),
    the most probable nodes first.

    Args:
      accuracy: float `[G, n]`, G heads, n candidates each.
      num_nodes: nodes below the root (1 .. n + n^2 + ... + n^G).
    Returns:
      (parents, heads, ranks), lists of `num_nodes` ints: node i's parent (0 the
      root, j the j-th node, 1-based), the head (0-based) and rank its token comes from.
    Raises:
      ValueError: `num_nodes` outside what the heads can fill.
    """
    accuracy = np.asarray(accuracy, np.float64)
    G, n = accuracy.shape
    if not 1 <= num_nodes <= sum(n ** d for d in range(1, G + 1)):
        raise ValueError(f"a Medusa tree of {G} heads x {n} candidates cannot have {num_nodes} nodes")
    parents, heads, ranks = [], [], []
    frontier = [(-accuracy[0, r], (r,), 0) for r in range(n)]  # (-probability, rank path, parent node)
    heapq.heapify(frontier)
    while len(parents) < num_nodes:
        neg, path, parent = heapq.heappop(frontier)
        parents.append(parent)
        heads.append(len(path) - 1)
        ranks.append(path[-1])
        node = len(parents)
        if len(path) < G:
            for r in range(n):
                heapq.heappush(frontier, (neg * accuracy[len(path), r], (*path, r), node))
    return parents, heads, ranks
