"""Who may register what (``services/kv_registry/identity.py``), on the certificate a call
arrives with: the addresses it names, the id it may hold, and what the registry keeps of a
registration's nonce."""

from __future__ import annotations

import pytest

from kervan.sampling import RequestLimits
from kervan.worker_info import WorkerInfo, WorkerRole
from services.common.errors import PermissionDenied
from services.common.security import WORKER_ADDRESS_SCHEME
from services.kv_registry.identity import nonce_digest, registration_identity


class Context:
    def __init__(self, pem: bytes | None, addresses: list[str] = ()):
        names = [b"worker.kervan-mesh", *(f"{WORKER_ADDRESS_SCHEME}{a}".encode() for a in addresses)]
        self._auth = {} if pem is None else {"x509_pem_cert": [pem], "x509_subject_alternative_name": names}

    def auth_context(self):
        return self._auth


def worker(address: str, worker_id: str | None = None) -> WorkerInfo:
    return WorkerInfo(worker_id=worker_id or f"decode@{address}", address=address, role=WorkerRole.DECODE,
                      model="m", block_size=16, hash_name="sha256", limits=RequestLimits(max_model_len=64, max_n=1))


def test_a_certificate_naming_addresses_registers_only_those_as_role_at_address():
    ctx = Context(b"cert-a", ["10.0.0.5:50060"])
    assert registration_identity(ctx, worker("10.0.0.5:50060")) == registration_identity(ctx, worker("10.0.0.5:50060"))
    with pytest.raises(PermissionDenied, match="may register 10.0.0.5:50060, not '10.0.0.6:50060'"):
        registration_identity(ctx, worker("10.0.0.6:50060"))
    with pytest.raises(PermissionDenied, match="ROLE@ADDRESS"):
        registration_identity(ctx, worker("10.0.0.5:50060", "decode@other"))


def test_required_addresses_refuse_a_certificate_naming_none_and_without_tls_nothing_is_checked():
    shared = Context(b"cert-shared")
    assert registration_identity(shared, worker("10.0.0.7:50060")) is not None  # the k8s deploy's shared one
    with pytest.raises(PermissionDenied, match="may register no address"):
        registration_identity(shared, worker("10.0.0.7:50060"), require_addresses=True)
    assert registration_identity(Context(None), worker("10.0.0.7:50060"), require_addresses=True) is None


def test_the_nonce_is_kept_as_a_digest_bound_to_the_certificate():
    assert nonce_digest("", "cert") == ""
    assert nonce_digest("n", "cert-a") != nonce_digest("n", "cert-b") != nonce_digest("n", None)
    assert len(nonce_digest("n", "cert-a")) == 64  # a SHA-256: the nonce itself is never stored
