"""Weights in 2 MB pages (Linux transparent huge pages), pure of side effects until called.

A decoding step streams every weight of the target once, ~100 MB of codes for the default target, which
with 4 KB pages is some 25,000 pages a forward: far more than the CPU's TLB holds, so each new page costs
a page walk in the middle of the stream. ``huge_page_copies`` copies the tensors a kernel streams into one
anonymous mapping advised for huge pages (``madvise(MADV_HUGEPAGE)``, which works where the system's
setting is "madvise" or "always"), 50 pages instead of 25,000. It pays most for one-row products, which
are bound by the weights' trip from memory."""

from __future__ import annotations

import math
import mmap
from typing import Sequence

import torch

HUGE_PAGE = 2 << 20
ALIGN = 64  # bytes: each copy starts on a cache line


def huge_page_region(nbytes: int) -> torch.Tensor | None:
    """uint8 [nbytes] starting on a 2 MB boundary of an anonymous mapping advised for huge pages (pages are
    allocated, huge, as they are first written); None where the system has no such advice."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return None
    # the advice covers whole 2 MB pages of the address space: map one more and start at a 2 MB boundary
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.madvise(mmap.MADV_HUGEPAGE)  # before the first write: pages are allocated (huge) as they are touched
    except OSError:  # a kernel built without transparent huge pages
        region.close()
        return None
    raw = torch.frombuffer(region, dtype=torch.uint8)  # holds a reference to the mapping
    offset = -raw.data_ptr() % HUGE_PAGE
    return raw[offset:offset + nbytes]


class Arena:
    """Tensors laid out one after the other (each on a cache line) in one huge-page region of a size
    known beforehand (``huge_page_region``), or ordinary tensors where there is none."""

    def __init__(self, nbytes: int) -> None:
        self.region = huge_page_region(nbytes) if nbytes else None
        self.offset = 0

    @staticmethod
    def size(nbytes: int) -> int:
        """Bytes a tensor of ``nbytes`` takes in an arena."""
        return -(-nbytes // ALIGN) * ALIGN

    def empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
        if self.region is None or self.offset + nbytes > self.region.numel():
            return torch.empty(tuple(shape), dtype=dtype)
        out = self.region[self.offset:self.offset + nbytes].view(dtype).view(tuple(shape))
        self.offset += self.size(nbytes)
        return out


def huge_page_copies(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of the CPU tensors ``tensors`` (same shapes, dtypes and values, contiguous) laid out one
    after the other in one anonymous mapping advised for huge pages; the mapping lives as long as any
    copy does. Where the system has no such advice (not Linux, or a kernel without transparent huge pages)
    the tensors are returned as they are."""
    if not tensors or any(t.device.type != "cpu" for t in tensors):
        return list(tensors)
    arena = Arena(sum(Arena.size(t.numel() * t.element_size()) for t in tensors))
    if arena.region is None:
        return list(tensors)
    copies = []
    for tensor in tensors:
        copy = arena.empty(tensor.shape, tensor.dtype)
        copy.copy_(tensor)
        copies.append(copy)
    return copies
