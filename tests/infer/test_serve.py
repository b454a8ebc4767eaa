"""``eagle-serve`` over a tiny random model, with real clients: the ``openai`` package, raw HTTP
(httpx) and a headless chromium running the chat page."""

from __future__ import annotations

import dataclasses
import json
import os
import select
import shutil
import subprocess
import threading
import time
import urllib.parse

import pytest

pytest.importorskip("starlette")
uvicorn = pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from eagle import EagleModel  # noqa: E402
from infer.serve import create_app, main  # noqa: E402

from tests.conftest import tiny_drafter, tiny_target  # noqa: E402

MAX_POSITIONS = 256


class Paced:
    """The model, with a gate each generation waits at and an optional pause after each decoding
    round (to hold the engine busy, or to make a stream slow enough to drop midway)."""

    def __init__(self, model: EagleModel) -> None:
        self.model, self.gate, self.delay, self.fail = model, threading.Event(), 0.0, False
        self.gate.set()

    def __getattr__(self, name):
        return getattr(self.model, name)

    def generate(self, *args, **kwargs):
        assert self.gate.wait(30)
        if self.fail:
            raise RuntimeError("the device fell over")
        stream = self.model.generate(*args, **kwargs)
        delay, events = self.delay, stream.events

        def paced_events():
            for event in events:
                time.sleep(delay)
                yield event

        if delay:
            stream.events = paced_events()
        return stream


class Server:
    def __init__(self, app, paced: Paced) -> None:
        self.app, self.paced, self.model = app, paced, paced.model
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.02)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.base = f"http://127.0.0.1:{port}"
        self.http = httpx.Client(base_url=self.base, timeout=30)
        self.client = openai.OpenAI(base_url=self.base + "/v1", api_key="unused", max_retries=0, timeout=30)

    def metric(self, name: str) -> float:
        for line in self.http.get("/metrics").text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[-1])
        return 0.0

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module")
def server():
    target = tiny_target(max_positions=MAX_POSITIONS)
    # Fixed sizes: a ``pld`` chain sized by measured cost (``auto_length``) differs from run to run, and
    # the tests compare the server's rounds with a reference run's.
    model = EagleModel.from_pretrained(target, drafter=tiny_drafter(target), total_tokens=12, depth=4, top_k=3,
                                       auto_length=False)
    paced = Paced(model)
    srv = Server(create_app(paced, max_queue=8, max_batch=1), paced)  # one at a time: paced rounds fill the queue
    yield srv
    srv.close()


def chat(content: str) -> list[dict]:
    return [{"role": "user", "content": content}]


PROMPTS = ["t3 t4 t5", "t9 t2 t9 t2 t9", "t17 t5 t6 t7 t5 t6", "t30 t1"]


def drafted_words(model, result) -> int:
    """How many words of ``result.text`` came from accepted drafts: each round's tokens but its last
    (the word tokenizer shows one word per token, none for a special one)."""
    special, i, n = set(model.target.tokenizer.all_special_ids), 0, 0
    for length in result.accept_lengths:
        n += sum(t not in special for t in result.token_ids[i:i + length - 1])
        i += length
    return n


def test_rounds_split_drafted_text_from_the_targets(server):
    """``Stream.rounds``: the spans add up to the text; a round's drafted text is its tokens but the last."""
    model, drafted = server.model, 0
    special = set(model.target.tokenizer.all_special_ids)  # shown as no text
    for prompt in PROMPTS:
        stream = model.generate(chat(prompt), method="eagle-tree", max_new_tokens=24, stream=True)
        rounds = list(stream.rounds())
        assert "".join(r.text for r in rounds) == stream.result.text
        assert [len(r.tokens) for r in rounds] == stream.result.accept_lengths
        for r in rounds:  # the word tokenizer shows one word per token
            assert r.drafted == len(r.tokens) - 1
            shown = sum(t not in special for t in r.tokens[:-1])
            assert sum(len(text.split()) for text, d in r.spans if d) == shown
            assert [d for _, d in r.spans] in ([], [False], [True, False])
            drafted += r.drafted
    assert drafted > 0  # some drafts were accepted, so the split was exercised


