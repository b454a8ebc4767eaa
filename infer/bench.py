"""``eagle-bench``: tokens/s, mean accepted length, speedups, greedy identity, per-category
numbers and a per-step time breakdown for several decoding methods, in one process with one
model load.

The ``llama.cpp*`` methods run llama.cpp's ``llama-server`` (a build folder from config key ``llama_cpp``
or ``$EAGLE_LLAMA_CPP``) on the target's GGUF file with as many threads as torch uses, on the same
chat-templated token ids, timed the same way (wall time of the whole request); see ``infer.llama_cpp``.

Methods run interleaved per prompt (every method on prompt 1, then every method on prompt 2,
...) so slow drift of the machine hits all methods alike. ``hf`` is Hugging Face
``model.generate()`` on the same target model, the baseline a user would otherwise run.
The statistics are small pure functions (``read_prompts``, ``summarize``, ``markdown``) that
work on plain record dicts, without a model."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import tempfile
import platform
import os
import shlex
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, Iterable, Optional

from eagle.config import LoadOptions, check_bool, check_int
from eagle.decoding.loop import STEPS
from eagle.errors import EagleError, Parser, check_writable, command, given_flags, note_ignored
from eagle.inputs import INT8, METHODS, SUFFIX, check_spec, modifiers, split_method
from eagle.prompts import NO_CATEGORY, read_prompts
from infer import llama_cpp
from infer.cli import (add_config_args, add_model_args, add_sampling_args, check_method, check_model_args,
                       check_sampling, load_model, note_ignored_flags, parse_command)

PROG = "eagle-bench"
RUN_ENV = ("EAGLE_CPU_ISA", "EAGLE_CPU_KERNELS", "EAGLE_FAKE_CAPTURE")  # recorded in the report's command
BENCH_METHODS = ("hf",) + METHODS + llama_cpp.METHODS
DEFAULT_METHODS = "hf,ar,pld,eagle-tree"
PARTS = ("prefill",) + STEPS  # the time breakdown, as fractions of total time


# ---- input ---------------------------------------------------------------------------------
DRAFTER_METHODS = ("eagle-tree", "eagle-chain")


def parse_methods(text: str) -> list[str]:
    """``"hf,ar,pld"`` -> ``["hf", "ar", "pld"]``; unknown or repeated names are errors. An EAGLE
    method may name its own drafter folder: ``eagle-tree@DIR``."""
    methods = [m.strip() for m in text.split(",") if m.strip()]
    if not methods:
        raise EagleError("--methods is empty; choose from " + ", ".join(BENCH_METHODS))
    for m in methods:
        method, drafter = split_method(m)
        if drafter is not None and (method not in DRAFTER_METHODS or not drafter):
            raise EagleError(f"{m!r}: only {' and '.join(DRAFTER_METHODS)} take a drafter folder after '@'")
        if INT8 in modifiers(m)[1] and method not in METHODS:
            raise EagleError(f"{m!r}: only eagle's own methods ({', '.join(METHODS)}) run with int8 activations")
        if SUFFIX in modifiers(m)[1] and method not in METHODS:
            raise EagleError(f"{m!r}: only eagle's own methods ({', '.join(METHODS)}) take suffix drafts")
    unknown = [m for m in methods if split_method(m)[0] not in BENCH_METHODS]
    if unknown:
        raise EagleError(f"unknown method(s) {', '.join(map(repr, unknown))}; choose from {', '.join(BENCH_METHODS)}")
    if len(set(methods)) != len(methods):
        raise EagleError(f"a method is listed twice in --methods {text!r}")
    return methods


def first_per_category(prompts: list[dict], n: int | None) -> list[dict]:
    """The first ``n`` prompts of each category, in file order (all of them when ``n`` is None)."""
    if n is None:
        return prompts
    seen: dict[str, int] = {}
    kept = []
    for p in prompts:
        seen[p["category"]] = seen.get(p["category"], 0) + 1
        if seen[p["category"]] <= n:
            kept.append(p)
    return kept


# ---- running -------------------------------------------------------------------------------
def _sync(device: Any) -> None:
    import torch

    if getattr(device, "type", "") == "cuda":
        torch.cuda.synchronize()


def transformers_model(target: Any) -> Any:
    """The target's transformers model, for ``hf``: its own, or for a GGUF target held as codes (which has no
    transformers forward: ``eagle.runtime.gguf_weights.GGUFModel``) the file converted once to fp32
    (``load_target(..., lean=False)``), loaded on first use."""
    if hasattr(target.model, "generate"):
        return target.model
    return _converted(target.name)


@functools.cache
def _converted(spec: str) -> Any:
    from eagle.runtime.target import load_target

    return load_target(spec, lean=False).model


def run_hf(model: Any, ids: list[int], max_new_tokens: int, temperature: float, top_p: float, top_k: int,
           seed: int | None) -> dict:
    """Hugging Face ``generate()`` on the target: one target forward per new token."""
    import torch

    target = model.target
    eos = sorted(target.eos_token_ids)
    pad = target.tokenizer.pad_token_id
    if pad is None:
        pad = eos[0] if eos else 0
    input_ids = torch.tensor([ids], device=target.device)
    kwargs: dict[str, Any] = dict(
        max_new_tokens=min(max_new_tokens, target.max_context - len(ids)),  # the same context limit as ours
        do_sample=temperature > 0, eos_token_id=eos or None, pad_token_id=pad,
        attention_mask=torch.ones_like(input_ids))
    if temperature > 0:
        kwargs.update(temperature=temperature, top_p=top_p, top_k=top_k)
    if seed is not None:
        torch.manual_seed(seed)
    _sync(target.device)
    start = time.perf_counter()
    with torch.inference_mode():
        out = transformers_model(target).generate(input_ids, **kwargs)
    _sync(target.device)
    seconds = time.perf_counter() - start
    new = [int(t) for t in out[0, len(ids):].tolist()]
    return dict(new_tokens=len(new), seconds=seconds, accept_lengths=[1] * len(new), target_forwards=len(new),
                token_ids=new, step_seconds=None, prefill_s=None)


def run_eagle(model: Any, ids: list[int], method: str, max_new_tokens: int, temperature: float, top_p: float,
              top_k: int, seed: int | None) -> dict:
    """One ``EagleModel.generate`` call, timed from the outside (same clock as ``hf``)."""
    _sync(model.target.device)
    start = time.perf_counter()
    result = model.generate(ids, method=method, max_new_tokens=max_new_tokens, temperature=temperature,
                            top_p=top_p, top_k=top_k, seed=seed)
    _sync(model.target.device)
    seconds = time.perf_counter() - start
    return dict(new_tokens=len(result.token_ids), seconds=seconds, accept_lengths=list(result.accept_lengths),
                target_forwards=result.target_forwards, token_ids=list(result.token_ids),
                step_seconds=dict(result.step_seconds), prefill_s=result.prefill_s,
                decode_seconds=seconds - result.prefill_s, accepted_by_source=dict(result.accepted_by_source))


def run_one(model: Any, ids: list[int], method: str, args: Any, servers: dict | None = None) -> dict:
    """One method on one prompt: its record, with the graph captures and capture fallbacks it caused."""
    from eagle.runtime.cuda_graphs import capture_stats

    options = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                   top_k=args.top_k, seed=args.seed)
    before = capture_stats()
    if method == "hf":
        record = run_hf(model, ids, **options)
    elif method in llama_cpp.METHODS:
        record = llama_cpp.run((servers or {})[method], ids, **options)
    else:
        record = run_eagle(model, ids, split_method(method)[0], **options)
    after = capture_stats()
    return dict(record, graph_captures=after["captured"] - before["captured"],
                graph_fallbacks=after["fallbacks"] - before["fallbacks"])


def drafter_name(model: Any) -> str | None:
    """Which drafter an ``EagleModel`` drafts with: its kind and the folder it was loaded from."""
    config = model.drafter_config
    return None if config is None else f"{config.kind} {model.drafter_source or '(in memory)'}"


def with_drafter(model: Any, folder: str) -> Any:
    """An ``EagleModel`` on ``model``'s target and settings with the drafter in ``folder``."""
    from eagle.engine import open_drafter, shipped_drafter_of_kind

    folder = shipped_drafter_of_kind(folder, model.target) or folder  # a kind, e.g. eagle-tree@eagle3
    return model.with_drafter(open_drafter(folder, model.target))


