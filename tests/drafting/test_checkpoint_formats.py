"""EAGLE-1 layout import/export (eagle.drafting.checkpoint_formats, eagle-export): lossless round trips, the key names
and config fields each consumer's loader expects, pickle safety, and target mismatches."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle.drafting.drafter import FORMAT, Drafter
from eagle.errors import EagleError
from eagle.drafting.checkpoint_formats import EAGLE3_LAYOUT, EAGLE_LAYOUT, TARGET_KEY, detect_format, export_drafter
from infer.export import main as export_main
from tests.conftest import tiny_drafter, tiny_target

# ---- what each consumer's own code says (names copied from the files, at the commits given) ---------------
# SafeAILab/EAGLE  eagle/model/cnets1.py @ cb7e084 (the EAGLE-1/2 ``Model``) and eagle/model/ea_model.py:
#   Model: embed_tokens (loaded from the base model), layers = [LlamaDecoderLayer(config, index) for index in
#   range(config.num_hidden_layers)], fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=bias).
#   LlamaDecoderLayer: self_attn (LlamaAttention: q_proj, k_proj, v_proj -- with a bias when the config has a true
#   qkv_bias -- and o_proj), mlp (LlamaMLP: gate_proj, up_proj, down_proj), input_layernorm only if index != 0,
#   post_attention_layernorm. LlamaAttention's head size is hidden_size // num_attention_heads (no head_dim);
#   rope_scaling is None or {"type", "factor"}. ea_model.py: bias = config.json "bias", True when absent; the
#   weights go in with load_state_dict(strict=False) (a missing one silently stays random).
#   The config fields cnets1.py reads: hidden_act, hidden_size, intermediate_size, max_position_embeddings,
#   num_attention_heads, num_hidden_layers, num_key_value_heads, pad_token_id, pretraining_tp, qkv_bias (if present),
#   rms_norm_eps, rope_scaling, rope_theta, vocab_size (pad_token_id and pretraining_tp have LlamaConfig defaults).
# vllm-project/vllm  vllm/model_executor/models/llama_eagle.py @ 00da923:
#   LlamaModel: embed_tokens, layers (LlamaDecoderLayer; layer i == 0 gets nn.Identity() for input_layernorm),
#   fc = torch.nn.Linear(hidden_size * 2, hidden_size, bias=False). LlamaModel.load_weights stacks ".q_proj",
#   ".k_proj", ".v_proj" into ".qkv_proj" and ".gate_proj", ".up_proj" into ".gate_up_proj", skips "embed_tokens."
#   (shared with the target) and skips silently a name the model does not have; EagleLlamaForCausalLM.load_weights
#   prefixes "model." to every name without "lm_head". Config read there: vocab_size, hidden_size,
#   num_hidden_layers, add_para_norm (getattr, default False), rms_norm_eps, logit_scale (getattr, default 1.0).
# sgl-project/sglang  python/sglang/srt/models/llama_eagle.py @ 034b3be:
#   LlamaModel: embed_tokens, layers (LlamaDecoderLayer(config, i); layer_id 0 has its input_layernorm deleted),
#   fc = torch.nn.Linear(config.hidden_size * 2, config.hidden_size) (nn.Linear's default: with a bias).
#   LlamaForCausalLMEagle.load_weights drops names with "lm_head" and prefixes "model." to the others;
#   EntryClass = [LlamaForCausalLMEagle]. Config read there: vocab_size, hidden_size, num_hidden_layers,
#   tie_word_embeddings, hot_vocab_size (getattr, default vocab_size).
ATTENTION = ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight"]
MLP = ["mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"]


def eagle_layer(i: int) -> list[str]:
    """A cnets1.py LlamaDecoderLayer's parameters (input_layernorm only past layer 0)."""
    return [f"layers.{i}.{n}" for n in ATTENTION + MLP + ["post_attention_layernorm.weight"]
            + (["input_layernorm.weight"] if i else [])]


