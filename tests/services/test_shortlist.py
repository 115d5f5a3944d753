"""The shortlist (services/scheduler/shortlist.py) changes how many workers a placement
prices, never which it picks: on random meshes of every role mix, with prefix matches,
recent placements, full workers, exclusions, tight KV room and size limits, the scheduler
with the shortlist and without it choose the same decode and prefill workers for the same
reason, with the same fetch of another worker's blocks (the cluster KV tier), or fail the
same way."""

from __future__ import annotations

import random

import pytest

from kervan.sampling import InvalidRequest, RequestLimits
from kervan.worker_info import WorkerInfo, WorkerRole
from services.common.convert import load_to_proto, worker_info_to_proto
from services.common.load import Load
from services.proto import kv_registry_pb2
from services.scheduler.live_view import listed
from services.scheduler.placement import AllBusy, PlacementConfig, Size, place
from services.scheduler.recent import RecentPlacements
from services.scheduler.servicer import SchedulerServicer


def mesh(rng: random.Random, num_workers: int, tight: bool) -> kv_registry_pb2.ListWorkersResponse:
    """``tight``: small pools, mostly holding cached prefixes, so that room runs out and
    evictions make different loads cost the same."""
    out = kv_registry_pb2.ListWorkersResponse()
    for i in range(num_workers):
        role = rng.choice([WorkerRole.PREFILL, WorkerRole.DECODE, WorkerRole.DECODE, WorkerRole.BOTH])
        blocks = rng.choice([8, 12, 16, 24] if tight else [64, 256, 4096])
        free = rng.randint(0, blocks)
        info = WorkerInfo(worker_id=f"{role.value}@127.0.0.1:{1000 + i}", address=f"127.0.0.1:{1000 + i}", role=role,
                          model=rng.choice(["m", "m", "other"]), block_size=16, hash_name="sha256",
                          limits=RequestLimits(max_model_len=rng.choice([1024, 8192]), max_n=4))
        load = Load(num_free_blocks=free, num_blocks=blocks,
                    num_evictable_blocks=rng.randint(free // 2 if tight else 0, free),
                    num_prefill_tokens=rng.choice([0, 0, 500, 5000]), num_requests=rng.randint(0, 8),
                    max_requests=rng.choice([0, 8]), prefill_tokens_per_s=rng.choice([0, 2000, 50_000]),
                    kv_link_bytes_per_s=rng.choice([0, 10**7, 10**9]), kv_block_bytes=rng.choice([0, 4096, 1 << 20]))
        # many idle workers: ties the walk must break as the kv policy does
        if rng.random() < 0.3:
            load = Load(num_free_blocks=blocks, num_blocks=blocks, max_requests=8)
        out.workers.add(info=worker_info_to_proto(info), load=load_to_proto(load))
    return out


def decide(servicer: SchedulerServicer, view, hashes, match, model, size, excluded):
    reported = view.reported
    pool = [c for c in reported if c.address not in excluded]
    candidates = servicer._candidates(view, pool, hashes, match, model, size, len(pool) < len(reported))
    try:
        d = place(candidates, len(hashes), servicer.policy, model=model, size=size, block_hashes=hashes)
    except (AllBusy, InvalidRequest) as err:
        return type(err).__name__, len(candidates)
    if d is None:
        return None, len(candidates)
    fetch = (d.fetch.first_block, d.fetch.num_blocks) if d.fetch else None  # a holder tied with another may differ
    return (d.decode.worker_id, d.prefill.worker_id if d.prefill else None, d.reason, d.cached_blocks, fetch), \
        len(candidates)


@pytest.mark.parametrize("seed", range(60))
def test_the_shortlist_chooses_what_pricing_every_worker_chooses(seed):
    rng = random.Random(seed)
    tight = seed % 2 == 1
    workers = mesh(rng, rng.choice([3, 20, 200]), tight)
    view = listed(workers)
    config = PlacementConfig(overlap_weight=rng.choice([1.0, 2.0]), eviction_weight=rng.choice([0.0, 1.0]),
                             pull_block_cost=rng.choice([0.0, 0.5]), link_bytes_per_s=rng.choice([0.0, 1.25e8]))
    clock = [0.0]
    recent = RecentPlacements(clock=lambda: clock[0])
    fast = SchedulerServicer(None, config, recent=recent)
    full = SchedulerServicer(None, config, recent=recent, shortlist=False)
    ids = [w.info.worker_id for w in workers.workers]
    prefixes = [[rng.randbytes(8) for _ in range(rng.choice([1, 8, 64]))] for _ in range(5)]
    shortlisted = []
    for k in range(30):
        clock[0] += rng.choice([0.01, 0.2, 4.0])
        hashes = rng.choice(prefixes)[:rng.randint(1, 20 if tight else 64)]
        holders = rng.sample(ids, min(len(ids), rng.choice([3, len(ids) // 3])))  # a popular prefix: many hold it
        match = kv_registry_pb2.MatchResponse(matched_blocks={w: rng.randint(0, len(hashes)) for w in holders})
        size = Size(num_prompt_tokens=len(hashes) * 16, max_tokens=rng.choice([16, 4000]), n=rng.choice([1, 1, 2]))
        model = rng.choice(["m", "", "other", "missing"])
        excluded = {w.info.address for w in rng.sample(list(workers.workers), rng.choice([0, 0, 1, 2]))}
        got, priced = decide(fast, view, hashes, match, model, size, excluded)
        want, _ = decide(full, view, hashes, match, model, size, excluded)
        assert got == want, (seed, k)
        shortlisted.append(priced)
        if isinstance(got, tuple) and rng.random() < 0.5:  # the placement is remembered, as Place does
            recent.add(got[0], prefill_tokens=100, blocks=4, block_hashes=hashes)
    if len(ids) == 200 and not config.pull_block_cost:  # the point: far fewer priced than listed
        assert sorted(shortlisted)[len(shortlisted) // 2] < 40, sorted(shortlisted)


@pytest.mark.parametrize("seed", range(200))
def test_the_walk_finds_the_lowest_cost_plain_worker_as_pricing_each_would(seed):
    """``best_plain`` against pricing every eligible worker with room, ties by (active, id),
    on small pools where evictions make busier workers cheaper and costs tie."""
    from services.scheduler.placement import Candidate, cost, has_room
    from services.scheduler.shortlist import best_plain, plain_order
    rng = random.Random(seed)
    config = PlacementConfig(overlap_weight=rng.choice([1.0, 2.0]), eviction_weight=rng.choice([0.5, 1.0, 3.0]))
    pool = []
    for i in range(rng.randint(1, 30)):
        free = rng.randint(0, 24)
        pool.append(Candidate(worker_id=f"w{rng.randint(0, 99):02d}-{i}", address=f"a{i}", matched_blocks=0,
                              role=rng.choice([WorkerRole.DECODE, WorkerRole.BOTH, WorkerRole.PREFILL]),
                              active_blocks=rng.randint(0, 6), free_blocks=free, evictable_blocks=rng.randint(0, free),
                              full=rng.random() < 0.1, model=rng.choice(["m", "x"])))
    num_blocks, size = rng.randint(1, 12), Size(num_prompt_tokens=16)
    for prefill in (False, True):
        eligible = [c for c in pool if (c.role is WorkerRole.PREFILL) == prefill and not c.full and c.model == "m"]
        roomy = [c for c in eligible if has_room(c, num_blocks)]
        want = min(roomy, key=lambda c: (cost(c, num_blocks, config), c.active_blocks, c.worker_id), default=None)
        got = best_plain(plain_order(pool), set(), num_blocks, config, "m", size, prefill)
        assert got.worker == want, seed
        if want is None:  # nothing to stop the walk: it saw every worker, and says whether room was all that lacked
            assert got.lacked_room == bool(eligible), seed
