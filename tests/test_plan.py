"""The memory plan (`engine.memory_plan`) against the arrays it describes."""

import os
import subprocess
import sys

import jax
import pytest
from flax import nnx

from engine.memory_plan import memory_plan, shard_shapes
from model.llama import kv_heads_per_device
from engine.step import KVPool
from model.config import get_preset
from model.llama import Llama

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-gemma", "tiny-moe"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_one_device_matches_the_built_model_and_pool(name, dtype):
    cfg = get_preset(name).replace(dtype=dtype)
    model = Llama(cfg, rngs=nnx.Rngs(0))
    plan = memory_plan(cfg, 1, block_size=16)
    assert plan.weight_bytes == sum(x.nbytes for x in jax.tree.leaves(nnx.state(model)))  # with the RoPE table
    pool = KVPool.zeros(cfg, 37, 16)
    assert 37 * 16 * plan.kv_bytes_per_token == pool.k.nbytes + pool.v.nbytes


def test_windowed_sequences_hold_the_window_blocks():
    """With every layer windowed a decoding sequence holds its window's blocks and the one being written; one
    global layer keeps them all."""
    cfg = get_preset("tiny-llama").replace(layer_windows=(40, 40))
    plan = memory_plan(cfg, 1, block_size=16, device_bytes=1 << 30)
    assert plan.blocks_per_seq(8192) == 4 and plan.blocks_per_seq(20) == 2
    assert plan.max_num_seqs_at(8192) == plan.kv_blocks // 4
    assert memory_plan(cfg.replace(layer_windows=(40, 0)), 1, block_size=16).blocks_per_seq(8192) == 512


def test_kv_heads_replicate_past_their_count():
    assert [kv_heads_per_device(8, tp) for tp in (1, 2, 4, 8, 16, 32)] == [8, 4, 2, 1, 1, 1]
    with pytest.raises(ValueError, match="KV heads"):
        kv_heads_per_device(6, 4)
    with pytest.raises(ValueError, match="multiple"):
        kv_heads_per_device(3, 4)
    with pytest.raises(ValueError, match="multiples"):
        shard_shapes(get_preset("smollm2-135m"), 2)  # 9 query heads


def test_llama_3_70b_over_8_devices():
    cfg = get_preset("llama-3-70b")
    plan = memory_plan(cfg, 8, device_bytes=80 << 30, utilization=0.9)
    # Norms are whole on every device; everything else is an eighth (the vocabulary 128256 splits evenly).
    replicated = 2 * cfg.num_layers * cfg.hidden_size + cfg.hidden_size
    rope = cfg.max_position_embeddings * cfg.head_dim * 4  # the RoPE table, float32, on every device
    assert plan.weight_bytes == 2 * ((cfg.num_params - replicated) // 8 + replicated) + rope
    assert plan.kv_bytes_per_token == 2 * 80 * 1 * 128 * 2  # one KV head per device
    assert plan.kv_tokens % 16 == 0 and plan.kv_tokens * plan.kv_bytes_per_token <= plan.kv_pool_bytes
    assert plan.max_num_seqs_at(8192) == plan.kv_blocks // 512
    # 16 GiB of weights per device: the whole model would not fit one 80 GiB device.
    assert memory_plan(cfg, 1).kv_blocks == 0


def test_command_line_prints_the_table():
    out = subprocess.run([sys.executable, "-m", "engine.memory_plan", "--model=llama-3-70b", "--tensor_parallel_size=8",
                          "--dtype=bfloat16"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "| weights | 16.43 GiB |" in out.stdout and "| KV per token | 40.0 KiB |" in out.stdout
    assert "| 8192 | 177 |" in out.stdout


def test_the_old_module_name_still_prints_the_plan_with_a_deprecation_message():
    out = subprocess.run([sys.executable, "-m", "engine.plan", "--model=llama-3-70b", "--tensor_parallel_size=8",
                          "--dtype=bfloat16"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "| 8192 | 177 |" in out.stdout, out.stderr[-2000:]
    assert "engine.plan is deprecated: use python -m engine.memory_plan" in out.stderr


def test_command_line_rejects_a_split_that_does_not_divide():
    out = subprocess.run([sys.executable, "-m", "engine.memory_plan", "--model=llama-3-70b", "--tensor_parallel_size=3"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "multiples of tensor_parallel_size 3" in out.stderr
    out = subprocess.run([sys.executable, "-m", "engine.memory_plan", "--model=no-such-model"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "unknown model preset" in out.stderr


@pytest.mark.parametrize("flag, message", [("--block_size=0", "block_size must be >= 1"),
                                           ("--max_num_batched_tokens=-100", "max_num_batched_tokens must be >= 1"),
                                           ("--memory_utilization=1.5", "utilization must be in (0, 1]"),
                                           ("--memory_utilization=nan", "utilization must be in (0, 1]"),
                                           ("--device_memory_gib=0", "device_memory_gib must be in"),
                                           ("--device_memory_gib=inf", "device_memory_gib must be in")])
def test_command_line_rejects_bad_numbers(flag, message):
    out = subprocess.run([sys.executable, "-m", "engine.memory_plan", "--model=llama-3-8b", flag],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and message in out.stderr, out.stderr[-1000:]


def test_command_line_reports_a_bad_config(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama", "vocab_size": 10}')
    out = subprocess.run([sys.executable, "-m", "engine.memory_plan", f"--model={tmp_path}"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "lacks the field 'num_attention_heads'" in out.stderr, out.stderr[-1000:]
