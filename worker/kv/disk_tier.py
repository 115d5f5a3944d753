# mypy: disable-error-code="arg-type"
"""Tier 2 behind the engine's KV pool: blocks the host tier lets go of, kept on local disk in
one preallocated file per worker, so that a prefix seen long ago (or before a restart) is
read back instead of computed again.

The file (``kv-blocks.bin`` under ``--kv-disk-dir``, sized by ``--kv-disk-bytes``):

    header   4 KiB: magic, version, the identity JSON (model, dtype, block shape, slots)
    records  128 bytes per slot: magic, last-use number, hash, MAC of (identity, hash, block)
    blocks   one block per slot, in the host tier's layout ([layers, 2, kv_heads, bs * hd])

Raw tensor bytes only, never pickle. A record is cleared before its slot is overwritten and
written after the block, so a crash mid-write leaves a slot that is empty or refused by its
MAC, never another block's KV under a hash. The MAC (keyed BLAKE2b) is what makes a block
read back trusted: its key is never in the tier's directory (``KERVAN_KV_DISK_KEY``, or a
key made once under ``KERVAN_CACHE_DIR/keys/``), so whoever can write the file cannot forge a
block for a hash. The directory is 0700 and ours, the file opened without following a link
and refused unless ours and 0600 (``private_files.py``). A file whose identity differs (another
model, weights, dtype or size) is started afresh; a matching one is indexed again at start,
and the worker announces those blocks to the registry in its first full dump.

Reads and writes run on one I/O thread, in the order the engine asked for them, so a read
queued after a slot's new write sees the new block; the engine only decides slots and never
waits for a write. Writes beyond ``max_pending`` are dropped (counted): a slow disk costs
hits, never a stalled step. A block that fails a check is refused and forgotten."""

from __future__ import annotations

import fcntl
import hashlib
import hmac
import json
import logging
import os
import queue
import secrets
import struct
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path

import torch

from kervan.block_hash import BlockHash
from kervan.envs import cache_dir, kv_disk_key
from worker.kv.private_files import open_private, private_directory
from worker.kv.slots import HashSlots

log = logging.getLogger(__name__)

MAGIC = b"KERVANKV"
VERSION = 2
HEADER_BYTES = 4096
RECORD = struct.Struct("<4sQH46s32s36x")  # magic, last-use number, hash length, hash, MAC: 128 bytes
RECORD_MAGIC = b"KVB2"
EMPTY_RECORD = bytes(RECORD.size)
FILE_NAME = "kv-blocks.bin"
KEY_FILE = "kv-disk.key"


def tier_key(directory: str | Path) -> bytes:
    """The disk tier's MAC key: ``KERVAN_KV_DISK_KEY``, else one made once (32 random bytes)
    in ``KERVAN_CACHE_DIR/keys/``, which must not be inside the tier's ``directory``."""
    key = kv_disk_key()
    if key is not None:
        return key
    keys = cache_dir() / "keys"
    if keys.resolve().is_relative_to(Path(directory).resolve()):
        raise ValueError(f"the disk tier's key would be in its own directory {directory}: set KERVAN_KV_DISK_KEY "
                         f"or KERVAN_CACHE_DIR elsewhere")
    fd = open_private(private_directory(keys) / KEY_FILE)
    try:
        key = os.pread(fd, 64, 0)
        if len(key) != 32:
            key = secrets.token_bytes(32)
            os.ftruncate(fd, 0)
            os.pwrite(fd, key, 0)
        return key
    finally:
        os.close(fd)


