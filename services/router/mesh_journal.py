"""What this router did lately, for the mesh page (``GET /mesh``): its last placements and
migrations, newest first. Bounded and in memory only: each router keeps its own."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import asdict, dataclass

JOURNAL_SIZE = 50  # events of each kind kept


@dataclass(frozen=True)
class MeshEvent:
    at: float  # unix time
    request_id: str  # the id the workers know (this router's own, not the client's)
    worker: str = ""  # an aggregated placement's worker, or a migration's lost worker
    prefill: str = ""
    decode: str = ""
    reason: str = ""  # the scheduler's prefill reason, or why a request migrated
    delivered: int = 0  # a migration: the tokens the client had when its worker was lost


class MeshJournal:
    def __init__(self, size: int = JOURNAL_SIZE):
        self.placements: deque[MeshEvent] = deque(maxlen=size)
        self.migrations: deque[MeshEvent] = deque(maxlen=size)

    def placed(self, request_id: str, worker: str, prefill: str, decode: str, reason: str) -> None:
        self.placements.appendleft(MeshEvent(time.time(), request_id, worker, prefill, decode, reason))

    def migrated(self, request_id: str, lost: str, why: str, delivered: int) -> None:
        self.migrations.appendleft(MeshEvent(time.time(), request_id, worker=lost, reason=why, delivered=delivered))

    def recent(self) -> dict[str, list[dict[str, object]]]:
        return {"placements": [asdict(e) for e in self.placements],
                "migrations": [asdict(e) for e in self.migrations]}
