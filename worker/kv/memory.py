"""Host memory for KV blocks and packed weights: zeroed, faulted in at once, and on huge
pages where the kernel gives them (``madvise``). The pool and the host tier both hold
blocks that copies and attention read scattered over the whole buffer; with 4 KiB pages
each block is a TLB miss (measured: a 64-block demotion into a 1 GiB host tier took 4.1 ms
on 4 KiB pages against 0.7 ms into memory the caches held). A decode step streams every
weight once, and reads them a TLB entry per 2 MiB from one arena (``in_one_arena``).

A step's activations come from the C heap, and glibc's malloc serves every block past its
mmap threshold (at most 32 MiB; a 2,048-token step at Llama-3.2-1B's shape allocates 64 MiB
for gate/up alone) with a fresh ``mmap`` and unmaps it when freed, so every step the kernel
zeroes and maps those pages again on first touch, inside the matmul and activation kernels
that write them: a 2,048-token prompt step at 1B took 1.26-1.31x as long on the AMX Xeon
(``benchmarks/pages/engine_throughput.md``). tcmalloc and jemalloc keep freed
memory, which is why vLLM's and SGLang's CPU backends ask for them with ``LD_PRELOAD``; a
library cannot preload, but glibc takes the same policy from ``mallopt``
(``keep_freed_heap``)."""

from __future__ import annotations

import ctypes
import mmap

import torch

from kervan import envs

M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's <malloc.h>
_heap_kept: bool | None = None  # keep_freed_heap's outcome, once a process asked


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # zero-filled
    if hasattr(mmap, "MADV_HUGEPAGE"):
        buf.madvise(mmap.MADV_HUGEPAGE)
    data = torch.frombuffer(buf, dtype=torch.uint8)
    data.zero_()  # fault every page in now, not in the middle of the first steps
    return data.view(dtype).view(shape)


def in_one_arena(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of ``tensors`` (one dtype) side by side in one buffer on huge pages, in the
    order given: a step that reads them in that order streams one region front to back."""
    if not tensors:
        return []
    arena = zeros_on_huge_pages((sum(t.numel() for t in tensors),), tensors[0].dtype)
    out, start = [], 0
    for t in tensors:
        view = arena[start:start + t.numel()].view(t.shape)
        view.copy_(t)
        out.append(view)
        start += t.numel()
    return out


def keep_freed_heap() -> bool:
    """Large blocks from the heap, not from mmap, and the heap's top never trimmed below 2 GiB:
    a step reuses the pages the last one freed. The process then keeps its peak heap until it
    exits (as under tcmalloc). Only with glibc, once per process, unless ``KERVAN_HEAP=system``;
    True when the policy is in force."""
    global _heap_kept
    if _heap_kept is None:
        _heap_kept = False
        if envs.heap() == "keep":
            try:
                libc = ctypes.CDLL(None)
                libc.gnu_get_libc_version  # noqa: B018 - glibc's, absent from musl and macOS
            except (OSError, AttributeError):
                return False
            _heap_kept = libc.mallopt(M_MMAP_MAX, 0) == 1 and libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1) == 1
    return _heap_kept
