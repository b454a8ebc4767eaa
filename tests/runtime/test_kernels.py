"""The compiled fp32 kernels (eagle/runtime/csrc/cpu_kernels.cpp): float64 references, row independence,
where PackedLinear and LeanDecoder use them. Every test runs once per instruction set this CPU has
(``kernels.cpu_isas()``: AVX-512 with VNNI, AVX-512, AVX2, portable), chosen as ``EAGLE_CPU_ISA`` would."""

import pytest
import torch
import torch.nn.functional as F

from eagle.runtime import kernels
from eagle.runtime.decoder import PackedLinear


@pytest.fixture(autouse=True, params=kernels.cpu_isas())
def isa(request, monkeypatch):
    """Each test once per instruction set: ``cpu_kernels()`` (so PackedLinear, LeanDecoder) builds for it."""
    monkeypatch.setenv(kernels.ISA_ENV, request.param)
    kernels.cpu_kernels.cache_clear()
    yield request.param
    kernels.cpu_kernels.cache_clear()


def op_or_skip():
    op = kernels.stream_linear_op()
    if op is None:
        pytest.skip("the compiled kernels did not build here (no compiler or ninja)")
    assert kernels.cpu_kernels().isa == kernels.chosen_isa()
    return op


def test_the_isa_is_the_best_this_cpu_runs_unless_the_environment_picks_a_lower_one(monkeypatch):
    have = kernels.cpu_isas()
    assert have[-1] == "portable" and ("avx512" in have) == kernels.cpu_has_avx512()
    assert ("avx512vnni" in have) == (kernels.cpu_has_avx512() and kernels.cpu_has_vnni())
    monkeypatch.delenv(kernels.ISA_ENV)
    assert kernels.chosen_isa() == have[0]
    for wrong, message in (("sse9", "must be one of"), *((isa, "runs only") for isa in kernels.ISAS if isa not in have)):
        monkeypatch.setenv(kernels.ISA_ENV, wrong)
        with pytest.raises(ValueError, match=message):
            kernels.chosen_isa()


def test_every_isa_gives_close_results_and_avx2_gives_avx512s_bits():
    """The same products, norms and attention on each instruction set: AVX2 and AVX-512 sum the same
    fused multiply-adds in the same order (the same bits); the portable path rounds a multiply-add twice."""
    modules = {isa: kernels.kernels_for(isa) for isa in kernels.cpu_isas()}
    if any(m is None for m in modules.values()):
        pytest.skip("the compiled kernels did not build here")
    gen = torch.Generator().manual_seed(11)
    w, x = torch.randn(70, 200, generator=gen), torch.randn(5, 200, generator=gen)
    q, keys, values = (torch.randn(4, 3, 64, generator=gen), torch.randn(2, 40, 64, generator=gen),
                       torch.randn(2, 40, 64, generator=gen))
    gate_up = torch.randn(3, 64, generator=gen) * 4

    def run(m):
        return (m.stream_linear(x, w, None), m.rms_norm(x, w[0], 1e-5),
                m.attention(q, keys, values, 40, None, 0.125), m.silu_mul(gate_up))

    results = {isa: run(m) for isa, m in modules.items()}
    for isa, got in results.items():
        for a, b in zip(got, results["portable"]):
            assert torch.allclose(a, b, atol=1e-4, rtol=1e-4), isa
    for wide in ("avx512", "avx512vnni"):
        if wide in results:
            assert all(torch.equal(a, b) for a, b in zip(results["avx2"], results[wide])), wide


# K with and without a tail of fewer than 16; N not a multiple of any block width
@pytest.mark.parametrize("out_features,in_features", [(48, 64), (97, 37), (5, 1536), (1, 7)])
def test_stream_linear_matches_a_float64_reference_for_1_to_16_rows(out_features, in_features):
    op = op_or_skip()
    gen = torch.Generator().manual_seed(out_features * in_features)
    w = torch.randn(out_features, in_features, generator=gen)
    bias = torch.randn(out_features, generator=gen)
    for rows in range(1, kernels.STREAM_MAX_ROWS + 1):
        x = torch.randn(rows, in_features, generator=gen)
        for b in (None, bias):
            ref = F.linear(x.double(), w.double(), None if b is None else b.double())
            out = op(x, w, b)
            assert out.shape == (rows, out_features) and out.dtype == torch.float32
            assert torch.allclose(out.double(), ref, atol=1e-4, rtol=1e-5), (rows, b is None)


def test_a_rows_result_does_not_depend_on_the_rows_computed_with_it():
    """Bit for bit: one row alone, or any of 16 rows computed together (decoding one token and
    verifying a tree give the target the same numbers for the same row)."""
    op = op_or_skip()
    gen = torch.Generator().manual_seed(0)
    w, x = torch.randn(300, 576, generator=gen), torch.randn(16, 576, generator=gen)
    together = op(x, w, None)
    for n in range(1, 17):
        assert torch.equal(op(x[:n].contiguous(), w, None), together[:n])
    for i in range(16):
        assert torch.equal(op(x[i:i + 1].contiguous(), w, None)[0], together[i])


def test_stream_linear_refuses_what_it_cannot_compute():
    op = op_or_skip()
    w = torch.randn(8, 32)
    with pytest.raises(RuntimeError, match="1 to 16 rows"):
        op(torch.randn(17, 32), w, None)
    with pytest.raises(RuntimeError, match="fp32"):
        op(torch.randn(2, 32, dtype=torch.bfloat16), w.bfloat16(), None)
    with pytest.raises(RuntimeError, match="x \\[M, K\\]"):
        op(torch.randn(2, 16), w, None)


def test_packed_linear_streams_up_to_16_rows_and_packs_beyond(monkeypatch):
    real = op_or_skip()
    calls = []

    def counting(x, w, b, once):
        calls.append(x.shape[0])
        return real(x, w, b, once)

    lin = torch.nn.Linear(64, 40)
    packed = PackedLinear(lin.weight, lin.bias)
    assert packed.stream_op is real and PackedLinear(lin.weight, stream=False).stream_op is None
    monkeypatch.setattr(packed, "stream_op", counting)
    x = torch.randn(2, 12, 64)
    with torch.inference_mode():
        for n in (1, 5, 16, 24):
            flat = x.reshape(24, 64)[:n]
            assert torch.allclose(packed(flat), lin(flat), atol=1e-5)
        assert torch.allclose(packed(x[:, :8]), lin(x[:, :8]), atol=1e-5)  # [2, 8, 64]: 16 rows
    assert calls == [1, 5, 16, 16]
    assert PackedLinear(lin.weight.bfloat16()).stream_op is None  # fp32 only


