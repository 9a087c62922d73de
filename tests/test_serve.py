"""The gRPC service end to end on loopback, with tiny random-weight models.

Servers run in this process on their own event-loop thread (the engine on
its worker thread); clients are the project's own (`engine.serving.client`).
"""

import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request

import grpc
import numpy as np
import pytest
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from benchmarks.grpc_load import run_load
from checkpoints import LoadedModel, load_model
from engine import LLM, SamplingParams
from engine.serving.client import AsyncClient, Client, generate_request
from engine import Engine, EngineConfig
from engine.serving.protos import generate_pb2 as pb
from engine.serving.server import SERVICE_NAME, Tenants, TLSConfig
from tests.servers import ServerThread, scheduled

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKEN = "s3cret-token"
LIMITS = {"num_blocks": 64, "block_size": 16, "max_num_seqs": 8, "max_num_batched_tokens": 64}


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny-llama", **LIMITS)


@pytest.fixture(scope="module")
def server(llm):
    s = ServerThread(llm, tenants=Tenants({TOKEN: "tests"}))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    with Client(server.target, auth_token=TOKEN) as c:
        yield c


def _offline(server, llm, prompts, params):
    return server.on_engine(lambda _: llm.generate(prompts, params))


def _free_blocks(server):
    return server.on_engine(lambda e: e.blocks.num_free_blocks)


# ---- service basics ------------------------------------------------------------------------

def test_health_reflection_model_info(server, client, llm):
    assert client.health() == "SERVING" and client.health(SERVICE_NAME) == "SERVING"
    with grpc.insecure_channel(server.target) as channel:
        # Reflection needs the token too; only health checks are exempt.
        db = ProtoReflectionDescriptorDatabase(channel)
        with pytest.raises(grpc.RpcError) as e:
            db.get_services()
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with grpc.insecure_channel(server.target, options=()) as channel:
        intercepted = grpc.intercept_channel(channel, _AddToken())
        db = ProtoReflectionDescriptorDatabase(intercepted)
        assert {SERVICE_NAME, "grpc.health.v1.Health"} <= set(db.get_services())
        methods = {m.name for m in db.FindFileContainingSymbol(SERVICE_NAME).service[0].method}
        assert methods == {"Generate", "Score", "Tokenize", "Detokenize", "ModelInfo"}
    info = client.model_info()
    assert info.model_name == "tiny-llama" and info.max_model_len == 256 == llm.engine.max_model_len
    assert info.vocab_size == 256 and list(info.eos_token_ids) == [2] and list(info.speculation_kinds) == []
    assert info.max_logprobs == 20 and info.num_blocks == 64 and info.max_num_seqs == 8
    assert json.loads(info.config_json)["num_layers"] == 2


class _AddToken(grpc.UnaryUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    def _add(self, details):
        return details._replace(metadata=[("authorization", f"Bearer {TOKEN}")])

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._add(details), request)

    def intercept_stream_stream(self, continuation, details, requests):
        return continuation(self._add(details), requests)


def test_auth_token_is_required(server, client):
    for token in (None, "wrong", TOKEN + "x"):
        with Client(server.target, auth_token=token) as bad:
            with pytest.raises(grpc.RpcError) as e:
                bad.generate("hi", max_tokens=2)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "authorization: Bearer" in e.value.details()
            with pytest.raises(grpc.RpcError) as e:
                bad.tokenize("hi")
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert bad.health() == "SERVING"  # probes need no token
    assert len(client.generate("hi", max_tokens=2, ignore_eos=True).token_ids) == 2


def test_tokenize_detokenize_roundtrip(client, llm):
    text = "héllo 日本 🙂"
    ids = client.tokenize(text)
    assert ids == list(text.encode())  # the byte-level tokenizer: one token per UTF-8 byte
    assert client.detokenize(ids) == text
    chat = [{"role": "user", "content": "hi"}]
    assert client.tokenize(chat) == llm.encode(chat)
    assert client.detokenize([104, 2, 105]) == "hi" and client.detokenize([104, 2, 105], True) == "h\x02i"
    with pytest.raises(grpc.RpcError) as e:
        client.detokenize([300])
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "[0, 256)" in e.value.details()


