"""Native XLA:CPU kernels (XLA FFI custom calls), the CPU counterparts of `pallas_kernels/`.

`skinny_matmul(x, w)`: y float32 `[T, N]` = x `[T, K]` @ W `[K, N]` for small
T (decode steps, verify windows, small batches), with W packed once by
`pack(w)` into panels of 16 output columns (`PackedWeight`, layout
`[ceil(N / 16), K, 16]`, zero padded). Each call streams every panel from
memory once and keeps `rows x 16` accumulators in vector registers
(`skinny_matmul.cc`); threads split the panels. Weights may be float32,
bfloat16 (half the bytes) or int8 with a per-output-column scale (a quarter);
accumulation is float32. float32 weights that are exactly GGUF Q4_1 or Q8_0
values (a GGUF checkpoint's) stay in those blocks, the same sums from a fifth
or a quarter of the bytes (`blocks.py`; `JSE_WEIGHT_BLOCKS=0` in the
environment keeps them in float32 panels). `skinny_matmul_reference` is the
plain-jnp reference.

`amx_matmul(x, w)`: the same product on Intel AMX tiles (the engine's every
product where the CPU has AMX), with W packed once by
`pack_amx(w, passes)` into bf16 tiles (`AmxWeight`) and x split into bf16 hi
and lo parts; 3 passes keep close to fp32 (the bf16x3 split), 2 are bf16
weights times ~fp32 activations (`amx_matmul.cc`); `amx_head_log_softmax`
fuses the output head with scoring's reduction.
`amx_matmul_reference` is its plain-jnp reference. `amx_available()` says
whether this CPU and OS allow AMX.

`log_softmax_gather(logits, targets)`: scoring's per-row reduction, each
target's log-probability and each row's argmax, in one threaded pass over the
rows (`log_softmax.cc`; AVX-512 only, `log_softmax_gather_reference` else).

`filter_logits(...)` and `draw(scores, uniforms)`: the sampler's per-row
passes (`engine.sampler` defines them; `sampling.cc`), one thread per row, on
any CPU the library loads on.

`paged_attention(...)`: ragged paged attention with the contract of
`pallas_kernels.reference.ragged_paged_attention_reference` (its reference),
for steps of few tokens (decode, verify windows); `paged_attention.cc` gives
the algorithm.

The library is compiled by the install (`pip install -e .`, see `setup.py`).
When it is missing or cannot load, or the CPU has neither AVX-512F nor
AVX2+FMA, `available()` is False, one warning is logged, and callers keep
XLA's dot. A `PackedWeight`'s `isa` picks the skinny kernel's AVX-512 or AVX2
path per product (`skinny_isas()` lists those this CPU runs; the engine times
them, `engine.kernels`). `JSE_CPU_ISA=avx2` in the environment keeps an
AVX-512 CPU on the AVX2 paths of every kernel and `JSE_CPU_ISA=avx512` off AMX
(read once, when the library loads).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import importlib.machinery
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np

from cpu_kernels import blocks

log = logging.getLogger(__name__)

PANEL = 16  # output columns per panel (the kernel's vector width)
_HERE = os.path.dirname(os.path.abspath(__file__))
_TARGET = "jse_skinny_matmul"
_LAYERS_TARGET = "jse_skinny_matmul_layers"
_ATTENTION_TARGET = "jse_paged_attention"
_AMX_TARGET = "jse_amx_matmul"
_AMX_LAYERS_TARGET = "jse_amx_matmul_layers"
_LOG_SOFTMAX_TARGET = "jse_log_softmax_gather"
_AMX_HEAD_TARGET = "jse_amx_head_log_softmax"
_FILTER_TARGET = "jse_filter_logits"
_DRAW_TARGET = "jse_draw"
AMX_TILE_K = 32  # bf16 elements of k per AMX tile row
AMX_BLOCK = 32  # output columns (and rows) per 2 x 2 block of AMX C tiles
_DTYPES = {"float32": np.float32, "bfloat16": jnp.bfloat16, "int8": np.int8}
_ISAS = {"": 0, "avx2": 1, "avx512": 2}  # the skinny kernel's `isa` attribute


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedWeight:
    """A `[K, N]` weight in the kernel's panel layout.

    panels: `[ceil(N / 16), K, 16]` float32, bfloat16 or int8; for a block `format`, uint8
      `[ceil(N / 16), K / 32, blocks.BLOCK_BYTES[format]]`.
    scales: float32 `[ceil(N / 16) * 16]` for int8 (W ~= panels * scales per
      column), else `[0]`.
    n: N, the real number of output columns (static).
    isa: the kernel path that runs it (static): "avx512", "avx2", or "" for the best this CPU has
      (`skinny_isas()`). The two paths sum in a different order.
    format: "" (panels of their element type), "q4_1" or "q8_0" (exact float32 values in GGUF blocks) (static).
    """

    panels: jax.Array
    scales: jax.Array
    n: int = dataclasses.field(metadata={"static": True})
    isa: str = dataclasses.field(default="", metadata={"static": True})
    format: str = dataclasses.field(default="", metadata={"static": True})

    @property
    def nbytes(self) -> int:
        return self.panels.nbytes + self.scales.nbytes


def pack(w, dtype: str = "float32", isa: str = "") -> PackedWeight:
    """Packs W `[K, N]` (any float array) into panels of `dtype` ("float32", "bfloat16" or "int8"), for the
    kernel path `isa` ("avx512", "avx2" or "": the best this CPU has).

    int8 uses symmetric per-column scales: q = round(W / s), s = max|W[:, n]| / 127. float32 weights whose
    values are exactly GGUF Q4_1 or Q8_0 blocks are kept in that block format (`blocks.find_blocks`; unless
    `JSE_WEIGHT_BLOCKS=0`): the same values, fewer bytes.
    Raises ValueError for another dtype or isa, or a non-2-D weight.
    """
    if dtype not in _DTYPES:
        raise ValueError(f"packed weight dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    if isa not in _ISAS:
        raise ValueError(f"skinny kernel isa must be one of {sorted(_ISAS)}, got {isa!r}")
    w = np.asarray(w, np.float32)
    if w.ndim != 2:
        raise ValueError(f"pack wants a [K, N] weight, got shape {w.shape}")
    K, N = w.shape
    scales = np.zeros(0, np.float32)
    if dtype == "float32" and blocks.enabled():
        found = blocks.find_blocks(w)
        if found is not None:
            return PackedWeight(jnp.asarray(found[1]), jnp.asarray(scales), N, isa, found[0])
    n_pad = -(-N // PANEL) * PANEL
    w = np.pad(w, ((0, 0), (0, n_pad - N)))
    if dtype == "int8":
        scales = np.maximum(np.abs(w).max(axis=0), 1e-30).astype(np.float32) / 127.0
        w = np.clip(np.rint(w / scales), -127, 127)
    panels = w.reshape(K, n_pad // PANEL, PANEL).transpose(1, 0, 2)
    return PackedWeight(jnp.asarray(np.ascontiguousarray(panels).astype(_DTYPES[dtype])), jnp.asarray(scales), N, isa)


def unpack(p: PackedWeight) -> jax.Array:
    """The float32 `[K, N]` weight a packed one stands for (dequantized for int8 and the block formats)."""
    if p.format:
        return jnp.asarray(blocks.unpack_blocks(p.format, np.asarray(p.panels), p.n))
    panels = p.panels.astype(jnp.float32)
    w = jnp.transpose(panels, (1, 0, 2)).reshape(panels.shape[1], -1)
    if p.scales.size:
        w = w * p.scales[None, :]
    return w[:, :p.n]


def skinny_matmul_reference(x: jax.Array, p: PackedWeight) -> jax.Array:
    """float32 `[T, N]` = x @ unpack(p), by `jnp.dot` at highest precision."""
    return jnp.dot(x.astype(jnp.float32), unpack(p), precision=jax.lax.Precision.HIGHEST)


def skinny_matmul(x: jax.Array, p: PackedWeight) -> jax.Array:
    """float32 `[T, N]` = x `[T, K]` @ W through the native kernel; requires `available()`."""
    _require()
    T = x.shape[0]
    scales = p.scales if p.scales.size else jnp.zeros(0, jnp.float32)
    call = jax.ffi.ffi_call(_TARGET, jax.ShapeDtypeStruct((T, p.n), jnp.float32))
    return call(x.astype(jnp.float32), p.panels, scales, isa=np.int32(_ISAS[p.isa]), format=_format(p))


def skinny_matmul_layers(x: jax.Array, weights: list[PackedWeight], layer: jax.Array) -> jax.Array:
    """float32 `[T, N]` = x `[T, K]` @ `weights[layer]` through the native kernel, for a loop over layers
    (`lax.scan`): every layer's panels are operands the loop passes through as they are, so the product reads
    the chosen layer's in place where slicing a stacked `[L, ...]` weight would copy it each iteration.

    `weights`: L `PackedWeight`s of one shape, dtype, N and isa; `layer`: int32 `[]`. Requires
    `available()`; a `layer` outside [0, L) fails the call at run time.
    """
    _require()
    first = weights[0]
    key = lambda w: (w.panels.shape, w.panels.dtype, w.n, w.isa, w.format)  # noqa: E731
    if any(key(w) != key(first) for w in weights):
        raise ValueError("skinny_matmul_layers: every layer's weight must have one shape, dtype, n, isa and format")
    scales = [w.scales if w.scales.size else jnp.zeros(0, jnp.float32) for w in weights]
    call = jax.ffi.ffi_call(_LAYERS_TARGET, jax.ShapeDtypeStruct((x.shape[0], first.n), jnp.float32))
    return call(x.astype(jnp.float32), jnp.asarray(layer, jnp.int32), *[w.panels for w in weights], *scales,
                isa=np.int32(_ISAS[first.isa]), format=_format(first))


def _format(p: PackedWeight) -> np.int32:
    """The skinny kernel's `format` attribute for `p`: 0 for panels, else its block format's number."""
    return np.int32(blocks.FORMATS[p.format] if p.format else 0)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AmxWeight:
    """A `[K, N]` weight in AMX bf16 tiles (see `amx_matmul.cc` for the layout).

    hi: bfloat16 `[Np / 16, Kp / 32, 16, 32]`, W rounded to bf16 (Kp, Np: K and N
      padded with zeros to multiples of 32).
    lo: bfloat16, the same shape, W - hi rounded to bf16 (3 passes), or `[0]` (2 passes).
    n: N, the real number of output columns (static).
    """

    hi: jax.Array
    lo: jax.Array
    n: int = dataclasses.field(metadata={"static": True})

    @property
    def nbytes(self) -> int:
        return self.hi.nbytes + self.lo.nbytes


def pack_amx(w, passes: int = 3) -> AmxWeight:
    """Packs W `[K, N]` (any float array) into AMX tiles: `passes` 3 keeps W as hi + lo bf16 parts (close to
    fp32), 2 as bf16 alone (x's hi and lo parts each make a pass). A W exact in bf16 (a checkpoint stored in
    bf16) has no lo part and takes 2 passes either way: the same sums, a third less to read. Raises ValueError
    for another `passes` or a non-2-D weight."""
    if passes not in (2, 3):
        raise ValueError(f"amx passes must be 2 or 3, got {passes!r}")
    w = np.asarray(w, np.float32)
    if w.ndim != 2:
        raise ValueError(f"pack_amx wants a [K, N] weight, got shape {w.shape}")
    K, N = w.shape
    kp, n_pad = -(-K // AMX_TILE_K) * AMX_TILE_K, -(-N // AMX_BLOCK) * AMX_BLOCK
    w = np.pad(w, ((0, kp - K), (0, n_pad - N)))
    # [c, r, e, p, j] -> [p, c, r, j, e]: k = 32 c + 2 r + e, n = 16 p + j
    tiles = w.reshape(kp // 32, 16, 2, n_pad // 16, 16).transpose(3, 0, 1, 4, 2).reshape(n_pad // 16, kp // 32, 16, 32)
    hi = tiles.astype(jnp.bfloat16)
    lo = (tiles - hi.astype(np.float32)).astype(jnp.bfloat16) if passes == 3 else np.zeros(0, jnp.bfloat16)
    if not lo.any():
        lo = np.zeros(0, jnp.bfloat16)
    return AmxWeight(jnp.asarray(hi), jnp.asarray(lo), N)


def unpack_amx(p: AmxWeight, k: int) -> jax.Array:
    """The float32 `[k, N]` weight a packed one stands for (hi + lo)."""
    tiles = p.hi.astype(jnp.float32)
    if p.lo.size:
        tiles = tiles + p.lo.astype(jnp.float32)
    n16, c = tiles.shape[:2]
    w = tiles.reshape(n16, c, 16, 16, 2).transpose(1, 2, 4, 0, 3).reshape(c * 32, n16 * 16)
    return w[:k, :p.n]


def amx_matmul_reference(x: jax.Array, p: AmxWeight) -> jax.Array:
    """float32 `[T, N]`: what `amx_matmul` computes (x split into bf16 parts as the kernel does, products
    summed in float32 at highest precision)."""
    x = x.astype(jnp.float32)
    k = x.shape[1]
    x_hi = x.astype(jnp.bfloat16).astype(jnp.float32)
    x_lo = (x - x_hi).astype(jnp.bfloat16).astype(jnp.float32)
    hi = unpack_amx(AmxWeight(p.hi, jnp.zeros(0, jnp.bfloat16), p.n), k)
    dot = functools.partial(jnp.dot, precision=jax.lax.Precision.HIGHEST)
    y = dot(x_hi, hi) + dot(x_lo, hi)
    return y + dot(x_hi, unpack_amx(p, k) - hi) if p.lo.size else y


def amx_matmul(x: jax.Array, p: AmxWeight) -> jax.Array:
    """float32 `[T, N]` = x `[T, K]` @ W on AMX tiles; requires `amx_available()`."""
    if not amx_available():
        raise RuntimeError("AMX is not available on this CPU or OS (or JSE_CPU_ISA turned it off)")
    call = jax.ffi.ffi_call(_AMX_TARGET, jax.ShapeDtypeStruct((x.shape[0], p.n), jnp.float32))
    return call(x.astype(jnp.float32), p.hi, p.lo)


def amx_matmul_layers(x: jax.Array, weights: list[AmxWeight], layer: jax.Array) -> jax.Array:
    """float32 `[T, N]` = x `[T, K]` @ `weights[layer]` on AMX tiles, for a loop over layers (as
    `skinny_matmul_layers`). `weights`: L `AmxWeight`s of one shape and n (lo parts all empty or all full);
    `layer`: int32 `[]`. Requires `amx_available()`; a `layer` outside [0, L) fails the call at run time."""
    if not amx_available():
        raise RuntimeError("AMX is not available on this CPU or OS (or JSE_CPU_ISA turned it off)")
    first = weights[0]
    if any((w.hi.shape, w.lo.shape, w.n) != (first.hi.shape, first.lo.shape, first.n) for w in weights):
        raise ValueError("amx_matmul_layers: every layer's weight must have one shape and n")
    call = jax.ffi.ffi_call(_AMX_LAYERS_TARGET, jax.ShapeDtypeStruct((x.shape[0], first.n), jnp.float32))
    return call(x.astype(jnp.float32), jnp.asarray(layer, jnp.int32), *[w.hi for w in weights],
                *[w.lo for w in weights])


def amx_head_log_softmax(x: jax.Array, p: AmxWeight, targets: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`log_softmax_gather(amx_matmul(x, p), targets)[:2]` without writing the `[T, N]` logits: the AMX
    product reduced per row as its column blocks are made (float32 `[T]` log-probabilities of int32 `targets`
    `[T]`, int32 `[T]` argmax). Requires `amx_available()`; a target outside [0, N) raises at run time."""
    if not amx_available():
        raise RuntimeError("AMX is not available on this CPU or OS (or JSE_CPU_ISA turned it off)")
    T = x.shape[0]
    call = jax.ffi.ffi_call(_AMX_HEAD_TARGET, (jax.ShapeDtypeStruct((T,), jnp.float32),
                                               jax.ShapeDtypeStruct((T,), jnp.int32)))
    return tuple(call(x.astype(jnp.float32), p.hi, p.lo, targets.astype(jnp.int32), n=np.int64(p.n)))


