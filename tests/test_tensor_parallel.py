"""Tensor parallelism on CPU host devices: the sharded model and engine against one device.

Each check runs in a subprocess: the host device count is fixed when jax starts its CPU backend.
"""

import contextlib
import functools
import json
import math
import os
import socket
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec as P

from engine import LLM
from engine.memory_plan import memory_plan
from engine.step import KVPool, StepBatch, make_step
from model.config import get_preset
from model.llama import TP_AXIS, abstract_model, check_tensor_parallel
from pallas_kernels.ragged_paged_attention import ragged_paged_attention
from scheduler.request import SamplingParams
from tests.prompts import prompts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_on_devices(code: str, devices: int, timeout: int = 900, **values):
    """Runs `code` in a fresh interpreter with `devices` CPU devices and `values` as globals (by repr);
    returns the JSON it prints last."""
    prelude = f"import jax\njax.config.update('jax_num_cpu_devices', {devices})\n"
    prelude += "".join(f"{name} = {value!r}\n" for name, value in values.items())
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_logits_and_greedy_tokens_equal_one_device():
    # tiny-llama: 4 query heads over 2 KV heads, so tp 4 replicates each KV head on two devices; the Qwen2
    # variant (QKV bias, tied embeddings) has 8 over 2. Vocabulary 250 does not split over 4: padded.
    result = run_on_devices("""
        import json
        import jax, jax.numpy as jnp, numpy as np
        from flax import nnx
        from checkpoints import LoadedModel, load_model
        from engine import Engine, EngineConfig
        from engine.spec.config import SpeculationConfig
        from engine.step import tensor_parallel_mesh
        from model.llama import Llama
        from scheduler.request import SamplingParams
        from tests.test_speculative import _run

        out = {}
        configs = {"tiny-llama": load_model("tiny-llama").config.replace(vocab_size=250),
                   "tiny-qwen2": load_model("tiny-qwen2").config.replace(num_heads=8, head_dim=6)}
        rng = np.random.default_rng(0)
        for name, cfg in configs.items():
            base = Llama(cfg, rngs=nnx.Rngs(0))
            params = base.to_params()
            ids = jnp.asarray(rng.integers(0, cfg.vocab_size, (3, 9)), jnp.int32)
            dense = jax.jit(lambda m, x: m.dense_logits(x))
            ref = np.asarray(dense(base, ids))
            loaded = LoadedModel(cfg, params, load_model("tiny-llama").tokenizer)
            prompts = [rng.integers(3, 250, n).tolist() for n in (5, 23, 40, 2)]
            for tp in (1, 2, 4):
                sharded = Llama(cfg, params=params, mesh=tensor_parallel_mesh(tp))
                out[f"{name} tp{tp} logits"] = float(np.abs(np.asarray(dense(sharded, ids)) - ref).max())
                if tp == 2:
                    continue  # logits only; engines at the widest split (KV heads replicated)
                # draft speculation with the target split 4 ways, drafting every step (no cost gate, whose
                # timings decide whether a draft as slow as the target pays); EAGLE: in the real model's test.
                # n-gram's program runs the same sharded target pass (`_target_verify`) on proposals from the
                # host. XLA's dot on one device too: the sharded programs use it (the native kernels take whole
                # weights), and AMX's three bf16 passes round differently.
                for spec in [None] + (["draft"] if tp == 4 else []):
                    config = EngineConfig(tensor_parallel_size=tp, num_blocks=64, max_num_batched_tokens=32,
                                          max_num_seqs=4, matmul="xla")
                    engine = Engine(loaded, config, draft=loaded if spec else None,
                                    speculation=SpeculationConfig(4, min_acceptance=0.0, method=spec) if spec else None)
                    outs = _run(engine, prompts, [SamplingParams(max_tokens=10, temperature=0.0)] * len(prompts))
                    out[f"{name} tp{tp} {spec} tokens"] = [o.token_ids for o in outs]
                    out[f"{name} tp{tp} {spec} accepted"] = sum(o.num_accepted_tokens for o in outs)
        print(json.dumps(out))
    """, devices=4)
    for name in ("tiny-llama", "tiny-qwen2"):
        for tp in (2, 4):
            assert result[f"{name} tp{tp} logits"] < 1e-5, (name, tp)
        for key in (f"{name} tp4 None tokens", f"{name} tp4 draft tokens"):
            assert result[key] == result[f"{name} tp1 None tokens"], key
        assert result[f"{name} tp4 draft accepted"] > 0, result
        assert all(len(t) == 10 for t in result[f"{name} tp1 None tokens"])


