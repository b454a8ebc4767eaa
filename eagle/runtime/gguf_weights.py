"""A GGUF target's weights as the compiled kernels multiply them: its quantized matrices kept as their raw
GGUF blocks, never de-quantized as a whole.

``load_gguf_model`` reads the tensor data of a GGUF file (``eagle.runtime.gguf_file`` reads its header)
into a ``GGUFModel``: the stand-in for a transformers model that the lean forwards
(``eagle.runtime.decoder.LeanDecoder``, ``eagle.runtime.gemma.GemmaDecoder``) read, with the attribute
names of transformers' Llama, Qwen2/3 and Gemma-3 models (``model.layers[i].self_attn.q_proj``, ...).
Each matrix of a type in ``gguf_file.STREAMED`` is a ``GGUFMatrix``: its rows' GGUF bytes (uint8
[N, row bytes], the file's own layout), multiplied by ``stream_linear_gguf_parts`` (``GGUFLinear``) with
the bits of the compiled fp32 kernel on the weight gguf-py de-quantizes; other types (F16, BF16) are
de-quantized to fp32 when read. The embedding (``GGUFEmbedding``) de-quantizes only the rows
it looks up, and a tied LM head multiplies the same codes. So a loaded target holds about the GGUF's
size: no full-precision copy of the model is made (``GGUFEmbedding.weight`` makes one on request, for
what needs the whole matrix: building a drafter's head, training).

As transformers' GGUF reader does: a llama file's q and k rows are stored permuted (llama.cpp's rotary
layout); their rows are put back in transformers' order (``llama_row_order``: rows are independent, so
this is a row selection of the codes). Gemma's norms are stored as 1 + w; transformers subtracts the 1
(``norm.weight`` here is that difference, in fp32, as transformers computes it)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from eagle.runtime.quant_blocks import BlockCodes, decode
from eagle.runtime.gguf_file import GGUFHeader, LLAMA_FAMILY, TensorInfo, check_gguf, tensor_storage, KEEP_BLOCKS
from eagle.runtime.huge_pages import Arena
from eagle.runtime.kernels import cpu_kernels


def ggml_type_id(name: str) -> int:
    """A GGML type's number ("Q4_K" -> 12)."""
    from gguf import GGMLQuantizationType

    return int(GGMLQuantizationType[name].value)


def dequantize_numpy(raw: np.ndarray, ggml_type: str) -> np.ndarray:
    """gguf-py's de-quantization of GGUF rows uint8 [N, row bytes] -> fp32 [N, K]."""
    from gguf import GGMLQuantizationType, quants

    return np.ascontiguousarray(quants.dequantize(raw, GGMLQuantizationType[ggml_type]), dtype=np.float32)


@dataclasses.dataclass
class GGUFMatrix:
    """A matrix [N, K] as its GGUF rows: ``raw`` uint8 [N, row bytes] of GGML type ``ggml_type``; ``interleaved``:
    a Q4_K or Q6_K matrix whose rows the compiled kernels rewrote in place 8 at a time (``interleave``)."""

    raw: torch.Tensor
    ggml_type: str
    interleaved: bool = False

    @property
    def type_id(self) -> int:
        return INTERLEAVED[self.ggml_type] if self.interleaved else ggml_type_id(self.ggml_type)

    def interleave(self) -> bool:
        """Rewrite a Q4_K or Q6_K matrix's rows in place as groups of 8 rows (``gguf_interleave`` in
        ``eagle/runtime/csrc/cpu_kernels.cpp``, as llama.cpp repacks Q4_K): one load of codes serves 8 rows and
        every sum lands in its row's lane, so the int8 products take far fewer instructions a weight, with the
        same integers. Only where those products run and the rows come in eights; the values it stands for stay
        the same (``rows``, ``dequantize``). Returns whether it is."""
        module = cpu_kernels()
        if not self.interleaved and self.ggml_type in INTERLEAVED and self.out_features % 8 == 0 and \
                module is not None and module.int8_activations:
            module.gguf_interleave(self.raw, ggml_type_id(self.ggml_type))
            self.interleaved = True
        return self.interleaved

    def gguf_rows(self) -> torch.Tensor:
        """The rows in GGUF's own layout (a copy when interleaved)."""
        return cpu_kernels().gguf_deinterleave(self.raw, self.type_id) if self.interleaved else self.raw

    def pick(self, index: torch.Tensor) -> "GGUFMatrix":
        """Rows ``index`` [n] as a matrix of their own, in GGUF's layout."""
        index = index.reshape(-1).long().cpu()
        if self.interleaved:
            return GGUFMatrix(cpu_kernels().gguf_interleaved_rows(self.raw, self.type_id, index), self.ggml_type)
        return GGUFMatrix(self.raw.index_select(0, index), self.ggml_type)

    @property
    def out_features(self) -> int:
        return self.raw.shape[0]

    @property
    def in_features(self) -> int:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        weights, size = GGML_QUANT_SIZES[GGMLQuantizationType[self.ggml_type]]
        return self.raw.shape[1] // size * weights

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """Rows ``index`` [n] de-quantized: fp32 [n, K] (the values gguf-py computes)."""
        module = cpu_kernels()
        if module is not None:
            return module.gguf_dequantize_rows(self.raw, self.type_id, index.reshape(-1).long().cpu())
        picked = self.raw.index_select(0, index.reshape(-1).long().cpu())
        return torch.from_numpy(dequantize_numpy(picked.numpy(), self.ggml_type))

    def dequantize(self) -> torch.Tensor:
        """The whole matrix in fp32 [N, K] (a full-precision copy: for references and fallbacks)."""
        return torch.from_numpy(dequantize_numpy(self.gguf_rows().numpy(), self.ggml_type))


