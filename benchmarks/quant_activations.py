"""The GGUF as shipped, its decode-step matmuls with float activations against int8 ones
(``worker/kernels/quant_int8.cpp``), and llama.cpp on the same file, in one run.

- Speed: batch-1 decode ms per token (a 64-token prompt, then ``--new-tokens`` greedy
  steps, the median step) and batch-8 and batch-32 decode tok/s, for the engine with
  ``KERVAN_QUANT_ACTIVATIONS=float``, ``int8`` and ``auto`` (the per-shape choice timed at
  load), and prompt processing of 512 tokens (tok/s of one 512-token prefill); llama.cpp's
  ``llama-bench`` (``tg``: batch 1, ``pp``: the prompt) in every round, after Kervan's runs,
  where ``--llama-bench`` names a build (``--llama-bench-pp`` another build for prompts:
  a build's AMX path may crash on prompts, see the README). Rounds alternate the systems;
  each ratio is the median of per-round ratios with its min-max.
- Memory: the bytes of the weights each engine holds (``quantized_bytes``: the int8 kernel's
  packed copies beside the GGUF's blocks).
- Quality: perplexity on held-out text (``benchmarks/quantization.py``'s docstrings), float32
  activations in, teacher-forced through the paged model in chunks of 16 tokens (so every
  matmul is a few-row call, the kernels' domain) with each kernel, against the dequantized
  path (1,024-token chunks: dequantized tiles and the dtype's matmul); top-1 agreement of
  each position's next token between them; and greedy agreement: the tokens of 8 chat
  prompts x 64 greedy tokens that are the same as the float kernel's, in the engine.

    python -m benchmarks.quant_activations --model ~/.cache/kervan/models/smollm2-135m \\
        --llama-bench PATH/llama-bench --json-out benchmarks/results/quant_activations-amx.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import time
from statistics import median

import torch

from benchmarks.machine import machine, write_report
from benchmarks.quantization import held_out_text
from benchmarks.stats import spread

KERNELS = ("float", "int8", "auto")
CHAT = ("What is the capital of France?", "Write a haiku about the sea.", "Explain recursion to a child.",
        "List three prime numbers.", "What is 12 times 7?", "Name a famous painter.",
        "How do plants make food?", "Translate 'good morning' into French.")


def engine_with(kernel: str, args):
    from worker import Engine
    os.environ["KERVAN_QUANT_ACTIVATIONS"] = kernel  # read when the engine loads
    try:
        return Engine.from_pretrained(args.model, dtype=args.dtype, max_num_seqs=32)
    finally:
        del os.environ["KERVAN_QUANT_ACTIVATIONS"]


def batch1_ms(engine, new_tokens: int) -> float:
    from worker import SamplingParams
    engine.add_request(list(range(100, 164)), SamplingParams(max_tokens=new_tokens, temperature=0.0,
                                                             ignore_eos=True))
    engine.step()  # the prefill
    steps = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - start)
    return median(steps) * 1e3


def batch_rate(engine, batch: int, new_tokens: int) -> float:
    from worker import SamplingParams
    prompts = [[1] + [(37 * i + 11 * k) % 40000 + 100 for k in range(15)] for i in range(batch)]
    start = time.perf_counter()
    engine.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))  # the prefills alone
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    engine.generate(prompts, SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True))
    return batch * (new_tokens - 1) / max(time.perf_counter() - start - prefill, 1e-9)


def prompt_rate(engine, tokens: int, seed: int) -> float:
    """tok/s of one ``tokens``-long prefill; a prompt of its own per round (no prefix-cache hit)."""
    from worker import SamplingParams
    prompt = [(13 * k + 7919 * seed) % 40000 + 100 for k in range(tokens)]
    start = time.perf_counter()
    engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    return tokens / (time.perf_counter() - start)


def llama_bench(path: str, gguf: str, threads: int, prompt: int, new_tokens: int) -> float:
    cmd = [path, "-m", gguf, "-t", str(threads), "-p", str(prompt), "-n", str(new_tokens), "-r", "1", "-o", "json"]
    [row] = json.loads(subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=True).stdout)
    return float(row["avg_ts"])


def speed(args) -> dict:
    engines = {k: engine_with(k, args) for k in KERNELS}
    choices = [c.describe() for c in engines["auto"].runner.kernel_choices]
    gguf = str(next(p for p in os.scandir(args.model) if p.name.endswith(".gguf")).path)
    threads = torch.get_num_threads()
    rows: dict[str, dict[str, list[float]]] = {k: {"batch_1_ms": [], "batch_8_tok_s": [], "batch_32_tok_s": [],
                                                   "pp_tok_s": []}
                                               for k in (*KERNELS, "llama_cpp", "llama_cpp_pp_build")}
    for round_ in range(args.rounds):
        order = KERNELS[round_ % len(KERNELS):] + KERNELS[:round_ % len(KERNELS)]
        for k in order:
            rows[k]["batch_1_ms"].append(batch1_ms(engines[k], args.new_tokens))
            rows[k]["batch_8_tok_s"].append(batch_rate(engines[k], 8, args.new_tokens))
            rows[k]["batch_32_tok_s"].append(batch_rate(engines[k], 32, args.new_tokens))
            rows[k]["pp_tok_s"].append(prompt_rate(engines[k], args.prompt_tokens, round_))
        if args.llama_bench:
            rows["llama_cpp"]["batch_1_ms"].append(1e3 / llama_bench(args.llama_bench, gguf, threads, 0, 128))
        if args.llama_bench_pp:
            rows["llama_cpp"]["pp_tok_s"].append(llama_bench(args.llama_bench_pp, gguf, threads, args.prompt_tokens, 0))
        if args.llama_bench_pp != args.llama_bench:  # the prompt build's own batch 1, for the record
            rows["llama_cpp_pp_build"]["batch_1_ms"].append(1e3 / llama_bench(args.llama_bench_pp, gguf, threads, 0,
                                                                               128))
    from worker.quant.model import quantized_bytes
    held = {k: quantized_bytes(engines[k].runner.model)["total"] for k in KERNELS}  # the packed copies included
    for engine in engines.values():
        engine.close()
    out: dict = {"kernel_choices": choices, "threads": threads}
    for name, series in rows.items():
        if any(series.values()):
            out[name] = {key: spread(values) for key, values in series.items() if values}
    for k in KERNELS:
        out[k]["weight_bytes"] = held[k]
        out[k]["batch_1_speedup_vs_float"] = spread([f / v for f, v in zip(rows["float"]["batch_1_ms"],
                                                                            rows[k]["batch_1_ms"])])
        if rows["llama_cpp"]["batch_1_ms"]:
            out[k]["batch_1_vs_llama_cpp"] = spread([ll / v for ll, v in zip(rows["llama_cpp"]["batch_1_ms"],
                                                                               rows[k]["batch_1_ms"])])
        if rows["llama_cpp"]["pp_tok_s"]:
            out[k]["pp_vs_llama_cpp"] = spread([v / ll for ll, v in zip(rows["llama_cpp"]["pp_tok_s"],
                                                                         rows[k]["pp_tok_s"])])
    out["llama_cpp"]["builds"] = {"tg": args.llama_bench, "pp": args.llama_bench_pp}
    return out


def chunked_logits(model, ids: list[int], chunk: int) -> torch.Tensor:
    """Next-token logits [n, vocab] of one text, fed ``chunk`` tokens at a time (float32)."""
    from worker.layers.paged_attention import AttentionMetadata
    from worker.runner.model_runner import allocate_kv_caches
    cfg, n, bs = model.cfg, len(ids), 16
    blocks = -(-n // bs)
    caches = allocate_kv_caches(cfg.num_layers, blocks, cfg.num_kv_heads, bs, cfg.head_dim, torch.float32,
                                torch.device("cpu"))
    out = []
    with torch.inference_mode():
        for ctx in range(0, n, chunk):
            part = ids[ctx:ctx + chunk]
            meta = AttentionMetadata.build(list(range(ctx, ctx + len(part))), [], [],
                                           [(0, len(part), ctx, list(range(-(-(ctx + len(part)) // bs))))], bs,
                                           torch.device("cpu"), native=True)
            hidden = model(torch.tensor(part), torch.arange(ctx, ctx + len(part)), caches, meta)
            out.append(model.compute_logits(hidden).float())
    return torch.cat(out)


def quality(args) -> dict:
    from kervan.tokenizer import Tokenizer
    from worker.loader import load_model
    from worker.quant.kernel_choice import choose_kernels
    tokenizer = Tokenizer.from_dir(args.model)
    ids = tokenizer.encode(held_out_text())[:args.text_tokens]
    texts = [ids[i:i + 1024] for i in range(0, len(ids), 1024)]
    out, preds = {}, {}
    for name, chunk, kernel in (("dequantized", 1024, "float"), ("float", 16, "float"), ("int8", 16, "int8")):
        model = load_model(args.model, torch.float32, 4096)
        os.environ["KERVAN_QUANT_ACTIVATIONS"] = kernel
        try:
            choose_kernels(model, torch.float32, deterministic=False)
        finally:
            del os.environ["KERVAN_QUANT_ACTIVATIONS"]
        nll, count, top = 0.0, 0, []
        for text in texts:
            logits = chunked_logits(model, text, chunk)
            nll += float(torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(text[1:]), reduction="sum"))
            count += len(text) - 1
            top.append(logits[:-1].argmax(-1))
        preds[name] = torch.cat(top)
        out[name] = {"perplexity": round(math.exp(nll / count), 4), "chunk_tokens": chunk}
    for name in out:
        out[name]["top1_agreement_with_dequantized"] = round(float((preds[name] == preds["dequantized"]).float()
                                                                  .mean()), 4)
    out["tokens"] = len(ids)
    return out


def greedy_agreement(args) -> dict:
    from kervan.chat_template import ChatTemplate
    from worker import SamplingParams
    template = ChatTemplate.from_dir(args.model)
    prompts = [template.render([{"role": "user", "content": c}]) for c in CHAT]
    texts = {}
    for kernel in ("float", "int8"):
        engine = engine_with(kernel, args)
        outs = engine.generate(prompts, SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))
        texts[kernel] = [o.token_ids for o in outs]
        engine.close()
    same = sum(a == b for f, i in zip(texts["float"], texts["int8"]) for a, b in zip(f, i))
    first = [next((j for j, (a, b) in enumerate(zip(f, i)) if a != b), len(f)) for f, i in zip(texts["float"],
                                                                                                 texts["int8"])]
    return {"prompts": len(CHAT), "tokens_each": 64, "same_token_share": round(same / (64 * len(CHAT)), 4),
            "first_difference_at": first}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a directory holding the GGUF (kervan pull smollm2-135m)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--llama-bench", default=None, help="llama.cpp's llama-bench for tg (batch 1)")
    ap.add_argument("--llama-bench-pp", default=None, help="llama-bench for pp (default: --llama-bench)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--text-tokens", type=int, default=4096)
    ap.add_argument("--skip-quality", action="store_true")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    args.llama_bench_pp = args.llama_bench_pp or args.llama_bench
    report = {"machine": machine(args.dtype), "args": vars(args), "speed": speed(args)}
    if not args.skip_quality:
        report["quality"] = quality(args)
        report["greedy"] = greedy_agreement(args)
    write_report(report, args.json_out)


if __name__ == "__main__":
    main()
