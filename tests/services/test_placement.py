"""The placement cost function and the policies, on plain data."""

import random
from collections import Counter

import pytest

from kervan.sampling import InvalidRequest, RequestLimits
from kervan.worker_info import WorkerRole
from services.scheduler import placement
from services.scheduler.placement import (
    FORKED,
    PREFILL_QUEUE_FULL,
    REMOTE,
    AllBusy,
    Ask,
    Candidate,
    Choice,
    PlacementConfig,
    Size,
)
from services.scheduler.policies import POLICIES, PlacementPolicy, make_policy, register
from services.scheduler.policies.approx_tree import ApproxTrees
from services.scheduler.policies.prefix_hash import prefix_key

CFG = PlacementConfig(overlap_weight=1.0, min_remote_prefill_blocks=2)


def place(candidates, num_prompt_blocks, cfg, rng=None, **kwargs):
    """``placement.place`` with a fresh policy of ``cfg`` (stateless but for approx_tree's memory)."""
    return placement.place(candidates, num_prompt_blocks, make_policy(cfg, rng), **kwargs)


def cand(wid, role="decode", matched=0, active=0, queued=0, free=100, model="m", evictable=0, full=False,
         max_model_len=4096, max_n=16, sent=0, host=0, disk=0):
    return Candidate(worker_id=wid, address=f"{wid}:1", role=WorkerRole(role), matched_blocks=matched, host_blocks=host,
                     disk_blocks=disk,
                     active_blocks=active,
                     prefill_tokens=queued, free_blocks=free, evictable_blocks=evictable, model=model, full=full,
                     limits=RequestLimits(max_model_len=max_model_len, max_n=max_n), sent_blocks=sent)


def test_prefers_the_worker_holding_the_prefix_unless_it_is_busier():
    d = place([cand("a", matched=6), cand("b")], 8, CFG)
    assert d.decode.worker_id == "a" and d.scores == {"a": 4.0, "b": 16.0}  # a miss costs prefill and memory
    d = place([cand("a", matched=6, active=15), cand("b")], 8, CFG)
    assert d.decode.worker_id == "b"  # 2 + (15 + 2) > 8 + (0 + 8)
    weighted = place([cand("a", matched=6, active=15), cand("b")], 8, PlacementConfig(overlap_weight=3.0))
    assert weighted.decode.worker_id == "a"  # 3*2 + 17 < 3*8 + 8


def test_a_prefix_in_host_memory_costs_a_copy_between_a_pool_hit_and_a_miss():
    """8 matched blocks in the pool cost nothing to reuse; in the host tier, a copy each
    (host_block_cost of a prefill) and the pool blocks they are copied into; a miss, both."""
    cfg = PlacementConfig(overlap_weight=1.0, host_block_cost=0.1)
    d = place([cand("pool", matched=8), cand("host", matched=8, host=8), cand("none")], 8, cfg)
    assert d.decode.worker_id == "pool"
    assert d.scores == pytest.approx({"pool": 0.0, "host": 0.8 + 8, "none": 16.0})
    d = place([cand("host", matched=8, host=8), cand("none")], 8, cfg)
    assert d.decode.worker_id == "host"  # a copy beats a prefill
    d = place([cand("host", matched=8, host=8, free=8), cand("none", free=100)], 8, cfg)
    assert d.decode.worker_id == "none"  # no room to copy into: 8 blocks plus one to decode into


def test_a_prefix_on_disk_costs_a_read_between_host_memory_and_a_miss():
    cfg = PlacementConfig(overlap_weight=1.0, host_block_cost=0.1, disk_block_cost=0.25)
    pool = [cand("host", matched=8, host=8), cand("disk", matched=8, disk=8), cand("both", matched=8, host=4, disk=4),
            cand("none")]
    d = place(pool, 8, cfg)
    assert d.decode.worker_id == "host"
    assert d.scores == pytest.approx({"host": 0.8 + 8, "disk": 2.0 + 8, "both": 1.4 + 8, "none": 16.0})
    d = place([cand("disk", matched=8, disk=8, free=8), cand("none", free=100)], 8, cfg)
    assert d.decode.worker_id == "none"  # no room to read into


