"""scripts/gpu_check.sh and its summary (scripts/gpu_check_summary.py), without a GPU: the CUDA plan's parts and
flags (a dry run), a part that hangs (time-boxed, the others still reported), and the summary's figures, goals and
failures from the files parts leave."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from infer import bench, size_projection

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import gpu_check_summary  # noqa: E402

DEFAULT_PARTS = ["tests", "convert", "bench-fp32-greedy", "bench-fp32-t1", "bench-bf16-greedy", "bench-fp32-device-rounds",
                 "serving-load", "batched", "size-projection"]


def run_check(tmp_path: Path, **env: str) -> tuple[subprocess.CompletedProcess, dict]:
    out, work = tmp_path / "out", tmp_path / "work"
    full = dict(os.environ, OUT=str(out), EAGLE_GPU_CHECK_WORK=str(work), PYTHON=env.pop("PYTHON", sys.executable),
                EAGLE_CACHE=os.environ.get("EAGLE_CACHE", str(tmp_path / "cache")), **env)
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], env=full, capture_output=True, text=True,
                          timeout=300)
    return proc, json.loads((out / "gpu-check.json").read_text())


def after(command: list[str], marker: list[str]) -> list[str]:
    """The arguments that follow ``marker`` (e.g. ``-m infer.bench``) in ``command``."""
    for i in range(len(command)):
        if command[i:i + len(marker)] == marker:
            return command[i + len(marker):]
    raise AssertionError(f"{' '.join(marker)} not in {shlex.join(command)}")


def test_the_cuda_plan_runs_every_part_within_one_call_with_flags_that_exist(tmp_path):
    proc, summary = run_check(tmp_path, EAGLE_GPU_CHECK_DRY="1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    parts = summary["parts"]
    assert list(parts) == DEFAULT_PARTS and all(p["planned"] for p in parts.values())
    assert sum(p["limit"] for p in parts.values()) <= 570 <= 590  # the budget; 10 minutes is a call's most
    assert summary["failed"] == [] and summary["goals"]
    for name, p in parts.items():
        command = p["command"]
        if "infer.bench" in command:
            args = bench.build_parser().parse_args(after(command, ["-m", "infer.bench"]))
            assert args.device == "cuda" and args.json.endswith(f"/{name}.json")
        elif "infer.size_projection" in command:
            args = size_projection.build_parser().parse_args(after(command, ["-m", "infer.size_projection"]))
            assert set(args.sizes.split(",")) == set(size_projection.SHAPES) and args.dtype == "bfloat16"
        elif name == "batched":
            source = (ROOT / "scripts" / "serving_speed.py").read_text()
            flags = [a for a in after(command, ["scripts/serving_speed.py"]) if a.startswith("--")]
            assert flags and all(f'"{flag}"' in source for flag in flags)
        elif name == "convert":
            assert command[-1] == summary["target"] and "converted_gguf_dir" in command[-2]
        elif name == "tests":
            assert "EAGLE_TEST_DEVICE=cuda" in command
            for test in [a for a in command if a.startswith("tests/")]:
                path, _, function = test.partition("::")
                assert (ROOT / path).is_file()
                assert not function or f"def {function}(" in (ROOT / path).read_text()


# an interpreter for the check under which eagle-bench hangs and the batched run prints one JSON line at once
HANGING_BENCH = f"""#!/bin/bash
case "$1 $2" in
  "-m infer.bench") exec sleep 120 ;;
  "scripts/serving_speed.py --target") echo '{{"method": "ar", "batch": 1, "tokens_per_s": 10.0}}'; exit 0 ;;
esac
exec {sys.executable} "$@"
"""


def test_a_part_that_hangs_runs_out_of_its_time_and_the_others_still_report(tmp_path):
    """The interpreter given runs eagle-bench as a hang and the batched run as one JSON line: the bench part is
    stopped at its limit, the batched part's figures are still summarised, and the check fails naming the part."""
    wrapper = tmp_path / "python"
    wrapper.write_text(HANGING_BENCH)
    wrapper.chmod(0o755)
    start = time.monotonic()
    proc, summary = run_check(tmp_path, PYTHON=str(wrapper), EAGLE_GPU_CHECK_DEVICE="cpu",
                              EAGLE_GPU_CHECK_PARTS="bench-fp32-greedy batched", EAGLE_GPU_CHECK_LIMIT="3")
    assert time.monotonic() - start < 60
    assert proc.returncode == 1
    assert summary["parts"]["bench-fp32-greedy"]["timed_out"] and summary["parts"]["batched"]["rc"] == 0
    assert summary["batched"] == [{"method": "ar", "batch": 1, "tokens_per_s": 10.0}]
    assert summary["failed"] == ["part bench-fp32-greedy ran out of time (3 s)"]
    assert "bench-fp32-greedy" not in summary  # it wrote no report


