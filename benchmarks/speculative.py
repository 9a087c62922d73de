"""Speculative decoding on the real model (fp32, CPU) by prompt domain and proposer: the EAGLE head, Medusa
heads, a draft model, n-gram lookup (chains, and token trees: "ngram-tree", "medusa-tree", "eagle-tree" =
EAGLE-2 dynamic trees).

  python benchmarks/speculative.py                      # the default-settings table: off and auto, each in
                                                        # its own process, every domain, batch 1, 4 and 16
  python benchmarks/speculative.py --configs=off,auto,ngram --domains=chat --batch_sizes=1 --repeats=5
  python benchmarks/speculative.py --repeats=0 --ks=2,4,6 --proposers=eagle,ngram,eagle-tree [--tree_nodes=12]
      [--tree_branching=4]                              # each proposer at fixed K, in one process
  (any of them: [--max_tokens=64] [--temperature=0] [--prompts_dir=...]; prompts: python -m benchmarks.prompts)

With --ks, for each domain, proposer, batch size B and K: B real prompts (chat template, greedy or
seeded sampling at --temperature, `ignore_eos`) decode together. Decode steps are timed from the second step
after prefill while all B requests run (so no compilation and no shrinking
batch is timed): tok/s = tokens emitted in the timed steps / their time.

* alpha: accepted / proposed draft tokens over the whole run.
* acceptance length: tokens a verify emits (accepted + the correction or
  bonus token), over the run's verifies; per position: the fraction of
  verifies proposing a token at window position i that accepted it.
* tokens/step: emitted tokens per target step in the timed steps.
* host draft share: the proposer's host seconds (the cost gate, n-gram lookups) over the
  run's step seconds (`EngineStats.draft_share`); a device proposer's draft passes run inside the
  step program and are in c.
* c: the extra cost per proposed token (the draft passes and the wider verify
  window together) relative to a plain target step,
  c = (t_spec_step - t_plain_step) / (K * t_plain_step), from the timed steps.
* verify window cost: the target step over T = 1, 2, 4, 8, 16 tokens of one
  sequence, in ms and relative to T = 1 (what a verify of K+1 tokens costs).
* predicted speed-up (1 + K alpha) / (1 + K c) (the approximation in the issue;
  Leviathan et al. 2023 §3.4 give the exact expected tokens
  (1 - alpha^(K+1)) / (1 - alpha)), next to the measured tok/s ratio.
* default settings (`--configs`, by default "off" and "auto": what `LLM()`
  does): each configuration runs in a process of its own, one engine kept
  across all cells with each domain as its request class (K adapted per
  class, the cost gate choosing the draft lengths per step), as a server
  would. Per cell: two untimed passes (compilation, and the gate learning the
  class), then `--timed_passes` timed ones (their median), each asserting it compiled nothing. The
  processes alternate over `--repeats` rounds, the order rotating; the table
  gives medians (min-max) of tok/s and the ratio to "off" per round, and
  asserts greedy outputs equal to "off"'s.

Prompts are the first ones of each file's held-out split, which distillation
never trains on (`training/data.py`), then the training split's where a batch needs more (creative at batch
16); `--split=train` takes the training split's instead, to tell how much of a head's acceptance is fitting
its training prompts.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from absl import app, flags  # noqa: E402

from benchmarks.baselines import read_prompts, spawn_worker, spread  # noqa: E402  (defines --prompts_dir)

FLAGS = flags.FLAGS
flags.DEFINE_list("domains", ["chat", "code", "math", "creative", "summarization", "long_context"],
                  "Prompt domains of --prompts_dir.")
flags.DEFINE_list("batch_sizes", ["1", "4", "16"], "Requests decoding together.")
flags.DEFINE_list("ks", [], "Draft lengths K of a table of each --proposers at fixed K (never adapted), in one "
                  "process; empty: only the default-settings table.")
flags.DEFINE_integer("repeats", 3, "Rounds of the default-settings table, each configuration in a process of "
                     "its own, alternating (0: no default-settings table).")
flags.DEFINE_list("configs", ["off", "auto"], "Default-settings table: \"off\", \"auto\" (LLM's default), \"eagle-ngram-tree\" or a "
                  "--proposers name with the engine's defaults, each with \"-sync\" after it for async scheduling off; the "
                  "first is the baseline of the ratios.")
flags.DEFINE_string("worker", None, "Internal: run one --configs entry over every cell, print its figures.")
flags.DEFINE_integer("max_tokens", 64, "Tokens per request.")
flags.DEFINE_integer("skip", 0, "Skip this many prompts of the split at the start of each file.")
flags.DEFINE_enum("split", "held_out", ["held_out", "train"], "Which split of each file's prompts (training/data.py).")
flags.DEFINE_integer("timed_passes", 3, "Default-settings table: timed passes per cell in each process (their "
                     "median).")
flags.DEFINE_bool("fresh_prompts", False, "Default-settings table: each pass of a cell sends prompts no earlier "
                  "pass sent (for proposers that remember earlier outputs, such as suffix decoding).")
flags.DEFINE_integer("rounds", 1, "Each cell decodes this many disjoint groups of `batch` prompts, one group after "
                     "another, and reports the mean of their figures (batch 1 with one prompt is one sample).")
flags.DEFINE_string("draft", None, "Draft: a directory or a bundled name (default: the model's bundled draft).")
flags.DEFINE_list("proposers", ["eagle", "ngram"], "Proposers to measure (the `speculative` kinds; ngram-tree / "
                  "medusa-tree / eagle-tree: token trees of --tree_nodes nodes, K deep; medusa: the chain of each "
                  "head's top token).")
flags.DEFINE_integer("tree_nodes", 12, "Nodes of an ngram-tree / medusa-tree / eagle-tree proposal.")
flags.DEFINE_integer("tree_branching", 4, "eagle-tree: children per expanded node, nodes expanded per level.")
flags.DEFINE_string("eagle_head", None, "EAGLE head: a directory or a bundled name (default: the model's own).")
flags.DEFINE_enum("kernel_dtype", None, ["float32", "bfloat16", "int8"],
                  "The target's CPU kernel weights, in the plain and the speculative engines alike (default: "
                  "the model's dtype; bfloat16 on an AMX CPU runs every product on AMX tiles).")
flags.DEFINE_enum("draft_kernel_dtype", None, ["float32", "bfloat16", "int8"],
                  "The draft's / head's weights in the CPU kernel (default: the dtype their checkpoint stores).")
flags.DEFINE_bool("require_equal", True, "Greedy: stop when a speculative output differs from the target's "
                  "(else count such requests: for backends whose products differ between window widths).")
flags.DEFINE_float("temperature", 0.0, "0: greedy (speculative output asserted equal to the plain engine's); "
                   "else seeded sampling at this temperature.")
flags.DEFINE_bool("precompile", True, "Compile every step shape a cell's draft-length ladder can take before it "
                  "runs; --noprecompile runs each cell once untimed instead, which compiles only the shapes it uses "
                  "(fewer compiles where they are slow, as on a GPU).")
flags.DEFINE_list("early_exit_layers", None, "Use an untrained early-exit draft of these target layers "
                  "(checkpoints.draft.early_exit_draft) instead of --draft.")



def _prompts(tok, domain, n, offset=0):
    """n prompts of the domain's --split (held out: never trained on, training/data.py), from --skip + offset;
    where the held-out split is too small for a batch (creative has 12), the training split's fill it."""
    from training.data import EVAL_PERCENT, prompt_hash

    rows = read_prompts(domain)
    held_out = FLAGS.split == "held_out"
    split = [r["prompt"] for r in rows if (prompt_hash(r["id"]) % 100 < EVAL_PERCENT.get(domain, 100)) == held_out]
    if held_out:
        split += [r["prompt"] for r in rows if prompt_hash(r["id"]) % 100 >= EVAL_PERCENT.get(domain, 100)]
    texts = split[FLAGS.skip + offset:FLAGS.skip + offset + n]
    if len(texts) < n:
        raise ValueError(f"{domain}: {len(split)} prompts, {FLAGS.skip + offset + n} needed")
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True))
            for t in texts]


