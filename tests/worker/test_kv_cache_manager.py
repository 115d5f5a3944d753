"""KVCacheManager: block tables, prefix hits, copy-on-write, exact ids and counts."""

from kervan.kv_events import BlockStored
from worker import SamplingParams
from worker.batch import BlockCopy
from worker.kv.kv_cache_manager import KVCacheManager
from worker.sequence import Sequence

BS = 4


def make_request(rid, tokens, n=1):
    return Sequence(rid, list(tokens), SamplingParams(n=n), BS)


def table(kv, req):
    return kv.get_block_ids(req.seq_id)


def refs(kv, req):
    return [b.ref_cnt for b in kv.tables[req.seq_id]]


def admit(kv, req):
    hit = kv.get_computed_blocks(req)
    new = kv.allocate_slots(req, req.num_tokens - hit.num_tokens, hit.blocks)
    kv.pool.check_integrity()
    if new is not None:
        req.num_computed_tokens = req.num_tokens
    return hit, new


def test_prompt_allocation_hashes_full_blocks_only():
    kv = KVCacheManager(8, BS)
    req = make_request("a", range(10))
    hit, new = admit(kv, req)
    assert hit.num_tokens == 0 and [b.block_id for b in new] == [0, 1, 2]
    assert refs(kv, req) == [1, 1, 1]
    [ev] = kv.take_events()
    assert isinstance(ev, BlockStored) and ev.block_hashes == req.block_hashes[:2]
    assert ev.token_ids == list(range(8)) and ev.parent_block_hash is None
    assert kv.tables["a"][2].block_hash is None
    assert kv.num_free_blocks == 5


def test_prefix_hit_shares_blocks_and_last_token_is_always_computed():
    kv = KVCacheManager(8, BS)
    a = make_request("a", range(10))
    admit(kv, a)
    b = make_request("b", list(range(8)) + [50, 51, 52])
    hit, new = admit(kv, b)
    assert hit.num_tokens == 8 and [blk.block_id for blk in hit.blocks] == [0, 1]
    assert table(kv, b) == [0, 1, 3] and refs(kv, b) == [2, 2, 1]
    # an identical 8-token prompt may reuse only one block: its last token needs logits
    c = make_request("c", range(8))
    hit, _ = admit(kv, c)
    assert hit.num_tokens == 4 and table(kv, c) == [0, 4]
    assert kv.num_free_blocks == 3


def test_allocation_failure_changes_nothing():
    kv = KVCacheManager(3, BS)
    a = make_request("a", range(9))
    assert admit(kv, a)[1] is not None
    b = make_request("b", range(100, 105))
    assert kv.allocate_slots(b, 5) is None
    assert "b" not in kv.tables and kv.num_free_blocks == 0
    kv.pool.check_integrity()


def test_free_returns_blocks_tail_first_and_cached_blocks_stay_hittable():
    kv = KVCacheManager(6, BS)
    a = make_request("a", range(10))
    admit(kv, a)
    kv.free(a)
    kv.pool.check_integrity()
    assert list(kv.pool.free_queue) == [3, 4, 5, 2, 1, 0] and kv.num_free_blocks == 6
    b = make_request("b", range(9))
    hit, _ = admit(kv, b)
    assert [blk.block_id for blk in hit.blocks] == [0, 1]


def test_decode_appends_a_block_when_the_last_is_full():
    kv = KVCacheManager(6, BS)
    req = make_request("a", range(4))
    admit(kv, req)
    req.append_output(9, None)
    assert [b.block_id for b in kv.allocate_slots(req, 1)] == [1]
    req.num_computed_tokens += 1
    req.append_output(9, None)
    assert kv.allocate_slots(req, 1) == [] and table(kv, req) == [0, 1]
    kv.pool.check_integrity()


def test_fork_shares_blocks_and_copies_the_partial_one_on_write():
    kv = KVCacheManager(8, BS)
    parent = make_request("p", range(6), n=2)
    admit(kv, parent)
    child = parent.fork(1)
    kv.fork(parent, child)
    assert table(kv, child) == [0, 1] and refs(kv, parent) == [2, 2]
    # the child writes position 6, inside the shared partial block 1: copy-on-write
    child.append_output(40, None)
    assert [b.block_id for b in kv.allocate_slots(child, 1)] == []
    assert table(kv, child) == [0, 2] and kv.take_copies() == [BlockCopy(src=1, dst=2)]
    assert refs(kv, parent) == [2, 1]
    # the parent now owns block 1 alone and writes it in place
    parent.append_output(41, None)
    kv.allocate_slots(parent, 1)
    assert table(kv, parent) == [0, 1] and kv.take_copies() == []
    kv.pool.check_integrity()
    kv.free(child)
    kv.free(parent)
    kv.pool.check_integrity()
    assert kv.num_free_blocks == 8


def test_fork_of_block_aligned_prompt_needs_no_copy():
    kv = KVCacheManager(8, BS)
    parent = make_request("p", range(8), n=2)
    admit(kv, parent)
    child = parent.fork(1)
    kv.fork(parent, child)
    child.append_output(40, None)
    assert [b.block_id for b in kv.allocate_slots(child, 1)] == [2]
    assert kv.take_copies() == [] and table(kv, child) == [0, 1, 2]
    kv.pool.check_integrity()
