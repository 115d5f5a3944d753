"""Tier 1 behind the KV pool (``worker/kv/host_tier.py``): cached blocks the pool reuses
are demoted to host memory, and a later request (or a preempted sequence resuming) copies
them back instead of computing them — with the greedy tokens of a pool hit and of
`transformers`. float32 with the default kernels (``make_engine``): the copies are the
very bytes computed before, so a promoted prefix is exact by construction."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import MODEL_KINDS, hf_greedy, make_engine, make_prompts
from tests.worker.test_engine import assert_idle
from worker import SamplingParams
from worker.config import ConfigError
from worker.kv.host_tier import HostTier

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
HOST_BYTES = 256 << 10  # 128 blocks of the tiny llama's 2 KiB (float32, block size 4)


def test_the_tier_keeps_the_most_recently_used_blocks():
    tier = HostTier(2, (1, 2, 1, 4), torch.float32)
    block = lambda v: torch.full((1, 2, 1, 1, 4), float(v))  # noqa: E731
    tier.put([b"a"], block(1))
    tier.put([b"b"], block(2))
    assert tier.take([b"a"])[0, 0, 0, 0, 0] == 1  # a is now the most recently used
    tier.put([b"c"], block(3))  # pushes out b
    assert b"b" not in tier and tier.leading([b"a", b"c", b"b"]) == 2
    assert tier.take([b"a", b"c"]).shape == (1, 2, 2, 1, 4) and tier.num_dropped == 1
    tier.put([b"c"], block(9))  # already held: refreshed, not rewritten
    assert tier.take([b"c"])[0, 0, 0, 0, 0] == 3


def test_an_evicted_prefix_comes_back_from_host_memory_with_the_same_tokens(hf_models):
    hf, path = hf_models("llama")
    first, *others = make_prompts([41, 40, 40, 40, 40], seed=60)
    outs = {}
    for host_bytes in (0, HOST_BYTES):
        engine = make_engine(path, num_kv_blocks=24, kv_host_bytes=host_bytes)  # 24 blocks: one prompt's worth
        [before] = engine.generate([first], GREEDY)
        engine.generate(others, GREEDY)  # the pool reuses every block of the first prompt
        assert engine.kv.get_computed_blocks(_sequence(engine, first)).num_tokens == 0  # not in the pool
        [again] = engine.generate([first], GREEDY)
        outs[host_bytes] = (before, again, engine)
        assert_idle(engine)
    _, without, _ = outs[0]
    before, again, engine = outs[HOST_BYTES]
    assert without.num_cached_tokens == 0  # gone with the pool
    assert again.num_cached_tokens == 40  # ten blocks back from host memory; the last token computed
    assert again.outputs[0].token_ids == before.outputs[0].token_ids == hf_greedy(hf, first, 6)
    assert engine.kv.host.num_promoted >= 10


def _sequence(engine, prompt):
    from worker.sequence import Sequence
    return Sequence("probe", prompt, GREEDY, engine.config.block_size, engine.model_config.eos_token_ids)


@pytest.mark.parametrize("kind", MODEL_KINDS)
def test_a_preempted_sequence_resumes_from_host_memory(hf_models, kind):
    """24 blocks cannot hold four 20-token prompts growing by 10: sequences are preempted,
    and their blocks come back from host memory when they resume (swap, not recompute)."""
    hf, path = hf_models(kind)
    engine = make_engine(path, num_kv_blocks=24, kv_host_bytes=HOST_BYTES)
    prompts = make_prompts([20, 19, 21, 18], seed=11)
    outs = engine.generate(prompts, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    assert engine.stats().num_preemptions > 0 and engine.kv.host.num_promoted > 0
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(hf, prompt, 10)
    assert_idle(engine)


def test_a_negative_host_budget_is_refused():
    from worker.config import EngineConfig
    with pytest.raises(ConfigError, match="kv_host_bytes"):
        EngineConfig(kv_host_bytes=-1)
    with pytest.raises(ConfigError, match="kv_offload_min_uses"):
        EngineConfig(kv_offload_min_uses=0)


def test_the_registry_hears_which_blocks_live_in_host_memory(llama):
    """Events: a block the pool reuses is removed from the device tier and stored in the host
    tier; one the host tier pushes out (and the pool lacks) is removed from it; a promoted
    block is the device's again; a full dump lists the host-only blocks apart."""
    from kervan.kv_events import BlockRemoved, BlockStored
    _, path = llama
    engine = make_engine(path, num_kv_blocks=12, kv_host_bytes=16 << 10)  # 16 host blocks
    first, second, third = make_prompts([40, 40, 40], seed=61)
    engine.generate([first], GREEDY)
    engine.take_events()
    engine.generate([second], GREEDY)  # reuses the first prompt's blocks
    events = engine.take_events()
    removed_device = {h for e in events if isinstance(e, BlockRemoved) and e.medium == "device" for h in e.block_hashes}
    stored_host = {h for e in events if isinstance(e, BlockStored) and e.medium == "host" for h in e.block_hashes}
    assert stored_host and stored_host <= removed_device
    assert set(engine.tier_blocks()["host"]) == set(engine.kv.host.slots) - set(engine.kv.pool.cached)
    engine.generate([third], GREEDY)  # 16 host blocks: the oldest (the first prompt's) are pushed out
    events = engine.take_events()
    assert any(isinstance(e, BlockRemoved) and e.medium == "host" for e in events)
    second_in_host = {h for e in events if isinstance(e, BlockStored) and e.medium == "host" for h in e.block_hashes}
    [again] = engine.generate([second], GREEDY)  # back from host memory, the device's again
    assert again.num_cached_tokens > 0
    promoted = {h for e in engine.take_events() if isinstance(e, BlockStored) and e.medium == "device"
                for h in e.block_hashes}
    assert promoted & second_in_host
    assert_idle(engine)


