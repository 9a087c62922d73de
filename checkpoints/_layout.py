"""Shared plumbing: mapping a foreign checkpoint's tensor names into `param_specs` layout.

A foreign format names each weight per layer and stores linear weights `[out, in]`;
ours stacks layers along axis 0 and stores linear weights `[in, out]`. A name map is
`{our_name: (their_name, transpose)}`; layer names contain `{i}` for the layer index, and an expert's
(a mixture of experts stores one tensor per expert) `{j}` for the expert's.
"""

from __future__ import annotations

from typing import Callable

import ml_dtypes
import numpy as np

from model.config import ModelConfig
from model.llama import LAYER_PARAMS, param_specs

NameMap = dict[str, tuple[str, bool]]


def np_dtype(dtype: str) -> np.dtype:
    """The numpy dtype for a ModelConfig dtype string ("float32" or "bfloat16")."""
    if dtype == "bfloat16":
        return np.dtype(ml_dtypes.bfloat16)
    if dtype == "float32":
        return np.dtype(np.float32)
    raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {dtype!r}")


def gather(cfg: ModelConfig, names: NameMap, fetch: Callable[[str], np.ndarray]) -> dict[str, np.ndarray]:
    """Builds our params (in `cfg.dtype`) by fetching each foreign tensor once.

    Raises KeyError (from `fetch`) when the checkpoint lacks a tensor the config needs,
    ValueError when a tensor has the wrong shape.
    """
    dt = np_dtype(cfg.dtype)
    params = {}
    for ours, (shape, _) in param_specs(cfg).items():
        theirs, transpose = names[ours]
        # Cast each tensor before stacking so peak memory is one copy in the target dtype.
        get = lambda n: (fetch(n).T if transpose else fetch(n)).astype(dt)
        if "{j}" in theirs:
            value = np.stack([np.stack([get(theirs.format(i=i, j=j)) for j in range(cfg.num_experts)])
                              for i in range(cfg.num_layers)])
        elif ours in LAYER_PARAMS:
            value = np.stack([get(theirs.format(i=i)) for i in range(cfg.num_layers)])
        else:
            value = np.ascontiguousarray(get(theirs))
        if value.shape != shape:
            raise ValueError(f"{theirs}: shape {value.shape} in checkpoint, expected {shape} for {ours}")
        params[ours] = value
    return params


def scatter(cfg: ModelConfig, names: NameMap, params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The inverse of `gather`: our params -> `{their_name: contiguous array}`."""
    out = {}
    for ours in param_specs(cfg):
        theirs, transpose = names[ours]
        value = np.asarray(params[ours])
        for i, v in (enumerate(value) if ours in LAYER_PARAMS else [(None, value)]):
            out[theirs.format(i=i)] = np.ascontiguousarray(v.T if transpose else v)
    return out


def cast(params: dict[str, np.ndarray], dtype: str) -> dict[str, np.ndarray]:
    dt = np_dtype(dtype)
    return {k: np.asarray(v).astype(dt, copy=False) for k, v in params.items()}
