"""Chat data -> token ids and a loss mask over assistant tokens only.

Reads ShareGPT (``conversations: [{from, value}]``) or OpenAI-messages (``messages: [{role,
content}]``) records from local JSON/JSONL files (or a hub dataset id through ``datasets`` when
online). A line that is not JSON or not a conversation is an error naming ``file:line``; with
``skip_malformed`` it is skipped, counted and named instead. Conversations without an assistant
turn are skipped and counted."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Iterable, Sequence

from eagle.errors import EagleError, read_text
from eagle.prompts import has_chat_template

ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
         "bing": "assistant", "bard": "assistant", "system": "system"}


@dataclasses.dataclass
class LoadedChats:
    """Parsed conversations plus what was skipped and why."""

    conversations: list[list[dict]]
    skipped: dict[str, int]
    problems: list[str] = dataclasses.field(default_factory=list)  # "file:line: why" per malformed line skipped


def to_messages(record: Any) -> list[dict]:
    """One record -> OpenAI-style messages; raises ValueError on a malformed record."""
    if not isinstance(record, dict):
        raise ValueError("record is not an object")
    if "messages" in record:
        turns = [(m["role"], m["content"]) for m in record["messages"]]
    elif "conversations" in record:
        turns = [(m["from"], m["value"]) for m in record["conversations"]]
    else:
        raise ValueError("record has neither 'messages' nor 'conversations'")
    messages = []
    for role, content in turns:
        if role not in ROLES or not isinstance(content, str):
            raise ValueError(f"bad turn role {role!r}")
        messages.append({"role": ROLES[role], "content": content})
    return messages


def read_numbered(source: str) -> tuple[list[tuple[str, Any]], list[str]]:
    """Records from a local .json/.jsonl file, gzipped or not (``.jsonl.gz``), or a hub dataset id
    via ``datasets``, each with
    where it is (``file:line``, or ``dataset[i]``); returns (records, "file:line: why" for each
    line that is not JSON). A file that is not UTF-8, or a .json array that does not parse, is an
    ``EagleError`` naming the place."""
    path = Path(source)
    if path.is_file():
        text = read_text(path)
        if path.suffix == ".json" and text.lstrip().startswith("["):
            try:
                records = json.loads(text)
            except json.JSONDecodeError as exc:
                raise EagleError(f"{path}:{exc.lineno}: not valid JSON ({exc.msg}, column {exc.colno})") from None
            return [(f"{path}[{i}]", r) for i, r in enumerate(records)], []
        records, bad = [], []
        for n, line in enumerate(text.split("\n"), 1):  # not splitlines(): U+2028, ... occur inside JSON strings
            if not line.strip():
                continue
            try:
                records.append((f"{path}:{n}", json.loads(line)))
            except json.JSONDecodeError as exc:
                bad.append(f"{path}:{n}: not valid JSON ({exc.msg}, column {exc.colno})")
        return records, bad
    if path.suffix in (".json", ".jsonl", ".gz") or path.exists():
        raise EagleError(f"chat data not found: {source}")
    import datasets

    try:
        return [(f"{source}[{i}]", r) for i, r in enumerate(datasets.load_dataset(source, split="train"))], []
    except Exception as exc:  # the datasets library raises many kinds here (offline, missing, ...)
        raise EagleError(f"cannot load dataset {source!r}: {exc}") from exc


def read_records(source: str) -> tuple[list[Any], int]:
    """Records from a local .json/.jsonl file (or a hub dataset id via ``datasets``); returns
    (records, number of lines that are not JSON)."""
    records, bad = read_numbered(source)
    return [r for _, r in records], len(bad)


def load_chats(source: str, skip_malformed: bool = False) -> LoadedChats:
    """The conversations of one source. A malformed line (not JSON, or not a conversation) is an
    ``EagleError`` naming ``file:line``, or with ``skip_malformed`` skipped and named in ``problems``."""
    records, problems = read_numbered(source)
    if problems and not skip_malformed:
        more = f" (and {len(problems) - 1} more malformed line(s); skip_malformed=true skips them)" \
            if len(problems) > 1 else ""
        raise EagleError(problems[0] + more)
    skipped = {"malformed_json": len(problems), "malformed_record": 0, "no_assistant_turn": 0}
    chats = []
    for where, record in records:
        try:
            messages = to_messages(record)
        except (ValueError, KeyError, TypeError) as exc:
            problem = f"{where}: not a conversation ({exc_text(exc)})"
            if not skip_malformed:
                raise EagleError(problem) from None
            problems.append(problem)
            skipped["malformed_record"] += 1
            continue
        if not any(m["role"] == "assistant" and m["content"].strip() for m in messages):
            skipped["no_assistant_turn"] += 1
            continue
        chats.append(messages)
    if not chats:
        raise EagleError(f"{source}: no usable conversation with an assistant turn (skipped: {skipped})")
    return LoadedChats(conversations=chats, skipped=skipped, problems=problems)


def exc_text(exc: Exception) -> str:
    """A short reason from a record's ``KeyError``/``TypeError``/``ValueError``."""
    return f"missing key {exc.args[0]!r}" if isinstance(exc, KeyError) and exc.args else str(exc)


