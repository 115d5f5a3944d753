"""The KV cache manager over operation sequences hypothesis draws (admit with prefix
hits, grow by a token, fork a sample, free), checked after every operation against
what it must hold: each table covers its request's computed tokens, a block's
references are the tables holding it, a prefix hit is the request's own leading
blocks, a refusal changes nothing, and a shared partial block is never written."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from worker import SamplingParams
from worker.kv.kv_cache_manager import KVCacheManager
from worker.sequence import Sequence

BS = 4
NUM_BLOCKS = 10

ops = st.lists(st.one_of(
    st.tuples(st.just("admit"), st.lists(st.integers(0, 2), min_size=1, max_size=14)),  # few symbols: shared prefixes
    st.tuples(st.just("grow"), st.integers(0, 31), st.integers(0, 2)),
    st.tuples(st.just("fork"), st.integers(0, 31)),
    st.tuples(st.just("free"), st.integers(0, 31)),
), max_size=30)


def check(kv: KVCacheManager, live: dict[str, Sequence]) -> None:
    kv.pool.check_integrity()
    assert set(kv.tables) == set(live)
    held = Counter(b.block_id for table in kv.tables.values() for b in table)
    assert all(b.ref_cnt == held[b.block_id] for b in kv.pool.blocks)  # references are the tables, no more
    for rid, req in live.items():
        assert len(kv.tables[rid]) == -(-req.num_computed_tokens // BS)  # covers its tokens, exactly


@settings(max_examples=300, deadline=None)
@given(ops)
def test_the_manager_keeps_its_invariants(sequence):
    kv = KVCacheManager(NUM_BLOCKS, BS)
    live: dict[str, Sequence] = {}
    for k, op in enumerate(sequence):
        kv.take_copies()
        free_before = kv.num_free_blocks
        if op[0] == "admit":
            req = Sequence(f"r{k}", op[1], SamplingParams(), BS)
            hit = kv.get_computed_blocks(req)
            assert hit.num_tokens < req.num_tokens and hit.num_tokens % BS == 0
            assert [b.block_hash for b in hit.blocks] == req.block_hashes[:len(hit.blocks)]  # its own prefix
            if kv.allocate_slots(req, req.num_tokens - hit.num_tokens, hit.blocks) is None:
                assert kv.num_free_blocks == free_before and req.seq_id not in kv.tables  # nothing taken
            else:
                req.num_computed_tokens = req.num_tokens
                live[req.seq_id] = req
        elif op[0] in ("grow", "fork", "free") and live:
            req = live[sorted(live)[op[1] % len(live)]]
            if op[0] == "grow":
                table_before = kv.get_block_ids(req.seq_id)
                req.append_output(op[2], None)
                if kv.allocate_slots(req, 1) is None:
                    assert kv.get_block_ids(req.seq_id) == table_before and kv.num_free_blocks == free_before
                    req.token_ids.pop()
                    req.block_hashes = req.block_hashes[:req.num_tokens // BS]
                else:
                    req.num_computed_tokens += 1
                    last = kv.tables[req.seq_id][(req.num_computed_tokens - 1) // BS]
                    assert last.ref_cnt == 1  # the block written now is this request's alone
            elif op[0] == "fork":
                child = req.fork(len(live))
                child.seq_id = f"{req.seq_id}.{k}"
                kv.fork(req, child)
                live[child.seq_id] = child
            else:
                kv.free(live.pop(req.seq_id))
        check(kv, live)
    for req in list(live.values()):
        kv.free(req)
    assert kv.num_free_blocks == NUM_BLOCKS
