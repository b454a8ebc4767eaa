"""eagle: EAGLE-style speculative decoding with a feature-level drafter and dynamic draft trees."""

from eagle.config import PromptLookupConfig, SamplingConfig, SpeculativeConfig, TreeConfig
from eagle.drafting.drafter import Drafter, DrafterConfig
from eagle.errors import EagleError
from eagle.decoding.loop import GenerationResult
from eagle.engine import METHODS, EagleModel
from eagle.runtime.target import DEFAULT_TARGET, Target, load_target

__all__ = [
    "DEFAULT_TARGET", "METHODS", "Drafter", "DrafterConfig", "EagleError", "EagleModel", "GenerationResult",
    "PromptLookupConfig", "SamplingConfig", "SpeculativeConfig", "Target", "TreeConfig", "load_target",
]
