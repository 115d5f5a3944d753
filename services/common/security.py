"""Transport security of the mesh: mutual TLS between services, and where a server
may listen without it.

Each service is given its certificate and key (PEM) and the mesh's CA. The same
certificate serves as its server and its client certificate; its subject's common
name (CN) is its mesh role, one of ``ROLES``, which servers check against the
methods each role may call (``services/common/auth.py``). A peer whose certificate
does not chain to the mesh's CA (or has expired) fails the TLS handshake.

Without TLS every channel is plaintext, and a server listens only on loopback
unless ``--allow-plaintext`` says otherwise (logged as a warning): plaintext on a
routable address opens every internal RPC to anyone who can reach the port. A
plaintext mesh can still keep other local users out: with ``KERVAN_MESH_SECRET`` in
every service's environment, each internal call carries it and each internal service
requires it (``kervan up`` makes one when the router has API keys)."""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from kervan.envs import KERVAN_MESH_SECRET

log = logging.getLogger(__name__)

ROLES = ("router", "scheduler", "worker", "kv-registry", "control-plane", "admin")
MESH_NAME = "kervan-mesh"  # a mesh certificate is valid for <role>.kervan-mesh (or <role>.<--tls-server-name>)
PUBLIC_ROUTER_CN = "router-public"  # the router's public certificate: no mesh role
WORKER_ADDRESS_SCHEME = "kervan-worker://"  # a worker certificate's URI SAN: an address it may register
MESH_SECRET_ENV = KERVAN_MESH_SECRET
MESH_SECRET_METADATA = "kervan-mesh-secret"
LOOPBACK_NAMES = {"localhost", "ip6-localhost"}


class SecurityError(ValueError):
    """A security configuration refused before anything listens."""


def mesh_name(role: str, domain: str | None = None) -> str:
    """The name a mesh certificate of ``role`` is valid for, and checked for."""
    return f"{role}.{domain or MESH_NAME}"


def is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class MeshSecurity:
    """This process's TLS material (PEM bytes), or none: plaintext."""

    cert: bytes | None = None
    key: bytes | None = None
    ca: bytes | None = None
    allow_plaintext: bool = False
    # the name peers' certificates are checked for, whatever address a channel dials (workers
    # advertise pod IPs no certificate can list); None: the dialled host itself
    server_name: str | None = None
    # without TLS, the credential every internal call carries and every internal service
    # requires (KERVAN_MESH_SECRET; `kervan up` makes one when the public API has keys)
    mesh_secret: bytes | None = None

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise SecurityError("a TLS certificate needs its key, and a key its certificate")
        if self.cert is not None and self.ca is None:
            raise SecurityError("TLS needs the mesh's CA (--tls-ca) to verify peers")

    @classmethod
    def from_files(cls, cert: str | None, key: str | None, ca: str | None, allow_plaintext: bool = False,
                   server_name: str | None = None) -> MeshSecurity:
        def read(path: str | None) -> bytes | None:
            return Path(path).read_bytes() if path else None
        return cls(read(cert), read(key), read(ca), allow_plaintext, server_name or None)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> MeshSecurity:
        """From a service's flags (and ``KERVAN_MESH_SECRET``); a configuration that cannot
        work, or plaintext beyond loopback not allowed, exits at once (before any model or
        connection)."""
        try:
            security = cls.from_files(args.tls_cert, args.tls_key, args.tls_ca, bool(args.allow_plaintext),
                                      args.tls_server_name)
            secret = os.environ.get(MESH_SECRET_ENV, "")
            if secret:
                if len(secret) < 16:
                    raise SecurityError(f"{MESH_SECRET_ENV} needs at least 16 characters")
                security = dataclasses.replace(security, mesh_secret=secret.encode())
            security.check_listen(args.host, "this service")
        except (OSError, SecurityError) as exc:
            raise SystemExit(f"security: {exc}") from None
        return security

    @property
    def tls(self) -> bool:
        return self.ca is not None

    def server_credentials(self, require_client_cert: bool = True) -> grpc.ServerCredentials:
        """Internal services require a client certificate from the mesh's CA; the
        router's public port does not (its clients present an API key instead)."""
        if self.key is None or self.cert is None:
            raise SecurityError("a TLS server needs its certificate and key")
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca,
                                           require_client_auth=require_client_cert)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                            certificate_chain=self.cert)

    def channel(self, address: str, options: Sequence[tuple[str, object]] = (), role: str | None = None
                ) -> grpc.aio.Channel:
        """A channel to ``address``; ``role``: the mesh role served there, whose name the
        server's certificate must carry (a certificate of another role is refused in the
        handshake). Without it, the certificate is checked for the host dialled."""
        interceptors = mesh_secret_interceptors(self.mesh_secret) if self.mesh_secret else None
        if self.tls:
            return grpc.aio.secure_channel(address, self.channel_credentials(),
                                           options=self._options(address, options, role), interceptors=interceptors)
        return grpc.aio.insecure_channel(address, options=list(options), interceptors=interceptors)

    def sync_channel(self, address: str, options: Sequence[tuple[str, object]] = (), role: str | None = None
                     ) -> grpc.Channel:
        if self.tls:
            return grpc.secure_channel(address, self.channel_credentials(),
                                       options=self._options(address, options, role))
        return grpc.insecure_channel(address, options=list(options))

    def _options(self, address: str, options: Sequence[tuple[str, object]], role: str | None
                 ) -> list[tuple[str, object]]:
        if role is not None:
            return [*options, ("grpc.ssl_target_name_override", mesh_name(role, self.server_name))]
        name = self.server_name
        if name is None and address.startswith(("ipv4:", "ipv6:")):
            # a list of replicas (services/common/replicas.py) names no single host: their
            # certificates are checked for the first one's address
            name = address.split(":", 1)[1].split(",")[0].rpartition(":")[0].strip("[]")
        if name is None:
            return list(options)
        return [*options, ("grpc.ssl_target_name_override", name)]

    def check_listen(self, host: str, what: str) -> None:
        """Refuses plaintext beyond loopback unless allowed, and then warns."""
        if self.tls or is_loopback(host):
            return
        if not self.allow_plaintext:
            raise SecurityError(f"{what} would listen on {host} without TLS: give --tls-cert, --tls-key and "
                                f"--tls-ca, or --allow-plaintext to accept anyone who can reach the port")
        log.warning("%s listens on %s WITHOUT TLS (--allow-plaintext): anyone who can reach it can call it",
                    what, host)


