"""``eagle-serve``: an OpenAI-compatible HTTP server over one ``EagleModel``, and a chat page.

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions`` (streaming as server-sent
events or not), ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text) and the
chat page at ``/``. Generation runs on the scheduler thread of ``infer.scheduler``: requests wait
in a bounded queue (config key ``max_queue``; a full queue answers 429) and join the running batch
(``--max-batch``) between decoding rounds; each round's new text streams to its client. A client
that goes away leaves the batch at the next round. Bad requests get 400 with an OpenAI-style error
body ``{"error": {"message", "type", "param", "code"}}``; the config keys ``api_key``, ``max_body_bytes`` and
``request_timeout_s`` (``ServeOptions``) add 401, 413 and the time limit.

Besides OpenAI's fields a request may give ``method`` (one of ``eagle.engine.METHODS``) and
``top_k``; answers carry an ``eagle`` field with the decoding stats, and stream chunks carry the
chunk's text as ``spans``, pieces marked drafted (accepted drafts) or not (the target's own
token of the round)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import hashlib
import hmac
import json
import math
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Optional

from eagle.config import check_bool, check_float, check_int
from eagle.errors import EagleError, command
from eagle.engine import METHODS
from eagle.runtime.openmp import release_workers
from infer.scheduler import (SUFFIX_SCOPES, ApiError, BatchedBackend, Job, Metrics, Scheduler, SerialBackend,
                             SuffixScopes)

PROG = "eagle-serve"
PAGE = Path(__file__).parent / "static" / "chat.html"
ROLES = ("system", "developer", "user", "assistant")
# the tree size of a seeded sampled eagle-tree request on a model whose trees are sized "auto": auto
# sizing adapts to timings measured while decoding, and the draws depend on the tree, so such a
# request would not repeat; a fixed size makes it repeat (as the library does with that size)
SEEDED_TOTAL_TOKENS = 8
# the same for pld's chain (root included: 3 drafts) where auto_length would size it by timings: nearly as
# fast as auto_length on sampled chat, where the whole chain is far slower (docs/serving.md, Reproducibility)
SEEDED_PLD_TOKENS = 4
MAX_BODY_BYTES = 1 << 20  # the default --max-body-bytes
# the default --max-batch on a CPU (elsewhere 1: the batched engine's GPU paths are not on by default). A lone
# request still runs the one-sequence loop (``BatchedBackend``); 4 clients at once share one forward a round
CPU_MAX_BATCH = 8


def default_max_batch(model: Any) -> int:
    """``--max-batch`` when none is given: ``CPU_MAX_BATCH`` for a target on a CPU, else 1."""
    return CPU_MAX_BATCH if model.target.device.type == "cpu" else 1


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


# ---------------------------------------------------------------- what a request decodes

def encode(model: Any, job: Job) -> list[int]:
    """The prompt's token ids; ``ApiError`` (400) when it is empty, outside the vocabulary, or leaves
    no room in the context (the message gives both numbers)."""
    target = model.target
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


def round_size(model: Any, job: Job) -> int | str | None:
    """The most tokens a round of ``job`` verifies, root included: an ``eagle-tree`` request's tree size, a
    seeded sampled ``pld`` request's chain (None: the model's own sizing, or neither method). Sizes measured
    while decoding would make a seeded sampled request's draws differ from one run to the next (the draws
    depend on the drafts), so such a request gets a fixed size: ``SEEDED_TOTAL_TOKENS`` tree nodes, or
    a ``pld`` chain of ``SEEDED_PLD_TOKENS`` (at most the model's) where ``auto_length`` would size it."""
    seeded = job.seed is not None and job.temperature > 0
    if job.method == "pld":
        lookup = getattr(model, "prompt_lookup", None)
        if not seeded or lookup is None or not lookup.auto_length:
            return None
        return min(SEEDED_PLD_TOKENS, lookup.num_draft_tokens + 1)
    tree = getattr(model, "tree", None)
    if job.method != "eagle-tree" or tree is None or tree.choices is not None:
        return None
    if job.total_tokens is not None:
        return job.total_tokens
    if tree.total_tokens == "auto" and seeded:
        return SEEDED_TOTAL_TOKENS
    return tree.total_tokens


# ---------------------------------------------------------------- the app

def create_app(model: Any, method: str | None = None, max_queue: int = 16, max_tokens: int | None = None,
               model_name: str | None = None, api_key: str | None = None, max_body_bytes: int = MAX_BODY_BYTES,
               request_timeout_s: float | None = None, max_batch: int | None = None, backend: Any = None,
               cache_pool: bool = False, suffix_scope: str = "key") -> Any:
    """The ASGI app serving an already-built ``EagleModel`` (or anything with its ``generate``,
    ``target``, ``drafter`` and ``draft_model``). ``method``: the default decoding method
    (eagle-tree when the model has a drafter, else ar); ``max_queue``: requests that may wait for a
    place in the running batch; ``max_tokens``: the default for requests that give none (None: up to
    the context); ``model_name``: the id ``/v1/models`` lists (default the target's name);
    ``api_key``: the Bearer token ``/v1`` requires (None: none); ``max_body_bytes``: larger request
    bodies get 413; ``request_timeout_s``: a request's time limit from its arrival (None: none);
    ``max_batch``: requests decoded together (None: ``default_max_batch``); ``backend``: the
    ``infer.scheduler.Backend`` that decodes (default: ``SerialBackend(model)`` for ``max_batch`` 1, else
    ``BatchedBackend(model, max_batch, cache_pool)``, where a lone request runs as on ``SerialBackend``;
    ``cache_pool``: the batch's caches as slots of one pool, the GPU layout, off by default:
    ``eagle.decoding.serving.ServingEngine``); ``suffix_scope``: whose earlier answers the suffix drafts of
    methods suffix, eagle-tree and eagle-chain come from (``SuffixScopes``: "request", "key" (the request's
    API key's), "server"; for requests on the one-sequence loop)."""
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.requests import Request
    from starlette.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
    from starlette.routing import Route

    if method is None:
        method = "eagle-tree" if model.drafter_config is not None else "ar"
    if max_batch is None:
        max_batch = default_max_batch(model)
    check_serving(max_queue=max_queue, max_body_bytes=max_body_bytes, request_timeout_s=request_timeout_s,
                  max_batch=max_batch, api_key=api_key)
    name = model_name or model.target.name
    metrics = Metrics()
    from eagle.engine import EagleModel

    # suffix drafts for an EagleModel (a wrapper of one decodes as it decodes)
    scopes = SuffixScopes(model, suffix_scope) if isinstance(model, EagleModel) else None
    if backend is None:  # one request at a time on the fast single-stream path, else one batch
        backend = (SerialBackend(model, suffix=scopes) if max_batch == 1
                   else BatchedBackend(model, max_batch, cache_pool, suffix=scopes))
    engine = Scheduler(backend, model.target.tokenizer, model.target.max_context, max_queue, metrics)
    release_workers()  # this thread hands decoding to the scheduler's: its idle OpenMP workers would slow it
    created = int(time.time())
    key = api_key.encode() if api_key is not None else None

    def error(exc: ApiError, headers: dict | None = None) -> Response:
        metrics.request(exc.status)
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    def authorized(request: Request) -> bool:
        """Without --api-key every request; with it, those that bear it (compared in constant time)."""
        if key is None:
            return True
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key)

    def tenant(request: Request) -> str:
        """Who sent the request, for ``--suffix-scope key``: a digest of its Bearer token ("" without one)."""
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        return hashlib.sha256(token.strip().encode()).hexdigest()[:16] if scheme.lower() == "bearer" else ""

    def unauthorized() -> Response:
        return error(ApiError("a valid API key is required: send the header 'Authorization: Bearer <key>' with "
                              "the key given to eagle-serve (api_key)", status=401, code="invalid_api_key"),
                     headers={"WWW-Authenticate": "Bearer"})

    async def read_body(request: Request) -> bytes:
        """The request body, or ``ApiError`` 413 as soon as it is known to pass ``max_body_bytes``."""
        too_large = ApiError(f"the request body is larger than {max_body_bytes} bytes (eagle-serve "
                             f"max_body_bytes)", status=413, code="request_too_large")
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_body_bytes:
            raise too_large
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_body_bytes:
                raise too_large
            chunks.append(chunk)
        return b"".join(chunks)

    async def watch_disconnect(request: Request, job: Job) -> None:
        """Sets ``job.cancel`` when the client goes away (the body has been read already)."""
        try:
            while True:
                message = await request.receive()
                if message["type"] == "http.disconnect":
                    job.cancel.set()
                    engine.notify()
                    return
        except Exception:
            return

    async def completions(request: Request, chat: bool) -> Response:
        if not authorized(request):
            return unauthorized()
        try:
            raw = await read_body(request)
            try:
                body = json.loads(raw)
            except (ValueError, UnicodeDecodeError) as exc:
                raise ApiError(f"the request body is not valid JSON: {exc}") from None
            job = parse_request(body, chat, model, method, max_tokens)
            job.tenant = tenant(request)
            if request_timeout_s is not None:
                job.deadline = job.arrived + request_timeout_s
            ids = await asyncio.get_running_loop().run_in_executor(None, encode, model, job)
            job.total_tokens = round_size(model, job)
        except ApiError as exc:
            return error(exc)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def emit(kind: str, payload: Any) -> None:
            loop.call_soon_threadsafe(events.put_nowait, (kind, payload))

        try:
            engine.submit(job, ids, emit)
        except ApiError as exc:
            return error(exc)
        watcher = asyncio.ensure_future(watch_disconnect(request, job))
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        now = int(time.time())
        try:
            kind, payload = await events.get()
        except BaseException:
            job.cancel.set()
            engine.notify()
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
                    engine.notify()
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
            engine.notify()
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
        if not authorized(request):
            return unauthorized()
        return JSONResponse({"object": "list", "data": [{"id": name, "object": "model", "created": created,
                                                         "owned_by": "eagle"}]})

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok", "model": name, "method": method, "queue_length": engine.waiting,
                             "running": engine.running, "max_batch": backend.capacity})

    async def metrics_page(request: Request) -> Response:
        return PlainTextResponse(metrics.text(engine.waiting, engine.running, backend.capacity),
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


def check_serving(max_queue: int, max_body_bytes: int, request_timeout_s: float | None, max_batch: int,
                  api_key: str | None) -> None:
    """Refuse serving options out of range (``EagleError`` naming the option)."""
    if max_queue < 0:
        raise EagleError(f"max_queue must be >= 0, got {max_queue}")
    if max_body_bytes < 1:
        raise EagleError(f"max_body_bytes must be >= 1, got {max_body_bytes}")
    if request_timeout_s is not None and not (math.isfinite(request_timeout_s) and request_timeout_s > 0):
        raise EagleError(f"request_timeout_s must be > 0, got {request_timeout_s}")
    if max_batch < 1:
        raise EagleError(f"--max-batch must be >= 1, got {max_batch}")
    if api_key is not None and (not api_key.strip() or api_key != api_key.strip()):
        raise EagleError("api_key must be a non-empty token without surrounding spaces")


def build_parser() -> Any:
    from eagle.errors import Parser
    from infer.cli import add_config_args, add_model_args

    parser = Parser(prog=PROG, description="Serve an OpenAI-compatible API (and a chat page at /) with "
                                           "EAGLE-style speculative decoding.")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="default 8000")
    parser.add_argument("--method", choices=METHODS,
                        help="default decoding method; a request may pick another with its 'method' field "
                             "(default: eagle-tree when a drafter is available, else ar)")
    parser.add_argument("--max-batch", type=int, default=None,
                        help="requests decoded together in the running batch, one target forward a round verifying "
                             f"every running request's draft tree; others wait in the queue (default {CPU_MAX_BATCH} on "
                             "a CPU, else 1: one at a time; a request alone runs the single-stream path)")
    parser.add_argument("--suffix-scope", choices=SUFFIX_SCOPES, default="key",
                        help="whose earlier answers suffix drafts (methods suffix, eagle-tree, eagle-chain) may come "
                             "from: the request alone, the same API key's requests (default), or every request")
    add_model_args(parser)
    add_config_args(parser, "; eagle-serve's own: max_queue, api_key, max_body_bytes, request_timeout_s, max_tokens, "
                            "warmup, served_model_name, cache_pool")
    return parser