def log_softmax_gather_reference(logits: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """float32 `[T]` log-softmax of `logits` `[T, V]` at int32 `targets` `[T]`, int32 `[T]` argmax per row (the
    lowest index among equal maxima) and float32 `[T]` the argmax's log-softmax."""
    logits = logits.astype(jnp.float32)
    chosen = jnp.take_along_axis(logits, targets[:, None].astype(jnp.int32), axis=-1)[:, 0]
    lse = jax.nn.logsumexp(logits, axis=-1)
    return chosen - lse, jnp.argmax(logits, axis=-1).astype(jnp.int32), jnp.max(logits, axis=-1) - lse


def log_softmax_gather(logits: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`log_softmax_gather_reference` in the native kernel; requires `cpu_features() == "avx512"`. A target outside
    [0, V) raises at run time."""
    if cpu_features() != "avx512":
        raise RuntimeError("log_softmax_gather needs the kernel library on an AVX-512 CPU")
    T = logits.shape[0]
    call = jax.ffi.ffi_call(_LOG_SOFTMAX_TARGET, (jax.ShapeDtypeStruct((T,), jnp.float32),
                                                  jax.ShapeDtypeStruct((T,), jnp.int32),
                                                  jax.ShapeDtypeStruct((T,), jnp.float32)))
    return tuple(call(logits.astype(jnp.float32), targets.astype(jnp.int32)))


def filter_logits(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
                  min_p: jax.Array) -> jax.Array:
    """float32 `[N, V]`: `engine.sampler.filter_logits`'s contract (its arguments and kept set; the
    thresholds' sums in float64) in the native kernel. Requires `available()`."""
    _require()
    call = jax.ffi.ffi_call(_FILTER_TARGET, jax.ShapeDtypeStruct(logits.shape, jnp.float32))
    f32 = lambda a: a.astype(jnp.float32)
    return call(f32(logits), f32(temperature), top_k.astype(jnp.int32), f32(top_p), f32(min_p))


def draw(scores: jax.Array, uniforms: jax.Array) -> jax.Array:
    """int32 `[N]`: per row of float32 `scores` `[N, V]` (log-weights, -inf excluded, at least one finite), the
    first token whose running weight `e^(s - max)` passes `uniforms` `[N]` (in [0, 1)) times the row's total,
    else the last token with weight: a draw from `softmax(scores)`. Requires `available()`."""
    _require()
    call = jax.ffi.ffi_call(_DRAW_TARGET, jax.ShapeDtypeStruct(scores.shape[:1], jnp.int32))
    return call(scores.astype(jnp.float32), uniforms.astype(jnp.float32))


def paged_attention_supported(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether `paged_attention` takes these head shapes (at most 16 query heads per KV head, D % 8 == 0, D <= 256)."""
    return num_heads % num_kv_heads == 0 and num_heads // num_kv_heads <= 16 and head_dim % 8 == 0 and head_dim <= 256


def paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, block_tables: jax.Array,
                    seq_lens: jax.Array, query_start_loc: jax.Array, layer: jax.Array, *,
                    sm_scale: float | None = None, softcap: float = 0.0, sliding_window: int | jax.Array = 0,
                    tree_mask: jax.Array | None = None) -> jax.Array:
    """Causal (or token-tree) attention of ragged query tokens over a paged KV pool, in the native kernel.

    Same arguments, result and semantics as `ragged_paged_attention_reference`:
    q `[T, H, D]`, pools `[L, P, B, K, D]` (float32 or bfloat16), int32
    block_tables `[S, M]`, seq_lens `[S]`, query_start_loc `[S+1]`, layer `[]`,
    softcap (0 = none), sliding_window (int or int32 `[]`, 0 = global), optional int32 tree_mask `[T]` (`pallas_kernels.reference.tree_visible`);
    returns `[T, H, D]` in q's dtype (float32 inside). Requires `available()`
    and `paged_attention_supported(H, K, D)`. An out-of-range block table
    entry or length raises at run time instead of reading outside the pool.
    """
    _require()
    T, H, D = q.shape
    scale = sm_scale if sm_scale is not None else 1.0 / float(np.sqrt(D))
    call = jax.ffi.ffi_call(_ATTENTION_TARGET, jax.ShapeDtypeStruct((T, H, D), jnp.float32))
    out = call(q.astype(jnp.float32), k_pages, v_pages, block_tables.astype(jnp.int32), seq_lens.astype(jnp.int32),
               query_start_loc.astype(jnp.int32), jnp.asarray(layer, jnp.int32), jnp.asarray(sliding_window, jnp.int32),
               jnp.zeros((0,), jnp.int32) if tree_mask is None else tree_mask.astype(jnp.int32),
               sm_scale=np.float32(scale), softcap=np.float32(softcap))
    return out.astype(q.dtype)


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The compiled kernel library, loaded and registered once; None (and one warning) if it cannot run here."""
    try:
        lib = ctypes.CDLL(library_path())
    except OSError as e:
        log.warning("CPU kernels unavailable (%s); using XLA's dot. `pip install -e .` builds them", e)
        return None
    if lib.jse_cpu_features() == 0:
        log.warning("this CPU has neither AVX-512F nor AVX2+FMA; using XLA's dot")
        return None
    jax.ffi.register_ffi_target(_TARGET, jax.ffi.pycapsule(lib.JseSkinnyMatmul), platform="cpu")
    jax.ffi.register_ffi_target(_LAYERS_TARGET, jax.ffi.pycapsule(lib.JseSkinnyMatmulLayers), platform="cpu")
    jax.ffi.register_ffi_target(_ATTENTION_TARGET, jax.ffi.pycapsule(lib.JsePagedAttention), platform="cpu")
    jax.ffi.register_ffi_target(_AMX_TARGET, jax.ffi.pycapsule(lib.JseAmxMatmul), platform="cpu")
    jax.ffi.register_ffi_target(_AMX_LAYERS_TARGET, jax.ffi.pycapsule(lib.JseAmxMatmulLayers), platform="cpu")
    jax.ffi.register_ffi_target(_AMX_HEAD_TARGET, jax.ffi.pycapsule(lib.JseAmxHeadLogSoftmax), platform="cpu")
    jax.ffi.register_ffi_target(_LOG_SOFTMAX_TARGET, jax.ffi.pycapsule(lib.JseLogSoftmaxGather), platform="cpu")
    jax.ffi.register_ffi_target(_FILTER_TARGET, jax.ffi.pycapsule(lib.JseFilterLogits), platform="cpu")
    jax.ffi.register_ffi_target(_DRAW_TARGET, jax.ffi.pycapsule(lib.JseDraw), platform="cpu")
    return lib


def _require() -> None:
    if _library() is None:
        raise RuntimeError("the CPU kernels are not available here (see the warning logged); `pip install -e .`")


def available() -> bool:
    """Whether the kernel is built, loads, and has a vector path on this CPU."""
    return _library() is not None


def amx_available() -> bool:
    """Whether `amx_matmul` runs here: the library loads and the CPU and OS allow AMX-BF16 tiles."""
    lib = _library()
    return lib is not None and lib.jse_amx_available() == 1


def skinny_isas() -> list[str]:
    """The skinny kernel's paths this CPU runs, best first: ["avx512", "avx2"], ["avx2"] or []."""
    return {"avx512": ["avx512", "avx2"], "avx2": ["avx2"], "none": []}[cpu_features()]


def cpu_features() -> str:
    """The instruction set the kernel runs with: "avx512", "avx2" or "none"."""
    lib = _library()
    return "none" if lib is None else {2: "avx512", 1: "avx2"}[lib.jse_cpu_features()]


def library_path() -> str:
    """Where the install put the library (`setup.py` builds it as the extension `cpu_kernels._native`); raises
    OSError where it did not."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = os.path.join(_HERE, "_native" + suffix)
        if os.path.exists(path):
            return path
    raise OSError(f"no compiled library _native*.so in {_HERE}")
