"""Drafter checkpoints in the layouts of the EAGLE research repo, vLLM, SGLang, SpecForge and llama.cpp.

EAGLE-1/2 drafters (``kind`` "eagle") use the EAGLE-1 layout: a Llama-style ``config.json``
(``num_hidden_layers`` decoder layers, ``bias`` telling whether ``fc`` has one) plus the weights
``fc.weight`` [H, 2H], optional ``fc.bias``, ``layers.N.self_attn.{q,k,v,o}_proj.weight``,
``layers.N.mlp.{gate,up,down}_proj.weight``, ``layers.N.post_attention_layernorm.weight`` and, for
N > 0, ``layers.N.input_layernorm.weight``. These are exactly our ``Drafter`` parameter names, so the
conversion renames nothing: it translates the config and checks what each consumer can express. The
embedding and the LM head are the target's and are never written (all three consumers take them from
the target).

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

EAGLE-3 drafters (``kind`` "eagle3") use the EAGLE-3 release layout: a Llama config with
``num_hidden_layers`` 1, ``draft_vocab_size``, ``target_hidden_size`` and the aux layer ids; weights
``fc.weight`` [H, 3H] (no bias), ``midlayer.*`` (vLLM: ``layers.0.*``) with ``input_layernorm`` (on the
token embedding), ``hidden_norm``, ``self_attn.{q,k,v}_proj`` [., 2H], ``o_proj``,
``post_attention_layernorm``, ``mlp.*``; ``norm.weight``, ``lm_head.weight`` [V_draft, H], ``d2t``
int64 [V_draft] as OFFSETS (target id = draft id + d2t[draft id]; ours stores the target ids) and
``t2d`` bool [V]. No embedding is written: every consumer below takes the target's. All of them fuse
exactly three target layers, concatenated in ascending layer order (llama.cpp: in list order, so
the ids are written sorted). The layer ids differ by consumer:

* SGLang, ``python/sglang/srt/models/llama_eagle3.py`` (``LlamaForCausalLMEagle3``): parameters
  ``model.midlayer.*``, ``model.fc`` (bias only if config ``bias``), ``model.norm``, ``lm_head``; the
  loader prefixes ``model.`` and **silently skips** names it does not know (``layers.0.*`` would be
  lost); ``d2t`` becomes ``hot_token_id = d2t + arange``, ``t2d`` is skipped; ``tie_word_embeddings``
  true would make the head the embedding. The aux ids come from ``eagle_config.
  eagle_aux_hidden_state_layer_ids`` only (``srt/model_executor/model_runner.py``) and
  ``set_eagle3_layers_to_capture`` (``srt/models/llama.py``) adds 1 to each, capturing the input of
  that layer: the ids are ours (outputs of layers i). Without ids it captures the inputs of 2, L/2, L-3.
* SpecForge, ``specforge/modeling/draft/llama3_eagle.py`` (``LlamaForCausalLMEagle3``): the same
  names plus its own ``embed_tokens`` (reloaded from the target for training); ``fc`` reads
  ``target_hidden_size * 3``; options ``fc_norm`` and ``norm_output`` (not used here).
  ``resolve_eagle_capture_layers`` (``specforge/algorithms/model_providers.py``) reads
  ``eagle_config.eagle_aux_hidden_state_layer_ids``, default [1, L/2-1, L-4], and hands them to
  SGLang's ``set_eagle3_layers_to_capture``: our convention.
* vLLM, ``vllm/model_executor/models/llama_eagle3.py`` (``Eagle3LlamaForCausalLM``; the registry maps
  ``LlamaForCausalLMEagle3`` to it too): keys without ``model.`` (the loader adds it; ``midlayer.``
  is renamed ``layers.0.``), ``d2t`` -> ``draft_id_to_target_id`` (offsets), ``t2d`` skipped,
  ``embed_tokens`` shared with the target when absent; ``norm_before_residual`` (default false; true
  for a speculators config without it, ``vllm/transformers_utils/configs/speculators/algos.py``)
  and ``eagle_config.use_aux_hidden_state`` honoured. The aux ids come from the top-level
  ``eagle_aux_hidden_state_layer_ids`` (some versions then ``eagle_config``'s;
  ``_get_eagle3_aux_layers_from_config`` in ``vllm/v1/worker/gpu_model_runner.py``), used as they are
  by ``LlamaModel.forward`` (``vllm/model_executor/models/llama.py``), which appends
  ``hidden_states + residual`` before running layer ``idx``: the input of layer j, ours + 1.
* llama.cpp, ``conversion/llama.py`` (``convert_hf_to_gguf.py DRAFT --target-model-dir TARGET``):
  EAGLE-3 when ``draft_vocab_size`` is set and one layer; renames ``midlayer.*`` or ``layers.0.*``;
  keeps ``fc.weight``, ``d2t`` (written as absolute ids, must be unique), drops ``t2d``; reads the
  top-level ``eagle_aux_hidden_state_layer_ids`` only (default 2, L/2, L-3),
  ``target_hidden_size``, ``norm_before_residual`` and ``norm_before_fc``. ``common/speculative.cpp``
  extracts the input of each named layer: ours + 1, like vLLM.
* EAGLE repo, ``eagle/model/cnets.py`` (``Model``, ``use_eagle3=True``): ``midlayer.*``, ``fc``,
  ``norm``, ``lm_head``, ``d2t`` offsets, ``t2d``; loads the embedding from the base model only when
  config.json has no ``target_hidden_size``; ignores the aux ids: ``modeling_llama_kv.py`` always
  feeds the inputs of layers 2, L//2, L-3 (ours 1, L//2-1, L-4); head size hidden / heads.

So an ``eagle3`` export writes our ids in ``eagle_config`` (SGLang, SpecForge) and ours + 1 at the
top level (vLLM, llama.cpp); on import the two must agree, and a config naming neither gets the
consumers' default for the target given.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Callable

import torch

from eagle.config import from_dict
from eagle.drafting.drafter_config import FORMAT, DrafterConfig, TargetInfo, default_eagle3_layers
from eagle.drafting.weights import check_state, read_safetensors
from eagle.errors import EagleError

EAGLE_LAYOUT = "eagle-1"  # what detect_format returns for an EAGLE-1/2 release config
EAGLE3_LAYOUT = "eagle-3"  # ... and for an EAGLE-3 one (SpecForge / EAGLE repo / vLLM / speculators)
EXPORT_FORMATS = ("eagle", "eagle3", "vllm", "sglang")
LLAMA_ARCHITECTURES = ("LlamaForCausalLM", "LlamaForCausalLMEagle", "EagleLlamaForCausalLM")
ARCHITECTURE = {"eagle": "LlamaForCausalLM", "vllm": "LlamaForCausalLM", "sglang": "LlamaForCausalLMEagle"}
EAGLE3_ARCHITECTURE = {"eagle": "LlamaForCausalLMEagle3", "eagle3": "LlamaForCausalLMEagle3",
                       "sglang": "LlamaForCausalLMEagle3", "vllm": "Eagle3LlamaForCausalLM"}
EAGLE3_FUSED = 3  # target layers every EAGLE-3 consumer fuses (fc reads 3 x target_hidden_size)
TARGET_KEY = "eagle_drafter_target"  # our TargetInfo, carried in exported configs (others ignore it)


# ---- config -----------------------------------------------------------------------------------
def detect_format(cfg: dict) -> str:
    """``FORMAT`` for our own checkpoints (``"format": "eagle-drafter/1"``), ``EAGLE3_LAYOUT`` for an
    EAGLE-3 release config (an ``Eagle3`` architecture, ``speculators_model_type`` eagle3,
    ``eagle_config`` or ``target_hidden_size``), ``EAGLE_LAYOUT`` for an EAGLE-1/2 Llama-style
    release config; anything else is an error saying why."""
    if "format" in cfg:
        if cfg["format"] == FORMAT:
            return FORMAT
        raise EagleError(f"unknown drafter format {cfg['format']!r} in config.json (this version reads {FORMAT!r} "
                         f"and the EAGLE-1/2 and EAGLE-3 layouts)")
    archs = cfg.get("architectures") or []
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise EagleError(f"config.json 'architectures' must be a list of names, got {archs!r}")
    if (any("Eagle3" in a for a in archs) or cfg.get("speculators_model_type") == "eagle3" or "eagle_config" in cfg
            or "target_hidden_size" in cfg):
        return EAGLE3_LAYOUT
    if not archs and cfg.get("model_type") != "llama":
        raise EagleError("config.json is neither ours (no 'format': 'eagle-drafter/1') nor an EAGLE-1/2 Llama-style "
                         "config (no 'architectures', model_type not 'llama')")
    unknown = [a for a in archs if a not in LLAMA_ARCHITECTURES]
    if unknown:
        raise EagleError(f"unsupported drafter architecture {unknown[0]!r}: the EAGLE-1/2 layout is read for "
                         f"{', '.join(LLAMA_ARCHITECTURES)}")
    return EAGLE_LAYOUT


def _check_llama_fields(cfg: dict) -> None:
    """Refuse a Llama-style drafter config that lacks a size or asks for what the drafter cannot run."""
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size"):
        if isinstance(cfg.get(key), bool) or not isinstance(cfg.get(key), int) or cfg[key] < 1:
            raise EagleError(f"EAGLE drafter config.json: {key!r} missing or not a positive integer")
    if cfg.get("hidden_act", "silu") != "silu":
        raise EagleError(f"EAGLE drafter config.json: hidden_act {cfg['hidden_act']!r} is not supported (only 'silu')")
    for key in ("attention_bias", "qkv_bias", "mlp_bias"):
        if cfg.get(key):
            raise EagleError(f"EAGLE drafter config.json: {key} is set; projections with biases are not supported")


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
    if detect_format(cfg) != EAGLE_LAYOUT:
        raise EagleError("not an EAGLE-1/2 drafter config")
    _check_llama_fields(cfg)
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


def check_exportable(cfg: DrafterConfig, fmt: str, target_layers: int | None = None) -> None:
    """Refuse what ``fmt``'s consumer cannot run exactly as we do (see the module docstring).
    ``target_layers``: the target's decoder layer count, when known."""
    if fmt not in EXPORT_FORMATS:
        raise EagleError(f"unknown export format {fmt!r}; choose from {', '.join(EXPORT_FORMATS)}")
    if cfg.kind == "eagle3":
        check_eagle3_exportable(cfg, fmt, target_layers)
        return
    if fmt == "eagle3":
        raise EagleError("--format eagle3 is the EAGLE-3 layout, and this is an EAGLE-1/2 drafter (kind 'eagle'); "
                         "use --format eagle, vllm or sglang")
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


