"""Loading GGUF files (llama.cpp's format) into our layout.

Format spec: ggml's `docs/gguf.md` (github.com/ggml-org/ggml). Tensor names and
metadata keys follow llama.cpp's `convert_hf_to_gguf.py` and `gguf-py/gguf/constants.py`.
"""

from __future__ import annotations

import os
import re

import gguf
import numpy as np
from gguf.quants import dequantize

from checkpoints._layout import NameMap, gather
from model.config import ModelConfig, RopeScaling, get_preset, preset_names
from model.ops import rope_inv_freq

GGUF_NAMES: NameMap = {
    "embed": ("token_embd.weight", False),
    "final_norm": ("output_norm.weight", False),
    "lm_head": ("output.weight", True),
    "attn_norm": ("blk.{i}.attn_norm.weight", False),
    "wq": ("blk.{i}.attn_q.weight", True),
    "wk": ("blk.{i}.attn_k.weight", True),
    "wv": ("blk.{i}.attn_v.weight", True),
    "wo": ("blk.{i}.attn_output.weight", True),
    "bq": ("blk.{i}.attn_q.bias", False),
    "bk": ("blk.{i}.attn_k.bias", False),
    "bv": ("blk.{i}.attn_v.bias", False),
    "mlp_norm": ("blk.{i}.ffn_norm.weight", False),
    "w_gate": ("blk.{i}.ffn_gate.weight", True),
    "w_up": ("blk.{i}.ffn_up.weight", True),
    "w_down": ("blk.{i}.ffn_down.weight", True),
    "q_norm": ("blk.{i}.attn_q_norm.weight", False),
    "k_norm": ("blk.{i}.attn_k_norm.weight", False),
    "post_attn_norm": ("blk.{i}.post_attention_norm.weight", False),  # Gemma's; its pre-MLP norm is ffn_norm
    "post_mlp_norm": ("blk.{i}.post_ffw_norm.weight", False),
}

# Architectures whose Q/K rows convert_hf_to_gguf permuted for llama.cpp's interleaved
# ("normal") RoPE; the others use NEOX RoPE, which is already our half-split layout.
_PERMUTED_ARCHS = ("llama",)
_ARCHS = ("llama", "qwen2", "qwen3", "qwen3moe", "phi3", "gemma2", "gemma3")

# A mixture of experts (Mixtral as `llama`, `qwen3moe`): the router and every expert of a layer in one tensor,
# numpy shapes [X, E] and [X, out, in]; ours are [E, X] and [X, in, out] (`load_gguf` swaps each expert's axes).
GGUF_EXPERTS: NameMap = {
    "router": ("blk.{i}.ffn_gate_inp.weight", True),
    "w_gate": ("blk.{i}.ffn_gate_exps.weight", False),
    "w_up": ("blk.{i}.ffn_up_exps.weight", False),
    "w_down": ("blk.{i}.ffn_down_exps.weight", False),
}

# Token texts llama.cpp treats as end-of-generation (llama-vocab.cpp, `special_eog_ids`),
# beside the declared eos: chat models end turns with one and documents with another.
_EOG_TEXTS = frozenset({
    "<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>",
    "<EOT>", "_<EOT>", "<|end▁of▁sentence|>", "<end_of_utterance>",
})
CONTROL = 3  # gguf.TokenType.CONTROL
USER_DEFINED = 4  # gguf.TokenType.USER_DEFINED


class _Reader(gguf.GGUFReader):
    """gguf's reader over a plain ndarray view of its memory map: each slice of an `np.memmap` runs numpy's
    Python-level `memmap.__array_finalize__`, and the header's ~100k vocabulary strings took 2.4 s of
    slices (0.9 s this way; same fields and tensors, still mapped, not read)."""

    def _get(self, offset, dtype, count=1, override_order=None):
        if type(self.data) is np.memmap:
            self.data = self.data.view(np.ndarray)
        return super()._get(offset, dtype, count, override_order)


def open_reader(reader_or_path: gguf.GGUFReader | str | os.PathLike) -> gguf.GGUFReader:
    if isinstance(reader_or_path, gguf.GGUFReader):
        return reader_or_path
    return _Reader(os.fspath(reader_or_path))


def field(reader: gguf.GGUFReader, key: str, default=None):
    """A metadata value as a Python object (str, number, list), or `default` if absent."""
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def eos_token_ids(reader: gguf.GGUFReader) -> tuple[int, ...]:
    """The declared eos first, then every other control token llama.cpp stops on."""
    eos = field(reader, "tokenizer.ggml.eos_token_id")
    tokens = field(reader, "tokenizer.ggml.tokens", [])
    types = field(reader, "tokenizer.ggml.token_type") or [CONTROL] * len(tokens)  # untyped: by text alone
    eog = [i for i, (t, ty) in enumerate(zip(tokens, types)) if ty == CONTROL and t in _EOG_TEXTS]
    return tuple(dict.fromkeys(([eos] if eos is not None else []) + eog))