@pytest.mark.parametrize("method", ["eagle-tree", "ar", "pld"])
def test_openai_client_greedy_equals_generate(server, method):
    for prompt in PROMPTS[:3]:
        ref = server.model.generate(chat(prompt), method=method, max_new_tokens=20)
        out = server.client.chat.completions.create(model="any", messages=chat(prompt), max_tokens=20,
                                                    temperature=0, extra_body={"method": method})
        assert out.choices[0].message.content == ref.text
        assert out.choices[0].finish_reason == "length"
        assert out.usage.prompt_tokens == ref.prompt_tokens and out.usage.completion_tokens == 20
        stats = out.model_extra["eagle"]
        assert stats["method"] == method and stats["accept_lengths"] == ref.accept_lengths
        assert stats["target_forwards"] == ref.target_forwards
        assert stats["mean_accepted_length"] == pytest.approx(ref.mean_accept_length, abs=1e-3)
        assert stats["tokens_per_second"] > 0

        chunks = list(server.client.chat.completions.create(model="any", messages=chat(prompt), max_tokens=20,
                                                            temperature=0, stream=True,
                                                            extra_body={"method": method}))
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        assert text == ref.text
        assert sum(bool(c.choices[0].delta.content) for c in chunks) > 1  # really streamed
        assert chunks[-1].choices[0].finish_reason == "length"
        assert chunks[-1].usage.completion_tokens == 20
        spans = [s for c in chunks if c.model_extra.get("eagle") for s in c.model_extra["eagle"]["spans"]]
        assert "".join(s[0] for s in spans) == ref.text
        assert sum(len(s[0].split()) for s in spans if s[1]) == drafted_words(server.model, ref)


def test_completions_endpoint_takes_raw_text(server):
    prompt = "t3 t4 t5 t6"
    ids = server.model.target.tokenizer(prompt)["input_ids"]
    ref = server.model.generate(ids, method="eagle-tree", max_new_tokens=16)
    out = server.client.completions.create(model="any", prompt=prompt, max_tokens=16, temperature=0)
    assert out.choices[0].text == ref.text and out.usage.completion_tokens == 16
    streamed = list(server.client.completions.create(model="any", prompt=prompt, max_tokens=16, temperature=0,
                                                     stream=True))
    assert "".join(c.choices[0].text for c in streamed) == ref.text
    assert streamed[-1].choices[0].finish_reason == "length"
    by_ids = server.http.post("/v1/completions", json={"prompt": ids, "max_tokens": 16, "temperature": 0}).json()
    assert by_ids["choices"][0]["text"] == ref.text


