"""What the host tier's copies cost: their bandwidth against a plain copy, and their effect
on the inter-token latency of decodes running beside them (``benchmarks/kv_tiers.py``
runs both; ``--workloads bandwidth,itl``).

- ``bandwidth``: 64 blocks demoted (pool -> host tier) and promoted (host tier -> pool)
  through the engine's own paths, in GB/s, against one plain copy of the same bytes (into
  the same buffer each time, and into eight in turn, which the caches cannot hold). The
  blocks are demoted in eviction order (a request's tail first, as ``KVCacheManager.free``
  leaves them) and promoted in prefix order, as a revisit asks for them; also a prefix
  demoted one block at a time (a long decode's growth), promoted run by run; with ``--tier
  disk`` also written to and read from the disk tier.
- ``itl``: ``--itl-streams`` long generations decode while documents are revisited one at a
  time beside them; the streams' inter-token latency with the revisits' prefixes coming from
  the pool (``pool``: a pool that holds every document, no copy), from the host tier
  (``host``: a pool that holds three, each revisit promoted and the pool's older blocks
  demoted in the same steps) and computed again (``recompute``: the small pool, no tier)."""

from __future__ import annotations

import itertools
import random
import time
from statistics import mean, median

import torch

from worker import Engine, SamplingParams
from worker.kv.memory import zeros_on_huge_pages


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def bandwidth(engine: Engine, blocks: int = 64, reps: int = 10) -> dict:
    """GB/s of each copy, medians of ``reps``; ``engine`` has a host tier and at least
    ``blocks`` + 1 pool blocks."""
    tiers, host, runner = engine.kv.tiers, engine.kv.host, engine.runner
    ids = list(range(blocks))  # a request's blocks in a fresh pool, in prefix order
    data = runner.read_blocks(ids)
    nbytes = data.numel() * data.element_size()
    src, dst = data.clone(), torch.empty_like(data)
    rounds = iter(range(1, 1 << 30))

    def fresh() -> list[bytes]:  # a prefix the tier does not hold yet: each demotion copies
        r = next(rounds)
        return [r.to_bytes(8, "big") + i.to_bytes(24, "big") for i in range(blocks)]

    def demote(prefix: list[bytes], pool_ids: list[int]) -> list[bytes]:
        """``prefix``'s blocks (held at ``pool_ids``) leave the pool tail first, as the engine demotes."""
        order = list(reversed(range(blocks)))
        tiers.demote([prefix[k] for k in order],
                     lambda positions, out: runner.read_blocks([pool_ids[order[p]] for p in positions], out=out))
        return prefix

    def demote_one_by_one(prefix: list[bytes]) -> list[bytes]:
        """``prefix``'s blocks leave the pool one a step, tail first, as a long decode's
        growth takes them: each lands wherever the tier has room, one-block runs."""
        for k in reversed(range(blocks)):
            tiers.demote([prefix[k]], lambda positions, out, k=k: runner.read_blocks([ids[k]], out=out))
        return prefix

    def promote(prefix: list[bytes]) -> None:
        """A revisit's prefix back into the pool: the step's ``KVWrite`` of each run of slots."""
        start = 0
        for part in host.take_runs(prefix):
            runner.write_blocks(ids[start:start + part.shape[2]], part)
            start += part.shape[2]

    def timed(fn) -> float:
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return nbytes / median(times) / 1e9
    # the tier's demotions write where the caches have not been: a plain copy into buffers in turn too
    targets = itertools.cycle([zeros_on_huge_pages(tuple(data.shape), data.dtype) for _ in range(8)])
    held, scattered = demote(fresh(), ids), demote_one_by_one(fresh())
    out = {"bytes": nbytes, "plain_copy_gb_s": timed(lambda: dst.copy_(src)),
           "plain_copy_in_turn_gb_s": timed(lambda: next(targets).copy_(src)),
           "promote_gb_s": timed(lambda: promote(held)),
           "promote_scattered_gb_s": timed(lambda: promote(scattered)),
           "demote_gb_s": timed(lambda: demote(fresh(), ids)),
           # a pool that has moved on: the request's blocks scattered over it
           "demote_scattered_gb_s": timed(lambda: demote(fresh(), random.Random(0).sample(
               range(len(engine.kv.pool.blocks)), blocks)))}
    disk = engine.kv.disk
    if disk is not None:  # a write is queued, then made; a read of blocks just written comes from the page cache
        def write():
            hashes = fresh()
            disk.put(hashes, data)
            disk.fetch(hashes[-1:]).result()  # after the writes, on the one I/O thread
            return hashes
        out["disk_write_gb_s"] = timed(write)
        on_disk = write()
        out["disk_read_gb_s"] = timed(lambda: disk.fetch(on_disk).result())
    return out


def itl(engine: Engine, args, rng_seed: int) -> dict:
    """The decode streams' inter-token latency while documents are revisited beside them
    (``engine``'s pool and tiers make the variant)."""
    vocab = min(engine.model_config.vocab_size, 30000)
    rng = random.Random(rng_seed)
    docs = [[rng.randrange(3, vocab) for _ in range(args.doc_len)] for _ in range(args.itl_docs)]
    question = lambda: [rng.randrange(3, vocab) for _ in range(8)]  # noqa: E731
    revisit = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    engine.generate([d + question() for d in docs], revisit)  # cold: every document once, not counted
    long = SamplingParams(max_tokens=args.itl_output, temperature=0, ignore_eos=True)
    streams = {engine.add_request([rng.randrange(3, vocab) for _ in range(32)], long): None
               for _ in range(args.itl_streams)}
    last: dict[str, float] = {}
    gaps: list[float] = []
    doc_ttft: list[float] = []
    visiting: tuple[str, float, bool] | None = None  # request id, sent at, first token seen
    while streams:
        if visiting is None:
            visiting = (engine.add_request(rng.choice(docs) + question(), revisit), time.perf_counter(), False)
        for out in engine.step():
            now = time.perf_counter()
            if out.request_id in streams:
                if out.request_id in last:
                    gaps.append(now - last[out.request_id])
                last[out.request_id] = now
                if out.finished:
                    del streams[out.request_id]
            elif out.request_id == visiting[0]:
                if not visiting[2]:
                    doc_ttft.append(now - visiting[1])
                    visiting = (visiting[0], visiting[1], True)
                if out.finished:
                    visiting = None
    if visiting is not None:
        engine.abort(visiting[0])
    stats = engine.stats()
    return {"itl_p50_ms": median(gaps) * 1e3, "itl_p99_ms": percentile(gaps, 99) * 1e3,
            "itl_mean_ms": mean(gaps) * 1e3, "revisits": len(doc_ttft),
            "revisit_ttft_p50_ms": median(doc_ttft) * 1e3, "host_promoted_blocks": stats.num_host_promoted}
