"""A GGUF file's metadata and tensor table, read without its tensors (about a second even with a
262k-token vocabulary), what eagle runs of it, the transformers config it describes (``config_fields``) and
how each tensor type is stored when loaded.

``check_gguf`` refuses a file eagle cannot run before any tensor is converted, with one line naming
what is missing: an architecture without a lean forward, a tensor type without a converter, a
feature the forward lacks (logit soft-capping, mixture of experts, ...). ``tensor_storage`` is the one
place that decides, per GGUF tensor type, whether a tensor is de-quantized to fp32 when loaded or
kept as its raw GGUF blocks, which the compiled kernels multiply from (``STREAMED``:
``eagle.runtime.gguf_weights``)."""

from __future__ import annotations

import dataclasses
import hashlib
import mmap
import struct
from pathlib import Path
from typing import Any

from eagle.errors import EagleError

# the Llama family: transformers model types run by ``eagle.runtime.decoder.LeanDecoder``, and the GGUF architectures
# of the same names (their weights converted by ``gguf_weights.hf_state_dict``)
LLAMA_FAMILY = ("llama", "qwen2", "qwen3")
# GGUF ``general.architecture`` -> the transformers model type eagle's lean forward runs
ARCHITECTURES = {**{name: name for name in LLAMA_FAMILY}, "gemma3": "gemma3_text"}
# GGUF tensor types the loader converts (gguf's de-quantizers; the names of ``gguf.GGMLQuantizationType``)
TENSOR_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
                "IQ4_NL", "IQ4_XS")
DEQUANTIZE, KEEP_BLOCKS = "dequantize", "keep-blocks"
# the types kept as their raw blocks (``stream_linear_gguf`` computes from them); the others are de-quantized
K_QUANTS = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")  # codes in super-blocks of 256 (llama.cpp's "k-quants")
STREAMED = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS")

_MAGIC = b"GGUF"
# value type -> struct format of the fixed-size GGUF value types
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_KEPT_ARRAY = 64  # arrays longer than this are skipped (the vocabulary, merges, scores): their length is kept


@dataclasses.dataclass(frozen=True)
class Skipped:
    """A long metadata array that was not read: its element count."""

    length: int


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """One tensor of the file: ``shape`` in GGUF order (fastest-varying dimension first), ``ggml_type``
    its type's name ("Q4_K", "F32", ...), ``offset`` from the start of the tensor data."""

    name: str
    shape: tuple[int, ...]
    ggml_type: str
    offset: int


@dataclasses.dataclass
class GGUFHeader:
    """``metadata``: key -> value (long arrays as ``Skipped``); ``tensors``: the tensor table;
    ``data_offset``: where the tensor data starts in the file (tensor offsets count from there);
    ``tokenizer_digest``: a hash of the architecture and the stored bytes of every ``tokenizer.*`` entry but the
    chat template (the vocabulary, merges, token types, special ids): two files with equal digests turn text into
    the same ids and back (their chat templates may differ)."""

    version: int
    metadata: dict[str, Any]
    tensors: list[TensorInfo]
    data_offset: int = 0
    tokenizer_digest: str = ""

    @property
    def architecture(self) -> str | None:
        return self.metadata.get("general.architecture")

    def arch_value(self, key: str, default: Any = None) -> Any:
        """``{architecture}.{key}`` from the metadata."""
        return self.metadata.get(f"{self.architecture}.{key}", default)


