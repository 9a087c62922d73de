"""Draft models for speculative decoding, stored next to the code in `checkpoints/drafts/`.

A draft is a small Llama-family decoder that shares the target's tokenizer and
vocabulary. To keep the stored file small while V is large, a draft derives
its (tied) embedding from the target's: the same matrix when the widths match,
else

    draft.embed [V, E] = target.embed [V, E_t] @ embed_projection [E_t, E]

and its output head may cover only `head_vocab_size` tokens (`head_ids`, see
`ModelConfig.head_vocab_size`): a draft's cost is mostly its head.

Such a directory holds `config.json` (transformers' Llama keys plus a `draft`
entry naming the target, its `E_t` and the head size) and `model.safetensors`
with every weight but `model.embed_tokens.weight`, plus `embed_projection`
when the widths differ and `head_ids` (int32) with a partial head. Loading it
needs the target's params; the result is an ordinary `LoadedModel` (params
in `model.llama.param_specs` layout) that runs through the same `Llama`
module and paged step as the target. A plain Hugging Face directory with the
same vocabulary also loads as a draft.

An EAGLE head (`model.eagle.EagleHead`) is stored the same way: a 1-layer
draft with the target's width (so the target's embedding), its partial head,
and the fusion layer as one more tensor, `eagle_fc`; its config's `draft.kind`
is "eagle", and loading it gives `params[model.eagle.FC]`.

Medusa heads (`model.medusa.MedusaHeads`) have no decoder layer: their
directory holds `medusa_w`, `medusa_b`, `medusa_accuracy` and `head_ids`
(`save_medusa`) and a config.json whose `draft.kind` is "medusa"; loading gives
those tensors plus the target's output head (`model.medusa.READOUT`), with the target's config.
"""

from __future__ import annotations

import json
import os

import ml_dtypes
import numpy as np
import safetensors.numpy

from checkpoints._layout import cast, gather, np_dtype, scatter
from checkpoints.hf import HF_NAMES, checkpoint_dtype, hf_config_dict, load_hf_dir, open_safetensors
from checkpoints.resolve import DEFAULT_MODEL, LoadedModel
from model.config import ModelConfig
from model import medusa
from model.eagle import FC

DRAFTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "drafts")
DEFAULT_DRAFT = "smollm2-135m-draft"
DEFAULT_EAGLE = "smollm2-135m-eagle"
DEFAULT_MEDUSA = "smollm2-135m-medusa"
# The draft and the EAGLE head each bundled target uses when none is named.
DEFAULT_DRAFTS = {DEFAULT_MODEL: DEFAULT_DRAFT}
DEFAULT_EAGLE_HEADS = {DEFAULT_MODEL: DEFAULT_EAGLE}
DEFAULT_MEDUSA_HEADS = {DEFAULT_MODEL: DEFAULT_MEDUSA}
# What `speculative="auto"` turns on for a model (`LLM` arguments), once `benchmarks/speculative.py` shows it
# pays there. SmolLM2: n-gram lookup under the cost gate and its regret account (`engine.spec.costs.DraftRegret`).
# On the 2-core AVX-512 CPU without AMX the fp32 step is ~6 ms and compute bound (a 4-token window costs 1.42x a
# step, 8 tokens 2.12x): auto / off at batch 1 is 1.66x on long_context and 0.88-1.10x elsewhere, and at batch 4
# and 16 0.88-1.12x (3 noisy rounds, RESULTS.md session 7). EAGLE-2 trees (with the n-gram chain in them:
# `{"speculative": "eagle", "num_tree_nodes": 7, "ngram_in_tree": True}`) take 20-24 ms a step there (0.50-0.63x
# forced at batch 1), and their step programs do not fit the server's compile and memory-map budget yet.
# Suffix decoding ({"speculative": "suffix"}) is 1.1-2.5x n-gram's speed where requests repeat earlier outputs
# and within noise of it on prompts never seen at batch 1, 4 and 16 but for code at batch 16 (0.94x: its lookups'
# host time in steps that draft nothing; RESULTS.md session 10), so it is opted into, not the default.
AUTO_SPECULATION: dict[str, dict] = {DEFAULT_MODEL: {"speculative": "ngram"}}
PROJECTION = "embed_projection"
HEAD_IDS = "head_ids"