def test_a_batch_larger_than_the_tier_keeps_its_last_blocks():
    tier = HostTier(2, (1, 2, 1, 4), torch.float32)
    data = torch.arange(3.0).reshape(1, 1, 3, 1, 1).expand(1, 2, 3, 1, 4).contiguous()
    spilled = []
    assert tier.put([b"a", b"b", b"c"], data, lambda hashes, kv: spilled.append((hashes, kv[0, 0, :, 0, 0]))) == [b"a"]
    assert spilled[0][0] == [b"a"] and spilled[0][1].tolist() == [0.0]  # on to the next tier, if any
    assert list(tier.slots) == [b"b", b"c"] and tier.take([b"c"])[0, 0, 0, 0, 0] == 2


def test_the_reuse_gate_keeps_one_off_prompts_out_of_the_tier_and_lets_preempted_sequences_swap(llama):
    """``kv_offload_min_uses=2``: a prompt used once leaves the pool for nowhere; one used
    twice is demoted when the pool moves on; a preempted sequence's blocks always are."""
    _, path = llama
    engine = make_engine(path, num_kv_blocks=24, kv_host_bytes=HOST_BYTES, kv_offload_min_uses=2)
    once, twice, *others = make_prompts([40, 40, 40, 40], seed=64)
    engine.generate([once], GREEDY)
    engine.generate([twice], GREEDY)
    engine.generate([twice], GREEDY)  # a pool hit: its second use
    engine.generate(others, GREEDY)  # the pool moves on
    held = set(engine.kv.host.slots)
    assert not held & set(_sequence(engine, once).block_hashes)
    assert set(_sequence(engine, twice).block_hashes[:10]) <= held
    assert not held & set(_sequence(engine, others[0]).block_hashes)  # used once, pushed out since: gone
    preempting = make_engine(path, num_kv_blocks=24, kv_host_bytes=HOST_BYTES, kv_offload_min_uses=2)
    preempting.generate(make_prompts([20, 19, 21, 18], seed=11), SamplingParams(max_tokens=10, temperature=0,
                                                                                ignore_eos=True))
    assert preempting.stats().num_preemptions > 0 and preempting.kv.host.num_promoted > 0
    assert_idle(engine)


def test_a_prefix_promoted_in_the_step_whose_demotions_fill_the_tier_keeps_its_kv(hf_models):
    """A host tier of 10 blocks holding a 40-token prefix: admitting it again takes pool blocks
    that still cache another prompt, whose 12 blocks are demoted into the same tier in the same
    step, reusing the promoted blocks' slots: the prefix reaches the pool whole, with the first
    run's tokens. The prefix is promoted from a view of the tier's slots (one run: the tier
    gives a prefix ascending slots), lent until the step's demotions, which must not take
    those slots: without the loan this test gets another prompt's KV."""
    hf, path = hf_models("llama")
    first, second, third = make_prompts([41, 40, 40], seed=66)
    engine = make_engine(path, num_kv_blocks=24, kv_host_bytes=20 << 10)  # 10 blocks of 2 KiB
    assert engine.kv.host.num_blocks == 10
    [before] = engine.generate([first], GREEDY)  # 12 blocks of the 24
    engine.generate([second], GREEDY)  # the 12 never used
    engine.generate([third], GREEDY)  # the first's: its prompt's 10 blocks go to the tier
    assert engine.kv.host.leading(_sequence(engine, first).block_hashes) == 10
    [again] = engine.generate([first], GREEDY)  # back from the tier; the second's 12 blocks demoted
    assert again.num_cached_tokens == 40
    assert again.outputs[0].token_ids == before.outputs[0].token_ids == hf_greedy(hf, first, 6)
    assert_idle(engine)


