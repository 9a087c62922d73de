"""Prometheus metrics of a serving engine, in a registry of their own.

Updated on the engine thread after every step (`EngineWorker`); served over
HTTP by `serve(port)`. Names follow Prometheus conventions: seconds, `_total`
counters. Rates (tokens/s, requests/s) are best taken with `rate()` over the
counters; `engine_generation_tokens_per_second` is a convenience over the last
`TOKENS_PER_SECOND_WINDOW_S` seconds.
"""

from __future__ import annotations

import collections
import hmac
import socketserver
import ssl
import threading
import time
import wsgiref.simple_server

import prometheus_client as prom

from engine.compilation import compilation_count

TOKENS_PER_SECOND_WINDOW_S = 10.0
# Seconds; CPU steps take 10 ms to 1 s, GPU steps 5 to 50 ms.
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_ITL_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2.5, 5)


class Warmup:
    """A server's start-up: programs compiled of those it will run, and whether it serves (any thread)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.started = time.monotonic()
        self.done = self.total = 0
        self.ready = False
        self._first: tuple[float, int] | None = None  # (time, done) at the first progress report

    def update(self, done: int, total: int) -> None:
        with self._lock:
            if self._first is None:
                self._first = (time.monotonic(), done - 1)
            self.done, self.total = done, total

    def progress(self) -> tuple[int, int, float | None]:
        """(programs compiled, of total, an estimate of the seconds left or None before the first one)."""
        with self._lock:
            done, total, first = self.done, self.total, self._first
        if first is None or done <= first[1]:
            return done, total, None
        rate = (time.monotonic() - first[0]) / (done - first[1])
        return done, total, rate * (total - done)


class Metrics:
    """The engine's metrics. A fresh registry per instance, so several servers can share a process (tests)."""

    def __init__(self):
        self.registry = r = prom.CollectorRegistry()
        self.warmup = Warmup()
        prom.Gauge("engine_warmup_programs_compiled", "Programs compiled (or loaded from the compilation cache) "
                   "during start-up.", registry=r).set_function(lambda: self.warmup.done)
        prom.Gauge("engine_warmup_programs_total", "Programs the server compiles before it serves (0 before the "
                   "model is loaded).", registry=r).set_function(lambda: self.warmup.total)
        prom.Gauge("engine_ready", "1 once the server serves (gRPC health SERVING), 0 while it warms up.",
                   registry=r).set_function(lambda: float(self.warmup.ready))
        self.ttft = prom.Histogram("engine_time_to_first_token_seconds",
                                   "Arrival of a request to its first generated token.", buckets=_TTFT_BUCKETS,
                                   registry=r)
        self.itl = prom.Histogram("engine_inter_token_latency_seconds",
                                  "Time between consecutive generated tokens of a request.", buckets=_ITL_BUCKETS,
                                  registry=r)
        self.generated_tokens = prom.Counter("engine_generated_tokens", "Tokens generated.", registry=r)
        self.prompt_tokens = prom.Counter("engine_prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.cached_prompt_tokens = prom.Counter(
            "engine_cached_prompt_tokens", "Prompt tokens of finished requests whose KV came from the prefix cache.",
            registry=r)
        # Per tenant: what an operator bills from (only the operator's scrape token reads /metrics, see `serve`).
        self.tenant_requests = prom.Counter("engine_tenant_requests", "Finished requests per tenant.", ["tenant"],
                                            registry=r)
        self.tenant_prompt_tokens = prom.Counter("engine_tenant_prompt_tokens",
                                                 "Prompt tokens of finished requests per tenant.", ["tenant"], registry=r)
        self.tenant_cached_prompt_tokens = prom.Counter(
            "engine_tenant_cached_prompt_tokens", "Prompt tokens from the prefix cache per tenant.", ["tenant"],
            registry=r)
        self.tenant_completion_tokens = prom.Counter("engine_tenant_completion_tokens",
                                                     "Generated tokens of finished requests per tenant.", ["tenant"],
                                                     registry=r)
        self.requests = prom.Gauge("engine_requests", "Requests in the engine by state.", ["state"], registry=r)
        self.finished = prom.Counter("engine_requests_finished", "Requests ended, by finish reason "
                                     "(stop, length, abort; error: the engine failed while running it).",
                                     ["reason"], registry=r)
        self.rejected = prom.Counter("engine_requests_rejected", "Generate requests refused as invalid.", registry=r)
        self.kv_blocks_in_use = prom.Gauge("engine_kv_blocks_in_use", "KV blocks held by requests.", registry=r)
        self.kv_blocks_total = prom.Gauge("engine_kv_blocks_total", "Usable KV blocks in the pool.", registry=r)
        self.steps = prom.Counter("engine_steps", "Engine steps run.", registry=r)
        prom.Gauge("engine_prefix_cache_hit_rate", "Cached / all prompt tokens of finished requests since start.",
                   registry=r).set_function(self._hit_rate)
        # 0 while nothing was proposed (no draft model, or speculation off).
        self.acceptance_rate = prom.Gauge("engine_spec_acceptance_rate",
                                          "Accepted / proposed draft tokens since start.", registry=r)
        self.acceptance_length = prom.Gauge("engine_spec_acceptance_length",
                                            "Mean tokens emitted per verify (accepted + 1) since start.", registry=r)
        self.position_acceptance = prom.Gauge(
            "engine_spec_position_acceptance", "Per draft position: accepted / proposed there since start.",
            ["position"], registry=r)
        self.draft_share = prom.Gauge("engine_spec_draft_time_share",
                                      "The proposer's host seconds (cost gate, lookups) / all step seconds since "
                                      "start; a device proposer's draft passes are in the step program.",
                                      registry=r)
        self.class_tokens_per_second = prom.Gauge(
            "engine_spec_class_tokens_per_second", "Per request class: tokens per second of its decode steps "
            "(its share of each step's time, decayed over its recent steps) with the proposer drafting, and "
            "off: what the cost gate's regret account weighs (engine.spec.costs.DraftRegret).",
            ["request_class", "proposer"], registry=r)
        self.suffix_cache_tokens = prom.Gauge(
            "engine_spec_suffix_cache_tokens", "Suffix decoding: tokens of earlier requests its global tries keep "
            "(at most --suffix_cache_tokens, over every tenant).", registry=r)
        self.class_proposer = prom.Gauge(
            "engine_spec_class_proposer", "Per request class: 1 for what its latest decode step ran (the "
            "proposer, or off), 0 for the other.", ["request_class", "proposer"], registry=r)
        prom.Gauge("engine_compilations", "XLA programs compiled by this process.",
                   registry=r).set_function(compilation_count)
        prom.Gauge("engine_generation_tokens_per_second",
                   f"Tokens generated per second over the last {TOKENS_PER_SECOND_WINDOW_S:g} s.",
                   registry=r).set_function(self._tokens_per_second)
        self._lock = threading.Lock()  # the window is written on the engine thread, read by the HTTP thread
        self._window: collections.deque[tuple[float, int]] = collections.deque()
        self._prompt = self._cached = 0

    def record_step(self, engine, num_tokens: int) -> None:
        """After a step that generated `num_tokens`: counters, the tokens/s window, engine state gauges."""
        now = time.monotonic()
        self.steps.inc()
        self.generated_tokens.inc(num_tokens)
        with self._lock:
            self._window.append((now, num_tokens))
            while self._window[0][0] < now - TOKENS_PER_SECOND_WINDOW_S:
                self._window.popleft()
        self.record_engine_state(engine)

    def record_engine_state(self, engine) -> None:
        sched, blocks = engine.scheduler, engine.blocks
        self.requests.labels("waiting").set(len(sched.waiting))
        self.requests.labels("running").set(len(sched.running))
        self.kv_blocks_total.set(blocks.num_usable_blocks)
        self.kv_blocks_in_use.set(blocks.num_usable_blocks - blocks.num_free_blocks)
        stats = engine.stats
        if stats.draft_share is not None:
            self.draft_share.set(stats.draft_share)
        if stats.num_draft_tokens:
            self.acceptance_rate.set(stats.acceptance_rate)
            self.acceptance_length.set(stats.acceptance_length)
            for i, rate in enumerate(stats.position_acceptance):
                self.position_acceptance.labels(str(i)).set(rate)
        proposer = engine.proposer
        cache = getattr(proposer, "cache", None)  # suffix decoding's memory of earlier outputs
        if cache is not None:
            self.suffix_cache_tokens.set(cache.num_tokens)
        if engine.gate.enabled:
            for (name, drafted), rate in engine.gate.regret.tokens_per_second().items():
                self.class_tokens_per_second.labels(name, proposer.kind if drafted else "off").set(rate)
            for name, drafted in engine.gate.regret.last_drafted.items():
                self.class_proposer.labels(name, proposer.kind).set(float(drafted))
                self.class_proposer.labels(name, "off").set(float(not drafted))

    def record_finished(self, reason: str, prompt_tokens: int, cached_prompt_tokens: int, completion_tokens: int,
                        tenant: str) -> None:
        self.finished.labels(reason).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.cached_prompt_tokens.inc(cached_prompt_tokens)
        self.tenant_requests.labels(tenant).inc()
        self.tenant_prompt_tokens.labels(tenant).inc(prompt_tokens)
        self.tenant_cached_prompt_tokens.labels(tenant).inc(cached_prompt_tokens)
        self.tenant_completion_tokens.labels(tenant).inc(completion_tokens)
        with self._lock:
            self._prompt += prompt_tokens
            self._cached += cached_prompt_tokens

    def _hit_rate(self) -> float:
        with self._lock:
            return self._cached / self._prompt if self._prompt else 0.0

    def _tokens_per_second(self) -> float:
        now = time.monotonic()
        with self._lock:
            return sum(n for t, n in self._window if t >= now - TOKENS_PER_SECOND_WINDOW_S) / TOKENS_PER_SECOND_WINDOW_S

    def serve(self, port: int, host: str = "127.0.0.1", *, certfile: str | None = None, keyfile: str | None = None,
              tenants=None, scrape_token: str | None = None):
        """Serves `/metrics` over HTTP on a daemon thread; port 0 picks a free one.

        With `certfile`/`keyfile` (PEM paths) it serves HTTPS. With
        `scrape_token` (the operator's scrape credential, as Prometheus's
        `authorization` config sends it) a request needs `Authorization:
        Bearer <scrape_token>`, else 401. The page counts every tenant's
        traffic, so with `tenants` (`engine.serving.auth.Tenants`) a tenant's
        token gets 403, and without a scrape token nobody reads it. Returns the
        server (its `server_port`; `shutdown()` stops it).
        """
        app = prom.make_wsgi_app(self.registry)
        if tenants is not None or scrape_token is not None:
            app = _operator_only(app, tenants, scrape_token)
        server = wsgiref.simple_server.make_server(host, port, app, _ThreadingWSGIServer, handler_class=_QuietHandler)
        if certfile:
            context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            context.load_cert_chain(certfile, keyfile)
            server.socket = context.wrap_socket(server.socket, server_side=True)
        threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
        return server


class _ThreadingWSGIServer(socketserver.ThreadingMixIn, wsgiref.simple_server.WSGIServer):
    daemon_threads = True


class _QuietHandler(wsgiref.simple_server.WSGIRequestHandler):
    def log_message(self, *_):  # no access log on stderr
        pass


def _operator_only(app, tenants, scrape_token: str | None):
    expected = None if scrape_token is None else f"Bearer {scrape_token}".encode()

    def guarded(environ, start_response):
        sent = environ.get("HTTP_AUTHORIZATION", "")
        if expected is not None and hmac.compare_digest(sent.encode(), expected):
            return app(environ, start_response)
        if tenants is not None and tenants.tenant_of([("authorization", sent)]) is not None:
            start_response("403 Forbidden", [("Content-Type", "text/plain")])
            return [b"a tenant's token does not read /metrics (it counts every tenant's traffic): scrape with the "
                    b"operator's token (--metrics_token_file)\n"]
        start_response("401 Unauthorized", [("Content-Type", "text/plain"), ("WWW-Authenticate", "Bearer")])
        return [b"missing or wrong scrape token: send 'Authorization: Bearer <token>' (--metrics_token_file)\n"]

    return guarded
