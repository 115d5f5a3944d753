# mypy: disable-error-code="arg-type,attr-defined,misc,return-value"
"""``kervan bench``: the command line, and ``sweep``, which the benchmarks in
``benchmarks/`` call with the same arguments."""

from __future__ import annotations

import asyncio
import json
import math
import sys
from pathlib import Path

import click


def parse_loads(rates: str | None, concurrencies: str | None, ramp: str | None = None) -> list[tuple[str, object]]:
    """``--request-rate 1,2,inf``, ``--concurrency 1,8`` or ``--ramp 30:1,60:4`` -> [("rate", 1.0), ...]."""
    if sum(x is not None for x in (rates, concurrencies, ramp)) > 1:
        raise click.UsageError("--request-rate (open loop), --concurrency (closed loop) and --ramp exclude each other")
    if ramp is not None:
        from .load import Ramp
        try:
            return [("ramp", Ramp.parse(ramp))]
        except ValueError as exc:
            raise click.UsageError(str(exc)) from None
    try:
        if concurrencies:
            loads = [("concurrency", int(c)) for c in concurrencies.split(",")]
        else:
            loads = [("rate", float(r)) for r in (rates or "inf").split(",")]
    except ValueError:
        raise click.UsageError("a rate is a number of requests per second (or inf); a concurrency an integer") \
            from None
    if any(v <= 0 or (kind == "rate" and math.isnan(v)) for kind, v in loads):
        raise click.UsageError("rates and concurrencies are positive")
    return loads


async def sweep(backend, requests_for, loads, *, seed: int = 0, max_concurrency: int | None = None,
                percentiles=(50, 90, 99), slo: dict | None = None, warmup: int = 1, progress: bool = True,
                say=None) -> list[dict]:
    """One run per load, in the order given, load i over ``requests_for(i)``: the same
    shape, other prompts, so a run never finds the previous run's prompts cached (shared
    prefixes stay shared). ``warmup`` requests of ``requests_for(-1)`` go first, their
    results dropped: connections open, first-call costs paid."""
    from .load import run_closed_loop, run_open_loop
    from .report import summarize

    runs = []
    async with backend:
        for req in requests_for(-1)[:warmup]:
            await backend.send(req)
        for i, (kind, value) in enumerate(loads):
            requests = requests_for(i)
            if kind == "ramp":
                results, wall = await run_open_loop(backend, requests, value, seed, max_concurrency, progress)
                runs.append({"load": "ramp", "ramp": [list(p) for p in value.phases],
                             "summary": summarize(results, wall, percentiles, slo),
                             "phases": ramp_phases(value, results, seed, percentiles, slo)})
                label = "ramp"
            else:
                if kind == "rate":
                    results, wall = await run_open_loop(backend, requests, value, seed, max_concurrency, progress)
                    label = f"{value:g}/s"
                else:
                    results, wall = await run_closed_loop(backend, requests, value, progress)
                    label = f"c={value}"
                runs.append({"load": label, kind if kind == "concurrency" else "request_rate": value,
                             "summary": summarize(results, wall, percentiles, slo)})
            summary = runs[-1]["summary"]
            if say:
                say(one_line(label, summary))
    return runs


def ramp_phases(ramp, results, seed: int, percentiles, slo: dict | None) -> list[dict]:
    """One summary per phase of a ramp, of the requests that arrived in it (throughputs
    over the phase's seconds)."""
    from .report import summarize

    by_phase: list[list] = [[] for _ in ramp.phases]
    for result, offset in zip(results, ramp.offsets(seed)):
        by_phase[ramp.phase_of(offset)].append(result)
    return [{"seconds": seconds, "request_rate": rate, "summary": summarize(group, seconds, percentiles, slo)}
            for (seconds, rate), group in zip(ramp.phases, by_phase)]


def one_line(label: str, s: dict) -> str:
    good = f", goodput {s['goodput']:.2f} req/s" if s.get("goodput") is not None else ""
    failed = f", {s['failed']} failed {s['errors']}" if s["failed"] else ""
    return (f"{label:>10}: {s['completed']} done in {s['duration_s']:.1f}s, {s['request_throughput']:.2f} req/s, "
            f"{s['output_throughput']:.1f} out tok/s; TTFT median {s['median_ttft_ms']} ms, "
            f"TPOT median {s['median_tpot_ms']} ms, ITL p99 {s.get('p99_itl_ms')} ms{good}{failed}")


@click.command()
@click.option("--backend", type=click.Choice(["kervan", "openai"]), default="kervan", show_default=True,
              help="kervan: a router's gRPC API; openai: any OpenAI-compatible server's /v1/completions")
@click.option("--addr", default="127.0.0.1:8470", show_default=True,
              help="kervan: router address(es), comma-separated; openai: the base URL (http://host:port/v1)")
