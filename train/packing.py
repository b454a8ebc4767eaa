"""Packed micro-batches: several conversations in one row, attention blocked between them.

A row holds whole conversations one after another (at most ``row_tokens`` tokens), each with its
own positions 0, 1, ... and a segment id; the tail of a row that no conversation fills is one more
segment marked not ``valid``. Attention is causal within a segment and blocked across segments
(``block_causal``), in the target's forward (``packed_features``) and in the drafter's unrolled
passes (``train.loss.unroll_bias`` with ``segments``), so a packed row trains exactly what the same
conversations padded one per row would, with no padding computed."""

from __future__ import annotations

from typing import Sequence

import torch

from eagle.runtime.masks import additive_bias
from eagle.runtime.target import Target, model_features


def pack_rows(lengths: Sequence[int], order: Sequence[int], row_tokens: int, open_rows: int = 32) -> list[list[int]]:
    """The examples of ``order`` (indices into ``lengths``) as rows of at most ``row_tokens`` tokens:
    each goes into the first of at most ``open_rows`` open rows it fits (in ``order``), else opens a
    new one (the fullest open row is closed first when ``open_rows`` are open). Deterministic; every
    index exactly once. An example longer than ``row_tokens`` is an error."""
    rows: list[list[int]] = []
    open_: list[tuple[int, int]] = []  # (row index, tokens used)
    for i in order:
        n = lengths[i]
        if n > row_tokens:
            raise ValueError(f"example {i} has {n} tokens, more than a packed row's {row_tokens}")
        for k, (row, used) in enumerate(open_):
            if used + n <= row_tokens:
                rows[row].append(i)
                open_[k] = (row, used + n)
                break
        else:
            if len(open_) == open_rows:
                open_.pop(max(range(len(open_)), key=lambda k: open_[k][1]))
            rows.append([i])
            open_.append((len(rows) - 1, n))
    return rows


def collate_packed(rows: list[list[dict[str, torch.Tensor]]]) -> dict[str, torch.Tensor]:
    """Rows of examples (``input_ids`` [T_i], ``loss_mask`` [T_i], and ``hidden`` [T_i, H] / ``aux``
    [T_i, n H] when stored) -> a packed batch, T = the longest row: input_ids, positions, segment
    [B, T] long; loss_mask, valid [B, T] bool; hidden/aux [B, T, .] float32 when the examples have
    them. The unfilled tail of a row is one more segment, not valid, positions from 0."""
    longest = max(sum(len(ex["input_ids"]) for ex in row) for row in rows)
    b = len(rows)
    batch = {"input_ids": torch.zeros(b, longest, dtype=torch.long), "positions": torch.zeros(b, longest, dtype=torch.long),
             "segment": torch.zeros(b, longest, dtype=torch.long), "loss_mask": torch.zeros(b, longest, dtype=torch.bool),
             "valid": torch.zeros(b, longest, dtype=torch.bool)}
    keys = [k for k in ("hidden", "aux") if k in rows[0][0]]
    for key in keys:
        batch[key] = torch.zeros(b, longest, rows[0][0][key].shape[-1])
    for r, row in enumerate(rows):
        start = 0
        for s, ex in enumerate(row):
            n = len(ex["input_ids"])
            span = slice(start, start + n)
            batch["input_ids"][r, span] = torch.as_tensor(ex["input_ids"])
            batch["loss_mask"][r, span] = torch.as_tensor(ex["loss_mask"]).bool()
            batch["positions"][r, span] = torch.arange(n)
            batch["segment"][r, span] = s
            batch["valid"][r, span] = True
            for key in keys:
                batch[key][r, span] = ex[key].float()
            start += n
        batch["positions"][r, start:] = torch.arange(longest - start)
        batch["segment"][r, start:] = len(row)
    return batch


def block_causal(segment: torch.Tensor) -> torch.Tensor:
    """[B, T] segment ids -> [B, T, T] bool: query t may attend key k when k <= t in the same segment."""
    t = segment.shape[-1]
    causal = torch.ones(t, t, dtype=torch.bool, device=segment.device).tril()
    return causal & (segment[:, :, None] == segment[:, None, :])


@torch.no_grad()
def packed_features(target: Target, input_ids: torch.Tensor, positions: torch.Tensor, segment: torch.Tensor,
                    aux_layers: Sequence[int] = ()) -> torch.Tensor:
    """The target's features of a packed batch, on its device, in its dtype: input_ids, positions,
    segment [B, T] -> [B, T, (1 + n) H] (last hidden state, then the outputs of the n ``aux_layers``),
    each segment seeing only itself (a [B, 1, T, T] additive mask and per-segment positions; Gemma-3's
    sliding windows count those positions). With a lean forward (a GGUF target:
    ``train.features.feature_target``) all B x T rows go through it in one call (its matrices multiplied
    from their codes by the compiled kernels), else through the transformers model's forward."""
    device = target.device
    mask = additive_bias(block_causal(segment.to(device)), target.dtype)
    ids, positions = input_ids.to(device), positions.to(device)
    if target.lean is not None:
        return target.lean.forward(ids, positions, target.lean.new_cache(), mask, list(aux_layers))
    result = target.model.model(input_ids=ids, position_ids=positions, attention_mask=mask,
                                output_hidden_states=bool(aux_layers), use_cache=False)
    return model_features(result, aux_layers)
