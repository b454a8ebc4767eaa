"""gpu-check.json, the summary of ``scripts/gpu_check.sh``, from what its parts left behind.

Reads ``WORK/parts.jsonl`` (one line per part: rc, seconds, limit, command; skipped or planned),
``WORK/pytest.xml``, ``WORK/batched.txt`` (``scripts/serving_speed.py``'s JSON lines) and the reports in
``OUT`` (eagle-bench JSONs, the load test's, the size projection's or its copy in ``WORK`` from a first call,
the training smoke run's); a part that left nothing is reported as such. Writes ``OUT/gpu-check.json`` with ``parts``, each report's figures,
``headline``, ``goals`` (the GPU goals: value, target, met) and ``failed`` (a part that failed or ran out
of time, a failed test, a capture that fell back, no test report): exit 1 when any, else 0.

    python scripts/gpu_check_summary.py --out OUT --work WORK --device cuda --target PATH [--quiet]"""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

BENCHES = ("bench-fp32-greedy", "bench-fp32-t1", "bench-bf16-greedy", "bench-fp32-device-rounds")
BENCH_KEYS = ("tokens_per_second", "mean_accept_length", "speedup_vs_ar", "speedup_vs_hf", "identical_to_ar",
              "identical_share", "step_fractions", "graph_captures", "graph_fallbacks")
LOAD_KEYS = ("method", "concurrency", "tokens_per_second", "mean_accepted_length", "errors", "mismatches")
TIMED_OUT = (124, 137)  # timeout's exit status, and a kill after its grace period


def read_json(path: Path) -> Any:
    """A JSON file, or None when it is missing or cut short (a part stopped while writing it)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def parts(work: Path) -> dict[str, dict]:
    """``parts.jsonl`` -> {part: its record, with ``timed_out`` where its rc says so}."""
    out: dict[str, dict] = {}
    path = work / "parts.jsonl"
    for line in (path.read_text().splitlines() if path.is_file() else []):
        if line.strip():
            row = json.loads(line)
            row["timed_out"] = row.get("rc") in TIMED_OUT
            out[row.pop("part")] = row
    return out


def tests(work: Path) -> dict | None:
    """pytest's junit XML -> counts and the failed tests' names, or None without one."""
    xml = work / "pytest.xml"
    if not xml.is_file():
        return None
    try:
        suite = ET.parse(xml).getroot()
    except ET.ParseError:
        return None
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    counts["failed"] = [f"{c.get('classname')}::{c.get('name')}" for c in suite.iter("testcase")
                        if c.find("failure") is not None or c.find("error") is not None]
    return counts


def bench(data: dict) -> dict:
    return {"prompts": data.get("prompts"), "machine": data.get("machine", {}),
            "methods": {m: {k: s.get(k) for k in BENCH_KEYS} for m, s in data.get("methods", {}).items()}}


def batched(work: Path) -> list[dict] | None:
    """``scripts/serving_speed.py``'s JSON lines (one per method and batch size), or None without any."""
    path = work / "batched.txt"
    if not path.is_file():
        return None
    rows = []
    for line in path.read_text().splitlines():
        if line.startswith("{"):
            try:
                rows.append(json.loads(line))
            except ValueError:
                pass
    return rows or None


def projection(data: dict) -> dict:
    """A size projection's figures per shape (the report itself is returned in $OUT)."""
    return {"failed": data.get("failed", {}), "sizes": {name: {
        "verify_60_vs_1": s["verify_vs_one_row"].get("60"), "verify_128_vs_1": s["verify_vs_one_row"].get("128"),
        "ar_ms_per_token": 1e3 * s["ar_seconds_per_token"], "break_even_tau": s["break_even_tau"],
        "projected_speedup": {str(p["tau"]): p["speedup"] for p in s["projected_speedup"]},
        "graph_captures": s["graph_captures"], "graph_fallbacks": s["graph_fallbacks"]}
        for name, s in data.get("sizes", {}).items()}}


def ratio(rows: list[dict], method: str, level: int, base_method: str, base_level: int, key: str,
          level_key: str) -> float | None:
    """tokens/s of (method, level) over (base_method, base_level) among ``rows``, or None when either is missing."""
    def rate(m: str, n: int) -> float | None:
        return next((r.get(key) for r in rows if r.get("method") == m and r.get(level_key) == n), None)

    top, bottom = rate(method, level), rate(base_method, base_level)
    return top / bottom if top is not None and bottom else None


def goal(name: str, value: float | None, target: float, at_least: bool = True) -> dict:
    met = None if value is None else (value >= target if at_least else value <= target)
    return {"goal": name, "value": value, "target": (">= " if at_least else "<= ") + f"{target:g}", "met": met}


