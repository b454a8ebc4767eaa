"""Tiny random-initialized targets and drafters, built in the test process (seconds)."""

from __future__ import annotations

import os

import pytest
import torch

from eagle.drafting.drafter import Drafter
from eagle.runtime.architectures import lean_decoder
from eagle.runtime.quant_blocks import block_quantize, decode
from eagle.runtime.target import Target


@pytest.fixture(autouse=True)
def drafting_not_gated_by_timing(request, monkeypatch):
    """"auto" sizing's gate (``DraftGate``) stops drafting where drafting rounds were slower than plain ones on
    this machine's clock: tests expect drafts whatever machine runs them, so the gate always drafts here but in
    tests marked ``timed_gate`` (those of the gate itself, with their own clocks)."""
    if request.node.get_closest_marker("timed_gate") is None:
        monkeypatch.setattr("eagle.decoding.tree_sizing.DraftGate.drafts", lambda self, estimate: True)


def word_tokenizer(vocab_size: int, eos: bool = False):
    """A word-level fast tokenizer over tokens ``t0 .. t{V-1}`` (``t0`` is the EOS when asked)."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t1"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # special tokens match whole words only, so that "t10" is not split into "t1" + "0"
    kwargs = {"eos_token": AddedToken("t0", single_word=True)} if eos else {}
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token=AddedToken("t1", single_word=True), **kwargs)


def test_device() -> torch.device:
    """Where the tiny models live: ``$EAGLE_TEST_DEVICE`` (e.g. ``cuda`` on a GPU machine), else the CPU.
    The same suite then runs the library on that device (float32 everywhere); tests that build
    tensors themselves put them on ``target.device`` (or this device)."""
    return torch.device(os.environ.get("EAGLE_TEST_DEVICE", "cpu"))


def tiny_target(vocab_size: int = 32, seed: int = 0, family: str = "llama", eos: bool = False,
                init_std: float = 0.3, max_positions: int = 256, hidden: int = 32, layers: int = 2,
                lean: bool = True, tied: bool = False) -> Target:
    """A random target. ``init_std`` large makes its distributions peaked (not uniform).
    ``lean``: decode with ``eagle.runtime.decoder.LeanDecoder`` (as ``load_target`` does), else the model's forward."""
    from transformers import AutoConfig, AutoModelForCausalLM

    extra = {"head_dim": 16} if family == "qwen3" else {}  # Qwen3's heads are wider than hidden / heads
    cfg = AutoConfig.for_model(
        family, vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
        initializer_range=init_std, tie_word_embeddings=tied, eos_token_id=0 if eos else None,
        bos_token_id=None, pad_token_id=None, **extra)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).eval().to(test_device())
    with torch.no_grad():  # Qwen3's per-head norms start at 1: random ones, so that a forward without them differs
        for name, p in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.uniform_(0.5, 1.5)
    model.generation_config.eos_token_id = 0 if eos else None
    model.requires_grad_(False)
    return Target(model=model, tokenizer=word_tokenizer(vocab_size, eos), name=f"tiny-{family}-{seed}",
                  device=test_device(), dtype=torch.float32, lean=lean_decoder(model) if lean else None)


