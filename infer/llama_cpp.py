"""llama.cpp's ``llama-server`` as decoding methods beside ours: ``llama.cpp`` (plain decoding),
``llama.cpp-draft`` (a draft model's GGUF file, ``--spec-type draft-simple``), ``llama.cpp-eagle3`` (an
EAGLE-3 drafter converted to GGUF, ``--spec-type draft-eagle3``) and ``llama.cpp-ngram``
(``--spec-type ngram-simple``), all on the target's own GGUF file.

The build folder is what ``scripts/llama_cpp.sh build`` makes: ``build/bin/llama-server`` (its
libraries beside it), the sources in ``src/`` (``convert_hf_to_gguf.py``) and ``pylib/`` (sentencepiece
for the converter). A folder that holds ``llama-server`` itself works too, without the converter.

A prompt goes to ``/completion`` as token ids (the ids our chat template makes, so both sides decode
the same sequence) with ``return_tokens``, so the tokens compared with ``ar`` are the server's own
ids; the prompt cache is off (every request prefills its whole prompt, as ours do).
Accepted length: the server reports ``draft_n`` (tokens drafted) and ``draft_n_accepted`` over a
request; every target forward that yields tokens (the prompt's, then one per decoding step) yields
one token of its own plus the drafts it accepted, so forwards = new tokens - accepted drafts and the
mean accepted length is new tokens / forwards (1.0 without drafts), the same count as ours (bonus
included). The per-step distribution is not reported, so such records carry no accepted-length list."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from eagle.errors import EagleError

METHODS = ("llama.cpp", "llama.cpp-draft", "llama.cpp-eagle3", "llama.cpp-ngram")
SPEC_ARGS = {"llama.cpp": [], "llama.cpp-draft": ["--spec-type", "draft-simple"],
             "llama.cpp-eagle3": ["--spec-type", "draft-eagle3"], "llama.cpp-ngram": ["--spec-type", "ngram-simple"]}
DRAFT_METHODS = ("llama.cpp-draft", "llama.cpp-eagle3")  # the methods with a draft GGUF (``-md``)
ENV = "EAGLE_LLAMA_CPP"
BUILD_HINT = "scripts/llama_cpp.sh build makes one in .llama.cpp"
CONTEXT = 4096  # tokens of KV cache per server: a bench prompt plus its new tokens fit
STARTUP_S = 120.0  # how long a server may take to load and answer /health


# ---- locating the build --------------------------------------------------------------------
def build_folder(given: str | None) -> Path:
    """The llama.cpp build folder from config key ``llama_cpp`` or else ``$EAGLE_LLAMA_CPP``."""
    value = given or os.environ.get(ENV)
    if not value:
        raise EagleError(f"the llama.cpp methods need a llama.cpp build: pass --set llama_cpp=DIR or set {ENV} "
                         f"({BUILD_HINT})")
    path = Path(value).expanduser()
    if not path.is_dir():
        raise EagleError(f"no llama.cpp build at {value}: no such folder ({BUILD_HINT})")
    return path


def cpu_has_avx512f() -> bool:
    """Whether this CPU lists AVX-512F (``/proc/cpuinfo``; False where it cannot be read)."""
    try:
        return re.search(r"\bavx512f\b", Path("/proc/cpuinfo").read_text()) is not None
    except OSError:
        return False


def server_binary(folder: Path, name: str = "llama-server") -> Path:
    """``name`` in the build folder: ``build/bin/`` (the AVX-512 build of ``scripts/llama_cpp.sh``) or
    ``build-avx2/bin/``, the one this CPU runs best first, else ``bin/`` or the folder itself."""
    builds = ("build/bin", "build-avx2/bin") if cpu_has_avx512f() else ("build-avx2/bin", "build/bin")
    for sub in builds + ("bin", "."):
        path = folder / sub / name
        if path.is_file():
            if not os.access(path, os.X_OK):
                raise EagleError(f"{path} is not executable")
            return path
    raise EagleError(f"no {name} in {folder} (looked in {', '.join(builds)}, bin and the folder itself; {BUILD_HINT})")


def converter(folder: Path) -> Path:
    """llama.cpp's ``convert_hf_to_gguf.py`` in the build folder (``src/`` or the folder itself)."""
    for sub in ("src", "."):
        path = folder / sub / "convert_hf_to_gguf.py"
        if path.is_file():
            return path
    raise EagleError(f"no convert_hf_to_gguf.py in {folder} (nor in {folder / 'src'}): give the draft as a .gguf "
                     f"file with llama_cpp_draft, or use a folder made by scripts/llama_cpp.sh build")