@pytest.mark.parametrize("hidden", [576, 40, 7])
def test_rms_norm_matches_a_float64_reference_and_torchs(hidden):
    module = kernels.cpu_kernels()
    if module is None:
        op_or_skip()
    gen = torch.Generator().manual_seed(hidden)
    x, w = torch.randn(2, 5, hidden, generator=gen) * 3, torch.randn(hidden, generator=gen)
    ref = w.double() * x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-5)
    out = module.rms_norm(x, w, 1e-5)
    assert out.shape == x.shape and torch.allclose(out.double(), ref, atol=1e-5, rtol=1e-5)
    assert torch.allclose(out, F.rms_norm(x, (hidden,), w, 1e-5), atol=1e-5, rtol=1e-5)
    assert torch.equal(module.rms_norm(x[1, 2:3].contiguous(), w, 1e-5), out[1, 2:3])  # rows independent
    with pytest.raises(RuntimeError, match="x \\[..., H\\]"):
        module.rms_norm(x, w[:-1].contiguous(), 1e-5)


def test_lean_decoder_uses_the_compiled_kernels_in_fp32_and_can_do_without():
    from eagle.runtime.decoder import LeanDecoder, rms_norm
    from tests.conftest import tiny_target

    op_or_skip()
    model = tiny_target(seed=4).model
    with_kernels, without = LeanDecoder(model), LeanDecoder(model, kernels=False)
    assert with_kernels.rms_norm is not rms_norm and with_kernels.head.stream_op is not None
    assert without.rms_norm is rms_norm and without.head.stream_op is None
    assert with_kernels.kernel_choice() != without.kernel_choice()  # cost curves are cached per choice
    ids = torch.randint(0, 32, (1, 9), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(9)[None]
    a = with_kernels.forward(ids, pos, with_kernels.new_cache())
    b = without.forward(ids, pos, without.new_cache())
    assert torch.allclose(a, b, atol=1e-5)


def test_the_environment_can_turn_the_kernels_off(monkeypatch):
    op_or_skip()
    kernels.cpu_kernels.cache_clear()
    monkeypatch.setenv("EAGLE_CPU_KERNELS", "0")
    try:
        assert kernels.cpu_kernels() is None and kernels.stream_linear_op() is None
        assert PackedLinear(torch.randn(8, 16)).stream_op is None
    finally:
        kernels.cpu_kernels.cache_clear()
    monkeypatch.delenv("EAGLE_CPU_KERNELS")
    assert kernels.stream_linear_op() is not None


def module_or_skip():
    op_or_skip()
    return kernels.cpu_kernels()


def attention_reference(q, keys, values, bias):
    """float64 softmax(q k^T / sqrt(d) + bias) v, grouped-query: q [nh, R, d], keys/values
    [nkv, L, d], bias [R, L] -> [R, nh * d]."""
    nh, rows, d = q.shape
    group = nh // keys.shape[0]
    k, v = keys.double().repeat_interleave(group, 0), values.double().repeat_interleave(group, 0)
    scores = q.double() @ k.transpose(1, 2) / d ** 0.5 + bias.double()
    return (scores.softmax(-1) @ v).transpose(0, 1).reshape(rows, nh * d)


@pytest.mark.parametrize("d", [64, 48, 16])
def test_rope_cache_rotates_as_torch_and_writes_the_cache_rows(d):
    """Head dims that are multiples of 32 and odd multiples of 16 (a half vector at the end of each half)."""
    from eagle.runtime.decoder import rotate

    module = module_or_skip()
    gen = torch.Generator().manual_seed(1)
    nh, nkv, rows, cap, start = 6, 2, 5, 32, 9
    qkv = torch.randn(rows, (nh + 2 * nkv) * d, generator=gen)
    angles = torch.rand(rows, d // 2, generator=gen) * 50
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    keys, values = torch.full((nkv, cap, d), 7.0), torch.full((nkv, cap, d), 7.0)
    q = module.rope_cache(qkv, cos, sin, keys, values, nh, start)
    heads = qkv.view(rows, nh + 2 * nkv, d).transpose(0, 1)
    rotated = rotate(heads[None, :nh + nkv], cos[None, None], sin[None, None])[0]
    assert torch.equal(q, rotated[:nh])
    assert torch.equal(keys[:, start:start + rows], rotated[nh:])
    assert torch.equal(values[:, start:start + rows], heads[nh + nkv:])
    untouched = torch.ones(cap, dtype=torch.bool)
    untouched[start:start + rows] = False
    assert (keys[:, untouched] == 7).all() and (values[:, untouched] == 7).all()
    with pytest.raises(RuntimeError, match="rows past the buffer"):
        module.rope_cache(qkv, cos, sin, keys, values, nh, cap - 2)


@pytest.mark.parametrize("nh,nkv,d", [(9, 3, 64), (4, 4, 32), (8, 2, 128)])
def test_attention_matches_a_float64_reference(nh, nkv, d):
    from eagle.runtime.masks import additive_bias

    module = module_or_skip()
    gen = torch.Generator().manual_seed(nh * d)
    length, cap = 70, 96
    keys, values = torch.randn(nkv, cap, d, generator=gen), torch.randn(nkv, cap, d, generator=gen)
    for rows in (1, 4, 16):
        q = torch.randn(nh, rows, d, generator=gen) * 2
        causal = torch.ones(rows, length, dtype=torch.bool).tril(length - rows)
        allowed = causal & (torch.rand(rows, length, generator=gen) < 0.6)
        allowed[:, 0] = True
        for bias in (None, additive_bias(allowed, torch.float32)[0, 0]):
            out = module.attention(q, keys, values, length, bias, d ** -0.5)
            reference = additive_bias(causal, torch.float32)[0, 0] if bias is None else bias
            want = attention_reference(q, keys[:, :length], values[:, :length], reference)
            assert out.shape == (rows, nh * d) and torch.allclose(out.double(), want, atol=1e-5), (rows, bias is None)
    with pytest.raises(RuntimeError, match="length"):
        module.attention(q, keys, values, cap + 1, None, 1.0)


def test_an_attention_row_does_not_depend_on_other_rows_or_masked_keys():
    """Bit for bit: a row among 8 whose keys have masked keys between them (a tree node
    verified after its ancestors' siblings) equals that row alone over just its own keys in
    order (the same token in a plain decoding step)."""
    from eagle.runtime.masks import additive_bias

    module = module_or_skip()
    gen = torch.Generator().manual_seed(3)
    nh, nkv, d, length = 9, 3, 64, 57
    keys, values = torch.randn(nkv, length, d, generator=gen), torch.randn(nkv, length, d, generator=gen)
    q = torch.randn(nh, 8, d, generator=gen)
    allowed = torch.rand(8, length, generator=gen) < 0.5
    allowed[:, :40] = True
    together = module.attention(q, keys, values, length, additive_bias(allowed, torch.float32)[0, 0], d ** -0.5)
    for row in range(8):
        own = allowed[row].nonzero()[:, 0]
        k, v = keys[:, own].contiguous(), values[:, own].contiguous()
        alone = module.attention(q[:, row:row + 1].contiguous(), k, v, len(own), None, d ** -0.5)
        assert torch.equal(alone[0], together[row]), row


def first_largest(row: list[float]) -> int:
    """Brute force: the index of the first NaN, else of the first largest value (torch's argmax)."""
    for k, v in enumerate(row):
        if v != v:
            return k
    return max(range(len(row)), key=lambda k: (row[k], -k))


def test_argmax_rows_gives_the_first_largest_index_as_torch():
    """Random rows, ties (the first wins), a vocabulary not a multiple of 16, infinities and NaNs."""
    module = module_or_skip()
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(12, 1000 + 7, generator=gen)
    x[1, 3] = x[1, 900] = x[1].max() + 1  # a tie: the first
    x[2, 1005] = 50.0  # in the tail past the last whole vector
    x[3, 40] = float("inf")
    x[4, :] = float("-inf")
    x[5, 600] = float("nan")
    x[6, 10], x[6, 20] = float("nan"), 1e9  # a NaN before the largest
    x[7, 30], x[7, 500] = 1e9, float("nan")  # a NaN after it
    x[8, :] = x[8, 0]  # all equal
    x[9, 2], x[9, 700] = -0.0, 0.0
    x[9, :] = torch.where(x[9] > 0, -x[9], x[9])  # everything else negative: the zeros tie
    got = module.argmax_rows(x)
    assert got.tolist() == [first_largest(row) for row in x.tolist()] == x.argmax(-1).tolist()
    assert module.argmax_rows(x[:, :5].contiguous()).tolist() == x[:, :5].argmax(-1).tolist()
    with pytest.raises(RuntimeError, match="argmax_rows"):
        module.argmax_rows(x.double())


def screen_reference(approx, radius, norms, slack):
    """Which tokens the bound keeps per row [N, V] (bool), by the torch expressions ``screen_candidates``
    replaces."""
    reach = torch.outer(radius, norms)
    lowest = (approx - reach).amax(dim=1)
    reach += approx
    return reach >= (lowest - slack * torch.maximum(reach.abs().amax(dim=1), lowest.abs()))[:, None]


def test_screen_candidates_keeps_what_the_bound_keeps():
    """Each row's candidates and their union as the torch expressions give them: crowds in a block of 16,
    candidates in the tail past the last whole vector, one row alone; empty (the whole head decides) for a
    value that is not finite in any row, a row with more than ``most`` candidates, or a union with more."""
    module = module_or_skip()
    gen = torch.Generator().manual_seed(4)
    n, v, slack = 6, 1000 + 7, 2.0 ** -20
    approx = torch.randn(n, v, generator=gen) * 4
    radius, norms = torch.rand(n, generator=gen) * 0.05, torch.rand(v, generator=gen) + 0.5
    radius[1] = 0.02
    approx[1, 32:48] = approx[1].max() + 1e-4 * torch.rand(16, generator=gen)  # a whole block within reach
    approx[2, 1003] = approx[2, 1005] = approx[2].max() + 1  # best in the tail, twice
    approx[3, :] = 1.0  # every token ties
    want = screen_reference(approx, radius, norms, slack)
    assert want[3].all() and want[:3].sum(dim=1).tolist()[1] >= 16
    rows = [0, 1, 2, 4, 5]
    tokens, keep = module.screen_candidates(approx[rows].contiguous(), radius[rows].contiguous(), norms, slack, v // 8)
    assert torch.equal(tokens, want[rows].any(dim=0).nonzero()[:, 0])
    assert torch.equal(keep, want[rows][:, tokens]) and keep.any(dim=1).all()
    assert 1003 in tokens.tolist() and 1005 in tokens.tolist()
    tokens, keep = module.screen_candidates(approx[:1].contiguous(), radius[:1].contiguous(), norms, slack, v // 8)
    assert torch.equal(tokens, want[0].nonzero()[:, 0]) and keep.all()
    for bad in (approx[:4], approx[rows[:2]]):  # a row of ties: more than an eighth; a tight limit
        most = v // 8 if bad.shape[0] == 4 else 3
        tokens, keep = module.screen_candidates(bad.contiguous(), radius[:bad.shape[0]].contiguous(), norms, slack, most)
        assert tokens.shape == (0,) and keep.shape == (bad.shape[0], 0)
    for value in (float("nan"), float("inf")):
        odd = approx[rows].clone()
        odd[2, 500] = value
        tokens, _ = module.screen_candidates(odd, radius[rows].contiguous(), norms, slack, v // 8)
        assert tokens.shape == (0,)


def test_silu_mul_matches_a_float64_reference():
    module = module_or_skip()
    gate_up = torch.randn(3, 2 * 48, generator=torch.Generator().manual_seed(5)) * 6
    gate, up = gate_up.double().chunk(2, -1)
    assert torch.allclose(module.silu_mul(gate_up).double(), F.silu(gate) * up, atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="silu_mul"):
        module.silu_mul(torch.randn(3, 40))


def test_lean_decoder_attention_kernel_matches_the_model_and_keeps_rows_independent():
    """The target's forward with the compiled attention (head_dim 32: hidden 128, 4 heads) agrees
    with the transformers model, and a tree's rows are bit-identical to the same tokens decoded
    one at a time."""
    from eagle.runtime.decoder import LeanDecoder
    from eagle.decoding.tree_mask import tree_attention
    from eagle.runtime.masks import attention_bias
    from tests.conftest import tiny_target

    module_or_skip()
    model = tiny_target(seed=6, hidden=128).model
    lean = LeanDecoder(model)
    assert lean.compiled is not None and "attention" in lean.kernel_choice()
    ids = torch.randint(0, 32, (1, 30), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        cache = lean.new_cache()
        prefix = lean.forward(ids[:, :20], torch.arange(20)[None], cache)
        steps = [lean.forward(ids[:, 20 + k:21 + k], torch.tensor([[20 + k]]), cache)[0, 0] for k in range(4)]
        want = model.model(input_ids=ids[:, :24]).last_hidden_state[0]
        got = torch.cat([prefix[0], torch.stack(steps)])
        assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
        parents = torch.tensor([-1, 0, 0, 1, 2, 3])  # 0-1-3-5 holds tokens 20..23
        tokens = ids[0, [20, 21, 25, 22, 26, 23]][None]
        attn = tree_attention(parents)
        cache.truncate(20)
        tree = lean.forward(tokens, (20 + attn.depths)[None], cache, attention_bias(attn.mask, 20, torch.float32))[0]
    assert all(torch.equal(tree[node], step) for node, step in zip([0, 1, 3, 5], steps))
    with torch.inference_mode():  # decoder layers' outputs (EAGLE-3 features) survive the in-place layers
        cache.truncate(20)
        lean.forward(ids[:, 20:23], torch.arange(20, 23)[None], cache)
        out = lean.forward(ids[:, 23:24], torch.tensor([[23]]), cache, aux_layers=(0,))[0, 0]
        layer0 = model.model(input_ids=ids[:, :24], output_hidden_states=True).hidden_states[1][0, 23]
    assert torch.equal(out[:128], steps[3])
    assert torch.allclose(out[128:], layer0, atol=1e-3)  # |values| up to ~100 here


def test_lean_drafter_compiled_layers_match_the_drafter_on_a_tree():
    """An fp32 ``LeanDrafter`` (head_dim 32) runs its layers by the compiled ``DecoderStack``
    (layer 0 without an input norm): after a cached prefix, a tree of nodes gives the predictions
    of the plain ``Drafter`` on each node's own path; greedy eagle-tree drafted that way is ar."""
    from eagle import EagleModel
    from eagle.drafting.drafter import LeanDrafter
    from eagle.decoding.tree_mask import tree_attention
    from eagle.runtime.masks import attention_bias
    from tests.conftest import prompts, tiny_drafter, tiny_target

    module_or_skip()
    target = tiny_target(seed=6, hidden=128)
    drafter = tiny_drafter(target, num_layers=2, draft_vocab_size=8)
    lean = LeanDrafter(drafter)
    assert lean.stack is not None and lean.layers[0].input_norm is None
    gen = torch.Generator().manual_seed(2)
    f, e = torch.randn(1, 14, 128, generator=gen), torch.randn(1, 14, 128, generator=gen)
    parents = torch.tensor([-1, 0, 0, 1, 2, 3])  # node 5's path: 0-1-3-5
    attn = tree_attention(parents)
    with torch.inference_mode():
        cache = lean.new_cache()
        lean(f[:, :8], e[:, :8], torch.arange(8)[None], cache)
        tree = lean(f[:, 8:], e[:, 8:], (8 + attn.depths)[None], cache, attention_bias(attn.mask, 8, torch.float32))
        for node, path in {3: [0, 1, 3], 4: [0, 2, 4], 5: [0, 1, 3, 5]}.items():
            rows = list(range(8)) + [8 + p for p in path]
            ref = drafter(f[:, rows], e[:, rows], torch.arange(len(rows))[None])[0, -1]
            assert torch.allclose(tree[0, node], ref, atol=1e-4 * ref.abs().max().item()), node
    assert cache.get_seq_length() == 14
    model = EagleModel.from_pretrained(target, drafter=drafter, total_tokens=8, depth=3, top_k=2,
                                       drafter_dtype=torch.float32)
    for ids in prompts(4, seed=3):  # greedy eagle-tree, drafted by the compiled layers, is ar's output
        assert model.generate(ids, method="eagle-tree", max_new_tokens=12).token_ids == \
            model.generate(ids, method="ar", max_new_tokens=12).token_ids


def test_greedy_head_argmax_is_the_fp32_heads_even_on_near_ties():
    """``GreedyHead`` (bf16 logits, a bound, fp32 recomputation of the candidates) returns exactly
    the fp32 head's argmax: on rows whose best logits are near-ties (head rows that differ in the
    last bits, where the bf16 logits alone pick the wrong token) and exact ties (duplicate rows:
    the first index, as argmax)."""
    from eagle.runtime.decoder import GreedyHead, cpu_has_fast_bf16

    op_or_skip()
    if not cpu_has_fast_bf16():
        pytest.skip("GreedyHead runs where bf16 products are native")
    gen = torch.Generator().manual_seed(7)
    vocab, k = 3000, 96
    w = torch.randn(vocab, k, generator=gen)
    w[1000:1100] = w[:100] * (1 + 1e-6 * torch.randn(100, 1, generator=gen))  # near-twins of rows 0-99
    w[2000:2100] = w[:100]  # exact twins: the first index wins
    w[2500:2700] = w[100] + 2e-3 * torch.randn(200, k, generator=gen)  # a crowd whose order bf16 blurs
    head = PackedLinear(w)
    greedy = GreedyHead(head)
    x = torch.cat([w[:100] * 3 + 0.01 * torch.randn(100, k, generator=gen),  # best logit among twins
                   w[100] * 3 + 0.3 * torch.randn(100, k, generator=gen),  # best logit in the crowd
                   torch.randn(60, k, generator=gen)])
    with torch.inference_mode():
        want = torch.cat([head(rows.contiguous()).argmax(-1) for rows in x.split(16)])
        approx_choice = greedy.approx(x.bfloat16()).float().argmax(-1)
        for rows in (x[:1], x[:7], x[:16], x):
            n = rows.shape[0]
            assert torch.equal(greedy(rows), want[:n])
        flat = torch.zeros(3, k)  # every logit 0: all are candidates, the full head decides (token 0)
        assert torch.equal(greedy(flat), torch.zeros(3, dtype=torch.long))
    assert (approx_choice != want).any()  # the bf16 logits alone are not enough here
    assert (want[:100] < 1000).any() and (want[:100] >= 1000).any() and not (want[:100] >= 2000).any()


@pytest.mark.parametrize("bits,out_features,in_features", [(4, 53, 96), (8, 41, 64), (4, 7, 1536)])
def test_stream_linear_q_gives_the_bits_of_the_fp32_kernel_on_the_decoded_weight(bits, out_features, in_features):
    from eagle.runtime.quant_blocks import block_encode
    from tests.conftest import block_quantized

    module = module_or_skip()
    gen = torch.Generator().manual_seed(bits * out_features)
    w = block_quantized(torch.randn(out_features, in_features, generator=gen) * 0.2, bits)
    encoded = block_encode(w)
    assert encoded is not None and encoded.bits == bits
    assert encoded.scales.dtype == (torch.float16 if bits == 4 else torch.float32)
    bias = torch.randn(out_features, generator=gen)
    # past 16 rows (AVX2's one-pass panels take any number, in blocks of 64): the fp32 kernel 16 rows a call
    more = (17, 64, 70) if module.stream_rows_q > kernels.STREAM_MAX_ROWS else ()
    for rows in (*range(1, kernels.STREAM_MAX_ROWS + 1), *more):
        x = torch.randn(rows, in_features, generator=gen)
        for b in (None, bias):
            reference = torch.cat([module.stream_linear(part, w, b) for part in x.split(kernels.STREAM_MAX_ROWS)])
            for scales in {encoded.scales, encoded.scales.float()}:  # float16 scales are read exactly
                assert torch.equal(module.stream_linear_q(x, encoded.codes, scales, b), reference)
    if not more:
        with pytest.raises(RuntimeError, match="1 to 16 rows"):
            module.stream_linear_q(torch.randn(17, in_features), encoded.codes, encoded.scales, None)
    with pytest.raises(RuntimeError, match="shapes do not match"):
        module.stream_linear_q(torch.randn(2, in_features - 32), encoded.codes, encoded.scales, None)


def test_lean_decoder_streams_block_coded_weights_with_the_same_bits():
    """A target whose weights are dequantized Q4_1 (layers) and Q8_0 (head), as the default GGUF
    target's: the forward from the codes equals the fp32 one bit for bit (decoding, a tree, the argmax)."""
    from eagle.runtime.decoder import LeanDecoder
    from eagle.decoding.tree_mask import tree_attention
    from eagle.runtime.masks import attention_bias
    from tests.conftest import block_quantized, tiny_target

    module_or_skip()
    model = tiny_target(seed=8, hidden=128).model
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and "embed" not in name:
                p.copy_(block_quantized(p, 8 if name.startswith("lm_head") else 4))
    coded, plain = LeanDecoder(model), LeanDecoder(model, encode=False)
    assert coded.head.encoded.bits == 8 and all(
        lin.encoded.bits == 4 for layer in coded.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down))
    assert plain.head.encoded is None and coded.kernel_choice() != plain.kernel_choice()
    assert coded.layers[0].qkv.plain_weight is None  # the codes replace the fp32 copy
    ids = torch.randint(0, 32, (1, 40), generator=torch.Generator().manual_seed(2))
    parents = torch.tensor([-1, 0, 0, 1, 2, 3, 3, 4])
    attn = tree_attention(parents)
    with torch.inference_mode():
        outs = []
        for lean in (coded, plain):
            cache = lean.new_cache()
            prefix = lean.forward(ids[:, :20], torch.arange(20)[None], cache)
            steps = [lean.forward(ids[:, 20 + k:21 + k], torch.tensor([[20 + k]]), cache) for k in range(3)]
            bias = attention_bias(attn.mask, 23, torch.float32)
            tree = lean.forward(ids[:, 23:31], (23 + attn.depths)[None], cache, bias)
            outs.append((prefix, torch.cat(steps, 1), tree, lean.argmax(tree[0]), lean.head(tree[0])))
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def test_compact_rows_moves_the_kept_rows_of_every_buffer_as_index_select_does():
    op_or_skip()
    module = kernels.cpu_kernels()
    gen = torch.Generator().manual_seed(0)
    buffers = [torch.randn(1, 3, 32, 16, generator=gen) for _ in range(4)] + [torch.randn(2, 1, 32, 8).double()]
    start, keep = 10, [10, 12, 13, 17]
    expected = [buf.clone() for buf in buffers]
    for buf in expected:
        buf[..., start:start + len(keep), :] = buf.index_select(-2, torch.tensor(keep))
    module.compact_rows(buffers, start, keep)
    assert all(torch.equal(got, want) for got, want in zip(buffers, expected))
    with pytest.raises(RuntimeError):
        module.compact_rows(buffers, start, [12, 11])  # must increase
    with pytest.raises(RuntimeError):
        module.compact_rows(buffers, start, [9])  # a source before its destination
    with pytest.raises(RuntimeError):
        module.compact_rows(buffers, start, [40])  # past the buffers


def test_a_stale_build_lock_is_removed_and_a_fresh_one_kept(tmp_path):
    """A killed build leaves ``lock`` behind, on which every later load would wait forever; one a live
    build holds (recent) stays."""
    import os
    import time

    from eagle.runtime.kernels import STALE_LOCK_S, clear_stale_lock

    lock = tmp_path / "lock"
    lock.touch()
    assert not clear_stale_lock(tmp_path) and lock.exists()
    old = time.time() - STALE_LOCK_S - 5
    os.utime(lock, (old, old))
    assert clear_stale_lock(tmp_path) and not lock.exists()
    assert not clear_stale_lock(tmp_path)  # nothing left to remove


# GGML types streamed by stream_linear_gguf: (type id, weights and bytes a block, offsets of float16 scales)
GGML_BLOCKS = {"Q4_0": (2, 32, 18, [0]), "Q4_1": (3, 32, 20, [0, 2]), "Q5_0": (6, 32, 22, [0]),
               "Q5_1": (7, 32, 24, [0, 2]), "Q8_0": (8, 32, 34, [0]), "Q4_K": (12, 256, 144, [0, 2]),
               "Q5_K": (13, 256, 176, [0, 2]), "Q6_K": (14, 256, 210, [208]), "Q2_K": (10, 256, 84, [80, 82]),
               "Q3_K": (11, 256, 110, [108]), "IQ4_NL": (20, 32, 18, [0]), "IQ4_XS": (23, 256, 136, [0])}


def random_gguf_rows(name: str, rows: int, in_features: int, seed: int):
    """GGUF bytes [rows, row bytes] of random codes with float16 scales of ordinary size, and the fp32 weight
    gguf-py de-quantizes them to."""
    import numpy as np
    from gguf import GGMLQuantizationType, quants

    type_id, weights, size, halves = GGML_BLOCKS[name]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows * in_features // weights, size), dtype=np.uint8)
    for offset in halves:
        scale = (rng.uniform(1e-3, 3e-2, len(blocks)) * rng.choice([-1, 1], len(blocks))).astype(np.float16)
        blocks[:, offset:offset + 2] = scale.view(np.uint8).reshape(-1, 2)
    raw = blocks.reshape(rows, -1)
    weight = quants.dequantize(raw, GGMLQuantizationType(type_id)).reshape(rows, in_features).astype(np.float32)
    return torch.from_numpy(raw.copy()), type_id, torch.from_numpy(weight)


@pytest.mark.parametrize("name", list(GGML_BLOCKS))
def test_stream_linear_gguf_gives_the_bits_of_the_fp32_kernel_on_the_dequantized_weight(name):
    """Each GGUF block type read from its own bytes: the outputs of stream_linear on the weight gguf-py
    de-quantizes, bit for bit, for 1-16 rows (so a tree row gets a plain step's bits), near a float64 product."""
    module = module_or_skip()
    in_features = 512
    raw, type_id, weight = random_gguf_rows(name, 29, in_features, seed=len(name))
    gen = torch.Generator().manual_seed(type_id)
    bias = torch.randn(29, generator=gen)
    for rows in range(1, kernels.STREAM_MAX_ROWS + 1):
        x = torch.randn(rows, in_features, generator=gen)
        for b in (None, bias):
            got = module.stream_linear_gguf(x, raw, type_id, b)
            assert torch.equal(got, module.stream_linear(x, weight, b)), (name, rows)
        want = x.double() @ weight.double().T
        assert torch.allclose(got.double() - bias.double(), want, atol=1e-3), name
    with pytest.raises(RuntimeError, match="shapes do not match"):
        module.stream_linear_gguf(torch.randn(1, in_features - 32), raw, type_id, None)
    with pytest.raises(RuntimeError, match="is not streamed"):
        module.stream_linear_gguf(torch.randn(1, in_features), raw, 16, None)  # IQ2_XXS


SUPER_BLOCKED = ("Q4_K", "Q5_K", "Q6_K")  # their int8 products quantize x per super-block of 256 (ggml's Q8_K)


def int8_block(name: str) -> int:
    """How many of x's values share a scale in the int8 products with code type ``name``."""
    return 256 if name in SUPER_BLOCKED else 32


def int8_rows_reference(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """x [M, K] as the int8 products see it: each block of ``block`` quantized to codes -127..127 with scale
    max |x| / 127 (codes rounded to the nearest, ties to even), de-quantized (float64)."""
    blocks = x.view(x.shape[0], -1, block)
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    return (torch.round(blocks * inv).double() * (amax / 127.0).double()).view_as(x)


def int8_products(module, name: str, in_features: int = 512):
    """(product(x) with int8 activations, product(x) without, the de-quantized weight) for GGUF type ``name`` or
    block codes (``block4``/``block8``, fp32 or ``-half`` scales) of a random 37 x ``in_features`` weight."""
    from eagle.runtime.quant_blocks import block_quantize, decode

    if name.endswith("-interleaved"):  # rows in groups of 8 (GGUFMatrix.interleave)
        raw, type_id, weight = random_gguf_rows(name.split("-")[0], 40, in_features, seed=len(name))
        packed = raw.clone()
        kind = module.gguf_interleave(packed, type_id)
        return (lambda x: module.stream_linear_gguf(x, packed, kind, None, int8=True),
                lambda x: module.stream_linear_gguf(x, raw, type_id, None), weight)
    if name in GGML_BLOCKS:
        raw, type_id, weight = random_gguf_rows(name, 37, in_features, seed=len(name))
        return (lambda x: module.stream_linear_gguf(x, raw, type_id, None, int8=True),
                lambda x: module.stream_linear_gguf(x, raw, type_id, None), weight)
    bits = 4 if name.startswith("block4") else 8
    codes = block_quantize(torch.randn(37, 512, generator=torch.Generator().manual_seed(bits)), bits)
    scales = codes.scales.half() if name.endswith("half") else codes.scales.float()
    return (lambda x: module.stream_linear_q(x, codes.codes, scales, None, True, True),
            lambda x: module.stream_linear_q(x, codes.codes, scales, None, True), decode(codes))


@pytest.mark.parametrize("name", [*GGML_BLOCKS, "Q4_K-interleaved", "Q6_K-interleaved", "Q5_0-interleaved", "block4", "block4-half", "block8", "block8-half"])
def test_int8_activations_multiply_the_codes_by_x_quantized_per_block(name, isa):
    """Every code type with int8 activations: the float64 product of the de-quantized weight and x as quantized
    (per block of 32, per super-block of 256 for Q4_K, Q5_K and Q6_K, as llama.cpp does; fp32 rounding only), any
    number of rows, each row's bits those of that row alone (a tree row gets a plain step's); the fp32 product
    differs by far more (x's quantization error), so the comparison is not vacuous."""
    module = module_or_skip()
    int8, exact, weight = int8_products(module, name)
    if isa == "portable" and name.split("-")[0] not in SUPER_BLOCKED:  # the K-quants' run there by plain loops
        with pytest.raises(RuntimeError, match="int8 activations need the AVX2"):
            int8(torch.randn(1, 512))
        return
    gen = torch.Generator().manual_seed(len(name))
    x = torch.randn(21, 512, generator=gen) * torch.rand(21, 512, generator=gen) * 3
    got = int8(x)
    seen = int8_rows_reference(x, int8_block(name.split("-")[0]))
    want = seen @ weight.double().T
    scale = seen.abs() @ weight.double().abs().T  # the size of each sum's terms
    assert ((got.double() - want).abs() / scale).max() < 1e-5, name
    fp32 = torch.cat([exact(x[i:i + 16]) for i in range(0, 21, 16)])  # 16 rows a call: AVX-512 stream_linear_q's most
    assert ((fp32.double() - want).abs() / scale).max() > 1e-4, name  # int8's error is measurable
    for rows in (1, 2, 3, 4, 5, 8, 16, 21):
        assert torch.equal(int8(x[:rows]), got[:rows]), (name, rows)
    assert torch.equal(torch.cat([int8(x[i:i + 1]) for i in range(21)]), got), name
    zero = int8(torch.zeros(2, 512))
    assert torch.equal(zero, torch.zeros_like(zero)), name


@pytest.mark.parametrize("name", [*GGML_BLOCKS, "Q4_K-interleaved", "Q6_K-interleaved", "Q5_0-interleaved", "block4", "block8-half"])
def test_int8_activations_give_the_same_bits_on_every_avx_instruction_set(name):
    """AVX2's two-step byte products (vpmaddubsw, vpmaddwd), AVX-512's and VNNI's one-step ones (vpdpbusd) sum the
    same integers: the same bits, also where the codes reach -128 and x's codes +-127 (every byte of a block
    at its largest, where a 16-bit pair sum would come closest to saturating)."""
    modules = {isa: kernels.kernels_for(isa) for isa in kernels.cpu_isas() if isa != "portable"}
    if len(modules) < 2 or any(m is None for m in modules.values()):
        pytest.skip("fewer than two AVX instruction sets here")
    gen = torch.Generator().manual_seed(len(name) + 5)
    x = torch.randn(19, 512, generator=gen) * 2
    x[3] = 1.0  # codes +127 throughout
    x[4] = -1.0
    x[5, ::2] = -x[5, ::2].abs() - 3  # every other code -127
    for rows in (19, 1, 2):  # a pass takes more rows of W for fewer rows of x, as many as the registers hold
        results = {isa: int8_products(module, name)[0](x[:rows]) for isa, module in modules.items()}
        for isa, got in results.items():
            assert torch.equal(got, results["avx2"]), (name, isa, rows)
    if name not in GGML_BLOCKS or GGML_BLOCKS[name][1] != 32:
        return
    x = torch.cat([x, x[:, :32]], dim=1)  # 17 blocks a row: AVX-512's Q5_0 takes two at a time, then the last alone
    for rows in (19, 1):
        results = {isa: int8_products(module, name, 544)[0](x[:rows]) for isa, module in modules.items()}
        for isa, got in results.items():
            assert torch.equal(got, results["avx2"]), (name, isa, rows, 544)


def test_codes_greedy_head_argmax_is_the_fp32_heads_even_on_near_ties(isa, monkeypatch):
    """``CodesGreedyHead`` (int8 logits from the head's 8-bit codes, a bound, fp32 recomputation of the candidates)
    returns exactly the fp32 head's argmax: on near-ties (rows one code apart, where the int8 logits alone pick
    the wrong token), exact ties (duplicate rows: the first index), crowds, 1-21 rows, with a bias; x that is not
    finite gets the whole head's answer. With the bound taken away it fails (the negative control)."""
    from eagle.runtime import decoder
    from eagle.runtime.quant_blocks import block_quantize
    from eagle.runtime.decoder import CodesGreedyHead, codes_greedy_head

    op_or_skip()
    gen = torch.Generator().manual_seed(5)
    vocab, k = 3000, 96
    w = torch.randn(vocab, k, generator=gen)
    w[1000:1100] = w[:100]
    w[2000:2100] = w[:100]  # exact twins: the first index wins
    w[2500:2700] = w[100] + 2e-2 * torch.randn(200, k, generator=gen)  # a crowd whose order int8 blurs
    codes = block_quantize(w, 8)
    codes.codes[1000:1100, 5] += torch.where(codes.codes[1000:1100, 5] < 127, 1, -1).to(torch.int8)  # near-twins
    bias = 1e-3 * torch.randn(vocab, generator=gen)
    bias[1000:1100] = bias[2000:2100] = bias[:100]
    head = PackedLinear.from_codes(codes, bias)
    assert codes_greedy_head(head) is None  # a small head: the screen would not pay
    if not kernels.cpu_kernels().int8_activations:
        return
    monkeypatch.setattr(decoder, "SCREENED_HEAD_WEIGHTS", vocab * k)
    greedy = CodesGreedyHead(head)  # screening any number of rows (whether it pays here: the next test)
    w = (codes.codes.float().view(vocab, -1, 32) * codes.scales).view(vocab, k)
    x = torch.cat([w[:100] * 3 + 0.01 * torch.randn(100, k, generator=gen),  # best logit among twins
                   w[100] * 3 + 0.3 * torch.randn(100, k, generator=gen),  # best logit in the crowd
                   torch.randn(60, k, generator=gen)])
    with torch.inference_mode():
        want = head(x).argmax(-1)
        approx = kernels.cpu_kernels().stream_linear_q(x, codes.codes, codes.scales, bias, True, True)
        for rows in (x[:1], x[:7], x[:16], x[:21], x):
            assert torch.equal(greedy(rows), want[:rows.shape[0]])
        nan = x[100:103].clone()  # the other rows' candidates are in the crowd, the NaN row's argmax is 0
        nan[1, 4] = torch.nan
        assert torch.equal(greedy(nan), head(nan).argmax(-1))
        bound_holds_and_is_not_vacuous(greedy, head, torch.cat([x, x[:30] ** 3]))
        blind = CodesGreedyHead(head)
        blind.norms = torch.zeros_like(blind.norms)  # no bound: the int8 logits' best alone
        assert not torch.equal(blind(x), want)
        blind.max_rows = x.shape[0] - 1  # more rows than it screens: the whole head decides
        assert torch.equal(blind(x), want)
    assert (approx.argmax(-1) != want).any()  # the int8 logits alone are not enough here
    assert (want[:100] < 1000).any() and (want[:100] >= 1000).any() and not (want[:100] >= 2000).any()


def test_a_codes_heads_argmax_of_many_rows_is_made_a_group_of_rows_at_a_time(isa, monkeypatch):
    """``head_argmax``: a head streamed from its codes meets many rows a group at a time, at most
    ``ARGMAX_LOGITS_BYTES`` of logits (at least 16 rows), and gives the argmax of all the rows' logits at once; a head
    whose logits of all the rows fit, or one with an fp32 weight, takes every row in one product."""
    from eagle.runtime import decoder
    from eagle.runtime.quant_blocks import block_quantize
    from eagle.runtime.decoder import head_argmax

    op_or_skip()
    gen = torch.Generator().manual_seed(8)
    vocab = 3000
    codes = block_quantize(torch.randn(vocab, 64, generator=gen), 8)
    x = torch.randn(37, 64, generator=gen)
    op = kernels.cpu_kernels().argmax_rows
    cases = ((PackedLinear.from_codes(codes), 4 * vocab * 16, [16, 16, 5]),
             (PackedLinear.from_codes(codes), 4 * vocab * 20, [20, 17]),
             (PackedLinear.from_codes(codes), decoder.ARGMAX_LOGITS_BYTES, [37]),  # 37 rows' logits: 444 KB
             (PackedLinear(torch.randn(vocab, 64)), 4 * vocab * 16, [37]))
    for head, most, groups in cases:
        calls = []
        monkeypatch.setattr(decoder, "ARGMAX_LOGITS_BYTES", most)
        with torch.inference_mode():
            want = head(x).argmax(-1)
            monkeypatch.setattr(head, "forward", lambda rows, head=head: calls.append(rows.shape[0]) or
                                PackedLinear.forward(head, rows))
            assert torch.equal(head_argmax(head, x, op), want) and torch.equal(head_argmax(head, x[:3], op), want[:3])
        assert calls == groups + [3], (most, calls)
        monkeypatch.undo()


def test_codes_greedy_head_screens_only_the_row_counts_it_measured_faster_at(isa, monkeypatch, tmp_path):
    """``codes_greedy_head`` times the screen against the whole head's product and argmax at 1, 4 and 16 rows:
    it screens up to the last row count it won (ascending, to the first loss), and is None where it loses at one
    row (a CPU without fast int8 dot products); the choice is kept in the cache, not measured again. Above
    ``max_rows`` the whole head answers."""
    from eagle.runtime import decoder
    from eagle.runtime.quant_blocks import block_quantize
    from eagle.runtime.decoder import CodesGreedyHead, codes_greedy_head

    op_or_skip()
    if not kernels.cpu_kernels().int8_activations:
        pytest.skip("no int8 products on this CPU build")
    gen = torch.Generator().manual_seed(6)
    head = PackedLinear.from_codes(block_quantize(torch.randn(2048, 64, generator=gen), 8))
    monkeypatch.setattr(decoder, "SCREENED_HEAD_WEIGHTS", 0)
    for i, (wins, max_rows) in enumerate((({1, 4, 16}, 16), ({1, 16}, 1), ({4, 16}, None), ({1, 4}, 4))):
        def timed(calls, rounds, wins=wins):
            assert rounds >= 1 and {n for _, n in calls} == {1, 4, 16}
            return {(kind, n): 1.0 if (kind == "screen") == (n in wins) else 2.0 for kind, n in calls}

        monkeypatch.setenv("EAGLE_CACHE", str(tmp_path / str(i)))
        monkeypatch.setattr(decoder, "interleaved_medians", timed)
        greedy = codes_greedy_head(head)
        assert (greedy.max_rows if greedy is not None else None) == max_rows, wins
        monkeypatch.setattr(decoder, "interleaved_medians", None)  # measured once: now read from the cache
        again = codes_greedy_head(head)
        assert (again.max_rows if again is not None else None) == max_rows, wins
    greedy = CodesGreedyHead(head, max_rows=4)
    screened = []
    monkeypatch.setattr(greedy, "_approx", lambda x: screened.append(x.shape[0]) or CodesGreedyHead._approx(greedy, x))
    x = torch.randn(9, 64, generator=gen)
    with torch.inference_mode():
        want = head(x).argmax(-1)
        assert torch.equal(greedy(x[:4]), want[:4]) and torch.equal(greedy(x), want)
    assert screened == [4]
    # the real timing runs and gives one of the trial counts (which one depends on the CPU)
    monkeypatch.undo()
    monkeypatch.setattr(decoder, "SCREENED_HEAD_WEIGHTS", 0)
    monkeypatch.setenv("EAGLE_CACHE", str(tmp_path / "real"))
    greedy = codes_greedy_head(head)
    assert greedy is None or greedy.max_rows in decoder.SCREEN_TRIAL_ROWS


def bound_holds_and_is_not_vacuous(greedy, head, x: torch.Tensor) -> None:
    """Every int8 logit within ``radius(x) |w_j|`` of the fp32 one; the largest gap over a twentieth of that."""
    with torch.inference_mode():
        gap = (greedy._approx(x).double() - head(x).double()).abs()
        bound = greedy.bound(x)
    assert (gap <= bound).all()
    assert (gap > bound / 20).any()



@pytest.mark.parametrize("name", ["Q6_K", "Q4_K", "Q5_K", "Q8_0", "Q5_0"])
def test_a_gguf_heads_screened_argmax_is_the_fp32_heads(name, isa, monkeypatch):
    """``CodesGreedyHead`` on a head of GGUF rows (Qwen's Q6_K output head; K-quants meet x quantized per
    super-block of 256, with minimums summed apart): exactly the fp32 head's argmax on exact twins (the first
    index), near-twins (one code apart), twins that int8 orders the other way round, 1-21 rows, with a bias; the
    bound holds and is not vacuous; with the bound taken away it fails (the negative control)."""
    from eagle.runtime import decoder
    from eagle.runtime.decoder import CodesGreedyHead
    from eagle.runtime.gguf_weights import GGUFLinear, GGUFMatrix, split_norms

    op_or_skip()
    if not kernels.cpu_kernels().int8_activations:
        pytest.skip("no int8 products on this CPU build")
    vocab, k = 2400, 512
    raw, _, _ = random_gguf_rows(name, vocab, k, seed=11)
    raw[800:900] = raw[:100]  # exact twins
    raw[1600:1700] = raw[:100]
    block_bytes, first = {"Q6_K": (210, 0), "Q4_K": (144, 16), "Q5_K": (176, 48), "Q8_0": (34, 2),
                          "Q5_0": (22, 6)}[name]  # a block's size, where its codes start
    raw[1600:1700, first] ^= 1  # near-twins: one code one apart
    few = torch.arange(k) % 16 == 0  # x's support for rows base and 1700 (small logits: wide gaps beside them)
    base = 100 + int(GGUFMatrix(raw[100:800], name).dequantize()[:, few].norm(dim=1).argmax())  # beats the others
    raw[1700] = raw[base]
    raw[1700, [first, raw.shape[1] - block_bytes + first]] ^= 1  # its twin but for one code in each half
    gen = torch.Generator().manual_seed(12)
    bias = 1e-3 * torch.randn(vocab, generator=gen)
    bias[800:900] = bias[:100]
    bias[1600:1700] = bias[:100]
    bias[1700] = bias[base]
    matrix = GGUFMatrix(raw, name)
    head = GGUFLinear([matrix], bias)
    w = matrix.dequantize()
    w64 = w.double()
    norms = split_norms(matrix).double()
    assert torch.allclose(norms[0], w64.norm(dim=1)) and (norms[1] >= norms[0] * (1 - 1e-6)).all()
    monkeypatch.setattr(decoder, "SCREENED_HEAD_WEIGHTS", vocab * k)
    greedy = CodesGreedyHead(head)
    scale = w.abs().mean()
    x = torch.cat([w[:100] / scale + 0.01 * torch.randn(100, k, generator=gen),  # best logit among twins
                   (w[base] / scale + 0.01 * torch.randn(60, k, generator=gen)) * few,  # base or its twin 1700
                   torch.randn(40, k, generator=gen)])
    # rows base and 1700 apart in fp32 and in int8, the other way round: where the twins differ, x at n + 0.49
    # quantization steps (quantized to n) and at -(m + 0.51) (to -(m + 1)), the larger weight difference at the first
    block = int8_block(name)
    (k1, k2), delta = (w[1700] - w[base]).nonzero()[:, 0].tolist(), (w[1700] - w[base]).abs()
    for row in x[100:160]:
        row[[k1, k2]] = 0.0
        step = row.view(-1, block).abs().amax(-1) / 127
        size = {j: float(delta[j] * step[j // block]) for j in (k1, k2)}
        big, small = sorted((k1, k2), key=size.get, reverse=True)
        ratio = size[big] / size[small]
        n, m = next((n, m) for n in range(40) for m in range(40)
                    if (n + 0.49) * ratio > (m + 0.51) * 1.001 and n * ratio < (m + 1) * 0.999)
        row[big] = (n + 0.49) * step[big // block] * torch.sign(w[1700, big] - w[base, big])
        row[small] = -(m + 0.51) * step[small // block] * torch.sign(w[1700, small] - w[base, small])
    with torch.inference_mode():
        want = head(x).argmax(-1)
        for rows in (x[:1], x[:4], x[:16], x[:21], x):
            assert torch.equal(greedy(rows), want[:rows.shape[0]]), name
        nan = x[100:103].clone()
        nan[1, 4] = torch.nan
        assert torch.equal(greedy(nan), head(nan).argmax(-1))
        bound_holds_and_is_not_vacuous(greedy, head, torch.cat([x, x[:30] ** 3]))
        blind = CodesGreedyHead(head)
        blind.norms = torch.zeros_like(blind.norms)  # no bound: the int8 logits' best alone
        approx = greedy._approx(x)
        assert not torch.equal(blind(x), want), name
    assert (approx.argmax(-1) != want).any()  # the int8 logits alone are not enough here
    assert (want[:100] < 800).any() and (want[:100] >= 1600).any() and (want[100:160] == 1700).any()


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "Q5_0"])
def test_interleaved_rows_stand_for_the_same_matrix(name):
    """Q4_K, Q6_K and Q5_0 rows interleaved 8 at a time (``gguf_interleave``, in place) give GGUF's bytes back, all of them
    (``gguf_deinterleave``) or some (``gguf_interleaved_rows``), and gguf-py's values row by row
    (``gguf_dequantize_rows``); a matrix whose rows are not a multiple of 32 too (Q6_K's and Q5_0's planes take 32); their products take int8
    activations only, and rows in groups of 8; other types have no such layout."""
    module = module_or_skip()
    raw, type_id, weight = random_gguf_rows(name, 40, 512, seed=7)
    packed = raw.clone()
    kind = module.gguf_interleave(packed, type_id)
    assert kind != type_id and not torch.equal(packed, raw)
    assert torch.equal(module.gguf_deinterleave(packed, kind), raw)
    index = torch.tensor([0, 7, 8, 39, 13, 13, 33])
    assert torch.equal(module.gguf_dequantize_rows(packed, kind, index), weight[index])
    assert torch.equal(module.gguf_interleaved_rows(packed, kind, index), raw[index])
    with pytest.raises(RuntimeError, match="int8 activations only"):
        module.stream_linear_gguf(torch.randn(2, 512), packed, kind, None)
    with pytest.raises(RuntimeError, match="N a multiple of 8"):
        module.gguf_interleave(raw[:12].clone(), type_id)
    with pytest.raises(RuntimeError, match="no interleaved layout"):
        module.gguf_interleave(random_gguf_rows("Q5_K", 8, 256, seed=1)[0], GGML_BLOCKS["Q5_K"][0])