def test_mixture_of_experts_on_two_devices_equals_one():
    """A Mixtral-style model (4 experts, 2 per token, a sliding window, Gemma's fields off) split over 2 devices
    (per-expert tensor parallelism: every expert's F split in two) gives the logits and the greedy tokens of one
    device, through the paged engine with n-gram speculation."""
    result = run_on_devices("""
        import json
        import jax, jax.numpy as jnp, numpy as np
        from flax import nnx
        from checkpoints import LoadedModel, load_model
        from engine import Engine, EngineConfig
        from engine.spec.config import SpeculationConfig
        from engine.step import tensor_parallel_mesh
        from model.llama import Llama
        from scheduler.request import SamplingParams
        from tests.test_speculative import _run

        tiny = load_model("tiny-llama")
        cfg = tiny.config.replace(num_experts=4, num_experts_per_tok=2, layer_windows=(6, 6))
        base = Llama(cfg, rngs=nnx.Rngs(0))
        params = base.to_params()
        rng = np.random.default_rng(0)
        ids = jnp.asarray(rng.integers(0, cfg.vocab_size, (3, 9)), jnp.int32)
        dense = jax.jit(lambda m, x: m.dense_logits(x))
        sharded = Llama(cfg, params=params, mesh=tensor_parallel_mesh(2))
        out = {"logits": float(np.abs(np.asarray(dense(sharded, ids)) - np.asarray(dense(base, ids))).max())}
        prompts = [rng.integers(3, 250, n).tolist() for n in (5, 23, 40)]
        for tp in (1, 2):
            config = EngineConfig(tensor_parallel_size=tp, num_blocks=64, max_num_batched_tokens=32, max_num_seqs=4,
                                  matmul="xla")
            engine = Engine(LoadedModel(cfg, params, tiny.tokenizer), config,
                            speculation=SpeculationConfig(4, method="ngram"))
            outs = _run(engine, prompts, [SamplingParams(max_tokens=12, temperature=0.0)] * len(prompts))
            out[f"tp{tp}"] = [o.token_ids for o in outs]
        print(json.dumps(out))
    """, devices=2)
    assert result["logits"] < 1e-5, result
    assert result["tp2"] == result["tp1"] and all(len(t) == 12 for t in result["tp1"])


def test_sharded_pool_and_weights_hold_the_planned_bytes_and_compile_once():
    result = run_on_devices("""
        import json
        import jax, numpy as np
        from flax import nnx
        from engine import LLM
        from engine.memory_plan import memory_plan
        from model.llama import Llama
        from scheduler.request import SamplingParams

        llm = LLM("tiny-llama", speculative=None, tensor_parallel_size=4, num_blocks=32, block_size=16,
                  max_num_seqs=4, max_num_batched_tokens=32)
        eng = llm.engine
        runner = eng.runner
        model = Llama(eng.model_config, rngs=nnx.Rngs(0), mesh=runner.mesh)
        weights = [0] * 4
        for x in jax.tree.leaves(nnx.state(model)):
            for s in x.addressable_shards:
                weights[s.device.id] += s.data.nbytes
        pool = runner.pools[0]
        kv = [0] * 4
        for x in (pool.k, pool.v):
            for s in x.addressable_shards:
                kv[s.device.id] += s.data.nbytes
        eng.precompile()
        llm.generate(["warm"], SamplingParams(temperature=0.5, max_tokens=2))
        before = eng.compilation_count()
        rng = np.random.default_rng(0)
        prompts = [rng.integers(3, 256, n).tolist() for n in (3, 9, 31, 45)]
        params = [SamplingParams(temperature=t, max_tokens=m, seed=s) for t, m, s in
                  [(0, 5, None), (0.7, 9, 1), (1.2, 3, 2), (0, 12, None)]]
        llm.generate(prompts, params)
        plan = memory_plan(llm.engine.model_config, 4, block_size=16)
        print(json.dumps({"weights": weights, "planned_weights": plan.weight_bytes, "kv": kv,
                          "planned_kv": 32 * 16 * plan.kv_bytes_per_token, "pool_heads": pool.k.shape[3],
                          "compiled": eng.compilation_count() - before}))
    """, devices=4)
    assert result["weights"] == [result["planned_weights"]] * 4
    assert result["kv"] == [result["planned_kv"]] * 4
    assert result["pool_heads"] == 4  # 2 KV heads, each on two of the 4 devices
    assert result["compiled"] == 0


