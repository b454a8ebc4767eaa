"""``eagle-generate``: generate from a prompt (or chat with ``--interactive``), streaming the text
to stdout as tokens are accepted, with one stats line on stderr.

Any ``EagleError`` (bad option, missing drafter, prompt too long, ...) is one line
``eagle-generate: error: <message>`` on stderr and exit code 2."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any, Iterable, TextIO

from eagle.config import (DTYPE_NAMES, LoadOptions, SamplingConfig, check_int, option_configs,
                          read_configs)
from eagle.errors import EagleError, Parser, command, given_flags, note_ignored
from eagle.inputs import DEFAULT_TARGET, FORMATS, METHODS, check_prompt_text, check_spec, is_draft_lm
from eagle.named_targets import NAMED_TARGETS
from eagle.drafting.drafter_config import KINDS as DRAFTER_KINDS

PROG = "eagle-generate"


DTYPES = DTYPE_NAMES


def total_tokens_arg(value: str) -> int | str:
    if value == "auto":
        return value
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer or 'auto', got {value!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """Flags shared by ``eagle-generate``, ``eagle-bench`` and ``eagle-serve``: what to load, where, and the
    tree's size; the tuning options are config keys (``add_config_args``)."""
    g = parser.add_argument_group("model")
    g.add_argument("--target", default=DEFAULT_TARGET,
                   help=f"model folder, .gguf file, cached hub id, {DEFAULT_TARGET!r} (default), or a target "
                        f"assembled from PyPI parts: {', '.join(NAMED_TARGETS)} (docs/targets.md)")
    g.add_argument("--drafter", help="drafter folder (default: the one shipped for the target, if any; 'eagle3': "
                                     "the EAGLE-3 drafter shipped for it)")
    g.add_argument("--draft-model", help="draft model for method 'sd': a model spec or a draft LM folder, same "
                                         "tokenizer as the target (default: the draft LM shipped for the target, if any)")
    g.add_argument("--device", help="torch device, e.g. cpu or cuda (default: cuda when present)")
    g.add_argument("--threads", type=int,
                   help="CPU threads the products run on (torch's intra-op threads; default: torch's, one per "
                        "physical core); eagle-bench gives llama.cpp as many")
    g.add_argument("--dtype", choices=DTYPES, default="auto",
                   help="what the target computes in (default auto: bfloat16 on CUDA, float32 on a CPU); greedy "
                        "output equals plain decoding's token for token in float32, while in 16-bit formats a "
                        "forward of several tokens can round differently from one of a single token")
    g.add_argument("--total-tokens", type=total_tokens_arg,
                   help="draft tree nodes verified per step, an integer or 'auto' (default: sized by the target's "
                        "measured forward cost)")
    g.add_argument("--suffix-corpus", metavar="PATH",
                   help="a file or folder of text or code whose continuations method suffix (and +suffix in "
                        "eagle-bench) drafts from, beside the request and earlier answers; tokenized once, cached")


def add_config_args(parser: argparse.ArgumentParser, extra: str = "") -> None:
    """``--config FILE`` and ``--set KEY=VALUE``: the tuning options (``LoadOptions`` and the command's own,
    ``extra`` names them), as training's commands take theirs (docs/options.md lists the keys)."""
    g = parser.add_argument_group("tuning (config keys: docs/options.md)")
    g.add_argument("--config", metavar="FILE",
                   help="YAML or JSON file of config keys: the tree (depth, top_k, lookup_tokens, sampled_tree, ...), "
                        "sd (gamma, lenience, ...), the drafter (drafter_dtype, drafter_quant), the runtime "
                        f"(cuda_graphs, device_rounds, int8_activations), suffix drafts (suffix: a mapping){extra}")
    g.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="one config key (the value parsed as YAML), over --config's; repeat it for more")


def read_config_args(args: argparse.Namespace, *classes: type) -> list[Any]:
    """Read ``--config`` and ``--set`` into ``LoadOptions`` and ``classes`` (a command's own options), set
    every key on ``args`` under its own name (``top_k``: ``tree_top_k``, sampling's ``top_k`` being a flag)
    and the keys given on ``args.config_keys``; returns the instances."""
    configs, given = read_configs(args.config, args.set, (LoadOptions, *classes))
    for cfg in configs:
        for name, value in dataclasses.asdict(cfg).items():
            setattr(args, CONFIG_ARGS.get(name, name), value)
    args.config_keys = given
    return configs


