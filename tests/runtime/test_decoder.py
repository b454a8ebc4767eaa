"""The lean target forward and prepacked linears against transformers' own forward."""

import pytest
import torch
from torch import nn
from transformers import DynamicCache

from eagle import EagleError, EagleModel
from eagle.runtime import kv_cache
from eagle.runtime.decoder import LeanDecoder, PackedLinear, cpu_has_fast_bf16, packed_copy, unsupported_reason
from eagle.decoding.tree_mask import tree_attention
from eagle.runtime.masks import attention_bias

from tests.conftest import prompts, tiny_drafter, tiny_target


@pytest.mark.parametrize("rows", [1, 5, 16])
def test_packed_linear_matches_linear(rows):
    torch.manual_seed(0)
    a, b = nn.Linear(24, 40, bias=True), nn.Linear(24, 8, bias=False)
    x = torch.randn(1, rows, 24)
    assert torch.allclose(PackedLinear(a.weight, a.bias)(x), a(x), atol=1e-5)
    fused = PackedLinear.fused([a, b])(x)
    assert torch.allclose(fused, torch.cat([a(x), b(x)], -1), atol=1e-5)
    strided = torch.randn(24, rows).t()[None]  # not contiguous
    assert torch.allclose(PackedLinear(a.weight, a.bias)(strided), a(strided), atol=1e-5)