def test_splits_that_do_not_divide_are_refused():
    with pytest.raises(ValueError, match="multiples of tensor_parallel_size 2"):
        check_tensor_parallel(get_preset("smollm2-135m"), 2)  # 9 query heads
    with pytest.raises(ValueError, match="multiple of the 2 KV heads"):
        check_tensor_parallel(get_preset("tiny-llama").replace(num_heads=6, intermediate_size=96), 3)
    with pytest.raises(ValueError, match="partial output head"):
        check_tensor_parallel(get_preset("tiny-llama").replace(head_vocab_size=64), 2)
    result = run_on_devices("""
        import json
        from engine import LLM
        try:
            LLM("tiny-llama", speculative=None, tensor_parallel_size=4, num_blocks=8)
        except ValueError as e:
            print(json.dumps(str(e)))
    """, devices=2)
    assert "tensor_parallel_size 4 needs 4 devices; 2 visible" in result


def _chat_prompts(n: int) -> list[str]:
    return prompts("chat")[:n]


def test_real_model_greedy_output_equal_over_three_devices():
    # SmolLM2-135M: 9 query heads and 3 KV heads, so 3 devices (3 query heads and 1 KV head each).
    result = run_on_devices("""
        import json
        from checkpoints import load_model
        from checkpoints.draft import DEFAULT_EAGLE, load_draft
        from engine import LLM
        from scheduler.request import SamplingParams

        loaded = load_model("smollm2-135m-instruct")
        eagle = load_draft(DEFAULT_EAGLE, loaded)
        prompts = [[{"role": "user", "content": p}] for p in PROMPTS]
        out = {}
        # exact speculation: greedy output with a proposer (drafting every step) equals the target alone's
        for spec, tp in ((None, 1), (None, 3), ("eagle", 3)):
            llm = LLM(loaded, speculative=spec, draft_model=eagle if spec == "eagle" else None,
                      tensor_parallel_size=tp, max_num_seqs=8, num_blocks=256)
            if spec:
                llm.engine.proposer.config.min_acceptance = 0.0
            outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
            out[f"{spec} {tp}"] = [o.token_ids for o in outs]
            out[f"{spec} {tp} accepted"] = sum(o.num_accepted_tokens for o in outs)
        print(json.dumps(out))
    """, devices=3, PROMPTS=_chat_prompts(10))
    for spec in ("None", "eagle"):
        assert result[f"{spec} 3"] == result["None 1"], spec
    assert result["eagle 3 accepted"] > 0
    assert len(result["None 1"]) == 10 and all(len(t) == 16 for t in result["None 1"])


def test_two_processes_with_two_devices_each_match_one_process():
    # jax.distributed over loopback, gloo collectives: every process runs the same scheduler on the same
    # prompts (engine/distributed.py); a process given other prompts is caught before any step runs.
    code = textwrap.dedent("""
        import json, sys
        from engine.distributed import initialize
        initialize(f"127.0.0.1:{PORT}", 2, PID, local_cpu_devices=2)
        from checkpoints import load_model
        from engine import LLM
        from scheduler.request import SamplingParams
        loaded = load_model("tiny-llama")
        out = {}
        for spec in (None, "draft"):
            llm = LLM(loaded, speculative=spec, draft_model=loaded if spec else None, tensor_parallel_size=4,
                      num_blocks=64, max_num_batched_tokens=32, max_num_seqs=4)
            out[str(spec)] = [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=10, temperature=0))]
        # unseeded: the processes must draw the same seeds, or the batch check stops the step
        out["sampled"] = [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=4, temperature=1))]
        try:
            llm.generate([PROMPTS[0] + [PID + 3]], SamplingParams(max_tokens=2))
        except RuntimeError as e:
            out["mismatch"] = str(e)
        print(json.dumps(out), flush=True)
    """)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 250, n).tolist() for n in (5, 23, 40, 2)]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    results = []
    with _held_port() as port:
        procs = [subprocess.Popen([sys.executable, "-c", f"PID = {i}\nPORT = {port}\nPROMPTS = {prompts!r}\n" + code],
                                  cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for i in range(2)]
        for p in procs:
            stdout, stderr = p.communicate(timeout=900)
            assert p.returncode == 0, stderr[-3000:]
            results.append(json.loads(stdout.strip().splitlines()[-1]))
    llm = LLM("tiny-llama", speculative=None, num_blocks=64, max_num_batched_tokens=32, max_num_seqs=4)
    want = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0))]
    for r in results:
        assert r["None"] == want and r["draft"] == want
        assert r["sampled"] == results[0]["sampled"]
        assert "packed different batches" in r["mismatch"]


