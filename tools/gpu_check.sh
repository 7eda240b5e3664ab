#!/usr/bin/env bash
# The GPU check: every test marked `gpu` (pytest -m gpu), then tools/bench_gpu.py's table.
#
#   bash tools/gpu_check.sh            here, or on a GPU machine in the repository's root
#
# On a machine without network (the lent GPU machine): what the project needs and that machine
# lacks comes from gpu-bundle/ (`make gpu-bundle` here, then carry it): wheels installed with
# --no-index into a target directory, and an fp16 copy of MiniLM. The working tree itself goes
# first on PYTHONPATH, so the code checked is the code carried. Without a CUDA device it says so,
# counts the GPU tests that skipped, and exits 0. Logs go to $OUT when it is set (device runs).
# Budget: tests 300 s, benchmark 240 s (8 minutes in all on one GPU).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
BUNDLE=${GPU_BUNDLE:-$ROOT/gpu-bundle}
LOGS=${OUT:-${TMPDIR:-/tmp}/outrider-gpu-check}
mkdir -p "$LOGS"
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -x "$ROOT/.venv/bin/python" ]; then PY=$ROOT/.venv/bin/python
else PY=python3; fi
export PYTHONUNBUFFERED=1

# 1. What is missing, from the bundle (never from a network).
if ! "$PY" -c "import zmq, pydantic, gguf" 2>/dev/null; then
    if ! ls "$BUNDLE"/wheels/*.whl >/dev/null 2>&1; then
        echo "gpu_check: pyzmq, pydantic or gguf is missing and $BUNDLE/wheels holds no wheels" \
             "(run 'make gpu-bundle' on a machine with network and carry gpu-bundle/)" >&2
        exit 2
    fi
    SITE=${GPU_SITE:-${TMPDIR:-/tmp}/outrider-gpu-site}
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
        "$BUNDLE"/wheels/*.whl || { echo "gpu_check: installing $BUNDLE/wheels failed" >&2; exit 2; }
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$ROOT/runtime:$ROOT/plugins${PYTHONPATH:+:$PYTHONPATH}"
if [ -z "${OUTRIDER_MINILM_DIR:-}" ] && [ -d "$BUNDLE/minilm" ]; then export OUTRIDER_MINILM_DIR=$BUNDLE/minilm; fi

# 2. A GPU, or a clear word that there is none.
if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    summary=$("$PY" -m pytest -q -m gpu -p no:cacheprovider tests 2>&1 | tail -n 1)
    skipped=$(grep -oE '[0-9]+ skipped' <<<"$summary" | grep -oE '[0-9]+' || echo 0)
    ran=$(grep -oE '[0-9]+ (passed|failed|error)' <<<"$summary" || true)
    if [ -n "$ran" ]; then
        echo "gpu_check: no CUDA device, yet GPU tests ran: $summary" >&2
        exit 1
    fi
    echo "no CUDA device: $skipped GPU tests skipped"
    exit 0
fi

# 3. The GPU tests, then the benchmark table.
"$PY" - <<'EOF'
import torch
p = torch.cuda.get_device_properties(0)
print(f"gpu_check: {p.name}, {p.total_memory / 2**30:.0f} GiB, compute capability {p.major}.{p.minor}, "
      f"torch {torch.__version__}, CUDA {torch.version.cuda}")
EOF
timeout 300 "$PY" -m pytest -q -m gpu -rs -p no:cacheprovider tests 2>&1 | tee "$LOGS/gpu_tests.log"
tests_rc=${PIPESTATUS[0]}
timeout 240 "$PY" tools/bench_gpu.py "$@" 2>&1 | tee "$LOGS/bench_gpu.log"
bench_rc=${PIPESTATUS[0]}
echo "gpu_check: tests exit $tests_rc, benchmark exit $bench_rc (logs in $LOGS)"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
