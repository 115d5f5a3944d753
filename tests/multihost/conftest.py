"""The mesh over simulated hosts (``control_plane/hosts/``): network namespaces with their own
addresses and ``/dev/shm``, joined by a switch, links shaped by ``tc``. Everything here skips,
with the reason, where such hosts cannot be made (not root, no ``ip``/``tc``/``unshare``)."""

from __future__ import annotations

import pytest

from tests.multihost.hosts import REASON


def pytest_collection_modifyitems(config, items):
    if REASON is None:
        return
    for item in items:
        if "tests/multihost/" in str(item.fspath):
            item.add_marker(pytest.mark.skip(reason=REASON))
