"""``EagleModel``: the Python API. Load a target (and a drafter or a draft model) once, then
``generate`` with any method in the same process so speedups are measured like for like."""

from __future__ import annotations

import atexit
import dataclasses
import functools
import weakref
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from eagle.config import (PromptLookupConfig, SamplingConfig, SpeculativeConfig, SuffixConfig, TreeConfig, check_bool,
                          check_int, from_dict, option_configs)
from eagle.decoding.device_rounds import (MAX_TREE, DeviceTreeDrafter, device_decode_loop,
                                          device_rounds_apply, draw_temperature)
from eagle.decoding.loop import GenerationResult, decode_loop, static_greedy_loop
from eagle.decoding.proposers import DraftModel, EagleDrafter, NoDraft, PromptLookup, Proposer, SuffixDrafts, SuffixLookup
from eagle.decoding.sampling import make_generator
from eagle.decoding.tree_sizing import Sizing
from eagle.drafting import draft_lm
from eagle.drafting.drafter import Drafter, DrafterConfig, DrafterFile, LeanDrafter
from eagle.drafting.suffix import SuffixStore, read_corpus
from eagle.drafting.token_frequencies import DraftVocab
from eagle.errors import EagleError
from eagle.inputs import METHODS
from eagle.runtime import kv_cache
from eagle.runtime.quant_blocks import FORMATS
from eagle.runtime.decoder import cpu_has_fast_bf16, packed_copy
from eagle.runtime.kernels import stream_linear_op
from eagle.runtime.target import DEFAULT_TARGET, Target, load_target, spec_gguf

SHIPPED = Path(__file__).parent / "shipped" / "drafters"  # the default drafter per target
SHIPPED_BY_KIND = {"eagle": SHIPPED, "eagle3": Path(__file__).parent / "shipped" / "eagle3_drafters"}


def _shipped(root: Path, target_name: str, marker: str) -> Path | None:
    """``root/<name>`` when it holds ``marker``. Only a bare name (like ``smollm2-135m-instruct``)
    can have one: a folder, file or hub id never does (an absolute path joined onto ``root``
    would otherwise point at the target's own folder)."""
    name = target_name.lower()
    if not name or len(Path(name).parts) != 1 or Path(name).is_absolute() or name in (".", ".."):
        return None
    path = root / name
    return path if (path / marker).is_file() else None


def shipped_drafter(target_name: str, kind: str = "eagle") -> Path | None:
    """The drafter of ``kind`` ("eagle": the default one; "eagle3") shipped with the package for a
    named target, if any."""
    return _shipped(SHIPPED_BY_KIND[kind], target_name, "model.safetensors")


def shipped_drafter_for(target: Target, kind: str = "eagle") -> Path | None:
    """The drafter of ``kind`` shipped for a target with ``target``'s tokenizer (by fingerprint), hidden
    size and vocabulary, whatever the target is called (a ``.gguf`` file or folder of a shipped target's model)."""
    import json

    for path in sorted(SHIPPED_BY_KIND[kind].glob("*/config.json")):
        try:
            info = json.loads(path.read_text()).get("target", {})
        except (OSError, ValueError):
            continue
        if (info.get("tokenizer_fingerprint") == target.tokenizer_fingerprint
                and info.get("hidden_size") == target.hidden_size and info.get("vocab_size") == target.vocab_size
                and (path.parent / "model.safetensors").is_file()):
            return path.parent
    return None


def shipped_drafter_of_kind(spec: Any, target: Target, target_name: str | None = None) -> Path | None:
    """When ``spec`` names a drafter kind ("eagle", "eagle3") rather than a folder: the drafter of that
    kind shipped for ``target`` (by ``target_name``, else by tokenizer fingerprint), an error when none
    is; otherwise None (``spec`` is a folder or a ``Drafter``)."""
    if not (isinstance(spec, str) and spec in SHIPPED_BY_KIND and not Path(spec).exists()):
        return None
    path = (shipped_drafter(target_name, spec) if target_name else None) or shipped_drafter_for(target, spec)
    if path is None:
        raise EagleError(f"no {spec} drafter is shipped for target {target.name}: pass a drafter folder")
    return path


