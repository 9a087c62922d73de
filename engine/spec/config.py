"""The speculation settings (`SpeculationConfig`), checked where they are made."""

from __future__ import annotations

import dataclasses
import numbers


@dataclasses.dataclass
class SpeculationConfig:
    """Speculation settings: G, adaptive G per request class and per request, and the proposer.

    num_speculative_tokens: G when speculation pays (the top of the ladder
      G, G/2, ..., 1 of compiled draft lengths).
    min_acceptance: when a running acceptance rate (of a request or of its
      class) is below this, G is halved, down to 0 (off). A floor for
      proposals that hardly ever pay; whether a rate above it pays in a
      given batch is the cost gate's call (`engine.spec.gate.Gate.begin_step`). 0 turns
      both off: every decode drafts G.
    ema_decay: weight of the past in the running acceptance rates, per
      verify step (0.9: a rate that has seen alpha 0.5 for a while falls
      below 0.1 after about 20 verifies in a row that accept nothing; a
      proposal that never accepts turns off after 7).
    retry_after_steps: a class switched off is retried at G = 1 after this many
      engine steps (twice as long after each failed retry), on the requests
      that arrive then.
    prompt_lookup_max, prompt_lookup_min: the n-gram sizes "ngram" matches,
      longest first.
    method: the proposer, "draft" (a draft model), "eagle" (an EAGLE head),
      "medusa" (Medusa heads), "ngram" (prompt lookup) or "suffix" (suffix
      decoding: `engine.spec.suffix.SuffixProposer`).
    tree_nodes: 0 for chains; else proposals are token trees of at most this
      many nodes below the root (<= 31: a tree mask is one int32 word), each
      path at most `num_speculative_tokens` deep. "ngram": the continuations of
      every earlier match, merged (`engine.spec.ngram.lookup_tree`); "medusa": the
      heads' static sparse tree (`model.medusa.medusa_tree`); "eagle": EAGLE-2
      dynamic trees (`engine.spec.eagle.make_eagle_tree_step`); "suffix": the
      likeliest continuations of the longest suffix match.
    tree_branching: "eagle" trees: children proposed per expanded node, and
      nodes expanded per level (EAGLE-2's top-k), 1..8.
    ngram_in_tree: "eagle" trees: where the context has an n-gram match
      (`engine.spec.ngram.lookup`, sizes `prompt_lookup_max`..`prompt_lookup_min`),
      its continuation (at most G tokens) joins the head's candidates in the
      same tree, ranked before them; the head's candidates that repeat it merge
      into it. The coupled tree verify keeps the output the target's whatever
      the tree holds, so this stays exact.
    """

    num_speculative_tokens: int = 4
    min_acceptance: float = 0.1
    ema_decay: float = 0.9
    retry_after_steps: int = 200
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    method: str = "draft"
    tree_nodes: int = 0
    tree_branching: int = 4
    ngram_in_tree: bool = False
    suffix_cache_tokens: int = 65536

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value, kind = getattr(self, field.name), {"int": int, "float": float}.get(field.type)
            if kind is None:
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Integral if kind is int else numbers.Real):
                raise ValueError(f"{field.name} must be {'an integer' if kind is int else 'a number'}, got {value!r}")
            setattr(self, field.name, kind(value))  # numpy scalars become Python's
        if self.method not in ("draft", "eagle", "medusa", "ngram", "suffix"):
            raise ValueError(f"speculation method must be 'draft', 'eagle', 'medusa', 'ngram' or 'suffix', "
                             f"got {self.method!r}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("prompt lookup sizes must satisfy 1 <= prompt_lookup_min <= prompt_lookup_max")
        if not 0 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"num_speculative_tokens must be in [0, 16], got {self.num_speculative_tokens}")
        if not 0 <= self.tree_nodes <= 31 or (self.tree_nodes and self.method == "draft"):
            raise ValueError(f"tree_nodes must be in [0, 31] (token trees: methods 'ngram', 'medusa', 'eagle' and "
                             f"'suffix'), got {self.tree_nodes}")
        if self.suffix_cache_tokens < 0:
            raise ValueError(f"suffix_cache_tokens must be >= 0, got {self.suffix_cache_tokens}")
        if not 1 <= self.tree_branching <= 8:
            raise ValueError(f"tree_branching must be in [1, 8], got {self.tree_branching}")
        if self.ngram_in_tree and not (self.method == "eagle" and self.tree_nodes):
            raise ValueError("ngram_in_tree needs EAGLE-2 trees (method 'eagle' and tree_nodes >= 1)")
        if self.tree_nodes and not self.num_speculative_tokens:
            raise ValueError(f"tree_nodes={self.tree_nodes} needs num_speculative_tokens >= 1 (the trees' depth)")
        if not 0 <= self.min_acceptance <= 1 or not 0 <= self.ema_decay < 1:
            raise ValueError("min_acceptance must be in [0, 1] and ema_decay in [0, 1)")

    @property
    def ladder(self) -> tuple[int, ...]:
        """The draft lengths a step program is compiled for: G, G/2, ..., 1 (ascending)."""
        ks, k = [], self.num_speculative_tokens
        while k:
            ks.append(k)
            k //= 2
        return tuple(reversed(ks))
