"""A suffix index over token sequences (SuffixDecoding, arXiv 2411.04975): the longest earlier
occurrence of the context's suffix and a tree of what followed it, with observed frequencies.

Storage is numpy arrays sized by a token budget: a ring of tokens (sequences separated by
``SEP``) and, per hashed gram length m, a hash-chain (as zlib's LZ77 matcher): ``heads[h]`` the
newest position whose last m tokens hash to h, ``prev[slot]`` the next older one. 20 bytes a
token plus the heads (docs/suffix.md has the measured size and lookup cost). When a sequence
does not fit, the oldest sequences are evicted whole. A lookup walks the chain of the longest
gram length that matches, measures each candidate's match backwards with one vectorized
compare, and reads the continuations of the longest ones forwards."""

from __future__ import annotations

import dataclasses
import math
import threading
from collections import deque
from typing import TYPE_CHECKING, Sequence

import numpy as np

if TYPE_CHECKING:
    from eagle.config import SuffixConfig

SEP = -1  # between sequences: equals no token, so no match or continuation crosses it
_MIX = np.uint64(0x9E3779B97F4A7C15)
_BASE = np.uint64(1000003)


def _gram_hashes(window: np.ndarray, m: int, bits: int) -> np.ndarray:
    """Hashes [len(window) - m + 1] of every m tokens of ``window`` (int array), each ending at
    ``window[m - 1 + i]``, in [0, 2**bits). The one hash both indexing and lookup use."""
    w = window.astype(np.int64).astype(np.uint64) + np.uint64(2)  # SEP (-1) -> 1
    n = len(w) - m + 1
    h = np.zeros(max(n, 0), dtype=np.uint64)
    with np.errstate(over="ignore"):
        for j in range(m):
            h = h * _BASE + w[j:j + n]
        return ((h * _MIX) >> np.uint64(64 - bits)).astype(np.int64)


@dataclasses.dataclass
class Continuations:
    """What followed the longest match: ``match`` tokens of the context's suffix matched at
    ``occurrences`` places; a tree below the context's last token: node i has token
    ``tokens[i]``, parent ``parents[i]`` (-1: the context's last token; parents come first) and
    was followed ``counts[i]`` of ``occurrences`` times (its conditional frequency is its count
    over its parent's)."""

    match: int = 0
    occurrences: int = 0
    tokens: list[int] = dataclasses.field(default_factory=list)
    parents: list[int] = dataclasses.field(default_factory=list)
    counts: list[int] = dataclasses.field(default_factory=list)


def continuation_tree(rows: np.ndarray, min_token_prob: float = 0.0, limit: int | None = None) -> Continuations:
    """The trie of ``rows`` [K, D] (token ids, ``SEP`` padding after a row's end) with counts; a child
    whose count is below ``min_token_prob`` of its parent's is left out with its subtree; at most
    ``limit`` nodes, the most frequent first among a node's children (breadth-first)."""
    out = Continuations(occurrences=int(rows.shape[0]))
    if rows.size == 0:
        return out
    unique, weights = np.unique(rows, axis=0, return_counts=True)
    children: dict[tuple[int, int], int] = {}
    counts: dict[int, int] = {}  # trie built on tuple keys first, then ordered breadth-first by count
    keys: list[tuple[int, int]] = []
    for row, w in zip(unique.tolist(), weights.tolist()):
        node = -1
        for token in row:
            if token == SEP:
                break
            key = (node, token)
            child = children.get(key)
            if child is None:
                child = children[key] = len(keys)
                keys.append(key)
                counts[child] = 0
            counts[child] += w
            node = child
    by_parent: dict[int, list[int]] = {}
    for i, (parent, _) in enumerate(keys):
        by_parent.setdefault(parent, []).append(i)
    total = {-1: out.occurrences}
    new_index = {-1: -1}
    queue = deque([-1])
    while queue:
        parent = queue.popleft()
        for child in sorted(by_parent.get(parent, ()), key=lambda c: -counts[c]):
            if counts[child] < min_token_prob * total[parent] or (limit is not None and len(out.tokens) >= limit):
                continue
            new_index[child] = len(out.tokens)
            total[child] = counts[child]
            out.tokens.append(keys[child][1])
            out.parents.append(new_index[parent])
            out.counts.append(counts[child])
            queue.append(child)
    return out