def test_stream_options_include_usage(server):
    chunks = list(server.client.chat.completions.create(model="any", messages=chat("t3 t4"), max_tokens=5,
                                                        temperature=0, stream=True,
                                                        stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    assert chunks[-2].choices[0].finish_reason == "length"


def test_seeded_sampling_is_reproducible(server):
    def ask(seed, method="eagle-tree"):
        return server.client.chat.completions.create(
            model="any", messages=chat("t3 t4 t5"), max_tokens=24, temperature=1.0, top_p=0.95, seed=seed,
            extra_body={"method": method, "top_k": 20}).choices[0].message.content

    for method in ("eagle-tree", "ar"):
        first = ask(11, method)
        assert ask(11, method) == first
        assert any(ask(seed, method) != first for seed in (12, 13, 14))  # the seed matters: it samples


@pytest.mark.parametrize("max_batch", [1, 4])
def test_seeded_sampling_repeats_with_auto_trees(server, max_batch):
    """Auto tree sizing adapts to timings, so a seeded sampled eagle-tree request runs with a fixed tree
    size (``SEEDED_TOTAL_TOKENS``): it repeats, and equals the library's output with that size, one
    request at a time or in the batched engine."""
    from starlette.testclient import TestClient

    from infer.serve import SEEDED_TOTAL_TOKENS

    model = server.model
    auto = EagleModel(model.target, model.drafter, tree=dataclasses.replace(model.tree, total_tokens="auto"))
    fixed = EagleModel(model.target, model.drafter,
                       tree=dataclasses.replace(model.tree, total_tokens=SEEDED_TOTAL_TOKENS))
    body = {"messages": chat("t3 t4 t5"), "max_tokens": 24, "temperature": 1.0, "seed": 5}
    with TestClient(create_app(auto, max_batch=max_batch)) as client:
        answers = [client.post("/v1/chat/completions", json=body).json() for _ in range(2)]
        greedy = client.post("/v1/chat/completions", json={**body, "temperature": 0}).json()
    ref = fixed.generate(chat("t3 t4 t5"), method="eagle-tree", max_new_tokens=24, temperature=1.0, seed=5)
    assert [a["choices"][0]["message"]["content"] for a in answers] == [ref.text] * 2
    assert answers[0]["eagle"]["total_tokens"] == SEEDED_TOTAL_TOKENS
    assert greedy["eagle"]["total_tokens"] == "auto"  # only seeded sampling leaves auto sizing


@pytest.mark.parametrize("max_batch", [1, 4])
def test_seeded_sampled_pld_runs_a_fixed_chain(server, monkeypatch, max_batch):
    """pld's ``auto_length`` shortens chains by timings measured while decoding, and the draws depend on
    the chain, so a seeded sampled pld request runs a fixed chain (``SEEDED_PLD_TOKENS``): it repeats, and
    equals the library's output with that chain, one request at a time or in the batched engine. Here
    the cost curve makes every verified row dear, so ``auto_length`` drafts nothing: the same seed then
    draws other tokens."""
    from starlette.testclient import TestClient

    from eagle.decoding import tree_sizing
    from infer.serve import SEEDED_PLD_TOKENS

    steep = tree_sizing.CostCurve(sizes=list(range(1, 65)), seconds=[float(n) for n in range(1, 65)])
    monkeypatch.setattr(tree_sizing, "cost_curve", lambda target, greedy=False: steep)
    model = EagleModel(server.model.target, server.model.drafter, tree=server.model.tree)
    whole = model.with_round_size("pld", SEEDED_PLD_TOKENS)
    prompt = chat(PROMPTS[1] + " " + PROMPTS[1])
    body = {"messages": prompt, "max_tokens": 32, "temperature": 1.0, "seed": 5, "method": "pld"}
    with TestClient(create_app(model, max_batch=max_batch)) as client:
        answers = [client.post("/v1/chat/completions", json=body).json() for _ in range(2)]
    ref = whole.generate(prompt, method="pld", max_new_tokens=32, temperature=1.0, seed=5)
    sized = model.generate(prompt, method="pld", max_new_tokens=32, temperature=1.0, seed=5)
    assert [a["choices"][0]["message"]["content"] for a in answers] == [ref.text] * 2
    assert answers[0]["eagle"]["total_tokens"] == SEEDED_PLD_TOKENS < model.prompt_lookup.num_draft_tokens + 1
    assert sized.target_forwards == len(sized.token_ids) and sized.text != ref.text


def test_stop_strings_cut_the_text(server):
    ref = server.model.generate(chat("t3 t4 t5"), method="eagle-tree", max_new_tokens=24).text
    words = ref.split()
    stop = " " + words[6]
    cut = ref[:ref.index(stop)]
    for stream in (False, True):
        body = {"messages": chat("t3 t4 t5"), "max_tokens": 24, "temperature": 0, "stop": [stop, "never"],
                "stream": stream}
        if stream:
            chunks = list(server.client.chat.completions.create(model="any", **body))
            text = "".join(c.choices[0].delta.content or "" for c in chunks)
            finish = chunks[-1].choices[0].finish_reason
        else:
            out = server.client.chat.completions.create(model="any", **body)
            text, finish = out.choices[0].message.content, out.choices[0].finish_reason
        assert (text, finish) == (cut, "stop")
    out = server.http.post("/v1/chat/completions", json={"messages": chat("t3 t4 t5"), "max_tokens": 24,
                                                         "temperature": 0, "stop": "never"}).json()
    assert out["choices"][0] == {"index": 0, "message": {"role": "assistant", "content": ref}, "logprobs": None,
                                 "finish_reason": "length"}


def test_concurrent_requests_are_all_answered_intact(server):
    jobs = [(PROMPTS[i % len(PROMPTS)], ("eagle-tree", "ar", "pld")[i % 3], 8 + i) for i in range(8)]
    refs = [server.model.generate(chat(p), method=m, max_new_tokens=n).text for p, m, n in jobs]
    results: dict[int, str] = {}

    def ask(i):
        p, m, n = jobs[i]
        if i % 2:
            chunks = server.client.chat.completions.create(model="any", messages=chat(p), max_tokens=n,
                                                           temperature=0, stream=True, extra_body={"method": m})
            results[i] = "".join(c.choices[0].delta.content or "" for c in chunks)
        else:
            results[i] = server.client.chat.completions.create(
                model="any", messages=chat(p), max_tokens=n, temperature=0,
                extra_body={"method": m}).choices[0].message.content

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [results.get(i) for i in range(len(jobs))] == refs


LONG = " ".join(["t3"] * MAX_POSITIONS)
BAD = [
    ("chat", '{"messages": [', None),
    ("chat", "[1, 2]", None),
    ("chat", {"messages": "hello"}, "messages"),
    ("chat", {"messages": []}, "messages"),
    ("chat", {"messages": [{"content": "t3"}]}, "messages[0].role"),
    ("chat", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ("chat", {"messages": [{"role": "user", "content": " "}]}, "messages[0].content"),
    ("chat", {"max_tokens": 0}, "max_tokens"),
    ("chat", {"max_tokens": "5"}, "max_tokens"),
    ("chat", {"max_tokens": 2.5}, "max_tokens"),
    ("chat", '{"messages": [{"role": "user", "content": "t3"}], "temperature": NaN}', "temperature"),
    ("chat", {"temperature": -0.5}, "temperature"),
    ("chat", {"temperature": "hot"}, "temperature"),
    ("chat", {"top_p": 0}, "top_p"),
    ("chat", {"top_p": 1.5}, "top_p"),
    ("chat", {"top_k": -2}, "top_k"),
    ("chat", {"seed": "x"}, "seed"),
    ("chat", {"stop": 5}, "stop"),
    ("chat", {"stop": [""]}, "stop"),
    ("chat", {"stream": "yes"}, "stream"),
    ("chat", {"method": "beam"}, "method"),
    ("chat", {"method": "sd"}, "method"),  # no draft model loaded
    ("chat", {"n": 2}, "n"),
    ("chat", {"total_tokens": 0}, "total_tokens"),
    ("chat", {"total_tokens": "many"}, "total_tokens"),
    ("chat", {"messages": chat(LONG)}, "messages"),
    ("text", {}, "prompt"),
    ("text", {"prompt": ""}, "prompt"),
    ("text", {"prompt": [3, 99999]}, "prompt"),
    ("text", {"prompt": LONG}, "prompt"),
]


@pytest.mark.parametrize("endpoint, body, param", BAD, ids=[f"{i}-{b[2]}" for i, b in enumerate(BAD)])
def test_bad_requests_get_400(server, endpoint, body, param):
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    if isinstance(body, dict):
        base = {"messages": chat("t3 t4")} if endpoint == "chat" else {}
        body = json.dumps({**base, "max_tokens": 4, **body})
    before = server.metric('eagle_requests_total{status="400"}')
    response = server.http.post(path, content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["param"] == param
    if body.count("t3") >= MAX_POSITIONS:
        assert error["code"] == "context_length_exceeded"
    assert server.metric('eagle_requests_total{status="400"}') == before + 1
    assert server.http.get("/health").json()["status"] == "ok"


def test_unknown_routes_answer_in_openai_shape(server):
    response = server.http.get("/v1/nothing")
    assert response.status_code == 404 and response.json()["error"]["code"] == "not_found"
    assert server.http.get("/v1/chat/completions").status_code == 405


def test_full_queue_gets_429_and_the_loop_stays_responsive(server):
    engine, paced = server.app.state.engine, server.paced
    engine.max_queue = 1
    paced.gate.clear()  # the first generation holds the engine until released
    results: list[int] = []
    body = {"messages": chat("t3 t4"), "max_tokens": 4, "temperature": 0}

    def ask():
        results.append(server.http.post("/v1/chat/completions", json=body).status_code)

    try:
        threads = [threading.Thread(target=ask) for _ in range(2)]
        threads[0].start()
        wait_for(lambda: server.http.get("/health").json()["running"] == 1)
        threads[1].start()
        wait_for(lambda: server.http.get("/health").json()["queue_length"] == 1)
        assert server.metric("eagle_queue_length") == 1
        response = server.http.post("/v1/chat/completions", json=body)
        assert response.status_code == 429
        assert response.json()["error"]["type"] == "rate_limit_error"
        assert server.client.models.list().data[0].id == server.model.target.name  # the loop still answers
    finally:
        paced.gate.set()
        engine.max_queue = 8
    for t in threads:
        t.join(30)
    assert results == [200, 200]


def wait_for(condition, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_dropped_stream_stops_its_generation(server):
    server.paced.delay = 0.05  # 200 tokens would take seconds
    cancelled = server.metric('eagle_requests_total{status="499"}')
    tokens = server.metric("eagle_tokens_generated_total")
    body = {"messages": chat("t3 t4"), "max_tokens": 200, "temperature": 0, "stream": True, "method": "ar"}
    try:
        with httpx.Client(base_url=server.base, timeout=30) as http:
            with http.stream("POST", "/v1/chat/completions", json=body) as response:
                lines = response.iter_lines()
                got = [line for line, _ in zip(lines, range(4))]
                assert all(line.startswith("data: ") for line in got if line)
        wait_for(lambda: server.metric('eagle_requests_total{status="499"}') == cancelled + 1, timeout=5)
    finally:
        server.paced.delay = 0.0
    assert server.metric("eagle_tokens_generated_total") - tokens < 50
    assert server.http.get("/health").json() == {"status": "ok", "model": server.model.target.name,
                                                  "method": "eagle-tree", "queue_length": 0, "running": 0,
                                                  "max_batch": 1}
    ref = server.model.generate(chat("t9 t2"), method="eagle-tree", max_new_tokens=10).text
    out = server.client.chat.completions.create(model="any", messages=chat("t9 t2"), max_tokens=10, temperature=0)
    assert out.choices[0].message.content == ref


def test_a_dropped_plain_request_stops_its_generation(server):
    server.paced.delay = 0.05
    cancelled = server.metric('eagle_requests_total{status="499"}')
    body = {"messages": chat("t3 t4"), "max_tokens": 200, "temperature": 0, "method": "ar"}
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.base + "/v1/chat/completions", json=body, timeout=0.5)
        wait_for(lambda: server.metric('eagle_requests_total{status="499"}') == cancelled + 1, timeout=5)
    finally:
        server.paced.delay = 0.0
    assert server.http.get("/health").json()["running"] == 0


def test_a_failing_generation_is_a_500_and_the_server_goes_on(server):
    server.paced.fail = True
    try:
        for stream in (False, True):
            response = server.http.post("/v1/chat/completions", json={"messages": chat("t3"), "max_tokens": 4,
                                                                      "stream": stream})
            assert response.status_code == 500
            assert response.json()["error"]["type"] == "server_error"
            assert "the device fell over" in response.json()["error"]["message"]
    finally:
        server.paced.fail = False
    out = server.client.chat.completions.create(model="any", messages=chat("t3"), max_tokens=4, temperature=0)
    assert out.choices[0].finish_reason == "length"


def test_models_health_and_metrics(server):
    assert [m.id for m in server.client.models.list().data] == [server.model.target.name]
    assert server.http.get("/health").json()["status"] == "ok"
    before = server.metric("eagle_tokens_generated_total")
    ok = server.metric('eagle_requests_total{status="200"}')
    server.client.chat.completions.create(model="any", messages=chat("t5 t6"), max_tokens=7, temperature=0)
    response = server.http.get("/metrics")
    assert response.headers["content-type"].startswith("text/plain")
    assert "# TYPE eagle_requests_total counter" in response.text
    assert server.metric("eagle_tokens_generated_total") == before + 7
    assert server.metric('eagle_requests_total{status="200"}') == ok + 1
    assert server.metric("eagle_mean_accepted_length") >= 1.0
    assert server.metric("eagle_tokens_per_second") > 0
    assert server.metric("eagle_queue_length") == 0


def test_command_line_errors_exit_2(capsys):
    assert main(["--set", "max_queue=-1"]) == 2
    assert "eagle-serve: error: max_queue must be >= 0" in capsys.readouterr().err
    assert main(["--method", "beam"]) == 2
    for argv, message in [(["--max-batch", "0"], "--max-batch must be >= 1"),
                          (["--set", "max_body_bytes=0"], "max_body_bytes must be >= 1"),
                          (["--set", "request_timeout_s=0"], "request_timeout_s must be > 0"),
                          (["--set", "request_timeout_s=.nan"], "request_timeout_s must be a finite number"),
                          (["--set", "api_key=''"], "api_key must be a non-empty token"),
                          (["--set", "api_key=a", "--set", "api_key=b"], "api_key is set twice")]:
        assert main(argv) == 2
        assert message in capsys.readouterr().err


# ---------------------------------------------------------------- the running batch, limits, auth

def another_server(server, **options):
    """One more server on the same model, with ``options`` of ``create_app``."""
    paced = Paced(server.model)
    srv = Server(create_app(paced, max_queue=8, **{"max_batch": 1, **options}), paced)
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def batched(server):
    """Four requests decoded together."""
    yield from another_server(server, max_batch=4)


@pytest.fixture(scope="module")
def limited(server):
    """A 1.5 s time limit per request."""
    yield from another_server(server, request_timeout_s=1.5)


def test_concurrent_requests_in_one_batch_are_correct_and_not_mixed(batched):
    """Eight requests (greedy and seeded sampled, three methods, streamed or not) on a batch of four:
    each answer equals the request decoded alone, and the batch really held several at once."""
    model = batched.model
    jobs = [(PROMPTS[i % len(PROMPTS)], ("eagle-tree", "ar", "pld")[i % 3], 10 + i, 0.0 if i % 4 else 1.0)
            for i in range(8)]
    refs = [model.generate(chat(p), method=m, max_new_tokens=n, temperature=t, seed=3 if t else None,
                           top_k=0).text for p, m, n, t in jobs]
    # the sampled eagle-tree request runs with SEEDED_TOTAL_TOKENS nodes only on "auto" trees; here 12
    assert batched.metric("eagle_steps_total") == 0  # a fresh server: the mean batch size is this test's
    results: dict[int, str] = {}
    batched.paced.delay = 0.01  # the requests overlap

    def ask(i):
        p, m, n, t = jobs[i]
        extra = {"method": m, "seed": 3} if t else {"method": m}
        if i % 2:
            chunks = batched.client.chat.completions.create(model="any", messages=chat(p), max_tokens=n,
                                                            temperature=t, stream=True, extra_body=extra)
            results[i] = "".join(c.choices[0].delta.content or "" for c in chunks)
        else:
            results[i] = batched.client.chat.completions.create(
                model="any", messages=chat(p), max_tokens=n, temperature=t, extra_body=extra).choices[0].message.content

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(jobs))]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        batched.paced.delay = 0.0
    assert [results.get(i) for i in range(len(jobs))] == refs
    assert batched.metric("eagle_batch_size_mean") > 1.2  # steps held several sequences
    assert batched.metric("eagle_batch_capacity") == 4


def test_a_cpu_server_batches_by_default(server):
    """Without ``max_batch`` a CPU target's server decodes up to ``CPU_MAX_BATCH`` requests together (a
    request alone on the one-sequence loop: infer.scheduler's tests)."""
    from starlette.testclient import TestClient

    from infer.serve import CPU_MAX_BATCH

    with TestClient(create_app(server.model)) as client:
        assert client.get("/health").json()["max_batch"] == CPU_MAX_BATCH > 1


def test_api_key_is_required_on_v1_only(server):
    from starlette.testclient import TestClient

    body = {"messages": chat("t3 t4"), "max_tokens": 3, "temperature": 0}
    with TestClient(create_app(server.model, api_key="s3cret")) as client:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"},
                        {"Authorization": "Basic s3cret"}, {"Authorization": "Bearer s3cret-and-more"}):
            response = client.post("/v1/chat/completions", json=body, headers=headers)
            assert response.status_code == 401, headers
            assert response.json()["error"]["code"] == "invalid_api_key"
            assert response.headers["www-authenticate"] == "Bearer"
        assert client.get("/v1/models").status_code == 401
        auth = {"Authorization": "Bearer s3cret"}
        assert client.post("/v1/chat/completions", json=body, headers=auth).status_code == 200
        assert client.post("/v1/completions", json={"prompt": "t3", "max_tokens": 2}, headers=auth).status_code == 200
        assert client.get("/v1/models", headers={"Authorization": "bearer s3cret"}).status_code == 200
        assert client.get("/health").status_code == 200 and client.get("/metrics").status_code == 200
        assert 'eagle_requests_total{status="401"} 6' in client.get("/metrics").text


def test_a_body_over_the_limit_gets_413(server):
    from starlette.testclient import TestClient

    body = json.dumps({"messages": chat("t3 " * 100), "max_tokens": 2, "temperature": 0}).encode()
    with TestClient(create_app(server.model, max_body_bytes=len(body) - 1)) as client:
        response = client.post("/v1/chat/completions", content=body, headers={"Content-Type": "application/json"})
        assert response.status_code == 413
        assert response.json()["error"]["code"] == "request_too_large"
        assert str(len(body) - 1) in response.json()["error"]["message"]
        # without a Content-Length (chunked): refused while reading
        response = client.post("/v1/chat/completions", content=iter([body[:100], body[100:]]),
                               headers={"Content-Type": "application/json"})
        assert response.status_code == 413
    with TestClient(create_app(server.model, max_body_bytes=len(body))) as client:
        assert client.post("/v1/chat/completions", content=body).status_code == 200


def test_a_prompt_longer_than_the_context_is_refused_with_the_numbers(server):
    import re

    for path, body in (("/v1/chat/completions", {"messages": chat(LONG)}), ("/v1/completions", {"prompt": LONG})):
        response = server.http.post(path, json={**body, "max_tokens": 4})
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["code"] == "context_length_exceeded"
        found = re.search(r"the prompt has (\d+) tokens; the model's context is (\d+)", error["message"])
        assert found and int(found[1]) >= MAX_POSITIONS and int(found[2]) == MAX_POSITIONS


def test_the_server_takes_what_it_loaded_out_of_the_cycle_collector(tmp_path, monkeypatch):
    """``eagle-serve`` freezes what is loaded before serving (``gc.freeze``): a full collection no longer scans
    the model's objects on every later run, which stalled every stream of the batch."""
    import gc

    from tests.conftest import save_tiny_model

    target, drafter = save_tiny_model(tmp_path)
    frozen = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: frozen.append(gc.get_freeze_count()))
    gc.unfreeze()
    try:
        main(["--target", target, "--drafter", drafter, "--set", "warmup=false", "--port", "0"])
    finally:
        gc.unfreeze()
    assert frozen and frozen[0] > 1000