def _decode(llm, prompts, request_class="default", timed=False):
    """Returns (tokens/s, ms per step, tokens per step, acceptance rate or None) over the timed steps."""
    from engine import SamplingParams

    from scheduler.packing import bucket_for

    engine = llm.engine
    # Compile every decode shape the run can take (each draft length of the ladder), so none is timed.
    runner, b = engine.runner, len(prompts)
    S = bucket_for(b, runner.seq_buckets)
    widest = bucket_for(b * (1 + max(k for k in runner.spec_ks if k is not None) if len(runner.spec_ks) > 1 else b),
                        runner.token_buckets)
    if FLAGS.precompile:
        # Fewer rows too: the batch's last requests finish on their own.
        engine.precompile([(t, s) for t, s in runner.buckets if s <= S and t <= widest])
    # Prefill every prompt once beforehand, so that in the run the prefix cache serves them in a step or
    # two and all B requests decode together (long prompts would otherwise still be prefilling while
    # the first ones finish).
    for p in prompts:
        engine.add_request(p, SamplingParams(temperature=0, max_tokens=1))
    while engine.has_unfinished():
        engine.step()
    ids = [engine.add_request(p, SamplingParams(temperature=FLAGS.temperature, seed=i, max_tokens=FLAGS.max_tokens,
                                                ignore_eos=True),
                              request_class=request_class).request_id for i, p in enumerate(prompts)]
    from engine.compilation import compilation_count

    compiled = compilation_count()
    st = engine.stats
    before = (st.num_verifies, st.num_accepted_tokens, list(st.drafted_at), list(st.accepted_at))
    seconds0 = dict(st.seconds)
    outs, steps, tokens, elapsed, untimed = {}, 0, 0, 0.0, 2
    while engine.has_unfinished():
        t = time.perf_counter()
        step_outs = engine.step()
        dt = time.perf_counter() - t
        running = len(engine.scheduler.running) + sum(o.finished for o in step_outs)
        decoding = all(r.num_computed_tokens >= len(r.prompt_token_ids) for r in engine.scheduler.running)
        if decoding and untimed:
            untimed -= 1
        elif decoding and running == len(prompts) and not any(o.finished for o in step_outs):
            steps, elapsed = steps + 1, elapsed + dt
            tokens += sum(len(o.delta_token_ids) for o in step_outs)
        for o in step_outs:
            outs[o.request_id] = o
    if not steps:
        raise RuntimeError(f"no step ran with all {len(prompts)} requests decoding (too few KV blocks?)")
    if timed and compilation_count() != compiled:
        raise AssertionError(f"a timed run compiled {compilation_count() - compiled} programs")
    drafted = sum(outs[i].num_draft_tokens for i in ids)
    accepted = sum(outs[i].num_accepted_tokens for i in ids)
    verifies = st.num_verifies - before[0]
    length = 1 + (st.num_accepted_tokens - before[1]) / verifies if verifies else 1.0
    grow = lambda xs: xs + [0] * (len(st.drafted_at) - len(xs))
    positions = [(a - a0) / (d - d0) for a, a0, d, d0 in zip(st.accepted_at, grow(before[3]), st.drafted_at,
                                                                grow(before[2])) if d > d0]
    spent = {p: st.seconds[p] - seconds0[p] for p in st.seconds}
    share = spent["propose"] / sum(spent.values())
    return tokens / elapsed, 1e3 * elapsed / steps, tokens / steps, (accepted / drafted if drafted else None), \
        [outs[i].token_ids for i in ids], length, positions, share


