"""A service started by a launcher dies with it.

The launcher (``kervan up``) holds the write end of a pipe and passes the read end
to each child, named by ``KERVAN_LIFELINE_FD``. Nothing is ever written: the read
returns only when every copy of the write end is closed, that is when the launcher
has exited, however it died (SIGKILL included). The child then stops as on SIGTERM
(draining), and exits at once if that takes longer than ``grace_s``. A pipe, not
``PR_SET_PDEATHSIG``: that fires when the launcher's *thread* that started the
child ends, which a launcher driven from a thread pool does long before it exits."""

from __future__ import annotations

import os
import signal
import threading
import time

from kervan.envs import KERVAN_LIFELINE_FD

ENV = KERVAN_LIFELINE_FD


def watch_lifeline(grace_s: float = 30.0) -> bool:
    """Starts the watch when this process was given a lifeline; returns whether it was."""
    fd = os.environ.pop(ENV, None)  # not passed on to this process's own children
    if fd is None or not fd.isdigit():
        return False

    def watch() -> None:
        try:
            while os.read(int(fd), 1):
                pass
        except OSError:
            pass
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_s)
        os._exit(1)

    threading.Thread(target=watch, name="lifeline", daemon=True).start()
    return True
