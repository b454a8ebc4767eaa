import collections

import pytest
import torch

from eagle import EagleError, EagleModel
from eagle.config import SamplingConfig
from train.generation import (BatchDecoder, Request, bucket_for, generate_batch, keys_for, prefill_groups,
                              request_noise, request_seed)

from tests.conftest import prompts, tiny_gemma, tiny_target


def test_prefill_groups_keep_the_padded_size_within_the_budget():
    lengths = [5, 1, 9, 3, 3, 40]
    groups = prefill_groups(lengths, budget=12)
    assert sorted(i for g in groups for i in g) == list(range(6))
    assert all(len(g) * max(lengths[i] for i in g) <= 12 or len(g) == 1 for g in groups)
    assert [lengths[g[0]] for g in groups] == sorted(lengths[g[0]] for g in groups)
    assert groups[-1] == [5]  # longer than the budget: alone


def test_keys_and_buckets():
    assert [keys_for(e, 512) for e in (1, 64, 65, 200, 511, 900)] == [64, 64, 128, 256, 512, 512]
    assert [bucket_for(n, (1, 2, 4, 6)) for n in (1, 3, 5, 6)] == [1, 4, 6, 6]


@pytest.mark.parametrize("family, seed", [("llama", 10), ("qwen3", 12)])
def test_greedy_rows_equal_decoding_each_prompt_alone_with_refills(family, seed):
    """More prompts than rows (finished rows refilled from the queue, the tail run on smaller row
    buckets), prompt lengths 1-18, rows ending at EOS at different steps and rows running to the
    limit: each row's tokens are plain single-stream greedy decoding's (Qwen3: with per-head norms)."""
    target = tiny_target(eos=True, seed=seed, family=family)
    model = EagleModel(target)
    batch = prompts(23, seed=4)
    out = generate_batch(target, batch, 20, SamplingConfig(), rows=4)
    assert any(out.ended) and not all(out.ended)
    assert len({len(t) for t in out.token_ids}) > 8  # answers of many lengths: rows refilled at different steps
    for ids, tokens, ended in zip(batch, out.token_ids, out.ended):
        alone = model.generate(ids, method="ar", max_new_tokens=20)
        assert tokens + ([0] if ended else []) == alone.token_ids, ids


def test_gemma_rows_equal_decoding_each_prompt_alone_past_the_window():
    """A Gemma-3 target (sliding-window layers of window 6 beside full-attention ones, local and global
    RoPE): each row's greedy tokens, prompts and answers longer than the window, with refills and a
    next turn prefilled onto its row's cache, are plain single-stream greedy decoding's (fp32)."""
    target = tiny_gemma(seed=5, window=6)
    model = EagleModel(target)
    batch = prompts(9, seed=2)
    out = generate_batch(target, batch, 16, SamplingConfig(), rows=3)
    for ids, tokens in zip(batch, out.token_ids):
        assert tokens == model.generate(ids, method="ar", max_new_tokens=16).token_ids, ids
    decoder = BatchDecoder(target, rows=2, capacity=128, sampling=SamplingConfig(), refill_at=1)
    first = torch.randint(1, 32, (30,), generator=torch.Generator().manual_seed(7)).tolist()
    pending, seen = collections.deque([Request(first, 10, key="first")]), {}
    for result in decoder.stream(lambda: pending.popleft() if pending else None):
        seen[result.key] = result.token_ids
        if result.key == "first":
            follow = first + result.token_ids + [3, 4, 5, 6]
            pending.append(Request(follow, 12, key=tuple(follow)))
    assert decoder.stats.reused_rows == 1
    for key, tokens in seen.items():
        ids = first if key == "first" else list(key)
        assert tokens == model.generate(ids, method="ar", max_new_tokens=len(tokens)).token_ids
    with pytest.raises(EagleError, match="sliding windows"):
        BatchDecoder(target, rows=2, capacity=64, sampling=SamplingConfig(), attention="varlen")


