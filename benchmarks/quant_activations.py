"""A GGUF's quantized matmuls with each activation kernel, every call of a weight through one
kernel (the engine's rule: a token's result must not depend on what else is in its call),
against the model's float answer and llama.cpp on the same file, in one run: the measure
``KERVAN_QUANT_ACTIVATIONS``'s default (``worker/quant/kernel_choice.py``) is chosen by.

The kernels: ``float`` (the codes decoded to float, x as it comes), ``int8`` (x rounded to
int8 by blocks of 32, llama.cpp's path), ``int8x2`` (x to two int8 terms, its own and its
remainder's); the LM head takes ``int8x2`` under both integer kernels.

- Speed, in ``--dtype`` (the machine's own by default): batch-1 decode ms per token (a
  64-token prompt, then ``--new-tokens`` greedy steps, the median step), batch-8 and batch-32
  decode tok/s, and one ``--prompt-tokens`` prefill's tok/s; llama.cpp's ``llama-bench``
  (``tg``, ``pp``) in every round where ``--llama-bench`` names a build. Rounds rotate the
  systems; each ratio is the median of per-round ratios with its min-max.
- Quality, against the reference: transformers running the GGUF dequantized to float32
  (the model's own answer, as its publisher's code computes it):
  - perplexity of held-out text (``benchmarks/quantization.py``'s), teacher-forced in
    1,024-token windows, every position scored, each kernel in float32 activations; and
    under llama.cpp's protocol (the second half of each window scored) beside
    ``llama-perplexity -c 1024`` on the same text (``--llama-perplexity``); top-1 agreement
    of each position's next token with the reference;
  - greedy answers to the 52 conversations of ``benchmarks/chat_set.py``, ``--answer-tokens``
    each, through the engine in float32 and in ``--dtype``: the share whose first token is
    the reference's, the share that is the reference's whole answer, and the mean length
    of the agreeing start; llama.cpp's ``llama-simple`` (greedy) on the same rendered
    prompts where ``--llama-simple`` names it, its text re-tokenized.

    python -m benchmarks.quant_activations --model ~/.cache/kervan/models/smollm2-135m \\
        --llama-bench L/llama-bench --llama-perplexity L/llama-perplexity --llama-simple L/llama-simple \\
        --json-out benchmarks/results/quant_activations-amx.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import tempfile
import time
from pathlib import Path
from statistics import mean, median

import torch

from benchmarks.machine import machine, write_report
from benchmarks.quantization import held_out_text
from benchmarks.stats import spread

KERNELS = ("float", "int8", "int8x2")
WINDOW = 1024


def engine_with(kernel: str, args, dtype: str):
    from worker import Engine
    os.environ["KERVAN_QUANT_ACTIVATIONS"] = kernel  # read when the engine loads
    try:
        return Engine.from_pretrained(args.model, dtype=dtype, max_num_seqs=64)
    finally:
        del os.environ["KERVAN_QUANT_ACTIVATIONS"]


def gguf_of(model: str) -> str:
    return str(next(p for p in Path(model).iterdir() if p.name.endswith(".gguf")))


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
    [row] = json.loads(subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=True).stdout)
    return float(row["avg_ts"])


def speed(args) -> dict:
    threads = torch.get_num_threads()
    gguf = gguf_of(args.model)
    rows: dict[str, dict[str, list[float]]] = {k: {"batch_1_ms": [], "batch_8_tok_s": [], "batch_32_tok_s": [],
                                                   "pp_tok_s": []} for k in (*KERNELS, "llama_cpp")}
    held = {}
    from worker.quant.model import quantized_bytes
    for round_ in range(args.rounds):
        order = KERNELS[round_ % len(KERNELS):] + KERNELS[:round_ % len(KERNELS)]
        for k in order:  # one engine in memory at a time: the 1B model's copies would not fit three times
            engine = engine_with(k, args, args.dtype)
            held[k] = quantized_bytes(engine.runner.model)["total"]  # the int8 kernel's packed copies included
            rows[k]["batch_1_ms"].append(batch1_ms(engine, args.new_tokens))
            rows[k]["batch_8_tok_s"].append(batch_rate(engine, 8, args.new_tokens))
            rows[k]["batch_32_tok_s"].append(batch_rate(engine, 32, args.new_tokens))
            rows[k]["pp_tok_s"].append(prompt_rate(engine, args.prompt_tokens, round_))
            engine.close()
        if args.llama_bench:
            rows["llama_cpp"]["batch_1_ms"].append(1e3 / llama_bench(args.llama_bench, gguf, threads, 0, 128))
            rows["llama_cpp"]["pp_tok_s"].append(llama_bench(args.llama_bench, gguf, threads, args.prompt_tokens, 0))
    out: dict = {"threads": threads}
    for name, series in rows.items():
        if any(series.values()):
            out[name] = {key: spread(values) for key, values in series.items() if values}
    for k in KERNELS:
        out[k]["weight_bytes"] = held[k]
        for key, faster in (("batch_1_ms", lambda a, b: a / b), ("batch_8_tok_s", lambda a, b: b / a),
                            ("batch_32_tok_s", lambda a, b: b / a), ("pp_tok_s", lambda a, b: b / a)):
            out[k][f"{key}_vs_float"] = spread([faster(f, v) for f, v in zip(rows["float"][key], rows[k][key])])
            if rows["llama_cpp"][key]:
                out[k][f"{key}_vs_llama_cpp"] = spread([faster(ll, v) for ll, v in zip(rows["llama_cpp"][key],
                                                                                          rows[k][key])])
    out["llama_cpp"] = {**out.get("llama_cpp", {}), "build": args.llama_bench}
    return out


def windows(args) -> list[list[int]]:
    from kervan.tokenizer import Tokenizer
    ids = Tokenizer.from_dir(args.model).encode(held_out_text())[:args.text_tokens]
    return [ids[i:i + WINDOW] for i in range(0, len(ids) - WINDOW + 1, WINDOW)]


def scored(logits: torch.Tensor, text: list[int], second_half: bool) -> tuple[float, int]:
    """(summed negative log-likelihood, tokens) of ``text``'s next tokens from ``logits``."""
    start = WINDOW // 2 if second_half else 0
    nll = torch.nn.functional.cross_entropy(logits[start:-1].float(), torch.tensor(text[start + 1:]), reduction="sum")
    return float(nll), len(text) - 1 - start


