"""BlockPool: exact ids, reference counts, free-queue order, events."""

from kervan.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from worker.kv.block_pool import BlockPool


def ids(blocks):
    return [b.block_id for b in blocks]


def free_order(pool):
    return list(pool.free_queue)


def test_allocate_free_and_lru_order():
    pool = BlockPool(6, 4)
    a = pool.get_new_blocks(2)
    pool.check_integrity()
    assert ids(a) == [0, 1] and [b.ref_cnt for b in a] == [1, 1]
    b = pool.get_new_blocks(3)
    assert ids(b) == [2, 3, 4] and free_order(pool) == [5]
    pool.free_blocks(list(reversed(a)))
    pool.check_integrity()
    assert free_order(pool) == [5, 1, 0]
    assert ids(pool.get_new_blocks(2)) == [5, 1]
    pool.check_integrity()
    assert pool.num_free_blocks == 1


def test_shared_block_freed_only_at_last_reference():
    pool = BlockPool(4, 4)
    [blk] = pool.get_new_blocks(1)
    pool.touch([blk])
    assert blk.ref_cnt == 2
    pool.free_blocks([blk])
    pool.check_integrity()
    assert blk.ref_cnt == 1 and blk.block_id not in pool.free_queue
    pool.free_blocks([blk])
    pool.check_integrity()
    assert free_order(pool) == [1, 2, 3, 0]


def test_cached_block_stays_reusable_until_evicted():
    pool = BlockPool(3, 2)
    blocks = pool.get_new_blocks(2)
    pool.cache_blocks(blocks, [b"h0", b"h1"], None, [7, 8, 9, 10])
    [stored] = pool.take_events()
    assert isinstance(stored, BlockStored) and stored.seq == 1
    assert stored.block_hashes == [b"h0", b"h1"] and stored.token_ids == [7, 8, 9, 10]
    pool.free_blocks(list(reversed(blocks)))
    pool.check_integrity()
    assert free_order(pool) == [2, 1, 0]
    # a prefix hit lifts the cached block out of the middle of the queue
    hit = pool.get_cached_block(b"h0")
    assert hit is blocks[0]
    pool.touch([hit])
    pool.check_integrity()
    assert free_order(pool) == [2, 1] and hit.ref_cnt == 1
    # allocating past the free block evicts the cached h1
    assert ids(pool.get_new_blocks(2)) == [2, 1]
    [removed] = pool.take_events()
    assert isinstance(removed, BlockRemoved) and removed.block_hashes == [b"h1"] and removed.seq == 2
    assert pool.get_cached_block(b"h1") is None
    pool.check_integrity()


def test_duplicate_hash_is_not_cached_twice_and_events_split_runs():
    pool = BlockPool(4, 1)
    first = pool.get_new_blocks(1)
    pool.cache_blocks(first, [b"b"], b"a", [2])
    pool.take_events()
    blocks = pool.get_new_blocks(3)
    pool.cache_blocks(blocks, [b"a", b"b", b"c"], None, [1, 2, 3])
    events = pool.take_events()
    assert [(e.block_hashes, e.parent_block_hash, e.token_ids) for e in events] == [
        ([b"a"], None, [1]), ([b"c"], b"b", [3])]
    assert blocks[1].block_hash is None and pool.get_cached_block(b"b") is first[0]
    pool.check_integrity()


def test_reset_prefix_cache_forgets_hashes():
    pool = BlockPool(2, 1)
    blocks = pool.get_new_blocks(2)
    pool.cache_blocks(blocks, [b"x", b"y"], None, [1, 2])
    pool.take_events()
    pool.reset_prefix_cache()
    assert [type(e) for e in pool.take_events()] == [AllBlocksCleared]
    assert pool.get_cached_block(b"x") is None and all(b.block_hash is None for b in blocks)
    pool.check_integrity()


def test_caching_disabled_never_hits():
    pool = BlockPool(2, 1, enable_caching=False)
    blocks = pool.get_new_blocks(1)
    pool.cache_blocks(blocks, [b"x"], None, [1])
    assert pool.get_cached_block(b"x") is None and pool.take_events() == []
