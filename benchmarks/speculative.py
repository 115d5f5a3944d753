"""Speculative decoding on a real model: decode tokens/s with and without each proposer, and
how many guesses are kept.

Workloads, on held-out texts (the docstrings of the standard library files ``train_eagle``
leaves out, ``control_plane/tools/eagle_data.py``):

- ``chat``: a chat request to explain, summarize or exemplify a docstring;
- ``extraction``: a chat request to repeat a docstring word for word (what n-gram guesses).

For each batch size and temperature (0, and 0.8 unseeded), every round runs each method once
on the same prompts, interleaved, in engines of this process without prefix caching (an EAGLE
head reads the prompt's hidden states only where the target computes them); decode tokens/s
counts the tokens after each request's first and the time after the last first token. Ratios
are against no speculation in the same round; medians with their min-max. The acceptance rate
and mean accepted length are the engine's counters over all rounds.

``--mesh-batches``: the same through the mesh ``kervan up`` starts (a prefill and a decode
worker, each its own process, the KV pushed between them; greedy, as ``kervan bench`` asks),
one cluster per method with the same flags, all up, taking turns; new prompts every round (no prefix hits). A
request's decode rate is its tokens after the first over the time after its first; the
row's, their mean.

    python -m benchmarks.speculative --model ~/.cache/kervan/models/smollm2-135m \\
        --eagle worker/spec/heads/smollm2-135m --json-out benchmarks/results/speculative-avx512.json
"""

from __future__ import annotations

import argparse
import asyncio
import time

from benchmarks.machine import add_dtype_argument, machine, write_report
from benchmarks.stats import spread
from kervan.engine_args import EngineArgs


def prompts(model_dir: str, workload: str, count: int) -> list[str]:
    from control_plane.tools.eagle_data import chat_prompts, stdlib_docstrings
    from kervan.chat_template import ChatTemplate

    docs = stdlib_docstrings(held_out=True)[:count]
    if workload == "chat":
        return chat_prompts(docs, model_dir)
    template = ChatTemplate.from_dir(model_dir)
    return [template.render([{"role": "user", "content": f"Repeat this text word for word:\n\n{doc}"}])
            for doc in docs]


def decode_rate(engine, texts: list[str], params) -> float:
    """Tokens after each request's first, per second after the last first token."""
    ids = [engine.add_request(t, params) for t in texts]
    have_first, started, counted = set(), None, 0
    while engine.has_unfinished_requests():
        outs = engine.step()
        if started is not None:
            counted += sum(len(out.outputs[0].new_token_ids) for out in outs)
        have_first.update(out.request_id for out in outs if out.outputs[0].token_ids)
        if started is None and len(have_first) == len(ids):
            started = time.perf_counter()
    return counted / (time.perf_counter() - started)


