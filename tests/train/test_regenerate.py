import collections
import json
import random
from pathlib import Path

import pytest

from eagle import EagleError
from eagle.config import SamplingConfig, load_config_file
from train.generation import BatchDecoder, generate_batch
from eagle.prompts import has_chat_template
from eagle.runtime.target import load_target
from train import regenerate
from train.data import load_chats
from train.selfdistill import SelfDistillConfig, main as selfdistill_main

from tests.conftest import tiny_gemma
from tests.train.test_train import save_tiny_chat_target


def sharegpt(users: list[str], system: str | None = None) -> dict:
    turns = [{"from": "system", "value": system}] if system else []
    for u in users:
        turns += [{"from": "human", "value": u}, {"from": "gpt", "value": "t9 t9"}]
    return {"id": "x", "conversations": turns}


def test_read_elements_keeps_the_complete_elements_of_a_cut_array_and_counts_bad_lines():
    whole = json.dumps([sharegpt(["t5"]), sharegpt(["t6 t7"]), sharegpt(["t8"])])
    records, bad, cut = regenerate.read_elements(whole[:-20])
    assert len(records) == 2 and bad == 0 and cut
    assert regenerate.read_elements(whole) == (json.loads(whole), 0, False)
    lines = json.dumps(sharegpt(["t5"])) + "\n{not json\n\n" + json.dumps({"messages": []}) + "\n"
    records, bad, cut = regenerate.read_elements(lines)
    assert len(records) == 2 and bad == 1 and not cut


def test_jsonl_lines_keep_the_line_separators_inside_their_strings(tmp_path):
    """U+2028, U+0085 and U+001C end a line for str.splitlines but are plain characters in a JSON string,
    written as they are by json.dumps(ensure_ascii=False) (ShareGPT has them)."""
    records = [sharegpt([f"a{sep}b", "c"]) for sep in ("\u2028", "\x85", "\x1c")] + [sharegpt(["d"])]
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    assert regenerate.read_elements(path.read_text(encoding="utf-8")) == (records, 0, False)
    assert regenerate.completed(path) == records and regenerate.completed(path) == records  # the file is kept whole
    assert [c[0]["content"] for c in load_chats(str(path)).conversations] == ["a\u2028b", "a\x85b", "a\x1cb", "d"]


def test_select_chats_drops_malformed_benchmark_and_duplicate_conversations(tmp_path):
    (tmp_path / "mt.jsonl").write_text(json.dumps({"turns": ["t20 t21", "t22   t23"], "category": "c"}) + "\n")
    (tmp_path / "dev.jsonl").write_text(json.dumps({"prompt": "t30"}) + "\n")
    excluded = regenerate.benchmark_prompts(str(tmp_path))
    records = [sharegpt(["t5 t6", "t7"]), sharegpt(["t5  t6", "t7 "]),  # a duplicate up to whitespace
               sharegpt(["t8", "t22 t23"]),  # a second turn is an MT-bench turn
               sharegpt(["t30"]), sharegpt(["t31"], system="t4"), {"conversations": [{"from": "x", "value": "t5"}]},
               {"conversations": [{"from": "gpt", "value": "t5"}]}, "junk",
               sharegpt(["t10", "t11", "t12"])]
    chats, stats = regenerate.select_chats(records, excluded, heldout_fraction=0.0, max_turns=2)
    assert [c.users for c in chats] == [["t5 t6", "t7"], ["t31"], ["t10", "t11"]] and chats[1].system == "t4"
    assert (stats["malformed"], stats["no_user_turn"], stats["excluded_benchmark"], stats["duplicates"],
            stats["turns_over_max_turns"], stats["kept"]) == (2, 1, 2, 1, 1, 3)
    assert stats["excluded_by_file"] == {str(tmp_path / "dev.jsonl"): 1, str(tmp_path / "mt.jsonl"): 1}


def test_topic_code_keeps_the_conversations_whose_first_turn_is_about_code():
    records = [sharegpt(["Write a Python function that sorts a list.", "thanks"]), sharegpt(["```\nx = 1\n```"]),
               sharegpt(["Why does my SQL query return nothing?"]), sharegpt(["Plan a trip to Rome.", "in python?"]),
               sharegpt(["What is a good name for a cat?"])]
    chats, stats = regenerate.select_chats(records, {}, 0.0, 0, topic="code")
    assert [c.users[0][:12] for c in chats] == ["Write a Pyth", "```\nx = 1\n``", "Why does my "]
    assert stats["not_coding"] == 2 and stats["kept"] == 3
    assert len(regenerate.select_chats(records, {}, 0.0, 0)[0]) == 5  # topic "all"


