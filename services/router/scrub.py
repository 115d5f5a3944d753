"""What a client is told of a failure inside the mesh: the message with the mesh's
addresses and URLs taken out (the whole message is logged for the operator).

Messages come from the router, the scheduler and the workers, and from gRPC itself,
which names peers its own way (``ipv4:10.1.2.3:50060``, ``ipv6:%5B::1%5D:50060``,
``unix:/run/kervan.sock``)."""

from __future__ import annotations

import logging
import re

import grpc

log = logging.getLogger(__name__)

# a bare IPv6 address: with "::", or of 4 to 8 groups (never a time such as 12:30:45)
_GROUPS = r"[0-9A-Fa-f]{1,4}(?::[0-9A-Fa-f]{1,4})*"
_IPV6 = (rf"(?<![\w:])(?=[:0-9A-Fa-f]*[0-9A-Fa-f])(?:(?:{_GROUPS})?::(?:{_GROUPS})?"
         r"|(?:[0-9A-Fa-f]{1,4}:){3,7}[0-9A-Fa-f]{1,4})(?:%[\w.-]+)?(?![\w:])")  # and a zone (%eth0)
_INTERNALS = re.compile(
    r"\b(?:ipv4|ipv6|unix|unix-abstract|vsock|dns):\S+"  # gRPC's peer and target names
    r"|\b[a-z][a-z0-9+.-]*://\S+"  # URLs (a Redis one may carry a password)
    r"|(?:\[|%5[Bb])[0-9A-Fa-f.]*:[0-9A-Fa-f:.%]*(?:\]|%5[Dd])(?::\d{1,5})?"  # [IPv6] or %5BIPv6%5D, a port
    r"|\b\d{1,3}(?:\.\d{1,3}){3}(?::\d{1,5})?\b"  # IPv4, and a port
    r"|\b\d{1,3}(?:-\d{1,3}){3}(?:\.[\w-]+)*(?::\d{1,5})?"  # a pod's DNS name (10-0-0-5.ns.pod...)
    r"|\b[\w-]+(?:\.[\w-]+)*\.(?:svc|cluster\.local|internal)\b(?::\d{1,5})?"  # cluster-internal names
    rf"|{_IPV6}"
    r"|\b[A-Za-z][\w.-]*:\d{2,5}\b"  # host:port
    r"|\b[\w.-]+@[\w.:%\[\]-]+")  # a worker id (role@address)
# statuses about the request itself: the client sees what to fix, and they are not logged
_REQUEST_STATUSES = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.ALREADY_EXISTS,
                     grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.OUT_OF_RANGE,
                     grpc.StatusCode.RESOURCE_EXHAUSTED}


def scrub(message: str) -> str:
    return _INTERNALS.sub("<internal>", message)


def public_message(code: grpc.StatusCode, message: str) -> str:
    """The message a client gets with ``code``: every status is scrubbed (a worker's
    refusal can name its address too); a failure of the mesh is also logged whole."""
    if code not in _REQUEST_STATUSES:
        log.warning("request failed %s: %s", code.name, message)
    return scrub(message)
