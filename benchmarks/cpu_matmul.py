"""Skinny products on CPU: a 30-layer stack of [T, 576] @ [576, 4608] products, by library and by T.

  python benchmarks/cpu_matmul.py [--rows=1,2,4,5,8,16] [--layers=30] [--repeats=7]

The shape is SmolLM2-135M's fused gate/up projection; decode reads each
weight once per step, so a step over T tokens should cost about one 1-token
step while T is small (memory bound). Rows: XLA's dot (jitted, fp32), numpy
(OpenBLAS), torch (oneDNN/MKL, fp32), and the native kernel
(`cpu_kernels.skinny_matmul`) with fp32, bf16 and int8 weights, and, where
the CPU has AMX, the AMX kernel (`cpu_kernels.amx_matmul`, 3 passes and 2;
`--rows=16,32,64,128,512` shows where it takes over). Median ms
over --repeats of the whole stack; the last column of each row is T=max / T=1.

Then (--real_model) SmolLM2-135M-Instruct's whole jitted step (fp32) over T
tokens of one sequence, as a verify window of K+1 tokens would be, with XLA's
dot and with the kernel, and each as a multiple of its own 1-token step.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from absl import app, flags  # noqa: E402
import numpy as np  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_list("rows", ["1", "2", "4", "5", "8", "16"], "Token counts T.")
flags.DEFINE_integer("layers", 30, "Products in the stack (distinct weights, so nothing stays in cache).")
flags.DEFINE_integer("repeats", 7, "Timed repeats (median).")
flags.DEFINE_integer("k", 576, "Input width K.")
flags.DEFINE_integer("n", 4608, "Output width N.")
flags.DEFINE_bool("real_model", True, "Also time the real model's step over T tokens of one sequence.")


def _median_ms(fn, repeats: int) -> float:
    fn()  # warm-up (compilation, caches)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def main(argv):
    del argv
    import jax
    import jax.numpy as jnp

    import cpu_kernels as ck

    rows, L, K, N = [int(t) for t in FLAGS.rows], FLAGS.layers, FLAGS.k, FLAGS.n
    rng = np.random.default_rng(0)
    weights = [rng.normal(0, 0.02, (K, N)).astype(np.float32) for _ in range(L)]
    jw = [jnp.asarray(w) for w in weights]
    table: dict[str, list[float]] = {}

    xla = jax.jit(lambda x, ws: [x @ w for w in ws])
    table["XLA dot (jax %s), fp32" % jax.__version__] = [
        _median_ms(lambda x=jnp.ones((T, K)): jax.block_until_ready(xla(x, jw)), FLAGS.repeats) for T in rows]
    table["numpy / OpenBLAS, fp32"] = [
        _median_ms(lambda x=np.ones((T, K), np.float32): [x @ w for w in weights], FLAGS.repeats) for T in rows]
    try:
        import torch
        torch.set_num_threads(os.cpu_count() or 1)
        tw = [torch.from_numpy(w) for w in weights]
        with torch.inference_mode():
            table[f"torch {torch.__version__}, fp32"] = [
                _median_ms(lambda x=torch.ones(T, K): [x @ w for w in tw], FLAGS.repeats) for T in rows]
    except ImportError:
        pass
    if ck.available():
        for dtype in ("float32", "bfloat16", "int8"):
            packed = [ck.pack(w, dtype) for w in weights]
            kernel = jax.jit(lambda x, ps: [ck.skinny_matmul(x, p) for p in ps])
            table[f"kernel ({ck.cpu_features()}), {dtype} weights"] = [
                _median_ms(lambda x=jnp.ones((T, K)): jax.block_until_ready(kernel(x, packed)), FLAGS.repeats)
                for T in rows]
    else:
        print("(the native kernel is unavailable on this machine)\n")
    if ck.amx_available():
        for passes in (3, 2):
            packed = [ck.pack_amx(w, passes) for w in weights]
            kernel = jax.jit(lambda x, ps: [ck.amx_matmul(x, p) for p in ps])
            table[f"AMX kernel, {passes} pass{'es' if passes > 1 else ''} ({'bf16x3' if passes == 3 else 'bf16 weights'})"] = [
                _median_ms(lambda x=jnp.ones((T, K)): jax.block_until_ready(kernel(x, packed)), FLAGS.repeats)
                for T in rows]

    print(f"# {L} x [T, {K}] @ [{K}, {N}] products, median ms of {FLAGS.repeats} ({os.cpu_count()} CPUs)\n")
    print("| | " + " | ".join(f"T={T}" for T in rows) + f" | T={rows[-1]} / T={rows[0]} |")
    print("|---|" + "---:|" * (len(rows) + 1))
    for name, ms in table.items():
        print(f"| {name} | " + " | ".join(f"{v:.1f}" for v in ms) + f" | {ms[-1] / ms[0]:.2f} |")
    if FLAGS.real_model:
        _real_model_steps(rows, FLAGS.repeats)
    weight_mb = L * K * N * 4 / 1e6
    best = min(v for ms in table.values() for v in ms[:1])
    print(f"\nfp32 weights read per stack: {weight_mb:.0f} MB; fastest T=1 stack reads "
          f"{weight_mb / best:.1f} GB/s")


def _real_model_steps(rows: list[int], repeats: int) -> None:
    from checkpoints import load_model
    from engine import LLM

    model = load_model()
    table = {}
    for matmul in ("xla", "auto"):
        runner = LLM(model, speculative=None, matmul=matmul, max_num_seqs=1, num_blocks=64).engine.runner
        name = "kernel" if runner.packed_bytes else "XLA dot"
        table[name] = [_median_ms(lambda T=T: runner.run(runner.padding_batch(T, 1), None), repeats) for T in rows]
    print("\nSmolLM2-135M-Instruct fp32, whole step over T tokens of one sequence, median ms:\n")
    print("| | " + " | ".join(f"T={T}" for T in rows) + " |")
    print("|---|" + "---:|" * len(rows))
    for name, ms in table.items():
        print(f"| {name}, ms | " + " | ".join(f"{v:.1f}" for v in ms) + " |")
        print(f"| {name}, x its 1-token step | " + " | ".join(f"{v / ms[0]:.2f}" for v in ms) + " |")


if __name__ == "__main__":
    app.run(main)
