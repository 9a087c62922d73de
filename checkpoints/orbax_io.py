"""Orbax checkpoints of our own layout.

Directory layout: `model_config.json` (the ModelConfig as JSON), `params/` (an Orbax
StandardCheckpointer checkpoint of `{name: array}` as in `param_specs`) and, if saved with
one, the tokenizer's `tokenizer.json` / `tokenizer_config.json`.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import numpy as np
import orbax.checkpoint as ocp

from checkpoints._layout import cast, np_dtype
from model.config import ModelConfig, RopeScaling
from model.llama import param_specs

CONFIG_FILE = "model_config.json"
_PARAMS_DIR = "params"


def config_to_json(cfg: ModelConfig) -> str:
    return json.dumps(dataclasses.asdict(cfg), indent=2)


def config_from_json(text: str) -> ModelConfig:
    """Inverse of `config_to_json`; JSON lists come back as the tuple and dataclass fields."""
    d = json.loads(text)
    if d.get("rope_scaling") is not None:
        d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
    for name in ("eos_token_ids", "layer_windows"):
        d[name] = tuple(d.get(name, ()))
    return ModelConfig(**d)


def is_orbax_dir(path: str | os.PathLike) -> bool:
    return os.path.isfile(os.path.join(path, CONFIG_FILE)) and os.path.isdir(os.path.join(path, _PARAMS_DIR))


def save_orbax(path: str | os.PathLike, cfg: ModelConfig, params: dict, tokenizer=None) -> None:
    """Saves params (cast to `cfg.dtype`) and the config (and tokenizer files if given) under `path`.

    Raises FileExistsError if `path` already holds a checkpoint.
    """
    path = os.path.abspath(path)  # Orbax requires absolute paths
    if os.path.exists(os.path.join(path, _PARAMS_DIR)):
        raise FileExistsError(f"{path} already holds a checkpoint")
    os.makedirs(path, exist_ok=True)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(os.path.join(path, _PARAMS_DIR), cast(params, cfg.dtype))
        ckptr.wait_until_finished()
    with open(os.path.join(path, CONFIG_FILE), "w") as f:
        f.write(config_to_json(cfg))
    if tokenizer is not None:
        tokenizer.save(path)


def load_orbax(path: str | os.PathLike) -> tuple[ModelConfig, dict]:
    """Reads a directory written by `save_orbax` into (config, params); params are numpy arrays
    shaped as `param_specs(config)` in `config.dtype`. Raises FileNotFoundError if `path` is not
    such a directory, ValueError if the stored arrays do not match the config."""
    path = os.path.abspath(path)
    if not is_orbax_dir(path):
        raise FileNotFoundError(f"{path} is not an Orbax checkpoint written by save_orbax")
    with open(os.path.join(path, CONFIG_FILE)) as f:
        cfg = config_from_json(f.read())
    dt, specs = np_dtype(cfg.dtype), param_specs(cfg)
    # ShapeDtypeStruct targets without sharding restore as host numpy arrays.
    target = {n: jax.ShapeDtypeStruct(shape, dt) for n, (shape, _) in specs.items()}
    with ocp.StandardCheckpointer() as ckptr:
        params = ckptr.restore(os.path.join(path, _PARAMS_DIR), target)
    # Orbax restores arrays as stored, whatever the target's shapes say.
    wrong = {n: v.shape for n, v in params.items() if v.shape != specs[n][0]}
    if wrong:
        raise ValueError(f"{path}: stored shapes {wrong} do not match {CONFIG_FILE}")
    return cfg, {n: np.asarray(v).astype(dt, copy=False) for n, v in params.items()}