def test_a_check_stopped_from_outside_leaves_the_summary_of_the_parts_done(tmp_path):
    """The device tool stops a command at its time limit: what ran before is summarised already."""
    import signal

    wrapper = tmp_path / "python"
    wrapper.write_text(HANGING_BENCH)
    wrapper.chmod(0o755)
    out = tmp_path / "out"
    env = dict(os.environ, OUT=str(out), EAGLE_GPU_CHECK_WORK=str(tmp_path / "work"), PYTHON=str(wrapper),
               EAGLE_GPU_CHECK_DEVICE="cpu", EAGLE_GPU_CHECK_PARTS="batched bench-fp32-greedy",
               EAGLE_CACHE=str(tmp_path / "cache"))
    proc = subprocess.Popen(["bash", str(ROOT / "scripts" / "gpu_check.sh")], env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while "== bench-fp32-greedy (limit" not in (out / "gpu-check.log").read_text() if (
                out / "gpu-check.log").is_file() else True:
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.5)
    finally:  # the whole session: ``timeout`` runs each part in a process group of its own
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == proc.pid:  # the session id
                try:
                    os.kill(int(stat.parent.name), signal.SIGKILL)
                except ProcessLookupError:
                    pass
        proc.wait()
    summary = json.loads((out / "gpu-check.json").read_text())
    assert list(summary["parts"]) == ["batched"] and summary["batched"][0]["tokens_per_s"] == 10.0


