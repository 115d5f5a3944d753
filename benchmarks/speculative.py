"""Speculative decoding on a real model: decode tokens/s with and without each proposer, and
how many guesses are kept.

Workloads, on held-out texts (the docstrings of the standard library files ``train_eagle``
leaves out, ``control_plane/tools/eagle_data.py``):

- ``chat``: a chat request to explain, summarize or exemplify a docstring;
- ``extraction``: a chat request to repeat a docstring word for word (what n-gram guesses);
- ``questions``: everyday chat questions (cooking, travel, health, history, advice: no code,
  no docstrings), off the texts the EAGLE head was trained on.

Proposers: ``ngram``, ``eagle`` (``--eagle``: a head) and ``draft`` (``--draft``: a smaller or
lower-precision model of the same vocabulary; the pulled GGUF Q4_1 is a real draft of the
same model expanded to float32). ``--k-sweep`` first measures each proposer's batch-1 greedy
ratio at every k listed on the ``chat`` prompts of their own (held-out docstrings, never the
rows' ``questions``) and runs the rows at each proposer's best k; the sweep is in the report.

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
row's, their mean. Each row's acceptance is the decode worker's counters' change over that
row alone (reports before 2026-12-07 wrote one pooled figure into every mesh row).

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

QUESTIONS = (
    "What should I pack for a week of hiking in the mountains?", "How do I make a simple tomato soup?",
    "Why do leaves change colour in autumn?", "What are some tips for sleeping better?",
    "Can you suggest a plan for learning to play the guitar?", "What caused the fall of the Roman Empire?",
    "How can I save money on groceries?", "What is a good way to start running as a beginner?",
    "How do bees make honey?", "What should I consider when adopting a dog?",
    "Write a short poem about the sea at night.", "How do I politely decline a wedding invitation?",
    "What are the health benefits of walking every day?", "Explain how a rainbow forms.",
    "What are good houseplants for a dark apartment?", "How do I prepare for a job interview?",
    "What is the difference between weather and climate?", "Suggest a three-day itinerary for Rome.",
    "How can I be more patient with my children?", "Why is the sky blue?",
    "What are some easy vegetarian dinners?", "How do volcanoes form?",
    "What should I do if I feel stressed at work?", "Tell me a short story about a lost cat finding home.",
    "How do I keep cut flowers fresh longer?", "What were the main causes of the First World War?",
    "How often should I water a cactus?", "What makes bread rise?",
    "How can I improve my handwriting?", "What are the rules of chess for beginners?",
    "How do I remove a coffee stain from a shirt?", "What is the best way to learn a new language?",
)  # the ``questions`` workload: nothing like the docstrings the EAGLE head was trained on


def prompts(model_dir: str, workload: str, count: int) -> list[str]:
    from control_plane.tools.eagle_data import chat_prompts, stdlib_docstrings
    from kervan.chat_template import ChatTemplate

    template = ChatTemplate.from_dir(model_dir)
    if workload == "questions":
        return [template.render([{"role": "user", "content": q}]) for q in QUESTIONS[:count]]
    docs = stdlib_docstrings(held_out=True)[:count]
    if workload == "chat":
        return chat_prompts(docs, model_dir)
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


def spec_counts(cluster) -> tuple[float, float, float]:
    """The decode worker's (drafts, draft tokens, accepted tokens) so far."""
    metrics = counters(cluster.addresses["decode-0-metrics"])
    return tuple(metrics.get(f"kervan_spec_decode_num_{name}_total", 0.0)
                 for name in ("drafts", "draft_tokens", "accepted_tokens"))


