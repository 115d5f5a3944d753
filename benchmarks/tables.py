"""The README's result tables, generated from the raw JSON under ``benchmarks/results/``.

Every number a table quotes is read from a committed report, never typed in:

    python -m benchmarks.tables            # rewrite the generated tables in benchmarks/pages/*.md
    python -m benchmarks.tables --check    # exit 1 if a page's tables differ from the JSON

A generated table sits between ``<!-- table: NAME -->`` and ``<!-- end table -->`` in the
README; ``tests/test_benchmark_tables.py`` fails when one is stale."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from benchmarks import cells, mesh_tables

HERE = Path(__file__).parent
RESULTS = cells.RESULTS
README = HERE / "README.md"
PAGES = HERE / "pages"  # one page per benchmark; the README is their index


def documents() -> list[Path]:
    """The README and every benchmark's page: where tables are generated and reports cited."""
    return [README, *sorted(PAGES.glob("*.md"))]
BLOCK = re.compile(r"(<!-- table: (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- end table -->)", re.S)


def engine_throughput() -> str:
    """One row per (report, dtype): Kervan's throughput, deterministic mode's cost, vLLM and
    transformers (at its best batch size, and in batches sorted by output length)."""
    peers = ("vllm", "transformers", "transformers_sorted")
    rows = ["| report | CPU (ISA) | model | dtype | rounds | Kervan tok/s | deterministic / default | "
            + " | ".join(f"{p} tok/s | Kervan / {p}" for p in peers) + " |",
            "|---|---|---|---|---|---|---|" + "---|---|" * len(peers)]
    for label, report in cells.reports("engine_throughput"):
        machine = report["machine"]
        features = [machine["isa"]] + ["native bf16"] * machine["native_bf16"] + ["AMX"] * machine.get("amx", False)
        cpu = f"{machine['cpu']} ({', '.join(features)})"
        model = Path(report["model"]).name
        for by_dtype in report["dtypes"].values():
            runs = by_dtype["runs"]

            def tok_s(system: str, runs=runs) -> str:
                have = [r[system]["output_tokens_per_s"] for r in runs if system in r]
                return cells.middle(have) if have else "–"

            det = by_dtype.get("kervan_deterministic_vs_kervan")
            vs = [by_dtype.get(f"kervan_vs_{p}") for p in peers]
            rows.append(f"| {label} | {cpu} | {model} | {by_dtype['dtype']} | {len(runs)} "
                        f"| {tok_s('kervan')} | {cells.ratio(det) if det else '–'} | "
                        + " | ".join(f"{tok_s(p)} | {cells.ratio(v) if v else '–'}" for p, v in zip(peers, vs))
                        + " |")
    return "\n".join(rows) + "\n"


