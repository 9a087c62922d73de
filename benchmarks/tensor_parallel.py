"""Step time by tensor-parallel size, on the real model (a correctness run on CPU host devices).

  python -m benchmarks.tensor_parallel [--sizes=1,3] [--num_prompts=8] [--max_tokens=32]

On CPU the host's cores are split into `max(sizes)` XLA devices and every
all-reduce is a copy through host memory, so larger sizes are slower here:
the table shows the cost of the sharded programs, not a speed-up. Rows: the
one-device engine with its native CPU kernels, the one-device engine on
XLA's dot (the sharded runs use XLA's dot), then each size > 1. Columns:
median device time of prefill steps and of decode steps (ms), and the
whole generation's wall time; greedy, `--num_prompts` chat prompts. The
outputs of every row are checked equal to the first.
"""

from __future__ import annotations

import json
import os
import statistics
import time

from absl import app, flags

from benchmarks.baselines import prompts_dir  # defines --prompts_dir

flags.DEFINE_list("sizes", ["1", "3"], "Tensor-parallel sizes (SmolLM2-135M splits over 1 or 3: 9 heads, 3 KV heads).")
flags.DEFINE_integer("num_prompts", 8, "Chat prompts.")
flags.DEFINE_integer("max_tokens", 32, "Tokens generated per prompt.")
FLAGS = flags.FLAGS


def main(_):
    import jax

    sizes = [int(s) for s in FLAGS.sizes]
    jax.config.update("jax_num_cpu_devices", max(sizes))
    from checkpoints import load_model
    from engine import LLM
    from scheduler.request import SamplingParams

    with open(os.path.join(prompts_dir(), "chat.jsonl")) as f:
        prompts = [[{"role": "user", "content": json.loads(line)["prompt"]}] for line in f][:FLAGS.num_prompts]
    loaded = load_model("smollm2-135m-instruct")
    sp = SamplingParams(max_tokens=FLAGS.max_tokens, temperature=0.0)
    rows, first = [], None
    for tp, matmul in [(1, "auto"), (1, "xla"), *((s, "xla") for s in sizes if s > 1)]:
        llm = LLM(loaded, speculative=None, tensor_parallel_size=tp, matmul=matmul, max_num_seqs=FLAGS.num_prompts)
        llm.generate(prompts, sp)  # compiles every bucket this run meets
        prefill, decode = [], []
        llm.engine.on_step = lambda t: (decode if t.num_tokens <= FLAGS.num_prompts else prefill).append(t.device)
        start = time.perf_counter()
        out = [o.token_ids for o in llm.generate(prompts, sp)]
        wall = time.perf_counter() - start
        first = first or out
        rows.append((tp, matmul, statistics.median(prefill) * 1e3, statistics.median(decode) * 1e3, wall, out == first))
    print(f"| tensor parallel | matmul | prefill step ms | decode step ms (batch {FLAGS.num_prompts}) "
          f"| wall s | output equal |")
    print("|---:|---|---:|---:|---:|---|")
    for tp, matmul, p, d, wall, same in rows:
        print(f"| {tp} | {matmul} | {p:.1f} | {d:.1f} | {wall:.2f} | {same} |")


if __name__ == "__main__":
    app.run(main)
