"""The compiled fp32 kernels (eagle/csrc/cpu_kernels.cpp): float64 references, row independence,
where PackedLinear and LeanDecoder use them."""

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


@pytest.mark.parametrize("hidden", [576, 40, 7])
def test_rms_norm_matches_a_float64_reference_and_torchs(hidden):
    module = kernels.cpu_kernels()
    if module is None:
        op_or_skip()
    gen = torch.Generator().manual_seed(hidden)
    x, w = torch.randn(2, 5, hidden, generator=gen) * 3, torch.randn(hidden, generator=gen)
    ref = w.double() * x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-5)
    out = module.rms_norm(x, w, 1e-5)
    assert out.shape == x.shape and torch.allclose(out.double(), ref, atol=1e-5, rtol=1e-5)
    assert torch.allclose(out, F.rms_norm(x, (hidden,), w, 1e-5), atol=1e-5, rtol=1e-5)
    assert torch.equal(module.rms_norm(x[1, 2:3].contiguous(), w, 1e-5), out[1, 2:3])  # rows independent
    with pytest.raises(RuntimeError, match="x \\[..., H\\]"):
        module.rms_norm(x, w[:-1].contiguous(), 1e-5)


def test_lean_decoder_uses_the_compiled_kernels_in_fp32_and_can_do_without():
    from eagle.lean import LeanDecoder, rms_norm
    from tests.conftest import tiny_target

    op_or_skip()
    model = tiny_target(seed=4).model
    with_kernels, without = LeanDecoder(model), LeanDecoder(model, kernels=False)
    assert with_kernels.rms_norm is not rms_norm and with_kernels.head.stream_op is not None
    assert without.rms_norm is rms_norm and without.head.stream_op is None
    assert with_kernels.kernel_choice() != without.kernel_choice()  # cost curves are cached per choice
    ids = torch.randint(0, 32, (1, 9), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(9)[None]
    a = with_kernels.forward(ids, pos, with_kernels.new_cache())
    b = without.forward(ids, pos, without.new_cache())
    assert torch.allclose(a, b, atol=1e-5)


def test_the_environment_can_turn_the_kernels_off(monkeypatch):
    op_or_skip()
    kernels.cpu_kernels.cache_clear()
    monkeypatch.setenv("EAGLE_CPU_KERNELS", "0")
    try:
        assert kernels.cpu_kernels() is None and kernels.stream_linear_op() is None
        assert PackedLinear(torch.randn(8, 16)).stream_op is None
    finally:
        kernels.cpu_kernels.cache_clear()
    monkeypatch.delenv("EAGLE_CPU_KERNELS")
    assert kernels.stream_linear_op() is not None