# ---- statistics (pure) ---------------------------------------------------------------------
def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _steps(r: dict) -> int:
    """Target forwards that yielded tokens: one per accepted length, or the record's ``steps`` where
    only the count is known (llama.cpp)."""
    return len(r["accept_lengths"]) if r.get("accept_lengths") is not None else r["steps"]


def _rates(records: list[dict]) -> dict:
    """Totals over records: tokens/s (new tokens over the whole measured time), decode-only tokens/s
    (over ``decode_seconds``: time after the prompt's prefill; None when a record lacks it), mean
    accepted length (tokens per target forward that yielded tokens)."""
    tokens = sum(r["new_tokens"] for r in records)
    seconds = sum(r["seconds"] for r in records)
    gained = sum(sum(r["accept_lengths"]) if r.get("accept_lengths") is not None else r["new_tokens"] for r in records)
    steps = sum(_steps(r) for r in records)
    decode = [r.get("decode_seconds") for r in records]
    decode_s = sum(decode) if records and all(d is not None for d in decode) else None
    return dict(tokens_per_second=tokens / seconds if seconds > 0 else 0.0,
                decode_tokens_per_second=tokens / decode_s if decode_s else None,
                mean_accept_length=gained / steps if steps else 0.0,
                new_tokens=tokens, seconds=seconds, steps=steps, prompts=len(records))


def step_fractions(records: list[dict]) -> dict | None:
    """Prefill and per-step time (``GenerationResult.step_seconds``) summed over records, as
    fractions of the total measured time; None when the records carry no breakdown (``hf``)."""
    if not records or any(r.get("step_seconds") is None for r in records):
        return None
    total = sum(r["seconds"] for r in records)
    if total <= 0:
        return None
    sums = {part: 0.0 for part in PARTS}
    for r in records:
        sums["prefill"] += r.get("prefill_s") or 0.0
        for step, s in r["step_seconds"].items():
            sums[step] = sums.get(step, 0.0) + s
    return {part: s / total for part, s in sums.items()}