def test_heldout_split_is_fixed_by_the_conversation_not_its_place():
    records = [sharegpt([f"t{4 + i % 50} t{5 + i // 50}"]) for i in range(400)]
    chats, _ = regenerate.select_chats(records, {}, 0.25, 0)
    held = {c.id for c in chats if c.heldout}
    assert 60 < len(held) < 140
    random.Random(0).shuffle(records)
    again, _ = regenerate.select_chats(records, {}, 0.25, 0)
    assert {c.id for c in again if c.heldout} == held


def run_regenerate(tmp_path, target_dir, source, out, *settings):
    keys = dict(item.split("=", 1) for item in (f"target={target_dir}", f"source={source}", f"out_dir={out}",
                                                  "answer_max_tokens=6", "context_tokens=40", "rows=2",
                                                  f"exclude_prompts={tmp_path / 'bench.jsonl'}", *settings))
    selfdistill_main(["--set", *(f"{k}={v}" for k, v in keys.items())])  # settings replace the defaults
    return {r["id"]: r for path in ("data.jsonl", "heldout.jsonl") if (out / path).exists()
            for r in map(json.loads, (out / path).read_text().splitlines())}


@pytest.mark.slow
def test_every_turn_is_the_targets_answer_given_the_regenerated_conversation(tmp_path):
    """Multi-turn: answer t is the target's greedy answer to u1, a1, ..., u_t (its own earlier
    answers, not the source's); a benchmark prompt's conversation and a duplicate are dropped and
    counted; a turn that would not fit the context ends its conversation; the output is chat data
    the trainer reads; a killed run resumes to the same data; sampled answers are seeded."""
    target_dir = save_tiny_chat_target(tmp_path / "target", vocab_size=64)
    (tmp_path / "bench.jsonl").write_text(json.dumps({"prompt": "t40 t41"}) + "\n")
    rng = random.Random(0)
    records = [sharegpt([" ".join(f"t{rng.randint(4, 63)}" for _ in range(rng.randint(1, 5)))
                         for _ in range(rng.randint(1, 3))]) for _ in range(12)]
    records += [sharegpt(["t40 t41"]), records[0], sharegpt([" ".join(["t5"] * 40), "t6"])]
    source = tmp_path / "sharegpt.json"
    source.write_text(json.dumps(records)[:-1])  # cut short like the package's file
    out = tmp_path / "out"
    made = run_regenerate(tmp_path, target_dir, source, out, "heldout_fraction=0.3")
    stats = json.loads((out / "stats.json").read_text())
    assert stats["source"]["excluded_benchmark"] == 1 and stats["source"]["duplicates"] == 1
    assert stats["source"]["source_cut_short"] and stats["source"]["kept"] == 13
    assert stats["generation"]["first_turn_too_long"] == 1
    assert stats["written"]["train"] + stats["written"]["heldout"] == len(made) == 12 and stats["written"]["heldout"]
    target = load_target(str(target_dir))
    turns = 0
    for record in made.values():
        convo = record["conversations"]
        users, answers = [m["value"] for m in convo[::2]], [m["value"] for m in convo[1::2]]
        for t, answer in enumerate(answers):
            messages = [{"role": role, "content": text} for u, a in zip(users[:t], answers)
                        for role, text in (("user", u), ("assistant", a))] + [{"role": "user", "content": users[t]}]
            text = target.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            ids = target.tokenizer(text, add_special_tokens=False)["input_ids"]
            alone = generate_batch(target, [ids], 6, SamplingConfig()).token_ids[0]
            assert answer == target.tokenizer.decode(alone, skip_special_tokens=True).strip()
            turns += 1
    assert turns > len(made)  # multi-turn conversations were answered turn by turn
    assert len(load_chats(str(out / "data.jsonl")).conversations) == stats["written"]["train"]

    lines = (out / "data.jsonl").read_text().splitlines()  # killed while writing the third record
    (out / "data.jsonl").write_text(lines[0] + "\n" + lines[1] + "\n" + lines[2][:15])
    assert run_regenerate(tmp_path, target_dir, source, out, "heldout_fraction=0.3") == made
    assert len((out / "data.jsonl").read_text().splitlines()) == len(lines)

    sampled = run_regenerate(tmp_path, target_dir, source, tmp_path / "s1", "answer_temperature=1.0")
    assert run_regenerate(tmp_path, target_dir, source, tmp_path / "s2", "answer_temperature=1.0", "rows=3") == sampled
    assert sampled != run_regenerate(tmp_path, target_dir, source, tmp_path / "s3", "answer_temperature=1.0", "seed=5")


