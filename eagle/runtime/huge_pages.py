"""Weights in 2 MB pages (Linux transparent huge pages), pure of side effects until called.

A decoding step streams every weight of the target once, ~100 MB of codes for the default target, which
with 4 KB pages is some 25,000 pages a forward: far more than the CPU's TLB holds, so each new page costs
a page walk in the middle of the stream. ``huge_page_copies`` copies the tensors a kernel streams into one
anonymous mapping advised for huge pages (``madvise(MADV_HUGEPAGE)``, which works where the system's
setting is "madvise" or "always"), 50 pages instead of 25,000. It pays most for one-row products, which
are bound by the weights' trip from memory."""

from __future__ import annotations

import mmap
from typing import Sequence

import torch

HUGE_PAGE = 2 << 20
ALIGN = 64  # bytes: each copy starts on a cache line


def huge_page_copies(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of the CPU tensors ``tensors`` (same shapes, dtypes and values, contiguous) laid out one
    after the other in one anonymous mapping advised for huge pages; the mapping lives as long as any
    copy does. Where the system has no such advice (not Linux, or a kernel without transparent huge pages)
    the tensors are returned as they are."""
    if not tensors or not hasattr(mmap, "MADV_HUGEPAGE") or any(t.device.type != "cpu" for t in tensors):
        return list(tensors)
    sizes = [t.numel() * t.element_size() for t in tensors]
    total = sum(-(-size // ALIGN) * ALIGN for size in sizes)
    # the advice covers whole 2 MB pages of the address space: map one more and start at a 2 MB boundary
    region = mmap.mmap(-1, total + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.madvise(mmap.MADV_HUGEPAGE)  # before the first write: pages are allocated (huge) as they are touched
    except OSError:  # a kernel built without transparent huge pages
        region.close()
        return list(tensors)
    raw = torch.frombuffer(region, dtype=torch.uint8)  # holds a reference to the mapping
    offset = -raw.data_ptr() % HUGE_PAGE
    copies = []
    for tensor, size in zip(tensors, sizes):
        copy = raw[offset:offset + size].view(tensor.dtype).view(tensor.shape)
        copy.copy_(tensor)
        copies.append(copy)
        offset += -(-size // ALIGN) * ALIGN
    return copies
