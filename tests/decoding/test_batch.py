import pytest
import torch

from eagle import EagleError, EagleModel
from eagle.decoding.batch import batch_bias, generate_batch, padded_batch
from eagle.config import SamplingConfig
from eagle.decoding.sampling import make_generator

from tests.conftest import prompts, tiny_target


def test_padded_batch_left_pads_and_counts_positions_from_the_first_real_token():
    ids, real, pos = padded_batch([[5, 6, 7], [9]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 9]]
    assert real.tolist() == [[True, True, True], [False, False, True]]
    assert pos.tolist() == [[0, 1, 2], [0, 0, 0]]


def test_batch_bias_equals_a_brute_force_mask():
    real = torch.tensor([[False, True, True, True, True], [True, True, False, True, True]])
    for q in (1, 2, 5):
        bias = batch_bias(real, q, torch.float32)
        assert bias.shape == (2, 1, q, 5)
        for b in range(2):
            for i in range(q):
                for j in range(5):
                    allowed = bool(real[b, j]) and j <= 5 - q + i
                    assert (bias[b, 0, i, j] == 0) == allowed


def test_greedy_batch_equals_decoding_each_prompt_alone():
    """Different prompt lengths (padding), rows ending at EOS at different steps (dropped from the
    batch and its cache) and rows running to the limit: each row equals plain decoding."""
    target = tiny_target(eos=True, seed=3)
    model = EagleModel(target)
    batch = prompts(12, seed=4)
    out = generate_batch(target, batch, 20, SamplingConfig(), make_generator(0))
    assert any(out.ended) and not all(out.ended)
    for ids, tokens, ended in zip(batch, out.token_ids, out.ended):
        alone = model.generate(ids, method="ar", max_new_tokens=20)
        assert tokens + ([0] if ended else []) == alone.token_ids, ids


def test_sampled_batch_rows_follow_the_target_distribution():
    """First tokens of 3000 rows of one prompt (next to a longer one, so it is padded) match the
    target's softmax; the negative control (another prompt's distribution) does not."""
    target = tiny_target(init_std=0.1)
    prompt, other = [4, 7, 9], [1, 2, 3, 4, 5, 6, 7]
    out = generate_batch(target, [other] + [prompt] * 3000, 1, SamplingConfig(temperature=1.0), make_generator(0))
    counts = torch.bincount(torch.tensor([t[0] for t in out.token_ids[1:]]), minlength=target.vocab_size).float()

    def probs(ids):
        logits = target.model(torch.tensor([ids], device=target.device)).logits[0, -1]
        return torch.softmax(logits.float(), -1).cpu()

    tv = 0.5 * (counts / counts.sum() - probs(prompt)).abs().sum()
    control = 0.5 * (counts / counts.sum() - probs(other)).abs().sum()
    assert tv < 0.05 and control > 0.15, (float(tv), float(control))


def test_batch_needs_the_lean_forward_and_prompts():
    with pytest.raises(EagleError, match="lean forward"):
        generate_batch(tiny_target(lean=False), [[1, 2]], 3, SamplingConfig(), make_generator(0))
    with pytest.raises(EagleError, match="at least one"):
        generate_batch(tiny_target(), [[]], 3, SamplingConfig(), make_generator(0))
    with pytest.raises(EagleError, match="max_new_tokens"):
        generate_batch(tiny_target(), [[1, 2]], 0, SamplingConfig(), make_generator(0))
    with pytest.raises(EagleError, match="exceeds the model's context"):
        generate_batch(tiny_target(max_positions=16), [[1] * 10, [2]], 7, SamplingConfig(), make_generator(0))
