"""Model configurations: one frozen dataclass and a registry of named presets.

Shape letters used across the project: T tokens, S sequences, L layers,
E hidden (embedding) size, F MLP size, H query heads, K KV heads, D head dim,
V vocab, P blocks (pages), B block size; in speculative decoding G draft
tokens per row (a step program's draft length, Leviathan et al.'s gamma; a
token tree's node count) and N a token tree's window nodes (G + 1).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Callable


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style RoPE frequency scaling (HF `rope_type: "llama3"`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a Llama-family decoder (Llama 2/3, Qwen2, Mistral, SmolLM2)."""

    name: str
    vocab_size: int  # V
    hidden_size: int  # E
    intermediate_size: int  # F
    num_layers: int  # L
    num_heads: int  # H
    num_kv_heads: int  # K
    head_dim: int  # D
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2
    dtype: str = "float32"  # weights and activations: "float32" or "bfloat16"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # > 0: logits only for this many vocabulary entries (the `head_ids` param), the rest get
    # probability 0 — a draft's cheap output head (the head is most of a small draft's cost).
    head_vocab_size: int = 0

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {self.dtype!r}")

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    @property
    def num_params(self) -> int:
        E, F, L, H, K, D, V = (self.hidden_size, self.intermediate_size, self.num_layers,
                               self.num_heads, self.num_kv_heads, self.head_dim, self.vocab_size)
        per_layer = 2 * E + E * H * D + 2 * E * K * D + H * D * E + 3 * E * F
        if self.qkv_bias:
            per_layer += H * D + 2 * K * D
        return V * E * (1 if self.tie_word_embeddings else 2) + L * per_layer + E

    @classmethod
    def from_hf_config(cls, path: str, name: str | None = None) -> "ModelConfig":
        """Reads a Hugging Face `config.json` (a file or the directory holding it).

        Supports `model_type` llama, mistral and qwen2. Raises ValueError for others.
        """
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        with open(path) as f:
            hf = json.load(f)
        model_type = hf.get("model_type")
        if model_type not in ("llama", "mistral", "qwen2"):
            raise ValueError(f"unsupported model_type {model_type!r} in {path}")
        # transformers 5 moves rope settings into `rope_parameters`.
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        theta = hf.get("rope_theta", rope.get("rope_theta", 10000.0))
        scaling = None
        if rope.get("rope_type", rope.get("type")) == "llama3":
            scaling = RopeScaling(
                factor=float(rope["factor"]),
                low_freq_factor=float(rope["low_freq_factor"]),
                high_freq_factor=float(rope["high_freq_factor"]),
                original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
            )
        elif rope.get("rope_type", rope.get("type")) not in (None, "default"):
            raise ValueError(f"unsupported rope scaling {rope!r} in {path}")
        if hf.get("sliding_window") and model_type == "mistral":
            raise ValueError("sliding-window attention is not supported")
        heads = hf["num_attention_heads"]
        eos = hf.get("eos_token_id")
        eos = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return cls(
            name=name or hf.get("_name_or_path") or model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads", heads),
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            qkv_bias=model_type == "qwen2" or bool(hf.get("attention_bias", False)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos,
        )


_PRESETS: dict[str, Callable[[], ModelConfig]] = {}


def _preset(fn: Callable[[], ModelConfig]) -> Callable[[], ModelConfig]:
    _PRESETS[fn().name] = fn
    return fn


@_preset
def smollm2_135m() -> ModelConfig:
    return ModelConfig(
        name="smollm2-135m", vocab_size=49152, hidden_size=576, intermediate_size=1536,
        num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5,
        rope_theta=100000.0, max_position_embeddings=8192, tie_word_embeddings=True,
        bos_token_id=1, eos_token_ids=(2,),
    )


@_preset
def llama_3_2_1b() -> ModelConfig:
    return ModelConfig(
        name="llama-3.2-1b", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
        num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64, rms_norm_eps=1e-5,
        rope_theta=500000.0, rope_scaling=RopeScaling(32.0, 1.0, 4.0, 8192),
        max_position_embeddings=131072, tie_word_embeddings=True, dtype="bfloat16",
        bos_token_id=128000, eos_token_ids=(128001, 128008, 128009),
    )


@_preset
def llama_3_8b() -> ModelConfig:
    return ModelConfig(
        name="llama-3-8b", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5,
        rope_theta=500000.0, max_position_embeddings=8192, dtype="bfloat16",
        bos_token_id=128000, eos_token_ids=(128001, 128009),
    )


@_preset
def llama_3_70b() -> ModelConfig:
    return ModelConfig(
        name="llama-3-70b", vocab_size=128256, hidden_size=8192, intermediate_size=28672,
        num_layers=80, num_heads=64, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5,
        rope_theta=500000.0, max_position_embeddings=8192, dtype="bfloat16",
        bos_token_id=128000, eos_token_ids=(128001, 128009),
    )


@_preset
def qwen2_5_0_5b() -> ModelConfig:
    return ModelConfig(
        name="qwen2.5-0.5b", vocab_size=151936, hidden_size=896, intermediate_size=4864,
        num_layers=24, num_heads=14, num_kv_heads=2, head_dim=64, rms_norm_eps=1e-6,
        rope_theta=1000000.0, max_position_embeddings=32768, tie_word_embeddings=True,
        qkv_bias=True, dtype="bfloat16", bos_token_id=None, eos_token_ids=(151643, 151645),
    )


@_preset
def mistral_7b() -> ModelConfig:
    """Mistral-7B v0.3 (32768 vocab, no sliding window)."""
    return ModelConfig(
        name="mistral-7b", vocab_size=32768, hidden_size=4096, intermediate_size=14336,
        num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5,
        rope_theta=1000000.0, max_position_embeddings=32768, dtype="bfloat16",
        bos_token_id=1, eos_token_ids=(2,),
    )


@_preset
def tiny_llama() -> ModelConfig:
    """A random-weight test model (2 layers, GQA 4/2)."""
    return ModelConfig(
        name="tiny-llama", vocab_size=256, hidden_size=64, intermediate_size=128,
        num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5,
        rope_theta=10000.0, max_position_embeddings=256, bos_token_id=1, eos_token_ids=(2,),
    )


@_preset
def tiny_qwen2() -> ModelConfig:
    """A random-weight test model with QKV bias and tied embeddings."""
    return ModelConfig(
        name="tiny-qwen2", vocab_size=256, hidden_size=48, intermediate_size=96,
        num_layers=2, num_heads=6, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6,
        rope_theta=1000000.0, max_position_embeddings=256, tie_word_embeddings=True,
        qkv_bias=True, eos_token_ids=(2,),
    )


def preset_names() -> list[str]:
    return sorted(_PRESETS)


def get_preset(name: str) -> ModelConfig:
    """Returns the preset called `name`; raises KeyError listing the known names."""
    try:
        return _PRESETS[name]()
    except KeyError:
        raise KeyError(f"unknown model preset {name!r}; known presets: {', '.join(preset_names())}") from None