CONFIG_ARGS = {"top_k": "tree_top_k"}  # a config key kept on args under another name


def parse_command(parser: argparse.ArgumentParser, argv: list[str] | None, *classes: type) -> argparse.Namespace:
    """``argv`` parsed by ``parser``, then its ``--config``/``--set`` keys (``read_config_args``). A flag that
    names a config key (``--depth 3``, ``--no-cuda-graphs``) is refused with the ``--set`` that says it."""
    keys = {f.name for cls in (LoadOptions, *classes) for f in dataclasses.fields(cls)}
    flags = {s for action in parser._actions for s in action.option_strings}
    for arg in sys.argv[1:] if argv is None else argv:
        flag = arg.partition("=")[0]
        key = {"tree_top_k": "top_k"}.get(flag[2:].replace("-", "_"), flag[2:].replace("-", "_"))
        negated = key.startswith("no_") and key[3:] in keys
        if flag.startswith("--") and flag not in flags and (key in keys or negated):
            example = f"{key[3:]}=false" if negated else f"{key}=VALUE"
            raise EagleError(f"{flag} is a config key: --set {example} (or in a --config file)")
    args = parser.parse_args(argv)
    read_config_args(args, *classes)
    return args


# the methods that read each model flag and config key (eagle-bench's hf and llama.cpp methods read none of them)
FLAG_METHODS = {
    "--drafter": ("eagle-tree", "eagle-chain", "llama.cpp-eagle3"), "--draft-model": ("sd", "llama.cpp-draft"), "cuda_graphs": METHODS,
    "int8_activations": METHODS,
    "device_rounds": ("eagle-tree", "eagle-chain"), "--total-tokens": ("eagle-tree",),
    "depth": ("eagle-tree", "eagle-chain"), "top_k": ("eagle-tree",), "lookup_tokens": ("eagle-tree",),
    "sampled_tree": ("eagle-tree", "eagle-chain"), "draw_temperature_scale": ("eagle-tree", "eagle-chain"),
    "draw_support": ("eagle-tree", "eagle-chain"), "drafter_dtype": ("eagle-tree", "eagle-chain", "sd"),
    "drafter_quant": ("eagle-tree", "eagle-chain"), "gamma": ("sd",), "lenience": ("sd",),
    "adaptive_gamma": ("sd",), "draft_vocab": ("sd",),
    "draft_confidence": ("sd",), "--suffix-corpus": ("suffix",), "suffix": ("suffix",),
}
SAMPLING_ONLY = ("--top-p", "--top-k", "--seed", "lenience", "sampled_tree", "draw_temperature_scale",
                 "draw_support")
DRAW_FLAGS = ("draw_temperature_scale", "draw_support")


def note_ignored_flags(prog: str, parser: argparse.ArgumentParser, args: argparse.Namespace, methods: list[str],
                       label: str, extra: Iterable[tuple] = ()) -> list[str]:
    """Name once on stderr the model and sampling flags and config keys given that no run of ``methods`` reads
    (``ignored_flag_rules``), and what ``extra`` rules say of a command's own; returns the lines."""
    extra = list(extra)
    names = {*FLAG_METHODS, *SAMPLING_ONLY, *(name for rule in extra for name in rule[0])}
    given = given_flags(parser, args, [n for n in names if n.startswith("--")]) | (
        getattr(args, "config_keys", set()) & names)
    return note_ignored(prog, given, ignored_flag_rules(args, methods, label) + extra)