def consumer_parameters(fmt: str, cfg: dict) -> set[str]:
    """The parameters the consumer's model builds from ``cfg`` (its names, after its loader's prefix),
    less the embedding, which all three take from the target."""
    layers = [k for i in range(cfg["num_hidden_layers"]) for k in eagle_layer(i)]
    if fmt == "eagle":
        return {"fc.weight", *(["fc.bias"] if cfg.get("bias", True) else []), *layers}
    if fmt == "vllm":
        stacked = {n.replace(".q_proj", ".qkv_proj").replace(".k_proj", ".qkv_proj").replace(".v_proj", ".qkv_proj")
                   .replace(".gate_proj", ".gate_up_proj").replace(".up_proj", ".gate_up_proj") for n in layers}
        return {"model.fc.weight", *(f"model.{n}" for n in stacked)}
    return {"model.fc.weight", "model.fc.bias", *(f"model.{n}" for n in layers)}


def consumer_loads(fmt: str, names: list[str]) -> dict[str, int]:
    """What the consumer's loader does with checkpoint ``names``: parameter name -> how many checkpoint
    tensors went into it (vLLM stacks q/k/v and gate/up); the embedding and lm_head are dropped as each
    loader drops them."""
    loaded: dict[str, int] = {}
    for name in names:
        if fmt in ("vllm", "sglang"):
            if "lm_head" in name:
                continue
            name = "model." + name
        if fmt == "vllm":
            if "embed_tokens." in name:
                continue
            for shard, stacked in ((".q_proj", ".qkv_proj"), (".k_proj", ".qkv_proj"), (".v_proj", ".qkv_proj"),
                                   (".gate_proj", ".gate_up_proj"), (".up_proj", ".gate_up_proj")):
                if shard in name:
                    name = name.replace(shard, stacked)
                    break
        loaded[name] = loaded.get(name, 0) + 1
    return loaded


@pytest.fixture(scope="module")
def target():
    return tiny_target()


