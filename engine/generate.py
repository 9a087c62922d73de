"""Generate text from the command line, streaming it to stdout.

  python -m engine.generate --prompt "What is the capital of France?" --chat --temperature 0

Model, engine and speculation flags are `engine.flags`'.
"""

from __future__ import annotations

import sys

from absl import app, flags, logging

from engine.flags import FLAGS, llm_from_flags

flags.DEFINE_string("prompt", None, "The prompt text.")
flags.DEFINE_bool("chat", False, "Send the prompt as a user chat message through the model's chat template.")
flags.DEFINE_integer("max_tokens", 128, "Most tokens to generate.")
flags.DEFINE_float("temperature", 0.7, "0 is greedy.")
flags.DEFINE_float("top_p", 1.0, "Nucleus sampling mass, in (0, 1].")
flags.DEFINE_integer("top_k", 0, "Keep the k most likely tokens; 0 disables.")
flags.DEFINE_float("min_p", 0.0, "Drop tokens below min_p times the top probability.")
flags.DEFINE_integer("seed", None, "Sampling seed.")
flags.DEFINE_multi_string("stop", [], "A stop string (repeat the flag for several).")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if not FLAGS.prompt:
        print("error: --prompt is required and must not be empty", file=sys.stderr)
        return 2
    logging.set_verbosity(logging.WARNING)  # keep jax's backend probing (e.g. "no TPU") off stderr
    import jax
    from engine import InvalidRequestError, SamplingParams  # after flag parsing: jax import is slow

    try:
        params = SamplingParams(temperature=FLAGS.temperature, top_p=FLAGS.top_p, top_k=FLAGS.top_k,
                                min_p=FLAGS.min_p, seed=FLAGS.seed, max_tokens=FLAGS.max_tokens,
                                stop=tuple(FLAGS.stop))
        params.validate()
        llm = llm_from_flags()
        prompt = [{"role": "user", "content": FLAGS.prompt}] if FLAGS.chat else FLAGS.prompt
        lead = jax.process_index() == 0  # over several processes, the first prints
        outputs = llm.generate([prompt], params,
                               on_output=lambda _, out: lead and print(out.delta_text, end="", flush=True))
    except (InvalidRequestError, ValueError, KeyError, FileNotFoundError) as e:
        print(f"\nerror: {e.args[0] if e.args else e}", file=sys.stderr)
        return 2
    out = outputs[0]
    if not lead:
        return 0
    spec = f" acceptance_rate={out.acceptance_rate:.2f}" if out.acceptance_rate is not None else ""
    print(f"\n[finish_reason={out.finish_reason} tokens={len(out.token_ids)} "
          f"tokens_per_step={out.tokens_per_step:.2f}{spec}]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    app.run(main)
