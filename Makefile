# Two commands on a fresh machine (see README):  make main   and   make test
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
export PREFECT_SERVER_ANALYTICS_ENABLED ?= false
export DO_NOT_TRACK ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: lint typecheck setup test test-fast main smoke-all clean install-offline gpu-check gpu-speed docs

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	# CPU torch first: nothing later may pull a CUDA build. (Not --no-compile: where PYTHONDONTWRITEBYTECODE is set,
	# as on our CI machines, every process would then compile every module it imports; measured: pytest 1,469 s.)
	$(PIP) install -q torch==2.13.0
	# The rest with uv (35 s where pip takes 147 s, measured on a clean clone with a cold uv cache; the same 214
	# packages at the same versions as pip resolves): uv keeps the installed torch, which satisfies the project's
	# pin. Bytecode compiled at install as pip does. Where uv cannot reach the index (pip configured for a mirror
	# uv does not read), pip does it.
	$(PIP) install -q 'uv==0.13.*'
	# The editable install as a plain path line (editable_mode=compat: the checkout's root on sys.path, where cse/ links
	# every layer), not setuptools' import hook, which editors and type checkers do not run.
	$(VENV)/bin/uv pip install -q --python $(PY) --compile-bytecode --config-settings editable_mode=compat -e '.[test,minilm,docs]' \
	  || { echo "uv could not install the project: pip instead" >&2; $(PIP) install -q --config-settings editable_mode=compat -e '.[test,minilm,docs]'; }
	touch $@

setup: $(VENV)/.installed

# The docs site first (mkdocs build --strict: a broken link or a docstring that disagrees with its signature fails it),
# into a temporary folder, then the suite in two pytest processes at once: the tests marked `beside` (BESIDE_FILES in
# tests/conftest.py: they drive servers, workers and ranks and mostly wait on them) and the rest, which alone keeps
# about one of two cores busy. The `beside` output follows the suite's; either one failing fails `make test`; an
# interrupted `make test` interrupts it with SIGINT (its tests' teardowns stop the servers they started). Both with
# one intra-op thread (and the processes they start): two processes of two OpenMP threads each spin against each other
# on 2 cores (measured: the MiniLM parity pass took 212 s beside `cse run`'s test instead of 61 s alone).
PYTEST := HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(PY) -m pytest
LANE := OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
# mypy (make typecheck) runs first in the `beside` lane, whose tests mostly wait: the two lanes still end about
# together (measured on a clean clone: mypy's cold run took about 100 s of the critical path when it ran before both).
test: setup lint
	@d=$$(mktemp -d) && trap 'rm -rf "$$d"' EXIT && NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet -d "$$d"
	@log=$$(mktemp) && trap 'kill -INT $$beside 2>/dev/null; rm -f "$$log"' EXIT INT TERM; \
	sh -c '$(VENV)/bin/mypy && exec env $(LANE) $(PYTEST) -q -p no:cacheprovider -m beside' >"$$log" 2>&1 & beside=$$!; \
	$(LANE) $(PYTEST) -q -m "not beside"; suite=$$?; \
	wait $$beside; rc=$$?; beside=; echo "--- mypy, then the tests marked beside (run at the same time):"; cat "$$log"; \
	exit $$(( suite != 0 ? suite : rc ))

# Ruff: lint (rules and their reasons in pyproject.toml) and formatting, on the whole tree.
lint: setup
	$(VENV)/bin/ruff check --quiet .
	$(VENV)/bin/ruff format --check --quiet .

# mypy over the package cse ([tool.mypy] in pyproject.toml: the settings, the untyped packages and the layers that
# must annotate every def).
typecheck: setup
	$(VENV)/bin/mypy

# The edit-run loop: every test but the end-to-end ones (marked slow: flows, ops, reliability, real MiniLM runs).
test-fast: setup
	$(PYTEST) -q -m "not slow"

# The documentation site (docs/, mkdocs.yml) into site/; `mkdocs serve` previews it.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

main: setup
	bash scripts/main_job.sh

smoke-all: setup
	bash scripts/smoke_all.sh

# Air-gapped GPU node (README "Air-gapped GPU nodes"): a venv over the node's own Python and its packages (so its
# CUDA torch and other packages stay as they are), the plan's wheels from WHEELHOUSE (never torch), then the
# project itself, all with --no-index. NODE_PYTHON is the interpreter that holds the CUDA torch.
NODE_PYTHON ?= python3
SUBSET ?= train
install-offline:
	@test -n "$(WHEELHOUSE)" || { echo "usage: make install-offline WHEELHOUSE=DIR [NODE_PYTHON=python3] [SUBSET=train|full]"; exit 2; }
	@test -d "$(WHEELHOUSE)" || { echo "install-offline: WHEELHOUSE=$(WHEELHOUSE) is not a folder"; exit 2; }
	$(NODE_PYTHON) -c "import torch; print('node torch', torch.__version__, 'cuda', torch.version.cuda)"
	$(NODE_PYTHON) scripts/offline_install.py venv $(VENV)
	$(PY) scripts/offline_install.py plan "$(WHEELHOUSE)" --subset $(SUBSET) --json $(VENV)/offline-plan.json --wheels > $(VENV)/offline-wheels.txt
	xargs -r $(PIP) install -q --no-index --no-deps < $(VENV)/offline-wheels.txt
	$(PIP) install -q --no-index --no-build-isolation --find-links "$(WHEELHOUSE)" --no-deps --config-settings editable_mode=compat -e .
	$(PY) -c "import torch, cse.models.method, cse.training.loop, cse.evaluation.sts; print('installed; torch', torch.__version__, 'kept')"

# Proves and measures the CUDA path (benchmarks/gpu_check.py); DEVICE=cpu: the tiny rehearsal that make test runs.
DEVICE ?= auto
gpu-check:
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(PY) -m benchmarks.gpu_check --device $(DEVICE) $(GPU_CHECK_ARGS)

# Step time of every method eager vs compiled on the real Wiki1M rows (real and computed tokens/s, MFU on both),
# kernels and launches per step, warm-up first and cached, checkpoint and evaluation overhead of a whole run, the
# evaluation-precision check, the sentence-transformers peer eager and compiled (benchmarks/gpu_speed.py,
# docs/gpu.md); DEVICE=cpu: the tiny rehearsal. GPU_SPEED_ARGS="--budget-s 420" starts nothing after 7 minutes
# (what it skips, the report says).
gpu-speed:
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(PY) -m benchmarks.gpu_speed --device $(DEVICE) $(GPU_SPEED_ARGS)

clean:
	rm -rf .cse site