@click.option("--model", "served_model", default="kervan", show_default=True, help="openai: the model name to ask for")
@click.option("--tls-ca", default=None, type=click.Path(exists=True, dir_okay=False), help="kervan: the router's CA")
@click.option("--api-key", default=None, help="sent as 'authorization: Bearer <key>'")
@click.option("--num-prompts", default=200, show_default=True, help="requests per run (the same list for every load)")
@click.option("--input-len", default="fixed:256", show_default=True,
              help="prompt tokens: N, fixed:N, uniform:LO:HI or normal:MEAN:STD (after the shared prefix)")
@click.option("--output-len", default="fixed:64", show_default=True, help="output tokens, as --input-len")
@click.option("--prompts-file", default=None, type=click.Path(exists=True, dir_okay=False),
              help="real prompts: JSON lines with a 'prompt' field, or one prompt per line (replaces --input-len)")
@click.option("--shared-prefix", default=None,
              help="GROUPS:LENGTH[:ZIPF_S]: every prompt starts with one of GROUPS prefixes, chosen by Zipf(s)")
@click.option("--token-range", default="3:600", show_default=True,
              help="LO:HI: random prompt token ids are drawn from [LO, HI) (keep HI under the vocabulary)")
@click.option("--request-rate", default=None,
              help="open loop: Poisson arrivals at these requests/s, comma-separated for a sweep (default inf)")
@click.option("--concurrency", default=None, help="closed loop instead: N in flight, comma-separated for a sweep")
@click.option("--ramp", default=None, help="open loop whose rate steps: SECONDS:RATE,... (e.g. 30:1,60:4,30:1), "
              "one run of that many requests, summarized whole and per phase (replaces --num-prompts)")
@click.option("--max-concurrency", default=None, type=int, help="open loop: at most this many in flight")
@click.option("--goodput", multiple=True, help="a latency target, NAME:MS with NAME ttft, tpot or e2el (repeatable)")
@click.option("--percentiles", default="50,90,99", show_default=True)
@click.option("--seed", default=0, show_default=True)
@click.option("--warmup", default=1, show_default=True, help="requests sent (and not counted) before the runs")
@click.option("--json", "json_path", default=None, help="also write the result to this file")
@click.option("--plot", "plot_path", default=None, help="a PNG of latency against throughput (needs matplotlib)")
@click.option("--no-progress", is_flag=True)
def bench(backend, addr, served_model, tls_ca, api_key, num_prompts, input_len, output_len, prompts_file,
          shared_prefix, token_range, request_rate, concurrency, ramp, max_concurrency, goodput, percentiles, seed,
          warmup, json_path, plot_path, no_progress) -> None:
    """Load a Kervan router (or an OpenAI-compatible server) and report throughput,
    TTFT, TPOT, ITL and end-to-end latency percentiles, and goodput. Prints JSON."""
    from . import workload
    from .report import parse_goodput, plot_sweep

    loads = parse_loads(request_rate, concurrency, ramp)
    if ramp is not None:
        num_prompts = loads[0][1].num_requests
    try:
        lo, hi = (int(x) for x in token_range.split(":"))
        shape = dict(input_len=workload.Lengths.parse(input_len), output_len=workload.Lengths.parse(output_len),
                     token_range=(lo, hi), prompts_file=Path(prompts_file) if prompts_file else None,
                     shared_prefix=workload.SharedPrefix.parse(shared_prefix) if shared_prefix else None)
        workload.build(1, **shape)  # a bad file fails here, before any load
        slo = parse_goodput(list(goodput))
        pcts = tuple(float(p) for p in percentiles.split(","))
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    target = make_backend(backend, addr, served_model, tls_ca, api_key)
    say = lambda line: click.echo(line, err=True)  # noqa: E731
    def requests_for(i: int):
        return workload.build(num_prompts, seed=seed * 1000 + i + 1, prefix_seed=seed, **shape)

    runs = asyncio.run(sweep(target, requests_for, loads, seed=seed, max_concurrency=max_concurrency,
                             percentiles=pcts, slo=slo, warmup=warmup, progress=not no_progress, say=say))
    result = {"backend": backend, "target": addr, "num_prompts": num_prompts, "seed": seed,
              "workload": {"input_len": None if prompts_file else input_len, "output_len": output_len,
                           "prompts_file": prompts_file, "shared_prefix": shared_prefix},
              "runs": runs}
    text = json.dumps(result, indent=1)
    if json_path:
        Path(json_path).write_text(text + "\n")
    if plot_path:
        plot_sweep(runs, Path(plot_path), f"kervan bench: {backend} at {addr}")
    click.echo(text)
    if all(r["summary"]["completed"] == 0 for r in runs):
        sys.exit(1)


def make_backend(kind: str, addr: str, model: str, tls_ca: str | None, api_key: str | None):
    from .backends import KervanBackend, OpenAIBackend

    if kind == "openai":
        return OpenAIBackend(addr, model, api_key)
    if tls_ca:
        from services.common.security import MeshSecurity
        return KervanBackend(addr, MeshSecurity.from_files(None, None, tls_ca), api_key)
    return KervanBackend(addr, api_key=api_key)
