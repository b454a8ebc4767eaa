"""Target features: run the target over tokenized chats and store per example the input ids,
the loss mask and the feature (last hidden state before the LM head; with ``aux_layers`` also
those decoder layers' outputs, for drafters that fuse them) in safetensors shards with a
manifest. Resumable: verified shards are skipped; a corrupt or half-written shard is detected by
its checksum and regenerated. Shards made by another target are refused."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
import sys
import time
from pathlib import Path
from typing import Iterator, Sequence

import torch
from tqdm import tqdm

from eagle.config import add_set_argument, changed_keys, check_bool, check_int, load_config_file
from eagle.errors import EagleError, Parser, command, note_ignored
from eagle.runtime.target import DEFAULT_TARGET, Target, load_target
from train.data import load_all, load_chats, tokenize_all
from train.packing import packed_features

MANIFEST = "manifest.json"


@dataclasses.dataclass(frozen=True)
class FeaturesConfig:
    target: str = DEFAULT_TARGET
    data: str | tuple[str, ...] = "data/selfdistill/data.jsonl"  # one chat file, or several (concatenated)
    out_dir: str = "data/features"
    max_length: int = 1024
    shard_size: int = 64
    batch_tokens: int = 4096
    feature_dtype: str = "float16"
    aux_layers: tuple[int, ...] = ()  # also store these decoder layers' outputs (EAGLE-3 style fusion)
    # earlier data replayed before `data`'s conversations: chat file -> how many of its conversations, drawn at
    # random in the order given, all from one random.Random(replay_seed)
    replay: dict[str, int] = dataclasses.field(default_factory=dict)
    replay_seed: int = 0
    # a data line that is not JSON or not a conversation: an error naming file:line (False), or skipped and
    # named on stderr (True)
    skip_malformed: bool = False
    # stop once a shard ends past this many seconds (0 = never): the shards written by then are the features (a
    # rerun with a larger bound continues with the next shard)
    max_wall_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("max_length", "shard_size", "batch_tokens"):
            check_int(name, getattr(self, name), 1)
        check_bool("skip_malformed", self.skip_malformed)
        if isinstance(self.max_wall_s, bool) or not isinstance(self.max_wall_s, (int, float)) or self.max_wall_s < 0:
            raise EagleError(f"max_wall_s must be a number of seconds >= 0, got {self.max_wall_s!r}")
        if self.feature_dtype not in ("float16", "bfloat16", "float32"):
            raise EagleError(f"feature_dtype must be float16, bfloat16 or float32, got {self.feature_dtype!r}")
        object.__setattr__(self, "aux_layers", tuple(self.aux_layers))
        if not isinstance(self.data, str):
            object.__setattr__(self, "data", tuple(self.data))
        if not isinstance(self.replay, dict) or not all(isinstance(n, int) and n > 0 for n in self.replay.values()):
            raise EagleError(f"replay must map chat files to counts >= 1, got {self.replay!r}")


def replay_draw(replay: dict[str, int], seed: int) -> list[list[dict]]:
    """``n`` conversations of each chat file of ``replay`` (file -> n), a random draw from one
    ``random.Random(seed)`` over the files in order (so the same settings draw the same)."""
    rng, conversations = random.Random(seed), []
    for source, n in replay.items():
        pool = load_chats(source).conversations
        if n > len(pool):
            raise EagleError(f"replay asks for {n} conversations of {source}, which holds {len(pool)}")
        conversations.extend(rng.sample(pool, n))
    return conversations


def target_identity(target: Target) -> dict:
    return {"name": target.name, "hidden_size": target.hidden_size, "vocab_size": target.vocab_size,
            "tokenizer_fingerprint": target.tokenizer_fingerprint}


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def feature_target(spec: str, device: str | torch.device | None = None) -> Target:
    """The target as training reads its features. A GGUF file (the default target's or a named target's included)
    on a CPU keeps its matrices as their codes, and its features come from the lean forward (``eagle.runtime.decoder``:
    many rows per call, the compiled kernels; in the numerics inference gives the file, ``load_gguf_target``), with transformers' tokenizer of the file (its offsets mark
    the replies): no full-precision copy of the model is made. Any other target, or another device: the
    transformers model and its forward (``load_target(lean=False)``)."""
    from eagle.runtime.target import default_device_dtype, gguf_metadata_dir, load_gguf_target, spec_gguf

    dev, _ = default_device_dtype(device)
    path = spec_gguf(str(spec))  # the default target's, a named target's (assembled once) or a .gguf path
    if dev.type != "cpu" or path is None:
        return load_target(spec, device=device, lean=False)
    from transformers import AutoTokenizer

    return load_gguf_target(path, str(spec), tokenizer=AutoTokenizer.from_pretrained(gguf_metadata_dir(path)))


@torch.inference_mode()
def compute_features(target: Target, examples: list[dict], batch_tokens: int,
                     aux_layers: Sequence[int] = ()) -> list[torch.Tensor]:
    """Features [T_i, (1 + n) H] for each example: the last hidden state, then the outputs of the
    n ``aux_layers`` (right-padded batches of similar length, at most ``batch_tokens`` tokens each
    but one example at least, each in one forward: ``train.packing.packed_features``, the padding a
    segment of its own)."""
    order = sorted(range(len(examples)), key=lambda i: len(examples[i]["input_ids"]))
    out: list[torch.Tensor | None] = [None] * len(examples)
    i = 0
    while i < len(order):
        j = i + 1
        while j < len(order) and len(examples[order[j]]["input_ids"]) * (j - i + 1) <= batch_tokens:
            j += 1
        chunk = order[i:j]
        longest = max(len(examples[k]["input_ids"]) for k in chunk)
        ids = torch.zeros(len(chunk), longest, dtype=torch.long)
        segment = torch.ones(len(chunk), longest, dtype=torch.long)
        for row, k in enumerate(chunk):
            n = len(examples[k]["input_ids"])
            ids[row, :n] = torch.tensor(examples[k]["input_ids"])
            segment[row, :n] = 0
        positions = torch.arange(longest)[None].expand(len(chunk), -1)
        hidden = packed_features(target, ids, positions, segment, aux_layers)
        for row, k in enumerate(chunk):
            out[k] = hidden[row, : len(examples[k]["input_ids"])].float().cpu()
        i = j
    return out  # type: ignore[return-value]


def write_shard(path: Path, examples: list[dict], features: list[torch.Tensor], dtype: torch.dtype,
                hidden_size: int) -> None:
    """``features`` [T_i, (1 + n) H] per example: stored as ``hidden`` [T_i, H] and, when n > 0,
    ``aux`` [T_i, n H]."""
    from safetensors.torch import save_file

    tensors = {}
    for i, (ex, feat) in enumerate(zip(examples, features)):
        tensors[f"{i}.input_ids"] = torch.tensor(ex["input_ids"], dtype=torch.long)
        tensors[f"{i}.loss_mask"] = torch.tensor(ex["loss_mask"], dtype=torch.uint8)
        tensors[f"{i}.hidden"] = feat[:, :hidden_size].to(dtype).contiguous()
        if feat.shape[1] > hidden_size:
            tensors[f"{i}.aux"] = feat[:, hidden_size:].to(dtype).contiguous()
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp))
    tmp.replace(path)


def read_shard(path: Path) -> list[dict[str, torch.Tensor]]:
    """The examples of a shard: input_ids, loss_mask, hidden (and aux), features in the stored
    dtype (``collate`` makes them float32 per batch, so a big folder stays half the size in memory)."""
    from safetensors.torch import load_file

    tensors = load_file(str(path))
    n = sum(name.endswith(".input_ids") for name in tensors)
    return [{"input_ids": tensors[f"{i}.input_ids"], "loss_mask": tensors[f"{i}.loss_mask"].bool(),
             "hidden": tensors[f"{i}.hidden"], **({"aux": tensors[f"{i}.aux"]} if f"{i}.aux" in tensors else {})}
            for i in range(n)]


def load_manifest(out_dir: Path, target: Target | None = None) -> dict:
    """The manifest of a feature folder, refused when made by another target."""
    path = out_dir / MANIFEST
    if not path.is_file():
        raise EagleError(f"no feature manifest at {path}")
    manifest = json.loads(path.read_text())
    if target is not None and manifest["target"]["tokenizer_fingerprint"] != target.tokenizer_fingerprint or (
            target is not None and manifest["target"]["hidden_size"] != target.hidden_size):
        raise EagleError(f"features in {out_dir} were made by target {manifest['target']['name']!r}, "
                         f"not {target.name!r}: regenerate them")
    return manifest


def shard_is_valid(out_dir: Path, name: str, entry: dict) -> bool:
    path = out_dir / name
    return path.is_file() and sha256(path) == entry.get("sha256")


def examples_digest(examples: list[dict]) -> str:
    """What a shard was computed from: its examples' token ids and loss masks."""
    return hashlib.sha256(json.dumps([[ex["input_ids"], ex["loss_mask"]] for ex in examples]).encode()).hexdigest()


