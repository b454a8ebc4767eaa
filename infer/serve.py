"""``eagle-serve``: an OpenAI-compatible HTTP server over one ``EagleModel``, and a chat page.

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions`` (streaming as server-sent
events or not), ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text) and the
chat page at ``/``. The engine decodes one request at a time (batch size 1) in a worker thread;
requests wait in a bounded queue (``--max-queue``; a full queue answers 429). A client that goes
away stops its generation at the next decoding round. Bad requests get 400 with an OpenAI-style
error body ``{"error": {"message", "type", "param", "code"}}``.

Besides OpenAI's fields a request may give ``method`` (one of ``eagle.engine.METHODS``) and
``top_k``; answers carry an ``eagle`` field with the decoding stats, and stream chunks carry the
chunk's text as ``spans``, pieces marked drafted (accepted drafts) or not (the target's own
token of the round)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

from eagle.errors import EagleError, command
from eagle.engine import METHODS

PROG = "eagle-serve"
PAGE = Path(__file__).parent / "static" / "chat.html"
ROLES = ("system", "developer", "user", "assistant")
# the tree size of a seeded sampled eagle-tree request on a model whose trees are sized "auto": auto
# sizing adapts to timings measured while decoding, and the draws depend on the tree, so such a
# request would not repeat; a fixed size makes it repeat (as the library does with that size)
SEEDED_TOTAL_TOKENS = 8
VIEWS = 4  # models with another tree size kept at once


class ApiError(Exception):
    """An answer other than 200, as OpenAI shapes it."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 type: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = message, param, status, type, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclasses.dataclass
class Job:
    """One validated request. ``prompt``: chat messages (``chat``) or raw text or token ids."""

    prompt: Any
    chat: bool
    method: str
    max_tokens: int | None
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: list[str]
    stream: bool
    total_tokens: int | str | None = None
    include_usage: bool = False
    cancel: threading.Event = dataclasses.field(default_factory=threading.Event)


# ---------------------------------------------------------------- request validation