def draft_names() -> list[str]:
    """Drafts bundled in `checkpoints/drafts/` (one directory each)."""
    if not os.path.isdir(DRAFTS_DIR):
        return []
    return sorted(n for n in os.listdir(DRAFTS_DIR) if os.path.isfile(os.path.join(DRAFTS_DIR, n, "config.json")))


def early_exit_draft(target: LoadedModel, layers: list[int], name: str = "early-exit") -> LoadedModel:
    """A draft made of copies of some of the target's layers, its final norm and its output head.

    The self-speculative draft of LayerSkip (Elhoushi et al. 2024, §4) and
    Draft & Verify (Zhang et al. 2024): without training it already agrees with
    the target on easy tokens; `training.distill` fine-tunes it. Costs no
    storage beyond the target's. Raises ValueError for layer indices outside
    the target or a repeated one.
    """
    from model.llama import LAYER_PARAMS

    n = target.config.num_layers
    if not layers or len(set(layers)) != len(layers) or not all(0 <= i < n for i in layers):
        raise ValueError(f"layers must be distinct indices in [0, {n}), got {layers}")
    params = {k: (np.asarray(v)[list(layers)] if k in LAYER_PARAMS else v) for k, v in target.params.items()}
    windows = tuple(target.config.window(i) for i in layers) if target.config.layer_windows else ()
    return LoadedModel(target.config.replace(name=name, num_layers=len(layers), layer_windows=windows), params,
                       target.tokenizer)


def derived_embed(target_embed: np.ndarray, projection: np.ndarray) -> np.ndarray:
    """float32 `[V, E]` = target embedding `[V, E_t]` @ projection `[E_t, E]`."""
    return np.asarray(target_embed, np.float32) @ np.asarray(projection, np.float32)


def save_draft(path: str | os.PathLike, cfg: ModelConfig, params: dict[str, np.ndarray],
               projection: np.ndarray | None, target_name: str, storage_dtype: str = "bfloat16",
               extra: dict | None = None) -> None:
    """Writes a draft whose embedding derives from the target's (see the module docstring).

    Args:
      path: the directory to write (created if missing).
      cfg: the draft's config (tied embeddings).
      params: `param_specs(cfg)` arrays (plus `model.eagle.FC` for an EAGLE head); `embed` is not stored.
      projection: float32 `[E_t, E]`, or None when the draft has the target's width.
      target_name: the target it was distilled from (recorded in config.json).
      storage_dtype: dtype of the stored tensors ("bfloat16" halves the file).
      extra: more entries for config.json's `draft` record (e.g. training command).
    Raises:
      ValueError: if `cfg` does not tie embeddings (an untied head would be stored in full).
    """
    if not cfg.tie_word_embeddings:
        raise ValueError("a projected-embedding draft needs tie_word_embeddings=True")
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    stored = cfg.replace(dtype=storage_dtype, head_vocab_size=0)
    params = dict(params)
    head_ids = params.pop(HEAD_IDS, None)
    fc = params.pop(FC, None)
    tensors = scatter(stored, HF_NAMES, cast(params, storage_dtype))
    if fc is not None:
        tensors[FC] = cast({"fc": fc}, storage_dtype)["fc"]
    del tensors[HF_NAMES["embed"][0]]
    if projection is not None:
        tensors[PROJECTION] = cast({"p": projection}, storage_dtype)["p"]
    if head_ids is not None:
        tensors[HEAD_IDS] = np.asarray(head_ids, np.int32)
    safetensors.numpy.save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    hf = hf_config_dict(stored)
    hf["draft"] = {"target": target_name,
                   "target_hidden_size": int(cfg.hidden_size if projection is None else projection.shape[0]),
                   "embed": "target.embed" if projection is None else f"target.embed @ {PROJECTION}",
                   "head_vocab_size": int(cfg.head_vocab_size), "kind": "eagle" if fc is not None else "draft",
                   **(extra or {})}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf, f, indent=2)


def save_medusa(path: str | os.PathLike, params: dict[str, np.ndarray], target_name: str,
                storage_dtype: str = "bfloat16", extra: dict | None = None) -> None:
    """Writes Medusa heads: `params` holds `model.medusa.W` `[K, E, E]`, `B` `[K, E]` (stored in
    `storage_dtype`), `ACCURACY` `[K, n]` (float32) and `HEAD_IDS` (int32); `extra` goes into config.json's
    `draft` record (e.g. the training command)."""
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    w, b = np.asarray(params[medusa.W]), np.asarray(params[medusa.B])
    tensors = {**cast({medusa.W: w, medusa.B: b}, storage_dtype),
               medusa.ACCURACY: np.asarray(params[medusa.ACCURACY], np.float32),
               medusa.HEAD_IDS: np.asarray(params[medusa.HEAD_IDS], np.int32)}
    safetensors.numpy.save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    record = {"kind": "medusa", "target": target_name, "target_hidden_size": int(w.shape[1]),
              "num_heads": int(w.shape[0]), "head_vocab_size": int(len(params[medusa.HEAD_IDS])), **(extra or {})}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"draft": record}, f, indent=2)


