"""Model configurations: one frozen dataclass and a registry of named presets.

Shape letters used across the project: T tokens, S sequences, L layers,
E hidden (embedding) size, F MLP size (an expert's, in a mixture of experts), X experts, H query heads, K KV heads, D head dim,
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
    """Hyper-parameters of a Llama-family decoder (Llama 2/3, Qwen2/3, Mistral, Phi-3, Gemma 2/3, SmolLM2).

    The families differ in fields, not in code paths of their own: `qk_norm` (Qwen3, Gemma 3),
    `layer_windows` (sliding-window attention: Mistral, Gemma 2/3), `norm_offset`, `sandwich_norms`,
    `hidden_act`, `scale_embeddings`, `sm_scale`, the soft-caps and `rope_local_theta` (Gemma 2/3).
    """

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
    qk_norm: bool = False  # RMSNorm over each head's D of q and k before RoPE (Qwen3, Gemma 3)
    # Per layer, the sliding window W of its attention (a token at position p sees positions p-W+1..p;
    # transformers' `sliding_window`), 0 for global attention; () = every layer global.
    layer_windows: tuple[int, ...] = ()
    rope_local_theta: float = 0.0  # RoPE base of windowed layers (Gemma 3's local layers); 0 = rope_theta
    norm_offset: float = 0.0  # RMSNorm scales by (norm_offset + weight): Gemma's 1 + w
    sandwich_norms: bool = False  # norms after attention and after the MLP too (Gemma 2/3)
    hidden_act: str = "silu"  # the gated MLP's activation: "silu" or "gelu_tanh" (GeGLU, Gemma)
    scale_embeddings: bool = False  # token embeddings times sqrt(E), rounded to the dtype (Gemma)
    sm_scale: float = 0.0  # attention's score scale; 0 = 1/sqrt(D) (Gemma: query_pre_attn_scalar ** -0.5)
    attn_softcap: float = 0.0  # scores -> c * tanh(scores / c) before the softmax (Gemma 2); 0 = none
    final_softcap: float = 0.0  # the same on the output logits (Gemma 2)
    # Mixture of experts (Mixtral, Qwen3-MoE): X experts of MLP size F each in every layer, each token's output
    # the sum of its `num_experts_per_tok` best experts' weighted by the router's softmax, renormalized over
    # them when `norm_topk_prob`. 0 experts: a dense MLP.
    num_experts: int = 0  # X
    num_experts_per_tok: int = 0
    norm_topk_prob: bool = True

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {self.dtype!r}")
        if self.layer_windows and (len(self.layer_windows) != self.num_layers or min(self.layer_windows) < 0):
            raise ValueError(f"layer_windows needs {self.num_layers} windows >= 0 (0: global), "
                             f"got {self.layer_windows}")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok must be in [1, {self.num_experts}], got {self.num_experts_per_tok}")
        if self.hidden_act not in ("silu", "gelu_tanh"):
            raise ValueError(f"hidden_act must be 'silu' or 'gelu_tanh', got {self.hidden_act!r}")

    def window(self, layer: int) -> int:
        """Layer `layer`'s sliding window, 0 for global attention."""
        return self.layer_windows[layer] if self.layer_windows else 0

    @property
    def max_window(self) -> int:
        """The widest window when every layer is windowed (a sequence's KV before its position minus this is
        never read again), else 0."""
        return max(self.layer_windows) if self.layer_windows and min(self.layer_windows) > 0 else 0

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    @property
    def num_params(self) -> int:
        E, F, L, H, K, D, V = (self.hidden_size, self.intermediate_size, self.num_layers,
                               self.num_heads, self.num_kv_heads, self.head_dim, self.vocab_size)
        per_layer = 2 * E + E * H * D + 2 * E * K * D + H * D * E + 3 * E * F * max(1, self.num_experts)
        per_layer += E * self.num_experts  # the router
        if self.qkv_bias:
            per_layer += H * D + 2 * K * D
        if self.qk_norm:
            per_layer += 2 * D
        if self.sandwich_norms:
            per_layer += 2 * E
        return V * E * (1 if self.tie_word_embeddings else 2) + L * per_layer + E

    @classmethod
    def from_hf_config(cls, path: str, name: str | None = None) -> "ModelConfig":
        """Reads a Hugging Face `config.json` (a file or the directory holding it).

        Supports `model_type` in `HF_MODEL_TYPES`, with transformers 4.x and 5.x key names (5.x moved the
        RoPE settings into `rope_parameters`, per layer type for Gemma 3). Raises ValueError for another
        model type, RoPE scaling other than Llama 3's, Phi-3's partial rotary embedding, or a Qwen3-MoE with
        dense layers among its expert layers.
        """
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        with open(path) as f:
            hf = json.load(f)
        model_type = hf.get("model_type")
        if model_type not in HF_MODEL_TYPES:
            raise ValueError(f"unsupported model_type {model_type!r} in {path}; supported: {', '.join(HF_MODEL_TYPES)}")
        gemma = model_type in ("gemma2", "gemma3_text")
        experts = hf.get("num_local_experts") or hf.get("num_experts") or 0
        if model_type == "qwen3_moe" and (hf.get("mlp_only_layers") or hf.get("decoder_sparse_step", 1) != 1):
            raise ValueError(f"dense layers among the expert layers (mlp_only_layers, decoder_sparse_step) are not "
                             f"supported ({path})")
        heads = hf["num_attention_heads"]
        num_layers = hf["num_hidden_layers"]
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        local_rope = {}
        if "full_attention" in rope:  # per layer type (Gemma 3 under transformers 5)
            rope, local_rope = rope["full_attention"] or {}, rope.get("sliding_attention") or {}
        theta = float(hf.get("rope_theta", rope.get("rope_theta", 1e6 if model_type == "gemma3_text" else 10000.0)))
        local_theta = 0.0
        if model_type == "gemma3_text":
            local_theta = float(hf.get("rope_local_base_freq", local_rope.get("rope_theta", 10000.0)))
        if float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))) != 1.0:
            raise ValueError(f"partial rotary embeddings are not supported ({path})")
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
        eos = hf.get("eos_token_id")
        eos = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        scalar = hf.get("query_pre_attn_scalar")
        return cls(
            name=name or hf.get("_name_or_path") or model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf.get("moe_intermediate_size") or hf["intermediate_size"] if experts
            else hf["intermediate_size"],
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads", heads),
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=hf.get("tie_word_embeddings", gemma),
            qkv_bias=model_type == "qwen2" or bool(hf.get("attention_bias", False)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos,
            qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3_text"),
            num_experts=experts,
            num_experts_per_tok=hf.get("num_experts_per_tok", 0) if experts else 0,
            norm_topk_prob=model_type == "mixtral" or bool(hf.get("norm_topk_prob", True)),
            layer_windows=_hf_layer_windows(hf, model_type, num_layers),
            rope_local_theta=local_theta,
            norm_offset=1.0 if gemma else 0.0,
            sandwich_norms=gemma,
            hidden_act="gelu_tanh" if gemma else "silu",
            scale_embeddings=gemma,
            sm_scale=float(scalar) ** -0.5 if gemma and scalar else 0.0,
            attn_softcap=float(hf.get("attn_logit_softcapping") or 0.0),
            final_softcap=float(hf.get("final_logit_softcapping") or 0.0),
        )


# transformers' `model_type`s `ModelConfig.from_hf_config` reads.
HF_MODEL_TYPES = ("llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe", "phi3", "gemma2", "gemma3_text")


def _hf_layer_windows(hf: dict, model_type: str, num_layers: int) -> tuple[int, ...]:
    """Per-layer sliding windows of a `config.json` (0: global), () when every layer is global: its
    `layer_types` where present, else each family's rule as transformers' config classes state it
    (Mistral and Phi-3 window every layer; Qwen2/3 the layers from `max_window_layers` on with
    `use_sliding_window`; Gemma 2 every other layer from the first, Gemma 3 five of every six)."""
    window = hf.get("sliding_window") or 0
    if model_type in ("qwen2", "qwen3", "qwen3_moe") and not hf.get("use_sliding_window", False):
        window = 0
    if not window:
        return ()
    types = hf.get("layer_types")
    if types is None:
        if model_type in ("qwen2", "qwen3", "qwen3_moe"):
            first = hf.get("max_window_layers", 0)
            types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
        elif model_type in ("gemma2", "gemma3_text"):
            every = 2 if model_type == "gemma2" else hf.get("sliding_window_pattern", 6)
            types = ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(num_layers)]
        elif model_type in ("mistral", "mixtral", "phi3"):
            types = ["sliding_attention"] * num_layers
        else:
            return ()
    windows = tuple(int(window) if t == "sliding_attention" else 0 for t in types)
    return windows if any(windows) else ()


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


