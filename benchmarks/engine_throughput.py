"""Engine throughput: Kervan's continuous batching against transformers' static batches.

A mixed workload — many requests, prompt and output lengths drawn uniformly from
ranges, greedy, ``ignore_eos`` so every request produces exactly its length — runs
through Kervan's engine and, in the same process on the same weights and dtype,
through ``transformers`` ``generate`` in static batches (left-padded prompts, each
batch generating until its longest request is done). Only the tokens each request
asked for count as output for both. Prints one JSON object: output tokens/s of
each and their ratio, and the engine's KV waste (allocated but unfilled slots
over allocated, summed over every step). Rounds alternate the two systems on
fresh prompts; the headline numbers are medians over rounds.

    python -m benchmarks.engine_throughput                # embedded default model, 3 rounds
    python -m benchmarks.engine_throughput --model DIR --num-requests 128
"""

from __future__ import annotations

import argparse
import json
import random
import time
from statistics import median

import torch

from worker import Engine, SamplingParams
from worker.config import DTYPES
from worker.default_model import ensure_default_model


def workload(num: int, prompt_range: tuple[int, int], output_range: tuple[int, int], vocab: int, seed: int):
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(*prompt_range))] for _ in range(num)]
    outputs = [rng.randint(*output_range) for _ in range(num)]
    return prompts, outputs


def run_kervan(engine: Engine, prompts, outputs) -> dict:
    engine.generate([prompts[0][:8]], SamplingParams(max_tokens=4, temperature=0))  # warm-up
    for prompt, n in zip(prompts, outputs):
        engine.add_request(prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    allocated = used = steps = produced = 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            produced += len(out.outputs[0].new_token_ids)
        a, u = engine.kv_slot_usage()
        allocated, used, steps = allocated + a, used + u, steps + 1
    seconds = time.perf_counter() - start
    return {"output_tokens": produced, "seconds": round(seconds, 3),
            "output_tokens_per_s": round(produced / seconds, 1), "steps": steps,
            "kv_waste": round(1 - used / allocated, 4), "preemptions": engine.scheduler.num_preemptions}


def load_transformers(model_dir, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()


def run_transformers(model, prompts, outputs, batch_size: int) -> dict:
    warm = torch.tensor([prompts[0][:8]])
    model.generate(warm, attention_mask=torch.ones_like(warm), max_new_tokens=4, do_sample=False, pad_token_id=0)
    useful = generated = 0
    start = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        batch, wants = prompts[i:i + batch_size], outputs[i:i + batch_size]
        width = max(map(len, batch))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        longest = max(wants)
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                                 do_sample=False, pad_token_id=0)
        assert out.shape[1] == width + longest
        useful += sum(wants)
        generated += len(batch) * longest
    seconds = time.perf_counter() - start
    return {"output_tokens": useful, "generated_tokens_incl_padding": generated, "seconds": round(seconds, 3),
            "output_tokens_per_s": round(useful / seconds, 1), "batch_size": batch_size}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="Hugging Face model directory (default: embedded model)")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--prompt-len", default="32:512", help="min:max prompt tokens")
    ap.add_argument("--output-len", default="16:256", help="min:max output tokens")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--hf-batch-size", type=int, default=32)
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=3, help="rounds; the report carries the median")
    args = ap.parse_args()

    model_dir = args.model or ensure_default_model()
    engine = Engine.from_pretrained(model_dir, dtype=args.dtype, max_num_seqs=args.max_num_seqs)
    prompt_range = tuple(int(x) for x in args.prompt_len.split(":"))
    output_range = tuple(int(x) for x in args.output_len.split(":"))
    hf_model = None if args.skip_transformers else load_transformers(model_dir, DTYPES[args.dtype])
    runs = []
    # this machine is shared and noisy: alternate the two systems, fresh prompts each round
    # (so no round hits the prefix cache of the previous one), and report the median ratio
    for r in range(args.repeat):
        prompts, outputs = workload(args.num_requests, prompt_range, output_range,
                                    engine.model_config.vocab_size, args.seed + r)
        run = {"seed": args.seed + r, "prompt_tokens": sum(map(len, prompts)),
               "kervan": run_kervan(engine, prompts, outputs)}
        if hf_model is not None:
            run["transformers"] = run_transformers(hf_model, prompts, outputs, args.hf_batch_size)
            run["speedup_vs_transformers"] = round(run["kervan"]["output_tokens_per_s"]
                                                   / run["transformers"]["output_tokens_per_s"], 2)
        runs.append(run)
    report = {
        "benchmark": "engine_throughput",
        "model": str(model_dir), "dtype": args.dtype, "threads": torch.get_num_threads(),
        "workload": {"num_requests": args.num_requests, "prompt_len": prompt_range, "output_len": output_range},
        "runs": runs,
        "kervan_output_tokens_per_s": median(r["kervan"]["output_tokens_per_s"] for r in runs),
        "kv_waste": max(r["kervan"]["kv_waste"] for r in runs),
    }
    if hf_model is not None:
        report["transformers_output_tokens_per_s"] = median(r["transformers"]["output_tokens_per_s"] for r in runs)
        report["speedup_vs_transformers"] = median(r["speedup_vs_transformers"] for r in runs)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
