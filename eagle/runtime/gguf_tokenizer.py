"""A Gemma tokenizer read from a GGUF file's own vocabulary, without transformers' fast tokenizer.

transformers builds a Gemma GGUF's tokenizer (``GemmaTokenizer`` over the ``tokenizers`` library) from the
file's ``tokenizer.ggml.tokens`` and ``token_type``: a BPE with byte fallback whose merges are every split
of a token into two tokens, best first by the merged token's position in the file (earlier first), then by
the longer left part; spaces become "▁" (no prefix space); tokens of spaces only are spelled in "▁"; the
control tokens (type 3) and user-defined tokens (type 4) are matched whole in the text first. For the
262,144-token Gemma-3 vocabulary that object holds about 320 MB (514,906 merges). ``SentencePieceBPE``
tokenizes and detokenizes identically with the vocabulary alone (a merge's rank is computed from the two
tokens when it is needed), in about 50 MB, and renders the file's chat template as transformers does (its own
Jinja renderer, the same variables). ``gguf_tokenizer`` gives it for a file it serves, else None.
"""

from __future__ import annotations

import heapq
import re
from pathlib import Path
from typing import Any, Iterable, Sequence

# GGUF token types (llama.cpp's ``llama_token_type``)
CONTROL, USER_DEFINED, BYTE = 3, 4, 6
# architectures whose SentencePiece vocabulary transformers reads as Gemma's (``gemma_tokenizer``)
GEMMA_ARCHITECTURES = ("gemma", "gemma2", "gemma3")
_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type")
SPACE = "\u2581"


def gemma_spelling(tokens: Sequence[str]) -> list[str]:
    """The vocabulary as transformers spells a Gemma GGUF's: a token of whitespace holding a space
    becomes that many "▁" (the file stores "  " where the model's vocabulary has "▁▁")."""
    return [SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]


