"""GGUF headers read without tensors, and files eagle cannot run refused before any conversion."""

import time

import numpy as np
import pytest

from eagle import EagleError
from eagle.cache_dir import cache_root
from eagle.runtime.gguf_file import (DEQUANTIZE, KEEP_BLOCKS, TENSOR_TYPES, Skipped, check_gguf, llama3_factors,
                                     llama3_rope_parameters, read_header, tensor_storage)
from eagle.runtime.target import load_target


def write_gguf(path, arch="llama", extra=None, tensors=None, vocab=300):
    """A tiny GGUF file: an architecture, a few hyperparameters, a ``vocab``-token vocabulary (a long
    array) and ``tensors`` {name: (array, raw GGML type or None)} (default: one F32 norm)."""
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_embedding_length(32)
    writer.add_token_list([f"t{i}" for i in range(vocab)])
    for key, value in (extra or {}).items():
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_uint32(key, value)
    write_tensors(writer, tensors or {"output_norm.weight": (np.ones(32, np.float32), None)})
    return path


def write_tensors(writer, tensors) -> None:
    """Add ``tensors`` {name: (array, raw GGML type or None)} to a ``GGUFWriter`` and write its file."""
    for name, (array, raw) in tensors.items():
        writer.add_tensor(name, array, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_the_header_is_read_without_the_long_arrays(tmp_path):
    from gguf import GGMLQuantizationType

    q8 = np.zeros((4, 34), np.uint8)  # 4 rows of one Q8_0 block (32 weights in 34 bytes)
    path = write_gguf(tmp_path / "m.gguf", tensors={"output_norm.weight": (np.ones(32, np.float32), None),
                                                    "blk.0.attn_q.weight": (q8, GGMLQuantizationType.Q8_0)})
    header = read_header(path)
    assert header.architecture == "llama" and header.arch_value("block_count") == 1
    assert header.metadata["tokenizer.ggml.tokens"] == Skipped(300)
    assert [(t.name, t.shape, t.ggml_type) for t in header.tensors] == [
        ("output_norm.weight", (32,), "F32"), ("blk.0.attn_q.weight", (32, 4), "Q8_0")]
    assert check_gguf(path) is not None


def test_the_tokenizer_digest_is_the_tokenizer_metadatas_alone(tmp_path):
    """Files of one vocabulary and architecture have one tokenizer digest whatever their other metadata and chat
    template; another token, another special token id or another architecture gives another digest."""
    digest = lambda name, **kw: read_header(write_gguf(tmp_path / f"{name}.gguf", **kw)).tokenizer_digest
    base = digest("base")
    assert digest("wider", extra={"llama.context_length": 4096}) == base
    assert digest("template", extra={"tokenizer.chat_template": "{{ messages }}"}) == base
    assert digest("longer", vocab=301) != base
    assert digest("eos", extra={"tokenizer.ggml.eos_token_id": 7}) != base
    assert digest("qwen2", arch="qwen2") != base


@pytest.mark.parametrize("arch, extra, raw, message", [
    ("mamba", {}, None, "architecture 'mamba' is not supported"),
    ("llama", {}, "IQ2_XXS", "tensor types without a converter: IQ2_XXS (blk.0.ffn_down.weight)"),
    ("llama", {"llama.expert_count": 8}, None, "mixture of experts (llama.expert_count = 8)"),
    ("gemma3", {"gemma3.final_logit_softcapping": 30.0}, None, "final logit soft-capping"),
    ("qwen2", {"qwen2.attention.sliding_window": 4096}, None, "sliding-window attention in qwen2"),
    ("llama", {"llama.rope.scaling.type": "yarn"}, None, "rope scaling 'yarn'"),
    ("qwen3", {"qwen3.attention.key_length": 128, "qwen3.attention.value_length": 64}, None,
     "keys of 128 and values of 64 dimensions a head"),
])
def test_what_cannot_run_is_refused_in_one_line_before_any_conversion(tmp_path, arch, extra, raw, message):
    from gguf import GGMLQuantizationType

    tensors = None
    if raw is not None:  # one IQ2_XXS block of 256 weights is 66 bytes
        tensors = {"output_norm.weight": (np.ones(32, np.float32), None),
                   "blk.0.ffn_down.weight": (np.zeros((2, 66), np.uint8), GGMLQuantizationType[raw])}
    path = write_gguf(tmp_path / "m.gguf", arch=arch, extra=extra, tensors=tensors)
    start = time.perf_counter()
    with pytest.raises(EagleError) as err:
        check_gguf(path)
    assert time.perf_counter() - start < 2
    assert message in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(EagleError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_target(str(path))
    assert not any((cache_root() / "targets").glob("m-*"))  # nothing was converted


@pytest.mark.parametrize("factors, message", [
    (np.array([1, 3, 2, 5, 8, 8], np.float32), "RoPE frequency factors (rope_freqs.weight) that are not Llama-3"),
    (np.ones(6, np.float16), "rope_freqs.weight is F16 [6], not a vector of F32"),
])
def test_rope_frequency_factors_that_are_not_llama3_scaling_are_refused(tmp_path, factors, message):
    path = write_gguf(tmp_path / "m.gguf", extra={"llama.rope.freq_base": 10000.0},
                      tensors={"output_norm.weight": (np.ones(32, np.float32), None),
                               "rope_freqs.weight": (factors, None)})
    with pytest.raises(EagleError) as err:
        check_gguf(path)
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("theta, dim, factor", [(500000.0, 64, 32.0), (500000.0, 128, 8.0), (10000.0, 128, 4.0)])
def test_the_llama3_rope_parameters_are_found_from_the_factors(theta, dim, factor):
    """The released Llama 3.1/3.2 scalings (and another ramp, fitted) come back from their factors."""
    from tests.runtime.test_gguf_weights import llama3_rope_factors

    found = llama3_rope_parameters(llama3_rope_factors(theta, dim, factor, 1.0, 4.0, 8192), theta)
    assert found == {"rope_type": "llama3", "rope_theta": theta, "factor": factor, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    other = llama3_rope_factors(theta, dim, factor, 2.0, 6.0, 4096)
    fitted = llama3_rope_parameters(other, theta)
    assert fitted is not None and fitted["low_freq_factor"] != 1.0
    assert np.allclose(llama3_factors(theta, dim, factor, **{k: fitted[k] for k in (
        "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}), other, rtol=1e-5)
    assert llama3_rope_parameters(np.ones(dim // 2), theta) is None


def test_damaged_files_are_clear_errors(tmp_path):
    (tmp_path / "bad.gguf").write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 8)
    with pytest.raises(EagleError, match="cannot read GGUF file"):
        check_gguf(tmp_path / "bad.gguf")
    (tmp_path / "text.gguf").write_text("hello")
    with pytest.raises(EagleError, match="not a GGUF file"):
        check_gguf(tmp_path / "text.gguf")


def test_every_accepted_type_has_a_storage_decision():
    kept = {t for t in TENSOR_TYPES if tensor_storage(t) == KEEP_BLOCKS}
    assert kept == {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS"}
    assert all(tensor_storage(t) == DEQUANTIZE for t in set(TENSOR_TYPES) - kept)
    with pytest.raises(ValueError, match="IQ2_XXS"):
        tensor_storage("IQ2_XXS")


def test_named_long_arrays_are_read_in_full(tmp_path):
    from gguf import GGUFWriter

    writer = GGUFWriter(str(tmp_path / "v.gguf"), "gemma3")
    tokens = [f"t{i}" for i in range(100)] + ["▁é", "😀", ""]
    writer.add_token_list(tokens)
    writer.add_token_types([1] * 100 + [4, 3, 6])
    writer.add_token_scores([float(i) for i in range(103)])
    write_tensors(writer, {"output_norm.weight": (np.ones(32, np.float32), None)})
    meta = read_header(tmp_path / "v.gguf", ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type")).metadata
    assert meta["tokenizer.ggml.tokens"] == tokens
    assert meta["tokenizer.ggml.token_type"].tolist() == [1] * 100 + [4, 3, 6]
    assert meta["tokenizer.ggml.scores"] == Skipped(103)