INTERLEAVED = {"Q4_K": 1012, "Q6_K": 1014, "Q5_0": 1006}  # the kernels' numbers of interleaved rows of these types (not GGML's)
SUPER_BLOCKED = ("Q4_K", "Q5_K", "Q6_K")  # their int8 products quantize x per super-block of 256 (ggml's Q8_K)
SPLIT_TYPES = ("Q8_0", "Q5_0") + SUPER_BLOCKED  # the types ``split_norms`` knows


def int8_block(ggml_type: str) -> int:
    """How many values of x share one scale when the int8 products meet codes of this type."""
    return 256 if ggml_type in SUPER_BLOCKED else 32


def split_norms(matrix: GGUFMatrix, rows: int = 4096) -> torch.Tensor:
    """fp32 [2, N]: each row's Euclidean norm |w_j|, and |a_j| + |b_j| for the two parts w_j = a_j - b_j the int8
    products sum apart (a: the codes times their scales; b: the minimums, d dmin per 32 weights for Q4_K and Q5_K,
    32 d sc per 16 for Q6_K, none for Q8_0 and Q5_0), in float64 from gguf-py's values, ``rows`` at a time.
    Types of ``SPLIT_TYPES``."""
    if matrix.ggml_type not in SPLIT_TYPES:
        raise ValueError(f"split_norms: {matrix.ggml_type} is not one of {', '.join(SPLIT_TYPES)}")
    n, out = matrix.out_features, torch.empty(2, matrix.out_features)
    for i in range(0, n, rows):
        index = torch.arange(i, min(n, i + rows))
        w = matrix.rows(index).double()
        b = _minimums(matrix.gguf_rows()[i:i + rows].numpy(), matrix.ggml_type, w.shape[1])
        out[0, i:i + w.shape[0]] = w.norm(dim=1).float()
        if b is None:
            out[1, i:i + w.shape[0]] = out[0, i:i + w.shape[0]]
        else:
            out[1, i:i + w.shape[0]] = ((w + b).norm(dim=1) + b.norm(dim=1)).float()
    return out


