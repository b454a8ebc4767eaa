"""Training features from the lean forward over a GGUF target's codes, against the transformers model
holding the de-quantized weights; a drafter's loss and its gradient on such a target."""

import json
import random

import pytest
import torch

from eagle.runtime.gguf_weights import GGUFModel
from train.checkpoint import weights_digest
from train.features import OnlineFeatures, collate, compute_features
from train.main import TrainConfig, build_student, frozen_head
from train.packing import collate_packed, packed_features
from eagle.runtime.target import model_features

from tests.runtime.test_gguf_weights import gemma_pair, tiny_llama_pair  # noqa: F401 (a fixture)

VOCAB, LAYERS = 48, 4


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(a tiny Llama streamed from GGUF codes, the transformers model with the de-quantized weights)."""
    return tiny_llama_pair(tmp_path_factory, VOCAB, LAYERS)


def examples(lengths, seed=0):
    rng = random.Random(seed)
    return [{"input_ids": [rng.randrange(2, VOCAB) for _ in range(n)],
             "loss_mask": [0] * (n // 3) + [1] * (n - n // 3)} for n in lengths]


def reference_features(reference, ids, aux_layers):
    """Each example alone through transformers' forward: [T, (1 + n) H]."""
    with torch.no_grad():
        out = reference.model.model(input_ids=torch.tensor([ids]), output_hidden_states=True)
    return model_features(out, aux_layers)[0]


def test_features_from_the_gguf_codes_are_the_transformers_models(pair):
    """Right-padded batches of several examples (more rows than the compiled stack's 16, and a short one
    alone that runs in it), the last hidden state and EAGLE-3's three layers: equal to the transformers
    model's, each example alone, within fp32 rounding; the layers differ from each other (a wrong layer
    would be seen)."""
    streamed, reference = pair
    assert isinstance(streamed.model, GGUFModel)
    exs = examples([5, 23, 40, 31, 12, 64])
    aux = [0, 1, 2]  # low, mid and high layers (EAGLE-3)
    got = compute_features(streamed, exs, batch_tokens=100, aux_layers=aux)
    for ex, feat in zip(exs, got):
        want = reference_features(reference, ex["input_ids"], aux)
        assert feat.shape == (len(ex["input_ids"]), 4 * 256)
        torch.testing.assert_close(feat, want, rtol=1e-4, atol=1e-4)
    want = reference_features(reference, exs[2]["input_ids"], [0, 1])
    assert not torch.allclose(want[:, 256:512], want[:, 512:], rtol=1e-2, atol=1e-2)


def test_packed_rows_from_the_gguf_codes_are_each_conversation_alone(pair):
    """Conversations packed into one row (their own positions, attention blocked between them) give what
    each gives alone through transformers' forward; the unfilled tail of a shorter row changes nothing."""
    streamed, reference = pair
    exs = examples([9, 17, 6, 30], seed=1)
    batch = collate_packed([[{k: torch.tensor(v) for k, v in ex.items()} for ex in exs[:3]],
                            [{k: torch.tensor(v) for k, v in exs[3].items()}]])
    feats = packed_features(streamed, batch["input_ids"], batch["positions"], batch["segment"], [1])
    start = 0
    for ex in exs[:3]:
        n = len(ex["input_ids"])
        torch.testing.assert_close(feats[0, start:start + n], reference_features(reference, ex["input_ids"], [1]),
                                   rtol=1e-4, atol=1e-4)
        start += n
    torch.testing.assert_close(feats[1, :30], reference_features(reference, exs[3]["input_ids"], [1]),
                               rtol=1e-4, atol=1e-4)


def test_a_drafter_trains_on_a_gguf_target_from_its_codes(pair, tmp_path):
    """The loss of an EAGLE-1/2 drafter and of an eagle3 one on online features from the codes: finite, with
    gradients on the drafter; the LM head is the de-quantized one; the weights' digest reads the codes."""
    streamed, reference = pair
    head = frozen_head(streamed)
    assert torch.equal(head.weight, reference.model.lm_head.weight)
    for kind in ("eagle", "eagle3"):
        arch = tmp_path / f"{kind}.json"
        arch.write_text(json.dumps({"kind": kind}))
        cfg = TrainConfig(online=True, data="unused.jsonl", drafter_config=str(arch), report_to="none")
        student = build_student(cfg, streamed, None, head)
        data = OnlineFeatures(streamed, examples([12, 20], seed=2), student.aux_layers)
        loss = student.loss(student.module, collate(data.many([0, 1])), torch.Generator().manual_seed(0))
        loss.total.backward()
        assert torch.isfinite(loss.total) and student.module.fc.weight.grad.abs().sum() > 0
    assert weights_digest(streamed.model) == weights_digest(streamed.model) != weights_digest(reference.model)



def test_a_drafter_layer_starts_as_the_targets_last_layer(pair, tmp_path):
    """``layer_from_target: -1``: the drafter's layer holds the last target layer's matrices and
    post-attention norm (de-quantized from the codes: the reference model's weights); an eagle3 drafter is
    refused in one line."""
    streamed, reference = pair
    cfg = TrainConfig(online=True, data="unused.jsonl", report_to="none", layer_from_target=-1)
    layer = build_student(cfg, streamed, None).module.layers[0]
    source = reference.model.model.layers[LAYERS - 1]
    for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                 "mlp.up_proj", "mlp.down_proj", "post_attention_layernorm"):
        assert torch.equal(layer.get_submodule(name).weight, source.get_submodule(name).weight), name
    arch = tmp_path / "eagle3.json"
    arch.write_text(json.dumps({"kind": "eagle3"}))
    with pytest.raises(Exception, match="layer_from_target starts an EAGLE-1/2 drafter"):
        build_student(TrainConfig(online=True, data="x", drafter_config=str(arch), layer_from_target=0), streamed,
                      None)


def test_packed_rows_of_a_gemma_gguf_target_respect_its_sliding_windows(gemma_pair):
    """Gemma-3 (sliding window 8): conversations longer than the window packed into one row give what each
    gives alone through transformers' forward (its sliding layers count positions within the conversation)."""
    streamed, reference = gemma_pair
    exs = [{"input_ids": ids, "loss_mask": [1] * len(ids)}
           for ids in ([random.Random(i).randrange(2, 40) for _ in range(n)] for i, n in enumerate((13, 21, 5)))]
    batch = collate_packed([[{k: torch.tensor(v) for k, v in ex.items()} for ex in exs]])
    feats = packed_features(streamed, batch["input_ids"], batch["positions"], batch["segment"], [0])
    start = 0
    for ex in exs:
        n = len(ex["input_ids"])
        torch.testing.assert_close(feats[0, start:start + n], reference_features(reference, ex["input_ids"], [0]),
                                   rtol=1e-4, atol=1e-4)
        start += n
