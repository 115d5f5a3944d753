from kervan.block_hash import ROOT_HASH, hash_block, hash_blocks


def test_only_full_blocks_are_hashed_and_chained():
    tokens = list(range(10))
    hashes = hash_blocks(tokens, 4)
    assert len(hashes) == 2
    assert hashes[0] == hash_block(ROOT_HASH, [0, 1, 2, 3])
    assert hashes[1] == hash_block(hashes[0], [4, 5, 6, 7])


def test_same_block_under_a_different_prefix_hashes_differently():
    a = hash_blocks([1, 2, 3, 4, 9, 9, 9, 9], 4)
    b = hash_blocks([5, 6, 7, 8, 9, 9, 9, 9], 4)
    assert a[1] != b[1]


def test_extra_key_separates_equal_prompts_and_resuming_matches():
    tokens = list(range(12))
    assert hash_blocks(tokens, 4, extra=b"tenant-a") != hash_blocks(tokens, 4, extra=b"tenant-b")
    full = hash_blocks(tokens, 4, extra=b"s")
    assert hash_blocks(tokens, 4, extra=b"s", parent=full[0], first_block=1) == full[1:]


def test_hash_is_stable_across_processes():
    import subprocess
    import sys
    code = "from kervan.block_hash import hash_blocks; print(hash_blocks(list(range(8)), 4)[-1].hex())"
    runs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
            for _ in range(2)}
    assert runs == {hash_blocks(list(range(8)), 4)[-1].hex() + "\n"}
