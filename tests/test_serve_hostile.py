"""The gRPC service against hostile clients: each test reproduces a finding of the hostile-client review.

Request-id hijack, the cross-tenant prefix-cache probe, event-loop stalls on
large inputs, uncancellable Score, malformed messages, oversized labels,
shutdown without a final message, /metrics without auth, and the smaller
items. Tiny random-weight model, servers in this process (`tests.servers`).
"""

import asyncio
import struct
import threading
import time
import urllib.error
import urllib.request

import grpc
import pytest

from engine import LLM, InvalidRequestError
from engine.serving.client import AsyncClient, Client, generate_request
from engine.serving.protos import generate_pb2 as pb
from engine.serving.server import ServingLimits, Tenants
from tests.servers import ServerThread, scheduled

TOKENS = {"token-a": "alice", "token-b": "bob"}
LIMITS = {"num_blocks": 64, "block_size": 16, "max_num_seqs": 8, "max_num_batched_tokens": 64}
# 65 prompt tokens: 4 full blocks of 16 come from the prefix cache on a hit (the last token is always computed).
SECRET = list(range(100, 165))


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny-llama", **LIMITS)


@pytest.fixture(scope="module")
def server(llm):
    s = ServerThread(llm, tenants=Tenants(TOKENS), limits=ServingLimits(max_score_inputs=512, max_score_tokens=100_000))
    yield s
    s.stop()


def _idle(server, timeout: float = 10) -> bool:
    usable = server.on_engine(lambda e: e.blocks.num_usable_blocks)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.on_engine(lambda e: (e.num_requests, e.blocks.num_free_blocks)) == (0, usable) and \
                server.server.worker.num_score_calls == 0:
            return True
        time.sleep(0.02)
    return False


async def _read_rest(call) -> list:
    """The messages of a streaming call after those taken with `read()` (the two APIs do not mix)."""
    out = []
    while (msg := await call.read()) is not grpc.aio.EOF:
        out.append(msg)
    return out


async def _warm_up(c: AsyncClient) -> None:
    """Compiles the shapes `_long_stream` uses, so that no compilation stalls the engine mid-test."""
    await c.generate(list(range(3, 13)), temperature=0, max_tokens=3, ignore_eos=True)