# ---- EAGLE-3 ----------------------------------------------------------------------------------
def consumer_layer_ids(aux_layers: list[int]) -> list[int]:
    """Our aux layers (outputs of layers i) -> the ids vLLM and llama.cpp read (inputs of layers
    i + 1), sorted as every consumer concatenates them."""
    return [i + 1 for i in sorted(aux_layers)]


def check_eagle3_exportable(cfg: DrafterConfig, fmt: str, target_layers: int | None = None) -> None:
    """Refuse an eagle3 drafter that ``fmt``'s consumer would run differently from us."""
    if len(cfg.aux_layers) != EAGLE3_FUSED:
        raise EagleError(f"this eagle3 drafter fuses {len(cfg.aux_layers)} target layers {cfg.aux_layers}; SGLang, "
                         f"vLLM, SpecForge and llama.cpp all fuse exactly {EAGLE3_FUSED} (fc reads 3 x hidden)")
    if target_layers is not None and max(cfg.aux_layers) >= target_layers - 1:
        raise EagleError(f"aux_layers {cfg.aux_layers} must name layers below the target's last ({target_layers})")
    if fmt == "eagle":
        if cfg.head_dim * cfg.num_attention_heads != cfg.hidden_size:
            raise EagleError(f"the EAGLE repo fixes head_dim = hidden_size / num_attention_heads "
                             f"({cfg.hidden_size // cfg.num_attention_heads}), but this drafter has head_dim "
                             f"{cfg.head_dim}")
        layers = sorted(cfg.aux_layers)
        implied = layers[-1] + 4  # the EAGLE repo always reads the outputs of 1, L//2-1, L-4
        if default_eagle3_layers(implied) != layers or target_layers not in (None, implied):
            raise EagleError(f"the EAGLE repo ignores the configured layers and always fuses the outputs of target "
                             f"layers 1, L//2-1, L-4 (modeling_llama_kv.py), but this drafter fuses {layers}; "
                             f"use --format eagle3, sglang or vllm")


