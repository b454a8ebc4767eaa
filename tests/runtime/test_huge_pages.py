import mmap
import sys

import pytest
import torch

from eagle.runtime.kernels import cpu_kernels
from eagle.runtime.decoder import PackedLinear, to_huge_pages
from eagle.runtime.huge_pages import ALIGN, huge_page_copies


def vma_flags(address: int) -> list[str]:
    """The VmFlags of the mapping holding ``address`` (Linux /proc/self/smaps)."""
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split(" ", 1)[0]
        if "-" in head and ":" not in head:
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    raise AssertionError("no mapping holds the address")


def test_copies_keep_values_and_are_independent():
    tensors = [torch.randn(3, 5), torch.arange(7, dtype=torch.int8), torch.randn(4).half(), torch.zeros(0),
               torch.randint(0, 255, (33, 17), dtype=torch.uint8)]
    copies = huge_page_copies(tensors)
    for tensor, copy in zip(tensors, copies):
        assert copy.dtype == tensor.dtype and copy.shape == tensor.shape and copy.is_contiguous()
        assert torch.equal(copy, tensor)
    copies[0].zero_()
    assert tensors[0].abs().sum() > 0  # copies, not views of the originals
    del tensors
    assert copies[4].sum() >= 0  # the mapping outlives the originals


@pytest.mark.skipif(not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"), reason="Linux only")
def test_copies_share_one_mapping_advised_for_huge_pages():
    tensors = [torch.randn(1000, 7), torch.randn(3)]
    copies = huge_page_copies(tensors)
    if copies[0] is tensors[0]:
        pytest.skip("this kernel has no transparent huge pages")
    assert [c.data_ptr() % ALIGN for c in copies] == [0, 0]
    assert copies[1].data_ptr() - copies[0].data_ptr() == -(-1000 * 7 * 4 // ALIGN) * ALIGN  # one after the other
    assert "hg" in vma_flags(copies[0].data_ptr())  # MADV_HUGEPAGE
    # a control: a plain mapping is not advised (torch's own small allocations live in the malloc heap, which a
    # long test run can leave advised)
    plain = mmap.mmap(-1, 4 * ALIGN)
    control = torch.frombuffer(plain, dtype=torch.uint8)
    assert "hg" not in vma_flags(control.data_ptr())
    del control
    plain.close()


def test_packed_linears_move_with_the_same_products():
    torch.manual_seed(0)
    linears = [PackedLinear(torch.randn(64, 32)), PackedLinear(torch.randn(48, 32), torch.randn(48)),
               PackedLinear.quantized(torch.randn(40, 32), None, 4)]  # fp32 weights and block codes
    x = torch.randn(3, 32)
    before = [lin(x) for lin in linears]
    weights = [lin.kernel_weight()[0] for lin in linears]
    moved = to_huge_pages(linears)
    streamed = cpu_kernels() is not None and hasattr(mmap, "MADV_HUGEPAGE")
    assert moved == streamed or not sys.platform.startswith("linux")
    if moved:
        assert linears[2].encoded is not None
        assert all(lin.kernel_weight()[0] is not w for lin, w in zip(linears, weights))
    for lin, out in zip(linears, before):
        assert torch.equal(lin(x), out)