@dataclasses.dataclass(frozen=True)
class ServeOptions:
    """eagle-serve's own config keys. ``max_queue``: requests that may wait for a place in the running batch;
    more get 429. ``api_key``: require 'Authorization: Bearer KEY' on /v1 (401 otherwise). ``max_body_bytes``:
    larger request bodies get 413. ``request_timeout_s``: a request's time limit in seconds from its arrival;
    then it ends with the text so far (finish_reason "length", eagle.timed_out true), or gets 504 if it had not
    started. ``max_tokens``: max_tokens of a request that gives none (default: up to the context).
    ``warmup``: first decode a few tokens greedily and sampled (false: the first request pays for compiling
    kernels and measuring the tree-size cost curves). ``served_model_name``: the model id /v1/models lists
    (default: the target's name). ``cache_pool``: with max_batch above 1, the batch's caches as slots of one pool
    and, where the target runs on CUDA graphs, its rounds captured too (the GPU layout; off by default)."""

    max_queue: int = 16
    api_key: Optional[str] = None
    max_body_bytes: int = MAX_BODY_BYTES
    request_timeout_s: Optional[float] = None
    max_tokens: Optional[int] = None
    warmup: bool = True
    served_model_name: Optional[str] = None
    cache_pool: bool = False

    def __post_init__(self) -> None:
        check_int("max_queue", self.max_queue)
        check_int("max_body_bytes", self.max_body_bytes)
        if self.request_timeout_s is not None:
            check_float("request_timeout_s", self.request_timeout_s)
        if self.max_tokens is not None:
            check_int("max_tokens", self.max_tokens, 1)
        check_bool("warmup", self.warmup)
        check_bool("cache_pool", self.cache_pool)
        for name in ("api_key", "served_model_name"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise EagleError(f"{name} must be a string, got {getattr(self, name)!r}")


@command(PROG)
def main(argv: list[str] | None = None) -> None:
    from infer.cli import parse_command

    args = parse_command(build_parser(), argv, ServeOptions)
    if not 0 <= args.port <= 65535:
        raise EagleError(f"--port must be in 0..65535, got {args.port}")
    check_serving(max_queue=args.max_queue, max_body_bytes=args.max_body_bytes,
                  request_timeout_s=args.request_timeout_s, max_batch=1 if args.max_batch is None else args.max_batch, api_key=args.api_key)
    try:
        import starlette  # noqa: F401
        import uvicorn
    except ImportError:
        raise EagleError("eagle-serve needs starlette and uvicorn: pip install 'eagle[serve]'") from None
    from infer.cli import check_method, load_model

    model = load_model(args)
    method = args.method or ("eagle-tree" if model.drafter_config is not None else "ar")
    check_method(model, method)
    if args.warmup:
        warm_up(model, method)
    app = create_app(model, method=method, max_queue=args.max_queue, max_tokens=args.max_tokens,
                     model_name=args.served_model_name, api_key=args.api_key, max_body_bytes=args.max_body_bytes,
                     request_timeout_s=args.request_timeout_s, max_batch=args.max_batch, cache_pool=args.cache_pool,
                     suffix_scope=args.suffix_scope)
    print(f"{PROG}: {model.target.name}, method {method}, on http://{args.host}:{args.port}/ "
          f"(chat page at /, API at /v1)", file=sys.stderr, flush=True)
    # what is loaded now lives as long as the server: out of the cycle collector's view, whose full collections
    # would otherwise scan it all (about 150 ms with the default target), stalling every running stream
    gc.collect()
    gc.freeze()
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")


if __name__ == "__main__":
    sys.exit(main())
