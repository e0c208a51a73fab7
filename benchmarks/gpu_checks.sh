#!/usr/bin/env bash
# The checks and figures for a CUDA machine, in one call of a bounded length.
#
# Run from the repository root on a machine with a CUDA GPU and a CUDA build of
# torch (torchaxe is used from src/, not installed):
#
#     bash benchmarks/gpu_checks.sh            # logs in $OUT (default /tmp/torchaxe-gpu)
#
# Parts, each under its own time limit and all under TOTAL seconds, so that one part
# that hangs or fails leaves the others their time:
#   env       the GPU, the driver, python and torch versions
#   tests     tests/test_cuda.py and tests/test_data_prefetch.py on the GPU
#   prefetch  benchmarks/prefetch_overlap.py: the copy DevicePrefetcher hides
#   e2e       benchmarks/end_to_end.py --target cuda: advise -> apply -> run on the GPT example
#   compile   benchmarks/compile_mode.py --target cuda --only gpt
#   mfu       benchmarks/mfu.py --target cuda --only gpt: MFU before and after advise
#             (table and measured peak), and the operators that made the difference
# Each part's output goes to $OUT/<part>.log and its last lines to stdout; the e2e,
# compile and mfu parts also save their JSON results there (copy them to
# benchmarks/results/).
#
# The parts run in the order above; their limits add up to more than TOTAL, so the
# last ones get what the others left (a part with under 20 s left is skipped). mfu
# comes last: it needs about MFU_LIMIT seconds (four profiled runs and an advise of
# MFU_BUDGET); when the others leave too little, run it alone with PARTS="env mfu".
#
# Settings (environment): PYTHON (default python3), TOTAL (default 540 seconds),
# TARGET (default cuda; cpu runs the same parts as a dry run), PARTS (which of the parts,
# default all), GPT_ARGS, E2E_BUDGET, E2E_LIMIT, MFU_BUDGET, MFU_LIMIT.
set -u
OUT=${OUT:-/tmp/torchaxe-gpu}
PY=${PYTHON:-python3}
TOTAL=${TOTAL:-540}
TARGET=${TARGET:-cuda}
E2E_BUDGET=${E2E_BUDGET:-150s}
E2E_LIMIT=${E2E_LIMIT:-320}
MFU_BUDGET=${MFU_BUDGET:-90s}
MFU_LIMIT=${MFU_LIMIT:-230}
PARTS=${PARTS:-env tests prefetch e2e compile mfu}
GPT_ARGS=${GPT_ARGS:---batch-size 32 --seq-len 256 --d-model 512 --n-layers 6 --n-heads 8 --vocab-size 8192 --steps 100000 --log-every 100000}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export TORCHAXE_HOME="${TORCHAXE_HOME:-$(mktemp -d)}"
START=$(date +%s)

part() {  # part NAME LIMIT COMMAND...: run it for at most LIMIT seconds (less if TOTAL is near)
    local name=$1 limit=$2 left
    shift 2
    [[ " $PARTS " == *" $name "* ]] || return 0
    left=$(( START + TOTAL - $(date +%s) - 5 ))
    if (( left < 20 )); then echo "== $name: skipped, ${left}s left of ${TOTAL}s"; return; fi
    (( limit > left )) && limit=$left
    echo "== $name (at most ${limit}s)"
    local t0=$(date +%s)
    timeout -k 10 "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "-- $name: exit $rc after $(( $(date +%s) - t0 ))s$( (( rc == 124 )) && echo ' (time limit)')"
    tail -n "${TAIL:-30}" "$OUT/$name.log"
}

part env 30 bash -c "nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv 2>&1; nproc;
  $PY -c 'import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda, torch.cuda.is_available() and torch.cuda.get_device_name())'"
part tests 75 "$PY" -m pytest -q -p no:cacheprovider -m "not slow" tests/test_cuda.py tests/test_data_prefetch.py
part prefetch 50 "$PY" benchmarks/prefetch_overlap.py --device "$TARGET" --mb 64 --rounds 3
part e2e "$E2E_LIMIT" "$PY" benchmarks/end_to_end.py --target "$TARGET" --budget "$E2E_BUDGET" --repeats 2 --pruned \
    --max-combinations 4 --check-accuracy --args "$GPT_ARGS" --out "$OUT/end_to_end_cuda.json"
part compile 150 "$PY" benchmarks/compile_mode.py --target "$TARGET" --only gpt --repeats 2 --steps 20 \
    --out "$OUT/compile_mode_cuda.json"
part mfu "$MFU_LIMIT" "$PY" benchmarks/mfu.py --target "$TARGET" --only gpt --budget "$MFU_BUDGET" --steps 10 --rounds 2 \
    --gpt-args "$GPT_ARGS" --out "$OUT/mfu_$TARGET.json"
echo "== total $(( $(date +%s) - START ))s"
