#!/usr/bin/env bash
# One call of a GPU machine for issue 8's figures: the fast path's tests (their CUDA variants run
# there), then benchmarks/gpu_decode.py; logs, Markdown and JSON land in $OUT.
#   bash benchmarks/run_on_device.sh [gpu_decode.py options, e.g. --quick]
# The GPU image's transformers may be older than the one this project pins (constraints.txt): carry
# the pinned wheel in .whl/ (it is pure Python; its dependencies are on the image), e.g.
#   pip download --no-deps -d .whl "transformers==$(grep -i '^transformers==' constraints.txt | cut -d= -f3)"
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/specdec-device-out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 - <<'PY' 2>&1 | tee "$OUT/device.txt"
import torch, transformers
print("torch", torch.__version__, "transformers", transformers.__version__,
      "device", torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")
PY
python3 -m pytest -q -p no:cacheprovider tests/test_fast_path.py 2>&1 | tee "$OUT/fast_path_tests.log"
tests_rc=${PIPESTATUS[0]}
python3 benchmarks/gpu_decode.py --out "$OUT/gpu_decode.md" --json "$OUT/gpu_decode.json" "$@" \
    2>&1 | tee "$OUT/gpu_decode.log"
bench_rc=${PIPESTATUS[0]}
echo "tests rc=$tests_rc benchmark rc=$bench_rc"
exit $(( tests_rc || bench_rc ))
