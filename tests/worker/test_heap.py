"""A CPU engine's process keeps the heap memory a step frees (``worker/kv/memory.py``): a block
past glibc's mmap threshold, freed and asked for again, comes back on pages already mapped."""

import os
import subprocess
import sys

import pytest

from kervan import envs

PROBE = """
import resource, sys, torch
from worker.kv.memory import keep_freed_heap
print(keep_freed_heap() if sys.argv[1] == "keep" else False)
for _ in range(2):  # 64 MiB, written: the heap grows to hold it (twice: the first one's place is not yet the top)
    torch.ones(64 << 20, dtype=torch.uint8)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    torch.ones(64 << 20, dtype=torch.uint8)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def faults(policy: str) -> tuple[str, int]:
    env = {**os.environ, envs.KERVAN_HEAP: policy}
    out = subprocess.run([sys.executable, "-c", PROBE, policy], env=env, capture_output=True, text=True,
                         check=True, timeout=120).stdout.split()
    return out[0], int(out[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_freed_block_comes_back_without_page_faults():
    kept, kept_faults = faults("keep")
    system, system_faults = faults("system")
    assert (kept, system) == ("True", "False")
    # glibc's default maps the block anew every time: 16,384 faults each on 4 KiB pages (32 where
    # transparent huge pages are always on); kept, the heap's pages are reused
    assert kept_faults * 10 < system_faults
    assert kept_faults < 1000


def test_a_bad_heap_policy_is_refused(monkeypatch):
    monkeypatch.setenv(envs.KERVAN_HEAP, "tcmalloc")
    with pytest.raises(ValueError, match="expected keep or system"):
        envs.heap()
