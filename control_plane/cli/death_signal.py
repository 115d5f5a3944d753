"""A child that dies with its launcher: ``PR_SET_PDEATHSIG`` set between fork and exec, for
redis-server (which cannot watch the launcher's lifeline pipe as Kervan's services do)."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Callable

PR_SET_PDEATHSIG = 1
# resolved here, at import: a forked child must not load libraries before exec
_PRCTL = ctypes.CDLL(None).prctl if sys.platform.startswith("linux") else None


def death_signal(launcher: int) -> Callable[[], None] | None:
    """A preexec_fn: SIGTERM to the child when the launcher's thread that started it ends
    (with no other thread, the launcher's end); None where the kernel has no such signal."""
    if _PRCTL is None:
        return None

    def setup() -> None:
        _PRCTL(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != launcher:  # the launcher died before prctl took effect
            os._exit(1)
    return setup