def mesh_rows(args, methods: dict[str, dict], engine, batches: list[int]) -> list[dict]:
    """Greedy decode tokens/s through a prefill+decode mesh per method, with the decode
    worker's acceptance counters."""
    from benchmarks.load import run_closed_loop
    from control_plane.cli.launcher import Cluster, ClusterSpec, new_log_dir

    keys = ("speculative", "num_speculative_tokens", "speculative_model", "speculative_disable_by_batch_size")
    flags = {name: {key: o[key] for key in keys if key in o} for name, o in methods.items()}
    clusters = {name: Cluster(ClusterSpec(args.model, engine=EngineArgs(dtype=args.dtype, **flags[name]), metrics=True),
                              new_log_dir())
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
                before = {name: spec_counts(c) for name, c in clusters.items() if name != "none"}
                for r in range(args.rounds):
                    work = [(p, args.max_tokens) for p in ids[r * batch:(r + 1) * batch]]
                    for name, cluster in clusters.items():
                        results, _ = asyncio.run(run_closed_loop(cluster.router_address, work, batch))
                        rates[name].append(sum((t.tokens - 1) / (t.e2e - t.ttft) for t in results) / len(results))
                row = {"workload": workload, "temperature": 0.0, "batch": batch, "through": "mesh",
                       "tokens_per_s": {n: spread(v) for n, v in rates.items()}}
                for name, counts in before.items():  # this row's own guesses: the counters' change over it
                    drafts, guesses, kept = (a - b for a, b in zip(spec_counts(clusters[name]), counts))
                    row[name] = {"ratio": spread([s / b for s, b in zip(rates[name], rates["none"])]),
                                 "acceptance_rate": kept / guesses if guesses else None,
                                 "mean_accepted_length": 1 + kept / drafts if drafts else None}
                print(row, flush=True)
                rows.append(row)
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
    ap.add_argument("--workloads", default="chat,extraction,questions")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--num-speculative-tokens", type=int, default=3)
    ap.add_argument("--eagle-speculative-tokens", type=int, default=None, help="the EAGLE head's k (default: the same)")
    ap.add_argument("--disable-by-batch-size", type=int, default=None,
                    help="speculative_disable_by_batch_size (default: the engine's; 0: speculate at every batch)")
    ap.add_argument("--draft", default=None,
                    help="a draft model's directory (the same vocabulary): the pulled GGUF of the model served dense")
    ap.add_argument("--k-sweep", default=None, type=lambda v: [int(x) for x in v.split(",")],
                    help="k values to sweep per proposer first (batch 1, greedy, prompts of their own); "
                         "the rows then run at each proposer's best")
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
    if args.draft:
        methods["draft"] = dict(speculative="draft", speculative_model=args.draft, num_speculative_tokens=k,
                                **auto_off)

    def load(opts: dict):
        return Engine.from_pretrained(args.model, dtype=args.dtype, enable_prefix_caching=False, **opts)

    sweep = {}
    if args.k_sweep:
        methods, sweep = swept(args, methods, load, SamplingParams(max_tokens=args.max_tokens, temperature=0.0,
                                                                   ignore_eos=True))
    engines = {name: load(opts) for name, opts in methods.items()}
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
                  "k_sweep": sweep, "k": {n: o.get("num_speculative_tokens") for n, o in methods.items()},
                  "results": results}, args.json_out)


def swept(args, methods: dict[str, dict], load, params) -> tuple[dict[str, dict], dict]:
    """Each proposer at its best k of ``--k-sweep``: batch-1 greedy decode over no speculation,
    on chat prompts kept for the sweep (held-out docstrings past those the rows use), the
    median of ``--rounds``; the methods at their best k, and every ratio measured."""
    texts = prompts(args.model, "chat", 16 + args.rounds)[16:]
    plain = load(methods["none"])
    base = [decode_rate(plain, [t], params) for t in texts]
    plain.close()
    chosen, sweep = dict(methods), {}
    for name in [n for n in methods if n != "none"]:
        sweep[name] = {}
        for k in args.k_sweep:
            engine = load({**methods[name], "num_speculative_tokens": k})
            rates = [decode_rate(engine, [t], params) for t in texts]
            engine.close()
            sweep[name][str(k)] = spread([r / b for r, b in zip(rates, base)])
            print(f"k sweep {name} k={k}: {sweep[name][str(k)]}", flush=True)
        best = max(args.k_sweep, key=lambda k: sweep[name][str(k)]["median"])
        chosen[name] = {**methods[name], "num_speculative_tokens": best}
    return chosen, sweep


if __name__ == "__main__":
    main()
