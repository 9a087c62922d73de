"""Token-tree attention on this machine's backend: the Pallas kernel (compiled through Triton on a GPU,
interpret mode on a CPU) against the jnp reference and a float64 oracle on random trees, then timings of
verify windows (decode rows, chains, trees) at SmolLM2-135M's attention shape.

    PYTHONPATH=. python benchmarks/tree_attention_check.py [--cases=40] [--json=out.json]

Correctness: `--cases` random batches per (shape, dtype): 1-4 token trees (depths 1..8, widths 1..4, up to
32 nodes, after 0..300 cached tokens) beside 0-2 causal rows (decode tokens and prefill chunks past the
32-token tree window), shuffled, padded to one fixed shape per class so each class compiles once. Shapes:
tiny (6 query / 2 KV heads, D 16, block size 8) and SmolLM2 (9 / 3, D 64, block size 16); float32 and
bfloat16 pools. Printed: the largest |kernel - reference| per class (bound: 1e-5 float32, 2e-2 bfloat16) and,
for float32, |reference - float64 oracle|; a chain tree must give the causal output bit for bit.
f32 dots run at HIGHEST precision (no TF32), as the kernel's float32 path does.
Timing: medians of `--reps` calls of one layer over a 30-layer pool (the engine's call), per window.
Exits 1 when any bound fails.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from pallas_kernels.ragged_paged_attention import ragged_paged_attention  # noqa: E402
from pallas_kernels.reference import ragged_paged_attention_reference  # noqa: E402
from scheduler.packing import _ancestor_masks  # noqa: E402
from tests.test_pallas_attention import make_batch  # noqa: E402
from tests.test_tree_attention import dense_oracle, random_tree, tree_batch  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
TOL = {"float32": 1e-5, "bfloat16": 2e-2}
SHAPES = {"tiny": dict(heads=6, kv_heads=2, head_dim=16, block_size=8),
          "smollm2": dict(heads=9, kv_heads=3, head_dim=64, block_size=16)}
T_FIXED, S_FIXED, CONTEXT_MAX = 256, 6, 300


def _rows(rng):
    rows = [("tree", int(rng.integers(0, CONTEXT_MAX)), random_tree(rng, int(rng.integers(1, 9)),
                                                                      int(rng.integers(1, 5))))
            for _ in range(int(rng.integers(1, 5)))]
    rows += [("causal", int(rng.integers(0, 200)), int(rng.choice([1, 5, 33, 48])))
             for _ in range(int(rng.integers(0, 3)))]
    return [rows[i] for i in rng.permutation(len(rows))]


def _fixed(args, tree, cols, P_fixed):
    """Pads a `tree_batch` to T_FIXED tokens, S_FIXED sequences, `cols` block-table columns and `P_fixed`
    pool blocks (padding sequences have no tokens; spare blocks hold noise)."""
    q, k, v, bt, sl, qsl = args
    T, S, P = q.shape[0], bt.shape[0], k.shape[1]
    rng = np.random.default_rng(P)
    noise = rng.standard_normal((k.shape[0], P_fixed - P) + k.shape[2:]).astype(np.float32)
    k = jnp.concatenate([k, jnp.asarray(noise, k.dtype)], axis=1)
    v = jnp.concatenate([v, jnp.asarray(-noise, v.dtype)], axis=1)
    q = jnp.pad(q, ((0, T_FIXED - T), (0, 0), (0, 0)))
    bt = jnp.pad(bt, ((0, S_FIXED - S), (0, cols - bt.shape[1])))
    sl = jnp.pad(sl, (0, S_FIXED - S))
    qsl = jnp.pad(qsl, (0, S_FIXED - S), mode="edge")
    return (q, k, v, bt, sl, qsl), jnp.pad(tree, (0, T_FIXED - T))


def check(n_cases: int) -> tuple[list[dict], bool]:
    kernel = jax.jit(lambda *a, tree: ragged_paged_attention(*a, 1, tree_mask=tree))
    causal_kernel = jax.jit(lambda *a: ragged_paged_attention(*a, 1))
    ref = jax.jit(lambda *a, tree: ragged_paged_attention_reference(*a, 1, tree_mask=tree))
    results, ok = [], True
    for seed, (shape, dims) in enumerate(SHAPES.items()):
        for dtype in ("float32", "bfloat16"):
            rng = np.random.default_rng(seed)
            cols = -(-(CONTEXT_MAX + 48) // dims["block_size"]) + 1
            P_fixed = S_FIXED * cols + 3
            worst, worst_oracle, finite, t0 = 0.0, 0.0, True, time.perf_counter()
            for c in range(n_cases):
                rows = _rows(rng)  # at most 4 x 32 tree + 2 x 48 causal tokens: fits T_FIXED and S_FIXED
                args, tree = tree_batch(c, rows, dtype=jnp.dtype(dtype), pad_tokens=1, **dims)
                small = (args, tree)
                args, tree = _fixed(args, tree, cols, P_fixed)
                want = np.asarray(ref(*args, tree=tree), np.float32)
                got = np.asarray(kernel(*args, tree=tree), np.float32)
                finite &= bool(np.all(np.isfinite(got)))
                worst = max(worst, float(np.max(np.abs(got - want))))
                if dtype == "float32" and shape == "tiny":
                    oracle = dense_oracle(*small, 1)
                    n = oracle.shape[0]
                    worst_oracle = max(worst_oracle, float(np.max(np.abs(want[:n] - oracle))))
            # A chain is causal attention: the tree path must equal the causal one exactly.
            chain = [("tree", 37, list(range(-1, 7))), ("causal", 3, 40), ("causal", 20, 1)]
            args, tree = _fixed(*tree_batch(2, chain, dtype=jnp.dtype(dtype), pad_tokens=1, **dims), cols, P_fixed)
            chain_equal = bool(np.array_equal(np.asarray(kernel(*args, tree=tree)), np.asarray(causal_kernel(*args))))
            passed = finite and worst <= TOL[dtype] and worst_oracle <= 1e-5 and chain_equal
            ok &= passed
            results.append({"shape": shape, "dtype": dtype, "cases": n_cases, "max_err_vs_reference": worst,
                            "max_err_reference_vs_float64": worst_oracle if dtype == "float32" and shape == "tiny"
                            else None, "chain_equals_causal": chain_equal, "passed": passed,
                            "seconds": round(time.perf_counter() - t0, 1)})
            print(json.dumps(results[-1]), flush=True)
    return results, ok


def _median_ms(f, args, reps):
    jax.block_until_ready(f(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def timings(reps: int) -> list[dict]:
    """One layer's call over a 30-layer SmolLM2 pool, float32 (the real model's pool dtype)."""
    rng = np.random.default_rng(0)
    out = []
    windows = {"decode (1 token)": [-1], "chain of 5": list(range(-1, 4)),
               "tree, depth 5": random_tree(rng, 5, 4), "tree, depth 8": random_tree(rng, 8, 4)}
    for S in (1, 16):
        for context in (256, 1024):
            for name, parents in windows.items():
                n = len(parents)
                args = make_batch(S, [n] * S, [context + n] * S, num_layers=30, **SHAPES["smollm2"])
                tree = jnp.asarray(np.tile(_ancestor_masks(np.asarray(parents)).view(np.int32), S))
                kernel = jax.jit(lambda *a, tree=tree: ragged_paged_attention(*a, 7, tree_mask=tree))
                ref = jax.jit(lambda *a, tree=tree: ragged_paged_attention_reference(*a, 7, tree_mask=tree))
                row = {"sequences": S, "context": context, "window": name, "tokens": S * len(parents),
                       "pallas_ms": round(_median_ms(kernel, args, reps), 4),
                       "reference_ms": round(_median_ms(ref, args, reps), 4)}
                out.append(row)
                print(json.dumps(row), flush=True)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=40)
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--json", default=None, help="Write the results here too.")
    parser.add_argument("--no_timings", action="store_true")
    args = parser.parse_args()
    print(f"# backend {jax.default_backend()}: {jax.devices()[0].device_kind}, jax {jax.__version__}", flush=True)
    results, ok = check(args.cases)
    times = [] if args.no_timings else timings(args.reps)
    print("\n| shape | pool | cases | max abs err vs reference | reference vs float64 | chain = causal | passed |")
    print("|---|---|---:|---:|---:|---|---|")
    for r in results:
        oracle = "" if r["max_err_reference_vs_float64"] is None else f"{r['max_err_reference_vs_float64']:.1e}"
        print(f"| {r['shape']} | {r['dtype']} | {r['cases']} | {r['max_err_vs_reference']:.1e} | {oracle} "
              f"| {r['chain_equals_causal']} | {r['passed']} |")
    if times:
        print("\n| sequences | context | window | tokens | Pallas ms | reference ms |")
        print("|---:|---:|---|---:|---:|---:|")
        for r in times:
            print(f"| {r['sequences']} | {r['context']} | {r['window']} | {r['tokens']} | {r['pallas_ms']:.3f} "
                  f"| {r['reference_ms']:.3f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"backend": jax.default_backend(), "device": jax.devices()[0].device_kind,
                       "jax": jax.__version__, "check": results, "timings": times}, f, indent=1)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