def _minimums(raw: np.ndarray, ggml_type: str, k: int) -> torch.Tensor | None:
    """b of ``split_norms`` for GGUF rows raw uint8 [n, row bytes], float64 [n, K] (None: 0)."""
    if ggml_type not in SUPER_BLOCKED:
        return None
    n = raw.shape[0]
    blocks = raw.reshape(n, k // 256, -1)
    if ggml_type == "Q6_K":
        d = blocks[..., 208:210].copy().view(np.float16).astype(np.float64)  # [n, S, 1]
        per16 = 32.0 * d * blocks[..., 192:208].view(np.int8).astype(np.float64)  # [n, S, 16]
        return torch.from_numpy(np.repeat(per16, 16, axis=-1).reshape(n, k))
    dmin = blocks[..., 2:4].copy().view(np.float16).astype(np.float64)  # [n, S, 1]
    q = blocks[..., 4:16].astype(np.int64)  # the 12 scale bytes
    mins = np.concatenate([q[..., 4:8] & 63, (q[..., 8:12] >> 4) | ((q[..., 4:8] >> 6) << 4)], axis=-1)  # [n, S, 8]
    return torch.from_numpy(np.repeat(dmin * mins, 32, axis=-1).reshape(n, k))


BLOCK_CODED = ("Q4_0", "Q4_1", "Q8_0")  # types read into ``BlockCodes``, streamed by ``stream_linear_q``
CHUNK_BYTES = 8 << 20  # a block-coded tensor is read this much at a time (no whole copy of a large embedding)


def codes_into(raw: torch.Tensor, ggml_type: str, codes: torch.Tensor, scales: torch.Tensor) -> None:
    """Q4_0, Q4_1 or Q8_0 rows (uint8 [n, row bytes]) written as ``eagle.runtime.quant_blocks.BlockCodes``
    into ``codes`` and ``scales`` (the layout ``stream_linear_q`` decodes in registers, faster than
    ``stream_linear_gguf``'s buffer), standing for the very weights gguf-py de-quantizes: Q4_1's codes and
    (d, m) as stored; Q4_0's d (c - 8) as d c + m with m = -8 d (exact in float16); Q8_0's codes with d
    in fp32 [n, K / 32, 1]."""
    n = raw.shape[0]
    size = {"Q8_0": 34, "Q4_1": 20, "Q4_0": 18}[ggml_type]
    head = {"Q8_0": 2, "Q4_1": 4, "Q4_0": 2}[ggml_type]
    blocks = raw.view(n, -1, size)
    codes.view(n, blocks.shape[1], -1).copy_(blocks[..., head:].view(codes.dtype))
    halves = blocks[..., :head].contiguous().view(torch.float16)  # [n, K / 32, 1 or 2]
    if ggml_type == "Q4_0":
        scales[..., :1].copy_(halves)
        scales[..., 1:].copy_(halves * -8)
        if not torch.isfinite(scales).all():
            raise ValueError("a Q4_0 scale too large for float16 after multiplying by -8")
    else:
        scales.copy_(halves)


@dataclasses.dataclass
class Pending:
    """A tensor of a ``BLOCK_CODED`` type not read yet (``_fuse`` reads it where it goes): its entry in the
    file and the row order to apply (None: as stored)."""

    info: TensorInfo
    order: torch.Tensor | None = None

    @property
    def rows(self) -> int:
        return tensor_bytes(self.info)[0]


class _Reader:
    """Reads the tensors of an open GGUF file (``read_tensor``), into ``arena`` where it says."""

    def __init__(self, f: Any, header: GGUFHeader, arena: Arena) -> None:
        self.f, self.header, self.arena = f, header, arena

    def raw_rows(self, info: TensorInfo, start: int, rows: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows start..start+rows of a tensor's GGUF bytes, uint8 [rows, row bytes] (into ``out`` if given)."""
        row_bytes = tensor_bytes(info)[1]
        out = torch.empty(rows, row_bytes, dtype=torch.uint8) if out is None else out
        self.f.seek(self.header.data_offset + info.offset + start * row_bytes)
        if self.f.readinto(memoryview(out.numpy()).cast("B")) != out.numel():
            raise ValueError(f"tensor {info.name} runs past the end of the file")
        return out

    def matrix(self, pending: Pending) -> GGUFMatrix:
        """A pending tensor read as its GGUF rows (in the arena), its row order applied."""
        rows, row_bytes = tensor_bytes(pending.info)
        raw = self.raw_rows(pending.info, 0, rows, self.arena.empty((rows, row_bytes), torch.uint8))
        matrix = GGUFMatrix(raw, pending.info.ggml_type)
        return matrix if pending.order is None else reorder_rows(matrix, pending.order)


def joined_rows(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """Tensors [n_i, ...] concatenated along rows: a view when they are consecutive rows of one contiguous
    tensor (as ``load_gguf_model`` lays out fused products), else a copy."""
    first = parts[0]
    offset = first.storage_offset()
    for t in parts:
        if not t.is_contiguous() or t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() or (
                t.storage_offset() != offset):
            return torch.cat(list(parts))
        offset += t.numel()
    return first.as_strided((sum(t.shape[0] for t in parts), *first.shape[1:]), first.stride())


def _fuse(items: list[Any], reader: _Reader) -> list[Any]:
    """The matrices of one fused product as loaded: when every one is a ``Pending`` block-coded tensor of
    the same kind (8 or 4 bits), their codes and scales written one after the other into the arena, read
    a few MB at a time, and each matrix a view of its rows (the product then reads them with no copy);
    else each as read (GGUF rows, or fp32)."""
    kinds = {("Q8_0" if item.info.ggml_type == "Q8_0" else "Q4") if isinstance(item, Pending) else None
             for item in items}
    if len(kinds) != 1 or None in kinds:
        return [reader.matrix(item) if isinstance(item, Pending) else item for item in items]
    eight = kinds == {"Q8_0"}
    width = items[0].info.shape[0]
    total = sum(item.rows for item in items)
    arena = reader.arena
    fused = BlockCodes(arena.empty((total, width if eight else width // 2), torch.int8 if eight else torch.uint8),
                       arena.empty((total, width // 32, 1 if eight else 2), torch.float32 if eight else torch.float16))
    out, start = [], 0
    for item in items:
        rows, row_bytes = item.rows, tensor_bytes(item.info)[1]
        part = BlockCodes(fused.codes[start:start + rows], fused.scales[start:start + rows])
        step = max(1, CHUNK_BYTES // row_bytes)
        for first in range(0, rows, step):
            n = min(step, rows - first)
            codes_into(reader.raw_rows(item.info, first, n), item.info.ggml_type, part.codes[first:first + n],
                       part.scales[first:first + n])
        if item.order is not None:
            part.codes.copy_(part.codes.index_select(0, item.order))
            part.scales.copy_(part.scales.index_select(0, item.order))
        out.append(part)
        start += rows
    return out


def arena_bytes(header: GGUFHeader) -> int:
    """An upper bound of what ``load_gguf_model`` puts in its arena: the block codes and scales of the
    ``BLOCK_CODED`` tensors (scales 4 bytes a block), the GGUF rows of the other streamed ones."""
    total = 0
    for info in header.tensors:
        rows, row_bytes = tensor_bytes(info)
        if info.ggml_type in BLOCK_CODED:
            blocks = rows * info.shape[0] // 32
            total += Arena.size(blocks * (32 if info.ggml_type == "Q8_0" else 16)) + Arena.size(blocks * 4)
        elif tensor_storage(info.ggml_type) == KEEP_BLOCKS:
            total += Arena.size(rows * row_bytes)
    return total


@dataclasses.dataclass
class GGUFProjection:
    """A linear layer of a GGUF model (what transformers holds as an ``nn.Linear``): ``matrix`` a
    ``GGUFMatrix`` or, for a type that is not streamed, fp32 [N, K]; ``bias`` fp32 [N] or None."""

    matrix: GGUFMatrix | BlockCodes | torch.Tensor
    bias: torch.Tensor | None = None

    @property
    def out_features(self) -> int:
        return rows_of(self.matrix)

    @property
    def weight(self) -> torch.Tensor:
        """fp32 [N, K] (de-quantized on each request when kept as codes: a full-precision copy, for building a
        drafter's head or training, never for decoding)."""
        return dense(self.matrix)


def rows_of(matrix: Any) -> int:
    """The rows of a matrix as loaded (GGUF rows, block codes, fp32, or one not read yet)."""
    if isinstance(matrix, Pending):
        return matrix.rows
    return matrix.out_features if isinstance(matrix, GGUFMatrix) else (
        matrix.codes.shape[0] if isinstance(matrix, BlockCodes) else matrix.shape[0])


def dense(matrix: GGUFMatrix | BlockCodes | torch.Tensor) -> torch.Tensor:
    """A matrix in fp32 [N, K] (de-quantized when kept as codes)."""
    if isinstance(matrix, GGUFMatrix):
        return matrix.dequantize()
    return decode(matrix) if isinstance(matrix, BlockCodes) else matrix


class GGUFLinear:
    """``y = x W^T + b`` with ``W`` the row-wise concatenation of GGUF matrices (a fused q/k/v or
    gate/up whose parts may have different types), multiplied from their codes by the compiled kernel
    (any number of rows, each group of W's rows decoded once for all of them; a row's result does not
    depend on the rows computed with it, so a tree node gets a plain step's bits). Where the kernels do not run, the de-quantized weight and
    ``F.linear``. The attributes ``tune_kernels``, ``to_huge_pages`` and ``kernel_choice`` read of a
    ``PackedLinear`` say it is none of theirs."""

    packed, plain_weight, encoded, stream_op = False, None, None, None
    pad_rows: tuple[int, ...] = ()
    plain_rows: frozenset[int] = frozenset()

    def __init__(self, parts: Sequence[GGUFMatrix], bias: torch.Tensor | None = None, int8: bool = False) -> None:
        """``int8``: the codes meet x quantized to int8 per block of 32 (``int8_activations``: faster, not
        the fp32 product's bits); interleaved Q4_K parts (``GGUFMatrix.interleave``) take only those."""
        self.parts = list(parts)
        if not int8 and any(p.interleaved for p in self.parts):
            raise ValueError("GGUFLinear: interleaved Q4_K rows take int8 activations only")
        self.raws = [p.raw for p in self.parts]
        self.types = [p.type_id for p in self.parts]
        self.in_features = self.parts[0].in_features
        if any(p.in_features != self.in_features for p in self.parts):
            raise ValueError("GGUFLinear: parts must have the same input width")
        self.out_features = sum(p.out_features for p in self.parts)
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.compiled = cpu_kernels()
        self.weight = None if self.compiled is not None else torch.cat([p.dequantize() for p in self.parts])
        self.int8 = int8 and self.compiled is not None

    @classmethod
    def fused(cls, projections: Sequence[GGUFProjection], int8: bool = False) -> "GGUFLinear":
        """One product for several projections reading the same input (all kept as codes)."""
        bias = None
        if any(p.bias is not None for p in projections):
            bias = torch.cat([p.bias if p.bias is not None else torch.zeros(p.out_features) for p in projections])
        return cls([p.matrix for p in projections], bias, int8)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if self.compiled is None:
            return F.linear(x, self.weight, self.bias)
        flat = x.reshape(rows, self.in_features).float().contiguous()
        if rows == 0:
            return flat.new_empty(*x.shape[:-1], self.out_features)
        out = self.compiled.stream_linear_gguf_parts(flat, self.raws, self.types, self.bias, self.int8)
        return out.view(*x.shape[:-1], self.out_features)

    def kernel_product(self) -> tuple:
        """This product as the compiled ``DecoderStack`` takes it: (no weight, no scales, GGUF parts,
        their types, bias, int8 activations)."""
        return None, None, self.raws, self.types, self.bias, self.int8

    def tune_padding(self, *args: Any, **kwargs: Any) -> tuple[int, ...]:
        return ()

    def describe(self) -> str:
        return "+".join(p.ggml_type + ("x8" if p.interleaved else "") for p in self.parts)


class GGUFEmbedding:
    """A token embedding looked up from its GGUF codes: ids [...] -> fp32 [..., H], each row
    de-quantized as gguf-py does, times ``scale`` when given (Gemma's sqrt(hidden), as transformers'
    scaled embedding multiplies in the embedding's dtype)."""

    def __init__(self, matrix: GGUFMatrix | BlockCodes | torch.Tensor, scale: float | None = None) -> None:
        self.matrix = matrix
        self.scale = None if scale is None else torch.tensor(scale)
        self.num_embeddings = self.out_features = rows_of(matrix)
        self.embedding_dim = matrix.in_features if isinstance(matrix, GGUFMatrix) else (
            matrix.codes.shape[1] * (2 if matrix.bits == 4 else 1) if isinstance(matrix, BlockCodes) else matrix.shape[1])

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        index = input_ids.reshape(-1).long().cpu()
        if isinstance(self.matrix, GGUFMatrix):
            rows = self.matrix.rows(index)
        elif isinstance(self.matrix, BlockCodes):  # d c (+ m): gguf-py's values (d c is exact)
            rows = decode(BlockCodes(self.matrix.codes.index_select(0, index), self.matrix.scales.index_select(0, index)))
        else:
            rows = self.matrix.index_select(0, index)
        rows = rows.view(*input_ids.shape, self.embedding_dim)
        return rows if self.scale is None else rows * self.scale.to(rows.dtype)

    @property
    def weight(self) -> torch.Tensor:
        """The whole embedding matrix in fp32 [V, H], unscaled (a full-precision copy, made on each request:
        for building a drafter's head or training, never for decoding)."""
        return dense(self.matrix)


class GGUFModel:
    """What the lean forwards and ``eagle.runtime.target.Target`` read of a transformers causal LM, for
    weights kept as GGUF codes: ``config``, ``generation_config``, ``model`` (``embed_tokens``,
    ``rotary_emb``, ``norm``, ``layers`` with transformers' attribute names), ``get_input_embeddings()``
    (a ``GGUFEmbedding``) and ``get_output_embeddings()`` (a ``GGUFProjection``; the embedding's codes
    when tied). It has no forward of its own: the lean forward is the only one."""

    def __init__(self, config: Any, generation_config: Any, model: Any, head: GGUFProjection,
                 storage: dict[str, str], huge_pages: bool = False) -> None:
        self.config, self.generation_config, self.model, self.head = config, generation_config, model, head
        self.storage = storage  # GGML type -> how its tensors are held (``gguf_file.tensor_storage``)
        self.huge_pages = huge_pages  # the streamed codes were read into huge pages (no copy to make there)

    @property
    def tied_embeddings(self) -> bool:
        """Whether the LM head multiplies the embedding's own codes."""
        return self.head.matrix is self.model.embed_tokens.matrix

    def get_input_embeddings(self) -> GGUFEmbedding:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> GGUFProjection:
        return self.head

    def nbytes(self) -> int:
        """Bytes of the weights held (codes and fp32 tensors; the tied embedding counted once)."""
        seen = {t.data_ptr(): t.numel() * t.element_size() for t in _tensors([self.model, self.head])}
        return sum(seen.values())


def _tensors(obj: Any) -> Any:
    """The tensors held by ``obj`` (namespaces, projections, matrices, embeddings, lists), recursively."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, GGUFMatrix):
        yield obj.raw
    elif isinstance(obj, BlockCodes):
        yield from (obj.codes, obj.scales)
    elif isinstance(obj, GGUFEmbedding):
        yield from _tensors(obj.matrix)
    elif isinstance(obj, (GGUFProjection, SimpleNamespace)):
        for value in vars(obj).values():
            yield from _tensors(value)
    elif isinstance(obj, list):
        for value in obj:
            yield from _tensors(value)


def tensor_bytes(info: TensorInfo) -> tuple[int, int]:
    """(rows, bytes a row) of a tensor in the file: rows = the product of its shape but the first
    (GGUF's fastest-varying) dimension."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    weights, size = GGML_QUANT_SIZES[GGMLQuantizationType[info.ggml_type]]
    return math.prod(info.shape[1:]), info.shape[0] // weights * size


def read_tensor(reader: _Reader, info: TensorInfo) -> GGUFMatrix | Pending | torch.Tensor:
    """One tensor of the file: a ``Pending`` one for a ``BLOCK_CODED`` type (read where it goes), a
    ``GGUFMatrix`` [N, row bytes] for another streamed type (read into the arena), else fp32 in
    transformers' shape (GGUF's shape reversed), de-quantized by gguf-py. Read straight into its buffer
    (no mapping of the file stays behind)."""
    if info.ggml_type in BLOCK_CODED:
        return Pending(info)
    if tensor_storage(info.ggml_type) == KEEP_BLOCKS:
        return reader.matrix(Pending(info))
    return dense_tensor(reader, info)


def dense_tensor(reader: _Reader, info: TensorInfo) -> torch.Tensor:
    """One tensor of the file in fp32, in transformers' shape (GGUF's shape reversed), de-quantized by
    gguf-py (F32 as stored)."""
    raw = reader.raw_rows(info, 0, tensor_bytes(info)[0])
    if info.ggml_type == "F32":
        values = raw.view(torch.float32)
    else:
        values = torch.from_numpy(dequantize_numpy(raw.numpy(), info.ggml_type))
    return values.reshape(tuple(reversed(info.shape)))


def llama_row_order(rows: int, heads: int) -> torch.Tensor:
    """transformers' order of a llama GGUF's q or k rows: index [rows] into the file's rows (llama.cpp
    stores each head's rotary halves interleaved; transformers' ``_reverse_permute_weights``)."""
    return torch.arange(rows).reshape(heads, rows // heads // 2, 2).transpose(1, 2).reshape(-1)


def reorder_rows(t: GGUFMatrix | Pending | torch.Tensor | None, order: torch.Tensor) -> Any:
    """Rows ``order`` of a matrix (a pending one: applied when read)."""
    if t is None:
        return None
    if isinstance(t, Pending):
        return Pending(t.info, order)
    if isinstance(t, GGUFMatrix):
        return t.pick(order)
    return t.index_select(0, order)


_LLAMA_LAYER = {"self_attn": {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output"},
                "mlp": {"gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}}
_LLAMA_NORMS = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
_GEMMA_NORMS = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
                "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}
_HEAD_NORMS = {"q_norm": "attn_q_norm", "k_norm": "attn_k_norm"}  # Gemma-3's and Qwen3's per-head RMSNorms


class Rotary:
    """RoPE's cos and sin as transformers' rotary embedding of a Llama, Qwen2/3 or Gemma-3 config computes them
    (for the rope types whose inverse frequencies do not change with the length), without importing its
    modeling module (about 130 MB of imports): ``rotary(x, position_ids[, layer_type])`` -> cos, sin
    [..., head_dim] in ``x``'s dtype. ``layer_type``: Gemma-3's "sliding_attention" or "full_attention"."""

    STATIC = ("default", "linear", "llama3", "yarn")

    def __init__(self, config: Any) -> None:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        types = sorted(set(config.layer_types)) if config.model_type == "gemma3_text" else [None]
        self.tables = {}
        for layer_type in types:
            params = config.rope_parameters if layer_type is None else config.rope_parameters[layer_type]
            if params["rope_type"] == "default":
                dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
                inv_freq = 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
                self.tables[layer_type] = inv_freq, 1.0
            elif layer_type is None:
                self.tables[layer_type] = ROPE_INIT_FUNCTIONS[params["rope_type"]](config)
            else:
                self.tables[layer_type] = ROPE_INIT_FUNCTIONS[params["rope_type"]](config, layer_type=layer_type)

    @classmethod
    def serves(cls, config: Any) -> bool:
        params = config.rope_parameters
        if config.model_type == "gemma3_text":
            return all(params.get(t) is not None and params[t]["rope_type"] in cls.STATIC
                       for t in set(config.layer_types))
        return config.model_type in LLAMA_FAMILY and params["rope_type"] in cls.STATIC

    def __call__(self, x: torch.Tensor, position_ids: torch.Tensor,
                 layer_type: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq, scaling = self.tables[layer_type]
        freqs = position_ids[..., None].float() * inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * scaling).to(dtype=x.dtype), (emb.sin() * scaling).to(dtype=x.dtype)


def rotary_and_scale(config: Any) -> tuple[Any, float | None]:
    """The rotary embedding of ``config``'s model and the scale of its token embedding (Gemma's
    sqrt(hidden), else None): ``Rotary`` where it serves, else transformers' own module classes."""
    if Rotary.serves(config):
        return Rotary(config), (config.hidden_size ** 0.5 if config.model_type == "gemma3_text" else None)
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):  # the module classes, for the rotary embedding and the embedding's scale
        skeleton = AutoModelForCausalLM.from_config(config)
    return type(skeleton.model.rotary_emb)(config=config), getattr(skeleton.model.embed_tokens,
                                                                    "scalar_embed_scale", None)


def load_gguf_model(path: str | Path, config: Any, generation_config: Any,
                    header: GGUFHeader | None = None, interleave: bool = False) -> GGUFModel:
    """The weights of GGUF file ``path`` (architectures of ``gguf_file.ARCHITECTURES``) for ``config``
    (the transformers config its metadata gives), kept as codes where streamed. ``interleave``: the decoder
    layers' and the head's Q4_K and Q6_K matrices are interleaved (``GGUFMatrix.interleave``), for a model whose products take int8
    activations only."""
    header = header or check_gguf(path)
    arena = Arena(arena_bytes(header))  # what the kernels stream, in huge pages (eagle.runtime.huge_pages)
    with open(path, "rb") as f:
        model = _load(_Reader(f, header, arena), path, config, generation_config)
    if interleave:
        projections = [p for layer in model.model.layers for group in (layer.self_attn, layer.mlp)
                       for p in vars(group).values()] + [model.head]
        for projection in projections:
            if isinstance(projection, GGUFProjection) and isinstance(projection.matrix, GGUFMatrix):
                projection.matrix.interleave()
    return model


def _load(reader: _Reader, path: str | Path, config: Any, generation_config: Any) -> GGUFModel:
    header, arena = reader.header, reader.arena
    arch = header.architecture
    gemma = arch == "gemma3"
    tensors = {info.name: read_tensor(reader, info) for info in header.tensors}

    def take(name: str, required: bool = True) -> Any:
        if name not in tensors and required:
            raise ValueError(f"GGUF file {Path(path).name} has no tensor {name}")
        return tensors.pop(name, None)

    def norm(name: str) -> SimpleNamespace:
        weight = take(name).float()
        if gemma:  # stored as 1 + w; transformers' reader subtracts the 1 (in fp32)
            weight = weight - 1
        return SimpleNamespace(weight=weight, variance_epsilon=config.rms_norm_eps)

    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    layers = []
    for i in range(config.num_hidden_layers):
        layer = SimpleNamespace(**{attr: norm(f"blk.{i}.{name}.weight")
                                   for attr, name in (_GEMMA_NORMS if gemma else _LLAMA_NORMS).items()})
        for group, names in _LLAMA_LAYER.items():
            read = {}
            for attr, name in names.items():
                weight, bias = take(f"blk.{i}.{name}.weight"), take(f"blk.{i}.{name}.bias", required=False)
                if arch == "llama" and name in ("attn_q", "attn_k"):
                    order = llama_row_order(rows_of(weight), heads if name == "attn_q" else kv_heads)
                    weight, bias = reorder_rows(weight, order), reorder_rows(bias, order)
                read[attr] = (weight, None if bias is None else bias.float())
            fused = [[a for a in FUSED if a in read] for FUSED in (("q_proj", "k_proj", "v_proj"),
                                                                  ("gate_proj", "up_proj"), ("o_proj",), ("down_proj",))]
            projections = {}
            for attrs in fused:
                if attrs:
                    for attr, matrix in zip(attrs, _fuse([read[a][0] for a in attrs], reader)):
                        projections[attr] = GGUFProjection(matrix, read[attr][1])
            if arch in ("gemma3", "qwen3") and group == "self_attn":
                projections.update({attr: norm(f"blk.{i}.{name}.weight") for attr, name in _HEAD_NORMS.items()})
            setattr(layer, group, SimpleNamespace(**projections))
        layers.append(layer)

    rotary, scale = rotary_and_scale(config)
    embedding = _fuse([take("token_embd.weight")], reader)[0]
    output = take("output.weight", required=False)
    output = None if output is None else _fuse([output], reader)[0]
    head = GGUFProjection(embedding if output is None else output)  # tied: the embedding's codes
    inner = SimpleNamespace(embed_tokens=GGUFEmbedding(embedding, scale), rotary_emb=rotary,
                            norm=norm("output_norm.weight"), layers=layers)
    left = sorted(name for name in tensors if not name.startswith("rope_"))
    if left:
        raise ValueError(f"GGUF file {Path(path).name}: tensors eagle does not read: {', '.join(left[:5])}")
    storage = {info.ggml_type: tensor_storage(info.ggml_type) for info in header.tensors}
    return GGUFModel(config, generation_config, inner, head, storage, huge_pages=arena.region is not None)


def hf_state_dict(path: str | Path, header: GGUFHeader, config: Any) -> dict[str, torch.Tensor]:
    """The fp32 weights of a GGUF file of ``LLAMA_FAMILY`` by transformers' names, as its own
    GGUF reader gives them (gguf-py's de-quantization; a llama file's q and k rows in transformers'
    order) without that reader's parse of the whole metadata (half a minute for a 49k vocabulary).
    No ``lm_head.weight`` where the file ties the head to the embedding. A tensor it does not know
    is a ``ValueError``."""
    if header.architecture not in LLAMA_FAMILY:
        raise ValueError(f"hf_state_dict converts {', '.join(LLAMA_FAMILY)} files, not {header.architecture}")
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    names: dict[str, tuple[str, int | None]] = {"token_embd.weight": ("model.embed_tokens.weight", None),
                                                "output_norm.weight": ("model.norm.weight", None),
                                                "output.weight": ("lm_head.weight", None)}
    for i in range(config.num_hidden_layers):
        for attr, name in _LLAMA_NORMS.items():
            names[f"blk.{i}.{name}.weight"] = (f"model.layers.{i}.{attr}.weight", None)
        if header.architecture == "qwen3":
            for attr, name in _HEAD_NORMS.items():
                names[f"blk.{i}.{name}.weight"] = (f"model.layers.{i}.self_attn.{attr}.weight", None)
        for group, projections in _LLAMA_LAYER.items():
            for attr, name in projections.items():
                permute = {"attn_q": heads, "attn_k": kv_heads}.get(name) if header.architecture == "llama" else None
                for part in ("weight", "bias"):
                    names[f"blk.{i}.{name}.{part}"] = (f"model.layers.{i}.{group}.{attr}.{part}", permute)
    state = {}
    with open(path, "rb") as f:
        reader = _Reader(f, header, Arena(0))
        for info in header.tensors:
            if info.name.startswith("rope_"):
                continue
            if info.name not in names:
                raise ValueError(f"GGUF file {Path(path).name}: tensor {info.name} has no transformers name here")
            values = dense_tensor(reader, info)
            name, permute = names[info.name]
            if permute is not None:
                values = values[llama_row_order(values.shape[0], permute)]
            state[name] = values.contiguous()
    return state