def test_the_time_limit_ends_a_request_with_the_text_so_far(limited):
    """A request past ``--request-timeout-s`` ends with what it generated (finish_reason "length",
    ``eagle.timed_out``), streamed or not; one that never started gets 504."""
    model, paced = limited.model, limited.paced
    ref = model.generate(chat("t3 t4"), method="ar", max_new_tokens=200).text
    body = {"messages": chat("t3 t4"), "max_tokens": 200, "temperature": 0, "method": "ar"}
    paced.delay = 0.05  # 200 rounds would take 10 s
    try:
        start = time.monotonic()
        out = limited.http.post("/v1/chat/completions", json=body).json()
        assert time.monotonic() - start < 5
        text = out["choices"][0]["message"]["content"]
        assert out["choices"][0]["finish_reason"] == "length" and out["eagle"]["timed_out"] is True
        assert 0 < out["usage"]["completion_tokens"] < 200 and text and ref.startswith(text) and text != ref
        chunks = list(limited.client.chat.completions.create(model="any", stream=True, **{
            k: v for k, v in body.items() if k != "method"}, extra_body={"method": "ar"}))
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].model_extra["eagle"]["timed_out"]
        assert text and ref.startswith(text) and text != ref
        paced.gate.clear()  # the next generations wait at the gate, holding the batch
        codes: list[int] = []
        threads = [threading.Thread(target=lambda: codes.append(
            limited.http.post("/v1/chat/completions", json={**body, "max_tokens": 2}).status_code))
                   for _ in range(5)]
        for t in threads:
            t.start()
        wait_for(lambda: limited.http.get("/health").json()["queue_length"] == 4)
        time.sleep(1.6)
    finally:
        paced.gate.set()
        paced.delay = 0.0
    for t in threads:
        t.join(30)
    assert sorted(codes) == [200] + [504] * 4  # the one held at the gate, then four that timed out waiting
    assert limited.metric('eagle_requests_total{status="504"}') == 4


