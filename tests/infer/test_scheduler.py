"""The engine seam of ``eagle-serve`` (``infer.scheduler``) without HTTP: ``BatchedBackend`` over a
tiny random model."""

from __future__ import annotations

import pytest

from eagle import EagleModel
from eagle.errors import EagleError
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


def test_a_lone_sequence_runs_the_one_sequence_loop_and_company_joins_the_engine():
    """A sequence that finds the backend empty runs on ``SerialBackend`` (what one client alone costs
    is the one-sequence loop's); those arriving while it runs, or two arriving together, join the engine.
    Every sequence (greedy, and seeded sampled) gives what it gives decoded alone."""
    target = tiny_target(eos=True, seed=10)
    model = EagleModel.from_pretrained(target, drafter=tiny_drafter(target), total_tokens=8, depth=3, top_k=3)
    backend = BatchedBackend(model, capacity=4)
    sampled = dict(temperature=1.0, seed=4)
    joins = {0: [Admission(0, [3, 4, 5], "eagle-tree", 20)],
             2: [Admission(1, [3, 4, 6], "eagle-tree", 12), Admission(2, [3, 9], "pld", 10, **sampled)],
             40: [Admission(3, [5, 4, 6], "eagle-tree", 10, **sampled), Admission(4, [7, 7], "ar", 10)]}
    tokens, places = {}, {}
    for step in range(80):
        for a in joins.get(step, []):
            backend.add(a)
            tokens[a.key] = []
        for p in backend.step():
            tokens[p.key] += p.tokens
        for key in tokens:
            places.setdefault(key, set()).add("serial" if key in backend.serial.streams else
                                             "engine" if key in backend.engine else None)
    assert {k: v - {None} for k, v in places.items()} == {0: {"serial"}, 1: {"engine"}, 2: {"engine"},
                                                          3: {"engine"}, 4: {"engine"}}
    assert not backend.serial.streams and not backend.engine.request_ids
    for joined in joins.values():
        for a in joined:
            alone = model.generate(a.ids, method=a.method, max_new_tokens=a.max_new_tokens,
                                   temperature=a.temperature, seed=a.seed)
            assert tokens[a.key] == alone.token_ids, a.key


def test_suffix_scopes_bound_the_tenants_answers():
    """Scope "key": one store per API key, at most KEY_STORES of them (the least recently served
    dropped), each within history_tokens / KEY_STORES, so all of them stay within the bound."""
    import types

    from eagle.config import SuffixConfig
    from eagle.drafting.suffix import SuffixStore
    from infer.scheduler import KEY_STORES, SuffixScopes

    model = types.SimpleNamespace(suffix_store=SuffixStore(SuffixConfig(history_tokens=800)))
    scopes = SuffixScopes(model, "key")
    first = scopes.store("a")
    assert scopes.store("a") is first and scopes.store("b") is not first
    for i in range(KEY_STORES):
        scopes.store(f"t{i}")
    assert len(scopes.stores) == KEY_STORES and "a" not in scopes.stores
    assert all(s.history.capacity == 800 // KEY_STORES for s in scopes.stores.values())
    assert SuffixScopes(model, "server").store("x") is model.suffix_store
    assert SuffixScopes(model, "request").store("x") is not SuffixScopes(model, "request").store("x")
    with pytest.raises(EagleError, match="unknown suffix scope"):
        SuffixScopes(model, "tenant")
