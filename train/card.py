"""Write the model card (README.md) of a trained drafter from the run's own records: the
self-distillation manifest, the feature manifest, the training summary and an ``eagle-bench``
JSON measured on the project's dev prompt set."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from eagle.errors import EagleError, command


def _load(path: str) -> dict:
    p = Path(path)
    if not p.is_file():
        raise EagleError(f"missing record for the model card: {path}")
    return json.loads(p.read_text())


def render(drafter_dir: Path, data: dict, features: dict, summary: dict, bench: dict, train_yaml: str,
           fixed_tree: dict | None = None, init_summary: dict | None = None) -> str:
    cfg = json.loads((drafter_dir / "config.json").read_text())
    methods = bench["methods"]
    tree = methods.get("eagle-tree", {})
    rows = "\n".join(
        f"| {m} | {s['tokens_per_second']:.2f} | {s['mean_accept_length']:.2f} | "
        f"{'-' if s.get('speedup_vs_ar') is None else format(s['speedup_vs_ar'], '.2f') + 'x'} | "
        f"{'-' if s.get('identical_to_ar') is None else ('yes' if s['identical_to_ar'] else 'NO')} |"
        for m, s in methods.items())
    flags = bench["config"]
    return f"""# EAGLE drafter for {cfg['target']['name']}

An EAGLE-1/2 feature-level drafter ({cfg['num_layers']} decoder layer, hidden {cfg['hidden_size']}, fc 2H -> H,
draft vocabulary {cfg.get('draft_vocab_size') or cfg['vocab_size']} of {cfg['vocab_size']} tokens) for
`{cfg['target']['name']}` (tokenizer fingerprint `{cfg['target']['tokenizer_fingerprint']}`), trained with this
repository's pipeline on 2 CPU cores. `EagleModel.from_pretrained("{cfg['target']['name']}")` loads it by default.

## Data (self-distillation, no outside data)
The target wrote {data['questions_sampled']} user questions itself (Magpie-style: only the chat template's user
prefix, steered by topic and task seeds from `configs/selfdistill/seeds.yaml`), {data['questions_kept']} survived
filtering and deduplication, and it answered them greedily (at most
{data['config']['answer_max_tokens']} new tokens): {data['conversations']} conversations, {data['answer_tokens']}
answer tokens, {data['wall_s'] / 60:.0f} minutes of generation.
Features: {features['num_examples']} examples, {features['tokens']} tokens (max length
{features['config']['max_length']}), stored as {features['config']['feature_dtype']}.

## Training
`deepspeed --num_gpus 1 train/main.py --config {train_yaml}`: {summary['steps']} optimizer steps
({summary['epochs']} full epochs) on {summary['train_examples']} examples; loss = SmoothL1(feature) + 0.1 * soft-CE,
U(-0.1, 0.1) input noise, AdamW (configs/deepspeed/cpu-small.json). Wall time {summary.get('wall_s', 0) / 60:.0f}
minutes.
""" + ("" if init_summary is None else f"""Warm-started (`init_from: {summary.get('init_from', '')}`) from a drafter trained
earlier with the same pipeline: {init_summary['steps']} steps ({init_summary['epochs']} epochs) on the first
{init_summary['train_examples']} examples, {init_summary.get('wall_s', 0) / 60:.0f} minutes. In all
{summary['steps'] + init_summary['steps']} steps, {(summary.get('wall_s', 0) + init_summary.get('wall_s', 0)) / 60:.0f}
minutes. The held-out split below is drawn from all examples, so it may hold examples that the first run trained
on; the dev-set figures further down are independent of the training data.
""") + f"""
Held-out evaluation ({summary['eval_examples']} conversations): top-1 accuracy {summary['eval'].get('top1', 0):.3f},
expected accepted length of a depth-5 chain {summary['eval'].get('chain5_accept_length', 0):.2f} (unrolled estimate,
bonus token included).

## Measured on the dev prompt set (`benchmarks/prompts/dev.jsonl`)
`{flags['command']}` on {bench['machine']['device']} ({bench['machine']['torch_threads']} threads), {bench['prompts']}
prompts, greedy:

| method | tokens/s | mean accepted length | speedup vs ar | identical to ar |
|---|---|---|---|---|
{rows}

Mean accepted length of `eagle-tree`: **{tree.get('mean_accept_length', 0):.2f}** tokens per target forward.
""" + ("" if fixed_tree is None else f"""
With a fixed tree (`{fixed_tree['config']['command']}`, {fixed_tree['prompts']} prompts): mean accepted length
**{fixed_tree['methods']['eagle-tree']['mean_accept_length']:.2f}**,
{fixed_tree['methods']['eagle-tree']['tokens_per_second']:.2f} tokens/s.
""")


@command("eagle-card")
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drafter", required=True)
    parser.add_argument("--selfdistill", required=True, help="manifest.json of the self-distilled data")
    parser.add_argument("--features", required=True, help="manifest.json of the feature shards")
    parser.add_argument("--summary", required=True, help="summary.json of the training run")
    parser.add_argument("--bench", required=True, help="eagle-bench --json output on the dev prompt set")
    parser.add_argument("--train-config", required=True)
    parser.add_argument("--fixed-tree-bench", help="eagle-bench --json output of eagle-tree with fixed tree flags")
    parser.add_argument("--init-summary", help="summary.json of the run a warm-started run began from")
    args = parser.parse_args(argv)
    drafter = Path(args.drafter)
    text = render(drafter, _load(args.selfdistill), _load(args.features), _load(args.summary), _load(args.bench),
                  args.train_config, _load(args.fixed_tree_bench) if args.fixed_tree_bench else None,
                  _load(args.init_summary) if args.init_summary else None)
    (drafter / "README.md").write_text(text)
    print(f"wrote {drafter / 'README.md'}")


if __name__ == "__main__":
    import sys

    sys.exit(main())