class _Cursor:
    def __init__(self, buf: Any) -> None:
        self.buf, self.pos = buf, 0

    def unpack(self, fmt: str) -> Any:
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.unpack("<Q")
        self.pos += n
        return bytes(self.buf[self.pos - n:self.pos]).decode("utf-8", errors="replace")

    def skip_strings(self, count: int) -> None:
        for _ in range(count):
            self.pos += 8 + struct.unpack_from("<Q", self.buf, self.pos)[0]

    def array(self) -> Any:
        """An array value read in full: a list of strings, or a numpy array of a fixed-size type."""
        import numpy as np

        item, count = self.unpack("<I"), self.unpack("<Q")
        if item == _STRING:
            out = []
            for _ in range(count):
                out.append(self.string())
            return out
        if item not in _SCALARS:
            return [self.value(item) for _ in range(count)]
        size = struct.calcsize(_SCALARS[item])
        values = np.frombuffer(self.buf, np.dtype(_SCALARS[item]), count, self.pos).copy()
        self.pos += count * size
        return values

    def value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self.unpack(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind != _ARRAY:
            raise ValueError(f"unknown GGUF value type {kind}")
        item, count = self.unpack("<I"), self.unpack("<Q")
        if count <= _KEPT_ARRAY:
            return [self.value(item) for _ in range(count)]
        if item == _STRING:
            self.skip_strings(count)
        elif item in _SCALARS:
            self.pos += count * struct.calcsize(_SCALARS[item])
        else:
            for _ in range(count):
                self.value(item)
        return Skipped(count)


def read_header(path: str | Path, arrays: tuple[str, ...] = ()) -> GGUFHeader:
    """The metadata and tensor table of a GGUF file (versions 2 and 3), no tensor data read. The long
    arrays named in ``arrays`` (e.g. ``tokenizer.ggml.tokens``) are read in full: a list of strings, or a
    numpy array of their fixed-size type; the others are ``Skipped``."""
    from gguf import GGMLQuantizationType

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != _MAGIC:
            raise ValueError("not a GGUF file (no GGUF magic number)")
        cur = _Cursor(buf)
        cur.pos = 4
        version = cur.unpack("<I")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} (eagle reads versions 2 and 3)")
        n_tensors, n_kv = cur.unpack("<Q"), cur.unpack("<Q")
        metadata = {}
        tokenizer = hashlib.sha256()
        for _ in range(n_kv):
            start = cur.pos
            key = cur.string()
            kind = cur.unpack("<I")
            metadata[key] = cur.array() if kind == _ARRAY and key in arrays else cur.value(kind)
            if key.startswith("tokenizer.") and key != "tokenizer.chat_template":
                tokenizer.update(buf[start:cur.pos])
        tokenizer.update(str(metadata.get("general.architecture")).encode())
        tensors = []
        for _ in range(n_tensors):
            name = cur.string()
            shape = tuple(cur.unpack("<Q") for _ in range(cur.unpack("<I")))
            kind = cur.unpack("<I")
            try:
                type_name = GGMLQuantizationType(kind).name
            except ValueError:
                type_name = f"type {kind}"
            tensors.append(TensorInfo(name, shape, type_name, cur.unpack("<Q")))
        alignment = int(metadata.get("general.alignment", 32))
        data_offset = (cur.pos + alignment - 1) // alignment * alignment
    return GGUFHeader(version, metadata, tensors, data_offset, tokenizer.hexdigest()[:16])


def tensor_storage(ggml_type: str) -> str:
    """How the loader stores a tensor of this GGUF type: ``KEEP_BLOCKS`` (its raw GGUF blocks, which the
    compiled kernels multiply from: ``STREAMED``) or ``DEQUANTIZE`` (fp32: the other types of ``TENSOR_TYPES``)."""
    if ggml_type not in TENSOR_TYPES:
        raise ValueError(f"GGUF tensor type {ggml_type} has no converter")
    return KEEP_BLOCKS if ggml_type in STREAMED else DEQUANTIZE


def unsupported_reason(header: GGUFHeader) -> str | None:
    """What eagle lacks to run this file (one line), or None."""
    arch = header.architecture
    if arch not in ARCHITECTURES:
        return (f"architecture {arch!r} is not supported (eagle runs {', '.join(sorted(ARCHITECTURES))})"
                if arch else "no general.architecture in its metadata")
    types = sorted({t.ggml_type for t in header.tensors} - set(TENSOR_TYPES))
    if types:
        examples = {t: next(i.name for i in header.tensors if i.ggml_type == t) for t in types}
        return "tensor types without a converter: " + ", ".join(f"{t} ({examples[t]})" for t in types)
    for key, feature in (("expert_count", "mixture of experts"), ("attn_logit_softcapping", "attention logit soft-capping"),
                         ("final_logit_softcapping", "final logit soft-capping")):
        if header.arch_value(key):
            return f"{feature} ({arch}.{key} = {header.arch_value(key)})"
    if arch != "gemma3" and header.arch_value("attention.sliding_window"):
        return f"sliding-window attention in {arch} ({arch}.attention.sliding_window)"
    rope = header.arch_value("rope.scaling.type")
    if rope not in (None, "none", "linear"):
        return f"rope scaling {rope!r} ({arch}.rope.scaling.type)"
    key, value = header.arch_value("attention.key_length"), header.arch_value("attention.value_length")
    if key is not None and value is not None and key != value:
        return f"keys of {key} and values of {value} dimensions a head ({arch}.attention.key_length, value_length)"
    return None


