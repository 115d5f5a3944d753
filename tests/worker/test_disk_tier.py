"""Tier 2 behind the KV pool (``worker/kv/disk_tier.py``): blocks the host tier pushes out
go to one file on disk, come back when a prompt needs them, survive a restart of the engine,
and are refused when their bytes are not what was written. float32 with the default kernels
(``make_engine``): the blocks read back are the very bytes computed before, so a prefix
from disk is exact by construction, and the comparisons with `transformers` say so."""

from __future__ import annotations

import os
import struct
import threading

import pytest
import torch

from kervan.kv_events import MEDIUM_DISK, MEDIUM_HOST, BlockRemoved, BlockStored
from tests.conftest import hf_greedy, make_engine, make_prompts
from tests.worker.test_engine import assert_idle
from worker import SamplingParams
from worker.config import ConfigError
from worker.kv.disk_tier import FILE_NAME, KEY_FILE, RECORD, RECORD_MAGIC, DiskTier, tier_key
from worker.kv.private_files import UnsafePath

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
BLOCK = 1 << 10  # the tiny llama's block: 1 KiB (float32, block size 4)
SHAPE = (1, 2, 1, 4)


@pytest.fixture(autouse=True)
def disk_key(monkeypatch):
    """A MAC key of the test's own, never the user's cache."""
    monkeypatch.setenv("KERVAN_KV_DISK_KEY", "ab" * 32)


def _block(v: float) -> torch.Tensor:
    return torch.full((1, 2, 1, 1, 4), float(v))


def _read(tier: DiskTier, hashes: list[bytes]):
    got, raw = tier.fetch(hashes).result(timeout=10)
    return got, tier.blocks(raw)


def test_blocks_written_read_back_and_the_least_recently_used_pushed_out(tmp_path):
    tier = DiskTier(tmp_path, 2, SHAPE, torch.float32, "m")
    try:
        assert tier.put([b"a"], _block(1)) == [] and tier.put([b"b"], _block(2)) == []
        hashes, data = _read(tier, [b"a"])  # a is now the most recently used
        assert hashes == [b"a"] and data.shape == (1, 2, 1, 1, 4) and data[0, 0, 0, 0, 0] == 1
        assert tier.put([b"c"], _block(3)) == [b"b"]
        hashes, data = _read(tier, [b"a", b"c"])
        assert hashes == [b"a", b"c"] and data[0, 1, 1, 0, 3] == 3
        assert tier.num_stored == 3 and tier.num_loaded == 3 and tier.num_dropped == 1
    finally:
        tier.close()


def test_a_restart_finds_the_blocks_in_their_order_and_another_identity_starts_afresh(tmp_path):
    tier = DiskTier(tmp_path, 3, SHAPE, torch.float32, "model-1")
    tier.put([b"a", b"b", b"c"], torch.cat([_block(1), _block(2), _block(3)], dim=2))
    _read(tier, [b"a"])
    tier.close()
    again = DiskTier(tmp_path, 3, SHAPE, torch.float32, "model-1")
    try:
        assert again.num_restored == 3 and list(again.slots) == [b"a", b"b", b"c"]  # written order
        assert again.put([b"d"], _block(4)) == [b"a"]  # the oldest write goes first
        assert _read(again, [b"c"])[1][0, 0, 0, 0, 0] == 3
    finally:
        again.close()
    for other in (dict(identity="model-2"), dict(num_blocks=4), dict(dtype=torch.bfloat16)):
        args = dict(num_blocks=3, block_shape=SHAPE, dtype=torch.float32, identity="model-1") | other
        fresh = DiskTier(tmp_path, **args)
        assert fresh.num_restored == 0 and len(fresh) == 0, other
        fresh.close()


def test_a_block_whose_bytes_changed_is_refused_and_forgotten(tmp_path):
    tier = DiskTier(tmp_path, 4, SHAPE, torch.float32, "m")
    try:
        tier.put([b"a", b"b", b"c"], torch.cat([_block(1), _block(2), _block(3)], dim=2))
        _read(tier, [b"a"])  # the writes are made before this read (one I/O thread, in order)
        slot = tier.slots[b"b"]
        with open(tmp_path / FILE_NAME, "r+b") as f:  # one flipped byte in b's KV
            f.seek(tier.blocks_at + slot * tier.block_bytes + 5)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x40]))
        hashes, data = _read(tier, [b"a", b"b", b"c"])
        assert hashes == [b"a"] and data.shape[2] == 1  # stops at the first block refused
        assert tier.num_corrupt == 1 and tier.take_refused() == [b"b"] and b"b" not in tier
    finally:
        tier.close()


