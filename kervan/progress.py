"""Progress for the waits a person sits through: a pull, the kernel build, a model load, a
cluster's start, a benchmark. Bars are tqdm's, on stderr, and drawn only where stderr is a
terminal and neither ``--quiet`` nor ``KERVAN_QUIET`` asks for none; either way each phase
says one line as it ends, so logs and pipes stay readable and still show where the time went.
Every phase's wall time is kept (``Phases.timings``) for the summary a first start prints."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from kervan import envs

TICK_S = 0.2  # how often a phase's elapsed time is redrawn


def is_drawn(quiet: bool = False) -> bool:
    return not quiet and not envs.quiet() and sys.stderr.isatty()


def bar(total: float | None, desc: str, unit: str = "it", quiet: bool = False, **kwargs: Any) -> Any:
    """A tqdm bar on stderr; a disabled one (every call a no-op) when not drawn."""
    from tqdm import tqdm
    tqdm.monitor_interval = 0  # no monitor thread: `kervan up`'s launcher must run no thread of ours (phase)
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, disable=not is_drawn(quiet), leave=False,
                dynamic_ncols=True, **kwargs)


class Phases:
    """Named phases, each timed; ``phase`` draws a live elapsed-time line while it runs
    (unless ``quiet``) and prints one line with its wall time when it ends."""

    def __init__(self, quiet: bool = False):
        self.quiet = quiet
        self.timings: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str, doing: str, ticking: bool = True) -> Iterator[Any]:
        """``doing`` is drawn with its elapsed time until the block ends; the block gets a
        handle whose ``set_description_str`` renames what it is doing. ``ticking``: a thread
        redraws it; without, the block calls ``refresh`` (a block that starts processes with a
        ``preexec_fn`` must run no other thread: the launcher's Redis)."""
        start = time.perf_counter()
        line = bar(None, doing, quiet=self.quiet, bar_format="{desc} {elapsed}")
        stop = threading.Event()
        ticker = threading.Thread(target=_tick, args=(line, stop), daemon=True) if ticking and not line.disable \
            else None
        if ticker is not None:
            ticker.start()
        try:
            yield line
        finally:
            stop.set()
            if ticker is not None:
                ticker.join()
            line.close()
            took = self.timings[name] = time.perf_counter() - start
            print(f"{doing}: {took:.1f} s", file=sys.stderr, flush=True)

    def summary(self) -> str:
        return ", ".join(f"{name} {took:.1f} s" for name, took in self.timings.items())


def _tick(line: Any, stop: threading.Event) -> None:
    while not stop.wait(TICK_S):
        line.refresh()
