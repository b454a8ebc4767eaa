"""Which lean forward runs a model: ``LeanDecoder`` (Llama, Qwen2, Qwen3) or ``GemmaDecoder`` (Gemma-3), or none."""

from __future__ import annotations

from typing import Any

from eagle.runtime import gemma
from eagle.runtime.decoder import LeanDecoder, unsupported_reason


def lean_decoder(model: Any, int8_activations: bool = False) -> Any:
    """A lean forward for ``model`` when its architecture is supported, else None: a ``LeanDecoder``
    (Llama, Qwen2, Qwen3) or an ``eagle.runtime.gemma.GemmaDecoder`` (Gemma-3). ``int8_activations``: see
    ``LeanDecoder``."""
    if getattr(model.config, "model_type", None) in gemma.GEMMA_MODEL_TYPES:
        return gemma.GemmaDecoder(model, int8_activations=int8_activations) if gemma.unsupported_reason(
            model) is None else None
    return LeanDecoder(model, int8_activations=int8_activations) if unsupported_reason(model) is None else None