def forward(drafter: Drafter, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    h = drafter.config.hidden_size
    dev, dtype = drafter.fc.weight.device, drafter.fc.weight.dtype
    features, embeds = (torch.randn(2, 5, h, generator=gen).to(dev, dtype) for _ in range(2))
    positions = torch.arange(3, 8, device=dev).expand(2, 5)
    with torch.no_grad():
        return drafter(features, embeds, positions)


def assert_identical(a: Drafter, b: Drafter) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for key in sa:
        assert sa[key].dtype == sb[key].dtype and torch.equal(sa[key], sb[key]), key
    assert a.config == b.config
    assert torch.equal(forward(a), forward(b))


def write_release(directory: Path, drafter: Drafter, pickle: bool = True, embed: torch.Tensor | None = None,
                  **config) -> Path:
    """An EAGLE-1/2 release folder as the EAGLE authors publish it: a plain Llama config (no target
    block, "bias" only when given) and pytorch_model.bin with embed_tokens."""
    c = drafter.config
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": c.hidden_size,
           "intermediate_size": c.intermediate_size, "num_attention_heads": c.num_attention_heads,
           "num_key_value_heads": c.num_key_value_heads, "num_hidden_layers": c.num_layers,
           "rms_norm_eps": c.rms_norm_eps, "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta},
           "vocab_size": c.vocab_size, "max_position_embeddings": c.max_position_embeddings, "hidden_act": "silu",
           "torch_dtype": "float32", **config}
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(cfg))
    state = {k: v.clone() for k, v in drafter.state_dict().items()}
    state["embed_tokens.weight"] = embed if embed is not None else torch.randn(c.vocab_size, c.hidden_size)
    state["layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(c.head_dim // 2)  # old checkpoints carry it
    if pickle:
        torch.save(state, directory / "pytorch_model.bin")
    else:
        save_file(state, str(directory / "model.safetensors"))
    return directory


# ---- round trips against the specification ------------------------------------------------------
@pytest.mark.parametrize("fmt", ["eagle", "vllm", "sglang"])
@pytest.mark.parametrize("layers", [1, 2])
@pytest.mark.parametrize("bias", [False, True])
def test_export_import_round_trip(target, tmp_path, fmt, layers, bias):
    drafter = tiny_drafter(target, num_layers=layers, fc_bias=bias)
    if fmt == "vllm" and bias:  # vLLM's fc has no bias: the weight would be skipped silently
        with pytest.raises(EagleError, match="vLLM.*without a bias"):
            export_drafter(drafter, tmp_path / fmt, fmt)
        return
    out = export_drafter(drafter, tmp_path / fmt, fmt)
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    weights = load_file(str(out / "model.safetensors"))
    cfg = json.loads((out / "config.json").read_text())
    # every parameter the consumer builds from this config is loaded, from exactly the tensors its loader
    # stacks into it (3 for qkv_proj, 2 for gate_up_proj), and no tensor is skipped
    loaded = consumer_loads(fmt, list(weights))
    assert set(loaded) == consumer_parameters(fmt, cfg)
    assert all(n == (3 if ".qkv_proj" in k else 2 if ".gate_up_proj" in k else 1) for k, n in loaded.items())
    assert not any("embed_tokens" in k or "lm_head" in k for k in weights)  # the target's, in all three
    ours = drafter.state_dict()
    for key, tensor in weights.items():  # each is the drafter's tensor (sglang's zero fc.bias aside)
        assert torch.equal(tensor, ours[key]) if key in ours else (key, fmt) == ("fc.bias", "sglang")
    assert tuple(weights["fc.weight"].shape) == (cfg["hidden_size"], 2 * cfg["hidden_size"])
    if fmt == "sglang" and not bias:
        assert torch.count_nonzero(weights["fc.bias"]) == 0  # sglang's fc always has one: zeros add nothing
    # the config fields the consumer reads
    read = {"eagle": ["hidden_act", "hidden_size", "intermediate_size", "max_position_embeddings",
                      "num_attention_heads", "num_hidden_layers", "num_key_value_heads", "rms_norm_eps",
                      "rope_theta", "vocab_size"],
            "vllm": ["vocab_size", "hidden_size", "num_hidden_layers", "rms_norm_eps"],
            "sglang": ["vocab_size", "hidden_size", "num_hidden_layers", "tie_word_embeddings"]}[fmt]
    assert [f for f in read if f not in cfg] == []
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"], cfg["rms_norm_eps"]) == (
        layers, target.hidden_size, target.vocab_size, drafter.config.rms_norm_eps)
    if fmt == "eagle":
        assert cfg.get("bias", True) is bias  # absent would mean True
        assert not cfg.get("qkv_bias", False) and cfg.get("rope_scaling") is None
        assert cfg["hidden_size"] // cfg["num_attention_heads"] == drafter.config.head_dim
        assert cfg["rope_theta"] == drafter.config.rope_theta and cfg["hidden_act"] == "silu"
    if fmt == "vllm":
        assert not cfg.get("add_para_norm", False) and cfg.get("logit_scale", 1.0) == 1.0
    if fmt == "sglang":
        assert cfg["architectures"] == ["LlamaForCausalLMEagle"]  # its EntryClass
        assert cfg.get("hot_vocab_size", cfg["vocab_size"]) == cfg["vocab_size"]
    assert cfg["model_type"] == "llama" and cfg["torch_dtype"] == "float32" and "format" not in cfg
    assert detect_format(cfg) == EAGLE_LAYOUT
    from transformers import LlamaConfig  # the consumers parse it as a Llama config

    llama = LlamaConfig(**{k: v for k, v in cfg.items() if k != "architectures"})
    assert llama.head_dim * llama.num_attention_heads == cfg["num_attention_heads"] * cfg["head_dim"]
    assert "--speculative" in (out / "README.md").read_text() or "EaModel" in (out / "README.md").read_text()

    back = Drafter.from_pretrained(out, target=target)
    assert_identical(drafter, back)
    assert back.config.target == drafter.config.target  # the target block survives the trip
    again = export_drafter(back, tmp_path / f"{fmt}-again", fmt)  # and the files, too
    assert (again / "config.json").read_text() == (out / "config.json").read_text()
    w2 = load_file(str(again / "model.safetensors"))
    assert all(torch.equal(weights[k], w2[k]) for k in weights) and sorted(w2) == sorted(weights)


