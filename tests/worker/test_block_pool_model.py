"""The block pool against a model of it, over operation sequences hypothesis draws:
which block ids come out, in which order the free queue holds them, which hashes stay
cached, and which evictions are announced, after every operation."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kervan.kv_events import BlockRemoved, BlockStored
from worker.kv.block_pool import BlockPool

NUM_BLOCKS = 6

ops = st.lists(st.one_of(
    st.tuples(st.just("take"), st.integers(0, NUM_BLOCKS + 1)),
    st.tuples(st.just("free"), st.integers(0, 63)),
    st.tuples(st.just("touch"), st.integers(0, 63)),
    st.tuples(st.just("cache"), st.integers(0, 63), st.integers(0, 7)),
), max_size=40)


@settings(max_examples=300, deadline=None)
@given(ops)
def test_the_pool_behaves_like_its_model(sequence):
    pool = BlockPool(NUM_BLOCKS, block_size=4)
    refs = {i: 0 for i in range(NUM_BLOCKS)}  # the model: references per block,
    free = list(range(NUM_BLOCKS))  # the free queue, head first (LRU eviction order),
    hashes: dict[int, bytes] = {}  # and the hash each block is cached under
    held: list[int] = []  # one entry per reference the test holds
    for op in sequence:
        pool.take_events()
        if op[0] == "take":
            n = op[1]
            if n > len(free):
                try:
                    pool.get_new_blocks(n)
                except ValueError:
                    continue
                raise AssertionError("took more blocks than are free")
            got = [b.block_id for b in pool.get_new_blocks(n)]
            assert got == free[:n]  # the least recently freed first
            evicted = [hashes.pop(i) for i in got if i in hashes]
            assert [e.block_hashes for e in pool.take_events() if isinstance(e, BlockRemoved)] == (
                [evicted] if evicted else [])
            free = free[n:]
            for i in got:
                refs[i] = 1
            held += got
        elif op[0] == "free" and held:
            i = held.pop(op[1] % len(held))
            pool.free_blocks([pool.blocks[i]])
            refs[i] -= 1
            if refs[i] == 0:
                free.append(i)
        elif op[0] == "touch" and hashes:
            h = sorted(hashes.values())[op[1] % len(hashes)]
            block = pool.get_cached_block(h)
            assert block is not None and hashes[block.block_id] == h
            pool.touch([block])
            if refs[block.block_id] == 0:
                free.remove(block.block_id)
            refs[block.block_id] += 1
            held.append(block.block_id)
        elif op[0] == "cache" and held:
            i, h = held[op[1] % len(held)], bytes([op[2]]) * 32
            pool.cache_blocks([pool.blocks[i]], [h], None, [1, 2, 3, 4])
            stored = [e.block_hashes for e in pool.take_events() if isinstance(e, BlockStored)]
            if h in hashes.values() or i in hashes:  # a hash stays with its first holder; a block keeps its name
                assert stored == []
            else:
                hashes[i] = h
                assert stored == [[h]]
        pool.check_integrity()
        assert list(pool.free_queue) == free
        assert {h: b.block_id for h, b in pool.cached.items()} == {h: i for i, h in hashes.items()}
        assert pool.num_evictable == sum(i in hashes for i in free)
