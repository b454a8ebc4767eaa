"""The streamed fp32 kernel (eagle/csrc/stream_linear.cpp): float64 reference, row independence,
and where PackedLinear uses it."""

import pytest
import torch
import torch.nn.functional as F

from eagle import kernels
from eagle.lean import PackedLinear


def op_or_skip():
    op = kernels.stream_linear_op()
    if op is None:
        assert not kernels.cpu_has_avx512(), "AVX-512 CPU, yet the streamed kernel did not build"
        pytest.skip("the streamed kernel runs on AVX-512 CPUs only")
    return op


# K with and without a tail of fewer than 16; N not a multiple of any block width
@pytest.mark.parametrize("out_features,in_features", [(48, 64), (97, 37), (5, 1536), (1, 7)])
def test_stream_linear_matches_a_float64_reference_for_1_to_16_rows(out_features, in_features):
    op = op_or_skip()
    gen = torch.Generator().manual_seed(out_features * in_features)
    w = torch.randn(out_features, in_features, generator=gen)
    bias = torch.randn(out_features, generator=gen)
    for rows in range(1, kernels.STREAM_MAX_ROWS + 1):
        x = torch.randn(rows, in_features, generator=gen)
        for b in (None, bias):
            ref = F.linear(x.double(), w.double(), None if b is None else b.double())
            out = op(x, w, b)
            assert out.shape == (rows, out_features) and out.dtype == torch.float32
            assert torch.allclose(out.double(), ref, atol=1e-4, rtol=1e-5), (rows, b is None)


def test_a_rows_result_does_not_depend_on_the_rows_computed_with_it():
    """Bit for bit: one row alone, or any of 16 rows computed together (decoding one token and
    verifying a tree give the target the same numbers for the same row)."""
    op = op_or_skip()
    gen = torch.Generator().manual_seed(0)
    w, x = torch.randn(300, 576, generator=gen), torch.randn(16, 576, generator=gen)
    together = op(x, w, None)
    for n in range(1, 17):
        assert torch.equal(op(x[:n].contiguous(), w, None), together[:n])
    for i in range(16):
        assert torch.equal(op(x[i:i + 1].contiguous(), w, None)[0], together[i])


def test_stream_linear_refuses_what_it_cannot_compute():
    op = op_or_skip()
    w = torch.randn(8, 32)
    with pytest.raises(RuntimeError, match="1 to 16 rows"):
        op(torch.randn(17, 32), w, None)
    with pytest.raises(RuntimeError, match="fp32"):
        op(torch.randn(2, 32, dtype=torch.bfloat16), w.bfloat16(), None)
    with pytest.raises(RuntimeError, match="x \\[M, K\\]"):
        op(torch.randn(2, 16), w, None)


def test_packed_linear_streams_up_to_16_rows_and_packs_beyond(monkeypatch):
    real = op_or_skip()
    calls = []

    def counting(x, w, b):
        calls.append(x.shape[0])
        return real(x, w, b)

    lin = torch.nn.Linear(64, 40)
    packed = PackedLinear(lin.weight, lin.bias)
    assert packed.stream_op is real and PackedLinear(lin.weight, stream=False).stream_op is None
    monkeypatch.setattr(packed, "stream_op", counting)
    x = torch.randn(2, 12, 64)
    with torch.inference_mode():
        for n in (1, 5, 16, 24):
            flat = x.reshape(24, 64)[:n]
            assert torch.allclose(packed(flat), lin(flat), atol=1e-5)
        assert torch.allclose(packed(x[:, :8]), lin(x[:, :8]), atol=1e-5)  # [2, 8, 64]: 16 rows
    assert calls == [1, 5, 16, 16]
    assert PackedLinear(lin.weight.bfloat16()).stream_op is None  # fp32 only
