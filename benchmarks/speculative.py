"""Speculative decoding on the real model (fp32, CPU) by prompt domain and proposer: the EAGLE head, a draft
model, n-gram lookup.

  python benchmarks/speculative.py [--domains=chat,code,math] [--batch_sizes=1,4,16] [--ks=2,4,6]
      [--max_tokens=64] [--proposers=eagle,draft,ngram] [--temperature=0]

For each domain, proposer, batch size B and K: B real prompts (chat template, greedy or
seeded sampling at --temperature, `ignore_eos`) decode together. Decode steps are timed from the second step
after prefill while all B requests run (so no compilation and no shrinking
batch is timed): tok/s = tokens emitted in the timed steps / their time.

* alpha: accepted / proposed draft tokens over the whole run.
* acceptance length: tokens a verify emits (accepted + the correction or
  bonus token), over the run's verifies; per position: the fraction of
  verifies proposing a token at window position i that accepted it.
* tokens/step: emitted tokens per target step in the timed steps.
* c: the extra cost per proposed token (the draft passes and the wider verify
  window together) relative to a plain target step,
  c = (t_spec_step - t_plain_step) / (K * t_plain_step), from the timed steps.
* verify window cost: the target step over T = 1, 2, 4, 8, 16 tokens of one
  sequence, in ms and relative to T = 1 (what a verify of K+1 tokens costs).
* predicted speed-up (1 + K alpha) / (1 + K c) (the approximation in the issue;
  Leviathan et al. 2023 §3.4 give the exact expected tokens
  (1 - alpha^(K+1)) / (1 - alpha)), next to the measured tok/s ratio.
* adaptive: the default engine (K = 4, halved per request class while the
  running acceptance rate is below 0.5, retried every 200 steps) against no
  speculation, per domain: a stream of `--adaptive_requests` requests of that
  class served one at a time (batch 1), wall time of the whole stream (the two
  engines take turns request by request).

Prompts are the first ones of each file's held-out split, which distillation
never trains on (`training/data.py`).
"""

from __future__ import annotations

import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from absl import app, flags  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_list("domains", ["chat", "code", "math"], "Prompt files in ../shared/data/prompts.")
flags.DEFINE_list("batch_sizes", ["1", "4", "16"], "Requests decoding together.")
flags.DEFINE_list("ks", ["2", "4", "6"], "Draft lengths K.")
flags.DEFINE_integer("max_tokens", 64, "Tokens per request.")
flags.DEFINE_integer("skip", 0, "Skip this many held-out prompts at the start of each file.")
flags.DEFINE_integer("adaptive_requests", 8, "Requests per domain in the adaptive-speculation stream.")
flags.DEFINE_string("draft", None, "Draft: a directory or a bundled name (default: the model's bundled draft).")
flags.DEFINE_list("proposers", ["eagle", "ngram"], "Proposers to measure (the `speculative` kinds).")
flags.DEFINE_string("eagle_head", None, "EAGLE head: a directory or a bundled name (default: the model's own).")
flags.DEFINE_enum("draft_kernel_dtype", None, ["float32", "bfloat16", "int8"],
                  "The draft's / head's weights in the CPU kernel (default: their dtype).")
flags.DEFINE_float("temperature", 0.0, "0: greedy (speculative output asserted equal to the plain engine's); "
                   "else seeded sampling at this temperature.")
flags.DEFINE_list("early_exit_layers", None, "Use an untrained early-exit draft of these target layers "
                  "(checkpoints.draft.early_exit_draft) instead of --draft.")

DATA = os.path.join(ROOT, "..", "shared", "data", "prompts")


def _prompts(tok, domain, n):
    """The first n prompts of the domain's held-out split (never trained on: training/data.py)."""
    from training.data import EVAL_PERCENT, prompt_hash

    with open(os.path.join(DATA, f"{domain}.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    held = [r["prompt"] for r in rows if prompt_hash(r["id"]) % 100 < EVAL_PERCENT.get(domain, 100)]
    texts = held[FLAGS.skip:FLAGS.skip + n]
    if len(texts) < n:
        raise ValueError(f"{domain}: {len(held)} held-out prompts, {FLAGS.skip + n} needed")
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True))
            for t in texts]