def test_cancelling_frees_the_place_in_the_batch(server):
    """With a batch of one, a queued request starts as soon as the running one's client goes away."""
    server.paced.delay = 0.05
    cancelled = server.metric('eagle_requests_total{status="499"}')
    body = {"messages": chat("t3 t4"), "max_tokens": 200, "temperature": 0, "stream": True, "method": "ar"}
    ref = server.model.generate(chat("t9 t2"), method="ar", max_new_tokens=6).text
    second: dict = {}

    def ask():
        second["out"] = server.client.chat.completions.create(model="any", messages=chat("t9 t2"), max_tokens=6,
                                                              temperature=0, extra_body={"method": "ar"})
        second["at"] = time.monotonic()

    try:
        with httpx.Client(base_url=server.base, timeout=30) as http:
            with http.stream("POST", "/v1/chat/completions", json=body) as response:
                lines = response.iter_lines()  # kept: a dropped iterator closes the connection
                next(lines)
                thread = threading.Thread(target=ask)
                thread.start()
                wait_for(lambda: server.http.get("/health").json()["queue_length"] == 1)
                time.sleep(0.3)
                assert server.http.get("/health").json()["queue_length"] == 1  # it waits while the first runs
                dropped = time.monotonic()
        thread.join(30)
    finally:
        server.paced.delay = 0.0
    assert second["out"].choices[0].message.content == ref
    assert second["at"] - dropped < 3  # 200 tokens would have taken 10 s
    assert server.metric('eagle_requests_total{status="499"}') == cancelled + 1
    assert server.http.get("/health").json()["running"] == 0


