"""Typed configuration: one dataclass per concern; unknown keys are errors."""

from __future__ import annotations

import argparse
import dataclasses
import math
import numbers
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, TypeVar, Union

from eagle.errors import EagleError

T = TypeVar("T")


def check_int(name: str, value: Any, low: int | None = None, hint: str = "") -> int:
    """``value`` if it is an integer (not a bool) >= ``low``, else an ``EagleError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise EagleError(f"{name} must be an integer, got {value!r}")
    if low is not None and value < low:
        raise EagleError(f"{name} must be >= {low}{hint}, got {value}")
    return int(value)


def check_float(name: str, value: Any) -> float:
    """``value`` if it is a finite real number (not a bool), else an ``EagleError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise EagleError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise EagleError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise EagleError(f"{name} must be true or false, got {value!r}")
    return value


def check_seed(value: Any) -> int | None:
    """A seed: None or an integer that ``torch.Generator.manual_seed`` takes."""
    if value is None:
        return None
    check_int("seed", value)
    if not -(1 << 63) <= value < (1 << 64):
        raise EagleError(f"seed must be in [-2**63, 2**64), got {value}")
    return int(value)


def from_dict(cls: type[T], data: Mapping[str, Any] | None, where: str = "") -> T:
    """Build dataclass ``cls`` from ``data``; an unknown or missing key is an error naming the key."""
    place = f" in {where}" if where else ""
    if data is not None and not isinstance(data, Mapping):
        raise EagleError(f"expected a mapping of config keys{place}, got {type(data).__name__}")
    data = dict(data or {})
    fields = dataclasses.fields(cls)
    names = {f.name for f in fields}
    unknown = sorted(set(data) - names, key=str)
    if unknown:
        raise EagleError(
            f"unknown config key(s) {', '.join(repr(k) for k in unknown)}{place}; "
            f"allowed: {', '.join(sorted(names))}"
        )
    missing = [f.name for f in fields if f.name not in data and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if missing:
        raise EagleError(f"missing config key(s) {', '.join(repr(k) for k in missing)}{place}")
    try:
        return cls(**data)
    except EagleError as exc:
        if not place or place in str(exc):
            raise
        raise EagleError(f"{exc}{place}") from None
    except (TypeError, ValueError) as exc:  # a value of the wrong type deeper in the constructor
        raise EagleError(f"bad config value{place}: {exc}") from None


def add_set_argument(parser: argparse.ArgumentParser) -> None:
    """``--set KEY=VALUE ...``: config keys overridden on the command line. The flag may be repeated
    and take several pairs; every pair is kept, in order (``parse_overrides`` reads them)."""
    parser.add_argument("--set", action="extend", nargs="+", default=[], metavar="KEY=VALUE",
                        help="override config keys (values parsed as YAML); repeat it or give several pairs")


def parse_overrides(items: Sequence[str]) -> dict[str, Any]:
    """``["KEY=VALUE", ...]`` -> {key: YAML-parsed value}. An item without ``=`` is an error; so is a
    key given twice with different values (the error names both)."""
    import yaml

    out: dict[str, Any] = {}
    given: dict[str, str] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise EagleError(f"override {item!r} is not KEY=VALUE")
        value = yaml.safe_load(text)
        if key in out and out[key] != value:
            raise EagleError(f"{key} is set twice, to different values: {given[key]!r} and {item!r}")
        out[key], given[key] = value, item
    return out


def load_config_file(cls: type[T], path: str | None, overrides: Sequence[str] = (), where: str = "config") -> T:
    """``cls`` from a YAML file (optional) with ``KEY=VALUE`` overrides (``parse_overrides``)."""
    import yaml

    if path and not Path(path).is_file():
        raise EagleError(f"config file not found: {path}")
    data = (yaml.safe_load(Path(path).read_text()) or {}) if path else {}
    data.update(parse_overrides(overrides))
    return from_dict(cls, data, where=path or where)


def changed_keys(cfg: Any) -> set[str]:
    """The fields of dataclass ``cfg`` whose value differs from the field's default."""
    changed = set()
    for f in dataclasses.fields(cfg):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if getattr(cfg, f.name) != default:
            changed.add(f.name)
    return changed


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """How logits become a token: temperature 0 means greedy (argmax)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    def __post_init__(self) -> None:
        check_float("temperature", self.temperature)
        check_float("top_p", self.top_p)
        check_int("top_k", self.top_k)
        check_seed(self.seed)
        if self.temperature < 0:
            raise EagleError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise EagleError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise EagleError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclasses.dataclass(frozen=True)
class TreeConfig:
    """EAGLE-2 dynamic draft tree: the root's ``top_k`` children, then ``depth`` expansion steps
    of the ``top_k`` best frontier nodes (one drafter call each), so a path holds up to
    ``depth + 1`` draft tokens, as with EAGLE-2's ``depth``; then the best ``total_tokens`` nodes
    (root included) are verified in one pass.
    ``total_tokens="auto"`` (the default) sizes each tree by the target's measured forward-time
    curve: about 60 nodes on a GPU, far fewer on a CPU, where every extra token costs time.
    ``lookup_tokens``: up to this many prompt-lookup draft tokens (an n-gram match in the context,
    as in method ``pld``) join the candidate pool each step, scored by how often the target has
    agreed with them so far; 0 turns it off (then the tree is the drafter's alone, as in EAGLE-2).
    ``sampled_tree``: when sampling (temperature > 0), the dynamic tree's children are drawn from the
    drafter's distribution without replacement instead of being its top_k, and verified by
    recursive speculative decoding (``acceptance.recursive_rejection_tree``); prompt-lookup
    chains are then grafted as new nodes after the drawn siblings (never merged with a drawn
    node: its score would depend on what was drawn), and with "auto" a round's size is chosen
    from the previous round's pool. False keeps EAGLE-2's top_k children at every temperature.
    ``draw_temperature_scale``: the children are drawn at the sampling temperature times this (the
    rule judges them by that same distribution, so output stays exact at any value). The drafter,
    trained to match the target's distribution, is flatter than the target where it is unsure;
    drawn sharper it overlaps the target more: on the target's temperature-1 answers to the dev
    prompts one draw is accepted with probability 0.412 at 1.0, 0.426 at 0.85.
    ``draw_support``: the children are drawn among the drafter's this many most likely tokens
    (at least ``top_k``; its distribution renormalized over them, which the rule is told), so a
    rejected draw's residual touches those tokens only; 0: the whole draft vocabulary."""

    total_tokens: Union[int, str] = "auto"
    depth: int = 6
    top_k: int = 10
    choices: Optional[tuple] = None  # EAGLE-1 static tree, e.g. ((0,), (1,), (0, 0)); replaces the dynamic tree
    lookup_tokens: int = 10
    sampled_tree: bool = True
    draw_temperature_scale: float = 0.85
    draw_support: int = 64

    @property
    def levels(self) -> int:
        """The most draft tokens on a path below the root: the root's children plus ``depth`` expansions."""
        return self.depth + 1

    def __post_init__(self) -> None:
        if self.choices is not None:
            try:
                object.__setattr__(self, "choices", tuple(tuple(check_int("a tree choice's rank", r) for r in c)
                                                          for c in self.choices))
            except TypeError:
                raise EagleError(f"tree choices must be lists of child ranks, got {self.choices!r}") from None
            if not self.choices or any(not c or min(c) < 0 for c in self.choices):
                raise EagleError("tree choices must be non-empty lists of child ranks >= 0")
            from eagle.decoding.tree import static_layout

            try:
                static_layout(self.choices)
            except ValueError as exc:
                raise EagleError(str(exc)) from None
        if isinstance(self.total_tokens, str):
            if self.total_tokens != "auto":
                raise EagleError(f"total_tokens must be a positive integer or 'auto', got {self.total_tokens!r}")
        elif isinstance(self.total_tokens, bool) or not isinstance(self.total_tokens, numbers.Integral):
            raise EagleError(f"total_tokens must be a positive integer or 'auto', got {self.total_tokens!r}")
        elif self.total_tokens < 1:
            raise EagleError(f"total_tokens must be >= 1, got {self.total_tokens}")
        for name in ("depth", "top_k", "lookup_tokens", "draw_support"):
            check_int(name, getattr(self, name))
        check_bool("sampled_tree", self.sampled_tree)
        check_float("draw_temperature_scale", self.draw_temperature_scale)
        if self.depth < 0:
            raise EagleError(f"depth must be >= 0 (0: the root's children only), got {self.depth}")
        if self.top_k < 1:
            raise EagleError(f"top_k must be >= 1, got {self.top_k}")
        if self.lookup_tokens < 0:
            raise EagleError(f"lookup_tokens must be >= 0 (0 turns it off), got {self.lookup_tokens}")
        if not self.draw_temperature_scale > 0:
            raise EagleError(f"draw_temperature_scale must be > 0, got {self.draw_temperature_scale}")
        if self.draw_support < 0:
            raise EagleError(f"draw_support must be >= 0 (0: the whole draft vocabulary), got {self.draw_support}")


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """Classic speculative sampling with a separate draft model (method ``sd``).

    ``lenience`` = 1.0 is exact (lossless). Values below 1 accept more drafts, which
    changes the output distribution (lossy, documented as such). ``draft_vocab``: the draft model's
    head computes the logits of its tokenizer's most frequent tokens, this many, where a frequency table
    for that tokenizer is known (``eagle.drafting.token_frequencies``); 0: the whole vocabulary.
    ``draft_confidence``: a chain stops after a draft token the draft model gives less than this
    probability (up to ``gamma`` tokens; its own probabilities alone decide, so sampling stays exact)."""

    gamma: int = 8
    lenience: float = 1.0
    adaptive_gamma: bool = False
    max_gamma: int = 12
    draft_vocab: int = 32768
    draft_confidence: float = 0.8

    def __post_init__(self) -> None:
        check_int("gamma", self.gamma)
        check_int("max_gamma", self.max_gamma)
        check_int("draft_vocab", self.draft_vocab)
        if self.draft_vocab < 0:
            raise EagleError(f"draft_vocab must be >= 0 (0: the whole vocabulary), got {self.draft_vocab}")
        check_float("lenience", self.lenience)
        check_float("draft_confidence", self.draft_confidence)
        if not 0.0 <= self.draft_confidence < 1.0:
            raise EagleError(f"draft_confidence must be in [0, 1), got {self.draft_confidence}")
        check_bool("adaptive_gamma", self.adaptive_gamma)
        if self.gamma < 1:
            raise EagleError(f"gamma must be >= 1, got {self.gamma}")
        if not 0.0 < self.lenience <= 1.0:
            raise EagleError(f"lenience must be in (0, 1], got {self.lenience}")
        if self.max_gamma < self.gamma:
            raise EagleError(f"max_gamma ({self.max_gamma}) must be >= gamma ({self.gamma})")


@dataclasses.dataclass(frozen=True)
class PromptLookupConfig:
    """Prompt lookup decoding (method ``pld``): match the last n-gram in the context and
    propose the tokens that followed its most recent earlier occurrence, at most
    ``num_draft_tokens`` of them. ``auto_length``: only as many as are expected to pay for the rows
    they add to the target's forward, from its measured cost and how often the target agreed
    with lookup drafts so far (``eagle.decoding.proposers.PromptLookup``); off: all of them."""

    max_ngram: int = 3
    min_ngram: int = 1
    num_draft_tokens: int = 8
    auto_length: bool = True

    def __post_init__(self) -> None:
        check_bool("auto_length", self.auto_length)
        for name in ("max_ngram", "min_ngram", "num_draft_tokens"):
            check_int(name, getattr(self, name))
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise EagleError(f"need 1 <= min_ngram <= max_ngram, got {self.min_ngram}, {self.max_ngram}")
        if self.num_draft_tokens < 1:
            raise EagleError(f"num_draft_tokens must be >= 1, got {self.num_draft_tokens}")


@dataclasses.dataclass(frozen=True)
class SuffixConfig:
    """Suffix drafts (method ``suffix``; ``+suffix`` adds them to another method's trees): the
    continuations of the context's longest suffix found in the current request, in earlier
    outputs (at most ``history_tokens`` kept, the oldest evicted) and in a corpus (at most
    ``corpus_tokens``; a bigger one is refused), matched on at most ``max_pattern`` tokens, each
    continuation at most ``max_depth`` tokens and ``max_spec_factor`` times the match long; a
    token followed less than ``min_token_prob`` of the time is left out. A draft node's
    probability is how often its path followed the match: count / (occurrences + ``prior``),
    so a pattern seen once proposes with 1 / (1 + prior); ``max_nodes`` per source and round."""

    history_tokens: int = 1_000_000
    corpus_tokens: int = 10_000_000
    max_pattern: int = 32
    max_depth: int = 16
    max_spec_factor: float = 2.0
    min_token_prob: float = 0.1
    prior: float = 1.0
    max_nodes: int = 24

    def __post_init__(self) -> None:
        for name in ("history_tokens", "corpus_tokens", "max_pattern", "max_depth", "max_nodes"):
            check_int(name, getattr(self, name), 1)
        for name in ("max_spec_factor", "min_token_prob", "prior"):
            check_float(name, getattr(self, name))
        if self.max_pattern < 2:
            raise EagleError(f"max_pattern must be >= 2, got {self.max_pattern}")
        if not 0.0 <= self.min_token_prob < 1.0:
            raise EagleError(f"min_token_prob must be in [0, 1), got {self.min_token_prob}")
        if self.max_spec_factor <= 0 or self.prior < 0:
            raise EagleError("max_spec_factor must be > 0 and prior >= 0")


def option_configs(total_tokens: int | str | None = None, depth: int | None = None, top_k: int | None = None,
                   choices: list[list[int]] | None = None, lookup_tokens: int | None = None,
                   sampled_tree: bool | None = None, draw_temperature_scale: float | None = None,
                   draw_support: int | None = None, gamma: int | None = None, lenience: float | None = None,
                   adaptive_gamma: bool | None = None, draft_vocab: int | None = None,
                   draft_confidence: float | None = None,
                   **prompt_lookup: Any) -> tuple[TreeConfig, SpeculativeConfig, PromptLookupConfig]:
    """``EagleModel.from_pretrained``'s option names -> the configs they make (None: the default),
    checked without loading anything."""
    tree = {k: v for k, v in dict(total_tokens=total_tokens, depth=depth, top_k=top_k,
                                  choices=choices, lookup_tokens=lookup_tokens,
                                  sampled_tree=sampled_tree, draw_temperature_scale=draw_temperature_scale,
                                  draw_support=draw_support).items()
            if v is not None}
    spec = {k: v for k, v in dict(gamma=gamma, lenience=lenience, adaptive_gamma=adaptive_gamma,
                                  draft_vocab=draft_vocab, draft_confidence=draft_confidence).items()
            if v is not None}
    try:
        pl = PromptLookupConfig(**prompt_lookup)
    except TypeError as exc:
        raise EagleError(f"unknown option: {exc}") from exc
    return TreeConfig(**tree), SpeculativeConfig(**spec), pl


DTYPE_NAMES = ("auto", "float32", "bfloat16", "float16")


def check_optional(check: Any, name: str, value: Any) -> Any:
    """``value`` checked by ``check(name, value)``, or None."""
    return None if value is None else check(name, value)


@dataclasses.dataclass(frozen=True)
class LoadOptions:
    """``EagleModel.from_pretrained``'s tuning options under their API names, as the config keys of
    eagle-generate, eagle-bench and eagle-serve (``--config FILE``, ``--set KEY=VALUE``); None: the
    default. ``top_k`` is the tree's (``TreeConfig.top_k``), not sampling's ``--top-k``;
    ``drafter_dtype``: one of ``DTYPE_NAMES``; ``drafter_quant``: "auto", "none" or a block format;
    ``suffix``: suffix drafts' knobs, a mapping of ``SuffixConfig``'s keys (``--set 'suffix={max_depth: 24}'``),
    kept as the ``SuffixConfig`` it makes."""

    depth: Optional[int] = None
    top_k: Optional[int] = None
    lookup_tokens: Optional[int] = None
    sampled_tree: Optional[bool] = None
    draw_temperature_scale: Optional[float] = None
    draw_support: Optional[int] = None
    gamma: Optional[int] = None
    lenience: Optional[float] = None
    adaptive_gamma: Optional[bool] = None
    draft_vocab: Optional[int] = None
    draft_confidence: Optional[float] = None
    drafter_dtype: str = "auto"
    drafter_quant: str = "auto"
    cuda_graphs: Optional[bool] = None
    device_rounds: Optional[bool] = None
    int8_activations: Optional[bool] = None
    suffix: Optional[SuffixConfig] = None

    def __post_init__(self) -> None:
        from eagle.inputs import FORMATS

        if self.suffix is not None and not isinstance(self.suffix, SuffixConfig):
            object.__setattr__(self, "suffix", from_dict(SuffixConfig, self.suffix, "suffix"))

        for name in ("sampled_tree", "adaptive_gamma", "cuda_graphs", "device_rounds", "int8_activations"):
            check_optional(check_bool, name, getattr(self, name))
        for name in ("depth", "top_k", "lookup_tokens", "draw_support", "gamma", "draft_vocab"):
            check_optional(check_int, name, getattr(self, name))
        for name in ("draw_temperature_scale", "lenience", "draft_confidence"):
            check_optional(check_float, name, getattr(self, name))
        if self.drafter_dtype not in DTYPE_NAMES:
            raise EagleError(f"drafter_dtype must be one of {', '.join(DTYPE_NAMES)}, got {self.drafter_dtype!r}")
        quants = ("auto", "none") + tuple(FORMATS)
        if self.drafter_quant not in quants:
            raise EagleError(f"drafter_quant must be one of {', '.join(quants)}, got {self.drafter_quant!r}")


def read_configs(path: str | None, overrides: Sequence[str], classes: Sequence[type]) -> tuple[list[Any], set[str]]:
    """A command's config: the YAML or JSON file ``path`` (optional) with ``KEY=VALUE`` overrides
    (``parse_overrides``), split among the dataclasses ``classes`` (their field names are disjoint) ->
    (one instance per class, the keys given). An unknown key is one error naming every allowed key."""
    import yaml

    if path and not Path(path).is_file():
        raise EagleError(f"config file not found: {path}")
    try:
        data = (yaml.safe_load(Path(path).read_text()) or {}) if path else {}
    except yaml.YAMLError as exc:
        raise EagleError(f"config file {path} is not YAML or JSON: {str(exc).splitlines()[0]}") from None
    if not isinstance(data, Mapping):
        raise EagleError(f"config file {path} must hold a mapping of config keys, got {type(data).__name__}")
    data = {**data, **parse_overrides(overrides)}
    fields = [{f.name for f in dataclasses.fields(cls)} for cls in classes]
    allowed = set().union(*fields)
    unknown = sorted(set(data) - allowed, key=str)
    if unknown:
        raise EagleError(f"unknown config key(s) {', '.join(repr(k) for k in unknown)}; "
                         f"allowed: {', '.join(sorted(allowed))}")
    return [from_dict(cls, {k: v for k, v in data.items() if k in names}, where=path or "--set")
            for cls, names in zip(classes, fields)], set(data)
