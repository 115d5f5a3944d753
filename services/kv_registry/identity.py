"""Who may register what, on a mesh with TLS: the worker certificate a ``Register``
arrives with.

- A certificate that names addresses (``kervan-worker://HOST:PORT`` URIs among its SANs,
  as ``kervan up`` issues one per worker) may register only those, and only as
  ``ROLE@ADDRESS``: it can neither advertise another worker's address (and be sent its
  tenants' requests) nor hold another worker's id (and lock it out). The registry's
  ``--require-worker-addresses`` refuses certificates that name none.
- One live registration per certificate and address: a second worker id for the same
  address under a certificate whose first registration's lease is live is refused
  (``PrefixIndex.claim_identity``). Many workers may share a certificate that names no
  address (a Kubernetes deploy mounting one ``worker`` secret in every pod): each registers
  its own address.
- A retried ``Register`` gets its landed registration back only from the process that made
  it: the registry keeps a digest of the worker's nonce and the caller's certificate
  (``nonce_digest``), never the nonce, and lists neither.

Without TLS the callers cannot be told apart, and the certificate checks do not apply."""

from __future__ import annotations

import hashlib

import grpc

from kervan.worker_info import WorkerInfo
from services.common.errors import PermissionDenied
from services.common.security import WORKER_ADDRESS_SCHEME


def registration_identity(context: grpc.aio.ServicerContext, worker: WorkerInfo,
                          require_addresses: bool = False) -> str | None:
    """The caller certificate's identity (its SHA-256), after checking that it may
    register ``worker``; None without TLS. Raises ``PermissionDenied``."""
    auth = context.auth_context()
    pems = list(auth.get("x509_pem_cert") or ())
    if not pems:
        return None
    pem = pems[0]
    names = [n.decode(errors="replace") for n in auth.get("x509_subject_alternative_name") or ()]
    addresses = [n[len(WORKER_ADDRESS_SCHEME):] for n in names if n.startswith(WORKER_ADDRESS_SCHEME)]
    if addresses or require_addresses:
        if worker.address not in addresses:
            raise PermissionDenied(f"this certificate may register {', '.join(addresses) or 'no address'}, not "
                                   f"{worker.address!r} (its {WORKER_ADDRESS_SCHEME}HOST:PORT names)")
        if worker.worker_id != WorkerInfo.id_of(worker.role, worker.address):
            raise PermissionDenied(f"a worker registers as ROLE@ADDRESS ({worker.role}@{worker.address}), "
                                   f"not {worker.worker_id!r}")
    return hashlib.sha256(pem).hexdigest()


def nonce_digest(nonce: str, identity: str | None) -> str:
    """What the registry keeps of a registration's nonce: bound to the certificate that
    registered it, so a retry from another caller, even one that learned the nonce, is a new
    registration (refused while the lease is live). "" for no nonce (no retry to recognise)."""
    if not nonce:
        return ""
    return hashlib.sha256(f"kervan-registration\0{identity or ''}\0{nonce}".encode()).hexdigest()