def shipped_draft_lm(target_name: str) -> Path | None:
    """The draft LM shipped with the package for a named target, if any."""
    return _shipped(draft_lm.SHIPPED, target_name, draft_lm.MARKER)


@dataclasses.dataclass
class Round:
    """One decoding round of a ``Stream``: ``tokens``, the new token ids it accepted (the drafts the
    target agreed with, then the target's own token); ``drafted``, how many of them were drafts (a
    round cut short by EOS or the token limit counts its last token as the target's); ``spans``,
    the new text it shows, in order, as (text, drafted) pieces: drafted text comes from accepted
    drafts. Text of an incomplete multi-byte character waits for a later round."""

    tokens: list[int]
    drafted: int
    spans: list[tuple[str, bool]]

    @property
    def text(self) -> str:
        return "".join(text for text, _ in self.spans)


class Stream:
    """Iterator of text pieces as tokens are accepted; ``result`` is set once it is exhausted.
    ``rounds()`` iterates per decoding round instead, telling drafted text from the target's.
    ``close()`` (or leaving a ``with`` block) abandons the generation; one still open when the
    interpreter exits is closed then, before the modules it runs in are torn down."""

    def __init__(self, events: Iterator, tokenizer: Any) -> None:
        self.events, self.tokenizer = events, tokenizer
        self.result: GenerationResult | None = None
        _OPEN_STREAMS.add(self)

    def close(self) -> None:
        """Stop the generation (its generator's clean-up runs now); a closed stream yields nothing more."""
        _OPEN_STREAMS.discard(self)
        close = getattr(self.events, "close", None)
        if close is not None:
            close()

    def __enter__(self) -> "Stream":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __iter__(self) -> Iterator[str]:
        for round_ in self.rounds():
            if round_.spans:
                yield round_.text

    def rounds(self) -> Iterator[Round]:
        """One ``Round`` per target forward (its ``spans`` may be empty); sets ``result`` at the end."""
        text = RoundText(self.tokenizer)
        for event in self.events:
            if isinstance(event, GenerationResult):
                self.result = event
                _OPEN_STREAMS.discard(self)
                break
            yield text.feed(event)


class RoundText:
    """Incremental detokenizing of one generation: ``feed(tokens)`` takes a round's accepted token
    ids (drafts first, the target's own token last) and returns its ``Round``; ``tokens`` holds all
    fed so far."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer, self.tokens, self.shown = tokenizer, [], ""

    def feed(self, event: list[int]) -> Round:
        tokens, shown = self.tokens, self.shown
        drafted = len(event) - 1
        before = shown
        if drafted:  # the text up to the target's own token: where the drafted text ends
            before = self.tokenizer.decode(tokens + event[:drafted], skip_special_tokens=True)
        tokens.extend(event)
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # an incomplete multi-byte character: wait for the rest
            return Round(list(event), drafted, [])
        if len(text) <= len(shown):
            self.shown = text
            return Round(list(event), drafted, [])
        new = text[len(shown):]
        cut = 0
        if drafted and before.startswith(shown) and text.startswith(before):
            cut = len(before) - len(shown)
        spans = [(piece, flag) for piece, flag in ((new[:cut], True), (new[cut:], False)) if piece]
        self.shown = text
        return Round(list(event), drafted, spans)


_OPEN_STREAMS: "weakref.WeakSet[Stream]" = weakref.WeakSet()


@atexit.register
def _close_open_streams() -> None:
    """A generation abandoned mid-way is a suspended generator that runs under ``torch.inference_mode``;
    finalized during interpreter shutdown, torch's wrapper would fail on its torn-down modules."""
    for stream in list(_OPEN_STREAMS):
        stream.close()


def default_drafter_dtype(target: Target) -> torch.dtype:
    """bf16 for an fp32 target on a CPU that multiplies bf16 natively (oneDNN: AVX512-BF16, AMX):
    drafting is memory-bound there and bf16 halves its bytes. Else the target's."""
    if target.device.type == "cpu" and target.dtype == torch.float32 and cpu_has_fast_bf16():
        return torch.bfloat16
    return target.dtype


