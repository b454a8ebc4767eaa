"""DeepSpeed training entry: ``deepspeed train/main.py --config RUN.yaml`` (e.g. ``configs/recipes/*/train.yaml``).

Trains an EAGLE drafter (``student: drafter``) or a standalone draft LM for ``sd``
(``student: draft-lm``, ``eagle.drafting.draft_lm``) against the target's stored features.

Loss = feature_weight * SmoothL1(predicted feature, target feature) + ce_weight * soft-CE(draft
logits, target distribution), with U(-noise, noise) on the input features, masked to assistant
tokens. Checkpoints every ``save_every`` optimizer steps, crash-safe and checksummed, the newest
``keep_last`` kept (``train.checkpoint``); a rerun resumes from the one ``latest`` names, or
else the newest intact one. Held-out
evaluation reports top-1 accuracy and the expected accepted length of a depth-5 chain (also on
``dev_data``, when set). wandb logging (offline by default; ``--report-to none`` turns it off).
A run folder records what its checkpoints belong to (``train.checkpoint.claim``): a run of another
architecture, target or data into it is refused in one line (``--start-over`` deletes them)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import shutil
import sys
import time
from pathlib import Path
from typing import Callable, Iterable

import torch

from eagle.atomic import atomic_directory, write_file
from eagle.drafting import draft_lm
from eagle.config import add_set_argument, changed_keys, from_dict, load_config_file
from eagle.drafting.drafter import Drafter, most_frequent
from eagle.errors import EagleError, Parser, command, note_ignored
from eagle.runtime.gguf_file import LLAMA_FAMILY
from eagle.runtime.target import DEFAULT_TARGET, Target, load_target
from train import checkpoint
from train.features import FeatureShards, OnlineFeatures, feature_target, iter_batches, target_identity
from train.packing import collate_packed, pack_rows, packed_features
from train.loss import LossOutput, eagle_loss, soft_cross_entropy, unroll, uniform_noise


PROG = "eagle-train"
AUTOCAST = ("none", "bf16")
REPORT_TO = ("wandb", "none")
# the draft LM's config keys a run folder records as its architecture
DRAFT_LM_SHAPE = ("model_type", "num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                  "num_key_value_heads", "vocab_size")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    target: str = DEFAULT_TARGET
    features: str | tuple[str, ...] = ""  # feature folder made by eagle-features (offline mode), or several (their
                                   # examples together, e.g. the target's answers and a source's own)
    data: str | tuple[str, ...] = ""  # chat data (one file, or several concatenated), for online mode (features
                                   # computed during training)
    online: bool = False
    max_length: int = 1024
    student: str = "drafter"       # drafter (EAGLE feature drafter) | draft-lm (standalone draft LM for 'sd')
    drafter_config: str = "configs/drafter/eagle1.json"  # architecture JSON: DrafterConfig fields over the target's
    draft_lm_config: str = "configs/draft_lm/smollm2-135m-instruct.json"  # architecture JSON: DraftLMConfig
    init_from: str = ""            # warm start: a drafter (or draft LM) folder whose weights and architecture are kept
    draft_vocab_size: int = 0      # drafter: the N most frequent assistant tokens of the data (0 = as the architecture
                                   # JSON says, or as the warm-start drafter has); a warm start keeps its trained rows
    draft_vocab_data: tuple[str, ...] = ()  # drafter, with draft_vocab_size: chat data whose assistant tokens are
                                   # counted instead of the training data's (e.g. all the self-distilled chats when
                                   # training on a subset); with init_from the vocabulary is chosen anew from them
    aux_layers: tuple[int, ...] = ()  # drafter: also fuse these target layers' outputs (EAGLE-3 style; the features
                                   # must hold them: eagle-features aux_layers). With init_from, layers it lacks are
                                   # added with zero fc columns (it predicts as before until trained)
    layer_from_target: int | None = None  # drafter (new, EAGLE-1/2): start its first decoder layer as this target layer
                                   # (negative: from the last; train.main.copy_target_layer); None: random
    num_layers: int = 0            # drafter: decoder layers (0 = as the architecture JSON says, or as the warm-start
                                   # drafter has); with init_from, layers it lacks are appended with zero output
                                   # projections (it predicts as before until trained)
    deepspeed_config: str = "configs/deepspeed/zero1.json"
    out_dir: str = "runs/drafter"
    epochs: int = 20
    max_steps: int = 0             # optimizer steps; 0 = run all epochs
    examples_from: int = 0         # train on examples from this index on (0 = all), e.g. conversations appended since
                                   # the warm-start drafter was trained; the held-out split is still drawn from all
    replay_fraction: float = 0.0   # with examples_from: also this many earlier examples per new one (random, fixed)
    noise: float = 0.1
    unroll_steps: int = 1          # training-time test: >1 also trains on the drafter's own predictions (depths 2..n)
    unroll_decay: float = 0.8      # loss weight of unrolled step j is decay**j
    ce_weight: float = 0.1
    lm_ce_positions: int = 0       # draft-lm: cross-entropy on at most this many random positions per micro-batch (0 = all)
    feature_weight: float = 1.0
    autocast: str = "none"         # none | bf16: the loss's forward under torch.autocast in bfloat16 (weights, optimizer
                                   # and gradients stay float32); faster on a CPU with native bf16 (AVX512-BF16).
                                   # On CUDA DeepSpeed's bf16 (on by default there) already does this
    save_every: int = 100
    keep_last: int = 3             # checkpoints kept on disk (the newest; 0 = all)
    eval_every: int = 100
    eval_fraction: float = 0.05
    eval_chain_depth: int = 5
    dev_data: str = ""             # chat file also evaluated at each eval (features computed online), reported as dev_*;
                                   # e.g. the target's greedy answers to the dev prompts (eagle-selfdistill --answer)
    log_every: int = 10
    seed: int = 0
    report_to: str = "wandb"       # wandb | none
    wandb_project: str = "eagle"

    max_wall_s: float = 0.0        # stop (checkpoint and save, no held-out evaluation: it can outlast the limit) after
                                   # this many seconds of training (0 = no limit)
    pack_tokens: int = 0           # drafter: pack whole conversations into rows of at most this many tokens (a
                                   # micro-batch is then train_micro_batch_size_per_gpu such rows; attention blocked
                                   # between conversations: train.packing); 0 = one conversation per row, padded.
                                   # Online features are then computed on the device, on the packed rows

    def __post_init__(self) -> None:
        object.__setattr__(self, "aux_layers", tuple(self.aux_layers))
        if not isinstance(self.data, str):
            object.__setattr__(self, "data", tuple(self.data))
        if not isinstance(self.features, str):
            object.__setattr__(self, "features", tuple(self.features))
        if isinstance(self.max_wall_s, bool) or not isinstance(self.max_wall_s, (int, float)) or self.max_wall_s < 0:
            raise EagleError(f"max_wall_s must be a number of seconds >= 0, got {self.max_wall_s!r}")
        if self.replay_fraction and not self.examples_from:
            raise EagleError("replay_fraction replays examples before examples_from: set examples_from too")
        if self.unroll_steps < 1:
            raise EagleError(f"unroll_steps must be >= 1, got {self.unroll_steps}")
        if self.report_to not in REPORT_TO:
            raise EagleError(f"report_to must be one of {', '.join(REPORT_TO)}, got {self.report_to!r}")
        if self.autocast not in AUTOCAST:
            raise EagleError(f"autocast must be one of {', '.join(AUTOCAST)}, got {self.autocast!r}")
        if isinstance(self.keep_last, bool) or not isinstance(self.keep_last, int) or self.keep_last < 0:
            raise EagleError(f"keep_last must be an integer >= 0 (0 keeps every checkpoint), got {self.keep_last!r}")
        if isinstance(self.pack_tokens, bool) or not isinstance(self.pack_tokens, int) or self.pack_tokens < 0:
            raise EagleError(f"pack_tokens must be an integer >= 0 (0 pads one conversation per row), "
                             f"got {self.pack_tokens!r}")
        if self.pack_tokens and self.pack_tokens < self.max_length:
            raise EagleError(f"pack_tokens {self.pack_tokens} must be at least max_length {self.max_length} "
                             f"(a row holds whole conversations)")
        if self.pack_tokens and self.student != "drafter":
            raise EagleError("pack_tokens packs a drafter's micro-batches: student draft-lm trains padded")
        if self.layer_from_target is not None and (isinstance(self.layer_from_target, bool)
                                                   or not isinstance(self.layer_from_target, int)):
            raise EagleError(f"layer_from_target must be a target layer index, got {self.layer_from_target!r}")
        if self.examples_from < 0 or self.replay_fraction < 0:
            raise EagleError(f"examples_from and replay_fraction must be >= 0, got {self.examples_from} and "
                             f"{self.replay_fraction}")


def deepspeed_dict(cfg: TrainConfig, device: torch.device, total_steps: int) -> dict:
    ds = json.loads(Path(cfg.deepspeed_config).read_text())
    sched = ds.get("scheduler", {}).get("params", {})
    if sched.get("total_num_steps") == "auto":
        sched["total_num_steps"] = max(1, total_steps)
    if sched.get("warmup_num_steps", 0) >= total_steps:
        sched["warmup_num_steps"] = max(1, total_steps // 10)
    if "bf16" not in ds and "fp16" not in ds:
        ds["bf16"] = {"enabled": device.type == "cuda"}
    return ds


class FrozenHead(torch.nn.Module):
    """``y = x W^T (+ b)`` with a frozen ``weight`` [V, H] (and ``bias`` [V]) held as buffers."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.register_buffer("weight", weight, persistent=False)
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.weight, self.bias)


