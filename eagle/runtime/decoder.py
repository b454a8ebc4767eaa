"""A lean inference forward for Llama-family targets, and prepacked linear layers.

``LeanDecoder`` does the arithmetic of transformers' Llama/Qwen2/Qwen3 decoder (RMSNorm, RoPE from the
model's own rotary module, grouped-query SDPA, SiLU-gated MLP; Qwen3's RMSNorm on each query and key
head) with fewer, larger operations: q/k/v and gate/up fused into one matrix each, keys and values
written by position into a ``StaticCache``, masks passed in. It reads the weights of an unmodified transformers model, which
stays usable (its own forward is the reference in the tests). In fp32 on AVX-512 CPUs one sequence
of 1-16 tokens (decoding, tree verification) runs each decoder layer as one compiled call
(``eagle.runtime.kernels``) whose rows do not depend on each other, so a tree node gets the plain
step's bits; weights that are exact block encodings (a dequantized GGUF target's) are streamed
from their codes (``eagle.runtime.quant_blocks``). Greedy decoding takes the head's argmax from a bf16
copy with an exact fp32 recheck (``GreedyHead``), or, for a large head of 8-bit codes, from the int8 products of
the same codes with that recheck (``CodesGreedyHead``).

``PackedLinear``: ``y = x W^T + b`` with the weight prepacked for oneDNN on CPU, products of 1-16 rows
by the compiled kernel where it runs, and ``F.linear`` elsewhere (CUDA); ``tune_kernels`` picks
oneDNN or ``F.linear`` per row count by timing both on this machine. Measurements: docs/performance.md."""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import statistics
import time
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from eagle.cache_dir import keep_measurement, measurement_path
from eagle.errors import EagleError
from eagle.runtime.kernels import (STREAM_MAX_ROWS, attention_fits, cpu_kernels, runs_stack, source_digest,
                                   stream_linear_op)
from eagle.runtime.kv_cache import StaticCache
from eagle.runtime.huge_pages import huge_page_copies
from eagle.runtime.quant_blocks import BlockCodes, block_encode, block_quantize, decode
from eagle.runtime.gguf_file import LLAMA_FAMILY
from eagle.runtime.gguf_weights import (GGUFLinear, GGUFMatrix, GGUFModel, GGUFProjection, SPLIT_TYPES, int8_block,
                                        joined_rows, split_norms)
from eagle.runtime.layers import llama_layer, rms_norm, rotate, silu_mul, with_aux  # noqa: F401 - re-exported
from eagle.runtime.masks import causal_bias


def cpu_has_fast_bf16() -> bool:
    """Whether oneDNN runs bf16 matrix products natively on this CPU (AVX512-BF16 or AMX)."""
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported")
            and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()))


def _onednn_usable(weight: torch.Tensor) -> bool:
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available() or not hasattr(
            torch.ops.mkldnn, "_linear_pointwise"):
        return False
    return weight.dtype == torch.float32 or weight.dtype == torch.bfloat16 and cpu_has_fast_bf16()


def interleaved_medians(calls: dict[Any, Callable[[], Any]], rounds: int) -> dict[Any, float]:
    """Median seconds of each call over ``rounds`` rounds, the calls interleaved within a round so
    that drift of the machine hits all alike. {key: call} -> {key: seconds}."""
    seconds: dict[Any, list[float]] = {key: [] for key in calls}
    for _ in range(rounds):
        for key, call in calls.items():
            start = time.perf_counter()
            call()
            seconds[key].append(time.perf_counter() - start)
    return {key: statistics.median(times) for key, times in seconds.items()}