def write_parts(work: Path, rows: list[dict]) -> None:
    work.mkdir(parents=True, exist_ok=True)
    (work / "parts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_summary_reports_figures_goals_and_failures(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    out.mkdir()
    write_parts(work, [{"part": "tests", "rc": 0, "seconds": 50, "limit": 100},
                       {"part": "bench-fp32-greedy", "rc": 0, "seconds": 60, "limit": 90},
                       {"part": "serving-load", "rc": 0, "seconds": 70, "limit": 80},
                       {"part": "batched", "rc": 0, "seconds": 40, "limit": 60},
                       {"part": "size-projection", "rc": 124, "seconds": 120, "limit": 120},
                       {"part": "bench-fp32-t1", "rc": None, "seconds": 0, "skipped": True}])
    (work / "pytest.xml").write_text('<testsuites><testsuite tests="3" failures="1" errors="0" skipped="1">'
                                     '<testcase classname="t" name="a"/><testcase classname="t" name="b">'
                                     '<failure/></testcase><testcase classname="t" name="c"><skipped/></testcase>'
                                     '</testsuite></testsuites>')
    machine = {"graph_captures": 30, "graph_fallbacks": 0}
    (out / "bench-fp32-greedy.json").write_text(json.dumps({"prompts": 50, "machine": machine, "methods": {
        "ar": {"tokens_per_second": 300.0, "speedup_vs_ar": 1.0},
        "eagle-tree": {"tokens_per_second": 630.0, "speedup_vs_ar": 2.1, "identical_to_ar": True}}}))
    load = [{"method": m, "concurrency": n, "tokens_per_second": rate} for m, n, rate in
            (("ar", 1, 100.0), ("ar", 4, 390.0), ("ar", 16, 900.0), ("eagle-tree", 1, 150.0),
             ("eagle-tree", 4, 500.0), ("eagle-tree", 16, 1000.0))]
    (out / "serving-load.json").write_text(json.dumps({"machine": {"graph_captures": 5, "graph_fallbacks": 1},
                                                       "results": load}))
    (work / "batched.txt").write_text('noise\n{"method": "ar", "batch": 4, "tokens_per_s": 100.0}\n'
                                      '{"method": "eagle-tree", "batch": 4, "tokens_per_s": 120.0}\n')
    (out / "size-projection.json").write_text('{"sizes": {')  # cut short when its part was stopped
    summary = gpu_check_summary.summarize(out, work, "cuda", "t.gguf")
    assert summary["tests"]["passed"] == 1 and summary["tests"]["failed"] == ["t::b"]
    assert summary["headline"]["tree_vs_ar_fp32_greedy"] == 2.1
    assert summary["headline"]["graph_captures"] == 35 and summary["headline"]["graph_fallbacks"] == 1
    assert "size-projection" not in summary and summary["parts"]["size-projection"]["timed_out"]
    goals = {g["goal"]: g for g in summary["goals"]}
    assert goals["eagle-tree / ar, fp32 greedy"]["met"] is True
    assert goals["eagle-tree / ar, fp32 temperature 1"]["met"] is None  # not run
    assert goals["serving ar: 16 clients / 1 client, aggregate tokens/s"]["value"] == pytest.approx(9.0)
    assert goals["serving eagle-tree: 16 clients / 1 client, aggregate tokens/s"]["met"] is False
    assert goals["serving: eagle-tree / ar at 4 clients"]["value"] == pytest.approx(500 / 390)
    assert goals["batched: eagle-tree / ar at batch 4"]["value"] == pytest.approx(1.2)
    assert goals["CUDA graph captures that fell back"]["met"] is False
    assert summary["failed"] == ["part size-projection ran out of time (120 s)", "test t::b",
                                 "1 CUDA graph capture(s) fell back to eager running"]
    assert summary["headline"]["ok"] is False


def test_summary_of_a_projection_and_a_missing_test_report(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    out.mkdir()
    write_parts(work, [{"part": "tests", "rc": 2, "seconds": 5, "limit": 100},
                       {"part": "size-projection", "rc": 0, "seconds": 90, "limit": 120}])
    size = {"verify_vs_one_row": {"1": 1.0, "60": 1.25, "128": 1.9}, "ar_seconds_per_token": 0.02,
            "break_even_tau": 1.5, "projected_speedup": [{"tau": 2.87, "speedup": 1.91}], "graph_captures": 12,
            "graph_fallbacks": 0}
    (out / "size-projection.json").write_text(json.dumps({"sizes": {"llama-3.1-8b": size}, "failed": {}}))
    summary = gpu_check_summary.summarize(out, work, "cuda", "t.gguf")
    assert summary["size-projection"]["sizes"]["llama-3.1-8b"]["verify_60_vs_1"] == 1.25
    goals = {g["goal"]: g for g in summary["goals"]}
    assert goals["llama-3.1-8b shape: verify of 60 rows / 1 row"]["met"] is True
    assert summary["headline"]["graph_captures"] == 12
    assert summary["failed"] == ["part tests rc=2", "no test report"]


def test_two_calls_carry_the_target_in_parts_and_summarise_both(tmp_path):
    """``first`` keeps the carried target part and drafter weights and runs its parts; the second call joins the
    target from both parts, puts the drafter back, runs the other parts and summarises both calls. In a copy of the
    scripts with an interpreter that answers every part at once."""
    checkout = tmp_path / "checkout"
    (checkout / "scripts").mkdir(parents=True)
    for name in ("gpu_check.sh", "gpu_check_summary.py"):
        (checkout / "scripts" / name).write_text((ROOT / "scripts" / name).read_text())
    target = checkout / ".gpu" / "target"
    target.mkdir(parents=True)
    (target / "SmolLM2-135M-Instruct.Q4_1.gguf.part-aa").write_bytes(b"first half ")
    (checkout / ".gpu" / "weights").mkdir()
    (checkout / ".gpu" / "weights" / "model.safetensors").write_bytes(b"drafter")
    drafter = checkout / "eagle" / "shipped" / "drafters" / "smollm2-135m-instruct"
    drafter.mkdir(parents=True)
    wrapper = tmp_path / "python"
    wrapper.write_text(f"""#!/bin/bash
case "$1 $2" in
  "-m infer.bench")
    while [ $# -gt 0 ]; do
      [ "$1" = --json ] && echo '{{"prompts": 1, "machine": {{"graph_captures": 2}}, "methods": {{}}}}' > "$2"; shift
    done; exit 0 ;;
  "-m infer.size_projection")
    while [ $# -gt 0 ]; do [ "$1" = --json ] && echo '{{"sizes": {{}}, "failed": {{}}}}' > "$2"; shift; done; exit 0 ;;
  "-c "*converted_gguf_dir*) exit 0 ;;
  "scripts/serving_speed.py --target") echo '{{"method": "ar", "batch": 1, "tokens_per_s": 10.0}}'; exit 0 ;;
esac
exec {sys.executable} "$@"
""")
    wrapper.chmod(0o755)
    env = dict(os.environ, PYTHON=str(wrapper), EAGLE_GPU_CHECK_DEVICE="cpu", EAGLE_CACHE=str(tmp_path / "cache"),
               EAGLE_GPU_CHECK_WORK=str(tmp_path / "work"), EAGLE_GPU_CHECK_CARRY=str(tmp_path / "carry"))
    env.pop("EAGLE_GPU_TARGET", None)
    script = str(checkout / "scripts" / "gpu_check.sh")
    first = subprocess.run(["bash", script, "first"], env=dict(env, OUT=str(tmp_path / "out1"),
                                                               EAGLE_GPU_CHECK_PARTS="size-projection"),
                           capture_output=True, text=True, timeout=120)
    assert first.returncode == 0, first.stdout + first.stderr
    # the second call carries the other part; what the first carried is gone from the checkout
    (target / "SmolLM2-135M-Instruct.Q4_1.gguf.part-aa").unlink()
    (target / "SmolLM2-135M-Instruct.Q4_1.gguf.part-ab").write_bytes(b"second half")
    second = subprocess.run(["bash", script], env=dict(env, OUT=str(tmp_path / "out2")), capture_output=True,
                            text=True, timeout=120)
    assert second.returncode == 0, second.stdout + second.stderr
    joined = tmp_path / "carry" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert joined.read_bytes() == b"first half second half"
    assert (drafter / "model.safetensors").read_bytes() == b"drafter"
    summary = json.loads((tmp_path / "out2" / "gpu-check.json").read_text())
    assert list(summary["parts"]) == ["size-projection"] + DEFAULT_PARTS[1:8]
    assert summary["size-projection"] == {"failed": {}, "sizes": {}}  # the first call's report, kept in the work folder
    assert summary["batched"] == [{"method": "ar", "batch": 1, "tokens_per_s": 10.0}]
    assert summary["target"] == str(joined) and "--target " + str(joined) in " ".join(
        summary["parts"]["bench-fp32-greedy"]["command"])
    assert summary["headline"]["graph_captures"] == 2 * 5 and summary["failed"] == []