def load_all(sources: str | Sequence[str], skip_malformed: bool = False) -> LoadedChats:
    """``load_chats`` of one source or of several, concatenated in order (skips summed)."""
    loaded = [load_chats(s, skip_malformed) for s in ([sources] if isinstance(sources, str) else sources)]
    if not loaded:
        raise EagleError("no chat data source given")
    skipped = {key: sum(part.skipped[key] for part in loaded) for key in loaded[0].skipped}
    return LoadedChats(conversations=[c for part in loaded for c in part.conversations], skipped=skipped,
                       problems=[p for part in loaded for p in part.problems])


def plain_spans(tokenizer: Any, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """A base model's rendering (a tokenizer without chat template): its BOS text where it adds one
    to a prompt, then the contents back to back, as a prompt followed by its continuation is
    decoded (``eagle.runtime.target.Target.encode_prompt`` tokenizes a prompt as is). Returns the
    text and the character spans of the assistant contents."""
    bos = tokenizer.bos_token or ""
    adds_bos = bool(bos) and tokenizer("x")["input_ids"][:1] == [tokenizer.bos_token_id]
    text, spans = bos if adds_bos else "", []
    for message in messages:
        if message["role"] == "assistant":
            spans.append((len(text), len(text) + len(message["content"])))
        text += message["content"]
    return text, spans


def assistant_spans(tokenizer: Any, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """Render with the chat template; return the text and the character spans of assistant
    replies (content and the template's end-of-turn text up to the next turn). Without a chat
    template: ``plain_spans``."""
    if not has_chat_template(tokenizer):
        return plain_spans(tokenizer, messages)
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True) if i else ""
        upto = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
        if not text.startswith(upto) or not upto.startswith(before):
            raise EagleError("the chat template does not render conversations prefix by prefix; cannot mask")
        spans.append((len(before), len(upto.rstrip())))
    return text, spans


def tokenize_chat(tokenizer: Any, messages: list[dict], max_length: int) -> dict[str, list[int]]:
    """-> ``input_ids`` and ``loss_mask`` (1 on assistant tokens), truncated to ``max_length``."""
    text, spans = assistant_spans(tokenizer, messages)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = [int(any(lo <= start < hi for lo, hi in spans)) for start, _ in enc["offset_mapping"]]
    return {"input_ids": list(enc["input_ids"])[:max_length], "loss_mask": mask[:max_length]}


def tokenize_all(tokenizer: Any, chats: Iterable[list[dict]], max_length: int) -> list[dict[str, list[int]]]:
    out = [tokenize_chat(tokenizer, m, max_length) for m in chats]
    return [ex for ex in out if sum(ex["loss_mask"]) > 0]


def _tokenize_chunk(args: tuple[Any, list[list[dict]], int]) -> list[dict[str, list[int]]]:
    tokenizer, chats, max_length = args
    return tokenize_all(tokenizer, chats, max_length)


def tokenize_parallel(tokenizer: Any, chats: list[list[dict]], max_length: int, workers: int = 0) -> list[dict]:
    """``tokenize_all`` over ``workers`` processes (0: one per CPU core, at most 16; few chats: this
    process), the same examples in the same order."""
    import os

    workers = workers or min(16, os.cpu_count() or 1)
    if workers < 2 or len(chats) < 512:
        return tokenize_all(tokenizer, chats, max_length)
    import multiprocessing

    size = -(-len(chats) // (4 * workers))
    chunks = [(tokenizer, chats[i:i + size], max_length) for i in range(0, len(chats), size)]
    with multiprocessing.get_context("fork").Pool(workers) as pool:
        return [ex for part in pool.map(_tokenize_chunk, chunks) for ex in part]


def tokenize_sources(tokenizer: Any, fingerprint: str, sources: str | Sequence[str], max_length: int,
                     cache: Path | None = None) -> list[dict[str, list[int]]]:
    """The tokenized chats of one chat file or several (concatenated in order), as
    ``tokenize_all(tokenizer, load_all(sources).conversations, max_length)``; with ``cache`` (a
    folder) each file's examples are kept there, keyed by its bytes, the tokenizer's ``fingerprint``
    and ``max_length``, so a later run (another drafter kind, the draft vocabulary count) reads them."""
    import hashlib
    import os

    import torch

    out: list[dict[str, list[int]]] = []
    for source in ([sources] if isinstance(sources, str) else list(sources)):
        path = Path(source)
        key = None
        if cache is not None and path.is_file():
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
            key = cache / f"{hashlib.sha256(f'{digest}:{fingerprint}:{max_length}'.encode()).hexdigest()[:24]}.pt"
            if key.is_file():
                stored = torch.load(key)
                ids, masks, ends = stored["input_ids"].tolist(), stored["loss_mask"].tolist(), stored["ends"].tolist()
                out.extend({"input_ids": ids[a:b], "loss_mask": masks[a:b]} for a, b in zip([0] + ends[:-1], ends))
                continue
        examples = tokenize_parallel(tokenizer, load_chats(source).conversations, max_length)
        out.extend(examples)
        if key is not None:
            key.parent.mkdir(parents=True, exist_ok=True)
            lengths = torch.tensor([len(ex["input_ids"]) for ex in examples], dtype=torch.long)
            tmp = key.with_suffix(f".tmp{os.getpid()}")
            torch.save({"input_ids": torch.tensor([t for ex in examples for t in ex["input_ids"]], dtype=torch.int32),
                        "loss_mask": torch.tensor([m for ex in examples for m in ex["loss_mask"]], dtype=torch.uint8),
                        "ends": torch.cumsum(lengths, 0)}, tmp)
            tmp.replace(key)
    if not out and not isinstance(sources, str) and not list(sources):
        raise EagleError("no chat data source given")
    return out