def tiny_gemma(vocab_size: int = 32, seed: int = 0, window: int = 8, hidden: int = 32, layers: int = 4,
               init_std: float = 0.3, max_positions: int = 256, lean: bool = True) -> Target:
    """A random Gemma-3 text target: sliding-window layers (``window``) beside full-attention ones
    (every third layer), local and global RoPE (the global one scaled), query_pre_attn_scalar apart
    from head_dim, random (1 + w) norms, tied embedding."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    cfg = Gemma3TextConfig(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=12,
        sliding_window=window, layer_types=["full_attention" if (i + 1) % 3 == 0 else "sliding_attention"
                                            for i in range(layers)],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}},
        max_position_embeddings=max_positions, initializer_range=init_std, tie_word_embeddings=True,
        eos_token_id=None, bos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    model = Gemma3ForCausalLM(cfg).eval().to(test_device())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0.0, 0.5)
    model.generation_config.eos_token_id = None
    model.requires_grad_(False)
    return Target(model=model, tokenizer=word_tokenizer(vocab_size), name=f"tiny-gemma3-{seed}",
                  device=test_device(), dtype=torch.float32, lean=lean_decoder(model) if lean else None)


def tiny_drafter(target: Target, seed: int = 1, **overrides) -> Drafter:
    torch.manual_seed(seed)
    drafter = Drafter.from_target(target, **overrides).eval()
    with torch.no_grad():  # larger weights: a peaked (non-uniform) draft distribution
        for p in drafter.parameters():
            p.mul_(3.0)
    return drafter


@pytest.fixture(autouse=True)
def no_graph_fallbacks(request):
    """A test during which a graph capture fell back to eager running fails (the eager fallback is
    for users; a shape that cannot be captured is a defect), unless marked ``graph_fallback``."""
    from eagle.runtime.cuda_graphs import capture_stats

    before = capture_stats()
    yield
    after = capture_stats()
    if after["fallbacks"] > before["fallbacks"] and request.node.get_closest_marker("graph_fallback") is None:
        pytest.fail(f"{after['fallbacks'] - before['fallbacks']} graph capture(s) fell back to eager running: "
                    + "; ".join(after["errors"][len(before["errors"]):]), pytrace=False)


@pytest.fixture
def fake_capture(monkeypatch):
    """Static functions made during the test are captured by ``eagle.runtime.fake_capture`` (on
    CPU, with the compiled kernels off: a recording cannot replay them): what a CUDA capture would
    refuse raises, and the fallback fails the test. On CUDA the real capture runs."""
    from eagle.runtime import cuda_graphs, kernels
    from eagle.runtime.fake_capture import fake_capture as capture

    if test_device().type == "cuda":  # the real capture is the check
        yield None
        return
    monkeypatch.setenv("EAGLE_CPU_KERNELS", "0")
    kernels.cpu_kernels.cache_clear()
    try:
        with cuda_graphs.capture_with(capture):
            yield capture
    finally:
        monkeypatch.undo()
        kernels.cpu_kernels.cache_clear()


@pytest.fixture(scope="session", autouse=True)
def private_cost_curves(tmp_path_factory):
    """Cost curves measured in tests (tiny targets, a machine busy with tests) go to a temporary
    cache, not the user's; converted real targets and compiled kernels stay shared (links to the
    user's cache)."""
    from eagle.cache_dir import cache_root

    root = tmp_path_factory.mktemp("eagle-cache")
    for name in ("targets", "extensions"):
        shared = cache_root() / name
        shared.mkdir(parents=True, exist_ok=True)
        (root / name).symlink_to(shared, target_is_directory=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EAGLE_CACHE", str(root))
        yield root


@pytest.fixture(scope="session")
def target() -> Target:
    return tiny_target()


@pytest.fixture(scope="session")
def drafter(target: Target) -> Drafter:
    return tiny_drafter(target)


@pytest.fixture(scope="session")
def eagle3_target() -> Target:
    """A target deep enough for EAGLE-3's default aux layers (1, 3, 4 of 8)."""
    return tiny_target(layers=8)


@pytest.fixture(scope="session")
def eagle3_drafter(eagle3_target: Target) -> Drafter:
    """An EAGLE-3 drafter over a 20-token draft vocabulary for ``eagle3_target``."""
    return tiny_drafter(eagle3_target, kind="eagle3", draft_vocab_size=20)


@pytest.fixture(scope="session", params=["eagle", "eagle3"])
def kind_pair(request) -> tuple[Target, Drafter]:
    """(target, drafter) of each drafter kind: the EAGLE-1/2 ``target``/``drafter`` fixtures, then the EAGLE-3 pair."""
    if request.param == "eagle":
        return request.getfixturevalue("target"), request.getfixturevalue("drafter")
    return request.getfixturevalue("eagle3_target"), request.getfixturevalue("eagle3_drafter")


def prompts(n: int, vocab_size: int = 32, seed: int = 0, low: int = 1) -> list[list[int]]:
    """n random token-id prompts of lengths 1..12 (some with repeats, for prompt lookup)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = 1 + i % 12
        ids = torch.randint(low, vocab_size, (length,), generator=gen).tolist()
        out.append(ids + ids[: length // 2])
    return out


def block_quantized(weight: torch.Tensor, bits: int) -> torch.Tensor:
    """``weight`` [N, K] (K a multiple of 32) rounded as llama.cpp quantizes and gguf dequantizes it
    (Q4_1 for bits 4, Q8_0 for bits 8: ``eagle.runtime.quant_blocks.block_quantize``); the fp32 dequantized values."""
    return decode(block_quantize(weight.detach().float().cpu(), bits)).to(weight.device)


def save_tiny_model(root) -> tuple[str, str]:
    """A tiny target saved as a model folder under ``root`` and a drafter folder for it -> (target, drafter)."""
    target = tiny_target()
    target.model.save_pretrained(root / "target")
    target.tokenizer.save_pretrained(root / "target")
    tiny_drafter(target).save_pretrained(root / "drafter")
    return str(root / "target"), str(root / "drafter")
