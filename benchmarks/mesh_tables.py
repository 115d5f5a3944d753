"""The generated tables of the benchmarks that run the mesh's services: interference,
prefix placement, the mesh against engines, the ``Place`` path and the registry's lookups."""

from __future__ import annotations

from benchmarks import cells
from benchmarks.plan_score import SCORED, point_verdicts, score
from benchmarks.stats import spread


def interference() -> str:
    """Per report: each shape's latencies, its goodput per core at every TPOT target, and that
    over disaggregated's in the same round."""
    tables = []
    for label, report in cells.reports("interference"):
        shapes, targets = report["shapes"], [f"{t:g}" for t in report["tpot_targets_ms"]]
        rows = [f"| {label}: shape | stream TPOT p99 ms | stream ITL p99 ms | stream TTFT p50 ms | long TTFT p50 ms "
                "| long TTFT p99 ms | failed |", "|---|---|---|---|---|---|---|"]
        for name, s in shapes.items():
            rows.append(f"| {name} | {cells.maybe(s['stream_tpot_p99_ms'])} | {cells.maybe(s['stream_itl_p99_ms'])} "
                        f"| {cells.maybe(s['stream_ttft_p50_ms'])} | {cells.maybe(s['long_ttft_p50_ms'], '{:,.0f}')} "
                        f"| {cells.maybe(s['long_ttft_p99_ms'], '{:,.0f}')} | {s['failed']} |")
        rows += ["", "| goodput per core (req/s) at stream TPOT ≤ | " + " | ".join(f"{t} ms" for t in targets) + " |",
                 "|---|" + "---|" * len(targets)]
        for name, s in shapes.items():
            rows.append(f"| {name} | " + " | ".join(cells.maybe(s["goodput_per_core_at_tpot"][t], "{:.2f}")
                                                   for t in targets) + " |")
        rows += ["", "| per round, over disaggregated, at stream TPOT ≤ | " + " | ".join(f"{t} ms" for t in targets)
                 + " |", "|---|" + "---|" * len(targets)]
        for name, s in shapes.items():
            if "goodput_vs_disaggregated_at_tpot" in s:
                rows.append(f"| {name} | " + " | ".join(
                    cells.ratio(r) if r and "min" in r else "–" for r in
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
    for label, report in cells.reports("prefix_placement"):
        seeds = ", ".join(str(s) for s in report["seeds"])
        bound = cells.maybe(report["hit_rate_bound"], "{:.3f}")
        rows = [f"| {label}, seeds {seeds} (hit-rate bound {bound}): run | flags | hit rate | repeat hits "
                "| TTFT p50 ms | TTFT p99 ms | goodput req/s | TTFT p50 / kv's, per seed | rule that chose |",
                "|---|---|---|---|---|---|---|---|---|"]
        for name, p in report["policies"].items():
            vs_kv = p.get("ttft_p50_vs_kv")
            flags = report.get("runs", {}).get(name, name)
            rows.append(f"| {name} | `{flags}` | {cells.maybe(p['hit_rate'], '{:.3f}')} "
                        f"| {cells.maybe(p['repeat_hit_share'], '{:.3f}')} "
                        f"| {cells.maybe(p['ttft_p50_ms'])} | {cells.maybe(p['ttft_p99_ms'], '{:,.0f}')} "
                        f"| {cells.maybe(p['goodput'], '{:.2f}')} | {cells.ratio(vs_kv) if vs_kv else '–'} "
                        f"| {_branches(p.get('policy_branches_per_seed', []))} |")
        tables.append("\n".join(rows) + "\n")
    return "\n".join(tables)


def _latency(x: dict | None) -> str:
    return "–" if not x else f"{x['p50']:,.1f} / {x['p99']:,.1f}"


def _vs_rounds(entry: dict, name: str, base: str) -> str:
    """The per-round ratio's cell; reports before 2026-12-05 kept only the list of ratios."""
    if isinstance(entry.get(f"{name}_vs_{base}_throughput"), dict):
        return cells.ratio(entry[f"{name}_vs_{base}_throughput"])
    old = entry.get(f"{name}_vs_{base}_rounds")
    return cells.ratio(spread(old)) if old else "–"


def mesh_throughput() -> str:
    """Per report and concurrency: each system's throughput over its rounds (the median
    round's alone in older reports), latencies of its median round, and its per-round ratio
    to each baseline; then the KV transfer, per round."""
    tables = []
    for label, report in cells.reports("mesh_throughput"):
        for conc, entry in report["concurrency"].items():
            systems = [k for k, v in entry.items() if isinstance(v, dict) and "output_tokens_per_s" in v]
            rows = [f"| {label}, {conc} concurrent ({entry['requests']} requests): system | output tok/s "
                    "| TTFT p50 / p99 ms | ITL p50 / p99 ms | vs engine, per round | vs engines pinned, per round |",
                    "|---|---|---|---|---|---|"]
            for name in systems:
                every = entry.get(f"{name}_rounds")
                tok_s = (cells.middle([r["output_tokens_per_s"] for r in every]) if every
                         else f"{entry[name]['output_tokens_per_s']:,.1f} (median round)")
                rows.append(f"| {name} | {tok_s} | {_latency(entry[name]['ttft_ms'])} "
                            f"| {_latency(entry[name]['itl_ms'])} | {_vs_rounds(entry, name, 'engine')} "
                            f"| {_vs_rounds(entry, name, 'engines_pinned')} |")
            tables.append("\n".join(rows) + "\n")
        kv = report["kv_transfer"]
        if "rounds" not in kv:
            continue  # older reports kept a best of 5, quoted in their own section
        rows = [f"| {label}: KV transfer, {kv['kv_bytes'] / 2**20:.0f} MiB ({kv['prompt_tokens']} tokens), "
                f"{kv['rounds']} rounds | GB/s | vs plain copy, per round | vs warm copy, per round |",
                "|---|---|---|---|"]
        for name in ("shared_memory_push", "grpc_stream_push", "plain_shm_copy", "warm_shm_copy"):
            vs = [kv.get(f"{name}_vs_{base}") for base in ("plain_shm_copy", "warm_shm_copy")]
            rows.append(f"| {name.replace('_', ' ')} | {cells.spread(kv[f'{name}_gb_per_s'], '{:.2f}')} | "
                        + " | ".join(cells.ratio(v) if v else "–" for v in vs) + " |")
        tables.append("\n".join(rows) + "\n")
    return "\n".join(tables)


def place_path() -> str:
    """Per report and worker count: latencies per condition, placements/s per pass."""
    rows = ["| report | workers | serial p50 / p99 ms | 16 concurrent p50 / p99 ms | + KV events p50 / p99 ms "
            "| placements/s, 16 concurrent (per pass) | + KV events (per pass) | events/s written meanwhile "
            "| `ListWorkers` alone p50 ms | `Match` alone p50 ms |", "|---|---|---|---|---|---|---|---|---|---|"]
    for label, report in cells.reports("place_path"):
        for size in report["sizes"]:
            lat, rate = size["latency_ms"], size["placements_per_s"]
            per_pass = {k: ", ".join(map(str, v)) for k, v in size["per_pass"].items()}
            rows.append(f"| {label} | {size['workers']:,} | {_latency(lat['serial'])} | {_latency(lat['concurrent'])} "
                        f"| {_latency(lat['concurrent_with_events'])} "
                        f"| {rate['concurrent']:,.1f} ({per_pass['concurrent']}) "
                        f"| {rate['concurrent_with_events']:,.1f} ({per_pass['concurrent_with_events']}) "
                        f"| {size['events_per_s_during_placement']:,.0f} | {lat['list_workers']['p50']:.1f} "
                        f"| {lat['match']['p50']:.1f} |")
    return "\n".join(rows) + "\n"


def registry_lookup() -> str:
    """Per report and method: latency over all lookups, and p99 in each pass."""
    rows = ["| report | blocks / workers | method | p50 ms | p99 ms | max ms | p99 per pass |",
            "|---|---|---|---|---|---|---|"]
    for label, report in cells.reports("registry_lookup"):
        for name, lat in report["latency_ms"].items():
            passes = ", ".join(f"{p['p99']:.3f}" for p in report["latency_ms_per_pass"][name])
            rows.append(f"| {label} | {report['blocks_registered']:,} / {report['workers']} | {name} "
                        f"| {lat['p50']:.3f} | {lat['p99']:.3f} | {lat['max']:.2f} | {passes} |")
    return "\n".join(rows) + "\n"


def _ms(x: float | None) -> str:
    return "–" if x is None else f"{x:.1f}"


def _range(point: dict, key: str, spec: str) -> str:
    """`` (min–max)`` of a point's measured rounds, when it has several."""
    r = point.get("measured_range", {}).get(key)
    return f" ({r['min']:{spec}}–{r['max']:{spec}})" if r and r.get("min") is not None else ""


def plan_check() -> str:
    """Per report, model and load: what ``kervan plan`` predicted and what the cluster it
    recommended measured (the rounds' median, their range in brackets), and their ratio."""
    rows = ["| report | model | profile | load (of the 1:1 rate) | req/s | output tok/s predicted / measured "
            "| TTFT mean ms predicted / measured | ITL median ms predicted / measured "
            "| decode engine step in the cluster, mean ms | measured / predicted: tok/s, TTFT, ITL "
            "| scored (TTFT, ITL) |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for label, report in cells.reports("plan_check"):
        for name, model in report["models"].items():
            for p in model["points"]:
                pred, got, ratio = p["predicted"], p["measured"], p["measured_over_predicted"]
                ratios = ", ".join(f"**{ratio[k]:.2f}**" if k in ratio else "–"
                                   for k in ("output_tokens_per_s", "ttft_ms", "itl_ms"))
                rows.append(f"| {label} | {name} ({model['weights']}) | {model.get('profile_kind', 'engine')} "
                            f"| {p['load_share']:.1f} | {p['rate']:.2f} "
                            f"| {pred['output_tokens_per_s']:,.0f} / {got['output_tokens_per_s']:,.0f} "
                            f"| {pred['ttft_ms']:,.0f} / {got['ttft_ms']:,.0f}{_range(p, 'ttft_ms', '.0f')} "
                            f"| {pred['itl_ms']:.1f} / {got['itl_ms']:.1f}{_range(p, 'itl_ms', '.1f')} "
                            f"| {_ms(p.get('decode_engine_step_ms_mean'))} | {ratios} "
                            f"| {', '.join(point_verdicts(p).values())} |")
    return "\n".join(rows) + "\n"


def plan_check_score() -> str:
    """Per report, the rule of ``benchmarks/plan_score.py`` (fixed 2026-12-07) applied to every
    report, older ones included: TTFT, ITL and the knee; throughput is the load, not scored."""
    rows = ["| report | CPU | scored | within 20% | miss | undecided (rounds spread > 20%) "
            "| load points within by the median alone | knees: predicted / measured req/s |",
            "|---|---|---|---|---|---|---|---|"]
    for label, report in cells.reports("plan_check"):
        counts = score(report)
        knees = "; ".join(f"{name} {k['predicted_rate']:.2f} / " + (f"{k['measured_rate']:.2f}" if k["measured_rate"]
                                                                     else "outside the probes")
                          for name, m in report["models"].items() if (k := m.get("knee"))) or "not measured"
        scored = counts["within"] + counts["miss"] + counts["undecided"]
        points = sum(len(m["points"]) for m in report["models"].values()) * len(SCORED)
        rows.append(f"| {label} | {cells.cpu_kind(report['machine'])} | {scored} "
                    f"| **{counts['within']}** | {counts['miss']} | {counts['undecided']} "
                    f"| {counts['median_within']} of {points} | {knees} |")
    return "\n".join(rows) + "\n"


def planner_ramp() -> str:
    """Per report, configuration and round: SLO attainment (whole ramp and per phase),
    worker-seconds, peak workers, failures; the summary rows are medians with their range."""
    rows = ["| report | configuration | round | SLO attainment | per phase (low / high / low) | worker-seconds "
            "| peak workers | failed |", "|---|---|---|---|---|---|---|---|"]
    for label, report in cells.reports("planner_ramp"):
        for name, summary in report["summary"].items():
            att, ws = summary["slo_attainment"], summary["worker_seconds"]
            rows.append(f"| {label} | **{name}** | median (min–max) | **{att[0]:.2f}** ({att[1]:.2f}–{att[2]:.2f}) | "
                        f"| **{ws[0]:,.0f}** ({ws[1]:,.0f}–{ws[2]:,.0f}) | | {summary['failed']} |")
        for i, rnd in enumerate(report["rounds"]):
            for name, run in rnd.items():
                phases = " / ".join(f"{p['slo_attainment']:.2f}" for p in run["phases"])
                rows.append(f"| {label} | {name} | {i + 1} | {run['slo_attainment']:.2f} | {phases} "
                            f"| {run['worker_seconds']:,.0f} | {run['peak_workers']} | {run['failed']} |")
    return "\n".join(rows) + "\n"


def fleet() -> str:
    """Per report: Redis memory and load rate, sustained events, placement per variant and
    pass (whole Place and the scheduler's decision), and the cluster lookup."""
    out = []
    for label, report in cells.reports("fleet"):
        r = report["redis"]
        out.append(f"{label}: {report['workers']:,} workers, {r['blocks_registered']:,} blocks registered "
                   f"({r['distinct_blocks']:,} Redis keys)\n")
        if "hosts" in report:
            out.append(f"Across simulated hosts, every link {report['hosts']['link']}: the control services on one, "
                       f"the traffic on another.\n")
        out.append("| Redis used memory | bytes per registered block | loaded at (blocks/s) "
                   "| an owner bitmap (bytes, sampled) |\n|---|---|---|---|")
        out.append(f"| {r['used_memory_mb']:,} MB | {r['bytes_per_block']} | {r['blocks_per_s_loading']:,} "
                   f"| {', '.join(str(x) for x in r['bitmap_key_bytes_sampled'])} |\n")
        out.append("| publishers in a closed loop | events/s one registry sustains | blocks/s "
                   "| CPU: registry, Redis (cores) |\n|---|---|---|---|")
        out += [f"| {e['publishers']} | **{e['events_per_s']:,.0f}** | {e['blocks_per_s']:,.0f} "
                f"| {e['cpu_share']['registry']:.2f}, {e['cpu_share']['redis']:.2f} |" for e in report["events"]]
        p = report["placement"]
        bg = next((r["with_traffic"]["background"] for rs in p["runs"].values() for r in rs), {})
        sender = (f"; sent by their own process at niceness {bg['niceness']}" if "niceness" in bg else
                  "; sent from the measuring client's event loop")
        out.append(f"\nPlacement, quiet and then with the fleet's traffic behind it (a heartbeat from every\n"
                   f"worker each second and KV events at {p['event_rate_asked']:,.0f}/s asked{sender};\n"
                   f"what the registry answered is in the last column):\n")
        out.append("| scheduler | pass | condition | Place p50 / p99 ms | decision p50 / p99 ms (histogram) "
                   "| decisions under 1 ms | placements/s | background: heartbeats/s, events/s |")
        out.append("|---|---|---|---|---|---|---|---|")
        for variant, runs in p["runs"].items():
            for run in runs:
                for cond in ("quiet", "with_traffic"):
                    bg = run[cond].get("background")
                    behind = "–" if bg is None else f"{bg['heartbeats_per_s']:,.0f}, {bg['events_per_s']:,.0f}"
                    for flight, key in ((1, "serial"), (16, "concurrent")):
                        x = run[cond][key]
                        share = x["decision_ms"]["share_under_1ms"]
                        out.append(f"| {variant} | {run['pass'] + 1} | {cond.replace('_', ' ')}, {flight} in flight "
                                   f"| {x['place_ms']['p50']:.2f} / {x['place_ms']['p99']:.2f} "
                                   f"| {x['decision_ms']['p50']:.3f} / {x['decision_ms']['p99']:.3f} "
                                   f"| {'–' if share is None else f'{share:.1%}'} | {x['placements_per_s']:,.0f} "
                                   f"| {behind} |")
        c = report["cluster_lookup_ms"]
        if c is None:  # across hosts: the loopback shards are not run
            continue
        out.append("\n| a prompt's 128 owner bitmaps read from | p50 ms | p99 ms |\n|---|---|---|")
        out += [f"| {name.replace('_', ' ')} | {v['p50']:.3f} | {v['p99']:.3f} |" for name, v in c.items()]
    return "\n".join(out) + "\n"