def target_gguf(spec: str, flag: str = "--target") -> Path:
    """The GGUF file of a model spec given as ``flag`` (the default target's, a named target's, or a .gguf
    path); others are refused."""
    from eagle.inputs import check_spec
    from eagle.runtime.target import spec_gguf

    path = spec_gguf(spec)
    if path is not None:
        return path
    kind = check_spec(spec)
    what = "the target's" if flag == "--target" else "the draft model's"
    raise EagleError(f"the llama.cpp methods run llama-server on {what} GGUF file; {flag} {spec} is a "
                     f"{'model folder' if kind == 'folder' else 'hub id'}, not a .gguf file")


# ---- the draft model -------------------------------------------------------------------------
def convert_draft(folder: Path, draft_dir: Path, target_hf_dir: Path, out: Path,
                  python: str = sys.executable) -> tuple[Path, list[str]]:
    """An EAGLE-3 checkpoint folder (SpecForge or speculators layout) -> ``out`` (.gguf) with llama.cpp's
    converter, which takes the tokenizer from ``target_hf_dir`` (config.json + tokenizer files).
    Returns (out, the converter's ``EAGLE-3:`` log lines)."""
    script = converter(folder)
    env = dict(os.environ)
    pylib = folder / "pylib"
    if pylib.is_dir():  # sentencepiece, imported by the converter whether used or not
        env["PYTHONPATH"] = os.pathsep.join([str(pylib)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    cmd = [python, str(script), str(draft_dir), "--target-model-dir", str(target_hf_dir), "--outfile", str(out),
           "--outtype", "f32"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = (proc.stdout + proc.stderr).splitlines()
    if proc.returncode != 0 or not out.is_file():
        tail = " | ".join(line.strip() for line in lines[-3:])
        raise EagleError(f"converting the EAGLE-3 drafter {draft_dir} to GGUF failed (exit {proc.returncode}): {tail}")
    return out, [line for line in lines if "EAGLE-3" in line]


def export_eagle3(drafter: Any, out_dir: Path) -> Path:
    """Our EAGLE-3 drafter in the layout llama.cpp's converter reads (``eagle-export --format eagle3``)."""
    from eagle.drafting import checkpoint_formats

    if getattr(drafter, "config", None) is None or drafter.config.kind != "eagle3":
        kind = getattr(getattr(drafter, "config", None), "kind", None)
        raise EagleError(f"method 'llama.cpp-eagle3' needs an EAGLE-3 drafter (kind 'eagle3'), got "
                         f"{'none' if kind is None else repr(kind)}: pass --drafter an eagle3 drafter or "
                         f"--set llama_cpp_draft=FILE.gguf")
    if "eagle3" not in checkpoint_formats.EXPORT_FORMATS:
        raise EagleError("this version cannot export an EAGLE-3 drafter for llama.cpp (no eagle-export --format "
                         "eagle3): pass --set llama_cpp_draft=PATH (a .gguf, or a folder in the SpecForge EAGLE-3 layout)")
    return checkpoint_formats.export_drafter(drafter, out_dir, "eagle3")


def random_eagle3(target_config: dict, out: Path, aux_layers: list[int] | None = None, draft_vocab_size: int = 8192,
                  seed: int = 0) -> Path:
    """A random-weight EAGLE-3 drafter for a Llama-style target (its config.json as a dict) in the
    SpecForge layout (``LlamaForCausalLMEagle3``: ``fc.weight`` [H, 3H], ``midlayer.*`` with q/k/v over
    2H, ``norm``, ``lm_head`` [Vd, H], ``d2t`` offsets, ``t2d`` mask), written to ``out``: a pipeline
    check, whose drafts are (almost) never accepted. ``aux_layers``: in the config's convention (the
    inputs of those target layers; default 2, L/2, L-3)."""
    import torch
    from safetensors.torch import save_file

    h, layers, vocab = target_config["hidden_size"], target_config["num_hidden_layers"], target_config["vocab_size"]
    heads, kv = target_config["num_attention_heads"], target_config.get("num_key_value_heads") or target_config["num_attention_heads"]
    d = target_config.get("head_dim") or h // heads
    ff = target_config["intermediate_size"]
    dv = min(draft_vocab_size, vocab)
    aux = list(aux_layers) if aux_layers is not None else [2, layers // 2, layers - 3]
    g = torch.Generator().manual_seed(seed)

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.02

    draft_ids = torch.randperm(vocab, generator=g)[:dv].sort().values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[draft_ids] = True
    state = {"fc.weight": w(h, len(aux) * h), "norm.weight": torch.ones(h), "lm_head.weight": w(dv, h),
             "d2t": draft_ids - torch.arange(dv), "t2d": t2d,
             "midlayer.input_layernorm.weight": torch.ones(h), "midlayer.hidden_norm.weight": torch.ones(h),
             "midlayer.post_attention_layernorm.weight": torch.ones(h),
             "midlayer.self_attn.q_proj.weight": w(heads * d, 2 * h),
             "midlayer.self_attn.k_proj.weight": w(kv * d, 2 * h),
             "midlayer.self_attn.v_proj.weight": w(kv * d, 2 * h),
             "midlayer.self_attn.o_proj.weight": w(h, heads * d),
             "midlayer.mlp.gate_proj.weight": w(ff, h), "midlayer.mlp.up_proj.weight": w(ff, h),
             "midlayer.mlp.down_proj.weight": w(h, ff)}
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": h,
              "intermediate_size": ff, "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": d,
              "num_hidden_layers": 1, "hidden_act": "silu", "rms_norm_eps": target_config.get("rms_norm_eps", 1e-5),
              "rope_theta": target_config.get("rope_theta") or (target_config.get("rope_parameters") or {}).get(
                  "rope_theta", 10000.0),
              "max_position_embeddings": target_config.get("max_position_embeddings", 8192), "vocab_size": vocab,
              "draft_vocab_size": dv, "target_hidden_size": h, "tie_word_embeddings": False, "torch_dtype": "float32",
              "eagle_config": {"eagle_aux_hidden_state_layer_ids": aux}}
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def is_eagle3_folder(path: Path) -> bool:
    """A folder with an EAGLE-3 checkpoint's config.json (one layer and ``draft_vocab_size``, as the
    converter detects it)."""
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(cfg, dict) and "draft_vocab_size" in cfg and cfg.get("num_hidden_layers") == 1


# ---- the server ------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_args(binary: Path, model: Path, port: int, threads: int, method: str = "llama.cpp",
                draft: Path | None = None, context: int = CONTEXT, draft_max: int | None = None) -> list[str]:
    """The ``llama-server`` command line for one method: one slot, no prompt cache, ``threads`` for
    prompt and generation (the draft model takes the same), no web UI. A ``DRAFT_METHODS`` method drafts
    with the GGUF ``draft``, at most ``draft_max`` tokens a step (``--spec-draft-n-max``; None: llama.cpp's
    default), its other draft settings llama.cpp's defaults."""
    args = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
            "-tb", str(threads), "-c", str(context), "-np", "1", "--cache-ram", "0", "--no-webui"]
    if method in DRAFT_METHODS:
        if draft is None:
            raise EagleError(f"method {method!r} needs a draft model")
        args += ["-md", str(draft)] + ([] if draft_max is None else ["--spec-draft-n-max", str(draft_max)])
    return args + SPEC_ARGS[method]


class LlamaServer:
    """One ``llama-server`` process on a free local port; its log goes to ``log``. ``start()`` returns
    once ``/health`` answers 200, or raises an ``EagleError`` with the end of the log."""

    def __init__(self, binary: Path, model: Path, threads: int, method: str = "llama.cpp",
                 draft: Path | None = None, log: Path | None = None, startup_s: float | None = None,
                 draft_max: int | None = None) -> None:
        self.port = free_port()
        self.method = method
        self.args = server_args(binary, model, self.port, threads, method, draft, draft_max=draft_max)
        self.log = log or Path(os.devnull)
        self.startup_s = STARTUP_S if startup_s is None else startup_s
        self.proc: subprocess.Popen | None = None
        self.env = dict(os.environ)
        libs = str(binary.parent)
        self.env["LD_LIBRARY_PATH"] = os.pathsep.join(
            [libs] + ([self.env["LD_LIBRARY_PATH"]] if self.env.get("LD_LIBRARY_PATH") else []))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, n: int = 3) -> str:
        try:
            lines = [x.strip() for x in self.log.read_text(errors="replace").splitlines() if x.strip()]
        except OSError:
            return ""
        return " | ".join(lines[-n:])

    def start(self) -> "LlamaServer":
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=self.env, preexec_fn=_die_with_parent)
        deadline = time.monotonic() + self.startup_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise EagleError(f"llama-server for {self.method} exited with code {self.proc.returncode} before it "
                                 f"came up: {self.log_tail() or 'no log'}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.2)
        self.close()
        raise EagleError(f"llama-server for {self.method} did not come up within {self.startup_s:.0f} s: "
                         f"{self.log_tail() or 'no log'}")

    def post(self, path: str, body: dict, timeout: float = 600.0) -> dict:
        """POST JSON, return the JSON answer; a failure is an ``EagleError``."""
        request = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as exc:
            raise EagleError(f"llama-server ({self.method}) answered {path} with HTTP {exc.code}: "
                             f"{exc.read()[:300].decode(errors='replace')}") from None
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise EagleError(f"llama-server ({self.method}) failed on {path}: {exc}") from None

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def __enter__(self) -> "LlamaServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _die_with_parent() -> None:
    """In the child before exec (Linux): SIGTERM when the process that started it dies, so a killed
    bench leaves no server behind."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


# ---- requests and records (pure) -------------------------------------------------------------
def completion_body(ids: list[int], max_new_tokens: int, temperature: float, top_p: float = 1.0, top_k: int = 0,
                    seed: int | None = None) -> dict:
    """A ``/completion`` request for token ids: greedy at temperature 0, else plain temperature / top-p /
    top-k sampling (llama.cpp's other samplers, on by default, off: min-p 0.05, its top-k 40)."""
    body: dict[str, Any] = dict(prompt=list(ids), n_predict=max_new_tokens, temperature=temperature,
                                top_k=top_k, top_p=top_p, min_p=0.0, typical_p=1.0, repeat_penalty=1.0,
                                cache_prompt=False, return_tokens=True, stream=False)
    if seed is not None:
        body["seed"] = seed
    return body


def record(answer: dict, seconds: float) -> dict:
    """A ``/completion`` answer and the request's wall time -> a bench record (see ``summarize``):
    ``token_ids`` (the server's ids, an EOS that ended generation included), ``steps`` target forwards
    that yielded tokens, ``accept_lengths`` (all 1 when nothing was drafted, else None: not reported),
    ``prefill_s`` and ``decode_seconds`` from the server's ``timings``, ``draft_tokens``/``draft_accepted``."""
    tokens = answer.get("tokens")
    timings = answer.get("timings")
    if not isinstance(tokens, list) or not isinstance(timings, dict):
        raise EagleError("llama-server's /completion answer has no 'tokens' or 'timings' (a llama.cpp too old for "
                         "return_tokens?)")
    tokens = [int(t) for t in tokens]
    drafted = int(timings.get("draft_n", 0))
    accepted = min(int(timings.get("draft_n_accepted", 0)), max(0, len(tokens) - 1))
    steps = len(tokens) - accepted
    return dict(new_tokens=len(tokens), seconds=seconds, accept_lengths=None if drafted else [1] * len(tokens),
                steps=steps, target_forwards=steps, token_ids=tokens, step_seconds=None,
                prefill_s=float(timings.get("prompt_ms", 0.0)) / 1000,
                decode_seconds=float(timings.get("predicted_ms", 0.0)) / 1000,
                draft_tokens=drafted, draft_accepted=accepted)


def run(server: LlamaServer, ids: list[int], max_new_tokens: int, temperature: float, top_p: float, top_k: int,
        seed: int | None) -> dict:
    """One request, timed from the outside like ours (prompt + generation wall time)."""
    body = completion_body(ids, max_new_tokens, temperature, top_p, top_k, seed)
    start = time.perf_counter()
    answer = server.post("/completion", body)
    return record(answer, time.perf_counter() - start)


def version(folder: Path, binary: Path) -> str:
    """Which llama.cpp: the sdist named in the build folder's ``VERSION`` (scripts/llama_cpp.sh writes it),
    else ``llama-server --version``'s line, or ''."""
    try:
        return (folder / "VERSION").read_text().strip()
    except OSError:
        pass
    env = dict(os.environ, LD_LIBRARY_PATH=str(binary.parent))
    try:
        proc = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30, env=env)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    match = re.search(r"version: .*", proc.stdout + proc.stderr)
    return match.group(0).strip() if match else ""