def window_logits(model, text: list[int]) -> torch.Tensor:
    """Next-token logits [n, vocab] of one window through a Kervan model (one prompt chunk)."""
    from worker.layers.paged_attention import AttentionMetadata
    from worker.runner.model_runner import allocate_kv_caches
    cfg, n, bs = model.cfg, len(text), 16
    caches = allocate_kv_caches(cfg.num_layers, -(-n // bs), cfg.num_kv_heads, bs, cfg.head_dim, torch.float32,
                                torch.device("cpu"))
    meta = AttentionMetadata.build(list(range(n)), [], [], [(0, n, 0, list(range(-(-n // bs))))], bs,
                                   torch.device("cpu"), native=True, per_token=True)
    with torch.inference_mode():
        return model.compute_logits(model(torch.tensor(text), torch.arange(n), caches, meta)).float()


def perplexities(args, reference) -> dict:
    from worker.loader import load_model
    from worker.quant.kernel_choice import choose_kernels
    texts = windows(args)
    systems: dict[str, object] = {"reference": reference}
    out: dict = {"tokens": len(texts) * WINDOW, "window": WINDOW}
    preds = {}
    for name in ("reference", *KERNELS):
        if name == "reference":
            def logits_of(text):
                with torch.inference_mode():
                    return reference(torch.tensor([text])).logits[0].float()
        else:
            model = load_model(args.model, torch.float32, 4096)
            os.environ["KERVAN_QUANT_ACTIVATIONS"] = name
            try:
                choose_kernels(model)
            finally:
                del os.environ["KERVAN_QUANT_ACTIVATIONS"]
            systems[name] = model
            logits_of = lambda text, model=model: window_logits(model, text)  # noqa: E731
        totals = {False: [0.0, 0], True: [0.0, 0]}
        tops = []
        for text in texts:
            logits = logits_of(text)
            for half in totals:
                nll, count = scored(logits, text, half)
                totals[half][0] += nll
                totals[half][1] += count
            tops.append(logits[:-1].argmax(-1))
        preds[name] = torch.cat(tops)
        out[name] = {"perplexity": round(math.exp(totals[False][0] / totals[False][1]), 4),
                     "perplexity_second_halves": round(math.exp(totals[True][0] / totals[True][1]), 4),
                     "top1_agreement_with_reference": round(float((preds[name] == preds["reference"]).float().mean()),
                                                            4)}
    if args.llama_perplexity:
        out["llama_cpp"] = llama_perplexity(args)
    return out


def llama_perplexity(args) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(held_out_text())
    try:
        chunks = args.text_tokens // WINDOW
        res = subprocess.run([args.llama_perplexity, "-m", gguf_of(args.model), "-f", f.name, "-c", str(WINDOW),
                              "--chunks", str(chunks), "-t", str(torch.get_num_threads())],
                             capture_output=True, text=True, timeout=3600, check=True)
    finally:
        os.unlink(f.name)
    final = [line for line in res.stderr.splitlines() if "Final estimate: PPL" in line]
    return {"perplexity_second_halves": float(final[-1].split("=")[1].split("+/-")[0]), "chunks": chunks,
            "protocol": "llama-perplexity -c 1024: the second half of each window scored"}


def answers_agreement(answers: list[list[int]], reference: list[list[int]]) -> dict:
    prefix = [next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
              for got, want in zip(answers, reference)]
    return {"first_token_share": round(mean(p > 0 for p in prefix), 4),
            "whole_answer_share": round(mean(got == want for got, want in zip(answers, reference)), 4),
            "mean_agreeing_tokens": round(mean(prefix), 2), "answers": len(answers)}


def greedy(args, reference) -> dict:
    from benchmarks.chat_set import conversations
    from kervan.chat_template import ChatTemplate
    from kervan.tokenizer import Tokenizer
    from worker import SamplingParams
    from worker.platform import dtype_name
    template, tokenizer = ChatTemplate.from_dir(args.model), Tokenizer.from_dir(args.model)
    texts = [template.render(messages) for messages in conversations()]
    prompts = [tokenizer.encode(t) for t in texts]
    n = args.answer_tokens
    want = []
    for prompt in prompts:
        with torch.no_grad():
            ids = torch.tensor([prompt])
            want.append(reference.generate(ids, max_new_tokens=n, do_sample=False, min_new_tokens=n,
                                           attention_mask=torch.ones_like(ids))[0, len(prompt):].tolist())
    out: dict = {"answer_tokens": n}
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    for dtype in dict.fromkeys(("float32", args.dtype)):
        for kernel in KERNELS:
            engine = engine_with(kernel, args, dtype)
            got = [o.token_ids for o in engine.generate(prompts, params)]
            engine.close()
            out[f"{kernel}_{dtype_name(engine.config.dtype)}"] = answers_agreement(got, want)
    if args.llama_simple:
        got = []
        for text in texts:
            res = subprocess.run([args.llama_simple, "-m", gguf_of(args.model), "-n", str(n), text],
                                 capture_output=True, text=True, errors="replace", timeout=600, check=True)
            printed = res.stdout
            answer = printed[printed.index(text) + len(text):] if text in printed else printed
            got.append(tokenizer.encode(answer)[:n])
        out["llama_cpp"] = answers_agreement(got, want)
    return out


def reference_model(args):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(args.model, gguf_file=Path(gguf_of(args.model)).name,
                                                dtype=torch.float32).eval()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a directory holding the GGUF (kervan pull smollm2-135m)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--llama-bench", default=None, help="llama.cpp's llama-bench (tg: batch 1; pp: the prompt)")
    ap.add_argument("--llama-perplexity", default=None, help="llama.cpp's llama-perplexity")
    ap.add_argument("--llama-simple", default=None, help="llama.cpp's llama-simple (greedy answers)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--text-tokens", type=int, default=4096)
    ap.add_argument("--answer-tokens", type=int, default=32)
    ap.add_argument("--skip-quality", action="store_true")
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    report: dict = {"benchmark": "quant_activations", "machine": machine(args.dtype)}
    if not args.skip_quality:
        reference = reference_model(args)
        report["perplexity"] = perplexities(args, reference)
        report["greedy"] = greedy(args, reference)
        del reference
    if not args.skip_speed:
        report["speed"] = speed(args)
    write_report(report, args.json_out, args)


if __name__ == "__main__":
    main()
