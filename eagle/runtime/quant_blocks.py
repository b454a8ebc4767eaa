"""Exact block encodings of fp32 weights (pure): many targets ship quantized (the default one is a
GGUF file, Q4_1 layers and a Q8_0 embedding) and are dequantized to fp32 when loaded, so each block
of 32 weights of a row is w = d * c + m for small integer codes c and one scale pair (d, m).
Storing the codes and scales instead of the fp32 values lets the compiled kernel
(``eagle.runtime.kernels``, ``stream_linear_q``) read 0.625 (4-bit, float16 scales as GGUF stores them) or
1.125 (8-bit) bytes per weight instead of 4 and decode each weight to the very same fp32 value, so
every product keeps its bits.

``block_encode`` finds such an encoding from the fp32 values alone and keeps it only if decoding
reproduces every weight exactly (``decode`` is the reference; the kernel decodes with one fused
multiply-add, which equals ``d * c + m`` here because ``d`` is a float16 value and ``d * c`` is exact
in fp32). A matrix with a single block that does not fit stays fp32.

``block_quantize`` is the lossy counterpart, for weights whose precision never changes the output
(a drafter's: the target verifies every token): the nearest encoding, which the same kernel reads."""

from __future__ import annotations

import dataclasses

import torch

from eagle.inputs import FORMATS  # noqa: F401 (block_quantize's formats by their GGUF names -> bits)

BLOCK = 32
PROBE_ROWS = 8


@dataclasses.dataclass
class BlockCodes:
    """``codes``: 4 bits, uint8 [N, K / 2] (in each block, byte i holds code i in its low nibble and
    code i + 16 in its high nibble), codes 0..15; or 8 bits, int8 [N, K], codes -127..127.
    ``scales``: 4 bits [N, K / 32, 2], each block's (d, m); 8 bits [N, K / 32, 1], each block's d
    (w = d * c). With 4 bits float16 when every d and m is a float16 value (GGUF stores them so,
    ``block_quantize`` rounds them so): 0.125 bytes a weight instead of 0.25, which the kernel
    converts exactly, a few rows at a time (for 8 bits, whose codes take 1 byte a weight, the
    conversion costs more than it saves). Else float32."""

    codes: torch.Tensor
    scales: torch.Tensor

    @property
    def bits(self) -> int:
        return 4 if self.codes.dtype == torch.uint8 else 8