def _f32(x) -> float:
    # GGUF stores float32; its shortest decimal (1e-05, not 9.99999974e-06) is what was written.
    return float(str(np.float32(x)))


def _rope_scaling(reader: gguf.GGUFReader, head_dim: int, theta: float) -> RopeScaling | None:
    """Recovers Llama-3 scaling parameters from the `rope_freqs.weight` factors tensor.

    convert_hf_to_gguf bakes Llama 3.1+ scaling into per-frequency divisors and keeps no
    parameters; our config is parametric, so we accept the file only if Llama 3's low/high
    frequency factors (1, 4) and the converter's original context (8192: it reads a top-level
    `original_max_position_embeddings` that Llama 3 configs lack) reproduce it.
    """
    t = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if t is None:
        return None
    factors = dequantize(t.data, t.tensor_type).astype(np.float64).reshape(-1)
    guess = RopeScaling(float(factors.max()), 1.0, 4.0, 8192)
    probe = ModelConfig(name="probe", vocab_size=1, hidden_size=head_dim, intermediate_size=1, num_layers=1,
                        num_heads=1, num_kv_heads=1, head_dim=head_dim, rope_theta=theta)
    base = rope_inv_freq(probe)
    if not np.allclose(base / factors, rope_inv_freq(probe.replace(rope_scaling=guess)), rtol=1e-4):
        raise ValueError("rope_freqs.weight does not match Llama-3 scaling (low 1, high 4); unsupported")
    return guess