def test_a_prefix_another_worker_holds_is_pulled_from_it_when_that_saves_more_than_moving_it_costs():
    """b holds 8 of the 10 blocks but is busy, so the request decodes on a; with pulls on, b
    prefills (computing 2 blocks, not 10) and pushes the KV to a."""
    pool = [cand("a", "both"), cand("b", "both", matched=8, active=40)]
    assert place(pool, 10, CFG).reason == "aggregated"  # pulls off: a computes all 10
    d = place(pool, 10, PlacementConfig(overlap_weight=1.0, pull_block_cost=0.1))
    assert (d.decode.worker_id, d.prefill.worker_id, d.reason) == ("a", "b", "pull")
    # saving 8 blocks does not pay for moving 10 at 0.9 each; nor does a holder that is full
    assert place(pool, 10, PlacementConfig(overlap_weight=1.0, pull_block_cost=0.9)).reason == "aggregated"
    full = [cand("a", "both"), cand("b", "both", matched=8, active=40, full=True)]
    assert place(full, 10, PlacementConfig(overlap_weight=1.0, pull_block_cost=0.1)).reason == "aggregated"
    # a short remainder a decode worker would compute itself is pulled from a prefill worker too
    disagg = [cand("d", matched=1), cand("p1", "prefill"), cand("p2", "prefill", matched=9)]
    assert place(disagg, 10, PlacementConfig(overlap_weight=1.0, min_remote_prefill_blocks=20)).reason == "short"
    d = place(disagg, 10, PlacementConfig(overlap_weight=1.0, min_remote_prefill_blocks=20, pull_block_cost=0.1))
    assert (d.prefill.worker_id, d.reason) == ("p2", "pull")


def test_a_prefix_another_worker_holds_is_fetched_when_the_link_moves_it_faster_than_it_is_computed():
    """The cluster KV tier: b holds 64 blocks of 4 KiB in its host tier, the request lands on a.
    At 10 Gbit/s moving them takes 0.7 ms, computing 1,024 tokens at 100k tokens/s 10 ms: a
    fetches them. At 100 Mbit/s moving takes 21 ms: a computes them."""
    import dataclasses
    a = dataclasses.replace(cand("a", "both"), prefill_tokens_per_s=100_000.0, kv_block_bytes=4096)
    b = dataclasses.replace(cand("b", "decode", matched=64, host=64, active=500), kv_block_bytes=4096)
    fast = PlacementConfig(overlap_weight=1.0, link_bytes_per_s=10e9 / 8)
    d = place([a, b], 65, fast, block_size=16)
    assert d.decode.worker_id == "a" and d.fetch is not None
    assert (d.fetch.holder.worker_id, d.fetch.first_block, d.fetch.num_blocks) == ("b", 0, 64)
    assert d.fetch.move_s < d.fetch.compute_s
    slow = dataclasses.replace(fast, link_bytes_per_s=100e6 / 8)
    assert place([a, b], 65, slow, block_size=16).fetch is None
    # what a worker measured of its link outranks the configured figure; the slower end counts
    measured = [dataclasses.replace(a, link_bytes_per_s=100e6 / 8), dataclasses.replace(b, link_bytes_per_s=1.25e9)]
    assert place(measured, 65, fast, block_size=16).fetch is None
    # unknown prices (no link figure, no prefill rate) move nothing; nor does kv_fetch off
    assert place([a, b], 65, PlacementConfig(overlap_weight=1.0), block_size=16).fetch is None
    assert place([dataclasses.replace(a, prefill_tokens_per_s=0.0), b], 65, fast, block_size=16).fetch is None
    assert place([a, b], 65, dataclasses.replace(fast, kv_fetch=False), block_size=16).fetch is None
    # only what the holder has beyond the computing worker's own hit moves
    part = dataclasses.replace(a, matched_blocks=40)
    d = place([part, b], 65, fast, block_size=16)
    assert (d.fetch.first_block, d.fetch.num_blocks) == (40, 24)


