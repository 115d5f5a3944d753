# mypy: disable-error-code="arg-type,misc"
"""``kervan plan``: the command line of the planner (``control_plane/plan``)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import click

from control_plane.plan.choice import Plan, plan
from control_plane.plan.hardware import CATALOG, Hardware, get_hardware, with_overrides
from control_plane.plan.model_dir import model_shape
from control_plane.plan.model_shape import BYTES_PER_WEIGHT
from control_plane.plan.profile import CONTEXTS, DECODE_BATCHES, PREFILL_TOKENS, Profile, measure
from control_plane.plan.served import SERVED_BATCHES, SERVED_CONTEXTS, SERVED_PREFILL_TOKENS, measure_served
from control_plane.plan.sizing import Load, Slo


def render(p: Plan) -> str:
    """The plan as a person reads it."""
    m, mem, d, pf, pools = p.model, p.memory_per_device, p.decode, p.prefill, p.pools
    gb = 1e9
    lines = [
        f"{m['name']}: {m['parameters'] / 1e9:.2f}B parameters ({m['active_parameters'] / 1e9:.2f}B active per "
        f"token), weights {m['weights']}, {m['dtype']} activations; KV {m['kv_bytes_per_token'] / 1024:.1f} KiB "
        f"a token",
        f"on {p.hardware['name']} ({p.hardware['memory_bytes'] / gb:.0f} GB, "
        f"{p.hardware['bandwidth'] / gb:,.0f} GB/s, {p.hardware['peak_flops'] / 1e12:,.1f} TFLOP/s; "
        f"efficiencies {p.hardware['memory_efficiency']:.0%} memory, {p.hardware['compute_efficiency']:.0%} compute)",
        f"layout: TP{p.layout['tp']} x PP{p.layout['pp']}" + (f", EP{p.layout['ep']}" if p.layout["ep"] > 1 else "")
        + f" ({p.layout['devices']} device(s) a worker)",
        f"memory per device: weights {mem['weights_bytes'] / gb:.2f} GB, activations "
        f"{mem['activations_bytes'] / gb:.2f} GB, runtime {mem['runtime_bytes'] / gb:.2f} GB, KV "
        f"{mem['kv_bytes'] / gb:.2f} GB = {mem['kv_tokens']:,} tokens",
        f"decode: batch up to {d['max_batch']} (runs ~{d['operating_batch']}), ITL {d['itl_s'] * 1e3:.2f} ms, "
        f"{d['tokens_per_s_per_worker']:,.0f} tok/s a worker",
        f"prefill: {pf['tokens_per_s_per_worker']:,.0f} prompt tok/s a worker, TTFT {pf['ttft_s'] * 1e3:,.0f} ms",
        f"pools: {pools['prefill']} prefill + {pools['decode']} decode worker(s) ({pools['ratio']}), "
        f"{pools['devices']} device(s)",
        "aggregated: " + ("none fits the ITL target" if not p.aggregated else
                          f"{p.aggregated['workers']} worker(s), {p.aggregated['devices']} device(s), chunks of "
                          f"{p.aggregated['chunk']}, ITL {p.aggregated['step_s'] * 1e3:.2f} ms, TTFT "
                          f"{p.aggregated['ttft_s'] * 1e3:,.0f} ms"),
        f"recommended: {p.recommended}; expected {p.expected['output_tokens_per_s']:,.0f} output tok/s, TTFT "
        f"{p.expected['ttft_s'] * 1e3:,.0f} ms, ITL {p.expected['itl_s'] * 1e3:.2f} ms",
        "meets the targets" if p.meets_slo else "DOES NOT meet the targets",
        "why:", *(f"  - {r}" for r in p.reasons)]
    return "\n".join(lines)


@click.command("plan")
@click.option("--model", "model", required=True,
              help="a Hugging Face model directory, its config.json, or a pulled catalog name")
@click.option("--weights", type=click.Choice(sorted(BYTES_PER_WEIGHT)), default=None,
              help="the weights' format (default: what the directory holds)")
@click.option("--dtype", type=click.Choice(["bfloat16", "float16", "float32"]), default=None,
              help="activations and KV (default: bfloat16, float32 for float32 weights)")
@click.option("--hardware", default="h100-sxm", show_default=True,
              help=f"this (measured now), this-core (one core of it), or one of: {', '.join(CATALOG)}")
@click.option("--memory-gb", type=float, default=None, help="override the device's memory")
@click.option("--bandwidth-gb-s", type=float, default=None, help="override the device's memory bandwidth")
@click.option("--kv-link", default=None, metavar="RATE[,DELAY]",
              help="prefill and decode workers on different hosts, joined by this link (1gbit, 10gbit,2ms): the KV "
                   "hand-off crosses it (default: they share a node)")
@click.option("--kv-stream", default=None, metavar="RATE",
              help="the most one KV stream moves, whatever the link (what `benchmarks/kv_handoff_hosts.py` measures "
                   "of a bare gRPC stream here; default: no ceiling)")
@click.option("--rate", type=click.FloatRange(min=0, min_open=True), required=True, help="requests per second")
@click.option("--input-len", default="fixed:1024", show_default=True, help="prompt tokens: N, uniform:LO:HI, ...")
@click.option("--output-len", default="fixed:256", show_default=True, help="output tokens, as --input-len")
@click.option("--ttft-ms", type=click.FloatRange(min=0, min_open=True), default=1000.0, show_default=True,
              help="time to first token target")
@click.option("--itl-ms", type=click.FloatRange(min=0, min_open=True), default=50.0, show_default=True,
              help="inter-token latency target")
@click.option("--chunk", type=click.IntRange(min=16), default=2048, show_default=True, help="prefill tokens per step")
@click.option("--profile", "profile_path", default=None, type=click.Path(exists=True, dir_okay=False),
              help="step times measured by `kervan profile` instead of the roofline (one process: TP1)")
@click.option("--json", "json_path", default=None, help="also write the plan to this file")
def plan_command(model, weights, dtype, hardware, memory_gb, bandwidth_gb_s, kv_link, kv_stream, rate, input_len,
                 output_len, ttft_ms, itl_ms, chunk, profile_path, json_path) -> None:
    """What serving MODEL at RATE needs on HARDWARE within the TTFT and ITL targets: memory per
    device, the tensor/pipeline layout, the decode batch, the prefill and decode pools, and why."""
    from control_plane.bench.workload import Lengths

    shape, held, float_dtype = model_shape(model)
    try:
        ins, outs = Lengths.parse(input_len), Lengths.parse(output_len)
        hw = with_overrides(get_hardware(hardware), memory_bytes=memory_gb and memory_gb * 1e9,
                            bandwidth=bandwidth_gb_s and bandwidth_gb_s * 1e9)
        hw = with_kv_network(hw, kv_link, kv_stream)
        profile = Profile.load(profile_path) if profile_path else None
        load = Load(rate, ins.mean, outs.mean, ins.upper, outs.upper, ins.cv2)
        result = plan(shape, weights or held, (dtype or (profile.dtype if profile else float_dtype)), hw, load,
                      Slo(ttft_ms / 1e3, itl_ms / 1e3), chunk, profile)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    click.echo(render(result))
    if json_path:
        Path(json_path).write_text(json.dumps(result.to_dict(), indent=2) + "\n")


def with_kv_network(hw: Hardware, kv_link: str | None, kv_stream: str | None) -> Hardware:
    """``hw`` with the network a KV hand-off crosses (``--kv-link``, ``--kv-stream``)."""
    from control_plane.hosts.link import Link, LinkError
    try:
        link = Link.parse(kv_link) if kv_link else None
        stream = Link.parse(kv_stream) if kv_stream else None
    except LinkError as exc:
        raise ValueError(str(exc)) from None
    if link is not None and link.bytes_per_s is None:
        raise ValueError("--kv-link needs a rate (1gbit, 10gbit, ...)")
    return dataclasses.replace(hw, kv_link_bandwidth=link.bytes_per_s if link else None,
                               kv_link_latency_s=link.delay_s if link else 0.0,
                               kv_stream_bandwidth=stream.bytes_per_s if stream else None)


def _csv(values) -> str:
    return ",".join(map(str, values))


@click.command("profile")
@click.option("--model", "model", required=True, help="a model directory or a pulled catalog name")
@click.option("--dtype", default="auto", show_default=True, help="the serving dtype (auto: what this machine runs)")
@click.option("--batches", default=None, help=f"decode batch sizes to time (default {_csv(DECODE_BATCHES)}; "
              f"with --served {_csv(SERVED_BATCHES)})")
@click.option("--contexts", default=None, help=f"context lengths the decode batches run at (default "
              f"{_csv(CONTEXTS)}; with --served {_csv(SERVED_CONTEXTS)})")
@click.option("--prefill-tokens", default=None, help=f"prompt chunk sizes to time (default {_csv(PREFILL_TOKENS)}; "
              f"with --served {_csv(SERVED_PREFILL_TOKENS)})")
@click.option("--served", is_flag=True,
              help="measure through a cluster of one prefill and one decode worker (ITL at each batch, TTFT of "
                   "each prompt length, beside 0, 2, 4, 8 and 16 decoding), as clients see them, instead of the engine "
                   "alone")
@click.option("--out", "out_path", required=True, help="where to write the profile (JSON)")
def profile_command(model, dtype, batches, contexts, prefill_tokens, served, out_path) -> None:
    """Time the engine's decode steps and prefill chunks on this machine, for `kervan plan --profile`."""
    from control_plane.tools.pull import PullError, resolve_model

    try:
        model_dir = resolve_model(model)
        defaults = (SERVED_BATCHES, SERVED_CONTEXTS, SERVED_PREFILL_TOKENS) if served else \
            (DECODE_BATCHES, CONTEXTS, PREFILL_TOKENS)
        ints = [tuple(int(x) for x in v.split(",")) if v else default
                for v, default in zip((batches, contexts, prefill_tokens), defaults)]
    except (PullError, ValueError) as exc:
        raise click.UsageError(str(exc)) from None
    say = lambda line: click.echo(line, err=True)  # noqa: E731
    if served:
        result = measure_served(model_dir, dtype, *ints, say=say)
    else:
        result = measure(model_dir, dtype, *ints, say=say)
    Path(out_path).write_text(result.to_json() + "\n")
    click.echo(f"profile of {model} ({result.dtype}) written to {out_path}")
