"""Batched plain decoding with the lean target forward (Llama family and Gemma-3): many requests on a
fixed number of rows.

Not speculative: it is for throughput (making training data: ``train.selfdistill``), where batching
does what drafting does for one stream. ``BatchDecoder`` keeps ``rows`` sequences in one preallocated
KV cache of batched rows (``eagle.runtime.rows``), each row at its own length: one decode step
runs every row, each writing its token at its own position and attending to its own positions only,
so a row decodes as it would alone (up to floating-point rounding). A row that ends (EOS or its
token cap) is refilled from the queue of pending requests (continuous refill): free rows are prefilled
together once ``refill_at`` of them are free. On CUDA each step (the forward and the draw) is replayed
as a CUDA graph, one per row bucket and attended length; on a CPU the same functions run eagerly.
When the queue runs dry, the running rows move to the front and the step runs on a smaller bucket.
Attention: ``sdpa`` attends every row over the longest row's length (a power of two); ``varlen``
(flash attention with per-row used lengths, CUDA in bf16/fp16) reads each row's own keys only, so
one long conversation no longer makes every row read the whole cache. A free row keeps what its
cache holds: a request whose prompt starts with it (a conversation's next turn: the earlier turns,
the answer and the new user turn) is put in that row and only the tail past the common prefix is
prefilled (``extend_rows``). ``stats`` says where the time went (prefill, steps, captures).

Sampled tokens come from counter-based noise per request (``request_noise``): what a request draws
depends on its seed and prompt only, not on its row or its neighbours, so a run is reproducible (and
resumable) whatever the batching. Measurements: docs/data.md."""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import os
import time
from typing import Any, Callable, Iterator, Sequence

import torch

from eagle.config import SamplingConfig
from eagle.decoding.sampling import logits_to_probs
from eagle.errors import EagleError
from eagle.runtime.rows import ATTENTION, LayerPlan, decode_rows, extend_rows, prefill_rows, rotary_tables, varlen_works
from eagle.runtime.shapes import MIN_KEYS, StaticRunner, StaticShape, bucket_for, keys_for
from eagle.runtime.target import Target

MASK31 = (1 << 31) - 1
CUDA_ROWS, CPU_ROWS = 256, 8  # default rows per device kind
PREFILL_TOKENS = 8192  # padded prompt tokens per prefill call (bounds its memory)
HELD_KEY = 16  # leading tokens that index a free row's cached tokens (prompts at most this long are not matched)
MIN_REUSE = 32  # cached tokens worth a row's reuse


@dataclasses.dataclass(frozen=True)
class Request:
    """One prompt to decode: token ids, its cap on new tokens, the 31-bit key of its random draws
    (``request_seed``) and ``key``, handed back with its ``Result``."""

    prompt: Sequence[int]
    max_new_tokens: int
    seed: int = 0
    key: Any = None


@dataclasses.dataclass
class Result:
    """A finished request: its ``key``, the new tokens (the EOS that ended it excluded) and whether
    it stopped at an EOS (else at its ``max_new_tokens``)."""

    key: Any
    token_ids: list[int]
    ended: bool


@dataclasses.dataclass
class BatchOutput:
    """Per prompt, in input order: ``token_ids`` the new tokens (the EOS that ended it excluded)
    and ``ended`` whether it stopped at an EOS (else at ``max_new_tokens``)."""

    token_ids: list[list[int]]
    ended: list[bool]


@dataclasses.dataclass
class BatchStats:
    """Where a decoder's wall-clock time went (host clock; each phase ends with a host read of its
    tokens, so the device work is inside): ``prefill_s`` over ``prefills`` calls of
    ``prefill_tokens`` prompt tokens (``padded_tokens`` with padding; ``reused_tokens`` more were already
    in a reused row's cache, over ``reused_rows`` rows), ``step_s`` over ``steps`` decode
    steps that ran ``row_steps`` rows of which ``live_row_steps`` held a request, ``captures`` graphs
    taken in ``capture_s`` (inside the phases' times), and the ``attention`` used."""

    attention: str = "sdpa"
    prefill_s: float = 0.0
    prefills: int = 0
    prefill_tokens: int = 0
    padded_tokens: int = 0
    reused_tokens: int = 0
    reused_rows: int = 0
    step_s: float = 0.0
    steps: int = 0
    row_steps: int = 0
    live_row_steps: int = 0
    captures: int = 0
    capture_s: float = 0.0


