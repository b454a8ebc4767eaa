"""The command lines on a tiny random target saved to disk: eagle-generate and eagle-bench,
their one-line errors, and the benchmark's statistics on hand-made records."""

import io
import json
import re

import pytest

from eagle.engine import EagleModel
from eagle.prompts import read_prompts
from infer import bench, cli

from eagle.runtime.target import load_target
from tests.conftest import save_tiny_model, tiny_drafter

STATS = re.compile(r"^\[(?P<method>[\w-]+)\] (?P<n>\d+) new tokens, [\d.]+ tokens/s, mean accepted length [\d.]+, "
                   r"\d+ target forwards$")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny target folder and a drafter folder for it."""
    return save_tiny_model(tmp_path_factory.mktemp("models"))


def one_error_line(err: str, prog: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), err
    return lines[0]


# ---- eagle-generate ------------------------------------------------------------------------
def test_generate_streams_text_and_one_stats_line(saved, capsys):
    target, drafter = saved
    assert cli.main(["--target", target, "--drafter", drafter, "--max-new-tokens", "12", "t3 t4 t5"]) == 0
    out, err = capsys.readouterr()
    match = STATS.match(err.strip().splitlines()[-1])
    assert match and match["method"] == "eagle-tree" and match["n"] == "12"  # a drafter: eagle-tree by default
    assert re.fullmatch(r"(t\d+ ?)+\n", out)
    assert cli.main(["--target", target, "--max-new-tokens", "12", "t3 t4 t5"]) == 0  # no drafter: ar
    ar_out, ar_err = capsys.readouterr()
    assert STATS.match(ar_err.strip().splitlines()[-1])["method"] == "ar"
    assert ar_out == out  # greedy: the same text


def test_threads_set_the_products_threads_before_the_model_loads(saved, capsys, monkeypatch):
    """``--threads N``: torch's intra-op threads, set before anything loads (the kernels' row-count choices
    and the tree-size cost curves are measured per thread count); the same text."""
    import torch

    loaded_with = []
    original = EagleModel.from_pretrained

    def spy(*args, **kwargs):
        loaded_with.append(torch.get_num_threads())
        return original(*args, **kwargs)

    monkeypatch.setattr(EagleModel, "from_pretrained", spy)
    before = torch.get_num_threads()
    assert cli.main(["--target", saved[0], "--max-new-tokens", "8", "t3 t4 t5"]) == 0
    out, _ = capsys.readouterr()
    try:
        assert cli.main(["--target", saved[0], "--threads", "1", "--max-new-tokens", "8", "t3 t4 t5"]) == 0
        assert torch.get_num_threads() == 1 and loaded_with == [before, 1]
    finally:
        torch.set_num_threads(before)
    assert capsys.readouterr()[0] == out


def test_interactive_chat_keeps_the_history(saved, capsys, monkeypatch):
    seen = []
    original = EagleModel.generate

    def spy(self, prompt, **kwargs):
        seen.append([dict(m) for m in prompt])
        return original(self, prompt, **kwargs)

    monkeypatch.setattr(EagleModel, "generate", spy)
    monkeypatch.setattr("sys.stdin", io.StringIO("t3 t4\n\nt5 t6\n/exit\nt7\n"))
    assert cli.main(["--target", saved[0], "--interactive", "--method", "pld", "--max-new-tokens", "5"]) == 0
    _, err = capsys.readouterr()
    assert len([ln for ln in err.splitlines() if STATS.search(ln.lstrip("> "))]) == 2
    assert [m["role"] for m in seen[1]] == ["user", "assistant", "user"]
    assert seen[1][0]["content"] == "t3 t4" and seen[1][2]["content"] == "t5 t6"


@pytest.mark.parametrize("args, message", [
    (["--method", "beam", "t3"], "invalid choice: 'beam'"),
    (["--temperature", "-1", "t3"], "temperature must be >= 0"),
    (["--drafter", "{tmp}/no-such-drafter", "t3"], "no drafter at"),
    (["--method", "eagle-tree", "t3"], "needs a drafter"),
    (["--total-tokens", "0", "t3"], "total-tokens"),
    (["--set", "lookup_tokens=-1", "t3"], "lookup_tokens must be >= 0"),
    (["--set", "draw_temperature_scale=0", "t3"], "draw_temperature_scale must be > 0"),
    (["--set", "draw_support=-1", "t3"], "draw_support must be >= 0"),
    (["--set", "int8_activations=true", "t3"], "int8 activations apply to weights kept as codes"),  # random weights
    (["--threads", "0", "t3"], "--threads must be >= 1, got 0"),
    ([], "give a prompt"),
])
def test_generate_errors_are_one_line_and_exit_2(saved, capsys, tmp_path, args, message):
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    assert cli.main(["--target", saved[0], *args]) == 2
    out, err = capsys.readouterr()
    assert message in one_error_line(err, "eagle-generate") and out == ""


# ---- eagle-bench ---------------------------------------------------------------------------
def write_prompts(path, lines):
    path.write_text("\n".join(ln if isinstance(ln, str) else json.dumps(ln) for ln in lines) + "\n")
    return str(path)


def test_bench_writes_the_report(saved, tmp_path, capsys, monkeypatch):
    from matplotlib.figure import Figure

    drawn = []  # per saved figure and panel: title, bar heights, x tick labels, legend labels
    savefig = Figure.savefig

    def spy(fig, *args, **kwargs):
        fig.canvas.draw()
        drawn.append([(ax.get_title(), [p.get_height() for p in ax.patches],
                       [t.get_text() for t in ax.get_xticklabels()],
                       [t.get_text() for t in ax.get_legend().get_texts()] if ax.get_legend() else [])
                      for ax in fig.axes])
        return savefig(fig, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", spy)
    target, drafter = saved
    prompts = write_prompts(tmp_path / "p.jsonl", [
        {"prompt": "t3 t4 t5 t3 t4", "category": "a"},
        {"turns": ["t7 t8 t9 t7 t8", "t2"], "category": "b"},
        "",
        {"prompt": "t1 t2 t3 t1 t2"}])
    report, png = tmp_path / "out" / "b.json", tmp_path / "b.png"
    assert bench.main(["--target", target, "--drafter", drafter, "--prompts", prompts, "--methods",
                       "hf,ar,pld,eagle-tree", "--max-new-tokens", "16", "--json", str(report),
                       "--plot", str(png), "--set", "lookup_tokens=4", "--set", "drafter_dtype=float32",
                       "--total-tokens", "8"]) == 0  # a fixed tree: drafting not gated by the timing
    out, _ = capsys.readouterr()
    assert ("| method | tokens/s | decode tokens/s | mean accept len | speedup vs ar | speedup vs hf | "
            "identical to ar |") in out
    assert "eagle-bench --target" in out and "torch_threads" in out
    data = json.loads(report.read_text())
    assert data["prompts"] == 3 and data["config"]["max_new_tokens"] == 16
    assert data["config"]["tree"]["lookup_tokens"] == 4 and data["config"]["prompt_lookup"]["max_ngram"] == 3
    assert data["config"]["drafter_dtype"] == "float32" and data["config"]["drafter_quant"] == "none"
    assert list(data["methods"]) == ["hf", "ar", "pld", "eagle-tree"]
    for name, m in data["methods"].items():
        assert m["tokens_per_second"] > 0 and m["mean_accept_length"] >= 1
        assert m["speedup_vs_ar"] > 0 and m["speedup_vs_hf"] > 0
        assert set(m["per_category"]) == {"a", "b", "uncategorized"}
    for name in ("ar", "pld", "eagle-tree"):
        assert data["methods"][name]["identical_to_ar"] is True
        # the steps cover a generation but for its set-up (the proposer, ~50 us: 2-3% of a tiny model's 16 tokens
        # here, 5.6% once on a slower machine), which the bench's clock sees; a step left out would be far more
        assert abs(sum(data["methods"][name]["step_fractions"].values()) - 1) < 0.1
    assert data["methods"]["hf"]["step_fractions"] is None and data["methods"]["hf"]["mean_accept_length"] == 1
    assert data["methods"]["ar"]["speedup_vs_ar"] == 1.0
    assert png.read_bytes()[:4] == b"\x89PNG"
    # the plot shows what the report says: per method its accepted-length fractions, and its speedup vs ar
    methods = list(data["methods"])
    [[(left_title, left_heights, _, legend), (right_title, right_heights, right_labels, _)]] = drawn
    assert left_title == "Accepted length" and legend == methods
    longest = max(int(n) for m in data["methods"].values() for n in m["accept_length_histogram"])
    fractions = []
    for m in data["methods"].values():
        hist = m["accept_length_histogram"]
        fractions += [hist.get(str(n), 0) / sum(hist.values()) for n in range(1, longest + 1)]
    assert left_heights == pytest.approx(fractions) and longest > 1
    assert right_title == "Speedup" and right_labels == methods
    assert right_heights == pytest.approx([data["methods"][m]["speedup_vs_ar"] for m in methods])
    from matplotlib.image import imread

    pixels = imread(str(png))
    assert pixels.shape[:2] == (480, 1320)  # 11 x 4 inches at 120 dpi
    painted = (pixels[..., :3] < 0.9).any(-1)  # not white: axes, text, bars
    assert 0.02 < painted.mean() < 0.5
    green = (abs(pixels[..., 0] - 0x2C / 255) < 0.05) & (abs(pixels[..., 1] - 0xA0 / 255) < 0.05) & \
        (abs(pixels[..., 2] - 0x2C / 255) < 0.05)  # tab:green: the speedup bars fill part of the right half
    assert green[:, 660:].sum() > 2000


@pytest.mark.graph_fallback
@pytest.mark.parametrize("fails", [False, True])
def test_bench_reports_graph_captures_and_fallbacks(saved, tmp_path, capsys, monkeypatch, fails):
    """The static path with a capture (the CPU stand-in for CUDA's, with the compiled kernels off as a recording
    needs them; one that always fails as the control): the report counts captures and fallbacks per method and in
    the machine info, and a fallback is said loudly."""
    from eagle.runtime import cuda_graphs, kernels
    from eagle.runtime.fake_capture import fake_capture

    def failing(run, device, pool):
        raise RuntimeError("Cannot copy between CPU and CUDA tensors during CUDA graph capture")

    report, prompts = tmp_path / "b.json", write_prompts(tmp_path / "p.jsonl", [{"prompt": "t3 t4 t5"}])
    monkeypatch.setenv("EAGLE_CPU_KERNELS", "0")  # a recording replays torch's operations, not the kernels'
    kernels.cpu_kernels.cache_clear()
    try:
        with cuda_graphs.capture_with(failing if fails else fake_capture):
            assert bench.main(["--target", saved[0], "--drafter", saved[1], "--prompts", prompts, "--methods",
                               "ar,eagle-tree", "--max-new-tokens", "6", "--set", "cuda_graphs=true", "--set",
                               "device_rounds=true", "--set", "lookup_tokens=0", "--set", "warmup=0",
                               "--total-tokens", "6", "--json", str(report)]) == 0
    finally:
        kernels.cpu_kernels.cache_clear()  # built again, as the environment gives, by the next user
    out, err = capsys.readouterr()
    data = json.loads(report.read_text())
    machine = data["machine"]
    assert (machine["graph_fallbacks"] > 0) == fails and (machine["graph_captures"] > 0) != fails
    assert 50 < machine["peak_memory_mb"] < 100_000  # this process's largest resident memory, in MB
    for name in ("ar", "eagle-tree"):
        assert (data["methods"][name]["graph_fallbacks"] > 0) == fails
    assert ("FELL BACK" in out and "FELL BACK" in err) == fails
    assert "| method | captured | fell back |" in out


def test_bench_loads_the_target_in_the_dtype_asked_for(saved, tmp_path):
    report, prompts = tmp_path / "b.json", write_prompts(tmp_path / "p.jsonl", [{"prompt": "t3 t4"}])
    for dtype in ("bfloat16", "float32"):
        assert bench.main(["--target", saved[0], "--prompts", prompts, "--methods", "ar", "--max-new-tokens", "2",
                           "--dtype", dtype, "--json", str(report)]) == 0
        assert json.loads(report.read_text())["machine"]["dtype"] == dtype


@pytest.mark.parametrize("case, message", [
    ("missing", "prompt file not found"),
    ("malformed", "bad.jsonl:2: not valid JSON"),
    ("no-prompt", "noprompt.jsonl:1: expected a JSON object with 'prompt' or 'turns'"),
    ("unknown-method", "unknown method(s) 'beam'"),
    ("no-drafter", "'eagle-tree' needs a drafter"),
])
def test_bench_errors_are_one_line_and_exit_2(saved, tmp_path, capsys, case, message):
    good = write_prompts(tmp_path / "good.jsonl", [{"prompt": "t3 t4"}])
    argv = {"missing": ["--prompts", str(tmp_path / "nope.jsonl")],
            "malformed": ["--prompts", write_prompts(tmp_path / "bad.jsonl", [{"prompt": "t3"}, "{not json"])],
            "no-prompt": ["--prompts", write_prompts(tmp_path / "noprompt.jsonl", [{"text": "t3"}])],
            "unknown-method": ["--prompts", good, "--methods", "ar,beam"],
            "no-drafter": ["--prompts", good, "--methods", "ar,eagle-tree"]}[case]
    assert bench.main(["--target", saved[0], *argv]) == 2
    out, err = capsys.readouterr()
    assert message in one_error_line(err, "eagle-bench") and out == ""


# ---- statistics on hand-made records -------------------------------------------------------
def record(method, prompt, tokens, seconds, lengths, category="x", steps=None):
    return dict(method=method, prompt=prompt, category=category, new_tokens=len(tokens), seconds=seconds,
                accept_lengths=lengths, target_forwards=len(lengths), token_ids=tokens,
                step_seconds=steps, prefill_s=None if steps is None else 0.1 * seconds)


def test_summarize_hand_made_records():
    steps = {"draft": 0.2, "verify": 0.5, "accept": 0.1, "cache": 0.05, "other": 0.05}
    records = [
        record("hf", 0, [1, 2, 3, 4], 2.0, [1, 1, 1, 1], "a"),
        record("ar", 0, [1, 2, 3, 4], 1.0, [1, 1, 1, 1], "a", steps),
        record("pld", 0, [1, 2, 3, 4], 0.5, [3, 1], "a", steps),
        record("hf", 1, [5, 6], 1.0, [1, 1], "b"),
        record("ar", 1, [5, 6], 1.0, [1, 1], "b", steps),
        record("pld", 1, [5, 7], 0.5, [2], "b", steps),
    ]
    s = bench.summarize(records)
    assert list(s) == ["hf", "ar", "pld"]
    assert s["ar"]["tokens_per_second"] == 3.0 and s["hf"]["tokens_per_second"] == 2.0
    assert s["pld"]["tokens_per_second"] == 6.0 and s["pld"]["mean_accept_length"] == 2.0
    assert s["pld"]["speedup_vs_ar"] == 2.0 and s["pld"]["speedup_vs_hf"] == 3.0 and s["hf"]["speedup_vs_ar"] == 2 / 3
    assert s["ar"]["identical_to_ar"] is True and s["hf"]["identical_to_ar"] is True
    assert s["pld"]["identical_to_ar"] is False  # prompt 1 differs
    assert s["pld"]["per_category"]["a"] == {"tokens_per_second": 8.0, "mean_accept_length": 2.0, "prompts": 1}
    assert s["pld"]["accept_length_histogram"] == {"2": 1, "3": 1, "1": 1} or \
        s["pld"]["accept_length_histogram"] == {"1": 1, "2": 1, "3": 1}
    assert s["hf"]["step_fractions"] is None
    fractions = s["ar"]["step_fractions"]
    assert fractions["prefill"] == pytest.approx(0.1) and fractions["verify"] == pytest.approx(0.5)
    text = bench.markdown(s)
    assert "| pld | 6.0 | 2.00 | 2.00x | 3.00x | NO |" in text and "| a |" in text and "| ar | 10.0% |" in text
    sampled = bench.summarize(records, greedy=False)
    assert all(m["identical_to_ar"] is None for m in sampled.values())
    alone = bench.summarize([r for r in records if r["method"] == "pld"])
    assert alone["pld"]["speedup_vs_ar"] is None and alone["pld"]["identical_to_ar"] is None
    assert "| pld | 6.0 | 2.00 | - | - | n/a |" in bench.markdown(alone)


def test_read_prompts_and_parse_methods(tmp_path):
    path = write_prompts(tmp_path / "p.jsonl", [{"turns": ["first", "second"], "category": "writing"},
                                               {"prompt": "plain"}])
    assert read_prompts(path) == [{"prompt": "first", "category": "writing"},
                                        {"prompt": "plain", "category": "uncategorized"}]
    assert bench.parse_methods(" hf, ar,eagle-tree ") == ["hf", "ar", "eagle-tree"]
    mixed = [{"prompt": f"p{i}", "category": "ab"[i % 2]} for i in range(7)]
    assert [p["prompt"] for p in bench.first_per_category(mixed, 2)] == ["p0", "p1", "p2", "p3"]
    assert bench.first_per_category(mixed, None) == mixed
    with pytest.raises(Exception, match="twice"):
        bench.parse_methods("ar,ar")
    assert bench.parse_methods("eagle-tree,eagle-tree@runs/x") == ["eagle-tree", "eagle-tree@runs/x"]
    assert bench.split_method("eagle-chain@a@b") == ("eagle-chain", "a@b")
    for bad in ("ar@runs/x", "eagle-tree@", "sd@runs/x"):
        with pytest.raises(Exception, match="take a drafter folder"):
            bench.parse_methods(bad)


def test_bench_compares_drafters_in_one_process(saved, tmp_path, capsys):
    """``eagle-tree@DIR`` runs beside ``eagle-tree`` with the drafter in DIR (the report says which
    drafter each method drafted with), and greedy output stays ar's."""

    target_dir, drafter_dir = saved
    other = tmp_path / "other"
    tiny_drafter(load_target(target_dir), seed=7).save_pretrained(other)
    prompts = write_prompts(tmp_path / "p.jsonl", [{"prompt": "t3 t4 t5 t3 t4"}, {"prompt": "t7 t8 t9 t7"}])
    report = tmp_path / "b.json"
    methods = f"ar,eagle-tree,eagle-tree@{other}"
    assert bench.main(["--target", target_dir, "--drafter", drafter_dir, "--prompts", prompts, "--methods", methods,
                       "--max-new-tokens", "24", "--json", str(report), "--set", "warmup=0", "--set",
                       "lookup_tokens=0"]) == 0
    report = json.loads(report.read_text())
    data = report["methods"]
    assert list(data) == methods.split(",")
    assert data[f"eagle-tree@{other}"]["identical_to_ar"] is True and data["eagle-tree"]["identical_to_ar"] is True
    assert report["config"]["drafters"] == {"eagle-tree": f"eagle {drafter_dir}", f"eagle-tree@{other}": f"eagle {other}"}
    assert data[f"eagle-tree@{other}"]["step_fractions"]["draft"] > 0  # it drafted


