"""A standalone draft model as a proposer, run inside the step program.

Sources: Leviathan et al. 2023 (§2.3, Algorithm 1) and Chen et al. 2023 (Algorithm 2).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from flax import nnx

from engine.spec.config import SpeculationConfig
from engine.spec.programs import SpecBatch, place_drafts, single_token_batch, target_verify
from engine.spec.proposer import Proposer
from engine.spec.verify import sample_draft
from engine.step import KVPool, StepBatch, build_model, kv_bytes_per_block, paged_attend, step_program
from scheduler.request import Request
from scheduler.scheduler import StepPlan


class DeviceProposer(Proposer):
    """A proposer that drafts inside the step program from state it keeps per KV slot (a draft model's KV,
    an EAGLE head's KV and the target's features, Medusa's features). A step run without its program leaves
    that state behind for the step's requests, which then never draft again."""

    on_device = True

    def __init__(self, config: SpeculationConfig):
        super().__init__(config)
        self._behind: set[str] = set()  # requests whose draft state fell behind

    def can_draft(self, request: Request) -> bool:
        """False once the request's draft state fell behind."""
        return request.request_id not in self._behind

    def release(self, request: Request) -> None:
        """Keeping the draft state costs a draft pass over every step token: a request the gate keeps holding
        drops it and never drafts again."""
        self._behind.add(request.request_id)

    def idle_k(self, plan: StepPlan, will_draft) -> int | None:
        """None (target only) or 0 (the draft keeps its KV).

        When no request in the step will speculate (the gate's choice for this step aside: the policy
        switched them off, or the gate released them), the draft is skipped: speculation that does not
        pay then costs nothing, and those requests' draft state falls behind for good. Their
        blocks hold no draft state either, so a later request that reuses them through the prefix
        cache drafts from an incomplete context: fewer tokens accepted, the output unchanged.
        """
        if any(will_draft(s.request) for s in plan.seqs):
            return 0
        self._behind.update(s.request.request_id for s in plan.seqs)
        return None

    def fork(self, parent: Request, children: list[Request]) -> None:
        """The samples share the parent's blocks, so they inherit its draft state."""
        if parent.request_id in self._behind:
            self._behind.update(c.request_id for c in children)
        super().fork(parent, children)

    def forget(self, request_id: str) -> None:
        super().forget(request_id)
        self._behind.discard(request_id)


class DraftModelProposer(DeviceProposer):
    """A standalone draft model (same vocabulary as the target), run inside the step program.

    Args:
      draft: a `checkpoints.LoadedModel` with the target's vocabulary.
      config: G and the adaptive-speculation settings.
      vocab_size: the target's vocabulary size.
      engine_config: the engine's config (the CPU kernel settings).
    Raises:
      ValueError: the draft's vocabulary differs from the target's.
    """

    kind = "draft"

    def __init__(self, draft, config: SpeculationConfig, vocab_size: int, engine_config):
        if draft.config.vocab_size != vocab_size:
            raise ValueError(f"the draft's vocabulary ({draft.config.vocab_size}) differs from the target's "
                             f"({vocab_size})")
        super().__init__(config)
        self.model_config = draft.config
        self.graphdef, self.state, self.packed_bytes = build_model(draft, engine_config,
                                                                   engine_config.draft_kernel_dtype)

    def pools(self, num_blocks: int, block_size: int) -> tuple:
        return (KVPool.zeros(self.model_config, num_blocks, block_size),)

    def bytes_per_block(self, block_size: int) -> int:
        return kv_bytes_per_block(self.model_config, block_size)

    def step_program(self, target_graphdef, attention, G: int):
        """The jitted step for draft length `G` (`make_spec_step`)."""
        return make_spec_step(target_graphdef, self.graphdef, attention, G)


@functools.cache
def make_spec_step(target_graphdef: nnx.GraphDef, draft_graphdef: nnx.GraphDef, attention: Callable, G: int):
    """Returns the jitted `step(target_state, draft_state, pool, draft_pool, batch, spec)`.

    Returns `(sampled, num_emitted int32 [S], path_rank, pool, draft_pool)`: `sampled`
    is an `engine.step.Sampled` over the `S * (G+1)` verify slots (row-major;
    log-probabilities only if some row wants them), row `s` emits
    `sampled.tokens[s * (G+1):][:num_emitted[s]]`, and `path_rank` is None (a chain's
    accepted tokens are its first ones; token-tree programs return ranks, as
    `make_eagle_tree_step` does). Both pools are donated. `G`
    (static) is the largest draft length in the step; `G = 0` only keeps the
    draft's KV in step with the target's and samples as `make_step` does.
    """

    @step_program(donate_argnums=(2, 3))
    def step(target_state, draft_state, pool: KVPool, draft_pool: KVPool, batch: StepBatch, spec: SpecBatch):
        draft = nnx.merge(draft_graphdef, draft_state)
        target = nnx.merge(target_graphdef, target_state)
        hidden, draft_pool = draft(batch.token_ids, batch.positions, paged_attend(batch, attention), draft_pool)
        last_pos = batch.positions[batch.logits_indices]  # [S], position of each row's last real token
        V = target.cfg.vocab_size
        sampling = (batch.temperature, batch.top_k, batch.top_p, batch.min_p, batch.seeds)
        tokens, probs = [], []
        if G:
            t, p = sample_draft(draft.logits(hidden[batch.logits_indices]), *sampling, last_pos + 1)
            tokens.append(t)
            probs.append(p)
            for j in range(1, G + 1):
                live = j <= spec.num_draft
                single = single_token_batch(batch, tokens[-1], last_pos + j, spec.draft_slots[j - 1], live)
                h, draft_pool = draft(single.token_ids, single.positions, paged_attend(single, attention),
                                      draft_pool)
                if j < G:
                    t, p = sample_draft(draft.logits(h), *sampling, last_pos + j + 1)
                    tokens.append(t)
                    probs.append(p)
        token_ids, draft_tokens, draft_probs = place_drafts(batch, spec, tokens, probs, V)
        sampled, num_emitted, pool, _ = target_verify(target, pool, batch, spec, token_ids, draft_tokens,
                                                       draft_probs, attention)
        return sampled, num_emitted, None, pool, draft_pool

    return step
