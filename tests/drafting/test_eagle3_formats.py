"""EAGLE-3 import/export (eagle.drafting.checkpoint_formats, eagle-export): the names, shapes and config fields each
consumer's loader reads, the aux-layer ids checked against the hidden states the consumers capture, lossless round
trips (same weights, same drafts, same tree decoding) and clear refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle.config import TreeConfig
from eagle.drafting.checkpoint_formats import (EAGLE3_LAYOUT, TARGET_KEY, detect_format, eagle3_aux_layers,
                                               export_drafter)
from eagle.drafting.drafter import Drafter
from eagle.engine import EagleModel
from eagle.errors import EagleError
from infer.export import main as export_main
from tests.conftest import tiny_drafter, tiny_target

FORMATS = ["eagle3", "sglang", "vllm", "eagle"]
LAYER = ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
         "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight",
         "hidden_norm.weight", "post_attention_layernorm.weight"]
STACKED = ((".q_proj", ".qkv_proj"), (".k_proj", ".qkv_proj"), (".v_proj", ".qkv_proj"),
           (".gate_proj", ".gate_up_proj"), (".up_proj", ".gate_up_proj"))


def stacked(name: str) -> str:
    for shard, param in STACKED:
        if shard in name:
            return name.replace(shard, param)
    return name


# ---- what each consumer's loader does with a checkpoint's names (copied from their code) ---------------------
def sglang_loads(names: list[str]) -> tuple[set[str], list[str]]:
    """sgl-project/sglang python/sglang/srt/models/llama_eagle3.py: LlamaModel builds model.embed_tokens, model.fc,
    model.midlayer (LlamaDecoderLayer with qkv_proj over 2H, hidden_norm), model.norm; LlamaForCausalLMEagle3 adds
    lm_head (draft_vocab_size rows). load_weights: "d2t" -> hot_token_id = d2t + arange, "t2d" skipped, q/k/v and
    gate/up stacked, param_name = name if name in params_dict else f"model.{name}", and a name matching no
    parameter is skipped *silently*. -> (parameters loaded, names skipped)."""
    params = {"model.embed_tokens.weight", "model.fc.weight", "model.norm.weight", "lm_head.weight",
              *(stacked(f"model.midlayer.{n}") for n in LAYER)}
    loaded, skipped = set(), []
    for name in names:
        if "d2t" in name or "t2d" in name:
            continue
        name = stacked(name)
        param = name if name in params else f"model.{name}"
        (loaded.add(param) if param in params else skipped.append(name))
    return loaded, skipped


def vllm_loads(names: list[str]) -> set[str]:
    """vllm-project/vllm vllm/model_executor/models/llama_eagle3.py: Eagle3LlamaForCausalLM.load_weights skips
    "t2d", renames "d2t" to draft_id_to_target_id, prefixes "model." to every name without "lm_head", and skips
    embed_tokens when the checkpoint has none (shared with the target); LlamaModel.load_weights renames
    "midlayer." to "layers.0.", stacks q/k/v and gate/up and looks each name up in params_dict (a KeyError for a
    name it lacks). -> the parameters loaded."""
    params = {"model.embed_tokens.weight", "model.fc.weight", "model.norm.weight", "lm_head.weight",
              "draft_id_to_target_id", *(stacked(f"model.layers.0.{n}") for n in LAYER)}
    loaded = set()
    for name in names:
        if "t2d" in name:
            continue
        if "d2t" in name:
            name = name.replace("d2t", "draft_id_to_target_id")
        elif "lm_head" not in name:
            name = "model." + name.replace("midlayer.", "layers.0.")
        name = stacked(name)
        if name not in params:
            raise KeyError(name)
        loaded.add(name)
    return loaded


def llama_cpp_tensors(names: list[str]) -> set[str]:
    """ggml-org/llama.cpp conversion/llama.py: LlamaModel.index_tensors renames midlayer.* and layers.0.* to
    model.layers.0.*; modify_tensors keeps fc.weight, d2t (written as absolute ids), drops t2d, maps
    *.hidden_norm.weight to ATTN_NORM_2 and the rest through the llama tensor map (gguf-py tensor_mapping.py:
    "norm" -> OUTPUT_NORM, "lm_head" -> OUTPUT). -> the GGUF tensors src/models/eagle3.cpp load_arch_tensors
    reads (fc, output_norm, output, d2t, blk.0.{attn_norm, attn_norm_2, attn_q/k/v/output, ffn_norm/gate/up/down})."""
    llama_map = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                 "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                 "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
                 "hidden_norm": "attn_norm_2"}
    out = set()
    for name in names:
        if name.startswith("midlayer."):
            name = "model.layers.0." + name[len("midlayer."):]
        elif name.startswith("layers.0."):
            name = "model." + name
        if name == "t2d":
            continue
        if name in ("fc.weight", "d2t"):
            out.add(name.removesuffix(".weight"))
        elif name == "norm.weight":
            out.add("output_norm")
        elif name == "lm_head.weight":
            out.add("output")
        else:
            assert name.startswith("model.layers.0.") and name.endswith(".weight"), name
            out.add("blk.0." + llama_map[name[len("model.layers.0."):-len(".weight")]])
    return out


LLAMA_CPP_EAGLE3 = {"fc", "output_norm", "output", "d2t", "blk.0.attn_norm", "blk.0.attn_norm_2", "blk.0.attn_q",
                    "blk.0.attn_k", "blk.0.attn_v", "blk.0.attn_output", "blk.0.ffn_norm", "blk.0.ffn_gate",
                    "blk.0.ffn_up", "blk.0.ffn_down"}
# SafeAILab/EAGLE eagle/model/cnets.py Model (use_eagle3=True): embed_tokens (from the base model when config.json
# has no target_hidden_size), lm_head, midlayer (LlamaDecoderLayeremb: hidden_norm, input_layernorm, self_attn over
# 2H, post_attention_layernorm, mlp), fc (3H -> H, no bias), norm, buffers d2t and t2d; ea_model.py loads the
# weights with load_state_dict(strict=False): a missing one silently stays random.
EAGLE_REPO = {"lm_head.weight", "fc.weight", "norm.weight", "d2t", "t2d", *(f"midlayer.{n}" for n in LAYER)}


# ---- fixtures -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def target():
    return tiny_target(layers=8)


def eagle3_drafter(target, **overrides) -> Drafter:
    """A tiny eagle3 drafter with a draft vocabulary of 20 scattered, unsorted target ids (non-zero offsets)."""
    drafter = tiny_drafter(target, kind="eagle3", draft_vocab_size=20, **overrides)
    drafter.d2t.copy_(torch.randperm(target.vocab_size, generator=torch.Generator().manual_seed(3))[:20])
    return drafter


@pytest.fixture(scope="module")
def drafter(target):
    return eagle3_drafter(target)


def draft_logits(drafter: Drafter, blocks: list[int] | None = None, seed: int = 0) -> torch.Tensor:
    """Draft logits on random target features (aux blocks in the order ``blocks``) and, one level deeper, on the
    drafter's own output hidden states, mapped to target ids: [2, 2, 5, V]."""
    gen = torch.Generator().manual_seed(seed)
    h, n = drafter.config.hidden_size, len(drafter.config.aux_layers)
    dev, dtype = drafter.fc.weight.device, drafter.fc.weight.dtype
    feats = torch.randn(2, 5, (1 + n) * h, generator=gen)
    if blocks is not None:
        chunks = feats.split(h, dim=-1)
        feats = torch.cat([chunks[0]] + [chunks[1 + k] for k in blocks], dim=-1)
    embeds = torch.randn(2, 5, h, generator=gen)
    positions = torch.arange(3, 8).expand(2, 5)
    out, features = [], feats.to(dev, dtype)
    with torch.no_grad():
        for _ in range(2):  # target features, then the drafter's own output hidden states
            features = drafter(features, embeds.to(dev, dtype), positions.to(dev))
            logits = torch.full((2, 5, drafter.config.vocab_size), float("-inf"))
            logits[..., drafter.d2t.cpu()] = drafter.draft_logits(features, None).float().cpu()
            out.append(logits)
    return torch.stack(out)


