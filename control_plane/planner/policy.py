# mypy: disable-error-code="arg-type"
"""The planner's decision, a pure function of what it observed: how many prefill and
decode workers the next interval needs.

    predicted load = the predictor's rate for the next interval; the prompt and output
                     lengths' means over the last four intervals with requests
    decode workers = that load's output tokens/s over one worker's at the largest batch
                     whose step meets the ITL target
    prefill workers = the fewest whose TTFT (the prompt, the M/G/1 queue, the hand-over)
                      meets the TTFT target
    steps = the profile's (or the roofline's) times the pool's correction: what the router
            measured (ITL, TTFT) over what the profile expects at the load and pools just
            seen, smoothed (the serving loop, the network and sharing a machine's cores are
            in the one and not the other)

A pool also grows by one when its workers report a queue (requests waiting for the decode
pool, or its KV cache nearly full), whatever the arithmetic says. Then the bounds, and the
cool-downs: a pool grows at once to what is needed (at most once per ``scale_up_cooldown_s``)
and shrinks by one worker at a time, only to the most it needed over the last
``scale_down_cooldown_s`` (the HorizontalPodAutoscaler's stabilization window: one quiet
interval of a Poisson load is noise, and a flapping pool starts and drains workers for
nothing)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from control_plane.plan.pools import decode_pool, prefill_pool, prefill_ttft_s
from control_plane.plan.sizing import Layout, Load, Sizer, Slo
from control_plane.planner.metrics import Observation
from control_plane.planner.predictor import PREDICTORS, Average
from kervan.worker_info import WorkerRole

CORRECTION_RANGE = (0.5, 8.0)  # a measurement outside this says more about the measurement
CORRECTION_SMOOTHING = 0.5  # weight of the newest interval's ratio
KV_FULL = 0.9  # a decode pool this full grows
ONE_DEVICE = Layout(1, 1)  # a worker's layout (a worker group's is given)


@dataclass(frozen=True)
class PlannerConfig:
    slo: Slo
    min_prefill: int = 1
    max_prefill: int = 4
    min_decode: int = 1
    max_decode: int = 4
    interval_s: float = 10.0
    scale_up_cooldown_s: float = 10.0
    scale_down_cooldown_s: float = 60.0
    predictor: str = "constant"
    correct: bool = True  # apply the measured corrections

    def __post_init__(self) -> None:
        if not 0 <= self.min_prefill <= self.max_prefill:
            raise ValueError(f"prefill bounds {self.min_prefill}..{self.max_prefill}: need 0 <= min <= max")
        if not 1 <= self.min_decode <= self.max_decode:
            raise ValueError(f"decode bounds {self.min_decode}..{self.max_decode}: need 1 <= min <= max")
        if self.interval_s <= 0 or self.scale_up_cooldown_s < 0 or self.scale_down_cooldown_s < 0:
            raise ValueError("the interval must be positive and the cool-downs not negative")
        if self.predictor not in PREDICTORS:
            raise ValueError(f"predictor {self.predictor!r}: one of {', '.join(PREDICTORS)}")
        if self.slo.ttft_s <= 0 or self.slo.itl_s <= 0:
            raise ValueError("the TTFT and ITL targets must be positive")

    def bounds(self, pool: str) -> tuple[int, int]:
        if pool == WorkerRole.PREFILL:
            return self.min_prefill, self.max_prefill
        return self.min_decode, self.max_decode


@dataclass(frozen=True)
class Decision:
    target: dict[str, int]  # pool -> workers it should have
    needed: dict[str, int]  # before bounds and cool-downs
    load: dict[str, float]  # the predicted rate, input_len, output_len
    corrections: dict[str, float]
    reasons: list[str] = field(default_factory=list)


class CorrectedSizer:
    """A sizer whose decode steps and prefill chunks take ``corrections`` times as long."""

    def __init__(self, sizer: Sizer, corrections: dict[str, float]):
        self.sizer, self.corrections = sizer, corrections

    def __getattr__(self, name: str):
        return getattr(self.sizer, name)

    def decode_step_s(self, layout: Layout, batch: int, context: float) -> dict:
        step = self.sizer.decode_step_s(layout, batch, context)
        return {**step, "step_s": step["step_s"] * self.corrections[WorkerRole.DECODE]}

    def prefill_chunk_s(self, layout: Layout, tokens: int, context: float, decode_batch: int = 0) -> dict:
        step = self.sizer.prefill_chunk_s(layout, tokens, context, decode_batch)
        return {**step, "step_s": step["step_s"] * self.corrections[WorkerRole.PREFILL]}


class Policy:
    """Holds the predictors, corrections, last changes and each pool's recent needs between intervals."""

    def __init__(self, sizer: Sizer, config: PlannerConfig, layout: Layout = ONE_DEVICE):
        self.sizer, self.config, self.layout = sizer, config, layout
        self.predictors = {"rate": PREDICTORS[config.predictor](), "input_len": Average(), "output_len": Average()}
        self.corrections: dict[str, float] = {WorkerRole.DECODE: 1.0, WorkerRole.PREFILL: 1.0}
        self.last_change: dict[str, float] = {}
        # (when, needed) per pool
        self.history: dict[str, list[tuple[float, int]]] = {WorkerRole.PREFILL: [], WorkerRole.DECODE: []}
        self.started: float | None = None  # the first decision: a planner (re)started shrinks nothing for a window

    def decide(self, obs: Observation, current: dict[str, int], now: float) -> Decision:
        self.predictors["rate"].add(obs.rate)
        for key in ("input_len", "output_len"):
            if getattr(obs, key) > 0:  # no request: the lengths stay what they were
                self.predictors[key].add(getattr(obs, key))
        predicted = {k: p.predict() for k, p in self.predictors.items()}
        if predicted["input_len"] is None or predicted["output_len"] is None:  # never a request yet
            needed: dict[str, int] = {WorkerRole.PREFILL: 0, WorkerRole.DECODE: 0}
            reasons = ["no request seen yet: the pools' minimums"]
        else:
            needed, reasons = self._needed(obs, current, predicted)
        target, more = self._bounded(needed, current, now)
        return Decision(target, needed, {k: round(v or 0.0, 4) for k, v in predicted.items()},
                        dict(self.corrections), reasons + more)

    def _needed(self, obs: Observation, current: dict[str, int], predicted: dict) -> tuple[dict, list[str]]:
        slo, layout = self.config.slo, self.layout
        isl, osl = max(1.0, predicted["input_len"]), max(1.0, predicted["output_len"])
        context = isl + osl / 2
        memory = self.sizer.memory(layout, math.ceil(isl + osl))
        self._correct(obs, current, isl, osl, context)
        load = Load(predicted["rate"], isl, osl, math.ceil(isl), math.ceil(osl))
        sizer = CorrectedSizer(self.sizer, self.corrections)
        d = decode_pool(sizer, layout, memory, load, slo, context)
        p = prefill_pool(sizer, layout, load, slo, d.operating_batch)
        needed: dict[str, int] = {WorkerRole.PREFILL: p.workers, WorkerRole.DECODE: d.workers}
        reasons = [f"predicted {load.rate:.3g} req/s of {isl:.0f} prompt and {osl:.0f} output tokens",
                   f"decode: {load.rate * osl:.3g} tok/s over {d.tokens_per_s_per_worker:.3g} a worker (batch "
                   f"{d.max_batch} within ITL {slo.itl_s * 1e3:g} ms, steps x{self.corrections[WorkerRole.DECODE]:.2f} "
                   f"measured) -> {d.workers}",
                   f"prefill: {p.workers} worker(s) for TTFT {p.ttft_s * 1e3:.0f} ms (steps "
                   f"x{self.corrections[WorkerRole.PREFILL]:.2f} measured) within {slo.ttft_s * 1e3:g} ms"]
        if obs.decode_waiting >= max(1, obs.num_workers.get(WorkerRole.DECODE, 1)) or obs.decode_kv_usage >= KV_FULL:
            needed[WorkerRole.DECODE] = max(needed[WorkerRole.DECODE], current[WorkerRole.DECODE] + 1)
            reasons.append(f"decode pool queueing ({obs.decode_waiting:g} waiting, KV {obs.decode_kv_usage:.0%} "
                           f"full): one more")
        return needed, reasons

    def _correct(self, obs: Observation, current: dict[str, int], isl: float, osl: float, context: float) -> None:
        """Measured over expected, at the load just seen on the pools just seen."""
        if not self.config.correct:
            return
        ratios: dict[str, float] = {}
        if obs.itl_mean_s and obs.decode_running >= 1:
            expected = self.sizer.decode_step_s(self.layout, obs.decode_running, context)["step_s"]
            ratios[WorkerRole.DECODE] = obs.itl_mean_s / expected
        if obs.ttft_mean_s and obs.rate > 0 and current.get(WorkerRole.PREFILL, 0) > 0:
            seen = Load(obs.rate, isl, osl, math.ceil(isl), math.ceil(osl))
            batch = max(1, round(obs.decode_running / max(1, current.get(WorkerRole.DECODE, 1))))
            expected = prefill_ttft_s(self.sizer, self.layout, seen, current[WorkerRole.PREFILL], batch)["ttft_s"]
            if math.isfinite(expected):
                ratios[WorkerRole.PREFILL] = obs.ttft_mean_s / expected
        lo, hi = CORRECTION_RANGE
        for pool, ratio in ratios.items():
            mixed = (1 - CORRECTION_SMOOTHING) * self.corrections[pool] + CORRECTION_SMOOTHING * ratio
            self.corrections[pool] = min(hi, max(lo, mixed))

    def _bounded(self, needed: dict[str, int], current: dict[str, int], now: float) -> tuple[dict, list[str]]:
        cfg, target, reasons = self.config, {}, []
        self.started = now if self.started is None else self.started
        for pool in (WorkerRole.PREFILL, WorkerRole.DECODE):
            lo, hi = cfg.bounds(pool)
            want, have = min(hi, max(lo, needed[pool])), current[pool]
            history = self.history[pool]
            history.append((now, want))
            while history and history[0][0] < now - cfg.scale_down_cooldown_s:
                history.pop(0)
            if want > have and now - self.last_change.get(pool, -math.inf) < cfg.scale_up_cooldown_s:
                reasons.append(f"{pool}: {have} -> {want} waits out the scale-up cool-down")
                want = have
            elif want < have:
                window = max(n for _, n in history)
                if now - self.started < cfg.scale_down_cooldown_s:
                    reasons.append(f"{pool}: {have} -> {want} waits: the planner has not seen a whole window yet")
                    want = have
                elif window >= have:
                    reasons.append(f"{pool}: {have} -> {want} waits: {window} needed within the last "
                                   f"{cfg.scale_down_cooldown_s:g}s")
                    want = have
                else:
                    want = have - 1  # one drain at a time
            if want != have:
                self.last_change[pool] = now
                reasons.append(f"{pool}: {have} -> {want}")
            target[pool] = want
        return target, reasons
