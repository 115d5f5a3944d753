"""A throw-away certificate authority for a local mesh (``kervan up --tls``).

One CA, and certificates of two kinds:

- a **mesh** certificate per role (or per worker), CN the role (what servers check,
  ``services/common/auth.py``), usable as server and client certificate, valid only for
  ``<role>.kervan-mesh`` (what every mesh client checks when it dials that role, whatever
  address it dials: ``services/common/security.py``) and the role's own extra names: a
  worker's certificate cannot pose as the router or the scheduler. A worker's may also
  name the addresses it may register (``kervan-worker://HOST:PORT`` URIs), which the
  kv-registry holds it to;
- the router's **public** certificate, what its public port serves to clients (``kervan
  generate --tls-ca``, the OpenAI front): valid for loopback and the router's public
  names, server use only, CN ``router-public`` (no mesh role: it opens no internal door).

``python -m control_plane.cli.certificates DIR`` writes a set for a deploy
(``deploy/README.md``). Keys are ECDSA P-256 and written owner-only. Production meshes
bring their own (cert-manager, SPIFFE/SPIRE, a corporate CA) with the same names."""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from services.common.security import MESH_NAME, PUBLIC_ROUTER_CN, ROLES, WORKER_ADDRESS_SCHEME, mesh_name

__all__ = ["MESH_NAME", "CertificateAuthority", "Issued"]


@dataclass(frozen=True)
class Issued:
    cert: Path
    key: Path
    ca: Path

    def flags(self) -> list[str]:
        return ["--tls-cert", str(self.cert), "--tls-key", str(self.key), "--tls-ca", str(self.ca)]


class CertificateAuthority:
    def __init__(self, directory: Path, name: str = "kervan local mesh CA", valid_days: float = 7.0):
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self.key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        now = _now()
        self.cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
                     .public_key(self.key.public_key()).serial_number(x509.random_serial_number())
                     .not_valid_before(now - datetime.timedelta(minutes=5))
                     .not_valid_after(now + datetime.timedelta(days=valid_days))
                     .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                     .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False,
                                                  key_encipherment=False, data_encipherment=False,
                                                  key_agreement=False, key_cert_sign=True, crl_sign=True,
                                                  encipher_only=False, decipher_only=False), critical=True)
                     .sign(self.key, hashes.SHA256()))
        self.ca_path = directory / "ca.pem"
        self.ca_path.write_bytes(self.cert.public_bytes(serialization.Encoding.PEM))

    def issue(self, role: str, hosts: Sequence[str] = (), valid_days: float = 7.0, name: str | None = None,
              addresses: Sequence[str] = ()) -> Issued:
        """A mesh certificate whose CN is ``role``, valid for ``<role>.kervan-mesh`` and
        ``hosts``; ``addresses``: the HOST:PORTs a worker may register. Written as
        ``<name>.pem`` and ``<name>-key.pem``."""
        if role not in ROLES and not role.startswith("test-"):
            raise ValueError(f"role {role!r} is not one of {ROLES}")
        names = [x509.DNSName(mesh_name(role)), *_host_names(hosts),
                 *(x509.UniformResourceIdentifier(f"{WORKER_ADDRESS_SCHEME}{a}") for a in addresses)]
        return self._write(role, names, [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH],
                           valid_days, name or role)

    def issue_public(self, hosts: Sequence[str] = (), valid_days: float = 7.0, name: str = "router-public") -> Issued:
        """The router's public certificate: loopback and ``hosts``, server use only."""
        names = _host_names(["localhost", "127.0.0.1", "::1", *hosts])
        return self._write(PUBLIC_ROUTER_CN, names, [ExtendedKeyUsageOID.SERVER_AUTH], valid_days, name)

    def _write(self, common_name: str, names: list, usages: list, valid_days: float, name: str) -> Issued:
        key = ec.generate_private_key(ec.SECP256R1())
        now = _now()
        start = now - datetime.timedelta(minutes=5)
        end = now + datetime.timedelta(days=valid_days)
        if valid_days < 0:  # an expired certificate (tests): valid for a day that is over
            start = end - datetime.timedelta(days=1)
        cert = (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
                .issuer_name(self.cert.subject).public_key(key.public_key())
                .serial_number(x509.random_serial_number()).not_valid_before(start).not_valid_after(end)
                .add_extension(x509.SubjectAlternativeName(names), critical=False)
                .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
                .sign(self.key, hashes.SHA256()))
        cert_path, key_path = self.directory / f"{name}.pem", self.directory / f"{name}-key.pem"
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                      serialization.NoEncryption()))
        return Issued(cert_path, key_path, self.ca_path)


def _host_names(hosts: Sequence[str]) -> list[x509.GeneralName]:
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return names


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def main(argv: list[str] | None = None) -> None:
    import argparse
    ap = argparse.ArgumentParser(prog="python -m control_plane.cli.certificates",
                                 description="Write a mesh CA, a certificate per role (ROLE.pem, ROLE-key.pem) and "
                                             "the router's public certificate (router-public.pem).")
    ap.add_argument("directory", type=Path)
    ap.add_argument("--host", action="append", default=[],
                    help="a name or address clients reach the router by (repeatable): in its public certificate")
    ap.add_argument("--role-host", action="append", default=[], metavar="ROLE=NAME",
                    help="another name one role's mesh certificate is valid for (repeatable)")
    ap.add_argument("--days", type=float, default=365.0)
    args = ap.parse_args(argv)
    extra: dict[str, list[str]] = {}
    for item in args.role_host:
        role, _, name = item.partition("=")
        if role not in ROLES or not name:
            ap.error(f"--role-host {item!r}: ROLE=NAME with ROLE one of {', '.join(ROLES)}")
        extra.setdefault(role, []).append(name)
    ca = CertificateAuthority(args.directory, valid_days=args.days)
    for role in ROLES:
        ca.issue(role, extra.get(role, ()), args.days)
    ca.issue_public(args.host, args.days)
    print(f"wrote {ca.ca_path}, a certificate per role ({', '.join(ROLES)}) and router-public.pem in {args.directory}")


if __name__ == "__main__":
    main()
