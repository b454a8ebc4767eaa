"""What ``eagle-tree`` would gain at the sizes users run on GPUs, from random weights in their shapes.

Real 1.5B-8B weights cannot travel to a GPU lent for minutes, but their costs do not depend on the
weights' values. For each shape in ``SHAPES`` this builds the target with random weights through the
runtime's own path (``eagle.runtime.target.random_target``: lean forward, static shapes, CUDA graphs)
and a random drafter of its shape (``Drafter.from_target``: one layer, the shipped drafter's layout),
and measures in the engine itself (``EagleModel``, default options on the device):

- the verify cost curve: one target forward of 1 .. 128 rows after ``context`` cached tokens, the
  head's argmaxes included (``tree_sizing.measure_cost_curve``; up to 64 rows on the captured
  buckets, past them eagerly, as the engine runs them);
- per round of EAGLE's 60-node tree (top-k 10) at each draft depth: the draft phase, the verify, and
  the rest of the round (acceptance, cache compaction, feeding the drafter, the host read);
- ``ar``'s seconds per token (``EagleModel.generate``, one captured step per token).

A random drafter's drafts are rarely accepted, so the speedup is projected, not measured: a round
at the 60/6/10 tree gains the accepted length tau measured with real drafters (``ACCEPTED``,
``PUBLISHED``), so speedup = tau * (ar seconds per token) / (round seconds), and a tree breaks even
at tau = round / ar. ``--scale tiny`` shrinks every shape (2 layers, hidden 64) to rehearse the
whole run on a CPU.

    python -m infer.size_projection --json size-projection.json --markdown size-projection.md
    EAGLE_FAKE_CAPTURE=1 EAGLE_CPU_KERNELS=0 python -m infer.size_projection --scale tiny --device cpu"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

# Architectures as their config.json files on the Hugging Face hub give them (Qwen/Qwen2.5-1.5B-Instruct,
# meta-llama/Llama-3.2-3B-Instruct, meta-llama/Llama-3.1-8B-Instruct). max_position_embeddings is cut to CONTEXT, the positions the measurement's
# preallocated caches hold (131072 would take 17 GB of keys at 8B; Llama-3's rotary scaling wants more than 8192).
CONTEXT = 16384
SHAPES: dict[str, dict[str, Any]] = {
    "qwen2.5-1.5b": dict(model_type="qwen2", hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, intermediate_size=8960, vocab_size=151936, rope_theta=1000000.0,
                         rms_norm_eps=1e-6, tie_word_embeddings=True, max_position_embeddings=CONTEXT),
    "llama-3.2-3b": dict(model_type="llama", hidden_size=3072, num_hidden_layers=28, num_attention_heads=24,
                         num_key_value_heads=8, head_dim=128, intermediate_size=8192, vocab_size=128256,
                         rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
                         max_position_embeddings=CONTEXT,
                         rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                           original_max_position_embeddings=8192)),
    "llama-3.1-8b": dict(model_type="llama", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, intermediate_size=14336, vocab_size=128256, rope_theta=500000.0,
                         rms_norm_eps=1e-5, tie_word_embeddings=False, max_position_embeddings=CONTEXT,
                         rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                           original_max_position_embeddings=8192)),
}
for _shape in SHAPES.values():  # no token ends a generation: every run makes all its tokens
    _shape.update(bos_token_id=None, eos_token_id=None, pad_token_id=None)

# the shipped drafter's layout (eagle/shipped/drafters/smollm2-135m-instruct): EAGLE-1/2, one decoder layer of
# the target's shape, its own head over the most frequent quarter of the vocabulary (12288 of 49152)
DRAFT_VOCAB_SHARE = 12288 / 49152
TREE = dict(total_tokens=60, depth=6, top_k=10)  # EAGLE's tree, where the accepted lengths below were measured
ROWS = (1, 2, 4, 8, 16, 24, 32, 48, 60, 64, 96, 128)
DEPTHS = (1, 2, 3, 4, 5, 6)
AUTO_COST = 1.3  # a fixed tree size read off a curve: the largest whose verify costs at most this many one-row forwards

# accepted lengths (bonus token included) measured with real drafters in that tree, greedy
ACCEPTED = [
    {"tau": 2.87, "drafter": "the shipped EAGLE-2 drafter of SmolLM2-135M-Instruct",
     "where": "80 held-out prompts, EAGLE's 60/6/10 tree, greedy (one H200, 2026-11-26)"},
]
# published accepted lengths of drafters for targets near each size (AngelSlim's EAGLE-3 drafters for Qwen3,
# greedy, mean of 4 sets, as the reference notes give them): what a trained drafter reaches at that size
PUBLISHED = {
    "qwen2.5-1.5b": {"tau": 2.85, "drafter": "AngelSlim EAGLE-3 for Qwen3-1.7B", "where": "greedy, mean of 4 sets"},
    "llama-3.2-3b": {"tau": 3.03, "drafter": "AngelSlim EAGLE-3 for Qwen3-4B", "where": "greedy, mean of 4 sets"},
    "llama-3.1-8b": {"tau": 3.72, "drafter": "AngelSlim EAGLE-3 for Qwen3-8B", "where": "greedy, mean of 4 sets"},
}


def tiny(shape: dict[str, Any]) -> dict[str, Any]:
    """``shape`` shrunk for a CPU rehearsal: 2 layers, hidden 64 in heads of 16, one key head, the MLP's
    ratio kept, 1024 tokens; the rest (kind, rotary settings, tied head, context) as it is."""
    ratio = shape["intermediate_size"] / shape["hidden_size"]
    return dict(shape, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                intermediate_size=16 * round(64 * ratio / 16), vocab_size=1024)


def steady_round(view: Any, prompt: list[int], method: str, new_tokens: int) -> dict[str, float]:
    """Seconds per round (target forward) of ``method`` in steady decoding, by step of the round
    (``GenerationResult.step_seconds``) and in all (``round``), and ``tokens`` per round: the difference
    between a run of ``new_tokens`` and one of a quarter of them, after a warm-up run that captures the
    shapes, so that what the first and last rounds alone pay (the last rounds draft fewer levels) cancels."""
    view.generate(prompt, method, max_new_tokens=8)
    short = view.generate(prompt, method, max_new_tokens=max(1, new_tokens // 4))
    long = view.generate(prompt, method, max_new_tokens=new_tokens)
    rounds = long.target_forwards - short.target_forwards
    if rounds <= 0:  # as many rounds for fewer tokens: no difference to take
        short, rounds = None, long.target_forwards

    def spent(result: Any, step: str | None = None) -> float:
        if result is None:
            return 0.0
        return result.step_seconds.get(step, 0.0) if step else result.elapsed_s - result.prefill_s

    steps = {step: (spent(long, step) - spent(short, step)) / rounds for step in long.step_seconds}
    tokens = len(long.token_ids) - (len(short.token_ids) if short is not None else 0)
    return dict(steps, round=(spent(long) - spent(short)) / rounds, tokens=tokens / rounds)


def projection(ar_s: float, round_s: float, tau: float) -> float:
    """Tokens per second of rounds of ``round_s`` seconds gaining ``tau`` tokens each, over ``ar``'s at
    ``ar_s`` seconds a token."""
    return tau * ar_s / round_s


def measure(name: str, shape: dict[str, Any], device: str | None, dtype: torch.dtype | None, context: int,
            new_tokens: int, repeats: int, rows: tuple[int, ...] = ROWS,
            depths: tuple[int, ...] = DEPTHS) -> dict[str, Any]:
    """One shape's measurements and projection (module docstring); the model is freed before returning."""
    from eagle import EagleModel
    from eagle.decoding.device_rounds import MAX_TREE
    from eagle.decoding.tree_sizing import measure_cost_curve
    from eagle.drafting.drafter import Drafter
    from eagle.runtime.cuda_graphs import capture_stats
    from eagle.runtime.target import random_target
    from infer.bench import machine

    start, before = time.perf_counter(), capture_stats()
    target = random_target(shape, name, device, dtype)
    vocab = shape["vocab_size"]
    with torch.device(target.device):  # initialized where it runs
        drafter = Drafter.from_target(target, draft_vocab_size=max(TREE["top_k"], round(vocab * DRAFT_VOCAB_SHARE)))
    # CUDA's defaults, named so that a CPU rehearsal runs the same path: static shapes (captured), device rounds
    model = EagleModel.from_pretrained(target, drafter=drafter, lookup_tokens=0, cuda_graphs=True, device_rounds=True,
                                       **TREE)
    target = model.target  # the one on static shapes
    built_s = time.perf_counter() - start
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, vocab, (context,), generator=gen).tolist()
    curve = measure_cost_curve(target, sizes=rows, context=context, repeats=repeats, greedy=True)
    verify = dict(zip(curve.sizes, curve.seconds))

    ar = steady_round(model, prompt, "ar", new_tokens)
    ar_s = ar["round"] / ar["tokens"]
    by_depth = {depth: steady_round(model.with_tree(dataclasses.replace(model.tree, depth=depth)), prompt,
                                    "eagle-tree", new_tokens) for depth in depths}
    full = by_depth[max(depths)]
    after = capture_stats()
    report = {
        "shape": {k: v for k, v in shape.items() if not k.endswith("token_id")},
        "parameters": sum(p.numel() for p in target.model.parameters()),
        "drafter": dataclasses.asdict(drafter.config) | {"target": None},
        "machine": machine(model),
        "context": context, "new_tokens": new_tokens, "build_seconds": round(built_s, 2),
        "verify_seconds": verify,
        "verify_vs_one_row": {n: s / verify[rows[0]] for n, s in verify.items()},
        # a fixed tree size read off this curve: the largest tree whose verify costs at most AUTO_COST one-row forwards
        "auto_tree_size": max((n for n in range(2, MAX_TREE + 1) if curve.at(n) <= AUTO_COST * curve.at(1)), default=2),
        "ar_seconds_per_token": ar_s,
        "round_seconds_by_depth": by_depth,
        "draft_seconds_by_depth": {d: r.get("draft", 0.0) for d, r in by_depth.items()},
        "round_overhead_seconds": full["round"] - full.get("draft", 0.0) - full.get("verify", 0.0),
        "break_even_tau": full["round"] / ar_s,
        "projected_speedup": [dict(a, speedup=projection(ar_s, full["round"], a["tau"])) for a in ACCEPTED]
                             + ([dict(PUBLISHED[name], speedup=projection(ar_s, full["round"], PUBLISHED[name]["tau"]))]
                                if name in PUBLISHED else []),
        "graph_captures": after["captured"] - before["captured"],
        "graph_fallbacks": after["fallbacks"] - before["fallbacks"],
        "seconds": round(time.perf_counter() - start, 2),
    }
    del model, drafter, target
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return report