def summarize(records: Iterable[dict], greedy: bool = True) -> dict:
    """Per-method statistics from run records (dicts with ``method``, ``prompt`` (index),
    ``category``, ``new_tokens``, ``seconds``, ``accept_lengths``, ``target_forwards``,
    ``token_ids``, ``step_seconds`` (dict or None), ``prefill_s``).

    tokens/s is total new tokens over total time; the mean accepted length is over all steps
    of all prompts; speedups are ratios of tokens/s (None when ar / hf / llama.cpp did not run);
    ``identical_to_ar`` says whether every prompt's tokens equal ar's, ``identical_share`` for
    which share of the prompts they do (both None unless greedy and ar ran); ``identical_to_llama_cpp``
    and ``identical_share_llama_cpp`` the same against ``llama.cpp`` (whose numerics differ from ours:
    the check that llama.cpp's speculative methods are lossless). A ``+int8`` method is compared with
    ``ar+int8`` where that ran (the same numerics), else with ``ar``."""
    records = list(records)
    methods = list(dict.fromkeys(r["method"] for r in records))
    references = {name: {r["prompt"]: r["token_ids"] for r in records if r["method"] == name}
                  for name in ("ar", "ar" + INT8, "llama.cpp")}
    out: dict[str, dict] = {}
    for method in methods:
        mine = [r for r in records if r["method"] == method]
        stats = _rates(mine)
        stats["target_forwards"] = sum(r["target_forwards"] for r in mine)
        ar = "ar" + INT8 if method.endswith(INT8) and references["ar" + INT8] else "ar"
        for name, every, share in ((ar, "identical_to_ar", "identical_share"),
                                   ("llama.cpp", "identical_to_llama_cpp", "identical_share_llama_cpp")):
            tokens = references[name]
            same = [r["token_ids"] == tokens.get(r["prompt"]) for r in mine] if greedy and tokens else None
            stats[every] = all(same) if same is not None else None
            stats[share] = sum(same) / len(same) if same is not None else None
        categories = list(dict.fromkeys(r.get("category", NO_CATEGORY) for r in mine))
        stats["per_category"] = {
            c: {k: v for k, v in _rates([r for r in mine if r.get("category", NO_CATEGORY) == c]).items()
                if k in ("tokens_per_second", "mean_accept_length", "prompts")} for c in categories}
        stats["step_fractions"] = step_fractions(mine)
        for key in ("graph_captures", "graph_fallbacks"):  # in the measured runs (captures are made in warm-up)
            stats[key] = sum(r.get(key) or 0 for r in mine)
        sources = Counter()
        for r in mine:
            sources.update(r.get("accepted_by_source") or {})
        steps = sum(_steps(r) for r in mine)
        stats["accepted_by_source"] = {k: sources[k] / steps for k in sorted(sources)} if sources and steps else None
        histogram = Counter(n for r in mine for n in (r["accept_lengths"] or []))
        stats["accept_length_histogram"] = {str(n): histogram[n] for n in sorted(histogram)}
        out[method] = stats
    for stats in out.values():
        stats["speedup_vs_ar"] = _ratio(stats["tokens_per_second"], out.get("ar", {}).get("tokens_per_second"))
        stats["speedup_vs_hf"] = _ratio(stats["tokens_per_second"], out.get("hf", {}).get("tokens_per_second"))
        stats["speedup_vs_llama_cpp"] = _ratio(stats["tokens_per_second"],
                                               out.get("llama.cpp", {}).get("tokens_per_second"))
    return out


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _f(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _yes(value: bool | None) -> str:
    return "n/a" if value is None else ("yes" if value else "NO")


def markdown(summary: dict) -> str:
    """The main table, the per-category table and the time breakdown, as Markdown. The decode-only
    tokens/s and speedup vs llama.cpp columns appear when some method has them."""
    methods = list(summary)
    decode = any(s.get("decode_tokens_per_second") is not None for s in summary.values())
    vs_llama = any(s.get("speedup_vs_llama_cpp") is not None for s in summary.values())
    same_llama = any(s.get("identical_to_llama_cpp") is not None for s in summary.values())
    main = _table(
        ["method", "tokens/s"] + (["decode tokens/s"] if decode else []) +
        ["mean accept len", "speedup vs ar", "speedup vs hf"] + (["speedup vs llama.cpp"] if vs_llama else []) +
        ["identical to ar"] + (["identical to llama.cpp"] if same_llama else []),
        [[m, f"{s['tokens_per_second']:.1f}"] +
         ([_f(s.get("decode_tokens_per_second"))] if decode else []) +
         [f"{s['mean_accept_length']:.2f}", _x(s["speedup_vs_ar"]), _x(s["speedup_vs_hf"])] +
         ([_x(s.get("speedup_vs_llama_cpp"))] if vs_llama else []) +
         [_yes(s["identical_to_ar"])] + ([_yes(s.get("identical_to_llama_cpp"))] if same_llama else [])
         for m, s in summary.items()])
    categories = list(dict.fromkeys(c for s in summary.values() for c in s["per_category"]))
    per_cat = _table(
        ["category"] + [f"{m} tok/s (accept)" for m in methods],
        [[c] + [(f"{s['per_category'][c]['tokens_per_second']:.1f} ({s['per_category'][c]['mean_accept_length']:.2f})"
                 if c in s["per_category"] else "-") for s in summary.values()] for c in categories])
    graphs = ""
    if any(s.get("graph_captures") or s.get("graph_fallbacks") for s in summary.values()):
        graphs = "Graphs captured and capture fallbacks (shapes run eagerly: slow) in the measured runs\n\n" + _table(
            ["method", "captured", "fell back"],
            [[m, str(s.get("graph_captures", 0)), str(s.get("graph_fallbacks", 0)) +
              (" (FELL BACK)" if s.get("graph_fallbacks") else "")] for m, s in summary.items()]) + "\n\n"
    breakdown = _table(
        ["method"] + list(PARTS),
        [[m] + ([f"{100 * (s['step_fractions'].get(p, 0.0)):.1f}%" for p in PARTS] if s["step_fractions"]
                else ["-"] * len(PARTS)) for m, s in summary.items()])
    by_source = ""
    if any(s.get("accepted_by_source") for s in summary.values()):
        names = sorted({k for s in summary.values() for k in (s.get("accepted_by_source") or {})})
        by_source = "Accepted drafts per target forward, by source\n\n" + _table(
            ["method"] + names, [[m] + [f"{(s.get('accepted_by_source') or {}).get(k, 0.0):.2f}" for k in names]
                                 for m, s in summary.items() if s.get("accepted_by_source")]) + "\n\n"
    return (f"{main}\n\nPer category: tokens/s (mean accepted length)\n\n{per_cat}\n\n{graphs}{by_source}"
            f"Time per step, fraction of total time\n\n{breakdown}\n")


def plot(summary: dict, path: str | Path) -> None:
    """Two panels: accepted-length histogram per method; speedup vs ar (else vs hf) bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = list(summary)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    longest = max((int(n) for s in summary.values() for n in s["accept_length_histogram"]), default=1)
    width = 0.8 / max(1, len(methods))
    for i, (m, s) in enumerate(summary.items()):
        hist = s["accept_length_histogram"]
        total = sum(hist.values()) or 1
        xs = list(range(1, longest + 1))
        left.bar([x - 0.4 + width * (i + 0.5) for x in xs], [hist.get(str(x), 0) / total for x in xs], width,
                 label=m)
    left.set_xlabel("accepted tokens per target forward")
    left.set_ylabel("fraction of steps")
    left.set_title("Accepted length")
    left.legend()
    base = "ar" if "ar" in summary else ("hf" if "hf" in summary else None)
    if base is not None:
        values = [summary[m][f"speedup_vs_{base}"] for m in methods]
        bars = right.bar(methods, values, color="tab:green")
        right.bar_label(bars, fmt="%.2fx")
        right.axhline(1.0, color="grey", lw=0.8)
        right.set_ylabel(f"speedup vs {base} (tokens/s ratio)")
    else:
        right.text(0.5, 0.5, "no ar or hf baseline ran", ha="center", va="center")
    right.set_title("Speedup")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- command line --------------------------------------------------------------------------
def build_parser() -> Parser:
    parser = Parser(prog=PROG, description="Benchmark decoding methods on a prompt file, one model load.")
    parser.add_argument("--prompts", required=True,
                        help='JSONL: {"prompt": str, "category"?: str} or {"turns": [str, ...], "category": str}')
    parser.add_argument("--methods", default=DEFAULT_METHODS,
                        help=f"comma list from {', '.join(BENCH_METHODS)} (default {DEFAULT_METHODS}); "
                             f"eagle-tree@DIR (or eagle-chain@DIR) runs with the drafter in DIR instead of --drafter; "
                             f"a method with the suffix {INT8} (ar+int8, eagle-tree+int8) runs on the target loaded "
                             f"again with int8_activations; with the suffix {SUFFIX} (eagle-tree+suffix) suffix drafts "
                             f"(the request, its own earlier answers, --suffix-corpus) join its trees")
    parser.add_argument("--limit", type=int, help="only the first N prompts")
    parser.add_argument("--per-category", type=int,
                        help="only the first N prompts of each category (every category stays represented)")
    parser.add_argument("--json", help="write the results to this JSON file")
    parser.add_argument("--title", help="a title stored in the --json report (eagle-results uses it)")
    parser.add_argument("--plot", help="draw accepted lengths and speedups to this PNG file")
    g = parser.add_argument_group("load test (eagle-serve with concurrent clients; docs/serving.md)")
    g.add_argument("--concurrency", metavar="N[,N...]",
                   help="run the load test instead: streamed chat requests over the prompts from N concurrent clients "
                        "per level (e.g. 1,4,16), every answer checked against the request decoded alone (--methods "
                        "default: ar,pld,eagle-tree)")
    g.add_argument("--url", help="the eagle-serve to load (default: one started in this process with the model options)")
    g.add_argument("--max-batch", type=int, default=None,
                   help="the in-process server's --max-batch (default: eagle-serve's)")
    add_sampling_args(parser, max_new_tokens=128, temperature=0.0)
    add_model_args(parser)
    add_config_args(parser, "; eagle-bench's own: warmup, requests_per_client, api_key, cache_pool, llama_cpp, "
                            "llama_cpp_draft, llama_cpp_draft_max")
    return parser


@dataclasses.dataclass(frozen=True)
class BenchOptions:
    """eagle-bench's own config keys. ``warmup``: run every method on the first N prompts first, not counted.
    Load test: ``requests_per_client`` K (each level of N clients sends N * K requests, taking the prompts in
    turn; default: every level sends every prompt once), ``api_key`` (the Bearer token of the server at
    ``--url``), ``cache_pool`` (the in-process server's, ``infer.serve.ServeOptions``). llama.cpp methods: ``llama_cpp``, its build folder (scripts/llama_cpp.sh build makes
    .llama.cpp; default $EAGLE_LLAMA_CPP); ``llama_cpp_draft``, the draft for llama.cpp-eagle3: a .gguf file,
    or an EAGLE-3 checkpoint folder (SpecForge layout) converted with the build's convert_hf_to_gguf.py
    (default: --drafter, an eagle3 drafter, exported and converted); ``llama_cpp_draft_max``, the most tokens
    llama-server drafts a step in llama.cpp-draft and llama.cpp-eagle3 (its ``--spec-draft-n-max``; default:
    llama.cpp's)."""

    warmup: int = 1
    requests_per_client: Optional[int] = None
    api_key: Optional[str] = None
    llama_cpp: Optional[str] = None
    llama_cpp_draft: Optional[str] = None
    llama_cpp_draft_max: Optional[int] = None
    cache_pool: bool = False

    def __post_init__(self) -> None:
        check_int("warmup", self.warmup, 0)
        check_bool("cache_pool", self.cache_pool)
        if self.requests_per_client is not None:
            check_int("requests_per_client", self.requests_per_client, 1)
        if self.llama_cpp_draft_max is not None:
            check_int("llama_cpp_draft_max", self.llama_cpp_draft_max, 1)
        for name in ("api_key", "llama_cpp", "llama_cpp_draft"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise EagleError(f"{name} must be a string, got {getattr(self, name)!r}")


def redacted(arg: str) -> str:
    """A command-line word with a ``api_key=KEY`` pair's key hidden."""
    return "api_key=***" if arg.startswith("api_key=") else arg


def report_options(args: argparse.Namespace) -> dict:
    """The command's options for a JSON report: the flags and config keys, ``api_key`` left out."""
    config = {k: v for k, v in vars(args).items() if k not in ("api_key", "config_keys")}
    config["set"] = [redacted(item) for item in args.set]
    config["config_keys"] = sorted(args.config_keys)
    return config


def cpu_name() -> str:
    """The CPU's model name with its family and model numbers (Linux: a virtual machine may name a Zen 4 and a Zen 5
    both "AMD EPYC"), else what ``platform`` knows."""
    try:
        fields: dict[str, str] = {}
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if not key.strip():
                break  # the first processor's fields
            fields.setdefault(key.strip(), value.strip())
        if "model name" in fields:
            numbers = [f"{k} {fields[k]}" for k in ("cpu family", "model") if k in fields]
            return fields["model name"] + (f" ({', '.join(numbers)})" if numbers else "")
    except OSError:
        pass
    return platform.processor() or platform.machine()


def peak_memory_mb() -> float | None:
    """The largest resident memory this process has held so far, in MB (``getrusage``'s maximum RSS: kB on
    Linux, bytes on macOS), or None where the platform has no ``resource`` module."""
    try:
        import resource
    except ImportError:
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return round(peak / (2 ** 20 if sys.platform == "darwin" else 2 ** 10), 1)


def check_llama_cpp(args: Any, methods: list[str]) -> dict | None:
    """Before anything loads: the build folder, its llama-server, the target's GGUF file and the
    given draft. None when no llama.cpp method runs."""
    wanted = [m for m in methods if m in llama_cpp.METHODS]
    if args.llama_cpp_draft is not None and "llama.cpp-eagle3" not in wanted:
        raise EagleError("llama_cpp_draft is for method llama.cpp-eagle3, which is not in --methods")
    if args.llama_cpp_draft_max is not None and not set(wanted) & set(llama_cpp.DRAFT_METHODS):
        raise EagleError(f"llama_cpp_draft_max is for methods {' and '.join(llama_cpp.DRAFT_METHODS)}, neither of "
                         f"which is in --methods")
    if "llama.cpp-draft" in wanted and args.draft_model is None:
        raise EagleError("method llama.cpp-draft needs --draft-model: a .gguf file or a named target "
                         "(e.g. qwen2.5-coder-0.5b-instruct)")
    if not wanted:
        return None
    folder = llama_cpp.build_folder(args.llama_cpp)
    setup = dict(folder=folder, binary=llama_cpp.server_binary(folder), gguf=llama_cpp.target_gguf(args.target),
                 methods=wanted)
    if "llama.cpp-draft" in wanted:
        setup["draft_gguf"] = llama_cpp.target_gguf(args.draft_model, "--draft-model")
    draft = args.llama_cpp_draft
    if "llama.cpp-eagle3" in wanted:
        if draft is None:
            llama_cpp.converter(folder)
        else:
            path = Path(draft).expanduser()
            if path.suffix == ".gguf":
                check_spec(str(path))  # exists and starts like a GGUF file
            elif not path.is_dir():
                raise EagleError(f"llama_cpp_draft {draft}: no such .gguf file or folder")
            elif not llama_cpp.is_eagle3_folder(path):
                raise EagleError(f"llama_cpp_draft {draft}: not an EAGLE-3 checkpoint (its config.json needs "
                                 f"num_hidden_layers 1 and draft_vocab_size)")
            else:
                llama_cpp.converter(folder)
    return setup


def llama_cpp_draft(setup: dict, args: Any, model: Any, work: Path) -> Path:
    """The draft GGUF for llama.cpp-eagle3: the given .gguf, else the given EAGLE-3 folder or our
    exported drafter (``--drafter`` when it is an EAGLE-3 one, else the EAGLE-3 drafter shipped for the
    target) converted by llama.cpp's converter (its EAGLE-3 log lines are printed)."""
    given = Path(args.llama_cpp_draft).expanduser() if args.llama_cpp_draft else None
    if given is not None and given.suffix == ".gguf":
        return given
    from eagle.runtime.target import converted_gguf_dir

    drafter = model.drafter
    if given is None and (drafter is None or drafter.config.kind != "eagle3"):  # the EAGLE-3 one shipped beside it
        drafter = with_drafter(model, "eagle3").drafter
    source = given or llama_cpp.export_eagle3(drafter, work / "eagle3")
    out, lines = llama_cpp.convert_draft(setup["folder"], source, converted_gguf_dir(setup["gguf"]),
                                         work / "draft-eagle3.gguf")
    for line in lines:
        print(f"convert_hf_to_gguf: {line.strip()}", flush=True)
    return out


def start_servers(setup: dict, args: Any, model: Any, stack: contextlib.ExitStack, threads: int) -> dict:
    """One running llama-server per llama.cpp method (closed by ``stack``), logs in a temporary folder."""
    work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="eagle-llama-cpp-")))
    drafts = {"llama.cpp-draft": setup.get("draft_gguf"),
              "llama.cpp-eagle3": llama_cpp_draft(setup, args, model, work) if "llama.cpp-eagle3" in setup["methods"]
              else None}
    servers = {}
    for method in setup["methods"]:
        server = llama_cpp.LlamaServer(setup["binary"], setup["gguf"], threads, method, drafts.get(method),
                                       log=work / f"{method}.log", draft_max=args.llama_cpp_draft_max)
        stack.callback(server.close)
        servers[method] = server.start()
    return servers