class PackedLinear(nn.Module):
    """``y = x W^T + b`` for inference, with ``W`` [out, in] prepacked for oneDNN when usable.

    ``pad_rows`` (set by ``tune_padding``): ``pad_rows[n]`` is how many rows to compute when
    given ``n`` (zero rows appended, their outputs dropped). oneDNN picks its kernel by row count,
    and for a wide matrix a few rows can cost less than one."""

    int8 = False  # int8 activations: the codes meet x quantized per block of 32 (``int8_activations``)

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, stream: bool = True,
                 encode: bool = True, once: bool = False, int8: bool = False) -> None:
        """``once``: the weight is read once per forward (a target's): the streamed kernel fetches it
        so as to keep what is read again soon (a drafter's weights, the KV cache) in the caches.
        ``int8``: where the weight is streamed from its codes, multiply them by x quantized to int8
        (``eagle.runtime.kernels``: faster, not the fp32 product's bits)."""
        super().__init__()
        self.once = once
        weight = weight.detach().contiguous()
        self.packed = _onednn_usable(weight)
        self.in_features = weight.shape[1]
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight) if self.packed else weight
        self.bias = None if bias is None else bias.detach().contiguous()
        # fp32 on an AVX-512 CPU: 1-16 rows by the streamed kernel (``eagle.runtime.kernels``), more by oneDNN
        self.stream_op = stream_linear_op() if stream and weight.dtype == torch.float32 and (
            weight.device.type == "cpu") else None
        # a weight that is an exact block encoding (a dequantized GGUF target's) is streamed from its
        # codes: the same bits for a sixth (4-bit) or 28% (8-bit) of the memory traffic (``eagle.runtime.quant_blocks``)
        self.encoded = block_encode(weight) if self.stream_op is not None and encode else None
        self.pad_rows: tuple[int, ...] = ()
        # the unpacked weight, for the streamed kernel or the row counts ``F.linear`` computes faster
        # (``tune_kernels``, below); dropped when neither uses it
        self.plain_weight: torch.Tensor | None = weight if self.encoded is None and (
            self.packed or self.stream_op is not None) else None
        self.plain_rows: frozenset[int] = frozenset()
        self.int8 = int8 and self.encoded is not None

    @classmethod
    def fused(cls, linears: list[nn.Linear], stream: bool = True, encode: bool = True,
              once: bool = False, int8: bool = False) -> "PackedLinear":
        """One matrix for several linears reading the same input; outputs concatenated."""
        biases = [lin.bias for lin in linears]
        bias = None
        if any(b is not None for b in biases):
            bias = torch.cat([b.detach() if b is not None else lin.weight.new_zeros(lin.out_features)
                              for b, lin in zip(biases, linears)])
        return cls(torch.cat([lin.weight.detach() for lin in linears]), bias, stream, encode, once, int8)

    @classmethod
    def quantized(cls, weight: Any, bias: torch.Tensor | None, bits: int) -> "PackedLinear":
        """``weight`` [out, in] rounded to its nearest block encoding (``eagle.runtime.quant_blocks.block_quantize``,
        lossy: for a drafter, whose precision never changes the output), in fp32: the product of the
        quantized weight, streamed from its codes where the compiled kernels run (1.125 or 0.625
        bytes a weight against bf16's 2; no fp32 copy is kept, so more than 16 rows are computed 16 at a time),
        else computed from the decoded weight. ``weight`` may be anything ``block_quantize`` reads a few rows at
        a time (a file's rows), or its ``BlockCodes`` already (a CPU weight's: taken as they are)."""
        codes = weight if isinstance(weight, BlockCodes) else block_quantize(weight.detach(), bits)
        bias = None if bias is None else bias.detach().float()
        if codes.codes.device.type == "cpu" and stream_linear_op() is not None:
            return cls.from_codes(codes, bias, once=False)  # a drafter's weights are read again soon
        return cls(decode(codes), bias, encode=False)

    @classmethod
    def from_codes(cls, codes: BlockCodes, bias: torch.Tensor | None = None, int8: bool = False,
                   once: bool = True) -> "PackedLinear":
        """The product of a weight given only by its block codes (a GGUF target's Q4_0, Q4_1, Q8_0 matrices,
        ``eagle.runtime.gguf_weights``), streamed from them for any number of rows, no fp32
        copy made; where the compiled kernels do not run, ``F.linear`` on the decoded weight. ``int8``, ``once``:
        as for ``PackedLinear`` (a target's weights by default: read once per forward)."""
        linear = cls.__new__(cls)
        nn.Module.__init__(linear)
        linear.once, linear.packed, linear.pad_rows, linear.plain_rows = once, False, (), frozenset()
        linear.in_features = codes.codes.shape[1] * (2 if codes.bits == 4 else 1)
        linear.bias = None if bias is None else bias.detach().float().contiguous()
        linear.stream_op, linear.plain_weight = stream_linear_op(), None
        linear.encoded = codes if linear.stream_op is not None else None
        linear.weight = None if linear.stream_op is not None else decode(codes)
        linear.int8 = int8 and linear.encoded is not None
        return linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if self.int8:  # any number of rows in one call, each with the bits it has alone
            out = self.stream(x.reshape(rows, self.in_features).contiguous())
            return out.view(*x.shape[:-1], out.shape[-1])
        if self.stream_op is not None and 0 < rows <= STREAM_MAX_ROWS:
            return self.stream(x.reshape(rows, self.in_features).contiguous()).view(*x.shape[:-1], -1)
        if self.weight is None:  # codes only (``from_codes``): as many rows a call as the kernel takes
            flat = x.reshape(rows, self.in_features).contiguous()
            if rows == 0:
                return flat.new_empty(*x.shape[:-1], self.encoded.codes.shape[0])
            parts = flat.split(cpu_kernels().stream_rows_q)  # the weight is None only where codes are streamed
            out = self.stream(parts[0]) if len(parts) == 1 else torch.cat([self.stream(part) for part in parts])
            return out.view(*x.shape[:-1], -1)  # one part not copied: a large vocabulary's logits are megabytes a row
        if not self.packed:
            return F.linear(x, self.weight, self.bias)
        if rows in self.plain_rows:
            return F.linear(x, self.plain_weight, self.bias)
        if 0 < rows < len(self.pad_rows) and self.pad_rows[rows] > rows:
            flat = torch.cat([x.reshape(rows, -1), x.new_zeros(self.pad_rows[rows] - rows, self.in_features)])
            return self._product(flat)[:rows].reshape(*x.shape[:-1], -1)
        return self._product(x.contiguous())

    def stream(self, x: torch.Tensor) -> torch.Tensor:
        """The streamed kernel's product of 1-16 contiguous rows [M, in] -> [M, out], from the codes
        where the weight has an exact block encoding (the same bits)."""
        if self.encoded is not None:
            return cpu_kernels().stream_linear_q(x, self.encoded.codes, self.encoded.scales, self.bias, self.once,
                                                 self.int8)
        return self.stream_op(x, self.plain_weight, self.bias, self.once)

    def kernel_weight(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What the compiled layer reads for this matrix: (codes, scales), or (fp32 weight, None)."""
        if self.encoded is not None:
            return self.encoded.codes, self.encoded.scales
        return self.plain_weight, None

    def kernel_product(self) -> tuple:
        """This product as the compiled ``DecoderStack`` takes it: (weight or codes, scales or None, no GGUF
        parts, no types, bias, int8 activations)."""
        return (*self.kernel_weight(), [], [], self.bias, self.int8)

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")

    @torch.inference_mode()
    def tune_padding(self, max_rows: int = 8, rounds: int = 5, margin: float = 0.05) -> tuple[int, ...]:
        """Measure the product at 1..``max_rows`` rows and set ``pad_rows``: for each row count the
        size (no more than ``max_rows``) that runs fastest, kept only when it beats no padding by
        ``margin`` and gives bit-identical outputs for the real rows (checked here; oneDNN's
        reduction order does not depend on the data), so padding changes speed, never results.
        Returns ``pad_rows`` (empty where nothing is packed or the streamed kernel computes these rows)."""
        if not self.packed or self.stream_op is not None and max_rows <= STREAM_MAX_ROWS:
            return self.pad_rows
        self.pad_rows = ()
        x = torch.randn(max_rows, self.in_features, generator=torch.Generator().manual_seed(0)).to(self.weight.dtype)
        cost = interleaved_medians({m: lambda m=m: self._product(x[:m]) for m in range(1, max_rows + 1)}, rounds)
        table = [0]
        for n in range(1, max_rows + 1):
            faster = sorted((m for m in range(n + 1, max_rows + 1) if cost[m] < (1 - margin) * cost[n]),
                            key=cost.__getitem__)
            plain = self._product(x[:n]) if faster else None
            exact = (m for m in faster if torch.equal(self._product(x[:m])[:n], plain))
            table.append(next(exact, n))
        self.pad_rows = tuple(table)
        return self.pad_rows

    def adopt_kernels(self, plain_rows: frozenset[int]) -> None:
        """Set ``plain_rows`` (as ``tune_kernels`` measured them for this matrix's shape); drop
        the unpacked weight if no row count uses it."""
        self.plain_rows = plain_rows if self.plain_weight is not None else frozenset()
        if not self.plain_rows and self.stream_op is None:
            self.plain_weight = None


def twice_sum_rounding(k: int) -> float:
    """g = 2 K u / (1 - K u), u = 2^-24: twice the relative bound on an fp32 sum of K products rounded at most K
    times (the greedy heads' margin for the fp32 logits and their approximations alike)."""
    u = 2.0 ** -24
    return 2 * k * u / (1 - k * u)


def argmax_of_candidates(keep: torch.Tensor, exact: Callable[[torch.Tensor | None], torch.Tensor]) -> torch.Tensor:
    """Each row's largest exact logit among its candidates ``keep`` [N, V] (bool; a sound screen keeps every row's
    true best, so this is the argmax of all its logits, the first of equal ones): ``exact(tokens)`` -> the exact
    logits [N, len(tokens)] of the union of the rows' candidates, or, with None, of the whole vocabulary [N, V] (used
    where the candidates are over an eighth of it, the whole head costing less than gathering their rows, or none,
    as for logits that are not finite)."""
    tokens = keep.any(dim=0).nonzero()[:, 0]  # the union of the rows' candidates, in order
    if tokens.shape[0] == 0 or tokens.shape[0] > keep.shape[1] // 8:
        return exact(None).argmax(dim=1)
    return tokens[exact(tokens).masked_fill(~keep[:, tokens], -torch.inf).argmax(dim=1)]


class GreedyHead:
    """The argmax of an fp32 LM head's logits (as ``head`` computes them with the streamed kernel),
    exactly, for half the memory traffic: logits from a bf16 copy of the head (oneDNN), a bound E on
    how far each can be from the fp32 one, and the fp32 logits of only the tokens within 2E of the
    best approximate one (the true argmax is always among them), computed by the same kernel on
    their rows (each output is summed in one order whatever rows come with it: the same bits).

    With A the bf16 logits, r the fp32 ones and s the exact x w^T, for every token j:
    |r_j - s_j| <= g |x| |w_j| (a sum of K products rounded at most K times, g = K u / (1 - K u),
    u = 2^-24); |s_j - x_b w_b,j| <= |x| |w_j - w_b,j| + |x - x_b| |w_b,j|; oneDNN's sum of the exact
    bf16 products is within g |x_b| |w_b,j| of x_b w_b,j, and rounding it to bf16 moves it by at
    most 2^-9 of itself. E takes each norm's maximum over the vocabulary, doubles g, adds 2^-8 |A|
    and a margin. Typically only a few tokens per row are recomputed."""

    def __init__(self, head: PackedLinear) -> None:
        if head.stream_op is None or head.plain_weight is None:
            raise ValueError("GreedyHead needs a head computed by the streamed kernel")
        self.head = head
        weight = head.plain_weight
        low = weight.bfloat16()
        self.approx = PackedLinear(low, None if head.bias is None else head.bias.bfloat16(), stream=False)
        exact, rounded = weight.double(), low.double()
        self.gamma = twice_sum_rounding(weight.shape[1])
        self.max_norm = float(exact.norm(dim=1).max())
        self.max_low_norm = float(rounded.norm(dim=1).max())
        self.max_error_norm = float((exact - rounded).norm(dim=1).max())

    @torch.inference_mode()
    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """Features [N, K] (fp32) -> the index of each row's largest fp32 logit [N] (the first of
        equal ones, as ``argmax``)."""
        x = hidden.reshape(-1, self.head.in_features).float().contiguous()
        if x.shape[0] == 0:
            return torch.zeros(0, dtype=torch.long, device=x.device)
        low = x.bfloat16()
        approx = self.approx(low).float()  # [N, V]
        x64, low64 = x.double(), low.double()
        norm, low_norm, off = x64.norm(dim=1), low64.norm(dim=1), (x64 - low64).norm(dim=1)
        bound = (approx.abs().amax(dim=1).double() * 2.0 ** -8
                 + self.gamma * (low_norm * self.max_low_norm + norm * self.max_norm)
                 + norm * self.max_error_norm + off * self.max_low_norm) * 1.001 + 1e-6
        floor = (approx.amax(dim=1).double() - 2 * bound).float()

        def exact(tokens: torch.Tensor | None) -> torch.Tensor:
            weight, bias = self.head.plain_weight, self.head.bias
            if tokens is not None:
                weight = weight.index_select(0, tokens)
                bias = None if bias is None else bias.index_select(0, tokens)
            return torch.cat([self.head.stream_op(rows.contiguous(), weight, bias) for rows in x.split(STREAM_MAX_ROWS)])

        return argmax_of_candidates(approx >= floor[:, None], exact)


class CodesGreedyHead:
    """The argmax of an LM head read from codes (its fp32 logits, as ``head`` computes them), exactly, for less
    arithmetic: logits from the same codes with x quantized to int8 (the compiled int8 products), a bound on how far
    each can be from the fp32 one, and the fp32 logits of only the tokens the bound leaves within reach of the best
    (the true argmax is always among them), computed by the same kernel on their rows of codes (an output's sum does
    not depend on the other rows: the same bits). ``head``: a ``PackedLinear`` of 8-bit block codes (a GGUF's Q8_0
    head, Gemma-3's tied embedding) or a ``GGUFLinear`` of one GGUF matrix of a type ``split_norms`` knows (Qwen's
    Q6_K head): ``screenable``.

    With A the int8 logits, r the fp32 ones, s the exact x w^T and x' x as the int8 products see it (each block's
    codes times its scale): A sums products of x' and the two parts of w = a - b (a: codes times scales, b: the
    minimums; exact integer sums, then their scales) in fp32, so |A_j - s_j| <= |x - x'| |w_j| + g |x'| (|a_j| +
    |b_j|), and |r_j - s_j| <= g |x| |w_j| (g = 2 K u / (1 - K u), u = 2^-24: twice a K-term sum's bound). With
    c = (|x - x'|, g (|x'| + |x|)) and per-token norms n = (|w_j|, |a_j| + |b_j|) computed once, the argmax j* of r
    has A_j* + c n_j* >= max_i (A_i - c n_i). Where x holds no finite value, or the bound leaves an eighth of the
    vocabulary, the whole head decides; so it does for more than ``max_rows`` rows (None: no limit;
    ``codes_greedy_head`` sets it to where the screen measured faster)."""

    SLACK = 2.0 ** -20  # fp32 roundings of A +- c |w| and of their maximum, relative to the largest of them

    def __init__(self, head: "PackedLinear | GGUFLinear", max_rows: int | None = None) -> None:
        compiled = cpu_kernels()
        if not screenable(head):
            raise ValueError("CodesGreedyHead needs a head streamed from 8-bit block codes or one GGUF matrix of "
                             f"{', '.join(SPLIT_TYPES)}, and the int8 products")
        self.head, self.compiled, self.max_rows = head, compiled, max_rows
        gguf = isinstance(head, GGUFLinear)
        # [2, V]; for block codes, whose two norms are one (no minimums), [V] with the radius' terms summed
        norms = split_norms(head.parts[0]) if gguf else row_norms(head.encoded)
        self.norms = (norms * (1 + 2.0 ** -10)).contiguous()  # fp32 sums of K squares: within K u of the exact ones
        self.gamma = twice_sum_rounding(head.in_features)
        self.block = int8_block(head.parts[0].ggml_type) if gguf else 32

    def _approx(self, x: torch.Tensor) -> torch.Tensor:
        """The int8 logits [N, V]."""
        head = self.head
        if isinstance(head, GGUFLinear):
            return self.compiled.stream_linear_gguf_parts(x, head.raws, head.types, head.bias, True)
        return self.compiled.stream_linear_q(x, head.encoded.codes, head.encoded.scales, head.bias, True, True)

    def _exact(self, x: torch.Tensor, tokens: torch.Tensor | None) -> torch.Tensor:
        """The fp32 logits of ``tokens`` [N, len(tokens)] (None: of all), the head's own bits."""
        head = self.head
        if tokens is None:
            return head(x)
        bias = None if head.bias is None else head.bias.index_select(0, tokens)
        if isinstance(head, GGUFLinear):
            rows = head.parts[0].pick(tokens)
            return self.compiled.stream_linear_gguf(x, rows.raw, rows.type_id, bias, False)
        codes = head.encoded  # read at each call: it may have moved (huge pages)
        return PackedLinear.from_codes(BlockCodes(codes.codes.index_select(0, tokens),
                                                  codes.scales.index_select(0, tokens)), bias)(x)

    def whole(self, x: torch.Tensor) -> torch.Tensor:
        """The argmax of the whole head's fp32 logits [N] for rows x [N, K], unscreened."""
        return head_argmax(self.head, x, self.compiled.argmax_rows)

    def radius(self, x: torch.Tensor) -> torch.Tensor:
        """c [N, 2] (float64) for fp32 rows x [N, K]: each int8 logit is within c0 n0_j + c1 n1_j of the fp32 one
        (with a margin; n: ``norms`` [2, V]), x' taken as the int8 products quantize it; with ``norms`` [V] (block
        codes) c [N], the two terms summed."""
        c = self.compiled.int8_radius(x, self.gamma, self.block)
        return c if self.norms.dim() == 2 else c.sum(dim=1)

    def bound(self, x: torch.Tensor) -> torch.Tensor:
        """How far each int8 logit of rows x [N, K] can be from the fp32 one: float64 [N, V]."""
        c, n = self.radius(x), self.norms.double()
        return c @ n if n.dim() == 2 else torch.outer(c, n)

    @torch.inference_mode()
    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """Features [N, K] (fp32) -> the index of each row's largest fp32 logit [N] (the first of equal ones,
        as ``argmax``)."""
        x = hidden.reshape(-1, self.head.in_features).float().contiguous()
        n = x.shape[0]
        if n == 0:
            return torch.zeros(0, dtype=torch.long, device=x.device)
        if self.max_rows is not None and n > self.max_rows:
            return self.whole(x)
        approx = self._approx(x)  # [N, V]
        # the tokens within reach of each row's best (A_j + c n_j >= max_i (A_i - c n_i), with a slack for
        # fp32 roundings), in one compiled pass; none where the whole head decides (an eighth of the vocabulary)
        tokens, keep = self.compiled.screen_candidates(approx, self.radius(x).float(), self.norms, self.SLACK,
                                                       approx.shape[1] // 8)
        if tokens.shape[0] == 0:
            return self.whole(x)
        return tokens[self._exact(x, tokens).masked_fill(~keep, -torch.inf).argmax(dim=1)]


def screenable(head: Any) -> bool:
    """Whether ``CodesGreedyHead`` takes ``head``: fp32 products (not int8 activations) from 8-bit block codes or
    from one GGUF matrix of ``SPLIT_TYPES``, where the compiled int8 products run."""
    compiled = cpu_kernels()
    if compiled is None or not compiled.int8_activations or head.int8:
        return False
    if isinstance(head, GGUFLinear):
        return len(head.parts) == 1 and head.parts[0].ggml_type in SPLIT_TYPES
    return head.encoded is not None and head.encoded.bits == 8


def row_norms(codes: BlockCodes, rows: int = 1024) -> torch.Tensor:
    """The Euclidean norm of each row of the weight 8-bit ``codes`` stand for [N], in fp32, ``rows`` at a time
    through one buffer (a new temporary per slice of a large head left hundreds of MB resident)."""
    n, k = codes.codes.shape
    buf, out = torch.empty(min(rows, n), k), torch.empty(n)
    for i in range(0, n, rows):
        part = buf[:min(rows, n - i)]
        part.copy_(codes.codes[i:i + rows])
        part.view(part.shape[0], -1, 32).mul_(codes.scales[i:i + rows].float())
        torch.sum(part.square_(), dim=1, out=out[i:i + part.shape[0]])
    return out.sqrt_()


SCREENED_HEAD_WEIGHTS = 1 << 26  # smaller heads: the screen's fixed cost outweighs its saving (docs/performance.md)
SCREEN_TRIAL_ROWS = (1, 4, 16)  # row counts at which the screen is timed against the whole head


def head_rows(head: "PackedLinear | GGUFLinear") -> int:
    """The vocabulary of a head read from codes (8-bit block codes or GGUF rows)."""
    return head.out_features if isinstance(head, GGUFLinear) else head.encoded.codes.shape[0]


def head_subset(head: Any, ids: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """``head`` (a lean forward's, or a module's ``nn.Linear``) restricted to its rows ``ids`` [n]: features [N, H]
    -> logits [N, n], from a copy of those rows in the head's own form (codes, numerics: each logit as the whole
    head computes it), so that a step reads n rows of the vocabulary instead of all."""
    ids = ids.to(torch.long)
    bias = None if getattr(head, "bias", None) is None else head.bias.index_select(0, ids.to(head.bias.device))
    if isinstance(head, GGUFLinear) and len(head.parts) == 1:
        part = head.parts[0]
        return GGUFLinear([part.pick(ids)], bias, head.int8)
    if isinstance(head, PackedLinear) and head.encoded is not None:
        codes = head.encoded
        rows = BlockCodes(codes.codes.index_select(0, ids).contiguous(), codes.scales.index_select(0, ids).contiguous())
        return PackedLinear.from_codes(rows, bias, head.int8, head.once)
    weight = head.plain_weight if isinstance(head, PackedLinear) else getattr(head, "weight", None)
    if weight is None or isinstance(head, GGUFLinear):  # rows not at hand: the whole head, then its columns
        return lambda x: head(x).index_select(-1, ids.to(x.device))
    ids = ids.to(weight.device)
    if isinstance(head, PackedLinear):
        return PackedLinear(weight.index_select(0, ids), bias, stream=head.stream_op is not None, once=head.once)
    return functools.partial(F.linear, weight=weight.index_select(0, ids).contiguous(), bias=bias)


def codes_greedy_head(head: "PackedLinear | GGUFLinear") -> CodesGreedyHead | None:
    """The ``CodesGreedyHead`` of a head of at least ``SCREENED_HEAD_WEIGHTS`` weights that ``screenable`` takes,
    screening as many rows as it measured faster at (``paying_rows``); None where it pays at none (or is not
    taken). Timings choose speed only: either way the argmax is the fp32 head's."""
    if not screenable(head) or head_rows(head) * head.in_features < SCREENED_HEAD_WEIGHTS:
        return None
    screen = CodesGreedyHead(head)
    kind = head.describe() if isinstance(head, GGUFLinear) else "block8"
    key = json.dumps(["v2", kind, head_rows(head), head.in_features, head.bias is not None, screen.compiled.isa,
                      source_digest(), torch.get_num_threads()])
    path = measurement_path("screen", key)
    if path.is_file():  # measured once per machine, head shape and thread count
        screen.max_rows = json.loads(path.read_text())["max_rows"]
    else:
        screen.max_rows = paying_rows(screen)
        keep_measurement(path, {"key": key, "max_rows": screen.max_rows})
    return screen if screen.max_rows else None


@torch.inference_mode()
def paying_rows(screen: CodesGreedyHead, rows: Sequence[int] = SCREEN_TRIAL_ROWS, rounds: int = 3) -> int:
    """The most rows (of ``rows``, ascending, up to the first that loses) at which ``screen`` measured faster than
    the whole head's product and argmax; 0 where it loses at the first. The int8 products gain where the CPU sums
    byte products in one instruction (AVX-512 VNNI); elsewhere the screen's bound over the vocabulary can cost
    more than it saves (docs/performance.md)."""
    limit, screen.max_rows = screen.max_rows, None
    x = torch.randn(max(rows), screen.head.in_features, generator=torch.Generator().manual_seed(0))
    calls: dict[tuple[str, int], Callable[[], Any]] = {}
    for n in rows:
        calls["screen", n] = lambda n=n: screen(x[:n])
        calls["whole", n] = lambda n=n: screen.whole(x[:n])
    for call in calls.values():  # first calls pay for allocations
        call()
    cost = interleaved_medians(calls, rounds)
    screen.max_rows = limit
    best = 0
    for n in rows:
        if cost["screen", n] >= cost["whole", n]:
            break
        best = n
    return best


@torch.inference_mode()
def tune_kernels(linears: Sequence[PackedLinear], max_rows: int = 8, rounds: int = 3,
                 margin: float = 0.05) -> frozenset[int]:
    """Choose per row count between the packed product (padded as ``pad_rows`` says) and
    ``F.linear`` on the unpacked weight for ``linears``, given in the order a forward runs them:
    each measurement is a sweep through all of them in that order with one kernel, so matrices
    come from memory as in a real forward and a kernel pays for what it does to the next product.
    Both matter here: timed per shape on one hot matrix, or cycling the matrices of one shape (they
    fit in this CPU's L3), near-ties went to the kernel that is slower in a forward, and an
    ``F.linear`` between two packed products makes the next one slower. So one choice per row
    count holds for all matrices. Sets each
    matrix's ``plain_rows`` (the row counts where the ``F.linear`` sweep is faster by ``margin``);
    unpacked weights no row count uses are dropped. Both kernels compute the same product (summed
    in another order, so values may differ in the last bits). Matrices that are not packed, or
    whose 1-``max_rows`` rows the streamed kernel computes, are left alone. Returns the row counts
    chosen for ``F.linear``."""
    tunable = [lin for lin in linears if lin.packed and lin.plain_weight is not None and not (
        lin.stream_op is not None and max_rows <= STREAM_MAX_ROWS)]
    if not tunable:
        return frozenset()
    x = torch.randn(max_rows, max(lin.in_features for lin in tunable),
                    generator=torch.Generator().manual_seed(0)).to(tunable[0].weight.dtype)
    inputs = {lin.in_features: x[:, :lin.in_features].contiguous() for lin in tunable}

    def sweep(m: int, plain: bool) -> None:
        for lin in tunable:
            if plain:
                F.linear(inputs[lin.in_features][:m], lin.plain_weight, lin.bias)
            else:
                lin(inputs[lin.in_features][:m])

    cost = interleaved_medians({(plain, m): lambda plain=plain, m=m: sweep(m, plain)
                                for m in range(1, max_rows + 1) for plain in (False, True)}, rounds)
    plain_rows = frozenset(m for m in range(1, max_rows + 1) if cost[True, m] < (1 - margin) * cost[False, m])
    for lin in tunable:
        lin.adopt_kernels(plain_rows)
    return plain_rows


def to_huge_pages(linears: Sequence[PackedLinear]) -> bool:
    """Move what the streamed kernel reads of ``linears`` (codes and scales, or the fp32 weight) into
    one mapping of 2 MB pages (``eagle.runtime.huge_pages``); before a ``decoder_stack`` takes them. Returns
    whether they moved (not where the system has no huge pages to advise, or none is streamed)."""
    streamed = [lin for lin in linears if lin.stream_op is not None and (
        lin.encoded is not None or lin.plain_weight is not None)]
    tensors = [t for lin in streamed for t in lin.kernel_weight() if t is not None]
    copies = huge_page_copies(tensors)
    if all(c is t for c, t in zip(copies, tensors)):
        return False
    moved = iter(copies)
    for lin in streamed:
        if lin.encoded is not None:
            lin.encoded = BlockCodes(next(moved), next(moved))
        else:
            lin.plain_weight = next(moved)
    return True


def packed_copy(module: nn.Module, dtype: torch.dtype | None = None) -> nn.Module:
    """An inference copy of ``module`` (cast to ``dtype`` if given) whose ``nn.Linear`` submodules
    are ``PackedLinear``; a language model's output head gets its row padding tuned."""
    clone = copy.deepcopy(module).eval().requires_grad_(False)
    if dtype is not None:
        clone.to(dtype)
    for parent in list(clone.modules()):
        for name, child in parent.named_children():
            if isinstance(child, nn.Linear):
                setattr(parent, name, PackedLinear(child.weight, child.bias))
    head = clone.get_output_embeddings() if hasattr(clone, "get_output_embeddings") else None
    if isinstance(head, PackedLinear):
        head.tune_padding()
    return clone


@dataclasses.dataclass
class LayerWeights:
    """A Llama decoder layer for inference: RMSNorm weights (``input_norm`` None: the layer reads its
    input unnormed, as an EAGLE drafter's first layer does) and fused, prepacked products."""

    input_norm: torch.Tensor | None
    input_eps: float
    qkv: PackedLinear
    o: PackedLinear
    post_norm: torch.Tensor
    post_eps: float
    gate_up: PackedLinear
    down: PackedLinear
    embed_norm: torch.Tensor | None = None  # EAGLE-3 drafter: attention reads cat(norm(embedding), norm(x))
    q_norm: torch.Tensor | None = None  # Qwen3: an RMSNorm (eps: input_eps) on each query head and each key head
    k_norm: torch.Tensor | None = None

    def normed_heads(self, qkv: torch.Tensor, nh: int, nkv: int, norm: Callable | None = None) -> torch.Tensor:
        """``qkv`` [..., (nh + 2 nkv) d] with each query head normed by ``q_norm`` and each key head by
        ``k_norm`` over its d values (``norm``: ``rms_norm`` or the compiled one); ``qkv`` itself when the
        layer has no head norms."""
        if self.q_norm is None:
            return qkv
        norm = norm or rms_norm
        q, k, v = qkv.unflatten(-1, (nh + 2 * nkv, self.q_norm.numel())).split([nh, nkv, nkv], dim=-2)
        return torch.cat([norm(q.contiguous(), self.q_norm, self.input_eps),
                          norm(k.contiguous(), self.k_norm, self.input_eps), v], dim=-2).flatten(-2)

    def attention_input(self, x: torch.Tensor, embeds: torch.Tensor | None,
                        norm: Callable | None = None) -> torch.Tensor:
        """What q/k/v read: x normed by ``input_norm`` (if any), after the normed token embeddings
        when ``embed_norm`` is set (``norm``: ``rms_norm`` or the compiled one). [..., H] -> [..., H or 2H]."""
        norm = norm or rms_norm
        h = x if self.input_norm is None else norm(x, self.input_norm, self.input_eps)
        if self.embed_norm is None:
            return h
        return torch.cat([norm(embeds, self.embed_norm, self.input_eps), h], dim=-1)

    def matrices(self) -> tuple[PackedLinear, ...]:
        return self.qkv, self.o, self.gate_up, self.down


def head_norm(attention: Any, name: str) -> torch.Tensor | None:
    """The weight of an attention module's per-head RMSNorm ``name`` (Qwen3's q_norm, k_norm), or None."""
    module = getattr(attention, name, None)
    return None if module is None else module.weight.detach()


def decoder_stack(compiled: Any, num_heads: int, scale: float, layers: Sequence[LayerWeights]) -> Any:
    """The compiled kernels' ``DecoderStack`` of ``layers`` (their weights handed over once; each
    forward then runs all of them in one call). ``scale``: the attention's score scale."""
    stack = compiled.DecoderStack(num_heads, scale)
    for layer in layers:
        stack.add(layer.input_norm, layer.input_eps, layer.post_norm, layer.post_eps,
                  [lin.kernel_product() for lin in layer.matrices()], layer.q_norm, layer.k_norm)
    return stack


def unsupported_reason(model: Any) -> str | None:
    """Why ``LeanDecoder`` cannot run ``model`` (None when it can)."""
    cfg = model.config
    if getattr(cfg, "model_type", None) not in LLAMA_FAMILY:
        return f"model type {getattr(cfg, 'model_type', None)!r} is not one of {LLAMA_FAMILY}"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"activation {cfg.hidden_act!r} is not silu"
    if getattr(cfg, "use_sliding_window", False) or getattr(cfg, "layer_types", None) and any(
            t != "full_attention" for t in cfg.layer_types):
        return "sliding-window attention"
    if not hasattr(getattr(model, "model", None), "rotary_emb"):
        return "no rotary embedding module at model.model.rotary_emb"
    return None


def product(linears: Sequence[Any], stream: bool, encode: bool, int8: bool = False) -> "PackedLinear | GGUFLinear":
    """One product for a lean forward's layer from a model's linears reading the same input (outputs
    side by side): ``nn.Linear`` modules -> a ``PackedLinear``; a GGUF target's projections
    (``eagle.runtime.gguf_weights``) -> a ``GGUFLinear`` multiplying their codes, or, where one of them
    is not kept as codes (or the compiled kernels cannot run), a ``PackedLinear`` of their fp32 weights.
    ``int8``: products from codes take int8 activations (``PackedLinear``)."""
    if not isinstance(linears[0], GGUFProjection):
        return PackedLinear.fused(list(linears), stream, encode, once=True, int8=int8) if len(linears) > 1 else (
            PackedLinear(linears[0].weight, linears[0].bias, stream, encode, once=True, int8=int8))
    bias = None
    if any(lin.bias is not None for lin in linears):
        bias = torch.cat([lin.bias if lin.bias is not None else torch.zeros(lin.out_features) for lin in linears])
    if stream and all(isinstance(lin.matrix, GGUFMatrix) for lin in linears):
        return GGUFLinear.fused(linears, int8)
    if all(isinstance(lin.matrix, BlockCodes) for lin in linears):  # fused when loaded: one view, no copy
        return PackedLinear.from_codes(BlockCodes(joined_rows([lin.matrix.codes for lin in linears]),
                                                  joined_rows([lin.matrix.scales for lin in linears])), bias, int8)
    return PackedLinear(torch.cat([lin.weight for lin in linears]), bias, stream, encode, once=True)


def head_weight(model: Any) -> Any:
    """What ``lm_head`` takes of a model: its head's weight, or a GGUF target's head itself."""
    head = model.get_output_embeddings()
    return head if isinstance(head, GGUFProjection) else head.weight


def head_is_fp32_cpu(model: Any) -> bool:
    """Whether a model's LM head is an fp32 CPU matrix (a GGUF target's always is)."""
    head = model.get_output_embeddings()
    if isinstance(head, GGUFProjection):
        return True
    return head.weight.dtype == torch.float32 and head.weight.device.type == "cpu"


def lm_head(weight: Any, stream: bool, encode: bool,
            int8: bool = False) -> tuple["PackedLinear | GGUFLinear", "GreedyHead | CodesGreedyHead | None"]:
    """A target's LM head [V, H] as a lean forward computes it: the product (row padding tuned) and the screen for
    greedy argmaxes: for a large head of 8-bit codes where the int8 products run, ``CodesGreedyHead``; for an fp32
    head where bf16 products are native and the streamed kernel runs, ``GreedyHead`` (an otherwise encoded head
    streams fewer bytes than a bf16 copy: its exact logits are cheaper).
    ``weight``: fp32 [V, H], or a GGUF target's head (``GGUFProjection``: streamed from its codes). ``int8``:
    a head from codes takes int8 activations."""
    if isinstance(weight, GGUFProjection):
        if stream and isinstance(weight.matrix, GGUFMatrix):
            head = GGUFLinear([weight.matrix], weight.bias, int8)
            return head, codes_greedy_head(head)
        if isinstance(weight.matrix, BlockCodes):
            head = PackedLinear.from_codes(weight.matrix, weight.bias, int8)
            return head, codes_greedy_head(head) if stream else None
        weight = weight.weight
    head = PackedLinear(weight, stream=stream, encode=encode, once=True, int8=int8)
    head.tune_padding()
    if head.encoded is not None:
        return head, codes_greedy_head(head) if stream else None
    bf16_screen = stream and cpu_has_fast_bf16()
    return head, GreedyHead(head) if bf16_screen else None


def screened(greedy_head: Any) -> str:
    """What ``kernel_choice`` says of a greedy head screened by the int8 products (and up to how many rows)."""
    if not isinstance(greedy_head, CodesGreedyHead):
        return ""
    rows = "" if greedy_head.max_rows is None else f" up to {greedy_head.max_rows} rows"
    return f"greedy head screened by int8 products{rows}, "


def coded_weights(matrices: Sequence[Any]) -> str:
    """What ``kernel_choice`` says of products read from codes: block codes' bits, GGUF types, int8 activations."""
    coded = [lin.encoded.bits for lin in matrices if lin.encoded is not None]
    gguf = [lin.describe() for lin in matrices if isinstance(lin, GGUFLinear)]
    int8 = "int8 activations, " if any(lin.int8 for lin in matrices) else ""
    return (f"block-coded weights {coded}, " if coded else "") + (f"GGUF codes {gguf}, " if gguf else "") + int8


def int8_activations_here(int8_activations: bool, stream: bool) -> bool:
    """Whether a lean forward's products from codes take int8 activations: when asked for; asked for where
    the compiled kernels' int8 products do not run (``stream``: the forward uses the compiled kernels), an error."""
    if int8_activations and not (stream and cpu_kernels() is not None and cpu_kernels().int8_activations):
        raise EagleError("int8 activations need the compiled AVX2 or AVX-512 kernels and a float32 target on the "
                         "CPU" + ("" if cpu_kernels() is None else f" (these kernels are {cpu_kernels().isa})"))
    return int8_activations


def check_int8_activations(int8_activations: bool, matrices: Sequence[Any]) -> None:
    """Asking for int8 activations where no product reads codes (they apply only there) is an error."""
    if int8_activations and not any(lin.int8 for lin in matrices):
        raise EagleError("int8 activations apply to weights kept as codes (a GGUF target's, or exact block "
                         "encodings of them); this target has none")


class HeadAndCache:
    """What the lean forwards share: ``argmax`` through their LM head (``head``, ``greedy_head``:
    ``lm_head``) and a fresh cache for their ``layers``."""

    head: PackedLinear
    greedy_head: "GreedyHead | CodesGreedyHead | None"
    layers: list
    argmax_op: Callable[[torch.Tensor], torch.Tensor] | None = None  # the compiled argmax, with the compiled kernels

    def new_cache(self) -> StaticCache:
        return StaticCache(len(self.layers))

    @property
    def int8_activations(self) -> bool:
        """Whether its products from codes take int8 activations."""
        return any(lin.int8 for lin in (self.head, *self.layers[0].matrices()))

    def argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final-norm features [N, H] -> the token of each row's largest logit [N]: what
        ``head(hidden).argmax(-1)`` gives (``GreedyHead`` where it runs)."""
        if self.greedy_head is not None:
            return self.greedy_head(hidden)
        return head_argmax(self.head, hidden, self.argmax_op)


ARGMAX_LOGITS_BYTES = 16 << 20  # the most logits head_argmax makes at once: 16 rows of a 262144-token head


def head_argmax(head: Any, hidden: torch.Tensor, op: Callable[[torch.Tensor], torch.Tensor] | None) -> torch.Tensor:
    """``argmax(head(hidden), op)`` for features [N, H]. A head streamed from its codes in fp32 (each row's logits the
    same whatever rows come with it) meets many rows a group at a time, each group's logits (at most
    ``ARGMAX_LOGITS_BYTES``, and at least ``STREAM_MAX_ROWS`` rows) reduced before the next are made: a large
    vocabulary's logits of many rows (64 x 262144 are 67 MB) are never all in memory, for the same tokens
    (docs/performance.md)."""
    if isinstance(head, PackedLinear) and head.weight is None and head.encoded is not None and not head.int8:
        group = max(STREAM_MAX_ROWS, ARGMAX_LOGITS_BYTES // (4 * head.encoded.codes.shape[0]))
        if hidden.shape[0] > group:
            return torch.cat([argmax(head(part), op) for part in hidden.split(group)])
    return argmax(head(hidden), op)


def argmax(logits: torch.Tensor, op: Callable[[torch.Tensor], torch.Tensor] | None) -> torch.Tensor:
    """``logits.argmax(-1)``: by ``op`` (the compiled ``argmax_rows``, where the forward uses the compiled kernels;
    vectorized, unlike torch's) for fp32 CPU logits, else torch's."""
    if op is None or logits.dtype != torch.float32 or logits.device.type != "cpu" or logits.numel() == 0:
        return logits.argmax(-1)
    return op(logits.reshape(-1, logits.shape[-1]).contiguous()).view(logits.shape[:-1])


class LeanDecoder(HeadAndCache):
    """The target's decoder stack + LM head as a few fused operations. Rows of a batch share
    the cache length (left-pad them and mask the padding, or see ``eagle.runtime.rows``)."""

    def __init__(self, model: Any, kernels: bool = True, encode: bool = True, int8_activations: bool = False) -> None:
        """``kernels``: in fp32 on CPU, the compiled kernels where they run (``eagle.runtime.kernels``: 1-16
        rows streamed, RMSNorm in one pass); ``encode``: with them, weights that are exact block
        encodings (a dequantized GGUF target's) are streamed from their codes (``eagle.runtime.quant_blocks``);
        ``int8_activations``: those products take x quantized to int8 per block of 32, as llama.cpp's do
        (faster; not the fp32 products' bits, so greedy output can differ from the fp32 forward's)."""
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"LeanDecoder cannot run this model: {reason}")
        cfg, inner = model.config, model.model
        compiled = cpu_kernels() if kernels and head_is_fp32_cpu(model) else None
        self.argmax_op = None if compiled is None else compiled.argmax_rows
        self.rms_norm = rms_norm if compiled is None else (lambda x, w, eps: compiled.rms_norm(x.contiguous(), w, eps))
        self.silu_mul = silu_mul if compiled is None or cfg.intermediate_size % 16 else (
            lambda gate_up: compiled.silu_mul(gate_up.reshape(-1, gate_up.shape[-1]).contiguous()).view(
                *gate_up.shape[:-1], -1))
        stream = compiled is not None
        int8 = int8_activations_here(int8_activations, stream)
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.compiled = compiled if attention_fits(self.head_dim) else None
        self.embed = inner.embed_tokens
        self.rotary = inner.rotary_emb
        self.norm, self.norm_eps = inner.norm.weight.detach(), inner.norm.variance_epsilon
        self.head, self.greedy_head = lm_head(head_weight(model), stream, encode, int8)
        self.layers = []
        for layer in inner.layers:
            attn, mlp = layer.self_attn, layer.mlp
            self.layers.append(LayerWeights(
                input_norm=layer.input_layernorm.weight.detach(), input_eps=layer.input_layernorm.variance_epsilon,
                qkv=product([attn.q_proj, attn.k_proj, attn.v_proj], stream, encode, int8),
                o=product([attn.o_proj], stream, encode, int8),
                post_norm=layer.post_attention_layernorm.weight.detach(),
                post_eps=layer.post_attention_layernorm.variance_epsilon,
                gate_up=product([mlp.gate_proj, mlp.up_proj], stream, encode, int8),
                down=product([mlp.down_proj], stream, encode, int8),
                q_norm=head_norm(attn, "q_norm"), k_norm=head_norm(attn, "k_norm")))
        linears = [lin for layer in self.layers for lin in layer.matrices()] + [self.head]
        check_int8_activations(int8, linears)
        tune_kernels(linears)
        # a GGUF target's codes were read into huge pages (``eagle.runtime.gguf_weights``): no copies made here
        self.huge_pages = model.huge_pages if isinstance(model, GGUFModel) else to_huge_pages(linears)
        self.stack = None if self.compiled is None else decoder_stack(self.compiled, self.num_heads,
                                                                      self.head_dim ** -0.5, self.layers)

    def kernel_choice(self) -> str:
        """Which kernels run the forward: the compiled ones (by a hash of their source; with or without
        their attention), and the row counts ``F.linear`` computes (``PackedLinear.plain_rows``) for
        the head and for each layer matrix (layer 0's stand for all): timings measured with one
        choice do not hold for another."""
        first = self.layers[0]
        isa = cpu_kernels().isa if self.compiled is not None or self.head.stream_op is not None else ""
        compiled = (f"compiled {isa} kernels {source_digest()} and attention, " if self.compiled is not None else
                    f"compiled {isa} kernels {source_digest()}, " if self.head.stream_op is not None else "")
        matrices = (self.head, *first.matrices())
        compiled += coded_weights(matrices) + screened(self.greedy_head)
        if self.huge_pages:
            compiled += "in huge pages, "
        return compiled + repr([sorted(lin.plain_rows) for lin in matrices])

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cache: StaticCache,
                attention_mask: torch.Tensor | None = None, aux_layers: Sequence[int] = ()) -> torch.Tensor:
        """``input_ids``/``position_ids`` [B, q]; ``attention_mask`` additive [1 or B, 1, q, past + q]
        or None (causal). Returns the final-norm hidden states [B, q, H], followed along the last
        dim by the outputs of layers ``aux_layers`` ([B, q, (1 + n) H]); ``cache`` is extended."""
        b, q_len = input_ids.shape
        x = self.embed(input_ids)
        cos, sin = self.rotary(x, position_ids)  # [B, q, d]
        if self.stack is not None and b == 1 and runs_stack(q_len, attention_mask is not None):
            # every layer in one call of the compiled kernels, x updated in place; a row's result does not
            # depend on the other rows or on masked keys (``eagle.runtime.kernels``), so a token verified in a tree
            # gets the bits a plain step gives it
            like = cos.new_empty(1, self.num_kv_heads, q_len, self.head_dim)  # a layer's new keys, for the cache
            aux = self.stack.forward(x[0], cos[0].contiguous(), sin[0].contiguous(), cache.keys, cache.values,
                                     cache.reserve_layers(like),
                                     None if attention_mask is None else attention_mask[0, 0].contiguous(), True,
                                     list(aux_layers))
            return torch.cat([self.rms_norm(x, self.norm, self.norm_eps)] + [a[None] for a in aux], dim=-1)
        if attention_mask is None and q_len > 1:
            attention_mask = causal_bias(q_len, cache.get_seq_length(), x.dtype, x.device)
        nh, nkv, d = self.num_heads, self.num_kv_heads, self.head_dim

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            keys, values = cache.update(i, k, v)
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=attention_mask, enable_gqa=nkv != nh,
                                                 scale=d ** -0.5)
            return out.transpose(1, 2).reshape(b, q_len, nh * d)

        return with_aux(self, x, {None: (cos[:, None], sin[:, None])}, attend, aux_layers)

    def layer_body(self, layer: LayerWeights, x: torch.Tensor, attend: Callable) -> torch.Tensor:
        """``eagle.runtime.layers.llama_layer`` with this forward's RMSNorm and activation."""
        return llama_layer(layer, x, attend, self.num_heads, self.num_kv_heads, self.rms_norm, self.silu_mul)

    def rope_key(self, layer: LayerWeights) -> None:
        """Which rotary table a layer reads (one for all)."""
        return None

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        """The features the head reads."""
        return self.rms_norm(x, self.norm, self.norm_eps)