def test_command_line_client_tokenizes_and_generates_what_the_engine_does(server, llm, tmp_path):
    """`python -m engine.query` against the server: token ids, and greedy text equal to offline generation;
    the old name `engine.client` runs the same with a deprecation message."""
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    base = ["--target", server.target, "--auth_token_file", str(token_file)]
    out = subprocess.run([sys.executable, "-m", "engine.query", *base, "--tokenize", "hi"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[104, 105]", out.stderr[-2000:]
    want = _offline(server, llm, ["abc"], SamplingParams(temperature=0, max_tokens=6))[0]
    out = subprocess.run([sys.executable, "-m", "engine.client", *base, "--prompt", "abc", "--temperature", "0",
                          "--max_tokens", "6"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "engine.client is deprecated: use python -m engine.query" in out.stderr
    assert out.stdout == want.text and f"completion_tokens={len(want.token_ids)}]" in out.stderr


def test_score_matches_offline(server, client, llm):
    ids = list(range(3, 90))
    results = client.score(["hello world", ids])
    expected = server.on_engine(lambda _: llm.score(["hello world", ids]))
    for got, want in zip(results, expected):
        assert list(got.token_ids) == want.token_ids
        np.testing.assert_allclose(got.token_logprobs, want.token_logprobs, rtol=1e-6)
        assert got.log_likelihood == pytest.approx(want.log_likelihood)
    assert len(results[1].token_logprobs) == len(ids) - 1 and results[1].log_likelihood < 0
    with pytest.raises(grpc.RpcError) as e:
        client.score(["ok", ""])
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "inputs[1]" in e.value.details()


# ---- generation ----------------------------------------------------------------------------

GEN_CASES = [  # prompt, sampling fields (proto names = SamplingParams names)
    ("Once upon a time", {"temperature": 0.8, "top_p": 0.9, "seed": 11, "max_tokens": 24, "ignore_eos": True}),
    (list(range(10, 50)), {"temperature": 0, "max_tokens": 17}),
    ([{"role": "user", "content": "Name a colour."}], {"temperature": 1.1, "top_k": 20, "min_p": 0.05, "seed": 3,
                                                           "max_tokens": 30, "ignore_eos": True}),
    ("stop me", {"temperature": 0.5, "seed": 5, "max_tokens": 40, "ignore_eos": True, "stop_token_ids": [101, 102, 103]}),
]


def test_outputs_equal_offline_for_same_seeds(server, llm):
    async def concurrent():
        async with AsyncClient(server.target, auth_token=TOKEN) as c:
            return await asyncio.gather(*(c.generate(p, **kw) for p, kw in GEN_CASES))

    got = asyncio.run(concurrent())
    want = _offline(server, llm, [p for p, _ in GEN_CASES], [SamplingParams(**kw) for _, kw in GEN_CASES])
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids and g.text == w.text and g.finish_reason == w.finish_reason
        assert g.usage.prompt_tokens == len(w.prompt_token_ids)
        assert g.usage.completion_tokens == len(w.token_ids)
        assert g.usage.cached_prompt_tokens == 0 and not g.usage.HasField("acceptance_rate")


def test_logprobs_stream_with_tokens(server, client, llm):
    kw = {"temperature": 0.7, "seed": 2, "max_tokens": 6, "ignore_eos": True, "logprobs": 3}
    messages = list(client.generate_stream([7, 8, 9], **kw))
    want = _offline(server, llm, [[7, 8, 9]], SamplingParams(**kw))[0]
    lps = [lp for m in messages for lp in m.logprobs]
    assert [lp.sampled.token_id for lp in lps] == want.token_ids
    for lp, entry in zip(lps, want.logprobs):
        assert lp.sampled.logprob == pytest.approx(entry[lp.sampled.token_id], abs=1e-6)
        assert [(t.token_id, pytest.approx(t.logprob, abs=1e-6)) for t in lp.top] == list(entry.items())[:3]
    assert all(not m.logprobs for m in client.generate_stream([7, 8, 9], max_tokens=3))


BAD_REQUESTS = [  # (request, words the message must contain)
    (pb.GenerateRequest(text=""), "prompt is empty"),
    (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[])), "prompt is empty"),
    (pb.GenerateRequest(), "prompt is required: set one of text, token_ids, chat"),
    (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5] * 256)), "context limit is 256"),
    (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 999])), "token ids must be in [0, 256)"),
    (pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(temperature=-0.5)), "temperature must be"),
    (pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(temperature=float("nan"))), "temperature must be"),
    (pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(top_p=0)), "top_p must be in (0, 1]"),
    (pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(top_p=1.5)), "top_p must be in (0, 1]"),
    (pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(max_tokens=0)), "max_tokens must be"),
    (pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(seed=2**32)), "seed must be"),
    (pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(logprobs=21)), "logprobs must be"),
    (pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(stop=[""])), "stop strings"),
    (pb.GenerateRequest(chat=pb.ChatMessages()), "chat has no messages"),
    (pb.GenerateRequest(text="hi", speculation=pb.Speculation(enabled=True, num_speculative_tokens=4)),
     "speculation is not available for this model"),
]


