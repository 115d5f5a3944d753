"""``kervan profile --served``: the step times a plan reads, measured through the serving
stack instead of the engine alone — the way Dynamo's profiler times a deployed engine
through its front end (TTFT against prompt length, ITL against concurrency).

It starts the cluster a plan's smallest recommendation runs (one prefill worker, one decode
worker, each pinned to its own core, every prompt prefilled remotely) and measures, through
the router:

- **decode**: per context length and batch ``b``, ``b`` streams at once; the median gap
  between tokens while all ``b`` stream (the prompts' prefills, one after another, are left
  out). This is ITL as a client sees it: the engine's step, the worker's serving loop, the
  router's and the client's share of the machine at that token rate;
- **prefill**: per prompt length, TTFT of lone prompts, each at a length not asked before
  (a served mix's lengths vary, and a new length pays for new kernel shapes) and after the
  prefill worker idled ``IDLE_BEFORE_S`` (as an open loop's prompts find it), without and
  with ``b`` background streams decoding (``prefill_busy_s``): on a machine whose cores the
  router, scheduler, registry, Redis and the client share with the workers, a prompt's
  prefill is slower while the decode side streams, and a plan at load reads the curve of its
  decode batch.

TTFT in Kervan's mesh is the prompt's prefill, its KV push and the hops around them (the
first token comes back with the prefill): each prefill point is that TTFT, which the plan
reads as a prompt's time (its own hand-over term, the device link's, is then counted twice:
microseconds on one machine)."""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import replace
from pathlib import Path

from control_plane.plan.profile import Profile, synthetic_prompt
from kervan.engine_args import EngineArgs

# the scheduler of a plan's split cluster: every prompt prefilled on the prefill worker, as a plan assumes
ALL_PROMPTS_REMOTE = ("--min-remote-prefill-blocks", "0", "--max-prefill-queue-tokens", "0")
SERVED_BATCHES = (1, 2, 4, 8, 16, 32)
SERVED_CONTEXTS = (128, 512)
SERVED_PREFILL_TOKENS = (64, 128, 256, 512, 1024)
MIN_GAPS = 24  # token gaps per stream while the whole batch streams
REPEATS = 5  # lone prompts per prefill point (their median)
# the prefill worker idle before each lone prompt: an open loop's prompt mostly finds it so, its
# caches cooled by the rest of the machine (on the embedded model, a prompt after 1 s idle took
# 10 ms more than one sent right after another; after 0.3 s, 3.5 ms more)
IDLE_BEFORE_S = 0.5


