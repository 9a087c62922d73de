"""The EAGLE draft head: one decoder layer over the target's own features.

Source: Li et al. 2024, *EAGLE: Speculative Sampling Requires Rethinking
Feature Uncertainty*, §3-4. The target's feature at position i is its final
hidden state there (after the final norm, what its LM head reads), f_i. The
head takes the pair (f_{i-1}, token x_i), fuses it with one linear layer

    g_i = [embed(x_i), f_{i-1}] @ fc        (fc `[2E, E]`)

runs a Llama decoder layer (the paper's one, or more: `training.eagle
--num_layers`; its own paged KV: causal attention over the earlier pairs)
and predicts f_i; the target's LM head, restricted to
`head_ids` (`ModelConfig.head_vocab_size`; other tokens have probability
exactly 0, so verify stays exact), turns the prediction into the draft
distribution of x_{i+1}. Drafting feeds the head its own predictions: f-hat_i
and the token drawn from it give f-hat_{i+1}, and so on.

The head's weights are an ordinary few-layer `Llama` (`body`, its embedding the
target's, its final norm initialised from the target's) plus `fc`, stored as
`FC` in the params dict.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from model.config import ModelConfig
from model.llama import LAYER_PARAMS, Llama
from model.ops import AttendFn
from model.packed import keep_packed

FC = "eagle_fc"  # params key of the fusion layer, float `[2E, E]`


class EagleHead(nnx.Module):
    """The EAGLE head for one target.

    Args:
      cfg: the head's config: the target's with `num_layers=1` (or a few) and usually a
        `head_vocab_size`.
      params: `model.llama.param_specs(cfg)` arrays plus `FC`.
    Raises:
      ValueError: `FC` missing or of the wrong shape, or the params do not match `cfg`.
    """

    def __init__(self, cfg: ModelConfig, params: dict[str, np.ndarray]):
        params = dict(params)
        fc = params.pop(FC, None)
        E = cfg.hidden_size
        if fc is None or tuple(fc.shape) != (2 * E, E):
            raise ValueError(f"an EAGLE head needs {FC} of shape {(2 * E, E)}, got "
                             f"{None if fc is None else tuple(fc.shape)}")
        self.body = Llama(cfg, params=params)
        self.fc = nnx.Param(jnp.asarray(np.asarray(fc).astype(jnp.dtype(cfg.dtype))))

    @property
    def cfg(self) -> ModelConfig:
        return self.body.cfg

    def pack_linears(self, dtype: str, max_rows: int = 16, amx_passes: int | None = None, isa: str = "") -> int:
        """The CPU kernels' packed copies of the layer, the head and `fc` (see `Llama.pack_linears`)."""
        total = self.body.pack_linears(dtype, max_rows, amx_passes, isa)
        return total + keep_packed(self, "fc", np.asarray(self.fc[...], np.float32), dtype, amx_passes, source="fc",
                                   isa=isa)

    def __call__(self, token_ids: jax.Array, features: jax.Array, positions: jax.Array, attend: AttendFn,
                 cache: object) -> tuple[jax.Array, object]:
        """Predicted features `[T, E]` at each token's position, and the updated cache.

        Args:
          token_ids: int32 `[T]`, x_i.
          features: `[T, E]`, f_{i-1} (the target's, or the head's own prediction while drafting;
            zeros at position 0).
          positions, attend, cache: as `Llama.__call__`.
        """
        e = jnp.take(self.body.embed[...], token_ids, axis=0)
        fused = self.body._linear(jnp.concatenate([e, features.astype(e.dtype)], axis=-1), self, "fc")
        return self.body(token_ids, positions, attend, cache, inputs_embeds=fused)

    def logits(self, hidden: jax.Array) -> jax.Array:
        """float32 `[N, V]` draft logits of predicted features `[N, E]` (-1e30 outside `head_ids`)."""
        return self.body.logits(hidden)

    def top_k(self, hidden: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
        """The head's `k` most likely tokens for predicted features `[N, E]`, most likely first: (float32
        `[N, k]` log-probabilities, int32 `[N, k]` token ids). Reads the `head_ids` columns alone (the others
        have probability 0): a third of the vocabulary to normalize and search for this head."""
        logprobs, idx = jax.lax.top_k(jax.nn.log_softmax(self.body.head_logits(hidden), axis=-1), k)
        if self.cfg.head_vocab_size:
            idx = self.body.head_ids[...][idx]
        return logprobs, idx.astype(jnp.int32)


def deepen(cfg: ModelConfig, params: dict[str, np.ndarray], target, num_layers: int
           ) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """A head of `num_layers` layers that computes what the head (`cfg`, `params`: `EagleHead` params, layer
    weights `[L, ...]`) computes, for the target (`checkpoints.LoadedModel`) it was trained on.

    The new layers, appended after its own, are copies of the target's last layers with `wo` and `w_down`
    zero, so each adds nothing to the residual stream until trained (zero-initialised residual branches, as
    in Zhang et al. 2019, *Fixup Initialization*). Returns (config, params). Raises ValueError when the
    head already has more than `num_layers` layers.
    """
    have = cfg.num_layers
    if num_layers < have:
        raise ValueError(f"the head has {have} layers; deepening cannot remove any (asked for {num_layers})")
    n = target.config.num_layers
    extra = list(range(n - (num_layers - have), n))
    out = dict(params)
    for k in LAYER_PARAMS:
        if k in params:
            new = np.asarray(target.params[k], np.float32)[extra]
            out[k] = np.concatenate([params[k], np.zeros_like(new) if k in ("wo", "w_down") else new])
    windows = cfg.layer_windows + tuple(target.config.window(i) for i in extra) if cfg.layer_windows else ()
    return cfg.replace(num_layers=num_layers, layer_windows=windows), out
