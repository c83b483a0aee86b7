# The README's two commands: `make demo` (set up + main job) and `make test` (set up + tests).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# CPU machines: the pinned CPU wheel. On a CUDA machine see README ("Installing on a CUDA machine").
TORCH_SPEC ?= torch==2.13.0
CONSTRAINTS ?= -c constraints.txt
export SPECDEC_HOME ?= $(CURDIR)/.specdec

.PHONY: setup demo test bench bench-gpu bench-import clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first: a bare `torch` requirement would pull the newest CUDA build
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet $(CONSTRAINTS) -e ".[test]"
	touch $@

# The main job on the embedded default: the shipped traffic and specdec_evaluate end to end
# through Airflow's dag.test() (SQLite + local MLflow store under $SPECDEC_HOME), then the table,
# the champion config and how to open the UIs.
demo: setup
	$(VENV)/bin/specdec main-job

# the architecture contracts (pyproject's [tool.importlinter]: layers, no cycles), then the tests
test: setup
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q

bench: setup
	$(PY) benchmarks/decode_cpu.py

# On a CUDA machine (see README, "The CUDA fast path"): writes benchmarks/results/gpu_decode.md
bench-gpu: setup
	$(PY) benchmarks/gpu_decode.py

clean:
	rm -rf $(VENV)

# Traffic import throughput on the shipped sample and a generated 100,000-row file (SQLite, and
# PostgreSQL when SPECDEC_TEST_POSTGRES_URL is set).
bench-import: setup
	$(PY) benchmarks/import_throughput.py