@pytest.mark.parametrize("rows", [1, 10])
def test_packed_linear_in_bf16_matches_linear_in_bf16(rows):
    """Packed for oneDNN where the CPU multiplies bf16 natively (``cpu_has_fast_bf16``), else F.linear."""
    torch.manual_seed(0)
    a = nn.Linear(64, 48, bias=False).bfloat16()
    x = torch.randn(1, rows, 64, dtype=torch.bfloat16)
    packed = PackedLinear(a.weight)
    assert packed.packed == cpu_has_fast_bf16()
    out = packed(x)
    assert out.dtype == torch.bfloat16 and torch.allclose(out.float(), a(x).float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_padded_rows_give_the_same_outputs(dtype):
    """With ``pad_rows`` set, fewer rows than the table covers are computed padded: same values
    bit for bit (rows do not mix in a product), same shapes, bias kept."""
    torch.manual_seed(0)
    a = nn.Linear(48, 96, bias=True).to(dtype)
    packed = PackedLinear(a.weight, a.bias)
    x = torch.randn(2, 3, 48, dtype=dtype)
    plain = {n: packed(x.reshape(6, 48)[:n]) for n in range(1, 7)}
    packed.pad_rows = (0, 5, 5, 5, 5)  # 1-4 rows computed as 5
    for n in range(1, 7):
        out = packed(x.reshape(6, 48)[:n])
        assert out.shape == (n, 96) and torch.equal(out, plain[n])
    assert torch.equal(packed(x[:1, :2]), plain[2].reshape(1, 2, 96))
    assert packed(x[:, :0]).shape == (2, 0, 96)


def test_tune_padding_keeps_only_faster_sizes_with_identical_outputs(monkeypatch):
    """A fake product whose time depends on the row count (5 rows cheapest, but its outputs
    differ from the unpadded ones): the table takes the fastest size that is exact and beats
    no padding by the margin, never the inexact one."""
    from types import SimpleNamespace

    import eagle.runtime.decoder as lean

    cost = {1: 10.0, 2: 12.0, 3: 9.7, 4: 8.0, 5: 5.0, 6: 9.0}
    clock = [0.0]
    weight = torch.randn(8, 4)

    def product(x):
        clock[0] += cost[x.shape[0]]
        return (x[:, None, :] * weight[None]).sum(-1) + (1e-3 if x.shape[0] == 5 else 0.0)  # rows independent

    packed = PackedLinear(weight, stream=False)  # padding is about oneDNN's packed product
    monkeypatch.setattr(packed, "packed", True)
    monkeypatch.setattr(packed, "_product", product)
    monkeypatch.setattr(lean, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    assert packed.tune_padding(max_rows=6, rounds=3) == (0, 4, 4, 4, 4, 5, 6)
    cost.update({4: 9.6, 6: 9.9})  # 4 rows: no longer 5% faster than 1 or 3 rows, still than 2
    assert packed.tune_padding(max_rows=6, rounds=3) == (0, 1, 4, 3, 4, 5, 6)


def test_the_lean_heads_padding_table_is_exact_where_it_pads():
    target = tiny_target(seed=3)
    head = PackedLinear(target.model.get_output_embeddings().weight, stream=False)
    if not head.packed:
        pytest.skip("rows are padded only for oneDNN's packed products (CPU)")
    table = head.tune_padding(max_rows=6)
    assert len(table) == 7 and all(n <= m <= 6 for n, m in enumerate(table))
    x = torch.randn(6, head.in_features)
    with torch.inference_mode():
        for n in range(1, 7):
            assert torch.equal(head(x[:n]), head._product(x[:n].contiguous()))


def test_packed_copy_leaves_the_original_and_computes_the_same(drafter):
    copy = packed_copy(drafter)
    assert isinstance(drafter.fc, nn.Linear) and isinstance(copy.fc, PackedLinear)
    dev = drafter.fc.weight.device
    torch.manual_seed(0)
    f, e = torch.randn(1, 5, 32, device=dev), torch.randn(1, 5, 32, device=dev)
    pos = torch.arange(5, device=dev)[None]
    with torch.inference_mode():
        assert torch.allclose(copy(f, e, pos), drafter(f, e, pos), atol=1e-4, rtol=1e-5)


def _model_forward(target, ids, pos, cache, mask=None):
    out = target.model.model(input_ids=ids, position_ids=pos, attention_mask=mask, use_cache=True,
                             **kv_cache.cache_argument(target.model.model, cache)).last_hidden_state
    return out, target.model.lm_head(out)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_lean_forward_matches_the_model_on_a_tree_and_after_compaction(family):
    target = tiny_target(family=family, seed=2)
    assert target.lean is not None
    dev = target.device
    torch.manual_seed(1)
    prefix = torch.randint(1, 32, (1, 7), device=dev)
    lean, ref = target.new_cache(), DynamicCache(config=target.model.config)
    out = target.forward(prefix, torch.arange(7, device=dev)[None], lean)
    want_h, want_l = _model_forward(target, prefix, torch.arange(7, device=dev)[None], ref)
    assert torch.allclose(out.hidden, want_h, atol=1e-5) and torch.allclose(out.logits, want_l, atol=1e-4)
    # a tree: 0 -> {1, 2}, 1 -> 3, 2 -> 4, 3 -> 5
    parents = torch.tensor([-1, 0, 0, 1, 2, 3])
    tokens = torch.tensor([[5, 9, 11, 12, 3, 8]], device=dev)
    attn = tree_attention(parents)
    bias, pos = attention_bias(attn.mask, 7, torch.float32).to(dev), (7 + attn.depths)[None].to(dev)
    out = target.forward(tokens, pos, lean, bias)
    want_h, want_l = _model_forward(target, tokens, pos, ref, bias)
    assert torch.allclose(out.logits, want_l, atol=1e-4)
    # keep the path 0 -> 1 -> 3 -> 5, then one more token: equal to recomputing from scratch
    kv_cache.compact(lean, 7, torch.tensor([7, 8, 10, 12]))
    assert kv_cache.cache_length(lean) == 11
    out = target.forward(torch.tensor([[4]], device=dev), torch.tensor([[11]], device=dev), lean)
    full = torch.cat([prefix, torch.tensor([[5, 9, 12, 8, 4]], device=dev)], 1)
    _, want_l = _model_forward(target, full, torch.arange(12, device=dev)[None],
                               DynamicCache(config=target.model.config))
    assert torch.allclose(out.logits[0, -1], want_l[0, -1], atol=1e-4)


def test_static_cache_grows_and_rolls_back():
    target = tiny_target(max_positions=1024, seed=4)
    dev = target.device
    torch.manual_seed(0)
    ids = torch.randint(1, 32, (1, 600), device=dev)
    cache = target.new_cache()
    for start in range(0, 600, 100):  # past the first capacity (256) twice
        out = target.forward(ids[:, start:start + 100], torch.arange(start, start + 100, device=dev)[None], cache)
    assert kv_cache.cache_length(cache) == 600 and cache.keys[0].shape[-2] == 1024
    _, want = _model_forward(target, ids, torch.arange(600, device=dev)[None], DynamicCache(config=target.model.config))
    assert torch.allclose(out.logits[0, -1], want[0, -1], atol=1e-4)
    kv_cache.roll_back(cache, 550)
    again = target.forward(ids[:, 550:], torch.arange(550, 600, device=dev)[None], cache)
    assert torch.allclose(again.logits[0, -1], want[0, -1], atol=1e-4)


def test_unsupported_architectures_use_the_model_forward():
    assert "mistral" in unsupported_reason(tiny_target(family="mistral").model)
    gelu = tiny_target(seed=1).model
    gelu.config.hidden_act = "gelu"
    assert "gelu" in unsupported_reason(gelu)
    with pytest.raises(ValueError, match="cannot run"):
        LeanDecoder(gelu)


def test_greedy_output_is_the_same_with_either_forward():
    """The model's own forward (DynamicCache) and the lean forward give the same tokens, for ar and
    for tree decoding on each."""
    lean, plain = tiny_target(seed=6), tiny_target(seed=6, lean=False)
    assert plain.lean is None and isinstance(plain.new_cache(), DynamicCache)
    drafter = tiny_drafter(lean)
    lean_model = EagleModel.from_pretrained(lean, drafter=drafter, total_tokens=10, depth=4, top_k=3)
    plain_model = EagleModel.from_pretrained(plain, drafter=drafter, total_tokens=10, depth=4, top_k=3)
    for ids in prompts(8, seed=2):
        ref = plain_model.generate(ids, method="ar", max_new_tokens=20).token_ids
        assert lean_model.generate(ids, method="ar", max_new_tokens=20).token_ids == ref
        assert plain_model.generate(ids, method="eagle-tree", max_new_tokens=20).token_ids == ref
        assert lean_model.generate(ids, method="eagle-tree", max_new_tokens=20).token_ids == ref


def test_model_forward_refuses_a_static_cache_without_lean():
    plain = tiny_target(lean=False)
    with pytest.raises(EagleError, match="no lean forward"):
        plain.forward(torch.tensor([[1, 2]]), torch.arange(2)[None], tiny_target().new_cache())


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_aux_layer_outputs_are_the_decoder_layers_outputs_with_either_forward(family):
    target = tiny_target(family=family, seed=3, layers=3)
    pos = torch.arange(6, device=target.device)[None]
    outputs = {}
    hooks = [target.model.model.layers[i].register_forward_hook(
        lambda module, args, out, i=i: outputs.__setitem__(i, out[0] if isinstance(out, tuple) else out))
        for i in (0, 1)]
    try:
        prefix = torch.randint(1, 32, (1, 6), generator=torch.Generator().manual_seed(0)).to(target.device)
        lean = target.forward(prefix, pos, target.new_cache(), aux_layers=[1, 0])
        model = target.forward(prefix, pos, DynamicCache(config=target.model.config), aux_layers=[1, 0])
    finally:
        for hook in hooks:
            hook.remove()
    want = torch.cat([outputs[1], outputs[0]], dim=-1)  # the order asked for
    for out in (lean, model):
        assert out.aux.shape == (1, 6, 64) and torch.allclose(out.aux, want, atol=1e-4)
        assert torch.equal(out.features, torch.cat([out.hidden, out.aux], dim=-1))
    plain = target.forward(prefix, pos, target.new_cache())
    assert plain.aux is None and torch.equal(plain.features, plain.hidden)
    assert torch.allclose(plain.hidden, lean.hidden, atol=1e-6)


_REAL_PRODUCT = PackedLinear._product


def fake_kernel_clock(monkeypatch, plain_cost):
    """A fake clock for ``eagle.runtime.decoder``'s timings: ``F.linear(x, w)`` advances it by
    ``plain_cost(x, w)``, a packed product by 5. Returns the clock ([seconds])."""
    from types import SimpleNamespace

    import eagle.runtime.decoder as lean

    clock = [0.0]

    def plain(x, w, b=None):
        clock[0] += plain_cost(x, w)
        return torch.nn.functional.linear(x, w, b)

    def product(self, x):
        clock[0] += 5.0
        return _REAL_PRODUCT(self, x)

    monkeypatch.setattr(lean, "F", SimpleNamespace(linear=plain))
    monkeypatch.setattr(PackedLinear, "_product", product)
    monkeypatch.setattr(lean, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    return clock


def test_tune_kernels_takes_plain_linear_only_where_it_is_faster(monkeypatch):
    """A fake clock where ``F.linear`` is cheaper than the packed product for 1-3 rows: those row
    counts are computed by ``F.linear`` (same values), the others packed, for every matrix; a
    packed-only choice drops the unpacked weight."""
    import eagle.runtime.decoder as lean

    torch.manual_seed(0)
    lin = nn.Linear(16, 24, bias=True)
    packed, twin = PackedLinear(lin.weight, lin.bias, stream=False), PackedLinear(lin.weight * 2, lin.bias, stream=False)
    if not packed.packed:
        pytest.skip("kernels are chosen only for oneDNN's packed products (CPU)")
    clock = fake_kernel_clock(monkeypatch, lambda x, w: 1.0 if x.shape[0] <= 3 else 9.0)
    lean.tune_kernels([packed, twin], max_rows=6)
    assert packed.plain_rows == twin.plain_rows == frozenset({1, 2, 3})
    x = torch.randn(6, 16)
    with torch.inference_mode():
        for n in range(1, 7):
            before = clock[0]
            assert torch.allclose(twin(x[:n]), lin(x[:n]) + x[:n] @ lin.weight.t(), atol=1e-5)
            assert clock[0] - before == (1.0 if n <= 3 else 5.0)  # F.linear for 1-3 rows, packed after
    fake_kernel_clock(monkeypatch, lambda x, w: 9.0)
    assert lean.tune_kernels([packed], max_rows=4) == frozenset() and packed.plain_weight is None
    assert lean.tune_kernels([packed], max_rows=4) == frozenset()  # nothing left to measure against


def test_tune_kernels_times_the_matrices_in_turn(monkeypatch):
    """A fake clock where ``F.linear`` is cheap only on the matrix it ran last (still in cache
    beside its packed twin) and the packed product costs the same either way: timed over the
    matrices in turn, as a forward meets them, the packed product wins; a single matrix alone
    (always hot) would have chosen ``F.linear``."""
    import eagle.runtime.decoder as lean

    last = [None]
    torch.manual_seed(0)
    group = [PackedLinear(torch.randn(24, 16), None, stream=False) for _ in range(3)]
    if not group[0].packed:
        pytest.skip("kernels are chosen only for oneDNN's packed products (CPU)")

    def hot_or_cold(x, w):
        hot = last[0] is w
        last[0] = w
        return 1.0 if hot else 9.0

    fake_kernel_clock(monkeypatch, hot_or_cold)
    lean.tune_kernels(group, max_rows=4)
    assert all(lin.plain_rows == frozenset() and lin.plain_weight is None for lin in group)
    alone = PackedLinear(torch.randn(24, 16), None, stream=False)
    assert lean.tune_kernels([alone], max_rows=4) == frozenset(range(1, 5))
