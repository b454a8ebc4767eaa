"""llama.cpp's EAGLE-3 path on our drafter: convert it with llama.cpp's own converter, run
``llama-server --spec-type draft-eagle3`` and a plain ``llama-server`` on the target's GGUF file, send
the first prompts of a prompt file through ``/v1/chat/completions`` (the GGUF's chat template, greedy)
and check that both answer the same text, token for token; print the acceptance llama.cpp reports.

    python scripts/llama_cpp_check.py [--drafter DIR|random] [--llama-cpp DIR] [--prompts FILE] [-n 8]

``--drafter``: our drafter folder (kind eagle3; exported with ``eagle-export --format eagle3``), a folder
already in the SpecForge EAGLE-3 layout, or ``random`` (random weights for the target: the pipeline
runs, drafts are rejected; output must still match). Default: the EAGLE-3 drafter shipped for the
target. Exit status 0 when every answer matches, 1 on a mismatch, 2 on an error."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from eagle.errors import EagleError  # noqa: E402
from infer import llama_cpp  # noqa: E402


def draft_folder(spec: str | None, target_hf: Path, work: Path) -> Path:
    """The drafter as an EAGLE-3 checkpoint folder the converter reads (see the module docstring)."""
    if spec == "random":
        cfg = json.loads((target_hf / "config.json").read_text())
        return llama_cpp.random_eagle3(cfg, work / "random-eagle3")
    if spec is None:
        from eagle.engine import shipped_drafter

        from eagle.inputs import DEFAULT_TARGET

        spec = str(shipped_drafter(DEFAULT_TARGET, "eagle3") or "")
        if not spec:
            raise EagleError("no drafter shipped for the target: pass --drafter DIR (or DRAFTER=DIR to make)")
    path = Path(spec).expanduser()
    if not path.is_dir():
        raise EagleError(f"--drafter {spec}: no such folder")
    if llama_cpp.is_eagle3_folder(path):
        return path
    from eagle.drafting.drafter import Drafter

    return llama_cpp.export_eagle3(Drafter.from_pretrained(path, device="cpu"), work / "eagle3")


def chat(server: llama_cpp.LlamaServer, prompt: str, max_tokens: int) -> dict:
    body = dict(messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0.0, top_k=0,
                top_p=1.0, min_p=0.0, cache_prompt=False)
    answer = server.post("/v1/chat/completions", body)
    try:
        return dict(text=answer["choices"][0]["message"]["content"], timings=answer["timings"])
    except (KeyError, IndexError, TypeError):
        raise EagleError(f"unexpected /v1/chat/completions answer: {str(answer)[:200]}") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drafter", help="drafter folder (ours or SpecForge EAGLE-3 layout) or 'random'")
    parser.add_argument("--llama-cpp", default=str(ROOT / ".llama.cpp"), help="build folder (default .llama.cpp)")
    parser.add_argument("--target", default="smollm2-135m-instruct", help="the target (a .gguf or the default)")
    parser.add_argument("--prompts", default=str(ROOT / "benchmarks/prompts/dev.jsonl"))
    parser.add_argument("-n", "--num-prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    try:
        return check(args)
    except EagleError as exc:
        print(f"llama_cpp_check: error: {exc}", file=sys.stderr)
        return 2


def check(args: argparse.Namespace) -> int:
    from eagle.prompts import read_prompts
    from eagle.runtime.target import converted_gguf_dir

    folder = llama_cpp.build_folder(args.llama_cpp)
    binary = llama_cpp.server_binary(folder)
    gguf = llama_cpp.target_gguf(args.target)
    prompts = [p["prompt"] for p in read_prompts(args.prompts)][: args.num_prompts]
    target_hf = converted_gguf_dir(gguf)  # config.json and tokenizer files for the converter
    with ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="llama-cpp-check-")))
        source = draft_folder(args.drafter, target_hf, work)
        draft, lines = llama_cpp.convert_draft(folder, source, target_hf, work / "draft.gguf")
        for line in lines:
            print(f"convert_hf_to_gguf: {line.strip()}")
        servers = {}
        for method in ("llama.cpp", "llama.cpp-eagle3"):
            server = llama_cpp.LlamaServer(binary, gguf, args.threads, method, draft, log=work / f"{method}.log")
            stack.callback(server.close)
            servers[method] = server.start()
        print(f"llama-server: {llama_cpp.version(folder, binary)}; draft: {source}")
        for server in servers.values():  # warm-up, not compared
            chat(server, prompts[0], 8)
        mismatches, drafted, accepted, tokens = 0, 0, 0, 0
        for i, prompt in enumerate(prompts):
            plain = chat(servers["llama.cpp"], prompt, args.max_tokens)
            spec = chat(servers["llama.cpp-eagle3"], prompt, args.max_tokens)
            same = plain["text"] == spec["text"]
            mismatches += not same
            t = spec["timings"]
            drafted += t.get("draft_n", 0)
            accepted += t.get("draft_n_accepted", 0)
            tokens += t.get("predicted_n", 0)
            print(f"prompt {i}: {'same' if same else 'DIFFERENT'}; {t.get('predicted_n')} tokens, draft_n "
                  f"{t.get('draft_n', 0)}, draft_n_accepted {t.get('draft_n_accepted', 0)}; "
                  f"{t.get('predicted_per_second', 0):.1f} vs plain "
                  f"{plain['timings'].get('predicted_per_second', 0):.1f} decode tokens/s")
            if not same:
                print(f"  plain:  {plain['text'][:160]!r}\n  eagle3: {spec['text'][:160]!r}")
    rate = accepted / drafted if drafted else 0.0
    accept_length = tokens / max(1, tokens - accepted)
    print(f"{len(prompts) - mismatches}/{len(prompts)} prompts identical with and without the drafter; drafted "
          f"{drafted}, accepted {accepted} ({rate:.3f}); mean accepted length {accept_length:.2f} "
          f"(new tokens / target forwards)")
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