ROPE_FREQS = "rope_freqs.weight"
# the Llama-3 RoPE parameters of every released Llama 3.1-3.3 (transformers' names), tried before a fit
_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def rope_frequency_factors(path: str | Path, header: GGUFHeader) -> Any:
    """The file's per-pair RoPE frequency factors (``rope_freqs.weight``, float64 numpy [head_dim / 2];
    llama.cpp turns pair i at base^(-2i/d) / factor_i), or None when the file has none. llama.cpp's
    converter writes them for Llama-3 rope scaling instead of metadata; transformers' GGUF reader ignores
    them."""
    import numpy as np

    info = next((t for t in header.tensors if t.name == ROPE_FREQS), None)
    if info is None:
        return None
    if info.ggml_type != "F32" or len(info.shape) != 1:
        raise ValueError(f"{ROPE_FREQS} is {info.ggml_type} {list(info.shape)}, not a vector of F32")
    with open(path, "rb") as f:
        f.seek(header.data_offset + info.offset)
        return np.frombuffer(f.read(4 * info.shape[0]), dtype="<f4").astype(np.float64)


def llama3_factors(theta: float, dim: int, factor: float, low_freq_factor: float, high_freq_factor: float,
                   original_max_position_embeddings: float) -> Any:
    """The frequency factors of transformers' "llama3" rope type: its inverse frequencies are
    base^(-2i/d) / factor_i (numpy float64 [dim / 2])."""
    import numpy as np

    wavelen = 2 * np.pi * theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    context = original_max_position_embeddings
    smooth = (context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    medium = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < context / high_freq_factor, 1.0, np.where(wavelen > context / low_freq_factor,
                                                                         factor, medium))


def llama3_rope_parameters(factors: Any, theta: float) -> dict | None:
    """transformers' ``rope_parameters`` ("llama3") whose inverse frequencies are those of ``factors``
    (``rope_frequency_factors``; relative error under 1e-5), or None when no Llama-3 scaling gives them.
    Only the shape of the smooth ramp is determined by the factors, not the context it was written for:
    the released models' values are tried first, else a ramp fitted at their context length."""
    import numpy as np

    dim, factor = 2 * len(factors), float(factors.max())
    if factor <= 1 or not np.all(factors >= 1 - 1e-6):
        return None
    candidates = [dict(_LLAMA3_ROPE)]
    # the ramp: 1 / f = (1 - s) / factor + s with s linear in the frequency, s = a * freq + b
    ramp = (factors > 1 + 1e-6) & (factors < factor * (1 - 1e-6))
    if ramp.sum() >= 2:
        freq = theta ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)
        smooth = (1 / factors[ramp] - 1 / factor) / (1 - 1 / factor)
        a, b = np.polyfit(freq[ramp], smooth, 1)
        context = _LLAMA3_ROPE["original_max_position_embeddings"]
        if a > 0 > b:  # s = (context * freq / 2 pi - low) / (high - low)
            width = context / (2 * np.pi * a)
            candidates.append({"low_freq_factor": -b * width, "high_freq_factor": (1 - b) * width,
                               "original_max_position_embeddings": context})
    for params in candidates:
        if np.allclose(llama3_factors(theta, dim, factor, **params), factors, rtol=1e-5, atol=0):
            return {"rope_type": "llama3", "rope_theta": float(theta), "factor": factor,
                    "low_freq_factor": float(params["low_freq_factor"]),
                    "high_freq_factor": float(params["high_freq_factor"]),
                    "original_max_position_embeddings": int(params["original_max_position_embeddings"])}
    return None