def _number(body: dict, name: str, default: float, low: float, high: float = math.inf,
            low_open: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ApiError(f"'{name}' must be a number, got {json.dumps(value)}", name)
    value = float(value)
    if not math.isfinite(value) or value < low or (low_open and value == low) or value > high:
        bound = f"in ({low:g}, {high:g}]" if low_open else (f">= {low:g}" if high == math.inf else f"in [{low:g}, {high:g}]")
        raise ApiError(f"'{name}' must be {bound}, got {value}", name)
    return value


def _integer(body: dict, name: str, default: int | None, low: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(f"'{name}' must be an integer, got {json.dumps(value)}", name)
    if low is not None and value < low:
        raise ApiError(f"'{name}' must be >= {low}, got {value}", name)
    return value


def _content(message: dict, i: int) -> str:
    content = message.get("content")
    if isinstance(content, list):  # content parts: only text ones
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(f"messages[{i}].content: only text parts are supported", f"messages[{i}].content")
            texts.append(part["text"])
        content = "".join(texts)
    if not isinstance(content, str):
        raise ApiError(f"messages[{i}].content must be a string or a list of text parts", f"messages[{i}].content")
    return content


def parse_messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError("'messages' must be a non-empty list of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ApiError(f"messages[{i}] must be an object with 'role' and 'content'", f"messages[{i}]")
        role = m.get("role")
        if role not in ROLES:
            raise ApiError(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {json.dumps(role)}",
                           f"messages[{i}].role")
        content = _content(m, i)
        if not content.strip():
            raise ApiError(f"messages[{i}].content is empty", f"messages[{i}].content")
        out.append({"role": "system" if role == "developer" else role, "content": content})
    return out


def parse_prompt(body: dict) -> str | list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise ApiError("'prompt' is empty", "prompt")
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    raise ApiError("'prompt' must be a non-empty string or a list of token ids (one prompt per request)", "prompt")


def parse_request(body: Any, chat: bool, model: Any, default_method: str, default_max_tokens: int | None) -> Job:
    """A request body -> ``Job``, or ``ApiError`` (400) saying which field is wrong."""
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    prompt = parse_messages(body) if chat else parse_prompt(body)
    model_name = body.get("model")
    if model_name is not None and not isinstance(model_name, str):
        raise ApiError("'model' must be a string", "model")
    n = _integer(body, "n", 1)
    if n != 1:
        raise ApiError("only n=1 is supported", "n")
    if body.get("logprobs") not in (None, False, 0) or body.get("top_logprobs") not in (None, 0):
        raise ApiError("logprobs are not supported", "logprobs")
    if body.get("echo") or body.get("suffix") is not None or body.get("best_of") not in (None, 1):
        raise ApiError("echo, suffix and best_of are not supported", "echo")
    name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _integer(body, name, default_max_tokens, low=1)
    temperature = _number(body, "temperature", 1.0, 0.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0, low_open=True)
    top_k = _integer(body, "top_k", 0, low=-1)
    seed = _integer(body, "seed", None)
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 16:
        raise ApiError("'stop' must be a non-empty string or a list of up to 16 of them", "stop")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise ApiError("'stream' must be true or false", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise ApiError("'stream_options' must be an object", "stream_options")
    total_tokens = body.get("total_tokens")
    if total_tokens is not None and total_tokens != "auto" and (
            isinstance(total_tokens, bool) or not isinstance(total_tokens, int) or total_tokens < 1):
        raise ApiError(f"'total_tokens' must be a positive integer or \"auto\", got {json.dumps(total_tokens)}",
                       "total_tokens")
    method = body.get("method", default_method)
    if method is None:
        method = default_method
    if method not in METHODS:
        raise ApiError(f"unknown method {json.dumps(method)}; choose from {', '.join(METHODS)}", "method")
    from infer.cli import check_method

    try:
        check_method(model, method)
    except EagleError as exc:
        raise ApiError(str(exc).replace("--drafter", "eagle-serve --drafter"), "method") from None
    return Job(prompt=prompt, chat=chat, method=method, max_tokens=max_tokens, temperature=temperature,
               top_p=top_p, top_k=max(0, top_k), seed=seed, stop=stop, stream=stream, total_tokens=total_tokens,
               include_usage=bool(options.get("include_usage")))


# ---------------------------------------------------------------- metrics

class Metrics:
    """Counters and gauges for ``/metrics`` (updated from the event loop and the worker)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests: dict[int, int] = {}
        self.tokens = 0
        self.prompt_tokens = 0
        self.rounds = 0
        self.decode_seconds = 0.0
        self.last_tokens_per_second = 0.0

    def request(self, status: int) -> None:
        with self.lock:
            self.requests[status] = self.requests.get(status, 0) + 1

    def generation(self, prompt_tokens: int, tokens: int, rounds: int, seconds: float) -> None:
        with self.lock:
            self.prompt_tokens += prompt_tokens
            self.tokens += tokens
            self.rounds += rounds
            self.decode_seconds += seconds
            self.last_tokens_per_second = tokens / seconds if seconds > 0 else 0.0

    def text(self, waiting: int, running: int) -> str:
        with self.lock:
            lines = ["# HELP eagle_requests_total Requests answered, by HTTP status (499: the client went away).",
                     "# TYPE eagle_requests_total counter"]
            lines += [f'eagle_requests_total{{status="{s}"}} {n}' for s, n in sorted(self.requests.items())]
            mean = self.tokens / self.rounds if self.rounds else 0.0
            tps = self.tokens / self.decode_seconds if self.decode_seconds > 0 else 0.0
            for name, kind, help_, value in [
                ("eagle_prompt_tokens_total", "counter", "Prompt tokens of generations run.", self.prompt_tokens),
                ("eagle_tokens_generated_total", "counter", "Tokens generated.", self.tokens),
                ("eagle_target_forwards_total", "counter", "Decoding rounds (one target forward each).", self.rounds),
                ("eagle_decode_seconds_total", "counter", "Seconds spent generating (prefill included).",
                 round(self.decode_seconds, 6)),
                ("eagle_mean_accepted_length", "gauge", "Tokens gained per target forward, over all generations.",
                 round(mean, 4)),
                ("eagle_tokens_per_second", "gauge", "Tokens generated per second of generating, over all.",
                 round(tps, 3)),
                ("eagle_last_tokens_per_second", "gauge", "Tokens per second of the last generation.",
                 round(self.last_tokens_per_second, 3)),
                ("eagle_queue_length", "gauge", "Requests waiting for the engine.", waiting),
                ("eagle_requests_running", "gauge", "Requests being generated (0 or 1).", running)]:
                lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name} {value}"]
        return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- the engine

def _find_stop(text: str, stops: list[str], start: int) -> int:
    """The first index at or after ``start`` where a stop string begins, or -1."""
    found = [i for i in (text.find(s, start) for s in stops) if i >= 0]
    return min(found) if found else -1


def _spans(text: str, flags: list[bool], start: int, end: int) -> list[list[Any]]:
    """``text[start:end]`` as [piece, drafted] runs of equal flags."""
    out: list[list[Any]] = []
    for i in range(start, end):
        flag = flags[i] if i < len(flags) else False
        if out and out[-1][1] == flag:
            out[-1][0] += text[i]
        else:
            out.append([text[i], flag])
    return out


class Engine:
    """Runs ``Job``s one at a time on a worker thread; at most ``max_queue`` wait behind the running one.
    A job reports through ``emit(kind, payload)``: "start" (prompt tokens), "delta" (spans, live
    stats), then "end" (finish reason, usage, stats), "cancelled", or "error" (an ``ApiError``)."""

    def __init__(self, model: Any, max_queue: int, metrics: Metrics) -> None:
        self.model, self.max_queue, self.metrics = model, max_queue, metrics
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="eagle-decode")
        self.lock = threading.Lock()
        self.admitted = 0  # waiting + running
        self.running = 0
        self.closed = threading.Event()  # set at shutdown: the running generation stops at its next round
        self.views: dict[int | str, Any] = {}  # total_tokens -> the model with trees of that size

    def close(self) -> None:
        self.closed.set()
        self.executor.shutdown(wait=False, cancel_futures=True)

    @property
    def waiting(self) -> int:
        return self.admitted - self.running

    def submit(self, job: Job, emit: Callable[[str, Any], None]) -> None:
        with self.lock:
            if self.admitted >= self.max_queue + 1:
                raise ApiError(f"the server is busy: {self.waiting} requests are waiting (--max-queue "
                               f"{self.max_queue}); retry later", status=429, type="rate_limit_error",
                               code="queue_full")
            self.admitted += 1
        self.executor.submit(self._run, job, emit)

    def _run(self, job: Job, emit: Callable[[str, Any], None]) -> None:
        with self.lock:
            self.running = 1
        try:
            if job.cancel.is_set():
                self.metrics.request(499)
                emit("cancelled", None)
                return
            self.generate(job, emit)
        except ApiError as exc:
            self.metrics.request(exc.status)
            emit("error", exc)
        except Exception as exc:  # a bug or a device failure: report it, keep serving
            self.metrics.request(500)
            emit("error", ApiError(f"generation failed: {type(exc).__name__}: {exc}", status=500, type="server_error"))
        finally:
            with self.lock:
                self.running = 0
                self.admitted -= 1

    def encode(self, job: Job) -> list[int]:
        target = self.model.target
        param = "messages" if job.chat else "prompt"
        try:
            if job.chat:
                ids = target.apply_chat_template(job.prompt)
            elif isinstance(job.prompt, str):
                ids = [int(t) for t in target.tokenizer(job.prompt)["input_ids"]]
            else:
                ids = job.prompt
                bad = [t for t in ids if not 0 <= t < target.vocab_size]
                if bad:
                    raise ApiError(f"token id {bad[0]} is outside the vocabulary (0..{target.vocab_size - 1})", param)
        except EagleError as exc:
            raise ApiError(str(exc), param) from None
        if not ids:
            raise ApiError("the prompt is empty once tokenized", param)
        if len(ids) >= target.max_context:
            raise ApiError(f"the prompt has {len(ids)} tokens; the model's context is {target.max_context} "
                           f"(the prompt must leave room for at least one new token)", param,
                           code="context_length_exceeded")
        return ids

    def tree_size(self, job: Job) -> int | str | None:
        """The tree size ``job`` decodes with (None: not a tree method or not a tree model)."""
        tree = getattr(self.model, "tree", None)
        if job.method != "eagle-tree" or tree is None or tree.choices is not None:
            return None
        if job.total_tokens is not None:
            return job.total_tokens
        if tree.total_tokens == "auto" and job.seed is not None and job.temperature > 0:
            return SEEDED_TOTAL_TOKENS
        return tree.total_tokens

    def model_for(self, size: int | str | None) -> Any:
        """The model, or one sharing its weights whose trees have ``size`` nodes."""
        if size is None or size == self.model.tree.total_tokens:
            return self.model
        view = self.views.pop(size, None)
        if view is None:
            from eagle.engine import EagleModel

            m = self.model
            view = EagleModel(m.target, m.drafter, m.draft_model, dataclasses.replace(m.tree, total_tokens=size),
                              m.speculative, m.prompt_lookup, m.drafter_dtype, m.drafter_quant or "none",
                              m.device_rounds)
        self.views[size] = view  # the most recently used last
        while len(self.views) > VIEWS:
            del self.views[next(iter(self.views))]
        return view

    def generate(self, job: Job, emit: Callable[[str, Any], None]) -> None:
        ids = self.encode(job)
        max_tokens = job.max_tokens or self.model.target.max_context - len(ids)
        size = self.tree_size(job)
        model = self.model_for(size)
        start = time.perf_counter()
        try:
            stream = model.generate(ids, method=job.method, max_new_tokens=max_tokens,
                                         temperature=job.temperature, top_p=job.top_p, top_k=job.top_k,
                                         seed=job.seed, stream=True)
        except EagleError as exc:
            raise ApiError(str(exc)) from None
        emit("start", len(ids))
        job.total_tokens = size
        hold = max((len(s) for s in job.stop), default=1) - 1  # text that may begin a stop string waits
        text, flags, sent, finish, lengths = "", [], 0, None, []
        rounds = stream.rounds()
        try:
            for round_ in rounds:
                lengths.append(len(round_.tokens))
                for piece, drafted in round_.spans:
                    text += piece
                    flags.extend([drafted] * len(piece))
                if job.stop:
                    cut = _find_stop(text, job.stop, max(0, sent - hold))
                    if cut >= 0:
                        text, finish = text[:cut], "stop"
                end = len(text) if finish else max(sent, len(text) - hold)
                if end > sent:
                    emit("delta", (_spans(text, flags, sent, end), self._stats(job, lengths, start)))
                    sent = end
                if finish or job.cancel.is_set() or self.closed.is_set():
                    break
        finally:
            rounds.close()
            stream.events.close()  # frees the caches now
        seconds = time.perf_counter() - start
        tokens = sum(lengths)
        self.metrics.generation(len(ids), tokens, len(lengths), seconds)
        if finish is None and (job.cancel.is_set() or self.closed.is_set()):
            self.metrics.request(499)
            emit("cancelled", None)
            return
        if finish is None:
            result = stream.result
            final = result.text  # the library's text: equal to text, plus any withheld partial character
            cut = _find_stop(final, job.stop, max(0, sent - hold)) if job.stop else -1
            finish = "stop" if cut >= 0 or result.stop_reason == "eos" else "length"
            if cut >= 0:
                final = final[:cut]
            text = final
            if len(text) > sent:
                emit("delta", (_spans(text, flags, sent, len(text)), self._stats(job, lengths, start)))
        usage = {"prompt_tokens": len(ids), "completion_tokens": tokens, "total_tokens": len(ids) + tokens}
        self.metrics.request(200)
        emit("end", (finish, text, usage, self._stats(job, lengths, start, done=True)))

    def _stats(self, job: Job, lengths: list[int], start: float, done: bool = False) -> dict:
        seconds = time.perf_counter() - start
        tokens = sum(lengths)
        stats = {"method": job.method, "tokens": tokens, "target_forwards": len(lengths),
                 "mean_accepted_length": round(tokens / len(lengths), 4) if lengths else 0.0,
                 "tokens_per_second": round(tokens / seconds, 3) if seconds > 0 else 0.0,
                 "elapsed_s": round(seconds, 4)}
        if job.total_tokens is not None:
            stats["total_tokens"] = job.total_tokens
        if done:
            stats["accept_lengths"] = list(lengths)
        return stats


# ---------------------------------------------------------------- the app

def create_app(model: Any, method: str | None = None, max_queue: int = 16, max_tokens: int | None = None,
               model_name: str | None = None) -> Any:
    """The ASGI app serving an already-built ``EagleModel`` (or anything with its ``generate``,
    ``target``, ``drafter`` and ``draft_model``). ``method``: the default decoding method
    (eagle-tree when the model has a drafter, else ar); ``max_queue``: requests that may wait behind
    the running one; ``max_tokens``: the default for requests that give none (None: up to the
    context); ``model_name``: the id ``/v1/models`` lists (default the target's name)."""
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.requests import Request
    from starlette.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
    from starlette.routing import Route

    if method is None:
        method = "eagle-tree" if model.drafter is not None else "ar"
    if max_queue < 0:
        raise EagleError(f"max_queue must be >= 0, got {max_queue}")
    name = model_name or model.target.name
    metrics = Metrics()
    engine = Engine(model, max_queue, metrics)
    created = int(time.time())

    def error(exc: ApiError) -> Response:
        metrics.request(exc.status)
        return JSONResponse(exc.body(), status_code=exc.status)

    async def watch_disconnect(request: Request, job: Job) -> None:
        """Sets ``job.cancel`` when the client goes away (Starlette has read the body already)."""
        try:
            while True:
                message = await request.receive()
                if message["type"] == "http.disconnect":
                    job.cancel.set()
                    return
        except Exception:
            return

    async def completions(request: Request, chat: bool) -> Response:
        try:
            raw = await request.body()
            try:
                body = json.loads(raw)
            except (ValueError, UnicodeDecodeError) as exc:
                raise ApiError(f"the request body is not valid JSON: {exc}") from None
            job = parse_request(body, chat, model, method, max_tokens)
        except ApiError as exc:
            return error(exc)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def emit(kind: str, payload: Any) -> None:
            loop.call_soon_threadsafe(events.put_nowait, (kind, payload))

        try:
            engine.submit(job, emit)
        except ApiError as exc:
            return error(exc)
        watcher = asyncio.ensure_future(watch_disconnect(request, job))
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        now = int(time.time())
        try:
            kind, payload = await events.get()
        except BaseException:
            job.cancel.set()
            watcher.cancel()
            raise
        if kind != "start":
            watcher.cancel()
            if kind == "error":
                return JSONResponse(payload.body(), status_code=payload.status)
            return Response(status_code=499)
        head = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": now,
                "model": name}

        def chunk(text: str | None, spans: list | None, stats: dict | None, finish: str | None = None,
                  usage: dict | None = None, role: bool = False) -> str:
            if chat:
                delta: dict = {}
                if role:
                    delta["role"] = "assistant"
                if text is not None:
                    delta["content"] = text
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            out: dict = dict(head, choices=[choice])
            if usage is not None:
                out["usage"] = usage
            if stats is not None:
                out["eagle"] = dict(stats, spans=spans or [])
            return f"data: {json.dumps(out)}\n\n"

        if job.stream:
            async def sse():
                try:
                    if chat:
                        yield chunk("", [], None, role=True)
                    while True:
                        kind, payload = await events.get()
                        if kind == "delta":
                            spans, stats = payload
                            yield chunk("".join(s[0] for s in spans), spans, stats)
                        elif kind == "end":
                            finish, _, usage, stats = payload
                            yield chunk(None if chat else "", [], stats, finish, usage)
                            if job.include_usage:
                                yield f"data: {json.dumps(dict(head, choices=[], usage=usage))}\n\n"
                            yield "data: [DONE]\n\n"
                            return
                        elif kind == "error":
                            yield f"data: {json.dumps(payload.body())}\n\n"
                            yield "data: [DONE]\n\n"
                            return
                        else:  # cancelled
                            return
                finally:
                    job.cancel.set()  # a no-op once generation ended; else the client went away
                    watcher.cancel()

            return StreamingResponse(sse(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

        try:
            while True:
                kind, payload = await events.get()
                if kind in ("end", "error", "cancelled"):
                    break
        finally:
            job.cancel.set()
            watcher.cancel()
        if kind == "error":
            return JSONResponse(payload.body(), status_code=payload.status)
        if kind == "cancelled":
            return Response(status_code=499)
        finish, text, usage, stats = payload
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        return JSONResponse({"id": rid, "object": "chat.completion" if chat else "text_completion", "created": now,
                             "model": name, "choices": [choice], "usage": usage, "eagle": stats})

    async def chat_completions(request: Request) -> Response:
        return await completions(request, chat=True)

    async def text_completions(request: Request) -> Response:
        return await completions(request, chat=False)

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": name, "object": "model", "created": created,
                                                         "owned_by": "eagle"}]})

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok", "model": name, "method": method, "queue_length": engine.waiting,
                             "running": engine.running})

    async def metrics_page(request: Request) -> Response:
        return PlainTextResponse(metrics.text(engine.waiting, engine.running),
                                 media_type="text/plain; version=0.0.4")

    async def page(request: Request) -> Response:
        html = PAGE.read_text(encoding="utf-8")
        config = json.dumps({"model": name, "method": method,
                             "methods": [m for m in METHODS if _available(model, m)]})
        return HTMLResponse(html.replace("/*CONFIG*/{}", config))

    async def http_error(request: Request, exc: HTTPException) -> Response:
        return error(ApiError(f"{request.method} {request.url.path}: {exc.detail}", status=exc.status_code,
                              type="invalid_request_error", code="not_found" if exc.status_code == 404 else None))

    async def server_error(request: Request, exc: Exception) -> Response:
        return error(ApiError(f"internal error: {type(exc).__name__}: {exc}", status=500, type="server_error"))

    routes = [Route("/", page), Route("/v1/chat/completions", chat_completions, methods=["POST"]),
              Route("/v1/completions", text_completions, methods=["POST"]), Route("/v1/models", models),
              Route("/health", health), Route("/metrics", metrics_page)]
    @contextlib.asynccontextmanager
    async def lifespan(app: Any):
        yield
        engine.close()

    app = Starlette(routes=routes, exception_handlers={HTTPException: http_error, Exception: server_error},
                    lifespan=lifespan)
    app.state.engine, app.state.metrics = engine, metrics
    return app


