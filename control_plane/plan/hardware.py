"""The device a worker runs on, as a plan sees it: memory, memory bandwidth, peak matmul
rate per dtype, the link between a worker group's devices, the network a KV hand-off
crosses between hosts (``kv_link``, and what one KV stream moves at most, ``kv_stream``), and
what the engine reaches of the peaks. Named GPUs carry their public datasheet figures (dense, no sparsity); ``this``
measures the machine the command runs on.

The efficiencies are what an engine reaches of a peak on serving shapes, not the peak:
GPUs' from common practice (80% of HBM bandwidth on decode, 60% of dense matmul peak on
prefill); this CPU's from Kervan's own step profile (``benchmarks/step_profile.py``:
decode steps at 0.41-0.65 of their memory bound, prefill at 0.57-0.64 of its compute
bound). A ``kervan profile`` of the engine replaces both with measured curves."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace
from typing import Any

GB = 1e9


@dataclass(frozen=True)
class Hardware:
    name: str
    kind: str  # "gpu" or "cpu"
    memory_bytes: float  # per device
    bandwidth: float  # bytes/s a device streams from its memory
    peak_flops: dict[str, float]  # dense matmul FLOP/s per dtype
    link_bandwidth: float  # bytes/s each way between two devices of a worker group
    devices_per_node: int
    memory_efficiency: float
    compute_efficiency: float
    step_overhead_s: float  # a step's fixed cost outside its matmuls and attention
    link_latency_s: float = 10e-6  # one collective's fixed cost
    # the KV hand-off between a prefill and a decode worker: across hosts, the network link's rate and
    # latency (None: the two share a node, and the device link carries it), and at most what one KV
    # stream moves (the transport's own ceiling: None, none)
    kv_link_bandwidth: float | None = None
    kv_link_latency_s: float = 0.0
    kv_stream_bandwidth: float | None = None
    usable_memory: float = 0.9  # the share of memory the engine may take (vLLM's gpu_memory_utilization)
    runtime_bytes: float = 2 * GB  # the runtime's own memory per device (CUDA context, allocator, Python)
    source: str = ""

    def handover_s(self, num_bytes: float) -> float:
        """Time to move ``num_bytes`` of KV from a prefill worker to a decode worker."""
        rate = self.kv_link_bandwidth or self.link_bandwidth
        if self.kv_stream_bandwidth:
            rate = min(rate, self.kv_stream_bandwidth)
        return (self.kv_link_latency_s if self.kv_link_bandwidth else 0.0) + num_bytes / rate

    def flops(self, dtype: str) -> float:
        if dtype not in self.peak_flops:
            raise ValueError(f"{self.name} has no {dtype} matmul rate; it has {', '.join(self.peak_flops)}")
        return self.peak_flops[dtype]


def _gpu(name: str, memory_gb: float, bandwidth_tb_s: float, bf16_tflops: float, link_gb_s: float,
         source: str, fp8_tflops: float | None = None) -> Hardware:
    flops = {"bfloat16": bf16_tflops * 1e12, "float16": bf16_tflops * 1e12, "float32": bf16_tflops * 1e12 / 2}
    if fp8_tflops:
        flops["fp8"] = fp8_tflops * 1e12
    return Hardware(name=name, kind="gpu", memory_bytes=memory_gb * GB, bandwidth=bandwidth_tb_s * 1e12,
                    peak_flops=flops, link_bandwidth=link_gb_s * GB, devices_per_node=8,
                    memory_efficiency=0.8, compute_efficiency=0.6, step_overhead_s=0.3e-3, source=source)


CATALOG = {h.name: h for h in [
    _gpu("h100-sxm", 80, 3.35, 989, 450, "NVIDIA H100 datasheet: 80 GB HBM3, 3.35 TB/s, BF16 989 TFLOPS dense, "
         "NVLink 900 GB/s", fp8_tflops=1979),
    _gpu("h200-sxm", 141, 4.8, 989, 450, "NVIDIA H200 datasheet: 141 GB HBM3e, 4.8 TB/s, BF16 989 TFLOPS dense, "
         "NVLink 900 GB/s", fp8_tflops=1979),
    _gpu("a100-sxm-80gb", 80, 2.039, 312, 300, "NVIDIA A100 datasheet: 80 GB HBM2e, 2,039 GB/s, BF16 312 TFLOPS "
         "dense, NVLink 600 GB/s"),
    _gpu("l40s", 48, 0.864, 362, 32, "NVIDIA L40S datasheet: 48 GB GDDR6, 864 GB/s, BF16 362 TFLOPS dense, "
         "PCIe Gen4 x16", fp8_tflops=733),
]}


def get_hardware(name: str) -> Hardware:
    """A named device, ``this`` machine measured now, or ``this-core``: one of its cores as
    the device (what a worker pinned to one core with one thread, as `kervan up` pins them
    on a small machine, has)."""
    if name == "this":
        return measure_this()
    if name == "this-core":
        return measure_this(per_core=True)
    if name not in CATALOG:
        raise ValueError(f"unknown hardware {name!r}; known: this, this-core, {', '.join(CATALOG)}")
    return CATALOG[name]


def _best_s(fn, repeats: int) -> float:
    fn()  # first call: allocation, kernel choice
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def read_bandwidth(repeats: int = 5, buffer=None) -> float:
    """Bytes per second this machine streams now: over a 1 GiB float32 ``buffer`` (made here
    when not given), far past the caches, the faster of a sum and a matrix-vector product (the
    BLAS library's gemv: a decode step's own access pattern, which streamed 33 GB/s where the sum
    took 26 on the AMX Xeon), the best of ``repeats`` each. A decode step mostly reads its weights
    and KV, so this, not a copy's read-plus-write rate, is its ceiling."""
    import torch

    x = torch.ones(1 << 28) if buffer is None else buffer
    rows = 1 << 14 if x.numel() % (1 << 14) == 0 else 1
    matrix, vector = x.view(rows, -1), torch.ones(x.numel() // rows, dtype=x.dtype)
    best = min(_best_s(x.sum, repeats), _best_s(lambda: torch.mv(matrix, vector), repeats))
    return x.numel() * x.element_size() / best


def matmul_rate(dtype, n: int = 1024, repeats: int = 3) -> float:
    """FLOP/s of an ``n``^3 matmul in ``dtype`` (a torch dtype or its name), the best of ``repeats``."""
    import torch

    a = torch.randn(n, n).to(getattr(torch, dtype) if isinstance(dtype, str) else dtype)
    return 2 * n ** 3 / _best_s(lambda: a @ a, repeats)


def measure_this(per_core: bool = False) -> Hardware:
    """This machine's CPU as one device per host (``per_core``: each core a device with its
    share of the memory, measured on one thread): its memory, the bandwidth of a 1 GiB
    float32 sum, and the rate of 1024^3 matmuls in bfloat16 and float32 (the best of a few)."""
    import torch

    cores = len(os.sched_getaffinity(0))
    threads = torch.get_num_threads()
    if per_core:
        torch.set_num_threads(1)
    try:
        bandwidth = read_bandwidth(repeats=3)
        flops = {dtype: matmul_rate(dtype) for dtype in ("bfloat16", "float32")}
    finally:
        torch.set_num_threads(threads)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return Hardware(name="this-core" if per_core else "this", kind="cpu",
                    memory_bytes=memory / cores if per_core else memory, bandwidth=bandwidth, peak_flops=flops,
                    link_bandwidth=6 * GB, devices_per_node=cores if per_core else 1, memory_efficiency=0.5,
                    compute_efficiency=0.6, step_overhead_s=5e-3, usable_memory=0.8, runtime_bytes=1 * GB,
                    source=f"measured here ({'one core of ' if per_core else ''}{cores} cores): a 1 GiB float32 "
                           "sum, 1024^3 matmuls; the link between processes is shared memory, taken as 6 GB/s")


def with_overrides(hw: Hardware, **changes: float) -> Hardware:
    """``hw`` with some figures replaced (``--memory-gb`` and the like on the command line)."""
    given: dict[str, Any] = {k: v for k, v in changes.items() if v is not None}
    return replace(hw, **given)
