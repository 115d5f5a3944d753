"""The aggregated alternative to a prefill and a decode pool: workers that run both, each
step carrying the running decodes and, while prompts wait, one prefill chunk beside them
(Sarathi-Serve's chunked prefill). A chunk lengthens every step it shares, so the chunk is
the largest of a few sizes whose step with the decode batch still meets the ITL target; a
worker then serves ``batch / step`` output and ``chunk / step`` prompt tokens a second."""

from __future__ import annotations

import math
from typing import NamedTuple

from control_plane.plan.sizing import Layout, Load, Sizer, Slo, batch_cap, batches, mg1_wait_s, operating_batch

CHUNKS = (2048, 1024, 512, 256, 128, 64)


class AggregatedPool(NamedTuple):
    chunk: int  # prompt tokens a step carries beside its decodes
    max_batch: int
    operating_batch: int
    step_s: float  # a step of the operating batch with a chunk: the ITL while prompts wait
    workers: int
    ttft_s: float
    meets: bool


def aggregated_pool(sizer: Sizer, layout: Layout, memory: dict, load: Load, slo: Slo,
                    context: float) -> AggregatedPool | None:
    """The fewest aggregated workers (then the lowest TTFT) over the chunk sizes; None when
    no chunk fits a step within the ITL target."""
    decode = {b: sizer.decode_step_s(layout, b, context)["step_s"] for b in batches(batch_cap(memory, context))}
    best = None
    for chunk in (c for c in CHUNKS if c <= sizer.chunk):
        # the chunk's own time; the step's fixed cost is counted once, in the decode step
        extra = sizer.prefill_chunk_s(layout, chunk, load.input_len / 2)["step_s"]
        if sizer.profile is None:
            extra -= sizer.hw.step_overhead_s
        within = [b for b, t in decode.items() if t + extra <= slo.itl_s]
        if not within:
            continue
        batch = max(within)
        step = decode[batch] + extra
        out_demand, in_demand = load.rate * load.output_len, load.rate * load.input_len
        workers = max(1, math.ceil(out_demand / (batch / step)), math.ceil(in_demand / (chunk / step)))
        operating = operating_batch({b: t + extra for b, t in decode.items()}, out_demand / workers, batch)
        op_step = decode[operating] + extra
        service = load.input_len / (chunk / op_step)  # a prompt's share of a worker's steps
        ttft = math.ceil(load.input_len / chunk) * op_step + mg1_wait_s(load.rate, service, workers, load.input_cv2)
        if math.isinf(ttft):
            continue
        candidate = AggregatedPool(chunk, batch, operating, op_step, workers, ttft, ttft <= slo.ttft_s)
        if best is None or (candidate.meets, -candidate.workers, -candidate.ttft_s) > (
                best.meets, -best.workers, -best.ttft_s):
            best = candidate
    return best