def test_answers_source_keeps_the_sources_own_answers_and_loads_no_target(tmp_path, monkeypatch):
    """``answers=source``: every kept conversation is written with the source's own answers (two assistant turns
    in a row joined; turns from the first unanswered user turn on dropped; a conversation left with none
    skipped), benchmark prompts and the held-out split as for the target's answers; no target is loaded."""
    monkeypatch.setattr(regenerate, "load_target", lambda *a, **k: pytest.fail("answers=source loads no target"))
    (tmp_path / "bench.jsonl").write_text(json.dumps({"prompt": "t40 t41"}) + "\n")
    records = [{"id": str(i), "conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": f"a{i}"},
                                                 {"from": "gpt", "value": f"b{i}"}, {"from": "human", "value": f"r{i}"},
                                                 {"from": "gpt", "value": f"c{i}"}]} for i in range(20)]
    records += [sharegpt(["t40 t41"]), {"id": "u", "conversations": [{"from": "human", "value": "unanswered"}]},
                {"id": "v", "conversations": [{"from": "human", "value": "v1"}, {"from": "gpt", "value": "w1"},
                                              {"from": "human", "value": "v2"}]}]
    source = tmp_path / "sharegpt.json"
    source.write_text(json.dumps(records))
    made = run_regenerate(tmp_path, "unused-target", source, tmp_path / "out", "answers=source", "heldout_fraction=0.2")
    stats = json.loads((tmp_path / "out" / "stats.json").read_text())
    assert stats["source"]["excluded_benchmark"] == 1 and stats["generation"]["no_answer"] == 1
    assert len(made) == 21 and 0 < stats["written"]["heldout"] < 21
    turns = sorted([m["value"] for m in r["conversations"]] for r in made.values())
    assert turns == sorted([[f"q{i}", f"a{i}\n\nb{i}", f"r{i}", f"c{i}"] for i in range(20)] + [["v1", "w1"]])
    with pytest.raises(EagleError):
        SelfDistillConfig(answers="teacher")


def test_the_sharegpt_recipe_parses_and_bad_settings_are_refused():
    root = Path(__file__).resolve().parents[2]
    for target in ("smollm2-135m-instruct", "gemma-3-270m"):
        cfg = load_config_file(SelfDistillConfig, str(root / f"configs/recipes/{target}/sharegpt.yaml"))
        assert cfg.source == "sharegpt" and cfg.answer_max_tokens < cfg.context_tokens
    for bad in ({"rows": -1}, {"max_turns": True}, {"answer_max_tokens": 4096}, {"heldout_fraction": 1.5}):
        with pytest.raises(EagleError):
            SelfDistillConfig(**bad)


def test_past_the_deadline_nothing_starts_and_conversations_under_way_keep_their_answered_turns(monkeypatch):
    """``max_wall_s``: once the deadline passes ``take`` gives nothing (no new conversation, no next
    turn); a turn running then still finishes, and ``cut`` hands every conversation waiting for its
    next turn to ``done`` with the turns answered so far."""
    import collections
    import types

    monkeypatch.setattr(regenerate, "prompt_text", lambda target, chat, answers: "x" * (3 + 2 * len(answers)))
    monkeypatch.setattr(regenerate, "extend_ids", lambda tokenizer, text, previous: [1] * len(text))
    target = types.SimpleNamespace(tokenizer=types.SimpleNamespace(
        decode=lambda ids, skip_special_tokens: " ".join(map(str, ids))))
    chats = [regenerate.Chat(name, None, users, False) for name, users in
             (("a", ["u1", "u2", "u3"]), ("b", ["v1", "v2"]), ("c", ["w1"]))]
    gen = collections.Counter()
    work = regenerate.Conversations(target, iter(chats), 4, 100, 0, gen)
    first, second = work.take(), work.take()
    assert [r.key[0].id for r in (first, second)] == ["a", "b"]
    work.finish(*first.key, [5], True)  # a's first turn: its second waits in the queue
    work.deadline = 0.0
    assert work.take() is None and work.follow_ups
    work.finish(*second.key, [6, 7], True)  # b's first turn was running: it finishes
    work.cut()
    assert [(chat.id, answers) for chat, answers in work.done] == [("a", ["5"]), ("b", ["6 7"])]
    assert gen["conversations_cut_by_time"] == 2 and not work.follow_ups


