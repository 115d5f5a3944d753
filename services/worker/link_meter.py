"""What this worker's KV transfers measure of its links: the figure placement prices moving
KV blocks with (``Load.kv_link_bytes_per_s``)."""

from __future__ import annotations

MIN_MEASURED_BYTES = 1 << 20  # a smaller transfer times the round trip, not the link


class LinkMeter:
    """Bytes a second of this worker's recent KV transfers of at least ``MIN_MEASURED_BYTES``
    (an average weighted toward the recent; 0 until one)."""

    def __init__(self) -> None:
        self.bytes_per_s = 0.0

    def observe(self, num_bytes: int, seconds: float) -> None:
        if num_bytes < MIN_MEASURED_BYTES or seconds <= 0:
            return
        rate = num_bytes / seconds
        self.bytes_per_s = rate if not self.bytes_per_s else 0.7 * self.bytes_per_s + 0.3 * rate
