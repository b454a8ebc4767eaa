"""``eagle-export``: write a drafter for the EAGLE repo, vLLM, SGLang, SpecForge or llama.cpp.

    eagle-export --drafter DIR --format {eagle,eagle3,vllm,sglang} --out DIR [--target SPEC]

EAGLE-1/2 drafters go to the EAGLE-1 layout (eagle, vllm, sglang); EAGLE-3 drafters to the EAGLE-3
release layout (eagle3 = sglang, which SpecForge and llama.cpp's converter also read; eagle for the
EAGLE repo) or vLLM's (vllm). The folder gets config.json, model.safetensors and a README.md with the
launch commands. No format stores the embedding, so ``--target`` is only a check that the drafter
was built for that target. Layouts: see ``eagle.drafting.checkpoint_formats``."""

from __future__ import annotations

import sys
from pathlib import Path

from eagle.drafting.drafter import Drafter
from eagle.errors import EagleError, Parser, command
from eagle.drafting.checkpoint_formats import EXPORT_FORMATS, export_drafter

PROG = "eagle-export"


def build_parser() -> Parser:
    parser = Parser(prog=PROG, description=__doc__.splitlines()[0].split(": ", 1)[1])
    parser.add_argument("--drafter", required=True, help="drafter folder (ours, or an EAGLE-1/2 or EAGLE-3 release)")
    parser.add_argument("--format", required=True, choices=EXPORT_FORMATS, help="who will load the export")
    parser.add_argument("--out", required=True, help="output folder (new, empty, or an earlier export)")
    parser.add_argument("--target", help="check the drafter against this target (folder, .gguf, hub id in the cache)")
    parser.add_argument("--allow-pickle", action="store_true",
                        help="let --drafter be read from a pytorch_model.bin (unpickling can run code)")
    return parser


@command(PROG)
def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if Path(args.out).resolve() == Path(args.drafter).resolve():
        raise EagleError("--out must differ from --drafter")
    drafter = Drafter.from_pretrained(args.drafter, device="cpu", allow_pickle=args.allow_pickle)
    target_name = target_layers = None
    if args.target:
        from eagle.runtime.target import load_target

        target = load_target(args.target)
        drafter.check_target(target)
        target_name, target_layers = args.target, target.model.config.num_hidden_layers
    out = export_drafter(drafter, args.out, args.format, target_name=target_name, target_layers=target_layers)
    print(f"wrote {args.format} drafter to {out} (launch command in {out / 'README.md'})")


if __name__ == "__main__":
    sys.exit(main())
