"""``eagle.runtime.openmp.release_workers``: the calling thread's idle OpenMP workers end (seen as the
process's thread count, in a fresh process), and without the call they stay."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SCRIPT = """
import os, sys, time, torch
torch.set_num_threads(2)
def threads():
    return len(os.listdir("/proc/self/task"))
before = threads()
torch.ones(1_000_000).add_(1.0)  # a parallel region: its workers stay for the next one
during = threads()
if sys.argv[1] == "release":
    from eagle.runtime.openmp import release_workers
    assert release_workers()
deadline = time.monotonic() + (10 if sys.argv[1] == "release" else 0.5)
while threads() >= during and time.monotonic() < deadline:
    time.sleep(0.01)
print(before, during, threads())
"""


def thread_counts(mode: str) -> list[int]:
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=120,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert out.returncode == 0, out.stderr
    return [int(n) for n in out.stdout.split()]


@pytest.mark.skipif(not os.path.isdir("/proc/self/task") or (os.cpu_count() or 1) < 2,
                    reason="needs Linux and 2 cores")
def test_release_workers_ends_the_idle_openmp_threads():
    before, during, after = thread_counts("release")
    assert during > before  # the region's worker threads
    assert after == before
    before, during, after = thread_counts("keep")  # negative control: without the call they stay
    assert during > before and after == during


def test_the_server_releases_its_loading_threads_workers(monkeypatch):
    """``create_app`` (on the thread that loaded the model) hands decoding to the scheduler's thread and
    releases its own workers."""
    pytest.importorskip("starlette")
    from infer import serve
    from tests.conftest import tiny_target
    from eagle import EagleModel

    calls = []
    monkeypatch.setattr(serve, "release_workers", lambda: calls.append(1) or True)
    serve.create_app(EagleModel.from_pretrained(tiny_target(eos=True)))
    assert calls == [1]