def frozen_head(target: Target) -> torch.nn.Module:
    """The target's LM head as the loss multiplies by it (frozen; gradients flow to the drafter's side):
    the model's own head module, or a GGUF target's de-quantized once (fp32 [V, H]: the kernels that
    multiply its codes give no gradient)."""
    head = target.model.get_output_embeddings()
    if isinstance(head, torch.nn.Module):
        return head
    return FrozenHead(head.weight, head.bias)


def target_draft_logits(drafter: Drafter, lm_head: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """The target's logits over the draft vocabulary (only those rows of its LM head are computed)."""
    if drafter.d2t is None:
        return lm_head(hidden)
    return torch.nn.functional.linear(hidden, lm_head.weight[drafter.d2t])


def shift(batch: dict, device: torch.device, fuse: bool = False) -> dict:
    """Pairs (f_t, x_{t+1}) -> f_{t+1}: inputs, next tokens, targets, all [B, T-1]. With ``fuse``
    the inputs are [B, T-1, (1 + n) H]: f_t followed by the aux layers' outputs at t.

    The predicted feature f_{t+1} yields the distribution of token x_{t+2}, so pair t is
    trained when x_{t+2} is an assistant token of the same conversation (``mask``); ``valid``
    marks real pairs (x_{t+1} unpadded, of the same conversation). ``positions`` and
    ``segments`` [B, T-1] are those of token t: from a packed batch (``train.packing``), else
    0, 1, ... and one segment per row."""
    hidden = batch["hidden"].to(device)
    features = torch.cat([hidden, batch["aux"].to(device)], dim=-1) if fuse else hidden
    loss_mask, valid = batch["loss_mask"].to(device), batch["valid"].to(device)
    rows, length = loss_mask.shape
    segment = batch["segment"].to(device) if "segment" in batch else torch.zeros_like(loss_mask, dtype=torch.long)
    positions = batch["positions"].to(device) if "positions" in batch else \
        torch.arange(length, device=device)[None].expand(rows, -1)
    same2 = torch.cat([segment[:, 2:] == segment[:, :-2], torch.zeros_like(loss_mask[:, :1])], dim=1)
    mask = torch.cat([loss_mask[:, 2:], torch.zeros_like(loss_mask[:, :1])], dim=1) & same2
    return {"features": features[:, :-1], "tokens": batch["input_ids"][:, 1:].to(device),
            "target": hidden[:, 1:], "mask": mask, "valid": valid[:, 1:] & (segment[:, 1:] == segment[:, :-1]),
            "positions": positions[:, :-1], "segments": segment[:, :-1] if "segment" in batch else None}


class HiddenStates(torch.nn.Module):
    """Training view of a draft LM: token ids [B, T] -> last hidden states [B, T, H] (after the
    final norm; the frozen shared LM head is applied to masked positions only)."""

    def __init__(self, lm: torch.nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        embeds = self.lm.get_input_embeddings()(input_ids).to(self.lm.model.norm.weight.dtype)
        return self.lm.model(inputs_embeds=embeds).last_hidden_state


def lm_pairs(batch: dict, device: torch.device) -> dict:
    """Token t -> target feature f_t (which yields the distribution of token t+1): [B, T] ids,
    [B, T, H] targets; ``mask`` where token t+1 is an assistant token."""
    loss_mask = batch["loss_mask"].to(device)
    mask = torch.cat([loss_mask[:, 1:], torch.zeros_like(loss_mask[:, :1])], dim=1)
    return {"tokens": batch["input_ids"].to(device), "target": batch["hidden"].to(device), "mask": mask,
            "valid": batch["valid"].to(device)}


def draft_lm_loss(model, target: Target, batch: dict, cfg: TrainConfig,
                  generator: torch.Generator | None) -> LossOutput:
    """The EAGLE loss on a draft LM: its last hidden state regresses the target's feature at the
    same position and its token distribution the target's (through the shared LM head). The
    full-vocabulary cross-entropy is taken on at most ``lm_ce_positions`` random masked positions."""
    b = lm_pairs(batch, target.device)
    hidden = model(b["tokens"])
    lm_head = target.model.get_output_embeddings()
    pred_m, target_m = hidden[b["mask"]], b["target"][b["mask"]].to(hidden.dtype)
    if 0 < cfg.lm_ce_positions < pred_m.shape[0]:
        where = generator.device if generator is not None else torch.device("cpu")
        pick = torch.randperm(pred_m.shape[0], generator=generator, device=where)[: cfg.lm_ce_positions].to(pred_m.device)
    else:
        pick = torch.arange(pred_m.shape[0], device=pred_m.device)
    draft_logits = lm_head(pred_m[pick].to(target.dtype))
    with torch.no_grad():
        target_logits = lm_head(target_m[pick].to(target.dtype))
    ce = soft_cross_entropy(draft_logits, target_logits).mean()
    smooth_l1 = torch.nn.functional.smooth_l1_loss(pred_m.float(), target_m.float())  # every masked position
    top1 = (draft_logits.argmax(-1) == target_logits.argmax(-1)).float().mean()
    return LossOutput(total=cfg.feature_weight * smooth_l1 + cfg.ce_weight * ce, smooth_l1=smooth_l1, ce=ce,
                      top1=top1.detach())


def step_loss(model, drafter: Drafter, target: Target, batch: dict, cfg: TrainConfig,
              generator: torch.Generator | None, lm_head: torch.nn.Module | None = None) -> LossOutput:
    """The EAGLE loss of one micro-batch; with ``unroll_steps`` n > 1 the mean of the losses of n
    unrolled passes (``train.loss.unroll``) weighted by ``unroll_decay``**j. An eagle3 drafter is
    trained on the cross-entropy alone (its ``smooth_l1`` is 0), each pass feeding the previous
    pass's output hidden states (EAGLE-3's training-time test). ``lm_head``: ``frozen_head(target)``."""
    b = shift(batch, target.device, fuse=bool(drafter.config.aux_layers))
    dtype = next(drafter.parameters()).dtype
    feats = uniform_noise(b["features"].to(dtype), cfg.noise, generator)
    with torch.no_grad():
        embeds = target.embed(b["tokens"]).to(dtype)
    eagle3 = drafter.config.kind == "eagle3"
    preds = unroll(model, feats, embeds, b["positions"], cfg.unroll_steps, drafter.config.num_layers,
                   own_hidden=eagle3, segments=b["segments"])
    lm_head = lm_head if lm_head is not None else frozen_head(target)
    mask0 = b["mask"]
    target_m = b["target"][mask0].to(dtype)  # [N, H]: every pass targets the same features, a subset of these
    with torch.no_grad():  # the soft labels once for all passes, over the draft vocabulary only
        target_logits_all = target_draft_logits(drafter, lm_head, target_m.to(target.dtype)).to(dtype)
    rooted = b["positions"][mask0]  # a masked position t has a root in pass j when its position is >= j
    losses, weights = [], []
    for step, pred in enumerate(preds):
        keep = rooted >= step
        pred_m = pred[mask0][keep]  # only masked positions reach the LM heads
        draft_logits = drafter.draft_logits(pred_m.to(target.dtype), lm_head).to(dtype)
        target_logits, target_s = target_logits_all[keep], target_m[keep]
        ones = torch.ones(pred_m.shape[0], dtype=torch.bool, device=target.device)
        if eagle3:  # no feature to regress: its hidden state is its own (and its loss the cross-entropy alone)
            losses.append(eagle_loss(target_s, target_s, draft_logits, target_logits, ones, cfg.ce_weight, 0.0))
        else:
            losses.append(eagle_loss(pred_m, target_s, draft_logits, target_logits, ones, cfg.ce_weight,
                                     cfg.feature_weight))
        del draft_logits, target_logits
        weights.append(cfg.unroll_decay ** step)
    del target_logits_all
    return LossOutput(*(sum(w * getattr(l, f.name) for w, l in zip(weights, losses)) / sum(weights)
                        for f in dataclasses.fields(LossOutput)))


def chain_accept_lengths(correct: list[torch.Tensor]) -> torch.Tensor:
    """``correct[k]`` [B, T] bool: whether the depth-(k+1) draft judged at position p (root p - k)
    is right -> [B, T] accepted length of the chain from each root, bonus token included."""
    run = torch.ones_like(correct[0])
    length = torch.ones_like(correct[0], dtype=torch.float)
    for k, ok in enumerate(correct):
        shifted = torch.zeros_like(ok)
        shifted[:, : ok.shape[1] - k] = ok[:, k:]
        run = run & shifted
        length += run.float()
    return length


@torch.no_grad()
def evaluate(student: torch.nn.Module, target: Target, dataset, indices: list[int], depth: int,
             lm_head: torch.nn.Module | None = None) -> dict:
    """Top-1 accuracy (teacher-forced) and expected accepted length of a depth-``depth`` chain.

    A drafter's chain is unrolled as at inference (``train.loss.unroll``): step k from root r
    sees the target features up to r and its own earlier drafts. A draft LM sees tokens only,
    so while its drafts are accepted they are the target's tokens and teacher forcing is exact.
    A draft is accepted while every step's argmax equals the target's. ``lm_head``: ``frozen_head(target)``."""
    student.eval()
    lm_head = lm_head if lm_head is not None else frozen_head(target)
    hits = total = 0.0
    accept_sum = roots = 0.0
    for batch in iter_batches(dataset, indices, 4):
        if isinstance(student, Drafter):
            b = shift(batch, target.device, fuse=bool(student.config.aux_layers))
            dtype = next(student.parameters()).dtype
            pos = torch.arange(b["tokens"].shape[1], device=target.device)[None].expand(b["tokens"].shape[0], -1)
            embeds = target.embed(b["tokens"]).to(dtype)
            truth = lm_head(b["target"].to(target.dtype)).argmax(-1)
            preds = unroll(student, b["features"].to(dtype), embeds, pos, depth, student.config.num_layers,
                           own_hidden=student.config.kind == "eagle3")
            correct = [(student.to_target_ids(student.draft_logits(p.to(target.dtype), lm_head).argmax(-1)) == truth)
                       & b["valid"] for p in preds]
        else:
            b = lm_pairs(batch, target.device)
            truth = lm_head(b["target"].to(target.dtype)).argmax(-1)
            guess = lm_head(student(b["tokens"]).to(target.dtype)).argmax(-1)
            correct = [(guess == truth) & b["valid"]] * depth
        mask = b["mask"]
        hits += float((correct[0] & mask).sum())
        total += float(mask.sum())
        accept_sum += float((chain_accept_lengths(correct) * mask).sum())
        roots += float(mask.sum())
    student.train()
    return {"top1": hits / max(1.0, total), f"chain{depth}_accept_length": accept_sum / max(1.0, roots)}


@dataclasses.dataclass
class Student:
    """What a run trains: ``module`` (given to DeepSpeed; ``forward`` as the loss expects),
    ``parameters`` (the trainable ones), ``name`` (its output folder), ``save`` (to a folder, which
    it replaces in one step) and ``loss`` (engine, micro-batch, noise generator) -> LossOutput;
    ``aux_layers``: the target layers whose outputs it reads besides the feature; ``architecture``:
    its shape as a run folder records it (``train.checkpoint.run_identity``); ``kind``: "eagle" or
    "eagle3" for a drafter, "" for a draft LM."""

    module: torch.nn.Module
    parameters: list[torch.nn.Parameter]
    name: str
    save: Callable[[Path], None]
    loss: Callable[[torch.nn.Module, dict, torch.Generator | None], LossOutput]
    architecture: dict
    aux_layers: list[int] = dataclasses.field(default_factory=list)
    kind: str = ""


def build_student(cfg: TrainConfig, target: Target, dataset, lm_head: torch.nn.Module | None = None) -> Student:
    """What ``cfg`` trains for ``target`` (``lm_head``: ``frozen_head(target)``, when made already)."""
    if cfg.student == "drafter":
        if cfg.draft_vocab_data and not cfg.draft_vocab_size:
            raise EagleError("draft_vocab_data chooses a draft vocabulary: set draft_vocab_size too")
        if cfg.draft_vocab_size and cfg.online and not cfg.draft_vocab_data:
            raise EagleError("draft_vocab_size needs stored features (it counts the tokens of the data first) "
                             "or draft_vocab_data")
        if cfg.init_from:
            drafter = Drafter.from_pretrained(cfg.init_from, target=target).float().train()
            if cfg.draft_vocab_size and (cfg.draft_vocab_data or cfg.draft_vocab_size != drafter.config.draft_vocab_size):
                ids = most_frequent(vocab_counts(cfg, target, dataset), cfg.draft_vocab_size)
                if not (drafter.d2t is not None and torch.equal(ids, drafter.d2t.to(ids.device))):
                    drafter = drafter.with_draft_vocab(ids, target).train()
            if cfg.aux_layers and list(cfg.aux_layers[:len(drafter.config.aux_layers)]) != drafter.config.aux_layers:
                raise EagleError(f"aux_layers {list(cfg.aux_layers)} must start with those of the warm-start drafter "
                                 f"{drafter.config.aux_layers}")
            if len(cfg.aux_layers) > len(drafter.config.aux_layers):
                drafter = drafter.with_aux_layers(list(cfg.aux_layers[len(drafter.config.aux_layers):])).train()
            if cfg.num_layers and cfg.num_layers != drafter.config.num_layers:
                drafter = drafter.with_layers(cfg.num_layers).train()
        else:
            overrides = json.loads(Path(cfg.drafter_config).read_text()) if cfg.drafter_config else {}
            if cfg.draft_vocab_size:
                overrides["draft_vocab_size"] = cfg.draft_vocab_size
            if cfg.aux_layers:
                overrides["aux_layers"] = list(cfg.aux_layers)
            if cfg.num_layers:
                overrides["num_layers"] = cfg.num_layers
            counts = (vocab_counts(cfg, target, dataset)
                      if overrides.get("draft_vocab_size") and (cfg.draft_vocab_data or not cfg.online) else None)
            drafter = Drafter.from_target(target, token_counts=counts, **overrides).float()
            if cfg.layer_from_target is not None:
                copy_target_layer(drafter, target, cfg.layer_from_target)
        drafter.check_target(target)
        head = lm_head if lm_head is not None else frozen_head(target)
        architecture = {k: v for k, v in dataclasses.asdict(drafter.config).items() if k != "target"}
        return Student(drafter, list(drafter.parameters()), "drafter", drafter.save_pretrained,
                       lambda engine, batch, gen: step_loss(engine, drafter, target, batch, cfg, gen, head),
                       architecture, aux_layers=drafter.config.aux_layers, kind=drafter.config.kind)
    if cfg.student == "draft-lm":
        if cfg.init_from:  # float32 layers; the shared embedding stays the target's (frozen) tensor
            lm = draft_lm.load(cfg.init_from, target, dtype=torch.float32)
        else:
            arch = from_dict(draft_lm.DraftLMConfig, json.loads(Path(cfg.draft_lm_config).read_text()),
                             where=cfg.draft_lm_config)
            lm = draft_lm.from_target(target, arch)
        params = draft_lm.trainable_parameters(lm)
        for p in params:
            p.requires_grad_(True)
        config = lm.config.to_dict()
        architecture = {k: config.get(k) for k in DRAFT_LM_SHAPE}
        return Student(HiddenStates(lm).train(), params, "draft_lm",
                       lambda path: save_atomically(lambda tmp: draft_lm.save(lm, tmp, target), path),
                       lambda engine, batch, gen: draft_lm_loss(engine, target, batch, cfg, gen), architecture)
    raise EagleError(f"unknown student {cfg.student!r}: choose drafter or draft-lm")


LAYER_MATRICES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                  "mlp.up_proj", "mlp.down_proj")


@torch.no_grad()
def copy_target_layer(drafter: Drafter, target: Target, index: int) -> None:
    """Start the drafter's first decoder layer as target layer ``index`` (negative: from the last): its
    attention and MLP matrices and its post-attention norm, de-quantized from a GGUF target's codes. For
    an EAGLE-1/2 drafter of a Llama-family target (Llama, Qwen2, Qwen3), whose layer has the target's
    shapes; what the drafter's layer has no place for (a Qwen2's q/k/v biases, a Qwen3's per-head norms)
    is not carried."""
    layers = target.model.config.num_hidden_layers
    if drafter.config.kind != "eagle" or target.model.config.model_type not in LLAMA_FAMILY:
        raise EagleError(f"layer_from_target starts an EAGLE-1/2 drafter from a Llama-family target's layer "
                         f"({', '.join(LLAMA_FAMILY)}); this is a {drafter.config.kind} drafter of a "
                         f"{target.model.config.model_type} target")
    if not -layers <= index < layers:
        raise EagleError(f"layer_from_target {index} out of range: {target.name} has {layers} layers")
    source, layer = target.model.model.layers[index], drafter.layers[0]
    for name in LAYER_MATRICES:
        weight = source.get_submodule(name).weight if isinstance(source, torch.nn.Module) else \
            getattr(getattr(source, name.split(".")[0]), name.split(".")[1]).weight
        layer.get_submodule(name).weight.copy_(weight)
    layer.post_attention_layernorm.weight.copy_(source.post_attention_layernorm.weight)


def ignored_rules(cfg: TrainConfig, kind: str) -> list[tuple[tuple[str, ...], bool, str]]:
    """Which keys a run of ``cfg`` does not read, and when (rules of ``eagle.errors.note_ignored``);
    ``kind``: the drafter's kind ("" for a draft LM)."""
    draft_lm_mode = cfg.student == "draft-lm"
    return [
        (("features",), cfg.online, "with online: true (features are computed during training)"),
        (("data",), not cfg.online, "without online: true (the stored features are read)"),
        (("drafter_config", "draft_vocab_size", "draft_vocab_data", "aux_layers", "num_layers", "layer_from_target",
          "unroll_steps", "unroll_decay"), draft_lm_mode, "with student: draft-lm"),
        (("noise",), draft_lm_mode and cfg.noise != 0, "with student: draft-lm"),
        (("draft_lm_config", "lm_ce_positions"), not draft_lm_mode, "with student: drafter"),
        (("layer_from_target",), bool(cfg.init_from), "with init_from (the warm start's weights are kept)"),
        (("drafter_config", "draft_lm_config"), bool(cfg.init_from),
         "with init_from (the warm start's architecture is kept)"),
        (("unroll_decay",), cfg.unroll_steps == 1, "with unroll_steps: 1"),
        (("feature_weight",), kind == "eagle3" and cfg.feature_weight != 0,
         "for an eagle3 drafter (trained on the cross-entropy alone)"),
        (("wandb_project",), cfg.report_to == "none", "with report_to: none"),
    ]


def save_atomically(save: Callable[[Path], None], directory: Path) -> None:
    """``save`` into a fresh folder beside ``directory`` that then replaces it in one step (``eagle.atomic``)."""
    with atomic_directory(directory) as tmp:
        save(tmp)


def token_counts(examples: Iterable[dict], vocab_size: int) -> torch.Tensor:
    """How often each token id [V] occurs on the assistant positions of tokenized ``examples``."""
    counts = torch.zeros(vocab_size)
    for ex in examples:
        ids, mask = torch.as_tensor(ex["input_ids"]), torch.as_tensor(ex["loss_mask"]).bool()
        counts += torch.bincount(ids[mask], minlength=vocab_size)[:vocab_size].float()
    return counts


def vocab_counts(cfg: TrainConfig, target: Target, dataset) -> torch.Tensor:
    """The token counts [V] a draft vocabulary is chosen from: ``draft_vocab_data``'s chats, else the training data."""
    if not cfg.draft_vocab_data:
        return token_counts(dataset.examples, target.vocab_size)
    return token_counts(tokenized(target, cfg.draft_vocab_data, cfg.max_length), target.vocab_size)


def tokenized(target: Target, sources: str | tuple[str, ...], max_length: int) -> list[dict]:
    """The tokenized chats of ``sources`` (``train.data.tokenize_sources``), cached per file under
    ``$EAGLE_CACHE/tokenized`` for the next run on the same data."""
    from eagle.cache_dir import cache_root
    from train.data import tokenize_sources

    return tokenize_sources(target.tokenizer, target.tokenizer_fingerprint, sources, max_length,
                            cache_root() / "tokenized")


def online_dataset(target: Target, source: str | tuple[str, ...], max_length: int,
                   aux_layers: list[int]) -> OnlineFeatures:
    return OnlineFeatures(target, tokenized(target, source, max_length),
                          aux_layers)


def training_examples(candidates: list[int], cfg: TrainConfig) -> list[int]:
    """The training indices: those of ``candidates`` from ``cfg.examples_from`` on, plus
    ``replay_fraction`` times as many earlier ones (a seeded random draw)."""
    if not cfg.examples_from:
        return candidates
    new = [i for i in candidates if i >= cfg.examples_from]
    if not new:
        raise EagleError(f"examples_from {cfg.examples_from} leaves no training example "
                         f"(the data has {max(candidates, default=-1) + 1})")
    old = [i for i in candidates if i < cfg.examples_from]
    replay = random.Random(cfg.seed).sample(old, min(len(old), round(len(new) * cfg.replay_fraction)))
    return new + replay


def token_item(dataset, i: int) -> dict[str, torch.Tensor]:
    """Example ``i`` as ``collate_packed`` takes it: stored features included, or (online) its tokens alone."""
    if isinstance(dataset, OnlineFeatures):
        ex = dataset.examples[i]
        return {"input_ids": torch.tensor(ex["input_ids"]), "loss_mask": torch.tensor(ex["loss_mask"]).bool()}
    return dataset[i]


def example_lengths(dataset) -> list[int]:
    """Tokens of every example of ``dataset`` (what packing fills rows with)."""
    return [len(ex["input_ids"]) for ex in dataset.examples]


def packed_batch(dataset, rows: list[list[int]], target: Target, aux_layers: list[int]) -> dict:
    """A packed micro-batch of ``rows`` (lists of example indices; ``train.packing.collate_packed``);
    online, the features come from one target forward over the packed rows, on its device."""
    batch = collate_packed([[token_item(dataset, i) for i in row] for row in rows])
    if "hidden" not in batch:
        feats = packed_features(target, batch["input_ids"], batch["positions"], batch["segment"], aux_layers)
        feats = feats * batch["valid"].to(feats.device)[..., None]  # a row's unfilled tail: zeros, as collated
        batch["hidden"] = feats[..., :target.hidden_size]
        if aux_layers:
            batch["aux"] = feats[..., target.hidden_size:]
    return batch


def epoch_units(train_idx: list[int], epoch: int, cfg: TrainConfig, lengths: list[int] | None) -> list:
    """What one epoch's micro-batches are made of, in order: example indices (a seeded shuffle), or
    with ``pack_tokens`` rows of them packed in that order."""
    perm = list(train_idx)
    random.Random(cfg.seed * 1000 + epoch).shuffle(perm)
    return pack_rows(lengths, perm, cfg.pack_tokens) if cfg.pack_tokens else perm


def train(cfg: TrainConfig, start_over: bool = False) -> dict:
    """Run ``cfg`` (``start_over``: delete another run's checkpoints in ``out_dir`` first, see
    ``train.checkpoint.claim``); rank 0 returns the summary written to ``out_dir/summary.json``."""
    import deepspeed

    deepspeed.init_distributed()
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    device = torch.device(deepspeed.get_accelerator().device_name(), int(os.environ.get("LOCAL_RANK", "0"))) \
        if torch.cuda.is_available() else torch.device("cpu")
    # a drafter's run reads a GGUF target's features from the lean forward over its codes (``feature_target``)
    target = feature_target(cfg.target, device) if cfg.student == "drafter" else \
        load_target(cfg.target, device=device, lean=False)
    head = frozen_head(target)
    if not cfg.online and not cfg.features:
        raise EagleError("set 'features' (a folder made by eagle-features) or 'online: true' with 'data'")
    dataset = None if cfg.online else FeatureShards(cfg.features, target)
    torch.manual_seed(cfg.seed)
    student = build_student(cfg, target, dataset, head)  # online: no stored data to count tokens of (refused there)
    if cfg.online:
        dataset = online_dataset(target, cfg.data, cfg.max_length, student.aux_layers)
    elif student.aux_layers and student.aux_layers != dataset.aux_layers:
        raise EagleError(f"the drafter fuses target layers {student.aux_layers}, but the features in {cfg.features} "
                         f"hold {dataset.aux_layers or 'none'}: rerun eagle-features with aux_layers "
                         f"{student.aux_layers}")
    out = Path(cfg.out_dir)
    refusal = [None]
    if rank == 0:  # one rank decides; every rank stops on a refusal
        note_ignored(PROG, changed_keys(cfg), ignored_rules(cfg, student.kind))
        data = {"source": cfg.data if cfg.online else cfg.features, "examples": len(dataset.examples),
                "sha256": checkpoint.examples_digest(dataset.examples)}
        identity = checkpoint.run_identity(student.name, student.architecture,
                                           {**target_identity(target), "weights": checkpoint.weights_digest(target.model)},
                                           data)
        refusal = [checkpoint.claim(out, identity, start_over)]
    if world > 1:
        torch.distributed.broadcast_object_list(refusal, src=0)
    if refusal[0]:
        raise EagleError(refusal[0])
    order = list(range(len(dataset)))
    random.Random(cfg.seed).shuffle(order)
    n_eval = max(1, int(len(order) * cfg.eval_fraction)) if len(order) > 1 else 0
    eval_idx, train_idx = order[:n_eval], training_examples(order[n_eval:], cfg)
    ds_probe = json.loads(Path(cfg.deepspeed_config).read_text())
    micro, accum = ds_probe.get("train_micro_batch_size_per_gpu", 1), ds_probe.get("gradient_accumulation_steps", 1)
    lengths = example_lengths(dataset) if cfg.pack_tokens else None
    units_per_epoch = len(epoch_units(train_idx, 0, cfg, lengths))  # rows when packed (about the same each epoch)
    steps_per_epoch = max(1, units_per_epoch // (micro * accum * world))
    micro_per_epoch = max(1, units_per_epoch // (micro * world))
    total_steps = cfg.max_steps or steps_per_epoch * cfg.epochs
    dev = None
    if cfg.dev_data and rank == 0:  # the target is frozen: compute the dev features once, not at every evaluation
        online = online_dataset(target, cfg.dev_data, cfg.max_length, student.aux_layers)
        dev = [online[i] for i in range(len(online))]
    evaluates = rank == 0 and (bool(eval_idx) or dev is not None)

    def evaluate_all() -> dict:
        metrics = evaluate(student.module, target, dataset, eval_idx, cfg.eval_chain_depth, head) if eval_idx else {}
        if dev is not None:
            dev_metrics = evaluate(student.module, target, dev, list(range(len(dev))), cfg.eval_chain_depth, head)
            metrics.update({f"dev_{k}": v for k, v in dev_metrics.items()})
        return metrics

    engine, _, _, _ = deepspeed.initialize(model=student.module, model_parameters=student.parameters,
                                           config=deepspeed_dict(cfg, device, total_steps))
    ckpt_dir = out / "checkpoints"
    state = {"step": 0, "epoch": 0, "micro_in_epoch": 0, "wall_s": 0.0, "tokens": 0}
    resume = [None]
    if rank == 0:  # one rank verifies; all load what it chose
        checkpoint.clean(ckpt_dir)
        tag, verified, skipped = checkpoint.choose(ckpt_dir)
        message = checkpoint.resume_message(ckpt_dir, tag, verified, skipped)
        if message:
            print(message, file=sys.stderr, flush=True)
        resume = [tag]
    if world > 1:
        torch.distributed.broadcast_object_list(resume, src=0)
    generator = torch.Generator(device).manual_seed(cfg.seed)  # the input noise, drawn on the device
    if resume[0] is not None:
        _, client = engine.load_checkpoint(str(ckpt_dir), tag=resume[0])
        state.update({k: client[k] for k in state if client and k in client})  # DeepSpeed adds its own keys
        if client and "noise_rng" in client:  # the noise goes on as it would have without the stop
            generator.set_state(client["noise_rng"].cpu())
        else:  # a checkpoint written before the noise's state was kept
            generator.manual_seed(cfg.seed + state["step"])
        if rank == 0:
            print(f"resumed from step {state['step']} (epoch {state['epoch']})", flush=True)
    run = None
    if rank == 0 and cfg.report_to == "wandb":
        import wandb
        run = wandb.init(project=cfg.wandb_project, dir=str(out), mode=os.environ.get("WANDB_MODE", "offline"),
                         config=dataclasses.asdict(cfg), resume="allow", id=f"eagle-{out.name}")

    def out_of_time() -> bool:  # the same answer on every rank: rank 0's clock decides
        late = torch.tensor([float(bool(cfg.max_wall_s) and time.time() - start >= cfg.max_wall_s)], device=device)
        if world > 1:
            torch.distributed.broadcast(late, src=0)
        return bool(late.item())

    metrics: dict = {}
    late = False  # stopped by max_wall_s: checkpointed at once, not evaluated (that can outlast the limit)
    start, losses, curve = time.time(), [], []
    wall_before, tokens_before = state["wall_s"], state["tokens"]  # training time and tokens of earlier runs
    paused = 0.0  # seconds of this run spent evaluating and saving (not training)

    def tokens_per_s() -> float:  # this run's trained tokens per second of training
        return (state["tokens"] - tokens_before) / max(1e-9, time.time() - start - paused)

    while state["step"] < total_steps and state["epoch"] < cfg.epochs:
        units = epoch_units(train_idx, state["epoch"], cfg, lengths)
        usable = len(units) // (world * micro) * world * micro  # every rank runs the same number of micro-batches
        if usable == 0:
            raise EagleError(f"{len(units)} training {'rows' if cfg.pack_tokens else 'examples'} cannot fill one "
                             f"micro-batch of {micro} on {world} ranks")
        shard = units[:usable][rank::world]
        micro_batches = list(range(0, len(shard) - micro + 1, micro))
        for mb in micro_batches[state["micro_in_epoch"]:]:
            chunk = shard[mb:mb + micro]
            batch = packed_batch(dataset, chunk, target, student.aux_layers) if cfg.pack_tokens else \
                iter_batches(dataset, chunk, micro).__next__()
            state["tokens"] += int(batch["valid"].sum()) * world  # (a CPU tensor: no device sync)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.autocast == "bf16"):
                loss = student.loss(engine, batch, generator)
            engine.backward(loss.total)
            boundary = engine.is_gradient_accumulation_boundary()
            engine.step()
            state["micro_in_epoch"] += 1
            losses.append(torch.stack([x.detach().float() for x in (loss.total, loss.smooth_l1, loss.ce, loss.top1)]))
            if not boundary:
                continue
            state["step"] += 1
            step = state["step"]
            if rank == 0 and step % cfg.log_every == 0:
                avg = torch.stack(losses).mean(0).tolist()  # one device read per log line
                losses = []
                line = {"step": step, "loss": avg[0], "smooth_l1": avg[1], "ce": avg[2], "top1": avg[3],
                        "lr": engine.get_lr()[0], "elapsed_s": time.time() - start, "tokens": state["tokens"],
                        "tokens_per_s": tokens_per_s()}
                print(json.dumps(line), flush=True)
                curve.append(line)
                if run:
                    run.log(line, step=step)
            late = out_of_time()
            pause_from = time.time()
            if evaluates and not late and (step % cfg.eval_every == 0 or step == total_steps):
                metrics = evaluate_all()
                print(json.dumps({"step": step, "eval": metrics}), flush=True)
                curve.append({"step": step, "tokens": state["tokens"], "eval": metrics,
                              "elapsed_s": time.time() - start})
                if run:
                    run.log({f"eval/{k}": v for k, v in metrics.items()}, step=step)
            if step % cfg.save_every == 0 or step == total_steps or late:
                state["wall_s"] = wall_before + time.time() - start
                tag = f"step{step}"
                if rank == 0:  # before the barrier DeepSpeed's save begins with
                    shutil.rmtree(ckpt_dir / checkpoint.partial_tag(tag), ignore_errors=True)
                engine.save_checkpoint(str(ckpt_dir), tag=checkpoint.partial_tag(tag), save_latest=False,
                                       client_state={**state, "noise_rng": generator.get_state()})
                # (returns once every rank has written its files)
                if rank == 0:
                    checkpoint.publish(ckpt_dir, tag, cfg.keep_last)
                    student.save(out / student.name)
            paused += time.time() - pause_from
            if step >= total_steps or late:
                break
        else:
            state["epoch"] += 1
            state["micro_in_epoch"] = 0
            continue
        break
    if rank == 0:
        if evaluates and not metrics and not late:
            metrics = evaluate_all()
        student.save(out / student.name)
        epochs = state["epoch"] + state["micro_in_epoch"] / micro_per_epoch
        summary = {"steps": state["step"], "epochs": round(epochs, 2), "eval": metrics, "stopped_by_max_wall_s": late,
                   "wall_s": wall_before + time.time() - start, "train_tokens": state["tokens"],
                   "tokens_per_s": tokens_per_s(), "run_wall_s": time.time() - start, "curve": curve,
                   "train_examples": len(train_idx), "eval_examples": len(eval_idx), "init_from": cfg.init_from,
                   "config": dataclasses.asdict(cfg)}
        write_file(out / "summary.json", json.dumps(summary, indent=2))
        if run:
            run.finish()
        return summary
    return {}


@command(PROG)
def main(argv: list[str] | None = None) -> None:
    parser = Parser(prog=PROG, description="Train an EAGLE drafter (run through the deepspeed launcher)")
    parser.add_argument("--config", help="run YAML (TrainConfig keys)")
    add_set_argument(parser)
    parser.add_argument("--report-to", choices=REPORT_TO, help="the same as --set report_to=...")
    parser.add_argument("--start-over", action="store_true",
                        help="out_dir holds checkpoints of another run: delete them and start from step 0")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    overrides = args.set + ([f"report_to={args.report_to}"] if args.report_to else [])
    train(load_config_file(TrainConfig, args.config, overrides, "train config"), start_over=args.start_over)


if __name__ == "__main__":
    sys.exit(main())