def test_new_prefix_content_sends_a_prompt_no_worker_caches_to_the_worker_holding_the_least():
    content = PlacementConfig(new_prefix="content")
    pool = [cand("a", evictable=40), cand("b", sent=64), cand("c", active=10)]
    # b's prompt placed a moment ago shows in no report yet: only what was sent counts it
    assert place(pool, 8, content).decode.worker_id == "c"  # holds 10 against 40 and 64
    assert place(pool, 8, PlacementConfig()).decode.worker_id == "a"  # the cost sees a and b alike: idle, room
    # once any worker caches part of the prompt, the cost decides as always
    matched = [cand("a", evictable=40, matched=6), cand("c", active=10)]
    assert place(matched, 8, content).decode.worker_id == "a"


def test_long_uncached_prompts_go_to_a_prefill_worker():
    d = place([cand("d"), cand("p1", "prefill", active=5), cand("p2", "prefill", matched=3)], 8, CFG)
    assert (d.decode.worker_id, d.prefill.worker_id, d.cached_blocks) == ("d", "p2", 3)


def test_short_uncached_part_is_prefilled_locally():
    d = place([cand("d", matched=7), cand("p", "prefill")], 8, CFG)
    assert d.prefill is None and d.reason == "short" and d.cached_blocks == 7


def test_decode_only_fallback_without_prefill_workers():
    d = place([cand("d")], 8, CFG)
    assert d.prefill is None and d.reason == "no_prefill_worker"


def test_a_full_prefill_queue_overflows_to_a_less_queued_decode_worker():
    cfg = PlacementConfig(max_prefill_queue_tokens=1000)
    d = place([cand("d", queued=200), cand("p", "prefill", queued=1500)], 8, cfg)
    assert d.prefill is None and d.reason == "prefill_queue_full"
    assert place([cand("d", queued=1600), cand("p", "prefill", queued=1500)], 8, cfg).prefill.worker_id == "p"
    assert place([cand("d"), cand("p", "prefill", queued=900)], 8, cfg).prefill.worker_id == "p"
    never = PlacementConfig(max_prefill_queue_tokens=0)
    assert place([cand("d"), cand("p", "prefill", queued=10**6)], 8, never).prefill.worker_id == "p"


def test_aggregated_workers_prefill_themselves_and_no_decoder_means_none():
    assert place([cand("x", "both"), cand("p", "prefill")], 8, CFG).prefill is None
    assert place([cand("p", "prefill")], 8, CFG) is None


def test_temperature_spreads_load_but_favours_the_cheaper():
    cfg = PlacementConfig(temperature=2.0)
    rng = random.Random(0)
    picks = [place([cand("a", matched=7), cand("b", matched=6)], 8, cfg, rng).decode.worker_id for _ in range(400)]
    assert 0.7 < picks.count("a") / 400 < 0.95  # costs 3 vs 6: exp(0) vs exp(-1.5), about 82% to a


def test_filters_model_and_room_before_cost():
    pool = [cand("a", matched=8, model="other"), cand("b", active=3, free=5), cand("c", active=9)]
    assert place(pool, 8, CFG, model="m").decode.worker_id == "c"  # b has no room for 8 blocks, a serves another model
    assert place(pool, 8, CFG).decode.worker_id == "a"  # any model
    assert place(pool, 4, CFG, model="m").decode.worker_id == "b"  # 5 free blocks hold 4 (+1 to decode)
    full = [cand("b", active=3, free=0), cand("c", active=9, free=1)]
    assert place(full, 8, CFG).decode.worker_id == "b"  # no room anywhere: queue on the cheapest
    assert place(pool, 8, CFG, model="missing") is None


def test_round_robin_and_random_baselines_ignore_the_cost():
    pool = [cand("b"), cand("a", matched=8), cand("c")]
    rr = PlacementConfig(policy="round_robin")
    assert [place(pool, 8, rr, turn=t).decode.worker_id for t in range(4)] == ["a", "b", "c", "a"]
    rng = random.Random(1)
    picks = {place(pool, 8, PlacementConfig(policy="random"), rng).decode.worker_id for _ in range(50)}
    assert picks == {"a", "b", "c"}
    d = place([cand("d", matched=1), cand("p1", "prefill"), cand("p2", "prefill")], 8, rr, turn=1)
    assert (d.decode.worker_id, d.prefill.worker_id, d.reason) == ("d", "p2", "remote")


