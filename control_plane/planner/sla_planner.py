"""The SLA planner's loop: every interval, scrape the router and the workers, turn the
difference from the last scrape into an observation, ask the policy how many workers each
pool needs, and tell the scaler. Each interval is one JSON line in the log.

It fails safe: an interval whose router cannot be scraped, or whose scaling call fails, is
logged and changes nothing; a planner that stops (its process gone, or ``kervan up``'s
planner after an unexpected error) leaves the pools as they are. Nothing in the request
path waits on it."""

from __future__ import annotations

import json
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from control_plane.planner import decision_metrics
from control_plane.planner.metrics import POOLS, Scrape, Targets, observe, scrape
from control_plane.planner.policy import Policy
from control_plane.planner.scaler import Scaler


class SlaPlanner:
    def __init__(self, policy: Policy, scaler: Scaler, targets: Targets, log_path: Path | None = None,
                 say=lambda line: print(line, file=sys.stderr, flush=True)):
        self.policy, self.scaler, self.targets, self.log_path, self.say = policy, scaler, targets, log_path, say
        self.next_due: float | None = None
        self.previous: tuple[float, dict[str, Scrape]] | None = None
        self.stopped: str | None = None  # why it stopped, once it has
        self.records: list[dict] = []

    def tick(self, now: float) -> dict | None:
        """One interval's work when it is due (else None); never raises: an unexpected
        error stops the planner and leaves the pools as they are."""
        if self.stopped is not None or (self.next_due is not None and now < self.next_due):
            return None
        self.next_due = now + self.policy.config.interval_s
        try:
            record = self._interval(now)
        except Exception as exc:  # a bug must not take the cluster down with it
            self.stopped = f"{type(exc).__name__}: {exc}"
            record = {"stopped": self.stopped, "traceback": traceback.format_exc()}
            self.say(f"planner stopped ({self.stopped}); the pools stay as they are")
        record["time"] = round(now, 3)
        outcome = "stopped" if "stopped" in record else "skipped" if "skipped" in record else "decided"
        decision_metrics.INTERVALS.labels(outcome).inc()
        self.records.append(record)
        if self.log_path is not None:
            with open(self.log_path, "a") as log:
                log.write(json.dumps(record) + "\n")
        return record

    def _interval(self, now: float) -> dict:
        targets = self.targets()
        try:
            scrapes = {pool: scrape(targets.get(pool, []), required=pool == "router") for pool in POOLS}
        except OSError as exc:
            return {"skipped": f"the router's metrics: {exc}"}
        previous, self.previous = self.previous, (now, scrapes)
        if previous is None:
            return {"skipped": "first scrape (the baseline)"}
        obs = observe(previous[1], scrapes, now - previous[0])
        current = self.scaler.replicas()
        decision = self.policy.decide(obs, current, now)
        record: dict[str, Any] = {"observed": obs.to_json(), "current": current, "predicted": decision.load,
                  "needed": decision.needed, "target": decision.target, "corrections": decision.corrections,
                  "reasons": decision.reasons, "unscraped": [t for s in scrapes.values() for t in s.missing]}
        for pool, n in decision.target.items():
            decision_metrics.TARGET_WORKERS.labels(str(pool)).set(n)
            if n == current[pool]:
                continue
            try:
                self.scaler.scale(pool, n)
            except Exception as exc:  # the orchestrator said no: try again next interval
                record.setdefault("scale_errors", []).append(f"{pool} -> {n}: {type(exc).__name__}: {exc}")
                continue
            decision_metrics.SCALINGS.labels(str(pool), "up" if n > current[pool] else "down").inc()
            self.say(f"planner: {pool} {current[pool]} -> {n} ({'; '.join(decision.reasons[:2])})")
        return record

    def run_forever(self, poll_s: float = 0.5) -> None:
        """The standalone planner's loop (``python -m control_plane.planner``)."""
        while self.stopped is None:
            self.tick(time.monotonic())
            time.sleep(poll_s)


class PlannerThread(threading.Thread):
    """The planner beside a cluster driven from Python (tests, benchmarks), as ``kervan up
    --planner``'s supervise loop runs it: ``reap`` (drained workers gone) then a tick, every
    ``poll_s``, until ``halt`` is set; the pools' sizes at each poll are kept in ``sizes``."""

    def __init__(self, planner: SlaPlanner, reap: Callable[[], object], poll_s: float = 0.2):
        super().__init__(daemon=True)
        self.planner, self.reap, self.poll_s, self.halt = planner, reap, poll_s, threading.Event()
        self.sizes: list[tuple[float, dict[str, int]]] = []  # (monotonic time, pool -> workers)

    def run(self) -> None:
        while not self.halt.is_set():
            self.reap()
            self.planner.tick(time.monotonic())
            self.sizes.append((time.monotonic(), self.planner.scaler.replicas()))
            time.sleep(self.poll_s)

    def stop(self) -> None:
        self.halt.set()
        self.join(timeout=30)