def build(cfg: FeaturesConfig, target: Target | None = None) -> Path:
    """Compute missing or corrupt shards; return the feature folder."""
    chats, replayed = load_all(cfg.data, cfg.skip_malformed), replay_draw(cfg.replay, cfg.replay_seed)
    target = target or feature_target(cfg.target)
    out_dir = Path(cfg.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if chats.problems:
        more = f" (and {len(chats.problems) - 1} more)" if len(chats.problems) > 1 else ""
        print(f"eagle-features: warning: skipped {len(chats.problems)} malformed line(s): {chats.problems[0]}{more}",
              file=sys.stderr)
    examples = tokenize_all(target.tokenizer, replayed + chats.conversations, cfg.max_length)
    identity = target_identity(target)
    manifest_path = out_dir / MANIFEST
    if manifest_path.is_file():
        manifest = load_manifest(out_dir, target)
    else:
        manifest = {"target": identity, "shards": {}}
    manifest["source"], manifest["config"] = cfg.data, dataclasses.asdict(cfg)  # data may have been appended since
    manifest["skipped"] = chats.skipped
    manifest["malformed_lines"] = chats.problems
    manifest["replayed"] = len(replayed)
    manifest["num_examples"] = len(examples)
    dtype = getattr(torch, cfg.feature_dtype)
    shards = [examples[i:i + cfg.shard_size] for i in range(0, len(examples), cfg.shard_size)]
    total_tokens = sum(len(ex["input_ids"]) for ex in examples)
    bar = tqdm(total=total_tokens, unit="tok", unit_scale=True, desc="features")
    start = time.time()
    for index, shard in enumerate(shards):
        if cfg.max_wall_s and time.time() - start > cfg.max_wall_s:  # what the shards written hold
            bar.close()
            written = manifest["shards"].values()  # what FeatureShards reads
            manifest["num_examples"] = sum(entry["examples"] for entry in written)
            manifest["tokens"] = sum(entry["tokens"] for entry in written)
            manifest["stopped_at_max_wall_s"] = True
            manifest_path.write_text(json.dumps(manifest, indent=2))
            print(f"eagle-features: stopped at max_wall_s with {len(manifest['shards'])} of {len(shards)} shards "
                  f"({manifest['tokens']} tokens); a rerun continues", file=sys.stderr)
            return out_dir
        name = f"shard-{index:05d}.safetensors"
        tokens = sum(len(ex["input_ids"]) for ex in shard)
        entry = manifest["shards"].get(name, {})
        digest = examples_digest(shard)
        if (entry.get("examples_sha256") == digest and entry.get("aux_layers", []) == list(cfg.aux_layers)
                and shard_is_valid(out_dir, name, entry)):
            bar.update(tokens)
            continue
        write_shard(out_dir / name, shard, compute_features(target, shard, cfg.batch_tokens, cfg.aux_layers), dtype,
                    target.hidden_size)
        manifest["shards"][name] = {"examples": len(shard), "tokens": tokens, "sha256": sha256(out_dir / name),
                                    "examples_sha256": digest, "aux_layers": list(cfg.aux_layers)}
        manifest["tokens"] = sum(s["tokens"] for s in manifest["shards"].values())
        tmp = manifest_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(manifest, indent=2))
        tmp.replace(manifest_path)
        bar.update(tokens)
        bar.set_postfix(tok_per_s=f"{bar.n / max(1e-9, time.time() - start):.0f}")
    bar.close()
    for stale in sorted(set(manifest["shards"]) - {f"shard-{i:05d}.safetensors" for i in range(len(shards))}):
        del manifest["shards"][stale]  # the data shrank: shards past its end no longer belong to it
        (out_dir / stale).unlink(missing_ok=True)
    manifest["tokens"] = total_tokens
    manifest.pop("stopped_at_max_wall_s", None)
    manifest_path.write_text(json.dumps(manifest, indent=2))
    return out_dir