def test_follow_up_requests_queued_while_streaming_are_decoded():
    """A request queued by the consumer after a result (the next turn of a conversation) runs, and
    gives what it gives when decoded on its own."""
    target = tiny_target(eos=True, seed=3)
    decoder = BatchDecoder(target, rows=2, capacity=80, sampling=SamplingConfig(), refill_at=1)
    pending = collections.deque(Request(p, 6, key=("first", i)) for i, p in enumerate(prompts(5, seed=1)))
    seen = {}
    for result in decoder.stream(lambda: pending.popleft() if pending else None):
        seen[result.key] = result.token_ids
        if result.key[0] == "first":
            follow = prompts(5, seed=1)[result.key[1]] + result.token_ids + [7, 8]
            pending.append(Request(follow, 6, key=("second", tuple(follow))))
    assert len(seen) == 10
    for key, tokens in seen.items():
        if key[0] == "second":
            assert generate_batch(target, [list(key[1])], 6, SamplingConfig(), rows=1).token_ids[0] == tokens


def test_sampled_tokens_depend_on_the_seed_not_on_the_batching():
    target = tiny_target(eos=True, seed=5, init_std=0.1)
    batch = prompts(10, seed=2)
    sampling = SamplingConfig(temperature=1.0, top_p=0.9)
    one = generate_batch(target, batch, 12, sampling, seed=7, rows=1)
    many = generate_batch(target, batch, 12, sampling, seed=7, rows=4)
    assert one == many
    assert generate_batch(target, batch, 12, sampling, seed=8, rows=4) != many
    assert generate_batch(target, batch, 12, SamplingConfig(), seed=7, rows=4) != many


def test_sampled_rows_follow_the_target_distribution():
    """First tokens of 3000 requests of one prompt (beside a longer one) match the target's
    softmax; the negative control (another prompt's distribution) does not."""
    target = tiny_target(init_std=0.1)
    prompt, other = [4, 7, 9], [1, 2, 3, 4, 5, 6, 7]
    out = generate_batch(target, [other] + [prompt] * 3000, 1, SamplingConfig(temperature=1.0), seed=0, rows=256)
    counts = torch.bincount(torch.tensor([t[0] for t in out.token_ids[1:]]), minlength=target.vocab_size).float()

    def probs(ids):
        logits = target.model(torch.tensor([ids], device=target.device)).logits[0, -1]
        return torch.softmax(logits.float(), -1).cpu()

    tv = 0.5 * (counts / counts.sum() - probs(prompt)).abs().sum()
    control = 0.5 * (counts / counts.sum() - probs(other)).abs().sum()
    assert tv < 0.05 and control > 0.15, (float(tv), float(control))


def test_request_noise_is_uniform_and_differs_per_key_and_step():
    keys, steps = torch.tensor([1, 1, 2]), torch.tensor([0, 1, 0])
    noise = request_noise(keys, steps, 20000)
    assert noise.min() > 0 and noise.max() < 1
    assert abs(float(noise.mean()) - 0.5) < 0.01
    assert not torch.equal(noise[0], noise[1]) and not torch.equal(noise[0], noise[2])
    assert torch.equal(noise, request_noise(keys, steps, 20000))
    assert request_seed(0, 1) != request_seed(1, 0) and 0 <= request_seed(3, 4) < 2 ** 31


def test_batch_needs_the_lean_forward_and_prompts():
    with pytest.raises(EagleError, match="lean forward"):
        generate_batch(tiny_target(lean=False), [[1, 2]], 3, SamplingConfig())
    with pytest.raises(EagleError, match="at least one"):
        generate_batch(tiny_target(), [[]], 3, SamplingConfig())
    with pytest.raises(EagleError, match="max_new_tokens"):
        generate_batch(tiny_target(), [[1, 2]], 0, SamplingConfig())
    with pytest.raises(EagleError, match="exceeds the model's context"):
        generate_batch(tiny_target(max_positions=16), [[1] * 10, [2]], 7, SamplingConfig())
    decoder = BatchDecoder(tiny_target(), rows=2, capacity=64, sampling=SamplingConfig())
    with pytest.raises(EagleError, match="capacity"):
        list(decoder.stream(lambda: Request([1] * 60, 10)))


