"""The chaos suite writes one JSON report per run (``chaos-report.json``, or
``$KERVAN_CHAOS_REPORT``): it starts empty."""

import pytest

from tests.chaos.checker import REPORT


@pytest.fixture(scope="session", autouse=True)
def fresh_report():
    REPORT.unlink(missing_ok=True)
    yield