def _long_stream(c: AsyncClient, max_tokens: int = 180):
    request = generate_request(list(range(3, 13)), temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return c.stub.Generate(request, metadata=c.metadata)


def test_a_request_id_is_a_label_not_a_handle(server):
    """Finding 1: a second client reusing a live id and cancelling within ms aborted the first client's request."""
    async def scenario():
        async with AsyncClient(server.target, auth_token="token-a") as victim, \
                AsyncClient(server.target, auth_token="token-b") as attacker:
            request = generate_request(list(range(3, 13)), temperature=0, max_tokens=120, ignore_eos=True,
                                       request_id="victim-1")
            # The engine steps only while some request has fewer than 5 tokens: the victim (120) outlives the
            # probes' aborts however slowly this test runs.
            with server.steps_held(lambda e: all(len(r.output_token_ids) >= 5 for r in scheduled(e))):
                victim_call = victim.stub.Generate(request, metadata=victim.metadata)
                first = await victim_call.read()
                probes = []
                for _ in range(5):  # the same id, cancelled once it runs: must not touch the victim's request
                    probe = attacker.stub.Generate(request, metadata=attacker.metadata)
                    probes.append(await probe.read())  # it reached the engine and was stepped
                    probe.cancel()
                # Reusing a live id is not an error either (it would tell a stranger the id is live).
                other = await attacker.generate(list(range(3, 13)), temperature=0, max_tokens=5, ignore_eos=True,
                                                request_id="victim-1")
                # Every probe's abort applied: the victim alone is left, unfinished.
                deadline = time.monotonic() + 60
                while (n := server.on_engine(lambda e: e.num_requests)) > 1 and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)
                assert n == 1 and server.server.worker.num_streams == 1
            return [first, *await _read_rest(victim_call)], probes, other

    messages, probes, other = asyncio.run(scenario())
    assert messages[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert sum(len(m.token_ids) for m in messages) == 120
    assert {m.request_id for m in messages} == {"victim-1"}
    assert all(p.request_id == "victim-1" and p.token_ids for p in probes)
    assert other.request_id == "victim-1" and len(other.token_ids) == 5
    assert _idle(server)


def test_request_id_label_has_a_length_limit(server):
    with Client(server.target, auth_token="token-a") as c:
        with pytest.raises(grpc.RpcError) as e:
            c.generate("hi", max_tokens=2, request_id="x" * 257)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "request_id" in e.value.details()
        assert c.generate("hi", max_tokens=2, request_id="x" * 256).request_id == "x" * 256


def test_tenants_do_not_share_what_suffix_decoding_learned():
    """Finding 2's side channel in a proposer that learns from outputs: alice's repeated request is proposed her
    first answer (a fraction of the steps), bob's first request of the same prompt takes exactly the steps of a
    request nothing was learned for (every proposal verified, so steps depend on the proposals alone)."""
    llm = LLM("tiny-llama", speculative="suffix", **LIMITS)
    llm.engine.proposer.config.min_acceptance = 0.0
    s = ServerThread(llm, tenants=Tenants(TOKENS))
    try:
        prompt, kw = list(range(200, 230)), dict(temperature=0, max_tokens=24, ignore_eos=True)
        with Client(s.target, auth_token="token-a") as alice, Client(s.target, auth_token="token-b") as bob:
            first, again, other = (len(list(c.generate_stream(prompt, **kw))) for c in (alice, alice, bob))
        assert again * 2 <= first and other == first, (first, again, other)
        metrics = s.server.metrics
        metrics.record_engine_state(llm.engine)
        # Each request's prompt tail (8 tokens) and its 24 generated ones.
        assert metrics.registry.get_sample_value("engine_spec_suffix_cache_tokens") == 3 * (8 + 24)
    finally:
        s.stop()


def test_tenants_do_not_share_the_prefix_cache(server):
    """Finding 2: another tenant's prompt must give no cache hit (nor a faster first token); the same tenant's does."""
    kw = {"temperature": 0, "max_tokens": 2, "ignore_eos": True}
    with Client(server.target, auth_token="token-a") as alice, Client(server.target, auth_token="token-b") as bob:
        assert alice.generate(SECRET, **kw).usage.cached_prompt_tokens == 0
        assert bob.generate(SECRET, **kw).usage.cached_prompt_tokens == 0  # a guess from another tenant: no hit
        assert alice.generate(SECRET, **kw).usage.cached_prompt_tokens == 64
        assert bob.generate(SECRET, **kw).usage.cached_prompt_tokens == 64  # bob's own entry now
        # Inside a tenant, a cache salt separates further.
        assert alice.generate(SECRET, cache_salt="project-x", **kw).usage.cached_prompt_tokens == 0
        assert alice.generate(SECRET, cache_salt="project-x", **kw).usage.cached_prompt_tokens == 64


def test_a_large_tokenize_does_not_stall_other_streams(server):
    """Finding 3: a 3.9 MB Tokenize froze every stream for 2.5 s. Over the limit it is refused before any
    work; on a server whose limit admits it, it runs off the event loop: a whole stream is served while it runs."""
    text = "the quick brown fox " * (4_000_000 // 20)  # 4 MB
    roomy = ServerThread(LLM("tiny-llama", **LIMITS), limits=ServingLimits(max_request_bytes=8 << 20))
    tokenizer, beside = roomy.server.tokenizer, []

    def encode(s, real=tokenizer.encode):
        if len(s) == len(text):  # the large Tokenize: a stream from start to end before it returns
            with Client(roomy.target) as c:  # on the event loop, this would wait out its deadline
                beside.extend(c.generate_stream(list(range(3, 13)), temperature=0, max_tokens=24, ignore_eos=True,
                                                timeout=60))
        return real(s)

    async def scenario():
        async with AsyncClient(server.target, auth_token="token-a") as c:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await c.stub.Tokenize(pb.TokenizeRequest(text=text), metadata=c.metadata)
        async with AsyncClient(roomy.target) as c:
            ids = (await c.stub.Tokenize(pb.TokenizeRequest(text=text), metadata=c.metadata)).token_ids
            return refused.value, len(ids)

    tokenizer.encode = encode
    try:
        refused, n_ids = asyncio.run(scenario())
    finally:
        roomy.stop()
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT and "--max_request_bytes" in refused.details()
    assert n_ids == len(text)  # byte-level test tokenizer
    assert beside[-1].finish_reason == pb.FINISH_REASON_LENGTH and sum(len(m.token_ids) for m in beside) == 24


def test_a_huge_chat_is_refused_before_templating(server):
    tokenizer, templated = server.server.tokenizer, []

    def apply_chat_template(messages, *args, real=tokenizer.apply_chat_template, **kwargs):
        templated.append(len(messages))
        return real(messages, *args, **kwargs)

    tokenizer.apply_chat_template = apply_chat_template
    chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hi")] * 300_000)
    try:
        with Client(server.target, auth_token="token-a") as c:
            with pytest.raises(grpc.RpcError) as e:
                c.stub.Tokenize(pb.TokenizeRequest(chat=chat), metadata=c.metadata)
            assert templated == []
            c.stub.Tokenize(pb.TokenizeRequest(chat=pb.ChatMessages(messages=chat.messages[:2])), metadata=c.metadata)
    finally:
        del tokenizer.apply_chat_template
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "bytes" in e.value.details()
    assert templated == [2]  # what the counter sees of a chat that is templated


def test_a_cancelled_score_stops_and_does_not_hold_up_streams(server):
    """Finding 4: a Score went on after its deadline and held the engine thread (a stream got nothing for 87 s).
    Now the engine thread takes one chunk of it per turn, between the stream's steps, and drops it at the
    deadline."""
    inputs = [pb.ScoreInput(token_ids=pb.TokenIds(ids=[(7 * i + j) % 250 + 3 for j in range(250)]))
              for i in range(50)]  # 200 chunks of at most 64 tokens: 8 s at 40 ms a chunk (below), far past 1 s
    work = []  # what the engine thread ran, in order: "s" a step, "c" a chunk of Score

    def instrument(engine):
        engine.step = lambda real=engine.step: (work.append("s"), real())[1]
        engine.score_chunks = lambda jobs, real=engine.score_chunks: (work.append("c"), time.sleep(0.04),
                                                                      real(jobs))[2]

    async def scenario():
        async with AsyncClient(server.target, auth_token="token-a") as c:
            await _warm_up(c)
            await c.stub.Score(pb.ScoreRequest(inputs=inputs[:1]), metadata=c.metadata)  # compiles its chunk shapes
            server.on_engine(instrument)
            # After its first token the stream waits for the Score's first chunk: the two overlap.
            with server.steps_held(lambda e: "c" not in work and all(r.output_token_ids for r in scheduled(e))):
                call = _long_stream(c, max_tokens=200)
                first = await call.read()
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await c.stub.Score(pb.ScoreRequest(inputs=inputs), metadata=c.metadata, timeout=1.0)
            return e.value, [first, *await _read_rest(call)]

    try:
        error, messages = asyncio.run(scenario())
        assert _idle(server, timeout=60), "the cancelled Score still holds the engine"
    finally:
        server.on_engine(lambda engine: [engine.__dict__.pop(k, None) for k in ("step", "score_chunks")])
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert work.count("c") < 4 * len(inputs), "the Score ran to its end"
    assert messages[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert sum(len(m.token_ids) for m in messages) == 200
    live = "".join(work[:"".join(work).rindex("s")])  # while the stream ran
    assert "csc" in live and "cc" not in live, live  # one chunk per turn, a step between


def test_score_limits(server):
    with Client(server.target, auth_token="token-a") as c:
        with pytest.raises(grpc.RpcError) as e:
            c.score([[5, 6]] * 513)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "--max_score_inputs" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            c.score([list(range(3, 253))] * 450)  # 112,500 tokens over this server's 100,000
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "--max_score_tokens" in e.value.details()
        assert len(c.score([[5, 6, 7]] * 3)) == 3


def _raw_call(c: Client, method: str, payload: bytes):
    call = c.channel.unary_unary(f"/jaxspec.v1.Generation/{method}", request_serializer=lambda b: b,
                                 response_deserializer=lambda b: b)
    return call(payload, metadata=c.metadata, timeout=10)


def test_invalid_utf8_is_invalid_argument(server):
    """Finding 5: invalid UTF-8 in a string field gave UNKNOWN (and a server traceback)."""
    text_field = b"\x0a\x03a\xff\xfe"  # field 1 (text), 3 bytes, not UTF-8
    with Client(server.target, auth_token="token-a") as c:
        for method in ("Tokenize", "Score", "Generate"):
            payload = b"\x0a\x05" + text_field if method == "Score" else text_field  # Score: inputs[0].text
            if method == "Generate":
                stream = c.channel.unary_stream("/jaxspec.v1.Generation/Generate", request_serializer=lambda b: b,
                                                response_deserializer=lambda b: b)
                with pytest.raises(grpc.RpcError) as e:
                    list(stream(payload, metadata=c.metadata, timeout=10))
            else:
                with pytest.raises(grpc.RpcError) as e:
                    _raw_call(c, method, payload)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, e.value.details())
            assert "UTF-8" in e.value.details()


def test_model_info_checks_unknown_fields(server):
    with Client(server.target, auth_token="token-a") as c:
        with pytest.raises(grpc.RpcError) as e:
            _raw_call(c, "ModelInfo", b"\x08\x01")  # field 1 = 1: ModelInfoRequest has no fields
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "unknown fields #1" in e.value.details()
        assert c.model_info().vocab_size == 256


def test_metrics_are_the_operators_with_usage_per_tenant():
    """Issue 53: any tenant's token read /metrics, whose global counters gave away another tenant's prompt sizes
    and prefix-cache hits. Now a tenant's token gets 403, only the operator's scrape token reads the page, and
    the page counts each tenant's usage apart (requests, prompt, cached and completion tokens). Also: the
    block gauges are set before any step."""
    llm = LLM("tiny-llama", **LIMITS)  # a server of its own: no step has run on its engine
    s = ServerThread(llm, tenants=Tenants(TOKENS))
    http = s.server.metrics.serve(0, tenants=s.server.tenants, scrape_token="scrape-me")
    url = f"http://127.0.0.1:{http.server_port}/metrics"

    def page(token: str | None) -> str:
        headers = {} if token is None else {"Authorization": f"Bearer {token}"}
        return urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10).read().decode()

    try:
        for token, code in ((None, 401), ("nope", 401), ("token-a", 403), ("token-b", 403)):
            with pytest.raises(urllib.error.HTTPError) as e:
                page(token)
            assert e.value.code == code, token
        text = page("scrape-me")
        usable = llm.engine.blocks.num_usable_blocks
        assert f"engine_kv_blocks_total {float(usable)}" in text and "engine_steps_total 0.0" in text
        with Client(s.target, auth_token="token-a") as c:
            for _ in range(2):  # the second one hits alice's prefix cache: 4 blocks of 16
                c.generate(SECRET, max_tokens=3, ignore_eos=True, temperature=0)
        with Client(s.target, auth_token="token-b") as c:
            c.generate([5, 6, 7], max_tokens=2, ignore_eos=True)
        text = page("scrape-me")
        for line in ('engine_tenant_requests_total{tenant="alice"} 2.0',
                     f'engine_tenant_prompt_tokens_total{{tenant="alice"}} {2.0 * len(SECRET)}',
                     'engine_tenant_cached_prompt_tokens_total{tenant="alice"} 64.0',
                     'engine_tenant_completion_tokens_total{tenant="alice"} 6.0',
                     'engine_tenant_requests_total{tenant="bob"} 1.0',
                     'engine_tenant_prompt_tokens_total{tenant="bob"} 3.0',
                     'engine_tenant_cached_prompt_tokens_total{tenant="bob"} 0.0',
                     'engine_tenant_completion_tokens_total{tenant="bob"} 2.0'):
            assert line in text, line
    finally:
        http.shutdown()
        s.stop()


def test_shutdown_ends_streams_with_finish_reason_abort():
    """Finding 5: calls aborted by shutdown ended with UNAVAILABLE and never saw FINISH_REASON_ABORT."""
    llm = LLM("tiny-llama", **LIMITS)
    s = ServerThread(llm)

    async def scenario():
        async with AsyncClient(s.target) as c:
            call = _long_stream(c, max_tokens=240)
            first = await call.read()
            stopping = asyncio.wrap_future(asyncio.run_coroutine_threadsafe(s.server.stop(grace=0.1), s.loop))
            rest = await _read_rest(call)
            await stopping
            return [first, *rest]

    original_step = llm.engine.step
    llm.engine.step = lambda: (time.sleep(0.01), original_step())[1]  # outlast the grace period
    try:
        messages = asyncio.run(scenario())
    finally:
        del llm.engine.step
        s.loop.call_soon_threadsafe(s.loop.stop)
        s.thread.join(10)
    last = messages[-1]
    assert last.finish_reason == pb.FINISH_REASON_ABORT
    assert 0 < last.usage.completion_tokens == sum(len(m.token_ids) for m in messages) < 240
    assert llm.engine.num_requests == 0


def test_draining_is_visible_and_calls_in_flight_finish():
    """Issue 53: on shutdown the port closed at once, so a health check got "connection refused", never
    NOT_SERVING. Now, within the grace period: the port answers, health is NOT_SERVING, a new call gets
    UNAVAILABLE saying why, and the stream in flight runs to its last token."""
    llm = LLM("tiny-llama", **LIMITS)
    s = ServerThread(llm)
    seen, checked = {}, threading.Event()

    async def scenario():
        async with AsyncClient(s.target) as c:
            call = _long_stream(c, max_tokens=60)
            first = await call.read()
            stopping = asyncio.wrap_future(asyncio.run_coroutine_threadsafe(s.server.stop(grace=30), s.loop))
            for _ in range(1000):  # draining begins (health turned first) within 10 s
                if s.server._servicer.draining:
                    break
                await asyncio.sleep(0.01)
            with Client(s.target) as sync:
                seen["health"] = await asyncio.to_thread(sync.health)
                try:
                    await asyncio.to_thread(sync.generate, [5, 6, 7], max_tokens=2)
                except grpc.RpcError as e:
                    seen["new call"] = (e.code(), e.details())
            checked.set()
            rest = await _read_rest(call)
            await stopping
            return [first, *rest]

    def step(real=llm.engine.step):  # the stream in flight waits after its first token until the checks are done
        if any(r.output_token_ids for r in scheduled(llm.engine)):
            checked.wait(60)
        return real()

    llm.engine.step = step
    try:
        messages = asyncio.run(scenario())
    finally:
        checked.set()
        del llm.engine.step
        s.loop.call_soon_threadsafe(s.loop.stop)
        s.thread.join(10)
    assert seen["health"] == "NOT_SERVING"
    code, details = seen["new call"]
    assert code == grpc.StatusCode.UNAVAILABLE and "shutting down" in details
    assert messages[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert sum(len(m.token_ids) for m in messages) == 60


def test_llm_score_rejects_a_non_sequence(llm):
    with pytest.raises(InvalidRequestError, match="texts must be"):
        llm.score(5)


def test_tenant_file_format():
    t = Tenants.parse("# comment\nalice token-a\n\nbob   token-b\n")
    assert t.tenant_of([("authorization", "Bearer token-b")]) == "bob"
    assert t.tenant_of([("authorization", "Bearer token-c")]) is None
    assert Tenants.parse("lone-token\n").tenant_of([("authorization", "Bearer lone-token")]) == "default"
    for bad, words in [("a b c\n", "line 1"), ("a x\nb x\n", "line 2"), ("", "no auth tokens"),
                       ("bad/name tok\n", "tenant name")]:
        with pytest.raises(ValueError, match=words):
            Tenants.parse(bad)


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # a negative int32 or int64 goes on the wire as its 64-bit two's complement
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(number: int, payload: bytes | int) -> bytes:
    """One protobuf field: a varint, or a length-delimited payload."""
    if isinstance(payload, int):
        return _varint(number << 3) + _varint(payload)
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def test_integers_past_int32_are_refused_not_wrapped(server):
    """Issue 53: `token_ids` and `top_k` were int32 on the wire, so a varint of 2**40 + 5 arrived as 5 and
    was generated from. The bytes are built by hand, as an old or hostile client sends them."""
    prompt = _field(2, _field(1, b"".join(_varint(t) for t in (5, 6, 2**40 + 5))))  # TokenIds, packed
    stream = lambda c, payload: list(c.channel.unary_stream(
        "/jaxspec.v1.Generation/Generate", request_serializer=lambda b: b,
        response_deserializer=lambda b: b)(payload, metadata=c.metadata, timeout=10))
    ok = _field(2, _field(1, b"".join(_varint(t) for t in (5, 6, 7))))
    cases = [
        (prompt, "prompt token ids must be in [0, 256)"),
        (_field(2, _field(1, b"".join(_varint(t) for t in (5, -1)))), "prompt token ids must be in [0, 256)"),
        (ok + _field(4, _field(2, 2**33 + 1)), "top_k must be an integer in [0, 2**31)"),
        (ok + _field(4, _field(6, 2**32 + 3)), "max_tokens must be an integer in [1, 2**31)"),
        (ok + _field(4, _field(8, 2**40)), "stop_token_ids must be integers in [0, 2**31)"),
        (ok + _field(5, 2**40), "priority must be an integer in [-2**31, 2**31)"),
        # temperature (field 1, a double) = 1e308: finite as a double, inf as the float32 the device holds
        (ok + _field(4, b"\x09" + struct.pack("<d", 1e308)), "temperature must be 0 or a normal float32"),
    ]
    with Client(server.target, auth_token="token-a") as c:
        for payload, message in cases:
            with pytest.raises(grpc.RpcError) as e:
                stream(c, payload)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
            assert message in e.value.details(), (message, e.value.details())
        with pytest.raises(grpc.RpcError) as e:
            _raw_call(c, "Detokenize", _field(1, b"".join(_varint(t) for t in (5, 2**40 + 5))))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "[0, 256)" in e.value.details()
        assert len(stream(c, ok + _field(4, _field(6, 3)))) >= 1  # the same bytes with valid values generate


def test_stop_strings_have_limits_the_server_reports(server):
    """Issue 53: 60,000 stop strings (480 KB) were accepted and scanned per stop string per step on the engine
    thread, and a 900 KB stop string held back the whole stream. Both are refused at once, naming the limit;
    ModelInfo reports the limits (and speculation's: this server does not speculate)."""
    with Client(server.target, auth_token="token-a") as c:
        info = c.model_info()
        assert (info.max_stop_strings, info.max_stop_chars) == (16, 256)
        assert (info.num_speculative_tokens, info.num_tree_nodes) == (0, 0)
        added = []  # requests the scheduler took: a refused one never runs a step
        server.on_engine(lambda e: setattr(e.scheduler, "add", lambda r, real=e.scheduler.add: (added.append(r),
                                                                                             real(r))[1]))
        try:
            for stop, message in (([f"s{i:06d}" for i in range(60_000)], "at most max_stop_strings=16"),
                                  (["x" * 900_000], "at most max_stop_chars=256")):
                with pytest.raises(grpc.RpcError) as e:
                    c.generate([5, 6, 7], max_tokens=2, stop=stop)
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in e.value.details()
            assert added == []
            stops = [f"stop{i}" for i in range(16)]
            assert c.generate([5, 6, 7], max_tokens=2, stop=stops, ignore_eos=True).finish_reason is not None
            assert len(added) == 1  # the counter sees requests that run
        finally:
            server.on_engine(lambda e: e.scheduler.__dict__.pop("add"))


def test_a_score_call_is_checked_whole_before_any_input_is_scored(server, llm):
    """Issue 53: a Score whose inputs[1] had an out-of-range id was refused only after inputs[0] was scored.
    Now every input is checked first: nothing reaches the engine, over gRPC and offline."""
    scored = []

    def count_scores(engine):
        engine.score_chunks = lambda jobs, real=engine.score_chunks: scored.append(len(jobs)) or real(jobs)

    server.on_engine(count_scores)
    try:
        with Client(server.target, auth_token="token-a") as c:
            with pytest.raises(grpc.RpcError) as e:
                c.score([list(range(3, 200)), [5, 6, 999]])
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "inputs[1]: token ids must be in [0, 256)" in e.value.details()
            assert scored == []
            assert len(c.score([[5, 6, 7]])) == 1 and scored == [1]
    finally:
        server.on_engine(lambda engine: engine.__dict__.pop("score_chunks"))
    calls = []
    real = llm.engine.score
    llm.engine.score = lambda ids: calls.append(ids) or real(ids)
    try:
        with pytest.raises(InvalidRequestError, match="text 1: token ids must be in"):
            llm.score([[5, 6, 7], [5, 999]])
        assert calls == []
    finally:
        del llm.engine.score
