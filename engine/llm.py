"""Offline Python API: `LLM(...).generate(prompts, SamplingParams(...))` and `LLM(...).score(texts)`."""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Callable, Sequence

import numpy as np

from checkpoints import DEFAULT_MODEL, LoadedModel, load_model
from engine.config import EngineConfig
from engine.spec.config import SpeculationConfig
from engine.engine import Engine
from engine.spec import draft_kind
from engine.inputs import Prompt, encode_prompt
from engine.outputs import RequestOutput
from engine.scoring import ScoreOutput
from scheduler.request import InvalidRequestError, SamplingParams


class LLM:
    """Loads a model and generates with it.

    Args:
      model: a preset name, a path (GGUF file, Hugging Face directory, Orbax
        directory), the default real model `smollm2-135m-instruct`, or an
        already loaded `checkpoints.LoadedModel` (engines of one model share
        compiled programs).
      dtype: "float32" or "bfloat16"; None keeps the checkpoint's default.
      speculative: "eagle" (an EAGLE head on the target's features proposes
        tokens), "medusa" (Medusa heads on the target's last hidden state fill a
        token tree), "draft" (a draft model proposes), "ngram" (prompt lookup:
        tokens that followed the latest earlier occurrence of the last few
        tokens), "suffix" (suffix decoding: token trees of the likeliest
        continuations in the request's own context and in earlier outputs of
        its `cache_salt`; `engine.spec.suffix.SuffixProposer`), None (off), or "auto": the settings
        `checkpoints.draft.AUTO_SPECULATION` lists for `model` (the ones the
        benchmark showed to pay; for SmolLM2 n-gram lookup), or with
        `draft_model` its kind, else off. Settings passed here override auto's.
      draft_model: the draft, EAGLE head or Medusa heads (bundled name, path, or
        `LoadedModel`); None takes the model's default one.
      num_speculative_tokens: G, the most draft tokens per verify step
        (adaptive speculation lowers it per request class where acceptance is
        low); None: 4 ("suffix": 8), or auto's.
      num_tree_nodes: 0 for chains of draft tokens; else token trees of at most
        this many nodes (1..31), each path at most G deep ("ngram": the
        continuations of every earlier match, verified in one tree window;
        "medusa": the heads' static sparse tree; "eagle": EAGLE-2 dynamic
        trees; "suffix": the likeliest continuations, 0 the likeliest path); None: 0 ("suffix": 15), or
        auto's.
      tree_branching: "eagle" trees: children per expanded node and nodes
        expanded per level (1..8); None: 4, or auto's.
      ngram_in_tree: "eagle" trees: the n-gram lookup's chain joins each tree
        (`SpeculationConfig.ngram_in_tree`); None: False, or auto's.
      suffix_cache_tokens: "suffix": the most tokens of earlier requests the
        global suffix tries keep (`SpeculationConfig.suffix_cache_tokens`); None: 65536.
      **engine_args: fields of `EngineConfig` (block_size, max_num_seqs, ...).
    Raises:
      ValueError: unknown model name or path, bad engine arguments, a draft
        asked for where none is known, tree nodes without speculation.
    """

    def __init__(self, model: str | LoadedModel = DEFAULT_MODEL, *, dtype: str | None = None,
                 speculative: str | None = "auto", draft_model: str | LoadedModel | None = None,
                 num_speculative_tokens: int | None = None, num_tree_nodes: int | None = None,
                 tree_branching: int | None = None, ngram_in_tree: bool | None = None,
                 suffix_cache_tokens: int | None = None, **engine_args):
        from checkpoints.draft import (AUTO_SPECULATION, DEFAULT_DRAFTS, DEFAULT_EAGLE_HEADS, DEFAULT_MEDUSA_HEADS,
                                       draft_names, load_draft)

        loaded = model if isinstance(model, LoadedModel) else load_model(model, dtype=dtype)
        self.tokenizer = loaded.tokenizer
        if speculative not in ("auto", "eagle", "medusa", "draft", "ngram", "suffix", None):
            raise ValueError(f"speculative must be 'auto', 'eagle', 'medusa', 'draft', 'ngram', 'suffix' or None, "
                             f"got {speculative!r}")
        defaults = {"eagle": DEFAULT_EAGLE_HEADS, "medusa": DEFAULT_MEDUSA_HEADS, "draft": DEFAULT_DRAFTS}
        given = draft_model is not None and speculative == "auto"  # its kind decides below
        settings = {"num_speculative_tokens": 4, "num_tree_nodes": 0, "tree_branching": 4, "ngram_in_tree": False,
                    "suffix_cache_tokens": 65536}
        if speculative == "auto" and not given:
            auto = dict(AUTO_SPECULATION.get(model, {})) if isinstance(model, str) else {}
            kind = auto.pop("speculative", None)
            bundled = kind in ("ngram", "suffix") or (kind in defaults and defaults[kind].get(model) in draft_names())
            speculative = kind if bundled else None
            if bundled:
                settings.update(auto)
        elif speculative == "suffix":
            settings.update(num_speculative_tokens=8, num_tree_nodes=15)
        asked = {"num_speculative_tokens": num_speculative_tokens, "num_tree_nodes": num_tree_nodes,
                 "tree_branching": tree_branching, "ngram_in_tree": ngram_in_tree,
                 "suffix_cache_tokens": suffix_cache_tokens}
        settings.update({name: value for name, value in asked.items() if value is not None})
        draft = None
        if speculative in defaults or given:
            if draft_model is None:
                if not isinstance(model, str) or model not in defaults[speculative]:
                    raise ValueError(f"no default {speculative} for {model!r}: pass draft_model")
                draft_model = defaults[speculative][model]
            draft = draft_model if isinstance(draft_model, LoadedModel) else load_draft(draft_model, loaded)
            if given:
                speculative = draft_kind(draft)
        if speculative is None and num_tree_nodes:
            raise ValueError(f"num_tree_nodes={num_tree_nodes} needs speculation, but speculative resolved to None")
        speculation = None
        if speculative is not None:
            speculation = SpeculationConfig(settings["num_speculative_tokens"], method=speculative,
                                            tree_nodes=settings["num_tree_nodes"],
                                            tree_branching=settings["tree_branching"],
                                            ngram_in_tree=settings["ngram_in_tree"],
                                            suffix_cache_tokens=settings["suffix_cache_tokens"])
        self.engine = Engine(loaded, EngineConfig(**engine_args), draft=draft, speculation=speculation)

    def encode(self, prompt: Prompt) -> list[int]:
        """Token ids of a prompt (see `engine.inputs.encode_prompt`)."""
        return encode_prompt(self.tokenizer, prompt)

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 on_output: Callable[[int, RequestOutput], None] | None = None) -> list[RequestOutput]:
        """Generates for every prompt; results come back in input order.

        A prompt with `n > 1` samples gives `n` consecutive results (by `index`).

        Args:
          prompts: one prompt or a list of them (see `Prompt`).
          sampling_params: one for all prompts or one per prompt; default `SamplingParams()`.
          on_output: called as `on_output(i, output)` after every step that
            gives result `i` new tokens (streaming).
        Raises:
          InvalidRequestError: naming the first bad prompt; nothing runs then.
        """
        if isinstance(prompts, (str, np.ndarray)) or (
                isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], (int, np.integer, dict))):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise InvalidRequestError(f"prompts must be a prompt or a list of prompts, got {type(prompts).__name__}")
        params = sampling_params or SamplingParams()
        params = [params] * len(prompts) if isinstance(params, SamplingParams) else params
        if not isinstance(params, (list, tuple)) or not all(isinstance(p, SamplingParams) for p in params):
            raise InvalidRequestError("sampling_params must be a SamplingParams or a list of them")
        if len(params) != len(prompts):
            raise InvalidRequestError(f"{len(prompts)} prompts but {len(params)} sampling params")
        encoded = []
        for i, (p, sp) in enumerate(zip(prompts, params)):
            try:
                ids = self.encode(p)
                self.engine.validate(ids, sp)
            except InvalidRequestError as e:
                raise InvalidRequestError(f"prompt {i}: {e}") from None
            encoded.append(ids)
        first = {}  # request id -> its first result slot
        results: list[RequestOutput | None] = [None] * sum(sp.n for sp in params)
        try:
            slot = 0
            for ids, sp in zip(encoded, params):
                first[self.engine.add_request(ids, sp).request_id] = slot
                slot += sp.n
            while any(r is None or not r.finished for r in results):
                with _interrupts_between_steps():
                    outs = self.engine.step()
                for out in outs:
                    if out.request_id not in first:
                        continue  # another caller's request
                    i = first[out.request_id] + out.index
                    results[i] = out
                    if on_output is not None:
                        on_output(i, out)
        except BaseException:
            for request_id in first:  # leave the engine clean for the next call
                self.engine.abort(request_id)
            raise
        return results

    def score(self, texts: Prompt | Sequence[Prompt]) -> list[ScoreOutput]:
        """Per-token log-probabilities and log-likelihood of each text (or token-id list), in input order.

        Texts are tokenized as prompts are (the model's BOS only if its
        tokenizer adds one); the first token is not scored.
        Raises:
          InvalidRequestError: naming the first bad text (empty, over `max_model_len` tokens, ids outside
            the vocabulary); every text is checked before any is scored.
          scheduler.block_manager.NoFreeBlocksError: requests in flight hold too many KV blocks.
        """
        if isinstance(texts, (str, np.ndarray)) or (
                isinstance(texts, (list, tuple)) and texts and isinstance(texts[0], (int, np.integer))):
            texts = [texts]
        if not isinstance(texts, (list, tuple)):
            raise InvalidRequestError(f"texts must be a text, a list of token ids or a list of those, "
                                      f"got {type(texts).__name__}")
        encoded = []
        for i, text in enumerate(texts):  # every text is checked before any is scored
            try:
                encoded.append(self.engine.check_score_input(self.encode(text)))
            except InvalidRequestError as e:
                raise InvalidRequestError(f"text {i}: {e}") from None
        return [self.engine.score(ids) for ids in encoded]


@contextlib.contextmanager
def _interrupts_between_steps():
    """Holds a Ctrl-C (SIGINT) that arrives during an engine step until the step is over.

    An interrupt inside XLA compilation or a donated step can leave the
    runtime in a state where the next step crashes the process (seen after
    Ctrl-C during compilation); raised between steps, it leaves the engine
    consistent. Only the main thread receives signals; elsewhere this does nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: pending.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if pending:
        raise KeyboardInterrupt
