# mypy: disable-error-code="arg-type"
"""The pools a load needs on one layout: the decode pool (the load's output tokens per
second over one worker's at the largest batch the ITL target and the KV cache allow) and the
prefill pool (the fewest workers whose TTFT — the prompt's chunks, the queue as M/G/1, the KV
hand-over — meets its target: the first token comes back with the prefill)."""

from __future__ import annotations

import math
from typing import NamedTuple

from control_plane.plan.sizing import Layout, Load, Sizer, Slo, batch_cap, batches, mg1_wait_s, operating_batch


class DecodePool(NamedTuple):
    max_batch: int  # the largest batch within the ITL target and the KV cache
    operating_batch: int  # the batch each worker runs at the asked load
    itl_s: float
    tokens_per_s_per_worker: float  # at max_batch
    workers: int
    kv_batch_limit: int
    steps: dict[int, dict]  # batch -> the decode step's terms
    meets_itl: bool


class PrefillPool(NamedTuple):
    tokens_per_s_per_worker: float
    one_prompt_s: float  # a mean prompt alone, chunk by chunk
    kv_handover_s: float
    workers: int
    ttft_s: float
    chunk: dict  # the terms of a full chunk


def decode_pool(sizer: Sizer, layout: Layout, memory: dict, load: Load, slo: Slo, context: float) -> DecodePool:
    steps = {b: sizer.decode_step_s(layout, b, context) for b in batches(batch_cap(memory, context))}
    within = [b for b, st in steps.items() if st["step_s"] <= slo.itl_s]
    batch = max(within) if within else 1
    per_worker = batch / steps[batch]["step_s"]
    demand = load.rate * load.output_len
    workers = max(1, math.ceil(demand / per_worker))
    operating = operating_batch({b: st["step_s"] for b, st in steps.items()}, demand / workers, batch)
    return DecodePool(batch, operating, steps[operating]["step_s"], per_worker, workers,
                      max(1, int(memory["kv_tokens"] // context)), steps, bool(within))


def prefill_pool(sizer: Sizer, layout: Layout, load: Load, slo: Slo, decode_batch: int = 0) -> PrefillPool:
    """The smallest pool whose TTFT (``prefill_ttft_s``) meets the target; 1,024 workers at most."""
    chunk = sizer.prefill_chunk_s(layout, sizer.chunk, load.input_len / 2, decode_batch)
    for workers in range(1, 1025):
        ttft = prefill_ttft_s(sizer, layout, load, workers, decode_batch)
        if ttft["ttft_s"] <= slo.ttft_s:
            break
    return PrefillPool(ttft["rate"], ttft["alone_s"], ttft["handover_s"], workers, ttft["ttft_s"], chunk)


def prefill_ttft_s(sizer: Sizer, layout: Layout, load: Load, workers: int, decode_batch: int = 0) -> dict:
    """A mean prompt's TTFT on a pool of ``workers``: the prompt alone, chunk by chunk; the
    queue as M/G/1 on the pool seen as one server n times as fast (Pollaczek-Khinchine's
    mean wait, the service time varying as the prompt length does); the KV hand-over over
    the device link, or the network between hosts (``Hardware.handover_s``). The first token
    is the prefill's (the router streams it as the prefill worker answers), so no decode step.
    Infinite when the pool cannot keep up.
    ``decode_batch``: sequences each decode worker runs meanwhile (a served profile's
    prefill is slower beside them, on a machine whose cores the serving stack shares)."""
    chunk = sizer.prefill_chunk_s(layout, sizer.chunk, load.input_len / 2, decode_batch)
    rate = sizer.chunk / chunk["step_s"]  # prompt tokens/s of one busy worker
    alone = sum(sizer.prefill_chunk_s(layout, min(sizer.chunk, load.input_len - i), (i + load.input_len) / 2,
                                      decode_batch)["step_s"] for i in range(0, math.ceil(load.input_len), sizer.chunk))
    handover = sizer.hw.handover_s(load.input_len * sizer.shape.kv_bytes_per_token(sizer.dtype))
    wait = mg1_wait_s(load.rate, load.input_len / rate, workers, load.input_cv2)
    return {"ttft_s": alone + wait + handover, "rate": rate, "alone_s": alone, "handover_s": handover,
            "wait_s": wait}
