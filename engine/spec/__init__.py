"""Speculative decoding: proposers (where drafts come from), the gate (how many), the programs that draft
and verify, and exact verification.

- `config`: `SpeculationConfig`, the settings.
- `proposer`: the `Proposer` contract and `NoProposer`; one module per kind: `draft` (a draft model),
  `eagle` (an EAGLE head, EAGLE-2 trees), `medusa` (Medusa heads), `ngram` (prompt lookup), `suffix`
  (suffix decoding).
- `gate`: `Gate`, each step's draft lengths from the adaptive G (`acceptance`) and measured step costs
  (`costs`).
- `programs`: the verify step programs and what every speculative program shares; a device proposer's
  drafting programs live in its module.
- `verify`, `tree_verify`: rejection sampling for chains and token trees.

`make_proposer` builds an engine's proposer from its arguments.
"""

from __future__ import annotations

from engine.spec.config import SpeculationConfig
from engine.spec.draft import DraftModelProposer
from engine.spec.eagle import EagleProposer
from engine.spec.medusa import MedusaProposer
from engine.spec.ngram import NgramProposer
from engine.spec.proposer import NoProposer, Proposer
from engine.spec.suffix import SuffixProposer
from model import medusa
from model.eagle import FC


def make_proposer(draft, speculation: SpeculationConfig | None, target_config, engine_config) -> Proposer:
    """The engine's proposer from its `draft` (a `LoadedModel` or None) and `speculation` arguments
    (`engine.engine.Engine`); `NoProposer` without either.

    Raises:
      ValueError: method "draft", "eagle" or "medusa" without a draft of that kind.
    """
    if speculation is None:
        if draft is None:
            return NoProposer()
        speculation = SpeculationConfig(method=draft_kind(draft))
    if speculation.method == "ngram":
        return NgramProposer(speculation)
    if speculation.method == "suffix":
        return SuffixProposer(speculation)
    if draft is None or draft_kind(draft) != speculation.method:
        kind = {"eagle": "an EAGLE head", "medusa": "Medusa heads"}.get(speculation.method, "a draft model")
        raise ValueError(f"speculation method {speculation.method!r} needs {kind}")
    if speculation.method == "eagle":
        return EagleProposer(draft, speculation, target_config, engine_config)
    if speculation.method == "medusa":
        return MedusaProposer(draft, speculation, target_config, engine_config)
    return DraftModelProposer(draft, speculation, target_config.vocab_size, engine_config)


def draft_kind(draft) -> str:
    """"eagle", "medusa" or "draft": the speculation method a loaded draft (`LoadedModel`) is for."""
    return "eagle" if FC in draft.params else "medusa" if medusa.W in draft.params else "draft"