def test_bench_compares_int8_activations_in_one_process(saved, tmp_path):
    """``ar+int8`` and ``eagle-tree+int8`` run on the target loaded again with int8 activations (here a target
    whose weights are exact 4-bit block encodings, as a GGUF file's are): the +int8 methods are compared with
    ar+int8 (greedy: the same tokens), and the report names both kernel choices."""
    import shutil

    import torch

    from eagle.runtime.quant_blocks import block_quantize, decode

    target_dir, drafter_dir = saved
    coded = tmp_path / "coded"
    shutil.copytree(target_dir, coded)
    model = load_target(target_dir, lean=False).model
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear) and module.in_features % 32 == 0:
                module.weight.copy_(decode(block_quantize(module.weight.float(), 4)))
    model.save_pretrained(coded)
    prompts = write_prompts(tmp_path / "p.jsonl", [{"prompt": "t3 t4 t5 t3 t4"}, {"prompt": "t7 t8 t9 t7"}])
    report = tmp_path / "b.json"
    methods = "ar,ar+int8,eagle-tree+int8"
    assert bench.main(["--target", str(coded), "--drafter", drafter_dir, "--prompts", prompts, "--methods", methods,
                       "--max-new-tokens", "16", "--json", str(report), "--set", "warmup=0"]) == 0
    report = json.loads(report.read_text())
    data = report["methods"]
    assert list(data) == methods.split(",")
    assert data["eagle-tree+int8"]["identical_to_ar"] is True and data["ar+int8"]["identical_to_ar"] is True
    assert "int8 activations" in report["machine"]["kernels+int8"]
    assert "int8 activations" not in report["machine"]["kernels"]
    assert bench.main(["--target", target_dir, "--prompts", prompts, "--methods", "hf+int8"]) == 2


