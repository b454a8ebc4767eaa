"""Exact block encodings of fp32 weights (eagle.quant): found only where decoding gives every value back."""

import torch

from eagle.quant import block_encode, decode
from tests.conftest import block_quantized


def test_a_dequantized_q4_1_or_q8_0_weight_is_encoded_exactly():
    gen = torch.Generator().manual_seed(0)
    for bits, shape in ((4, (48, 96)), (8, (40, 64)), (4, (1, 32))):
        weight = block_quantized(torch.randn(*shape, generator=gen) * 0.1, bits)
        encoded = block_encode(weight)
        assert encoded is not None and encoded.bits == bits
        assert encoded.codes.shape == (shape[0], shape[1] * bits // 8) and encoded.scales.shape == (shape[0],
                                                                                                      shape[1] // 32, 2)
        assert torch.equal(decode(encoded), weight)


def test_constant_and_zero_blocks_are_encoded():
    weight = torch.zeros(3, 64)
    weight[1] = 0.25
    weight[2, :32] = -1.5
    encoded = block_encode(weight)
    assert encoded is not None and torch.equal(decode(encoded), weight)


def test_a_weight_that_is_no_block_encoding_stays_as_it_is():
    gen = torch.Generator().manual_seed(1)
    assert block_encode(torch.randn(16, 64, generator=gen)) is None  # plain fp32 values
    weight = block_quantized(torch.randn(16, 64, generator=gen), 4)
    weight[12, 40] = torch.nextafter(weight[12, 40], torch.tensor(9.0))  # one value one ulp off, past the probe
    assert block_encode(weight) is None
    assert block_encode(block_quantized(torch.randn(4, 64, generator=gen), 8)[:, :48]) is None  # K not 32 * n
    assert block_encode(block_quantized(torch.randn(4, 64, generator=gen), 4).bfloat16()) is None  # fp32 only