def test_llama_3_70b_step_over_8_devices_lowers_for_cuda_and_holds_the_planned_bytes():
    # An abstract mesh: nothing is allocated, and the step lowers for GPUs this host does not have.
    cfg = get_preset("llama-3-70b")
    mesh = AbstractMesh((8,), (TP_AXIS,))
    graphdef, state = abstract_model(cfg, mesh)
    per_device = sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(state))
    assert per_device == memory_plan(cfg, 8).weight_bytes
    T, S, num_blocks, width = 64, 8, 256, 32
    pool_shape = (cfg.num_layers, num_blocks, 16, 8, cfg.head_dim)  # 8 KV heads, one per device
    kv = jax.ShapeDtypeStruct(pool_shape, jnp.bfloat16, sharding=NamedSharding(mesh, P(None, None, None, TP_AXIS)))
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
    batch = StepBatch(i32(T), i32(T), i32(T), i32(S + 1), i32(S), i32(S, width), i32(S), f32(S), i32(S), f32(S), f32(S),
                      jax.ShapeDtypeStruct((S,), jnp.uint32), jax.ShapeDtypeStruct((S,), jnp.bool_))
    step = make_step(graphdef, functools.partial(ragged_paged_attention, backend="cuda"))
    text = step.trace(state, KVPool(kv, kv), batch).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("stablehlo.custom_call @__gpu$xla.gpu.triton") == cfg.num_layers  # the Pallas kernel
    assert text.count('"stablehlo.all_reduce"') == 2 * cfg.num_layers + 1  # o, down; the vocabulary-split embedding
    assert text.count("stablehlo.all_gather") == 1  # the logits
    E, D = cfg.hidden_size, cfg.head_dim
    assert f"tensor<{E}x{(cfg.num_heads // 8 + 2) * D}xbf16>" in text  # one device's QKV: 8 query heads, 1 KV head
    assert f"tensor<{cfg.num_layers}x{num_blocks}x16x1x{D}xbf16>" in text  # one device's share of the pool


