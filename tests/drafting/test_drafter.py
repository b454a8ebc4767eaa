import copy

import pytest
import torch
from transformers import DynamicCache

from eagle import Drafter, EagleError, EagleModel
from eagle.drafting.drafter import LeanDrafter
from eagle.decoding.tree_mask import tree_attention
from eagle.runtime.masks import attention_bias

from tests.conftest import block_quantized, prompts, tiny_drafter, tiny_target


def test_save_and_load_round_trip(tmp_path, target, drafter):
    drafter.save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    loaded = Drafter.from_pretrained(tmp_path, target=target)
    dev = target.device
    feats, embeds = torch.randn(1, 5, 32, device=dev), torch.randn(1, 5, 32, device=dev)
    pos = torch.arange(5, device=dev)[None]
    assert torch.equal(loaded(feats, embeds, pos), drafter(feats, embeds, pos))
    assert loaded.config == drafter.config
    assert not any("embed" in k for k in loaded.state_dict())  # the target's embedding is not stored
    # read into a skeleton, not copied over random weights: every tensor real, in the module's dtypes
    half = copy.deepcopy(drafter).to(torch.bfloat16)
    half.save_pretrained(tmp_path)
    state = Drafter.from_pretrained(tmp_path).state_dict()
    assert not any(t.is_meta for t in state.values()) and state.keys() == half.state_dict().keys()
    assert all(t.dtype == torch.float32 for t in state.values())
    for name, weight in half.state_dict().items():
        assert torch.equal(state[name], weight.float()), name


def test_drafter_for_another_target_is_refused(tmp_path, drafter):
    drafter.save_pretrained(tmp_path)
    with pytest.raises(EagleError, match="built for"):
        Drafter.from_pretrained(tmp_path, target=tiny_target(vocab_size=40))
    with pytest.raises(EagleError, match="tokenizer differs"):
        same_shape = tiny_target(seed=1)
        same_shape.tokenizer.add_tokens(["zz"])
        Drafter.from_pretrained(tmp_path, target=same_shape)
    with pytest.raises(EagleError, match="built for"):
        EagleModel.from_pretrained(tiny_target(hidden=48), drafter=str(tmp_path))


def test_cached_forward_equals_full_forward(drafter):
    dev = drafter.fc.weight.device
    feats, embeds = torch.randn(1, 7, 32, device=dev), torch.randn(1, 7, 32, device=dev)
    pos = torch.arange(7, device=dev)[None]
    full = drafter(feats, embeds, pos)
    cache = drafter.new_cache()
    first = drafter(feats[:, :4], embeds[:, :4], pos[:, :4], cache)
    rest = drafter(feats[:, 4:], embeds[:, 4:], pos[:, 4:], cache)
    assert torch.allclose(torch.cat([first, rest], 1), full, atol=1e-5)


def test_reduced_draft_vocabulary(target):
    counts = torch.zeros(32)
    counts[[3, 7, 9, 20, 31]] = torch.tensor([5.0, 9.0, 1.0, 4.0, 2.0])
    small = tiny_drafter(target, draft_vocab_size=4)
    assert small.lm_head.weight.shape == (4, 32)
    small = Drafter.from_target(target, token_counts=counts, draft_vocab_size=4)
    assert small.d2t.tolist() == [3, 7, 20, 31]  # the 4 most frequent, in id order
    assert torch.equal(small.lm_head.weight, target.model.lm_head.weight[[3, 7, 20, 31]])
    assert small.to_target_ids(torch.tensor([0, 2])).tolist() == [3, 20]
    model = EagleModel.from_pretrained(target, drafter=small, total_tokens=8, depth=3, top_k=2)
    for ids in prompts(5):
        assert model.generate(ids, method="eagle-tree", max_new_tokens=12).token_ids == \
            model.generate(ids, method="ar", max_new_tokens=12).token_ids


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_tree_forward_matches_sequential_decoding(family):
    """Every tree node's logits equal those of running its root-to-node path causally."""
    t = tiny_target(family=family, seed=2)
    dev = t.device
    torch.manual_seed(0)
    prefix = torch.randint(1, 32, (1, 5), device=dev)
    parents = torch.tensor([-1, 0, 0, 1, 1, 2, 3])
    tokens = torch.randint(1, 32, (7,), device=dev)
    attn = tree_attention(parents)
    cache = DynamicCache(config=t.model.config)
    t.forward(prefix, torch.arange(5, device=dev)[None], cache)
    bias = attention_bias(attn.mask, 5, torch.float32).to(dev)
    tree_logits = t.forward(tokens[None], (5 + attn.depths)[None].to(dev), cache, bias).logits[0]
    for node in range(7):
        path = [j for j in range(7) if attn.mask[node, j]]
        seq = torch.cat([prefix[0], tokens[path]])[None]
        ref = t.model(seq).logits[0, -1]
        assert torch.allclose(tree_logits[node], ref, atol=1e-4), (family, node)


