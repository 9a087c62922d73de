"""Times the ragged paged attention kernel next to the jnp reference and JAX's Pallas paged_attention,
and, on CPU, the native kernel on decode rows, on verify windows as chains and as token trees, and on
prefill chunks.

    python benchmarks/attention_kernels.py [--reps 3]

On a CPU-only machine every Pallas kernel runs in **interpret mode** (the
kernel body is evaluated as XLA:CPU ops, program by program): the figures say
nothing about GPU speed, only that the paths run and roughly how heavy the
interpreter is. On GPU the same script times the Triton kernels.

Shapes are SmolLM2-135M attention (H=9, K=3, D=64, block size 16, bf16, L=30):
  decode : S=8 sequences x 1 token, KV length 256 each
  prefill: S=1 sequence, 512 new tokens after a 0-token prefix (T=512)
Native kernel table (CPU, `cpu_kernels.paged_attention`, all 30 layers per call):
  decode rows at 64 x 256 and 8 x 256 context positions over bf16 and float32
  pools (float32: the real model's, whose dtype the pool takes); verify windows of
  16 tokens after 300 cached positions, 1 and 4 sequences, causal (a chain)
  and with the tree masks of a random 16-node tree (depth <= 5, width <= 4); a
  512-token prefill chunk over a float32 pool after 0 and 512 cached positions.
`jax.experimental.pallas.ops.gpu.paged_attention` is decode-only and wants a
`[K, P, B, D]` single-layer pool: the layer is sliced and transposed outside
the timed call (a copy our kernel does not need), its K/V heads padded to
`block_h=16` query heads per KV head internally.
Interpret-mode caveat: with a bf16 pool XLA:CPU converts the whole
`[L, P, B, K, D]` pool to float32 once per call of our kernel (it receives the
whole pool; the JAX kernel gets one pre-sliced layer), which dominates the
decode figure here (with L=2 or a float32 pool it is several times faster).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from pallas_kernels.ragged_paged_attention import ragged_paged_attention
from pallas_kernels.reference import ragged_paged_attention_reference

H, K, D, B, L = 9, 3, 64, 16, 30
DTYPE = jnp.bfloat16
LAYER = 7


def make(q_lens, kv_lens, seed=0, dtype=DTYPE):
    rng = np.random.default_rng(seed)
    S = len(q_lens)
    need = [-(-k // B) for k in kv_lens]
    max_blocks = max(need)
    P = sum(need) + 1
    ids = rng.permutation(np.arange(1, P))
    bt = np.zeros((S, max_blocks), np.int32)
    c = 0
    for s, n in enumerate(need):
        bt[s, :n] = ids[c:c + n]
        c += n
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    T = int(qsl[-1])
    q = jnp.asarray(rng.standard_normal((T, H, D)), dtype)
    kp = jnp.asarray(rng.standard_normal((L, P, B, K, D)), dtype)
    vp = jnp.asarray(rng.standard_normal((L, P, B, K, D)), dtype)
    return q, kp, vp, jnp.asarray(bt), jnp.asarray(kv_lens, jnp.int32), jnp.asarray(qsl)


def bench(f, args, reps):
    out = jax.block_until_ready(f(*args))  # compile + warm-up
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - t)
    return float(np.median(times)) * 1e3, out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    backend = jax.default_backend()
    mode = "Triton" if backend == "gpu" else "INTERPRET MODE on CPU (not representative of GPU speed)"
    kernel = jax.jit(functools.partial(ragged_paged_attention, layer=LAYER))
    reference = jax.jit(functools.partial(ragged_paged_attention_reference, layer=LAYER))

    rows = []
    shapes = {"decode  S=8  T=8   kv=256": ([1] * 8, [256] * 8), "prefill S=1  T=512 kv=512": ([512], [512])}
    for name, (q_lens, kv_lens) in shapes.items():
        args = make(q_lens, kv_lens)
        t_ref, o_ref = bench(reference, args, a.reps)
        t_ker, o_ker = bench(kernel, args, a.reps)
        err = float(jnp.max(jnp.abs(o_ker.astype(jnp.float32) - o_ref.astype(jnp.float32))))
        if name.startswith("decode"):
            t_jax = jax_paged_attention(args, a.reps, backend)
        else:
            t_jax = "n/a (decode-only kernel)"
        rows.append((name, f"{t_ker:.1f}", f"{t_ref:.1f}", t_jax, f"{err:.1e}"))

    print(f"backend: {backend}; Pallas kernels: {mode}; median of {a.reps} runs after warm-up, ms")
    hdr = ("shape", "ragged_paged_attention", "jnp reference", "pallas.ops.gpu.paged_attention", "max|kernel-ref|")
    widths = [max(len(str(r[i])) for r in rows + [hdr]) for i in range(len(hdr))]
    for r in [hdr] + rows:
        print(" | ".join(str(c).ljust(w) for c, w in zip(r, widths)))
    import cpu_kernels
    if backend == "cpu" and cpu_kernels.available():
        native_table(a.reps)


def native_table(reps):
    """The native kernel over every layer: decode rows, verify windows causal vs tree-masked, and a 512-token
    prefill chunk with no context before it and after 512 cached positions."""
    import cpu_kernels
    from engine.spec.tree_verify import tree_masks

    all_layers = lambda **kw: jax.jit(lambda *a: sum(  # noqa: E731
        cpu_kernels.paged_attention(*a, jnp.int32(layer), **kw).sum() for layer in range(L)))
    rng = np.random.default_rng(0)
    parents = [-1] + [int(rng.integers(max(0, i - 4), i)) for i in range(1, 16)]
    masks, _ = tree_masks(jnp.asarray([parents], jnp.int32))
    rows = []
    for name, q_lens, kv_lens, pool in [("decode S=64 kv=256", [1] * 64, [256] * 64, jnp.bfloat16),
                                        ("decode S=64 kv=256", [1] * 64, [256] * 64, jnp.float32),
                                        ("decode S=8 kv=256", [1] * 8, [256] * 8, jnp.bfloat16),
                                        ("decode S=8 kv=256", [1] * 8, [256] * 8, jnp.float32),
                                        ("verify S=1 16 tokens kv=316", [16], [316], jnp.bfloat16),
                                        ("verify S=4 16 tokens kv=316", [16] * 4, [316] * 4, jnp.bfloat16),
                                        ("prefill S=1 512 tokens kv=512", [512], [512], jnp.float32),
                                        ("prefill S=1 512 tokens kv=1024", [512], [1024], jnp.float32)]:
        args = make(q_lens, kv_lens, dtype=pool)
        causal, _ = bench(all_layers(), args, reps)
        tree = "—"
        if name.startswith("verify"):
            t, _ = bench(all_layers(tree_mask=jnp.tile(masks[0], len(q_lens))), args, reps)
            tree = f"{t:.2f}"
        rows.append((name, jnp.dtype(pool).name, f"{causal:.2f}", tree))
    print(f"\nnative kernel (CPU, {L} layers per call), median of {reps} runs, ms")
    print("| shape | pool | causal | tree masks |\n|---|---|---:|---:|")
    for r in rows:
        print("| " + " | ".join(r) + " |")


def jax_paged_attention(args, reps, backend):
    try:
        from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention
    except Exception as e:  # noqa: BLE001
        return f"unavailable ({type(e).__name__})"
    q, kp, vp, bt, sl, _ = args
    k1 = jnp.transpose(kp[LAYER], (2, 0, 1, 3))  # [K, P, B, D], outside the timed call
    v1 = jnp.transpose(vp[LAYER], (2, 0, 1, 3))
    ppcb = min(8, bt.shape[1])
    f = jax.jit(functools.partial(paged_attention, pages_per_compute_block=ppcb,
                                  k_splits=max(1, bt.shape[1] // ppcb), interpret=backend != "gpu"))
    try:
        t, _ = bench(f, (q, k1, v1, bt, sl), reps)
    except Exception as e:  # noqa: BLE001
        return f"failed: {type(e).__name__}: {str(e).splitlines()[0][:60]}"
    return f"{t:.1f}" + (" (interpret)" if backend != "gpu" else "")


if __name__ == "__main__":
    main()