class FeatureShards(torch.utils.data.Dataset):
    """All examples of a feature folder, or of several in order (each verified against its manifest and the
    target); ``aux_layers``: the decoder layers whose outputs their shards hold besides the feature (the same
    in every folder)."""

    def __init__(self, out_dir: str | Path | Sequence[str | Path], target: Target | None = None) -> None:
        dirs = [Path(out_dir)] if isinstance(out_dir, (str, Path)) else [Path(d) for d in out_dir]
        self.examples: list[dict[str, torch.Tensor]] = []
        for i, folder in enumerate(dirs):
            manifest = load_manifest(folder, target)
            aux_layers = list(manifest.get("config", {}).get("aux_layers", []))
            if i and aux_layers != self.aux_layers:
                raise EagleError(f"the features in {folder} hold the outputs of layers {aux_layers}, those in "
                                 f"{dirs[0]} of {self.aux_layers}: make them with the same aux_layers")
            self.aux_layers = aux_layers
            for name, entry in sorted(manifest["shards"].items()):
                if not shard_is_valid(folder, name, entry) or entry.get("aux_layers", []) != self.aux_layers:
                    raise EagleError(f"feature shard {folder / name} is corrupt, half-written or made with other "
                                     f"aux_layers: rerun eagle-features to regenerate it")
                self.examples.extend(read_shard(folder / name))

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.examples[i]