def default_rows(device: torch.device) -> int:
    return CUDA_ROWS if device.type == "cuda" else CPU_ROWS


def request_seed(seed: int, index: int) -> int:
    """The 31-bit noise key of request ``index`` of a run seeded ``seed`` (any strings or ints)."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{index}".encode()).digest()[:4], "little") & MASK31


def _mix(x: torch.Tensor) -> torch.Tensor:
    """An integer hash of int64 values in [0, 2^31) onto [0, 2^31) (products stay below 2^58)."""
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & MASK31
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & MASK31
    return x ^ (x >> 16)


def request_noise(keys: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """Uniform noise in (0, 1) [R, vocab] float32 for rows with noise keys ``keys`` [R] at token
    index ``steps`` [R] (int64): a function of (key, step, token) alone, the same on every device."""
    row = _mix(_mix(keys & MASK31) ^ (steps & MASK31))
    bits = _mix(_mix(row[:, None] ^ torch.arange(vocab, device=keys.device)[None])) & 0xFFFFFF
    return (bits.float() + 0.5) / float(1 << 24)


def draw_tokens(logits: torch.Tensor, sampling: SamplingConfig, keys: torch.Tensor,
                steps: torch.Tensor) -> torch.Tensor:
    """Logits [R, V] -> one token per row [R], sampled (greedy rows take the argmax:
    ``BatchDecoder._draw``): a draw from ``logits_to_probs`` by an exponential race (argmax of
    p / -log u: token i wins with probability p_i; a zero-probability token never does) on
    ``request_noise(keys, steps)``."""
    probs = logits_to_probs(logits, sampling)
    return (probs / -torch.log(request_noise(keys, steps, logits.shape[-1]))).argmax(-1)


def prefill_groups(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Indices of prompts of ``lengths``, shortest first, cut into groups whose padded size (count x
    longest) stays within ``budget`` tokens (a longer prompt goes alone)."""
    groups: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        if groups and (len(groups[-1]) + 1) * lengths[i] <= budget:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


@dataclasses.dataclass
class _Row:
    request: Request
    tokens: list[int]
    position: int  # where the row's pending token (in the ids buffer) is written by the next step