def test_bf16_round_trip_keeps_bits(target, tmp_path):
    drafter = tiny_drafter(target, num_layers=2).to(torch.bfloat16)
    out = export_drafter(drafter, tmp_path / "bf16", "sglang")
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert all(v.dtype == torch.bfloat16 for v in load_file(str(out / "model.safetensors")).values())
    back = Drafter.from_pretrained(out, dtype=torch.bfloat16).to(target.device)
    assert_identical(drafter, back)


def test_own_format_still_default(target, tmp_path):
    drafter = tiny_drafter(target, fc_bias=True)
    drafter.save_pretrained(tmp_path / "own")
    assert detect_format(json.loads((tmp_path / "own" / "config.json").read_text())) == FORMAT
    assert_identical(drafter, Drafter.from_pretrained(tmp_path / "own", target=target))


# ---- hand-written EAGLE release checkpoints --------------------------------------------------------
def test_release_pickle_needs_allow_pickle(target, tmp_path):
    drafter = tiny_drafter(target, fc_bias=True)
    d = write_release(tmp_path / "release", drafter)  # no "bias" key: the EAGLE repo's default is True
    with pytest.raises(EagleError, match="allow_pickle"):
        Drafter.from_pretrained(d, target=target)
    back = Drafter.from_pretrained(d, target=target, allow_pickle=True)
    assert back.config.fc_bias and back.config.target.tokenizer_fingerprint == ""
    assert (back.config.target.hidden_size, back.config.target.vocab_size) == (target.hidden_size, target.vocab_size)
    sa, sb = drafter.state_dict(), back.state_dict()
    assert list(sa) == list(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert torch.equal(forward(drafter), forward(back))


def test_release_safetensors_without_bias(target, tmp_path):
    drafter = tiny_drafter(target, num_layers=2)
    d = write_release(tmp_path / "release", drafter, pickle=False, bias=False, head_dim=None)
    back = Drafter.from_pretrained(d, target=target)
    assert not back.config.fc_bias and back.config.num_layers == 2
    assert torch.equal(forward(drafter), forward(back))


def test_release_inconsistent_bias_is_refused(target, tmp_path):
    d = write_release(tmp_path / "a", tiny_drafter(target), pickle=False, bias=True)  # no fc.bias in the weights
    with pytest.raises(EagleError, match="fc.bias"):
        Drafter.from_pretrained(d)
    d = write_release(tmp_path / "b", tiny_drafter(target, fc_bias=True), pickle=False, bias=False)
    with pytest.raises(EagleError, match="non-zero fc.bias"):
        Drafter.from_pretrained(d)


@pytest.mark.parametrize("other", [dict(hidden=64), dict(vocab_size=48)])
def test_release_for_another_target_is_refused(target, tmp_path, other):
    foreign = tiny_drafter(tiny_target(**other), fc_bias=True)
    d = write_release(tmp_path / "release", foreign, pickle=False)
    Drafter.from_pretrained(d)  # fine on its own
    with pytest.raises(EagleError, match="hidden .*vocab"):
        Drafter.from_pretrained(d, target=target)


def test_release_embedding_shape_is_checked(target, tmp_path):
    drafter = tiny_drafter(target, fc_bias=True)
    d = write_release(tmp_path / "release", drafter, pickle=False, embed=torch.zeros(40, target.hidden_size))
    with pytest.raises(EagleError, match="embed_tokens"):
        Drafter.from_pretrained(d, target=target)


def test_exported_folder_for_another_target_is_refused(target, tmp_path):
    out = export_drafter(tiny_drafter(tiny_target(hidden=64)), tmp_path / "x", "vllm")
    with pytest.raises(EagleError, match="hidden 64"):
        Drafter.from_pretrained(out, target=target)


def test_unsupported_configs(tmp_path):
    assert detect_format({"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 8}) == EAGLE3_LAYOUT
    assert detect_format({"architectures": ["LlamaForCausalLM"], "eagle_config": {}}) == EAGLE3_LAYOUT
    with pytest.raises(EagleError, match="unknown drafter format"):
        detect_format({"format": "eagle-drafter/9"})
    with pytest.raises(EagleError, match="Qwen2"):
        detect_format({"architectures": ["Qwen2ForCausalLM"]})
    with pytest.raises(EagleError, match="neither"):
        detect_format({"hidden_size": 8})


# ---- refusals and the command line --------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["eagle", "vllm", "sglang"])
def test_reduced_vocabulary_refuses_export(target, tmp_path, fmt):
    drafter = tiny_drafter(target, draft_vocab_size=8)
    with pytest.raises(EagleError, match="reduced draft vocabulary"):
        export_drafter(drafter, tmp_path / "out", fmt)
    assert not (tmp_path / "out").exists()


def test_cli_writes_folder(target, tmp_path, capsys):
    drafter = tiny_drafter(target)
    drafter.save_pretrained(tmp_path / "d")
    assert export_main(["--drafter", str(tmp_path / "d"), "--format", "vllm", "--out", str(tmp_path / "v")]) == 0
    assert sorted(p.name for p in (tmp_path / "v").iterdir()) == ["README.md", "config.json", "model.safetensors"]
    readme = (tmp_path / "v" / "README.md").read_text()
    assert "--speculative-config" in readme and '"method": "eagle"' in readme and str(tmp_path / "v") in readme
    assert_identical(drafter, Drafter.from_pretrained(tmp_path / "v").to(target.device))
    capsys.readouterr()


def test_cli_errors_are_one_line(target, tmp_path, capsys):
    tiny_drafter(target, draft_vocab_size=8).save_pretrained(tmp_path / "r")
    assert export_main(["--drafter", str(tmp_path / "r"), "--format", "sglang", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("eagle-export: error: ") and "reduced draft vocabulary" in err and err.count("\n") == 1
    assert export_main(["--drafter", str(tmp_path / "r"), "--format", "onnx", "--out", str(tmp_path / "o")]) == 2
    assert "invalid choice" in capsys.readouterr().err
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "pytorch_model.bin").write_bytes(b"")
    tiny_drafter(target).save_pretrained(tmp_path / "d")
    assert export_main(["--drafter", str(tmp_path / "d"), "--format", "eagle", "--out", str(tmp_path / "busy")]) == 2
    assert "other files" in capsys.readouterr().err


def test_config_dataclass_round_trip_is_exact(target, tmp_path):
    drafter = tiny_drafter(target, num_layers=2, fc_bias=True, rope_theta=12345.0, rms_norm_eps=1e-5)
    out = export_drafter(drafter, tmp_path / "e", "eagle")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg[TARGET_KEY] == dataclasses.asdict(drafter.config.target)
    assert Drafter.from_pretrained(out).config == drafter.config


def test_cli_checks_target(target, tmp_path, capsys):
    target.model.save_pretrained(tmp_path / "t")
    target.tokenizer.save_pretrained(tmp_path / "t")
    tiny_drafter(target).save_pretrained(tmp_path / "d")
    args = ["--drafter", str(tmp_path / "d"), "--format", "sglang", "--target", str(tmp_path / "t")]
    assert export_main(args + ["--out", str(tmp_path / "s")]) == 0
    assert str(tmp_path / "t") in (tmp_path / "s" / "README.md").read_text()
    tiny_drafter(tiny_target(vocab_size=48)).save_pretrained(tmp_path / "foreign")
    args[1] = str(tmp_path / "foreign")
    assert export_main(args + ["--out", str(tmp_path / "f")]) == 2
    assert "vocab 48" in capsys.readouterr().err and not (tmp_path / "f").exists()