def _decode(llm, prompts):
    """Returns (tokens/s, ms per step, tokens per step, acceptance rate or None) over the timed steps."""
    from engine import SamplingParams

    from scheduler.packing import bucket_for

    engine = llm.engine
    # Compile every decode shape the run can take (each draft length of the ladder), so none is timed.
    runner, b = engine.runner, len(prompts)
    S = bucket_for(b, runner.seq_buckets)
    widest = bucket_for(b * (1 + max(k for k in runner.spec_ks if k is not None) if len(runner.spec_ks) > 1 else b),
                        runner.token_buckets)
    engine.precompile([(t, S) for t in runner.token_buckets if S <= t <= widest])
    ids = [engine.add_request(p, SamplingParams(temperature=FLAGS.temperature, seed=i, max_tokens=FLAGS.max_tokens,
                                                ignore_eos=True)).request_id for i, p in enumerate(prompts)]
    st = engine.stats
    before = (st.num_verifies, st.num_accepted_tokens, list(st.drafted_at), list(st.accepted_at))
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
    drafted = sum(outs[i].num_draft_tokens for i in ids)
    accepted = sum(outs[i].num_accepted_tokens for i in ids)
    verifies = st.num_verifies - before[0]
    length = 1 + (st.num_accepted_tokens - before[1]) / verifies if verifies else 1.0
    grow = lambda xs: xs + [0] * (len(st.drafted_at) - len(xs))
    positions = [(a - a0) / (d - d0) for a, a0, d, d0 in zip(st.accepted_at, grow(before[3]), st.drafted_at,
                                                                grow(before[2])) if d > d0]
    return tokens / elapsed, 1e3 * elapsed / steps, tokens / steps, (accepted / drafted if drafted else None), \
        [outs[i].token_ids for i in ids], length, positions


def _streams(llms, prompts, request_class):
    """Serves the prompts one after another as one class on each engine, alternating engines per request.

    Alternating spreads the shared machine's load changes over both. Every program a stream can
    use is compiled first (prefill buckets of these prompts and the decode buckets, for each draft
    length of the ladder), so no compilation is timed. Returns, per engine, (tok/s, requests that
    speculated, "draft tokens proposed / accepted").
    """
    from engine import SamplingParams
    from scheduler.packing import bucket_for

    for llm in llms:
        engine = llm.engine
        budget = engine.config.max_num_batched_tokens  # a longer prompt is prefilled in chunks of this size
        chunks = {n for p in prompts for n in (min(len(p), budget), len(p) % budget) if n}
        engine.precompile(sorted({(bucket_for(n, engine.runner.token_buckets), 1) for n in chunks}
                                 | {(t, 1) for t in (1, 2, 4, 8)}))
    sp = SamplingParams(temperature=0, max_tokens=FLAGS.max_tokens, ignore_eos=True)
    served, elapsed = [[] for _ in llms], [0.0] * len(llms)
    for p in prompts:
        for i, llm in enumerate(llms):
            t = time.perf_counter()
            served[i].append(llm.engine.add_request(p, sp, request_class=request_class))
            while llm.engine.has_unfinished():
                llm.engine.step()
            elapsed[i] += time.perf_counter() - t
    out = []
    for reqs, dt in zip(served, elapsed):
        drafted = sum(r.num_draft_tokens for r in reqs)
        out.append((sum(len(r.output_token_ids) for r in reqs) / dt, sum(r.num_draft_tokens > 0 for r in reqs),
                    f"{drafted} / {sum(r.num_accepted_tokens for r in reqs)}"))
    return out


def _window_costs(llm, sizes=(1, 2, 4, 8, 16), repeats=20) -> dict[int, float]:
    """Median ms of the target's jitted step over T tokens of one sequence (T = a verify window of K+1)."""
    import statistics

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