def ignored_flag_rules(args: argparse.Namespace, methods: list[str], label: str) -> list[tuple]:
    """The rules of ``eagle.errors.note_ignored`` for the model and sampling flags and config keys when
    ``methods`` run (``label``: how the command line chose them, e.g. "with method ar"; ``llama.cpp-eagle3``
    reads ``--drafter`` when it is given no draft of its own)."""
    ran = {m.partition("@")[0] for m in methods}  # eagle-tree@DIR reads what eagle-tree reads, but not --drafter
    greedy = args.temperature == 0
    return [
        *(((flag,), not (set(methods) if flag == "--drafter" else ran) & set(users), label)
          for flag, users in FLAG_METHODS.items()),
        (SAMPLING_ONLY, greedy, "at temperature 0 (greedy decoding)"),
        (DRAW_FLAGS, args.sampled_tree is False, "with sampled_tree false"),
        (("drafter_dtype",), args.drafter_quant in FORMATS and "sd" not in ran,
         f"with drafter_quant {args.drafter_quant} (the quantized drafter computes in float32)"),
    ]


def add_sampling_args(parser: argparse.ArgumentParser, max_new_tokens: int, temperature: float) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-new-tokens", type=int, default=max_new_tokens, help=f"default {max_new_tokens}")
    g.add_argument("--temperature", type=float, default=temperature, help=f"0 is greedy (default {temperature:g})")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0, help="0 disables it")
    g.add_argument("--seed", type=int, help="seed for sampling")


