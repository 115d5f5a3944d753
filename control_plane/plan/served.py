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
- **prefill**: per prompt length, TTFT of lone prompts, without and with ``b`` background
  streams decoding (``prefill_busy_s``): on a machine whose cores the router, scheduler,
  registry, Redis and the client share with the workers, a prompt's prefill is slower while
  the decode side streams, and a plan at load reads the curve of its decode batch.

TTFT in Kervan's mesh is the prompt's prefill, its KV push and the hops around them; the
plan adds a hand-over and a decode step to a prompt's time, so each prefill point is stored
less the decode step at its batch (the sum then comes back to what was measured)."""

from __future__ import annotations

import asyncio
import statistics
import time
from pathlib import Path

from control_plane.plan.profile import Profile, _prompt

MIN_GAPS = 24  # token gaps per stream while the whole batch streams
REPEATS = 3  # lone prompts per prefill point


async def _follow(stub, ids: list[int], max_tokens: int, times: list[float]) -> None:
    from control_plane.client import build_request

    request = build_request(token_ids=ids, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    async for msg in stub.Generate(request, timeout=600):
        if msg.WhichOneof("kind") != "finished" and msg.delta.token_ids:
            times.append(time.perf_counter())


class Streams:
    """``batch`` streams of ``context``-token prompts, generating until cancelled."""

    def __init__(self, stub, batch: int, context: int, vocab: int, max_tokens: int, seed: int):
        self.times: list[list[float]] = [[] for _ in range(batch)]
        self.tasks = [asyncio.ensure_future(_follow(stub, _prompt(context, vocab, seed + i), max_tokens, t))
                      for i, t in enumerate(self.times)]

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


async def _lone_ttft(stub, tokens: int, vocab: int, seed: int) -> float:
    times: list[float] = []
    started = time.perf_counter()
    await _follow(stub, _prompt(tokens, vocab, seed), 2, times)  # 2: the KV goes to the decode worker
    return times[0] - started


async def _measure(address: str, vocab: int, max_len: int, batches, contexts, prefill_tokens, busy_batches,
                   say) -> tuple[dict, dict, dict]:
    import grpc

    from services.proto import router_pb2_grpc

    seed = 1 << 20  # prompts no earlier run cached
    async with grpc.aio.insecure_channel(address) as channel:
        stub = router_pb2_grpc.RouterServiceStub(channel)
        await _lone_ttft(stub, 16, vocab, seed)  # connections, first calls
        decode: dict[int, dict[int, float]] = {}
        for context in contexts:
            decode[context] = {}
            for batch in batches:
                seed += batch
                streams = Streams(stub, batch, context, vocab, max_len - context - 1, seed)
                try:
                    start = await streams.all_streaming(MIN_GAPS)
                    decode[context][batch] = statistics.median(streams.gaps_after(start))
                finally:
                    await streams.close()
            say(f"served decode at context {context}: " + ", ".join(f"batch {b} {s * 1e3:.1f} ms"
                                                                   for b, s in decode[context].items()))
        context = min(contexts)
        steps = Profile(model="", dtype="", machine={}, decode_s=decode, prefill_s={})  # the decode curves alone
        prefill: dict[int, dict[int, float]] = {}  # decoding beside -> prompt tokens -> seconds
        for background in (0, *busy_batches):
            seed += 1000
            streams = Streams(stub, background, context, vocab, max_len - context - 1, seed)
            try:
                await streams.all_streaming()
                step = steps.decode_step_s(max(background, 1), context)
                prefill[background] = {}
                for tokens in prefill_tokens:
                    ttfts = [await _lone_ttft(stub, tokens, vocab, seed + 100 * tokens + r) for r in range(REPEATS)]
                    prefill[background][tokens] = max(statistics.median(ttfts) - step, 1e-6)
            finally:
                await streams.close()
            say(f"served prefill beside {background} decoding: " + ", ".join(
                f"{t} tokens {s * 1e3:.1f} ms" for t, s in prefill[background].items()))
        return decode, prefill.pop(0), prefill


def measure_served(model_dir: str | Path, dtype: str = "auto", batches=(1, 4, 16, 32), contexts=(128, 512),
                   prefill_tokens=(64, 256, 1024), busy_batches=None, say=lambda line: None) -> Profile:
    """The served curves of ``model_dir`` on this machine (a cluster of one prefill and one
    decode worker, each on its own core; minutes). Prefill is timed beside ``busy_batches``
    decoding too: by default the batches between the first and the last (4 and 16 of 1, 4,
    16, 32), or the second of two."""
    batches = sorted(batches)
    if busy_batches is None:
        busy_batches = batches[1:-1] or batches[1:]
    from control_plane.launcher import Cluster, ClusterSpec, new_log_dir
    from control_plane.plan.command import model_shape
    from worker.platform import current_platform, dtype_name

    shape = model_shape(str(model_dir))[0]
    max_len = min(shape.max_position, max(contexts) + 2048)
    spec = ClusterSpec(Path(model_dir), num_prefill=1, num_decode=1, dtype=dtype, pin_cores=True,
                       scheduler_args=("--min-remote-prefill-blocks", "0", "--max-prefill-queue-tokens", "0"))
    cluster = Cluster(spec, new_log_dir())
    try:
        cluster.start()
        decode, prefill, busy = asyncio.run(_measure(cluster.router_address, shape.vocab_size, max_len, batches,
                                                     contexts, prefill_tokens, busy_batches, say))
    finally:
        cluster.stop()
    platform = current_platform()
    cpu = platform.cpu
    machine = {"cpu": cpu.model, "isa": cpu.isa, "amx": cpu.has_amx, "cores": cpu.num_cores}
    served_dtype = dtype_name(platform.resolve_dtype(dtype, platform.device))
    return Profile(model=str(model_dir), dtype=served_dtype, machine=machine, decode_s=decode, prefill_s=prefill,
                   served=True, prefill_busy_s=busy)
