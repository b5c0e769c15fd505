# Two entry points for a fresh machine: `make demo` and `make test`. Both install what they need
# into .venv (torch pinned to the 2.13.0 CPU wheel for development; users need torch>=2.4).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
DEMO_DIR ?= build/demo
TP ?= 2

.PHONY: install lint demo test test-reliability test-kernels conformance test-engine test-engine-ci engine-venv bench clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	touch $@

install: $(BIN)/.installed

# The `lint` extra (ruff, mypy and the stubs mypy needs, pinned), installed again when
# pyproject.toml changes.
$(BIN)/.lint-installed: $(BIN)/.installed pyproject.toml
	$(BIN)/pip install -q -e '.[lint]'
	touch $@

# ruff with the rule set in pyproject.toml, then mypy on the package with the settings there
# (run in .venv, so that it sees the types torch, safetensors, click and rich ship)
lint: $(BIN)/.lint-installed
	$(BIN)/python -m ruff check wna16ctl tests bench scripts
	$(BIN)/python -m mypy

# The main job on the embedded default: a Qwen3-MoE W4A16 demo checkpoint written by
# compressed-tensors, inspected, repacked for TP=$(TP), and verified.
demo: $(BIN)/.installed
	$(BIN)/wna16ctl demo $(DEMO_DIR)/ckpt --force
	@# exit 1 = "does not load at some TP size" (expected for TP 4 here); 2 would be bad input
	$(BIN)/wna16ctl inspect $(DEMO_DIR)/ckpt --tp 1,2,4; test $$? -le 1
	$(BIN)/wna16ctl repack $(DEMO_DIR)/ckpt --tp $(TP) -o $(DEMO_DIR)/tp$(TP) --force
	$(BIN)/wna16ctl verify $(DEMO_DIR)/ckpt $(DEMO_DIR)/tp$(TP)

# One test process per core, up to 4 (files stay whole on one worker, so module fixtures are built
# once): most tests are single-threaded (one torch thread, subprocess start-up, fsync, a kernel
# emulation whose threads take turns), so a single process would leave the other cores mostly idle.
# TEST_WORKERS=0 runs everything in one process.
TEST_WORKERS ?= logical
test: $(BIN)/.installed
	$(BIN)/python -m pytest -q -rs -n $(TEST_WORKERS) --maxprocesses 4 --dist loadfile

# The reliability tests' long tiers: `repack` stopped by Ctrl-C in a terminal at 200 seeded
# random moments on a larger checkpoint, each checked for exit 130 (or 0), one line, no crash or
# hang, and a byte-identical `--resume` (`make test` runs a 12-moment slice; ~10 min on 2 busy cores).
# WNA16CTL_CTRL_C_SEED and WNA16CTL_CTRL_C_TRIALS pick other moments.
test-reliability: $(BIN)/.installed
	$(BIN)/python -m pytest -q -rs -s -m reliability tests/test_reliability.py

# The kernels in depth: every GEMM mutant must be caught by the emulated tests (each one a
# recompile of the GEMM source; `make test` runs two of them), the whole v3 grid and v3's nvcc
# spill check, then how many of the plain and ThreadSanitizer cases catch each mutant (exit 1 if
# one survives).
test-kernels: $(BIN)/.installed
	$(BIN)/python -m pytest -q -rs -m 'mutants or not mutants' tests/native/test_emu_mutants.py
	$(BIN)/python -m pytest -q -rs -m 'kernels or not kernels' tests/native/test_emu_gemm_v3.py
	WNA16CTL_NVCC_TESTS=1 $(BIN)/python -m pytest -q -rs -m kernels tests/native/test_kernels.py
	$(BIN)/python -m pytest -q -rs -m kernels tests/test_roofline.py
	$(BIN)/python -m tests.emu.mutation

# The planner against the real decision code of every supported vLLM release (fetches each
# release's sources once into ~/.cache/wna16ctl; `make test` runs only the oldest and newest).
# It includes the `repack --layout vllm` key contract of every release x architecture, built
# by vLLM's model code in the engine venv (`make engine-venv`; skipped with one line without
# it; minutes per release on a 2-core machine, so not part of `make test`).  Then each
# release's own model classes are built on the meta device for the real configs, the
# adversarial fixtures and sampled cases, on sm80/sm90/sm100, and compared with inspect's plan:
# one count line per release x GPU (exit 1 on an unexplained disagreement; `make test` runs a
# slice of it, tests/conformance/test_model_build.py).
CONFORMANCE_EXAMPLES ?= 2000
CONFORMANCE_MODEL_RELEASES ?= all
CONFORMANCE_MODEL_SAMPLED ?= 40
conformance: $(BIN)/.installed
	WNA16CTL_CONFORMANCE_RELEASES=all WNA16CTL_CONFORMANCE_EXAMPLES=$(CONFORMANCE_EXAMPLES) \
		$(BIN)/python -m pytest -q -rs -m conformance tests/conformance
	$(BIN)/python -m tests.conformance.model_build --releases $(CONFORMANCE_MODEL_RELEASES) \
		--gpus sm80,sm90,sm100 --sampled $(CONFORMANCE_MODEL_SAMPLED)

# The optional engine tier: vLLM's CPU build in its own venv (it pins its own torch, the same
# 2.13.0 CPU wheel), used by tests marked `engine`: greedy tokens of a real engine, `repack
# --layout vllm` served with load_format="sharded_state" against a normal load (TP 1 and 2), and
# the vllm layout's key contract against vLLM's model code on the meta device.  On a CPU without
# AMX the tests switch vLLM to its EMULATION MoE backend through tests/engine_hooks (test-only).
# Tens of minutes on a 2-core machine: not part of `make test`.
ENGINE_VENV ?= build/engine-venv
$(ENGINE_VENV)/bin/.installed: scripts/engine-requirements.txt
	scripts/engine_venv.sh $(abspath $(ENGINE_VENV)) >/dev/null

engine-venv: $(ENGINE_VENV)/bin/.installed

test-engine: $(BIN)/.installed $(ENGINE_VENV)/bin/.installed
	WNA16CTL_ENGINE_PYTHON=$(abspath $(ENGINE_VENV))/bin/python $(BIN)/python -m pytest -q -rs -m engine

# The engine tier of CI (.ci/run): the tests marked `engine_ci` (repack --layout vllm --tp 2 of the
# Qwen3-MoE demo served with load_format="sharded_state" against a normal load, the key contract
# against vLLM's own state, the same with --ep, and vLLM's own saved state not loading back) in the engine venv cached
# under ~/.cache/wna16ctl (rebuilt when scripts/engine-requirements.txt changes); skipped with one
# line when that venv has to be built and the package registry cannot be reached.
test-engine-ci: $(BIN)/.installed
	scripts/engine_tier.sh $(BIN)/python

bench: $(BIN)/.installed
	$(BIN)/python bench/run_all.py

clean:
	rm -rf build .pytest_cache .mypy_cache