def test_blocks_demoted_tail_first_get_their_prefix_in_ascending_slots():
    """Eviction order (each request tail first) is the LRU order, but a prefix's slots
    ascend, so its promotion is one view of the tier's memory, not a gather."""
    tier = HostTier(8, (1, 2, 1, 4), torch.float32)
    evicted = [b"a3", b"a2", b"a1", b"a0", b"b1", b"b0"]  # two requests freed, a first
    data = torch.arange(6.0).reshape(1, 1, 6, 1, 1).expand(1, 2, 6, 1, 4).contiguous()
    assert tier.put(evicted, data) == []
    assert list(tier.slots) == evicted  # a3 goes first
    assert [tier.slots[h] for h in (b"b0", b"b1", b"a0", b"a1", b"a2", b"a3")] == [2, 3, 4, 5, 6, 7]  # from the top
    [run] = tier.take_runs([b"a0", b"a1", b"a2", b"a3"])
    assert run.data_ptr() == tier.data[:, :, 4].data_ptr()  # a view, in place
    assert run[0, 0, :, 0, 0].tolist() == [3.0, 2.0, 1.0, 0.0]  # each block its own KV
    parts = tier.take_runs([b"b0", b"b1", b"a0", b"a2"])
    assert [p.shape[2] for p in parts] == [3, 1]


def test_a_prefix_demoted_block_by_block_is_one_run_and_stays_one_once_the_tier_is_full():
    """A long decode's growth takes one cached block a step: each store holds one block, tail
    first. Free slots go from the top down, and a full tier gives up its least recently used
    blocks' slots in the order they went in, so each prefix is still one run of slots."""
    tier = HostTier(8, (1, 2, 1, 4), torch.float32)
    one = torch.zeros(1, 2, 1, 1, 4)
    for prefix in ("a", "b"):  # the second prefix pushes the first out, block by block
        for k in reversed(range(8)):
            tier.put([f"{prefix}{k}".encode()], one)
        slots = [tier.slots[f"{prefix}{k}".encode()] for k in range(8)]
        assert slots == list(range(8)), slots
    assert len(tier.take_runs([f"b{k}".encode() for k in range(8)])) == 1


def test_a_store_writes_straight_into_the_slots_and_never_reuses_a_lent_one():
    """``store`` hands ``fill`` views of the slots themselves; blocks lent this step (a
    promotion reading them in place) are never pushed out: the batch spills its first
    blocks instead."""
    tier = HostTier(3, (1, 2, 1, 4), torch.float32)
    tier.put([b"x", b"y", b"z"], torch.zeros(1, 2, 3, 1, 4))
    tier.take_runs([b"x"])  # lent: moved to the back of the LRU order
    filled, spilled = [], []

    def fill(positions, out):
        start = tier.data.data_ptr()
        in_tier = start <= out.data_ptr() < start + tier.data.numel() * tier.data.element_size()
        filled.append((positions, in_tier))
        out.fill_(7.0)
    dropped = tier.store([b"p", b"q", b"r"], fill, lambda hashes, kv: spilled.append(hashes), lent={b"x"})
    assert b"x" in tier and set(tier.slots) == {b"x", b"q", b"r"}
    assert dropped == [b"p", b"y", b"z"] and spilled == [[b"p"], [b"y", b"z"]]
    # p, the first, spills from a temporary; q and r are written into their slots, r first (prefix order)
    assert filled == [([0], False), ([2, 1], True)]
    assert tier.take([b"q", b"r"])[0, 0, :, 0, 0].tolist() == [7.0, 7.0]
    assert tier.take([b"x"])[0, 0, 0, 0, 0] == 0.0


def test_a_prefix_split_over_runs_of_slots_comes_back_run_by_run_with_the_same_tokens(hf_models):
    """The first prompt's blocks leave the pool over several steps (the third and fourth
    prompts' prefills and decodes each take some); another block demoted in between (here
    put by hand) splits its prefix into two runs of the tier's slots, promoted as one copy
    per run, each into its own pool blocks, with the first run's tokens."""
    from worker.kv.slots import consecutive_runs
    hf, path = hf_models("llama")
    first, second, third, fourth = make_prompts([41, 40, 20, 20], seed=67)
    engine = make_engine(path, num_kv_blocks=24, kv_host_bytes=HOST_BYTES)
    [before] = engine.generate([first], GREEDY)  # 12 of the 24 blocks
    engine.generate([second], GREEDY)  # the 12 never used
    engine.generate([third], GREEDY)  # some of the first's blocks, tail first
    engine.kv.host.put([bytes(32)], torch.zeros_like(engine.kv.host.data[:, :, :1]))  # another block
    engine.generate([fourth], GREEDY)  # the rest
    hashes = _sequence(engine, first).block_hashes[:10]
    assert engine.kv.get_computed_blocks(_sequence(engine, first)).num_tokens == 0
    assert len(consecutive_runs([engine.kv.host.slots[h] for h in hashes])) == 2
    [again] = engine.generate([first], GREEDY)
    assert again.num_cached_tokens == 40
    assert again.outputs[0].token_ids == before.outputs[0].token_ids == hf_greedy(hf, first, 6)
    assert_idle(engine)