def eagle3_config_dict(cfg: DrafterConfig, fmt: str, dtype: torch.dtype = torch.float32) -> dict:
    """Our eagle3 ``DrafterConfig`` -> the config.json of export format ``fmt``: ``eagle_config``
    ids ours (SGLang, SpecForge), top-level ids ours + 1 (vLLM, llama.cpp)."""
    check_eagle3_exportable(cfg, fmt)
    out = {
        "architectures": [EAGLE3_ARCHITECTURE[fmt]], "model_type": "llama",
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim, "num_hidden_layers": 1, "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta, "rope_scaling": None,
        "max_position_embeddings": cfg.max_position_embeddings, "vocab_size": cfg.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size or cfg.vocab_size, "target_hidden_size": cfg.hidden_size,
        "bias": False, "attention_bias": False, "mlp_bias": False, "pretraining_tp": 1,
        "tie_word_embeddings": False, "norm_before_residual": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "eagle_aux_hidden_state_layer_ids": consumer_layer_ids(cfg.aux_layers),
        TARGET_KEY: dataclasses.asdict(cfg.target),
    }
    if fmt != "vllm":
        out["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": sorted(cfg.aux_layers), "use_aux_hidden_state": True}
    if fmt == "eagle":  # with it, the EAGLE repo would not load the target's embedding (cnets.py Model)
        del out["target_hidden_size"]
    return out


