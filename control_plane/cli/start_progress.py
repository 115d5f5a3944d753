"""``kervan up``'s start as a person sees it: one line, redrawn from the launcher's wait loop
(no thread of its own), naming the services that serve and those still starting (a worker
loads its model before it serves)."""

from __future__ import annotations

from typing import Any


class StartProgress:
    def __init__(self, line: Any):
        self.line = line  # a tqdm line (kervan.progress.Phases.phase)
        self.last = ""

    def show(self, serving: list[str], starting: list[str]) -> None:
        text = f"starting the cluster: {len(serving)} up"
        if starting:
            text += f", waiting for {', '.join(starting)}"
        if text != self.last:
            self.last = text
            self.line.set_description_str(text, refresh=False)
        self.line.refresh()  # the elapsed time, every call