def goals(summary: dict) -> list[dict]:
    """The GPU goals (default target, dev prompts, default options; the 8B shape's verify cost)."""
    g = summary.get("bench-fp32-greedy", {}).get("methods", {})
    t1 = summary.get("bench-fp32-t1", {}).get("methods", {})
    load = summary.get("serving-load", {}).get("results", [])
    rows = summary.get("batched") or []
    out = [goal("eagle-tree / ar, fp32 greedy", g.get("eagle-tree", {}).get("speedup_vs_ar"), 2.0),
           goal("eagle-tree / ar, fp32 temperature 1", t1.get("eagle-tree", {}).get("speedup_vs_ar"), 1.3)]
    for method in ("ar", "eagle-tree"):
        out.append(goal(f"serving {method}: 16 clients / 1 client, aggregate tokens/s",
                        ratio(load, method, 16, method, 1, "tokens_per_second", "concurrency"), 8.0))
    for level, target in ((4, 1.3), (16, 1.0), (64, 1.0)):
        out.append(goal(f"serving: eagle-tree / ar at {level} clients",
                        ratio(load, "eagle-tree", level, "ar", level, "tokens_per_second", "concurrency"), target))
        out.append(goal(f"batched: eagle-tree / ar at batch {level}",
                        ratio(rows, "eagle-tree", level, "ar", level, "tokens_per_s", "batch"), target))
    out.append(goal("CUDA graph captures that fell back", summary["headline"]["graph_fallbacks"], 0, at_least=False))
    size = summary.get("size-projection", {}).get("sizes", {}).get("llama-3.1-8b", {})
    out.append(goal("llama-3.1-8b shape: verify of 60 rows / 1 row", size.get("verify_60_vs_1"), 1.3,
                    at_least=False))
    return out


def summarize(out: Path, work: Path, device: str, target: str) -> dict:
    summary: dict[str, Any] = {"device": device, "target": target, "parts": parts(work)}
    found = tests(work)
    if found is not None:
        summary["tests"] = found
    for name in BENCHES:
        data = read_json(out / f"{name}.json")
        if data is not None:
            summary[name] = bench(data)
    load = read_json(out / "serving-load.json")
    if load is not None:
        summary["serving-load"] = {"machine": load.get("machine", {}),
                                   "results": [{k: r.get(k) for k in LOAD_KEYS} for r in load.get("results", [])]}
    rows = batched(work)
    if rows is not None:
        summary["batched"] = rows
    data = read_json(out / "size-projection.json") or read_json(work / "size-projection.json")  # a first call's
    if data is not None:
        summary["size-projection"] = projection(data)
    smoke = read_json(out / "train-smoke.json")
    if smoke is not None:
        summary["train-smoke"] = smoke
    g = summary.get("bench-fp32-greedy", {}).get("methods", {})
    t1 = summary.get("bench-fp32-t1", {}).get("methods", {})
    b16 = summary.get("bench-bf16-greedy", {}).get("methods", {})
    rounds = summary.get("bench-fp32-device-rounds", {}).get("methods", {})
    counted = [summary[n]["machine"] for n in BENCHES + ("serving-load",) if n in summary]
    sizes = summary.get("size-projection", {}).get("sizes", {}).values()
    summary["headline"] = {
        "tree_vs_ar_fp32_greedy": g.get("eagle-tree", {}).get("speedup_vs_ar"),
        "tree_identical_to_ar_fp32": g.get("eagle-tree", {}).get("identical_to_ar"),
        "tree_vs_ar_fp32_t1": t1.get("eagle-tree", {}).get("speedup_vs_ar"),
        "tree_vs_ar_bf16_greedy": b16.get("eagle-tree", {}).get("speedup_vs_ar"),
        "tree_identical_share_bf16": b16.get("eagle-tree", {}).get("identical_share"),
        "tree_vs_ar_fp32_device_rounds": rounds.get("eagle-tree", {}).get("speedup_vs_ar"),
        "train_smoke_ok": summary.get("train-smoke", {}).get("ok"),
        "graph_captures": sum(m.get("graph_captures", 0) for m in counted) + sum(s["graph_captures"] for s in sizes),
        "graph_fallbacks": sum(m.get("graph_fallbacks", 0) for m in counted) + sum(s["graph_fallbacks"] for s in sizes),
        "tests_passed": summary.get("tests", {}).get("passed", 0),
    }
    summary["goals"] = goals(summary)
    failed = []
    for name, row in summary["parts"].items():
        if row.get("planned") or row.get("skipped"):
            continue
        if row["timed_out"]:
            failed.append(f"part {name} ran out of time ({row.get('limit')} s)")
        elif row.get("rc") != 0:
            failed.append(f"part {name} rc={row.get('rc')}")
    failed += [f"test {t}" for t in summary.get("tests", {}).get("failed", [])]
    if summary["headline"]["graph_fallbacks"]:
        failed.append(f"{summary['headline']['graph_fallbacks']} CUDA graph capture(s) fell back to eager running")
    ran_tests = summary["parts"].get("tests", {})
    if ran_tests and not ran_tests.get("planned") and not ran_tests.get("skipped") and "tests" not in summary:
        failed.append("no test report")
    summary["failed"] = failed
    summary["headline"]["ok"] = not failed
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--work", required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--target", default="")
    parser.add_argument("--quiet", action="store_true", help="write gpu-check.json only (after each part)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    summary = summarize(out, Path(args.work), args.device, args.target)
    (out / "gpu-check.json").write_text(json.dumps(summary, indent=2) + "\n")
    if not args.quiet:
        print(json.dumps(summary["headline"], indent=2))
        for row in summary["goals"]:
            print(f"goal {row['goal']}: {row['value']} (target {row['target']}, met {row['met']})")
        for line in summary["failed"]:
            print("FAILED:", line)
    return 1 if summary["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