def eagle3_state_dict(state: dict[str, torch.Tensor], cfg: DrafterConfig, fmt: str) -> dict[str, torch.Tensor]:
    """Our eagle3 state dict -> export format ``fmt``'s tensors (contiguous CPU copies): the layer as
    ``midlayer.*`` (vLLM: ``layers.0.*``), fc's column blocks in ascending layer order, ``d2t`` as
    offsets, ``t2d`` [V] bool."""
    h, order = cfg.hidden_size, sorted(range(len(cfg.aux_layers)), key=lambda k: cfg.aux_layers[k])
    prefix = "layers.0." if fmt == "vllm" else "midlayer."
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        value = value.detach().cpu()
        if key == "fc.weight":
            value = torch.cat([value[:, k * h:(k + 1) * h] for k in order], dim=1)
        elif key == "d2t":
            ids = value.long()
            if torch.unique(ids).numel() != ids.numel():
                raise EagleError("this drafter's d2t maps two draft tokens to one target token (llama.cpp refuses it)")
            t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
            t2d[ids] = True
            out["t2d"] = t2d
            value = ids - torch.arange(ids.numel())
        elif key.startswith("layers.0."):
            key = prefix + key[len("layers.0."):]
        out[key] = value.contiguous()
    return out


def eagle3_aux_layers(cfg: dict, target_layers: int | None) -> list[int]:
    """Our aux layers from an EAGLE-3 config: ``eagle_config.eagle_aux_hidden_state_layer_ids`` as
    they are (SGLang/SpecForge), top-level ``eagle_aux_hidden_state_layer_ids`` minus 1 (vLLM/llama.cpp);
    both must agree. Neither: the consumers' default for a ``target_layers``-layer target."""
    def ids(value: Any, where: str) -> list[int] | None:
        if value is None:
            return None
        if not isinstance(value, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in value):
            raise EagleError(f"EAGLE-3 config.json: {where} must be a list of layer indices, got {value!r}")
        return value

    nested = cfg.get("eagle_config") or {}
    if not isinstance(nested, dict):
        raise EagleError(f"EAGLE-3 config.json: eagle_config must be an object, got {nested!r}")
    ours = ids(nested.get("eagle_aux_hidden_state_layer_ids"), "eagle_config.eagle_aux_hidden_state_layer_ids")
    top = ids(cfg.get("eagle_aux_hidden_state_layer_ids"), "eagle_aux_hidden_state_layer_ids")
    if top is not None and min(top, default=1) < 1:
        raise EagleError(f"EAGLE-3 config.json: eagle_aux_hidden_state_layer_ids {top} name the input of layer 0 "
                         f"(the embedding), which this drafter cannot fuse")
    shifted = None if top is None else [j - 1 for j in top]
    if ours is not None and shifted is not None and sorted(ours) != sorted(shifted):
        raise EagleError(f"EAGLE-3 config.json names two different layer sets: eagle_config ids {ours} (outputs of "
                         f"those layers, as SGLang reads them) and top-level ids {top} (inputs of those layers, as "
                         f"vLLM and llama.cpp read them, i.e. outputs of {shifted})")
    layers = ours if ours is not None else shifted
    if layers is None:
        if target_layers is None:
            raise EagleError("EAGLE-3 config.json names no eagle_aux_hidden_state_layer_ids: give the target to use "
                             "the consumers' default (outputs of layers 1, L/2-1, L-4)")
        layers = default_eagle3_layers(target_layers)
    if any(i < 0 for i in layers) or len(set(layers)) != len(layers):
        raise EagleError(f"EAGLE-3 config.json: aux layer ids {layers} must be distinct and >= 0")
    return sorted(layers)