def _with_unknown_fields() -> bytes:
    sampling = pb.SamplingParams(max_tokens=3).SerializeToString() + b"\xa0\x06\x01"  # field 100 = 1
    field_16 = b"\x80\x01\x05"  # = 5
    return pb.GenerateRequest(text="hi").SerializeToString() + field_16 + b"\x22" + bytes([len(sampling)]) + sampling


def test_bad_requests_fail_clearly_while_a_good_one_completes(server, llm):
    greedy = {"temperature": 0, "max_tokens": 160, "ignore_eos": True}
    prompt = list(range(20, 60))

    async def scenario():
        async with AsyncClient(server.target, auth_token=TOKEN) as c:
            # No step once the good one has a token, until the bad ones are done: they run beside it.
            with server.steps_held(lambda e: all(r.output_token_ids for r in scheduled(e))):
                good = c.stub.Generate(generate_request(prompt, **greedy), metadata=c.metadata)
                messages = [await good.read()]
                errors = []
                for request, _ in BAD_REQUESTS:
                    errors.append(await _error_of(c.stub.Generate(request, metadata=c.metadata)))
                raw = c.channel.unary_stream("/jaxspec.v1.Generation/Generate", request_serializer=lambda b: b,
                                             response_deserializer=pb.GenerateResponse.FromString)
                errors.append(await _error_of(raw(_with_unknown_fields(), metadata=c.metadata)))
                assert server.on_engine(lambda e: e.num_requests) == 1  # the good one, in flight
            while (msg := await good.read()) is not grpc.aio.EOF:
                messages.append(msg)
            return messages, errors

    messages, errors = asyncio.run(scenario())
    expected = [words for _, words in BAD_REQUESTS] + ["unknown fields #16, sampling.#100"]
    assert len(errors) == len(expected)
    for (code, details), words in zip(errors, expected):
        assert code == grpc.StatusCode.INVALID_ARGUMENT, details
        assert words in details
    want = _offline(server, llm, [prompt], SamplingParams(**greedy))[0]
    assert [t for m in messages for t in m.token_ids] == want.token_ids
    assert messages[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert _free_blocks(server) == llm.engine.blocks.num_usable_blocks


async def _error_of(call) -> tuple[grpc.StatusCode, str]:
    try:
        async for _ in call:
            pass
    except grpc.aio.AioRpcError as e:
        return e.code(), e.details()
    raise AssertionError("the call succeeded")


@contextlib.contextmanager
def _slow_steps(llm, seconds: float):
    """Makes every engine step take at least `seconds`, so a long request is surely still running."""
    step = llm.engine.step

    def slow():
        time.sleep(seconds)
        return step()

    llm.engine.step = slow
    try:
        yield
    finally:
        del llm.engine.step


def _wait_until_idle(server, free: int, timeout: float = 10) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = server.on_engine(lambda e: (e.blocks.num_free_blocks, e.has_unfinished(), e.num_requests))
        if state == (free, False, 0):
            return True
        time.sleep(0.02)
    return False


def _aborts(server) -> float:
    return server.server.metrics.finished.labels("abort")._value.get()


def test_disconnect_cancel_and_deadline_free_the_blocks(server, client, llm):
    free = _free_blocks(server)
    long = {"temperature": 0, "max_tokens": 200, "ignore_eos": True}
    aborts = _aborts(server)
    with _slow_steps(llm, 0.01):
        # 1. cancel after the first message
        call = client.stub.Generate(generate_request(list(range(3, 43)), **long), metadata=client.metadata)
        first = next(call)
        assert len(first.token_ids) == 1 and first.finish_reason == pb.FINISH_REASON_UNSPECIFIED
        assert _free_blocks(server) < free  # the request holds blocks while it runs
        call.cancel()
        assert _wait_until_idle(server, free)
        # 2. the client goes away: its channel closes mid-stream
        gone = Client(server.target, auth_token=TOKEN)
        stream = gone.generate_stream(list(range(3, 43)), **long)
        next(stream)
        gone.close()
        assert _wait_until_idle(server, free)
        # 3. the deadline passes
        with pytest.raises(grpc.RpcError) as e:
            client.generate(list(range(3, 43)), timeout=0.5, **long)
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert _wait_until_idle(server, free)
    assert _aborts(server) == aborts + 3


def test_metrics_endpoint(server, client):
    rejected = server.server.metrics.rejected._value.get()
    for prompt, bad in (("x", {"temperature": -1}), ([5] * 256, {})):  # refused by the handler; by the engine
        with pytest.raises(grpc.RpcError):
            client.generate(prompt, **bad)
    client.generate("metrics", max_tokens=5, ignore_eos=True)
    http = server.server.metrics.serve(0)
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{http.server_port}/metrics", timeout=10).read().decode()
    finally:
        http.shutdown()
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
              if line and not line.startswith("#")}
    assert values["engine_time_to_first_token_seconds_count"] >= 1
    assert values["engine_inter_token_latency_seconds_count"] >= 4
    assert values["engine_generated_tokens_total"] >= 5
    assert values["engine_generation_tokens_per_second"] > 0
    assert values['engine_requests{state="running"}'] == 0 and values['engine_requests{state="waiting"}'] == 0
    assert values['engine_requests_finished_total{reason="length"}'] >= 1
    assert values["engine_kv_blocks_total"] == 63 and values["engine_kv_blocks_in_use"] == 0
    assert values["engine_compilations"] > 0 and values["engine_steps_total"] > 0
    cached, prompt = values["engine_cached_prompt_tokens_total"], values["engine_prompt_tokens_total"]
    assert values["engine_prefix_cache_hit_rate"] == pytest.approx(cached / prompt)
    assert values["engine_spec_acceptance_rate"] == 0 and values["engine_spec_draft_time_share"] == 0
    assert values["engine_requests_rejected_total"] == rejected + 2