def counters(address: str) -> dict[str, float]:
    """A service's /metrics samples without labels, by name."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
            if not s.labels}


def mesh_rows(args, methods: dict[str, dict], engine, batches: list[int]) -> list[dict]:
    """Greedy decode tokens/s through a prefill+decode mesh per method, with the decode
    worker's acceptance counters."""
    from benchmarks.load import run_closed_loop
    from control_plane.cli.launcher import Cluster, ClusterSpec, new_log_dir

    keys = ("speculative", "num_speculative_tokens", "speculative_model", "speculative_disable_by_batch_size")
    flags = {name: {key: o[key] for key in keys if key in o} for name, o in methods.items()}
    clusters = {name: Cluster(ClusterSpec(args.model, engine=EngineArgs(dtype=args.dtype), metrics=True,
                                          **flags[name]), new_log_dir())
                for name in methods}
    rows = []
    try:
        for cluster in clusters.values():
            cluster.start(timeout=300)
        for workload in args.workloads.split(","):
            texts = prompts(args.model, workload, max(batches) * args.rounds)
            ids = [engine.tokenizer.encode(t) for t in texts]
            for batch in batches:
                rates = {name: [] for name in clusters}
                for r in range(args.rounds):
                    work = [(p, args.max_tokens) for p in ids[r * batch:(r + 1) * batch]]
                    for name, cluster in clusters.items():
                        results, _ = asyncio.run(run_closed_loop(cluster.router_address, work, batch))
                        rates[name].append(sum((t.tokens - 1) / (t.e2e - t.ttft) for t in results) / len(results))
                row = {"workload": workload, "temperature": 0.0, "batch": batch, "through": "mesh",
                       "tokens_per_s": {n: spread(v) for n, v in rates.items()}}
                for name in clusters:
                    if name != "none":
                        row[name] = {"ratio": spread([s / b for s, b in zip(rates[name], rates["none"])])}
                print(row, flush=True)
                rows.append(row)
        for name, cluster in clusters.items():  # over every mesh round
            if name == "none":
                continue
            metrics = counters(cluster.addresses["decode-0-metrics"])
            drafts = metrics.get("kervan_spec_decode_num_drafts_total", 0)
            guesses = metrics.get("kervan_spec_decode_num_draft_tokens_total", 0)
            kept = metrics.get("kervan_spec_decode_num_accepted_tokens_total", 0)
            for row in rows:
                row[name].update(acceptance_rate=kept / guesses if guesses else None,
                                 mean_accepted_length=1 + kept / drafts if drafts else None)
    finally:
        for cluster in clusters.values():
            cluster.stop()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--eagle", default=None,
                    help="an EAGLE head's directory (python -m control_plane.tools.train_eagle)")
    ap.add_argument("--batches", default="1,4,16,64")
    ap.add_argument("--temperatures", default="0,0.8")
    ap.add_argument("--workloads", default="chat,extraction")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--num-speculative-tokens", type=int, default=3)
    ap.add_argument("--eagle-speculative-tokens", type=int, default=None, help="the EAGLE head's k (default: the same)")
    ap.add_argument("--disable-by-batch-size", type=int, default=None,
                    help="speculative_disable_by_batch_size (default: the engine's; 0: speculate at every batch)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--mesh-batches", default="1,4", help="through kervan up's mesh too ('' for none)")
    ap.add_argument("--json-out", default=None)
    add_dtype_argument(ap)
    args = ap.parse_args()
    from worker import Engine, SamplingParams

    k = args.num_speculative_tokens
    auto_off = {} if args.disable_by_batch_size is None else {
        "speculative_disable_by_batch_size": args.disable_by_batch_size}
    methods = {"none": {}, "ngram": dict(speculative="ngram", num_speculative_tokens=k, **auto_off)}
    if args.eagle:
        methods["eagle"] = dict(speculative="eagle", speculative_model=args.eagle,
                                num_speculative_tokens=args.eagle_speculative_tokens or k, **auto_off)
    engines = {name: Engine.from_pretrained(args.model, dtype=args.dtype, enable_prefix_caching=False, **opts)
               for name, opts in methods.items()}
    batches = [int(b) for b in args.batches.split(",")]
    results = []
    for workload in args.workloads.split(","):
        texts = prompts(args.model, workload, max(batches))
        for temperature in map(float, args.temperatures.split(",")):
            params = SamplingParams(max_tokens=args.max_tokens, temperature=temperature, ignore_eos=True)
            for batch in batches:
                rates = {name: [] for name in engines}
                before = {name: e.stats() for name, e in engines.items()}
                for _ in range(args.rounds):
                    for name, engine in engines.items():
                        rates[name].append(decode_rate(engine, texts[:batch], params))
                row = {"workload": workload, "temperature": temperature, "batch": batch,
                       "tokens_per_s": {n: spread(r) for n, r in rates.items()}}
                for name, engine in engines.items():
                    if name == "none":
                        continue
                    after = engine.stats()
                    drafts = after.spec_num_drafts - before[name].spec_num_drafts
                    guesses = after.spec_num_draft_tokens - before[name].spec_num_draft_tokens
                    kept = after.spec_num_accepted_tokens - before[name].spec_num_accepted_tokens
                    row[name] = {"ratio": spread([s / b for s, b in zip(rates[name], rates["none"])]),
                                 "acceptance_rate": kept / guesses if guesses else None,
                                 "mean_accepted_length": 1 + kept / drafts if drafts else None}
                print(row, flush=True)
                results.append(row)
    if args.mesh_batches:
        reference = engines["none"]
        for name in [n for n in engines if n != "none"]:
            engines.pop(name).close()
        results += mesh_rows(args, methods, reference, [int(b) for b in args.mesh_batches.split(",")])
    write_report({"benchmark": "speculative", "machine": machine(args.dtype), "args": vars(args),
                  "results": results}, args.json_out)


if __name__ == "__main__":
    main()