def check_extended_prompts(target, conversations: list[list[str]], system: str | None = None) -> int:
    """Each next prompt of each conversation (users and answers alternating) tokenized by
    ``extend_ids`` from the one before equals the whole prompt tokenized; -> prompts checked."""
    checked = 0
    for turns in conversations:
        chat = regenerate.Chat("c", system, turns[::2], False)
        previous = None
        for t in range(len(chat.users)):
            text = regenerate.prompt_text(target, chat, turns[1::2][:t])
            ids = regenerate.extend_ids(target.tokenizer, text, previous)
            assert ids == target.tokenizer(text, add_special_tokens=False)["input_ids"], (turns, t)
            previous, checked = (text, ids), checked + 1
    return checked


def test_a_next_prompt_tokenized_from_the_one_before_is_the_whole_prompt_tokenized(tmp_path):
    target = load_target(str(save_tiny_chat_target(tmp_path / "target", vocab_size=64)))
    rng = random.Random(0)
    conversations = [[" ".join(f"t{rng.randint(4, 63)}" for _ in range(rng.randint(1, 6)))
                      for _ in range(2 * rng.randint(1, 4))] for _ in range(20)]
    assert check_extended_prompts(target, conversations) > 40
    cuts = regenerate._cut_tokens(target.tokenizer)
    assert cuts and all(target.tokenizer.convert_ids_to_tokens(i) == t for i, t in cuts.items())


@pytest.mark.integration
def test_next_prompts_of_real_chats_tokenize_as_whole_prompts_with_the_default_target():
    """SmolLM2's chat template and tokenizer, the tracked chats' turns (code, lists, other
    languages, leading and trailing spaces) as users and answers."""
    target = load_target("smollm2-135m-instruct")
    chats = load_chats("data/people-smollm2/data.jsonl.gz").conversations[:40]
    conversations = []
    for i, chat in enumerate(chats):
        texts = [m["content"] for m in chat if m["role"] in ("user", "assistant")]
        conversations.append([t + (" " if i % 3 == 0 else "") for t in texts * 2])  # 2+ turns each
    assert check_extended_prompts(target, conversations, system=None) >= 80
    assert check_extended_prompts(target, conversations[:5], system="Be brief.\n") >= 10


def test_a_base_model_answers_each_turn_continuing_the_plain_conversation():
    """A base model (a Gemma-3 whose tokenizer has no chat template): each turn's prompt is the
    conversation's contents back to back (``train.data.plain_spans``, what training reads), and each
    answer, kept as written, is the target's greedy continuation of it; decoded batched."""
    target = tiny_gemma(seed=3, window=6)
    assert not has_chat_template(target.tokenizer)
    chats = [regenerate.Chat(id=f"c{i}", system=None, users=[f" t{4 + i} t{5 + i} ", f" t{9 + i} t{3 + i} t7 "],
                             heldout=False) for i in range(5)]
    work = regenerate.Conversations(target, iter(chats), 5, 64, 0, collections.Counter())
    decoder = BatchDecoder(target, 2, 64, SamplingConfig(), refill_at=1)
    for result in decoder.stream(work.take):
        chat, answers = result.key
        work.finish(chat, answers, result.token_ids, result.ended)
    assert len(work.done) == 5
    for chat, answers in work.done:
        assert len(answers) == 2
        for t, answer in enumerate(answers):
            text = "".join(u + a for u, a in zip(chat.users[:t], answers)) + chat.users[t]
            ids = target.tokenizer(text, add_special_tokens=False)["input_ids"]
            alone = generate_batch(target, [ids], 5, SamplingConfig()).token_ids[0]
            assert answer == target.tokenizer.decode(alone, skip_special_tokens=True)