def _config(reader: gguf.GGUFReader, names: set[str]) -> ModelConfig:
    arch = field(reader, "general.architecture")
    if arch not in _ARCHS:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(_ARCHS)}")
    k = lambda key, default=None: field(reader, f"{arch}.{key}", default)
    E, H = int(k("embedding_length")), int(k("attention.head_count"))
    D = int(k("attention.key_length", E // H))
    theta = _f32(k("rope.freq_base", 10000.0))
    vocab = len(field(reader, "tokenizer.ggml.tokens", [])) or k("vocab_size")
    if not vocab:
        raise ValueError("GGUF file has neither tokenizer.ggml.tokens nor a vocab_size")
    bos = field(reader, "tokenizer.ggml.bos_token_id")
    num_layers = int(k("block_count"))
    experts = int(k("expert_count", 0))
    if {"rope_factors_long.weight", "rope_factors_short.weight"} & names:
        raise ValueError("LongRoPE scaling (rope_factors_long / _short) is not supported")
    window = int(k("attention.sliding_window", 0)) if arch == "phi3" else 0  # Phi-3: every layer
    cfg = ModelConfig(
        name="gguf", vocab_size=int(vocab), hidden_size=E,
        intermediate_size=int(k("expert_feed_forward_length", 0) or k("feed_forward_length")) if experts
        else int(k("feed_forward_length")), num_layers=num_layers, num_heads=H,
        num_kv_heads=int(k("attention.head_count_kv", H)), head_dim=D,
        rms_norm_eps=_f32(k("attention.layer_norm_rms_epsilon", 1e-5)), rope_theta=theta,
        rope_scaling=_rope_scaling(reader, D, theta),
        max_position_embeddings=int(k("context_length", 2048)),
        tie_word_embeddings="output.weight" not in names, qkv_bias="blk.0.attn_q.bias" in names,
        bos_token_id=None if bos is None else int(bos), eos_token_ids=eos_token_ids(reader),
        qk_norm="blk.0.attn_q_norm.weight" in names,
        **({"layer_windows": (window,) * num_layers} if window else _gemma_fields(arch, k, num_layers)),
        num_experts=experts, num_experts_per_tok=int(k("expert_used_count", 0)) if experts else 0,
        norm_topk_prob=bool(k("expert_weights_norm", True)),
    )
    return cfg.replace(name=_name(cfg, field(reader, "general.name") or arch))


def _gemma_fields(arch: str, k, num_layers: int) -> dict:
    """Gemma 2 / 3's `ModelConfig` fields from a GGUF's metadata and what llama.cpp (`llama-model.cpp`) fixes
    in code: windowed layers every other one from the first (Gemma 2) or five in six (Gemma 3, unless the
    file gives `attention.sliding_window_pattern`), a local RoPE base of 10000 (Gemma 3), the soft-caps
    (Gemma 2). convert_hf_to_gguf stores Gemma's norm weights with their + 1 added: no offset here."""
    if arch not in ("gemma2", "gemma3"):
        return {}
    window = int(k("attention.sliding_window", 0))
    every = 2 if arch == "gemma2" else int(k("attention.sliding_window_pattern", 6))
    return dict(
        layer_windows=tuple(window if (i + 1) % every else 0 for i in range(num_layers)) if window else (),
        rope_local_theta=_f32(k("rope.freq_base_swa", 10000.0)) if arch == "gemma3" else 0.0,
        sandwich_norms=True, hidden_act="gelu_tanh", scale_embeddings=True,
        attn_softcap=_f32(k("attn_logit_softcapping", 0.0)), final_softcap=_f32(k("final_logit_softcapping", 0.0)))


def _name(cfg: ModelConfig, general_name: str) -> str:
    """A preset's name if the geometry is that preset's, so preset-keyed tables apply; else a slug."""
    geometry = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                "head_dim", "tie_word_embeddings", "qkv_bias", "rope_theta", "rope_scaling")
    for preset in preset_names():
        p = get_preset(preset)
        if all(getattr(p, g) == getattr(cfg, g) for g in geometry):
            return preset
    return re.sub(r"[^a-z0-9.]+", "-", general_name.lower()).strip("-")


def load_gguf(path: str | os.PathLike | gguf.GGUFReader,
              dtype: str | None = None) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Reads a GGUF file's (or open reader's) config and weights, dequantized to `dtype` (default float32).

    Every tensor type `gguf.quants.dequantize` knows is accepted (F32, F16, BF16, Q4_0..Q8_0,
    K-quants, IQ*). Returns (config, params) with params named and shaped as `param_specs` (Phi-3's fused
    projections sliced, a mixture of experts' fused expert tensors split per expert).
    Raises ValueError for an unsupported architecture or unknown vocabulary size, NotImplementedError
    for a tensor type the gguf package cannot dequantize, KeyError for a missing tensor.
    """
    reader = open_reader(path)
    tensors = {t.name: t for t in reader.tensors}
    cfg = _config(reader, set(tensors))
    if dtype is not None:
        cfg = cfg.replace(dtype=dtype)
    permuted = field(reader, "general.architecture") in _PERMUTED_ARCHS
    q, kv, F = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    # Phi-3's fused projections (llama.cpp's `attn_qkv`, and `ffn_up` holding gate then up), as row slices.
    fused = {"attn_q": ("attn_qkv", 0, q), "attn_k": ("attn_qkv", q, q + kv), "attn_v": ("attn_qkv", q + kv, q + 2 * kv),
             "ffn_gate": ("ffn_up", 0, F), "ffn_up": ("ffn_up", F, 2 * F)}
    phi3 = field(reader, "general.architecture") == "phi3"

    def fetch(name: str) -> np.ndarray:
        part = name.split(".")[2] if name.startswith("blk.") else None
        if phi3 and part in fused:
            whole, lo, hi = fused[part]
            return fetch_whole(name.replace(part, whole))[lo:hi]
        return fetch_whole(name)

    def fetch_whole(name: str) -> np.ndarray:
        t = tensors[name]
        if t.tensor_type in (gguf.GGMLQuantizationType.F64, gguf.GGMLQuantizationType.I8,
                             gguf.GGMLQuantizationType.I16, gguf.GGMLQuantizationType.I32):
            w = np.asarray(t.data, np.float32)  # already typed by the reader; not quantized
        else:
            w = dequantize(t.data, t.tensor_type)  # numpy shape = reversed ggml ne: [out, in]
        if permuted and name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = cfg.num_heads if "attn_q" in name else cfg.num_kv_heads
            w = unpermute_qk(w, heads)
        if name.endswith("_exps.weight"):
            w = np.swapaxes(w, -1, -2)  # each expert [out, in] -> [in, out]
        return w

    return cfg, gather(cfg, {**GGUF_NAMES, **GGUF_EXPERTS} if cfg.num_experts else GGUF_NAMES, fetch)


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undoes convert_hf_to_gguf's `permute` of Q/K rows `[N*D, E]` (or bias `[N*D]`).

    llama.cpp rotates interleaved pairs (x0,x1),(x2,x3)...; HF and we rotate halves
    (x_j, x_{j+D/2}). The converter reorders each head's rows as
    `reshape(N, 2, D/2, ...).swapaxes(1, 2)`; the inverse swaps back from `(N, D/2, 2, ...)`.
    """
    rest = w.shape[1:]
    return w.reshape(n_heads, -1, 2, *rest).swapaxes(1, 2).reshape(w.shape)