def flash_reference(q, k, v, cu_q, cu_k, max_q, max_k, dropout, causal, debug, scale=None, seqused_k=None):
    """Flash attention's variable-length contract, brute force: batch b's queries are rows cu_q[b] ..
    cu_q[b+1] of ``q`` [Tq, heads, d]; its keys start at row cu_k[b] of ``k``/``v`` [Tk, kv_heads, d],
    ``seqused_k[b]`` of them (else up to cu_k[b+1]); query heads share key heads in groups."""
    assert dropout == 0.0 and not causal and cu_q.dtype == cu_k.dtype == seqused_k.dtype == torch.int32
    out = torch.empty_like(q)
    group = q.shape[1] // k.shape[1]
    for b in range(len(cu_q) - 1):
        start = int(cu_k[b])
        keys = k[start:start + int(seqused_k[b])].repeat_interleave(group, dim=1)
        values = v[start:start + int(seqused_k[b])].repeat_interleave(group, dim=1)
        for t in range(int(cu_q[b]), int(cu_q[b + 1])):
            weights = torch.softmax(torch.einsum("hd,nhd->hn", q[t], keys) * scale, -1)
            out[t] = torch.einsum("hn,nhd->hd", weights, values)
    return out, None, None, None, None


def test_varlen_rows_attend_to_their_own_keys_only(monkeypatch):
    """``attention="varlen"`` (flash attention over each row's used keys; CUDA only, here its contract
    done by brute force): each row's greedy tokens are still decoding it alone, and it is one graph
    shape per bucket (the attended length no longer varies)."""
    from eagle.runtime import rows as rows_module
    from train import generation as batch_module

    target = tiny_target(eos=True, seed=10)
    monkeypatch.setattr(rows_module, "flash_varlen", flash_reference)
    monkeypatch.setattr(batch_module, "varlen_works", lambda device, dtype: None)
    prompts_ = prompts(9, seed=4)
    decoder = BatchDecoder(target, rows=4, capacity=120, sampling=SamplingConfig(), attention="varlen",
                           capture=False)  # the reference reads lengths on the host: no graph
    assert decoder.varlen and decoder.stats.attention == "varlen"
    pending = collections.deque(Request(p, 20, key=i) for i, p in enumerate(prompts_))
    out = {r.key: r.token_ids + ([0] if r.ended else []) for r in decoder.stream(
        lambda: pending.popleft() if pending else None)}
    model = EagleModel(target)
    for i, ids in enumerate(prompts_):
        assert out[i] == model.generate(ids, method="ar", max_new_tokens=20).token_ids[:len(out[i])], ids
    stats = decoder.stats
    assert stats.steps > 0 and stats.prefills > 0 and stats.live_row_steps <= stats.row_steps
    assert stats.prefill_tokens == sum(map(len, prompts_)) <= stats.padded_tokens


def test_varlen_is_refused_where_flash_attention_is_missing():
    target = tiny_target()
    if target.device.type != "cuda":
        with pytest.raises(EagleError, match="CUDA"):
            BatchDecoder(target, rows=2, capacity=64, sampling=SamplingConfig(), attention="varlen")
        assert BatchDecoder(target, rows=2, capacity=64, sampling=SamplingConfig()).stats.attention == "sdpa"
    with pytest.raises(EagleError, match="attention must be"):
        BatchDecoder(target, rows=2, capacity=64, sampling=SamplingConfig(), attention="flash")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flash attention runs on CUDA only")
def test_varlen_attention_matches_plain_attention_on_cuda():
    from eagle.runtime.rows import varlen_works

    assert varlen_works(torch.device("cuda"), torch.bfloat16) is None


