#!/usr/bin/env bash
# GPU checks in one or two calls of a GPU machine, each step under its own time limit:
#   tests      the head's captured training step on CUDA (tests/test_head.py), then
#              tests/test_fast_path.py (their CUDA variants run there);
#   before     benchmarks/gpu_breakdown.py on the engine as it was (.before/specdec_core, when
#              carried: `git archive REV specdec_core | tar -x -C .before`), graphs on, compile off,
#              one warm-up call (as gpu_decode.py makes), plain and K 4, 6, 8;
#   breakdown  the same on this checkout's engine;
#   fused      the breakdown's plain step with the decoder layers' projections fused (the engine's
#              default on CUDA) and unfused, graphs on, compile off: the kernels per step and their
#              device time (specdec_core/fused_projections.py); then the fused step compiled
#              (plain_compiled: the kernels of the step the bandwidth goal is measured on, and its
#              compile seconds), and last compiled with inductor's coordinate descent tuning
#              (plain_tuned; cut by the step's limit, the others are kept);
#   grid       benchmarks/gpu_decode.py --quick --engine-compile off --items 2,3 (verify(K) and the
#              alpha x K grid against the planner, with captured rounds);
#   decode     benchmarks/gpu_decode.py --quick --items 1,4,5 (compile at the engine's default;
#              DECODE_ITEMS=1,2,3,4,5 for all);
#   profile    `specdec profile measure --device cuda` end to end, against a random-weight model of
#              the embedded default's architecture (benchmarks/random_model.py) and a throwaway
#              store (SPECDEC_HOME in the step's work folder); prints the compile time;
#   profile_layer  the same with SPECDEC_COMPILE_SCOPE=layer (one compiled decoder layer shared
#              by every layer: specdec_core/layer_compile.py);
#   decode_layer   gpu_decode.py item 1 (plain decoding, compile on) with the layer scope, into
#              gpu_decode_layer.md: what the shorter compile costs per token;
#   scope      benchmarks/compile_scope.py --device cuda --repeats 1 --scopes layer --cold-only:
#              the layer scope's cold compile seconds on the embedded default's shape
#              (SCOPE_SCOPES=layer,model adds the whole forward's, 77 s on an H100 on 2026-11-27;
#              each process's row is written as it ends; decode and decode_layer time the two
#              scopes' forwards);
#   head_step  benchmarks/head_step.py: one EAGLE-3 head training step (eagle3_gpu.py's recipe,
#              a random-weight target of the embedded default's shape), its batch gathered from
#              the packed target passes against built a row at a time: ops and milliseconds;
#   head       benchmarks/eagle3_gpu.py: the target answers prompts of every domain, EAGLE-3 heads
#              train on 1k, 5k and all of them, held-out acceptance per domain (the learning
#              curve); needs the embedded default's GGUF (98 MB), over what one call carries (64
#              MiB with the checkout): its parts travel in .gguf-a/, .gguf-b/, ... (`--split-gguf`),
#              one a call of one warm machine; each call copies the parts it carries to /tmp, and
#              the head step joins them (in the call that brings the last part).
# Every step's log and outputs go to a work folder; after each step it is packed into
# $OUT/results.tar.gz (a device call brings back at most 8 files), beside $OUT/device.txt
# (versions, then every step's rc and seconds). Exits non-zero when any step failed.
#
#   bash benchmarks/run_on_device.sh                # STEPS (default: fused decode profile_layer
#                                                   # decode_layer: the bandwidth and compile goals
#                                                   # still open, 450 s of limits, so that the head's
#                                                   # call (about 300 s) fits the same 15-minute
#                                                   # lease; breakdown and grid met theirs on
#                                                   # 2026-11-27, profile (the whole-forward scope)
#                                                   # missed its twice; head_step and scope time
#                                                   # what the head's call and profile_layer's log
#                                                   # show too), each under its LIMITS
#   STEPS="head" bash benchmarks/run_on_device.sh   # only some steps
#   LIMITS="grid=60 decode=150" bash ...            # each step's limit in seconds (default
#                                                   # tests=150 before=45 breakdown=45 grid=60
#                                                   # head_step=40 fused=100 decode=140 profile=90
#                                                   # profile_layer=120 decode_layer=90 scope=50
#                                                   # head=270; LIMITS= for none): a step
#                                                   # over its limit is stopped, its log kept,
#                                                   # the next one runs
#   bash benchmarks/run_on_device.sh --smoke        # dry run on this machine's CPU: the same steps
#                                                   # on the tiny test shapes (compile_scope traced
#                                                   # with the eager backend; .whl/ not installed)
#   bash benchmarks/run_on_device.sh --split-gguf [auto|BYTES]   # the embedded default's GGUF
#                                                   # in parts .gguf-a/, .gguf-b/, ...: the first
#                                                   # sized to travel beside .whl/ (or BYTES), each
#                                                   # later one alone; prints each call's carry and
#                                                   # size against the 64 MiB a call takes
#   bash benchmarks/run_on_device.sh --join-gguf    # the parts carried so far (this call's and
#                                                   # earlier calls' of the machine) joined and
#                                                   # checked: prints the GGUF's path
#
# On an H100 (2026-11-26) the steps did not fit a 15-minute lease with torch.compile compiling one
# body per forward width; it now compiles one body for every verify width (and one for a step).
#
# Wheels. The GPU image has torch, transformers, numpy, pandas, rich, safetensors, tokenizers,
# pyyaml, requests and pytest, but not the pipeline's database and settings packages that
# `specdec profile measure` imports (SQLAlchemy, alembic and its Mako, pydantic and its
# pydantic_core, annotated-types, typing-inspection), nor gguf (the head step reads the GGUF). Any
# *.whl in .whl/ (git-ignored; the device call carries it) is installed with --no-deps into
# /tmp/site first (kept there for a second call of the same machine). Fetch them for the image's
# Python 3.12 on x86_64 Linux, at the versions in constraints.txt, with
#   bash benchmarks/run_on_device.sh --fetch-wheels transformers gguf
# which runs, for each NAME==VERSION found in constraints.txt,
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl NAME==VERSION
# (about 21 MB with transformers); a --smoke run leaves them alone (they are for Python 3.12).
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