def _by_int(values: dict) -> dict[int, Any]:
    """A dict keyed by row counts or depths (ints, or strings once read from JSON) -> keyed by ints."""
    return {int(k): v for k, v in values.items()}


def markdown(report: dict[str, Any]) -> str:
    """A ``size-projection`` report -> the results page's tables (after its heading and machine line)."""
    sizes = report["sizes"]
    tau = ACCEPTED[0]["tau"]
    lines = ["| shape | parameters | verify 1 row (ms) | 60 rows / 1 row | 128 rows / 1 row | auto tree size | "
             "ar (ms/token) | draft, depth 6 (ms) | round overhead (ms) | round (ms) | break-even tau | "
             f"projected speedup, tau {tau} | published tau: projected speedup |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    nan = float("nan")
    for name, s in sizes.items():
        verify, ratio = _by_int(s["verify_seconds"]), _by_int(s["verify_vs_one_row"])
        rounds = _by_int(s["round_seconds_by_depth"])
        full = rounds[max(rounds)]
        ours, *published = s["projected_speedup"]
        lines.append(
            f"| {name} | {s['parameters'] / 1e9:.2f}B | {1e3 * verify[min(verify)]:.2f} | {ratio.get(60, nan):.2f}x | "
            f"{ratio.get(128, nan):.2f}x | {s.get('auto_tree_size', '-')} | {1e3 * s['ar_seconds_per_token']:.2f} | "
            f"{1e3 * full.get('draft', 0.0):.2f} | {1e3 * s['round_overhead_seconds']:.2f} | "
            f"{1e3 * full['round']:.2f} | {s['break_even_tau']:.2f} | {ours['speedup']:.2f}x | "
            + (f"{published[0]['tau']}: {published[0]['speedup']:.2f}x |" if published else "- |"))
    depths = sorted({d for s in sizes.values() for d in _by_int(s["draft_seconds_by_depth"])})
    lines += ["", "Draft phase per round by tree depth (ms; top-k 10, 60 nodes kept)", "",
              "| shape | " + " | ".join(f"depth {d}" for d in depths) + " |", "|---" * (len(depths) + 1) + "|"]
    for name, s in sizes.items():
        draft = _by_int(s["draft_seconds_by_depth"])
        lines.append(f"| {name} | " + " | ".join(f"{1e3 * draft[d]:.2f}" if d in draft else "-" for d in depths) + " |")
    row_counts = sorted({n for s in sizes.values() for n in _by_int(s["verify_seconds"])})
    lines += ["", "Verify cost by rows (one target forward after the context, ms)", "",
              "| shape | " + " | ".join(str(n) for n in row_counts) + " |", "|---" * (len(row_counts) + 1) + "|"]
    for name, s in sizes.items():
        verify = _by_int(s["verify_seconds"])
        lines.append(f"| {name} | " + " | ".join(f"{1e3 * verify[n]:.2f}" if n in verify else "-" for n in row_counts)
                     + " |")
    a = ACCEPTED[0]
    lines += ["", f"Inputs: tau {a['tau']} is the accepted length of {a['drafter']} ({a['where']}); the published "
              "tau are " + "; ".join(f"{p['drafter']} {p['tau']}" for p in PUBLISHED.values()) + " (greedy, mean of "
              "4 sets). Projected speedup = tau x ar's seconds per token / the 60/6/10 round's seconds; break-even "
              "tau = round / ar; auto tree size: the largest tree whose verify costs at most 1.3 one-row forwards "
              "(what total_tokens=\"auto\" verifies). The random drafter's own accepted lengths are not a result.",
              ""]
    return "\n".join(lines)


def section(report: dict[str, Any], source: str) -> str:
    """The results page's section of a ``size-projection`` report (``eagle-results``)."""
    mach = next(iter(report["sizes"].values()), {}).get("machine", {}) if report["sizes"] else {}
    where = mach.get("gpu") or mach.get("cpu") or ""
    captures = sum(s["graph_captures"] for s in report["sizes"].values())
    fallbacks = sum(s["graph_fallbacks"] for s in report["sizes"].values())
    head = [f"## {report.get('title') or 'Projection: eagle-tree at real model sizes (random weights)'}", "",
            f"`{report.get('command', '')}`", "",
            f"PROJECTION, not a measured speedup: costs measured with random weights in each shape, accepted lengths "
            f"taken from real drafters. Machine: {where}; {mach.get('device')} {mach.get('dtype')}, torch "
            f"{mach.get('torch')}; CUDA graphs: {captures} captured, {fallbacks} fell back. Date: "
            f"{mach.get('date', 'not recorded')}. Context {report.get('context')} tokens, "
            f"{report.get('new_tokens')} new tokens a run. Data: `{source}`.", ""]
    return "\n".join(head) + "\n" + markdown(report)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m infer.size_projection", description=__doc__.splitlines()[0])
    parser.add_argument("--scale", choices=("full", "tiny"), default="full", help="tiny: shrunk shapes, for a CPU")
    parser.add_argument("--sizes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--device", help="default: CUDA when present")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), help="default: bf16 on CUDA, fp32 on a CPU")
    parser.add_argument("--context", type=int, help="prompt tokens before the measured rounds (default 256; tiny 48)")
    parser.add_argument("--new-tokens", type=int, help="tokens of the longer timed run (default 32; tiny 12)")
    parser.add_argument("--repeats", type=int, help="timings per row count of the verify curve (default 3; tiny 1)")
    parser.add_argument("--json", help="write the report here (rewritten after each shape)")
    parser.add_argument("--markdown", help="write the results page's section here")
    parser.add_argument("--title", help="the section's title")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    names = [n for n in args.sizes.split(",") if n]
    unknown = [n for n in names if n not in SHAPES]
    if unknown:
        raise SystemExit(f"unknown size {unknown[0]!r}; choose from {', '.join(SHAPES)}")
    small = args.scale == "tiny"
    context = args.context or (48 if small else 256)
    new_tokens = args.new_tokens or (12 if small else 32)
    repeats = args.repeats or (1 if small else 3)
    report: dict[str, Any] = {"kind": "size-projection", "title": args.title, "scale": args.scale,
                              "command": "python -m infer.size_projection " + " ".join(argv), "context": context,
                              "new_tokens": new_tokens, "tree": TREE, "accepted": ACCEPTED, "published": PUBLISHED,
                              "sizes": {}, "failed": {}}
    dtype = getattr(torch, args.dtype) if args.dtype else None
    for name in names:
        shape = tiny(SHAPES[name]) if small else SHAPES[name]
        print(f"[{time.strftime('%H:%M:%S')}] {name}: {shape}", flush=True)
        try:
            report["sizes"][name] = measure(name, shape, args.device, dtype, context, new_tokens, repeats)
        except Exception as exc:  # noqa: BLE001 - one shape failing (out of memory, say) keeps the others
            report["failed"][name] = f"{type(exc).__name__}: {exc}"
            print(f"{name} FAILED: {report['failed'][name]}", flush=True)
        else:
            s = report["sizes"][name]
            print(json.dumps({"size": name, "verify_60_vs_1": round(s["verify_vs_one_row"][60], 3),
                              "break_even_tau": round(s["break_even_tau"], 3),
                              "projected": [round(p["speedup"], 3) for p in s["projected_speedup"]],
                              "fallbacks": s["graph_fallbacks"], "seconds": s["seconds"]}), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    if args.markdown:
        Path(args.markdown).write_text(section(report, args.json or "") if report["sizes"] else "")
    return 1 if report["failed"] or any(s["graph_fallbacks"] for s in report["sizes"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
