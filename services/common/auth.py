"""Who may call what: every server checks each call before its servicer sees it.

- Health and reflection are open to anyone (probes, load balancers, grpcurl).
- On a mesh with TLS, the caller's certificate (verified against the mesh's CA in
  the handshake) names its role in its CN; each service says which roles may call
  which of its methods (``Service.callers``): a worker may push KV to a worker but
  not place requests, only workers may register, heartbeat or publish blocks. A call
  without a certificate is UNAUTHENTICATED, from a role the method does not admit
  PERMISSION_DENIED. Without TLS (loopback only) callers cannot be told apart, and
  every role is admitted; with a mesh secret (``security.py``), an internal service
  admits only calls that carry it (UNAUTHENTICATED otherwise).
- A server given API keys (the router's public API) also requires
  ``authorization: Bearer <key>`` metadata; keys are compared in constant time and
  may carry an expiry. A missing, wrong or expired key is UNAUTHENTICATED."""

from __future__ import annotations

import hashlib
import hmac
import inspect
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import grpc

from services.common.errors import Behaviour, rewrap
from services.common.metrics import RPC_ERRORS
from services.common.security import MESH_SECRET_METADATA

OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
_COMMENT = re.compile(r"(?:^|\s)#")
ANY_ROLE = "*"


@dataclass(frozen=True)
class ApiKey:
    secret: bytes
    expires_at: float | None = None  # Unix time; None: never

    @property
    def identity(self) -> str:
        """Who holds this key, as the router counts and salts by it: not the key, and the same
        however the header spells it (``Bearer K``, ``bearer  K ``)."""
        return "key-" + hashlib.sha256(b"kervan-api-key\0" + self.secret).hexdigest()[:16]


class ApiKeys:
    """The keys a public API accepts. A file holds one per line, optionally followed by
    ``expires=<ISO 8601 time with its zone>``; blank lines are skipped, and so is a
    comment: ``#`` at the start of a line or after a space (a ``#`` inside a key is part
    of it)."""

    def __init__(self, keys: Collection[ApiKey]):
        self.keys = tuple(keys)

    @classmethod
    def from_file(cls, path: str | Path) -> ApiKeys:
        keys = []
        for n, line in enumerate(Path(path).read_text().splitlines(), 1):
            words = _COMMENT.split(line, 1)[0].split()
            if not words:
                continue
            expires = None
            for word in words[1:]:
                name, _, value = word.partition("=")
                if name != "expires":
                    raise ValueError(f"{path}:{n}: unknown key option {name!r} (only expires=<ISO time>)")
                try:
                    when = datetime.fromisoformat(value)
                except ValueError:
                    raise ValueError(f"{path}:{n}: expires={value!r} is not an ISO 8601 time") from None
                if when.tzinfo is None:  # local time would shift with the host's zone
                    raise ValueError(f"{path}:{n}: expires={value} has no time zone: add Z or +HH:MM")
                expires = when.timestamp()
            if len(words[0]) < 16:
                raise ValueError(f"{path}:{n}: an API key needs at least 16 characters")
            keys.append(ApiKey(words[0].encode(), expires))
        if not keys:
            raise ValueError(f"{path} holds no API key")
        return cls(keys)

    def check(self, metadata: Mapping[str, str]) -> str | None:
        """None when the call carries a valid key, else why not."""
        return self.match(metadata)[1]

    def identity(self, metadata: Mapping[str, str]) -> str:
        """The identity of the valid key the call carries ("" for none)."""
        return self.match(metadata)[0] or ""

    def match(self, metadata: Mapping[str, str]) -> tuple[str | None, str | None]:
        """(the matched key's identity, None) for a valid key, else (None, why not)."""
        header = metadata.get("authorization", "")
        scheme, _, token = header.strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return None, "missing API key: send 'authorization: Bearer <key>'"
        given = token.strip().encode()
        # every key is compared (no early exit), each in constant time
        matched = [k for k in self.keys if hmac.compare_digest(k.secret, given)]
        if not matched:
            return None, "invalid API key"
        live = [k for k in matched if k.expires_at is None or k.expires_at >= time.time()]
        if not live:
            return None, "expired API key"
        return live[0].identity, None


Context = grpc.aio.ServicerContext[Any, Any]
Check = Callable[[Context], Awaitable[None]]


def caller_role(context: Context) -> str | None:
    """The role in the caller's verified certificate (its CN), or None without one."""
    names = list(context.auth_context().get("x509_common_name") or ())
    return names[0].decode(errors="replace") if names else None


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """``callers``: full method name or service prefix (``/pkg.Service/``) -> roles
    admitted; a method not named admits every role. ``mesh_tls``: whether callers
    hold certificates (roles are checked only then)."""

    def __init__(self, callers: Mapping[str, Collection[str]], mesh_tls: bool, api_keys: ApiKeys | None = None,
                 mesh_secret: bytes | None = None):
        self.callers = callers
        self.mesh_tls = mesh_tls
        self.api_keys = api_keys
        self.mesh_secret = mesh_secret

    def roles_for(self, method: str) -> Collection[str]:
        service = method[:method.rindex("/") + 1]
        return self.callers.get(method, self.callers.get(service, (ANY_ROLE,)))

    async def intercept_service(
            self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]],
            details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = await continuation(details)
        method = details.method
        if handler is None or method.startswith(OPEN_PREFIXES) or (
                self.api_keys is None and not self.mesh_tls and self.mesh_secret is None):
            return handler  # nothing to check: no wrapper around every streamed message
        refusal = None
        metadata = {k: v for k, v in details.invocation_metadata or () if isinstance(v, str)}
        if self.api_keys is not None:
            refusal = self.api_keys.check(metadata)
        if self.mesh_secret is not None and not hmac.compare_digest(
                metadata.get(MESH_SECRET_METADATA, "").encode(), self.mesh_secret):
            refusal = f"this service needs the mesh's credential ({MESH_SECRET_METADATA} metadata)"
        roles = self.roles_for(method)

        async def check(context: Context) -> None:
            if refusal is not None:
                await _refuse(context, method, grpc.StatusCode.UNAUTHENTICATED, refusal)
            if not self.mesh_tls:
                return
            role = caller_role(context)
            if role is None:
                await _refuse(context, method, grpc.StatusCode.UNAUTHENTICATED,
                              "this service needs a mesh client certificate")
            if ANY_ROLE not in roles and role not in roles:
                await _refuse(context, method, grpc.StatusCode.PERMISSION_DENIED,
                              f"role {role!r} may not call {method} (admitted: {', '.join(sorted(roles))})")

        return rewrap(handler, lambda inner: _checked_unary(inner, check), lambda inner: _checked_stream(inner, check))


async def _refuse(context: Context, method: str, code: grpc.StatusCode, message: str) -> None:
    RPC_ERRORS.labels(method, code.name).inc()
    await context.abort(code, message)


def _checked_unary(inner: Behaviour, check: Check) -> Behaviour:
    async def behaviour(request_or_iterator: Any, context: Context) -> Any:
        await check(context)  # before a streamed request is read: nothing is committed for a refused caller
        return await inner(request_or_iterator, context)
    return behaviour


def _checked_stream(inner: Behaviour, check: Check) -> Behaviour:
    if not inspect.isasyncgenfunction(inner):
        return _checked_unary(inner, check)

    async def behaviour(request: Any, context: Context) -> AsyncIterator[Any]:
        await check(context)
        async for response in inner(request, context):
            yield response
    return behaviour
