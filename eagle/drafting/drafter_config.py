"""A drafter's architecture and the target it was built for (the JSON of a checkpoint's config.json)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from eagle.config import from_dict
from eagle.errors import EagleError

FORMAT = "eagle-drafter/1"


@dataclasses.dataclass
class TargetInfo:
    """What a drafter was built for; loading it against another target is refused."""

    name: str = ""
    hidden_size: int = 0
    vocab_size: int = 0
    tokenizer_fingerprint: str = ""


@dataclasses.dataclass
class DrafterConfig:
    """Drafter architecture (the JSON in ``configs/drafter/`` and in a checkpoint's config.json)."""

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
    target: TargetInfo = dataclasses.field(default_factory=TargetInfo)

    def __post_init__(self) -> None:
        if isinstance(self.target, dict):
            self.target = from_dict(TargetInfo, self.target, where="drafter config 'target'")
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
        data = json.loads(Path(path).read_text())
        data.pop("format", None)
        return from_dict(cls, data, where=str(path))

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, **dataclasses.asdict(self)}, indent=2)
