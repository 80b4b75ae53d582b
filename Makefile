# The two commands of the README's quick start:
#   make lab    create .venv if needed, then open the course in JupyterLab
#   make test   create .venv if needed, then run the test suite and every notebook and lab
#               (solutions and student versions) under nbval
# Both are idempotent: the environment is rebuilt only when pyproject.toml changes.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# torch is installed before the package so that its range (torch>=2.9) is already met.
# On a Linux laptop without a GPU, keep the CPU wheel small with:
#   make test TORCH_INDEX=--index-url=https://download.pytorch.org/whl/cpu
TORCH       ?= torch>=2.9
TORCH_INDEX ?=

.PHONY: lab test lint figures clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install $(TORCH_INDEX) "$(TORCH)"
	$(BIN)/pip install -e ".[dev]"
	touch $@

# Jupyter refuses to run as root (containers, cloud shells) unless told it may.
LAB_FLAGS ?= $(if $(filter 0,$(shell id -u)),--allow-root)

lab: $(VENV)/.installed
	$(BIN)/jupyter lab $(LAB_FLAGS) notebooks/00_start_here.ipynb

test: $(VENV)/.installed
	$(BIN)/python -m pytest tests notebooks labs --nbval-lax --nbval-cell-timeout=120

lint: $(VENV)/.installed
	$(BIN)/ruff check .

figures: $(VENV)/.installed
	$(BIN)/python -m shardlab figures

clean:
	rm -rf $(VENV) .pytest_cache