def machine(model: Any) -> dict:
    import torch

    info = dict(device=str(model.target.device), dtype=str(model.target.dtype).replace("torch.", ""),
                torch_threads=torch.get_num_threads(), torch=torch.__version__, platform=platform.platform(),
                cpu=cpu_name(), date=time.strftime("%Y-%m-%d", time.gmtime()))
    if model.target.device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(model.target.device)
    if model.target.graphs is not None:
        info["graphs"] = model.target.graphs.describe()
    if model.device_rounds:
        info["device_rounds"] = True
    if model.target.lean is not None:  # the product kernels (compiled, oneDNN or F.linear per row count)
        info["kernels"] = model.target.lean.kernel_choice()
    return info


@command(PROG)
def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_command(build_parser(), argv, BenchOptions)
    methods = parse_methods(args.methods)
    check_sampling(args)
    for flag, value in (("--limit", args.limit), ("--per-category", args.per_category)):
        if value is not None and value < 1:
            raise EagleError(f"{flag} must be >= 1, got {value}")
    prompts = first_per_category(read_prompts(args.prompts), args.per_category)[: args.limit]
    if args.concurrency is not None:
        return load_test(args, argv, methods, prompts)
    load_test_only = given_flags(build_parser(), args, ["--url", "--max-batch"]) | (
        args.config_keys & {"api_key", "requests_per_client"})
    for name in sorted(load_test_only):
        raise EagleError(f"{name} is an option of the load test: give --concurrency too")
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if path:
            check_writable(path, flag)
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise EagleError("--plot needs matplotlib: pip install 'eagle[bench]'") from None
    check_model_args(args)
    setup = check_llama_cpp(args, methods)
    # what each method reads (llama.cpp-eagle3 with a draft of its own: not --drafter; a +int8 method: its own's)
    reading = [modifiers(m)[0] for m in methods if not (m == "llama.cpp-eagle3" and args.llama_cpp_draft)]
    reading += ["suffix"] * any(SUFFIX in modifiers(m)[1] for m in methods)
    note_ignored_flags(PROG, build_parser(), args, reading, f"with --methods {args.methods}", [
        (("llama_cpp",), setup is None, f"with --methods {args.methods}"),
        (("--title",), not args.json, "without --json (it titles the JSON report)")])
    # the draft model is loaded here for sd only (llama.cpp-draft's runs in llama-server)
    sd = "sd" in (split_method(m)[0] for m in methods)
    loading = args if sd else argparse.Namespace(**{**vars(args), "draft_model": None})
    model = load_model(loading)
    int8 = load_model(argparse.Namespace(**{**vars(loading), "int8_activations": True})) if any(
        INT8 in modifiers(m)[1] for m in methods) else None

    def model_of(method: str) -> Any:
        base = int8 if INT8 in modifiers(method)[1] else model
        base = with_drafter(base, split_method(method)[1]) if split_method(method)[1] else base
        if SUFFIX in modifiers(method)[1] or split_method(method)[0] == "suffix":  # earlier outputs of its own
            base = base.with_suffix(base.suffix_store.fresh())
        return base

    models = {m: model_of(m) for m in methods}
    for method in methods:
        if method != "hf" and method not in llama_cpp.METHODS:
            check_method(models[method], split_method(method)[0])
    with contextlib.ExitStack() as stack:
        run_all(args, argv, methods, prompts, model, models, setup, stack)


