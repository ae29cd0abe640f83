# Each target does its own set-up: a virtual environment in .venv with kvprof and its test extras.
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH ?= torch==2.13.0

.PHONY: setup test demo

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e '.[test]'
	touch $@

test: setup
	$(PY) -m pytest -q

# The whole pipeline on the tiny world built locally (until the trained demo world ships).
demo: setup
	$(PY) -m kvprof.tiny runs/tiny
	$(VENV)/bin/kvprof capture --model runs/tiny/model --workflow runs/tiny/workflow_lora.toml \
		--tasks runs/tiny/tasks.jsonl --out runs/capture
	$(VENV)/bin/kvprof rank-analysis runs/capture/trace.jsonl --out runs/rank
	$(VENV)/bin/kvprof replay runs/capture/trace.jsonl --out runs/replay
	$(VENV)/bin/kvprof report runs/capture/capture.json runs/rank/rank_analysis.json runs/replay/replay.json \
		--out runs/report.html
