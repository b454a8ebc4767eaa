"""Drafter checkpoints in the EAGLE-1/2 layout, for the EAGLE research repo, vLLM and SGLang.

The layout is a Llama-style ``config.json`` (``num_hidden_layers`` decoder layers, ``bias``
telling whether ``fc`` has one) plus the weights ``fc.weight`` [H, 2H], optional ``fc.bias``,
``layers.N.self_attn.{q,k,v,o}_proj.weight``, ``layers.N.mlp.{gate,up,down}_proj.weight``,
``layers.N.post_attention_layernorm.weight`` and, for N > 0, ``layers.N.input_layernorm.weight``.
These are exactly our ``Drafter`` parameter names, so the conversion renames nothing: it
translates the config and checks what each consumer can express. The embedding and the LM head
are the target's and are never written (all three consumers take them from the target).

What the consumers expect (read from their loaders):

* EAGLE repo, ``eagle/model/ea_model.py`` + ``cnets1.py`` (EAGLE-1/2 ``Model``): config through
  ``EConfig`` (a Llama config); ``bias`` read from config.json and **True when absent**; head size is
  always ``hidden_size // num_attention_heads`` (no ``head_dim``); ``rope_theta`` honoured,
  ``rope_scaling`` only linear/dynamic; weights from ``pytorch_model.bin``, else
  ``model.safetensors``, loaded with ``strict=False`` (a missing key is silently left random);
  embedding read from the base model (``load_emb=True``), LM head = base model's.
* vLLM, ``vllm/model_executor/models/llama_eagle.py`` (``EagleLlamaForCausalLM``; the draft
  config's ``LlamaForCausalLM`` is renamed ``EagleLlamaForCausalLM`` by
  ``vllm/transformers_utils/configs/eagle.py``): keys without a ``model.`` prefix (the loader adds
  it); ``fc`` is built **without a bias** (a ``fc.bias`` key is an error or dropped, by version);
  ``embed_tokens`` is skipped and shared with the target, the LM head is the target's unless the
  checkpoint has ``lm_head``; layer 0 has no input layernorm.
* SGLang, ``python/sglang/srt/models/llama_eagle.py`` (``LlamaForCausalLMEagle``): keys without a
  ``model.`` prefix (the loader adds it), ``lm_head*`` keys ignored; ``fc`` is built **with a bias**
  (``nn.Linear`` default), so a bias-free drafter is written with an all-zero ``fc.bias`` (which
  adds exactly 0.0); embedding and LM head are set from the target (``set_embed_and_head`` in
  ``speculative/eagle_worker.py``); layer 0 has no input layernorm.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Callable

import torch

from eagle.config import from_dict
from eagle.drafting.drafter_config import FORMAT, DrafterConfig, TargetInfo
from eagle.drafting.weights import read_safetensors
from eagle.errors import EagleError

EAGLE_LAYOUT = "eagle-1"  # what detect_format returns for an EAGLE-1/2 release config
EXPORT_FORMATS = ("eagle", "vllm", "sglang")
LLAMA_ARCHITECTURES = ("LlamaForCausalLM", "LlamaForCausalLMEagle", "EagleLlamaForCausalLM")
ARCHITECTURE = {"eagle": "LlamaForCausalLM", "vllm": "LlamaForCausalLM", "sglang": "LlamaForCausalLMEagle"}
TARGET_KEY = "eagle_drafter_target"  # our TargetInfo, carried in exported configs (others ignore it)


# ---- config -----------------------------------------------------------------------------------
def detect_format(cfg: dict) -> str:
    """``FORMAT`` for our own checkpoints (``"format": "eagle-drafter/1"``), ``EAGLE_LAYOUT`` for an
    EAGLE-1/2 Llama-style release config; anything else is an error saying why."""
    if "format" in cfg:
        if cfg["format"] == FORMAT:
            return FORMAT
        raise EagleError(f"unknown drafter format {cfg['format']!r} in config.json (this version reads {FORMAT!r} "
                         f"and the EAGLE-1/2 layout)")
    archs = cfg.get("architectures") or []
    if any("Eagle3" in a for a in archs) or "target_hidden_size" in cfg:
        raise EagleError(f"an EAGLE-3 drafter ({', '.join(archs) or 'target_hidden_size set'}) cannot be read: "
                         f"only the EAGLE-1/2 layout is supported")
    if not archs and cfg.get("model_type") != "llama":
        raise EagleError("config.json is neither ours (no 'format': 'eagle-drafter/1') nor an EAGLE-1/2 Llama-style "
                         "config (no 'architectures', model_type not 'llama')")
    unknown = [a for a in archs if a not in LLAMA_ARCHITECTURES]
    if unknown:
        raise EagleError(f"unsupported drafter architecture {unknown[0]!r}: the EAGLE-1/2 layout is read for "
                         f"{', '.join(LLAMA_ARCHITECTURES)}")
    return EAGLE_LAYOUT


def _rope_theta(cfg: dict) -> float:
    params = cfg.get("rope_parameters") or {}
    kind = params.get("rope_type", "default")
    scaling = cfg.get("rope_scaling")
    if kind != "default" or scaling:
        raise EagleError(f"the drafter config asks for rope scaling ({scaling or kind!r}); only plain RoPE is supported")
    theta = cfg.get("rope_theta", params.get("rope_theta", 10000.0))
    return float(theta)


def eagle_config_to_drafter_config(cfg: dict, target_info: TargetInfo | None = None,
                                   fc_bias: bool | None = None) -> DrafterConfig:
    """An EAGLE-1/2 Llama-style config dict -> our ``DrafterConfig``. ``fc_bias`` None means the
    config's ``bias`` (False when absent; ``load_eagle_checkpoint`` decides from the weights
    then, as the EAGLE repo's own default, True, would be wrong for bias-free files). ``target_info`` None means the
    ``eagle_drafter_target`` block our export writes, else the config's hidden and vocab sizes
    with no tokenizer fingerprint (then only sizes are checked against a target)."""
    detect_format(cfg)
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size"):
        if not isinstance(cfg.get(key), int) or cfg[key] < 1:
            raise EagleError(f"EAGLE drafter config.json: {key!r} missing or not a positive integer")
    if cfg.get("hidden_act", "silu") != "silu":
        raise EagleError(f"EAGLE drafter config.json: hidden_act {cfg['hidden_act']!r} is not supported (only 'silu')")
    for key in ("attention_bias", "qkv_bias", "mlp_bias"):
        if cfg.get(key):
            raise EagleError(f"EAGLE drafter config.json: {key} is set; projections with biases are not supported")
    if cfg.get("draft_vocab_size") not in (None, cfg["vocab_size"]):
        raise EagleError("EAGLE drafter config.json: a reduced draft vocabulary (draft_vocab_size) is not part of the "
                         "EAGLE-1/2 layout")
    if target_info is None:
        if isinstance(cfg.get(TARGET_KEY), dict):
            target_info = from_dict(TargetInfo, cfg[TARGET_KEY], where=f"config.json {TARGET_KEY!r}")
        else:
            target_info = TargetInfo(hidden_size=cfg["hidden_size"], vocab_size=cfg["vocab_size"])
    return DrafterConfig(
        hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
        num_attention_heads=cfg["num_attention_heads"],
        num_key_value_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
        vocab_size=cfg["vocab_size"], head_dim=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
        num_layers=int(cfg.get("num_hidden_layers", 1)), rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=_rope_theta(cfg), max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        fc_bias=bool(cfg.get("bias", False)) if fc_bias is None else fc_bias, target=target_info)


def check_exportable(cfg: DrafterConfig, fmt: str) -> None:
    """Refuse what ``fmt``'s consumer cannot run exactly as we do (see the module docstring)."""
    if fmt not in EXPORT_FORMATS:
        raise EagleError(f"unknown export format {fmt!r}; choose from {', '.join(EXPORT_FORMATS)}")
    if cfg.aux_layers:
        raise EagleError(f"this drafter fuses target layers {cfg.aux_layers} besides the feature, which the EAGLE-1 "
                         f"layout cannot express (and EAGLE-3 drafters are built differently)")
    if cfg.draft_vocab_size is not None:
        raise EagleError(f"this drafter has a reduced draft vocabulary ({cfg.draft_vocab_size} of {cfg.vocab_size} "
                         f"tokens, own lm_head + d2t map), which the EAGLE-1 layout cannot express; export a "
                         f"full-vocabulary drafter (no draft_vocab_size)")
    if fmt == "vllm" and cfg.fc_bias:
        raise EagleError("vLLM's EAGLE-1 Llama drafter (llama_eagle.py) builds fc without a bias, and this drafter's fc "
                         "has one: it cannot be served by vLLM unchanged; use --format sglang or eagle, or train "
                         "with fc_bias false")
    if fmt == "eagle" and cfg.head_dim * cfg.num_attention_heads != cfg.hidden_size:
        raise EagleError(f"the EAGLE repo fixes head_dim = hidden_size / num_attention_heads "
                         f"({cfg.hidden_size // cfg.num_attention_heads}), but this drafter has head_dim {cfg.head_dim}")


