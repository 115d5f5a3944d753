"""Several replicas of a service behind one gRPC channel.

``--scheduler 127.0.0.1:7001,127.0.0.1:7002`` (or a client's ``--addr`` with several
routers) becomes one channel that balances calls round robin over the replicas and
carries a retry policy (gRPC's service config, documented in the README): a call that
fails UNAVAILABLE before any response arrived — its replica died, or was never up —
is sent again to another one, invisibly to the caller. A stream that had already
answered is not retried by gRPC (its answer would repeat): its caller sees
UNAVAILABLE and retries itself. A single address, or a ``dns:///`` name whose
records are the replicas (a Kubernetes headless Service), is used as given."""

from __future__ import annotations

import ipaddress
import json

MAX_ATTEMPTS = 3


def target(addresses: str) -> str:
    """A gRPC target for one address or a comma-separated list of HOST:PORT."""
    parts = [a.strip() for a in addresses.split(",") if a.strip()]
    if not parts:
        raise ValueError("no address given")
    if len(parts) == 1:
        return parts[0]
    hosts = []
    for part in parts:
        host, _, port = part.rpartition(":")
        host = "127.0.0.1" if host == "localhost" else host.strip("[]")
        try:
            hosts.append((ipaddress.ip_address(host), port))
        except ValueError:
            raise ValueError(f"{part!r}: a list of replicas takes IP addresses (one DNS name may stand for many: "
                             f"dns:///NAME:PORT)") from None
    if len({ip.version for ip, _ in hosts}) > 1:
        raise ValueError("a list of replicas is all IPv4 or all IPv6")
    if hosts[0][0].version == 4:
        return "ipv4:" + ",".join(f"{ip}:{port}" for ip, port in hosts)
    return "ipv6:" + ",".join(f"[{ip}]:{port}" for ip, port in hosts)


def service_config(service: str) -> str:
    """Round robin over the replicas; UNAVAILABLE before any response is retried."""
    return json.dumps({
        "loadBalancingConfig": [{"round_robin": {}}],
        "methodConfig": [{"name": [{"service": service}], "retryPolicy": {
            "maxAttempts": MAX_ATTEMPTS, "initialBackoff": "0.05s", "maxBackoff": "1s", "backoffMultiplier": 2,
            "retryableStatusCodes": ["UNAVAILABLE"]}}]})


def options(service: str) -> list[tuple[str, object]]:
    return [("grpc.service_config", service_config(service)), ("grpc.enable_retries", 1)]