async def _follow(stub, ids: list[int], max_tokens: int, times: list[float]) -> None:
    from control_plane.cli.client import build_request

    request = build_request(token_ids=ids, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    async for msg in stub.Generate(request, timeout=600):
        if msg.WhichOneof("kind") != "finished" and msg.delta.token_ids:
            times.append(time.perf_counter())


def unique_prompt(tokens: int, vocab: int, number: int) -> list[int]:
    """A prompt whose first two tokens spell ``number``: no two of a run share a cached block."""
    base = vocab - 3
    return [3 + number % base, 3 + number // base % base, *synthetic_prompt(max(0, tokens - 2), vocab, number)]


class Streams:
    """One stream per prompt, generating until cancelled."""

    def __init__(self, stub, prompts: list[list[int]], max_tokens: int):
        self.times: list[list[float]] = [[] for _ in prompts]
        self.tasks = [asyncio.ensure_future(_follow(stub, prompt, max_tokens, times))
                      for prompt, times in zip(prompts, self.times)]

    async def all_streaming(self, gaps: int = 0, timeout_s: float = 600.0) -> float:
        """Waits until every stream has its first token and ``gaps`` more after the last
        first one; returns when the last stream started."""
        deadline = time.monotonic() + timeout_s
        while self.times and time.monotonic() < deadline:
            for task in self.tasks:
                if task.done():
                    task.result()  # a failed stream fails the profile
                    raise RuntimeError("a stream ended before the batch was measured: raise max_tokens")
            if all(self.times):
                start = max(t[0] for t in self.times)
                if all(sum(x > start for x in t) >= gaps for t in self.times):
                    return start
            await asyncio.sleep(0.02)
        if not self.times:  # no streams: nothing to wait for
            return time.perf_counter()
        raise TimeoutError("the batch never streamed whole")

    def gaps_after(self, start: float) -> list[float]:
        return [b - a for t in self.times for a, b in zip(t, t[1:]) if a >= start]

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


class Prompts:
    """The run's prompts, none sharing a block with another. Lone prompts of about ``tokens``
    come each at a length not asked before: a served mix's lengths vary, and the first prompt
    of a length pays for new kernel shapes (oneDNN's primitives), which one repeated length
    would hide."""

    def __init__(self, vocab: int):
        self.vocab, self.made, self.lone = vocab, 0, 0

    def exactly(self, tokens: int) -> list[int]:
        self.made += 1
        return unique_prompt(tokens, self.vocab, self.made)

    def next(self, tokens: int) -> list[int]:
        self.lone += 1
        offset = (self.lone + 1) // 2 * (1 if self.lone % 2 else -1)  # 1, -1, 2, -2, ...: near ``tokens``
        return self.exactly(max(3, tokens + offset))


async def _lone_ttft(stub, prompt: list[int], idle_s: float = 0.0) -> float:
    await asyncio.sleep(idle_s)
    times: list[float] = []
    started = time.perf_counter()
    await _follow(stub, prompt, 2, times)  # 2 tokens: the prompt's KV goes to the decode worker
    return times[0] - started


class Served:
    """The measurements, through the router ``stub`` calls."""

    def __init__(self, stub, vocab: int, max_len: int):
        self.stub, self.vocab, self.max_len = stub, vocab, max_len
        self.prompts = Prompts(vocab)

    def streams(self, batch: int, context: int) -> Streams:
        return Streams(self.stub, [self.prompts.exactly(context) for _ in range(batch)], self.max_len - context - 1)

    async def itl(self, batch: int, context: int) -> float:
        """The median gap between tokens while ``batch`` streams decode, all of them."""
        streams = self.streams(batch, context)
        try:
            start = await streams.all_streaming(MIN_GAPS)
            return statistics.median(streams.gaps_after(start))
        finally:
            await streams.close()

    async def ttft(self, tokens: int, decoding: int, context: int) -> float:
        """The median TTFT of lone prompts of about ``tokens`` while ``decoding`` streams decode."""
        streams = self.streams(decoding, context)
        try:
            await streams.all_streaming()
            return statistics.median([await _lone_ttft(self.stub, self.prompts.next(tokens), IDLE_BEFORE_S)
                                      for _ in range(REPEATS)])
        finally:
            await streams.close()


async def _measure(address: str, vocab: int, max_len: int, batches, contexts, prefill_tokens, busy_batches,
                   say) -> Profile:
    import grpc

    from services.proto import router_pb2_grpc

    async with grpc.aio.insecure_channel(address) as channel:
        served = Served(router_pb2_grpc.RouterServiceStub(channel), vocab, max_len)
        await _lone_ttft(served.stub, served.prompts.next(16))  # connections, first calls
        decode: dict[int, dict[int, float]] = {}
        for context in contexts:
            decode[context] = {b: await served.itl(b, context) for b in batches}
            say(f"served decode at context {context}: " + ", ".join(f"batch {b} {s * 1e3:.1f} ms"
                                                                   for b, s in decode[context].items()))
        context = min(contexts)
        prefill: dict[int, dict[int, float]] = {}  # decoding beside -> prompt tokens -> seconds
        for decoding in (0, *busy_batches):
            prefill[decoding] = {t: await served.ttft(t, decoding, context) for t in prefill_tokens}
            say(f"served prefill beside {decoding} decoding: " + ", ".join(
                f"{t} tokens {s * 1e3:.1f} ms" for t, s in prefill[decoding].items()))
        return Profile(model="", dtype="", machine={}, decode_s=decode, prefill_s=prefill.pop(0), served=True,
                       prefill_busy_s=prefill)


def measure_served(model_dir: str | Path, dtype: str = "auto", batches=SERVED_BATCHES, contexts=SERVED_CONTEXTS,
                   prefill_tokens=SERVED_PREFILL_TOKENS, busy_batches=None, say=lambda line: None) -> Profile:
    """The served curves of ``model_dir`` on this machine (a cluster of one prefill and one
    decode worker, each on its own core; minutes). Prefill is timed beside ``busy_batches``
    decoding too: by default the batches between the first and the last (2, 4, 8 and 16 of
    1, 2, 4, 8, 16, 32), or the second of two."""
    batches = sorted(batches)
    if busy_batches is None:
        busy_batches = batches[1:-1] or batches[1:]
    from control_plane.cli.launcher import Cluster, ClusterSpec, new_log_dir
    from control_plane.plan.model_dir import model_shape
    from worker.platform import current_platform, dtype_name

    shape = model_shape(str(model_dir))[0]
    max_len = min(shape.max_position, max(contexts) + 2048)
    spec = ClusterSpec(Path(model_dir), num_prefill=1, num_decode=1, engine=EngineArgs(dtype=dtype), pin_cores=True,
                       scheduler_args=ALL_PROMPTS_REMOTE)
    cluster = Cluster(spec, new_log_dir())
    try:
        cluster.start()
        measured = asyncio.run(_measure(cluster.router_address, shape.vocab_size, max_len, batches, contexts,
                                        prefill_tokens, busy_batches, say))
    finally:
        cluster.stop()
    platform = current_platform()
    cpu = platform.cpu
    machine = {"cpu": cpu.model, "isa": cpu.isa, "amx": cpu.has_amx, "cores": cpu.num_cores}
    served_dtype = dtype_name(platform.resolve_dtype(dtype, platform.device))
    return replace(measured, model=str(model_dir), dtype=served_dtype, machine=machine)
