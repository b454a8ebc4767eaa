"""llama.cpp as eagle-bench methods: the records and statistics from llama-server's answers, the
server's start and its failures, and eagle-bench end to end, against a fake ``llama-server`` (a
small Python HTTP server written here); the real build only where one exists (slow)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from eagle.errors import EagleError
from eagle.engine import EagleModel
from infer import bench, llama_cpp

from tests.conftest import save_tiny_model

ROOT = Path(__file__).resolve().parents[2]

# A stand-in for llama-server: /health, and /completion answering the tokens the config file names for the
# prompt ids (else the last prompt id repeated), with timings; it logs each request body and its argv.
FAKE_SERVER = r'''
import json, os, sys, time
from http.server import BaseHTTPRequestHandler, HTTPServer

argv = sys.argv[1:]
if "--version" in argv:
    print("version: 1 (fake)")
    sys.exit(0)
cfg = json.load(open(os.environ["FAKE_LLAMA"]))
def arg(name):
    return argv[argv.index(name) + 1] if name in argv else None
spec = arg("--spec-type")
with open(cfg["log"], "a") as f:
    f.write(json.dumps({"argv": argv}) + "\n")
if cfg.get("mode") == "exit":
    print("error: failed to load model", flush=True)
    sys.exit(1)
if cfg.get("mode") == "silent":
    time.sleep(60)
    sys.exit(0)

class Handler(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass
    def reply(self, code, body):
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
    def do_GET(self):
        self.reply(200, {"status": "ok"})
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with open(cfg["log"], "a") as f:
            f.write(json.dumps({"spec": spec, "body": body}) + "\n")
        replies = cfg["replies"].get(spec or "none", {})
        tokens = replies.get(json.dumps(body["prompt"]), [body["prompt"][-1]] * body["n_predict"])[:body["n_predict"]]
        timings = {"prompt_n": len(body["prompt"]), "prompt_ms": 2.0, "predicted_n": len(tokens),
                   "predicted_ms": 4.0 * len(tokens)}
        if spec:
            timings.update(draft_n=3 * len(tokens), draft_n_accepted=len(tokens) // 2)
        self.reply(200, {"content": "", "tokens": tokens, "timings": timings})

HTTPServer(("127.0.0.1", int(arg("--port"))), Handler).serve_forever()
'''


@pytest.fixture
def fake_build(tmp_path, monkeypatch):
    """A build folder with the fake llama-server in build/bin; returns a function writing its config."""
    folder = tmp_path / "llama.cpp"
    (folder / "build" / "bin").mkdir(parents=True)
    binary = folder / "build" / "bin" / "llama-server"
    binary.write_text(f"#!{sys.executable}\n{FAKE_SERVER}")
    binary.chmod(0o755)
    config, log = tmp_path / "fake.json", tmp_path / "fake.log"
    monkeypatch.setenv("FAKE_LLAMA", str(config))

    def configure(mode="ok", replies=None):
        config.write_text(json.dumps({"mode": mode, "replies": replies or {}, "log": str(log)}))
        return folder, log

    configure()
    return configure


def logged(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()]


# ---- records and statistics (pure) ------------------------------------------------------------
def test_record_counts_forwards_from_accepted_drafts():
    plain = llama_cpp.record({"tokens": [5, 6, 7, 2], "timings": {"prompt_ms": 10.0, "predicted_ms": 40.0,
                                                                  "predicted_n": 4}}, seconds=0.06)
    assert plain["accept_lengths"] == [1, 1, 1, 1] and plain["steps"] == 4 and plain["token_ids"] == [5, 6, 7, 2]
    assert plain["prefill_s"] == 0.01 and plain["decode_seconds"] == 0.04
    # 10 tokens, 4 drafts accepted: the prompt's forward and 5 steps gave one token each of their own
    spec = llama_cpp.record({"tokens": list(range(10)), "timings": {"draft_n": 9, "draft_n_accepted": 4,
                                                                     "predicted_ms": 20.0}}, seconds=0.03)
    assert spec["accept_lengths"] is None and spec["steps"] == spec["target_forwards"] == 6
    assert (spec["draft_tokens"], spec["draft_accepted"]) == (9, 4)
    with pytest.raises(EagleError, match="no 'tokens'"):
        llama_cpp.record({"content": "hi", "timings": {}}, seconds=1.0)


def test_summary_has_decode_rates_and_speedups_vs_llama_cpp():
    def rec(method, **fields):
        return dict(method=method, prompt=0, category="a", **fields)

    def server(tokens, seconds, **timings):
        return rec(method, **llama_cpp.record({"tokens": tokens, "timings": timings}, seconds))

    records = [rec("ar", new_tokens=4, seconds=2.0, token_ids=[1, 2, 3, 4], accept_lengths=[1] * 4, target_forwards=4,
                   step_seconds=None, prefill_s=0.0, decode_seconds=1.0)]
    method = "llama.cpp"
    records.append(server([1, 2, 3, 4], 1.0, predicted_ms=500.0))
    method = "llama.cpp-ngram"
    records.append(server([1, 2, 3, 9], 0.5, draft_n=4, draft_n_accepted=2, predicted_ms=250.0))
    s = bench.summarize(records)
    assert s["llama.cpp"]["speedup_vs_llama_cpp"] == 1.0 and s["ar"]["speedup_vs_llama_cpp"] == 0.5
    assert s["llama.cpp-ngram"]["speedup_vs_llama_cpp"] == 2.0
    assert s["llama.cpp-ngram"]["mean_accept_length"] == 2.0  # 4 tokens over 2 forwards
    assert s["llama.cpp"]["mean_accept_length"] == 1.0 and s["llama.cpp"]["accept_length_histogram"] == {"1": 4}
    assert s["llama.cpp-ngram"]["accept_length_histogram"] == {}
    assert s["ar"]["decode_tokens_per_second"] == 4.0 and s["llama.cpp"]["decode_tokens_per_second"] == 8.0
    assert s["llama.cpp"]["identical_to_ar"] is True and s["llama.cpp-ngram"]["identical_to_ar"] is False
    assert s["ar"]["identical_to_llama_cpp"] is True and s["llama.cpp-ngram"]["identical_share_llama_cpp"] == 0.0
    text = bench.markdown(s)
    assert ("| method | tokens/s | decode tokens/s | mean accept len | speedup vs ar | speedup vs hf | "
            "speedup vs llama.cpp | identical to ar | identical to llama.cpp |") in text
    assert "| llama.cpp-ngram | 8.0 | 16.0 | 2.00 | 4.00x | - | 2.00x | NO | NO |" in text
    alone = bench.summarize([r for r in records if r["method"] != "llama.cpp"])
    assert alone["ar"]["speedup_vs_llama_cpp"] is None and "speedup vs llama.cpp" not in bench.markdown(alone)


def test_completion_body_turns_llama_cpp_samplers_off():
    greedy = llama_cpp.completion_body([1, 2], 16, 0.0)
    assert greedy["prompt"] == [1, 2] and greedy["n_predict"] == 16 and greedy["temperature"] == 0.0
    assert greedy["return_tokens"] and not greedy["cache_prompt"] and "seed" not in greedy
    sampled = llama_cpp.completion_body([1], 8, 1.0, top_p=0.9, top_k=5, seed=3)
    assert (sampled["top_p"], sampled["top_k"], sampled["min_p"], sampled["seed"]) == (0.9, 5, 0.0, 3)


def test_random_eagle3_checkpoint_has_the_specforge_layout(tmp_path):
    from safetensors.torch import load_file

    smollm2 = dict(hidden_size=576, num_hidden_layers=30, vocab_size=49152, num_attention_heads=9,
                   num_key_value_heads=3, head_dim=64, intermediate_size=1536, rope_parameters={"rope_theta": 1e5})
    out = llama_cpp.random_eagle3(smollm2, tmp_path / "e3")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["rope_theta"] == 1e5
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]
    assert llama_cpp.is_eagle3_folder(out) and not llama_cpp.is_eagle3_folder(tmp_path)
    state = load_file(str(out / "model.safetensors"))
    assert state["fc.weight"].shape == (576, 1728) and state["lm_head.weight"].shape == (8192, 576)
    assert state["midlayer.self_attn.q_proj.weight"].shape == (576, 1152)
    assert state["midlayer.self_attn.k_proj.weight"].shape == (192, 1152)
    targets = state["d2t"] + __import__("torch").arange(8192)  # offsets -> target ids, exactly the t2d mask
    assert state["t2d"].sum() == 8192 and state["t2d"][targets].all()


# ---- locating the build and starting the server --------------------------------------------------
def test_build_folder_and_binary_errors(tmp_path, monkeypatch):
    monkeypatch.delenv(llama_cpp.ENV, raising=False)
    with pytest.raises(EagleError, match="pass --set llama_cpp=DIR or set EAGLE_LLAMA_CPP"):
        llama_cpp.build_folder(None)
    with pytest.raises(EagleError, match="no llama.cpp build at .*no such folder"):
        llama_cpp.build_folder(str(tmp_path / "none"))
    monkeypatch.setenv(llama_cpp.ENV, str(tmp_path))
    assert llama_cpp.build_folder(None) == tmp_path
    with pytest.raises(EagleError, match="no llama-server in"):
        llama_cpp.server_binary(tmp_path)
    (tmp_path / "llama-server").write_text("")
    with pytest.raises(EagleError, match="is not executable"):
        llama_cpp.server_binary(tmp_path)
    with pytest.raises(EagleError, match="no convert_hf_to_gguf.py"):
        llama_cpp.converter(tmp_path)
    with pytest.raises(EagleError, match="not a .gguf file"):
        llama_cpp.target_gguf(save_tiny_model(tmp_path)[0])


def test_server_answers_and_stops(fake_build):
    folder, log = fake_build(replies={"none": {"[1, 2]": [7, 8, 2]}})
    server = llama_cpp.LlamaServer(llama_cpp.server_binary(folder), Path("m.gguf"), threads=2)
    with server:
        rec = llama_cpp.run(server, [1, 2], 8, 0.0, 1.0, 0, None)
        proc = server.proc
    assert proc.poll() is not None  # stopped
    assert rec["token_ids"] == [7, 8, 2] and rec["accept_lengths"] == [1, 1, 1] and rec["seconds"] > 0
    argv, request = logged(log)
    assert argv["argv"][argv["argv"].index("-t") + 1] == "2" and "--spec-type" not in argv["argv"]
    assert request["body"]["return_tokens"] is True and request["body"]["cache_prompt"] is False


@pytest.mark.parametrize("mode, message", [("exit", "exited with code 1 before it came up: .*failed to load model"),
                                           ("silent", "did not come up within 1 s")])
def test_server_that_does_not_come_up_is_one_clear_error(fake_build, tmp_path, monkeypatch, mode, message):
    folder, _ = fake_build(mode)
    monkeypatch.setattr(llama_cpp, "STARTUP_S", 1.0)
    server = llama_cpp.LlamaServer(llama_cpp.server_binary(folder), Path("m.gguf"), 2, log=tmp_path / "s.log")
    with pytest.raises(EagleError, match=message):
        server.start()
    server.close()
    assert server.proc is None


def test_convert_draft_reports_the_converter_log(tmp_path):
    folder = tmp_path / "build"
    (folder / "src").mkdir(parents=True)
    script = folder / "src" / "convert_hf_to_gguf.py"
    script.write_text("import sys\nargs = sys.argv[1:]\n"
                      "if 'bad' in args[0]:\n    print('ValueError: no draft_vocab_size'); sys.exit(1)\n"
                      "open(args[args.index('--outfile') + 1], 'wb').write(b'GGUF')\n"
                      "print('INFO:hf-to-gguf:EAGLE-3: target_layers = [2, 15, 27] (target model has 30 layers)')\n")
    out, lines = llama_cpp.convert_draft(folder, tmp_path / "draft", tmp_path / "target", tmp_path / "d.gguf")
    assert out.read_bytes() == b"GGUF" and lines == [
        "INFO:hf-to-gguf:EAGLE-3: target_layers = [2, 15, 27] (target model has 30 layers)"]
    with pytest.raises(EagleError, match="converting the EAGLE-3 drafter .*bad.* failed .exit 1.: ValueError"):
        llama_cpp.convert_draft(folder, tmp_path / "bad", tmp_path / "target", tmp_path / "e.gguf")


# ---- eagle-bench with the fake server -------------------------------------------------------------
@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("models"))


def test_bench_runs_llama_cpp_methods_beside_ours(saved, fake_build, tmp_path, monkeypatch, capsys):
    target, _ = saved
    prompts = ["t3 t4 t5", "t7 t8 t9 t7"]
    model = EagleModel.from_pretrained(target)
    ids = [model.target.encode_prompt(p) for p in prompts]
    ar = [model.generate(i, method="ar", max_new_tokens=6).token_ids for i in ids]
    # plain llama.cpp answers what ar does; the n-gram server differs on the second prompt
    folder, log = fake_build(replies={"none": {json.dumps(i): t for i, t in zip(ids, ar)},
                                      "ngram-simple": {json.dumps(ids[0]): ar[0]}})
    fake_gguf = tmp_path / "t.gguf"
    fake_gguf.write_bytes(b"GGUF")
    monkeypatch.setattr(llama_cpp, "target_gguf", lambda spec: fake_gguf)
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    report = tmp_path / "r.json"
    assert bench.main(["--target", target, "--prompts", str(tmp_path / "p.jsonl"), "--methods",
                       "llama.cpp,ar,llama.cpp-ngram", "--max-new-tokens", "6", "--set", f"llama_cpp={folder}",
                       "--json", str(report)]) == 0
    out, _ = capsys.readouterr()
    assert "speedup vs llama.cpp" in out and "llama_cpp version: 1 (fake)" in out
    data = json.loads(report.read_text())
    m = data["methods"]
    assert m["llama.cpp"]["identical_to_ar"] is True and m["llama.cpp-ngram"]["identical_share"] == 0.5
    assert m["llama.cpp-ngram"]["identical_share_llama_cpp"] == 0.5 and m["ar"]["identical_to_llama_cpp"] is True
    assert m["llama.cpp"]["speedup_vs_llama_cpp"] == 1.0 and m["ar"]["speedup_vs_llama_cpp"] > 0
    # the fake accepts len // 2 of every answer's 6 tokens: 6 / (6 - 3) per prompt
    assert m["llama.cpp-ngram"]["mean_accept_length"] == 2.0 and m["llama.cpp"]["mean_accept_length"] == 1.0
    assert m["ar"]["decode_tokens_per_second"] > 0 and m["llama.cpp"]["decode_tokens_per_second"] == 250.0
    assert "--spec-type ngram-simple" in data["config"]["llama_cpp_servers"]["llama.cpp-ngram"]
    bodies = [e for e in logged(log) if "body" in e]
    assert len(bodies) == 2 * 3  # one warmup prompt and two measured, per server
    assert [b["body"]["prompt"] for b in bodies if b["spec"] is None] == [ids[0], ids[0], ids[1]]


def test_bench_eagle3_method_takes_a_draft_gguf(saved, fake_build, tmp_path, monkeypatch):
    target, drafter = saved
    folder, log = fake_build()
    draft = tmp_path / "d.gguf"
    draft.write_bytes(b"GGUF")
    monkeypatch.setattr(llama_cpp, "target_gguf", lambda spec: draft)
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "t3 t4"}) + "\n")
    base = ["--target", target, "--prompts", str(tmp_path / "p.jsonl"), "--max-new-tokens", "4", "--set",
            f"llama_cpp={folder}", "--set", "warmup=0"]
    assert bench.main(base + ["--methods", "llama.cpp-eagle3", "--set", f"llama_cpp_draft={draft}"]) == 0
    argv = logged(log)[0]["argv"]
    assert argv[argv.index("-md") + 1] == str(draft) and argv[argv.index("--spec-type") + 1] == "draft-eagle3"
    # without --llama-cpp-draft our drafter is exported: an EAGLE-1/2 drafter cannot be
    assert bench.main(base + ["--methods", "llama.cpp-eagle3", "--drafter", drafter]) == 2


def test_bench_draft_method_serves_the_draft_models_gguf(saved, fake_build, tmp_path, monkeypatch, capsys):
    """llama.cpp-draft: ``-md`` the GGUF file --draft-model names (resolved like a target), ``--spec-type
    draft-simple`` and ``llama_cpp_draft_max`` as ``--spec-draft-n-max``; plain llama.cpp gets none of them, and
    the draft model is not loaded in this process (no sd)."""
    target, _ = saved
    folder, log = fake_build()
    files = {"target": tmp_path / "t.gguf", "qwen2.5-coder-0.5b-instruct": tmp_path / "d.gguf"}
    asked = []

    def gguf(spec, flag="--target"):
        asked.append((spec, flag))
        return files["target" if flag == "--target" else spec]

    monkeypatch.setattr(llama_cpp, "target_gguf", gguf)
    loaded = []
    real_load = bench.load_model
    monkeypatch.setattr(bench, "load_model", lambda a: loaded.append(a.draft_model) or real_load(a))
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "t3 t4"}) + "\n")
    report = tmp_path / "r.json"
    assert bench.main(["--target", target, "--prompts", str(tmp_path / "p.jsonl"), "--max-new-tokens", "4",
                       "--set", f"llama_cpp={folder}", "--set", "warmup=0", "--methods", "llama.cpp,llama.cpp-draft,ar",
                       "--draft-model", "qwen2.5-coder-0.5b-instruct", "--set", "llama_cpp_draft_max=8",
                       "--json", str(report)]) == 0
    _, err = capsys.readouterr()
    assert "--draft-model" not in err and loaded == [None]  # read by llama.cpp-draft, loaded by none of ours
    assert asked == [(target, "--target"), ("qwen2.5-coder-0.5b-instruct", "--draft-model")]
    argvs = {e["argv"][e["argv"].index("--spec-type") + 1] if "--spec-type" in e["argv"] else "none": e["argv"]
             for e in logged(log) if "argv" in e}
    draft = argvs["draft-simple"]
    assert draft[draft.index("-md") + 1] == str(files["qwen2.5-coder-0.5b-instruct"])
    assert draft[draft.index("--spec-draft-n-max") + 1] == "8"
    assert "-md" not in argvs["none"] and "--spec-draft-n-max" not in argvs["none"]
    data = json.loads(report.read_text())
    assert data["config"]["draft_model"] == "qwen2.5-coder-0.5b-instruct"
    assert data["methods"]["llama.cpp-draft"]["mean_accept_length"] == 2.0  # the fake accepts 2 of 4 tokens


def test_server_args_of_the_draft_methods(tmp_path):
    binary, model, draft = tmp_path / "llama-server", tmp_path / "t.gguf", tmp_path / "d.gguf"
    args = llama_cpp.server_args(binary, model, 8080, 2, "llama.cpp-draft", draft)
    assert args[args.index("-md") + 1] == str(draft) and args[-2:] == ["--spec-type", "draft-simple"]
    assert "--spec-draft-n-max" not in args  # llama.cpp's default
    args = llama_cpp.server_args(binary, model, 8080, 2, "llama.cpp-eagle3", draft, draft_max=16)
    assert args[args.index("--spec-draft-n-max") + 1] == "16" and args[-1] == "draft-eagle3"
    assert "-md" not in llama_cpp.server_args(binary, model, 8080, 2, "llama.cpp", draft, draft_max=4)
    with pytest.raises(EagleError, match="'llama.cpp-draft' needs a draft model"):
        llama_cpp.server_args(binary, model, 8080, 2, "llama.cpp-draft")


@pytest.mark.parametrize("args, message", [
    (["--methods", "llama.cpp"], "the llama.cpp methods need a llama.cpp build: pass --set llama_cpp=DIR"),
    (["--methods", "llama.cpp", "--set", "llama_cpp={tmp}/none"], "no llama.cpp build at {tmp}/none: no such folder"),
    (["--methods", "llama.cpp", "--set", "llama_cpp={tmp}"], "no llama-server in {tmp}"),
    (["--methods", "llama.cpp", "--set", "llama_cpp={build}"], "is a model folder, not a .gguf file"),
    (["--methods", "ar", "--set", "llama_cpp_draft=x.gguf"], "is not in --methods"),
    (["--methods", "llama.cpp-eagle3", "--set", "llama_cpp={build}", "--set", "llama_cpp_draft={tmp}"],
     "not an EAGLE-3 checkpoint"),
    (["--methods", "llama.cpp-draft", "--set", "llama_cpp={build}"], "method llama.cpp-draft needs --draft-model"),
    (["--methods", "llama.cpp,ar", "--set", "llama_cpp={build}", "--set", "llama_cpp_draft_max=4"],
     "llama_cpp_draft_max is for methods llama.cpp-draft and llama.cpp-eagle3"),
    (["--methods", "llama.cpp-draft", "--set", "llama_cpp={build}", "--set", "llama_cpp_draft_max=0"],
     "llama_cpp_draft_max must be"),
])
def test_bench_refuses_llama_cpp_problems_before_loading(saved, fake_build, tmp_path, monkeypatch, capsys, args,
                                                         message):
    folder, _ = fake_build()
    monkeypatch.delenv(llama_cpp.ENV, raising=False)
    monkeypatch.setattr(bench, "load_model", lambda a: pytest.fail("the model load was reached"))
    if "not a .gguf" not in message:  # past the target check (the tiny target is a folder)
        monkeypatch.setattr(llama_cpp, "target_gguf", lambda spec, flag="--target": tmp_path / "t.gguf")
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "t3"}) + "\n")
    fill = {"{tmp}": str(tmp_path), "{build}": str(folder)}
    args = [a.replace("{tmp}", fill["{tmp}"]).replace("{build}", fill["{build}"]) for a in args]
    message = message.replace("{tmp}", str(tmp_path))
    assert bench.main(["--target", saved[0], "--prompts", str(tmp_path / "p.jsonl"), *args]) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert out == "" and len(lines) == 1 and message in lines[0], err


# ---- the real build -----------------------------------------------------------------------------
REAL = Path(os.environ.get(llama_cpp.ENV) or ROOT / ".llama.cpp")


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.skipif(not (REAL / "build" / "bin" / "llama-server").is_file(), reason="no llama.cpp build")
def test_real_llama_cpp_matches_ar_with_a_random_eagle3_drafter(tmp_path):
    """The real llama-server: the check script (convert, serve, compare) and eagle-bench's llama.cpp
    methods, greedy output identical to ar's (a random drafter: drafts are rejected, output unchanged)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "llama_cpp_check.py"), "--drafter", "random",
                           "--llama-cpp", str(REAL), "-n", "2", "--max-tokens", "32"],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "EAGLE-3: target_layers = [2, 15, 27]" in proc.stdout and "2/2 prompts identical" in proc.stdout
    from eagle.runtime.target import converted_gguf_dir, smollm2_gguf_path

    cfg = json.loads((converted_gguf_dir(smollm2_gguf_path()) / "config.json").read_text())
    draft = llama_cpp.random_eagle3(cfg, tmp_path / "e3")
    report = tmp_path / "r.json"
    assert bench.main(["--prompts", str(ROOT / "benchmarks/prompts/dev.jsonl"), "--limit", "2", "--methods",
                       "ar,llama.cpp,llama.cpp-eagle3,llama.cpp-ngram", "--max-new-tokens", "32", "--set",
                       f"llama_cpp={REAL}", "--set", f"llama_cpp_draft={draft}", "--json", str(report)]) == 0
    methods = json.loads(report.read_text())["methods"]
    # llama.cpp's numerics differ from ours (activations rounded to 8 bits for the Q4_1 products): a near tie
    # can go the other way, so its tokens need not equal ar's; its speculative methods must equal its own
    for name in ("llama.cpp-eagle3", "llama.cpp-ngram"):
        assert methods[name]["identical_to_llama_cpp"] is True, name
        assert methods[name]["tokens_per_second"] > 0
    assert methods["llama.cpp"]["identical_share"] is not None


