"""Per-device memory plan for a model under tensor parallelism: weights, KV pool, activations, capacity.

  python -m engine.memory_plan --model=llama-3-70b --tensor_parallel_size=8 --dtype=bfloat16 \\
      [--device_memory_gib=80] [--memory_utilization=0.9] [--kv_cache_dtype=bfloat16] \\
      [--max_num_batched_tokens=512] [--max_num_seqs=64] [--block_size=16]

Sharding is Megatron-LM's (Shoeybi et al. 2019, §3): the QKV and gate/up
projections split by output columns, o and down by input rows (one all-reduce
each), the embedding and the LM head by vocabulary (padded to a multiple of
the axis), norms replicated. The KV heads split across the axis; when the axis
is wider than the KV-head count each device keeps one KV head (replicated
`tp / K` times, as vLLM does), so the KV bytes per device stop shrinking there.

Weights and KV bytes are exact (the arrays' own sizes; `tests/test_plan.py`
checks them against the built model and pool). Activations are an estimate of
the largest transient set of one step: the residual stream and the widest
projection outputs over the token budget, and the gathered float32 logits of
the sampled rows with the sampler's working copies. On CPU the native kernels
keep packed copies of the weights besides (the engine logs their size at
start-up); the plan, written for accelerators, does not count them.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys

import numpy as np

from model.config import ModelConfig
from model.llama import check_tensor_parallel, kv_heads_per_device, param_specs

_BYTES = {"float32": 4, "bfloat16": 2}
SAMPLER_COPIES = 4  # [S, V] float32 arrays live at once while sampling: logits, scaled, exponentials, kept mask


def shard_shapes(cfg: ModelConfig, tp: int) -> dict[str, tuple[int, ...]]:
    """Each parameter's per-device shape, from its logical axes in `model.llama.param_specs`: `vocab`,
    `q_heads` and `mlp` split over `tp` (vocab padded up), `kv_heads` to `kv_heads_per_device` heads, the
    rest (`embed`, `layers`) whole.

    Raises ValueError when the heads or the intermediate size do not split over `tp`.
    """
    check_tensor_parallel(cfg, tp)
    kv = kv_heads_per_device(cfg.num_kv_heads, tp) * cfg.head_dim
    per_device = {"vocab": lambda n: math.ceil(n / tp), "q_heads": lambda n: n // tp,
                  "mlp": lambda n: n // tp, "kv_heads": lambda n: kv}
    return {name: tuple(per_device.get(axis, lambda n: n)(n) for n, axis in zip(shape, axes))
            for name, (shape, axes) in param_specs(cfg).items()}


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Bytes per device. `kv_tokens` is how many tokens the KV pool holds in what is left of
    `device_bytes * utilization` after the weights (with the RoPE table) and activations (0 when nothing is
    left)."""

    tensor_parallel_size: int
    weight_bytes: int
    kv_bytes_per_token: int
    activation_bytes: int
    device_bytes: int
    utilization: float
    block_size: int
    sliding_window: int = 0  # `ModelConfig.max_window`: a sequence's passed blocks go back to the pool

    @property
    def kv_pool_bytes(self) -> int:
        return max(0, int(self.device_bytes * self.utilization) - self.weight_bytes - self.activation_bytes)

    @property
    def kv_blocks(self) -> int:
        return self.kv_pool_bytes // (self.kv_bytes_per_token * self.block_size)

    @property
    def kv_tokens(self) -> int:
        return self.kv_blocks * self.block_size

    def blocks_per_seq(self, max_model_len: int) -> int:
        """Blocks one decoding sequence of `max_model_len` tokens holds: all of them, or with every layer
        windowed the window's blocks and the one being written (`scheduler.BlockManager.release_before`)."""
        whole = math.ceil(max_model_len / self.block_size)
        return min(whole, math.ceil(self.sliding_window / self.block_size) + 1) if self.sliding_window else whole

    def max_num_seqs_at(self, max_model_len: int) -> int:
        """Sequences of `max_model_len` tokens the pool holds at once while they decode (whole blocks each)."""
        return self.kv_blocks // self.blocks_per_seq(max_model_len)