def check_sampling(args: argparse.Namespace) -> None:
    """Refuse bad sampling options before anything is loaded."""
    SamplingConfig(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    check_int("max_new_tokens", args.max_new_tokens, 1)


def check_device(device: str | None) -> None:
    if device is None:
        return
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError) as exc:
        raise EagleError(f"bad --device {device!r}: {exc}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise EagleError(f"--device {device}: CUDA is not available on this machine")


def option_args(args: argparse.Namespace) -> dict:
    """The tree and ``sd`` flags as ``EagleModel.from_pretrained`` options."""
    return dict(total_tokens=args.total_tokens, depth=args.depth, top_k=args.tree_top_k,
                lookup_tokens=args.lookup_tokens, sampled_tree=args.sampled_tree,
                draw_temperature_scale=args.draw_temperature_scale, draw_support=args.draw_support,
                gamma=args.gamma, lenience=args.lenience, adaptive_gamma=args.adaptive_gamma,
                draft_vocab=args.draft_vocab, draft_confidence=args.draft_confidence)


def check_model_args(args: argparse.Namespace) -> None:
    """Refuse bad model flags before anything is loaded: options out of range, a target, drafter
    or draft model that is not there, a device that does not exist."""
    option_configs(**option_args(args))
    check_spec(args.target)
    if args.drafter is not None and not (args.drafter in DRAFTER_KINDS and not Path(args.drafter).exists()):
        path = Path(args.drafter).expanduser()
        if not path.is_dir():
            raise EagleError(f"no drafter at {args.drafter}: no such folder")
        if not (path / "config.json").is_file():
            raise EagleError(f"no drafter at {args.drafter}: config.json missing")
    if args.draft_model is not None and not is_draft_lm(args.draft_model):
        check_spec(args.draft_model)
    check_device(args.device)
    check_threads(args.threads)
    if getattr(args, "suffix_corpus", None) is not None and not Path(args.suffix_corpus).expanduser().exists():
        raise EagleError(f"--suffix-corpus {args.suffix_corpus}: no such file or folder")


def check_threads(threads: int | None) -> None:
    """``--threads`` below 1 is an error."""
    if threads is not None and threads < 1:
        raise EagleError(f"--threads must be >= 1, got {threads}")


def load_model(args: argparse.Namespace) -> Any:
    """One ``EagleModel`` from the shared model flags."""
    from transformers.utils import logging as hf_logging

    from eagle.engine import EagleModel

    check_device(args.device)
    check_threads(args.threads)
    hf_logging.disable_progress_bar()  # keep stderr for our own lines
    import torch

    if args.threads is not None:  # before loading: kernel choices and tree-size cost curves are per thread count
        torch.set_num_threads(args.threads)
    drafter_dtype = None if args.drafter_dtype == "auto" else getattr(torch, args.drafter_dtype)
    dtype = None if args.dtype == "auto" else getattr(torch, args.dtype)
    return EagleModel.from_pretrained(
        args.target, drafter=args.drafter, draft_model=args.draft_model, device=args.device, dtype=dtype,
        drafter_dtype=drafter_dtype, drafter_quant=None if args.drafter_quant == "auto" else args.drafter_quant,
        cuda_graphs=args.cuda_graphs, device_rounds=args.device_rounds, int8_activations=args.int8_activations,
        suffix=getattr(args, "suffix", None), suffix_corpus=getattr(args, "suffix_corpus", None), **option_args(args))


def check_method(model: Any, method: str) -> None:
    """A method that needs a drafter or a draft model the model lacks is an error up front."""
    if method in ("eagle-tree", "eagle-chain") and model.drafter_config is None:
        raise EagleError(f"method {method!r} needs a drafter: pass --drafter FOLDER (no drafter is shipped for "
                         f"target {model.target.name!r})")
    if method == "sd" and model.draft_model is None:
        raise EagleError(f"method 'sd' needs a draft model: pass --draft-model (no draft LM is shipped for target "
                         f"{model.target.name!r})")


def build_parser() -> Parser:
    parser = Parser(prog=PROG, description="Generate text with EAGLE-style speculative decoding.")
    parser.add_argument("prompt", nargs="?", help="the user message (the chat template applied when the target "
                                                  "has one; a base model's prompt is tokenized as is)")
    parser.add_argument("-i", "--interactive", action="store_true",
                        help="multi-turn chat on stdin; /exit or end of input quits")
    parser.add_argument("--method", choices=METHODS,
                        help="decoding method (default: eagle-tree when a drafter is available, else ar)")
    add_sampling_args(parser, max_new_tokens=256, temperature=0.0)
    add_model_args(parser)
    add_config_args(parser)
    return parser


def stats_line(result: Any) -> str:
    return (f"[{result.method}] {len(result.token_ids)} new tokens, {result.tokens_per_second:.1f} tokens/s, "
            f"mean accepted length {result.mean_accept_length:.2f}, {result.target_forwards} target forwards")


def run_turn(model: Any, prompt: Any, args: argparse.Namespace, out: TextIO, err: TextIO) -> Any:
    """Generate once, streaming text to ``out``; the stats line goes to ``err``. Returns the result."""
    stream = model.generate(prompt, method=args.method, max_new_tokens=args.max_new_tokens,
                            temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                            stream=True)
    for piece in stream:
        out.write(piece)
        out.flush()
    out.write("\n")
    out.flush()
    result = stream.result
    print(stats_line(result), file=err, flush=True)
    return result


def chat(model: Any, args: argparse.Namespace, inp: TextIO, out: TextIO, err: TextIO) -> None:
    """Multi-turn chat: the whole message history goes to every turn. A turn that fails (e.g. the
    conversation outgrew the context) prints its error and is dropped; the chat goes on."""
    messages: list[dict] = []
    if args.prompt:
        messages.append({"role": "user", "content": args.prompt})
    while True:
        if not messages or messages[-1]["role"] != "user":
            err.write("> ")
            err.flush()
            line = inp.readline()
            if not line or line.strip() == "/exit":
                return
            if not line.strip():
                continue
            messages.append({"role": "user", "content": line.rstrip("\n")})
        try:
            result = run_turn(model, messages, args, out, err)
        except EagleError as exc:
            messages.pop()
            print(f"{PROG}: error: {exc}", file=err, flush=True)
            continue
        messages.append({"role": "assistant", "content": result.text})


@command(PROG)
def main(argv: list[str] | None = None) -> None:
    args = parse_command(build_parser(), argv)
    if not args.interactive and args.prompt is None:
        raise EagleError("give a prompt, or --interactive")
    if args.prompt is not None:
        check_prompt_text(args.prompt)
    check_sampling(args)
    check_model_args(args)
    model = load_model(args)
    if args.method is None:
        args.method = "eagle-tree" if model.drafter_config is not None else "ar"
    check_method(model, args.method)
    note_ignored_flags(PROG, build_parser(), args, [args.method], f"with method {args.method}")
    if args.interactive:
        chat(model, args, sys.stdin, sys.stdout, sys.stderr)
    else:
        run_turn(model, args.prompt, args, sys.stdout, sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