class SentencePieceBPE:
    """Gemma's tokenizer over ``tokens`` (the file's spelling) and their GGUF ``token_types``, with the
    interface eagle uses of a transformers tokenizer: ``tok(text)["input_ids"]``, ``encode``,
    ``decode(ids, skip_special_tokens)``, ``get_vocab``, ``convert_ids_to_tokens``, the special token ids and
    strings, ``chat_template`` (the file's, or None) and ``apply_chat_template``."""

    def __init__(self, tokens: Sequence[str], token_types: Sequence[int], bos_token_id: int | None,
                 eos_token_id: int | None, unk_token_id: int | None, pad_token_id: int | None,
                 add_bos: bool = True, add_eos: bool = False, chat_template: str | None = None) -> None:
        self.chat_template = chat_template
        self.tokens = gemma_spelling(tokens)
        self.vocab = {t: i for i, t in enumerate(self.tokens)}  # a repeated token: its last id, as transformers
        self.bos_token_id, self.eos_token_id = bos_token_id, eos_token_id
        self.unk_token_id, self.pad_token_id = unk_token_id, pad_token_id
        self.add_bos, self.add_eos = add_bos, add_eos
        self.bos_token, self.eos_token, self.unk_token, self.pad_token = (
            None if i is None else self.tokens[i] for i in (bos_token_id, eos_token_id, unk_token_id, pad_token_id))
        types = [int(t) for t in token_types]
        added = {t: self.vocab[t] for t, kind in zip(tokens, types) if kind == CONTROL and t in self.vocab}
        self.special = frozenset(added)  # skipped by ``decode(skip_special_tokens=True)``
        added.update({t: self.vocab[t] for t, kind in zip(tokens, types)
                      if kind == USER_DEFINED and t in self.vocab and t not in added})
        self.added = added  # matched whole in the text, before the BPE
        self.added_ids = {i: t for t, i in added.items()}
        # leftmost-longest matching: at each position the first alternative that matches is the longest
        self.splitter = re.compile("|".join(re.escape(t) for t in sorted(added, key=len, reverse=True))) \
            if added else None
        mask = self.vocab.get("<mask>")
        self.all_special_ids = [i for i in (bos_token_id, eos_token_id, unk_token_id, pad_token_id, mask)
                                if i is not None]

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def special_tokens_map(self) -> dict[str, str]:
        """The special tokens' strings by role (``bos_token``, ...), as the chat template sees them."""
        return {name: token for name, token in (("bos_token", self.bos_token), ("eos_token", self.eos_token),
                                                 ("unk_token", self.unk_token), ("pad_token", self.pad_token))
                if token is not None}

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = False, tokenize: bool = True,
                            **kwargs: Any) -> list[int] | str:
        """The conversation rendered by the file's chat template with transformers' renderer and variables
        (``render_jinja_template``: the messages, ``add_generation_prompt``, the special tokens, ``kwargs``),
        then, with ``tokenize``, its ids without special tokens added: what
        ``PreTrainedTokenizerBase.apply_chat_template`` gives."""
        from transformers.utils.chat_template_utils import render_jinja_template

        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        rendered, _ = render_jinja_template([messages], chat_template=self.chat_template,
                                            add_generation_prompt=add_generation_prompt,
                                            **{**self.special_tokens_map, **kwargs})
        return self.encode(rendered[0], add_special_tokens=False) if tokenize else rendered[0]

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": self.encode(text, add_special_tokens)}

    def get_vocab(self) -> dict[str, int]:
        return dict(self.vocab)

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> list[str | None]:
        return [self.tokens[i] if 0 <= i < len(self.tokens) else None for i in ids]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Text -> token ids (``<bos>`` first when the file says so and ``add_special_tokens``)."""
        ids: list[int] = []
        start = 0
        for match in self.splitter.finditer(text) if self.splitter is not None else ():
            ids += self.bpe(text[start:match.start()])
            ids.append(self.added[match.group()])
            start = match.end()
        ids += self.bpe(text[start:])
        if add_special_tokens:
            ids = ([self.bos_token_id] if self.add_bos and self.bos_token_id is not None else []) + ids + (
                [self.eos_token_id] if self.add_eos and self.eos_token_id is not None else [])
        return ids

    def symbols(self, text: str) -> list[int]:
        """The ids BPE starts from: one a character, a character not in the vocabulary as its UTF-8 byte
        tokens ``<0xHH>``, else ``<unk>`` (consecutive ones as one)."""
        out: list[int] = []
        for ch in text:
            i = self.vocab.get(ch)
            if i is None:
                codes = [self.vocab.get(f"<0x{b:02X}>") for b in ch.encode("utf-8")]
                if None not in codes:
                    out += codes
                    continue
                if self.unk_token_id is None or (out and out[-1] == self.unk_token_id):
                    continue
                i = self.unk_token_id
            out.append(i)
        return out

    def rank(self, left: int, right: int) -> tuple[int, int] | None:
        """The rank of merging tokens ``left`` and ``right`` (lower first), None when their concatenation
        is no token: (the merged token's id, minus the left part's length)."""
        merged = self.vocab.get(self.tokens[left] + self.tokens[right])
        return None if merged is None else (merged, -len(self.tokens[left]))

    def bpe(self, text: str) -> list[int]:
        """A piece of text without added tokens -> ids: spaces as "▁", then the lowest-ranked merge of
        two neighbours first (the leftmost of equal ones), until none applies."""
        if not text:
            return []
        ids = self.symbols(text.replace(" ", SPACE))
        n = len(ids)
        nxt, prev, alive = list(range(1, n + 1)), list(range(-1, n - 1)), [True] * n
        heap = []
        for pos in range(n - 1):
            r = self.rank(ids[pos], ids[pos + 1])
            if r is not None:
                heap.append((r, pos))
        heapq.heapify(heap)
        while heap:
            (merged, _), pos = heapq.heappop(heap)
            right = nxt[pos]
            if not alive[pos] or right >= n:
                continue
            now = self.rank(ids[pos], ids[right])
            if now is None or now[0] != merged:  # a stale entry (its neighbours have changed)
                continue
            ids[pos], alive[right] = merged, False
            nxt[pos] = nxt[right]
            if nxt[pos] < n:
                prev[nxt[pos]] = pos
            if prev[pos] >= 0:
                r = self.rank(ids[prev[pos]], merged)
                if r is not None:
                    heapq.heappush(heap, (r, prev[pos]))
            if nxt[pos] < n:
                r = self.rank(merged, ids[nxt[pos]])
                if r is not None:
                    heapq.heappush(heap, (r, pos))
        return [i for i, keep in zip(ids, alive) if keep]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False, **_: Any) -> str:
        """Token ids -> text: "▁" as a space, runs of byte tokens as their UTF-8 text (one U+FFFD a byte
        when invalid), added tokens as they are; special ones left out with ``skip_special_tokens``."""
        out: list[str] = []
        chunk: list[str] = []
        for i in ids:
            i = int(i)
            added = self.added_ids.get(i)
            if added is not None:
                if skip_special_tokens and added in self.special:
                    continue
                out.append(_detokenize(chunk))
                out.append(added)
                chunk = []
            elif 0 <= i < len(self.tokens) and self.vocab.get(self.tokens[i]) == i:
                chunk.append(self.tokens[i])
        out.append(_detokenize(chunk))
        return "".join(out)


def _detokenize(tokens: list[str]) -> str:
    """transformers' Gemma decoder over vocabulary tokens: "▁" -> " ", byte fallback, fuse."""
    out: list[str] = []
    pending = bytearray()
    for token in tokens:
        if len(token) == 6 and token.startswith("<0x") and token.endswith(">") and all(
                c in "0123456789abcdefABCDEF" for c in token[3:5]):
            pending.append(int(token[3:5], 16))
            continue
        if pending:
            out.append(_bytes_text(pending))
            pending = bytearray()
        out.append(token.replace(SPACE, " "))
    if pending:
        out.append(_bytes_text(pending))
    return "".join(out)


def _bytes_text(data: bytearray) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return "\ufffd" * len(data)


def serves(meta: dict) -> bool:
    """Whether ``SentencePieceBPE`` serves a GGUF file of this metadata: a Gemma SentencePiece vocabulary."""
    return (meta.get("general.architecture") in GEMMA_ARCHITECTURES and meta.get("tokenizer.ggml.model") == "llama"
            and all(key in meta for key in _ARRAYS))


def gguf_tokenizer(path: str | Path, header: Any = None) -> SentencePieceBPE | None:
    """The lean tokenizer of GGUF file ``path`` where it serves the file (``serves``), else None;
    ``header``: the file's ``GGUFHeader`` when read already (a file not served is then not read again)."""
    from eagle.runtime.gguf_file import read_header

    if header is not None and not serves(header.metadata):
        return None
    meta = read_header(path, _ARRAYS).metadata
    if not serves(meta) or not isinstance(meta["tokenizer.ggml.tokens"], list):
        return None
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    if len(types) != len(tokens):
        return None
    ids = {name: meta.get(f"tokenizer.ggml.{name}_token_id") for name in ("bos", "eos", "unknown", "padding")}
    tokenizer = SentencePieceBPE(tokens, types, ids["bos"], ids["eos"], ids["unknown"], ids["padding"],
                                 add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", True)),
                                 add_eos=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
                                 chat_template=meta.get("tokenizer.chat_template") or None)
    if len(tokenizer.special) != sum(1 for kind in types if kind == CONTROL):
        return None  # a control token spelled otherwise in the vocabulary: transformers adds it with a new id
    return tokenizer
