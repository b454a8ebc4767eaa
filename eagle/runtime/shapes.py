"""Static shapes: the one table of bucket constants and the one static-shape runner.

A static call runs on fixed shapes so that it can be captured once (a CUDA graph) and replayed. Its
shape comes from the buckets below: rows padded to the smallest bucket that holds them, attended cache
lengths a power of two from ``MIN_KEYS`` up (``keys_for``). ``StaticRunner`` keeps one ``StaticShape``
per key (its static inputs, the function over them, its output, its graph): made on first use,
captured then (``capturer_for``: CUDA, a capture installed by ``capture_with``, or the CPU stand-in
``eagle.runtime.fake_capture`` under ``EAGLE_FAKE_CAPTURE=1``) and replayed after, or run eagerly where
nothing captures. A capture that fails runs that shape eagerly from then on, counted (``capture_stats``,
process-wide, and per runner) and warned once per distinct error; the tests, ``eagle-bench`` and
``scripts/gpu_check.sh`` treat a fallback as a failure."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
import warnings
from typing import Any, Callable, Iterator, Sequence

import torch

from eagle.errors import EagleError

# the one table of bucket constants
BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # one sequence's rows in a static call (a tree verified, a drafter step)
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)  # rows of a pooled static call (all sequences')
SEGMENT_BUCKETS = (1, 2, 4, 8, 16)  # one sequence's rows in a pooled static call
SPAN_BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # the keys a pooled drafter step's tree mask spans
MIN_KEYS = 64  # the shortest attended cache length; longer ones double up to the capacity
MAX_TREE = BUCKETS[-1]  # the most tree tokens one sequence's static round verifies
BATCH_MAX_TREE = SEGMENT_BUCKETS[-1]  # the most a sequence of a pooled batch verifies in one static call
WARMUP_RUNS = 3


_STATS = {"captured": 0, "fallbacks": 0}
_ERRORS: list[str] = []  # each fallback's error, in order
_WARNED: set[str] = set()
_CAPTURE: list[Callable] = []  # a capture installed by ``capture_with`` (the last one wins)


def capture_stats() -> dict:
    """Process-wide counts since import: ``captured`` (static functions captured as graphs),
    ``fallbacks`` (captures that failed: those shapes run eagerly), ``errors`` (each fallback's
    error text)."""
    return dict(_STATS, errors=list(_ERRORS))


@contextlib.contextmanager
def capture_with(capture: Callable) -> Iterator[None]:
    """Runners made inside capture with ``capture(run, device, pool) -> (graph, output)`` (a graph
    has ``replay()``) instead of ``cuda_capture``, on any device."""
    _CAPTURE.append(capture)
    try:
        yield
    finally:
        _CAPTURE.remove(capture)


def capture_installed() -> bool:
    """Whether static functions may be captured on a CPU now (``capture_with``, or ``$EAGLE_FAKE_CAPTURE=1``):
    code that would read a value back to the host there takes its capturable form."""
    return bool(_CAPTURE) or os.environ.get("EAGLE_FAKE_CAPTURE") == "1"


def _cpu_capture() -> Callable | None:
    """``$EAGLE_FAKE_CAPTURE=1``: a CPU runner captures with ``eagle.runtime.fake_capture`` (a rehearsal of
    what a GPU captures); else none."""
    if os.environ.get("EAGLE_FAKE_CAPTURE") != "1":
        return None
    from eagle.runtime.kernels import cpu_kernels

    if cpu_kernels() is not None:  # their calls bypass torch's dispatcher: a recording could not replay them
        raise EagleError("EAGLE_FAKE_CAPTURE=1 records torch's operations only: set EAGLE_CPU_KERNELS=0 too")
    from eagle.runtime.fake_capture import fake_capture

    return fake_capture


def capturer_for(device: torch.device) -> Callable | None:
    """What captures a runner's static functions on ``device``: the installed capture (``capture_with``),
    else ``cuda_capture`` on CUDA, else the CPU stand-in where ``$EAGLE_FAKE_CAPTURE=1``; None: they run
    eagerly."""
    return _CAPTURE[-1] if _CAPTURE else cuda_capture if device.type == "cuda" else _cpu_capture()


def cuda_capture(run: Callable[[], Any], device: torch.device, pool: Any) -> tuple[Any, Any]:
    """Warm ``run`` up on a side stream, then capture it (as PyTorch documents) and replay it once
    (the capture itself computes nothing) -> (graph, its output in the graph's memory). Raises
    what the capture raises."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(WARMUP_RUNS):
            run()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        output = run()
    graph.replay()
    return graph, output


def _fell_back(key: Any, exc: BaseException) -> None:
    """Count a failed capture; warn once per distinct error."""
    text = f"{type(exc).__name__}: {exc}"
    _STATS["fallbacks"] += 1
    _ERRORS.append(f"{key}: {text}")
    if text not in _WARNED:
        _WARNED.add(text)
        warnings.warn(f"CUDA graph capture failed, running this shape eagerly (slow; see "
                      f"eagle.runtime.cuda_graphs.capture_stats): {text}", stacklevel=4)


def bucket_for(n: int, buckets: Sequence[int] = BUCKETS) -> int | None:
    """The smallest bucket >= n, or None when n exceeds the largest."""
    return next((b for b in buckets if b >= n), None)


def keys_for(end: int, capacity: int, floor: int = MIN_KEYS) -> int:
    """How many cache positions a call whose writes end at ``end`` attends over: the smallest power
    of two >= max(end, ``floor``), at most ``capacity``."""
    return min(capacity, max(floor, 1 << max(0, end - 1).bit_length()))


def capture_graph(run: Callable[[], Any], device: torch.device, pool: Any, key: Any = "",
                  capturer: Callable | None = None) -> tuple[Any, Any]:
    """Capture ``run`` with ``capturer`` (default: the installed capture, else ``cuda_capture``) ->
    (graph, its output); a capture that fails is counted and warned as a runner's (``capture_stats``)
    and gives (None, the output of an eager run)."""
    capturer = capturer or (_CAPTURE[-1] if _CAPTURE else cuda_capture)
    try:
        graph, output = capturer(run, device, pool)
    except Exception as exc:  # noqa: BLE001 - an operation that cannot be captured: run this shape eagerly
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        _fell_back(key, exc)
        return None, run()
    _STATS["captured"] += 1
    return graph, output


@dataclasses.dataclass
class StaticShape:
    """One static call: its input buffers, the function over them, its output, its graph."""

    inputs: dict[str, torch.Tensor]
    run: Callable[[], Any]
    output: Any = None
    graph: Any = None
    eager: bool = False  # its capture failed (counted): it runs eagerly


class StaticRunner:
    """Static shapes by key on ``device``: ``run(key, make, fill)`` makes a key's ``StaticShape`` at its first
    call, has ``fill`` write its inputs, then replays its graph, captures it (at its first call, when
    ``capture`` and something captures here), or runs it eagerly. ``captured``, ``fallbacks``: this runner's
    counts; ``capture_seconds``: the time its captures took."""

    def __init__(self, device: torch.device, capture: bool = True) -> None:
        self.device = device
        self.capturer = capturer_for(device)
        self.capture = capture and self.capturer is not None
        self.graph_pool = torch.cuda.graph_pool_handle() if self.capture and device.type == "cuda" else None
        self.shapes: dict[Any, StaticShape] = {}
        self.captured = self.fallbacks = 0
        self.capture_seconds = 0.0

    def run(self, key: Any, make: Callable[[], StaticShape], fill: Callable[[StaticShape], None]) -> Any:
        """The output of shape ``key`` after ``fill`` set its inputs (a tensor or a tuple of them, in static
        memory: overwritten by the next call of the same key)."""
        shape = self.shapes.get(key)
        if shape is None:
            shape = self.shapes[key] = make()
        fill(shape)
        if shape.graph is not None:
            shape.graph.replay()
        elif self.capture and not shape.eager:
            start = time.perf_counter()
            shape.graph, shape.output = capture_graph(shape.run, self.device, self.graph_pool, key, self.capturer)
            shape.eager = shape.graph is None
            self.captured += not shape.eager
            self.fallbacks += shape.eager
            self.capture_seconds += time.perf_counter() - start
        else:
            shape.output = shape.run()
        return shape.output