class SuffixIndex:
    """Token sequences, newest last, within ``capacity`` tokens (separators included); matches of
    ``gram_lengths`` tokens or more, patterns of at most ``max_pattern`` tokens; a lookup walks at most
    ``max_walk`` positions of a chain and reads the continuations of at most ``max_occurrences``
    occurrences (the most recent). Thread-safe: one lock around adding and looking up."""

    def __init__(self, capacity: int, max_pattern: int = 32, gram_lengths: Sequence[int] = (2, 8),
                 max_walk: int = 256, max_occurrences: int = 64) -> None:
        if capacity < 2:
            raise ValueError(f"a suffix index needs capacity >= 2, got {capacity}")
        self.capacity, self.max_pattern = int(capacity), int(max_pattern)
        self.gram_lengths = tuple(sorted(set(int(m) for m in gram_lengths), reverse=True))
        self.max_walk, self.max_occurrences = max_walk, max_occurrences
        self.bits = min(22, max(10, math.ceil(math.log2(capacity))))
        self.ring = np.full(capacity, SEP, dtype=np.int32)
        self.prev = {m: np.full(capacity, -1, dtype=np.int64) for m in self.gram_lengths}
        self.heads = {m: np.full(1 << self.bits, -1, dtype=np.int64) for m in self.gram_lengths}
        self.base = 0  # the oldest position held
        self.end = 0  # the next position written
        self.starts: deque[int] = deque()  # each held sequence's first position
        self.open = False  # whether the newest sequence is still being extended
        self.lock = threading.Lock()

    @property
    def tokens(self) -> int:
        """Positions held (tokens and separators)."""
        return self.end - self.base

    @property
    def nbytes(self) -> int:
        return self.ring.nbytes + sum(a.nbytes for a in self.prev.values()) + sum(a.nbytes for a in self.heads.values())

    def add(self, tokens: Sequence[int]) -> None:
        """A whole sequence (``extend`` then ``end_sequence``)."""
        with self.lock:
            self._extend(np.asarray(tokens, dtype=np.int32))
            self._end_sequence()

    def extend(self, tokens: Sequence[int]) -> None:
        """Append to the newest sequence (one is begun if none is open)."""
        with self.lock:
            self._extend(np.asarray(tokens, dtype=np.int32))

    def add_separated(self, flat: np.ndarray) -> None:
        """Whole sequences at once: ``flat`` [n] holds them each followed by ``SEP`` (a corpus)."""
        flat = np.asarray(flat, dtype=np.int32)
        starts = np.concatenate([[0], np.flatnonzero(flat[:-1] == SEP) + 1]) if flat.size else flat
        if flat.size > self.capacity:  # only the newest whole sequences that fit
            cut = starts[starts >= flat.size - self.capacity]
            cut = int(cut[0]) if cut.size else flat.size - self.capacity
            flat, starts = flat[cut:], starts[starts >= cut] - cut
        if flat.size == 0:
            return
        with self.lock:
            self._end_sequence()
            self.starts.extend((self.end + starts).tolist())
            self._write(flat)
            if flat[-1] != SEP:
                self.open = True

    def end_sequence(self) -> None:
        with self.lock:
            self._end_sequence()

    def _end_sequence(self) -> None:
        if self.open:
            self._write(np.array([SEP], dtype=np.int32))
            self.open = False

    def _extend(self, tokens: np.ndarray) -> None:
        if tokens.size == 0:
            return
        if not self.open:
            self.starts.append(self.end)
            self.open = True
        self._write(tokens[-(self.capacity - 1):])

    def _evict(self, n: int) -> None:
        """Make room for ``n`` more positions: drop the oldest sequences whole (the open one only in part)."""
        need = self.end + n - self.capacity
        if need <= self.base:
            return
        while self.starts and self.starts[0] < need:
            self.starts.popleft()
        self.base = self.starts[0] if self.starts else need
        if self.base < need:  # only the open sequence is left, and it is too long: keep its tail
            self.base = need
        if not self.starts or self.starts[0] != self.base:
            self.starts.appendleft(self.base)

    def _write(self, tokens: np.ndarray) -> None:
        n = len(tokens)
        self._evict(n)
        first, cap = self.end, self.capacity
        slots = np.arange(first, first + n) % cap
        self.ring[slots] = tokens
        self.end += n
        longest = self.gram_lengths[0]
        before = np.arange(first - longest + 1, first)
        window = np.concatenate([np.where(before >= self.base, self.ring[before % cap], SEP), tokens])
        positions = np.arange(first, first + n, dtype=np.int64)
        for m in self.gram_lengths:
            h = _gram_hashes(window[longest - m:], m, self.bits)
            order = np.argsort(h, kind="stable")
            hs, ps = h[order], positions[order]
            starts = np.ones(n, dtype=bool)
            starts[1:] = hs[1:] != hs[:-1]
            ends = np.ones(n, dtype=bool)
            ends[:-1] = starts[1:]
            older = np.empty(n, dtype=np.int64)
            older[1:] = ps[:-1]
            older[starts] = self.heads[m][hs[starts]]
            self.prev[m][ps % cap] = older
            self.heads[m][hs[ends]] = ps[ends]

    def lookup(self, context: Sequence[int], depth: int, min_token_prob: float = 0.0,
               limit: int | None = None, max_spec_factor: float | None = None) -> Continuations:
        """The continuations (at most ``depth`` tokens; with ``max_spec_factor``, at most that many per
        matched token, rounded up) of the longest suffix of ``context`` (at most ``max_pattern``
        tokens, at least the shortest gram length) that occurs in the index followed by a token;
        ``continuation_tree``'s ``min_token_prob`` and ``limit``."""
        with self.lock:
            match, positions = self._longest(context)
            if not match:
                return Continuations()
            if max_spec_factor is not None:
                depth = min(depth, math.ceil(max_spec_factor * match))
            rows = self._following(positions, depth)
        tree = continuation_tree(rows, min_token_prob, limit)
        tree.match = match
        return tree

    def _longest(self, context: Sequence[int]) -> tuple[int, np.ndarray]:
        """(longest match length, end positions of its occurrences, newest first, at most ``max_occurrences``)."""
        pattern = np.asarray(context[-self.max_pattern:], dtype=np.int32)[::-1]  # backwards from the last token
        cap, base, end = self.capacity, self.base, self.end
        for m in self.gram_lengths:
            if len(pattern) < m:
                continue
            h = int(_gram_hashes(pattern[m - 1::-1], m, self.bits)[0])
            found, p, prev = [], int(self.heads[m][h]), self.prev[m]
            while p >= base and len(found) < self.max_walk:
                if p < end - 1:
                    found.append(p)
                p = int(prev[p % cap])
            if not found:
                continue
            ends = np.asarray(found, dtype=np.int64)
            back = ends[:, None] - np.arange(len(pattern))
            same = (self.ring[back % cap] == pattern) & (back >= base)
            lengths = np.logical_and.accumulate(same, axis=1).sum(axis=1)
            lengths[self.ring[(ends + 1) % cap] == SEP] = 0  # no token followed it
            best = int(lengths.max())
            if best >= m:
                return best, ends[lengths == best][:self.max_occurrences]
        return 0, np.zeros(0, dtype=np.int64)

    def _following(self, positions: np.ndarray, depth: int) -> np.ndarray:
        """The ``depth`` tokens after each position [K] -> [K, depth], ``SEP`` from a sequence's end on."""
        ahead = positions[:, None] + 1 + np.arange(depth)
        rows = np.where(ahead < self.end, self.ring[ahead % self.capacity], SEP)
        rows[~np.logical_and.accumulate(rows != SEP, axis=1)] = SEP
        return rows


