"""Who is calling: bearer tokens mapped to tenants, the gRPC interceptor that checks them, and TLS settings.

A tenant is the unit of isolation in the prefix cache: requests of
different tenants never share cached KV blocks, so one tenant can learn
nothing about another's prompts from `cached_prompt_tokens` or from how
fast its first token comes. Tenants still share compute and the queue: a
busy tenant slows every other one down, and a request's wait depends on all
tenants' load.
"""

from __future__ import annotations

import dataclasses
import hmac
import re

import grpc
from grpc_health.v1 import health

# Tenant names go into cache salts and metric labels: keep them plain.
_TENANT_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
DEFAULT_TENANT = "default"


@dataclasses.dataclass(frozen=True)
class TLSConfig:
    certificate_chain: bytes  # PEM
    private_key: bytes  # PEM


class Tenants:
    """Bearer tokens and the tenant each one authenticates.

    Args:
      tokens: {token: tenant name}.
    Raises:
      ValueError: no tokens, an empty token, or a tenant name outside
        `[A-Za-z0-9_.-]{1,64}`.
    """

    def __init__(self, tokens: dict[str, str]):
        if not tokens:
            raise ValueError("no auth tokens given")
        for token, tenant in tokens.items():
            if not token or any(c.isspace() for c in token):
                raise ValueError("auth tokens must be non-empty and without spaces")
            if not _TENANT_NAME.match(tenant):
                raise ValueError(f"tenant name {tenant!r} must match [A-Za-z0-9_.-]{{1,64}}")
        self._expected = [(f"Bearer {token}".encode(), tenant) for token, tenant in tokens.items()]

    @classmethod
    def parse(cls, text: str) -> Tenants:
        """Reads a token file: one `tenant token` pair per line, or a lone token (tenant "default").

        Blank lines and lines starting with `#` are skipped. Raises
        ValueError naming the line for anything else, or for a token given twice.
        """
        tokens: dict[str, str] = {}
        for n, line in enumerate(text.splitlines(), 1):
            fields = line.split()
            if not fields or fields[0].startswith("#"):
                continue
            if len(fields) > 2:
                raise ValueError(f"line {n}: expected 'tenant token' or a lone token, got {len(fields)} fields")
            tenant, token = (DEFAULT_TENANT, fields[0]) if len(fields) == 1 else fields
            if token in tokens:
                raise ValueError(f"line {n}: this token is already given")
            tokens[token] = tenant
        return cls(tokens)

    def tenant_of(self, metadata) -> str | None:
        """The tenant whose token `metadata` carries (`authorization: Bearer <token>`), or None.

        Compares against every token in constant time, so the time taken does not tell which
        token a guess came close to.
        """
        sent = dict(metadata or ()).get("authorization", "")
        sent = sent.encode() if isinstance(sent, str) else b""
        found = None
        for expected, tenant in self._expected:
            if hmac.compare_digest(sent, expected):
                found = tenant
        return found


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """Requires a known bearer token (`Tenants`) on every call except gRPC health checks
    (load balancers probe without credentials); others get UNAUTHENTICATED."""

    def __init__(self, tenants: Tenants):
        self.tenants = tenants

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or details.method.startswith(f"/{health.SERVICE_NAME}/"):
            return handler
        if self.tenants.tenant_of(details.invocation_metadata) is not None:
            return handler
        return _denying(handler, "missing or wrong auth token: send metadata 'authorization: Bearer <token>'")


def _denying(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that fails with UNAUTHENTICATED."""

    async def deny(_request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    for kind in ("unary_unary", "unary_stream", "stream_unary", "stream_stream"):
        if getattr(handler, kind) is not None:
            return getattr(grpc, f"{kind}_rpc_method_handler")(
                deny, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)
    raise TypeError(f"unknown handler kind: {handler!r}")
