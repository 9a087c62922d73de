"""The OpenAI-compatible HTTP API end to end on loopback, through the real `openai` client, with a tiny
random-weight model: outputs equal `LLM.generate`'s, errors name their field, a dropped stream frees its
blocks. The server runs in this process on its own event-loop thread (`tests.servers.ServerThread`)."""

import glob
import json
import os
import shutil
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request

import openai
import pytest

from engine import LLM, SamplingParams
from engine.serving.server import Tenants
from tests.servers import ServerThread

TOKEN = "http-s3cret"
SCRAPE = "operator-token"
LIMITS = {"num_blocks": 64, "block_size": 16, "max_num_seqs": 8, "max_num_batched_tokens": 64}


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny-llama", **LIMITS)


@pytest.fixture(scope="module")
def server(llm):
    s = ServerThread(llm, http=True, scrape_token=SCRAPE, tenants=Tenants({TOKEN: "tests"}))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=TOKEN, max_retries=0, timeout=60)


def _offline(server, llm, prompts, params):
    return server.on_engine(lambda _: llm.generate(prompts, params))


def _free_blocks(server):
    return server.on_engine(lambda e: e.blocks.num_free_blocks)


def _get(server, path, token=TOKEN):
    request = urllib.request.Request(server.base_url + path, headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_completion_greedy_equals_offline_streamed_or_not(server, client, llm):
    want = _offline(server, llm, ["hello"], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    got = client.completions.create(model="tiny-llama", prompt="hello", max_tokens=12, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert got.choices[0].text == want.text and got.choices[0].finish_reason == "length"
    assert got.usage.prompt_tokens == len(want.prompt_token_ids) and got.usage.completion_tokens == 12
    assert got.usage.total_tokens == got.usage.prompt_tokens + 12
    chunks = list(client.completions.create(model="tiny-llama", prompt="hello", max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    # A token-id prompt is taken as given.
    ids = client.completions.create(model="tiny-llama", prompt=want.prompt_token_ids, max_tokens=12, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert ids.choices[0].text == want.text


def test_chat_greedy_equals_offline_streamed_or_not(server, client, llm):
    messages = [{"role": "user", "content": "hi there"}]
    want = _offline(server, llm, [messages], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0]
    got = client.chat.completions.create(model="tiny-llama", messages=messages, max_completion_tokens=10,
                                         temperature=0, extra_body={"ignore_eos": True})
    assert got.choices[0].message.role == "assistant" and got.choices[0].message.content == want.text
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)
    stream = client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=10, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_n_samples_with_a_seed_are_the_offline_samples(server, client, llm):
    """n = 2 with seed 7: the choices are what seeds 7 and 8 give offline (how `LLM.generate` samples n)."""
    params = dict(temperature=1.0, max_tokens=8, ignore_eos=True)
    want = [_offline(server, llm, ["abc"], SamplingParams(seed=s, **params))[0].text for s in (7, 8)]
    got = client.completions.create(model="tiny-llama", prompt="abc", n=2, seed=7, max_tokens=8, temperature=1.0,
                                    extra_body={"ignore_eos": True})
    assert [c.text for c in sorted(got.choices, key=lambda c: c.index)] == want and want[0] != want[1]
    assert got.usage.completion_tokens == 16 and got.usage.prompt_tokens == 3


def test_logprobs_equal_offline(server, client, llm):
    want = _offline(server, llm, ["xyz"], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True,
                                                         logprobs=2))[0]
    got = client.completions.create(model="tiny-llama", prompt="xyz", max_tokens=5, temperature=0, logprobs=2,
                                    extra_body={"ignore_eos": True}).choices[0].logprobs
    assert got.token_logprobs == pytest.approx([e[t] for t, e in zip(want.token_ids, want.logprobs)], abs=1e-6)
    assert all(len(top) == 2 for top in got.top_logprobs)
    assert "".join(got.tokens) == want.text and got.text_offset[0] == 0
    chat = client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "xyz"}],
                                          max_tokens=3, temperature=0, logprobs=True, top_logprobs=3,
                                          extra_body={"ignore_eos": True}).choices[0].logprobs.content
    assert len(chat) == 3 and all(len(t.top_logprobs) == 3 for t in chat)
    assert all(t.logprob == pytest.approx(t.top_logprobs[0].logprob) for t in chat)  # greedy: the top token


def test_stop_string_ends_the_text_before_it(server, client, llm):
    full = _offline(server, llm, ["stop"], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0].text
    stop = full[5:7]
    got = client.completions.create(model="tiny-llama", prompt="stop", max_tokens=16, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True}).choices[0]
    assert got.finish_reason == "stop" and got.text == full[:full.index(stop)]


