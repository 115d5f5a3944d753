"""Engine throughput: Kervan's engine against transformers and vLLM's CPU build.

A mixed workload — many requests, prompt and output lengths drawn uniformly from
ranges, greedy, ``ignore_eos`` so every request produces exactly its length — runs
through Kervan's engine and, on the same weights and dtype,
- ``transformers`` ``generate`` in static batches (left-padded prompts, each batch
  generating until its longest request is done), in this process;
- vLLM's CPU build, when ``--vllm-python`` names the Python of a venv that has it
  (``benchmarks/vllm_peer.py`` runs there; all requests submitted at once, as the
  engine gets them), set up as its CPU docs recommend (TCMalloc and Intel OpenMP preloaded,
  OpenMP threads bound, the same KV space) at the fastest ``max_num_batched_tokens`` of
  ``--vllm-batched-tokens`` on the calibration prompts; every setting and tuning variable it
  ran with is in the report.
Only the tokens each request asked for count as output. transformers runs at its
best batch size (chosen by a calibration round on prompts of their own, never the
measured ones, from ``--hf-batch-sizes``), in arrival order and, as a static batcher
that knows every request's length would, sorted by output length
(``transformers_sorted``: little padding left; at its own best batch size among those
that split the requests into more than one batch, since one batch of all of them is
the unsorted run again). ``kervan_unpacked`` is the engine
without oneDNN weight packing (``KERVAN_WEIGHT_PACKING=off``), the one optimisation
transformers does not get (which now also gives up batch invariance: the engine's own
kernels take packed layouts). Every engine gets the same KV budget
(``--kv-cache-gib``) and its timer covers submitting the requests too; a round
fails unless each system produced exactly the tokens asked for. Rounds run the
systems in rotated order on fresh prompts; each
dtype's numbers are medians over rounds (ratios: the median of the per-round
ratios, with min and max), and the report compares each engine's best dtype (on an
AVX2 CPU float32, where bf16 is emulated; with native bf16, bf16). Also reported:
the engine's KV waste (allocated but unfilled slots over allocated, summed over
every step), load times, and the ISA.

    python -m benchmarks.engine_throughput                       # embedded default model, dtype auto
    python -m benchmarks.engine_throughput --vocab-size 32000 --dtype float32,bfloat16 \\
        --vllm-python /path/to/vllm-venv/bin/python             # the 58M model, both dtypes, vLLM too
    python -m benchmarks.engine_throughput --model smollm2-135m  # the real 135M model (kervan pull)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import time
from statistics import median

import torch

from benchmarks.machine import machine, write_report
from benchmarks.models import SHAPES, ensure_random_model
from benchmarks.vllm_peer import VllmPeer, documented_preload
from control_plane.tools.pull import resolve_model
from kervan.envs import KERVAN_WEIGHT_PACKING
from worker import Engine, SamplingParams
from worker.default_model import ensure_default_model
from worker.platform import DTYPE_CHOICES, dtype_name


def workload(num: int, prompt_range: tuple[int, int], output_range: tuple[int, int], vocab: int, seed: int):
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(*prompt_range))] for _ in range(num)]
    outputs = [rng.randint(*output_range) for _ in range(num)]
    return prompts, outputs


def run_kervan(engine: Engine, prompts, outputs) -> dict:
    engine.generate([prompts[0][:8]], SamplingParams(max_tokens=4, temperature=0))  # warm-up
    allocated = used = steps = produced = 0
    start = time.perf_counter()  # submitting the requests is timed, as vLLM's generate() times it
    for prompt, n in zip(prompts, outputs):
        engine.add_request(prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    while engine.has_unfinished_requests():
        for out in engine.step():
            produced += len(out.outputs[0].new_token_ids)
        stats = engine.stats()
        allocated, used = allocated + stats.num_kv_slots_allocated, used + stats.num_kv_slots_used
        steps += 1
    seconds = time.perf_counter() - start
    return {"output_tokens": produced, "seconds": round(seconds, 3),
            "output_tokens_per_s": round(produced / seconds, 1), "steps": steps,
            "kv_waste": round(1 - used / allocated, 4), "preemptions": engine.stats().num_preemptions}


def load_transformers(model_dir, dtype: torch.dtype, device: str):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()


def run_transformers(model, prompts, outputs, batch_size: int, by_length: bool = False) -> dict:
    warm = torch.tensor([prompts[0][:8]], device=model.device)
    model.generate(warm, attention_mask=torch.ones_like(warm), max_new_tokens=4, do_sample=False, pad_token_id=0)
    useful = generated = 0
    if by_length:  # batches of similar output lengths: a static batcher's best case
        order = sorted(range(len(prompts)), key=lambda i: outputs[i])
        prompts, outputs = [prompts[i] for i in order], [outputs[i] for i in order]
    start = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        batch, wants = prompts[i:i + batch_size], outputs[i:i + batch_size]
        width = max(map(len, batch))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch], device=model.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=model.device)
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


def timed_load(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, round(time.perf_counter() - t0, 2)


def new_engine(model_dir, dtype: str, args, packing: str = "auto") -> Engine:
    previous = os.environ.get(KERVAN_WEIGHT_PACKING)
    os.environ[KERVAN_WEIGHT_PACKING] = packing
    try:
        return Engine.from_pretrained(model_dir, dtype=dtype, device=args.device, max_num_seqs=args.max_num_seqs,
                                      max_num_batched_tokens=args.max_num_batched_tokens,
                                      kv_cache_memory_bytes=int(args.kv_cache_gib * (1 << 30)))
    finally:
        if previous is None:
            os.environ.pop(KERVAN_WEIGHT_PACKING)
        else:
            os.environ[KERVAN_WEIGHT_PACKING] = previous


def best_batch_size(hf_model, calibration, sizes: list[int], by_length: bool = False) -> tuple[int, dict]:
    """transformers' fastest batch size on the calibration prompts (not the measured ones)."""
    prompts, outputs = calibration
    rates = {b: run_transformers(hf_model, prompts, outputs, b, by_length)["output_tokens_per_s"] for b in sizes}
    return max(rates, key=rates.get), rates


