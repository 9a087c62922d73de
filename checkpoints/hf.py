"""Hugging Face checkpoint directories: `config.json` plus single or sharded `*.safetensors`.

Format spec: the safetensors README (github.com/huggingface/safetensors): an 8-byte
little-endian header length, a JSON header {name: {dtype, shape, data_offsets}}, then the
raw little-endian data. Tensor names are transformers' (`LlamaForCausalLM` and the families
`ModelConfig.from_hf_config` reads: Gemma's four norms per layer in `hf_names`, Phi-3's fused
`qkv_proj` and `gate_up_proj` split in `_split_fused`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct

import ml_dtypes
import numpy as np
import safetensors.numpy

from checkpoints._layout import NameMap, cast, gather, scatter
from model.config import ModelConfig

HF_NAMES: NameMap = {
    "embed": ("model.embed_tokens.weight", False),
    "final_norm": ("model.norm.weight", False),
    "lm_head": ("lm_head.weight", True),
    "attn_norm": ("model.layers.{i}.input_layernorm.weight", False),
    "wq": ("model.layers.{i}.self_attn.q_proj.weight", True),
    "wk": ("model.layers.{i}.self_attn.k_proj.weight", True),
    "wv": ("model.layers.{i}.self_attn.v_proj.weight", True),
    "wo": ("model.layers.{i}.self_attn.o_proj.weight", True),
    "bq": ("model.layers.{i}.self_attn.q_proj.bias", False),
    "bk": ("model.layers.{i}.self_attn.k_proj.bias", False),
    "bv": ("model.layers.{i}.self_attn.v_proj.bias", False),
    "mlp_norm": ("model.layers.{i}.post_attention_layernorm.weight", False),
    "w_gate": ("model.layers.{i}.mlp.gate_proj.weight", True),
    "w_up": ("model.layers.{i}.mlp.up_proj.weight", True),
    "w_down": ("model.layers.{i}.mlp.down_proj.weight", True),
    "q_norm": ("model.layers.{i}.self_attn.q_norm.weight", False),
    "k_norm": ("model.layers.{i}.self_attn.k_norm.weight", False),
}

# Gemma 2/3 norm the attention's input, its output, the MLP's input and its output; Llama's
# `post_attention_layernorm` is the MLP's input norm, Gemma's the attention output's.
_GEMMA_NORMS: NameMap = {
    "attn_norm": ("model.layers.{i}.input_layernorm.weight", False),
    "post_attn_norm": ("model.layers.{i}.post_attention_layernorm.weight", False),
    "mlp_norm": ("model.layers.{i}.pre_feedforward_layernorm.weight", False),
    "post_mlp_norm": ("model.layers.{i}.post_feedforward_layernorm.weight", False),
}


# Mixtral's and Qwen3-MoE's router and experts (one tensor per expert, `{j}`).
_MIXTRAL_EXPERTS: NameMap = {
    "router": ("model.layers.{i}.block_sparse_moe.gate.weight", True),
    "w_gate": ("model.layers.{i}.block_sparse_moe.experts.{j}.w1.weight", True),
    "w_up": ("model.layers.{i}.block_sparse_moe.experts.{j}.w3.weight", True),
    "w_down": ("model.layers.{i}.block_sparse_moe.experts.{j}.w2.weight", True),
}
_QWEN_EXPERTS: NameMap = {
    "router": ("model.layers.{i}.mlp.gate.weight", True),
    "w_gate": ("model.layers.{i}.mlp.experts.{j}.gate_proj.weight", True),
    "w_up": ("model.layers.{i}.mlp.experts.{j}.up_proj.weight", True),
    "w_down": ("model.layers.{i}.mlp.experts.{j}.down_proj.weight", True),
}


def hf_names(cfg: ModelConfig, tensor_names=()) -> NameMap:
    """transformers' tensor names for `cfg`'s family (a mixture of experts' by which router `tensor_names` has)."""
    names = {**HF_NAMES, **_GEMMA_NORMS} if cfg.sandwich_norms else HF_NAMES
    if cfg.num_experts:
        mixtral = _MIXTRAL_EXPERTS["router"][0].format(i=0) in tensor_names
        names = {**names, **(_MIXTRAL_EXPERTS if mixtral else _QWEN_EXPERTS)}
    return names


def _split_fused(tensors: dict[str, np.ndarray], cfg: ModelConfig) -> None:
    """Adds q/k/v and gate/up views (no copies) of Phi-3's fused `qkv_proj` (rows: H*D of q, K*D of k, K*D of
    v) and `gate_up_proj` (F rows of gate, then F of up), as transformers' `Phi3Attention` and `Phi3MLP` split
    them."""
    q, kv, F = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    for i in range(cfg.num_layers):
        pre = f"model.layers.{i}."
        if (qkv := tensors.get(pre + "self_attn.qkv_proj.weight")) is not None:
            tensors[pre + "self_attn.q_proj.weight"] = qkv[:q]
            tensors[pre + "self_attn.k_proj.weight"] = qkv[q:q + kv]
            tensors[pre + "self_attn.v_proj.weight"] = qkv[q + kv:]
        if (gate_up := tensors.get(pre + "mlp.gate_up_proj.weight")) is not None:
            tensors[pre + "mlp.gate_proj.weight"] = gate_up[:F]
            tensors[pre + "mlp.up_proj.weight"] = gate_up[F:]

# The numpy API of safetensors has no bfloat16, so tensors are memory-mapped by hand.
_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "F64": np.float64, "I32": np.int32}