def main(argv):
    del argv
    from checkpoints import load_model
    from checkpoints.draft import DEFAULT_DRAFT, DEFAULT_EAGLE, early_exit_draft, load_draft
    from engine import LLM

    target = load_model()
    draft = None
    if FLAGS.early_exit_layers:
        draft = early_exit_draft(target, [int(i) for i in FLAGS.early_exit_layers])
    elif "draft" in FLAGS.proposers:
        draft = load_draft(FLAGS.draft or DEFAULT_DRAFT, target)
    heads = {"draft": draft, "eagle": load_draft(FLAGS.eagle_head or DEFAULT_EAGLE, target)
             if "eagle" in FLAGS.proposers else None}
    batch_sizes = [int(b) for b in FLAGS.batch_sizes]
    ks = [int(k) for k in FLAGS.ks]
    mode = "greedy" if FLAGS.temperature == 0 else f"temperature {FLAGS.temperature}"
    print(f"# Speculative decoding ({time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPUs, fp32, {mode}, "
          f"{FLAGS.max_tokens} tokens/request)\n")
    plain_llm = LLM(target, speculative=None, max_num_seqs=16, max_num_batched_tokens=512)
    costs = _window_costs(plain_llm)
    print("Target step time by tokens in the step (one sequence; a verify window is K+1 tokens, padded to a "
          "power of two):\n")
    print("| tokens | " + " | ".join(str(t) for t in costs) + " |")
    print("|---|" + "---:|" * len(costs))
    print("| ms | " + " | ".join(f"{ms:.1f}" for ms in costs.values()) + " |")
    print("| x 1-token step | " + " | ".join(f"{ms / costs[1]:.2f}" for ms in costs.values()) + " |\n")
    print("| domain | proposer | batch | K | alpha | acceptance length | per position | tokens/step | c "
          "| ms/step (spec / plain) | tok/s (spec / plain) | speed-up measured | (1+K alpha)/(1+K c) |")
    print("|---|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|")

    def with_proposer(name, **kw):
        return LLM(target, speculative=name, draft_model=heads.get(name), draft_kernel_dtype=FLAGS.draft_kernel_dtype,
                   **kw)

    spec_llms = {(name, k): with_proposer(name, num_speculative_tokens=k, max_num_seqs=16, max_num_batched_tokens=512)
                 for name in FLAGS.proposers for k in ks}
    for llm in spec_llms.values():
        llm.engine.proposer.config.min_acceptance = 0.0  # measure raw acceptance: never adapt
    adaptive = {}
    # The stream's engines: default speculation settings; prefix caching off so that the prefill shapes
    # compiled beforehand are the ones used.
    stream_kw = dict(max_num_seqs=1, max_num_batched_tokens=512, num_blocks=256, enable_prefix_caching=False)
    defaults = [with_proposer(name, **stream_kw) for name in FLAGS.proposers]
    stream_plain = LLM(target, speculative=None, **stream_kw)
    for domain in FLAGS.domains:
        for b in batch_sizes:
            prompts = _prompts(target.tokenizer, domain, b)
            plain_tps, plain_ms, _, _, want, _, _ = _decode(plain_llm, prompts)
            for (name, k), llm in spec_llms.items():
                tps, ms, per_step, alpha, got, length, positions = _decode(llm, prompts)
                if FLAGS.temperature == 0:
                    assert got == want, "speculative greedy output differs from the target's"
                c = (ms - plain_ms) / (k * plain_ms)
                alpha = alpha or 0.0  # n-gram: None when nothing matched
                per_pos = " ".join(f"{a:.2f}" for a in positions)
                print(f"| {domain} | {name} | {b} | {k} | {alpha:.2f} | {length:.2f} | {per_pos} | {per_step:.2f} "
                      f"| {c:.2f} | {ms:.0f} / {plain_ms:.0f} | {tps:.1f} / {plain_tps:.1f} | {tps / plain_tps:.2f}x "
                      f"| {(1 + k * alpha) / (1 + k * c):.2f}x |")
        prompts = _prompts(target.tokenizer, domain, FLAGS.adaptive_requests)
        adaptive[domain] = _streams((*defaults, stream_plain), prompts, domain)
    print(f"\n## Adaptive speculation (default settings), {FLAGS.adaptive_requests} requests per domain, "
          "one at a time\n")
    print("| domain | proposer | tok/s adaptive | tok/s no speculation | ratio | requests that speculated "
          "| draft tokens proposed / accepted |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for domain, results in adaptive.items():
        p = results[-1][0]
        for name, (a, n, drafts) in zip(FLAGS.proposers, results[:-1]):
            print(f"| {domain} | {name} | {a:.1f} | {p:.1f} | {a / p:.2f}x | {n} of {FLAGS.adaptive_requests} "
                  f"| {drafts} |")

if __name__ == "__main__":
    app.run(main)