class BatchDecoder:
    """``rows`` sequences of at most ``capacity`` tokens each (prompt and new tokens) decoded
    together, greedy or sampled as ``sampling`` says. ``capture`` (default: on CUDA): replay each
    step as a CUDA graph. ``refill_at`` (default: an eighth of the rows, at least 1): free rows
    wait until that many are free, so one prefill serves many. ``attention``: ``sdpa``, ``varlen``
    (an error where ``varlen_works`` says no) or ``auto`` (``varlen`` where it works).
    ``reuse``: put a request whose prompt starts with what a free row's cache holds (at least
    ``MIN_REUSE`` tokens) in that row and prefill only the rest. ``stream`` runs requests; ``stats``
    accumulates over them."""

    def __init__(self, target: Target, rows: int, capacity: int, sampling: SamplingConfig,
                 capture: bool | None = None, refill_at: int | None = None,
                 prefill_tokens: int = PREFILL_TOKENS, attention: str = "auto", reuse: bool = True) -> None:
        if target.lean is None:
            raise EagleError(f"{target.name} has no lean forward; batched decoding needs one")
        if rows < 1 or capacity < 2:
            raise EagleError(f"a batch decoder needs rows >= 1 and capacity >= 2, got {rows} and {capacity}")
        if attention not in ATTENTION:
            raise EagleError(f"attention must be one of {', '.join(ATTENTION)}, got {attention!r}")
        lean, device, dtype = target.lean, target.device, target.dtype
        why_not = None if attention == "sdpa" else (
            "varlen attention does not take sliding windows" if any(LayerPlan.of(lean).windows) else
            varlen_works(device, dtype))
        if attention == "varlen" and why_not:
            raise EagleError(why_not)
        self.varlen = attention != "sdpa" and why_not is None
        self.stats = BatchStats(attention="varlen" if self.varlen else "sdpa")
        self.target, self.lean, self.sampling, self.rows = target, lean, sampling, rows
        self.capacity = -(-capacity // MIN_KEYS) * MIN_KEYS  # attended lengths stay multiples of 64
        self.refill_at = refill_at or max(1, rows // 8)
        self.prefill_tokens = prefill_tokens
        self.eos = frozenset(target.eos_token_ids)
        self.kv = torch.zeros(2, len(lean.layers), rows, self.capacity, lean.num_kv_heads, lean.head_dim,
                              dtype=dtype, device=device)
        with torch.inference_mode():
            self.rope = rotary_tables(lean, self.capacity, device, dtype)
        # per row: the pending token, where it goes, its request's noise key, how many tokens it drew
        self.ids, self.positions, self.keys, self.steps = (torch.zeros(rows, dtype=torch.long, device=device)
                                                           for _ in range(4))
        self.buckets = tuple(sorted({rows, *(1 << k for k in range(rows.bit_length()) if 1 << k < rows)}))
        self.capture = (device.type == "cuda") if capture is None else capture and device.type == "cuda"
        self.runner = StaticRunner(device, self.capture)  # each step's shape (rows, attended keys)
        self.reuse = reuse
        self.held: dict[int, list[int]] = {}  # free row -> the tokens its cache holds at positions 0, 1, ...
        self.held_by_key: dict[tuple[int, ...], set[int]] = collections.defaultdict(set)  # first HELD_KEY -> rows

    def check(self, request: Request) -> None:
        n = len(request.prompt)
        if n < 1 or request.max_new_tokens < 1:
            raise EagleError(f"a request needs a prompt token and max_new_tokens >= 1, got {n} and "
                             f"{request.max_new_tokens}")
        if n + request.max_new_tokens > self.capacity:
            raise EagleError(f"a prompt of {n} tokens plus {request.max_new_tokens} new ones exceeds the decoder's "
                             f"capacity ({self.capacity})")

    @torch.inference_mode()
    def stream(self, take: Callable[[], Request | None]) -> Iterator[Result]:
        """Decode requests from ``take`` (None: none pending now) until none runs and none is
        pending, yielding each ``Result`` as it finishes: the caller may queue a follow-up (the next
        turn of a conversation) before it resumes the iteration."""
        slots: list[_Row | None] = [None] * self.rows
        while True:
            free = [s for s, row in enumerate(slots) if row is None]
            if free and (len(free) >= self.refill_at or len(free) == self.rows):
                batch = []
                while len(batch) < len(free):
                    request = take()
                    if request is None:
                        break
                    self.check(request)
                    batch.append(request)
                if batch:
                    yield from self._admit(batch, free, slots)
                    continue
            live = [s for s, row in enumerate(slots) if row is not None]
            if not live:
                return
            size = bucket_for(live[-1] + 1, self.buckets)
            if bucket_for(len(live), self.buckets) < size:
                self._compact(live, slots)
                size = bucket_for(len(live), self.buckets)
            yield from self._step(size, slots)

    def _admit(self, batch: list[Request], free: list[int], slots: list[_Row | None]) -> Iterator[Result]:
        """Put ``batch`` in free rows and take each one's first token: a request whose prompt starts
        with a free row's cached tokens goes to that row and prefills its tail; the others prefill
        whole in the first free rows (in groups, shortest prompts first)."""
        fresh, tails = [], []
        for request in batch:
            row, start = self._held_row(request.prompt, free) if self.reuse else (None, 0)
            if row is None:
                fresh.append(request)
            else:
                free.remove(row)
                tails.append((request, row, start))
        free.sort(key=lambda row: row in self.held)  # rows holding nothing first: the others may serve a next turn
        placed = [(request, free.pop(0), 0) for request in fresh]
        for _, row, _ in placed + tails:
            self._forget(row)
        for part in (placed, tails):
            for group in prefill_groups([len(r.prompt) - start for r, _, start in part], self.prefill_tokens):
                yield from self._prefill([part[i] for i in group], slots)

    def _prefill(self, group: list[tuple[Request, int, int]], slots: list[_Row | None]) -> Iterator[Result]:
        """Prefill each (request, row, start) of ``group`` (all starts 0, or all reused rows) from its
        start and take its first token."""
        begin, device = time.perf_counter(), self.kv.device
        requests = [request for request, _, _ in group]
        heads = [start for _, _, start in group]
        width = max(len(r.prompt) - start for r, start in zip(requests, heads))
        ids = torch.tensor([list(r.prompt[start:]) + [0] * (width - len(r.prompt) + start)
                            for r, start in zip(requests, heads)], device=device)
        lengths = torch.tensor([len(r.prompt) for r in requests], device=device)
        starts = torch.tensor(heads, device=device)
        where = torch.tensor([row for _, row, _ in group], device=device)
        if max(heads):
            keys_len = min(self.capacity, max(heads) + width)
            hidden = extend_rows(self.lean, self.kv, self.rope, where, ids, starts, lengths - starts - 1,
                                 keys_len)
        else:
            hidden = prefill_rows(self.lean, self.kv, self.rope, where, ids, lengths - 1)
        keys = torch.tensor([r.seed for r in requests], device=device)
        tokens = self._draw(hidden, keys, torch.zeros_like(keys))
        self.ids[where], self.positions[where], self.keys[where] = tokens, lengths, keys
        self.steps[where] = 1
        host = tokens.tolist()
        self.stats.prefill_s += time.perf_counter() - begin
        self.stats.prefills += 1
        self.stats.prefill_tokens += sum(len(r.prompt) for r in requests) - sum(heads)
        self.stats.padded_tokens += width * len(requests)
        self.stats.reused_tokens += sum(heads)
        self.stats.reused_rows += sum(1 for start in heads if start)
        for (request, s, _), token in zip(group, host):
            slots[s] = _Row(request, [], len(request.prompt))
            yield from self._accept(s, token, slots)

    def _held_row(self, prompt: Sequence[int], free: list[int]) -> tuple[int | None, int]:
        """The free row whose cached tokens share the longest head with ``prompt`` and how many of
        its tokens to keep (at most len(prompt) - 1: the last one is run for its logits), or (None,
        0) when no row shares ``MIN_REUSE`` tokens."""
        best, keep = None, 0
        if len(prompt) > HELD_KEY:
            for row in self.held_by_key.get(tuple(prompt[:HELD_KEY]), ()):
                same = min(len(os.path.commonprefix([self.held[row], list(prompt)])), len(prompt) - 1)
                if same > keep and row in free:
                    best, keep = row, same
        return (best, keep) if keep >= MIN_REUSE else (None, 0)

    def _hold(self, row: int, tokens: list[int]) -> None:
        """Free row ``row``'s cache holds ``tokens`` at positions 0, 1, ...: keep them for reuse."""
        if self.reuse and len(tokens) > HELD_KEY:
            self.held[row] = tokens
            self.held_by_key[tuple(tokens[:HELD_KEY])].add(row)

    def _forget(self, row: int) -> None:
        tokens = self.held.pop(row, None)
        if tokens is not None:
            self.held_by_key[tuple(tokens[:HELD_KEY])].discard(row)

    def _compact(self, live: list[int], slots: list[_Row | None]) -> None:
        """Move the running rows ``live`` (increasing) to rows 0 .. len(live)-1."""
        src = torch.tensor(live, device=self.kv.device)
        n, used = len(live), keys_for(max(slots[s].position for s in live) + 1, self.capacity)
        self.kv[:, :, :n, :used] = self.kv[:, :, src, :used]
        for buf in (self.ids, self.positions, self.keys, self.steps):
            buf[:n] = buf[src]
        moved = [slots[s] for s in live]
        slots[:] = moved + [None] * (self.rows - n)
        self.held.clear()  # free rows were overwritten
        self.held_by_key.clear()

    def _step(self, size: int, slots: list[_Row | None]) -> Iterator[Result]:
        """One decode step of rows 0 .. size-1 (free ones compute and are ignored)."""
        start = time.perf_counter()
        keys_len = (self.capacity if self.varlen else  # varlen reads each row's own keys: one graph per bucket
                    keys_for(max(row.position for row in slots[:size] if row is not None) + 1, self.capacity))
        tokens = self._run(size, keys_len)
        host = tokens.tolist()
        self.stats.step_s += time.perf_counter() - start
        self.stats.steps += 1
        self.stats.row_steps += size
        self.ids[:size].copy_(tokens)
        self.positions[:size].add_(1).clamp_(max=self.capacity - 1)  # free rows keep writing in range
        self.steps[:size].add_(1)
        for s in range(size):
            if slots[s] is not None:
                self.stats.live_row_steps += 1
                slots[s].position += 1
                yield from self._accept(s, host[s], slots)

    def _draw(self, hidden: torch.Tensor, keys: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
        """Final-norm features [R, H] -> one token per row [R]: greedy, the lean forward's argmax (the compiled
        one, or the screened head, on a CPU); sampled, ``draw_tokens`` keyed by ``keys`` and ``steps``."""
        if self.sampling.greedy:
            return self.lean.argmax(hidden)
        return draw_tokens(self.lean.head(hidden).float(), self.sampling, keys, steps)

    def _run(self, size: int, keys_len: int) -> torch.Tensor:
        """The step's tokens [size] (a graph's static output on CUDA, replayed; else computed)."""
        def run() -> torch.Tensor:
            hidden = decode_rows(self.lean, self.kv[:, :, :size], self.rope, self.ids[:size],
                                 self.positions[:size], keys_len, self.varlen)
            return self._draw(hidden, self.keys[:size], self.steps[:size])

        if not self.capture:
            return run()
        runner = self.runner
        captured, seconds = runner.captured, runner.capture_seconds
        out = runner.run(("batch", size, keys_len), lambda: StaticShape({}, run), lambda shape: None)
        self.stats.captures += runner.captured - captured
        self.stats.capture_s += runner.capture_seconds - seconds
        return out

    def _accept(self, s: int, token: int, slots: list[_Row | None]) -> Iterator[Result]:
        """Row ``s`` drew ``token``: keep it, or end the row (EOS or its cap) and free it."""
        row = slots[s]
        ended = token in self.eos
        if not ended:
            row.tokens.append(token)
        if ended or len(row.tokens) >= row.request.max_new_tokens:
            slots[s] = None
            # the cache holds the prompt and every token fed back: all drawn but the last
            self._hold(s, (list(row.request.prompt) + row.tokens)[:row.position])
            yield Result(row.request.key, row.tokens, ended)


@torch.inference_mode()
def generate_batch(target: Target, prompts: list[list[int]], max_new_tokens: int, sampling: SamplingConfig,
                   seed: int = 0, rows: int | None = None) -> BatchOutput:
    """Decode every prompt (token ids) for up to ``max_new_tokens``, stopping each at an EOS: greedy
    or sampled as ``sampling`` says, prompt i's draws keyed by ``request_seed(seed, i)``. ``rows``:
    sequences decoded at once (default: 256 on CUDA, 8 on a CPU, at most the number of prompts)."""
    if target.lean is None:
        raise EagleError(f"{target.name} has no lean forward; batched decoding needs one")
    if not prompts or min(len(p) for p in prompts) < 1:
        raise EagleError("generate_batch needs at least one prompt, each with at least one token")
    if max_new_tokens < 1:
        raise EagleError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    longest = max(len(p) for p in prompts)
    if longest + max_new_tokens > target.max_context:
        raise EagleError(f"a prompt of {longest} tokens plus {max_new_tokens} new ones exceeds the model's context "
                         f"({target.max_context})")
    decoder = BatchDecoder(target, min(rows or default_rows(target.device), len(prompts)), longest + max_new_tokens,
                           sampling)
    pending = collections.deque(Request(p, max_new_tokens, request_seed(seed, i), i) for i, p in enumerate(prompts))
    out = BatchOutput(token_ids=[[] for _ in prompts], ended=[False] * len(prompts))
    for result in decoder.stream(lambda: pending.popleft() if pending else None):
        out.token_ids[result.key], out.ended[result.key] = result.token_ids, result.ended
    return out