class OnlineFeatures(torch.utils.data.Dataset):
    """Tokenized chats whose features (and ``aux_layers`` outputs) are computed during training
    (nothing stored)."""

    def __init__(self, target: Target, examples: list[dict], aux_layers: Sequence[int] = ()) -> None:
        self.target, self.examples, self.aux_layers = target, examples, list(aux_layers)

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.many([i])[0]

    def many(self, indices: Sequence[int]) -> list[dict[str, torch.Tensor]]:
        """The items of ``indices``, their features from one batched target forward."""
        examples = [self.examples[i] for i in indices]
        feats = compute_features(self.target, examples, 1 << 30, self.aux_layers)
        h = self.target.hidden_size
        return [{"input_ids": torch.tensor(ex["input_ids"]), "loss_mask": torch.tensor(ex["loss_mask"]).bool(),
                 "hidden": feat[:, :h], **({"aux": feat[:, h:]} if self.aux_layers else {})}
                for ex, feat in zip(examples, feats)]


def iter_batches(dataset: torch.utils.data.Dataset, indices: list[int], batch_size: int) -> Iterator[dict]:
    """Collated batches of ``indices`` in order (an ``OnlineFeatures`` computes each batch in one forward)."""
    many = getattr(dataset, "many", None)
    for i in range(0, len(indices), batch_size):
        chunk = indices[i:i + batch_size]
        yield collate(many(chunk) if many is not None else [dataset[j] for j in chunk])


def collate(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Right-pad a list of examples -> input_ids [B, T], loss_mask and valid [B, T] bool, hidden
    [B, T, H] float32 (and aux [B, T, n H] when the examples have it)."""
    longest = max(len(it["input_ids"]) for it in items)
    batch = {"input_ids": torch.zeros(len(items), longest, dtype=torch.long),
             "loss_mask": torch.zeros(len(items), longest, dtype=torch.bool),
             "valid": torch.zeros(len(items), longest, dtype=torch.bool)}
    keys = ("hidden", "aux") if "aux" in items[0] else ("hidden",)
    for key in keys:
        batch[key] = torch.zeros(len(items), longest, items[0][key].shape[-1])
    for row, it in enumerate(items):
        n = len(it["input_ids"])
        batch["input_ids"][row, :n] = it["input_ids"]
        batch["loss_mask"][row, :n] = it["loss_mask"]
        batch["valid"][row, :n] = True
        for key in keys:
            batch[key][row, :n] = it[key]
    return batch


@command("eagle-features")
def main(argv: list[str] | None = None) -> None:
    parser = Parser(prog="eagle-features", description="Compute target features for drafter training")
    parser.add_argument("--config", help="YAML with FeaturesConfig keys")
    add_set_argument(parser)
    args = parser.parse_args(argv)
    cfg = load_config_file(FeaturesConfig, args.config, args.set, "features config")
    note_ignored("eagle-features", changed_keys(cfg), [(("replay_seed",), not cfg.replay, "without replay")])
    build(cfg)

if __name__ == "__main__":
    sys.exit(main())
