"""The README's result tables, generated from the raw JSON under ``benchmarks/results/``.

Every number a table quotes is read from a committed report, never typed in:

    python -m benchmarks.tables            # rewrite the generated tables in benchmarks/README.md
    python -m benchmarks.tables --check    # exit 1 if the README's tables differ from the JSON

A generated table sits between ``<!-- table: NAME -->`` and ``<!-- end table -->`` in the
README; ``tests/test_benchmark_tables.py`` fails when one is stale."""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

HERE = Path(__file__).parent
RESULTS = HERE / "results"
README = HERE / "README.md"
BLOCK = re.compile(r"(<!-- table: (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- end table -->)", re.S)


def _range(ratio: dict) -> str:
    return f"**{ratio['median']:.2f}** ({ratio['min']:.2f}–{ratio['max']:.2f})"


def _tok_s(values: list[float]) -> str:
    return f"{sorted(values)[len(values) // 2]:,.1f} ({min(values):,.1f}–{max(values):,.1f})"


def _reports(benchmark: str):
    """(the report's cell: file and commit, the report) for each committed ``benchmark-*.json``."""
    for path in sorted(RESULTS.glob(f"{benchmark}-*.json")):
        report = json.loads(path.read_text())
        yield f"`{path.name}` ({report['commit']})", report


def engine_throughput() -> str:
    """One row per (report, dtype): Kervan's throughput, deterministic mode's cost, vLLM."""
    rows = ["| report | CPU (ISA) | model | dtype | rounds | Kervan tok/s | deterministic / default | vLLM tok/s "
            "| Kervan / vLLM |",
            "|---|---|---|---|---|---|---|---|---|"]
    for label, report in _reports("engine_throughput"):
        machine = report["machine"]
        features = [machine["isa"]] + ["native bf16"] * machine["native_bf16"] + ["AMX"] * machine.get("amx", False)
        cpu = f"{machine['cpu']} ({', '.join(features)})"
        model = Path(report["model"]).name
        for by_dtype in report["dtypes"].values():
            runs = by_dtype["runs"]

            def tok_s(system: str, runs=runs) -> str:
                have = [r[system]["output_tokens_per_s"] for r in runs if system in r]
                return _tok_s(have) if have else "–"

            det = by_dtype.get("kervan_deterministic_vs_kervan")
            vllm = by_dtype.get("kervan_vs_vllm")
            rows.append(f"| {label} | {cpu} | {model} | {by_dtype['dtype']} | {len(runs)} "
                        f"| {tok_s('kervan')} | {_range(det) if det else '–'} | {tok_s('vllm')} "
                        f"| {_range(vllm) if vllm else '–'} |")
    return "\n".join(rows) + "\n"


