"""The cluster KV tier inside the engine: what a holder reads of a prefix by its hashes (pool,
host tier), and a prompt started from blocks another engine sent (``FetchedKV``)."""

from __future__ import annotations

import torch

from kervan.block_hash import hash_blocks
from tests.conftest import make_engine, make_prompts
from worker import FetchedKV, SamplingParams

BLOCK = 16
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def computed(engine, prompt, **options):
    before = engine.stats().num_prompt_tokens_computed
    engine.add_request(prompt, GREEDY, **options)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    return outs[-1], engine.stats().num_prompt_tokens_computed - before


def test_a_holder_reads_a_prefix_from_its_pool_and_host_tier_as_a_fresh_engine_computes_it(llama):
    doc = make_prompts([160], seed=61)[0]
    holder = make_engine(llama[1], block_size=BLOCK, num_kv_blocks=14, kv_host_bytes=1 << 20)
    holder.generate([doc + [3, 4]], GREEDY)
    holder.generate([make_prompts([200], seed=62)[0]], GREEDY)  # 13 of 14 blocks: most of doc goes to the host tier
    hashes = hash_blocks(doc, BLOCK)
    read = holder.read_prefix(hashes + [b"\0" * 32])  # a block no one holds ends the run
    assert read.disk is None and read.data.shape[2] == len(hashes) == 10
    assert holder.stats().num_host_blocks >= 9  # read from both places, not only the pool
    fresh = make_engine(llama[1], block_size=BLOCK, num_kv_blocks=64)
    fresh.add_request(doc + [3], SamplingParams(max_tokens=1), request_id="r", hold_kv=True)
    while fresh.has_unfinished_requests():
        fresh.step()
    torch.testing.assert_close(read.data, fresh.export_kv("r")[:, :, :10], rtol=1e-5, atol=1e-5)
    assert holder.read_prefix([b"\0" * 32]).data.shape[2] == 0


def test_a_prompt_started_from_fetched_blocks_computes_only_the_rest_and_answers_the_same(llama):
    doc = make_prompts([128], seed=63)[0]
    prompt = doc + [5, 6, 7]
    holder = make_engine(llama[1], block_size=BLOCK, num_kv_blocks=64)
    holder.generate([doc + [9]], GREEDY)
    fetched = FetchedKV(0, holder.read_prefix(hash_blocks(prompt, BLOCK)).data)
    reference, everything = computed(make_engine(llama[1], block_size=BLOCK, num_kv_blocks=64), prompt)
    out, work = computed(make_engine(llama[1], block_size=BLOCK, num_kv_blocks=64), prompt, fetched=fetched)
    assert (everything, work, out.num_cached_tokens) == (len(prompt), 3, 128)
    assert out.outputs[0].token_ids == reference.outputs[0].token_ids


def test_fetched_blocks_that_do_not_meet_the_pools_hit_or_do_not_fit_are_computed_instead(llama):
    doc = make_prompts([128], seed=64)[0]
    prompt = doc + [5, 6]
    holder = make_engine(llama[1], block_size=BLOCK, num_kv_blocks=64)
    holder.generate([doc + [9]], GREEDY)
    data = holder.read_prefix(hash_blocks(prompt, BLOCK)).data
    # from block 2 on, but this engine caches nothing: a gap before them
    _, work = computed(make_engine(llama[1], block_size=BLOCK, num_kv_blocks=64), prompt,
                       fetched=FetchedKV(2, data[:, :, 2:]))
    assert work == len(prompt)
    # another block size's layout: left unused
    other = make_engine(llama[1], block_size=8, num_kv_blocks=64)
    _, work = computed(other, prompt, fetched=FetchedKV(0, data))
    assert work == len(prompt)
    # the engine's own hit covers blocks 0-3; the fetch from block 2 on fills 4-7
    mine = make_engine(llama[1], block_size=BLOCK, num_kv_blocks=64)
    computed(mine, doc[:64] + [1])
    out, work = computed(mine, prompt, fetched=FetchedKV(2, data[:, :, 2:]))
    assert (work, out.num_cached_tokens) == (2, 128)


def test_a_holder_sends_what_its_disk_tier_holds_read_on_the_disk_thread(llama, tmp_path):
    """Blocks pushed down past the host tier to disk: ``read_prefix`` gives the leading ones still
    in memory at once and reads the rest on the disk tier's thread (the future); together they
    are what a fresh engine computes."""
    doc = make_prompts([96], seed=65)[0]
    block = 2 * 2 * 2 * BLOCK * 16 * 4  # layers, K/V, KV heads, block size, head dim, float32
    holder = make_engine(llama[1], block_size=BLOCK, num_kv_blocks=8, kv_host_bytes=2 * block,
                         kv_disk_bytes=64 * block, kv_disk_dir=str(tmp_path / "disk"))
    try:
        holder.generate([doc + [3]], GREEDY)
        holder.generate([make_prompts([100], seed=66)[0]], GREEDY)  # doc leaves the pool, then the host tier
        hashes = hash_blocks(doc, BLOCK)
        read = holder.read_prefix(hashes)
        assert read.disk is not None
        got, raw = read.disk.result(timeout=30)
        assert got and read.data.shape[2] + len(got) == len(hashes)  # memory's lead, then disk's
        data = torch.cat([read.data, holder.disk_blocks(raw)], dim=2)
    finally:
        holder.close()
    fresh = make_engine(llama[1], block_size=BLOCK, num_kv_blocks=64)
    fresh.add_request(doc + [3], SamplingParams(max_tokens=1), request_id="r", hold_kv=True)
    while fresh.has_unfinished_requests():
        fresh.step()
    torch.testing.assert_close(data, fresh.export_kv("r")[:, :, :len(hashes)], rtol=1e-5, atol=1e-5)


def test_the_link_meter_counts_transfers_long_enough_to_time_the_link():
    """What a worker reports of its link (``Load.kv_link_bytes_per_s``): transfers under 1 MiB time
    the round trip, not the link, and are left out; the rest, weighted toward the recent."""
    from services.worker.link_meter import MIN_MEASURED_BYTES, LinkMeter
    meter = LinkMeter()
    meter.observe(MIN_MEASURED_BYTES - 1, 1e-6)
    assert meter.bytes_per_s == 0
    meter.observe(100 << 20, 1.0)
    assert meter.bytes_per_s == 100 << 20
    meter.observe(200 << 20, 1.0)
    assert meter.bytes_per_s == 0.7 * (100 << 20) + 0.3 * (200 << 20)
