"""Engine limits, separate from the model's config."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Engine limits, separate from the model's config.

    num_blocks: KV pool size in blocks; None sizes the pool from
      `kv_cache_bytes`.
    max_model_len: prompt + output tokens per sequence; None means the model's
      context limit, capped at what the pool holds.
    enable_prefix_caching: reuse the KV of cached prompt blocks (radix tree, LRU).
    kv_watermark: fraction of the pool kept free: cached blocks are evicted to
      keep it on the free list, and new requests are admitted only above it.
    swap_space_bytes: host memory for the KV of preempted sequences.
    swap_threshold_tokens: preempted sequences at least this long are swapped
      to host memory; shorter ones (or when swap space is full) are recomputed.
    max_stop_strings, max_stop_chars: a request's stop strings, and the
      characters of each (the stream holds back one fewer than the longest; each
      step's text is searched for each of them).
    """

    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_bytes: int = 1 << 30
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    kv_watermark: float = 0.1
    swap_space_bytes: int = 1 << 30
    swap_threshold_tokens: int = 256
    max_stop_strings: int = 16
    max_stop_chars: int = 256
    # "auto": the Pallas kernel on GPU; on CPU (where Pallas only runs in interpret mode, an emulator
    # several times slower) the native kernel for small steps when it loads, else the jnp reference.
    attention: str = "auto"  # or "pallas" / "native" / "reference"
    # The kernel family that runs every product (`engine.kernels`): "auto" times those this CPU runs on the
    # model's shapes (once per machine and model, cached on disk) and takes the fastest; "amx", "avx512",
    # "avx2" (the native CPU kernels) or "xla" (XLA's dot) forces one.
    matmul: str = "auto"
    # The weights the CPU kernel streams, for the target and the draft: None keeps the dtype the checkpoint
    # stores (`LoadedModel.stored_dtype`: the bundled bf16 heads), else the model's;
    # "bfloat16" halves the bytes (activations stay in the model's dtype, sums in fp32); "int8"
    # quantizes them with per-column scales (meant for drafts: the output stays exact).
    kernel_dtype: str | None = None
    draft_kernel_dtype: str | None = None
    # Devices the target's weights and KV pool split over (Megatron-style tensor parallelism; the draft or
    # EAGLE head is replicated). `kv_cache_bytes` is per device.
    tensor_parallel_size: int = 1
    # Async scheduling: the next step is scheduled and dispatched before this one's tokens are read back, so
    # the host's work hides behind the device's (steps without a proposer; `Engine.step`).
    async_scheduling: bool = True

    def __post_init__(self):
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.matmul not in ("auto", "amx", "avx512", "avx2", "xla"):
            raise ValueError(f"matmul must be 'auto', 'amx', 'avx512', 'avx2' or 'xla', got {self.matmul!r}")
        for name in ("kernel_dtype", "draft_kernel_dtype"):
            if getattr(self, name) not in (None, "float32", "bfloat16", "int8"):
                raise ValueError(f"{name} must be None, 'float32', 'bfloat16' or 'int8', got {getattr(self, name)!r}")
        if self.attention not in ("auto", "reference", "native", "pallas"):
            raise ValueError(f"attention must be 'auto', 'reference', 'native' or 'pallas', got {self.attention!r}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if not 0 <= self.kv_watermark < 1:
            raise ValueError(f"kv_watermark must be in [0, 1), got {self.kv_watermark}")
        if self.swap_space_bytes < 0 or self.swap_threshold_tokens < 0:
            raise ValueError("swap_space_bytes and swap_threshold_tokens must be >= 0")
        if self.max_stop_strings < 0 or self.max_stop_chars < 1:
            raise ValueError("max_stop_strings must be >= 0 and max_stop_chars >= 1")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2 (or None for the model's limit), got {self.max_model_len}")
