"""What batch invariance costs: the engine as it is against the engine before it (a checkout
of commit 6ed6c80, whose linears took oneDNN's kernels chosen by the row count, whose prompts
took SDPA, and whose quantized weights rounded x to int8 in decode rows only), on the same
machine, in the same run.

For each model and dtype, each system runs in a process of its own (``PYTHONPATH`` the
checkout), a fresh engine per round, rounds alternating the systems' order, and measures
through the public ``Engine`` API both versions share:

- ``batch_1_ms``: a 64-token prompt, then 64 greedy steps: the median step;
- ``batch_16_ms``: 16 such sequences decoding together: the median step;
- ``pp_512_tok_s`` and ``pp_2048_tok_s``: one prompt of that many tokens (a new one each
  round, prefix caching off), its tokens over the wall time of its prefill.

Each ratio is the median of the per-round ratios (the current engine's speed over the
baseline's: above 1.0 it is faster), with its min and max. The pass marks, fixed before the
run: decode (batch 1 and 16) at least 0.9 of the baseline on every model; prompts at least
0.5 on the float models. Prompts of quantized models have no mark: their int8-activation
kernel now takes every prompt row as well (``benchmarks/quant_activations.py``).

    git worktree add /tmp/kervan-before 6ed6c80
    python -m benchmarks.invariance_cost --baseline /tmp/kervan-before \\
        --model smollm2-gguf=~/.cache/kervan/models/smollm2-135m:auto \\
        --json-out benchmarks/results/invariance_cost-amx.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks.machine import machine, write_report
from benchmarks.stats import spread

# runs in the checkout under test: the Engine API both versions share, one JSON line out
MEASURE = """
import json, sys, time, random
from statistics import median
import logging; logging.disable(logging.WARNING)
from worker import Engine, SamplingParams
model, dtype, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
engine = Engine.from_pretrained(model, dtype=dtype, enable_prefix_caching=False, max_num_batched_tokens=2048,
                                max_num_seqs=16)
rnd = random.Random(seed)
def prompt(n): return [rnd.randrange(100, 40000) for _ in range(n)]
def steps(batch):
    for _ in range(batch):
        engine.add_request(prompt(64), SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))
    while any(s.num_computed_tokens < s.num_tokens - 1 for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    walls = []
    while engine.has_unfinished_requests():
        start = time.perf_counter(); engine.step(); walls.append(time.perf_counter() - start)
    return median(walls) * 1e3
def prefill(n):
    p = prompt(n)
    start = time.perf_counter()
    engine.generate([p], SamplingParams(max_tokens=1, temperature=0.0))
    return n / (time.perf_counter() - start)
steps(1); prefill(64)  # warm: code paths, kernels' state
out = {"batch_1_ms": steps(1), "batch_16_ms": steps(16), "pp_512_tok_s": prefill(512), "pp_2048_tok_s": prefill(2048)}
print(json.dumps(out))
"""
HIGHER_IS_FASTER = {"batch_1_ms": False, "batch_16_ms": False, "pp_512_tok_s": True, "pp_2048_tok_s": True}


def measure(checkout: Path, model: str, dtype: str, seed: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    res = subprocess.run([sys.executable, "-c", MEASURE, model, dtype, str(seed)], env=env, capture_output=True,
                         text=True, timeout=3600, cwd=checkout)
    if res.returncode != 0:
        raise RuntimeError(f"{checkout}: {res.stderr[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", required=True, help="a checkout of the engine before batch invariance")
    ap.add_argument("--model", action="append", required=True, metavar="LABEL=DIR:DTYPE")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    here = Path(__file__).resolve().parents[1]
    systems = {"current": here, "baseline": Path(args.baseline).resolve()}
    base_commit = subprocess.run(["git", "-C", str(systems["baseline"]), "rev-parse", "HEAD"], capture_output=True,
                                 text=True).stdout.strip()
    models: dict = {}
    for spec in args.model:
        label, rest = spec.split("=", 1)
        model_dir, dtype = rest.rsplit(":", 1)
        rounds: dict[str, list[dict]] = {name: [] for name in systems}
        for r in range(args.rounds):
            for name in (list(systems) if r % 2 == 0 else list(systems)[::-1]):
                rounds[name].append(measure(systems[name], os.path.expanduser(model_dir), dtype, seed=r))
                print(label, name, r, rounds[name][-1], flush=True)
        ratios = {}
        for key, higher in HIGHER_IS_FASTER.items():
            pairs = [(c[key], b[key]) for c, b in zip(rounds["current"], rounds["baseline"])]
            ratios[key] = spread([c / b if higher else b / c for c, b in pairs])
        models[label] = {"model": model_dir, "dtype": dtype, "rounds": rounds, "current_over_baseline": ratios,
                         **{name: {key: spread([x[key] for x in rounds[name]]) for key in HIGHER_IS_FASTER}
                            for name in systems}}
    write_report({"benchmark": "invariance_cost", "machine": machine("auto"), "baseline_commit": base_commit,
                  "rounds": args.rounds, "models": models}, args.json_out, args)


if __name__ == "__main__":
    main()