def new_index(capacity: int, cfg: "SuffixConfig") -> SuffixIndex:
    return SuffixIndex(capacity, max_pattern=cfg.max_pattern)


class SuffixStore:
    """What suffix drafts come from beyond the current request: the outputs of earlier requests
    (``history``, within ``cfg.history_tokens``, the oldest evicted first) and a corpus (read-only,
    ``read_corpus``). One store is shared by the requests of one scope (``eagle-serve
    --suffix-scope``)."""

    def __init__(self, cfg: "SuffixConfig", corpus: SuffixIndex | None = None) -> None:
        self.cfg, self.corpus = cfg, corpus
        self._history: SuffixIndex | None = None
        self._lock = threading.Lock()

    @property
    def history(self) -> SuffixIndex:
        """Earlier outputs (its arrays made on first use)."""
        with self._lock:
            if self._history is None:
                self._history = new_index(self.cfg.history_tokens, self.cfg)
            return self._history

    def fresh(self) -> "SuffixStore":
        """A store with this one's corpus and no earlier outputs."""
        return SuffixStore(self.cfg, self.corpus)

    def clear_history(self) -> None:
        with self._lock:
            self._history = None

    def sources(self) -> list[tuple[str, SuffixIndex]]:
        return [("history", self.history)] + ([("corpus", self.corpus)] if self.corpus is not None else [])


