"""GGUF targets streamed from their codes: each code type's products, the loaded model against a transformers
model holding the de-quantized weights, tree rows against single rows, greedy decoding against ``ar``."""

import numpy as np
import pytest
import torch

from eagle import EagleModel
from eagle.decoding.tree_mask import tree_attention
from eagle.runtime.masks import attention_bias
from eagle.runtime import kernels
from eagle.runtime.architectures import lean_decoder
from eagle.runtime.decoder import LeanDecoder
from eagle.runtime.gemma import GemmaDecoder
from eagle.runtime.gguf_weights import GGUFLinear, GGUFMatrix, llama_row_order, load_gguf_model
from eagle.runtime.target import Target

from tests.conftest import prompts, tiny_drafter, word_tokenizer
from tests.runtime.test_gguf_file import write_tensors

STREAMED = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS")
# bytes of a block, weights of a block, offsets of the float16 scales, and a typical |code x sub-scale| (so that
# random codes give weights of about the size asked for)
LAYOUT = {"Q4_0": (18, 32, [0], 8), "Q4_1": (20, 32, [0, 2], 8), "Q5_0": (22, 32, [0], 16),
          "Q5_1": (24, 32, [0, 2], 16), "Q8_0": (34, 32, [0], 64), "Q4_K": (144, 256, [0, 2], 250),
          "Q5_K": (176, 256, [0, 2], 500), "Q6_K": (210, 256, [208], 2000), "Q2_K": (84, 256, [80, 82], 10),
          "Q3_K": (110, 256, [108], 32), "IQ4_NL": (18, 32, [0], 60), "IQ4_XS": (136, 256, [0], 1000)}


def kernels_or_skip():
    module = kernels.cpu_kernels()
    if module is None:
        pytest.skip("the compiled CPU kernels do not build here")
    return module


def random_codes(ggml_type: str, rows: int, in_features: int, rng: np.random.Generator,
                 size: float = 0.05) -> np.ndarray:
    """GGUF rows uint8 [rows, row bytes] of random codes whose weights are about ``size``."""
    block, weights, halves, typical = LAYOUT[ggml_type]
    raw = rng.integers(0, 256, (rows * in_features // weights, block), dtype=np.uint8)
    for offset in halves:
        scale = (rng.uniform(0.5, 1.5, len(raw)) * size / typical * rng.choice([-1, 1], len(raw))).astype(np.float16)
        raw[:, offset:offset + 2] = scale.view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, -1)


def dequantized(raw: np.ndarray, ggml_type: str) -> torch.Tensor:
    from gguf import GGMLQuantizationType, quants

    return torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType[ggml_type]).astype(np.float32))


@pytest.mark.parametrize("ggml_type", STREAMED)
def test_a_loaded_product_has_the_bits_of_the_fp32_kernel_on_the_dequantized_weight(ggml_type):
    """``GGUFLinear`` of one type, 40 rows in one call, with a bias: the outputs of ``stream_linear``
    (16 rows a call) on the weight gguf-py de-quantizes, bit for bit, so a row's result is the same
    whatever rows come with it."""
    module = kernels_or_skip()
    rng = np.random.default_rng(len(ggml_type))
    raw = random_codes(ggml_type, 24, 512, rng)
    weight, bias = dequantized(raw, ggml_type), torch.randn(24)
    linear = GGUFLinear([GGUFMatrix(torch.from_numpy(raw), ggml_type)], bias)
    x = torch.randn(40, 512)
    got = linear(x)
    for start in range(0, 40, 16):
        assert torch.equal(got[start:start + 16], module.stream_linear(x[start:start + 16], weight, bias)), ggml_type
    assert torch.equal(linear(x[7:8]), got[7:8])  # one row alone: the bits it gets among 40
    assert torch.allclose(got.double(), x.double() @ weight.double().T + bias.double(), atol=1e-4)


def test_a_fused_product_of_parts_of_different_types_is_their_products_side_by_side():
    module = kernels_or_skip()
    rng = np.random.default_rng(0)
    types, sizes = ["Q4_K", "Q5_0", "Q8_0"], [16, 8, 12]
    raws = [random_codes(t, n, 256, rng) for t, n in zip(types, sizes)]
    bias = torch.randn(sum(sizes))
    linear = GGUFLinear([GGUFMatrix(torch.from_numpy(r), t) for r, t in zip(raws, types)], bias)
    x = torch.randn(5, 256)
    weight = torch.cat([dequantized(r, t) for r, t in zip(raws, types)])
    assert torch.equal(linear(x), module.stream_linear(x, weight, bias))
    assert linear.describe() == "Q4_K+Q5_0+Q8_0"


