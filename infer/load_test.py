"""The load test of ``eagle-bench --concurrency``: N concurrent OpenAI-style clients against
``eagle-serve`` (started in this process, or one at ``--url``), each sending streamed chat requests
over the prompts, one after the other.

Per level of concurrency and method it reports aggregate tokens/s (completion tokens of all
requests over the wall time of the level), time to first token, time per output token after the
first, and request latency (p50/p90/p99 over requests), the mean accepted length, and errors. Every
answer is checked against the same request decoded alone (greedy: the level with one client, run
first): an answer missing, cut short or different from it is counted and listed. The clients are
the standard library's ``http.client``; the statistics are small pure functions."""

from __future__ import annotations

import http.client
import json
import math
import os
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from typing import Any

QUANTILES = (50, 90, 99)


def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100) of ``values`` by linear interpolation, None when empty."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def spread(values: list[float]) -> dict:
    """``{"p50": ..., "p90": ..., "p99": ...}`` of ``values`` (seconds, rounded)."""
    return {f"p{q}": (None if (v := percentile(values, q)) is None else round(v, 5)) for q in QUANTILES}


def stream_chat(base: str, body: dict, api_key: str | None = None, timeout: float = 600.0) -> dict:
    """POST one streamed ``/v1/chat/completions`` request; returns its record: ``text``, ``finish``,
    ``tokens`` (usage.completion_tokens), ``ttft_s`` (to the first chunk with text), ``latency_s``,
    the ``eagle`` stats of the last chunk, and ``error`` (None, or what went wrong)."""
    url = urllib.parse.urlsplit(base)
    conn = http.client.HTTPConnection(url.hostname, url.port or 80, timeout=timeout)
    headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    record: dict = {"text": "", "finish": None, "tokens": 0, "ttft_s": None, "latency_s": None, "eagle": None,
                    "error": None}
    start = time.perf_counter()
    try:
        conn.request("POST", url.path.rstrip("/") + "/v1/chat/completions", json.dumps(body), headers)
        response = conn.getresponse()
        if response.status != 200:
            record["error"] = f"HTTP {response.status}: {response.read()[:300].decode(errors='replace')}"
            return record
        done = False
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                done = True
                break
            chunk = json.loads(data)
            if "error" in chunk:
                record["error"] = f"stream error: {chunk['error'].get('message')}"
                break
            if chunk.get("usage"):
                record["tokens"] = chunk["usage"]["completion_tokens"]
            if chunk.get("eagle"):
                record["eagle"] = chunk["eagle"]
            for choice in chunk.get("choices", []):
                piece = (choice.get("delta") or {}).get("content") or ""
                if piece and record["ttft_s"] is None:
                    record["ttft_s"] = time.perf_counter() - start
                record["text"] += piece
                if choice.get("finish_reason"):
                    record["finish"] = choice["finish_reason"]
        if not done and record["error"] is None:
            record["error"] = "the stream ended without [DONE]"
    except (OSError, http.client.HTTPException, ValueError) as exc:
        record["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        record["latency_s"] = time.perf_counter() - start
        conn.close()
    return record


def run_level(base: str, bodies: list[dict], concurrency: int, api_key: str | None = None) -> tuple[list[dict], float]:
    """Send ``bodies`` with ``concurrency`` clients (each takes the next body when its last answer is
    complete); returns the records in ``bodies``' order and the wall time."""
    records: list[dict | None] = [None] * len(bodies)
    lock, nxt = threading.Lock(), [0]

    def client() -> None:
        while True:
            with lock:
                i = nxt[0]
                nxt[0] += 1
            if i >= len(bodies):
                return
            records[i] = stream_chat(base, bodies[i], api_key)

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        for future in [pool.submit(client) for _ in range(concurrency)]:
            future.result()
    return [r for r in records if r is not None], time.perf_counter() - start


def check(records: list[dict], references: list[dict]) -> list[dict]:
    """Answers that differ from the same request decoded alone: ``kind`` "lost" (an error or no text
    where the reference has some), "cut" (a strict prefix of it), or "mixed" (anything else).
    Request i's reference is ``references[i % len(references)]`` (a level may send the prompts more
    than once, ``level_bodies``)."""
    bad = []
    for i, r in enumerate(records):
        ref = references[i % len(references)]
        if r["error"] is None and r["text"] == ref["text"] and r["finish"] == ref["finish"]:
            continue
        if r["error"] is not None or (not r["text"] and ref["text"]):
            kind = "lost"
        elif ref["text"].startswith(r["text"]):
            kind = "cut"
        else:
            kind = "mixed"
        bad.append({"request": i, "kind": kind, "error": r["error"], "got": r["text"][:80],
                    "expected": ref["text"][:80]})
    return bad


def summarize_level(method: str, concurrency: int, records: list[dict], wall_s: float,
                    mismatches: list[dict] | None) -> dict:
    """One row of the report (``mismatches`` None: not checked, e.g. sampled)."""
    ok = [r for r in records if r["error"] is None]
    tokens = sum(r["tokens"] for r in ok)
    tpot = [(r["latency_s"] - r["ttft_s"]) / (r["tokens"] - 1) for r in ok
            if r["ttft_s"] is not None and r["tokens"] > 1]
    forwards = sum((r["eagle"] or {}).get("target_forwards", 0) for r in ok)
    return {"method": method, "concurrency": concurrency, "requests": len(records), "errors": len(records) - len(ok),
            "tokens": tokens, "wall_s": round(wall_s, 3),
            "tokens_per_second": round(tokens / wall_s, 3) if wall_s > 0 else None,
            "mean_accepted_length": round(tokens / forwards, 4) if forwards else None,
            "ttft_s": spread([r["ttft_s"] for r in ok if r["ttft_s"] is not None]),
            "tpot_s": spread(tpot), "latency_s": spread([r["latency_s"] for r in ok]),
            "checked": mismatches is not None, "mismatches": len(mismatches) if mismatches is not None else None,
            "mismatched": mismatches or []}


def markdown(rows: list[dict]) -> str:
    """The report's table."""
    def ms(spread_: dict) -> str:
        return " / ".join("-" if v is None else f"{v * 1000:.0f}" for v in spread_.values())

    head = ("| method | clients | requests | tokens/s | x 1 client | TTFT ms p50/p90/p99 | per-token ms p50/p90/p99 "
            "| accepted length | errors | mismatches |\n|---|---|---|---|---|---|---|---|---|---|\n")
    base = {r["method"]: r["tokens_per_second"] for r in rows if r["concurrency"] == 1}
    lines = []
    for r in rows:
        one = base.get(r["method"])
        gain = f"{r['tokens_per_second'] / one:.2f}x" if one and r["tokens_per_second"] else "-"
        length = "-" if r["mean_accepted_length"] is None else f"{r['mean_accepted_length']:.2f}"
        checked = "-" if r["mismatches"] is None else str(r["mismatches"])
        lines.append(f"| {r['method']} | {r['concurrency']} | {r['requests']} | {r['tokens_per_second']} | {gain} "
                     f"| {ms(r['ttft_s'])} | {ms(r['tpot_s'])} | {length} | {r['errors']} | {checked} |")
    return head + "\n".join(lines) + "\n"


def bodies_for(prompts: list[dict], method: str, max_tokens: int, temperature: float, top_p: float, top_k: int,
               seed: int | None) -> list[dict]:
    """One streamed chat request body per prompt."""
    out = []
    for p in prompts:
        body = {"messages": [{"role": "user", "content": p["prompt"]}], "max_tokens": max_tokens,
                "temperature": temperature, "stream": True, "stream_options": {"include_usage": True},
                "method": method}
        if temperature > 0:
            body.update(top_p=top_p, top_k=top_k)
            if seed is not None:
                body["seed"] = seed
        out.append(body)
    return out


def level_bodies(bodies: list[dict], concurrency: int, per_client: int | None) -> list[dict]:
    """What a level of ``concurrency`` clients sends: every body once (``per_client`` None), or
    ``concurrency * per_client`` requests taking the bodies in turn, from the first again when
    they run out (so each client is busy however few the prompts)."""
    if per_client is None:
        return list(bodies)
    return [bodies[i % len(bodies)] for i in range(concurrency * per_client)]


def run_load(base: str, prompts: list[dict], methods: list[str], levels: list[int], max_tokens: int,
             temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
             warmup: int = 0, api_key: str | None = None, log: Any = print,
             per_client: int | None = None) -> list[dict]:
    """Per method: ``warmup`` requests (not counted) and the requests alone (one client: the
    reference); then per level of ``levels`` above 1, each method in turn (so the methods of a
    level run close together in time, on a machine whose load changes), sending
    ``level_bodies(..., per_client)``. The reference sends each distinct prompt the levels use once
    (all of them with ``per_client`` None, else the first ``max(levels) * per_client``); it is the
    one-client row. Greedy answers are checked against it (a seeded sampled one too: it repeats).
    Returns the report's rows, by method then level; each has ``load_average``, the machine's
    1-minute load average when its level ended (``os.getloadavg``; None where there is none)."""
    rows: dict[tuple[str, int], dict] = {}
    checked = temperature == 0 or seed is not None
    bodies, references = {}, {}

    def add(method: str, level: int, records: list[dict], wall: float, bad: list[dict]) -> None:
        row = summarize_level(method, level, records, wall, bad if checked else None)
        row["load_average"] = round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None
        rows[method, level] = row
        log(markdown([row]).splitlines()[-1])

    for method in methods:
        bodies[method] = bodies_for(prompts, method, max_tokens, temperature, top_p, top_k, seed)
        if per_client is not None:
            bodies[method] = bodies[method][:max(levels) * per_client]
        if warmup:
            run_level(base, bodies[method][:warmup], 1, api_key)
        references[method], wall = run_level(base, bodies[method], 1, api_key)
        if 1 in levels:
            add(method, 1, references[method], wall,
                [{"request": i, "kind": "lost", "error": r["error"], "got": "", "expected": ""}
                 for i, r in enumerate(references[method]) if r["error"] is not None])
    for level in levels:
        for method in methods if level > 1 else ():
            records, wall = run_level(base, level_bodies(bodies[method], level, per_client), level, api_key)
            add(method, level, records, wall, check(records, references[method]))
    return [rows[m, level] for m in methods for level in levels]


class LocalServer:
    """``eagle-serve``'s app on 127.0.0.1 (a free port) in a thread of this process, for the load
    test without ``--url``; ``base`` is its address. A context manager."""

    def __init__(self, app: Any) -> None:
        import uvicorn

        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, name="eagle-serve", daemon=True)
        self.base = ""

    def __enter__(self) -> "LocalServer":
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the in-process server did not start")
            time.sleep(0.02)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.base = f"http://127.0.0.1:{port}"
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def parse_levels(text: str) -> list[int]:
    """``"1,4,16"`` -> [1, 4, 16]: distinct positive client counts, in order."""
    from eagle.errors import EagleError

    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise EagleError(f"--concurrency must be a comma list of client counts, got {text!r}") from None
    if not levels or any(n < 1 for n in levels) or len(set(levels)) != len(levels):
        raise EagleError(f"--concurrency must list distinct client counts >= 1, got {text!r}")
    return sorted(levels)