def decode(encoded: BlockCodes) -> torch.Tensor:
    """The fp32 weight [N, K] an encoding stands for."""
    codes, scales = encoded.codes, encoded.scales.float()
    if encoded.bits == 4:
        halves = codes.view(codes.shape[0], -1, BLOCK // 2)
        codes = torch.cat([halves & 15, halves >> 4], dim=-1)  # [N, K / 32, 32]
    else:
        codes = codes.view(codes.shape[0], -1, BLOCK)
    values = scales[..., :1] * codes.float()
    if encoded.bits == 4:
        values = values + scales[..., 1:]
    return values.reshape(codes.shape[0], -1)


def _fit(blocks: torch.Tensor, d: torch.Tensor, m: torch.Tensor, low: int, high: int) -> torch.Tensor | None:
    """Codes [N, B, 32] with d * c + m == blocks exactly (d a float16 value, so d * c is exact), or None."""
    codes = torch.round((blocks - m) / torch.where(d == 0, 1.0, d)).clamp(low, high)
    return codes if torch.equal(d * codes + m, blocks) else None


@torch.no_grad()
def block_encode(weight: torch.Tensor) -> BlockCodes | None:
    """An exact 4-bit affine (d * c + m, c in 0..15: GGUF's Q4_1) or 8-bit symmetric (d * c, c in
    -127..127: Q8_0) encoding of an fp32 CPU weight [N, K] (K a multiple of 32), or None when the
    values are not one (then the weight stays as it is). A few rows are tried first, so an ordinary
    fp32 weight is turned down after a sliver of the work."""
    if weight.dtype != torch.float32 or weight.dim() != 2 or weight.shape[1] % BLOCK or weight.device.type != "cpu":
        return None
    if weight.shape[0] > PROBE_ROWS and _encode(weight[:PROBE_ROWS]) is None:
        return None
    return _encode(weight)


def _encode(weight: torch.Tensor) -> BlockCodes | None:
    n = weight.shape[0]
    blocks = weight.detach().reshape(n, -1, BLOCK)
    low, high = blocks.amin(-1, keepdim=True), blocks.amax(-1, keepdim=True)
    d = ((high - low) / 15).half().float()
    codes = _fit(blocks, d, low, 0, 15)
    if codes is not None:
        return BlockCodes(_nibbles(codes), _pairs(d, low))
    d = (blocks.abs().amax(-1, keepdim=True) / 127).half().float()
    codes = _fit(blocks, d, torch.zeros_like(d), -127, 127)
    return None if codes is None else _bytes(codes, d)


@torch.no_grad()
def block_quantize(weight: torch.Tensor, bits: int) -> BlockCodes:
    """The nearest block encoding of a weight [N, K] (K a multiple of 32), lossy: 8 bits symmetric
    (d = max |w| / 127 per block, GGUF's Q8_0) or 4 bits affine (d = (max - min) / 15, m = min, Q4_1),
    d and m rounded to float16 as GGUF stores them (as llama.cpp quantizes). ``decode`` of the result
    is the quantized weight, within about d / 2 of ``weight`` (plus the float16 roundings). ``weight``: a tensor,
    or anything with its ``dim()``, ``shape``, ``device`` and slices of rows (``weight[i:j]``, a tensor): it is read
    a few rows at a time."""
    if bits not in FORMATS.values() or weight.dim() != 2 or weight.shape[1] % BLOCK:
        raise ValueError(f"block_quantize: bits 8 or 4 and a weight [N, K] with K a multiple of {BLOCK}, "
                         f"got bits {bits} and shape {tuple(weight.shape)}")
    # a few rows at a time, each part written into the result: the float temporaries stay small beside the
    # codes (rows are independent, so the parts are the whole weight's)
    n, k = weight.shape
    codes = torch.empty(n, k * bits // 8, dtype=torch.int8 if bits == 8 else torch.uint8, device=weight.device)
    d = torch.empty(n, k // BLOCK, 1, device=weight.device)
    m = torch.empty_like(d) if bits == 4 else None
    step = max(1, (1 << 18) // max(k, 1))
    for i in range(0, n, step):
        blocks = weight[i:i + step].detach().float().reshape(-1, k // BLOCK, BLOCK)
        if bits == 8:
            scale = d[i:i + step] = (blocks.abs().amax(-1, keepdim=True) / 127).half().float()
            rounded = torch.round(blocks / torch.where(scale == 0, 1.0, scale)).clamp(-127, 127)
            codes[i:i + step] = rounded.reshape(blocks.shape[0], -1)
        else:
            low = blocks.amin(-1, keepdim=True)
            scale = d[i:i + step] = ((blocks.amax(-1, keepdim=True) - low) / 15).half().float()
            low = m[i:i + step] = low.half().float()
            rounded = torch.round((blocks - low) / torch.where(scale == 0, 1.0, scale)).clamp(0, 15)
            codes[i:i + step] = _nibbles(rounded)
    return _bytes(codes, d) if bits == 8 else BlockCodes(codes, _pairs(d, m))


def _pairs(d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """4-bit blocks' d and m [N, B, 1] each -> scales [N, B, 2]: float16 where that holds them exactly."""
    scales = torch.cat([d, m], dim=-1)
    half = scales.half()
    return (half if torch.equal(half.float(), scales) else scales).contiguous()


def _bytes(codes: torch.Tensor, d: torch.Tensor) -> BlockCodes:
    """8-bit codes [N, K / 32, 32] (-127..127, any dtype) and their blocks' d [N, K / 32, 1] -> ``BlockCodes``."""
    return BlockCodes(codes.to(torch.int8).reshape(codes.shape[0], -1).contiguous(), d.contiguous())


def _nibbles(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes [N, K / 32, 32] (0..15, any dtype) -> uint8 [N, K / 2] as ``BlockCodes`` packs them."""
    codes = codes.to(torch.uint8)
    return (codes[..., :BLOCK // 2] | (codes[..., BLOCK // 2:] << 4)).reshape(codes.shape[0], -1).contiguous()


CODES, SCALES = ".q8_codes", ".q8_scales"  # suffixes of a packed weight's two tensors in a checkpoint


def pack_state(state: dict[str, torch.Tensor], min_size: int = 1 << 16) -> dict[str, torch.Tensor]:
    """A state dict for storage: each float matrix [N, K] of at least ``min_size`` weights with K a
    multiple of 32 becomes its 8-bit block codes (``NAME.q8_codes`` int8 [N, K]) and float16 scales
    (``NAME.q8_scales`` [N, K / 32]): 1.0625 bytes a weight instead of bf16's 2. Lossy (Q8_0's
    rounding, the encoding a drafter computes from by default); other tensors are kept as they are."""
    out = {}
    for name, tensor in state.items():
        if tensor.is_floating_point() and tensor.dim() == 2 and tensor.shape[1] % BLOCK == 0 and (
                tensor.numel() >= min_size):
            codes = block_quantize(tensor, 8)
            out[name + CODES], out[name + SCALES] = codes.codes, codes.scales.squeeze(-1).half()
        else:
            out[name] = tensor
    return out


def unpack_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``pack_state``'s inverse: packed weights decoded to float32; a plain state dict is returned as is."""
    out = {}
    for name, tensor in state.items():
        if name.endswith(SCALES):
            continue
        if name.endswith(CODES):
            base = name[:-len(CODES)]
            if base + SCALES not in state:
                raise ValueError(f"packed weight {base} has codes but no {base + SCALES}")
            out[base] = decode(BlockCodes(tensor, state[base + SCALES].float().unsqueeze(-1)))
        else:
            out[name] = tensor
    return out