def load_test(args: Any, argv: list[str], methods: list[str], prompts: list[dict]) -> None:
    """``--concurrency``: drive eagle-serve (at ``--url``, or started here on the loaded model) with
    concurrent clients (``infer.load_test``); print the table, write ``--json``."""
    from infer import load_test as lt

    levels = lt.parse_levels(args.concurrency)
    if args.methods == DEFAULT_METHODS:  # not given: the default's methods that eagle-serve serves
        methods = [m for m in methods if m != "hf"]
    served = [m for m in methods if m not in ("hf",) + llama_cpp.METHODS and "@" not in m and not modifiers(m)[1]]
    if served != methods:
        raise EagleError(f"the load test runs methods eagle-serve serves ({', '.join(METHODS)}), not "
                         f"{', '.join(m for m in methods if m not in served)}")
    for key in ("llama_cpp", "llama_cpp_draft", "llama_cpp_draft_max"):
        if key in args.config_keys:
            raise EagleError(f"{key} is for llama.cpp methods, which the load test does not run")
    if args.max_batch is not None and args.max_batch < 1:
        raise EagleError(f"--max-batch must be >= 1, got {args.max_batch}")
    if args.json:
        check_writable(args.json, "--json")
    parser = build_parser()
    model_flags = [a.option_strings[0] for g in parser._action_groups if g.title == "model" for a in g._group_actions
                   if getattr(args, a.dest) != parser.get_default(a.dest)]  # the model options given
    model_flags += sorted(args.config_keys & {f.name for f in dataclasses.fields(LoadOptions)})
    note_ignored(PROG, given_flags(parser, args, ["--plot", "--max-batch", "--title"]) | set(model_flags) | (
        args.config_keys & {"api_key"}), [
        (("--plot",), True, "by the load test"),
        (("--max-batch", *model_flags), args.url is not None, "with --url (the server there has its own)"),
        (("api_key",), args.url is None, "without --url (the in-process server has no key)"),
        (("--title",), not args.json, "without --json (it titles the JSON report)")])
    if args.url is None:
        note_ignored_flags(PROG, parser, args, methods, f"with --methods {args.methods}")
    env = [f"{k}={os.environ[k]}" for k in RUN_ENV if os.environ.get(k)]
    command = shlex.join(env + [PROG] + [redacted(arg) for arg in argv])
    print(f"$ {command}")
    with contextlib.ExitStack() as stack:
        if args.url is None:
            check_model_args(args)
            model = load_model(args)
            for method in methods:
                check_method(model, method)
            from infer.serve import create_app, default_max_batch

            info = machine(model)
            max_batch = default_max_batch(model) if args.max_batch is None else args.max_batch
            app = create_app(model, method=methods[0], max_queue=max(levels), max_batch=max_batch,
                             cache_pool=args.cache_pool)
            base = stack.enter_context(lt.LocalServer(app)).base
            info["server"] = f"in-process, max_batch {max_batch}" + (", cache_pool" if args.cache_pool else "")
        else:
            base = args.url
            info = dict(server=base, client_cpu=cpu_name(), platform=platform.platform(),
                        date=time.strftime("%Y-%m-%d", time.gmtime()))
        print("machine: " + ", ".join(f"{k} {v}" for k, v in info.items()), flush=True)
        from eagle.runtime.cuda_graphs import capture_stats

        before = capture_stats()
        rows = lt.run_load(base, prompts, methods, levels, args.max_new_tokens, args.temperature, args.top_p,
                           args.top_k, args.seed, warmup=min(args.warmup, len(prompts)),
                           api_key=args.api_key if args.url else None, log=lambda line: print(line, flush=True),
                           per_client=args.requests_per_client)
        if args.url is None:  # the in-process server's graphs (its batched rounds' included)
            after = capture_stats()
            info.update(graph_captures=after["captured"] - before["captured"],
                        graph_fallbacks=after["fallbacks"] - before["fallbacks"])
    print()
    print(lt.markdown(rows), end="", flush=True)
    if info.get("graph_fallbacks"):
        print(f"\n{info['graph_fallbacks']} CUDA graph capture(s) FELL BACK to eager running "
              f"({info['graph_captures']} captured): eagle.runtime.cuda_graphs.capture_stats", flush=True)
    bad = [r for r in rows if r["errors"] or r["mismatches"]]
    for r in bad:
        print(f"{r['method']} at {r['concurrency']} clients: {r['errors']} errors, {r['mismatches']} answers lost, "
              f"cut or mixed: {r['mismatched'][:3]}", flush=True)
    if args.json:
        config = report_options(args)
        config.update(methods=methods, concurrency=levels, command=command)
        report = dict(title=args.title, kind="load-test", config=config, machine=info, prompts=len(prompts),
                      results=rows)
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        print(f"\nwrote {args.json}")
    if bad:
        raise EagleError(f"{len(bad)} load-test level(s) had errors or answers that differ from the request alone")