if [ "${1:-}" = "--split-gguf" ]; then
    # What a device call carries: the checkout's tracked and untracked-not-ignored files, plus its
    # carry paths, 64 MiB in all (DEVICE_TREE_LIMIT; DEVICE_TREE_MARGIN kept free). The first call
    # also carries .whl/ (installed into /tmp/site for the later calls of the same machine).
    gguf=${GGUF:-$(ls .specdec/models/smollm2-135m-instruct/*.gguf 2>/dev/null | head -1)}
    [ -n "$gguf" ] && [ -f "$gguf" ] || { echo "no GGUF under .specdec/models: run the main job once" >&2; exit 1; }
    limit=${DEVICE_TREE_LIMIT:-67108864} margin=${DEVICE_TREE_MARGIN:-524288}
    rm -rf .gguf-?
    git check-ignore -q .gguf-a/part || {
        echo ".gguf-a/ is not ignored by git: untracked, it would travel in every call" >&2; exit 1; }
    tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 stat -c %s -- 2>/dev/null \
           | awk '{ n += $1 } END { print n + 0 }')
    wheels=$(cat .whl/*.whl 2>/dev/null | wc -c)
    size=$(stat -c %s "$gguf")
    room=$((limit - margin - tree))
    first=${2:-auto}
    [ "$first" = auto ] && first=$((room - wheels))
    if [ "$first" -le 0 ] || [ "$first" -gt $((room - wheels)) ] || [ "$room" -le 0 ]; then
        echo "a first part of $first bytes does not fit beside the checkout ($tree bytes) and .whl/" \
             "($wheels bytes) in a call's $limit bytes (less $margin): carry fewer wheels or track less" >&2
        exit 1
    fi
    letters=(a b c d e f g h)
    mkdir -p .gguf-a && head -c "$first" "$gguf" > .gguf-a/part
    offset=$first i=1
    while [ "$offset" -lt "$size" ]; do
        [ "$i" -lt "${#letters[@]}" ] || { echo "more than ${#letters[@]} parts: the checkout leaves too little room" >&2; exit 1; }
        mkdir -p ".gguf-${letters[$i]}"
        tail -c +"$((offset + 1))" "$gguf" | head -c "$room" > ".gguf-${letters[$i]}/part"
        offset=$((offset + room)) i=$((i + 1))
    done
    parts="${letters[*]:0:$i}"
    sum=$( cd "$(dirname "$gguf")" && sha256sum "$(basename "$gguf")" )
    for letter in $parts; do
        echo "$sum" > ".gguf-$letter/SHA256SUMS"
        echo "$parts" > ".gguf-$letter/PARTS"
    done
    echo "checkout $tree bytes, .whl/ $wheels bytes, GGUF $size bytes in ${i} parts; per call (limit $limit):"
    call=1
    for letter in $parts; do
        bytes=$(stat -c %s ".gguf-$letter/part")
        if [ "$letter" = a ]; then
            echo "  call $call: carry [\".whl\", \".gguf-a\"]: $((tree + wheels + bytes)) bytes"
        else
            echo "  call $call: carry [\".gguf-$letter\"]: $((tree + bytes)) bytes"
        fi
        call=$((call + 1))
    done
    echo "  STEPS=head in the last call (earlier calls run other steps, or STEPS= for none)"
    exit 0
fi

# the GGUF's parts this call carries, kept outside the checkout for the later calls of this machine
PARTS_TMP=${PARTS_TMP:-/tmp}
for folder in .gguf-?; do
    [ -f "$folder/part" ] || continue
    cp "$folder/part" "$PARTS_TMP/gguf-${folder#.gguf-}.part"
    cp "$folder/SHA256SUMS" "$PARTS_TMP/gguf.sha256" && cp "$folder/PARTS" "$PARTS_TMP/gguf.parts"
done

join_gguf() {   # the GGUF joined from the parts earlier calls and this one copied; prints its path
    local gguf=$PARTS_TMP/smollm2.gguf letter parts want
    [ -f "$PARTS_TMP/gguf.parts" ] || { echo "no part of the GGUF has been carried: carry .gguf-a" >&2; return 1; }
    parts=$(cat "$PARTS_TMP/gguf.parts")
    want=$(cut -d' ' -f1 "$PARTS_TMP/gguf.sha256")
    if [ ! -f "$gguf" ] || [ "$(sha256sum "$gguf" | cut -d' ' -f1)" != "$want" ]; then
        for letter in $parts; do
            [ -f "$PARTS_TMP/gguf-$letter.part" ] || {
                echo "the GGUF's part $letter is not here: carry .gguf-$letter in a call of this machine" >&2
                return 1; }
        done
        ( for letter in $parts; do cat "$PARTS_TMP/gguf-$letter.part"; done ) > "$gguf.tmp" && mv "$gguf.tmp" "$gguf"
        [ "$(sha256sum "$gguf" | cut -d' ' -f1)" = "$want" ] || {
            echo "joined GGUF: checksum differs (parts $parts of two splits? split again, carry each)" >&2
            rm -f "$gguf"; return 1; }
    fi
    echo "$gguf"
}

if [ "${1:-}" = "--join-gguf" ]; then
    join_gguf
    exit
fi

SMOKE=0
if [ "${1:-}" = "--smoke" ]; then
    SMOKE=1
    shift
fi
OUT=${OUT:-/tmp/specdec-device-out}
STEPS=${STEPS-fused decode profile_layer decode_layer}   # STEPS= (empty): none
# each step's limit in seconds: a 15-minute lease then brings back something of every step
LIMITS=${LIMITS-tests=150 before=45 breakdown=45 grid=60 head_step=40 fused=100 decode=140 profile=90 profile_layer=120 decode_layer=90 scope=50 head=270}
mkdir -p "$OUT"
LOGS=$(mktemp -d "${TMPDIR:-/tmp}/specdec-device-logs.XXXXXX")      # packed into $OUT/results.tar.gz
WORK=$(mktemp -d "${TMPDIR:-/tmp}/specdec-device-work.XXXXXX")
trap 'rm -rf "$LOGS" "$WORK"' EXIT
if [ "$SMOKE" = 0 ] && ls .whl/*.whl >/dev/null 2>&1 \
        && [ "$(ls .whl)" != "$(cat /tmp/site/.wheels 2>/dev/null)" ]; then
    rm -rf /tmp/site
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
    ls .whl > /tmp/site/.wheels
fi
# installed by this call or an earlier one
[ "$SMOKE" = 0 ] && [ -d /tmp/site ] && export PYTHONPATH=/tmp/site
SITE=${PYTHONPATH:-}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

if [ "$SMOKE" = 1 ]; then
    DEVICE=cpu
    SHAPE_ARGS=(--smoke)
    SHAPES=(smoke)
    MEASURE_ARGS=(--candidate prompt_lookup --candidate layer_skip:num_layers=1 --batch-sizes 1
                  --k-max 2)
    DECODE_ARGS=(--smoke)
    SCOPE_ARGS=(--backend eager)      # inductor's C++ code generation alone is over the step's limit
    PROFILE_NAME=random-smoke-cpu
    GRID_TOKENS=${GRID_TOKENS:-16}
else
    DEVICE=cuda
    SHAPE_ARGS=()
    SHAPES=(llama-3.2-1b smollm2-135m)
    MEASURE_ARGS=(--candidate prompt_lookup --candidate layer_skip:num_layers=8)
    DECODE_ARGS=()
    SCOPE_ARGS=()
    PROFILE_NAME=random-smollm2-135m-cuda
fi

{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.used --format=csv 2>&1 || true; } \
    | tee "$OUT/device.txt"
python3 - <<'PY' 2>&1 | tee -a "$OUT/device.txt"
import sys, torch, transformers
print("python", sys.version.split()[0], "torch", torch.__version__, "transformers",
      transformers.__version__, "device",
      torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")
PY

fast_path_tests() {
    # -v: each test's name and outcome as it ends (a run cut by its limit still says which failed)
    python3 -m pytest -v -p no:cacheprovider --durations=15 \
        "tests/test_head.py::test_a_graphed_training_step_on_cuda_captures_and_trains_as_the_eager_step" \
        tests/test_fast_path.py
}

profile_measure() {   # profile_measure [COMPILE_SCOPE]
    # a throwaway store and no inherited SPECDEC_* settings
    local var
    for var in $(compgen -e | grep '^SPECDEC_'); do unset "$var"; done
    export SPECDEC_HOME=$WORK/specdec-home SPECDEC_COMPILE_SCOPE=${1:-model}
    local model=$WORK/random-model
    rm -rf "$SPECDEC_HOME" "$model"
    python3 benchmarks/random_model.py "$model" ${SHAPE_ARGS[@]+"${SHAPE_ARGS[@]}"} || return
    python3 -m tasks.cli db upgrade || return
    # -v: a line per compiled forward body (its batch, width and seconds), kept if cut by the limit
    python3 -m tasks.cli -v profile measure --model "$model" --device "$DEVICE" \
        --name "$PROFILE_NAME" "${MEASURE_ARGS[@]}"
}

gpu_breakdown() {   # gpu_breakdown NAME [PYTHONPATH first entry] [CONFIGS]: graphs on, compile off
    # (but plain_compiled's)
    local name=$1 code=${2:-$PWD} configs=${3:-plain_graphs,spec_k4,spec_k6,spec_k8}
    PYTHONPATH="$code:$PWD${SITE:+:$SITE}" python3 benchmarks/gpu_breakdown.py \
        ${SHAPE_ARGS[@]+"${SHAPE_ARGS[@]}"} --warmup 1 --engine-compile off \
        --configs "$configs" --out "$LOGS/$name.md" --json "$LOGS/$name.json"
}

before_breakdown() {
    [ -d .before/specdec_core ] || { echo "no .before/specdec_core carried"; return 1; }
    gpu_breakdown breakdown_before "$PWD/.before"
}

gpu_grid() {
    # 256 new tokens: over 64 the controlled drafter's accept/reject stream strays from alpha
    # (0.42-0.61 measured at alpha 0.5-0.7 on an H100), and the grid then misses the planner by the
    # stream's noise, not the cost model's error
    python3 benchmarks/gpu_decode.py ${DECODE_ARGS[@]+"${DECODE_ARGS[@]}"} --quick --engine-compile off \
        --items 2,3 --max-new-tokens "${GRID_TOKENS:-256}" --out "$LOGS/gpu_grid.md" \
        --json "$LOGS/gpu_grid.json"
}

gpu_decode() {
    # items 1, 4 and 5 (compile at the engine's default): 2 and 3 are the grid step's; with all
    # five, items 4-5 did not fit the step's 140-150 s on an H100
    python3 benchmarks/gpu_decode.py ${DECODE_ARGS[@]+"${DECODE_ARGS[@]}"} --quick \
        --items "${DECODE_ITEMS:-1,4,5}" --out "$LOGS/${DECODE_NAME:-gpu_decode}.md" \
        --json "$LOGS/${DECODE_NAME:-gpu_decode}.json" "$@"
}

compile_scopes() {   # compile scopes, cold (benchmarks/compile_scope.py): the layer's by default;
    # the whole forward's two bodies alone took 77 s on an H100 (SCOPE_SCOPES=layer,model for both)
    python3 benchmarks/compile_scope.py ${SHAPE_ARGS[@]+"${SHAPE_ARGS[@]}"} --device "$DEVICE" \
        --repeats 1 --scopes "${SCOPE_SCOPES:-layer}" --cold-only ${SCOPE_ARGS[@]+"${SCOPE_ARGS[@]}"} \
        --out "$LOGS/compile_scope.md" --json "$LOGS/compile_scope.json"
}

gpu_decode_layer() {   # plain decoding compiled with one decoder layer's body
    SPECDEC_COMPILE_SCOPE=layer DECODE_ITEMS=1 DECODE_NAME=gpu_decode_layer gpu_decode "$@"
}

head_step() {   # one head training step, packed batches against row-at-a-time ones
    python3 benchmarks/head_step.py --device "$DEVICE" ${SHAPE_ARGS[@]+"${SHAPE_ARGS[@]}"} \
        --out "$LOGS/head_step.md" --json "$LOGS/head_step.json"
}

head_training() {
    if [ "$SMOKE" = 1 ]; then
        python3 benchmarks/eagle3_gpu.py --smoke --out "$LOGS/head"
        return
    fi
    local gguf
    gguf=$(join_gguf) || return
    python3 benchmarks/eagle3_gpu.py --gguf "$gguf" --out "$LOGS/head" ${HEAD_ARGS:-}
}

declare -A RC=()
ORDER=()
limit_of() {   # limit_of KEY: the step's limit in seconds from LIMITS ("" when none)
    local pair
    for pair in $LIMITS; do
        [ "${pair%%=*}" = "$1" ] && { echo "${pair#*=}"; return; }
    done
}

pack() {   # the logs so far into $OUT/results.tar.gz (replaced after every step); the heads
    # (about 19 MB each, over a returned file's 16 MB) into $OUT/heads.tar.part-aa, -ab, ...
    tar -czf "$OUT/results.tar.gz.tmp" --exclude='./head/head-*' -C "$LOGS" . \
        && mv "$OUT/results.tar.gz.tmp" "$OUT/results.tar.gz"
    if ls -d "$LOGS"/head/head-* >/dev/null 2>&1; then
        rm -f "$OUT"/heads.tar.part-*
        tar -cf - -C "$LOGS/head" $(cd "$LOGS/head" && ls -d head-*) | split -b 15000000 - "$OUT/heads.tar.part-"
    fi
}

run_step() {   # run_step KEY LOG FUNCTION [args]: tee the function's output into LOG (packed)
    local key=$1 log=$2
    shift 2
    case " $STEPS " in *" $key "*) ;; *) return 0 ;; esac
    log="$LOGS/$log"
    echo "=== $key: $(date -u +%H:%M:%S) UTC ===" | tee "$log"
    local start=$SECONDS limit
    limit=$(limit_of "$key")
    # a job of its own (job control on: its own process group), so that a step over its limit is
    # stopped with all its processes (what it printed so far stays in its log) and the next runs
    set -m
    ( "$@" 2>&1 | tee -a "$log"; exit "${PIPESTATUS[0]}" ) &
    local pid=$! watch=
    if [ -n "$limit" ]; then
        # the watch is a job of its own too: stopping it stops its sleep, which would otherwise
        # hold this call's output open until the limit (a step that ended early kept the call
        # waiting for its whole limit)
        ( sleep "$limit"; echo "=== $key: over its limit of ${limit}s, stopped ===" | tee -a "$log"
          kill -TERM -- -"$pid" 2>/dev/null; sleep 5; kill -KILL -- -"$pid" 2>/dev/null ) &
        watch=$!
    fi
    set +m
    wait "$pid"
    RC[$key]=$?
    [ -n "$watch" ] && { kill -- -"$watch" 2>/dev/null; wait "$watch" 2>/dev/null; }
    ORDER+=("$key")
    echo "=== $key: rc=${RC[$key]} in $((SECONDS - start))s ===" | tee -a "$log"
    echo "$key rc=${RC[$key]} $((SECONDS - start))s" >> "$OUT/device.txt"
    pack
}

run_step tests fast_path_tests.log fast_path_tests
run_step before breakdown_before.log before_breakdown
run_step breakdown breakdown_after.log gpu_breakdown breakdown_after
run_step grid gpu_grid.log gpu_grid
run_step head_step head_step.log head_step
run_step fused breakdown_fused.log gpu_breakdown breakdown_fused "$PWD" plain_graphs,plain_unfused,plain_compiled,plain_tuned
run_step decode gpu_decode.log gpu_decode "$@"
run_step profile_layer profile_measure_layer.log profile_measure layer
run_step decode_layer gpu_decode_layer.log gpu_decode_layer "$@"
run_step scope compile_scope.log compile_scopes
run_step profile profile_measure.log profile_measure
run_step head head.log head_training

failed=0
summary=""
for key in "${ORDER[@]}"; do
    summary+="$key rc=${RC[$key]} "
    [ "${RC[$key]}" = 0 ] || failed=1
done
echo "steps: ${summary:-none}" | tee -a "$OUT/device.txt"
pack
exit $failed
