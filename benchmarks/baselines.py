"""Pieces the benchmarks share: the real prompts' folder, worker processes and their medians, and the Hugging
Face transformers baseline."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

from absl import flags

from benchmarks import prompts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
flags.DEFINE_string("prompts_dir", prompts.default_dir(),
                    "Folder of the prompt files (<domain>.jsonl), built by `python -m benchmarks.prompts`.")


def spawn_worker(script: str, args: list[str]) -> dict:
    """Runs `python script *args` (a benchmark's worker) in a process of its own and returns the JSON it printed
    after `RESULT ` last. Raises RuntimeError, with the tail of its stderr, if it failed."""
    done = subprocess.run([sys.executable, os.path.abspath(script), *args], capture_output=True, text=True)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    if done.returncode or not lines:
        raise RuntimeError(f"{os.path.basename(script)} {' '.join(args[-1:])} failed (exit {done.returncode}):\n"
                           f"{done.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def spread(values: list[float], spec: str = ".1f") -> str:
    """The median of `values` with their range: "median (min-max)", or the value alone."""
    med = statistics.median(values)
    return f"{med:{spec}} ({min(values):{spec}}-{max(values):{spec}})" if len(values) > 1 else f"{med:{spec}}"


def prompts_dir() -> str:
    """--prompts_dir (before flags are parsed: its default), checked to hold every domain's file.
    Raises FileNotFoundError, saying how to build them, if it does not."""
    return prompts.require(flags.FLAGS.prompts_dir if flags.FLAGS.is_parsed() else prompts.default_dir())


def read_prompts(domain: str) -> list[dict]:
    """The rows of `<prompts_dir>/<domain>.jsonl` in file order."""
    with open(os.path.join(prompts_dir(), f"{domain}.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def hf_setup(gguf_path: str, dtype: str = "float32"):
    """transformers' model of the GGUF in `dtype` ("float32", or "bfloat16": oneDNN's AMX path on CPUs with AMX)."""
    import torch
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(os.cpu_count() or 1)
    d, name = os.path.split(gguf_path)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=getattr(torch, dtype))
    model.eval()
    return model


def hf_batch(prompt_ids: list[list[int]], pad_id: int):
    import torch
    n = max(len(p) for p in prompt_ids)
    ids = torch.full((len(prompt_ids), n), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompt_ids), n), dtype=torch.long)
    for i, p in enumerate(prompt_ids):  # left padding
        ids[i, n - len(p):] = torch.tensor(p)
        mask[i, n - len(p):] = 1
    return ids, mask