def test_small_load_test(server):
    prompts = ["Tell me a story.", [{"role": "user", "content": "Hi!"}], list(range(30, 80))]
    r = asyncio.run(run_load(server.target, prompts, num_clients=6, duration_s=2.0, max_tokens=8,
                             auth_token=TOKEN))
    assert r.errors == 0 and r.lost == 0, r.error_messages
    assert r.completed >= 6 and r.tokens == 8 * r.completed
    assert len(r.ttft_s) == r.completed and len(r.itl_s) == 7 * r.completed
    assert r.tokens_per_s > 0 and max(r.ttft_s) < 30


# ---- multi-byte text -----------------------------------------------------------------------

CYCLE = "a日🙂é"  # UTF-8 bytes 61 | e6 97 a5 | f0 9f 99 82 | c3 a9: all distinct


def _cycle_llm() -> LLM:
    """tiny-llama rewired so the next token is a fixed function of the current one: after byte b
    comes the byte that follows b in CYCLE's UTF-8 (cyclically), at any temperature.

    Attention and MLP outputs are zeroed, so the final hidden state is the
    current token's normalised embedding; the LM head column of each successor
    is the predecessor's embedding direction, scaled to a margin of ~80 logits.
    """
    loaded = load_model("tiny-llama")
    params = dict(loaded.params)
    params["wo"] = np.zeros_like(params["wo"])
    params["w_down"] = np.zeros_like(params["w_down"])
    unit = params["embed"] / np.linalg.norm(params["embed"], axis=1, keepdims=True)
    head = np.zeros_like(params["lm_head"])
    seq = list(CYCLE.encode())
    for a, b in zip(seq, seq[1:] + seq[:1]):
        head[:, b] = 20 * unit[a]
    params["lm_head"] = head
    llm = LLM("tiny-llama", **LIMITS)
    llm.engine = Engine(LoadedModel(loaded.config, params, loaded.tokenizer), EngineConfig(**LIMITS))
    return llm


def _self_signed(tmp: str) -> tuple[bytes, bytes] | None:
    if shutil.which("openssl") is None:
        return None
    cert, key = os.path.join(tmp, "cert.pem"), os.path.join(tmp, "key.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1", "-keyout", key, "-out", cert],
                   check=True, capture_output=True)
    with open(cert, "rb") as c, open(key, "rb") as k:
        return c.read(), k.read()


@pytest.fixture(scope="module")
def cycle_server():
    """A TLS server (plaintext if openssl is missing) over the cycle model; yields (server, llm, CA cert)."""
    llm = _cycle_llm()
    with tempfile.TemporaryDirectory() as tmp:
        pem = _self_signed(tmp)
    s = ServerThread(llm, tls=TLSConfig(*pem) if pem else None)
    yield s, llm, pem[0] if pem else None
    s.stop()


