"""Step programs kept across restarts as serialized executables (`engine.programs`): a restart loads every
program without tracing it and generates the same tokens; a torn file compiles again; other settings are
other programs."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = """
import json, os, sys
import jax
from engine import compilation
from engine.compilation import compilation_count, use_persistent_cache
if len(sys.argv) > 3:  # JAX's own persistent cache on as well (what use_persistent_cache turns off)
    jax.config.update("jax_compilation_cache_dir", sys.argv[3])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    compilation._executable_dir = os.path.join(sys.argv[1], "executables")
else:
    use_persistent_cache(sys.argv[1])
from engine import LLM, SamplingParams
llm = LLM("tiny-llama", num_blocks=48, block_size=16, max_num_seqs=4, max_num_batched_tokens=8,
          speculative=None if sys.argv[2] == "off" else sys.argv[2])
llm.engine.precompile()
before = compilation_count()
prompts = [[1, 2, 3, 4, 5] * 3, [7, 8, 9]]
outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
sampled = llm.generate(prompts, SamplingParams(temperature=0.8, seed=3, max_tokens=12, ignore_eos=True))
score = llm.score(["hello world"])[0]
programs = llm.engine.runner.programs
print(json.dumps({"greedy": [o.token_ids for o in outs], "sampled": [o.token_ids for o in sampled],
                  "score": score.token_logprobs, "loaded": programs.num_loaded, "compiled": programs.num_compiled,
                  "after_warmup": compilation_count() - before,
                  "block_ops": len(llm.engine.runner.block_op_buckets)}))
"""


def _run(cache, speculative="ngram", jax_cache=None):
    args = [str(cache), speculative] + ([str(jax_cache)] if jax_cache else [])
    out = subprocess.run([sys.executable, "-c", SCRIPT, *args], cwd=ROOT, capture_output=True,
                         text=True, env=dict(os.environ, PYTHONPATH=ROOT), timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


def test_a_restart_loads_every_program_and_generates_the_same_tokens(tmp_path):
    first, _ = _run(tmp_path)
    folder = tmp_path / "executables"
    files = sorted(folder.iterdir())
    # Every step shape (4 token x 3 sequence buckets, 9 with S <= T) twice (plain and n-gram verify), Score's
    # 4 token buckets, and the three block operations per block-op bucket.
    assert first["compiled"] == len(files) == 9 * 2 + 4 + 3 * first["block_ops"] and first["loaded"] == 0
    assert first["after_warmup"] == 0
    second, _ = _run(tmp_path)
    assert second["loaded"] == len(files) and second["compiled"] == 0 and second["after_warmup"] == 0
    assert {k: second[k] for k in ("greedy", "sampled", "score")} == {k: first[k] for k in ("greedy", "sampled", "score")}

    files[0].write_bytes(files[0].read_bytes()[:100])  # torn: compiled again and replaced
    third, log = _run(tmp_path)
    assert third["compiled"] == 1 and third["loaded"] == len(files) - 1 and "did not load" in log
    assert third["greedy"] == first["greedy"] and third["sampled"] == first["sampled"]
    assert files[0].stat().st_size > 100

    other, _ = _run(tmp_path, speculative="off")  # other settings: other programs, none loaded
    assert other["loaded"] == 0 and other["compiled"] == 9 + 4 + 3 * first["block_ops"]
    assert other["greedy"] == first["greedy"]


def test_an_executable_from_jaxs_own_cache_is_not_kept(tmp_path):
    """An executable that JAX's persistent cache handed back, serialized again, loaded but failed to run
    (`NOT_FOUND: Function ... not found`): a restart crashed on its first step. Such executables are not
    written; the next run compiles (or takes them from JAX's cache) and generates the same tokens."""
    jax_cache = tmp_path / "jax"
    first, _ = _run(tmp_path, jax_cache=jax_cache)
    folder = tmp_path / "executables"
    assert first["compiled"] == len(list(folder.iterdir())) > 0
    for f in folder.iterdir():
        f.unlink()
    second, _ = _run(tmp_path, jax_cache=jax_cache)  # every program is a hit in JAX's cache
    assert second["compiled"] == first["compiled"] and list(folder.iterdir()) == []
    third, _ = _run(tmp_path, jax_cache=jax_cache)
    assert third["greedy"] == first["greedy"] and third["sampled"] == first["sampled"]
