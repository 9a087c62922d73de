"""Talk to a running server (`python -m engine.serve`) from the command line.

  python -m engine.query --prompt "What is the capital of France?" --chat --temperature 0
  python -m engine.query --info | --tokenize TEXT | --score TEXT

The client library is `engine.serving.client`.
"""

from __future__ import annotations

import sys

import grpc

from engine.serving.client import Client, Completion


def _define_flags(flags) -> None:
    # Defined only when run as a program, so importing this module registers no flags.
    flags.DEFINE_string("target", "127.0.0.1:50051", "Server host:port.")
    flags.DEFINE_string("prompt", None, "Prompt text to generate from.")
    flags.DEFINE_bool("chat", False, "Send --prompt as a user chat message.")
    flags.DEFINE_integer("max_tokens", 128, "Most tokens to generate.")
    flags.DEFINE_float("temperature", 0.7, "0 is greedy.")
    flags.DEFINE_float("top_p", 1.0, "Nucleus sampling mass, in (0, 1].")
    flags.DEFINE_integer("top_k", 0, "Keep the k most likely tokens; 0 disables.")
    flags.DEFINE_float("min_p", 0.0, "Drop tokens below min_p times the top probability.")
    flags.DEFINE_integer("seed", None, "Sampling seed.")
    flags.DEFINE_multi_string("stop", [], "A stop string (repeat for several).")
    flags.DEFINE_integer("logprobs", None, "Print each token's logprob and this many alternatives (0-20).")
    flags.DEFINE_integer("priority", 0, "Lower is served first.")
    flags.DEFINE_float("timeout_s", None, "Call deadline in seconds.")
    flags.DEFINE_bool("info", False, "Print the server's ModelInfo and health, and exit.")
    flags.DEFINE_string("tokenize", None, "Print the token ids of this text, and exit.")
    flags.DEFINE_string("score", None, "Print the per-token logprobs and log-likelihood of this text, and exit.")
    flags.DEFINE_string("auth_token_file", None, "File holding the server's shared token.")
    flags.DEFINE_string("tls_ca", None, "PEM CA certificate(s) of a TLS server.")


def _main(argv) -> int:
    from absl import flags

    FLAGS = flags.FLAGS
    if len(argv) > 1:
        print(f"error: unexpected arguments {argv[1:]}", file=sys.stderr)
        return 2
    token = None
    if FLAGS.auth_token_file:
        with open(FLAGS.auth_token_file) as f:
            token = f.read().strip()
    ca = None
    if FLAGS.tls_ca:
        with open(FLAGS.tls_ca, "rb") as f:
            ca = f.read()
    with Client(FLAGS.target, auth_token=token, root_certificates=ca) as client:
        try:
            if FLAGS.info:
                print(client.model_info(), end="")
                print(f"health: {client.health()}")
            elif FLAGS.tokenize is not None:
                print(client.tokenize(FLAGS.tokenize))
            elif FLAGS.score is not None:
                result = client.score([FLAGS.score])[0]
                for token_id, logprob in zip(result.token_ids[1:], result.token_logprobs):
                    print(f"{token_id}\t{logprob:.4f}\t{client.detokenize([token_id])!r}")
                print(f"log_likelihood {result.log_likelihood:.4f} over {len(result.token_logprobs)} tokens")
            elif FLAGS.prompt is not None:
                _generate(client, FLAGS)
            else:
                print("error: give --prompt, --info, --tokenize or --score", file=sys.stderr)
                return 2
        except grpc.RpcError as e:
            print(f"\nerror: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    return 0


def _generate(client: Client, FLAGS) -> None:
    prompt = [{"role": "user", "content": FLAGS.prompt}] if FLAGS.chat else FLAGS.prompt
    sampling = {"max_tokens": FLAGS.max_tokens, "temperature": FLAGS.temperature, "top_p": FLAGS.top_p,
                    "top_k": FLAGS.top_k, "min_p": FLAGS.min_p, "stop": FLAGS.stop, "logprobs": FLAGS.logprobs, "seed": FLAGS.seed}
    messages = []
    for msg in client.generate_stream(prompt, priority=FLAGS.priority, timeout=FLAGS.timeout_s,
                                      **{k: v for k, v in sampling.items() if v is not None}):
        messages.append(msg)
        print(msg.text, end="", flush=True)
    done = Completion.join(messages)
    print(f"\n[finish_reason={done.finish_reason} prompt_tokens={done.usage.prompt_tokens} "
          f"completion_tokens={done.usage.completion_tokens}]", file=sys.stderr)
    for token_id, lp in zip(done.token_ids, done.logprobs):
        alternatives = " ".join(f"{t.token_id}:{t.logprob:.3f}" for t in lp.top)
        print(f"{token_id}\t{lp.sampled.logprob:.4f}\t{alternatives}", file=sys.stderr)


def run() -> None:
    """Parses the command line and runs (`python -m engine.query`)."""
    from absl import app, flags

    _define_flags(flags)
    app.run(_main)


if __name__ == "__main__":
    run()