def test_metrics_report_the_batch_and_the_first_token(server):
    ttft = server.metric("eagle_time_to_first_token_seconds_count")
    for method in ("eagle-tree", "ar"):
        server.client.chat.completions.create(model="any", messages=chat("t5 t6"), max_tokens=7, temperature=0,
                                              extra_body={"method": method})
    text = server.http.get("/metrics").text
    assert "# TYPE eagle_time_to_first_token_seconds histogram" in text
    assert server.metric("eagle_time_to_first_token_seconds_count") == ttft + 2
    assert server.metric('eagle_time_to_first_token_seconds_bucket{le="+Inf"}') == ttft + 2
    assert server.metric("eagle_time_to_first_token_seconds_sum") > 0
    assert server.metric('eagle_accepted_length{method="eagle-tree"}') > 1.0  # drafts were accepted
    assert server.metric('eagle_accepted_length{method="ar"}') == 1.0
    assert server.metric('eagle_method_tokens_total{method="ar"}') >= 7
    for name, value in (("eagle_batch_size", 0), ("eagle_batch_capacity", 1), ("eagle_queue_length", 0)):
        assert server.metric(name) == value
    assert server.metric("eagle_batch_size_mean") == 1.0 and server.metric("eagle_steps_total") > 0


def test_metrics_count_graph_captures_and_fallbacks(server, monkeypatch):
    """The process's CUDA graph captures and fallbacks (``cuda_graphs.capture_stats``) are exposed."""
    from infer import scheduler

    monkeypatch.setattr(scheduler, "capture_stats", lambda: {"captured": 7, "fallbacks": 2, "errors": []})
    assert server.metric("eagle_graph_captures_total") == 7 and server.metric("eagle_graph_fallbacks_total") == 2