def _eagle3_flat_config(cfg: dict) -> dict:
    """A speculators config's ``transformer_layer_config`` merged into the top level (as llama.cpp does)."""
    inner = cfg.get("transformer_layer_config")
    if inner is None:
        return cfg
    if not isinstance(inner, dict):
        raise EagleError("EAGLE-3 config.json: transformer_layer_config must be an object")
    return {**cfg, **inner}


def check_eagle3_config(cfg: dict) -> None:
    """Refuse an EAGLE-3 config this drafter cannot run as its consumers do."""
    _check_llama_fields(cfg)
    if cfg.get("num_hidden_layers", 1) != 1:
        raise EagleError(f"EAGLE-3 drafter with {cfg.get('num_hidden_layers')} decoder layers: only one is supported")
    if cfg.get("target_hidden_size", cfg["hidden_size"]) != cfg["hidden_size"]:
        raise EagleError(f"EAGLE-3 drafter with hidden size {cfg['hidden_size']} for a target of hidden size "
                         f"{cfg['target_hidden_size']}: only a drafter as wide as its target is supported")
    # vLLM reads a speculators config's missing norm_before_residual as true (speculators/algos.py update_eagle3)
    speculators = cfg.get("speculators_model_type") is not None
    unsupported = {"norm_before_residual": cfg.get("norm_before_residual", speculators),
                   "norm_before_fc": cfg.get("norm_before_fc", False), "fc_norm": cfg.get("fc_norm", False),
                   "norm_output false": not cfg.get("norm_output", True),
                   "tie_word_embeddings": cfg.get("tie_word_embeddings", False),
                   "eagle_config.use_aux_hidden_state false":
                       not (cfg.get("eagle_config") or {}).get("use_aux_hidden_state", True)}
    asked = [name for name, value in unsupported.items() if value]
    if asked:
        raise EagleError(f"EAGLE-3 config.json asks for {', '.join(asked)}, which this drafter does not implement")