def default_drafter_quant(target: Target) -> str | None:
    """"q8_0" for an fp32 target on a CPU where the compiled kernels run: a drafter call reads its
    weights again after each target forward has pushed them out of the caches, and 8-bit codes are
    1.125 bytes a weight against bf16's 2, at the same accepted length. Else None (no quantization)."""
    if target.device.type == "cpu" and target.dtype == torch.float32 and stream_linear_op() is not None:
        return "q8_0"
    return None


def open_drafter(folder: str | Path, target: Target) -> Drafter | DrafterFile:
    """The drafter in ``folder`` for ``target``: for an fp32 target on a CPU a ``DrafterFile`` (its inference copy
    read from the file, the fp32 module only when asked for) where the folder is in eagle's format, else the
    loaded ``Drafter``."""
    on_cpu = target.device.type == "cpu" and target.dtype == torch.float32
    return (DrafterFile.open(folder, target) if on_cpu else None) or Drafter.from_pretrained(folder, target=target)


@dataclasses.dataclass
class DeferredDraftLM:
    """The draft LM shipped for a target, read on first use: only ``sd`` needs it, and loading it with
    every model doubled the default target's memory (``EagleModel.draft_model`` may hold one)."""

    path: Path
    target: Target
    model: Any = None

    def load(self) -> Any:
        if self.model is None:
            self.model = draft_lm.load(self.path, self.target)
        return self.model


