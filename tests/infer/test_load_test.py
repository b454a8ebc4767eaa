"""The load test of ``eagle-bench --concurrency``: its statistics against brute force, its check
against answers that were lost, cut or mixed, and a whole run against a tiny model's server (and
against one whose backend swaps the tokens of two sequences: the negative control)."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from infer import load_test as lt  # noqa: E402
from infer.bench import main as bench_main  # noqa: E402
from infer.scheduler import Progress, SerialBackend  # noqa: E402
from infer.serve import create_app  # noqa: E402

PROMPTS = [{"prompt": p, "category": "c"} for p in ("t3 t4 t5", "t9 t2 t9 t2 t9", "t17 t5 t6 t7", "t30 t1", "t8")]


def test_percentiles_match_numpy():
    rng = random.Random(0)
    for n in (1, 2, 7, 100):
        values = [rng.random() for _ in range(n)]
        for q in (0, 50, 90, 99, 100):
            assert lt.percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert lt.percentile([], 50) is None
    assert lt.spread([1.0, 3.0]) == {"p50": 2.0, "p90": 2.8, "p99": 2.98}


def record(text: str, finish: str = "length", error: str | None = None) -> dict:
    return {"text": text, "finish": finish, "error": error, "tokens": len(text.split()), "ttft_s": 0.1,
            "latency_s": 1.0, "eagle": None}


def test_check_names_lost_cut_and_mixed_answers():
    refs = [record("a b c"), record("d e f"), record("g h"), record("i j"), record("k", "stop")]
    got = [record("a b c"), record("", None, "HTTP 500: boom"), record("g"), record("i x"), record("k", "length")]
    bad = lt.check(got, refs)
    assert [(b["request"], b["kind"]) for b in bad] == [(1, "lost"), (2, "cut"), (3, "mixed"), (4, "cut")]
    assert lt.check(refs, refs) == []
    # a level sending the prompts twice: request i is checked against reference i mod 5
    assert [b["request"] for b in lt.check(refs + got, refs)] == [6, 7, 8, 9]


def test_summary_counts_tokens_errors_and_latencies():
    records = [record("a b c"), record("d e"), record("", None, "HTTP 429")]
    row = lt.summarize_level("ar", 2, records, 2.0, [])
    assert (row["tokens"], row["errors"], row["tokens_per_second"], row["mismatches"]) == (5, 1, 2.5, 0)
    # time per output token after the first: (1.0 - 0.1) / 2 and / 1
    assert row["tpot_s"]["p50"] == pytest.approx((0.45 + 0.9) / 2)
    assert "| ar | 2 | 3 | 2.5 |" in lt.markdown([row])


@pytest.fixture(scope="module")
def model():
    from eagle import EagleModel
    from tests.conftest import tiny_drafter, tiny_target

    target = tiny_target(max_positions=256)
    return EagleModel.from_pretrained(target, drafter=tiny_drafter(target), total_tokens=12, depth=4, top_k=3)


def test_a_run_against_the_server_finds_every_answer_intact(model):
    with lt.LocalServer(create_app(model, max_batch=3)) as server:
        rows = lt.run_load(server.base, PROMPTS, ["eagle-tree", "ar"], [1, 3], max_tokens=12, log=lambda _: None)
    assert [(r["method"], r["concurrency"]) for r in rows] == [("eagle-tree", 1), ("eagle-tree", 3), ("ar", 1),
                                                                ("ar", 3)]
    for r in rows:
        assert (r["requests"], r["errors"], r["mismatches"], r["tokens"]) == (5, 0, 0, 60)
        assert r["tokens_per_second"] > 0 and r["ttft_s"]["p50"] > 0 and r["tpot_s"]["p99"] > 0
        assert r["load_average"] is None or r["load_average"] >= 0
    # the batched engine sizes trees from the load: on this random drafter it may draft nothing
    assert rows[0]["mean_accepted_length"] >= 1.0 and rows[2]["mean_accepted_length"] == 1.0


def test_levels_send_k_requests_per_client_taking_the_prompts_in_turn(model):
    """``per_client``: a level of N clients sends N * K requests over the prompts again and again;
    the reference sends each prompt used once, and every answer is checked against its own."""
    assert lt.level_bodies(["a", "b", "c"], 4, 2) == ["a", "b", "c", "a", "b", "c", "a", "b"]
    assert lt.level_bodies(["a", "b", "c"], 4, None) == ["a", "b", "c"]
    with lt.LocalServer(create_app(model, max_batch=4)) as server:
        rows = lt.run_load(server.base, PROMPTS, ["ar"], [1, 2, 4], max_tokens=8, per_client=2, log=lambda _: None)
    assert [(r["concurrency"], r["requests"], r["errors"], r["mismatches"], r["tokens"]) for r in rows] == [
        (1, 5, 0, 0, 40), (2, 4, 0, 0, 32), (4, 8, 0, 0, 64)]


class Swapping(SerialBackend):
    """A broken backend: when two sequences step together, each gets the other's tokens."""

    def step(self) -> list[Progress]:
        out = super().step()
        if len(out) >= 2 and out[0].tokens and out[1].tokens:
            a, b = out[0], out[1]
            out[0], out[1] = Progress(a.key, b.tokens, a.stop_reason), Progress(b.key, a.tokens, b.stop_reason)
        return out


