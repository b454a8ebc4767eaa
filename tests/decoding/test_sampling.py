import torch

from eagle.decoding.sampling import sample


def test_sample_draws_each_row_from_its_distribution_and_never_a_zero():
    gen = torch.Generator().manual_seed(0)
    p = torch.tensor([0.0, 0.5, 0.0, 0.2, 0.3, 0.0])
    n = 100_000
    freq = torch.bincount(sample(p.expand(n, -1), gen), minlength=6) / n
    assert (freq - p).abs().sum() / 2 < 0.01
    assert freq[[0, 2, 5]].sum() == 0
    shifted = torch.tensor([0.0, 0.3, 0.0, 0.2, 0.5, 0.0])  # the check has teeth: another distribution fails it
    assert (freq - shifted).abs().sum() / 2 > 0.15
    unnormalized = torch.bincount(sample((4 * p).expand(n, -1), gen), minlength=6) / n
    assert (unnormalized - p).abs().sum() / 2 < 0.01


def test_sample_keeps_the_leading_shape():
    gen = torch.Generator().manual_seed(1)
    one_hot = torch.eye(5)[[4, 0, 2]].reshape(3, 1, 5)
    assert sample(one_hot, gen).tolist() == [[4], [0], [2]]
    assert sample(torch.eye(5)[3], gen).shape == ()