PLAINTEXT = MeshSecurity()


class _WithMeshSecret:
    """Adds the mesh secret to a call's metadata."""

    def __init__(self, secret: bytes):
        self.pair = (MESH_SECRET_METADATA, secret.decode())

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()), self.pair)
        return grpc.aio.ClientCallDetails(details.method, details.timeout, metadata, details.credentials,
                                          details.wait_for_ready)


class _UnaryUnary(_WithMeshSecret, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Any, details: grpc.aio.ClientCallDetails,
                              request: Any) -> Any:
        return await continuation(self._details(details), request)


class _UnaryStream(_WithMeshSecret, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Any, details: grpc.aio.ClientCallDetails,
                              request: Any) -> Any:
        return await continuation(self._details(details), request)


class _StreamUnary(_WithMeshSecret, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation: Any, details: grpc.aio.ClientCallDetails,
                              request_iterator: Any) -> Any:
        return await continuation(self._details(details), request_iterator)


class _StreamStream(_WithMeshSecret, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation: Any, details: grpc.aio.ClientCallDetails,
                              request_iterator: Any) -> Any:
        return await continuation(self._details(details), request_iterator)


def mesh_secret_interceptors(secret: bytes) -> list[grpc.aio.ClientInterceptor]:
    """One per kind of call: a channel files each interceptor under one kind only."""
    return [kind(secret) for kind in (_UnaryUnary, _UnaryStream, _StreamUnary, _StreamStream)]


def add_security_arguments(ap: argparse.ArgumentParser) -> None:
    group = ap.add_argument_group("transport security")
    group.add_argument("--tls-cert", default=None, help="this service's certificate (PEM); its CN is its mesh role")
    group.add_argument("--tls-key", default=None, help="the certificate's private key (PEM)")
    group.add_argument("--tls-ca", default=None, help="the mesh's CA certificate (PEM): peers must chain to it")
    group.add_argument("--tls-server-name", default=None,
                       help=f"the mesh's domain: a peer serving ROLE must hold a certificate for ROLE.<this> "
                            f"(default {MESH_NAME}), whatever address it is dialled by")
    group.add_argument("--allow-plaintext", action="store_true",
                       help="listen beyond loopback without TLS (not advised: every RPC open to the network)")