@dataclasses.dataclass
class CorpusFiles:
    """A corpus folder's files: ``texts`` (path, text) of those read, ``skipped`` {reason: count}."""

    texts: list[tuple[str, str]]
    skipped: dict[str, int]

    @property
    def bytes(self) -> int:
        return sum(len(t.encode("utf-8", "surrogatepass")) for _, t in self.texts)


BYTES_PER_TOKEN = 3  # what a corpus is assumed to tokenize to before it is, to refuse one too big at once


def corpus_files(path: str) -> CorpusFiles:
    """The text files under ``path`` (a file or a folder, recursively, in name order); an unreadable
    file is skipped and counted as "unreadable", one with a NUL byte or that is not UTF-8 as "binary"."""
    from pathlib import Path

    from eagle.errors import EagleError

    root = Path(path).expanduser()
    if not root.exists():
        raise EagleError(f"--suffix-corpus {path}: no such file or folder")
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    texts, skipped = [], {"unreadable": 0, "binary": 0}
    for file in files:
        try:
            data = file.read_bytes()
        except OSError:
            skipped["unreadable"] += 1
            continue
        try:
            if b"\0" in data:
                raise UnicodeDecodeError("utf-8", data, 0, 1, "NUL byte")
            texts.append((str(file), data.decode("utf-8")))
        except UnicodeDecodeError:
            skipped["binary"] += 1
    return CorpusFiles(texts, skipped)


def corpus_key(files: CorpusFiles, fingerprint: str) -> str:
    import hashlib

    digest = hashlib.sha256(fingerprint.encode())
    for name, text in files.texts:
        digest.update(name.encode("utf-8", "surrogatepass") + b"\0" + hashlib.sha256(
            text.encode("utf-8", "surrogatepass")).digest())
    return digest.hexdigest()[:24]


def read_corpus(path: str, tokenizer: object, fingerprint: str, cfg: "SuffixConfig",
                log: object = None) -> tuple[SuffixIndex, dict]:
    """The suffix index of a corpus (``corpus_files``), its tokens cached in ``eagle.cache_dir`` by
    the files' contents and the tokenizer (``fingerprint``), so a corpus is tokenized once. A corpus
    whose text would exceed ``cfg.corpus_tokens`` (at ``BYTES_PER_TOKEN``) is refused before any
    tokenizing. Returns (index, stats: files, skipped, tokens, cached, bytes of the index)."""
    from eagle.cache_dir import cache_root
    from eagle.errors import EagleError

    files = corpus_files(path)
    size = files.bytes
    if size > cfg.corpus_tokens * BYTES_PER_TOKEN:
        raise EagleError(f"--suffix-corpus {path}: {size / 1e6:.1f} MB of text, about {size // BYTES_PER_TOKEN:,} "
                         f"tokens, over the corpus bound of {cfg.corpus_tokens:,} tokens (suffix corpus_tokens)")
    cached = cache_root() / "suffix" / (corpus_key(files, fingerprint) + ".npy")
    hit = cached.is_file()
    if hit:
        flat = np.load(cached)
    else:
        parts = []
        batch = 64
        for i in range(0, len(files.texts), batch):
            texts = [t for _, t in files.texts[i:i + batch]]
            for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]:
                parts.append(np.asarray(ids, dtype=np.int32))
                parts.append(np.array([SEP], dtype=np.int32))
        flat = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_suffix(".tmp.npy")
        np.save(tmp, flat)
        tmp.replace(cached)
    if len(flat) > cfg.corpus_tokens:
        raise EagleError(f"--suffix-corpus {path}: {len(flat):,} tokens, over the corpus bound of "
                         f"{cfg.corpus_tokens:,} tokens (suffix corpus_tokens)")
    index = new_index(max(2, len(flat) + 1), cfg)
    index.add_separated(flat)
    stats = dict(files=len(files.texts), skipped=files.skipped, tokens=int((flat != SEP).sum()), cached=hit,
                 index_bytes=index.nbytes)
    return index, stats