def _decode_rounds(llm, groups, request_class="default"):
    """`_decode` over each prompt group in turn: the mean of each figure (per-position acceptance over the
    positions every group reached), the outputs of all groups in order."""
    if not FLAGS.precompile:
        t = time.perf_counter()
        _decode(llm, groups[0], request_class)
        print(f"(warm-up run: {time.perf_counter() - t:.0f} s)", file=sys.stderr, flush=True)
    runs = [_decode(llm, g, request_class) for g in groups]
    mean = lambda j: statistics.mean(r[j] or 0.0 for r in runs)
    depth = min(len(r[6]) for r in runs)
    positions = [statistics.mean(r[6][i] for r in runs) for i in range(depth)]
    return mean(0), mean(1), mean(2), mean(3), [t for r in runs for t in r[4]], mean(5), positions, mean(7)


def _check_greedy(got: list[list[int]], want: list[list[int]]) -> None:
    """Greedy speculative outputs must equal the target's alone. With `--norequire_equal` (a GPU, whose
    product algorithms differ between a decode step and a verify window, so near-ties can flip) the
    requests that differ are counted instead."""
    if got == want:
        return
    differ = sum(g != w for g, w in zip(got, want))
    if FLAGS.require_equal:
        raise AssertionError(f"speculative greedy output differs from the target's in {differ} of {len(want)} requests")
    print(f"note: {differ} of {len(want)} greedy outputs differ from the target's", flush=True)


