"""Token-frequency tables: which tokens of a vocabulary a draft model's head computes.

A draft model for ``sd`` (``eagle.decoding.proposers.DraftModel``) spends a large part of each step on its LM head
(Qwen2.5-Coder-0.5B: 152k rows, about a quarter of a step). Drafting only among the tokens that make nearly all of
real text (FR-Spec's frequency-ranked draft vocabulary) reads a fraction of those rows; the target still verifies
every draft, so greedy output is unchanged and sampling stays exact (the draft's distribution is zero outside the
subset and is the one its tokens were drawn from). A table lists a tokenizer's tokens from the most to the least
frequent in a corpus and is matched to a model by its tokenizer's fingerprint: tables ship in
``eagle/shipped/token_frequencies``, and ``scripts/token_frequencies.py`` writes one for any tokenizer into the cache
(``EAGLE_CACHE/token_frequencies``), where it is found the same way."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable

import torch

from eagle.atomic import write_file
from eagle.cache_dir import cache_root
from eagle.errors import EagleError

if TYPE_CHECKING:
    from eagle.runtime.target import Target

SHIPPED = Path(__file__).parent.parent / "shipped" / "token_frequencies"
MAX_IDS = 65536  # a table keeps the most frequent tokens up to this many


def table_dirs() -> list[Path]:
    """Where tables are looked for: the shipped ones, then the cache's."""
    return [SHIPPED, cache_root() / "token_frequencies"]


def count_tokens(encode: Callable[[str], list[int]], texts: Iterable[str], vocab_size: int) -> torch.Tensor:
    """How often each token occurs in ``texts`` tokenized by ``encode``: int64 [vocab_size]."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for text in texts:
        ids = encode(text)
        if ids:
            counts += torch.bincount(torch.tensor(ids, dtype=torch.long), minlength=vocab_size)[:vocab_size]
    return counts


def table(counts: torch.Tensor, fingerprint: str, source: str) -> dict:
    """A table from ``counts`` [V]: the tokens seen, most frequent first (ties: lower id first), at most
    ``MAX_IDS``; the tokenizer's fingerprint; what was counted."""
    seen = int((counts > 0).sum())
    order = torch.argsort(counts, descending=True, stable=True)[:min(seen, MAX_IDS)]
    return {"fingerprint": fingerprint, "vocab_size": int(counts.shape[0]), "ids": order.to(torch.int32),
            "tokens": int(counts.sum()), "source": source}


def write_table(path: str | Path, entry: dict) -> None:
    import io

    buffer = io.BytesIO()
    torch.save(entry, buffer)
    write_file(path, buffer.getvalue())


def read_table(path: str | Path) -> dict:
    entry = torch.load(path, weights_only=True)
    if not isinstance(entry, dict) or not {"fingerprint", "vocab_size", "ids"} <= entry.keys():
        raise EagleError(f"{path} is not a token-frequency table")
    return entry


def find_table(fingerprint: str, vocab_size: int) -> dict | None:
    """The first table (shipped, then cached) made for the tokenizer with ``fingerprint``, or None."""
    for folder in table_dirs():
        for path in sorted(folder.glob("*.pt")) if folder.is_dir() else []:
            entry = read_table(path)
            if entry["fingerprint"] == fingerprint and entry["vocab_size"] == vocab_size:
                return entry
    return None


def frequent_tokens(fingerprint: str, vocab_size: int, n: int, always: Iterable[int] = ()) -> torch.Tensor | None:
    """The ``n`` most frequent tokens of the tokenizer with ``fingerprint`` by its table, with the ids ``always``
    (its special tokens) added, sorted ascending [<= n + len(always)]; None where no table is known or ``n`` is 0
    or covers the vocabulary (the whole head is then computed)."""
    if n <= 0 or n >= vocab_size:
        return None
    entry = find_table(fingerprint, vocab_size)
    if entry is None:
        return None
    ids = torch.cat([entry["ids"][:n].long(), torch.tensor(sorted(set(always)), dtype=torch.long)])
    return torch.unique(ids[(ids >= 0) & (ids < vocab_size)])


class DraftVocab:
    """A draft model's head restricted to its most frequent tokens: ``ids`` (sorted, on the model's device) and
    ``head`` (features [N, H] -> their logits [N, len(ids)], ``Target.head_subset``)."""

    def __init__(self, model: "Target", ids: torch.Tensor) -> None:
        self.ids = ids.to(model.device)
        self.head = model.head_subset(self.ids)

    @classmethod
    def of(cls, model: "Target", n: int) -> "DraftVocab | None":
        """The ``n`` most frequent tokens of ``model``'s tokenizer by a known table (its end-of-sequence ids
        always among them); None where no table is known or ``n`` is 0 (the whole head)."""
        ids = frequent_tokens(model.tokenizer_fingerprint, model.vocab_size, n, model.eos_token_ids)
        return None if ids is None else cls(model, ids)
