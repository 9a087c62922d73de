"""Which kernels run the engine's products on this CPU, chosen by timing them on the model's own shapes.

A kernel family runs every product of one engine (target and proposer):

- "amx": every product on AMX tiles (`cpu_kernels.amx_matmul`; int8 draft weights on the skinny kernel).
- "avx512": every product on the skinny kernel's AVX-512 path (at 512 tokens as fast as XLA's dot: 810
  against 787 ms for SmolLM2's layers, AMD EPYC).
- "avx2": the skinny kernel's AVX2 path for products over at most `engine.step.SKINNY_MAX_ROWS` tokens, XLA's
  dot over the same weight values above (2.3x faster than the AVX2 path at 512 tokens). A token's sums then
  hang on its step's size, as batch invariance does on such CPUs.
- "xla": XLA's dot everywhere.

One family per engine, never one per step size: kernels sum in different orders, so a request whose
products changed kernel with its batch mates would lose batch invariance, and speculative decoding its
greedy equality with plain decoding. The trade-off: where one family is faster for decode and another
for wide steps (AMX CPUs: the skinny kernel at one token, AMX from a few), the engine takes the one with
the least time over a one-token and a 16-token step (`MEASURE_TOKENS`), the steps of decode and of verify
windows or small batches.

`choose` times each family this CPU runs on a model of the target's shapes with random weights (its first
layers up to `MEASURE_BYTES` of kernel weights, so the timing streams from memory as decode does, and its
output head), families alternating over `ROUNDS`, medians. Where the target's float32 weights are exact GGUF
blocks (`weight_formats`: the skinny kernel then reads the blocks, `cpu_kernels.blocks`), the random weights
are made blocks of the same formats. The result is kept on disk per CPU, model shape, kernel dtype, weight
formats and kernel library (`checkpoints.resolve.cache_dir()/kernels/`), so a machine measures once.
`matmul` other than "auto" forces a family; `JSE_MEASURE_KERNELS=0` in the environment (or a failed
measurement) takes the instruction-set default (`isa_default`: AMX, then AVX-512, AVX2, XLA's dot).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import cpu_kernels
from cpu_kernels import blocks
from checkpoints.resolve import cache_dir, random_params
from model.config import ModelConfig

log = logging.getLogger(__name__)

FAMILIES = ("amx", "avx512", "avx2", "xla")
MEASURE_TOKENS = (1, 16)
MEASURE_BYTES = 128 << 20  # kernel weights the timed layers stream: well past any L3
ROUNDS = 7
ALL_ROWS = 1 << 30  # skinny kernel rows that stand for "every step size"
_ITEMSIZE = {"float32": 4, "bfloat16": 2, "int8": 1}


@dataclasses.dataclass(frozen=True)
class KernelChoice:
    """family: one of `FAMILIES`; how: "measured", "cached" (measured by an earlier process), "forced"
    (`matmul`), "default" (the instruction-set default); seconds: family -> median seconds of a step of each
    of `MEASURE_TOKENS` tokens, where measured."""

    family: str
    how: str
    seconds: dict[str, list[float]] = dataclasses.field(default_factory=dict)


def families(dtype: str = "float32") -> list[str]:
    """The families this process can run with kernel weights in `dtype`, the instruction-set default first."""
    if jax.default_backend() != "cpu" or not cpu_kernels.available():
        return ["xla"]
    amx = ["amx"] if cpu_kernels.amx_available() and dtype != "int8" else []
    return amx + cpu_kernels.skinny_isas() + ["xla"]


def isa_default(dtype: str = "float32") -> str:
    """The family the instruction set alone picks: AMX, else AVX-512, AVX2, XLA's dot."""
    return families(dtype)[0]