def test_qwen2_greedy_tree_matches_ar():
    t = tiny_target(family="qwen2", seed=4)
    model = EagleModel.from_pretrained(t, drafter=tiny_drafter(t), total_tokens=10, depth=4, top_k=3)
    for ids in prompts(10, seed=2):
        assert model.generate(ids, method="eagle-tree", max_new_tokens=16).token_ids == \
            model.generate(ids, method="ar", max_new_tokens=16).token_ids


def test_draft_vocabulary_resize_keeps_trained_rows_and_maps_new_ones():
    tiny = tiny_target(vocab_size=64, hidden=16, seed=3)
    drafter = tiny_drafter(tiny, draft_vocab_size=24)  # ids 0..23
    rows = tiny.model.get_output_embeddings().weight
    dev = tiny.device
    mapping = torch.randn(16, 16, device=dev)
    with torch.no_grad():  # a head that is exactly the target's rows through a linear map: the fit recovers it
        drafter.lm_head.weight.copy_(rows[drafter.d2t] @ mapping)
    ids = torch.tensor(sorted(set(range(2, 24)) | {30, 41, 63}), device=dev)
    resized = drafter.with_draft_vocab(ids, tiny)
    assert resized.config.draft_vocab_size == 25 and torch.equal(resized.d2t, ids)
    hidden = torch.randn(5, 16, device=dev)
    old, new = drafter.draft_logits(hidden, None), resized.draft_logits(hidden, None)
    assert torch.equal(new[:, :22], old[:, 2:24])  # kept tokens: the trained rows, unchanged
    torch.testing.assert_close(new[:, 22:], hidden @ (rows[ids[22:]] @ mapping).T, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(resized.fc.weight, drafter.fc.weight)
    with pytest.raises(EagleError, match="sorted, unique"):
        drafter.with_draft_vocab(torch.tensor([5, 3]), tiny)


@pytest.mark.parametrize("layers, draft_vocab", [(1, None), (2, 8)])
def test_lean_drafter_computes_what_the_drafter_does(target, layers, draft_vocab):
    drafter = tiny_drafter(target, num_layers=layers, draft_vocab_size=draft_vocab)
    lean = LeanDrafter(drafter)
    dev = target.device
    torch.manual_seed(0)
    f, e, pos = torch.randn(1, 9, 32, device=dev), torch.randn(1, 9, 32, device=dev), torch.arange(9, device=dev)[None]
    with torch.inference_mode():
        whole = drafter(f, e, pos)
        assert torch.allclose(lean(f, e, pos), whole, rtol=1e-4, atol=1e-4 * whole.abs().max().item())
        cache = lean.new_cache()  # cached in two pieces, positions past the first rotary table size
        lean(f[:, :4], e[:, :4], torch.arange(300, 304, device=dev)[None], cache)
        rest = lean(f[:, 4:], e[:, 4:], torch.arange(304, 309, device=dev)[None], cache)
        ref = drafter(f, e, torch.arange(300, 309, device=dev)[None])[:, 4:]
        assert torch.allclose(rest, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
        h = whole[0, :3]
        assert torch.allclose(lean.draft_logits(h, target.lm_head), drafter.draft_logits(h, target.lm_head), atol=1e-3)
    assert torch.equal(lean.to_target_ids(torch.tensor([0, 1])), drafter.to_target_ids(torch.tensor([0, 1])))
    half = LeanDrafter(drafter, torch.bfloat16)
    with torch.inference_mode():
        out = half(f.bfloat16(), e.bfloat16(), pos)
    assert out.dtype == torch.bfloat16 and (out.float() - whole).norm() < 0.15 * whole.norm()  # bf16: ~3 digits


def rounded_copy(drafter: Drafter, bits: int) -> Drafter:
    """A float32 copy of ``drafter`` with every linear weight rounded to the block format of ``bits``."""
    rounded = copy.deepcopy(drafter).float()
    with torch.no_grad():
        for module in rounded.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.copy_(block_quantized(module.weight, bits))
    return rounded


@pytest.mark.parametrize("quant, bits", [("q8_0", 8), ("q4_1", 4)])
def test_a_quantized_lean_drafter_computes_the_drafter_with_quantized_weights(target, quant, bits):
    """``LeanDrafter(quant=...)``: each matrix rounded to the block format (``block_quantize``), the
    rest (norms) as they are, computed in fp32: the plain ``Drafter`` with those weights, in one
    call and cached in two; a format that is not one, or another dtype, is refused."""
    drafter = tiny_drafter(target, num_layers=2, draft_vocab_size=8)
    rounded = rounded_copy(drafter, bits)
    lean = LeanDrafter(drafter, quant=quant)
    assert lean.dtype == torch.float32 and lean.quant == quant
    dev = target.device
    gen = torch.Generator().manual_seed(0)
    f, e = torch.randn(1, 9, 32, generator=gen).to(dev), torch.randn(1, 9, 32, generator=gen).to(dev)
    pos = torch.arange(9, device=dev)[None]
    with torch.inference_mode():
        ref, plain = rounded(f, e, pos), drafter.float()(f, e, pos)
        torch.testing.assert_close(lean(f, e, pos), ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
        cache = lean.new_cache()
        lean(f[:, :5], e[:, :5], pos[:, :5], cache)
        torch.testing.assert_close(lean(f[:, 5:], e[:, 5:], pos[:, 5:], cache), ref[:, 5:], rtol=1e-4,
                                   atol=1e-4 * ref.abs().max().item())
        h = ref[0, :3]
        torch.testing.assert_close(lean.draft_logits(h, target.lm_head), rounded.draft_logits(h, target.lm_head),
                                   rtol=1e-4, atol=1e-3)
    assert not torch.allclose(ref, plain, atol=1e-4 * ref.abs().max().item())  # the rounding is real
    with pytest.raises(EagleError, match="unknown drafter quantization"):
        LeanDrafter(drafter, quant="q5_k")
    with pytest.raises(EagleError, match="computes in float32"):
        LeanDrafter(drafter, torch.bfloat16, quant=quant)


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
@pytest.mark.parametrize("stored", ["fp32", "bf16", "packed"])
def test_a_lean_drafter_read_from_its_file_is_the_one_made_from_the_module(tmp_path, target, eagle3_target, kind,
                                                                           stored):
    """``DrafterFile``: a drafter folder opened without a module; ``LeanDrafter`` reads its matrices from the file
    a few rows at a time (stored 8-bit codes as they are) and computes the bits of the one made from the loaded
    ``Drafter``, for every quantization and none. The module is read only when asked for; what the loader
    refuses, ``open`` refuses."""
    from safetensors.torch import load_file, save_file

    from eagle.drafting.drafter import DrafterFile, _StackedRows
    from eagle.runtime.quant_blocks import pack_state

    tgt = target if kind == "eagle" else eagle3_target
    made = tiny_drafter(tgt, num_layers=2, draft_vocab_size=8) if kind == "eagle" else \
        tiny_drafter(tgt, kind="eagle3", draft_vocab_size=20)
    (made.to(torch.bfloat16) if stored == "bf16" else made).save_pretrained(tmp_path)
    path = str(tmp_path / "model.safetensors")
    if stored == "packed":
        save_file(pack_state(load_file(path), min_size=256), path, metadata={"format": "eagle-drafter/1"})
    file = DrafterFile.open(tmp_path, tgt)
    module = Drafter.from_pretrained(tmp_path, target=tgt)
    gen = torch.Generator().manual_seed(3)
    width = 32 * (1 + len(made.config.aux_layers) if kind == "eagle3" else 1)
    f, e = torch.randn(1, 7, width, generator=gen), torch.randn(1, 7, 32, generator=gen)
    pos = torch.arange(7)[None]
    for quant in ("q8_0", "q4_1", None):
        ours, theirs = LeanDrafter(file, quant=quant), LeanDrafter(module, quant=quant)
        with torch.inference_mode():
            a, b = ours(f, e, pos, ours.new_cache()), theirs(f, e, pos, theirs.new_cache())
            assert torch.equal(a, b), quant
            assert torch.equal(ours.draft_logits(a[0], tgt.lm_head), theirs.draft_logits(b[0], tgt.lm_head)), quant
        assert torch.equal(ours.to_target_ids(torch.arange(8)), theirs.to_target_ids(torch.arange(8)))
    names = [f"layers.0.self_attn.{p}_proj.weight" for p in "qkv"]  # rows across parts, as block_quantize reads them
    whole, stacked = torch.cat([module.state_dict()[name] for name in names]), _StackedRows(file, names)
    n = whole.shape[0]
    for start, stop in ((0, n), (5, n - 3), (n // 2 - 1, n // 2 + 1), (n - 10, n + 50)):
        assert torch.equal(stacked[start:stop], whole[start:stop]), (start, stop)
    assert file.module is None  # no module was made
    assert torch.equal(file.load().fc.weight, module.fc.weight) and file.load() is file.load()
    with pytest.raises(EagleError, match="built for"):
        DrafterFile.open(tmp_path, tiny_target(vocab_size=40, layers=tgt.model.config.num_hidden_layers))
    state = load_file(path)
    state["fc.weight" if stored != "packed" else "fc.weight.q8_codes"] = torch.zeros(3, 3, dtype=torch.int8)
    save_file(state, path, metadata={"format": "eagle-drafter/1"})
    with pytest.raises(EagleError, match="do not match the config"):
        DrafterFile.open(tmp_path, tgt)
    with open(path, "r+b") as out:
        out.truncate(out.seek(0, 2) - 10)
    with pytest.raises(EagleError, match="damaged or truncated"):
        DrafterFile.open(tmp_path, tgt)


def test_a_model_on_a_cpu_reads_its_drafter_from_the_file_and_the_module_only_when_asked(tmp_path, target, drafter):
    """``EagleModel.from_pretrained`` with a drafter folder, fp32 on a CPU: the inference copy comes from the
    file (no fp32 module in memory while decoding), the output is the module-built model's, and
    ``model.drafter`` reads the module when asked."""
    from eagle.drafting.drafter import DrafterFile

    drafter.save_pretrained(tmp_path)
    model = EagleModel.from_pretrained(target, drafter=str(tmp_path))
    assert isinstance(model._drafter, DrafterFile) and model.drafter_config == drafter.config
    assert model.drafter_source == str(tmp_path)
    reference = EagleModel(target, Drafter.from_pretrained(tmp_path, target=target))
    for prompt in prompts(3):
        ours = model.generate(prompt, method="eagle-tree", max_new_tokens=12)
        assert ours.token_ids == reference.generate(prompt, method="eagle-tree", max_new_tokens=12).token_ids
    assert model._drafter.module is None
    assert model.drafter is model.drafter and isinstance(model.drafter, Drafter)
    assert model.with_tree(model.tree)._packed is model._packed


def test_appended_layers_start_as_the_drafter_they_extend(target):
    """``with_layers`` appends layers whose output projections are zero: the same predictions
    (and the same cached keys for the old layers) until the new layer is trained; the new
    layer's other weights are random, so training can move it; shrinking is refused, and so is a
    weight that the deeper drafter would drop."""
    base = tiny_drafter(target, draft_vocab_size=8)
    deeper = base.with_layers(3)
    assert deeper.config.num_layers == 3 and len(deeper.layers) == 3
    dev = target.device
    torch.manual_seed(0)
    f, e, pos = torch.randn(1, 6, 32, device=dev), torch.randn(1, 6, 32, device=dev), torch.arange(6, device=dev)[None]
    assert torch.equal(deeper(f, e, pos), base(f, e, pos))
    assert torch.equal(deeper.lm_head.weight, base.lm_head.weight) and torch.equal(deeper.d2t, base.d2t)
    assert deeper.layers[2].self_attn.q_proj.weight.abs().sum() > 0
    with torch.no_grad():
        deeper.layers[1].mlp.down_proj.weight.normal_()
    assert not torch.allclose(deeper(f, e, pos), base(f, e, pos))
    with pytest.raises(EagleError, match="shrink"):
        deeper.with_layers(2)
    base.register_buffer("stray", torch.zeros(1))  # a weight the deeper drafter has no place for: refused, not dropped
    with pytest.raises(EagleError, match="stray"):
        base.with_layers(3)


def test_fused_aux_layers_start_as_the_drafter_they_extend_and_stay_exact(target):
    """``with_aux_layers`` adds zero fc columns: the same predictions whatever the aux outputs are;
    a prediction (H wide) reads as zero aux outputs; greedy eagle-tree with a fusing drafter
    (random, so its aux columns matter) still equals ar, with either target forward."""
    base = tiny_drafter(target)
    fused = base.with_aux_layers([0])
    assert fused.config.aux_layers == [0] and fused.fc.weight.shape == (32, 3 * 32)
    dev = target.device
    torch.manual_seed(0)
    f, e, pos = torch.randn(1, 6, 64, device=dev), torch.randn(1, 6, 32, device=dev), torch.arange(6, device=dev)[None]
    if dev.type == "cpu":
        assert torch.equal(fused(f, e, pos), base(f[..., :32], e, pos))
    else:  # a GPU's matrix kernels sum in an order chosen by shape: 96 columns and 64 round differently
        assert torch.allclose(fused(f, e, pos), base(f[..., :32], e, pos), rtol=1e-5, atol=1e-4)
    with torch.no_grad():
        fused.fc.weight[:, 64:].normal_()
    assert not torch.allclose(fused(f, e, pos), base(f[..., :32], e, pos))
    zeros = torch.cat([f[..., :32], torch.zeros(1, 6, 32, device=dev)], dim=-1)
    assert torch.equal(fused(f[..., :32], e, pos), fused(zeros, e, pos))
    lean = LeanDrafter(fused)
    with torch.inference_mode():
        assert torch.allclose(lean(f, e, pos), fused(f, e, pos), atol=1e-4 * fused(f, e, pos).abs().max().item())
    with pytest.raises(EagleError, match="below its last"):
        base.with_aux_layers([1]).check_target(target)  # the tiny target has 2 layers: layer 1's output is the feature
    for t in (target, tiny_target(lean=False)):
        model = EagleModel.from_pretrained(t, drafter=fused, total_tokens=8, depth=3, top_k=2)
        for ids in prompts(6, seed=5):
            assert model.generate(ids, method="eagle-tree", max_new_tokens=12).token_ids == \
                model.generate(ids, method="ar", max_new_tokens=12).token_ids


# ---- EAGLE-3 drafters (kind "eagle3") ----------------------------------------------------------

def eagle3_reference(drafter: Drafter, features: torch.Tensor, embeds: torch.Tensor,
                     positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """EAGLE-3 written out from its definition (SpecForge ``llama3_eagle.py``), causal, no cache:
    ``features`` [1, T, (1 + n) H] (target: last hidden state unused, then the n aux outputs, fused
    by fc) or [1, T, H] (the drafter's own output hidden states, taken as they are); one layer
    attends over cat(input_layernorm(embedding), hidden_norm(x)) with residual x -> (hidden
    [1, T, H], logits lm_head(norm(hidden)) [1, T, V_draft])."""
    cfg, layer = drafter.config, drafter.layers[0]
    h, nh, nkv, d = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    t = features.shape[1]

    def norm(x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps) * weight

    def rope(x):  # [1, T, heads, d], rotate-half layout
        inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=x.device) / d)
        angles = positions[0].float()[:, None] * inv_freq
        cos, sin = torch.cat([angles, angles], -1).cos()[:, None], torch.cat([angles, angles], -1).sin()[:, None]
        return x * cos + torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1) * sin

    x = features if features.shape[-1] == h else features[..., h:] @ drafter.fc.weight.T
    a = torch.cat([norm(embeds, layer.input_layernorm.weight), norm(x, layer.hidden_norm.weight)], -1)
    attn = layer.self_attn
    q = rope((a @ attn.q_proj.weight.T).view(1, t, nh, d)).transpose(1, 2)
    k = rope((a @ attn.k_proj.weight.T).view(1, t, nkv, d)).transpose(1, 2).repeat_interleave(nh // nkv, 1)
    v = (a @ attn.v_proj.weight.T).view(1, t, nkv, d).transpose(1, 2).repeat_interleave(nh // nkv, 1)
    scores = (q @ k.transpose(-1, -2)) / d ** 0.5
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1), float("-inf"))
    x = x + (scores.softmax(-1) @ v).transpose(1, 2).reshape(1, t, nh * d) @ attn.o_proj.weight.T
    mlp, post = layer.mlp, norm(x, layer.post_attention_layernorm.weight)
    x = x + (torch.nn.functional.silu(post @ mlp.gate_proj.weight.T) * (post @ mlp.up_proj.weight.T)) @ mlp.down_proj.weight.T
    return x, norm(x, drafter.norm.weight) @ drafter.lm_head.weight.T


def eagle3_inputs(drafter, t: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random target features [1, t, (1 + n) H], own hidden states [1, t, H], token embeddings [1, t, H]."""
    cfg, dev = drafter.config, drafter.fc.weight.device
    gen = torch.Generator().manual_seed(seed)
    width = (1 + len(cfg.aux_layers)) * cfg.hidden_size
    f, own, e = (torch.randn(1, t, w, generator=gen).to(dev) for w in (width, cfg.hidden_size, cfg.hidden_size))
    return f, own, e


def test_an_eagle3_drafter_computes_eagle3(eagle3_drafter):
    """The drafter equals EAGLE-3 written out: target features through fc (their first H columns,
    the last hidden state, unread), own hidden states as they are (fc not used at all: NaN
    weights there change nothing), logits through the final norm and the draft head."""
    drafter = eagle3_drafter
    assert drafter.fc.weight.shape == (32, 3 * 32) and drafter.fc.bias is None
    assert drafter.layers[0].self_attn.q_proj.weight.shape == (32, 2 * 32)
    f, own, e = eagle3_inputs(drafter, 7)
    pos = torch.arange(3, 10, device=f.device)[None]
    with torch.no_grad():
        for features in (f, own):
            want, want_logits = eagle3_reference(drafter, features, e, pos)
            got = drafter(features, e, pos)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
            torch.testing.assert_close(drafter.draft_logits(got, None), want_logits, rtol=1e-4,
                                       atol=1e-4 * want_logits.abs().max().item())
        changed = f.clone()
        changed[..., :32] = torch.randn_like(changed[..., :32])
        assert torch.equal(drafter(changed, e, pos), drafter(f, e, pos))
        assert not torch.allclose(drafter(f, e, pos), drafter(own, e, pos))
        broken = copy.deepcopy(drafter)
        broken.fc.weight.fill_(float("nan"))
        assert torch.equal(broken(own, e, pos), drafter(own, e, pos))
        assert broken(f, e, pos).isnan().all()
        assert LeanDrafter(broken)(own, e, pos).isfinite().all()


@pytest.mark.parametrize("change, message", [
    (dict(aux_layers=[]), "set aux_layers"),
    (dict(num_layers=2), "one decoder layer"),
    (dict(fc_bias=True), "no fc bias"),
    (dict(kind="eagle4"), "kind must be one of eagle, eagle3"),
])
def test_eagle3_configs_that_cannot_be_are_clear_errors(eagle3_drafter, change, message):
    import dataclasses

    with pytest.raises(EagleError, match=message):
        dataclasses.replace(eagle3_drafter.config, **change)


def test_eagle3_features_of_another_width_are_a_clear_error(eagle3_drafter):
    f, _, e = eagle3_inputs(eagle3_drafter, 3)
    pos = torch.arange(3, device=f.device)[None]
    for drafter in (eagle3_drafter, LeanDrafter(eagle3_drafter)):
        for width in (2 * 32, 3 * 32, 5 * 32):  # not H, nor (1 + 3) H
            with pytest.raises(EagleError, match=f"features of width {width}, expected 32 .* or 128"):
                drafter(f[..., :width] if width < 128 else torch.cat([f, e], -1), e, pos)


def test_eagle3_drafters_are_made_from_the_target(eagle3_target):
    """``from_target(kind="eagle3")``: the default aux layers (1, L/2-1, L-4; fewer, all below the
    last layer, on shallow targets), the head from the target's LM-head rows of the draft
    vocabulary, the final norm from the target's; layers asked for are kept; a target of one
    layer has none to fuse."""
    from eagle.drafting.drafter import default_eagle3_layers

    target = tiny_target(layers=8)
    with torch.no_grad():
        target.model.model.norm.weight.uniform_(0.5, 1.5)  # not ones, which a fresh norm has too
    counts = torch.arange(32.0).flip(0)  # token 0 most frequent
    drafter = Drafter.from_target(target, kind="eagle3", draft_vocab_size=20, token_counts=counts)
    assert drafter.config.kind == "eagle3" and drafter.config.aux_layers == [1, 3, 4]
    assert torch.equal(drafter.norm.weight, target.model.model.norm.weight)
    assert drafter.d2t.tolist() == list(range(20))
    assert torch.equal(drafter.lm_head.weight, target.model.lm_head.weight[:20])
    assert Drafter.from_target(target, kind="eagle3", aux_layers=[0, 6]).config.aux_layers == [0, 6]
    full = Drafter.from_target(target, kind="eagle3")  # no draft vocabulary: a head over the target's
    assert full.lm_head.weight.shape == (32, 32) and full.d2t.tolist() == list(range(32))
    assert full.to_target_ids(torch.tensor([5])).tolist() == [5]
    assert default_eagle3_layers(32) == [1, 15, 28]  # vLLM and llama.cpp's 2, 16, 29
    for layers in range(2, 9):
        shallow = tiny_target(layers=layers, hidden=16)
        Drafter.from_target(shallow, kind="eagle3").check_target(shallow)  # its default layers are valid for it
    with pytest.raises(EagleError, match="at least 2 layers"):
        Drafter.from_target(tiny_target(layers=1, hidden=16), kind="eagle3")


def test_eagle3_drafters_cannot_be_widened_or_deepened(eagle3_drafter):
    with pytest.raises(EagleError, match="an eagle3 drafter's layers are fixed"):
        eagle3_drafter.with_aux_layers([2])
    with pytest.raises(EagleError, match="one decoder layer"):
        eagle3_drafter.with_layers(2)


def test_eagle3_save_and_load_round_trip(tmp_path, eagle3_target, eagle3_drafter):
    """Saved and loaded: the same config (kind, aux layers) and weights (final norm, hidden_norm,
    head, d2t); loaded from 8-bit block codes (``pack_state``), the matrices are their Q8_0 values."""
    from safetensors.torch import load_file, save_file

    from eagle.runtime.quant_blocks import block_quantize, decode, pack_state

    drafter = eagle3_drafter
    drafter.save_pretrained(tmp_path)
    loaded = Drafter.from_pretrained(tmp_path, target=eagle3_target)
    assert loaded.config == drafter.config and loaded.config.kind == "eagle3"
    assert loaded.state_dict().keys() == drafter.state_dict().keys() >= {"norm.weight", "layers.0.hidden_norm.weight",
                                                                          "lm_head.weight", "d2t"}
    for name, weight in drafter.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], weight), name
    f, own, e = eagle3_inputs(drafter, 5)
    pos = torch.arange(5, device=f.device)[None]
    with torch.no_grad():
        for features in (f, own):
            assert torch.equal(loaded(features, e, pos), drafter(features, e, pos))
    path = str(tmp_path / "model.safetensors")
    save_file(pack_state(load_file(path), min_size=1024), path, metadata={"format": "eagle-drafter/1"})
    assert any(k.endswith(".q8_codes") for k in load_file(path))
    packed = Drafter.from_pretrained(tmp_path, target=eagle3_target)
    for name, weight in drafter.state_dict().items():
        got = packed.state_dict()[name]
        if weight.dim() == 2 and weight.numel() >= 1024:
            assert torch.equal(got, decode(block_quantize(weight.float(), 8)).to(got.dtype)), name
        else:
            assert torch.equal(got, weight), name
    with pytest.raises(EagleError, match="below its last"):  # a target too shallow for its aux layers
        Drafter.from_pretrained(tmp_path, target=tiny_target(layers=4))


def test_an_eagle3_lean_drafter_computes_what_the_drafter_does(eagle3_target, eagle3_drafter):
    """In one call and cached in pieces (target features, then own hidden states below them, as a
    tree's deeper levels are fed), positions past the first rotary table size; logits through the
    final norm; bf16 within its precision."""
    drafter, lean = eagle3_drafter, LeanDrafter(eagle3_drafter)
    assert lean.stack is None  # the compiled stack has no EAGLE-3 attention input
    f, own, e = eagle3_inputs(drafter, 9)
    pos = torch.arange(9, device=f.device)[None]
    with torch.inference_mode():
        for features in (f, own):
            whole = drafter(features, e, pos)
            torch.testing.assert_close(lean(features, e, pos), whole, rtol=1e-4, atol=1e-4 * whole.abs().max().item())
        want, ref_cache = [], drafter.new_cache()
        got, cache = [], lean.new_cache()
        for features, lo, hi in ((f, 0, 4), (own, 4, 6), (f, 6, 7), (own, 7, 9)):
            p = torch.arange(300 + lo, 300 + hi, device=f.device)[None]
            want.append(drafter(features[:, lo:hi], e[:, lo:hi], p, ref_cache))
            got.append(lean(features[:, lo:hi], e[:, lo:hi], p, cache))
        want, got = torch.cat(want, 1), torch.cat(got, 1)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
        h = want[0, :3]
        torch.testing.assert_close(lean.draft_logits(h, None), drafter.draft_logits(h, None), rtol=1e-4, atol=1e-3)
        assert not torch.allclose(lean.draft_logits(h, None), h @ drafter.lm_head.weight.T, atol=1e-2)  # normed
    assert torch.equal(lean.to_target_ids(torch.tensor([0, 19])), drafter.to_target_ids(torch.tensor([0, 19])))
    half = LeanDrafter(drafter, torch.bfloat16)
    with torch.inference_mode():
        whole = drafter(f, e, pos)
        out = half(f.bfloat16(), e.bfloat16(), pos)
    assert out.dtype == torch.bfloat16 and (out.float() - whole).norm() < 0.15 * whole.norm()


@pytest.mark.parametrize("quant, bits", [("q8_0", 8), ("q4_1", 4)])
def test_a_quantized_eagle3_lean_drafter_computes_the_drafter_with_quantized_weights(eagle3_drafter, quant, bits):
    """As for EAGLE-1/2 drafters: fc, the 2H-wide q/k/v, the MLP and the head rounded to the block
    format, norms as they are: the plain drafter with those weights, on both inputs and cached."""
    drafter = eagle3_drafter
    rounded = rounded_copy(drafter, bits)
    lean = LeanDrafter(drafter, quant=quant)
    assert lean.quant == quant and lean.dtype == torch.float32
    f, own, e = eagle3_inputs(drafter, 9, seed=1)
    pos = torch.arange(9, device=f.device)[None]
    with torch.inference_mode():
        for features in (f, own):
            ref, plain = rounded(features, e, pos), drafter(features, e, pos)
            torch.testing.assert_close(lean(features, e, pos), ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
            assert not torch.allclose(ref, plain, atol=1e-4 * ref.abs().max().item())  # the rounding is real
        cache = lean.new_cache()
        lean(f[:, :5], e[:, :5], pos[:, :5], cache)
        ref = rounded(f, e, pos)
        torch.testing.assert_close(lean(f[:, 5:], e[:, 5:], pos[:, 5:], cache), ref[:, 5:], rtol=1e-4,
                                   atol=1e-4 * ref.abs().max().item())
        h = ref[0, :3]
        torch.testing.assert_close(lean.draft_logits(h, None), rounded.draft_logits(h, None), rtol=1e-4, atol=1e-3)