def real_server() -> Path | None:
    """The real build's llama-server (``build/bin`` or ``build-avx2/bin``), or None."""
    try:
        return llama_cpp.server_binary(REAL) if REAL.is_dir() else None
    except EagleError:
        return None


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.skipif(real_server() is None, reason="no llama.cpp build")
def test_real_llama_cpp_draft_method_with_the_target_as_its_own_draft(tmp_path):
    """The real llama-server with ``--model-draft``: the default target drafting for itself is accepted (mean
    accepted length well above 1) and greedy output stays llama.cpp's own."""
    report = tmp_path / "r.json"
    assert bench.main(["--prompts", str(ROOT / "benchmarks/prompts/dev.jsonl"), "--limit", "1", "--methods",
                       "llama.cpp,llama.cpp-draft", "--draft-model", "smollm2-135m-instruct", "--max-new-tokens", "24",
                       "--set", f"llama_cpp={REAL}", "--set", "llama_cpp_draft_max=4", "--set", "warmup=0",
                       "--json", str(report)]) == 0
    data = json.loads(report.read_text())
    assert "--spec-draft-n-max 4" in data["config"]["llama_cpp_servers"]["llama.cpp-draft"]
    methods = data["methods"]
    assert methods["llama.cpp-draft"]["identical_to_llama_cpp"] is True
    assert methods["llama.cpp-draft"]["mean_accept_length"] > 2.0