def _patch(path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def _record_at(tier: DiskTier, slot: int) -> int:
    return tier.records_at + slot * RECORD.size


@pytest.mark.parametrize("tamper", ["record magic", "stored hash", "length", "mac", "forged with another key"])
def test_every_check_a_read_makes_refuses_a_block(tmp_path, tamper):
    """Each check on its own (each tamper passes the other three): a record that is not one,
    a genuine record and block of another hash moved into the slot, a block cut short (of
    zeros, which the read's zero fill would otherwise match), and a block rewritten under a
    MAC the attacker computed (a CRC anyone who can write the file could recompute; the MAC's
    key is not in its directory)."""
    tier = DiskTier(tmp_path, 3, SHAPE, torch.float32, "m")
    try:
        tier.put([b"a", b"b"], torch.cat([_block(1), _block(0)], dim=2))
        _read(tier, [b"a"])  # the writes are made
        a, b = tier.slots[b"a"], tier.slots[b"b"]
        path = tmp_path / FILE_NAME
        record = bytearray(os.pread(tier.fd, RECORD.size, _record_at(tier, b)))
        if tamper == "record magic":
            _patch(path, _record_at(tier, b), b"XXXX")
        elif tamper == "stored hash":  # a's genuine record and block, in b's slot
            _patch(path, _record_at(tier, b), os.pread(tier.fd, RECORD.size, _record_at(tier, a)))
            _patch(path, tier.blocks_at + b * tier.block_bytes,
                   os.pread(tier.fd, tier.block_bytes, tier.blocks_at + a * tier.block_bytes))
        elif tamper == "length":
            os.truncate(path, tier.blocks_at + b * tier.block_bytes + tier.block_bytes // 2)
        else:
            forged = torch.full((1, 2, 1, 4), 9.0).numpy().tobytes()
            key = b"\x00" * 32 if tamper == "forged with another key" else tier.key
            mac = DiskTier._mac(type("T", (), {"key": key, "_mac_prefix": tier._mac_prefix})(), b"b", forged)
            _patch(path, tier.blocks_at + b * tier.block_bytes, forged)
            if tamper == "forged with another key":
                _patch(path, _record_at(tier, b), RECORD.pack(RECORD_MAGIC, 2, 1, b"b", mac))
        assert record[:4] == RECORD_MAGIC
        hashes, _ = _read(tier, [b"b"])
        assert hashes == [] and tier.num_corrupt == 1 and tier.take_refused() == [b"b"]
        assert _read(tier, [b"a"])[0] == [b"a"]
    finally:
        tier.close()


def test_the_directory_and_file_are_the_users_own(tmp_path):
    """A planted link once got a victim file truncated; a world-writable file was kept."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    linked = tmp_path / "linked"
    linked.mkdir(mode=0o700)
    (linked / FILE_NAME).symlink_to(victim)
    with pytest.raises(UnsafePath, match="symbolic link"):
        DiskTier(linked, 2, SHAPE, torch.float32, "m")
    assert victim.read_bytes() == b"precious"
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o700)
    (loose / FILE_NAME).write_bytes(b"")
    os.chmod(loose / FILE_NAME, 0o666)
    with pytest.raises(UnsafePath, match="mode 666"):
        DiskTier(loose, 2, SHAPE, torch.float32, "m")
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, 4242, -1)
    with pytest.raises(UnsafePath, match="belongs to uid 4242"):
        DiskTier(theirs, 2, SHAPE, torch.float32, "m")
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    os.chmod(open_dir, 0o777)
    DiskTier(open_dir, 2, SHAPE, torch.float32, "m").close()
    assert os.stat(open_dir).st_mode & 0o777 == 0o700 and os.stat(open_dir / FILE_NAME).st_mode & 0o777 == 0o600


def test_the_key_is_made_once_outside_the_tiers_directory(tmp_path, monkeypatch):
    monkeypatch.delenv("KERVAN_KV_DISK_KEY")
    monkeypatch.setenv("KERVAN_CACHE_DIR", str(tmp_path / "cache"))
    key = tier_key(tmp_path / "tier")
    assert len(key) == 32 and tier_key(tmp_path / "tier") == key
    assert (tmp_path / "cache" / "keys" / KEY_FILE).stat().st_mode & 0o777 == 0o600
    with pytest.raises(ValueError, match="in its own directory"):
        tier_key(tmp_path / "cache")
    monkeypatch.setenv("KERVAN_KV_DISK_KEY", "zz")
    with pytest.raises(ValueError, match="64 hex digits"):
        tier_key(tmp_path / "tier")


def test_a_torn_record_is_not_indexed_at_restart(tmp_path):
    tier = DiskTier(tmp_path, 2, SHAPE, torch.float32, "m")
    tier.put([b"a", b"b"], torch.cat([_block(1), _block(2)], dim=2))
    slot = tier.slots[b"a"]
    tier.close()
    with open(tmp_path / FILE_NAME, "r+b") as f:  # a crash between clearing a record and writing it
        f.seek(tier.records_at + slot * RECORD.size)
        f.write(bytes(RECORD.size))
    again = DiskTier(tmp_path, 2, SHAPE, torch.float32, "m")
    try:
        assert list(again.slots) == [b"b"] and len(again.free) == 1
    finally:
        again.close()


def test_one_file_serves_one_worker(tmp_path):
    tier = DiskTier(tmp_path, 2, SHAPE, torch.float32, "m")
    try:
        with pytest.raises(ValueError, match="in use by another worker"):
            DiskTier(tmp_path, 2, SHAPE, torch.float32, "m")
    finally:
        tier.close()


def test_writes_past_the_bound_are_dropped_not_waited_for(tmp_path):
    tier = DiskTier(tmp_path, 8, SHAPE, torch.float32, "m", max_pending=2)
    gate = threading.Event()
    tier._jobs.put(("read", [], _Blocked(gate)))  # a disk that does not answer yet
    try:
        tier.put([b"a", b"b", b"c", b"d"], torch.cat([_block(v) for v in range(4)], dim=2))
        assert list(tier.slots) == [b"a", b"b"] and tier.num_write_dropped == 2
    finally:
        gate.set()
        tier.close()
    assert tier.num_stored == 2


class _Blocked:
    """A read job's future that holds the I/O thread until ``gate`` is set."""

    def __init__(self, gate):
        self.gate = gate

    def set_result(self, _):
        self.gate.wait(10)

    def done(self):
        return True


def _tiers(path, tmp_path, **options):
    """An engine whose pool holds one prompt, host tier two blocks, disk tier the rest."""
    return make_engine(path, num_kv_blocks=24, kv_host_bytes=2 * BLOCK, kv_disk_bytes=256 * BLOCK,
                       kv_disk_dir=str(tmp_path / "disk"), **options)


@pytest.mark.parametrize("write", ["back", "through"])
def test_an_evicted_prefix_comes_back_from_disk_with_the_same_tokens(hf_models, tmp_path, write):
    hf, path = hf_models("llama")
    first, *others = make_prompts([41, 40, 40, 40, 40], seed=60)
    engine = _tiers(path, tmp_path, kv_disk_write=write)
    try:
        [before] = engine.generate([first], GREEDY)
        engine.generate(others, GREEDY)  # the pool reuses the first prompt's blocks; the host tier holds 2
        [again] = engine.generate([first], GREEDY)
        assert again.num_cached_tokens == 40  # ten blocks back from disk (through the host tier)
        assert again.outputs[0].token_ids == before.outputs[0].token_ids == hf_greedy(hf, first, 6)
        stats = engine.stats()
        assert stats.num_disk_loaded >= 8 and stats.num_disk_blocks > 0 and stats.num_disk_corrupt == 0
        if write == "through":  # every block the host tier holds went to disk as it was demoted
            assert set(engine.kv.host.slots) <= set(engine.kv.disk.slots)
        assert_idle(engine)
    finally:
        engine.close()


def test_a_restarted_engine_serves_a_prefix_from_the_disk_it_left_and_tells_the_registry(hf_models, tmp_path):
    hf, path = hf_models("llama")
    first, *others = make_prompts([41, 40, 40, 40, 40], seed=61)
    engine = _tiers(path, tmp_path)
    engine.generate([first, *others], GREEDY)
    engine.close()  # the queued writes are made
    engine = _tiers(path, tmp_path)
    try:
        assert engine.stats().num_disk_blocks > 0
        [found] = engine.take_events()  # before any request: the registry hears what the disk holds
        assert isinstance(found, BlockStored) and found.medium == MEDIUM_DISK
        assert set(found.block_hashes) == set(engine.kv.disk.slots)
        _, cached = engine.cached_blocks()
        assert cached == [] and len(engine.tier_blocks()[MEDIUM_DISK]) == engine.stats().num_disk_blocks
        [again] = engine.generate([first], GREEDY)
        assert again.num_cached_tokens == 40 and again.outputs[0].token_ids == hf_greedy(hf, first, 6)
    finally:
        engine.close()


def test_a_corrupted_block_on_disk_is_computed_again_and_announced_gone(hf_models, tmp_path):
    hf, path = hf_models("llama")
    first, *others = make_prompts([41, 40, 40, 40, 40], seed=62)
    engine = _tiers(path, tmp_path)
    engine.generate([first, *others], GREEDY)
    engine.close()
    engine = _tiers(path, tmp_path)
    try:
        disk = engine.kv.disk
        third = engine.kv.disk.slots  # the first prompt's third block: damaged on disk
        victim = _sequence(engine, first).block_hashes[2]
        assert victim in third
        with open(disk.path, "r+b") as f:
            f.seek(disk.blocks_at + disk.slots[victim] * disk.block_bytes)
            f.write(struct.pack("<f", 1e30))
        engine.take_events()
        [again] = engine.generate([first], GREEDY)
        assert again.num_cached_tokens == 8  # the two blocks before it; the rest computed
        assert again.outputs[0].token_ids == hf_greedy(hf, first, 6)
        assert engine.stats().num_disk_corrupt == 1 and victim not in disk
        removed = [e for e in engine.take_events() if isinstance(e, BlockRemoved) and e.medium == MEDIUM_DISK]
        assert any(victim in e.block_hashes for e in removed)
        assert_idle(engine)
    finally:
        engine.close()


def test_the_registry_hears_blocks_move_from_host_memory_to_disk(hf_models, tmp_path):
    _, path = hf_models("llama")
    first, *others = make_prompts([41, 40, 40, 40, 40], seed=63)
    engine = _tiers(path, tmp_path)
    try:
        engine.generate([first, *others], GREEDY)
        events = engine.take_events()
        def of(kind, medium):
            return {h for e in events if isinstance(e, kind) and e.medium == medium for h in e.block_hashes}
        host, disk = of(BlockStored, MEDIUM_HOST), of(BlockStored, MEDIUM_DISK)
        # what left the pool went to host memory, and on to disk when the two host blocks ran out
        assert host and disk and host | disk <= of(BlockRemoved, "device") and len(disk - host) > 0
        assert not of(BlockRemoved, MEDIUM_DISK)  # the disk tier's 256 blocks lost none
        tiers = engine.tier_blocks()
        assert set(tiers[MEDIUM_DISK]).isdisjoint(tiers[MEDIUM_HOST]) and len(tiers[MEDIUM_HOST]) <= 2
    finally:
        engine.close()


def _sequence(engine, prompt):
    from worker.sequence import Sequence
    return Sequence("probe", prompt, GREEDY, engine.config.block_size, engine.model_config.eos_token_ids)


def test_disk_settings_that_cannot_work_are_refused(tmp_path):
    from worker.config import EngineConfig
    with pytest.raises(ConfigError, match="kv_disk_dir"):
        EngineConfig(kv_host_bytes=1 << 20, kv_disk_bytes=1 << 20)
    with pytest.raises(ConfigError, match="host tier"):
        EngineConfig(kv_disk_bytes=1 << 20, kv_disk_dir=str(tmp_path))
    with pytest.raises(ConfigError, match="back or through"):
        EngineConfig(kv_host_bytes=1, kv_disk_bytes=1, kv_disk_dir=str(tmp_path), kv_disk_write="around")


WRITER = """
import sys, torch
from worker.kv.disk_tier import DiskTier
tier = DiskTier(sys.argv[1], 64, (2, 2, 4, 1024), torch.float32, "m", max_pending=1 << 20)
n, said = 0, False
while True:  # blocks whose every value is the number in their hash, until killed
    hashes = [(n + k).to_bytes(32, "big") for k in range(16)]
    data = torch.arange(n, n + 16, dtype=torch.float32).view(1, 1, 16, 1, 1).expand(2, 2, 16, 4, 1024).contiguous()
    tier.put(hashes, data)
    n += 16
    if not said and tier.num_stored >= 64:  # every slot written once, and reused since
        print("writing", flush=True)
        said = True
"""


def test_a_worker_killed_mid_write_leaves_nothing_a_restart_trusts_wrongly(tmp_path):
    """SIGKILL a process writing blocks as fast as it can (32 KiB each, slots reused over
    and over); the file it leaves is indexed again, and every block indexed reads back whole
    with its own content — a torn write is an empty slot or a refused block, never another
    block's KV under a hash. (A process's death cannot tear one pwrite; the checksums are for
    what the page cache loses in a machine's crash.)"""
    import signal
    import subprocess
    import sys
    import time
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "writing"
        time.sleep(0.3)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    tier = DiskTier(tmp_path, 64, (2, 2, 4, 1024), torch.float32, "m")
    try:
        held = list(tier.slots)
        assert len(tier.free) <= 1  # at most the slot whose write was cut: its record cleared
        for h in held:
            [got], data = _read(tier, [h])  # each block whole: a record is written only after its block
            assert got == h and torch.all(data == int.from_bytes(h, "big")), h.hex()
        assert tier.num_corrupt == 0
    finally:
        tier.close()
