#!/usr/bin/env bash
# One call of a GPU machine that checks every GPU-only path, in four steps:
#   1. tests/test_fast_path.py (its CUDA variants run there);
#   2. `specdec profile measure --device cuda` end to end, against a random-weight model of the
#      embedded default's architecture (benchmarks/random_model.py, written to /tmp) and a
#      throwaway store (SPECDEC_HOME=/tmp/specdec-device); its table is printed;
#   3. benchmarks/gpu_breakdown.py for the Llama-3.2-1B and SmolLM2-135M shapes;
#   4. benchmarks/gpu_decode.py (options after the script's own are passed to it, e.g. --quick).
# Each step's output is tee'd to a log in $OUT (default /tmp/specdec-device-out), at most 8 files:
# device.txt (versions, then every step's rc), fast_path_tests.log, profile_measure.log,
# gpu_breakdown.log (its Markdown included), gpu_breakdown.json ({shape: raw}), gpu_decode.md,
# gpu_decode.json, gpu_decode.log. Exits non-zero when any step failed.
#
#   bash benchmarks/run_on_device.sh [gpu_decode.py options]
#   bash benchmarks/run_on_device.sh --smoke     # dry run on this machine's CPU: the same steps on
#                                                # the tiny test shapes (PATH must reach the venv)
#   STEPS="profile breakdown" bash benchmarks/run_on_device.sh    # only some steps
#                                                # (of: tests profile breakdown decode)
#   LIMITS="tests=60 decode=300" bash benchmarks/run_on_device.sh  # each step's limit in seconds
#                                                # (default tests=150 profile=150 breakdown=120
#                                                # decode=240; LIMITS= for none): a step over its
#                                                # limit is stopped, its log kept, the next one runs
#
# On an H100 (2026-11-26) the steps did not fit a 15-minute lease with torch.compile on (the engine's
# default on CUDA): it compiles one body per forward width, so gpu_decode's item 2 (9 widths) ran
# over 140 s and `profile measure` over 80 s before its first pass. `--engine-compile off` after the
# script's name passes to gpu_decode (item 1 then measures the uncompiled engine).
#
# Wheels. The GPU image has torch, transformers, numpy, pandas, rich, safetensors, tokenizers,
# pyyaml, requests and pytest, but not the pipeline's database and settings packages that
# `specdec profile measure` imports (SQLAlchemy, alembic and its Mako, pydantic and its
# pydantic_core, annotated-types, typing-inspection). Any *.whl in .whl/ (git-ignored; the device
# call carries the working tree) is installed with --no-deps into /tmp/site first. Fetch them for
# the image's Python 3.12 on x86_64 Linux, at the versions in constraints.txt, with
#   bash benchmarks/run_on_device.sh --fetch-wheels [more names, e.g. transformers]
# which runs, for each NAME==VERSION found in constraints.txt,
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl NAME==VERSION
# (about 8 MB). The image's transformers may be older than the pinned one: add `transformers` to
# carry the pinned wheel too (pure Python; its dependencies must then be on the image). Empty
# .whl/ again before a local --smoke run: those wheels are for Python 3.12.
set -uo pipefail
cd "$(dirname "$0")/.."

WHEELS="SQLAlchemy alembic Mako pydantic pydantic_core annotated-types typing-inspection"

if [ "${1:-}" = "--fetch-wheels" ]; then
    shift
    specs=()
    for name in $WHEELS "$@"; do
        pattern=$(printf '%s' "$name" | sed 's/[-_.]/[-_.]/g')
        line=$(grep -iE "^${pattern}==" constraints.txt | head -1)
        if [ -z "$line" ]; then
            echo "no pin for $name in constraints.txt" >&2
            exit 1
        fi
        specs+=("$line")
    done
    exec python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl "${specs[@]}"
fi

SMOKE=0
if [ "${1:-}" = "--smoke" ]; then
    SMOKE=1
    shift