def run_all(args: Any, argv: list[str], methods: list[str], prompts: list[dict], model: Any,
            models: dict[str, Any], setup: dict | None, stack: contextlib.ExitStack) -> None:
    """Start the llama.cpp servers, run every method interleaved per prompt (``models``: method -> the
    ``EagleModel`` it runs on; ``model`` the one of ``--drafter``), print and write the report."""
    import torch
    from eagle.runtime.cuda_graphs import capture_stats

    start = capture_stats()
    servers = start_servers(setup, args, model, stack, torch.get_num_threads()) if setup else {}
    ids = [model.target.encode_prompt(p["prompt"]) for p in prompts]
    # the environment variables that change what runs, as the command line a rerun needs
    env = [f"{k}={os.environ[k]}" for k in RUN_ENV if os.environ.get(k)]
    command = shlex.join(env + [PROG] + [redacted(arg) for arg in argv])
    info = machine(model)
    int8 = next((models[m] for m in methods if INT8 in modifiers(m)[1]), None)
    if int8 is not None and int8.target.lean is not None:
        info["kernels" + INT8] = int8.target.lean.kernel_choice()
    if setup:
        info["llama_cpp"] = llama_cpp.version(setup["folder"], setup["binary"]) or str(setup["binary"])
    print(f"$ {command}")
    print("machine: " + ", ".join(f"{k} {v}" for k, v in info.items()), flush=True)
    from tqdm import tqdm

    for i in range(min(args.warmup, len(prompts))):
        for method in methods:
            run_one(models[method], ids[i], method, args, servers)
    for m in methods:  # suffix drafts start from no earlier outputs: none of the warm-up's
        if models[m].suffix_grafts:
            models[m].suffix_store.clear_history()
    records = []
    for i in tqdm(range(len(prompts)), desc="prompts", unit="prompt", file=sys.stderr):
        for method in methods:
            record = run_one(models[method], ids[i], method, args, servers)
            records.append(dict(method=method, prompt=i, category=prompts[i]["category"], **record))
    summary = summarize(records, greedy=args.temperature == 0)
    end = capture_stats()  # the whole run, warm-up included: every shape is captured in its first call
    stats = dict(captured=end["captured"] - start["captured"], fallbacks=end["fallbacks"] - start["fallbacks"],
                 errors=end["errors"][len(start["errors"]):])
    info.update(graph_captures=stats["captured"], graph_fallbacks=stats["fallbacks"])
    peak = peak_memory_mb()  # this process's: every method's model, not llama.cpp's own server
    if peak is not None:
        info["peak_memory_mb"] = peak
    print()
    print(markdown(summary), end="", flush=True)
    print(f"graphs: {stats['captured']} captured, {stats['fallbacks']} fell back to eager running", flush=True)
    if stats["fallbacks"]:
        loud = (f"WARNING: {stats['fallbacks']} CUDA graph capture(s) FELL BACK to eager running (these numbers "
                f"are not the fast path); first: {stats['errors'][0]}")
        print(loud, flush=True)
        print(loud, file=sys.stderr, flush=True)
    if args.json:
        config = report_options(args)
        config.update(methods=methods, command=command, tree=dataclasses.asdict(model.tree),
                      prompt_lookup=dataclasses.asdict(model.prompt_lookup),
                      drafter_dtype=str(model.drafter_dtype).replace("torch.", ""),
                      drafter_quant=model.drafter_quant or "none")
        config["drafters"] = {m: drafter_name(models[m]) for m in methods if split_method(m)[0] in DRAFTER_METHODS}
        if servers:
            config["llama_cpp_servers"] = {m: shlex.join(s.args) for m, s in servers.items()}
        report = dict(title=args.title, config=config, machine=info, prompts=len(prompts), methods=summary,
                      records=[{k: v for k, v in r.items() if k != "token_ids"} for r in records])
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        print(f"\nwrote {args.json}")
    if args.plot:
        plot(summary, args.plot)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    sys.exit(main())
