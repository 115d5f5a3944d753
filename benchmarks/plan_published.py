"""``kervan plan``'s GPU presets against published measurements: what the plan's step model
predicts for a named model, GPU and layout, beside what NVIDIA and vLLM published for it.

Nothing here runs a model: the plan's own arithmetic (``control_plane.plan.sizing.Sizer`` on
the ``hardware.CATALOG`` preset, at the published layout, weight format and dtype) is set
against four published measurements, each named with its source below, at concurrency 1 or a
fixed batch (where no queue forms, so the load fixes nothing the plan is scored on):

- TTFT at concurrency 1: the prompt alone, chunk by chunk (``pools.prefill_ttft_s`` at a rate
  near zero: no queue, no hand-over, as an aggregated server has none);
- ITL at concurrency 1: one decode step at batch 1, its context midway through the output;
- a fixed batch's end-to-end latency (vLLM's latency test): the batch's prompts as one
  prefill, then ``output - 1`` decode steps at that batch.

The method and the mark were fixed before the first run and are not changed after one:
a prediction is within when ``|predicted / published - 1| <= TOLERANCE`` (0.20).

    python -m benchmarks.plan_published --json-out benchmarks/results/plan_published-gpu-presets.json
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from benchmarks.machine import machine, write_report
from control_plane.plan.hardware import CATALOG
from control_plane.plan.model_shape import ModelShape
from control_plane.plan.pools import prefill_ttft_s
from control_plane.plan.sizing import Layout, Load, Sizer

TOLERANCE = 0.20

# published configs (Hugging Face config.json of each model)
LLAMA_31_8B = ModelShape(name="Llama-3.1-8B", num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8,
                         head_dim=128, intermediate_size=14336, vocab_size=128256, max_position=131072,
                         tied_embeddings=False)
LLAMA_70B = ModelShape(name="Llama-3.x-70B", num_layers=80, hidden_size=8192, num_heads=64, num_kv_heads=8,
                       head_dim=128, intermediate_size=28672, vocab_size=128256, max_position=131072,
                       tied_embeddings=False)
NIM = "https://docs.nvidia.com/nim/benchmarking/llm/1.0.0/performance (NIM 1.8.0, Llama-3.3-70b-instruct)"
VLLM_CI = "https://buildkite.com/vllm/performance-benchmark/builds/9515 (vLLM performance benchmark, latency tests)"


@dataclass(frozen=True)
class Published:
    name: str
    source: str
    shape: ModelShape
    hardware: str
    layout: Layout
    weights: str
    input_len: int
    output_len: int
    batch: int  # 1: concurrency 1 (TTFT and ITL); more: a fixed batch's end-to-end latency
    values_ms: dict[str, float]


PUBLISHED = (
    Published("NIM Llama-3.3-70B fp8, 2 x H100, 5000 in / 500 out, concurrency 1", NIM, LLAMA_70B, "h100-sxm",
              Layout(2, 1), "fp8", 5000, 500, 1, {"ttft": 406.77, "itl": 18.58}),
    Published("NIM Llama-3.3-70B fp8, 2 x H100, 500 in / 2000 out, concurrency 1", NIM, LLAMA_70B, "h100-sxm",
              Layout(2, 1), "fp8", 500, 2000, 1, {"ttft": 47.77, "itl": 18.91}),
    Published("vLLM latency_llama8B_tp1, H200, bf16, 32 in / 128 out, batch 8", VLLM_CI, LLAMA_31_8B, "h200-sxm",
              Layout(1, 1), "bfloat16", 32, 128, 8, {"batch_latency": 833.421}),
    Published("vLLM latency_llama70B_tp4, H200, bf16, 32 in / 128 out, batch 8", VLLM_CI, LLAMA_70B, "h200-sxm",
              Layout(4, 1), "bfloat16", 32, 128, 8, {"batch_latency": 2077.53}),
)


def predict(p: Published) -> dict[str, float]:
    sizer = Sizer(p.shape, p.weights, "bfloat16", CATALOG[p.hardware])
    if p.batch == 1:
        load = Load(1e-9, p.input_len, p.output_len, p.input_len, p.output_len)
        ttft = prefill_ttft_s(sizer, p.layout, load, workers=1)
        itl = sizer.decode_step_s(p.layout, 1, p.input_len + p.output_len / 2)["step_s"]
        return {"ttft": (ttft["alone_s"] + ttft["wait_s"]) * 1e3, "itl": itl * 1e3}
    prefill = sizer.prefill_chunk_s(p.layout, p.batch * p.input_len, p.input_len / 2)["step_s"]
    decode = sizer.decode_step_s(p.layout, p.batch, p.input_len + p.output_len / 2)["step_s"]
    return {"batch_latency": (prefill + (p.output_len - 1) * decode) * 1e3}


def check(p: Published) -> dict:
    predicted = predict(p)
    ratios = {k: round(predicted[k] / v, 3) for k, v in p.values_ms.items()}
    return {"name": p.name, "source": p.source, "model": p.shape.name, "hardware": p.hardware,
            "hardware_source": CATALOG[p.hardware].source, "layout": str(p.layout), "weights": p.weights,
            "input_len": p.input_len, "output_len": p.output_len, "batch": p.batch,
            "published_ms": p.values_ms, "predicted_ms": {k: round(v, 2) for k, v in predicted.items()},
            "predicted_over_published": ratios,
            "within": {k: abs(r - 1) <= TOLERANCE for k, r in ratios.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    points = [check(p) for p in PUBLISHED]
    scored = [ok for point in points for ok in point["within"].values()]
    report = {"benchmark": "plan_published", "machine": machine("bfloat16"), "tolerance": TOLERANCE,
              "points": points, "within": sum(scored), "scored": len(scored)}
    write_report(report, args.json_out, args)


if __name__ == "__main__":
    main()