class Chromium:
    """Headless chromium driven over the DevTools protocol on a pipe (``--remote-debugging-pipe``:
    NUL-terminated JSON messages, commands on fd 3, answers on fd 4)."""

    def __init__(self, exe: str, profile: str) -> None:
        to_chrome, self.out = os.pipe()
        self.inp, from_chrome = os.pipe()

        def fds():
            os.dup2(to_chrome, 3)
            os.dup2(from_chrome, 4)

        self.proc = subprocess.Popen(
            [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
             f"--user-data-dir={profile}", "--remote-debugging-pipe", "about:blank"],
            preexec_fn=fds, close_fds=False, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(to_chrome)
        os.close(from_chrome)
        self.buffer, self.next_id = b"", 0

    def call(self, method: str, attached: str | None = None, timeout: float = 20.0, **params) -> dict:
        self.next_id += 1
        message = {"id": self.next_id, "method": method, "params": params}
        if attached:
            message["sessionId"] = attached
        os.write(self.out, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            while b"\0" in self.buffer:
                raw, self.buffer = self.buffer.split(b"\0", 1)
                answer = json.loads(raw)
                if answer.get("id") == self.next_id:
                    assert "error" not in answer, answer
                    return answer["result"]
            left = deadline - time.monotonic()
            assert left > 0, f"chromium did not answer {method}"
            if select.select([self.inp], [], [], left)[0]:
                data = os.read(self.inp, 1 << 20)
                assert data, "chromium exited"
                self.buffer += data

    def close(self) -> None:
        try:
            self.call("Browser.close", timeout=5)
        except (AssertionError, OSError):
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        os.close(self.out)
        os.close(self.inp)


@pytest.mark.skipif(shutil.which("chromium") is None,
                    reason="chromium is not installed (Debian: apt-get install -y chromium)")
def test_chat_page_streams_in_headless_chromium(server, tmp_path):
    prompt = "t17 t5 t6 t7 t5 t6"
    ref = server.model.generate(chat(prompt), method="eagle-tree", max_new_tokens=24)
    drafted = drafted_words(server.model, ref)
    assert drafted > 0
    query = urllib.parse.urlencode({"prompt": prompt, "temperature": 0, "max_tokens": 24, "method": "eagle-tree"})
    browser = Chromium(shutil.which("chromium"), str(tmp_path / "profile"))
    server.paced.delay = 0.05  # slow enough to watch the answer grow
    try:
        target = browser.call("Target.createTarget", url=f"{server.base}/?{query}")["targetId"]
        attached = browser.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        script = """JSON.stringify({state: document.body.dataset.state || "",
            answer: (document.querySelector(".msg.assistant .body") || {}).textContent || "",
            drafted: [...document.querySelectorAll(".msg.assistant .drafted")].map(e => e.textContent),
            chunks: (document.querySelector(".msg.assistant") || {dataset: {}}).dataset.chunks,
            stats: document.getElementById("stats").textContent})"""
        seen, deadline = [], time.monotonic() + 30
        while True:
            value = browser.call("Runtime.evaluate", attached, expression=script, returnByValue=True)["result"]
            page = json.loads(value.get("value") or '{"state": "", "answer": ""}')  # none before the page loaded
            seen.append(page["answer"])
            if page["state"] in ("done", "error") or time.monotonic() > deadline:
                break
            time.sleep(0.05)
    finally:
        server.paced.delay = 0.0
        browser.close()
    assert page["state"] == "done", page
    assert page["answer"] == ref.text
    partial = {a for a in seen if a and a != ref.text}
    assert partial and all(ref.text.startswith(a) for a in partial)  # it grew in place while streaming
    assert int(page["chunks"]) > 1
    assert sum(len(d.split()) for d in page["drafted"]) == drafted
    assert "tokens/s" in page["stats"] and f"mean accepted length {ref.mean_accept_length:.2f}" in page["stats"]


@pytest.mark.parametrize("scope", ["key", "server", "request"])
def test_suffix_scope_decides_whose_answers_draft(scope):
    """Two API keys ask the same: an earlier answer drafts for its own key (scope "key"), for anyone
    ("server") or for no one ("request"); answers equal plain decoding; /metrics counts by source."""
    target = tiny_target(max_positions=MAX_POSITIONS)
    model = EagleModel.from_pretrained(target, drafter=tiny_drafter(target), total_tokens=12, depth=4, top_k=3)
    srv = Server(create_app(model, method="suffix", max_queue=8, suffix_scope=scope), Paced(model))
    try:
        def ask(key: str) -> str:
            response = srv.http.post("/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                                     json=dict(messages=chat("t3 t4 t5"), max_tokens=24, temperature=0))
            return response.json()["choices"][0]["message"]["content"]

        plain = model.generate(chat("t3 t4 t5"), method="ar", max_new_tokens=24).text
        assert ask("alice") == plain
        before = srv.metric('eagle_accepted_drafts_total{source="history"}')
        assert ask("bob") == plain
        other = srv.metric('eagle_accepted_drafts_total{source="history"}') - before
        assert ask("alice") == plain
        same = srv.metric('eagle_accepted_drafts_total{source="history"}') - before - other
        assert (other > 0, same > 0) == {"key": (False, True), "server": (True, True), "request": (False, False)}[scope]
        assert "eagle_accepted_drafts_share" in srv.http.get("/metrics").text
    finally:
        srv.close()