@pytest.mark.parametrize("attention", ["sdpa", "varlen"])
def test_a_next_turn_reuses_the_rows_cache_and_decodes_as_alone(monkeypatch, attention):
    """A follow-up whose prompt starts with what a finished row's cache holds (the prompt, the
    answer fed back, then new tokens; or only part of the answer, or the prompt alone) goes to that
    row and prefills only its tail: every result is still what the request gives alone, and a
    prompt too short to share ``MIN_REUSE`` tokens is prefilled whole."""
    from eagle.runtime import rows as rows_module
    from train import generation as batch_module

    if attention == "varlen":
        monkeypatch.setattr(rows_module, "flash_varlen", flash_reference)
        monkeypatch.setattr(batch_module, "varlen_works", lambda device, dtype: None)
    target = tiny_target(eos=True, seed=3, max_positions=256)
    gen = torch.Generator().manual_seed(1)
    firsts = [torch.randint(1, 32, (40 + 3 * i,), generator=gen).tolist() for i in range(6)] + [[5, 6, 7]]
    decoder = BatchDecoder(target, rows=3, capacity=200, sampling=SamplingConfig(), refill_at=1,
                           attention=attention, capture=False)
    pending = collections.deque(Request(p, 8, key=("first", i, tuple(p))) for i, p in enumerate(firsts))
    seen = {}
    for result in decoder.stream(lambda: pending.popleft() if pending else None):
        seen[result.key] = result.token_ids
        if result.key[0] == "first":
            i, ids, tokens = result.key[1], list(result.key[2]), result.token_ids
            follow = [ids + tokens + [7, 8], ids + tokens[:2] + [9, 5, 6], ids][i % 3]
            pending.appendleft(Request(follow, 8, key=("next", i, tuple(follow))))  # next turns first
    assert len(seen) == 2 * len(firsts)
    for key, tokens in seen.items():
        assert generate_batch(target, [list(key[2])], 8, SamplingConfig(), rows=1).token_ids[0] == tokens, key
    stats = decoder.stats
    assert stats.reused_rows >= 4 and stats.reused_tokens >= 4 * 40
    assert stats.prefill_tokens + stats.reused_tokens == sum(len(k[2]) for k in seen)


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_a_prompt_tail_extended_onto_its_cached_head_is_the_whole_prompt_prefilled(kind):
    """``extend_rows`` after ``prefill_rows`` of the heads gives the features and the cache rows that
    ``prefill_rows`` of the whole prompts gives (fp32), with tails of different lengths padded (Gemma-3:
    sliding-window layers with a window shorter than the heads)."""
    from eagle.runtime.rows import extend_rows, prefill_rows, rotary_tables

    target = tiny_target(seed=4) if kind == "llama" else tiny_gemma(seed=4, window=8)
    lean, dev = target.lean, target.device
    gen = torch.Generator().manual_seed(0)
    whole = [torch.randint(1, 32, (n,), generator=gen).tolist() for n in (30, 41)]
    heads = [17, 33]
    kv = torch.zeros(2, len(lean.layers), 4, 64, lean.num_kv_heads, lean.head_dim, device=dev)
    rope = rotary_tables(lean, 64, dev, torch.float32)
    def ids(rows):  # [n] or [n, m] ids on the target's device
        return torch.tensor(rows, device=dev)

    with torch.inference_mode():
        width = max(map(len, whole))
        padded = ids([p + [0] * (width - len(p)) for p in whole])
        want = prefill_rows(lean, kv, rope, ids([0, 1]), padded, ids([29, 40]))
        head = ids([p[:h] + [0] * (max(heads) - h) for p, h in zip(whole, heads)])
        prefill_rows(lean, kv, rope, ids([2, 3]), head, ids(heads) - 1)
        tails = [p[h:] for p, h in zip(whole, heads)]
        tail = ids([t + [0] * (max(map(len, tails)) - len(t)) for t in tails])
        got = extend_rows(lean, kv, rope, ids([2, 3]), tail, ids(heads), ids([len(t) - 1 for t in tails]),
                          keys_len=64)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for a, b, n in ((0, 2, 30), (1, 3, 41)):
        torch.testing.assert_close(kv[:, :, b, :n], kv[:, :, a, :n], atol=1e-5, rtol=1e-5)