@pytest.mark.parametrize("body, param, message", [
    ({"temperature": -1}, "temperature", "temperature"),
    ({"top_p": 0}, "top_p", "top_p"),
    ({"max_tokens": "many"}, "max_tokens", "max_tokens"),
    ({"frequency_penalty": 0.5}, "frequency_penalty", "not supported"),
    ({"logprobs": 99}, "logprobs", "logprobs must be in [0, 20]"),
    ({"temprature": 0.5}, "temprature", "unknown field temprature"),
    ({"num_speculative_tokens": 4}, None, "speculation is not available"),
])
def test_a_bad_field_is_a_400_naming_it_and_the_server_serves_on(server, client, body, param, message):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny-llama", prompt="hi", max_tokens=2, extra_body=body)
    assert e.value.status_code == 400 and message in e.value.body["message"] and e.value.body["param"] == param
    assert client.completions.create(model="tiny-llama", prompt="hi", max_tokens=2).choices[0].finish_reason


def test_empty_prompt_messages_and_oversized_body_are_refused(server, client):
    with pytest.raises(openai.BadRequestError, match="prompt is empty"):
        client.completions.create(model="tiny-llama", prompt="", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="messages is empty"):
        client.chat.completions.create(model="tiny-llama", messages=[], max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="max_request_bytes"):
        client.completions.create(model="tiny-llama", prompt="x" * (2 << 20), max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="context limit"):
        client.completions.create(model="tiny-llama", prompt=list(range(5)) * 400, max_tokens=2)


def test_auth_models_health_and_metrics(server, client):
    bad = openai.OpenAI(base_url=server.base_url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model="tiny-llama", prompt="hi", max_tokens=2)
    assert [m.id for m in client.models.list().data] == ["tiny-llama"]
    status, text = _get(server, "/health", token="")
    assert status == 200 and json.loads(text) == {"status": "ok"}
    assert _get(server, "/metrics")[0] == 403  # a tenant's token: the page counts every tenant's traffic
    status, text = _get(server, "/metrics", token=SCRAPE)
    assert status == 200 and "engine_requests_finished_total" in text