def drafter_config_to_eagle(cfg: DrafterConfig, fmt: str, dtype: torch.dtype = torch.float32) -> dict:
    """Our ``DrafterConfig`` -> the Llama-style config.json of export format ``fmt``."""
    check_exportable(cfg, fmt)
    return {
        "architectures": [ARCHITECTURE[fmt]], "model_type": "llama",
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim, "num_hidden_layers": cfg.num_layers, "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta, "rope_scaling": None,
        "max_position_embeddings": cfg.max_position_embeddings, "vocab_size": cfg.vocab_size,
        "bias": cfg.fc_bias, "attention_bias": False, "mlp_bias": False, "pretraining_tp": 1,
        "tie_word_embeddings": False, "torch_dtype": str(dtype).removeprefix("torch."),
        TARGET_KEY: dataclasses.asdict(cfg.target),
    }


# ---- weights ----------------------------------------------------------------------------------
def drafter_state_to_eagle(state: dict[str, torch.Tensor], zero_fc_bias: bool = False) -> dict[str, torch.Tensor]:
    """Our state dict -> EAGLE key names (the same names; contiguous CPU copies). With
    ``zero_fc_bias`` a missing ``fc.bias`` is written as zeros (for SGLang, whose fc always has one)."""
    if "lm_head.weight" in state or "d2t" in state:
        raise EagleError("a reduced-vocabulary drafter (lm_head + d2t) cannot be written in the EAGLE-1 layout")
    out = {k: v.detach().contiguous().cpu() for k, v in state.items()}
    if zero_fc_bias and "fc.bias" not in out:
        w = out["fc.weight"]
        out["fc.bias"] = torch.zeros(w.shape[0], dtype=w.dtype)
    return out


