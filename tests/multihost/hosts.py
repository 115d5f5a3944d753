"""What the multi-host tests share: whether simulated hosts can be made here, and a service's
metrics read over the hosts' network."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from control_plane.hosts.network import unavailable_reason

REASON = unavailable_reason()  # None where hosts can be made


def scrape(address: str) -> dict[tuple[str, tuple], float]:
    """A service's metrics: (sample name, sorted labels) -> value."""
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}