def test_streamed_deltas_join_to_the_text_with_split_multibyte_characters(cycle_server):
    server, llm, ca = cycle_server
    cases = [{"temperature": t, "seed": 1, "max_tokens": n, "ignore_eos": True} for n in range(1, 25) for t in (0, 1.0)]
    cases += [{"temperature": 0, "max_tokens": 40, "stop": [s]} for s in ("🙂", "éa", "\U0001f642é", "日🙂éa日")]

    async def all_cases():
        async with AsyncClient(server.target, root_certificates=ca) as c:
            async def deltas(kw):
                return [m.text async for m in c.generate_stream("xa", **kw)]
            return await asyncio.gather(*(deltas(kw) for kw in cases))

    got = asyncio.run(all_cases())
    want = _offline(server, llm, ["xa"] * len(cases), [SamplingParams(**kw) for kw in cases])
    cycle = list((CYCLE[1:] + CYCLE[0]).encode())  # after "a": 日🙂éa日🙂éa...
    for kw, w in zip(cases, want):
        if kw.get("ignore_eos"):
            assert w.token_ids == (cycle * 3)[:kw["max_tokens"]]
    for kw, pieces, w in zip(cases, got, want):
        assert "".join(pieces) == w.text, kw
        for piece in pieces:
            assert "\ufffd" not in piece or "\ufffd" in w.text, (kw, pieces)
        if w.text.endswith("\ufffd"):  # cut inside a character: only the final flush shows it
            assert "\ufffd" not in "".join(pieces[:-1])
    assert want[cases.index({"temperature": 0, "seed": 1, "max_tokens": 5, "ignore_eos": True})].text == "日\ufffd"
    assert [w.text for w in want[-4:]] == ["日", "日🙂", "日", ""]


def test_tls_server_refuses_plaintext(cycle_server):
    server, _, ca = cycle_server
    if ca is None:
        pytest.skip("no openssl to make a certificate")
    with Client(server.target, root_certificates=ca) as c:
        assert c.detokenize(list("日".encode())) == "日"
    with Client(server.target) as plain:
        with pytest.raises(grpc.RpcError) as e:
            plain.model_info()
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE


def test_real_model_over_grpc_equals_offline_with_split_characters():
    """SmolLM2's byte-level BPE splits Japanese characters across tokens: the stream holds the
    partial bytes back (a message with tokens and no text) and still joins to the offline text."""
    llm = LLM(num_blocks=32, max_num_seqs=2, max_num_batched_tokens=64)
    s = ServerThread(llm)
    try:
        chat = [{"role": "user", "content": "Say hello in Japanese."}]
        cases = [{"temperature": 0, "max_tokens": 24}, {"temperature": 0.7, "seed": 4, "max_tokens": 24}]

        async def both():
            async with AsyncClient(s.target) as c:
                async def messages(kw):
                    return [m async for m in c.generate_stream(chat, **kw)]
                return await asyncio.gather(*(messages(kw) for kw in cases))

        got = asyncio.run(both())
        want = _offline(s, llm, [chat, chat], [SamplingParams(**kw) for kw in cases])
    finally:
        s.stop()
    held_back = 0
    for messages, w in zip(got, want):
        assert [t for m in messages for t in m.token_ids] == w.token_ids
        assert "".join(m.text for m in messages) == w.text
        # Only a character cut by max_tokens may show as U+FFFD, in the final flush.
        assert "\ufffd" not in w.text[:-1] and "\ufffd" not in "".join(m.text for m in messages[:-1])
        held_back += sum(1 for m in messages if m.token_ids and not m.text)
    assert any(ord(ch) > 0x3000 for ch in want[0].text), want[0].text  # CJK in the greedy answer
    assert held_back > 0


def test_generated_proto_code_is_up_to_date(tmp_path):
    protoc = pytest.importorskip("grpc_tools.protoc")
    proto = "engine/serving/protos/generate.proto"
    assert protoc.main(["protoc", f"-I{ROOT}", f"--python_out={tmp_path}", f"--pyi_out={tmp_path}",
                        f"--grpc_python_out={tmp_path}", os.path.join(ROOT, proto)]) == 0
    for name in ("generate_pb2.py", "generate_pb2.pyi", "generate_pb2_grpc.py"):
        with open(os.path.join(ROOT, "engine/serving/protos", name)) as committed, \
                open(tmp_path / "engine/serving/protos" / name) as fresh:
            assert committed.read() == fresh.read(), f"{name} is stale: regenerate it (BUILD.md)"