def tuned_vllm(model_dir, dtype: str, calibration, args) -> tuple[VllmPeer, dict]:
    """vLLM at the fastest of ``--vllm-batched-tokens`` on the calibration prompts (never the
    measured ones), as its CPU docs' tuning advice asks. One candidate runs at a time (a 1B
    model in float32 twice over would not fit beside Kervan's), then the fastest starts again."""
    def start(tokens: int) -> VllmPeer:
        return VllmPeer(args.vllm_python, str(model_dir), dtype,
                        {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": tokens},
                        args.kv_cache_gib, args.vllm_preload)

    if len(args.vllm_batched_tokens) == 1:
        return start(args.vllm_batched_tokens[0]), {}
    rates = {}
    for tokens in args.vllm_batched_tokens:
        peer = start(tokens)
        try:
            rates[tokens] = peer.run(*calibration)["output_tokens_per_s"]
        finally:
            peer.close()
    return start(max(rates, key=rates.get)), {str(k): v for k, v in rates.items()}


def run_dtype(model_dir, dtype: str, rounds, calibration, args) -> dict:
    """Every system in one dtype, round by round on the same prompts."""
    engine, kervan_load_s = timed_load(lambda: new_engine(model_dir, dtype, args))
    unpacked = new_engine(model_dir, dtype, args, packing="off") if args.unpacked else None
    resolved, config = dtype_name(engine.config.dtype), engine.config
    hf_model, hf_load_s = (None, None) if args.skip_transformers else timed_load(
        lambda: load_transformers(model_dir, config.dtype, config.device))
    sizes = [int(b) for b in args.hf_batch_sizes.split(",")]
    batch, calibrated = (sizes[0], {}) if hf_model is None or len(sizes) == 1 else \
        best_batch_size(hf_model, calibration, sizes)
    peer, searched = tuned_vllm(model_dir, resolved, calibration, args) if args.vllm_python else (None, {})
    systems = {"kervan": lambda p, o: run_kervan(engine, p, o)}
    if unpacked is not None:
        systems["kervan_unpacked"] = lambda p, o: run_kervan(unpacked, p, o)
    # the sorted control only means something with more than one batch: its own best size among those
    # that split the requests (one batch of all of them would be the unsorted run again)
    split = [b for b in sizes if b < len(calibration[0])]
    sorted_batch, sorted_calibrated = (split[0] if split else None, {}) if hf_model is None or len(split) <= 1 else \
        best_batch_size(hf_model, calibration, split, by_length=True)
    if hf_model is not None:
        systems["transformers"] = lambda p, o: run_transformers(hf_model, p, o, batch)
        if split:
            systems["transformers_sorted"] = lambda p, o: run_transformers(hf_model, p, o, sorted_batch,
                                                                           by_length=True)
    if peer is not None:
        systems["vllm"] = peer.run
    runs = []
    try:
        for index, (seed, (prompts, outputs)) in enumerate(rounds):
            order = list(systems)[index % len(systems):] + list(systems)[:index % len(systems)]  # rotated
            run = {"seed": seed, "prompt_tokens": sum(map(len, prompts)), "order": order}
            for name in order:
                run[name] = systems[name](prompts, outputs)
                if run[name]["output_tokens"] != sum(outputs):  # every system did the same work
                    raise RuntimeError(f"{name} produced {run[name]['output_tokens']} tokens, not {sum(outputs)}")
            runs.append(run)
    finally:
        if peer is not None:
            peer.close()
    result = {"dtype": resolved, "device": engine.config.device, "runs": runs,
              "kv_waste": max(r["kervan"]["kv_waste"] for r in runs),
              "load_s": {"kervan": kervan_load_s, "transformers": hf_load_s},
              "transformers_batch_size": batch, "transformers_calibration_tok_s": calibrated,
              "transformers_sorted_batch_size": sorted_batch if hf_model is not None and split else None,
              "transformers_sorted_calibration_tok_s": sorted_calibrated}
    for system in SYSTEMS:
        if system in runs[0]:
            result[f"{system}_output_tokens_per_s"] = median(r[system]["output_tokens_per_s"] for r in runs)
    for peer_name in SYSTEMS[2:]:  # per-round ratios: both systems saw the same moment
        if peer_name in runs[0]:
            result[f"kervan_vs_{peer_name}"] = ratio_summary(runs, "kervan", peer_name)
    if peer is not None:
        result["vllm_version"] = peer.info.get("vllm")
        result["vllm_settings"], result["vllm_env"] = peer.info.get("settings"), peer.info.get("env")
        result["vllm_search_tok_s"] = searched
    systems.clear()
    engine = unpacked = hf_model = None  # freed before the next dtype loads its own
    gc.collect()
    return result


# Kervan, then the peers (each compared with Kervan). Reports before batch invariance also ran
# "kervan_deterministic", the engine in the opt-in mode of the time, now its only one
SYSTEMS = ("kervan", "kervan_deterministic", "kervan_unpacked", "transformers", "transformers_sorted", "vllm")


def ratio_summary(runs: list[dict], system: str, baseline: str) -> dict:
    """The median of the per-round throughput ratios, with their min and max."""
    ratios = [r[system]["output_tokens_per_s"] / r[baseline]["output_tokens_per_s"] for r in runs]
    return {"median": round(median(ratios), 3), "min": round(min(ratios), 3), "max": round(max(ratios), 3)}


def best(by_dtype: dict, system: str) -> dict | None:
    key = f"{system}_output_tokens_per_s"
    have = [(r[key], name) for name, r in by_dtype.items() if key in r]
    if not have:
        return None
    tok_s, name = max(have)
    return {"dtype": by_dtype[name]["dtype"], "output_tokens_per_s": tok_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="Hugging Face model directory (default: embedded model)")
    ap.add_argument("--vocab-size", type=int, default=None,
                    help="without --model: a random model of the embedded model's shape with this vocabulary")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--prompt-len", default="32:512", help="min:max prompt tokens")
    ap.add_argument("--output-len", default="16:256", help="min:max output tokens")
    ap.add_argument("--dtype", default="auto", help=f"comma-separated, each one of {', '.join(DTYPE_CHOICES)}")
    ap.add_argument("--device", default="auto", help="auto (CUDA when present), cpu or cuda")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--hf-batch-sizes", default="8,16,32,64",
                    help="transformers' batch sizes to calibrate over (one: use it as it is)")
    ap.add_argument("--kv-cache-gib", type=float, default=2.0,
                    help="KV cache of every engine (Kervan's kv_cache_memory_bytes, vLLM's VLLM_CPU_KVCACHE_SPACE)")
    ap.add_argument("--unpacked", action="store_true", help="also the engine without weight packing")
    ap.add_argument("--json-out", default=None, help="also write the report here (benchmarks/results/*.json)")
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--vllm-python", default=None, help="the python of a venv with vllm-cpu: run vLLM as a peer")
    ap.add_argument("--vllm-preload", default="documented",
                    help="LD_PRELOAD for the vLLM peer: `documented` (its CPU docs: TCMalloc and the Intel OpenMP "
                         "its wheel installs), `none`, or a path list")
    ap.add_argument("--vllm-batched-tokens", default="2048,4096,8192",
                    type=lambda s: [int(x) for x in s.split(",")],
                    help="vLLM's max_num_batched_tokens to search on the calibration prompts (its CPU docs' tuning; "
                         "max_num_seqs is --max-num-seqs, at least the requests of a round here)")
    ap.add_argument("--shape", default="default", choices=sorted(SHAPES),
                    help="without --model: the random model's shape (benchmarks/models.py; llama1b: Llama-3.2-1B's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=3, help="rounds; the report carries the median")
    args = ap.parse_args()
    if args.vllm_python:
        args.vllm_preload = {"documented": documented_preload(args.vllm_python), "none": None}.get(
            args.vllm_preload, args.vllm_preload)
    dtypes = [d.strip().lower() for d in args.dtype.split(",")]
    if any(d not in DTYPE_CHOICES for d in dtypes):
        ap.error(f"--dtype: each of {dtypes} must be one of {', '.join(DTYPE_CHOICES)}")

    if args.model:
        model_dir = resolve_model(args.model)
    else:
        model_dir = ensure_random_model(args.vocab_size, args.shape) if args.vocab_size else ensure_default_model()
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    prompt_range = tuple(int(x) for x in args.prompt_len.split(":"))
    output_range = tuple(int(x) for x in args.output_len.split(":"))
    # fresh prompts each round, so no round hits the prefix cache of the previous one
    rounds = [(args.seed + r, workload(args.num_requests, prompt_range, output_range, vocab, args.seed + r))
              for r in range(args.repeat)]
    calibration = workload(args.num_requests, prompt_range, output_range, vocab, args.seed + 10_000)
    by_dtype = {d: run_dtype(model_dir, d, rounds, calibration, args) for d in dtypes}
    report = {
        "benchmark": "engine_throughput",
        "model": str(model_dir), "vocab_size": vocab, "machine": machine(), "threads": torch.get_num_threads(),
        "vllm_preload": args.vllm_preload,
        "workload": {"num_requests": args.num_requests, "prompt_len": prompt_range, "output_len": output_range,
                     "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
                     "kv_cache_gib": args.kv_cache_gib, "rounds": args.repeat},
        "dtypes": by_dtype,
        "best": {s: b for s in SYSTEMS if (b := best(by_dtype, s))},
        "kv_waste": max(r["kv_waste"] for r in by_dtype.values()),
    }
    for peer_name in SYSTEMS[2:]:
        if peer_name in report["best"]:
            report[f"kervan_best_vs_{peer_name}_best"] = round(
                report["best"]["kervan"]["output_tokens_per_s"] / report["best"][peer_name]["output_tokens_per_s"], 3)
    write_report(report, args.json_out)


if __name__ == "__main__":
    main()
