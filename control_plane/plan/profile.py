"""``kervan profile``: the engine's own step times on this machine, for ``kervan plan`` to use
in place of the roofline.

It runs the engine in this process at a few decode batch sizes and context lengths (the
median of several decode steps each, timed after the prompts are in) and at a few prefill
chunk sizes (one prompt of that many tokens, its one step), and stores the curves with the
model, dtype and machine they were measured on. A plan reads a step's time off them:
linear between measured points, and beyond the last one along the last segment.

    kervan profile --model smollm2-135m --out smollm2.profile.json
    kervan plan --model smollm2-135m --hardware this --profile smollm2.profile.json --rate 2"""

from __future__ import annotations

import bisect
import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

DECODE_BATCHES = (1, 4, 16, 64)
CONTEXTS = (128, 512, 2048)
PREFILL_TOKENS = (128, 512, 2048)


@dataclass(frozen=True)
class Profile:
    model: str
    dtype: str
    machine: dict
    decode_s: dict[int, dict[int, float]]  # context -> batch -> median step seconds
    prefill_s: dict[int, float]  # prompt tokens in one step -> its seconds
    served: bool = False  # measured through the serving stack (``served.py``), not the engine alone
    # served only: decode batch running beside -> prompt tokens -> seconds (prefill_s is beside none)
    prefill_busy_s: dict[int, dict[int, float]] = field(default_factory=dict)

    def decode_step_s(self, batch: float, context: float) -> float:
        """A decode step of ``batch`` sequences at ``context`` tokens each, read off the curves."""
        contexts = sorted(self.decode_s)
        per_context = [_along(sorted(self.decode_s[c].items()), batch) for c in contexts]
        return max(_along(list(zip(contexts, per_context)), context), 1e-6)

    def prefill_step_s(self, tokens: float, decode_batch: float = 0) -> float:
        """A prompt chunk of ``tokens``; with a served profile, while ``decode_batch``
        sequences decode beside it (read along the curves measured beside 0, 4, ... of them)."""
        beside = sorted({0: self.prefill_s, **self.prefill_busy_s}.items())
        at = [(b, _along(sorted(curve.items()), tokens)) for b, curve in beside]
        return max(_along(at, decode_batch), 1e-6)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @staticmethod
    def load(path: str | Path) -> Profile:
        raw = json.loads(Path(path).read_text())
        decode = {int(c): {int(b): float(s) for b, s in by.items()} for c, by in raw["decode_s"].items()}
        busy = {int(b): {int(t): float(s) for t, s in by.items()} for b, by in raw.get("prefill_busy_s", {}).items()}
        return Profile(model=raw["model"], dtype=raw["dtype"], machine=raw["machine"], decode_s=decode,
                       prefill_s={int(t): float(s) for t, s in raw["prefill_s"].items()},
                       served=bool(raw.get("served", False)), prefill_busy_s=busy)


def _along(points: list[tuple[int, float]], x: float) -> float:
    """Linear through ``points`` (sorted by x), extended along the end segments where they
    rise and flat where they fall: a step is never faster for more sequences or a longer
    context, and two noisy medians must not extrapolate to a step of no time at all."""
    if len(points) == 1:
        return points[0][1]
    xs = [p[0] for p in points]
    i = min(max(bisect.bisect_left(xs, x), 1), len(points) - 1)
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    if x > x1 and y1 < y0:
        return y1
    if x < x0 and y1 < y0:
        return y0
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def measure(model_dir: str | Path, dtype: str = "auto", batches=DECODE_BATCHES, contexts=CONTEXTS,
            prefill_tokens=PREFILL_TOKENS, steps: int = 8, say=lambda line: None) -> Profile:
    """The engine's curves on this machine (minutes for a small model on two cores)."""
    from worker import Engine
    from worker.platform import current_platform, dtype_name

    cap = max(contexts) + steps + 16
    engine = Engine.from_pretrained(model_dir, dtype=dtype, max_num_seqs=max(batches),
                                    max_num_batched_tokens=max(max(prefill_tokens), max(batches)),
                                    num_kv_blocks=max(batches) * (cap // 16 + 2) + 16, enable_prefix_caching=False)
    vocab = engine.model_config.vocab_size
    try:
        _decode(engine, 1, 16, 2, vocab)  # first calls: kernels, oneDNN's primitives
        decode = {}
        for context in contexts:
            decode[context] = {b: _decode(engine, b, context, steps, vocab) for b in batches}
            say(f"decode at context {context}: " + ", ".join(f"batch {b} {s * 1e3:.1f} ms"
                                                            for b, s in decode[context].items()))
        prefill = {t: _prefill(engine, t, vocab) for t in prefill_tokens}
        say("prefill: " + ", ".join(f"{t} tokens {s * 1e3:.1f} ms" for t, s in prefill.items()))
        cpu = current_platform().cpu
        machine = {"cpu": cpu.model, "isa": cpu.isa, "amx": cpu.has_amx, "cores": cpu.num_cores}
        return Profile(model=str(model_dir), dtype=dtype_name(engine.config.dtype), machine=machine,
                       decode_s=decode, prefill_s=prefill)
    finally:
        engine.close()


def synthetic_prompt(n: int, vocab: int, seed: int) -> list[int]:
    return [3 + (seed * 7919 + i * 104729) % (vocab - 3) for i in range(n)]


def _decode(engine, batch: int, context: int, steps: int, vocab: int) -> float:
    from kervan.sampling import SamplingParams

    params = SamplingParams(max_tokens=steps + 4, temperature=0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(synthetic_prompt(context, vocab, i), params)
    while engine.stats().num_prefill_tokens:  # the prompts in first: only decode steps are timed
        engine.step()
    engine.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    while engine.has_unfinished_requests():
        engine.step()
    return statistics.median(times)


def _prefill(engine, tokens: int, vocab: int, repeats: int = 3) -> float:
    from kervan.sampling import SamplingParams

    times = []
    for r in range(repeats):
        engine.add_request(synthetic_prompt(tokens, vocab, 1000 + r), SamplingParams(max_tokens=1, temperature=0))
        start = time.perf_counter()
        engine.step()  # the whole prompt in one step: the budget is at least its length
        times.append(time.perf_counter() - start)
        while engine.has_unfinished_requests():
            engine.step()
    return statistics.median(times)
