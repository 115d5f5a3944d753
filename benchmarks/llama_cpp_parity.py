"""Kervan's engine against llama.cpp on the same GGUF file, on this machine, in one run:
the interactive user's comparison (issue 50's mark: batch 1 per token at least llama.cpp's).

Each round runs, in rotated order,
- ``kervan``: the engine as it starts (the decode stack on, kernels chosen by timing);
- ``kervan_modules``: the same engine with ``KERVAN_DECODE_STACK=off`` (decode steps
  through the model's Python modules: what the stack saves);
- ``llama_cpp``: ``llama-bench`` (``tg``: batch-1 generation of ``--new-tokens`` from an
  empty context, ``pp``: one ``--prompt-tokens`` prompt) and ``llama-batched-bench``
  (``--batches`` sequences of 128-token prompts each generating 128 tokens), with the
  builds named on the command line, all threads of this process, ``-r --repetitions``
  (5) per round: each round's figure is llama-bench's own mean over its repetitions.

and measures the same things of Kervan:
- ``batch_1_ms``: a 1-token prompt, then ``--new-tokens`` greedy tokens: their wall time
  over their count (what ``llama-bench``'s ``tg`` averages);
- ``pp_tok_s``: one ``--prompt-tokens`` prompt (a new one each round: no prefix-cache hit),
  prompt tokens over the wall time of its prefill;
- ``batch_N_tok_s``: N requests of 128 prompt tokens, their prefills run first, then the
  128 decode steps timed: N x 128 over that time (``llama-batched-bench``'s ``speed_tg``).

Every ratio is the median of per-round ratios (both sides measured in the same round), with
its min and max. The pass marks, fixed before the run: ``batch_1`` at least 1.0 (Kervan's
tokens per second over llama.cpp's), ``pp`` above 1.0. The report records the builds'
ISA flags (their ``CMakeCache.txt``), what llama-bench says of itself (build commit and
number, CPU, backend, threads, types), where the source came from (``--llama-source``), and
the CPU. ``--no-modules`` leaves ``kervan_modules`` out (the 1B model: rounds are long).

    python -m benchmarks.llama_cpp_parity --model ~/.cache/kervan/models/smollm2-135m \\
        --llama-bench BUILD/bin/llama-bench --batched-bench BUILD/bin/llama-batched-bench \\
        --json-out benchmarks/results/llama_cpp_parity-amx.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from functools import partial
from pathlib import Path

import torch

from benchmarks.machine import machine, write_report
from benchmarks.stats import spread

KERVAN = {"kervan": "auto", "kervan_modules": "off"}  # system -> KERVAN_DECODE_STACK
BATCH_PROMPT = BATCH_NEW = 128  # llama-batched-bench's -npp and -ntg
SAID = ("build_commit", "build_number", "cpu_info", "backends", "n_threads", "type_k", "type_v", "n_batch",
        "n_ubatch", "model_type", "model_size", "model_n_params", "flash_attn", "use_mmap")  # of llama-bench's row


def engine_with(stack: str, args):
    from worker import Engine
    os.environ["KERVAN_DECODE_STACK"] = stack  # read when the engine loads
    try:
        return Engine.from_pretrained(args.model, dtype=args.dtype, max_num_seqs=max(args.batches),
                                      kv_cache_memory_bytes=1 << 30)
    finally:
        del os.environ["KERVAN_DECODE_STACK"]


def greedy(max_tokens: int):
    from worker import SamplingParams
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def batch1_ms(engine, new_tokens: int) -> float:
    engine.add_request([1], greedy(new_tokens + 1))
    engine.step()  # the prompt, and the first token
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return (time.perf_counter() - start) / new_tokens * 1e3


def prompt_rate(engine, tokens: int, seed: int) -> float:
    prompt = [(13 * k + 7919 * seed) % 40000 + 100 for k in range(tokens)]
    engine.add_request(prompt, greedy(1))
    start = time.perf_counter()
    engine.step()
    seconds = time.perf_counter() - start
    while engine.has_unfinished_requests():
        engine.step()
    return tokens / seconds


def batch_rate(engine, batch: int, seed: int) -> float:
    for i in range(batch):
        engine.add_request([(37 * i + 11 * k + seed) % 40000 + 100 for k in range(BATCH_PROMPT)],
                           greedy(BATCH_NEW + 1))
    while engine.scheduler.waiting or any(s.num_computed_tokens < s.num_tokens - 1 for s in engine.scheduler.running):
        engine.step()  # the prefills (each gives the first token)
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return batch * BATCH_NEW / (time.perf_counter() - start)


def kervan_round(engine, args, seed: int) -> dict:
    out = {"batch_1_ms": batch1_ms(engine, args.new_tokens), "pp_tok_s": prompt_rate(engine, args.prompt_tokens, seed)}
    for b in args.batches:
        out[f"batch_{b}_tok_s"] = batch_rate(engine, b, seed)
    return out


def llama_round(args, gguf: str, threads: int) -> dict:
    out = {"batch_1_ms": 1e3 / llama_bench(args, args.llama_bench, gguf, threads, 0, args.new_tokens),
           "pp_tok_s": llama_bench(args, args.llama_bench_pp, gguf, threads, args.prompt_tokens, 0)}
    if args.batched_bench:
        cmd = [args.batched_bench, "-m", gguf, "-t", str(threads), "-c", str(max(args.batches) * 320), "-b", "2048",
               "-ub", "512", "-npp", str(BATCH_PROMPT), "-ntg", str(BATCH_NEW),
               "-npl", ",".join(map(str, args.batches)), "--output-format", "jsonl"]
        lines = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, check=True).stdout.splitlines()
        for row in (json.loads(line) for line in lines if line.startswith("{")):
            out[f"batch_{row['pl']}_tok_s"] = float(row["speed_tg"])
    return out


def llama_bench(args, path: str, gguf: str, threads: int, prompt: int, new_tokens: int) -> float:
    cmd = [path, "-m", gguf, "-t", str(threads), "-p", str(prompt), "-n", str(new_tokens),
           "-r", str(args.repetitions), "-o", "json"]
    [row] = json.loads(subprocess.run(cmd, capture_output=True, text=True, timeout=1200, check=True).stdout)
    args.llama_said = {k: row[k] for k in SAID if k in row}
    return float(row["avg_ts"])


def build_flags(binary: str | None) -> dict:
    """The ISA options a llama.cpp build was configured with (its CMakeCache.txt)."""
    if not binary:
        return {}
    cache = Path(binary).resolve().parent.parent / "CMakeCache.txt"
    if not cache.is_file():
        return {"binary": binary}
    flags = {}
    for line in cache.read_text().splitlines():
        name, _, value = line.partition("=")
        if name.startswith(("GGML_AVX", "GGML_AMX", "GGML_NATIVE", "GGML_F16C", "GGML_FMA", "CMAKE_BUILD_TYPE")):
            flags[name.split(":")[0]] = value
    return {"binary": binary, **flags}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a directory holding the GGUF (kervan pull smollm2-135m)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--llama-bench", required=True, help="llama.cpp's llama-bench (tg, and pp unless --llama-bench-pp)")
    ap.add_argument("--llama-bench-pp", default=None, help="another build's llama-bench for pp (an AMX build's "
                                                            "prompt path may crash: benchmarks/README.md)")
    ap.add_argument("--batched-bench", default=None, help="llama.cpp's llama-batched-bench")
    ap.add_argument("--batches", default="8,32")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--repetitions", type=int, default=5, help="llama-bench's -r in every round")
    ap.add_argument("--llama-source", default=None, help="where the llama.cpp source came from (recorded)")
    ap.add_argument("--no-modules", action="store_true", help="leave kervan_modules out")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    args.llama_bench_pp = args.llama_bench_pp or args.llama_bench
    args.batches = [int(b) for b in args.batches.split(",")]
    gguf = str(next(p for p in os.scandir(args.model) if p.name.endswith(".gguf")).path)
    threads = torch.get_num_threads()
    kervan = {"kervan": KERVAN["kervan"]} if args.no_modules else KERVAN
    engines = {name: engine_with(stack, args) for name, stack in kervan.items()}
    systems = {name: partial(kervan_round, engine, args) for name, engine in engines.items()}
    systems["llama_cpp"] = lambda r: llama_round(args, gguf, threads)
    rounds: dict[str, list[dict]] = {name: [] for name in systems}
    for r in range(args.rounds):
        names = list(systems)
        for name in names[r % len(names):] + names[:r % len(names)]:
            rounds[name].append(systems[name](r))
            print(f"round {r} {name}: " + ", ".join(f"{k} {v:.2f}" for k, v in rounds[name][-1].items()), flush=True)
    metrics = list(rounds["kervan"][0])
    report = {"benchmark": "llama_cpp_parity", "model": gguf, "machine": machine(args.dtype), "threads": threads,
              "llama_cpp_builds": {"tg": build_flags(args.llama_bench), "pp": build_flags(args.llama_bench_pp),
                                   "batched": build_flags(args.batched_bench)},
              "llama_cpp_said": args.llama_said, "llama_cpp_source": args.llama_source,
              "llama_bench_repetitions": args.repetitions,
              "rotation": [names[r % len(names):] + names[:r % len(names)] for r in range(args.rounds)],
              "systems": {name: {m: spread([run[m] for run in runs]) for m in metrics if m in runs[0]}
                          for name, runs in rounds.items()}}
    for name in kervan:  # per round, higher is Kervan's advantage (batch_1: llama.cpp's ms over Kervan's)
        report[f"{name}_vs_llama_cpp"] = {
            m: spread([(ll[m] / k[m]) if m == "batch_1_ms" else (k[m] / ll[m]) for k, ll in zip(rounds[name],
                                                                                            rounds["llama_cpp"])])
            for m in metrics if m in rounds["llama_cpp"][0]}
    report["kervan_vs_kervan_modules"] = {} if args.no_modules else {
        m: spread([(mo[m] / k[m]) if m == "batch_1_ms" else (k[m] / mo[m]) for k, mo in zip(rounds["kervan"],
                                                                                        rounds["kervan_modules"])])
        for m in metrics}
    report["kernel_choices"] = [c.describe() for c in engines["kervan"].runner.kernel_choices]
    for engine in engines.values():
        engine.close()
    write_report(report, args.json_out, args)


if __name__ == "__main__":
    main()