def test_speculative_server_reports_acceptance_and_matches_offline():
    from checkpoints import load_model

    tiny = load_model("tiny-llama")
    llm = LLM(tiny, speculative="draft", draft_model=tiny, num_speculative_tokens=3, **LIMITS)
    s = ServerThread(llm)
    try:
        with Client(s.target) as c:
            assert list(c.model_info().speculation_kinds) == ["draft"]
            prompt = list(range(40, 60))
            kw = dict(temperature=0.8, seed=5, max_tokens=12, ignore_eos=True)
            got, off, capped = (list(c.generate_stream(prompt, **extra, **kw)) for extra in (
                {}, {"speculation": False}, {"speculation": True, "num_speculative_tokens": 2}))
            want = _offline(s, llm, [prompt], SamplingParams(**kw))[0]
            # One message per step. The draft is the target, so every draft is accepted: a verify step gives G
            # tokens and the target's next; the first is the prefill's, the last is cut by max_tokens.
            assert [t for m in got for t in m.token_ids] == want.token_ids and got[-1].usage.acceptance_rate == 1.0
            assert [len(m.token_ids) for m in got] == [1, 4, 4, 3]  # the server's G = 3
            assert not off[-1].usage.HasField("acceptance_rate") and [len(m.token_ids) for m in off] == [1] * 12
            assert capped[-1].usage.acceptance_rate == 1.0 and [len(m.token_ids) for m in capped] == [1, 3, 3, 3, 2]
    finally:
        s.stop()


def test_ngram_server_lists_its_kind_and_matches_offline():
    llm = LLM("tiny-llama", speculative="ngram", num_speculative_tokens=3, **LIMITS)
    s = ServerThread(llm)
    try:
        with Client(s.target) as c:
            assert list(c.model_info().speculation_kinds) == ["ngram"]
            prompt = [40, 41, 42, 43] * 5  # repeats: the lookup proposes
            kw = dict(temperature=0, max_tokens=12, ignore_eos=True)
            got = c.generate(prompt, **kw)
            want = _offline(s, llm, [prompt], SamplingParams(**kw))[0]
            assert got.token_ids == want.token_ids and got.usage.HasField("acceptance_rate")
            # What the cost gate's regret account measured, per class, drafting and off (`/metrics`).
            metrics = s.server.metrics
            metrics.record_engine_state(llm.engine)
            rate = {arm: metrics.registry.get_sample_value("engine_spec_class_tokens_per_second",
                                                           {"request_class": "default", "proposer": arm})
                    for arm in ("ngram", "off")}
            assert rate["ngram"] > 0 and rate["off"] > 0, rate
            chosen = [metrics.registry.get_sample_value("engine_spec_class_proposer",
                                                        {"request_class": "default", "proposer": arm})
                      for arm in ("ngram", "off")]
            assert sorted(chosen) == [0.0, 1.0]
            with pytest.raises(grpc.RpcError) as e:
                c.generate(prompt, speculation=True, speculation_kind="draft", **kw)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "'draft' is not available" in e.value.details()
            with pytest.raises(grpc.RpcError) as e:
                c.generate(prompt, speculation=True, num_tree_nodes=2, **kw)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "verifies chains" in e.value.details()
    finally:
        s.stop()


def test_tree_server_takes_a_per_request_node_budget():
    """A server verifying 8-node n-gram trees: a request's `num_tree_nodes` caps its trees (the output is the
    target's either way), one over the server's tree is refused and the server keeps serving."""
    llm = LLM("tiny-llama", speculative="ngram", num_speculative_tokens=3, num_tree_nodes=8, **LIMITS)
    s = ServerThread(llm)
    try:
        with Client(s.target) as c:
            prompt = [40, 41, 42, 43, 40, 41, 44, 40, 41] * 3  # "40 41" is followed by 42 and 44: trees branch
            kw = dict(temperature=0, max_tokens=12, ignore_eos=True)
            want = _offline(s, llm, [prompt], SamplingParams(**kw))[0]
            for nodes in (1, 2, 8):
                got = c.generate(prompt, speculation=True, num_tree_nodes=nodes, **kw)
                assert got.token_ids == want.token_ids
            with pytest.raises(grpc.RpcError) as e:
                c.generate(prompt, speculation=True, num_tree_nodes=9, **kw)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "exceeds the engine's 8" in e.value.details()
            assert c.generate(prompt, **kw).token_ids == want.token_ids
    finally:
        s.stop()