def _window_costs(llm, sizes=(1, 2, 4, 8, 16), repeats=20) -> dict[int, float]:
    """Median ms of the target's jitted step over T tokens of one sequence (T = a verify window of K+1)."""
    runner, out = llm.engine.runner, {}
    for T in sizes:
        packed = runner.padding_batch(T, 1)
        times = []
        for i in range(repeats + 3):  # 3 untimed: compilation and warm-up
            t = time.perf_counter()
            runner.run(packed, None)  # ends with the read back
            times.append(time.perf_counter() - t)
        out[T] = 1e3 * statistics.median(times[3:])
    return out


def _engine_for(config: str):
    """The LLM of a --configs entry: "off", "auto" (the defaults of `LLM()`), a --proposers name, or
    "eagle-ngram-tree" (EAGLE-2 trees with the n-gram chain in them); "-sync" after any of them turns async
    scheduling off."""
    from engine import LLM

    limits = {"max_num_seqs": 16, "max_num_batched_tokens": 512, "kernel_dtype": FLAGS.kernel_dtype,
              "async_scheduling": not config.endswith("-sync")}
    config = config.removesuffix("-sync")
    if config in ("off", "auto"):
        return LLM(speculative=None if config == "off" else "auto", **limits)
    if config == "eagle-ngram-tree":
        config, limits["ngram_in_tree"] = "eagle-tree", True
    kind = config.removesuffix("-tree")
    if kind != config:
        limits.update(num_tree_nodes=FLAGS.tree_nodes, tree_branching=FLAGS.tree_branching)
    draft = {"eagle": FLAGS.eagle_head, "draft": FLAGS.draft}.get(kind)
    return LLM(speculative=kind, draft_model=draft, draft_kernel_dtype=FLAGS.draft_kernel_dtype, **limits)


