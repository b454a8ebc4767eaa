"""A drafter's architecture and the target it was built for (the JSON of a checkpoint's config.json)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from eagle.config import check_bool, check_float, check_int, from_dict
from eagle.errors import EagleError

FORMAT = "eagle-drafter/1"
KINDS = ("eagle", "eagle3")  # EAGLE-1/2 feature regression; EAGLE-3 multi-layer fusion with its own head


def default_eagle3_layers(num_layers: int) -> list[int]:
    """The target layers an EAGLE-3 drafter fuses by default (ours: outputs of layers 1, L/2-1, L-4):
    SpecForge's default written the same way (specforge/algorithms/model_providers.py
    ``resolve_eagle_capture_layers``), and the inputs of layers 2, L/2, L-3 that vLLM
    (``get_eagle3_aux_hidden_state_layers`` in vllm/model_executor/models/llama.py), llama.cpp
    (conversion/llama.py) and SGLang (``set_eagle3_layers_to_capture`` in
    python/sglang/srt/models/llama.py) capture when a config names none. On a shallow target fewer, all
    below its last layer (``Drafter.check_target``); none for L < 2."""
    if num_layers < 2:
        raise EagleError(f"an eagle3 drafter fuses target layers below the last: the target needs at least 2 "
                         f"layers, it has {num_layers}")
    return sorted({min(max(0, i), num_layers - 2) for i in (1, num_layers // 2 - 1, num_layers - 4)})


@dataclasses.dataclass
class TargetInfo:
    """What a drafter was built for; loading it against another target is refused."""

    name: str = ""
    hidden_size: int = 0
    vocab_size: int = 0
    tokenizer_fingerprint: str = ""


@dataclasses.dataclass
class DrafterConfig:
    """Drafter architecture (the JSON in ``configs/drafter/`` and in a checkpoint's config.json).

    ``kind``: "eagle" (EAGLE-1/2: fc over the token embedding and the target's last hidden state,
    predicts the next feature, logits from the target's LM head or a draft-vocabulary head) or
    "eagle3" (EAGLE-3: fc fuses the outputs of the target layers ``aux_layers`` only, one decoder
    layer attends over cat(normed embedding, normed hidden), final norm, its own head over the draft
    vocabulary; deeper in a tree it feeds on its own output hidden states).
    ``aux_layers`` are 0-based target decoder layers whose *outputs* are read (Hugging Face
    ``hidden_states[i + 1]``), as SGLang and SpecForge write them in ``eagle_config.
    eagle_aux_hidden_state_layer_ids``; vLLM and llama.cpp name the same tensors ``i + 1`` (the input
    of layer ``i + 1``, top-level ``eagle_aux_hidden_state_layer_ids``). See ``default_eagle3_layers``
    and ``eagle.drafting.checkpoint_formats``."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    head_dim: int | None = None
    num_layers: int = 1
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8192
    fc_bias: bool = False
    draft_vocab_size: int | None = None
    aux_layers: list[int] = dataclasses.field(default_factory=list)  # target layers (0-based) whose outputs fc fuses
    kind: str = "eagle"
    target: TargetInfo = dataclasses.field(default_factory=TargetInfo)

    def __post_init__(self) -> None:
        if isinstance(self.target, dict):
            self.target = from_dict(TargetInfo, self.target, where="drafter config 'target'")
        for name in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "vocab_size"):
            check_int(name, getattr(self, name), 1)
        for name in ("head_dim", "draft_vocab_size"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), 1)
        check_int("num_layers", self.num_layers)
        check_int("max_position_embeddings", self.max_position_embeddings, 1)
        for name in ("rms_norm_eps", "rope_theta"):
            if not check_float(name, getattr(self, name)) > 0:
                raise EagleError(f"{name} must be > 0, got {getattr(self, name)}")
        check_bool("fc_bias", self.fc_bias)
        if not isinstance(self.aux_layers, (list, tuple)):
            raise EagleError(f"aux_layers must be a list of target layer indices, got {self.aux_layers!r}")
        if not isinstance(self.target, TargetInfo):
            raise EagleError(f"target must be an object with the target's name and sizes, got {self.target!r}")
        if self.kind not in KINDS:
            raise EagleError(f"drafter kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.kind == "eagle3":
            if not self.aux_layers:
                raise EagleError("an eagle3 drafter fuses target layers: set aux_layers (e.g. 1, L/2-1, L-4)")
            if self.num_layers != 1 or self.fc_bias:
                raise EagleError("an eagle3 drafter has one decoder layer and no fc bias (as every consumer loads it)")
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_layers < 1:
            raise EagleError(f"num_layers must be >= 1, got {self.num_layers}")
        if self.draft_vocab_size is not None and not 0 < self.draft_vocab_size <= self.vocab_size:
            raise EagleError(f"draft_vocab_size must be in [1, {self.vocab_size}], got {self.draft_vocab_size}")
        self.aux_layers = list(self.aux_layers)
        if any(not isinstance(i, int) or i < 0 for i in self.aux_layers) or len(set(self.aux_layers)) < len(
                self.aux_layers):
            raise EagleError(f"aux_layers must be distinct target layer indices >= 0, got {self.aux_layers}")

    @classmethod
    def from_json(cls, path: str | Path) -> "DrafterConfig":
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise EagleError(f"cannot read {path}: {exc}") from None
        if not isinstance(data, dict):
            raise EagleError(f"{path} is not a JSON object")
        data.pop("format", None)
        return from_dict(cls, data, where=str(path))

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, **dataclasses.asdict(self)}, indent=2)