def step_profile() -> str:
    """One row per (report, step): its time, its bound, and where the time went."""
    rows = ["| report | step | wall ms | bound ms (memory / compute) | bound share | linear | experts | attention "
            "| norm + activation + rotary | other ops | Python |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for label, report in cells.reports("step_profile"):
        for point in report["points"]:
            ops = point["ops_ms"]
            elementwise = sum(ops.get(k, 0.0) for k in ("norm", "activation", "rotary"))
            rest = sum(v for k, v in ops.items()
                       if k not in ("linear", "experts", "attention", "norm", "activation", "rotary"))
            experts = f"{ops['experts']:.1f}" if "experts" in ops else "–"
            rows.append(f"| {label} | {point['step']} | {point['wall_ms']:.1f} "
                        f"| {point['memory_bound_ms']:.1f} / {point['compute_bound_ms']:.1f} "
                        f"| **{point['bound_share']:.2f}**{_share_range(point)} | {ops.get('linear', 0.0):.1f} "
                        f"| {experts} | {ops.get('attention', 0.0):.1f} | {elementwise:.1f} | {rest:.1f} "
                        f"| {point['python_ms']:.1f}{_outside(point)} |")
    return "\n".join(rows) + "\n"


def _share_range(point: dict) -> str:
    """`` (0.61–0.66, 3 rounds)`` where the report ran rounds."""
    low_high = point.get("bound_share_range")
    return f" ({low_high[0]:.2f}–{low_high[1]:.2f}, {point['rounds']} rounds)" if low_high else ""


def _outside(point: dict) -> str:
    """`` (4.2% outside the stack)``, where the report measured it."""
    share = point.get("outside_stack_share")
    return "" if share is None else f" ({share:.1%} outside the stack)"


def moe_layer() -> str:
    """One row per (report, token count): the fused experts' call and the per-expert loop, their
    ratio, and the fused call's share of the read bandwidth."""
    rows = ["| report | experts in | tokens | experts read | fused ms | per-expert ms | per-expert / fused "
            "| fused's share of read bandwidth |", "|---|---|---|---|---|---|---|---|"]
    for label, report in cells.reports("moe_layer"):
        args = report["arguments"]
        kind = args["quantization"] or args["dtype"]
        for p in report["points"]:
            rows.append(f"| {label} | {kind} | {p['tokens']} | {p['experts_read']['median']:.1f} "
                        f"| {cells.spread(p['fused_ms'], '{:,.2f}')} | {cells.spread(p['per_expert_ms'], '{:,.2f}')} "
                        f"| {cells.ratio(p['speedup'])} | {cells.spread(p['fused_bandwidth_share'], '{:.2f}')} |")
    return "\n".join(rows) + "\n"


def linear_kernels() -> str:
    """One row per (report, row count): each path's time for a step's linears, and oneDNN's
    over the batch-invariant kernel the engine takes for the dtype (brgemm where it packs it)."""
    rows = ["| report | dtype | rows | plain ms | oneDNN ms | brgemm ms | invariant ms | oneDNN / the engine's |",
            "|---|---|---|---|---|---|---|---|"]
    for label, report in cells.reports("linear_kernels"):
        for m, paths in report["rows"].items():
            row_cells = [f"{paths[k]['ms']:.2f} ({paths[k]['min_ms']:.2f}–{paths[k]['max_ms']:.2f})"
                         if k in paths else "–" for k in ("plain", "onednn", "brgemm", "invariant")]
            engine = paths.get("brgemm") or paths.get("invariant")
            ratio = f"**{paths['onednn']['ms'] / engine['ms']:.2f}**" if engine else "–"
            rows.append(f"| {label} | {report.get('dtype', 'bfloat16')} | {m} | {' | '.join(row_cells)} | {ratio} |")
    return "\n".join(rows) + "\n"


QUANT_LABELS = {"bf16": "bf16", "gguf-q4_1": "GGUF Q4_1 as shipped", "int8": "int8", "fp8": "fp8",
                "int4": "int4 (g64)", "nvfp4": "nvfp4"}


def quantization() -> str:
    """One row per (report, format): bytes, quality, decode speed per batch; llama.cpp."""
    rows = []
    for label, report in cells.reports("quantization"):
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
            row_cells = [cells.spread(s[f"{k}_tok_s"])
                         + ("" if fmt == "bf16" else f", {cells.ratio(s[f'{k}_vs_bf16'])}") for k in keys]
            rows.append(f"| {name} | {s['weight_bytes'] / 1e6:.1f} MB ({s['weight_bytes'] / base:.2f}) | {ppl} "
                        f"| {agree} | " + " | ".join(row_cells) + " |")
        if "llama_cpp" in speed:
            one = batches[0]
            ratio = cells.ratio(speed["gguf-q4_1"][f"batch_{one}_vs_llama_cpp"])
            rows.append(f"| llama.cpp, same GGUF, {speed['llama_cpp']['threads']} threads | | | | "
                        f"{cells.spread(speed['llama_cpp'][f'batch_{one}_tok_s'])}; GGUF / llama.cpp per round "
                        f"{ratio} |" + " |" * (len(batches) - 1 + mixed))
        rows.append(f"| read bandwidth | {cells.spread(speed['read_bandwidth_gb_s'])} GB/s | | | "
                    + " | ".join("" for _ in range(len(batches) + mixed)) + " |")
    return "\n".join(rows) + "\n"


DTYPE_NAMES = ("float32", "bfloat16", "float16")
ACTIVATION_ROWS = {"float": "Kervan, float kernel", "int8": "Kervan, int8 (one term)",
                   "int8x2": "Kervan, int8x2 (two terms: the default)", "llama_cpp": "llama.cpp"}


def quant_activations() -> str:
    """Per report: each kernel's batch 1, 8 and 32 and a 512-token prompt, beside the float
    kernel and llama.cpp; then each one's perplexity and greedy answers against the float32
    reference (transformers on the dequantized GGUF), beside llama.cpp's."""
    rows = ["| report | CPU (ISA), dtype | system | weights MB | batch 1 ms/token | vs float kernel | vs llama.cpp "
            "| batch 8 tok/s | batch 32 tok/s | prompt 512 tok/s | vs float kernel | vs llama.cpp |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    quality = ["| report | system | perplexity | second halves (llama.cpp's protocol) | top-1 agreement "
               "| first token as the reference's | whole answer as the reference's | agreeing tokens |",
               "|---|---|---|---|---|---|---|---|"]
    for label, report in cells.reports("quant_activations"):
        m, s = report["machine"], report.get("speed", {})
        where = f"{m['cpu']} ({m['isa']}), {m['dtype']}"
        for key, name in ACTIVATION_ROWS.items():
            if key not in s:
                continue
            x = s[key]
            held = f"{x['weight_bytes'] / 1e6:,.1f}" if "weight_bytes" in x else "–"

            def versus(measure: str, of: str, x=x) -> str:
                return cells.ratio(x[f"{measure}_vs_{of}"]) if f"{measure}_vs_{of}" in x else "–"
            rows.append(f"| {label} | {where} | {name} | {held} | {cells.maybe(x.get('batch_1_ms'), '{:,.2f}')} "
                        f"| {versus('batch_1_ms', 'float')} | {versus('batch_1_ms', 'llama_cpp')} "
                        f"| {cells.maybe(x.get('batch_8_tok_s'))} | {cells.maybe(x.get('batch_32_tok_s'))} "
                        f"| {cells.maybe(x.get('pp_tok_s'))} | {versus('pp_tok_s', 'float')} "
                        f"| {versus('pp_tok_s', 'llama_cpp')} |")
        p, g = report["perplexity"], report["greedy"]
        for key, x in p.items():
            if not isinstance(x, dict):
                continue
            # the greedy answers of this system, per dtype (``{kernel}_{dtype}``; llama.cpp's: one)
            answers = {k[len(key) + 1:] if k != key else "": v for k, v in g.items() if key != "reference"
                       and (k == key or k.startswith(f"{key}_") and k[len(key) + 1:] in DTYPE_NAMES)}

            def each(field: str, fmt: str, answers=answers) -> str:
                return "; ".join(f"{dtype} {fmt.format(v[field])}".strip() for dtype, v in answers.items()) or "–"
            name = "transformers, float32 (the reference)" if key == "reference" else ACTIVATION_ROWS.get(key, key)
            ppl = f"{x['perplexity']:,.4f}" if "perplexity" in x else "–"
            top1 = f"{x['top1_agreement_with_reference']:.4f}" if "top1_agreement_with_reference" in x else "–"
            quality.append(f"| {label} | {name} | {ppl} | {x['perplexity_second_halves']:,.4f} | {top1} "
                           f"| {each('first_token_share', '{:.3f}')} | {each('whole_answer_share', '{:.3f}')} "
                           f"| {each('mean_agreeing_tokens', '{:.1f}')} |")
    return "\n".join(rows) + "\n\n" + "\n".join(quality) + "\n"


COST_MEASURES = {"batch_1_ms": "batch 1 ms a step", "batch_16_ms": "batch 16 ms a step",
                 "pp_512_tok_s": "prompt 512 tok/s", "pp_2048_tok_s": "prompt 2,048 tok/s"}


def invariance_cost() -> str:
    """Per report and model: each measure, the engine now against its checkout before batch
    invariance, and the per-round ratio (above 1.0: faster now)."""
    rows = ["| report | model, dtype | measure | now | before | now / before |", "|---|---|---|---|---|---|"]
    for label, report in cells.reports("invariance_cost"):
        for name, x in report["models"].items():
            for key, measure in COST_MEASURES.items():
                fmt = "{:,.2f}" if key.endswith("_ms") else "{:,.0f}"
                now, before = cells.spread(x["current"][key], fmt), cells.spread(x["baseline"][key], fmt)
                rows.append(f"| {label} | {name}, {x['dtype']} | {measure} | {now} | {before} "
                            f"| {cells.ratio(x['current_over_baseline'][key])} |")
    return "\n".join(rows) + "\n"


PARITY_SYSTEMS = {"kervan": "Kervan", "kervan_modules": "Kervan, decode stack off", "llama_cpp": "llama.cpp"}


def llama_cpp_parity() -> str:
    """One row per (report, system): batch 1, a 512-token prompt, batch 8 and 32, each with
    its ratio to llama.cpp (higher: Kervan ahead)."""
    metrics = (("batch_1_ms", "{:,.2f}"), ("pp_tok_s", "{:,.0f}"), ("batch_8_tok_s", "{:,.0f}"),
               ("batch_32_tok_s", "{:,.0f}"))
    rows = ["| report | CPU (ISA), dtype | system | batch 1 ms/token | vs llama.cpp | prompt 512 tok/s | vs llama.cpp "
            "| batch 8 tok/s | vs llama.cpp | batch 32 tok/s | vs llama.cpp |", "|---|---|---|" + "---|---|" * 4]
    for label, report in cells.reports("llama_cpp_parity"):
        m = report["machine"]
        where = f"{m['cpu']} ({m['isa']}{', AMX' if m.get('amx') and m['isa'] == 'avx512' else ''}), {m['dtype']}"
        for key, name in PARITY_SYSTEMS.items():
            if key not in report["systems"]:  # a run without that system (--no-modules)
                continue
            x, vs = report["systems"][key], report.get(f"{key}_vs_llama_cpp", {})
            row = [cells.maybe(x.get(metric), fmt) + " | " + (cells.ratio(vs[metric]) if metric in vs else "–")
                   for metric, fmt in metrics]
            rows.append(f"| {label} | {where} | {name} | " + " | ".join(row) + " |")
    return "\n".join(rows) + "\n"


def peers() -> str:
    """The headline: Kervan beside vLLM and llama.cpp on the same machine, from the reports
    whose peers ran at their documented best with every setting recorded (engine_throughput
    with ``vllm_settings``, llama_cpp_parity with ``llama_bench_repetitions``); per CPU kind
    and model, each measure's median with its range, and the per-round ratios."""
    rows = ["| CPU kind | model | measure | Kervan | vLLM (tuned) | llama.cpp | Kervan / vLLM | Kervan / llama.cpp "
            "| report |", "|---|---|---|---|---|---|---|---|---|"]
    for label, report in cells.reports("engine_throughput"):
        for d in report["dtypes"].values():
            if "vllm_settings" not in d:
                continue
            w, runs = report["workload"], d["runs"]
            measure = (f"{w['num_requests']} requests, prompts {_span(w['prompt_len'])} → {_span(w['output_len'])} "
                       f"tokens, output tok/s ({d['dtype']}; vLLM max_num_batched_tokens "
                       f"{d['vllm_settings']['max_num_batched_tokens']})")
            rows.append(f"| {cells.cpu_kind(report['machine'])} | {_model(report['model'])} | {measure} "
                        f"| {cells.middle([r['kervan']['output_tokens_per_s'] for r in runs])} "
                        f"| {cells.middle([r['vllm']['output_tokens_per_s'] for r in runs])} | – "
                        f"| {cells.ratio(d['kervan_vs_vllm'])} | – | {label} |")
    for label, report in cells.reports("llama_cpp_parity"):
        if "llama_bench_repetitions" not in report:
            continue
        k, ll, vs = report["systems"]["kervan"], report["systems"]["llama_cpp"], report["kervan_vs_llama_cpp"]
        for metric, name, fmt in PEER_METRICS:
            if metric in vs:
                rows.append(f"| {cells.cpu_kind(report['machine'])} | {_model(report['model'])} "
                            f"| {name} ({report['machine']['dtype']}, the GGUF's blocks) "
                            f"| {cells.spread(k[metric], fmt)} | – | {cells.spread(ll[metric], fmt)} | – "
                            f"| {cells.ratio(vs[metric])} | {label} |")
    return "\n".join(rows) + "\n"


PEER_METRICS = (("batch_1_ms", "batch 1, ms a token", "{:,.2f}"), ("pp_tok_s", "a 512-token prompt, tok/s", "{:,.0f}"),
                ("batch_8_tok_s", "batch 8 decode, tok/s", "{:,.0f}"), ("batch_32_tok_s", "batch 32 decode, tok/s",
                                                                           "{:,.0f}"))


def _span(lengths: list[int]) -> str:
    return str(lengths[0]) if lengths[0] == lengths[1] else f"{lengths[0]}–{lengths[1]}"


def _model(path: str) -> str:
    name = Path(path).name
    return {"kervan-bench-v128256-llama1b": "Llama-3.2-1B shape (random weights)",
            "llama1b-q4_0.gguf": "Llama-3.2-1B shape (random weights), Q4_0 GGUF",
            "kervan-bench-v151936-qwen-moe": "Qwen1.5-MoE-A2.7B shape, 2 of 24 layers (random weights)",
            "qwen-moe-24l-q4_0.gguf": "Qwen1.5-MoE-A2.7B shape, all 24 layers (random weights), Q4_0 GGUF",
            "smollm2-dense": "SmolLM2-135M (the GGUF expanded)",
            "SmolLM2-135M-Instruct.Q4_1.gguf": "SmolLM2-135M, the shipped Q4_1 GGUF"}.get(name, name)


def plan_published() -> str:
    """Per published measurement: what the plan predicts on the GPU preset beside it."""
    rows = ["| published measurement | source | predicted ms | published ms | predicted / published | within 20% |",
            "|---|---|---|---|---|---|"]
    for _, report in cells.reports("plan_published"):
        for p in report["points"]:
            for key, published in p["published_ms"].items():
                rows.append(f"| {p['name']}: {key.replace('_', ' ')} | {p['source']} | {p['predicted_ms'][key]:,.1f} "
                            f"| {published:,.1f} | **{p['predicted_over_published'][key]:.2f}** "
                            f"| {'yes' if p['within'][key] else 'no'} |")
    return "\n".join(rows) + "\n"


KERNELS = ("kervan_int8", "torch_int8pack", "kervan_int4", "torch_int4pack")


def quant_kernels() -> str:
    """One row per (report, shape, rows): each kernel's speed over dense bf16's."""
    rows = ["| report | shape (N x K) | rows | dense bf16 µs | " + " | ".join(KERNELS) + " |",
            "|---|---|---|---|" + "---|" * len(KERNELS)]
    for label, report in cells.reports("quant-kernels"):
        for name, shape in report["results"].items():
            for key in (k for k in shape if k.startswith("rows_")):
                point = shape[key]
                row_cells = [cells.ratio(point[k]["vs_dense_bf16"]) for k in KERNELS]
                rows.append(f"| {label} | {name} {shape['shape'][0]} x {shape['shape'][1]} | {key[5:]} "
                            f"| {cells.spread(point['dense_bf16']['us_per_call'], '{:,.0f}')} | "
                            + " | ".join(row_cells) + " |")
    return "\n".join(rows) + "\n"


def _kept(cell: dict) -> str:
    rate, length = cell.get("acceptance_rate"), cell.get("mean_accepted_length")
    return "no guesses" if rate is None else f"{rate:.0%} kept, {length:.2f} tokens/step"


def speculative() -> str:
    """One row per (report, workload, temperature, batch, engine or mesh): decode tok/s without
    speculation, and each proposer's speed over it with how many of its guesses were kept."""
    tables = []
    for label, report in cells.reports("speculative"):
        methods = [m for m in report["results"][0]["tokens_per_s"] if m != "none"]
        k = report.get("k", {})  # reports since 2026-12-07: each proposer's k, from the sweep
        rows = [f"| {label}: workload | temperature | batch | through | no speculation tok/s | "
                + " | ".join(f"{m}{f' k={k[m]}' if k.get(m) else ''} (vs none; guesses kept)" for m in methods)
                + " |", "|---|---|---|---|---|" + "---|" * len(methods)]
        for r in report["results"]:
            pooled = r.get("through") == "mesh" and "k" not in report  # one figure for every mesh row: withdrawn
            row_cells = [f"{cells.ratio(r[m]['ratio'])}; "
                         + ("kept: one figure pooled over every mesh row, withdrawn" if pooled else _kept(r[m]))
                         for m in methods]
            rows.append(f"| {r['workload']} | {r['temperature']:g} | {r['batch']} | {r.get('through', 'engine')} "
                        f"| {cells.spread(r['tokens_per_s']['none'])} | " + " | ".join(row_cells) + " |")
        tables.append("\n".join(rows) + "\n")
        if report.get("k_sweep"):  # how each k was chosen
            ks = sorted({int(x) for sweep in report["k_sweep"].values() for x in sweep})
            sweep_rows = [f"| {label}: k sweep (batch 1, greedy, vs none) | " + " | ".join(f"k={x}" for x in ks)
                          + " | chosen |", "|---|" + "---|" * (len(ks) + 1)]
            for m, sweep in report["k_sweep"].items():
                sweep_rows.append(f"| {m} | " + " | ".join(cells.ratio(sweep[str(x)]) if str(x) in sweep else "–"
                                                            for x in ks) + f" | {report['k'][m]} |")
            tables.append("\n".join(sweep_rows) + "\n")
    return "\n".join(tables)


def _vs(group: dict | None, bucket: str) -> str:
    return f"{group['group_vs_one_process'][bucket]:.2f}" if group else "–"


def parallel() -> str:
    """Per report and bucket: one process's step over its rounds, the read bandwidth measured
    between its steps, the roofline it gives and the share of it reached; each worker group of
    two ranks over one process."""
    tables = []
    for label, report in cells.reports("parallel"):
        dense, moe = report["dense"], report.get("moe", {})
        rows = [f"| {label}: batch | one process ms (rounds) | read GB/s between steps | bytes per step "
                "| roofline ms | roofline / step, per round | tensor parallel vs one | pipeline parallel vs one "
                "| MoE one process ms | expert parallel vs one | MoE tensor parallel vs one |",
                "|---|---|---|---|---|---|---|---|---|---|---|"]
        for b, roof in dense["roofline"].items():
            moe_ms = moe.get("one_process", {}).get("decode_step_ms", {}).get(b)
            rows.append(f"| {b} | {cells.middle(dense['one_process']['decode_step_ms_rounds'][b])} "
                        f"| {cells.middle(roof['read_gb_s_rounds'])} | {roof['bytes_per_step'] / 1e6:,.0f} MB "
                        f"| {cells.middle(roof['bound_ms_rounds'])} | {cells.ratio(roof['fraction'])} "
                        f"| {_vs(dense.get('tensor_parallel'), b)} | {_vs(dense.get('pipeline_parallel'), b)} "
                        f"| {'–' if moe_ms is None else f'{moe_ms:.1f}'} | {_vs(moe.get('expert_parallel'), b)} "
                        f"| {_vs(moe.get('tensor_parallel'), b)} |")
        compiled = report.get("cpu_compile", {}).get("buckets", {})
        if compiled:
            rows += ["", "| batch | native eager ms | torch eager ms | torch compiled ms | compiling s |",
                     "|---|---|---|---|---|"]
            rows += [f"| {b} | {c['eager_native_ms']:.1f} | {c['eager_torch_ms']:.1f} | {c['compiled_torch_ms']:.1f} "
                     f"| {c['compile_s']:.0f} |" for b, c in compiled.items()]
        tables.append("\n".join(rows) + "\n")
    return "\n".join(tables)


def linear_packing() -> str:
    """Per report, dtype and shape: plain and oneDNN-packed times, best of the timed batches."""
    rows = ["| report | dtype | shape (rows x K x N) | plain µs | packed µs | plain / packed |",
            "|---|---|---|---|---|---|"]
    for label, report in cells.reports("linear_packing"):
        for dtype, shapes in report["dtypes"].items():
            if "refused" in shapes:
                rows.append(f"| {label} | {dtype} | refused: {shapes['refused']} | | | |")
                continue
            for shape, r in shapes.items():
                rows.append(f"| {label} | {dtype} | {shape} | {r['plain_us']:,.1f} | {r['packed_us']:,.1f} "
                            f"| **{r['plain_vs_packed']:.2f}** |")
    return "\n".join(rows) + "\n"


def _leaves(tree: dict, path: tuple[str, ...] = ()):
    """(path, spread) for every ``benchmarks.stats.spread`` inside ``tree``, in order."""
    for key, value in tree.items():
        if isinstance(value, dict) and "median" in value and "min" in value:
            yield (*path, str(key)), value
        elif isinstance(value, dict):
            yield from _leaves(value, (*path, str(key)))


def measured(benchmark: str, keys: tuple[str, ...] = ("summary",)) -> str:
    """Every measure of each report's ``keys``: its median, range and every round's value,
    for the benchmarks whose reports are trees of measures (tiers, pulls, the HTTP front)."""
    tables = []
    for label, report in cells.reports(benchmark):
        rows = [f"| {label}: measure | median (min–max) | every round |", "|---|---|---|"]
        for path, x in _leaves({k: report[k] for k in keys} if len(keys) > 1 else report[keys[0]]):
            whole = all(float(v).is_integer() for v in x["rounds"] if v is not None)
            fmt = "{:,.0f}" if whole else "{:,.3f}" if abs(x["median"]) < 10 else "{:,.1f}"
            each = ", ".join(fmt.format(v) for v in x["rounds"] if v is not None)
            rows.append(f"| {' · '.join(path)} | {cells.spread(x, fmt)} | {each} |")
        tables.append("\n".join(rows) + "\n")
    return "\n".join(tables)


TABLES = {"engine_throughput": engine_throughput, "step_profile": step_profile, "moe_layer": moe_layer,
          "linear_kernels": linear_kernels,
          "quantization": quantization, "quant-kernels": quant_kernels, "quant_activations": quant_activations,
          "invariance_cost": invariance_cost,
          "llama_cpp_parity": llama_cpp_parity, "peers": peers, "plan_published": plan_published,
          "speculative": speculative, "parallel": parallel, "linear_packing": linear_packing,
          "interference": mesh_tables.interference, "prefix_placement": mesh_tables.prefix_placement,
          "mesh_throughput": mesh_tables.mesh_throughput, "place_path": mesh_tables.place_path,
          "registry_lookup": mesh_tables.registry_lookup, "plan_check": mesh_tables.plan_check,
          "plan_check_score": mesh_tables.plan_check_score,
          "planner_ramp": mesh_tables.planner_ramp, "fleet": mesh_tables.fleet,
          "kv_tiers": lambda: measured("kv_tiers"), "long_reasoning": lambda: measured("long_reasoning"),
          "kv_handoff_hosts": lambda: measured("kv_handoff_hosts"), "group_hosts": lambda: measured("group_hosts"),
          "kv_pull": lambda: measured("kv_pull"), "http_front": lambda: measured("http_front", ("ttft_ms",
                                                                                          "overhead_vs_grpc_ms"))}


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
    stale = []
    for path in documents():
        text = path.read_text()
        fresh = render(text)
        if fresh != text:
            stale.append(path)
            if not args.check:
                path.write_text(fresh)
    if args.check:
        sys.exit(1 if stale else 0)


if __name__ == "__main__":
    main()