def test_a_new_prefix_goes_where_it_evicts_no_cached_one():
    # both idle with 40 free blocks; a's are all cached prefixes, b's mostly empty
    d = place([cand("a", free=40, evictable=40), cand("b", free=40, evictable=10, active=5)], 8, CFG)
    assert d.decode.worker_id == "b" and d.scores == {"a": 25.0, "b": 21.0}  # a would evict 9 blocks
    never = PlacementConfig(overlap_weight=1.0, eviction_weight=0)
    assert place([cand("a", free=40, evictable=40), cand("b", free=40, evictable=10, active=5)], 8,
                 never).decode.worker_id == "a"


def test_a_worker_at_its_request_limit_gets_nothing_and_all_at_it_refuses():
    d = place([cand("a", matched=8, full=True), cand("b")], 8, CFG)
    assert d.decode.worker_id == "b" and "a" not in d.scores  # the prefix holder is full: the other one
    with pytest.raises(AllBusy, match="all 2 .* request limit"):
        place([cand("a", full=True), cand("b", "both", full=True), cand("p", "prefill")], 8, CFG)
    d = place([cand("d"), cand("p1", "prefill", full=True), cand("p2", "prefill", full=True)], 8, CFG)
    assert d.prefill is None and d.reason == PREFILL_QUEUE_FULL  # the prefill pool is full: prefill locally
    d = place([cand("d"), cand("p1", "prefill", full=True), cand("p2", "prefill", active=50)], 8, CFG)
    assert d.prefill.worker_id == "p2"


def test_only_workers_whose_registered_limits_hold_the_request_are_chosen():
    short, long = cand("short", max_model_len=512), cand("long", matched=0, active=50, max_model_len=4096)
    assert place([short, long], 8, CFG, size=Size(num_prompt_tokens=128, max_tokens=64)).decode is short
    # the less loaded worker cannot hold prompt + max_tokens: the other takes it
    assert place([short, long], 8, CFG, size=Size(num_prompt_tokens=128, max_tokens=900)).decode is long
    # a prefill worker needs room for the prompt and its first token only
    small_prefill = cand("p", "prefill", max_model_len=200)
    d = place([long, small_prefill], 8, CFG, size=Size(num_prompt_tokens=128, max_tokens=900))
    assert (d.prefill, d.reason) == (small_prefill, REMOTE)
    d = place([long, small_prefill], 16, CFG, size=Size(num_prompt_tokens=256, max_tokens=900))
    assert d.prefill is None  # the prompt alone exceeds it


def test_a_request_no_worker_holds_is_the_clients_mistake_named_by_the_largest_limit():
    workers = [cand("a", max_model_len=512, max_n=4), cand("b", max_model_len=1024, max_n=2)]
    with pytest.raises(InvalidRequest, match=r"prompt \(1000 tokens\) \+ max_tokens \(100\) exceeds the "
                                             r"maximum model length 1024"):
        place(workers, 8, CFG, size=Size(num_prompt_tokens=1000, max_tokens=100))
    with pytest.raises(InvalidRequest, match="n must be <= 4, got 5"):
        place(workers, 8, CFG, size=Size(num_prompt_tokens=10, max_tokens=10, n=5))
    with pytest.raises(InvalidRequest, match="no worker serves both n=3 and prompt"):  # each limit alone fits a worker
        place(workers, 8, CFG, size=Size(num_prompt_tokens=600, max_tokens=100, n=3))


def test_forked_samples_are_prefilled_by_their_decode_worker():
    d = place([cand("d"), cand("p", "prefill")], 8, CFG, size=Size(num_prompt_tokens=128, max_tokens=8, n=3))
    assert (d.prefill, d.reason) == (None, FORKED)


