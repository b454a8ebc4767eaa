import torch

from eagle.decoding.tree_mask import tree_attention
from eagle.runtime.masks import attention_bias


def random_parents(n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]
    return torch.tensor(parents)


def brute_force(parents: list[int]):
    """Walk parent pointers node by node."""
    n = len(parents)
    mask = [[False] * n for _ in range(n)]
    depth = [0] * n
    chains = []
    for i in range(n):
        chain, j = [], i
        while j != -1:
            mask[i][j] = True
            chain.append(j)
            j = parents[j]
        depth[i] = len(chain) - 1
        chains.append(chain[::-1])
    leaves = [i for i in range(n) if i not in parents]
    return torch.tensor(mask), torch.tensor(depth), sorted(chains[leaf] for leaf in leaves)


def test_mask_depths_and_paths_match_brute_force():
    for seed in range(30):
        n = 1 + seed * 2
        parents = random_parents(n, seed)
        attn = tree_attention(parents)
        mask, depth, paths = brute_force(parents.tolist())
        assert torch.equal(attn.mask, mask)
        assert torch.equal(attn.depths, depth)
        got = sorted([p for p in row.tolist() if p >= 0] for row in attn.paths)
        assert got == paths


def test_chain_is_causal():
    attn = tree_attention(torch.arange(-1, 5))
    assert torch.equal(attn.mask, torch.ones(6, 6, dtype=torch.bool).tril())
    assert attn.paths.tolist() == [[0, 1, 2, 3, 4, 5]]


def test_attention_bias_layout():
    parents = torch.tensor([-1, 0, 0, 1])
    bias = attention_bias(tree_attention(parents).mask, past_len=3, dtype=torch.float32)
    assert bias.shape == (1, 1, 4, 7)
    allowed = bias[0, 0] == 0
    assert allowed[:, :3].all()
    assert allowed[3, 3:].tolist() == [True, True, False, True]
    assert allowed[2, 3:].tolist() == [True, False, True, False]