def assert_same_drafter(a: Drafter, b: Drafter) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    assert all(sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]) for k in sa)
    assert a.config == b.config
    assert torch.equal(draft_logits(a), draft_logits(b))


# ---- exports against the consumers' loaders ---------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS)
def test_export_keys_shapes_and_config(drafter, target, tmp_path, fmt):
    out = export_drafter(drafter, tmp_path / fmt, fmt)
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    weights, cfg = load_file(str(out / "model.safetensors")), json.loads((out / "config.json").read_text())
    names = sorted(weights)
    h, c = target.hidden_size, drafter.config
    layer = "layers.0." if fmt == "vllm" else "midlayer."
    assert not any("embed_tokens" in k for k in names)  # every consumer takes the target's embedding
    # the loaders
    if fmt == "eagle":
        assert set(names) == EAGLE_REPO
    if fmt in ("eagle3", "sglang"):
        assert sglang_loads(names) == ({"model.fc.weight", "model.norm.weight", "lm_head.weight",
                                        *(stacked(f"model.midlayer.{n}") for n in LAYER)}, [])  # all but embed_tokens
    if fmt == "vllm":  # SGLang would skip every layers.0.* name without a word: that is why vllm is its own format
        assert sorted(sglang_loads(names)[1]) == sorted(stacked(layer + n) for n in LAYER)
    assert vllm_loads(names) == {"model.fc.weight", "model.norm.weight", "lm_head.weight", "draft_id_to_target_id",
                                 *(stacked(f"model.layers.0.{n}") for n in LAYER)}
    assert llama_cpp_tensors(names) == LLAMA_CPP_EAGLE3
    # shapes and the vocabulary maps
    assert tuple(weights["fc.weight"].shape) == (h, 3 * h)
    assert tuple(weights[layer + "self_attn.q_proj.weight"].shape) == (c.num_attention_heads * c.head_dim, 2 * h)
    assert tuple(weights[layer + "self_attn.k_proj.weight"].shape) == (c.num_key_value_heads * c.head_dim, 2 * h)
    assert tuple(weights["lm_head.weight"].shape) == (20, h)
    d2t, t2d = weights["d2t"], weights["t2d"]
    assert d2t.dtype == torch.int64 and tuple(d2t.shape) == (20,) and t2d.dtype == torch.bool
    assert torch.equal(torch.arange(20) + d2t, drafter.d2t.cpu())  # offsets: target = draft + d2t[draft]
    assert d2t.abs().sum() > 0
    assert tuple(t2d.shape) == (target.vocab_size,) and torch.equal(t2d.nonzero().flatten(), drafter.d2t.sort().values)
    # the config fields they read
    assert cfg["architectures"] == (["Eagle3LlamaForCausalLM"] if fmt == "vllm" else ["LlamaForCausalLMEagle3"])
    assert cfg["num_hidden_layers"] == 1 and cfg["draft_vocab_size"] == 20 and cfg["vocab_size"] == target.vocab_size
    assert (cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]) == (h, c.intermediate_size, c.head_dim)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (c.num_attention_heads, c.num_key_value_heads)
    assert (cfg["rms_norm_eps"], cfg["rope_theta"], cfg["max_position_embeddings"]) == (
        c.rms_norm_eps, c.rope_theta, c.max_position_embeddings)
    assert cfg["tie_word_embeddings"] is False and cfg["hidden_act"] == "silu" and not cfg.get("bias", False)
    # vLLM llama_eagle3.py LlamaDecoderLayer: norm_before_residual (getattr, False); llama.cpp conversion/llama.py
    # reads it too (default False) and norm_before_fc (default False)
    assert cfg["norm_before_residual"] is False and not cfg.get("norm_before_fc", False)
    if fmt == "eagle":  # cnets.py Model loads the base model's embedding only without target_hidden_size
        assert "target_hidden_size" not in cfg
    else:
        assert cfg["target_hidden_size"] == h
    # vllm/transformers_utils/configs/eagle.py keeps an architecture that starts or ends with "Eagle3"; both names
    # are in vLLM's registry (_SPECULATIVE_DECODING_MODELS) as llama_eagle3.Eagle3LlamaForCausalLM
    assert cfg["architectures"][0].startswith("Eagle3") or cfg["architectures"][0].endswith("Eagle3")
    # llama.cpp conversion/llama.py detects EAGLE-3 by draft_vocab_size and one layer
    assert "draft_vocab_size" in cfg and cfg["num_hidden_layers"] == 1
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in c.aux_layers] == [2, 4, 5]
    if fmt != "vllm":
        assert cfg["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [1, 3, 4], "use_aux_hidden_state": True}
    assert cfg[TARGET_KEY]["tokenizer_fingerprint"] == target.tokenizer_fingerprint
    assert detect_format(cfg) == EAGLE3_LAYOUT
    readme = (out / "README.md").read_text()
    want = {"eagle": ["use_eagle3=True"], "vllm": ['"method": "eagle3"', "--spec-type draft-eagle3"],
            "eagle3": ["--speculative-algorithm EAGLE3", '"method": "eagle3"', "convert_hf_to_gguf.py",
                       "--spec-type draft-eagle3"]}
    assert all(w in readme for w in want.get(fmt, want["eagle3"])) and str(out.resolve()) in readme


@pytest.mark.parametrize("fmt", ["eagle3", "vllm", "eagle"])
def test_layer_ids_name_the_hidden_states_we_fuse(drafter, target, tmp_path, fmt):
    """Brute force: the residual stream entering each target layer (a forward pre-hook on the Hugging Face layers);
    each consumer's capture rule applied to the exported config must pick exactly the aux features our runtime
    gives the drafter (Target.forward with aux_layers, the lean decoder)."""
    cfg = json.loads((export_drafter(drafter, tmp_path / fmt, fmt) / "config.json").read_text())
    ids = torch.tensor([[5, 17, 2, 9, 30, 11, 4]], device=target.device)
    entering: dict[int, torch.Tensor] = {}
    hooks = [layer.register_forward_pre_hook(
        lambda m, args, kwargs, k=k: entering.__setitem__(k, (args[0] if args else kwargs["hidden_states"]).clone()),
        with_kwargs=True) for k, layer in enumerate(target.model.model.layers)]
    try:
        with torch.no_grad():
            target.model.model(input_ids=ids)
    finally:
        for hook in hooks:
            hook.remove()
    positions = torch.arange(ids.shape[1], device=target.device)[None]
    aux = target.forward(ids, positions, target.new_cache(), aux_layers=drafter.config.aux_layers).aux
    ours = aux.split(target.hidden_size, dim=-1)
    num_layers = len(target.model.model.layers)
    captures = {  # layer inputs each consumer concatenates, in its order
        # vLLM llama.py LlamaModel.forward: aux_hidden_states.append(hidden_states + residual) before layer idx,
        # idx in the top-level ids as they are (gpu_model_runner._get_eagle3_aux_layers_from_config)
        "vllm": sorted(cfg["eagle_aux_hidden_state_layer_ids"]),
        # llama.cpp common/speculative.cpp: llama_set_embeddings_layer_inp(ctx_tgt, target_layer_ids[k]), in list order
        "llama.cpp": cfg["eagle_aux_hidden_state_layer_ids"],
    }
    if "eagle_config" in cfg:
        # SGLang model_runner reads eagle_config["eagle_aux_hidden_state_layer_ids"]; llama.py
        # set_eagle3_layers_to_capture: layers_to_capture = [val + 1 for val in layer_ids]; LlamaModel.forward
        # appends hidden_states + residual before layer i in layers_to_capture
        captures["sglang"] = sorted(i + 1 for i in cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
    if fmt == "eagle":  # EAGLE repo modeling_llama_kv.py: idx == L-3 or idx == L//2 or idx == 2, before layer idx
        captures["eagle"] = [i for i in range(num_layers) if i in (num_layers - 3, num_layers // 2, 2)]
    for consumer, layers in captures.items():
        assert len(layers) == len(ours), consumer
        for k, layer in enumerate(layers):
            torch.testing.assert_close(entering[layer], ours[k], rtol=1e-4, atol=1e-4, msg=consumer)  # off by one: ~20


# ---- round trips -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS)
def test_round_trip_same_weights_and_drafts(drafter, target, tmp_path, fmt):
    out = export_drafter(drafter, tmp_path / fmt, fmt)
    back = Drafter.from_pretrained(out, target=target)
    assert_same_drafter(drafter, back)
    assert Drafter.from_pretrained(out).config == drafter.config  # the ids and target block need no target
    again = export_drafter(back, tmp_path / f"{fmt}-again", fmt)
    assert (again / "config.json").read_text() == (out / "config.json").read_text()
    w1, w2 = load_file(str(out / "model.safetensors")), load_file(str(again / "model.safetensors"))
    assert sorted(w1) == sorted(w2) and all(torch.equal(w1[k], w2[k]) for k in w1)


def test_round_trip_same_tree_decoding(drafter, target, tmp_path):
    back = Drafter.from_pretrained(export_drafter(drafter, tmp_path / "e", "eagle3"), target=target)
    prompt, tree = [3, 14, 15, 9, 26, 5], TreeConfig(total_tokens=12, depth=3, top_k=4, lookup_tokens=0)  # no timing
    a = EagleModel(target, drafter, tree=tree).generate(prompt, method="eagle-tree", max_new_tokens=16)
    b = EagleModel(target, back, tree=tree).generate(prompt, method="eagle-tree", max_new_tokens=16)
    assert a.token_ids == b.token_ids and a.accept_lengths == b.accept_lengths and len(a.token_ids) == 16


def test_unsorted_aux_layers_are_written_in_layer_order(target, tmp_path):
    """Every consumer concatenates the captured layers in ascending order: fc's column blocks are reordered."""
    drafter = eagle3_drafter(target, aux_layers=[4, 1, 3])
    out = export_drafter(drafter, tmp_path / "x", "sglang")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    back = Drafter.from_pretrained(out, target=target)
    assert back.config.aux_layers == [1, 3, 4]
    # our drafter reads aux blocks in its own order (4, 1, 3); the import reads them as 1, 3, 4
    torch.testing.assert_close(draft_logits(drafter, blocks=[2, 0, 1]), draft_logits(back), rtol=1e-3, atol=1e-3)


# ---- hand-written release checkpoints ----------------------------------------------------------------------
def specforge_release(directory: Path, drafter: Drafter, target, pickle: bool = False, **config) -> Path:
    """A folder as SpecForge saves it (LlamaForCausalLMEagle3; its own embed_tokens, the target's; no target block;
    only eagle_config ids), from an sglang export."""
    export_drafter(drafter, directory / "src", "sglang")
    cfg = json.loads((directory / "src" / "config.json").read_text())
    for key in (TARGET_KEY, "eagle_aux_hidden_state_layer_ids", "norm_before_residual"):
        cfg.pop(key)
    cfg.update(config)
    cfg = {k: v for k, v in cfg.items() if v is not None}
    state = load_file(str(directory / "src" / "model.safetensors"))
    state["embed_tokens.weight"] = target.model.get_input_embeddings().weight.detach().cpu().clone()
    directory.mkdir(exist_ok=True)
    (directory / "config.json").write_text(json.dumps(cfg))
    if pickle:
        torch.save(state, directory / "pytorch_model.bin")
    else:
        save_file(state, str(directory / "model.safetensors"))
    return directory


def speculators_release(directory: Path, drafter: Drafter, **config) -> Path:
    """A vLLM speculators-style folder (Eagle3Speculator, transformer_layer_config, top-level ids in vLLM's
    convention, model.layers.0.* names), from a vllm export."""
    export_drafter(drafter, directory / "src", "vllm")
    flat = json.loads((directory / "src" / "config.json").read_text())
    layer_keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                  "num_hidden_layers", "hidden_act", "rms_norm_eps", "rope_theta", "max_position_embeddings",
                  "vocab_size", "model_type")
    cfg = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
           "transformer_layer_config": {k: flat[k] for k in layer_keys}, "draft_vocab_size": flat["draft_vocab_size"],
           "target_hidden_size": flat["target_hidden_size"], "norm_before_residual": False,
           "eagle_aux_hidden_state_layer_ids": flat["eagle_aux_hidden_state_layer_ids"], **config}
    cfg = {k: v for k, v in cfg.items() if v is not None}
    state = {("model." + k if k.startswith("layers.") else k): v
             for k, v in load_file(str(directory / "src" / "model.safetensors")).items()}
    (directory / "config.json").write_text(json.dumps(cfg))
    save_file(state, str(directory / "model.safetensors"))
    return directory


def same_model(a: Drafter, b: Drafter) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert b.config.aux_layers == a.config.aux_layers and b.config.draft_vocab_size == 20
    assert torch.equal(draft_logits(a), draft_logits(b))


def test_specforge_release_imports(drafter, target, tmp_path):
    d = specforge_release(tmp_path / "sf", drafter, target, pickle=True)
    with pytest.raises(EagleError, match="allow_pickle"):
        Drafter.from_pretrained(d, target=target)
    back = Drafter.from_pretrained(d, target=target, allow_pickle=True)
    same_model(drafter, back)
    assert back.config.target.tokenizer_fingerprint == "" and back.config.target.hidden_size == target.hidden_size


def test_speculators_release_imports(drafter, target, tmp_path):
    back = Drafter.from_pretrained(speculators_release(tmp_path / "sp", drafter), target=target)
    same_model(drafter, back)


def test_release_without_layer_ids_takes_the_consumers_default(drafter, target, tmp_path):
    d = specforge_release(tmp_path / "sf", drafter, target, eagle_config=None)
    with pytest.raises(EagleError, match="names no eagle_aux_hidden_state_layer_ids"):
        Drafter.from_pretrained(d)
    back = Drafter.from_pretrained(d, target=target)  # 8 layers: outputs of 1, 3, 4 = vLLM's 2, 4, 5
    assert back.config.aux_layers == [1, 3, 4]
    same_model(drafter, back)


def test_layer_id_conventions():
    assert eagle3_aux_layers({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 15, 26]}}, None) == [1, 15, 26]
    assert eagle3_aux_layers({"eagle_aux_hidden_state_layer_ids": [2, 16, 27]}, None) == [1, 15, 26]
    assert eagle3_aux_layers({"eagle_aux_hidden_state_layer_ids": [2, 16, 27],
                              "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 15, 26]}}, None) == [1, 15, 26]
    assert eagle3_aux_layers({}, 30) == [1, 14, 26]  # SGLang/vLLM/llama.cpp default 2, L/2, L-3 for L = 30


# ---- broken checkpoints ----------------------------------------------------------------------------------
def edit_config(directory: Path, **changes) -> None:
    cfg = json.loads((directory / "config.json").read_text())
    cfg.update(changes)
    (directory / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if v is not None}))