def step_profile() -> str:
    """One row per (report, step): its time, its bound, and where the time went."""
    rows = ["| report | step | wall ms | bound ms (memory / compute) | bound share | linear | attention | norm + "
            "activation + rotary | other ops | Python |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for label, report in _reports("step_profile"):
        for point in report["points"]:
            ops = point["ops_ms"]
            elementwise = sum(ops.get(k, 0.0) for k in ("norm", "activation", "rotary"))
            rest = sum(v for k, v in ops.items() if k not in ("linear", "attention", "norm", "activation", "rotary"))
            rows.append(f"| {label} | {point['step']} | {point['wall_ms']:.1f} "
                        f"| {point['memory_bound_ms']:.1f} / {point['compute_bound_ms']:.1f} "
                        f"| **{point['bound_share']:.2f}** | {ops.get('linear', 0.0):.1f} "
                        f"| {ops.get('attention', 0.0):.1f} | {elementwise:.1f} | {rest:.1f} "
                        f"| {point['python_ms']:.1f} |")
    return "\n".join(rows) + "\n"


def linear_kernels() -> str:
    """One row per (report, row count): each path's time for a step's linears."""
    rows = ["| report | rows | plain ms | oneDNN ms | brgemm ms | oneDNN / brgemm |", "|---|---|---|---|---|---|"]
    for label, report in _reports("linear_kernels"):
        for m, paths in report["rows"].items():
            cells = [f"{paths[k]['ms']:.2f} ({paths[k]['min_ms']:.2f}–{paths[k]['max_ms']:.2f})" if k in paths else "–"
                     for k in ("plain", "onednn", "brgemm")]
            ratio = f"**{paths['onednn']['ms'] / paths['brgemm']['ms']:.2f}**" if "brgemm" in paths else "–"
            rows.append(f"| {label} | {m} | {' | '.join(cells)} | {ratio} |")
    return "\n".join(rows) + "\n"


def _spread(x: dict, fmt: str = "{:,.1f}") -> str:
    return f"{fmt.format(x['median'])} ({fmt.format(x['min'])}–{fmt.format(x['max'])})"


QUANT_LABELS = {"bf16": "bf16", "gguf-q4_1": "GGUF Q4_1 as shipped", "int8": "int8", "fp8": "fp8",
                "int4": "int4 (g64)", "nvfp4": "nvfp4"}


def quantization() -> str:
    """One row per (report, format): bytes, quality, decode speed per batch; llama.cpp."""
    rows = []
    for label, report in _reports("quantization"):
        speed, quality, batches = report["speed"], report["quality"], report["args"]["batches"]
        mixed = "mixed_tok_s" in speed["bf16"]
        rows += [f"| format ({label}) | weight bytes (vs bf16) | perplexity (vs float32) | top-1 agreement | "
                 + " | ".join(f"batch {b} tok/s (vs bf16)" for b in batches)
                 + (" | mixed workload tok/s (vs bf16)" if mixed else "") + " |",
                 "|---|---|---|---|" + "---|" * (len(batches) + mixed)]
        base = speed["bf16"]["weight_bytes"]
        for fmt, name in QUANT_LABELS.items():
            s, q = speed[fmt], quality.get(fmt)
            ppl = f"{q['perplexity']:.3f} ({q['perplexity_vs_float32']:.3f})" if q else "–"
            agree = f"{q['top1_agreement_with_float32']:.3f}" if q else "–"
            keys = [f"batch_{b}" for b in batches] + (["mixed"] if mixed else [])
            cells = [f"{_spread(s[f'{k}_tok_s'])}" + ("" if fmt == "bf16" else f", {_range(s[f'{k}_vs_bf16'])}")
                     for k in keys]
            rows.append(f"| {name} | {s['weight_bytes'] / 1e6:.1f} MB ({s['weight_bytes'] / base:.2f}) | {ppl} "
                        f"| {agree} | " + " | ".join(cells) + " |")
        if "llama_cpp" in speed:
            one = batches[0]
            ratio = _range(speed["gguf-q4_1"][f"batch_{one}_vs_llama_cpp"])
            rows.append(f"| llama.cpp, same GGUF, {speed['llama_cpp']['threads']} threads | | | | "
                        f"{_spread(speed['llama_cpp'][f'batch_{one}_tok_s'])}; GGUF / llama.cpp per round "
                        f"{ratio} |" + " |" * (len(batches) - 1 + mixed))
        rows.append(f"| read bandwidth | {_spread(speed['read_bandwidth_gb_s'])} GB/s | | | "
                    + " | ".join("" for _ in range(len(batches) + mixed)) + " |")
    return "\n".join(rows) + "\n"


KERNELS = ("kervan_int8", "torch_int8pack", "kervan_int4", "torch_int4pack")


def quant_kernels() -> str:
    """One row per (report, shape, rows): each kernel's speed over dense bf16's."""
    rows = ["| report | shape (N x K) | rows | dense bf16 µs | " + " | ".join(KERNELS) + " |",
            "|---|---|---|---|" + "---|" * len(KERNELS)]
    for label, report in _reports("quant-kernels"):
        for name, shape in report["results"].items():
            for key in (k for k in shape if k.startswith("rows_")):
                point = shape[key]
                cells = [_range(point[k]["vs_dense_bf16"]) for k in KERNELS]
                rows.append(f"| {label} | {name} {shape['shape'][0]} x {shape['shape'][1]} | {key[5:]} "
                            f"| {_spread(point['dense_bf16']['us_per_call'], '{:,.0f}')} | " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n"


def _kept(cell: dict) -> str:
    rate, length = cell.get("acceptance_rate"), cell.get("mean_accepted_length")
    return "no guesses" if rate is None else f"{rate:.0%} kept, {length:.2f} tokens/step"


def speculative() -> str:
    """One row per (report, workload, temperature, batch, engine or mesh): decode tok/s without
    speculation, and each proposer's speed over it with how many of its guesses were kept."""
    tables = []
    for label, report in _reports("speculative"):
        methods = [m for m in report["results"][0]["tokens_per_s"] if m != "none"]
        rows = [f"| {label}: workload | temperature | batch | through | no speculation tok/s | "
                + " | ".join(f"{m} (vs none; guesses kept)" for m in methods) + " |",
                "|---|---|---|---|---|" + "---|" * len(methods)]
        for r in report["results"]:
            cells = [f"{_range(r[m]['ratio'])}; {_kept(r[m])}" for m in methods]
            rows.append(f"| {r['workload']} | {r['temperature']:g} | {r['batch']} | {r.get('through', 'engine')} "
                        f"| {_spread(r['tokens_per_s']['none'])} | " + " | ".join(cells) + " |")
        tables.append("\n".join(rows) + "\n")
    return "\n".join(tables)


def _maybe(x: dict | None, fmt: str = "{:,.1f}") -> str:
    return "–" if not x or x.get("median") is None or "min" not in x else _spread(x, fmt)


def interference() -> str:
    """Per report: each shape's latencies, its goodput per core at every TPOT target, and that
    over disaggregated's in the same round."""
    tables = []
    for label, report in _reports("interference"):
        shapes, targets = report["shapes"], [f"{t:g}" for t in report["tpot_targets_ms"]]
        rows = [f"| {label}: shape | stream TPOT p99 ms | stream ITL p99 ms | stream TTFT p50 ms | long TTFT p50 ms "
                "| long TTFT p99 ms | failed |", "|---|---|---|---|---|---|---|"]
        for name, s in shapes.items():
            rows.append(f"| {name} | {_maybe(s['stream_tpot_p99_ms'])} | {_maybe(s['stream_itl_p99_ms'])} "
                        f"| {_maybe(s['stream_ttft_p50_ms'])} | {_maybe(s['long_ttft_p50_ms'], '{:,.0f}')} "
                        f"| {_maybe(s['long_ttft_p99_ms'], '{:,.0f}')} | {s['failed']} |")
        rows += ["", "| goodput per core (req/s) at stream TPOT ≤ | " + " | ".join(f"{t} ms" for t in targets) + " |",
                 "|---|" + "---|" * len(targets)]
        for name, s in shapes.items():
            rows.append(f"| {name} | " + " | ".join(_maybe(s["goodput_per_core_at_tpot"][t], "{:.2f}")
                                                   for t in targets) + " |")
        rows += ["", "| per round, over disaggregated, at stream TPOT ≤ | " + " | ".join(f"{t} ms" for t in targets)
                 + " |", "|---|" + "---|" * len(targets)]
        for name, s in shapes.items():
            if "goodput_vs_disaggregated_at_tpot" in s:
                rows.append(f"| {name} | " + " | ".join(
                    _range(r) if r and "min" in r else "–" for r in
                    (s["goodput_vs_disaggregated_at_tpot"][t] for t in targets)) + " |")
        tables.append("\n".join(rows) + "\n")
    return "\n".join(tables)


def _branches(per_seed: list[dict]) -> str:
    total: dict[str, int] = {}
    for seed in per_seed:
        for branch, n in seed.items():
            total[branch] = total.get(branch, 0) + n
    placed = sum(total.values())
    return ", ".join(f"{b} {n / placed:.0%}" for b, n in sorted(total.items())) if placed else "–"


def prefix_placement() -> str:
    """Per report: each policy (or variant) over the seeds, and which of its rules chose."""
    tables = []
    for label, report in _reports("prefix_placement"):
        seeds = ", ".join(str(s) for s in report["seeds"])
        rows = [f"| {label}, seeds {seeds}: run | flags | hit rate | TTFT p50 ms | TTFT p99 ms | goodput req/s "
                "| TTFT p50 / kv's, per seed | rule that chose |", "|---|---|---|---|---|---|---|---|"]
        for name, p in report["policies"].items():
            vs_kv = p.get("ttft_p50_vs_kv")
            rows.append(f"| {name} | `{report.get('runs', {}).get(name, name)}` | {_maybe(p['hit_rate'], '{:.3f}')} "
                        f"| {_maybe(p['ttft_p50_ms'])} | {_maybe(p['ttft_p99_ms'], '{:,.0f}')} "
                        f"| {_maybe(p['goodput'], '{:.2f}')} | {_range(vs_kv) if vs_kv else '–'} "
                        f"| {_branches(p.get('policy_branches_per_seed', []))} |")
        tables.append("\n".join(rows) + "\n")
    return "\n".join(tables)


TABLES = {"engine_throughput": engine_throughput, "step_profile": step_profile, "linear_kernels": linear_kernels,
          "quantization": quantization, "quant-kernels": quant_kernels,
          "speculative": speculative, "interference": interference, "prefix_placement": prefix_placement}


def render(text: str) -> str:
    """``text`` with every generated table rewritten from the JSON."""
    def fill(match: re.Match) -> str:
        name = match["name"]
        if name not in TABLES:
            raise KeyError(f"README names table {name!r}; known: {', '.join(TABLES)}")
        return match.group(1) + TABLES[name]() + match.group(4)
    return BLOCK.sub(fill, text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the README's tables are stale")
    args = ap.parse_args()
    text = README.read_text()
    fresh = render(text)
    if args.check:
        sys.exit(0 if fresh == text else 1)
    README.write_text(fresh)


if __name__ == "__main__":
    main()
