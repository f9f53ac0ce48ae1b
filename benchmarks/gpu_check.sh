#!/usr/bin/env bash
# The GPU check, on a machine with one NVIDIA GPU, in under 8 minutes (GPU_CHECK_SECONDS, default 470):
#   1. nvidia-smi must answer; the CUDA build of JAX is installed (pip install -e ".[cuda,test]") unless JAX already
#      sees a GPU; jax.devices() is printed;
#   2. benchmarks/bench_gpu.py's parts, each under its own timeout: the calibration (hardware profile written to
#      OUT/profile.json, for scripts/plan.py --hardware-profile), a Qwen2.5-0.5B-shaped GRPO update (MFU), its decode
#      (fraction of the HBM roofline), the W-small RL steps predicted vs measured (the perf-model validation);
#   3. the tests marked gpu (pytest -m gpu), then the 1.5B update if time is left (the figures come first: a lent GPU's
#      time is short);
#   4. one table of everything (OUT/table.txt).
# A part that fails or runs out of time is marked so in the table; the others still run. Exit status: 0 when every
# part passed, 1 otherwise.
#
#   bash benchmarks/gpu_check.sh [OUT]        (OUT defaults to gpu_check_out/)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-gpu_check_out}
BUDGET=${GPU_CHECK_SECONDS:-470}
PY=${PYTHON:-python}
mkdir -p "$OUT"
: > "$OUT/status.txt"

if ! command -v nvidia-smi > /dev/null; then
    echo "gpu_check: nvidia-smi not found: no NVIDIA driver on this machine" >&2
    exit 2
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
if ! "$PY" -c "import jax; jax.devices('gpu')" > /dev/null 2>&1; then
    timeout 180 "$PY" -m pip install -q -e ".[cuda,test]"
fi
export JAX_PLATFORMS=cuda,cpu
"$PY" -c "import jax; print('jax', jax.__version__, jax.devices())"
if ! "$PY" -c "import jax, sys; sys.exit(jax.default_backend() != 'gpu')"; then
    echo "gpu_check: JAX does not see the GPU" >&2
    exit 3
fi

failed=0
# part NAME LIMIT COMMAND...: runs COMMAND under min(LIMIT, the time left), logs to OUT/NAME.log, records the status
part() {
    local name=$1 limit=$2 rc=0 start=$SECONDS
    shift 2
    local left=$((BUDGET - SECONDS))
    if ((left < 20)); then
        echo "$name skipped 0" >> "$OUT/status.txt"
        return
    fi
    ((limit > left)) && limit=$left
    echo "== $name (at most ${limit} s)"
    timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1 || rc=$?
    echo "$name $rc $((SECONDS - start))" >> "$OUT/status.txt"
    ((rc == 0)) || { failed=1; tail -n 5 "$OUT/$name.log"; }
}

bench=(benchmarks/bench_gpu.py --out "$OUT")
part calibrate 75 "$PY" "${bench[@]}" --part calibrate
part update 90 "$PY" "${bench[@]}" --part update --models 0.5b
part decode 75 "$PY" "${bench[@]}" --part decode --decode-models 0.5b
part validate 100 "$PY" "${bench[@]}" --part validate
part gpu-tests 150 "$PY" -m pytest -q -m gpu -p no:cacheprovider tests
part update-1.5b 80 "$PY" "${bench[@]}" --part update --models 1.5b --name update-1.5b

echo
"$PY" benchmarks/bench_gpu.py --table "$OUT" | tee "$OUT/table.txt"
exit $failed