def _worker(config: str) -> dict:
    """One configuration over every (domain, batch) cell: its timed figures and outputs."""
    from engine.compilation import compilation_count

    llm = _engine_for(config)
    out = {}
    for domain in FLAGS.domains:
        for b in (int(b) for b in FLAGS.batch_sizes):
            # --fresh_prompts: every pass sends prompts no earlier pass sent (a server's traffic, for proposers
            # that remember earlier outputs), the timed passes the split's first ones (the same in every
            # configuration, whatever the untimed passes took); else every pass sends the same prompts.
            fresh = FLAGS.fresh_prompts
            untimed = iter(range(FLAGS.timed_passes, 1_000))
            # Untimed passes until one compiles nothing (at least two: the gate learns the class; the shapes
            # its choices take, prefix-cache hits included, compile), then the timed ones.
            for i in range(6):
                compiled = compilation_count()
                _decode(llm, _prompts(llm.tokenizer, domain, b, next(untimed) * b if fresh else 0),
                        request_class=domain)
                if i and compilation_count() == compiled:
                    break
            # The median of several timed passes: one 64-step pass is a fraction of a second on a shared machine.
            runs = [_decode(llm, _prompts(llm.tokenizer, domain, b, j * b if fresh else 0), request_class=domain,
                            timed=True) for j in range(FLAGS.timed_passes)]
            tps, _, per_step, alpha, _, _, _, _ = sorted(runs, key=lambda run: run[0])[len(runs) // 2]
            tokens = [t for run in runs for t in run[4]] if fresh else runs[0][4]
            out[f"{domain} {b}"] = {"tps": tps, "per_step": per_step, "alpha": alpha, "tokens": tokens}
            print(f"{config} {domain} {b}: {tps:.1f} tok/s, {per_step:.2f} tokens/step", file=sys.stderr, flush=True)
    return out


def _spawn(config: str) -> dict:
    return spawn_worker(__file__, [*sys.argv[1:], f"--worker={config}"])


def _defaults_table() -> None:
    """The default-settings table: every --configs entry in a process of its own, alternating over rounds."""
    configs, runs = FLAGS.configs, {c: [] for c in FLAGS.configs}
    for r in range(FLAGS.repeats):
        for config in configs[r % len(configs):] + configs[:r % len(configs)]:
            t = time.perf_counter()
            runs[config].append(_spawn(config))
            print(f"round {r + 1}: {config} took {time.perf_counter() - t:.0f} s", file=sys.stderr, flush=True)
    base = configs[0]
    print(f"\n## Default settings, each configuration in its own process ({FLAGS.repeats} rounds, median (min-max); "
          f"ratio: to {base} in the same round)\n")
    print("| domain | batch | " + " | ".join(f"{c} tok/s" for c in configs) + " | "
          + " | ".join(f"{c} / {base}" for c in configs[1:]) + " | "
          + " | ".join(f"{c} tokens/step" for c in configs[1:]) + " |")
    print("|---|---:|" + "---:|" * (3 * len(configs) - 2))
    for domain in FLAGS.domains:
        for b in FLAGS.batch_sizes:
            cell = f"{domain} {b}"
            if FLAGS.temperature == 0:
                for c in configs[1:]:
                    for got, want in zip(runs[c], runs[base]):
                        _check_greedy(got[cell]["tokens"], want[cell]["tokens"])
            tps = [spread([run[cell]["tps"] for run in runs[c]], ".1f") for c in configs]
            ratios = [spread([run[cell]["tps"] / ref[cell]["tps"] for run, ref in zip(runs[c], runs[base])], ".2f")
                      for c in configs[1:]]
            steps = [f"{statistics.median(run[cell]['per_step'] for run in runs[c]):.2f}" for c in configs[1:]]
            print(f"| {domain} | {b} | " + " | ".join(tps) + " | " + " | ".join(ratios) + " | " + " | ".join(steps)
                  + " |", flush=True)


def main(argv):
    del argv
    import jax

    if FLAGS.worker:
        print("RESULT " + json.dumps(_worker(FLAGS.worker)), flush=True)
        return

    ks = [int(k) for k in FLAGS.ks]
    mode = "greedy" if FLAGS.temperature == 0 else f"temperature {FLAGS.temperature}"
    print(f"# Speculative decoding ({time.strftime('%Y-%m-%d')}, {jax.devices()[0].device_kind}, {os.cpu_count()} "
          f"CPUs, fp32, {mode}, {FLAGS.max_tokens} tokens/request)\n")
    if ks:
        _fixed_k_table(ks)
    if FLAGS.repeats:
        _defaults_table()


def _fixed_k_table(ks: list[int]) -> None:
    """Each --proposers at each fixed K (never adapted) against no speculation, in this process."""
    from checkpoints import load_model
    from checkpoints.draft import DEFAULT_DRAFT, DEFAULT_EAGLE, DEFAULT_MEDUSA, early_exit_draft, load_draft
    from engine import LLM

    target = load_model()
    draft = None
    if FLAGS.early_exit_layers:
        draft = early_exit_draft(target, [int(i) for i in FLAGS.early_exit_layers])
    elif "draft" in FLAGS.proposers:
        draft = load_draft(FLAGS.draft or DEFAULT_DRAFT, target)
    heads = {"draft": draft, "eagle": load_draft(FLAGS.eagle_head or DEFAULT_EAGLE, target)
             if any("eagle" in p for p in FLAGS.proposers) else None,
             "medusa": load_draft(DEFAULT_MEDUSA, target) if any("medusa" in p for p in FLAGS.proposers) else None}
    batch_sizes = [int(b) for b in FLAGS.batch_sizes]
    plain_llm = LLM(target, speculative=None, max_num_seqs=16, max_num_batched_tokens=512,
                    kernel_dtype=FLAGS.kernel_dtype)
    costs = _window_costs(plain_llm)
    print("Target step time by tokens in the step (one sequence; a verify window is K+1 tokens, padded to a "
          "power of two):\n")
    print("| tokens | " + " | ".join(str(t) for t in costs) + " |")
    print("|---|" + "---:|" * len(costs))
    print("| ms | " + " | ".join(f"{ms:.1f}" for ms in costs.values()) + " |")
    print("| x 1-token step | " + " | ".join(f"{ms / costs[1]:.2f}" for ms in costs.values()) + " |\n")
    print("| domain | proposer | batch | K | alpha | acceptance length | per position | tokens/step | c | host draft share "
          "| ms/step (spec / plain) | tok/s (spec / plain) | speed-up measured | (1+K alpha)/(1+K c) |")
    print("|---|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    spec_llms = {}
    for name in FLAGS.proposers:
        for k in ks:
            kind = name.removesuffix("-tree")
            kw = {"num_tree_nodes": FLAGS.tree_nodes, "tree_branching": FLAGS.tree_branching} if kind != name else {}
            spec_llms[(name, k)] = LLM(target, speculative=kind, draft_model=heads.get(kind),
                                       kernel_dtype=FLAGS.kernel_dtype, draft_kernel_dtype=FLAGS.draft_kernel_dtype,
                                       num_speculative_tokens=k, max_num_seqs=16, max_num_batched_tokens=512, **kw)
    for llm in spec_llms.values():
        llm.engine.proposer.config.min_acceptance = 0.0  # measure raw acceptance: never adapt
    for domain in FLAGS.domains:
        for b in batch_sizes:
            prompts = [_prompts(target.tokenizer, domain, b, r * b) for r in range(FLAGS.rounds)]
            plain_tps, plain_ms, _, _, want, _, _, _ = _decode_rounds(plain_llm, prompts)
            for (name, k), llm in spec_llms.items():
                tps, ms, per_step, alpha, got, length, positions, share = _decode_rounds(llm, prompts)
                if FLAGS.temperature == 0:
                    _check_greedy(got, want)
                c = (ms - plain_ms) / (k * plain_ms)
                alpha = alpha or 0.0  # n-gram: None when nothing matched
                per_pos = " ".join(f"{a:.2f}" for a in positions)
                print(f"| {domain} | {name} | {b} | {k} | {alpha:.2f} | {length:.2f} | {per_pos} | {per_step:.2f} "
                      f"| {c:.2f} | {share:.1%} | {ms:.0f} / {plain_ms:.0f} | {tps:.1f} / {plain_tps:.1f} "
                      f"| {tps / plain_tps:.2f}x | {(1 + k * alpha) / (1 + k * c):.2f}x |", flush=True)


if __name__ == "__main__":
    app.run(main)
