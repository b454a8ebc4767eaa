"""``eagle-results``: the results page (Markdown) from ``eagle-bench --json`` reports.

Each report becomes one section: its title (from a ``title`` key beside the JSON's ``config``, else
the file name), the exact command, the machine and date, and ``eagle-bench``'s own tables (a load
test's, ``eagle-bench --concurrency``, for a report of ``kind`` "load-test"; the projection's of
``infer.size_projection`` for ``kind`` "size-projection"). The page
is regenerated whole from the JSON files, never edited by hand: ``make results``."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

from eagle.errors import EagleError, Parser, command, read_text
from infer.bench import markdown

PROG = "eagle-results"


def section(report: dict, source: str) -> str:
    """One bench report -> a Markdown section."""
    if isinstance(report, dict) and report.get("kind") == "size-projection":  # python -m infer.size_projection
        from infer.size_projection import section as projection_section

        return projection_section(report, source)
    load = isinstance(report, dict) and report.get("kind") == "load-test"  # eagle-bench --concurrency
    try:
        cfg, mach, summary = report["config"], report["machine"], report["results" if load else "methods"]
    except (KeyError, TypeError):
        raise EagleError(f"{source}: not an eagle-bench --json report (needs config, machine, methods)") from None
    title = report.get("title") or Path(source).stem
    cmd = cfg.get("command") or ""
    if isinstance(cmd, list):
        cmd = shlex.join(cmd)
    where = mach.get("gpu") or mach.get("cpu") or mach.get("platform", "")
    machine = (f"{where}; {mach.get('device')} {mach.get('dtype')}, {mach.get('torch_threads')} torch threads, "
               f"torch {mach.get('torch')}")
    if mach.get("graph_captures") or mach.get("graph_fallbacks"):  # eagle-bench's counts (eagle.runtime.cuda_graphs)
        machine += (f"; CUDA graphs: {mach.get('graph_captures', 0)} captured, {mach.get('graph_fallbacks', 0)} "
                    f"fell back to eager running" + (" (NOT the fast path)" if mach.get("graph_fallbacks") else ""))
    if mach.get("peak_memory_mb"):  # eagle-bench's process (llama.cpp's server runs in its own)
        machine += f"; peak memory of the process {mach['peak_memory_mb']:.0f} MB"
    temp = cfg.get("temperature", 0)
    lines = [f"## {title}", "", f"`{cmd}`", "",
             f"Machine: {machine}. Date: {mach.get('date', 'not recorded')}. {report.get('prompts')} prompts, "
             f"{cfg.get('max_new_tokens')} new tokens, " + ("greedy" if not temp else f"temperature {temp:g}")
             + f". Data: `{source}`.", ""]
    if load:
        lines[-2] += f" Load test of eagle-serve ({mach.get('server', 'at --url')})."
    if report.get("note"):
        lines += [report["note"], ""]
    if load:
        from infer.load_test import markdown as load_markdown

        return "\n".join(lines) + "\n" + load_markdown(summary)
    return "\n".join(lines) + "\n" + markdown(summary)


def render(paths: list[str], header: str = "") -> str:
    parts = [header.rstrip() + "\n"] if header else []
    for path in paths:
        try:
            report = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise EagleError(f"cannot read {path}: {exc}") from None
        parts.append(section(report, path))
    return "\n".join(parts)


@command(PROG)
def main(argv: list[str] | None = None) -> None:
    parser = Parser(prog=PROG, description="Write the results page from eagle-bench --json reports.")
    parser.add_argument("reports", nargs="+", help="eagle-bench --json files, in page order")
    parser.add_argument("--header", help="a Markdown file put first (the page's title and introduction)")
    parser.add_argument("--out", help="write here instead of stdout")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    header = read_text(args.header) if args.header else ""
    page = render(args.reports, header)
    if args.out:
        Path(args.out).write_text(page)
    else:
        print(page, end="")


if __name__ == "__main__":
    sys.exit(main())