@_preset
def tiny_gemma() -> ModelConfig:
    """A random-weight test model with Gemma's fields: QK-norm, windowed layers around a global one on a RoPE
    base of their own, sandwich norms with the + 1 offset, GeGLU, scaled embeddings, soft-capped logits."""
    return ModelConfig(
        name="tiny-gemma", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=3, num_heads=4,
        num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=256,
        tie_word_embeddings=True, bos_token_id=1, eos_token_ids=(2,), qk_norm=True, layer_windows=(8, 0, 8),
        rope_local_theta=10000.0, norm_offset=1.0, sandwich_norms=True, hidden_act="gelu_tanh",
        scale_embeddings=True, sm_scale=0.2, final_softcap=30.0,
    )


@_preset
def tiny_moe() -> ModelConfig:
    """A random-weight mixture of experts (Mixtral's routing: 4 experts, 2 per token, renormalized)."""
    return tiny_llama().replace(name="tiny-moe", num_experts=4, num_experts_per_tok=2)


def preset_names() -> list[str]:
    return sorted(_PRESETS)


def get_preset(name: str) -> ModelConfig:
    """Returns the preset called `name`; raises KeyError listing the known names."""
    try:
        return _PRESETS[name]()
    except KeyError:
        raise KeyError(f"unknown model preset {name!r}; known presets: {', '.join(preset_names())}") from None
