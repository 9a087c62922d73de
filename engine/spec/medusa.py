"""Medusa heads as a proposer: a static token tree filled on the device from the heads' candidates.

Source: Cai et al. 2024, *Medusa* (§2.1 heads, §2.1.2 tree attention).
"""


from __future__ import annotations

import functools
from collections.abc import Callable

import jax.numpy as jnp
from flax import nnx

import numpy as np

from engine.spec.config import SpeculationConfig
from engine.spec.draft import DeviceProposer
from engine.step import KVPool, StepBatch, Weights, kernel_layout, step_program
from model import medusa
from scheduler.packing import tree_depths
from scheduler.request import Request
from scheduler.scheduler import StepPlan
from engine.spec.programs import (FeaturePool, SpecBatch, features_before, target_verify_tree)


class MedusaProposer(DeviceProposer):
    """Medusa heads (`model.medusa.MedusaHeads`) guessing from the target's features, inside the step program.

    Every drafting row verifies the same static tree (`model.medusa.medusa_tree`
    from the heads' measured top-i accuracies: `tree_nodes` nodes, or without
    trees the chain of each head's top token), its tokens filled on the device
    from the heads' candidates (`engine.spec.medusa.make_medusa_step`). The
    target's hidden state at every KV slot is kept in a `FeaturePool`; a step
    without the heads' program leaves it behind for its requests, which then
    stop drafting (as with a draft model). The candidates are a deterministic
    function of the target's state and the verify is the coupled tree verify,
    so the output is the target's whatever is drafted (`output_independent`).

    Args:
      heads: a `checkpoints.LoadedModel` with `model.medusa.W` in its params (`checkpoints.draft.load_draft`).
      config: the tree (`tree_nodes`), its depth cap (`num_speculative_tokens`) and the adaptive settings.
      target_config: the target's `ModelConfig`.
      engine_config: the `EngineConfig`; on CPU the heads' products then run in the native kernels, with
        weights in its `draft_kernel_dtype` (default: the heads' `stored_dtype`, else the target's dtype;
        `engine.step.kernel_layout`). None: XLA's dot.
    Raises:
      ValueError: not Medusa heads, heads of another width, or more tree nodes than the heads can fill.
    """

    kind = "medusa"
    output_independent = True

    def __init__(self, heads, config: SpeculationConfig, target_config, engine_config=None):
        if medusa.W not in heads.params:
            raise ValueError(f"{heads.config.name} are not Medusa heads (no {medusa.W})")
        super().__init__(config)
        module = medusa.MedusaHeads(target_config, heads.params)
        layout = engine_config and kernel_layout(
            engine_config, engine_config.draft_kernel_dtype or heads.stored_dtype or target_config.dtype)
        self.packed_bytes = module.pack_linears(*layout) if layout else 0
        self.model_config = target_config
        graphdef, state = nnx.split(module)
        self.graphdef, self.state = graphdef, Weights.of(state)
        accuracy = np.asarray(heads.params[medusa.ACCURACY])[:config.num_speculative_tokens]
        if config.tree_nodes:
            self.parents, heads_of, ranks = medusa.medusa_tree(accuracy, config.tree_nodes)
        else:  # the chain of each head's top token
            n = len(accuracy)
            self.parents, heads_of, ranks = list(range(n)), list(range(n)), [0] * n
        self.tree = (tuple(heads_of), tuple(ranks))
        self._depths = tree_depths(np.array([-1, *self.parents]), self.kind)

    def proposal_len(self, request: Request, k: int) -> int:
        """The tree's first nodes up to the first one deeper than the policy's G (which a request's own
        `num_speculative_tokens` caps), at most the request's `num_tree_nodes`."""
        deeper = np.flatnonzero(self._depths[1:] > k)
        n = int(deeper[0]) if len(deeper) else len(self.parents)
        return min(n, request.sampling.num_tree_nodes or n)

    @property
    def program_ks(self) -> tuple[int, ...]:
        """One program, the whole tree: unused window slots cost nothing (`_window_rows`)."""
        return (len(self.parents),)

    def depth(self, request: Request, k: int) -> int:
        return int(self._depths[:k + 1].max())

    def tree_parents(self, plan: StepPlan) -> dict[str, list[int]]:
        return {s.request.request_id: self.parents[:s.num_draft] for s in plan.seqs if s.num_draft}

    def pools(self, num_blocks: int, block_size: int) -> tuple:
        return (FeaturePool.zeros(self.model_config, num_blocks, block_size),)

    def bytes_per_block(self, block_size: int) -> int:
        return FeaturePool.bytes_per_block(self.model_config, block_size)

    def step_program(self, target_graphdef, attention, G: int):
        """The jitted step for a tree cut to its first `G` nodes (`engine.spec.medusa.make_medusa_step`)."""
        return make_medusa_step(target_graphdef, self.graphdef, attention, G,
                                (self.tree[0][:G], self.tree[1][:G]))


@functools.cache
def make_medusa_step(target_graphdef: nnx.GraphDef, heads_graphdef: nnx.GraphDef, attention: Callable,
                     G: int, tree: tuple[tuple[int, ...], tuple[int, ...]]):
    """Returns the jitted `step(target_state, heads_state, pool, features, batch, spec)` of Medusa heads
    (`model.medusa.MedusaHeads`), returning `(sampled, num_emitted, path_rank, pool, features)` as
    `make_eagle_tree_step` does (a node's rank is its index in the static tree, whose every prefix is the best
    tree of its size); the pools are donated.

    With `G` > 0, each drafting row's heads read the target's feature at the position before its last real
    token (the hidden state whose logits gave that token, from the `FeaturePool`) and their candidates fill
    the static tree `tree` = (heads, ranks) of node 1..G (`model.medusa.medusa_tree`; a cut tree keeps its
    first nodes); the target then verifies the trees as `make_tree_verify_step` does. Every step writes the
    target's hidden state at each packed token into the feature pool and moves the accepted paths' features
    with their KV, so the next step's heads read the feature of the last accepted node. `G = 0` only keeps
    the feature pool up to date.
    """
    heads_of, ranks_of = (jnp.asarray(x, jnp.int32) for x in tree)
    n = max(tree[1]) + 1 if G else 0

    @step_program(donate_argnums=(2, 3))
    def step(target_state, heads_state, pool: KVPool, features: FeaturePool, batch: StepBatch, spec: SpecBatch):
        target = nnx.merge(target_graphdef, target_state)
        token_ids = batch.token_ids
        if G:
            heads = nnx.merge(heads_graphdef, heads_state)
            S = spec.num_draft.shape[0]
            prev = features_before(features, batch.block_tables, jnp.arange(S), batch.positions[batch.logits_indices])
            candidates = heads.candidates(prev, n)  # [S, heads, n]
            token_ids = token_ids.at[spec.draft_token_index].set(candidates[:, heads_of, ranks_of], mode="drop")
        B = features.f.shape[2]
        sampled, num_emitted, pool, hidden, move, path = target_verify_tree(target, pool, batch, spec, token_ids, G,
                                                                      attention)
        f = features.f.at[0, batch.slot_mapping // B, batch.slot_mapping % B, 0].set(hidden.astype(features.f.dtype))
        return sampled, num_emitted, path - (path > 0), pool, FeaturePool(move(f))

    return step
