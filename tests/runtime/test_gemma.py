"""The lean Gemma-3 forward against transformers' Gemma3ForCausalLM, sliding windows included."""

import pytest
import torch
from transformers import DynamicCache

from eagle import EagleModel
from eagle.decoding.tree_mask import tree_attention
from eagle.runtime.masks import attention_bias
from eagle.runtime.gemma import GemmaDecoder, sliding_bias, unsupported_reason

from tests.conftest import prompts, tiny_drafter, tiny_gemma


@pytest.fixture(scope="module")
def gemma():
    return tiny_gemma()


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    """transformers' own logits [T, V] of a whole sequence (its own masks, windows included)."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def test_lean_gemma_matches_transformers_in_prefill_and_decoding_past_the_window(gemma):
    """A 5-token prefill, then 20 one-token steps (the window is 8), against transformers' sequential
    decoding with its own sliding-window cache; and a 20-token prefill against its full forward."""
    assert isinstance(gemma.lean, GemmaDecoder)
    ids = prompts(1, seed=3)[0][:5] + [(7 * i + 3) % 31 + 1 for i in range(20)]
    cache, hf_cache = gemma.new_cache(), DynamicCache(config=gemma.model.config)
    assert any(getattr(layer, "is_sliding", False) for layer in hf_cache.layers)
    ours = [gemma.forward(torch.tensor([ids[:5]]), torch.arange(5)[None], cache).logits[0]]
    with torch.no_grad():
        theirs = [gemma.model(torch.tensor([ids[:5]]), past_key_values=hf_cache, use_cache=True).logits[0]]
        for t in range(5, len(ids)):
            ours.append(gemma.forward(torch.tensor([[ids[t]]]), torch.tensor([[t]]), cache).logits[0])
            theirs.append(gemma.model(torch.tensor([[ids[t]]]), past_key_values=hf_cache, use_cache=True).logits[0])
    assert torch.allclose(torch.cat(ours), torch.cat(theirs), atol=1e-4, rtol=1e-4)
    assert torch.allclose(torch.cat(ours), hf_logits(gemma.model, ids), atol=1e-4, rtol=1e-4)
    prefill = gemma.forward(torch.tensor([ids[:20]]), torch.arange(20)[None], gemma.new_cache()).logits[0]
    assert torch.allclose(prefill, hf_logits(gemma.model, ids[:20]), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("prefix_len", [3, 14, 30])
def test_tree_verification_matches_each_nodes_sequence(gemma, prefix_len):
    """A tree after a prefix shorter or longer than the window: each node's logits equal those of
    transformers' forward over the prefix and the node's root-to-node chain."""
    parents = torch.tensor([-1, 0, 0, 1, 1, 2, 3, 6, 7, 8])  # depths up to 6
    attn = tree_attention(parents)
    prefix = [(5 * i + 2) % 31 + 1 for i in range(prefix_len)]
    tokens = [(3 * i + 4) % 31 + 1 for i in range(len(parents))]
    cache = gemma.new_cache()
    gemma.forward(torch.tensor([prefix]), torch.arange(prefix_len)[None], cache)
    tree = gemma.forward(torch.tensor([tokens]), (prefix_len + attn.depths)[None], cache,
                         attention_bias(attn.mask, prefix_len, torch.float32)).logits[0]
    for node in range(len(tokens)):
        chain = [tokens[j] for j in attn.mask[node].nonzero()[:, 0].tolist()]
        assert torch.allclose(tree[node], hf_logits(gemma.model, prefix + chain)[-1], atol=1e-4, rtol=1e-4), node


def test_sliding_bias_keeps_the_window_of_the_tree_mask():
    """Brute force: a query at position p sees an allowed key at position k iff p - k < window;
    slots out of every query's window are not read."""
    parents = torch.tensor([-1, 0, 1, 1, 3])
    attn = tree_attention(parents)
    past, window = 10, 3
    bias = attention_bias(attn.mask, past, torch.float32)
    positions = (past + attn.depths)[None]
    mask, start = sliding_bias(bias, positions, past, window)
    assert start == past - window + 1 and mask.shape == (1, 1, 5, past + 5 - start)
    key_positions = list(range(past)) + (past + attn.depths).tolist()
    for i in range(5):
        for j in range(start, past + 5):
            allowed = bool(bias[0, 0, i, j] == 0) and int(positions[0, i]) - key_positions[j] < window
            assert bool(mask[0, 0, i, j - start] == 0) == allowed, (i, j)
    assert sliding_bias(None, torch.tensor([[past]]), past, window) == (None, start)


def test_features_and_aux_layers_are_the_models_hidden_states(gemma):
    ids = torch.tensor([prompts(1, seed=4)[0] * 2])
    out = gemma.forward(ids, torch.arange(ids.shape[1])[None], gemma.new_cache(), aux_layers=(0, 2))
    with torch.no_grad():
        ref = gemma.model.model(ids, output_hidden_states=True)
    assert torch.allclose(out.hidden, ref.last_hidden_state, atol=1e-5)
    assert torch.allclose(out.aux, torch.cat([ref.hidden_states[1], ref.hidden_states[3]], -1), atol=1e-5)


def test_features_gemma_lacks_are_named(gemma):
    gemma.model.config.final_logit_softcapping = 30.0
    try:
        assert "final logit softcapping" in unsupported_reason(gemma.model)
    finally:
        gemma.model.config.final_logit_softcapping = None
    assert unsupported_reason(gemma.model) is None


@pytest.fixture(scope="module")
def gemma_model(gemma):
    return EagleModel.from_pretrained(gemma, drafter=tiny_drafter(gemma), total_tokens=12, depth=4, top_k=3)


@pytest.fixture(scope="module")
def gemma_eagle3_model(gemma):
    drafter = tiny_drafter(gemma, kind="eagle3", draft_vocab_size=20, aux_layers=[0, 1, 2])
    return EagleModel.from_pretrained(gemma, drafter=drafter, total_tokens=12, depth=4, top_k=3)


@pytest.mark.slow
@pytest.mark.parametrize("kind, method", [("eagle", "eagle-tree"), ("eagle", "eagle-chain"), ("eagle", "pld"),
                                          ("eagle3", "eagle-tree")])
def test_greedy_matches_ar_past_the_window(request, kind, method):
    """Prompts of 1-12 tokens (plus their repeated halves) and 20 new ones: the generations run past
    the window of 8."""
    model = request.getfixturevalue("gemma_model" if kind == "eagle" else "gemma_eagle3_model")
    gained = 0
    for ids in prompts(8, seed=1):
        ref = model.generate(ids, method="ar", max_new_tokens=20)
        out = model.generate(ids, method=method, max_new_tokens=20)
        assert out.token_ids == ref.token_ids, (method, ids)
        gained += max(out.accept_lengths)
    assert gained > 8  # drafts were really accepted sometimes


def test_ar_matches_transformers_greedy_generate(gemma_model, gemma):
    ids = prompts(3, seed=5)[2]
    ours = gemma_model.generate(ids, method="ar", max_new_tokens=20).token_ids
    with torch.no_grad():
        theirs = gemma.model.generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False,
                                      attention_mask=torch.ones(1, len(ids), dtype=torch.long))[0, len(ids):]
    assert ours == theirs.tolist()


def test_cuda_graphs_are_refused_for_gemma(gemma):
    from eagle.runtime.target import use_cuda_graphs

    assert use_cuda_graphs(gemma, None).graphs is None
    with pytest.raises(Exception, match="lean forward of a Llama-family target"):
        use_cuda_graphs(gemma, True)