def config_overrides(path: str | Path, header: GGUFHeader) -> dict[str, Any]:
    """What a transformers config of this file needs beyond what its GGUF reader derives from the
    metadata: ``rope_parameters`` for Llama-3 scaling (from ``rope_freqs.weight``) and ``head_dim`` from
    ``attention.key_length`` (the reader leaves Qwen3's at its config class's default). Raises
    ``ValueError`` for frequency factors eagle cannot express."""
    out: dict[str, Any] = {}
    if header.arch_value("attention.key_length") is not None:
        out["head_dim"] = int(header.arch_value("attention.key_length"))
    factors = rope_frequency_factors(path, header)
    if factors is not None:
        theta = float(header.arch_value("rope.freq_base", 10000.0))
        out["rope_parameters"] = llama3_rope_parameters(factors, theta)
        if out["rope_parameters"] is None:
            raise ValueError(f"RoPE frequency factors ({ROPE_FREQS}) that are not Llama-3 rope scaling")
    return out


# ``{architecture}.{key}`` -> the transformers config field it gives (the names of transformers' GGUF reader)
_CONFIG_KEYS = {"context_length": "max_position_embeddings", "block_count": "num_hidden_layers",
                "feed_forward_length": "intermediate_size", "embedding_length": "hidden_size",
                "rope.freq_base": "rope_theta", "attention.head_count": "num_attention_heads",
                "attention.head_count_kv": "num_key_value_heads", "attention.layer_norm_rms_epsilon": "rms_norm_eps",
                "vocab_size": "vocab_size"}
_ARCH_CONFIG_KEYS = {"llama": {"rope.dimension_count": "head_dim"},
                     "gemma3": {"attention.key_length": "head_dim", "attention.sliding_window": "sliding_window"}}
# config field -> ``tokenizer.ggml.{key}``
_TOKEN_ID_KEYS = {"bos_token_id": "bos_token_id", "eos_token_id": "eos_token_id", "unk_token_id": "unknown_token_id",
                  "pad_token_id": "padding_token_id"}


def config_fields(path: str | Path, header: GGUFHeader) -> dict[str, Any]:
    """The fields of the transformers config of a file eagle runs (``AutoConfig.for_model(**fields)``): model
    type, sizes, heads, rope, norm epsilon, tied LM head (no ``output.weight``), special token ids, the model's
    name, the vocabulary's size (its token count when the metadata has none), read from the metadata as
    transformers' GGUF reader reads them but without decoding the vocabulary, with ``config_overrides``."""
    arch = header.architecture
    fields: dict[str, Any] = {"model_type": ARCHITECTURES[arch],
                              "tie_word_embeddings": all(t.name != "output.weight" for t in header.tensors)}
    if "general.name" in header.metadata:
        fields["_model_name_or_path"] = header.metadata["general.name"]
    for key, field in {**_CONFIG_KEYS, **_ARCH_CONFIG_KEYS.get(arch, {})}.items():
        if header.arch_value(key) is not None:
            fields[field] = header.arch_value(key)
    for field, key in _TOKEN_ID_KEYS.items():
        if f"tokenizer.ggml.{key}" in header.metadata:
            fields[field] = header.metadata[f"tokenizer.ggml.{key}"]
    tokens = header.metadata.get("tokenizer.ggml.tokens")
    if "vocab_size" not in fields and tokens is not None:
        fields["vocab_size"] = tokens.length if isinstance(tokens, Skipped) else len(tokens)
    return {**fields, **config_overrides(path, header)}


def check_gguf(path: str | Path) -> GGUFHeader:
    """The header of a GGUF file eagle can run; else an ``EagleError`` naming what is missing."""
    try:
        header = read_header(path)
    except (OSError, ValueError, struct.error) as exc:
        raise EagleError(f"cannot read GGUF file {path}: {exc}") from None
    reason = unsupported_reason(header)
    if reason is None:
        try:
            config_overrides(path, header)
        except (OSError, ValueError) as exc:
            reason = str(exc)
    if reason is not None:
        raise EagleError(f"cannot run GGUF file {Path(path).name}: {reason}")
    return header


def has_k_quants(header: GGUFHeader) -> bool:
    """Whether any matrix of the file is a k-quant (``K_QUANTS``): the files whose products llama.cpp computes
    against int8 activations, and which ``eagle.runtime.target.load_gguf_target`` runs that way by default."""
    return any(t.ggml_type in K_QUANTS for t in header.tensors)
