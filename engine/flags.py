"""Command-line flags shared by the apps (`engine.generate`, `engine.serve`, the batch job, load tests).

Importing this module defines the model, engine and speculation flags once;
`llm_from_flags()` builds the `LLM` they describe. Each app defines only its
own flags besides these.
"""

from __future__ import annotations

from absl import flags

FLAGS = flags.FLAGS

# Model.
flags.DEFINE_string("model", "smollm2-135m-instruct", "Preset name, GGUF file, HF or Orbax directory.")
flags.DEFINE_enum("dtype", None, ["float32", "bfloat16"], "Weight dtype; default the checkpoint's.")
flags.DEFINE_enum("attention", "auto", ["auto", "reference", "native", "pallas"],
                  "Paged attention: auto = the Pallas kernel on GPU; on CPU the native kernel for small steps "
                  "(else the jnp reference).")
flags.DEFINE_enum("matmul", "auto", ["auto", "amx", "avx512", "avx2", "xla"],
                  "The kernels of every product: auto = the fastest of those this CPU runs, timed on the "
                  "model's shapes (cached per machine and model; engine.kernels); amx, avx512, avx2 (the "
                  "native CPU kernels) or xla (XLA's dot) forces one.")
# Speculative decoding.
flags.DEFINE_enum("speculative", "auto", ["auto", "eagle", "medusa", "draft", "ngram", "suffix", "off"],
                  "Speculative decoding: eagle = an EAGLE head on the target's features proposes, medusa = "
                  "Medusa heads fill a token tree, draft = a draft model proposes, ngram = prompt lookup, "
                  "suffix = suffix decoding (the request's own context and earlier outputs of its tenant); "
                  "auto = the proposer shown to pay on the model "
                  "(checkpoints.draft.AUTO_SPECULATION: ngram for SmolLM2), else off.")
flags.DEFINE_string("draft_model", None, "Draft model, EAGLE head or Medusa heads (bundled name or path); default: the "
                    "model's own.")
flags.DEFINE_integer("num_speculative_tokens", None, "Most draft tokens per verify step (G; default 4, or auto's).")
flags.DEFINE_integer("num_tree_nodes", None, "0: chains of draft tokens; else token trees of at most this many "
                     "nodes (1..31), each path at most G deep (ngram: every earlier match's continuation; medusa: the "
                     "heads' static sparse tree; eagle: EAGLE-2 dynamic trees). Default 0, or auto's.")
flags.DEFINE_integer("tree_branching", None, "EAGLE-2 trees: children per expanded node, nodes expanded per level "
                     "(1..8; default 4, or auto's).")
flags.DEFINE_bool("ngram_in_tree", None, "EAGLE-2 trees: the n-gram lookup's chain joins each tree (default: "
                  "auto's, else off).")
flags.DEFINE_integer("suffix_cache_tokens", None, "Suffix decoding: the most tokens of earlier requests (prompt "
                     "tails and outputs) kept for proposals, over every tenant (default 65536).")
flags.DEFINE_enum("kernel_dtype", None, ["float32", "bfloat16", "int8"],
                  "The weights the CPU kernel streams for the target; bfloat16 halves them (activations keep "
                  "--dtype). Default: the model's dtype.")
flags.DEFINE_enum("draft_kernel_dtype", None, ["float32", "bfloat16", "int8"],
                  "The draft's weights in the CPU kernel; int8 quantizes them (per-column scales). "
                  "Default: the dtype its checkpoint stores (bfloat16 for the bundled heads), else the draft's.")
# Engine limits (`engine.EngineConfig`).
flags.DEFINE_integer("block_size", 16, "KV block size in tokens (a power of two).")
flags.DEFINE_integer("num_blocks", None, "KV pool size in blocks; default: sized from --kv_cache_bytes.")
flags.DEFINE_integer("kv_cache_bytes", 1 << 30, "KV pool bytes when --num_blocks is not set.")
flags.DEFINE_integer("max_num_seqs", 64, "Most sequences per step.")
flags.DEFINE_integer("max_num_batched_tokens", 512, "Token budget per step.")
flags.DEFINE_integer("tensor_parallel_size", 1, "Devices the target splits over (Megatron-style tensor "
                     "parallelism). On CPU the host is split into that many XLA devices (a correctness path: "
                     "CPU collectives are slow).")
