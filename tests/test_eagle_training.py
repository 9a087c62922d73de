"""`python -m training.eagle` end to end on the real target and a tiny work directory: features, training,
the saved head, and continuing a saved head. Run as subprocesses: the app's absl flags share names with
`training.distill`'s, which other tests import."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from checkpoints import load_model
from checkpoints.draft import load_draft

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _train(workdir, out, *flags):
    cmd = [sys.executable, "-m", "training.eagle", f"--workdir={workdir}", f"--out={out}", "--head_vocab=512",
           "--tokens_per_batch=128", "--max_len=120", *flags]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(os.path.join(out, "config.json")) as f:
        return json.load(f)["draft"]["training"]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """Six train sequences; the eval split repeats three of them, so eval agreement measures fitting."""
    work = tmp_path_factory.mktemp("eagle_train")
    encode = load_model().tokenizer.encode
    seqs = [encode(" ".join(f"{a} plus {b} is {a + b}." for a in range(k, k + 12) for b in (k, 7)))[:100 + k]
            for k in range(6)]
    row = lambda split, i, s: {"split": split, "key": f"{split}{i}", "prompt_ids": s[:20], "output_ids": s[20:]}
    rows = [row("train", i, s) for i, s in enumerate(seqs)] + [row("eval", i, s) for i, s in enumerate(seqs[:3])]
    with open(work / "continuations.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return work


@pytest.fixture(scope="module")
def trained(workdir):
    """(head directory, its training record): 2 layers from the target's last ones, 10 epochs of 6 steps."""
    return workdir / "h2", _train(workdir, workdir / "h2", "--stage=all", "--num_layers=2", "--epochs=10",
                                  "--noise=0")


def test_a_head_trained_from_the_target_fits_its_sequences_and_records_its_recipe(workdir, trained):
    head, record = trained
    target = load_model()
    feats = np.load(workdir / "features_eval.npy")
    assert feats.shape == (303, target.config.hidden_size) and feats.dtype == np.float16
    assert record["sequences"] == 6 and record["tokens"] == 615
    assert "--num_layers=2" in record["command"] and "--head_vocab=512" in record["command"]
    assert [e["steps"] for e in record["epochs"]] == list(range(6, 61, 6))
    # The bar: always drafting the target's most frequent next token (over the head's tokens; not at position 0).
    head_ids = np.asarray(load_draft(str(head), target).params["head_ids"])
    argmax = (feats.astype(np.float32) @ np.asarray(target.params["embed"], np.float32)[head_ids].T).argmax(-1)
    lengths = np.load(workdir / "feature_seqs_eval.npz")["lengths"]
    argmax = np.delete(argmax, np.cumsum(lengths)[:-1].tolist() + [0])
    constant = np.bincount(argmax).max() / len(argmax)
    # Ten passes over the eval sequences themselves: the head agrees with the target's next token well above
    # the bar, teacher-forced (top1) and from its own features (top12).
    last = record["epochs"][-1]["eval"]
    assert last["top1"] > constant + 0.2 and last["top12"] > constant + 0.1, (constant, record["epochs"])


def test_continuing_a_deeper_head_keeps_its_depth_and_weights(workdir, trained):
    """`--init_from` without `--num_layers` keeps the loaded head's depth; at lr 0 the weights come back
    exactly (bf16 both times)."""
    head, _ = trained
    record = _train(workdir, workdir / "h2b", "--stage=train", f"--init_from={head}", "--epochs=1", "--lr=0")
    assert "--num_layers=2" in record["command"] and record["init_from"]["name"] == str(head)
    target = load_model()
    a, b = load_draft(str(head), target), load_draft(str(workdir / "h2b"), target)
    assert a.config.num_layers == b.config.num_layers == 2
    assert a.params.keys() == b.params.keys()
    for k in a.params:
        np.testing.assert_array_equal(np.asarray(a.params[k]), np.asarray(b.params[k]), err_msg=k)


@pytest.mark.parametrize("flag", ["--num_layers=0", "--unroll=0"])
def test_a_head_needs_a_layer_and_a_pass(tmp_path, flag):
    proc = subprocess.run([sys.executable, "-m", "training.eagle", f"--workdir={tmp_path}", f"--out={tmp_path}",
                           flag], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "0 is not a positive integer" in proc.stderr, proc.stderr[-2000:]
