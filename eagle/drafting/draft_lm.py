"""A standalone draft LM for classic speculative sampling (``sd``): a few decoder layers taken
from the target and distilled against it (``train/main.py`` with ``student: draft-lm``).

It shares the target's tokenizer, token embedding and (tied) LM head, which stay frozen, so a
saved draft LM holds only its decoder layers and final norm (``model.safetensors``), the
Hugging Face config (``config.json``) and ``draft_lm.json`` (the target it belongs to); loading
takes the embedding from the target. The loaded model is a plain ``LlamaForCausalLM``-style
transformers model, as any other ``draft_model``."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path
from typing import Any

import torch

from eagle.config import from_dict
from eagle.drafting.drafter_config import TargetInfo
from eagle.drafting.weights import read_safetensors
from eagle.errors import EagleError
from eagle.inputs import DRAFT_LM_MARKER
from eagle.runtime.quant_blocks import unpack_state

FORMAT = "eagle-draft-lm/1"
MARKER = DRAFT_LM_MARKER
SHIPPED = Path(__file__).parent.parent / "shipped" / "draft_lms"


@dataclasses.dataclass
class DraftLMConfig:
    """Architecture of a draft LM (``configs/draft_lm/*.json``): which target layers it starts from."""

    layers_from_target: list[int]

    def __post_init__(self) -> None:
        if not self.layers_from_target:
            raise EagleError("layers_from_target must name at least one target layer")


def is_draft_lm(path: str | Path) -> bool:
    return (Path(path) / MARKER).is_file()


def _shares_embedding(model: Any) -> bool:
    tied = getattr(model, "tied_embeddings", None)  # a GGUF target held as codes says so itself
    if tied is not None:
        return bool(tied)
    return model.get_output_embeddings().weight is model.get_input_embeddings().weight


def from_target(target: Any, cfg: DraftLMConfig) -> Any:
    """A draft LM made of the target's layers ``cfg.layers_from_target`` (in that order), its
    final norm and its embedding/LM head (shared tensors, frozen). Float32 copies of the layers."""
    model = target.model
    n = model.config.num_hidden_layers
    bad = [i for i in cfg.layers_from_target if not -n <= i < n]
    if bad:
        raise EagleError(f"layers_from_target {bad} out of range: the target has {n} layers")
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = len(cfg.layers_from_target)
    if getattr(config, "layer_types", None):
        config.layer_types = [config.layer_types[i] for i in cfg.layers_from_target]
    draft = type(model)(config).to(device=target.device, dtype=torch.float32)
    for new, old in enumerate(cfg.layers_from_target):
        draft.model.layers[new].load_state_dict(model.model.layers[old].state_dict())
    draft.model.norm.load_state_dict(model.model.norm.state_dict())
    _attach_embedding(draft, target)
    return draft


def _attach_embedding(draft: Any, target: Any) -> None:
    if not _shares_embedding(target.model):
        raise EagleError(f"{target.name} has an LM head separate from its embedding; draft LMs need a tied one")
    weight = target.model.get_input_embeddings().weight  # a GGUF target's: de-quantized (fp32) for the draft LM
    if not isinstance(weight, torch.nn.Parameter):
        weight = torch.nn.Parameter(weight, requires_grad=False)
    draft.get_input_embeddings().weight = weight
    draft.get_output_embeddings().weight = weight
    draft.get_input_embeddings().requires_grad_(False)


def trainable_parameters(draft: Any) -> list[torch.nn.Parameter]:
    """Everything but the shared (frozen) embedding."""
    shared = draft.get_input_embeddings().weight
    return [p for p in draft.parameters() if p is not shared]


def save(draft: Any, directory: str | Path, target: Any) -> None:
    """Write config.json, draft_lm.json and model.safetensors (no embedding) to ``directory``."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    draft.config.save_pretrained(directory)
    info = TargetInfo(name=target.name, hidden_size=target.hidden_size, vocab_size=target.vocab_size,
                      tokenizer_fingerprint=target.tokenizer_fingerprint)
    (directory / MARKER).write_text(json.dumps({"format": FORMAT, "target": dataclasses.asdict(info)}, indent=2))
    shared = draft.get_input_embeddings().weight
    state = {k: v.detach().contiguous().cpu() for k, v in draft.state_dict().items()
             if v is not shared and "embed_tokens" not in k and "lm_head" not in k}
    save_file(state, str(directory / "model.safetensors"), metadata={"format": FORMAT})


def load(directory: str | Path, target: Any, dtype: torch.dtype | None = None) -> Any:
    """Load a saved draft LM for ``target`` (refused for a target with another vocabulary or
    tokenizer), on the target's device, in ``dtype`` (default: the target's; the shared
    embedding keeps the target's), in eval mode with gradients off."""
    from transformers import AutoConfig, AutoModelForCausalLM

    directory = Path(directory)
    try:
        meta = json.loads((directory / MARKER).read_text())
    except (OSError, ValueError) as exc:
        raise EagleError(f"no draft LM at {directory}: {exc}") from exc
    if not isinstance(meta, dict):
        raise EagleError(f"{directory / MARKER} is not a JSON object")
    if meta.get("format") != FORMAT:
        raise EagleError(f"{directory / MARKER}: unknown format {meta.get('format')!r}")
    info = from_dict(TargetInfo, meta.get("target", {}), where=str(directory / MARKER))
    if (info.vocab_size, info.hidden_size) != (target.vocab_size, target.hidden_size) or \
            info.tokenizer_fingerprint != target.tokenizer_fingerprint:
        raise EagleError(f"draft LM at {directory} was made for {info.name}, not for {target.name}")
    try:
        config = AutoConfig.from_pretrained(directory)
        draft = AutoModelForCausalLM.from_config(config, dtype=dtype or target.dtype)
    except Exception as exc:  # noqa: BLE001 - transformers raises OSError, ValueError, KeyError, ... here
        raise EagleError(f"cannot read the draft LM's {directory / 'config.json'}: {exc}") from None
    state = unpack_state(read_safetensors(directory / "model.safetensors"))
    expected = draft.state_dict()
    wrong = [k for k, v in state.items() if k in expected and tuple(v.shape) != tuple(expected[k].shape)]
    if wrong:
        raise EagleError(f"draft LM at {directory} does not match its config: {wrong[0]} has shape "
                         f"{list(state[wrong[0]].shape)}, the config implies {list(expected[wrong[0]].shape)}")
    missing, unexpected = draft.load_state_dict(state, strict=False)
    missing = [k for k in missing if "embed_tokens" not in k and "lm_head" not in k]
    if missing or unexpected:
        raise EagleError(f"draft LM at {directory} does not match its config: missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]}")
    draft.to(device=target.device, dtype=dtype or target.dtype)
    _attach_embedding(draft, target)
    return draft.eval().requires_grad_(False)