# ---- options a mode does not read ----------------------------------------------------------
def warnings(err: str, prog: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith(f"{prog}: warning: ")]


def test_generate_names_each_option_its_method_or_greedy_decoding_ignores_once(saved, capsys):
    target, drafter = saved
    assert cli.main(["--target", target, "--drafter", drafter, "--method", "ar", "--set", "depth=2", "--set", "gamma=3",
                     "--top-p", "0.9", "--seed", "1", "--max-new-tokens", "3", "t3 t4"]) == 0
    assert warnings(capsys.readouterr().err, "eagle-generate") == [
        "eagle-generate: warning: --drafter, depth, gamma are ignored with method ar",
        "eagle-generate: warning: --top-p, --seed are ignored at temperature 0 (greedy decoding)"]
    # the same flags where they are read: no word
    assert cli.main(["--target", target, "--drafter", drafter, "--method", "eagle-tree", "--set", "depth=2",
                     "--temperature", "1", "--top-p", "0.9", "--seed", "1", "--max-new-tokens", "3", "t3 t4"]) == 0
    assert warnings(capsys.readouterr().err, "eagle-generate") == []
    assert cli.main(["--target", target, "--drafter", drafter, "--method", "eagle-chain", "--set", "top_k=2",
                     "--temperature", "1", "--set", "sampled_tree=false", "--set", "draw_support=8",
                     "--max-new-tokens", "3",
                     "t3"]) == 0
    assert warnings(capsys.readouterr().err, "eagle-generate") == [
        "eagle-generate: warning: top_k is ignored with method eagle-chain",
        "eagle-generate: warning: draw_support is ignored with sampled_tree false"]