def weight_formats(params: dict, dtype: str) -> dict[str, str]:
    """The block format (`cpu_kernels.blocks.find_blocks`) the skinny kernel will read each projection and the
    output head in, judged by the first `blocks.CHUNK` columns of layer 0's weight: name -> "q4_1" or "q8_0",
    only where one is found (none for a `dtype` other than float32 or with `JSE_WEIGHT_BLOCKS=0`)."""
    if dtype != "float32" or not blocks.enabled():
        return {}
    found = {}
    for name in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "lm_head", "embed"):
        if name not in params or (name == "embed" and "lm_head" in params) or params[name].ndim > 3:
            continue  # experts ([L, X, in, out]) run on XLA's ragged dot
        w = params[name][0] if params[name].ndim == 3 else params[name]
        w = w[:blocks.CHUNK].T if name == "embed" else w[:, :blocks.CHUNK]  # the head reads the embedding transposed
        fmt = blocks.find_blocks(np.asarray(w, np.float32))
        if fmt is not None:
            found[name] = fmt[0]
    return found


def choose(cfg: ModelConfig, dtype: str, matmul: str = "auto", formats: dict[str, str] | None = None) -> KernelChoice:
    """The kernel family for a model of `cfg`'s shapes with kernel weights in `dtype` ("float32", "bfloat16",
    "int8") and block `formats` (`weight_formats`): `matmul` itself unless it is "auto", else the fastest
    measured (or cached) here.

    Raises ValueError for a `matmul` this process cannot run (not in `families(dtype)`).
    """
    here = families(dtype)
    if matmul != "auto":
        if matmul not in here:
            raise ValueError(f"matmul={matmul!r} does not run here (this CPU and build run {here})")
        return KernelChoice(matmul, "forced")
    if len(here) == 1 or os.environ.get("JSE_MEASURE_KERNELS", "1") == "0":
        return KernelChoice(here[0], "default")
    formats = formats or {}
    path = os.path.join(cache_dir(), "kernels", _cache_key(cfg, dtype, here, formats) + ".json")
    try:
        with open(path) as f:
            seconds = json.load(f)["seconds"]
        how = "cached"
    except (OSError, ValueError, KeyError):
        try:
            seconds = measure(cfg, dtype, here, formats)
        except Exception as e:  # noqa: BLE001 - any failure keeps the engine on the default
            log.warning("timing the product kernels failed (%s: %s); using the default, %s", type(e).__name__, e,
                        here[0])
            return KernelChoice(here[0], "default")
        _write(path, {"seconds": seconds, "families": here, "dtype": dtype, "formats": formats})
        how = "measured"
    best = min(seconds, key=lambda f: sum(seconds[f]))
    log.info("product kernels: %s (%s; ms at %s tokens: %s)", best, how, "/".join(map(str, MEASURE_TOKENS)),
             ", ".join(f"{f} {'/'.join(f'{1e3 * s:.1f}' for s in v)}" for f, v in seconds.items()))
    return KernelChoice(best, how, seconds)


def layout(family: str, dtype: str) -> tuple[str, int, int | None, str] | None:
    """The arguments of `Llama.pack_linears` (dtype, skinny kernel rows, AMX passes, skinny path) that run
    `family` with kernel weights in `dtype`, or None for XLA's dot. int8 weights go to the skinny kernel
    under "amx" (AMX takes bf16 tiles only)."""
    from engine.step import SKINNY_MAX_ROWS
    if family == "xla":
        return None
    if family == "amx" and dtype != "int8":
        return dtype, 0, 2 if dtype == "bfloat16" else 3, ""
    isa = "" if family == "amx" else family
    every_size = (isa or cpu_kernels.skinny_isas()[0]) == "avx512"
    return dtype, ALL_ROWS if every_size else SKINNY_MAX_ROWS, None, isa


