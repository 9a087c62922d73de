"""Medusa heads as a proposer: a static token tree filled on the device from the heads' candidates.

Source: Cai et al. 2024, *Medusa* (§2.1 heads, §2.1.2 tree attention).
"""

from __future__ import annotations

import numpy as np
from flax import nnx

from engine.adaptive import SpeculationConfig
from engine.proposers import DraftModelProposer, Proposer
from engine.speculative import FeaturePool, make_medusa_step
from engine.step import Weights, kernel_layout
from model import medusa
from scheduler.packing import tree_depths
from scheduler.request import Request
from scheduler.scheduler import StepPlan


class MedusaProposer(DraftModelProposer):
    """Medusa heads (`model.medusa.MedusaHeads`) guessing from the target's features, inside the step program.

    Every drafting row verifies the same static tree (`model.medusa.medusa_tree`
    from the heads' measured top-i accuracies: `tree_nodes` nodes, or without
    trees the chain of each head's top token), its tokens filled on the device
    from the heads' candidates (`engine.speculative.make_medusa_step`). The
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
        Proposer.__init__(self, config)
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
        self._behind: set[str] = set()

    def wanted(self, request: Request, step: int) -> int:
        """The tree's first nodes up to the first one deeper than the policy's K (which a request's own
        `num_speculative_tokens` caps), at most the request's `num_tree_nodes`; 0 once the request's features
        fell behind."""
        if request.request_id in self._behind:
            return 0
        k = self.policy_k(request, step)
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

    def step_program(self, target_graphdef, attention, K: int):
        """The jitted step for a tree cut to its first `K` nodes (`engine.speculative.make_medusa_step`)."""
        return make_medusa_step(target_graphdef, self.graphdef, attention, K,
                                (self.tree[0][:K], self.tree[1][:K]))