def test_prefix_hash_sends_a_prefix_to_one_worker_and_moves_only_a_leaving_worker_s_share():
    cfg = PlacementConfig(policy="prefix_hash", hash_prefix_blocks=2)
    pool = [cand(f"w{i}", "both") for i in range(4)]
    keys = [(b"a%d" % k, b"b%d" % k, b"c") for k in range(400)]
    owner = {key: place(pool, 3, cfg, block_hashes=key).decode.worker_id for key in keys}
    assert all(place(pool, 3, cfg, block_hashes=key).decode.worker_id == owner[key] for key in keys[:50])
    assert all(place(pool, 3, cfg, block_hashes=key[:2] + (b"x",)).decode.worker_id == owner[key]
               for key in keys[:50])  # only the first 2 blocks count
    share = Counter(owner.values())
    assert set(share) == {"w0", "w1", "w2", "w3"} and min(share.values()) > 40  # spread over the ring
    without = [c for c in pool if c.worker_id != "w2"]
    moved = [key for key in keys if place(without, 3, cfg, block_hashes=key).decode.worker_id != owner[key]]
    assert {owner[key] for key in moved} == {"w2"}  # only w2's prefixes move
    assert prefix_key([b"5", b"6", b"7"], 4) == prefix_key([b"8", b"9", b"7"], 4)  # the last block covers the rest
    assert prefix_key([], 4) == b""


def test_approx_tree_follows_what_it_sent_balances_load_and_sends_misses_to_the_smallest_tree():
    trees = ApproxTrees(tree_blocks_per_worker=6)
    h = [bytes([i]) * 32 for i in range(10)]
    trees.insert("w0", h[1:5])
    assert trees.matched("w0", [h[1], h[2], h[9]]) == 2 and trees.matched("w1", h[1:3]) == 0
    trees.insert("w0", h[5:8])  # over capacity: the least recently used (h[1]) goes first
    assert trees.size("w0") == 6 and trees.matched("w0", h[1:3]) == 0 and trees.matched("w0", h[2:4]) == 2
    policy = make_policy(PlacementConfig(policy="approx_tree", balance_abs_threshold=4))
    policy.placed("a", [b"a%d" % i for i in range(50)], live=["a", "b"])
    policy.placed("b", [b"b%d" % i for i in range(10)], live=["a", "b"])
    assert policy.remembered_blocks("a", [b"a0", b"a1", b"b0"]) == 2

    def worker(wid, matched=0, running=0):
        return Candidate(worker_id=wid, address=wid, role=WorkerRole.BOTH, matched_blocks=matched, active_blocks=0,
                         num_requests=running)

    def chosen(pool):
        decision = placement.place(pool, 10, policy)
        return decision.decode.worker_id, decision.branch  # the rule that chose, counted by GetStats

    assert chosen([worker("a", 6, 3), worker("b", 0, 0)]) == ("a", "cache")  # a match over half the prompt wins
    assert chosen([worker("a", 4, 0), worker("b", 0, 3)]) == ("b", "smallest_tree")  # a weaker one does not
    assert chosen([worker("a", 10, 9), worker("b", 0, 2)]) == ("b", "balance")  # imbalance past the threshold
    policy.placed("a", [b"c0"], live=["a"])  # b left the mesh: its tree is forgotten
    assert policy.remembered_blocks("b", [b"b0"]) == 0 and policy.trees.size("a") == 51


def test_a_policy_is_one_registered_class_and_chooses_among_the_filtered_workers():
    """A new policy is a file with one decorated class: placement's filters (role, size,
    admission, room) run before it, and its choice is the decode worker."""
    seen = []

    @register
    class Busiest(PlacementPolicy):
        name = "test_busiest"

        def choose(self, pool: list[Candidate], ask: Ask) -> Choice:
            seen.append(sorted(c.worker_id for c in pool))
            return Choice(max(pool, key=lambda c: c.active_blocks), {})
    try:
        pool = [cand("a", active=5), cand("b", active=9), cand("c", active=50, full=True), cand("d", active=60, free=3),
                cand("p", "prefill", active=99)]
        d = place(pool, 8, PlacementConfig(policy="test_busiest"))
        assert (d.decode.worker_id, d.prefill.worker_id) == ("b", "p")
        assert seen == [["a", "b"], ["p"]]  # decoders: c is full, d has no room, p does not decode; then prefillers
    finally:
        del POLICIES["test_busiest"]
    with pytest.raises(ValueError, match="two placement policies are named 'kv'"):
        register(type("Again", (Busiest,), {"name": "kv"}))
    with pytest.raises(ValueError, match="'nope' is not one of approx_tree, kv, prefix_hash, random, round_robin"):
        make_policy(PlacementConfig(policy="nope"))
