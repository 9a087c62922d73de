"""Step programs kept across restarts as serialized executables (`engine.programs`): a restart loads every
program without tracing it and generates the same tokens; a torn file compiles again; other settings are
other programs."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = """
import json, sys
from engine.compilation import compilation_count, use_persistent_cache
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
                  "after_warmup": compilation_count() - before}))
"""


def _run(cache, speculative="ngram"):
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(cache), speculative], cwd=ROOT, capture_output=True,
                         text=True, env=dict(os.environ, PYTHONPATH=ROOT), timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


def test_a_restart_loads_every_program_and_generates_the_same_tokens(tmp_path):
    first, _ = _run(tmp_path)
    folder = tmp_path / "executables"
    files = sorted(folder.iterdir())
    # Every step shape (4 token x 3 sequence buckets, 9 with S <= T) twice (plain and n-gram verify), and
    # Score's 4 token buckets.
    assert first["compiled"] == len(files) == 9 * 2 + 4 and first["loaded"] == 0
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
    assert other["loaded"] == 0 and other["compiled"] == 9 + 4
    assert other["greedy"] == first["greedy"]