def edit_weights(directory: Path, fn) -> None:
    state = load_file(str(directory / "model.safetensors"))
    fn(state)
    save_file(state, str(directory / "model.safetensors"))


BROKEN = {
    "missing lm_head": (lambda d: edit_weights(d, lambda s: s.pop("lm_head.weight")), "missing.*lm_head"),
    "stray tensor": (lambda d: edit_weights(d, lambda s: s.__setitem__("fc_norm.weight", torch.ones(3))),
                     "unexpected.*fc_norm"),
    "ids disagree": (lambda d: edit_config(d, eagle_aux_hidden_state_layer_ids=[1, 3, 4]), "two different layer sets"),
    "embedding id": (lambda d: edit_config(d, eagle_aux_hidden_state_layer_ids=[0, 3, 4], eagle_config=None),
                     "embedding"),
    "norm_before_residual": (lambda d: edit_config(d, norm_before_residual=True), "norm_before_residual"),
    "fc_norm": (lambda d: edit_config(d, fc_norm=True), "fc_norm"),
    "two layers": (lambda d: edit_config(d, num_hidden_layers=2), "only one is supported"),
    "narrower drafter": (lambda d: edit_config(d, target_hidden_size=64), "as wide as its target"),
    "tied head": (lambda d: edit_config(d, tie_word_embeddings=True), "tie_word_embeddings"),
    "d2t out of range": (lambda d: edit_weights(d, lambda s: s["d2t"].__setitem__(0, 500)), "d2t"),
    "d2t duplicate": (lambda d: edit_weights(d, lambda s: s["d2t"].__setitem__(1, s["d2t"][0] - 1)), "twice"),
    "t2d wrong": (lambda d: edit_weights(d, lambda s: s["t2d"].__setitem__(slice(None), True)), "t2d"),
    "fc bias": (lambda d: edit_weights(d, lambda s: s.__setitem__("fc.bias", torch.ones(32))), "fc.bias"),
    "fc shape": (lambda d: edit_weights(d, lambda s: s.__setitem__("fc.weight", torch.zeros(32, 64))), "fc.weight"),
    "mixed names": (lambda d: edit_weights(d, lambda s: s.__setitem__("layers.0.hidden_norm.weight", torch.ones(32))),
                    "mix"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_broken_checkpoints_are_refused(drafter, target, tmp_path, case):
    out = export_drafter(drafter, tmp_path / "x", "eagle3")
    Drafter.from_pretrained(out, target=target)  # fine before the damage
    damage, message = BROKEN[case]
    damage(out)
    with pytest.raises(EagleError, match=message):
        Drafter.from_pretrained(out, target=target)


def test_speculators_default_norm_before_residual_is_refused(drafter, tmp_path):
    # vLLM speculators/algos.py update_eagle3: config_dict.get("norm_before_residual", True)
    with pytest.raises(EagleError, match="norm_before_residual"):
        Drafter.from_pretrained(speculators_release(tmp_path / "sp", drafter, norm_before_residual=None))


def test_foreign_embedding_is_refused(drafter, target, tmp_path):
    d = specforge_release(tmp_path / "sf", drafter, target)
    edit_weights(d, lambda s: s["embed_tokens.weight"].mul_(2.0))
    Drafter.from_pretrained(d)  # without the target nothing to compare with
    with pytest.raises(EagleError, match="own token embedding"):
        Drafter.from_pretrained(d, target=target)


# ---- export refusals and the command line ---------------------------------------------------------------------
def test_export_refusals(target, tmp_path):
    with pytest.raises(EagleError, match="EAGLE-1/2 drafter"):
        export_drafter(tiny_drafter(target), tmp_path / "a", "eagle3")
    with pytest.raises(EagleError, match="exactly 3"):
        export_drafter(eagle3_drafter(target, aux_layers=[1, 4]), tmp_path / "b", "vllm")
    with pytest.raises(EagleError, match="EAGLE repo"):  # the repo always reads 1, L//2-1, L-4
        export_drafter(eagle3_drafter(target, aux_layers=[0, 3, 5]), tmp_path / "c", "eagle")
    with pytest.raises(EagleError, match="EAGLE repo"):  # [1, 3, 4] is the default of 8 layers, not of 10
        export_drafter(eagle3_drafter(target), tmp_path / "d", "eagle", target_layers=10)
    duplicate = eagle3_drafter(target)
    duplicate.d2t[1] = duplicate.d2t[0]
    with pytest.raises(EagleError, match="two draft tokens"):
        export_drafter(duplicate, tmp_path / "e", "sglang")
    assert not any((tmp_path / n).exists() for n in "abcde")


def test_cli_exports_eagle3(drafter, target, tmp_path, capsys):
    target.model.save_pretrained(tmp_path / "t")
    target.tokenizer.save_pretrained(tmp_path / "t")
    drafter.save_pretrained(tmp_path / "d")
    args = ["--drafter", str(tmp_path / "d"), "--target", str(tmp_path / "t")]
    assert export_main(args + ["--format", "eagle3", "--out", str(tmp_path / "o")]) == 0
    assert_same_drafter(drafter, Drafter.from_pretrained(tmp_path / "o").to(target.device))
    assert export_main(args + ["--format", "eagle", "--out", str(tmp_path / "r")]) == 0
    tiny_drafter(target).save_pretrained(tmp_path / "e1")
    capsys.readouterr()
    assert export_main(["--drafter", str(tmp_path / "e1"), "--format", "eagle3", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("eagle-export: error: ") and "EAGLE-1/2 drafter" in err and err.count("\n") == 1