def test_a_backend_that_mixes_sequences_is_caught(model):
    with lt.LocalServer(create_app(model, backend=Swapping(model, 2))) as server:
        rows = lt.run_load(server.base, PROMPTS, ["ar"], [1, 2], max_tokens=12, log=lambda _: None)
    assert rows[0]["mismatches"] == 0  # alone, nothing to swap with
    assert rows[1]["mismatches"] > 0 and "mixed" in {m["kind"] for m in rows[1]["mismatched"]}


def test_the_references_equal_the_library_alone(model):
    """The one-client level, against which the others are checked, is the library's own greedy output."""
    with lt.LocalServer(create_app(model)) as server:
        records, _ = lt.run_level(server.base, lt.bodies_for(PROMPTS, "eagle-tree", 10, 0.0, 1.0, 0, None), 1)
    for p, r in zip(PROMPTS, records):
        ref = model.generate([{"role": "user", "content": p["prompt"]}], method="eagle-tree", max_new_tokens=10)
        assert (r["text"], r["finish"], r["tokens"]) == (ref.text, "length", 10)


def test_bench_load_test_command_line(tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    base = ["--prompts", str(prompts)]
    for argv, message in [
            (["--url", "http://x"], "--url is an option of the load test: give --concurrency too"),
            (["--max-batch", "2"], "--max-batch is an option of the load test"),
            (["--concurrency", "0"], "--concurrency must list distinct client counts >= 1"),
            (["--concurrency", "1,1"], "--concurrency must list distinct"),
            (["--concurrency", "two"], "--concurrency must be a comma list"),
            (["--concurrency", "1", "--methods", "hf,ar"], "the load test runs methods eagle-serve serves"),
            (["--concurrency", "1", "--methods", "eagle-tree@eagle3"], "not eagle-tree@eagle3"),
            (["--concurrency", "1", "--max-batch", "0"], "--max-batch must be >= 1"),
            (["--set", "requests_per_client=2"], "requests_per_client is an option of the load test"),
            (["--concurrency", "1", "--set", "requests_per_client=0"], "requests_per_client must be >= 1")]:
        assert bench_main(base + argv) == 2, argv
        assert message in capsys.readouterr().err


def test_bench_load_test_against_a_running_server(model, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS[:3]))
    out = tmp_path / "load.json"
    with lt.LocalServer(create_app(model, api_key="k", max_batch=2)) as server:
        code = bench_main(["--prompts", str(prompts), "--methods", "ar", "--max-new-tokens", "6", "--concurrency",
                           "1,2", "--url", server.base, "--set", "api_key=k", "--json", str(out), "--drafter", "x",
                           "--plot", "p.png"])
        assert code == 0, capsys.readouterr().err
        err = capsys.readouterr().err
        assert "--drafter is ignored with --url" in err and "--plot is ignored by the load test" in err
        report = json.loads(out.read_text())
        assert report["kind"] == "load-test" and "api_key" not in report["config"]
        assert [(r["concurrency"], r["errors"], r["mismatches"]) for r in report["results"]] == [(1, 0, 0), (2, 0, 0)]
        # a wrong key: every request fails, and the command says so
        assert bench_main(["--prompts", str(prompts), "--methods", "ar", "--max-new-tokens", "6", "--concurrency",
                           "1", "--url", server.base, "--set", "api_key=bad"]) == 2
        assert "HTTP 401" in capsys.readouterr().out