# Several hosts (`jax.distributed`): every process runs this same command with its own --process_id.
flags.DEFINE_string("coordinator_address", None, "host:port of process 0's coordinator (several processes).")
flags.DEFINE_integer("num_processes", 1, "Processes (hosts) the mesh spans; > 1 starts jax.distributed.")
flags.DEFINE_integer("process_id", 0, "This process's index, 0 .. --num_processes - 1.")
flags.DEFINE_string("compilation_cache_dir", "default", "Where compiled programs are kept across restarts (JAX's "
                    "persistent compilation cache); 'default': $JAX_COMPILATION_CACHE_DIR, else "
                    "~/.cache/jax-spec-engine/xla; '' keeps none.")
flags.DEFINE_bool("async_scheduling", True, "Schedule and dispatch the next step before this one's tokens are read "
                  "back, hiding the host's work behind the device's (steps without speculation).")
flags.DEFINE_integer("max_model_len", None, "Prompt + output tokens per request; default the model's limit "
                     "(capped by the KV pool).")
flags.DEFINE_float("grace_s", 10.0, "On SIGTERM or Ctrl-C, seconds what is in flight (the server's calls, the batch "
                   "job's lines) gets to finish before it is aborted.")
flags.DEFINE_integer("max_stop_strings", 16, "Most stop strings per request.")
flags.DEFINE_integer("max_stop_chars", 256, "Most characters per stop string (a stream holds back one fewer than "
                     "its longest).")


def llm_kwargs() -> dict:
    """The `engine.LLM` keyword arguments the model, kernel, speculation and engine-limit flags give (no
    process setup: `llm_from_flags` does that; the Ray runner's actors build their own `LLM` from these)."""
    return dict(model=FLAGS.model, dtype=FLAGS.dtype, attention=FLAGS.attention, matmul=FLAGS.matmul,
                kernel_dtype=FLAGS.kernel_dtype, draft_kernel_dtype=FLAGS.draft_kernel_dtype,
                speculative=None if FLAGS.speculative == "off" else FLAGS.speculative,
                draft_model=FLAGS.draft_model, num_speculative_tokens=FLAGS.num_speculative_tokens,
                num_tree_nodes=FLAGS.num_tree_nodes, tree_branching=FLAGS.tree_branching,
                ngram_in_tree=FLAGS.ngram_in_tree, suffix_cache_tokens=FLAGS.suffix_cache_tokens,
                block_size=FLAGS.block_size, num_blocks=FLAGS.num_blocks, kv_cache_bytes=FLAGS.kv_cache_bytes,
                max_num_seqs=FLAGS.max_num_seqs, max_num_batched_tokens=FLAGS.max_num_batched_tokens,
                max_model_len=FLAGS.max_model_len, tensor_parallel_size=FLAGS.tensor_parallel_size,
                async_scheduling=FLAGS.async_scheduling, max_stop_strings=FLAGS.max_stop_strings,
                max_stop_chars=FLAGS.max_stop_chars)


def llm_from_flags():
    """The `engine.LLM` the flags describe.

    Raises ValueError, KeyError or FileNotFoundError for an unknown model or
    draft, or bad engine limits (the apps print these and exit 2).
    """
    import jax

    if FLAGS.num_processes > 1:
        from engine.distributed import initialize

        initialize(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id,
                   local_cpu_devices=-(-FLAGS.tensor_parallel_size // FLAGS.num_processes))
    elif FLAGS.tensor_parallel_size > 1:
        # Before the backend starts: where jax runs on the CPU, it shows this many host devices.
        jax.config.update("jax_num_cpu_devices", max(FLAGS.tensor_parallel_size, jax.config.jax_num_cpu_devices))
    if FLAGS.compilation_cache_dir:
        from engine.compilation import use_persistent_cache

        use_persistent_cache(None if FLAGS.compilation_cache_dir == "default" else FLAGS.compilation_cache_dir)
    from engine import LLM  # after flag parsing: the jax import is slow

    return LLM(**llm_kwargs())