@contextlib.contextmanager
def _held_port():
    """A loopback port for a coordinator that a subprocess starts, held from choice to use: bound here with
    SO_REUSEPORT (as gRPC's servers, jax's coordinator among them, bind theirs) and never listening, until the
    block ends. Nothing else can take it in between, as with a port found free and closed before the use."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


@contextlib.contextmanager
def _two_processes(args: list[str], own: tuple[list[str], list[str]] = ([], [])):
    """`python -m <args> <own[i]>` as process i of two (loopback coordinator on a held port), 2 CPU devices
    each; those still running when the block ends are killed."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    with _held_port() as port:
        procs = [subprocess.Popen([sys.executable, "-m", *args, *own[i], "--tensor_parallel_size=4",
                                   "--num_processes=2", f"--process_id={i}", f"--coordinator_address=127.0.0.1:{port}"],
                                  cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for i in range(2)]
        try:
            yield procs
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()


def _first_line(proc: subprocess.Popen, prefix: str) -> str:
    """The first stdout line of `proc` starting with `prefix` (gloo prints its own lines), or '' at exit."""
    for line in proc.stdout:
        if line.startswith(prefix):
            return line
    return ""


TINY_FLAGS = ["--model=tiny-llama", "--speculative=off", "--num_blocks=64", "--max_num_seqs=4",
              "--max_num_batched_tokens=32"]


def test_grpc_server_over_two_processes_serves_from_process_0():
    # Process 0 serves; process 1 applies the requests it broadcasts (adds, an abort, a Score call) and steps with
    # it. Outputs equal one process's; an idle pause longer than the heartbeat is survived; SIGTERM ends both.
    import concurrent.futures
    import signal
    import time

    from engine.distributed import HEARTBEAT_S
    from engine.serving.client import Client

    with _two_processes(["engine.serve", *TINY_FLAGS, "--port=0", "--metrics_port=-1", "--noprecompile",
                         "--grace_s=1"]) as procs:
        line, follower = _first_line(procs[0], "serving "), _first_line(procs[1], "following ")
        assert line.startswith("serving tiny-llama on 127.0.0.1:"), line
        assert follower == "following process 0 (process 1 of 2)\n", follower
        target = line.split(" on ")[1].strip()
        rng = np.random.default_rng(1)
        prompts = [rng.integers(3, 250, n).tolist() for n in (5, 23, 40, 2, 17)]
        greedy = dict(max_tokens=10, temperature=0, ignore_eos=True)
        seeded = dict(max_tokens=8, temperature=0.9, seed=7, ignore_eos=True)
        with Client(target) as c, concurrent.futures.ThreadPoolExecutor(8) as pool:
            aborted = c.generate_stream(prompts[4], max_tokens=200, ignore_eos=True)
            next(aborted)
            got = list(pool.map(lambda p: c.generate(p, **greedy).token_ids, prompts))
            aborted.cancel()
            sampled = pool.submit(lambda: c.generate(prompts[1], **seeded).token_ids)
            scores = c.score([prompts[2], prompts[0]])
            sampled = sampled.result()
            time.sleep(HEARTBEAT_S + 1)  # idle: process 0 broadcasts empty turns
            again = c.generate(prompts[3], **greedy).token_ids
        llm = LLM("tiny-llama", speculative=None, num_blocks=64, max_num_seqs=4, max_num_batched_tokens=32)
        assert got == [o.token_ids for o in llm.generate(prompts, SamplingParams(**greedy))]
        assert again == got[3]
        assert sampled == llm.generate([prompts[1]], SamplingParams(**seeded))[0].token_ids
        for result, want in zip(scores, llm.score([prompts[2], prompts[0]])):
            np.testing.assert_allclose(list(result.token_logprobs), want.token_logprobs, atol=1e-5)
        procs[0].send_signal(signal.SIGTERM)
        for p in procs:
            assert p.wait(timeout=60) == 0, p.stderr.read()[-3000:]


def test_batch_job_over_two_processes_writes_what_one_process_writes(tmp_path):
    # Process 0 reads the file (process 1 is given a path that does not exist) and broadcasts each turn's
    # admitted lines; the output, bad lines' error records included, equals a one-process run's.
    from tests.test_batch import _generate_lines

    lines = _generate_lines(40)
    src = tmp_path / "in.jsonl"
    src.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    flags = [*TINY_FLAGS, "--max_num_batched_tokens=128", "--num_blocks=256", "--max_model_len=256"]
    with _two_processes(["engine.batch", *flags, f"--output={tmp_path / 'two.jsonl'}", "--max_inflight=16"],
                        own=([f"--input={src}"], [f"--input={tmp_path / 'not-here.jsonl'}"])) as procs:
        outs = [p.communicate(timeout=900) for p in procs]
    assert [p.returncode for p in procs] == [1, 1], outs[0][1][-3000:] + outs[1][1][-3000:]  # some lines failed
    one = subprocess.run([sys.executable, "-m", "engine.batch", *flags, f"--input={src}",
                          f"--output={tmp_path / 'one.jsonl'}", "--max_inflight=16"],
                         cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert one.returncode == 1, one.stderr[-3000:]

    def records(name):
        out = [json.loads(line) for line in (tmp_path / name).read_text().splitlines()]
        for r in out:
            ((r.get("response") or {}).get("body") or {}).pop("created", None)
        return out
    assert records("two.jsonl") == records("one.jsonl")
    assert len(records("two.jsonl")) == 61 and sum(1 for r in records("two.jsonl") if r.get("error")) == 21
    assert "followed process 0: lines ok 40, failed 21" in outs[1][1]
