"""The engine seam of ``eagle-serve`` (``infer.scheduler``) without HTTP: ``BatchedBackend`` over a
tiny random model."""

from __future__ import annotations

from eagle import EagleModel
from infer.scheduler import Admission, BatchedBackend

from tests.conftest import tiny_drafter, tiny_target


def test_batched_backend_cancel_and_close_leave_the_engine_empty():
    """Three sequences on a batch of two: what the engine holds is what was added and not yet
    ended or cancelled (an unknown key is ignored); ``close`` drops every one, queued or running,
    and a sequence added afterwards decodes as it does alone."""
    target = tiny_target(eos=True, seed=10)
    model = EagleModel.from_pretrained(target, drafter=tiny_drafter(target), total_tokens=8, depth=3, top_k=3)
    backend = BatchedBackend(model, capacity=2)
    for key in range(3):
        backend.add(Admission(key, [3, 4, 5 + key], "eagle-tree", 30))
    assert [p.key for p in backend.step()] == [0, 1] and backend.engine.request_ids == [0, 1, 2]
    backend.cancel(0)
    backend.cancel(99)
    assert backend.engine.request_ids == [1, 2]
    backend.close()
    assert backend.engine.request_ids == [] and backend.step() == []
    backend.add(Admission(7, [3, 4, 6], "eagle-tree", 8))
    tokens, ended = [], None
    while ended is None:
        for p in backend.step():
            tokens += p.tokens
            ended = p.stop_reason
    assert tokens == model.generate([3, 4, 6], method="ar", max_new_tokens=8).token_ids
