# The two commands of the README's quick start:
#   make lab    create .venv if needed, then open the course in JupyterLab
#   make test   create .venv if needed, then run every notebook under nbval, build the website
#               from that run, and run the test suite and every lab (solutions and student
#               versions) under nbval
# Both are idempotent: the environment is rebuilt only when pyproject.toml changes.
# For clusters and workshops (workshop/README.md):
#   make install                 set up .venv and nothing else (no server, no tests)
#   make install WHEELHOUSE=DIR  the same from a folder of wheels, for nodes without internet
#   make wheelhouse WHEELHOUSE=DIR   fill that folder, on a machine with internet (same OS and Python)

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# torch is installed before the package so that its range (torch>=2.9) is already met, by
# scripts/install_torch.py: the CPU build when there is no NVIDIA GPU, an installed torch left
# alone, one line saying which. TORCH_INDEX (pip arguments) overrides the choice, e.g.
#   make test TORCH_INDEX=--index-url=https://download.pytorch.org/whl/cu128
TORCH       ?= torch>=2.9
TORCH_INDEX ?=
# A folder of wheels: pip reads it through its own variables and then never asks the network.
WHEELHOUSE  ?=
ifneq ($(strip $(WHEELHOUSE)),)
export PIP_NO_INDEX    := 1
export PIP_FIND_LINKS  := $(abspath $(WHEELHOUSE))
endif

.PHONY: install wheelhouse lab test lint figures site clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# jupyter/ holds JupyterLab settings for a quiet start (see jupyter/README.md); copied into the venv.
$(VENV)/.installed: pyproject.toml scripts/install_torch.py $(shell find jupyter -type f) | $(BIN)/python
	@$(BIN)/python scripts/install_torch.py --spec "$(TORCH)" --index "$(TORCH_INDEX)"
	$(BIN)/pip install -e ".[dev]"
	cp -R jupyter/etc jupyter/share $(VENV)/
	touch $@

# install_torch.py runs again even when .venv is up to date: a CPU build made on a login node
# is replaced here when this node has a GPU (make install inside a GPU job); --check then says
# whether this torch fits this node.
install: $(VENV)/.installed
	@$(BIN)/python scripts/install_torch.py --spec "$(TORCH)" --index "$(TORCH_INDEX)"
	@$(BIN)/python scripts/install_torch.py --check --home "$(CURDIR)"

# Run where the wheels are wanted (Linux, the Python the nodes have; a GPU node, or TORCH_INDEX
# naming a CUDA index, for the CUDA build). pip download fetches the course's dependencies and
# the build backend (setuptools), which an install without an index needs too.
wheelhouse: | $(BIN)/python
	@test -n "$(WHEELHOUSE)" || { echo "usage: make wheelhouse WHEELHOUSE=DIR"; exit 2; }
	env -u PIP_NO_INDEX -u PIP_FIND_LINKS $(BIN)/pip download -d "$(WHEELHOUSE)" $(TORCH_INDEX) "$(TORCH)"
	env -u PIP_NO_INDEX -u PIP_FIND_LINKS $(BIN)/pip download -d "$(WHEELHOUSE)" ".[dev]" "setuptools>=68" wheel

# Jupyter refuses to run as root (containers, cloud shells) unless told it may.
LAB_FLAGS ?= $(if $(filter 0,$(shell id -u)),--allow-root)

# The file browser shows the whole course (rooted here); notebook 00 opens first.
lab: $(VENV)/.installed
	$(BIN)/jupyter lab $(LAB_FLAGS) --ServerApp.root_dir="$(CURDIR)" \
		--LabApp.default_url=/lab/tree/notebooks/00_start_here.ipynb

# `make test`, in three steps, so that no notebook runs twice:
#   1. every notebook under nbval, with the website's settings (the widgets' plain-text fallback),
#      each executed copy kept for the site (website/nbval_copies.py's --site-copies);
#   2. the website from those copies (website/build.py reuses them: no notebook runs again);
#   3. the test suite (tests/test_site.py reads that site; tests/test_browser.py runs the widgets
#      in chromium) and every lab, solutions and student versions, under nbval.
# `make test NOTEBOOKS=` skips step 1 (step 2 then runs any notebook that changed).
# Step 3 runs on PYTEST_WORKERS processes (pytest-xdist; 0 = this process alone). Much of it waits
# (a deliberate hang that must time out, a SLURM job, a browser), so 3 processes on 2 cores finish
# sooner. --dist loadfile keeps each file on one process, in order: a notebook's cells share one
# kernel, and a module's fixtures run once. Step 1 stays on one process: a notebook's measured
# times must not share the cores. --durations lists step 3's slowest tests: where to look when CI nears its 25 minutes.
NOTEBOOKS ?= notebooks
LABS      ?= labs
PYTEST_WORKERS ?= 3
NBVAL_ARGS = --nbval-lax --nbval-cell-timeout=120

test: $(VENV)/.site-installed
	$(if $(strip $(NOTEBOOKS)),$(BIN)/python -m pytest $(NOTEBOOKS) $(NBVAL_ARGS) -p website.nbval_copies --site-copies=_build/executed/notebooks)
	$(BIN)/python website/build.py
	$(BIN)/python -m pytest tests $(LABS) $(NBVAL_ARGS) -n $(PYTEST_WORKERS) --dist loadfile --durations=20

lint: $(VENV)/.installed
	$(BIN)/ruff check .

figures: $(VENV)/.installed
	$(BIN)/python -m shardlab figures

# The course as a static website in _build/html (docs/site.md): every notebook executed once
# (reused while nothing it depends on changed), the labs' student versions, docs, workshop kit.
$(VENV)/.site-installed: $(VENV)/.installed
	$(BIN)/pip install -e ".[dev,site]"
	touch $@

site: $(VENV)/.site-installed
	$(BIN)/python website/build.py

clean:
	rm -rf $(VENV) .pytest_cache test-artifacts _build
