"""The mesh over simulated hosts (``control_plane/hosts/``): network namespaces with their own
addresses and ``/dev/shm``, joined by a switch, links shaped by ``tc``. Everything here skips,
with the reason, where such hosts cannot be made (not root, no ``ip``/``tc``/``unshare``)."""

from __future__ import annotations

import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from control_plane.hosts.network import unavailable_reason

REASON = unavailable_reason()


def pytest_collection_modifyitems(config, items):
    if REASON is None:
        return
    for item in items:
        if "tests/multihost/" in str(item.fspath):
            item.add_marker(pytest.mark.skip(reason=REASON))


def scrape(address: str) -> dict[tuple[str, tuple], float]:
    """A service's metrics: (sample name, sorted labels) -> value."""
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}