def eagle3_state_to_drafter(state: dict[str, torch.Tensor], cfg: dict,
                            target_embedding: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """EAGLE-3 release weights -> our state dict: ``model.`` prefix stripped, ``midlayer.*`` ->
    ``layers.0.*``, ``d2t`` offsets -> target ids (``t2d`` checked against them, then dropped), an
    all-zero ``fc.bias`` and the embedding dropped (the embedding only if it is the target's, when
    ``target_embedding`` is given)."""
    vocab, draft_vocab = cfg["vocab_size"], cfg.get("draft_vocab_size") or cfg["vocab_size"]
    names = {key: key[len("model."):] if key.startswith("model.") else key for key in state}
    if any(n.startswith("midlayer.") for n in names.values()) and any(n.startswith("layers.") for n in names.values()):
        raise EagleError("EAGLE-3 drafter weights mix midlayer.* and layers.* names")
    out: dict[str, torch.Tensor] = {}
    for key, name in names.items():
        if not isinstance(state[key], torch.Tensor):
            raise EagleError(f"EAGLE-3 drafter weights: entry {key!r} is not a tensor")
        if name.startswith("midlayer."):
            name = "layers.0." + name[len("midlayer."):]
        if name.endswith("rotary_emb.inv_freq"):
            continue
        if name in out:
            raise EagleError(f"EAGLE-3 drafter weights hold {name} twice (with and without the model. prefix)")
        out[name] = state[key]
    embed = out.pop("embed_tokens.weight", None)
    if embed is not None:
        if tuple(embed.shape) != (vocab, cfg["hidden_size"]):
            raise EagleError(f"EAGLE-3 drafter embed_tokens.weight has shape {tuple(embed.shape)}, but the config says "
                             f"vocab {vocab} x hidden {cfg['hidden_size']}")
        if target_embedding is not None and (target_embedding.shape != embed.shape or not torch.allclose(
                embed.float(), target_embedding.detach().float().cpu(), rtol=1e-2, atol=1e-3)):
            raise EagleError("EAGLE-3 drafter carries its own token embedding, which differs from the target's; "
                             "this drafter always uses the target's")
    bias = out.pop("fc.bias", None)
    if bias is not None and torch.count_nonzero(bias) != 0:
        raise EagleError("EAGLE-3 drafter weights hold a non-zero fc.bias; the EAGLE-3 fc has none")
    offsets = out.pop("d2t", None)
    if offsets is None:
        if draft_vocab != vocab:
            raise EagleError(f"EAGLE-3 drafter weights hold no d2t, needed for a draft vocabulary of {draft_vocab} "
                             f"of {vocab} tokens")
        ids = torch.arange(vocab)
    else:
        if tuple(offsets.shape) != (draft_vocab,) or offsets.is_floating_point():
            raise EagleError(f"EAGLE-3 drafter d2t must be integers of shape ({draft_vocab},), got "
                             f"{offsets.dtype} {tuple(offsets.shape)}")
        ids = offsets.long() + torch.arange(draft_vocab)
        if int(ids.min()) < 0 or int(ids.max()) >= vocab or torch.unique(ids).numel() != draft_vocab:
            raise EagleError(f"EAGLE-3 drafter d2t (offsets: target id = draft id + d2t) maps to ids outside "
                             f"0..{vocab - 1} or to one target id twice")
    t2d = out.pop("t2d", None)
    if t2d is not None:
        mask = torch.zeros(vocab, dtype=torch.bool)
        mask[ids] = True
        if tuple(t2d.shape) != (vocab,) or not torch.equal(t2d.bool(), mask):
            raise EagleError("EAGLE-3 drafter t2d does not mark exactly the target ids that d2t maps to")
    out["d2t"] = ids
    return out


def load_eagle3_checkpoint(directory: Path, cfg: dict, shapes: Callable[[DrafterConfig], dict],
                           allow_pickle: bool = False, target_layers: int | None = None,
                           target_embedding: torch.Tensor | None = None) -> tuple[DrafterConfig, dict]:
    """An EAGLE-3 release folder (SpecForge / EAGLE repo ``midlayer.*``; vLLM / speculators
    ``layers.0.*``, with or without ``model.``) -> (``DrafterConfig``, our state dict), checked key by
    key against ``shapes(config)``. Aux layers: ``eagle3_aux_layers`` (with no ids in the config,
    the consumers' default for a ``target_layers``-layer target)."""
    cfg = _eagle3_flat_config(cfg)
    check_eagle3_config(cfg)
    state = eagle3_state_to_drafter(read_weights(directory, allow_pickle), cfg, target_embedding)
    vocab, draft_vocab = cfg["vocab_size"], cfg.get("draft_vocab_size") or cfg["vocab_size"]
    if isinstance(cfg.get(TARGET_KEY), dict):
        target_info = from_dict(TargetInfo, cfg[TARGET_KEY], where=f"config.json {TARGET_KEY!r}")
    else:
        target_info = TargetInfo(hidden_size=cfg["hidden_size"], vocab_size=vocab)
    identity = draft_vocab == vocab and torch.equal(state["d2t"], torch.arange(vocab))
    dcfg = DrafterConfig(
        kind="eagle3", hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
        num_attention_heads=cfg["num_attention_heads"],
        num_key_value_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"], vocab_size=vocab,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=_rope_theta(cfg),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        draft_vocab_size=None if identity else draft_vocab, aux_layers=eagle3_aux_layers(cfg, target_layers),
        target=target_info)
    check_state(shapes(dcfg), state, f"EAGLE-3 drafter weights at {directory}")
    return dcfg, state


# ---- export -----------------------------------------------------------------------------------
_OUTPUTS = ("config.json", "model.safetensors", "README.md")


def export_drafter(drafter: Any, out_dir: str | Path, fmt: str, target_name: str | None = None,
                   target_layers: int | None = None) -> Path:
    """Write ``drafter`` to ``out_dir`` in format ``fmt`` (``EXPORT_FORMATS``; eagle3 drafters: eagle3
    and sglang the same EAGLE-3 release layout, eagle that layout for the EAGLE repo, vllm
    ``Eagle3LlamaForCausalLM``): config.json, model.safetensors and a README.md with the launch
    command. Weights keep their dtype. ``target_layers``: the target's layer count, checked when given."""
    from safetensors.torch import save_file

    check_exportable(drafter.config, fmt, target_layers)
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise EagleError(f"--out {out} exists and is not a folder")
    if out.is_dir():
        others = sorted(p.name for p in out.iterdir() if p.name not in _OUTPUTS)
        if others:
            raise EagleError(f"--out {out} holds other files ({', '.join(others[:3])}); give an empty or new folder")
    dtype = drafter.fc.weight.dtype
    if drafter.config.kind == "eagle3":
        state = eagle3_state_dict(drafter.state_dict(), drafter.config, fmt)
        cfg = eagle3_config_dict(drafter.config, fmt, dtype)
    else:
        state = drafter_state_to_eagle(drafter.state_dict(), zero_fc_bias=(fmt == "sglang"))
        cfg = drafter_config_to_eagle(drafter.config, fmt, dtype)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "README.md").write_text(launch_readme(fmt, out.resolve(), target_name or drafter.config.target.name or "TARGET",
                                                 drafter.config))
    return out