def measure(cfg: ModelConfig, dtype: str, candidates: list[str],
            formats: dict[str, str] | None = None) -> dict[str, list[float]]:
    """Median seconds of a forward pass (products, norms, RoPE; no attention) and the output head over
    steps of each of `MEASURE_TOKENS` tokens, per family of `candidates`, on a model of `cfg`'s shapes with
    random weights, made GGUF blocks per `formats` (`weight_formats`): its first layers holding
    `MEASURE_BYTES` of kernel weights (at least one)."""
    from model.llama import Llama

    E, F, D = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    layer_bytes = _ITEMSIZE[dtype] * (E * (cfg.num_heads + 2 * cfg.num_kv_heads) * D + cfg.num_heads * D * E + 3 * E * F)
    n = max(1, min(cfg.num_layers, math.ceil(MEASURE_BYTES / layer_bytes)))
    short = dataclasses.replace(cfg, num_layers=n, layer_windows=cfg.layer_windows[:n])
    params = random_params(short)
    for name, fmt in (formats or {}).items():
        params[name] = _as_blocks(params[name], fmt, along_last=name == "embed")
    programs = {}
    for family in candidates:
        model = Llama(short, params=params)
        args = layout(family, dtype)
        if args:
            model.pack_linears(*args)
        graphdef, state = nnx.split(model)

        @jax.jit
        def forward(state, token_ids, graphdef=graphdef):
            m = nnx.merge(graphdef, state)
            positions = jnp.arange(token_ids.shape[0], dtype=jnp.int32)
            hidden, _ = m(token_ids, positions, lambda q, k, v, layer, cache, spec: (q, cache), None)
            return m.head_logits(hidden)

        for T in MEASURE_TOKENS:
            ids = jnp.zeros((T,), jnp.int32)
            programs[family, T] = (forward.lower(state, ids).compile(), state, ids)
    times = {key: [] for key in programs}
    for r in range(ROUNDS + 1):
        for key, (run, state, ids) in programs.items():
            t = time.perf_counter()
            jax.block_until_ready(run(state, ids))
            if r:  # round 0 warms up
                times[key].append(time.perf_counter() - t)
    return {f: [statistics.median(times[f, T]) for T in MEASURE_TOKENS] for f in candidates}


def _as_blocks(w: np.ndarray, fmt: str, along_last: bool) -> np.ndarray:
    """`w` (`[..., in, out]`, or `[out, in]` when `along_last`) rounded to GGUF `fmt` blocks along `in`
    (gguf-py's quantize and dequantize)."""
    import gguf

    kind = {"q4_1": gguf.GGMLQuantizationType.Q4_1, "q8_0": gguf.GGMLQuantizationType.Q8_0}[fmt]
    rows = np.ascontiguousarray(w if along_last else np.swapaxes(w, -1, -2), np.float32)
    out = gguf.quants.dequantize(gguf.quants.quantize(rows, kind), kind).astype(np.float32)
    return out if along_last else np.ascontiguousarray(np.swapaxes(out, -1, -2))


def _cache_key(cfg: ModelConfig, dtype: str, here: list[str], formats: dict[str, str]) -> str:
    """What a measurement depends on: the CPU, the kernel library, jax, the timed shapes, `dtype` and the
    weights' block `formats`."""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        cpu = ""
    try:
        lib = cpu_kernels.library_path()
    except OSError:
        lib = None
    key = {"cpu": cpu, "cpus": os.cpu_count(), "families": here, "jax": jax.__version__,
           "library": [os.path.getsize(lib), os.path.getmtime(lib)] if lib else None,
           "shapes": [cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                      cfg.head_vocab_size or cfg.vocab_size, min(cfg.num_layers, 1 << 20)],
           "dtype": dtype, "formats": formats, "tokens": MEASURE_TOKENS, "bytes": MEASURE_BYTES}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]


def _write(path: str, value: dict) -> None:
    """Writes `value` as JSON to `path` atomically; a cache that cannot be written is only logged."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(value, f)
        os.replace(tmp, path)
    except OSError as e:
        log.warning("could not cache the kernel timings in %s: %s", path, e)
