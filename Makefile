# The two commands a new user runs (both set up .venv on first use and are idempotent):
#   make demo   run the main job on the embedded tiny target
#   make test   run the test suite
# TORCH is what is installed before the package: the pinned CPU build by default. GPU machines: install
# the torch build for your CUDA into .venv first, then `make demo TORCH=` (installs no torch).
# Where PyPI's default torch wheel is a CUDA build, ask for the CPU one:
#   make test TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"

PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.mtp-train-installed
RUN_DIR ?= runs/demo

.PHONY: setup demo test assets clean-runs

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(if $(TORCH),$(BIN)/python -m pip install --quiet $(TORCH))
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	touch $@

demo: $(STAMP)
	$(BIN)/mtp-train info recipe=tiny run_dir=$(RUN_DIR)
	$(BIN)/mtp-train prepare recipe=tiny run_dir=$(RUN_DIR)
	$(BIN)/mtp-train precompute recipe=tiny run_dir=$(RUN_DIR)
	$(BIN)/mtp-train train recipe=tiny run_dir=$(RUN_DIR) resume=true
	$(BIN)/mtp-train validate recipe=tiny run_dir=$(RUN_DIR)
	$(BIN)/mtp-train export recipe=tiny run_dir=$(RUN_DIR)

test: $(STAMP)
	$(BIN)/python -m pytest -q

# Rebuild the embedded tiny target, draft and tokenizer (about 40 minutes on 2 CPU cores).
assets: $(STAMP)
	$(BIN)/python data_prep/build_tiny_assets.py

clean-runs:
	rm -rf runs
