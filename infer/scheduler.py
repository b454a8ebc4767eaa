"""The generation side of ``eagle-serve``: a scheduler thread that owns a decoding backend.

The seam between the server and an engine is ``Backend``: ``add`` puts a sequence into the running
batch, ``step`` runs one decoding round of every sequence in it and returns each one's new tokens,
``cancel`` takes a sequence out. ``Scheduler`` drives it on one thread: between rounds it admits
waiting requests (FIFO, up to the backend's ``capacity``), drops those whose client went away or whose
time ran out, and turns each sequence's new tokens into text, stop-string cuts and stream events.
``SerialBackend`` is the engine of ``EagleModel.generate`` behind that seam: each sequence its own
generation, stepped one round (one target forward) in turn."""

from __future__ import annotations

import collections
import dataclasses
import itertools
import threading
import time
from typing import Any, Callable, Protocol

from eagle.errors import EagleError
from eagle.runtime.cuda_graphs import capture_stats

VIEWS = 4  # models with another round size kept at once
TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)  # seconds, for the histogram


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
    """One validated request. ``prompt``: chat messages (``chat``) or raw text or token ids;
    ``deadline``: the ``time.monotonic()`` by which it must be answered (None: no limit)."""

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
    tenant: str = ""  # a digest of the request's API key ("" without one)
    arrived: float = dataclasses.field(default_factory=time.monotonic)
    deadline: float | None = None
    cancel: threading.Event = dataclasses.field(default_factory=threading.Event)


# ---------------------------------------------------------------- the seam

@dataclasses.dataclass(frozen=True)
class Admission:
    """A sequence as a backend decodes it: ``ids`` the prompt's token ids, at most ``max_new_tokens``
    new ones (the prompt leaves room for at least one); ``total_tokens`` the most tokens an eagle-tree
    or pld round verifies, root included (None: the model's own sizing)."""

    key: int
    ids: list[int]
    method: str
    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    total_tokens: int | str | None = None
    tenant: str = ""  # whose earlier answers suffix drafts may come from (``SuffixScopes``)


@dataclasses.dataclass(frozen=True)
class Progress:
    """What one ``step`` did for one sequence: ``tokens``, the ids it accepted in that round (the
    accepted drafts, then the target's own token; empty when it only ended); ``stop_reason`` once it
    ended ("eos", "length" at ``max_new_tokens``, "context" at the end of the context) and left the batch."""

    key: int
    tokens: list[int]
    stop_reason: str | None = None
    sources: dict[str, int] | None = None  # once it ended: its accepted drafts by source, where known


SUFFIX_SCOPES = ("request", "key", "server")
KEY_STORES = 8  # tenants whose earlier answers are kept at once (scope "key"), the least recently served dropped


