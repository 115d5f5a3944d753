"""A throw-away certificate authority for a local mesh (``kervan up --tls``).

One CA, and one certificate per mesh role whose CN is the role (what servers
check, ``services/common/auth.py``), valid for loopback (``localhost``, 127.0.0.1,
::1), for ``MESH_NAME`` (what ``--tls-server-name`` checks where peers are dialled
by IP address) and any extra host names, usable as both server and client
certificate. ``python -m control_plane.certificates DIR`` writes a set for a
deploy (``deploy/README.md``).
Keys are ECDSA P-256 and written owner-only. Production meshes bring their own
(cert-manager, SPIFFE/SPIRE, a corporate CA) with the same CNs."""

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

from services.common.security import ROLES

MESH_NAME = "kervan-mesh"


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

    def issue(self, role: str, hosts: Sequence[str] = (), valid_days: float = 7.0, name: str | None = None) -> Issued:
        """A certificate whose CN is ``role``, written as ``<name>.pem`` and ``<name>-key.pem``."""
        if role not in ROLES and not role.startswith("test-"):
            raise ValueError(f"role {role!r} is not one of {ROLES}")
        key = ec.generate_private_key(ec.SECP256R1())
        names: list[x509.GeneralName] = [x509.DNSName("localhost"), x509.DNSName(MESH_NAME),
                                         x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                                         x509.IPAddress(ipaddress.ip_address("::1"))]
        for host in hosts:
            try:
                names.append(x509.IPAddress(ipaddress.ip_address(host)))
            except ValueError:
                names.append(x509.DNSName(host))
        now = _now()
        start = now - datetime.timedelta(minutes=5)
        end = now + datetime.timedelta(days=valid_days)
        if valid_days < 0:  # an expired certificate (tests): valid for a day that is over
            start = end - datetime.timedelta(days=1)
        cert = (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, role)]))
                .issuer_name(self.cert.subject).public_key(key.public_key())
                .serial_number(x509.random_serial_number()).not_valid_before(start).not_valid_after(end)
                .add_extension(x509.SubjectAlternativeName(names), critical=False)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                      ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
                .sign(self.key, hashes.SHA256()))
        name = name or role
        cert_path, key_path = self.directory / f"{name}.pem", self.directory / f"{name}-key.pem"
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                      serialization.NoEncryption()))
        return Issued(cert_path, key_path, self.ca_path)


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def main(argv: list[str] | None = None) -> None:
    import argparse
    ap = argparse.ArgumentParser(prog="python -m control_plane.certificates",
                                 description="Write a mesh CA and a certificate per role (ROLE.pem, ROLE-key.pem).")
    ap.add_argument("directory", type=Path)
    ap.add_argument("--host", action="append", default=[],
                    help="another name or address every certificate is valid for (repeatable), e.g. the "
                         "router's public name")
    ap.add_argument("--days", type=float, default=365.0)
    args = ap.parse_args(argv)
    ca = CertificateAuthority(args.directory, valid_days=args.days)
    for role in ROLES:
        ca.issue(role, args.host, args.days)
    print(f"wrote {ca.ca_path} and a certificate per role ({', '.join(ROLES)}) in {args.directory}")


if __name__ == "__main__":
    main()
