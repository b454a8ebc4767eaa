"""Block encodings of fp32 weights (eagle.runtime.quant_blocks): exact ones found only where decoding gives every value
back; lossy ones (for drafters) on the nearest codes."""

import pytest
import torch

from eagle.runtime.quant_blocks import block_encode, block_quantize, decode
from tests.conftest import block_quantized


def test_a_dequantized_q4_1_or_q8_0_weight_is_encoded_exactly():
    gen = torch.Generator().manual_seed(0)
    for bits, shape in ((4, (48, 96)), (8, (40, 64)), (4, (1, 32))):
        weight = block_quantized(torch.randn(*shape, generator=gen) * 0.1, bits)
        encoded = block_encode(weight)
        assert encoded is not None and encoded.bits == bits
        assert encoded.codes.shape == (shape[0], shape[1] * bits // 8)
        assert encoded.scales.shape == (shape[0], shape[1] // 32, 2 if bits == 4 else 1)  # (d, m) or d
        assert torch.equal(decode(encoded), weight)


def test_4_bit_scales_are_float16_only_where_that_holds_them_exactly():
    gen = torch.Generator().manual_seed(2)
    weight = block_quantized(torch.randn(6, 64, generator=gen), 4)
    assert block_encode(weight).scales.dtype == torch.float16  # GGUF's Q4_1: d and m are float16 values
    weight[3, :32] = 1.0 + 2.0 ** -20 + 2.0 ** -12 * (torch.arange(32.0) % 16)  # m = 1 + 2^-20: no float16
    encoded = block_encode(weight)
    assert encoded is not None and encoded.scales.dtype == torch.float32 and torch.equal(decode(encoded), weight)


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


def test_block_quantize_rounds_each_weight_to_its_nearest_code():
    """The lossy encoding (for drafters): every weight within half a step of its block's grid, the
    grid's ends at the block's extremes, and the codes an exact encoding that the kernel reads."""
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(24, 96, generator=gen) * torch.logspace(-3, 1, 24)[:, None]  # rows of very different sizes
    for bits in (8, 4):
        codes = block_quantize(weight, bits)
        values = decode(codes)
        d = codes.scales[..., :1].expand(-1, -1, 32).reshape(24, 96)
        assert codes.bits == bits and ((values - weight).abs() <= 0.5 * d * (1 + 1e-2) + 1e-3 * weight.abs()).all()
        assert not torch.equal(values, weight) and torch.equal(decode(block_encode(values)), values)
        if bits == 8:
            assert codes.codes.abs().amax(-1).eq(127).all()  # each block's largest weight on the grid's end
    # a weight quantized a few rows at a time (here 128 of 2048): each row as it is alone
    tall = torch.randn(300, 2048, generator=gen) * torch.logspace(-2, 1, 300)[:, None]
    for bits in (8, 4):
        whole = block_quantize(tall, bits)
        for i in (0, 127, 128, 255, 256, 299):
            alone = block_quantize(tall[i:i + 1], bits)
            assert torch.equal(whole.codes[i:i + 1], alone.codes) and torch.equal(whole.scales[i:i + 1].float(),
                                                                                   alone.scales.float())
    with pytest.raises(ValueError, match="multiple of 32"):
        block_quantize(weight[:, :40], 8)
    with pytest.raises(ValueError, match="bits 8 or 4"):
        block_quantize(weight, 2)


def test_a_quantized_linear_computes_its_decoded_weight():
    """``PackedLinear.quantized`` (a drafter's matrices): the product of the decoded weight, at the
    few rows the streamed kernel takes (from the codes where it runs) and at more."""
    from eagle.runtime.decoder import PackedLinear

    gen = torch.Generator().manual_seed(3)
    weight, bias = torch.randn(80, 64, generator=gen), torch.randn(80, generator=gen)
    for bits in (8, 4):
        linear = PackedLinear.quantized(weight.bfloat16(), bias, bits)
        decoded = decode(block_quantize(weight.bfloat16(), bits))
        for rows in (1, 3, 16, 40):
            x = torch.randn(rows, 64, generator=gen)
            torch.testing.assert_close(linear(x), x @ decoded.T + bias, rtol=1e-5, atol=1e-4)
        if linear.stream_op is not None:  # the codes alone, whatever the row count: no fp32 copy kept
            assert linear.encoded is not None and linear.plain_weight is None and linear.weight is None


def test_pack_state_stores_q8_codes_and_unpacks_to_their_values():
    from eagle.runtime.quant_blocks import CODES, SCALES, pack_state, unpack_state

    torch.manual_seed(0)
    big, small, vec, ids = torch.randn(64, 1024), torch.randn(4, 32), torch.randn(64), torch.arange(10)
    packed = pack_state({"w": big.bfloat16(), "small": small, "norm": vec, "ids": ids}, min_size=4096)
    assert set(packed) == {"w" + CODES, "w" + SCALES, "small", "norm", "ids"}
    assert packed["w" + CODES].dtype == torch.int8 and packed["w" + SCALES].dtype == torch.float16
    nbytes = sum(t.numel() * t.element_size() for k, t in packed.items() if k.startswith("w."))
    assert nbytes == 64 * 1024 * 1.0625  # 8-bit codes + a float16 scale per 32 weights
    out = unpack_state(packed)
    assert set(out) == {"w", "small", "norm", "ids"}
    assert torch.equal(out["w"], decode(block_quantize(big.bfloat16().float(), 8)))
    assert (out["w"] - big).abs().max() < 0.02 * big.abs().max()  # Q8_0: within half a step of each block
    assert out["small"] is small and out["ids"] is ids
    plain = {"a": big}
    assert unpack_state(plain) == plain  # an unpacked checkpoint loads as it is


def test_a_packed_drafter_loads_with_its_quantized_weights(tmp_path):
    from safetensors.torch import load_file, save_file

    from eagle import Drafter
    from eagle.runtime.quant_blocks import pack_state
    from tests.conftest import tiny_drafter, tiny_target

    target = tiny_target(vocab_size=64, hidden=64)
    drafter = tiny_drafter(target)
    drafter.save_pretrained(tmp_path)
    path = str(tmp_path / "model.safetensors")
    save_file(pack_state(load_file(path), min_size=1024), path, metadata={"format": "eagle-drafter/1"})
    loaded = Drafter.from_pretrained(tmp_path, target=target)
    for name, weight in drafter.state_dict().items():
        got = loaded.state_dict()[name]
        if weight.dim() == 2 and weight.numel() >= 1024 and weight.is_floating_point():
            assert torch.equal(got, decode(block_quantize(weight.float(), 8)).to(got.dtype)), name
        else:
            assert torch.equal(got, weight), name