def test_a_flag_given_twice_with_different_values_is_an_error_naming_both(saved, capsys):
    assert cli.main(["--target", saved[0], "--max-new-tokens", "3", "--max-new-tokens", "5", "t3"]) == 2
    out, err = capsys.readouterr()
    assert one_error_line(err, "eagle-generate") == \
        "eagle-generate: error: --max-new-tokens is given twice, with different values: 3 and 5"
    assert cli.main(["--target", saved[0], "--max-new-tokens", "3", "--max-new-tokens", "3", "t3"]) == 0


def test_bench_names_the_options_none_of_its_methods_reads(saved, tmp_path, capsys):
    prompts = write_prompts(tmp_path / "p.jsonl", [{"prompt": "t3 t4"}])
    assert bench.main(["--target", saved[0], "--drafter", saved[1], "--prompts", prompts, "--methods", "hf,ar",
                       "--max-new-tokens", "2", "--set", "lookup_tokens=0", "--set", f"llama_cpp={tmp_path}",
                       "--title", "t", "--temperature", "1", "--set", "lenience=0.5"]) == 0
    assert warnings(capsys.readouterr().err, "eagle-bench") == [
        "eagle-bench: warning: --drafter, lookup_tokens, lenience, llama_cpp are ignored with --methods hf,ar",
        "eagle-bench: warning: --title is ignored without --json (it titles the JSON report)"]
    methods = f"ar,eagle-tree@{saved[1]}"  # a drafter folder of its own: --drafter is read by no method
    assert bench.main(["--target", saved[0], "--drafter", saved[1], "--prompts", prompts, "--methods", methods,
                       "--max-new-tokens", "2", "--set", "lookup_tokens=0"]) == 0
    assert warnings(capsys.readouterr().err, "eagle-bench") == [
        f"eagle-bench: warning: --drafter is ignored with --methods {methods}"]
