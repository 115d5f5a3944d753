"""What a worker is to the mesh: its role (``WorkerRole``) and the record it registers
with (``WorkerInfo``), the same on the worker that sends it, in the registry that stores
it and in the scheduler that places by it (``services/common/convert.py`` turns it into
protobuf and back)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from kervan.sampling import RequestLimits


class WorkerRole(str, Enum):
    """A closed set: the value is the name in worker ids (``decode@HOST:PORT``), flags, logs
    and the registry's records (a ``str``, so it formats and compares as that name)."""

    BOTH = "both"  # prefills and decodes its own requests (aggregated)
    PREFILL = "prefill"  # prefills prompts and hands their KV to a decode worker
    DECODE = "decode"  # decodes with KV handed to it (and prefills short prompts itself)

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @property
    def can_decode(self) -> bool:
        """Serves Generate: a request is placed on it to stream tokens."""
        return self is not WorkerRole.PREFILL

    @property
    def can_prefill(self) -> bool:
        """Serves Prefill: it computes a prompt's KV for another worker to decode."""
        return self is not WorkerRole.DECODE


@dataclass(frozen=True, kw_only=True)
class WorkerInfo:
    worker_id: str  # ROLE@ADDRESS
    address: str  # HOST:PORT of its WorkerService
    role: WorkerRole
    model: str
    block_size: int  # tokens per KV block: the mesh's
    hash_name: str  # the block-hash function: the mesh's
    limits: RequestLimits  # the largest request it serves
    kv_capacity_blocks: int = 0  # the most blocks it holds, all tiers (0: not said; the registry's bound)
    registration_nonce: str = ""  # its process's: a retried Register gets the same registration
    incarnation: str = ""  # the fencing token of its registration (the registry's; never listed)

    @staticmethod
    def id_of(role: WorkerRole, address: str) -> str:
        return f"{role}@{address}"