class SuffixScopes:
    """Which earlier answers a request's suffix drafts may come from (``eagle-serve --suffix-scope``):
    "request", none (its own prompt and output, and the corpus); "key", those of its API key's earlier
    requests; "server", every earlier request's. With "key" at most ``KEY_STORES`` tenants' answers
    are kept, each within ``history_tokens / KEY_STORES`` tokens, so the bound holds over all of them."""

    def __init__(self, model: Any, scope: str = "key") -> None:
        if scope not in SUFFIX_SCOPES:
            raise EagleError(f"unknown suffix scope {scope!r}; choose from {', '.join(SUFFIX_SCOPES)}")
        self.model, self.scope = model, scope
        self.stores: collections.OrderedDict[str, Any] = collections.OrderedDict()
        self.lock = threading.Lock()

    def store(self, tenant: str) -> Any:
        from eagle.drafting.suffix import SuffixStore

        shared = self.model.suffix_store
        if self.scope == "server":
            return shared
        if self.scope == "request":
            return shared.fresh()
        with self.lock:
            store = self.stores.pop(tenant, None)
            if store is None:
                cfg = dataclasses.replace(shared.cfg, history_tokens=max(2, shared.cfg.history_tokens // KEY_STORES))
                store = SuffixStore(cfg, shared.corpus)
            self.stores[tenant] = store
            while len(self.stores) > KEY_STORES:
                self.stores.popitem(last=False)
            return store

    def model_for(self, model: Any, method: str, tenant: str, seeded: bool = False) -> Any:
        """``model``, for method ``suffix`` and the drafting methods a view drafting from ``tenant``'s store.
        A ``seeded`` sampled request draws from its drafts, so it takes none from earlier answers (which
        change from run to run): its tokens repeat, and equal the library's for the same seed."""
        if seeded:
            return model.with_suffix(self.model.suffix_store.fresh()) if method == "suffix" else model
        if method in ("suffix", "eagle-tree", "eagle-chain", "sd"):
            return model.with_suffix(self.store(tenant))
        return model


class Backend(Protocol):
    """A decoding engine holding a running batch of at most ``capacity`` sequences.

    ``add`` joins a sequence before the next ``step`` (``EagleError``: the request is refused);
    ``step`` runs one round of every sequence in the batch and returns a ``Progress`` for each that
    accepted tokens or ended (an ended one has left the batch); ``cancel`` takes one out now and frees
    what it holds (an unknown key is ignored); ``close`` cancels all. Greedy output of a sequence must
    not depend on the others in the batch. Called from one thread only."""

    capacity: int

    def add(self, admission: Admission) -> None: ...

    def step(self) -> list[Progress]: ...

    def cancel(self, key: int) -> None: ...

    def close(self) -> None: ...


class SerialBackend:
    """``EagleModel.generate`` behind ``Backend``: each sequence its own generation (its own caches
    and sampling generator), and a ``step`` advances each of them one round in turn, one target
    forward each. ``capacity`` 1 decodes one request at a time; more interleave the rounds (fair
    turns, no throughput gain). Sequences of another tree size run on views of the model sharing its
    weights."""

    def __init__(self, model: Any, capacity: int = 1, suffix: SuffixScopes | None = None) -> None:
        if capacity < 1:
            raise EagleError(f"max_batch must be >= 1, got {capacity}")
        self.suffix = suffix
        if capacity > 1 and (getattr(model.target, "graphs", None) is not None or getattr(model, "device_rounds", False)):
            raise EagleError("interleaving generations (max_batch > 1) needs the dynamic path: the static path "
                             "(CUDA graphs, device rounds) keeps one generation's state in shared buffers")
        self.model, self.capacity = model, capacity
        self.streams: dict[int, Any] = {}
        self.views: dict[tuple[str, int | str], Any] = {}  # (method, size) -> the model whose rounds have that size

    def model_for(self, method: str, size: int | str | None) -> Any:
        """The model, or a view sharing its weights whose ``method`` rounds verify ``size`` tokens
        (``EagleModel.with_round_size``), kept for the next request of that size."""
        view = self.views.pop((method, size), None) or self.model.with_round_size(method, size)
        if (view.tree, view.prompt_lookup) == (self.model.tree, self.model.prompt_lookup):  # its own size
            return self.model
        self.views[method, size] = view  # the most recently used last
        while len(self.views) > VIEWS:
            del self.views[next(iter(self.views))]
        return view

    def add(self, admission: Admission) -> None:
        if len(self.streams) >= self.capacity:
            raise EagleError(f"the batch is full ({self.capacity} sequences)")
        a = admission
        model = self.model_for(a.method, a.total_tokens)
        if self.suffix is not None:
            model = self.suffix.model_for(model, a.method, a.tenant, a.seed is not None and a.temperature > 0)
        self.streams[a.key] = model.generate(
            a.ids, method=a.method, max_new_tokens=a.max_new_tokens, temperature=a.temperature, top_p=a.top_p,
            top_k=a.top_k, seed=a.seed, stream=True)

    def step(self) -> list[Progress]:
        out = []
        for key, stream in list(self.streams.items()):
            try:
                event = next(stream.events)
            except BaseException:
                self.cancel(key)
                raise
            if isinstance(event, list):
                out.append(Progress(key, event))
            else:  # the GenerationResult: it ended
                self.cancel(key)
                out.append(Progress(key, [], event.stop_reason, dict(event.accepted_by_source)))
        return out

    def cancel(self, key: int) -> None:
        stream = self.streams.pop(key, None)
        if stream is not None:
            stream.close()  # frees its caches now

    def close(self) -> None:
        for key in list(self.streams):
            self.cancel(key)


class BatchedBackend:
    """``eagle.decoding.serving.ServingEngine`` behind ``Backend``: every sequence of the batch
    drafts its own tree and ONE target forward verifies all of them each step; tree sizes come from
    the measured cost of the batch's rows (``load_sizing``), within an admission's ``total_tokens``
    (a seeded sampled request always gets all of it); ``cache_pool``: ``ServingEngine``'s (off by default).
    A sequence that finds the backend empty when a step begins (none running, none joining beside it) runs on
    ``SerialBackend`` (``suffix``: its ``SuffixScopes``), the one-sequence loop, so that one client alone pays
    nothing for batching; those arriving while it runs join the engine, and a step runs a round of both.
    Stop strings stay the scheduler's."""

    def __init__(self, model: Any, capacity: int, cache_pool: bool = False,
                 suffix: SuffixScopes | None = None) -> None:
        from eagle.decoding.serving import ServingEngine

        if capacity < 1:
            raise EagleError(f"max_batch must be >= 1, got {capacity}")
        self.engine, self.capacity = ServingEngine(model, max_batch=capacity, cache_pool=cache_pool), capacity
        self.serial = SerialBackend(model, suffix=suffix)
        self.admissions: dict[int, Admission] = {}  # added since the last step (queued in the engine)

    def add(self, admission: Admission) -> None:
        from eagle.decoding.serving import RequestOptions

        a = admission
        self.engine.add(a.key, list(a.ids), RequestOptions(  # refuses what cannot run, now
            method=a.method, max_new_tokens=a.max_new_tokens, temperature=a.temperature, top_p=a.top_p,
            top_k=a.top_k, seed=a.seed, total_tokens=a.total_tokens))
        self.admissions[a.key] = a

    def step(self) -> list[Progress]:
        if len(self.admissions) == 1 and not self.serial.streams and self.engine.request_ids == [*self.admissions]:
            (key, alone), = self.admissions.items()
            self.engine.cancel(key)
            self.serial.add(alone)
        self.admissions.clear()
        out = self.serial.step() if self.serial.streams else []
        return out + [Progress(e.request_id, list(e.new_token_ids), (e.stop_reason or "eos") if e.finished else None)
                      for e in self.engine.step()]

    def cancel(self, key: int) -> None:
        self.admissions.pop(key, None)
        self.serial.cancel(key)
        self.engine.cancel(key)

    def close(self) -> None:
        self.admissions.clear()
        self.serial.close()
        self.engine.close()


# ---------------------------------------------------------------- metrics

class Metrics:
    """Counters and gauges for ``/metrics`` (updated from the event loop and the scheduler)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests: dict[int, int] = {}
        self.tokens = 0
        self.prompt_tokens = 0
        self.rounds = 0
        self.decode_seconds = 0.0
        self.last_tokens_per_second = 0.0
        self.by_method: dict[str, list[int]] = {}  # method -> [tokens, rounds]
        self.by_source: dict[str, int] = {}  # accepted draft tokens by where they were drafted from
        self.steps = 0
        self.step_rows = 0  # sequences summed over steps
        self.step_seconds = 0.0
        self.ttft_buckets = [0] * len(TTFT_BUCKETS)
        self.ttft_sum = 0.0
        self.ttft_count = 0

    def request(self, status: int) -> None:
        with self.lock:
            self.requests[status] = self.requests.get(status, 0) + 1

    def generation(self, method: str, prompt_tokens: int, tokens: int, rounds: int, seconds: float) -> None:
        with self.lock:
            self.prompt_tokens += prompt_tokens
            self.tokens += tokens
            self.rounds += rounds
            self.decode_seconds += seconds
            self.last_tokens_per_second = tokens / seconds if seconds > 0 else 0.0
            counts = self.by_method.setdefault(method, [0, 0])
            counts[0] += tokens
            counts[1] += rounds

    def sources(self, counts: dict[str, int]) -> None:
        with self.lock:
            for source, n in counts.items():
                self.by_source[source] = self.by_source.get(source, 0) + n

    def step(self, rows: int, seconds: float) -> None:
        with self.lock:
            self.steps += 1
            self.step_rows += rows
            self.step_seconds += seconds

    def first_token(self, seconds: float) -> None:
        with self.lock:
            self.ttft_sum += seconds
            self.ttft_count += 1
            for i, bound in enumerate(TTFT_BUCKETS):
                if seconds <= bound:
                    self.ttft_buckets[i] += 1

    def text(self, waiting: int, running: int, capacity: int) -> str:
        def block(name: str, kind: str, help_: str, samples: list[tuple[str, Any]]) -> list[str]:
            return [f"# HELP {name} {help_}", f"# TYPE {name} {kind}"] + [f"{name}{labels} {v}" for labels, v in samples]

        graphs = capture_stats()
        with self.lock:
            lines = block("eagle_requests_total", "counter",
                          "Requests answered, by HTTP status (499: the client went away).",
                          [(f'{{status="{s}"}}', n) for s, n in sorted(self.requests.items())])
            mean = self.tokens / self.rounds if self.rounds else 0.0
            tps = self.tokens / self.decode_seconds if self.decode_seconds > 0 else 0.0
            for name, kind, help_, value in [
                ("eagle_prompt_tokens_total", "counter", "Prompt tokens of generations run.", self.prompt_tokens),
                ("eagle_tokens_generated_total", "counter", "Tokens generated.", self.tokens),
                ("eagle_target_forwards_total", "counter", "Decoding rounds, summed over sequences.", self.rounds),
                ("eagle_decode_seconds_total", "counter", "Seconds requests spent generating (prefill included), "
                                                          "summed over requests.", round(self.decode_seconds, 6)),
                ("eagle_mean_accepted_length", "gauge", "Tokens gained per decoding round, over all generations.",
                 round(mean, 4)),
                ("eagle_tokens_per_second", "gauge", "Tokens per second of a request's generating, over all.",
                 round(tps, 3)),
                ("eagle_last_tokens_per_second", "gauge", "Tokens per second of the last generation.",
                 round(self.last_tokens_per_second, 3)),
                ("eagle_queue_length", "gauge", "Requests waiting to join the running batch.", waiting),
                ("eagle_requests_running", "gauge", "Requests in the running batch.", running),
                ("eagle_batch_size", "gauge", "Sequences in the running batch now.", running),
                ("eagle_batch_capacity", "gauge", "Most sequences the running batch holds (--max-batch).", capacity),
                ("eagle_batch_size_mean", "gauge", "Sequences per decoding step, over all steps.",
                 round(self.step_rows / self.steps, 4) if self.steps else 0.0),
                ("eagle_steps_total", "counter", "Decoding steps (one round of every sequence in the batch).",
                 self.steps),
                ("eagle_step_seconds_total", "counter", "Seconds spent in decoding steps.",
                 round(self.step_seconds, 6)),
                ("eagle_graph_captures_total", "counter", "Static shapes captured as CUDA graphs (process-wide).",
                 graphs["captured"]),
                ("eagle_graph_fallbacks_total", "counter", "Shapes whose capture failed and that run eagerly, "
                                                           "slowly (process-wide).", graphs["fallbacks"])]:
                lines += block(name, kind, help_, [("", value)])
            methods = sorted(self.by_method.items())
            lines += block("eagle_method_tokens_total", "counter", "Tokens generated, by decoding method.",
                           [(f'{{method="{m}"}}', c[0]) for m, c in methods])
            lines += block("eagle_method_rounds_total", "counter", "Decoding rounds, by decoding method.",
                           [(f'{{method="{m}"}}', c[1]) for m, c in methods])
            lines += block("eagle_accepted_length", "gauge", "Tokens gained per decoding round, by decoding method.",
                           [(f'{{method="{m}"}}', round(c[0] / c[1], 4) if c[1] else 0.0) for m, c in methods])
            total = sum(self.by_source.values())
            lines += block("eagle_accepted_drafts_total", "counter",
                           "Accepted draft tokens by source (drafter, lookup; suffix: request, history, corpus).",
                           [(f'{{source="{k}"}}', n) for k, n in sorted(self.by_source.items())])
            lines += block("eagle_accepted_drafts_share", "gauge", "Share of the accepted draft tokens by source.",
                           [(f'{{source="{k}"}}', round(n / total, 4)) for k, n in sorted(self.by_source.items())])
            ttft = [(f'_bucket{{le="{b:g}"}}', n) for b, n in zip(TTFT_BUCKETS, self.ttft_buckets)]
            ttft += [('_bucket{le="+Inf"}', self.ttft_count), ("_sum", round(self.ttft_sum, 6)),
                     ("_count", self.ttft_count)]
            lines += ["# HELP eagle_time_to_first_token_seconds Seconds from a request's arrival to its first "
                      "generated token.", "# TYPE eagle_time_to_first_token_seconds histogram"]
            lines += [f"eagle_time_to_first_token_seconds{suffix} {v}" for suffix, v in ttft]
        return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- the scheduler

def find_stop(text: str, stops: list[str], start: int) -> int:
    """The first index at or after ``start`` where a stop string begins, or -1."""
    found = [i for i in (text.find(s, start) for s in stops) if i >= 0]
    return min(found) if found else -1


def text_spans(text: str, flags: list[bool], start: int, end: int) -> list[list[Any]]:
    """``text[start:end]`` as [piece, drafted] runs of equal flags."""
    out: list[list[Any]] = []
    for i in range(start, end):
        flag = flags[i] if i < len(flags) else False
        if out and out[-1][1] == flag:
            out[-1][0] += text[i]
        else:
            out.append([text[i], flag])
    return out


@dataclasses.dataclass
class _Pending:
    job: Job
    ids: list[int]
    emit: Callable[[str, Any], None]


class _Active:
    """A request in the running batch: its text so far and what of it was sent."""

    def __init__(self, pending: _Pending, tokenizer: Any) -> None:
        from eagle.engine import RoundText

        self.job, self.ids, self.emit = pending.job, pending.ids, pending.emit
        self.rounds = RoundText(tokenizer)
        self.text, self.flags, self.sent, self.lengths = "", [], 0, []
        self.start = time.perf_counter()
        self.first: float | None = None
        self.hold = max((len(s) for s in self.job.stop), default=1) - 1  # text that may begin a stop string waits

    def stats(self, done: bool = False, timed_out: bool = False) -> dict:
        seconds = time.perf_counter() - self.start
        tokens = sum(self.lengths)
        stats = {"method": self.job.method, "tokens": tokens, "target_forwards": len(self.lengths),
                 "mean_accepted_length": round(tokens / len(self.lengths), 4) if self.lengths else 0.0,
                 "tokens_per_second": round(tokens / seconds, 3) if seconds > 0 else 0.0,
                 "elapsed_s": round(seconds, 4)}
        if self.first is not None:
            stats["time_to_first_token_s"] = round(self.first - self.job.arrived, 4)
        if self.job.total_tokens is not None:
            stats["total_tokens"] = self.job.total_tokens
        if timed_out:
            stats["timed_out"] = True
        if done:
            stats["accept_lengths"] = list(self.lengths)
        return stats


class Scheduler:
    """Owns a ``Backend`` on one thread (``tokenizer`` turns each request's tokens into text). ``submit`` queues a request (at most ``max_queue`` wait; more
    get 429); between rounds the thread admits queued requests into the batch, removes cancelled and
    timed-out ones, steps the batch and reports to each request through its ``emit(kind, payload)``:
    "start" (prompt tokens) when it joins the batch, "delta" (spans, live stats) per round that shows
    new text, then "end" (finish reason, text, usage, stats), "cancelled", or "error" (an ``ApiError``;
    504 when the time limit passed before it joined the batch)."""

    def __init__(self, backend: Backend, tokenizer: Any, max_context: int, max_queue: int, metrics: Metrics) -> None:
        self.backend, self.tokenizer, self.max_queue, self.metrics = backend, tokenizer, max_queue, metrics
        self.max_context = max_context  # a request without max_tokens may fill it
        self.lock = threading.Lock()
        self.queue: collections.deque[_Pending] = collections.deque()
        self.active: dict[int, _Active] = {}
        self.keys = itertools.count()
        self.wake = threading.Event()
        self.closed = threading.Event()
        self.thread: threading.Thread | None = None

    @property
    def waiting(self) -> int:
        return len(self.queue)

    @property
    def running(self) -> int:
        return len(self.active)

    def submit(self, job: Job, ids: list[int], emit: Callable[[str, Any], None]) -> None:
        with self.lock:
            if self.closed.is_set():
                raise ApiError("the server is shutting down", status=503, type="server_error")
            if len(self.queue) >= self.max_queue and len(self.active) + len(self.queue) >= self.backend.capacity:
                raise ApiError(f"the server is busy: {len(self.queue)} requests are waiting (max_queue "
                               f"{self.max_queue}); retry later", status=429, type="rate_limit_error",
                               code="queue_full")
            self.queue.append(_Pending(job, ids, emit))
            if self.thread is None:
                self.thread = threading.Thread(target=self._loop, name="eagle-scheduler", daemon=True)
                self.thread.start()
        self.wake.set()

    def notify(self) -> None:
        """Wake the thread (a request was cancelled)."""
        self.wake.set()

    def close(self) -> None:
        self.closed.set()
        self.wake.set()
        if self.thread is not None:
            self.thread.join(30)

    # -- the thread

    def _loop(self) -> None:
        try:
            while not self.closed.is_set():
                self._admit()
                self._sweep()
                if not self.active:
                    self.wake.wait(0.5)
                    self.wake.clear()
                    continue
                start = time.perf_counter()
                rows = len(self.active)
                try:
                    progress = self.backend.step()
                except Exception as exc:  # a bug or a device failure: fail the batch, keep serving
                    self._fail_all(exc)
                    continue
                self.metrics.step(rows, time.perf_counter() - start)
                for p in progress:
                    if p.key in self.active:
                        self._advance(self.active[p.key], p)
        finally:
            for key, a in list(self.active.items()):
                self._drop(key, a)
            while self.queue:
                pending = self.queue.popleft()
                self.metrics.request(499)
                pending.emit("cancelled", None)
            self.backend.close()

    def _admit(self) -> None:
        while True:
            with self.lock:
                if not self.queue or len(self.active) >= self.backend.capacity:
                    return
                pending = self.queue.popleft()
                job = pending.job
                if job.cancel.is_set():
                    self.metrics.request(499)
                    pending.emit("cancelled", None)
                    continue
                if job.deadline is not None and time.monotonic() >= job.deadline:
                    self._error(pending.emit, ApiError(
                        f"the request's time limit ({job.deadline - job.arrived:g} s) passed while it waited for "
                        f"the engine", status=504, type="timeout_error", code="timeout"))
                    continue
                key = next(self.keys)
                self.active[key] = active = _Active(pending, self.tokenizer)
            max_tokens = job.max_tokens or max(1, self.max_context - len(pending.ids))
            admission = Admission(key, pending.ids, job.method, max_tokens, job.temperature, job.top_p, job.top_k,
                                  job.seed, job.total_tokens, job.tenant)
            try:
                self.backend.add(admission)
            except EagleError as exc:
                del self.active[key]
                self._error(pending.emit, ApiError(str(exc)))
                continue
            except Exception as exc:
                del self.active[key]
                self._error(pending.emit, ApiError(f"generation failed: {type(exc).__name__}: {exc}", status=500,
                                                   type="server_error"))
                continue
            active.start = time.perf_counter()
            pending.emit("start", len(pending.ids))

    def _sweep(self) -> None:
        """Take out the requests whose client went away, or whose time limit passed (they end with what
        they have)."""
        now = time.monotonic()
        for key, a in list(self.active.items()):
            if a.job.cancel.is_set():
                self._drop(key, a)
            elif a.job.deadline is not None and now >= a.job.deadline:
                self.backend.cancel(key)
                self._finish(key, a, "length", timed_out=True)

    def _drop(self, key: int, a: _Active) -> None:
        self.backend.cancel(key)
        self.active.pop(key, None)
        self._record(a)
        self.metrics.request(499)
        a.emit("cancelled", None)

    def _error(self, emit: Callable[[str, Any], None], exc: ApiError) -> None:
        self.metrics.request(exc.status)
        emit("error", exc)

    def _fail_all(self, exc: Exception) -> None:
        error = ApiError(f"generation failed: {type(exc).__name__}: {exc}", status=500, type="server_error")
        for key, a in list(self.active.items()):
            self.backend.cancel(key)
            self.active.pop(key, None)
            self._record(a)
            self._error(a.emit, error)

    def _record(self, a: _Active) -> None:
        self.metrics.generation(a.job.method, len(a.ids), sum(a.lengths), len(a.lengths),
                                time.perf_counter() - a.start)

    def _advance(self, a: _Active, p: Progress) -> None:
        """One round's tokens of ``a``: new text out (what may begin a stop string held back), a stop
        string ends it."""
        job, finish = a.job, None
        if p.tokens:
            if a.first is None:
                a.first = time.monotonic()
                self.metrics.first_token(a.first - job.arrived)
            a.lengths.append(len(p.tokens))
            for piece, drafted in a.rounds.feed(list(p.tokens)).spans:
                a.text += piece
                a.flags.extend([drafted] * len(piece))
            if job.stop:
                cut = find_stop(a.text, job.stop, max(0, a.sent - a.hold))
                if cut >= 0:
                    a.text, finish = a.text[:cut], "stop"
            end = len(a.text) if finish else max(a.sent, len(a.text) - a.hold)
            if end > a.sent:
                a.emit("delta", (text_spans(a.text, a.flags, a.sent, end), a.stats()))
                a.sent = end
        if p.sources:
            self.metrics.sources(p.sources)
        if finish:
            if p.stop_reason is None:
                self.backend.cancel(p.key)
            self._finish(p.key, a, finish)
        elif p.stop_reason is not None:
            # the library's text: equal to text, plus any withheld partial character
            final = self.tokenizer.decode(a.rounds.tokens, skip_special_tokens=True)
            cut = find_stop(final, job.stop, max(0, a.sent - a.hold)) if job.stop else -1
            if cut >= 0:
                final = final[:cut]
            a.text = final
            self._finish(p.key, a, "stop" if cut >= 0 or p.stop_reason == "eos" else "length")

    def _finish(self, key: int, a: _Active, finish: str, timed_out: bool = False) -> None:
        """Answer ``a`` with its text (the rest of it sent first) and take it out of the batch."""
        self.active.pop(key, None)
        if len(a.text) > a.sent:
            a.emit("delta", (text_spans(a.text, a.flags, a.sent, len(a.text)), a.stats()))
            a.sent = len(a.text)
        tokens = sum(a.lengths)
        self._record(a)
        usage = {"prompt_tokens": len(a.ids), "completion_tokens": tokens, "total_tokens": len(a.ids) + tokens}
        self.metrics.request(200)
        a.emit("end", (finish, a.text, usage, a.stats(done=True, timed_out=timed_out)))
