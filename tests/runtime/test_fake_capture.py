"""The CPU stand-in for CUDA graph capture (``eagle.runtime.fake_capture``) and the capture counts
of ``eagle.runtime.cuda_graphs``: what a real capture refuses raises, what it accepts is recorded and
replayed as a graph replays (the Python code not run again), and a failed capture is counted."""

from __future__ import annotations

import warnings

import pytest
import torch

from eagle.runtime import cuda_graphs
from eagle.runtime.shapes import StaticRunner, StaticShape, capture_stats
from eagle.runtime.fake_capture import HostAccessError, fake_capture


def capture(fn):
    """Capture ``fn(x)`` over a static input x [4] -> (graph, output, x)."""
    x = torch.arange(4.0)
    graph, out = fake_capture(lambda: fn(x), x.device)
    return graph, out, x


def host_scalar_index_put(x):
    y = x.clone()
    y[torch.arange(2)] = 1.0  # index_put_ of a host scalar: CUDA copies it from pageable memory
    return y


def fancy_item(x):
    return x * float(x.sum())


@pytest.mark.parametrize("fn, message", [
    (lambda x: x + torch.tensor([1.0, 2.0, 3.0, 4.0]), "made from host data"),
    (host_scalar_index_put, "host scalar"),
    (lambda x: x.clone().index_put_((torch.arange(2),), torch.tensor(0.5)), "host scalar"),
    (lambda x: x * x.sum().item(), "host"),
    (fancy_item, "host"),
    (lambda x: x[x > 1], "aten.index"),
    (lambda x: torch.nonzero(x), "nonzero"),
    (lambda x: x.repeat_interleave(x.long()), "repeat_interleave"),
    (lambda x: x + len(x.tolist()), "tolist"),
])
def test_what_cuda_capture_refuses_raises(fn, message):
    with torch.inference_mode(), pytest.raises(HostAccessError, match=message):
        capture(fn)
    assert torch.Tensor.tolist is not None and torch.tensor([1]).tolist() == [1]  # restored


def scalar_uses(x):
    y = torch.where(x > 1, x, -1.0) + 1  # Python scalars: passed by value
    y[:2] = 0.5  # a fill of a slice
    y = y.masked_fill(y > 3, 7.0)
    flags = torch.zeros(4, 3, dtype=torch.bool).scatter(1, torch.arange(4)[:, None] % 3, True)
    return y * flags.sum(-1) + (x * torch.tensor(2.0))  # a host scalar in an elementwise product: by value


def test_what_cuda_capture_accepts_is_recorded_and_replayed():
    """The replay computes from the static input's new values into the captured output, without
    running the Python function again (a host-side counter stays where the capture left it)."""
    calls = []

    def fn(x):
        calls.append(1)
        return scalar_uses(x)

    with torch.inference_mode():
        graph, out, x = capture(fn)
        assert torch.equal(out, scalar_uses(x)) and len(calls) == 2  # warm-up and capture
        x.copy_(torch.tensor([3.0, -2.0, 5.0, 0.0]))
        graph.replay()
        assert torch.equal(out, scalar_uses(x)) and len(calls) == 2


def test_in_place_updates_of_static_buffers_are_replayed():
    cache = torch.zeros(6)
    with torch.inference_mode():
        step = torch.zeros((), dtype=torch.long)

        def write(x):
            cache.index_copy_(0, step[None] + torch.arange(2), x[:2] * 2)
            return cache[:4].clone()

        graph, out, x = capture(write)
        step.fill_(3)
        graph.replay()
    assert cache.tolist() == [0, 2, 0, 0, 2, 0] and out.tolist() == [0, 2, 0, 0]


def runner() -> StaticRunner:
    return StaticRunner(torch.device("cpu"), True)


@pytest.mark.graph_fallback
def test_a_failed_capture_is_counted_warned_once_and_runs_eagerly():
    with cuda_graphs.capture_with(fake_capture):
        static = runner()
        assert static.capture
        x = torch.arange(4.0)
        before = capture_stats()
        with warnings.catch_warnings(record=True) as caught, torch.inference_mode():
            warnings.simplefilter("always")
            for key in ("a", "b"):  # two shapes, the same error: one warning
                out = static.run(key, lambda: StaticShape({"x": x}, lambda: host_scalar_index_put(x)),
                                 lambda entry: None)
            good = static.run("c", lambda: StaticShape({"x": x}, lambda: x * 2), lambda entry: None)
        after = capture_stats()
    assert out.tolist() == [1.0, 1.0, 2.0, 3.0] and good.tolist() == [0.0, 2.0, 4.0, 6.0]
    assert static.fallbacks == 2 and static.captured == 1
    assert after["fallbacks"] - before["fallbacks"] == 2 and after["captured"] - before["captured"] == 1
    assert all("host scalar" in e for e in after["errors"][len(before["errors"]):])
    assert len([w for w in caught if "CUDA graph capture failed" in str(w.message)]) <= 1
    assert static.shapes["a"].eager and static.shapes["c"].graph is not None


def test_without_a_capture_installed_a_cpu_runner_runs_eagerly():
    assert not runner().capture
