# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test unit integration bench clean

$(STAMP): requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps -e .
	@$(PY) -c "import torch, sys; v = torch.__version__; print('torch', v); sys.exit(0 if '+cpu' in v or '+cu' not in v else 1)"
	@# DeepSpeed's CPU ops, compiled once here so that no run compiles (planner/runtime/preflight/ops.py);
	@# a failure is a warning: the runs would compile (or fail) as before
	-DS_ACCELERATOR=cpu $(PY) -m planner.runtime.preflight.ops
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/planner search --model glm-10b --gpus 8xA100

test: $(STAMP)
	$(PY) -m pytest -q --durations=15 tests   # CI logs name the slowest tests

unit: $(STAMP)
	$(PY) -m pytest -q tests/unit

integration: $(STAMP)
	$(PY) -m pytest -q tests/integration

bench: $(STAMP)
	for f in benchmarks/*.py; do echo "== $$f"; $(PY) $$f || exit 1; done

clean:
	rm -rf $(VENV) .pytest_cache