def eagle_state_to_drafter(state: dict[str, torch.Tensor], cfg: dict | None = None) -> tuple[dict[str, torch.Tensor], bool]:
    """EAGLE-layout weights -> (our state dict, whether fc has a bias). Drops ``embed_tokens.weight``
    (checked against the config's vocab/hidden when ``cfg`` is given) and rotary ``inv_freq``
    buffers, strips a ``model.`` prefix, and reconciles ``fc.bias`` with the config's ``bias``: an
    all-zero bias under ``"bias": false`` (our SGLang export) is dropped; any other disagreement is
    an error."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if not isinstance(value, torch.Tensor):
            raise EagleError(f"EAGLE drafter weights: entry {key!r} is not a tensor")
        name = key[len("model."):] if key.startswith("model.") else key
        if name.endswith("rotary_emb.inv_freq"):
            continue
        if name == "embed_tokens.weight":
            if cfg is not None and tuple(value.shape) != (cfg.get("vocab_size"), cfg.get("hidden_size")):
                raise EagleError(f"EAGLE drafter embed_tokens.weight has shape {tuple(value.shape)}, but the config "
                                 f"says vocab {cfg.get('vocab_size')} x hidden {cfg.get('hidden_size')}")
            continue
        out[name] = value
    declared = None if cfg is None else cfg.get("bias")
    has_bias = "fc.bias" in out
    if declared is False and has_bias:
        if torch.count_nonzero(out["fc.bias"]) != 0:
            raise EagleError("EAGLE drafter config.json says \"bias\": false, but the weights hold a non-zero fc.bias")
        del out["fc.bias"]
        has_bias = False
    elif declared is True and not has_bias:
        raise EagleError("EAGLE drafter config.json says \"bias\": true, but the weights hold no fc.bias")
    return out, has_bias


def read_weights(directory: Path, allow_pickle: bool = False) -> dict[str, torch.Tensor]:
    """``model.safetensors``, else ``pytorch_model.bin`` (only with ``allow_pickle``)."""
    if (directory / "model.safetensors").is_file():
        return read_safetensors(directory / "model.safetensors")
    path = directory / "pytorch_model.bin"
    if not path.is_file():
        raise EagleError(f"no drafter weights at {directory}: neither model.safetensors nor pytorch_model.bin")
    if not allow_pickle:
        raise EagleError(f"{path} is a pickle file, and unpickling can run code: pass allow_pickle=True "
                         f"(--allow-pickle) only if you trust its source, or convert it to model.safetensors")
    try:
        state = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unpickling failure is the user's file
        raise EagleError(f"cannot read {path} (weights_only): {exc}") from exc
    if not isinstance(state, dict):
        raise EagleError(f"{path} does not hold a state dict (got {type(state).__name__})")
    return state


def load_eagle_checkpoint(directory: Path, cfg: dict, shapes: Callable[[DrafterConfig], dict],
                          allow_pickle: bool = False) -> tuple[DrafterConfig, dict]:
    """An EAGLE-1/2 layout folder -> (``DrafterConfig``, our state dict), checked key by key against
    ``shapes(config)``: the state dict (or {name: tensor}) of a drafter built from that config."""
    state, fc_bias = eagle_state_to_drafter(read_weights(directory, allow_pickle), cfg)
    dcfg = eagle_config_to_drafter_config(cfg, fc_bias=fc_bias)
    expected = {k: tuple(v.shape) for k, v in shapes(dcfg).items()}
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise EagleError(f"EAGLE drafter weights at {directory} do not match its config.json "
                         f"({dcfg.num_layers} layer(s)): missing {missing or 'none'}, unexpected {unexpected or 'none'}")
    for key, shape in expected.items():
        if tuple(state[key].shape) != shape:
            raise EagleError(f"EAGLE drafter weight {key} has shape {tuple(state[key].shape)}, config.json implies {shape}")
    return dcfg, state


# ---- export -----------------------------------------------------------------------------------
_OUTPUTS = ("config.json", "model.safetensors", "README.md")


def export_drafter(drafter: Any, out_dir: str | Path, fmt: str, target_name: str | None = None) -> Path:
    """Write ``drafter`` to ``out_dir`` in format ``fmt`` (eagle, vllm or sglang): config.json,
    model.safetensors and a README.md with the launch command. Weights keep their dtype."""
    from safetensors.torch import save_file

    check_exportable(drafter.config, fmt)
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise EagleError(f"--out {out} exists and is not a folder")
    if out.is_dir():
        others = sorted(p.name for p in out.iterdir() if p.name not in _OUTPUTS)
        if others:
            raise EagleError(f"--out {out} holds other files ({', '.join(others[:3])}); give an empty or new folder")
    state = drafter_state_to_eagle(drafter.state_dict(), zero_fc_bias=(fmt == "sglang"))
    dtype = drafter.fc.weight.dtype
    cfg = drafter_config_to_eagle(drafter.config, fmt, dtype)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "README.md").write_text(launch_readme(fmt, out.resolve(), target_name or drafter.config.target.name or "TARGET",
                                                 drafter.config))
    return out


def launch_readme(fmt: str, out: Path, target: str, cfg: DrafterConfig) -> str:
    """The exported folder's README: what it is and the command that serves it."""
    info = cfg.target
    head = (f"# EAGLE-1 drafter ({fmt} layout)\n\nExported by `eagle-export --format {fmt}` for the target "
            f"`{info.name or target}` (hidden size {cfg.hidden_size}, vocabulary {cfg.vocab_size}, "
            f"{cfg.num_layers} decoder layer(s), fc bias {str(cfg.fc_bias).lower()}). The embedding and the LM head "
            f"are not stored: they are taken from the target, which must be that same model.\n\n"
            f"Replace `{target}` below with the target's Hugging Face id or folder.\n\n")
    if fmt == "vllm":
        spec = json.dumps({"method": "eagle", "model": str(out), "num_speculative_tokens": 5})
        return head + (
            "## vLLM\n\n```bash\n"
            f"vllm serve {target} --speculative-config '{spec}'\n```\n\n```python\nfrom vllm import LLM\n\n"
            f"llm = LLM(model=\"{target}\", speculative_config={spec})\n```\n\n"
            "vLLM loads this folder with `EagleLlamaForCausalLM` (vllm/model_executor/models/llama_eagle.py).\n")
    if fmt == "sglang":
        return head + (
            "## SGLang\n\n```bash\n"
            f"python -m sglang.launch_server --model-path {target} --speculative-algorithm EAGLE \\\n"
            f"    --speculative-draft-model-path {out} --speculative-num-steps 5 \\\n"
            "    --speculative-eagle-topk 8 --speculative-num-draft-tokens 64\n```\n\n"
            "SGLang loads this folder with `LlamaForCausalLMEagle` (python/sglang/srt/models/llama_eagle.py); "
            "its fc always has a bias, so a bias-free drafter is stored with an all-zero `fc.bias`.\n")
    return head + (
        "## EAGLE research repo (SafeAILab/EAGLE)\n\nIn an environment with that repo installed (its package is also "
        "named `eagle`, so not the one this drafter was trained in):\n\n```python\nimport torch\n"
        "from eagle.engine.ea_model import EaModel\n\n"
        f"model = EaModel.from_pretrained(base_model_path=\"{target}\", ea_model_path=\"{out}\", use_eagle3=False,\n"
        "                                total_token=60, depth=5, top_k=10, torch_dtype=torch.float16,\n"
        "                                device_map=\"auto\")\n```\n\n"
        "The repo reads `bias` from config.json, then `pytorch_model.bin` or else `model.safetensors` "
        "(eagle/model/ea_model.py); `use_eagle3` exists in EAGLE-3-era versions of the repo.\n")