def launch_readme(fmt: str, out: Path, target: str, cfg: DrafterConfig) -> str:
    """The exported folder's README: what it is and the command that serves it."""
    if cfg.kind == "eagle3":
        return eagle3_readme(fmt, out, target, cfg)
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


def eagle3_readme(fmt: str, out: Path, target: str, cfg: DrafterConfig) -> str:
    """An eagle3 export's README: the layout, its layer ids and the launch commands."""
    layers, inputs = sorted(cfg.aux_layers), consumer_layer_ids(cfg.aux_layers)
    layout = {"vllm": "vLLM `Eagle3LlamaForCausalLM`, `layers.0.*`",
              "eagle": "EAGLE-3 release (`midlayer.*`) for the EAGLE repo"}.get(fmt, "EAGLE-3 release, `midlayer.*`")
    head = (f"# EAGLE-3 drafter ({layout})\n\nExported by `eagle-export --format {fmt}` for the target "
            f"`{cfg.target.name or target}` (hidden size {cfg.hidden_size}, vocabulary {cfg.vocab_size}, draft "
            f"vocabulary {cfg.draft_vocab_size or cfg.vocab_size}). It fuses the outputs of target layers {layers} "
            f"(0-based), which are the inputs of layers {inputs}: config.json names them "
            + ("" if fmt == "vllm" else f"`eagle_config.eagle_aux_hidden_state_layer_ids` {layers} (SGLang and "
               f"SpecForge add 1 when they capture) and ")
            + f"`eagle_aux_hidden_state_layer_ids` {inputs} (vLLM and llama.cpp read it as is). `d2t` holds offsets "
            f"(target id = draft id + d2t). The embedding is not stored: it is taken from the target, which must be "
            f"that same model.\n\nReplace `{target}` below with the target's Hugging Face id or folder.\n\n")
    spec = json.dumps({"method": "eagle3", "model": str(out), "num_speculative_tokens": 5})
    vllm = ("## vLLM\n\n```bash\n"
            f"vllm serve {target} --speculative-config '{spec}'\n```\n\n"
            "vLLM loads it with `Eagle3LlamaForCausalLM` (vllm/model_executor/models/llama_eagle3.py).\n\n")
    llama_cpp = ("## llama.cpp\n\n```bash\n"
                 f"python convert_hf_to_gguf.py {out} --target-model-dir TARGET_HF_DIR --outfile draft-eagle3.gguf\n"
                 "llama-server -m TARGET.gguf -md draft-eagle3.gguf --spec-type draft-eagle3\n```\n\n"
                 "`TARGET_HF_DIR` is the target's Hugging Face folder (the converter reads its config.json and "
                 "tokenizer; it needs `sentencepiece` importable).\n")
    if fmt == "eagle":
        return head + (
            "## EAGLE research repo (SafeAILab/EAGLE)\n\nIn an environment with that repo installed (its package is "
            "also named `eagle`):\n\n```python\nimport torch\nfrom eagle.model.ea_model import EaModel\n\n"
            f"model = EaModel.from_pretrained(base_model_path=\"{target}\", ea_model_path=\"{out}\", use_eagle3=True,\n"
            "                                total_token=60, depth=5, top_k=10, torch_dtype=torch.float16,\n"
            "                                device_map=\"auto\")\n```\n\n"
            "The repo always fuses the inputs of target layers 2, L//2, L-3 (eagle/model/modeling_llama_kv.py), "
            "which is why this export is only written when those are this drafter's layers; config.json has no "
            "`target_hidden_size`, so the repo loads the embedding from the base model (eagle/model/cnets.py).\n")
    if fmt == "vllm":
        return head + vllm + llama_cpp
    sglang = ("## SGLang\n\n```bash\n"
              f"python -m sglang.launch_server --model-path {target} --speculative-algorithm EAGLE3 \\\n"
              f"    --speculative-draft-model-path {out} --speculative-num-steps 5 \\\n"
              "    --speculative-eagle-topk 8 --speculative-num-draft-tokens 32\n```\n\n"
              "SGLang loads it with `LlamaForCausalLMEagle3` (python/sglang/srt/models/llama_eagle3.py); SpecForge "
              "reads the same layout (specforge/modeling/draft/llama3_eagle.py).\n\n")
    return head + sglang + vllm + llama_cpp
