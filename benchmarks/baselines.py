"""Pieces the benchmarks share: the real prompts' folder and the Hugging Face transformers baseline."""

from __future__ import annotations

import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def prompts_dir() -> str | None:
    """`shared/data/prompts` beside the repository or inside it."""
    for base in (os.path.dirname(ROOT), ROOT):
        path = os.path.join(base, "shared", "data", "prompts")
        if os.path.isdir(path):
            return path
    return None


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