class EagleModel:
    """A target with optional drafter (EAGLE methods) and draft model (``sd``)."""

    def __init__(self, target: Target, drafter: Drafter | DrafterFile | None = None, draft_model: Any = None,
                 tree: TreeConfig | None = None, speculative: SpeculativeConfig | None = None,
                 prompt_lookup: PromptLookupConfig | None = None, drafter_dtype: torch.dtype | None = None,
                 drafter_quant: str | None = None, device_rounds: bool | None = None,
                 suffix: SuffixStore | SuffixConfig | None = None, suffix_grafts: bool = False) -> None:
        """``drafter_dtype``: what the drafter and the draft model compute in (default
        ``default_drafter_dtype``). ``drafter_quant``: the EAGLE drafter's weights rounded to a block
        format of ``eagle.runtime.quant_blocks.FORMATS`` and computed in fp32, or "none" (default
        ``default_drafter_quant``, unless ``drafter_dtype`` is given). They only propose; every token
        is still the target's, whatever their precision (``sd`` accepts against the draft
        probabilities it really sampled from). ``device_rounds``: ``eagle-tree``/``eagle-chain`` rounds
        drafted, verified and accepted on the device with one host read each
        (``eagle.decoding.device_rounds``; default: on CUDA, where the tree options allow it: ``host_only``;
        ``True`` where they do not is an error when such a round is asked for). ``drafter``: a
        module, or a ``DrafterFile`` (what ``from_pretrained`` opens for an fp32 target on a CPU): the inference
        copy is then read from the file and the fp32 module only when ``drafter`` is asked for.
        ``suffix``: where method ``suffix`` (and, with ``suffix_grafts``, every drafting method's trees)
        takes suffix drafts from beyond the request: a ``SuffixStore`` (earlier outputs, a corpus), or the
        ``SuffixConfig`` of one made on first use (default: ``SuffixConfig()``)."""
        self.target, self._drafter, self.draft_model = target, drafter, draft_model
        self.tree = tree or TreeConfig()
        self.speculative = speculative or SpeculativeConfig()
        self.prompt_lookup = prompt_lookup or PromptLookupConfig()
        if drafter_quant is None and drafter_dtype is None:
            drafter_quant = default_drafter_quant(target)
        self.drafter_quant = None if drafter_quant == "none" else drafter_quant
        if self.drafter_quant is not None and self.drafter_quant not in FORMATS:
            raise EagleError(f"unknown drafter quantization {drafter_quant!r}; choose from none, {', '.join(FORMATS)}")
        self.drafter_dtype = drafter_dtype or default_drafter_dtype(target)
        if device_rounds is not None:
            check_bool("device_rounds", device_rounds)
        self.device_rounds_given = device_rounds
        self.device_rounds = target.device.type == "cuda" if device_rounds is None else device_rounds
        self._packed: dict[tuple[int, torch.dtype, str | None], tuple[Any, Any]] = {}
        self._suffix = suffix if suffix is not None else SuffixConfig()
        self.suffix_grafts = check_bool("suffix_grafts", suffix_grafts)
        # what sizing by cost has learned in this model's decoding so far, per kind of round, greedy and sampled
        self._sizing: dict[tuple[str, bool], Sizing] = {}

    @property
    def suffix_store(self) -> SuffixStore:
        """The suffix drafts' earlier outputs and corpus (made on first use from a ``SuffixConfig``)."""
        if isinstance(self._suffix, SuffixConfig):
            self._suffix = SuffixStore(self._suffix)
        return self._suffix

    def with_suffix(self, store: SuffixStore | None = None) -> "EagleModel":
        """This model with suffix drafts grafted onto its drafting methods' trees (``+suffix`` in
        ``eagle-bench``), from ``store`` (default: this model's), sharing weights as ``with_tree`` does."""
        view = self._view(self.tree, self.prompt_lookup)
        view._suffix, view.suffix_grafts = store or self.suffix_store, True
        return view

    @property
    def drafter(self) -> Drafter | None:
        """The EAGLE drafter (a ``DrafterFile``'s module read now if not yet), or None."""
        return self._drafter.load() if isinstance(self._drafter, DrafterFile) else self._drafter

    @property
    def drafter_config(self) -> DrafterConfig | None:
        """The drafter's config (its kind, sizes, target), without reading its weights; None without one."""
        return None if self._drafter is None else self._drafter.config

    @property
    def drafter_source(self) -> str:
        """The folder the drafter was read from ("" for one built in memory or none)."""
        if isinstance(self._drafter, DrafterFile):
            return str(self._drafter.directory)
        return getattr(self._drafter, "source", "")

    def _inference_copy(self, module: Any, dtype: torch.dtype, quant: str | None = None) -> Any:
        """An inference copy in ``dtype`` (a drafter: or quantized to ``quant``), made on first use
        (the weights are read then; build a new ``EagleModel`` after changing them): for the drafter
        a ``LeanDrafter``, for a draft model module its ``module_draft``."""
        key = (id(module), dtype, quant)
        entry = self._packed.get(key)
        if entry is None or entry[0] is not module:
            if isinstance(module, (Drafter, DrafterFile)):
                copy = LeanDrafter(module, None if quant else dtype, quant)
                if self.target.graphs is not None:  # the drafter on static shapes too (graphs on CUDA)
                    from eagle.runtime.cuda_graphs import GraphedDrafter

                    copy = GraphedDrafter(copy, self.target.graphs.cache.capacity, self.target.graphs.capture)
            else:
                copy = module_draft(module, dtype, self.target.tokenizer)
            entry = self._packed[key] = (module, copy)
        return entry[1]

    def _draft_vocab(self, draft: Target) -> DraftVocab | None:
        """The draft model's head on its ``draft_vocab`` most frequent tokens (made once per draft model)."""
        key = (id(draft), None, f"draft_vocab={self.speculative.draft_vocab}")
        entry = self._packed.get(key)
        if entry is None or entry[0] is not draft:
            entry = self._packed[key] = (draft, DraftVocab.of(draft, self.speculative.draft_vocab))
        return entry[1]

    @classmethod
    def from_pretrained(cls, target: str | Target = DEFAULT_TARGET, drafter: str | Path | Drafter | None = None,
                        draft_model: str | Any = None, device: Any = None, dtype: torch.dtype | None = None,
                        total_tokens: int | str | None = None, depth: int | None = None, top_k: int | None = None,
                        choices: list[list[int]] | None = None, lookup_tokens: int | None = None,
                        sampled_tree: bool | None = None, draw_temperature_scale: float | None = None,
                        draw_support: int | None = None, gamma: int | None = None, lenience: float | None = None,
                        adaptive_gamma: bool | None = None, draft_vocab: int | None = None,
                        draft_confidence: float | None = None,
                        drafter_dtype: torch.dtype | None = None, drafter_quant: str | None = None,
                        cuda_graphs: bool | None = None, device_rounds: bool | None = None,
                        int8_activations: bool | None = None, suffix: SuffixConfig | dict | None = None,
                        suffix_corpus: str | None = None, **prompt_lookup: Any) -> "EagleModel":
        """``drafter``: a drafter folder or ``Drafter`` (default: the one shipped for the target,
        if any; "eagle3": the EAGLE-3 drafter shipped for it). ``draft_model`` for ``sd``: a model spec (as for
        targets: loaded by ``load_target``, run by its lean forward with its own cache, a GGUF file's codes kept) or
        a loaded ``Target``, either refused unless its vocabulary and tokenizer are the target's; a draft LM folder
        (``eagle.drafting.draft_lm``) or a transformers module, computed in ``drafter_dtype`` (default: the
        draft LM shipped for the target, if any, read when ``sd`` first runs: ``DeferredDraftLM``).
        Tree options: ``total_tokens`` (int or "auto"), ``depth``, ``top_k``, ``choices`` (an
        EAGLE-1 static tree instead of the dynamic one), ``lookup_tokens`` (prompt-lookup drafts
        grafted onto the tree; 0 turns it off), ``sampled_tree`` (when sampling, draw the children
        from the drafter instead of taking its top-k: ``TreeConfig.sampled_tree``),
        ``draw_temperature_scale``, ``draw_support`` (``TreeConfig``'s); ``sd`` options:
        ``gamma``, ``lenience``, ``adaptive_gamma``, ``draft_vocab``, ``draft_confidence``
        (``SpeculativeConfig``'s); ``pld`` options: ``max_ngram``, ``min_ngram``, ``num_draft_tokens`` (the
        n-gram sizes also apply to ``lookup_tokens``).
        ``drafter_dtype``, ``drafter_quant``: see ``EagleModel``. ``cuda_graphs``: the target and the
        drafter on static shapes replayed as CUDA graphs (``eagle.runtime.cuda_graphs``; default: on CUDA;
        ``True`` on a CPU runs that static path without graphs). ``device_rounds``: see ``EagleModel``.
        ``int8_activations``: the target's products from codes take activations quantized to int8, as llama.cpp's
        do (``eagle.runtime.target.load_target``; default: on for a GGUF target with k-quant matrices). ``suffix``:
        ``SuffixConfig`` (or its keys) of method
        ``suffix``'s drafts; ``suffix_corpus``: a file or folder of text whose continuations they draft too
        (``eagle.drafting.suffix.read_corpus``: tokenized once, cached)."""
        if not isinstance(suffix, SuffixConfig):
            suffix = from_dict(SuffixConfig, suffix, "suffix")
        tree, spec, pl = option_configs(
            total_tokens=total_tokens, depth=depth, top_k=top_k, choices=choices,
            lookup_tokens=lookup_tokens, sampled_tree=sampled_tree, draw_temperature_scale=draw_temperature_scale,
            draw_support=draw_support, gamma=gamma, lenience=lenience, adaptive_gamma=adaptive_gamma,
            draft_vocab=draft_vocab, draft_confidence=draft_confidence, **prompt_lookup)
        tgt = load_target(target, device=device, dtype=dtype, cuda_graphs=cuda_graphs,
                          int8_activations=int8_activations)
        if drafter is None and isinstance(target, str):
            drafter = shipped_drafter(target) or shipped_drafter_for(tgt)
        else:
            drafter = shipped_drafter_of_kind(drafter, tgt, target if isinstance(target, str) else None) or drafter
        if drafter is not None and not isinstance(drafter, Drafter):
            drafter = open_drafter(drafter, tgt)
        elif drafter is not None:
            drafter.check_target(tgt)
            drafter = drafter.to(device=tgt.device, dtype=tgt.dtype).eval()
        if draft_model is None and isinstance(target, str):
            shipped = shipped_draft_lm(target)
            draft_model = None if shipped is None else DeferredDraftLM(shipped, tgt)
        if draft_model is not None and not isinstance(draft_model, (torch.nn.Module, DeferredDraftLM)):
            if not isinstance(draft_model, Target) and draft_lm.is_draft_lm(draft_model):
                draft_model = draft_lm.load(draft_model, tgt)
            else:
                draft_model = load_draft_model(draft_model, tgt)
        store: SuffixStore | SuffixConfig = suffix
        if suffix_corpus is not None:
            corpus, _ = read_corpus(suffix_corpus, tgt.tokenizer, tgt.tokenizer_fingerprint, suffix)
            store = SuffixStore(suffix, corpus)
        return cls(tgt, drafter, draft_model, tree, spec, pl, drafter_dtype, drafter_quant, device_rounds, store)

    def with_tree(self, tree: TreeConfig) -> "EagleModel":
        """This model with other tree options: the same target, drafter and draft model, and the same
        inference copies of their weights (made once, whichever of the two uses them first)."""
        return self._view(tree, self.prompt_lookup)

    def with_prompt_lookup(self, prompt_lookup: PromptLookupConfig) -> "EagleModel":
        """This model with other prompt-lookup options (``pld``'s, and the lookups of trees), sharing its
        weights and their inference copies as ``with_tree`` does."""
        return self._view(self.tree, prompt_lookup)

    def _view(self, tree: TreeConfig, prompt_lookup: PromptLookupConfig) -> "EagleModel":
        view = self._with(self._drafter, tree, prompt_lookup)
        view._packed = self._packed
        return view

    def with_round_size(self, method: str, size: int | str | None) -> "EagleModel":
        """This model, or a view of it whose ``method`` rounds verify at most ``size`` tokens, root included:
        ``eagle-tree``'s trees of ``size`` nodes (``with_tree``; "auto": sized as it decodes), ``pld``'s
        chains of ``size - 1`` drafts, not shortened by ``auto_length`` (``with_prompt_lookup``). The model
        itself for other methods, for ``size`` None and for its own size."""
        lookup = self.prompt_lookup
        if method == "eagle-tree" and size is not None and size != self.tree.total_tokens:
            return self.with_tree(dataclasses.replace(self.tree, total_tokens=size))
        if method == "pld" and size is not None and (lookup.auto_length or size != lookup.num_draft_tokens + 1):
            if not isinstance(size, int) or isinstance(size, bool) or size < 2:
                raise EagleError(f"a pld round's size is its drafts + 1, at least 2; got {size!r}")
            return self.with_prompt_lookup(dataclasses.replace(lookup, auto_length=False, num_draft_tokens=size - 1))
        return self

    def with_drafter(self, drafter: Drafter | DrafterFile | None) -> "EagleModel":
        """This model with another drafter (``open_drafter``'s): the same target, draft model and options."""
        return self._with(drafter, self.tree)

    def _with(self, drafter: Drafter | DrafterFile | None, tree: TreeConfig,
              prompt_lookup: PromptLookupConfig | None = None) -> "EagleModel":
        return EagleModel(self.target, drafter, self.draft_model, tree, self.speculative,
                          prompt_lookup or self.prompt_lookup, self.drafter_dtype, self.drafter_quant or "none",
                          self.device_rounds_given, self.suffix_store, self.suffix_grafts)

    def _cost_sizing(self, kind: str, sampling: SamplingConfig) -> Sizing:
        """What sizing ``kind``'s rounds ("eagle" trees, "pld" chains, "sd"'s gate) by cost has learned in this model's
        decoding so far, greedy or sampled; new for a cost curve measured anew."""
        from eagle.decoding.tree_sizing import cost_curve

        cost = cost_curve(self.target, greedy=sampling.greedy)
        sizing = self._sizing.get((kind, sampling.greedy))
        if sizing is None or sizing.curve != cost:
            sizing = self._sizing[kind, sampling.greedy] = Sizing(cost)
        return sizing

    def _method_tree(self, method: str) -> TreeConfig:
        """The tree options ``method`` drafts with (``eagle-chain``: one branch, no lookup)."""
        if method == "eagle-chain":
            return dataclasses.replace(self.tree, top_k=1, total_tokens=self.tree.levels + 1, choices=None,
                                       lookup_tokens=0)
        return self.tree

    def _device_drafter(self, method: str, sampling: SamplingConfig) -> DeviceTreeDrafter | None:
        """The drafter of ``method``'s device rounds, or None where they do not apply (off, another
        method, no drafter, or tree options only the host path has)."""
        if (not self.device_rounds or method not in ("eagle-tree", "eagle-chain") or self._drafter is None
                or self.suffix_grafts):
            return None
        tree = self._method_tree(method)
        if not device_rounds_apply(tree, sampling):
            return None
        reason = host_only(tree)
        if reason is not None:
            if self.device_rounds_given:
                raise EagleError(f"device_rounds: {reason}")
            return None
        return DeviceTreeDrafter(self._inference_copy(self._drafter, self.drafter_dtype, self.drafter_quant),
                                 self.target, tree.top_k, tree.depth, min(tree.total_tokens, MAX_TREE),
                                 draw_temperature(tree, sampling), tree.draw_support)

    def _proposer(self, method: str, sampling: SamplingConfig, generator: torch.Generator,
                  fixed_total: int | None = None, host_trees: bool = False,
                  draft_caches: Callable[[Any], Any] | None = None) -> Proposer:
        """The proposer of ``method``; ``fixed_total``: the most tree nodes where ``total_tokens`` is
        "auto", sized by the caller instead (``eagle.decoding.serving``); ``host_trees``: trees made from
        host values (``ar``'s, ``pld``'s, a greedy drafter's) on the host, for a caller that moves a round's
        trees to the device at once; ``draft_caches``: drafter -> a cache for it (a pool's slot), where a drafter's
        cache comes from."""
        device = torch.device("cpu") if host_trees else self.target.device
        if method == "ar":
            return NoDraft(device)
        if method == "pld":
            sized = self.prompt_lookup.auto_length and fixed_total is None
            return PromptLookup(self.prompt_lookup, device, self._cost_sizing(method, sampling) if sized else None)
        if method == "suffix":
            sized = fixed_total is None
            return SuffixLookup(self._suffix_drafts(), device, self._cost_sizing(method, sampling) if sized else None)
        if method == "sd":
            if self.draft_model is None:
                raise EagleError("method 'sd' needs a draft model: pass draft_model=... (--draft-model)")
            draft = self.draft_model.load() if isinstance(self.draft_model, DeferredDraftLM) else self.draft_model
            if not isinstance(draft, Target):  # a module: its inference copy; a loaded model spec runs as it is
                draft = self._inference_copy(draft, self.drafter_dtype)
            gated = fixed_total is None  # drafting only while it pays (measured: ``DraftGate``)
            return DraftModel(draft, self.speculative, sampling, generator,
                              suffix=self._suffix_drafts() if self.suffix_grafts else None,
                              sizing=self._cost_sizing(method, sampling) if gated else None,
                              vocab=self._draft_vocab(draft))
        if method in ("eagle-tree", "eagle-chain"):
            if self._drafter is None:
                raise EagleError(f"method {method!r} needs a drafter: pass drafter=... (--drafter)")
            tree = self._method_tree(method)
            if fixed_total is not None and tree.total_tokens == "auto":
                tree = dataclasses.replace(tree, total_tokens=fixed_total)
            sizing = self._cost_sizing("eagle", sampling) if tree.total_tokens == "auto" else None
            drafter = self._inference_copy(self._drafter, self.drafter_dtype, self.drafter_quant)
            return EagleDrafter(drafter, self.target, tree, lookup=self.prompt_lookup, sampling=sampling,
                                generator=generator, sizing=sizing, host_trees=host_trees,
                                new_cache=None if draft_caches is None else functools.partial(draft_caches, drafter),
                                suffix=self._suffix_drafts() if self.suffix_grafts else None)
        raise EagleError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")

    def _suffix_drafts(self) -> SuffixDrafts:
        return SuffixDrafts(self.suffix_store, self.target.max_context + 1)

    def generate(self, prompt: Any, method: str = "ar", max_new_tokens: int = 128, temperature: float = 0.0,
                 top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
                 stream: bool = False) -> GenerationResult | Stream:
        """Generate from ``prompt`` (a string, chat messages, or token ids). Returns a
        ``GenerationResult``, or with ``stream=True`` a ``Stream`` of text pieces."""
        sampling = SamplingConfig(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
        check_int("max_new_tokens", max_new_tokens, 1)
        if not isinstance(method, str) or method not in METHODS:
            raise EagleError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")
        check_bool("stream", stream)
        prompt_ids = self.target.encode_prompt(prompt)
        generator = make_generator(seed)
        device_drafter = self._device_drafter(method, sampling)
        if method == "ar" and sampling.greedy and self.target.graphs is not None:
            events = static_greedy_loop(self.target, prompt_ids, max_new_tokens, method)
        elif device_drafter is not None:
            events = device_decode_loop(self.target, device_drafter, prompt_ids, max_new_tokens, sampling, generator,
                                        method)
        else:
            events = decode_loop(self.target, self._proposer(method, sampling, generator), prompt_ids, max_new_tokens,
                                 sampling, generator, self.speculative, method)
        if stream:
            return Stream(events, self.target.tokenizer)
        *_, result = events
        return result


def host_only(tree: TreeConfig) -> str | None:
    """Why a dynamic tree's options need the host path, or None: device rounds graft no prompt-lookup drafts
    (``lookup_tokens`` > 0) and run one fixed tree size, where ``total_tokens="auto"`` sizes every round from
    the measured cost curve (``eagle.decoding.tree_sizing``), as the host path and the serving engine do."""
    if tree.lookup_tokens > 0:
        return f"device rounds graft no prompt-lookup drafts: set lookup_tokens=0 (it is {tree.lookup_tokens})"
    if not isinstance(tree.total_tokens, int):
        return "device rounds run one fixed tree size: give total_tokens an integer ('auto' sizes each round)"
    return None


def module_draft(module: torch.nn.Module, dtype: torch.dtype, tokenizer: Any) -> Target:
    """A transformers causal LM (a draft LM, a module passed as draft model) as the ``Target`` whose forward
    ``DraftModel`` runs: its ``packed_copy`` in ``dtype``, by the module's own forward with a ``DynamicCache``.
    A model with sliding-window attention is refused (its cache could not be rolled back)."""
    kv_cache.new_cache(module, "draft model")
    copy = packed_copy(module, dtype)
    return Target(model=copy, tokenizer=tokenizer, name="draft model", device=next(copy.parameters()).device,
                  dtype=dtype)


def load_draft_model(spec: str | Target, target: Target) -> Target:
    """A model spec (or a loaded ``Target``) as ``target``'s draft model, loaded by ``load_target`` on the target's
    device and dtype with its own cache (never the target's static-shape runner); a GGUF file in the target's
    numerics (int8 activations when the target has them) and with the target's tokenizer object when both were
    built from the same tokenizer metadata. Refused unless its vocabulary and tokenizer are the target's."""
    int8 = target.int8_activations and not isinstance(spec, Target) and spec_gguf(spec) is not None
    draft = load_target(spec, device=target.device, dtype=target.dtype, cuda_graphs=False, int8_activations=int8,
                        tokenizer_of=target)
    check_same_tokenizer(target, draft)
    return draft


def check_same_tokenizer(target: Target, draft: Target) -> None:
    """Refuse a draft model whose vocabulary or tokenizer is not the target's."""
    if draft.vocab_size != target.vocab_size or draft.tokenizer_fingerprint != target.tokenizer_fingerprint:
        raise EagleError(f"draft model {draft.name} has another vocabulary or tokenizer than the target "
                         f"{target.name} (vocab {draft.vocab_size} vs {target.vocab_size})")