def _available(model: Any, method: str) -> bool:
    from infer.cli import check_method

    try:
        check_method(model, method)
    except EagleError:
        return False
    return True


# ---------------------------------------------------------------- the command

def warm_up(model: Any, method: str) -> None:
    """Decode a few tokens greedily and sampled, so that one-time costs (compiled kernels, the
    drafter's inference copy, "auto" tree sizing's cost curves) are paid before the first request."""
    start = time.perf_counter()
    print(f"{PROG}: warming up ({method}, greedy and sampled)", file=sys.stderr, flush=True)
    for temperature in (0.0, 1.0):
        model.generate("Hello", method=method, max_new_tokens=4, temperature=temperature, seed=0)
    print(f"{PROG}: warmed up in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)


def build_parser() -> Any:
    from eagle.errors import Parser
    from infer.cli import add_model_args

    parser = Parser(prog=PROG, description="Serve an OpenAI-compatible API (and a chat page at /) with "
                                           "EAGLE-style speculative decoding.")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="default 8000")
    parser.add_argument("--method", choices=METHODS,
                        help="default decoding method; a request may pick another with its 'method' field "
                             "(default: eagle-tree when a drafter is available, else ar)")
    parser.add_argument("--max-queue", type=int, default=16,
                        help="requests that may wait behind the running one; more get 429 (default 16)")
    parser.add_argument("--max-tokens", type=int,
                        help="max_tokens of a request that gives none (default: up to the context)")
    parser.add_argument("--no-warmup", action="store_true",
                        help="serve at once, without first decoding a few tokens greedily and sampled (the first "
                             "request then pays for compiling kernels and measuring the tree-size cost curves)")
    parser.add_argument("--served-model-name", help="the model id /v1/models lists (default: the target's name)")
    add_model_args(parser)
    return parser


@command(PROG)
def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if not 0 <= args.port <= 65535:
        raise EagleError(f"--port must be in 0..65535, got {args.port}")
    if args.max_queue < 0:
        raise EagleError(f"--max-queue must be >= 0, got {args.max_queue}")
    if args.max_tokens is not None and args.max_tokens < 1:
        raise EagleError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    try:
        import starlette  # noqa: F401
        import uvicorn
    except ImportError:
        raise EagleError("eagle-serve needs starlette and uvicorn: pip install 'eagle[serve]'") from None
    from infer.cli import check_method, load_model

    model = load_model(args)
    method = args.method or ("eagle-tree" if model.drafter is not None else "ar")
    check_method(model, method)
    if not args.no_warmup:
        warm_up(model, method)
    app = create_app(model, method=method, max_queue=args.max_queue, max_tokens=args.max_tokens,
                     model_name=args.served_model_name)
    print(f"{PROG}: {model.target.name}, method {method}, on http://{args.host}:{args.port}/ "
          f"(chat page at /, API at /v1)", file=sys.stderr, flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")


if __name__ == "__main__":
    sys.exit(main())