def model_identity(model_dir: str | Path) -> str:
    """A digest of the model a block's KV was computed with: its config and a sample of every
    weight file's bytes (name, size, and 64 KiB at 16 places), so a fine-tune of the same
    architecture never reads another model's KV. Cheap: about 1 MiB read per weight file."""
    root = Path(model_dir)
    digest = hashlib.sha256((root / "config.json").read_bytes())
    for path in sorted(p for p in root.iterdir() if p.suffix in (".safetensors", ".bin", ".gguf", ".pt")):
        size = path.stat().st_size
        digest.update(f"{path.name}:{size}".encode())
        with path.open("rb") as f:
            for k in range(16):
                f.seek(size * k // 16)
                digest.update(f.read(65536))
    return digest.hexdigest()


class DiskTier(HashSlots):
    def __init__(self, directory: str | Path, num_blocks: int, block_shape: tuple[int, ...], dtype: torch.dtype,
                 identity: str, max_pending: int = 256, key: bytes | None = None):
        if num_blocks < 1:
            raise ValueError(f"a disk tier needs at least one block, got {num_blocks}")
        self.block_shape = tuple(block_shape)
        self.dtype = dtype
        self.block_bytes = torch.empty(self.block_shape, dtype=dtype).nbytes
        self.num_blocks = num_blocks
        self.max_pending = max_pending
        self.records_at = HEADER_BYTES
        table = -(-num_blocks * RECORD.size // 4096) * 4096
        self.blocks_at = HEADER_BYTES + table
        self.key = key if key is not None else tier_key(directory)
        self.path = private_directory(Path(directory)) / FILE_NAME
        self.fd = open_private(self.path)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # one worker per file
        except BlockingIOError:
            os.close(self.fd)
            raise ValueError(f"{self.path} is in use by another worker: give each worker its own --kv-disk-dir") \
                from None
        self.identity = json.dumps({"model": identity, "dtype": str(dtype).removeprefix("torch."),
                                    "block_shape": list(self.block_shape), "num_blocks": num_blocks},
                                   sort_keys=True).encode()
        self._mac_prefix = hashlib.sha256(self.identity).digest()  # a block is vouched for in this file only
        super().__init__(num_blocks)
        self._use = 0  # last-use numbers: the order of the LRU across restarts
        self.num_stored = 0  # blocks written
        self.num_loaded = 0  # blocks read back
        self.num_corrupt = 0  # blocks refused by a check (record, hash, length, MAC)
        self.num_write_dropped = 0  # writes not made: the queue was full (a slow disk)
        self.num_restored = self._open()
        self._pending = 0  # writes queued, not yet made
        self._failed: list[BlockHash] = []  # writes that failed on the thread, for the engine to forget
        self._lock = threading.Lock()
        self._jobs: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._io, name="kv-disk-tier", daemon=True)
        self._thread.start()

    # -- the engine's side (one thread) -------------------------------------------

    def put(self, hashes: Sequence[BlockHash], data: torch.Tensor, bounded: bool = True) -> list[BlockHash]:
        """Queue blocks for writing (``data``: ``[layers, 2, len(hashes), ...]``, not modified
        afterwards by the caller); returns the hashes pushed out to make room. A hash already
        held is only refreshed; writes past ``max_pending`` are dropped unless not ``bounded``
        (a clean stop writes what it has)."""
        dropped = []
        for k, h in enumerate(hashes):
            if h in self.slots:
                self.slots.move_to_end(h)
                continue
            if bounded and self._pending >= self.max_pending:
                self.num_write_dropped += len(hashes) - k
                break
            slot, pushed = self.claim(h)
            if pushed is not None:
                dropped.append(pushed)
            self._use += 1
            with self._lock:
                self._pending += 1
            self._jobs.put(("write", slot, self._use, h, data[:, :, k].contiguous()))
        return [h for h in dropped if h not in self.slots]

    def fetch(self, hashes: Sequence[BlockHash]) -> Future:
        """Read held blocks on the I/O thread; the future's result is ``(hashes, raw)``: the
        leading blocks that read back whole, as bytes (``blocks`` makes the tensor), stopping
        at the first one refused (a failed checksum or read), which is forgotten
        (``take_refused``). The I/O thread runs no torch op: a parallel op there would start
        a second OpenMP team beside the engine's, and it slowed every decode step after it
        by half (measured)."""
        future: Future = Future()
        wanted = [(h, self.slots[h]) for h in hashes]
        for h in hashes:
            self.slots.move_to_end(h)
        self._jobs.put(("read", wanted, future))
        return future

    def blocks(self, raw: list[bytearray]) -> torch.Tensor:
        """Blocks read by ``fetch`` as one tensor, ``[layers, 2, len(raw), ...]`` (on the
        caller's thread)."""
        out = torch.empty((*self.block_shape[:2], len(raw), *self.block_shape[2:]), dtype=self.dtype)
        for k, data in enumerate(raw):
            out[:, :, k].copy_(torch.frombuffer(data, dtype=self.dtype).view(self.block_shape))
        return out

    def take_refused(self) -> list[BlockHash]:
        """Blocks found bad since the last call (failed writes, failed checksums): forgotten
        here; the caller announces them gone."""
        with self._lock:
            failed, self._failed = self._failed, []
        gone = []
        for h in failed:
            slot = self.slots.pop(h, None)
            if slot is not None:
                self.free.append(slot)
                gone.append(h)
        return gone

    def clear(self) -> None:
        self._jobs.put(("clear",))
        super().clear()

    @property
    def closed(self) -> bool:
        return self.fd < 0

    def close(self) -> None:
        """Make the queued writes and stop the thread."""
        if self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join()
        if self.fd >= 0:
            os.close(self.fd)  # releases the lock
            self.fd = -1

    # -- the file ------------------------------------------------------------------

    def _open(self) -> int:
        """Index a matching file's blocks, or start the file afresh; returns the blocks found."""
        size = self.blocks_at + self.num_blocks * self.block_bytes
        header = os.pread(self.fd, HEADER_BYTES, 0)
        if header.startswith(MAGIC) and os.fstat(self.fd).st_size == size:
            version, length = struct.unpack_from("<II", header, len(MAGIC))
            if version == VERSION and header[len(MAGIC) + 8:len(MAGIC) + 8 + length] == self.identity:
                return self._index()
            log.info("%s holds another model's or size's KV: starting it afresh", self.path)
        os.ftruncate(self.fd, 0)
        try:
            os.posix_fallocate(self.fd, 0, size)  # the space is reserved now, not found missing mid-run
        except OSError as exc:
            os.ftruncate(self.fd, 0)
            raise ValueError(f"{self.path}: cannot reserve {size} bytes for the disk tier: {exc}") from None
        if len(self.identity) > HEADER_BYTES - len(MAGIC) - 8:
            raise ValueError("disk tier identity too long for its header")
        os.pwrite(self.fd, MAGIC + struct.pack("<II", VERSION, len(self.identity)) + self.identity, 0)
        os.pwrite(self.fd, bytes(self.blocks_at - self.records_at), self.records_at)
        return 0

    def _index(self) -> int:
        table = os.pread(self.fd, self.num_blocks * RECORD.size, self.records_at)
        found = []
        for slot in range(self.num_blocks):
            magic, use, length, raw, _ = RECORD.unpack_from(table, slot * RECORD.size)
            if magic == RECORD_MAGIC and 0 < length <= len(raw):
                found.append((use, raw[:length], slot))
        taken = set()
        for use, h, slot in sorted(found):  # oldest first: the LRU order they were last used in
            if h in self.slots:  # two slots under one hash (a crash between writes): keep the newer
                taken.discard(self.slots.pop(h))
            self.slots[h] = slot
            taken.add(slot)
            self._use = max(self._use, use)
        self.free = [s for s in range(self.num_blocks - 1, -1, -1) if s not in taken]
        return len(self.slots)

    def _io(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                if job[0] == "write":
                    self._write(*job[1:])
                elif job[0] == "read":
                    self._read(*job[1:])
                else:
                    os.pwrite(self.fd, bytes(self.blocks_at - self.records_at), self.records_at)
            except Exception as exc:  # noqa: BLE001 (the thread must outlive one bad job)
                log.warning("disk tier %s failed: %s", job[0], exc)
                if job[0] == "read" and not job[-1].done():
                    job[-1].set_result(([], None))

    def _mac(self, block_hash: BlockHash, raw) -> bytes:
        mac = hashlib.blake2b(key=self.key, digest_size=32)
        mac.update(self._mac_prefix + len(block_hash).to_bytes(2, "little") + block_hash)
        mac.update(raw)
        return mac.digest()

    def _write(self, slot: int, use: int, block_hash: BlockHash, block: torch.Tensor) -> None:
        try:
            raw = block.reshape(-1).view(torch.uint8).numpy()  # the tensor's own bytes, no copy
            record = RECORD.pack(RECORD_MAGIC, use, len(block_hash), block_hash, self._mac(block_hash, raw))
            os.pwrite(self.fd, EMPTY_RECORD, self.records_at + slot * RECORD.size)
            os.pwrite(self.fd, raw, self.blocks_at + slot * self.block_bytes)
            os.pwrite(self.fd, record, self.records_at + slot * RECORD.size)
            self.num_stored += 1
        except OSError as exc:
            log.warning("disk tier: writing a block failed (%s); it is forgotten", exc)
            with self._lock:
                self._failed.append(block_hash)
        finally:
            with self._lock:
                self._pending -= 1

    def _read(self, wanted: list[tuple[BlockHash, int]], future: Future) -> None:
        blocks, hashes = [], []
        for h, slot in wanted:
            record = os.pread(self.fd, RECORD.size, self.records_at + slot * RECORD.size)
            raw = bytearray(self.block_bytes)  # writable: the tensor made of it needs no copy
            got = os.preadv(self.fd, [raw], self.blocks_at + slot * self.block_bytes)
            magic, _, length, stored, mac = RECORD.unpack(record)
            # four checks, each needed on its own: a record, of the hash asked for, a whole block,
            # and the MAC of what the record claims (its hash) and the block (test_disk_tier.py)
            if (magic != RECORD_MAGIC or stored[:length] != h or got != self.block_bytes
                    or not hmac.compare_digest(self._mac(stored[:length], raw), mac)):
                log.warning("disk tier: block %s in slot %d failed its check; refused", h.hex()[:16], slot)
                self.num_corrupt += 1
                with self._lock:
                    self._failed.append(h)
                break
            blocks.append(raw)
            hashes.append(h)
        self.num_loaded += len(blocks)
        future.set_result((hashes, blocks))
