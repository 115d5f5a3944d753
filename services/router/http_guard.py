"""What a slow or greedy HTTP client can hold of the router: bounded in time and in count.

uvicorn times out only idle keep-alive connections: a client that never finishes its headers
(slowloris) or its body holds its socket forever, and enough of them take every file
descriptor (1,100 took the router to 929 fds and reset ``/health``). Here each connection
must send its headers within ``header_timeout_s`` of opening (or of the first byte of a
later request on it), and its body within ``body_timeout_s`` of the headers, else it is
closed; connections past ``max_connections``, or past ``max_per_client`` from one address,
are closed as they open. The soft ``RLIMIT_NOFILE`` is raised to the hard one at start
(``raise_open_files_limit``), and ``max_connections`` is kept to half of it."""

from __future__ import annotations

import asyncio
import logging
import resource
from collections import Counter
from dataclasses import dataclass, field

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HttpLimits:
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    max_connections: int = 1000
    max_per_client: int = 100


DEFAULT_LIMITS = HttpLimits()


@dataclass
class ConnectionCounts:
    limits: HttpLimits
    total: int = 0
    per_client: Counter[str] = field(default_factory=Counter)
    num_refused: int = 0
    num_timed_out: int = 0

    def admit(self, client: str) -> bool:
        if self.total >= self.limits.max_connections or self.per_client[client] >= self.limits.max_per_client:
            self.num_refused += 1
            return False
        self.total += 1
        self.per_client[client] += 1
        return True

    def release(self, client: str) -> None:
        self.total -= 1
        self.per_client[client] -= 1
        if not self.per_client[client]:
            del self.per_client[client]


def raise_open_files_limit() -> int:
    """The soft RLIMIT_NOFILE raised to the hard one; returns the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open files limit from %d to %d: %s", soft, hard, exc)
    return soft


def within_open_files(limits: HttpLimits, open_files: int) -> HttpLimits:
    """``limits`` with ``max_connections`` at most half the open files limit (the rest: gRPC, logs)."""
    cap = max(1, open_files // 2)
    return limits if limits.max_connections <= cap else HttpLimits(
        limits.header_timeout_s, limits.body_timeout_s, cap, min(limits.max_per_client, cap))


def guarded_protocol(counts: ConnectionCounts) -> type[H11Protocol]:
    """uvicorn's h11 protocol with ``counts``' limits (pass it as ``uvicorn.Config(http=...)``)."""

    class GuardedH11Protocol(H11Protocol):
        _admitted = False
        _deadline: asyncio.TimerHandle | None = None
        _waiting_for: object = None  # h11.IDLE: headers, h11.SEND_BODY: the body

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if not counts.admit(self._client_host()):
                transport.abort()  # nothing read, nothing answered: the cheapest refusal
                return
            self._admitted = True
            self._watch()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            if self._admitted:
                self._admitted = False
                counts.release(self._client_host())
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._watch()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._disarm()  # idle now: uvicorn's keep-alive timeout holds; the next byte re-arms

        def _client_host(self) -> str:
            return self.client[0] if self.client else ""

        def _watch(self) -> None:
            """Arm the deadline of what the client owes now, or disarm it once owed nothing."""
            state = self.conn.their_state
            owed = state if state in (h11.IDLE, h11.SEND_BODY) else None
            if owed is h11.IDLE and self.conn.our_state is not h11.IDLE:
                owed = None  # answering: the client owes nothing until the response is done
            if owed is self._waiting_for:
                return
            self._disarm()
            if owed is not None:
                timeout = counts.limits.header_timeout_s if owed is h11.IDLE else counts.limits.body_timeout_s
                self._deadline = self.loop.call_later(timeout, self._timed_out)
                self._waiting_for = owed

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
            self._deadline, self._waiting_for = None, None

        def _timed_out(self) -> None:
            self._deadline = None
            if not self.transport.is_closing():
                counts.num_timed_out += 1
                self.transport.abort()

    return GuardedH11Protocol