def memory_plan(cfg: ModelConfig, tensor_parallel_size: int = 1, kv_cache_dtype: str | None = None,
                max_num_batched_tokens: int = 512, max_num_seqs: int = 64, block_size: int = 16,
                device_bytes: int = 80 << 30, utilization: float = 0.9) -> MemoryPlan:
    """The per-device plan for `cfg` (its `dtype` is the weights' and activations') over `tensor_parallel_size`
    devices. `kv_cache_dtype` defaults to `cfg.dtype`. Raises ValueError for shapes that do not split."""
    for name, value in (("max_num_batched_tokens", max_num_batched_tokens), ("max_num_seqs", max_num_seqs),
                        ("block_size", block_size), ("device_bytes", device_bytes)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if not 0 < utilization <= 1:
        raise ValueError(f"memory utilization must be in (0, 1], got {utilization}")
    tp = tensor_parallel_size
    wb, kvb = _BYTES[cfg.dtype], _BYTES[kv_cache_dtype or cfg.dtype]
    weights = sum(int(np.prod(shape)) * (4 if name == "head_ids" else wb)  # head_ids: int32
                  for name, shape in shard_shapes(cfg, tp).items())
    tables = 2 if cfg.rope_local_theta else 1  # the RoPE tables (model.ops.rope_table), float32
    weights += tables * cfg.max_position_embeddings * cfg.head_dim * 4
    Kd = kv_heads_per_device(cfg.num_kv_heads, tp)
    kv_per_token = 2 * cfg.num_layers * Kd * cfg.head_dim * kvb
    # A mixture of experts runs each token through num_experts_per_tok experts: that many rows of F.
    E, D, T = cfg.hidden_size, cfg.head_dim, max_num_batched_tokens
    F = cfg.intermediate_size // tp * max(1, cfg.num_experts_per_tok)
    # Residual, normed input and the all-reduced output [T, E]; the wider of QKV (rotated in float32) and
    # gate/up with its product; then the gathered logits of the sampled rows.
    qkv = (cfg.num_heads // tp + 2 * Kd) * D
    per_token = 3 * E * wb + max(qkv * (wb + 4), 3 * F * wb)
    S = min(max_num_seqs, T)
    activations = T * per_token + SAMPLER_COPIES * S * cfg.vocab_size * 4
    return MemoryPlan(tp, weights, kv_per_token, activations, device_bytes, utilization, block_size, cfg.max_window)


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"


def format_plan(cfg: ModelConfig, plan: MemoryPlan, max_lens: list[int]) -> str:
    """The plan as a markdown table, then the largest max_num_seqs for each of `max_lens`."""
    lines = [f"{cfg.name}, {cfg.dtype}, tensor_parallel_size {plan.tensor_parallel_size}, "
             f"device {_gib(plan.device_bytes)} x {plan.utilization:.0%}",
             "", "| per device | bytes |", "|---|---:|",
             f"| weights | {_gib(plan.weight_bytes)} |",
             f"| activations (one step, estimate) | {_gib(plan.activation_bytes)} |",
             f"| KV pool (what is left) | {_gib(plan.kv_pool_bytes)} |",
             f"| KV per token | {plan.kv_bytes_per_token / 1024:.1f} KiB |",
             f"| KV pool tokens | {plan.kv_tokens:,} |",
             "", "| max_model_len | largest max_num_seqs |", "|---:|---:|"]
    lines += [f"| {n} | {plan.max_num_seqs_at(n)} |" for n in max_lens]
    if plan.kv_blocks == 0:
        lines.append("\nThe weights and activations do not leave room for one KV block: use more devices.")
    return "\n".join(lines)


def main(argv):
    from absl import flags

    from model.config import get_preset
    del argv
    F = flags.FLAGS
    try:
        if not 0 < F.device_memory_gib < 1 << 20:
            raise ValueError(f"--device_memory_gib must be in (0, 2^20), got {F.device_memory_gib}")
        cfg = ModelConfig.from_hf_config(F.model) if os.path.exists(F.model) else get_preset(F.model)
        if F.dtype:
            cfg = cfg.replace(dtype=F.dtype)
        plan = memory_plan(cfg, F.tensor_parallel_size, F.kv_cache_dtype, F.max_num_batched_tokens,
                           F.max_num_seqs, F.block_size, int(F.device_memory_gib * (1 << 30)),
                           F.memory_utilization)
    except KeyError as e:  # an unknown preset, or a config.json without a required field
        print(f"engine.memory_plan: {F.model} lacks the field {e}" if os.path.exists(F.model) else f"engine.memory_plan: {e.args[0]}",
              file=sys.stderr)
        return 2
    except (ValueError, TypeError, AttributeError, ZeroDivisionError, OSError) as e:  # unreadable or bad config
        print(f"engine.memory_plan: {e}", file=sys.stderr)
        return 2
    lens, n = [], 2048
    while n <= cfg.max_position_embeddings:
        lens.append(n)
        n *= 2
    print(format_plan(cfg, plan, lens or [cfg.max_position_embeddings]))
    return 0


def run() -> None:
    """Parses the command line and prints the plan (`python -m engine.memory_plan`)."""
    from absl import app, flags

    flags.DEFINE_string("model", "llama-3-70b", "Model preset, or a Hugging Face config.json (or its directory).")
    flags.DEFINE_integer("tensor_parallel_size", 1, "Devices the model is split over.")
    flags.DEFINE_enum("dtype", None, ["float32", "bfloat16"], "Weights and activations; default the preset's.")
    flags.DEFINE_enum("kv_cache_dtype", None, ["float32", "bfloat16"], "KV pool; default --dtype.")
    flags.DEFINE_float("device_memory_gib", 80.0, "Memory of one device, GiB.")
    flags.DEFINE_float("memory_utilization", 0.9, "Fraction of it the engine may use.")
    flags.DEFINE_integer("max_num_batched_tokens", 512, "Token budget per step.")
    flags.DEFINE_integer("max_num_seqs", 64, "Most sequences per step (sampled rows).")
    flags.DEFINE_integer("block_size", 16, "KV block size in tokens.")
    app.run(main)


if __name__ == "__main__":
    run()
