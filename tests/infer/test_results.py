"""eagle-results: the results page rendered from eagle-bench --json reports."""

import json

import pytest

from eagle.errors import EagleError
from infer import results

SUMMARY = {"ar": {"tokens_per_second": 100.0, "mean_accept_length": 1.0, "speedup_vs_ar": 1.0, "speedup_vs_hf": 4.0,
                  "identical_to_ar": True, "per_category": {"writing": {"tokens_per_second": 100.0,
                                                                        "mean_accept_length": 1.0}},
                  "step_fractions": {"verify": 1.0}},
           "eagle-tree": {"tokens_per_second": 150.0, "mean_accept_length": 2.0, "speedup_vs_ar": 1.5,
                          "speedup_vs_hf": 6.0, "identical_to_ar": True,
                          "per_category": {"writing": {"tokens_per_second": 150.0, "mean_accept_length": 2.0}},
                          "step_fractions": {"draft": 0.2, "verify": 0.8}}}


def report(**extra):
    return dict(config={"command": "eagle-bench --prompts p.jsonl --methods ar,eagle-tree", "max_new_tokens": 128,
                        "temperature": 0.0},
                machine={"device": "cpu", "dtype": "float32", "torch_threads": 2, "torch": "2.13.0",
                         "cpu": "Some CPU", "date": "2026-11-26"},
                prompts=20, methods=SUMMARY, **extra)


def test_page_has_command_machine_date_and_tables(tmp_path):
    path = tmp_path / "cpu-greedy.json"
    path.write_text(json.dumps(report(title="CPU, greedy")))
    header = tmp_path / "header.md"
    header.write_text("# Results\n")
    out = tmp_path / "results.md"
    results.main([str(path), "--header", str(header), "--out", str(out)])
    page = out.read_text()
    assert page.startswith("# Results\n")
    assert "## CPU, greedy" in page
    assert "`eagle-bench --prompts p.jsonl --methods ar,eagle-tree`" in page
    assert "Some CPU" in page and "Date: 2026-11-26" in page and "20 prompts, 128 new tokens, greedy" in page
    assert "| eagle-tree | 150.0 | 2.00 | 1.50x | 6.00x | yes |" in page


def test_a_file_that_is_no_bench_report_is_one_clear_error(tmp_path):
    path = tmp_path / "x.json"
    path.write_text(json.dumps({"hello": 1}))
    with pytest.raises(EagleError, match="not an eagle-bench --json report"):
        results.render([str(path)])
    path.write_text("{")
    with pytest.raises(EagleError, match="cannot read"):
        results.render([str(path)])


def test_a_gpu_section_says_its_graph_captures_and_fallbacks():
    gpu = report()
    gpu["machine"].update(device="cuda", gpu="Some GPU", graph_captures=12, graph_fallbacks=0)
    assert "CUDA graphs: 12 captured, 0 fell back to eager running." in results.section(gpu, "gpu.json")
    gpu["machine"]["graph_fallbacks"] = 3
    assert "3 fell back to eager running (NOT the fast path)" in results.section(gpu, "gpu.json")
    assert "CUDA graphs" not in results.section(report(), "cpu.json")


def test_a_section_says_the_peak_memory_of_the_bench_process_where_recorded():
    cpu = report()
    assert "peak memory" not in results.section(cpu, "cpu.json")  # reports written before it was recorded
    cpu["machine"]["peak_memory_mb"] = 707.2
    assert "; peak memory of the process 707 MB. Date:" in results.section(cpu, "cpu.json")


def test_a_load_test_report_renders_its_own_table():
    """``eagle-bench --concurrency --json`` reports (kind "load-test") sit in docs/results/ too."""
    row = {"method": "ar", "concurrency": 4, "requests": 8, "errors": 0, "tokens": 512, "wall_s": 10.0,
           "tokens_per_second": 51.2, "mean_accepted_length": 1.0, "ttft_s": {"p50": 0.5, "p90": 0.9, "p99": 1.0},
           "tpot_s": {"p50": 0.05, "p90": 0.06, "p99": 0.07}, "latency_s": {"p50": 7, "p90": 8, "p99": 9},
           "checked": True, "mismatches": 0, "mismatched": []}
    load = dict(report(kind="load-test", results=[row]))
    del load["methods"]
    load["machine"]["server"] = "in-process, max_batch 16"
    page = results.section(load, "cpu-serving-load.json")
    assert "Load test of eagle-serve (in-process, max_batch 16)." in page
    assert "| ar | 4 | 8 | 51.2 | - | 500 / 900 / 1000 | 50 / 60 / 70 | 1.00 | 0 | 0 |" in page
    del load["results"]
    with pytest.raises(EagleError, match="not an eagle-bench --json report"):
        results.section(load, "x.json")