def test_embedding_rows_are_gguf_pys_values():
    module = kernels_or_skip()
    rng = np.random.default_rng(1)
    for ggml_type in STREAMED:
        raw = random_codes(ggml_type, 10, 256, rng)
        index = torch.tensor([3, 0, 9, 3])
        got = module.gguf_dequantize_rows(torch.from_numpy(raw), GGUFMatrix(torch.empty(0), ggml_type).type_id, index)
        assert torch.equal(got, dequantized(raw, ggml_type)[index]), ggml_type


def test_llama_row_order_is_transformers_reverse_permutation():
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    processor = LlamaTensorProcessor()
    for rows, heads, kv_heads in ((256, 4, 4), (128, 4, 2)):
        want = processor._reverse_permute_weights(np.arange(rows), heads, kv_heads)
        assert torch.equal(llama_row_order(rows, kv_heads), torch.from_numpy(want))


# ---- a tiny model written as a GGUF file --------------------------------------------------------------------
LLAMA_TYPES = {"attn_q": "Q4_K", "attn_k": "Q5_0", "attn_v": "Q8_0", "attn_output": "Q6_K", "ffn_gate": "Q5_K",
               "ffn_up": "Q4_1", "ffn_down": "Q4_0", "token_embd": "Q5_1", "output": "Q6_K"}
HF_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
            "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
            "ffn_down": "mlp.down_proj"}


