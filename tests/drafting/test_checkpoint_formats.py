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
from eagle.drafting.checkpoint_formats import EAGLE_LAYOUT, TARGET_KEY, detect_format, export_drafter
from infer.export import main as export_main
from tests.conftest import tiny_drafter, tiny_target

# ---- the written specification -------------------------------------------------------------------
# Weight names, read from the loaders (all three take the embedding and LM head from the target):
#  * EAGLE repo  eagle/model/cnets1.py (EAGLE-1/2 Model): fc (bias per config "bias"), layers.N.self_attn.*,
#    layers.N.mlp.*, layers.N.post_attention_layernorm, input_layernorm only for N > 0; embed_tokens is
#    loaded from the base model (load_emb=True) and ea_model.py loads the rest with strict=False.
#  * vLLM  vllm/model_executor/models/llama_eagle.py: same names without "model." (its loader prepends it);
#    fc = Linear(2H, H, bias=False), so a drafter with an fc bias is refused; embed_tokens shared.
#  * SGLang  python/sglang/srt/models/llama_eagle.py: same names without "model." (its loader prepends it,
#    lm_head keys are ignored); fc = Linear(2H, H) always with a bias, so a bias-free drafter gets zeros.
LAYER0 = ["layers.0.self_attn.q_proj.weight", "layers.0.self_attn.k_proj.weight", "layers.0.self_attn.v_proj.weight",
          "layers.0.self_attn.o_proj.weight", "layers.0.mlp.gate_proj.weight", "layers.0.mlp.up_proj.weight",
          "layers.0.mlp.down_proj.weight", "layers.0.post_attention_layernorm.weight"]
LAYER1 = ["layers.1.input_layernorm.weight", "layers.1.self_attn.q_proj.weight", "layers.1.self_attn.k_proj.weight",
          "layers.1.self_attn.v_proj.weight", "layers.1.self_attn.o_proj.weight", "layers.1.mlp.gate_proj.weight",
          "layers.1.mlp.up_proj.weight", "layers.1.mlp.down_proj.weight", "layers.1.post_attention_layernorm.weight"]
EXPECTED_KEYS = {  # (format, num_layers, fc_bias) -> keys in model.safetensors; None = export refused
    ("eagle", 1, False): ["fc.weight"] + LAYER0,
    ("eagle", 1, True): ["fc.weight", "fc.bias"] + LAYER0,
    ("eagle", 2, False): ["fc.weight"] + LAYER0 + LAYER1,
    ("eagle", 2, True): ["fc.weight", "fc.bias"] + LAYER0 + LAYER1,
    ("vllm", 1, False): ["fc.weight"] + LAYER0,
    ("vllm", 1, True): None,
    ("vllm", 2, False): ["fc.weight"] + LAYER0 + LAYER1,
    ("vllm", 2, True): None,
    ("sglang", 1, False): ["fc.weight", "fc.bias"] + LAYER0,  # fc.bias all zeros
    ("sglang", 1, True): ["fc.weight", "fc.bias"] + LAYER0,
    ("sglang", 2, False): ["fc.weight", "fc.bias"] + LAYER0 + LAYER1,
    ("sglang", 2, True): ["fc.weight", "fc.bias"] + LAYER0 + LAYER1,
}
# config.json fields each loader reads (Llama config fields through transformers' LlamaConfig / EConfig):
LLAMA_FIELDS = ["model_type", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                "num_hidden_layers", "rms_norm_eps", "rope_theta", "vocab_size", "max_position_embeddings",
                "hidden_act", "torch_dtype"]
REQUIRED_CONFIG = {
    # eagle/model/ea_model.py reads "bias" (True when absent!); cnets1.py: rope_theta, rope_scaling, pretraining_tp
    "eagle": {"architectures": ["LlamaForCausalLM"], "fields": LLAMA_FIELDS + ["bias", "rope_scaling", "pretraining_tp"]},
    # vllm/transformers_utils/configs/eagle.py turns LlamaForCausalLM into EagleLlamaForCausalLM; head_dim is read
    "vllm": {"architectures": ["LlamaForCausalLM"], "fields": LLAMA_FIELDS + ["head_dim"]},
    # sglang picks the model class by architecture: LlamaForCausalLMEagle (llama_eagle.py EntryClass)
    "sglang": {"architectures": ["LlamaForCausalLMEagle"], "fields": LLAMA_FIELDS + ["head_dim", "tie_word_embeddings"]},
}


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
    expected = EXPECTED_KEYS[(fmt, layers, bias)]
    if expected is None:
        with pytest.raises(EagleError, match="vLLM.*without a bias"):
            export_drafter(drafter, tmp_path / fmt, fmt)
        return
    out = export_drafter(drafter, tmp_path / fmt, fmt)
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    weights = load_file(str(out / "model.safetensors"))
    assert sorted(weights) == sorted(expected)
    assert not any(k.startswith("model.") or "embed_tokens" in k or "lm_head" in k for k in weights)
    if fmt == "sglang" and not bias:
        assert torch.count_nonzero(weights["fc.bias"]) == 0
    cfg = json.loads((out / "config.json").read_text())
    spec = REQUIRED_CONFIG[fmt]
    assert cfg["architectures"] == spec["architectures"]
    assert [f for f in spec["fields"] if f not in cfg] == []
    assert (cfg["model_type"], cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]) == (
        "llama", layers, target.hidden_size, target.vocab_size)
    assert cfg["bias"] is bias and cfg["torch_dtype"] == "float32" and "format" not in cfg
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
    with pytest.raises(EagleError, match="EAGLE-3"):
        detect_format({"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 8})
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
