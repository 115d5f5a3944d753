"""Speculative decoding on a real model: decode tokens/s with and without each proposer, and
how many guesses are kept.

Workloads, on held-out texts (the docstrings of the standard library files ``train_eagle``
leaves out, ``worker/spec/eagle_data.py``):

- ``chat``: a chat request to explain, summarize or exemplify a docstring;
- ``extraction``: a chat request to repeat a docstring word for word (what n-gram guesses).

For each batch size and temperature (0, and 0.8 unseeded), every round runs each method once
on the same prompts, interleaved; decode tokens/s counts the tokens after each request's first
and the time after the last first token. Ratios are against no speculation in the same round;
medians with their min-max. The acceptance rate and mean accepted length are the engine's
counters over all rounds.

    python -m benchmarks.speculative --model ~/.cache/kervan/models/smollm2-135m \\
        --eagle ~/.cache/kervan/eagle/smollm2-135m --json-out benchmarks/results/speculative-avx512.json
"""

from __future__ import annotations

import argparse
import time

from benchmarks.machine import add_dtype_argument, machine, write_report
from benchmarks.stats import spread


def prompts(model_dir: str, workload: str, count: int) -> list[str]:
    from services.router.chat_template import ChatTemplate
    from worker.spec.eagle_data import chat_prompts, stdlib_docstrings

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--eagle", default=None, help="an EAGLE head's directory (python -m worker.spec.train_eagle)")
    ap.add_argument("--batches", default="1,4,16,64")
    ap.add_argument("--temperatures", default="0,0.8")
    ap.add_argument("--workloads", default="chat,extraction")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--num-speculative-tokens", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json-out", default=None)
    add_dtype_argument(ap)
    args = ap.parse_args()
    from worker import Engine, SamplingParams

    k = args.num_speculative_tokens
    methods = {"none": {}, "ngram": dict(speculative="ngram", num_speculative_tokens=k)}
    if args.eagle:
        methods["eagle"] = dict(speculative="eagle", speculative_model=args.eagle, num_speculative_tokens=k)
    engines = {name: Engine.from_pretrained(args.model, dtype=args.dtype, **opts) for name, opts in methods.items()}
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
    write_report({"benchmark": "speculative", "machine": machine(args.dtype), "args": vars(args),
                  "results": results}, args.json_out)


if __name__ == "__main__":
    main()