def write_model_gguf(path, model, types: dict[str, str], seed: int = 0, extra_tensors: dict | None = None,
                     metadata=None):
    """Write ``model`` (a transformers Llama, Qwen2, Qwen3 or Gemma-3) as a GGUF file whose matrices are random
    codes of ``types`` (per GGUF tensor name) and its norms (and a Qwen2's q/k/v biases) the model's; the model's
    weights are set to what the codes de-quantize to (in transformers' row order), so it is the reference for the
    streamed target. A Llama's or Qwen's hyperparameters go to the metadata as llama.cpp's converter writes them;
    ``extra_tensors`` {name: float32 array} are added as F32; ``metadata(writer)`` adds more keys (a tokenizer)."""
    from gguf import GGMLQuantizationType, GGUFWriter

    cfg = model.config
    gemma, qwen3, qwen2 = cfg.model_type == "gemma3_text", cfg.model_type == "qwen3", cfg.model_type == "qwen2"
    rng = np.random.default_rng(seed)
    writer = GGUFWriter(str(path), "gemma3" if gemma else "qwen3" if qwen3 else "qwen2" if qwen2 else "llama")
    if metadata is not None:
        metadata(writer)
    writer.add_block_count(cfg.num_hidden_layers)
    if qwen3:  # the head width is its own (transformers' reader leaves it at Qwen3Config's default)
        writer.add_key_length(cfg.head_dim)
        writer.add_value_length(cfg.head_dim)
    if not gemma:
        writer.add_context_length(cfg.max_position_embeddings)
        writer.add_embedding_length(cfg.hidden_size)
        writer.add_feed_forward_length(cfg.intermediate_size)
        writer.add_head_count(cfg.num_attention_heads)
        writer.add_head_count_kv(cfg.num_key_value_heads)
        writer.add_rope_dimension_count(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
        writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
        writer.add_vocab_size(cfg.vocab_size)
    tensors = {name: (array.astype(np.float32), None) for name, array in (extra_tensors or {}).items()}

    def matrix(name: str, param: torch.Tensor, heads: int | None = None) -> None:
        ggml_type = types[name.split(".")[-2] if name.startswith("blk.") else name.split(".")[0]]
        raw = random_codes(ggml_type, param.shape[0], param.shape[1], rng)  # rows in transformers' order
        param.copy_(dequantized(raw, ggml_type))
        if heads is not None:  # the file holds llama.cpp's order: file row order[r] is transformers' row r
            from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

            order = LlamaTensorProcessor()._reverse_permute_weights(np.arange(raw.shape[0]), heads, heads)
            stored = np.empty_like(raw)
            stored[order] = raw
            raw = stored
        tensors[name] = (raw, GGMLQuantizationType[ggml_type])

    def norm(name: str, param: torch.Tensor) -> None:
        tensors[name] = ((param.float() + 1 if gemma else param.float()).numpy().copy(), None)

    with torch.no_grad():
        inner = model.model
        matrix("token_embd.weight", inner.embed_tokens.weight)
        if not cfg.tie_word_embeddings:
            matrix("output.weight", model.lm_head.weight)
        norm("output_norm.weight", inner.norm.weight)
        for i, layer in enumerate(inner.layers):
            for name, hf in HF_NAMES.items():
                heads = None
                if not (gemma or qwen3 or qwen2) and name in ("attn_q", "attn_k"):  # llama.cpp permutes a llama's
                    heads = cfg.num_attention_heads if name == "attn_q" else cfg.num_key_value_heads
                matrix(f"blk.{i}.{name}.weight", layer.get_submodule(hf).weight, heads)
                if qwen2 and name in ("attn_q", "attn_k", "attn_v"):
                    tensors[f"blk.{i}.{name}.bias"] = (layer.get_submodule(hf).bias.float().numpy().copy(), None)
            norms = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
            if qwen3:
                norms.update({"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"})
            if gemma:
                norms = {"attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
                         "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
                         "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
            for name, hf in norms.items():
                norm(f"blk.{i}.{name}.weight", layer.get_submodule(hf).weight)
    write_tensors(writer, tensors)
    return path


def streamed_and_reference(tmp_path, model, types, name):
    """(the target loaded from the GGUF file, streamed; the transformers model with the same weights, lean)."""
    path = write_model_gguf(tmp_path / f"{name}.gguf", model, types)
    tokenizer = word_tokenizer(model.config.vocab_size)
    streamed = load_gguf_model(path, model.config, model.generation_config)
    make = lambda m: Target(model=m, tokenizer=tokenizer, name=name, device=torch.device("cpu"),
                            dtype=torch.float32, lean=lean_decoder(m))
    return make(streamed), make(model)


def tiny_llama_pair(tmp_path_factory, vocab_size: int = 48, layers: int = 2):
    """(a tiny random Llama written with ``LLAMA_TYPES`` and streamed from its GGUF codes, the transformers model
    with the de-quantized weights)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    kernels_or_skip()
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=256, intermediate_size=512, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval().requires_grad_(False)
    model.generation_config.eos_token_id = None
    return streamed_and_reference(tmp_path_factory.mktemp("gguf"), model, LLAMA_TYPES, "tiny-llama-gguf")


@pytest.fixture(scope="module")
def llama_pair(tmp_path_factory):
    return tiny_llama_pair(tmp_path_factory)


def test_the_loaded_llama_keeps_codes_and_decodes_with_the_references_bits(llama_pair):
    """Every matrix stays as its codes (the memory of the codes, no fp32 copy), the compiled decoder stack
    runs, and decoding steps give the logits of the transformers model holding the de-quantized weights
    (q and k rows put back in transformers' order) bit for bit; a 20-token prefill (beyond the streamed
    16 rows) closely."""
    streamed, reference = llama_pair
    lean = streamed.lean
    assert isinstance(lean, LeanDecoder) and lean.stack is not None
    for layer in lean.layers:  # Q4_0 read into block codes, the other types streamed from their GGUF rows
        assert all(isinstance(lin, GGUFLinear) for lin in (layer.qkv, layer.o, layer.gate_up))
        assert layer.down.encoded is not None and layer.down.weight is None and layer.down.plain_weight is None
    assert isinstance(lean.head, GGUFLinear) and "GGUF codes" in lean.kernel_choice()
    assert streamed.model.nbytes() < 0.4 * sum(p.numel() * 4 for p in reference.model.parameters())
    ids = prompts(1, vocab_size=48, seed=2)[0][:6] + [5, 17, 40, 2, 9, 33, 21, 8, 1, 44, 12, 30, 3, 6]
    caches = streamed.new_cache(), reference.new_cache()
    outs = [t.forward(torch.tensor([ids[:4]]), torch.arange(4)[None], c).logits for t, c in zip(llama_pair, caches)]
    assert torch.equal(*outs)
    for pos in range(4, 12):
        outs = [t.forward(torch.tensor([[ids[pos]]]), torch.tensor([[pos]]), c).logits
                for t, c in zip(llama_pair, caches)]
        assert torch.equal(*outs), pos
    with torch.no_grad():
        hf = reference.model(torch.tensor([ids])).logits[0]
    prefill = streamed.forward(torch.tensor([ids]), torch.arange(len(ids))[None], streamed.new_cache()).logits[0]
    assert torch.allclose(prefill, hf, atol=1e-4, rtol=1e-4)


def with_int8_activations(target: Target) -> Target:
    """The same loaded weights with int8 activations (``lean_decoder(..., int8_activations=True)``)."""
    return Target(model=target.model, tokenizer=target.tokenizer, name=target.name + "-int8", device=target.device,
                  dtype=target.dtype, lean=lean_decoder(target.model, int8_activations=True))


@pytest.mark.parametrize("nodes", [8, 24])
@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("pair", ["llama_pair", "gemma_pair", "qwen3_pair"])
def test_a_tree_row_has_the_bits_of_its_own_sequence(request, pair, int8, nodes):
    """Each node of a tree verified in one forward gets the logits of its own root-to-node sequence, bit for
    bit (Gemma: a prefix longer than the window of 8, so sliding layers mask part of it); with int8 activations
    too, and for trees past the kernels' 16 rows a call."""
    streamed = request.getfixturevalue(pair)[0]
    tree_rows_have_their_own_bits(with_int8_activations(streamed) if int8 else streamed, nodes)


def tree_rows_have_their_own_bits(streamed: Target, nodes: int) -> None:
    parents = torch.tensor([-1, 0, 0, 1, 1, 2, 3, 6] + [(i - 1) // 3 for i in range(8, nodes)])
    attn = tree_attention(parents)
    prefix = [3, 14, 15, 9, 2, 6, 21, 5, 8, 33, 2]
    tokens = [7, 11, 30, 4, 25, 1, 13, 38] + [(7 * i + 3) % 40 for i in range(8, nodes)]
    cache = streamed.new_cache()
    streamed.forward(torch.tensor([prefix]), torch.arange(len(prefix))[None], cache)
    tree = streamed.forward(torch.tensor([tokens]), (len(prefix) + attn.depths)[None], cache,
                            attention_bias(attn.mask, len(prefix), torch.float32)).logits[0]
    for node in range(len(tokens)):
        chain = [tokens[j] for j in attn.mask[node].nonzero()[:, 0].tolist()]
        cache = streamed.new_cache()
        streamed.forward(torch.tensor([prefix]), torch.arange(len(prefix))[None], cache)
        alone = streamed.forward(torch.tensor([chain]), torch.arange(len(prefix), len(prefix) + len(chain))[None],
                                 cache).logits[0, -1]
        assert torch.equal(tree[node], alone), node


@pytest.mark.slow
@pytest.mark.parametrize("pair", ["llama_pair", "qwen3_pair"])
def test_greedy_decoding_is_ar_and_ar_is_the_references(request, pair):
    streamed, reference = request.getfixturevalue(pair)
    model = EagleModel.from_pretrained(streamed, drafter=tiny_drafter(streamed), total_tokens=12, depth=4, top_k=3)
    ref = EagleModel.from_pretrained(reference, drafter=tiny_drafter(reference), total_tokens=12, depth=4, top_k=3)
    for ids in prompts(2, vocab_size=48, seed=4):
        ar = model.generate(ids, method="ar", max_new_tokens=16).token_ids
        assert ar == ref.generate(ids, method="ar", max_new_tokens=16).token_ids
        assert model.generate(ids, method="eagle-tree", max_new_tokens=16).token_ids == ar
        assert model.generate(ids, method="pld", max_new_tokens=16).token_ids == ar


@pytest.fixture(scope="module")
def qwen3_pair(tmp_path_factory):
    """A Qwen3 (per-head q/k RMSNorms, heads wider than hidden / heads) streamed from GGUF codes, and its reference."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    kernels_or_skip()
    cfg = Qwen3Config(vocab_size=48, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=96, max_position_embeddings=256,
                      tie_word_embeddings=True, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg).eval().requires_grad_(False)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.uniform_(0.5, 1.5)
    model.generation_config.eos_token_id = None
    return streamed_and_reference(tmp_path_factory.mktemp("gguf"), model, QWEN3_TYPES, "tiny-qwen3-gguf")


QWEN3_TYPES = {"attn_q": "Q3_K", "attn_k": "Q8_0", "attn_v": "Q6_K", "attn_output": "Q5_0", "ffn_gate": "Q4_K",
               "ffn_up": "Q2_K", "ffn_down": "Q6_K", "token_embd": "Q8_0"}  # Q3_K_M / Q2_K files' low-bit types


def test_the_loaded_qwen3_runs_its_head_norms_in_the_compiled_stack(qwen3_pair):
    """A Qwen3 GGUF target: the compiled decoder stack runs with the per-head norms (decoding steps), torch's
    operations for a prefill past its 16 rows; both give the logits of transformers' Qwen3 closely."""
    streamed, reference = qwen3_pair
    lean = streamed.lean
    assert isinstance(lean, LeanDecoder) and lean.stack is not None and lean.layers[0].q_norm is not None
    for layer in lean.layers:  # the Q3_K q and the Q2_K up projections stay as their codes too
        assert isinstance(layer.qkv, GGUFLinear) and isinstance(layer.gate_up, GGUFLinear)
        assert {part.ggml_type for part in layer.qkv.parts + layer.gate_up.parts} >= {"Q3_K", "Q2_K"}
    ids = [3, 14, 15, 9, 2, 6, 21, 5, 8, 33, 2, 7, 11, 30, 4, 25, 1, 13, 38, 40]
    with torch.no_grad():
        hf = reference.model(torch.tensor([ids])).logits[0]
    prefill = streamed.forward(torch.tensor([ids]), torch.arange(len(ids))[None], streamed.new_cache()).logits[0]
    assert torch.allclose(prefill, hf, atol=1e-4, rtol=1e-4)
    cache = streamed.new_cache()
    streamed.forward(torch.tensor([ids[:8]]), torch.arange(8)[None], cache)
    for pos in range(8, 12):
        step = streamed.forward(torch.tensor([[ids[pos]]]), torch.tensor([[pos]]), cache).logits[0, -1]
        assert torch.allclose(step, hf[pos], atol=1e-4, rtol=1e-4), pos


def test_a_qwen3_gguf_loads_from_its_own_metadata(tmp_path, monkeypatch, qwen3_pair):
    """``load_gguf_target`` on a Qwen3 file: the config from its metadata has the heads' width from
    ``attention.key_length`` (transformers' reader leaves Qwen3Config's default, 128) and the target gives
    transformers' logits."""
    from eagle.runtime.target import load_gguf_target

    monkeypatch.setenv("EAGLE_CACHE", str(tmp_path / "cache"))
    model = qwen3_pair[1].model
    path = write_model_gguf(tmp_path / "qwen3.gguf", model, QWEN3_TYPES)  # the fixture's codes again (same seed)
    target = load_gguf_target(path, "qwen3", tokenizer=word_tokenizer(model.config.vocab_size), int8_activations=False)
    assert target.model.config.model_type == "qwen3" and target.model.config.head_dim == 96
    ids = [3, 14, 15, 9, 2, 6, 21, 5, 8, 33]
    with torch.no_grad():
        hf = model(torch.tensor([ids])).logits[0]
    out = target.forward(torch.tensor([ids]), torch.arange(len(ids))[None], target.new_cache()).logits[0]
    assert torch.allclose(out, hf, atol=1e-4, rtol=1e-4)


GEMMA_TYPES = {"attn_q": "Q5_0", "attn_k": "Q5_0", "attn_v": "Q8_0", "attn_output": "Q4_K", "ffn_gate": "Q5_0",
               "ffn_up": "Q5_0", "ffn_down": "Q6_K", "token_embd": "Q8_0"}


@pytest.fixture(scope="module")
def gemma_pair(tmp_path_factory):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    kernels_or_skip()
    cfg = Gemma3TextConfig(
        vocab_size=40, hidden_size=256, intermediate_size=512, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=1, head_dim=64, query_pre_attn_scalar=48, sliding_window=8,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"], max_position_embeddings=256,
        tie_word_embeddings=True, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(cfg).eval().requires_grad_(False)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0.0, 0.5)
    model.generation_config.eos_token_id = None
    return streamed_and_reference(tmp_path_factory.mktemp("gguf"), model, GEMMA_TYPES, "tiny-gemma-gguf")


def test_the_loaded_gemma_matches_transformers_past_the_window(gemma_pair):
    streamed, reference = gemma_pair
    assert isinstance(streamed.lean, GemmaDecoder) and streamed.lean.compiled is not None
    assert all(isinstance(lin, GGUFLinear) for layer in streamed.lean.layers for lin in layer.matrices())
    ids = [(7 * i + 3) % 39 + 1 for i in range(24)]
    cache = streamed.new_cache()
    ours = [streamed.forward(torch.tensor([ids[:5]]), torch.arange(5)[None], cache).logits[0]]
    ours += [streamed.forward(torch.tensor([[ids[t]]]), torch.tensor([[t]]), cache).logits[0] for t in range(5, 24)]
    with torch.no_grad():
        theirs = reference.model(torch.tensor([ids])).logits[0]
    assert torch.allclose(torch.cat(ours), theirs, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_gemma_greedy_decoding_is_ar_past_the_window(gemma_pair):
    streamed = gemma_pair[0]
    model = EagleModel.from_pretrained(streamed, drafter=tiny_drafter(streamed), total_tokens=12, depth=4, top_k=3)
    for ids in prompts(2, vocab_size=40, seed=6):
        ar = model.generate(ids, method="ar", max_new_tokens=20).token_ids
        assert model.generate(ids, method="eagle-tree", max_new_tokens=20).token_ids == ar
        assert model.generate(ids, method="pld", max_new_tokens=20).token_ids == ar


@pytest.mark.parametrize("family, rope", [("llama", None), ("llama", {"rope_type": "linear", "factor": 2.0}),
                                          ("qwen2", None), ("gemma3_text", None)])
def test_the_rotary_tables_are_the_bits_of_transformers(family, rope):
    """``Rotary`` (which spares the loader transformers' modeling imports) gives the cos and sin of the
    model's own rotary module bit for bit, per Gemma layer type, and Gemma's embedding scale."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from eagle.runtime.gguf_weights import Rotary, rotary_and_scale

    extra = {"rope_scaling": rope} if rope else {}
    if family == "gemma3_text":
        extra = {"head_dim": 16, "layer_types": ["sliding_attention", "full_attention"]}
    cfg = AutoConfig.for_model(family, vocab_size=32, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, **extra)
    model = AutoModelForCausalLM.from_config(cfg)
    rotary, scale = rotary_and_scale(cfg)
    assert isinstance(rotary, Rotary)
    assert scale == getattr(model.model.embed_tokens, "scalar_embed_scale", None)
    positions, x = torch.arange(5000)[None], torch.zeros(1)
    for layer_type in sorted(set(cfg.layer_types)) if family == "gemma3_text" else [None]:
        ours = rotary(x, positions, layer_type)
        theirs = model.model.rotary_emb(x, positions, *([layer_type] if layer_type else []))
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs))


def llama3_rope_factors(theta: float, dim: int, factor: float, low: float, high: float, context: int) -> np.ndarray:
    """``rope_freqs.weight`` as llama.cpp's converter computes it for transformers' "llama3" rope scaling
    (float32 frequencies, a factor per pair)."""
    import math

    factors = []
    for freq in 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)):
        wavelen = 2 * math.pi / freq
        if wavelen < context / high:
            factors.append(1)
        elif wavelen > context / low:
            factors.append(factor)
        else:
            smooth = (context / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(factors, dtype=torch.float32).numpy()


@pytest.mark.parametrize("context", [8192, 64])
def test_a_llama3_gguf_runs_with_its_rope_scaling(tmp_path, context, monkeypatch):
    """A Llama-3 GGUF keeps its rope scaling as frequency factors (``rope_freqs.weight``), which
    transformers' GGUF reader ignores: the loaded target's config has the "llama3" rope parameters that give
    those factors (the released models' ramp, or one fitted to the factors), and its logits are those of a
    transformers Llama with that rope scaling; the same file without the factors is not that model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from eagle.runtime.target import load_gguf_target

    kernels_or_skip()
    monkeypatch.setenv("EAGLE_CACHE", str(tmp_path / "cache"))
    rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": context}
    cfg = LlamaConfig(vocab_size=48, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None,
                      rope_parameters=rope)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval().requires_grad_(False)
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    factors = llama3_rope_factors(10000.0, head_dim, 8.0, 1.0, 4.0, context)
    if context == 64:  # the ramp lies inside this head's frequencies: the factors alone give it
        assert 2 <= int(((factors > 1) & (factors < 8)).sum())
    ids = [3, 14, 15, 9, 2, 6, 21, 5, 8, 33, 2, 7, 11, 30, 4, 25, 1, 13, 38, 40, 17, 12, 19, 44]
    logits = {}
    for name, extra in (("scaled", {"rope_freqs.weight": factors}), ("plain", {})):
        path = write_model_gguf(tmp_path / f"{name}.gguf", model, LLAMA_TYPES, extra_tensors=extra)
        target = load_gguf_target(path, name, tokenizer=word_tokenizer(cfg.vocab_size), int8_activations=False)
        logits[name] = target.forward(torch.tensor([ids]), torch.arange(len(ids))[None], target.new_cache()).logits[0]
        if name == "scaled":
            params = target.model.config.rope_parameters
            assert params["rope_type"] == "llama3" and params["factor"] == 8.0
            if context == 8192:
                assert (params["low_freq_factor"], params["high_freq_factor"]) == (1.0, 4.0)
    with torch.no_grad():
        reference = model(torch.tensor([ids])).logits[0]
    assert torch.allclose(logits["scaled"], reference, atol=1e-4, rtol=1e-4)
    assert (logits["plain"] - reference).abs().max() > 1e-2


@pytest.mark.parametrize("tied", [False, True])
def test_the_dense_conversion_gives_the_models_weights_by_transformers_names(tmp_path, tied):
    """``hf_state_dict`` of a llama GGUF file (every streamed type; q and k rows in llama.cpp's order)
    is the state dict of the model it was written from, whose weights are what the codes de-quantize
    to: names, row order and values exact; a tied file has no ``lm_head.weight``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from eagle.runtime.gguf_file import read_header
    from eagle.runtime.gguf_weights import hf_state_dict

    cfg = LlamaConfig(vocab_size=48, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=tied)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval().requires_grad_(False)
    types = {k: v for k, v in LLAMA_TYPES.items() if not (tied and k == "output")}
    path = write_model_gguf(tmp_path / "tiny.gguf", model, types)
    state = hf_state_dict(path, read_header(path), cfg)
    want = {k: v for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    assert sorted(state) == sorted(want)
    for name, tensor in want.items():
        assert torch.equal(state[name], tensor), name


def test_the_dense_conversion_of_a_qwen3_keeps_its_head_norms(tmp_path, qwen3_pair):
    from eagle.runtime.gguf_file import read_header
    from eagle.runtime.gguf_weights import hf_state_dict

    model = qwen3_pair[1].model
    path = write_model_gguf(tmp_path / "qwen3.gguf", model, QWEN3_TYPES)  # the fixture's codes again (same seed)
    state = hf_state_dict(path, read_header(path), model.config)
    want = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied
    assert sorted(state) == sorted(want) and "model.layers.1.self_attn.k_norm.weight" in state
    for name, tensor in want.items():
        assert torch.equal(state[name], tensor), name


@pytest.mark.slow
@pytest.mark.integration
def test_the_default_targets_conversion_is_transformers_own(tmp_path, monkeypatch):
    """The default target's GGUF converted by ``converted_gguf_dir`` (weights read here, the configs and
    the tokenizer by transformers) loads as the model transformers' own GGUF reader gives."""
    from transformers import AutoModelForCausalLM

    from eagle.runtime.target import converted_gguf_dir, smollm2_gguf_path

    monkeypatch.setenv("EAGLE_CACHE", str(tmp_path))
    path = smollm2_gguf_path()
    ours = AutoModelForCausalLM.from_pretrained(converted_gguf_dir(path), dtype=torch.float32).state_dict()
    theirs = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).state_dict()
    assert sorted(ours) == sorted(theirs)
    for name, tensor in theirs.items():
        assert torch.equal(ours[name], tensor), name


@pytest.mark.parametrize("pair", ["llama_pair", "gemma_pair", "qwen3_pair"])
def test_int8_activations_run_every_coded_product_and_keep_greedy_decoding_ar(request, pair):
    """With int8 activations every product from codes (GGUF rows and block codes, the head included) takes x
    quantized to int8 in the compiled stack: logits within int8's error of the fp32 forward's, not its bits;
    greedy eagle-tree and pld give ar's tokens (ar with the same option)."""
    streamed = request.getfixturevalue(pair)[0]
    int8 = with_int8_activations(streamed)
    lean = int8.lean
    assert lean.int8_activations and int8.int8_activations and not streamed.int8_activations
    assert all(lin.int8 for layer in lean.layers for lin in layer.matrices()) and lean.head.int8
    assert "int8 activations" in lean.kernel_choice() and lean.stack is not None
    vocab = streamed.vocab_size
    ids = [(7 * i + 3) % (vocab - 1) + 1 for i in range(20)]
    outs = []
    for target in (streamed, int8):
        cache = target.new_cache()
        logits = [target.forward(torch.tensor([ids[:6]]), torch.arange(6)[None], cache).logits[0]]
        logits += [target.forward(torch.tensor([[ids[t]]]), torch.tensor([[t]]), cache).logits[0] for t in range(6, 20)]
        outs.append(torch.cat(logits))
    error = (outs[1] - outs[0]).abs().max() / outs[0].abs().max()
    assert 0.001 < error < 0.05, error
    # a batch of two runs torch's layers with the same (Python) products: the compiled stack took int8 too
    x, pos = torch.tensor([ids[:6]] * 2), torch.arange(6)[None].repeat(2, 1)
    torch_layers = int8.forward(x, pos, int8.new_cache()).logits[0]
    assert (torch_layers - outs[1][:6]).abs().max() / outs[0].abs().max() < 1e-5
    model = EagleModel.from_pretrained(int8, drafter=tiny_drafter(int8), total_tokens=12, depth=4, top_k=3)
    ids = prompts(1, vocab_size=vocab, seed=8)[0]
    ar = model.generate(ids, method="ar", max_new_tokens=12).token_ids
    assert model.generate(ids, method="eagle-tree", max_new_tokens=12).token_ids == ar
    assert model.generate(ids, method="pld", max_new_tokens=12).token_ids == ar


def test_a_k_quant_file_takes_int8_activations_by_default(tmp_path, monkeypatch, llama_pair):
    """Loaded without a choice, a GGUF file with k-quant matrices runs with int8 activations (llama.cpp's numerics
    for them), one without k-quants with the float32 products; an explicit choice overrides the default, and where
    the int8 products do not run (the portable kernels) the default is float32."""
    from eagle.runtime.target import load_gguf_target

    monkeypatch.setenv("EAGLE_CACHE", str(tmp_path / "cache"))
    model = llama_pair[1].model
    tokenizer = word_tokenizer(model.config.vocab_size)
    k_quants = write_model_gguf(tmp_path / "k.gguf", model, LLAMA_TYPES)
    blocks = write_model_gguf(tmp_path / "b.gguf", model, {name: "Q8_0" for name in LLAMA_TYPES})
    assert load_gguf_target(k_quants, "k", tokenizer=tokenizer).int8_activations
    assert not load_gguf_target(k_quants, "k", tokenizer=tokenizer, int8_activations=False).int8_activations
    assert not load_gguf_target(blocks, "b", tokenizer=tokenizer).int8_activations
    assert load_gguf_target(blocks, "b", tokenizer=tokenizer, int8_activations=True).int8_activations
    monkeypatch.setenv(kernels.ISA_ENV, "portable")
    kernels.cpu_kernels.cache_clear()
    try:
        assert not load_gguf_target(k_quants, "k", tokenizer=tokenizer).int8_activations
    finally:
        monkeypatch.delenv(kernels.ISA_ENV)
        kernels.cpu_kernels.cache_clear()


def test_int8_activations_are_refused_where_they_cannot_apply(llama_pair, monkeypatch):
    """Without weights kept as codes (a transformers model of random fp32 weights), or without the AVX2/AVX-512
    kernels, asking for int8 activations is an error, not a silent fp32 forward."""
    from eagle.errors import EagleError
    from eagle.runtime.target import load_target

    streamed, reference = llama_pair
    with pytest.raises(EagleError, match="weights kept as codes"):
        lean_decoder(reference.model, int8_activations=True)
    with pytest.raises(EagleError, match="loaded without int8 activations"):
        load_target(streamed, int8_activations=True)
    monkeypatch.setenv(kernels.ISA_ENV, "portable")
    kernels.cpu_kernels.cache_clear()
    try:
        with pytest.raises(EagleError, match="need the compiled AVX2 or AVX-512 kernels"):
            lean_decoder(streamed.model, int8_activations=True)
    finally:
        monkeypatch.delenv(kernels.ISA_ENV)
        kernels.cpu_kernels.cache_clear()


def test_a_model_loaded_for_int8_activations_interleaves_its_layers_k_quant_rows(tmp_path, llama_pair):
    """Loaded for int8 activations (``load_gguf_model(..., interleave=True)``, as ``load_gguf_target`` loads a
    target whose products take them), the layers' and the head's Q4_K and Q6_K matrices are interleaved 8 rows at a
    time, the others kept:
    the same values, the logits of the same int8 products on GGUF's layout within int8's error, a tree row the bits
    of its own sequence, a draft vocabulary's head the whole head's logits, greedy eagle-tree and pld ar's tokens;
    the float32 products refuse interleaved rows."""
    if not kernels.cpu_kernels().int8_activations:
        pytest.skip("no int8 products on this CPU build")
    reference = llama_pair[1].model
    path = write_model_gguf(tmp_path / "llama.gguf", reference, LLAMA_TYPES)
    load = lambda interleave: load_gguf_model(path, reference.config, reference.generation_config,
                                              interleave=interleave)
    model, plain = load(True), load(False)
    attention, up = model.model.layers[0].self_attn, model.model.layers[0].mlp.up_proj.matrix
    q, o = attention.q_proj.matrix, attention.o_proj.matrix
    assert q.interleaved and q.ggml_type == "Q4_K" and o.interleaved and o.ggml_type == "Q6_K"
    assert not up.interleaved and model.head.matrix.interleaved  # Q4_1; the Q6_K head
    for name in ("q_proj", "o_proj"):
        matrix = getattr(attention, name).matrix
        assert torch.equal(matrix.dequantize(), getattr(plain.model.layers[0].self_attn, name).matrix.dequantize())
        assert torch.equal(matrix.rows(torch.tensor([9, 0])), matrix.dequantize()[[9, 0]])
    with pytest.raises(ValueError, match="int8 activations only"):
        lean_decoder(model)
    tokenizer = llama_pair[0].tokenizer
    make = lambda m: Target(model=m, tokenizer=tokenizer, name="tiny-llama-gguf", device=torch.device("cpu"),
                            dtype=torch.float32, lean=lean_decoder(m, int8_activations=True))
    target, layout = make(model), make(plain)
    assert "Q4_Kx8" in target.lean.kernel_choice() and "Q6_Kx8" in target.lean.kernel_choice()
    assert "x8" not in layout.lean.kernel_choice()
    ids = [(7 * i + 3) % 47 + 1 for i in range(20)]
    outs = []
    for t in (target, layout):
        cache = t.new_cache()
        logits = [t.forward(torch.tensor([ids[:6]]), torch.arange(6)[None], cache).logits[0]]
        logits += [t.forward(torch.tensor([[ids[i]]]), torch.tensor([[i]]), cache).logits[0] for i in range(6, 20)]
        outs.append(torch.cat(logits))
    # each product within fp32 rounding of the other layout's (tests/runtime/test_kernels.py), but a rounding that
    # moves one of x's int8 codes in a later layer moves the logits by about 1/127 of that value's share
    assert (outs[0] - outs[1]).abs().max() / outs[1].abs().max() < 0.02
    tree_rows_have_their_own_bits(target, 24)
    ids = torch.tensor([5, 40, 3, 17])  # a draft vocabulary's rows of the head, picked from its groups
    hidden = target.forward(torch.tensor([ids[:3].tolist()]), torch.arange(3)[None], target.new_cache()).hidden[0]
    subset, whole = target.head_subset(ids)(hidden), target.lm_head(hidden)[:, ids]
    assert ((subset - whole).abs().max() / whole.abs().max()) < 1e-5
    eagle = EagleModel.from_pretrained(target, drafter=tiny_drafter(target), total_tokens=12, depth=4, top_k=3)
    for prompt in prompts(2, vocab_size=48, seed=9):
        ar = eagle.generate(prompt, method="ar", max_new_tokens=12).token_ids
        assert eagle.generate(prompt, method="eagle-tree", max_new_tokens=12).token_ids == ar
        assert eagle.generate(prompt, method="pld", max_new_tokens=12).token_ids == ar