def open_safetensors(path: str) -> dict[str, np.ndarray]:
    """Memory-maps every tensor of one `.safetensors` file (no copy until cast)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    out = {}
    for name, info in header.items():
        if info["dtype"] not in _DTYPES:
            raise ValueError(f"{path}: tensor {name} has unsupported dtype {info['dtype']}")
        begin, end = info["data_offsets"]
        dt = np.dtype(_DTYPES[info["dtype"]])
        out[name] = np.memmap(path, dtype=dt, mode="r", offset=8 + n + begin,
                              shape=(end - begin) // dt.itemsize).reshape(info["shape"])
    return out


def checkpoint_dtype(hf: dict) -> str:
    """The dtype a parsed `config.json` says the weights are stored in: "bfloat16", else "float32" (what
    anything not bf16 computes in). transformers 5 writes `dtype`, 4.x `torch_dtype`."""
    return "bfloat16" if (hf.get("dtype") or hf.get("torch_dtype")) == "bfloat16" else "float32"


def load_hf_dir(path: str | os.PathLike, dtype: str | None = None) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Reads a transformers directory of a family `ModelConfig.from_hf_config` reads into (config, params).

    Params are numpy arrays named and shaped as `param_specs(config)`, in `dtype` (default: the
    checkpoint's dtype when bfloat16, else float32). Raises FileNotFoundError when there is no
    `config.json` or no safetensors, ValueError for an unsupported model type or tensor dtype,
    KeyError for a tensor the config needs but the files lack.
    """
    path = os.fspath(path)
    with open(os.path.join(path, "config.json")) as f:
        hf = json.load(f)
    cfg = ModelConfig.from_hf_config(path)
    cfg = cfg.replace(dtype=dtype or checkpoint_dtype(hf))
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    tensors = {}
    for name in files:
        tensors.update(open_safetensors(os.path.join(path, name)))
    _split_fused(tensors, cfg)

    def fetch(name: str) -> np.ndarray:
        if name not in tensors:
            raise KeyError(f"{path} has no tensor {name!r}")
        return tensors[name]

    return cfg, gather(cfg, hf_names(cfg, tensors), fetch)


def hf_config_dict(cfg: ModelConfig) -> dict:
    """The transformers `config.json` for `cfg` (qkv_bias -> Qwen2, else Llama). Raises ValueError for a
    config of another family (QK-norm, windows, Gemma's fields), which these two cannot express."""
    plain = ModelConfig(**{f: getattr(cfg, f) for f in ("name", "vocab_size", "hidden_size", "intermediate_size",
                                                        "num_layers", "num_heads", "num_kv_heads", "head_dim")})
    family = [f for f in ("qk_norm", "layer_windows", "rope_local_theta", "norm_offset", "sandwich_norms",
                          "hidden_act", "scale_embeddings", "sm_scale", "attn_softcap", "final_softcap", "num_experts")
              if getattr(cfg, f) != getattr(plain, f)]
    if family:
        raise ValueError(f"{cfg.name}: only Llama and Qwen2 configs are written; this one sets {', '.join(family)}")
    qwen = cfg.qkv_bias
    rope_scaling = None
    if cfg.rope_scaling is not None:
        rope_scaling = {"rope_type": "llama3", **dataclasses.asdict(cfg.rope_scaling)}
    # transformers 5 reads `rope_parameters`; 4.x reads `rope_theta` and `rope_scaling`.
    rope_parameters = {"rope_type": "default", "rope_theta": cfg.rope_theta, **(rope_scaling or {})}
    eos = list(cfg.eos_token_ids)
    return {
        "architectures": ["Qwen2ForCausalLM" if qwen else "LlamaForCausalLM"],
        "model_type": "qwen2" if qwen else "llama",
        "_name_or_path": cfg.name,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": rope_scaling,
        "rope_parameters": rope_parameters,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": False,  # Llama's flag also adds an o_proj bias, which we do not have
        "mlp_bias": False,
        "use_sliding_window": False,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
        "torch_dtype": cfg.dtype,
    }


def save_hf_dir(path: str | os.PathLike, cfg: ModelConfig, params: dict[str, np.ndarray],
                tokenizer=None) -> None:
    """Writes `config.json` and `model.safetensors` (and the tokenizer's files if given) so that
    `load_hf_dir` and transformers' `from_pretrained` read it back. Params are saved in
    `cfg.dtype`; tied embeddings are written once (no `lm_head.weight`)."""
    config = hf_config_dict(cfg)
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    tensors = scatter(cfg, HF_NAMES, cast(params, cfg.dtype))
    safetensors.numpy.save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    if tokenizer is not None:
        tokenizer.save(path)