fi
OUT=${OUT:-/tmp/specdec-device-out}
STEPS=${STEPS:-tests profile breakdown decode}
# each step's limit in seconds: a 15-minute lease then brings back something of every step
LIMITS=${LIMITS-tests=150 profile=150 breakdown=120 decode=240}
mkdir -p "$OUT"
WORK=$(mktemp -d /tmp/specdec-device-work.XXXXXX)
if ls .whl/*.whl >/dev/null 2>&1; then
    rm -rf /tmp/site
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

if [ "$SMOKE" = 1 ]; then
    DEVICE=cpu
    SHAPE_ARGS=(--smoke)
    SHAPES=(smoke)
    MEASURE_ARGS=(--candidate prompt_lookup --candidate layer_skip:num_layers=1 --batch-sizes 1
                  --k-max 2)
    DECODE_ARGS=(--smoke)
    PROFILE_NAME=random-smoke-cpu
else
    DEVICE=cuda
    SHAPE_ARGS=()
    SHAPES=(llama-3.2-1b smollm2-135m)
    MEASURE_ARGS=(--candidate prompt_lookup --candidate layer_skip:num_layers=8)
    DECODE_ARGS=()
    PROFILE_NAME=random-smollm2-135m-cuda
fi

python3 - <<'PY' 2>&1 | tee "$OUT/device.txt"
import sys, torch, transformers
print("python", sys.version.split()[0], "torch", torch.__version__, "transformers",
      transformers.__version__, "device",
      torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")
PY

fast_path_tests() {
    python3 -m pytest -q -p no:cacheprovider --durations=15 tests/test_fast_path.py
}

profile_measure() {
    # a throwaway store and no inherited SPECDEC_* settings
    local var
    for var in $(compgen -e | grep '^SPECDEC_'); do unset "$var"; done
    export SPECDEC_HOME=/tmp/specdec-device
    local model=/tmp/specdec-random-model
    rm -rf "$SPECDEC_HOME" "$model"
    python3 benchmarks/random_model.py "$model" ${SHAPE_ARGS[@]+"${SHAPE_ARGS[@]}"} || return
    python3 -m tasks.cli db upgrade || return
    python3 -m tasks.cli profile measure --model "$model" --device "$DEVICE" \
        --name "$PROFILE_NAME" "${MEASURE_ARGS[@]}"
}

gpu_breakdown() {
    local shape rc=0
    for shape in "${SHAPES[@]}"; do
        if [ "$shape" = smoke ]; then set -- --smoke; else set -- --shape "$shape"; fi
        python3 benchmarks/gpu_breakdown.py "$@" --out "$WORK/breakdown-$shape.md" \
            --json "$WORK/breakdown-$shape.json" || rc=1
    done
    python3 - "$OUT/gpu_breakdown.json" "$WORK" "${SHAPES[@]}" <<'PY' || rc=1
import json, pathlib, sys
out, work, shapes = sys.argv[1], pathlib.Path(sys.argv[2]), sys.argv[3:]
merged = {s: json.loads((work / f"breakdown-{s}.json").read_text())
          for s in shapes if (work / f"breakdown-{s}.json").exists()}
pathlib.Path(out).write_text(json.dumps(merged, indent=2))
PY
    return $rc
}

gpu_decode() {
    python3 benchmarks/gpu_decode.py ${DECODE_ARGS[@]+"${DECODE_ARGS[@]}"} --out "$OUT/gpu_decode.md" \
        --json "$OUT/gpu_decode.json" "$@"
}

declare -A RC=()
ORDER=()
limit_of() {   # limit_of KEY: the step's limit in seconds from LIMITS ("" when none)
    local pair
    for pair in $LIMITS; do
        [ "${pair%%=*}" = "$1" ] && { echo "${pair#*=}"; return; }
    done
}

run_step() {   # run_step KEY LOG FUNCTION [args]: tee the function's output into $OUT/LOG
    local key=$1 log=$2
    shift 2
    case " $STEPS " in *" $key "*) ;; *) return 0 ;; esac
    echo "=== $key: $(date -u +%H:%M:%S) UTC ===" | tee "$OUT/$log"
    local start=$SECONDS limit
    limit=$(limit_of "$key")
    # a job of its own (job control on: its own process group), so that a step over its limit is
    # stopped with all its processes (what it printed so far stays in its log) and the next runs
    set -m
    ( "$@" 2>&1 | tee -a "$OUT/$log"; exit "${PIPESTATUS[0]}" ) &
    local pid=$! watch=
    set +m
    if [ -n "$limit" ]; then
        ( sleep "$limit"; echo "=== $key: over its limit of ${limit}s, stopped ===" | tee -a "$OUT/$log"
          kill -TERM -- -"$pid" 2>/dev/null; sleep 5; kill -KILL -- -"$pid" 2>/dev/null ) &
        watch=$!
    fi
    wait "$pid"
    RC[$key]=$?
    [ -n "$watch" ] && { kill "$watch" 2>/dev/null; wait "$watch" 2>/dev/null; }
    ORDER+=("$key")
    echo "=== $key: rc=${RC[$key]} in $((SECONDS - start))s ===" | tee -a "$OUT/$log"
}

run_step tests fast_path_tests.log fast_path_tests
run_step profile profile_measure.log profile_measure
run_step breakdown gpu_breakdown.log gpu_breakdown
run_step decode gpu_decode.log gpu_decode "$@"
rm -rf "$WORK"

failed=0
summary=""
for key in "${ORDER[@]}"; do
    summary+="$key rc=${RC[$key]} "
    [ "${RC[$key]}" = 0 ] || failed=1
done
echo "steps: ${summary:-none}" | tee -a "$OUT/device.txt"
count=$(find "$OUT" -type f | wc -l)
if [ "$count" -gt 8 ]; then
    echo "warning: $count files in $OUT; only 8 come back from a device call" | tee -a "$OUT/device.txt"
fi
exit $failed
