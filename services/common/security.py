"""Transport security of the mesh: mutual TLS between services, and where a server
may listen without it.

Each service is given its certificate and key (PEM) and the mesh's CA. The same
certificate serves as its server and its client certificate; its subject's common
name (CN) is its mesh role, one of ``ROLES``, which servers check against the
methods each role may call (``services/common/auth.py``). A peer whose certificate
does not chain to the mesh's CA (or has expired) fails the TLS handshake.

Without TLS every channel is plaintext, and a server listens only on loopback
unless ``--allow-plaintext`` says otherwise (logged as a warning): plaintext on a
routable address opens every internal RPC to anyone who can reach the port."""

from __future__ import annotations

import argparse
import ipaddress
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

log = logging.getLogger(__name__)

ROLES = ("router", "scheduler", "worker", "kv-registry", "control-plane", "admin")
LOOPBACK_NAMES = {"localhost", "ip6-localhost"}


class SecurityError(ValueError):
    """A security configuration refused before anything listens."""


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
        """From a service's flags; a configuration that cannot work, or plaintext beyond
        loopback not allowed, exits at once (before any model or connection)."""
        try:
            security = cls.from_files(args.tls_cert, args.tls_key, args.tls_ca, bool(args.allow_plaintext),
                                      args.tls_server_name)
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
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca,
                                           require_client_auth=require_client_cert)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                            certificate_chain=self.cert)

    def channel(self, address: str, options: Sequence[tuple[str, object]] = ()) -> grpc.aio.Channel:
        if self.tls:
            return grpc.aio.secure_channel(address, self.channel_credentials(), options=self._options(address, options))
        return grpc.aio.insecure_channel(address, options=list(options))

    def sync_channel(self, address: str, options: Sequence[tuple[str, object]] = ()) -> grpc.Channel:
        if self.tls:
            return grpc.secure_channel(address, self.channel_credentials(), options=self._options(address, options))
        return grpc.insecure_channel(address, options=list(options))

    def _options(self, address: str, options: Sequence[tuple[str, object]]) -> list[tuple[str, object]]:
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


def add_security_arguments(ap: argparse.ArgumentParser) -> None:
    group = ap.add_argument_group("transport security")
    group.add_argument("--tls-cert", default=None, help="this service's certificate (PEM); its CN is its mesh role")
    group.add_argument("--tls-key", default=None, help="the certificate's private key (PEM)")
    group.add_argument("--tls-ca", default=None, help="the mesh's CA certificate (PEM): peers must chain to it")
    group.add_argument("--tls-server-name", default=None,
                       help="check peers' certificates for this name rather than the host dialled (a mesh whose "
                            "workers advertise IP addresses: every certificate lists the name, e.g. kervan-mesh)")
    group.add_argument("--allow-plaintext", action="store_true",
                       help="listen beyond loopback without TLS (not advised: every RPC open to the network)")