def draft_path(name_or_path: str) -> str:
    """The directory of a draft: a name from `draft_names()` or a path (`~` expanded); not checked."""
    if name_or_path in draft_names():
        return os.path.join(DRAFTS_DIR, name_or_path)
    return os.path.expanduser(name_or_path)


def load_draft(name_or_path: str, target: LoadedModel) -> LoadedModel:
    """Loads a draft for `target`: a name from `draft_names()` or a directory.

    The draft gets the target's tokenizer, EOS ids and dtype; where its checkpoint
    stores narrower weights (the bundled heads: bfloat16), `stored_dtype` says so. Raises
    FileNotFoundError when there is no such draft, ValueError when its
    vocabulary (or, for a projected embedding, the target's hidden size) does
    not match the target's.
    """
    path = draft_path(name_or_path)
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"no draft {name_or_path!r}: known drafts {draft_names()}, or give a directory "
                                "with config.json and model.safetensors")
    with open(config_path) as f:
        hf = json.load(f)
    dtype = target.config.dtype
    tcfg = target.config
    if hf.get("draft", {}).get("kind") == "medusa":
        if hf["draft"]["target_hidden_size"] != tcfg.hidden_size:
            raise ValueError(f"Medusa heads {path} are {hf['draft']['target_hidden_size']} wide; the target is "
                             f"{tcfg.hidden_size}")
        tensors = open_safetensors(os.path.join(path, "model.safetensors"))
        params = {n: np.asarray(tensors[n]) for n in (medusa.W, medusa.B, medusa.ACCURACY, medusa.HEAD_IDS)}
        params[medusa.READOUT] = medusa.target_readout(tcfg, target.params)
        stored = "bfloat16" if params[medusa.W].dtype == ml_dtypes.bfloat16 else "float32"
        return LoadedModel(tcfg.replace(name=os.path.basename(os.path.normpath(path))), params, target.tokenizer,
                           _narrower(stored, dtype))
    stored = checkpoint_dtype(hf)
    if "draft" not in hf:
        cfg, params = load_hf_dir(path, dtype)
    else:
        cfg = ModelConfig.from_hf_config(path, name=os.path.basename(os.path.normpath(path))).replace(dtype=dtype)
        e_t = hf["draft"]["target_hidden_size"]
        if e_t != tcfg.hidden_size:
            raise ValueError(f"draft {path} projects a hidden size {e_t} embedding; the target has {tcfg.hidden_size}")
        tensors = open_safetensors(os.path.join(path, "model.safetensors"))
        if PROJECTION in tensors:
            embed = derived_embed(target.params["embed"], tensors[PROJECTION])
        elif cfg.hidden_size == e_t:
            embed = target.params["embed"]
        else:
            raise ValueError(f"draft {path} has hidden size {cfg.hidden_size} and no {PROJECTION}")
        params = gather(cfg, HF_NAMES, lambda n: embed if n == HF_NAMES["embed"][0] else tensors[n])
        if hf["draft"].get("head_vocab_size"):
            cfg = cfg.replace(head_vocab_size=hf["draft"]["head_vocab_size"])
            params[HEAD_IDS] = np.asarray(tensors[HEAD_IDS], np.int32)
        if FC in tensors:
            params[FC] = np.asarray(tensors[FC]).astype(np_dtype(dtype))
    if cfg.vocab_size != tcfg.vocab_size:
        raise ValueError(f"draft {path} has vocab_size {cfg.vocab_size}; the target has {tcfg.vocab_size}")
    cfg = cfg.replace(eos_token_ids=tcfg.eos_token_ids, bos_token_id=tcfg.bos_token_id)
    return LoadedModel(cfg, params, target.tokenizer, _narrower(stored, dtype))


def _narrower(stored: str, dtype: str) -> str | None:
    """`stored` where it is narrower than `dtype` (bfloat16 under float32), else None."""
    return stored if (stored, dtype) == ("bfloat16", "float32") else None