def test_a_dropped_stream_frees_its_blocks(server, client):
    idle = _free_blocks(server)
    stream = client.completions.create(model="tiny-llama", prompt="go on", max_tokens=400, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    for _, _ in zip(stream, range(3)):
        pass
    assert _free_blocks(server) < idle  # the request holds KV blocks while it runs
    stream.close()
    deadline = time.monotonic() + 10
    while _free_blocks(server) != idle and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _free_blocks(server) == idle


def test_while_warming_up_every_call_is_a_503_with_retry_after():
    import asyncio
    import threading

    from engine.serving.metrics import Metrics
    from engine.serving.openai_api import HttpServer
    from engine.serving.server import GenerationServer

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    run = lambda coro: asyncio.run_coroutine_threadsafe(coro, loop).result(30)  # noqa: E731
    grpc_server = GenerationServer(None, None, model_name="tiny-llama", metrics=Metrics())
    run(grpc_server.start())
    http = HttpServer(grpc_server)
    base = f"http://127.0.0.1:{run(http.start())}"
    try:
        for path, data in (("/health", None), ("/v1/completions", b'{"prompt": "hi"}')):
            request = urllib.request.Request(base + path, data=data, headers={"Content-Type": "application/json"})
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(request, timeout=30)
            assert e.value.code == 503 and int(e.value.headers["Retry-After"]) >= 1
            assert "warming up" in json.loads(e.value.read())["error"]["message"]
    finally:
        run(http.stop())
        run(grpc_server.stop(grace=0))
        loop.call_soon_threadsafe(loop.stop)


def test_echo_returns_the_prompt_logprobs_of_llm_score(server, client, llm):
    """`echo` with `logprobs`: the prompt's token log-probabilities are `LLM.score`'s; each position's
    `top_logprobs` holds its argmax, so the token is the top exactly where `LLM.score` says it is greedy."""
    greedy_run = _offline(server, llm, [[104, 105]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    ids = [104, 105, *greedy_run[0].token_ids, 33, 7]  # greedy tokens, then two that are not (likely)
    want = server.on_engine(lambda _: llm.score([ids])[0])
    got = client.completions.create(model="tiny-llama", prompt=ids, max_tokens=0, echo=True, logprobs=1)
    lp = got.choices[0].logprobs
    assert got.choices[0].text == llm.tokenizer.decode(ids) and lp.token_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx(want.token_logprobs, abs=1e-5)
    greedy = [tok == pytest.approx(max(top.values()), abs=0) for tok, top in
              zip(lp.token_logprobs[1:], lp.top_logprobs[1:])]
    assert greedy == want.token_is_greedy and 0 < sum(greedy) < len(greedy)
    one = client.completions.create(model="tiny-llama", prompt=ids, max_tokens=1, echo=True, logprobs=1,
                                    temperature=0).choices[0]
    assert len(one.logprobs.tokens) == len(ids) + 1 and one.logprobs.token_logprobs[1:-1] == lp.token_logprobs[1:]
    with pytest.raises(openai.BadRequestError, match="needs echo"):
        client.completions.create(model="tiny-llama", prompt=ids, max_tokens=0)


def test_lm_eval_local_completions_scores_equal_llm_score(server, llm, tmp_path):
    """lm-evaluation-harness's `local-completions` model (its remote tokenizer reads /tokenizer_info and
    /tokenize) runs a loglikelihood task written here: every pair's log-likelihood and greedy flag are what
    `LLM.score` gives on the same tokens."""
    pytest.importorskip("lm_eval")
    pairs = [{"context": "The cat sat on", "continuation": " the mat"},
             {"context": "One two three", "continuation": " four"},
             {"context": "hello", "continuation": " world!"},
             {"context": "aaaa", "continuation": "aaaa"}]
    (tmp_path / "pairs.json").write_text("\n".join(json.dumps(p) for p in pairs))
    (tmp_path / "jse_pairs.yaml").write_text(
        "task: jse_pairs\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {tmp_path / 'pairs.json'}\n"
        "test_split: test\noutput_type: loglikelihood\n"
        'doc_to_text: "{{context}}"\ndoc_to_target: "{{continuation}}"\n'
        "metric_list:\n  - metric: perplexity\n    aggregation: perplexity\n    higher_is_better: false\n"
        "  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n")
    # Its command line, in a process of its own: lm-eval forks, which a process running JAX must not.
    env = dict(os.environ, OPENAI_API_KEY=TOKEN, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    model_args = (f"base_url={server.base_url}/v1/completions,model=tiny-llama,tokenizer_backend=remote,"
                  f"auth_token={TOKEN},max_retries=1")
    out = subprocess.run([sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", model_args,
                          "--tasks", "jse_pairs", "--include_path", str(tmp_path), "--log_samples",
                          "--output_path", str(tmp_path / "out")], env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    [path] = glob.glob(str(tmp_path / "out" / "**" / "samples_jse_pairs_*.jsonl"), recursive=True)
    with open(path) as f:
        results = [json.loads(line) for line in f]
    samples = sorted(results, key=lambda s: s["doc_id"])
    assert len(samples) == len(pairs)
    for sample, pair in zip(samples, pairs):
        context = llm.tokenizer.encode(pair["context"])
        whole = llm.tokenizer.encode(pair["context"] + pair["continuation"])
        want = server.on_engine(lambda _: llm.score([whole])[0])
        got_ll, got_greedy = sample["resps"][0][0]  # the samples file writes them as strings
        assert float(got_ll) == pytest.approx(sum(want.token_logprobs[len(context) - 1:]), abs=1e-4)
        assert got_greedy == str(all(want.token_is_greedy[len(context) - 1:]))


def test_https_with_the_servers_certificate(llm, tmp_path):
    """With a certificate the HTTP API serves TLS only: the client that trusts it gets the engine's
    output, a plaintext request gets no answer."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("no openssl to make a certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True)
    s = ServerThread(llm, http=True, http_tls=(str(cert), str(key)))
    try:
        secure = openai.OpenAI(base_url=s.base_url + "/v1", api_key="unused", max_retries=0,
                               http_client=openai.DefaultHttpxClient(verify=ssl.create_default_context(cafile=str(cert))))
        got = secure.completions.create(model="tiny-llama", prompt="ab", max_tokens=3, temperature=0,
                                        extra_body={"ignore_eos": True})
        want = _offline(s, llm, ["ab"], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0]
        assert got.choices[0].text == want.text
        with pytest.raises(Exception):
            urllib.request.urlopen(s.base_url.replace("https", "http") + "/health", timeout=10)
    finally:
        s.stop()
