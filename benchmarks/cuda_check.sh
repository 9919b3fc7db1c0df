#!/usr/bin/env bash
# The GPU checks, in slices that each fit one 10-minute device call with room to spare. From a
# checkout, on a machine with a CUDA GPU, the correctness slice first:
#
#     benchmarks/cuda_check.sh --slice correctness [--wheels DIR]   # at most 5 minutes
#     benchmarks/cuda_check.sh --slice train       [--wheels DIR]   # at most 7 minutes
#     benchmarks/cuda_check.sh --slice bench       [--wheels DIR]   # at most 6 minutes
#     benchmarks/cuda_check.sh --slice multigpu    [--wheels DIR]   # at most 5 minutes; needs two GPUs
#
# Needs torch with CUDA importable by `python3` (or $PYTHON). --wheels DIR: a folder of wheels for
# what the machine lacks (pytest, pytest-timeout, hypothesis, rich, matplotlib, scikit-learn, numpy,
# setuptools), installed into a venv beside the machine's torch without a network; a failed install
# stops the slice (FAIL, exit 2). One verdict line per item, docs/gpus.md says what each means:
#   PASS  it ran and gave what it must      FAIL  it ran and did not (the log named beside it)
#   SKIP  this machine cannot run it (one GPU for a two-GPU item), or the slice ran out of time first
# Exits 1 when an item failed. Logs under $OUT (default /tmp/gradsync-cuda-check).
#
#   correctness  the native core builds; overlapped staging equals GRADSYNC_STAGING_MODE=sync bit for
#                bit (before anything is timed); the cuda tests: 2, 3, 4 ranks sharing cuda:0, every
#                collective and dtype against the CPU result, DDP and ZeRO-1 against one process,
#                torch's DDP on the gradsync backend against gloo's, no NCCL made
#   train        gradsync train --device cuda, each strategy, two ranks sharing the GPU; where tensors
#                ran is read from the run's own record (metrics.jsonl's "setup" event, "device");
#                a CUDA run's checkpoint resumed on the CPU
#   bench        gradsync bench ddp --device cuda --workers 2, 4 (ours, torch DDP on gradsync, on gloo)
#   multigpu     two ranks each on a GPU of its own: NCCL chosen, every collective against the CPU's,
#                NCCL's point-to-point past its buffers, the main job on NCCL
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/gradsync-cuda-check}
SLICE=""
WHEELS=""
while [ $# -gt 0 ]; do
    case "$1" in
        --slice) SLICE=${2:-}; shift 2 ;;
        --wheels) WHEELS=${2:-}; shift 2 ;;
        *) echo "cuda_check.sh: unknown argument $1 (use --slice correctness|train|bench|multigpu [--wheels DIR])" >&2
           exit 2 ;;
    esac
done
case "$SLICE" in
    correctness) BUDGET=300 ;;
    train) BUDGET=420 ;;
    bench) BUDGET=360 ;;
    multigpu) BUDGET=300 ;;
    *) echo "cuda_check.sh: --slice correctness|train|bench|multigpu (the correctness slice first)" >&2; exit 2 ;;
esac
mkdir -p "$OUT"
failed=0
verdict() {   # verdict NAME STATUS [DETAIL]
    printf '%-60s %s %s\n' "$1" "$2" "${3:-}"
    [ "$2" = FAIL ] && failed=1
    return 0
}
left() {   # seconds left of the slice's budget, keeping 10 for the verdicts
    echo $((BUDGET - SECONDS - 10))
}
within() {   # within SECONDS CMD...: CMD under a timeout of SECONDS or what the budget has left; 124 when
    local want=$1; shift   # there is not time for it at all
    local have; have=$(left)
    [ "$have" -lt 20 ] && return 124
    timeout "$(( want < have ? want : have ))" "$@"
}

if [ -n "$WHEELS" ]; then
    TORCH_SITE=$("$PY" -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))') \
        || { verdict "torch importable by $PY" FAIL; exit 2; }
    if ! { [ -x "$OUT/venv/bin/python" ] || "$PY" -m venv "$OUT/venv"; } > "$OUT/venv.log" 2>&1 \
        || ! "$OUT/venv/bin/pip" install -q --no-index --find-links "$WHEELS" pytest pytest-timeout hypothesis \
            rich matplotlib scikit-learn setuptools numpy >> "$OUT/venv.log" 2>&1; then
        verdict "install from $WHEELS" FAIL "(stopped: $OUT/venv.log)"
        exit 2
    fi
    PY="$OUT/venv/bin/python"
    export PYTHONPATH="src:$TORCH_SITE"
else
    export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
fi
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
GPUS=$("$PY" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)' 2>/dev/null || echo 0)
if [ "$GPUS" -lt 1 ]; then verdict "CUDA visible to torch" FAIL "(torch.cuda.is_available() is False)"; exit 1; fi
"$PY" -c 'import torch; print("GPU:", torch.cuda.get_device_name(0), "x", torch.cuda.device_count(), "torch", torch.__version__)'

pytest_item() {   # pytest_item NAME SECONDS LOG PYTEST-ARGS...
    local name=$1 seconds=$2 log=$3; shift 3
    within "$seconds" "$PY" -m pytest -q -p no:cacheprovider "$@" > "$log" 2>&1
    local status=$?
    local summary; summary=$(tail -n 1 "$log")
    if [ $status -eq 124 ] && [ ! -s "$log" ]; then verdict "$name" SKIP "(no time left in the slice)"
    elif [ $status -eq 0 ] && grep -q " passed" <<< "$summary" && ! grep -q "skipped" <<< "$summary"; then
        verdict "$name" PASS "$summary"
    elif [ $status -eq 0 ]; then verdict "$name" SKIP "$summary ($log)"
    else verdict "$name" FAIL "$summary ($log)"; fi
}

device_of() {   # the devices the run's metrics.jsonl "setup" records name, or "none"
    "$PY" - "$1/metrics.jsonl" <<'EOF'
import json, sys
try:
    records = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
except OSError:
    records = []
devices = sorted({str(r.get("device")) for r in records if r.get("event") == "setup"})
print(",".join(devices) if devices else "none")
EOF
}

train_item() {   # train_item NAME SECONDS WANT-PATH TRAIN-ARGS...: PASS when a setup record names a CUDA device
    local name=$1 seconds=$2 path=$3; shift 3   # (and, WANT-PATH given, that CUDA path)
    local tag=${name//--strategy /}; tag=${tag//[ ,]/_}
    local dir="$OUT/train-$tag"
    within "$seconds" "$PY" -m gradsync.cli train --device cuda --quiet --out "$dir" --overwrite "$@" \
        > "$dir.log" 2>&1
    local status=$?
    local devices; devices=$(device_of "$dir")
    local cuda_path; cuda_path=$("$PY" -c 'import json, sys
print(",".join(sorted({str(json.loads(l).get("cuda_path")) for l in open(sys.argv[1]) if "\"setup\"" in l})))' \
        "$dir/metrics.jsonl" 2>/dev/null)
    if [ $status -eq 124 ] && [ "$devices" = none ]; then verdict "train $name" SKIP "(no time left in the slice)"
    elif [ $status -ne 0 ]; then verdict "train $name" FAIL "(exit $status: $dir.log)"
    elif [[ "$devices" != *cuda* ]]; then verdict "train $name" FAIL "(setup record: device $devices, not cuda)"
    elif [ -n "$path" ] && [[ "$cuda_path" != *"$path"* ]]; then
        verdict "train $name" FAIL "(setup record: cuda_path $cuda_path, not $path)"
    else verdict "train $name" PASS "(device $devices, cuda_path $cuda_path)"; fi
}

case "$SLICE" in
correctness)
    if within 90 "$PY" setup.py -q build_ext --inplace > "$OUT/build.log" 2>&1 \
            && "$PY" -c 'from gradsync.comm.transport.shm.native import _core'; then
        verdict "native core built" PASS
    else
        verdict "native core built" FAIL "(the Python path runs; $OUT/build.log)"
    fi
    # before anything is timed: the overlapped staging against the synchronous one, bit for bit
    pytest_item "staging: overlap equals sync, bit for bit" 120 "$OUT/pytest-modes.log" -m cuda \
        tests/test_host_staging.py -k overlapped_staging_equals
    pytest_item "cuda tests (shared GPU: collectives, DDP, ZeRO-1, backend)" 240 "$OUT/pytest-cuda.log" -m cuda \
        tests/test_host_staging.py -k "not overlapped_staging_equals"
    ;;
train)
    for job in "ddp" "zero1" "diloco" "ddp --compress powersgd" "ps-sync --workers 3" "ddp --fault-tolerance live"; do
        train_item "--strategy $job" 60 "" --workers 2 --strategy $job
    done
    if within 60 "$PY" -m gradsync.cli train --device cpu --workers 2 --quiet --out "$OUT/train-ddp" \
            --resume --epochs 9 > "$OUT/resume-on-cpu.log" 2>&1; then verdict "a CUDA checkpoint resumed on the CPU" PASS
    else verdict "a CUDA checkpoint resumed on the CPU" FAIL "($OUT/resume-on-cpu.log)"; fi
    ;;
bench)
    for workers in 2 4; do
        if within 150 "$PY" -m gradsync.cli bench ddp --device cuda --workers "$workers" --steps 10 --bucket-mb 25 \
                --json "$OUT/bench-ddp-$workers.json" > "$OUT/bench-ddp-$workers.log" 2>&1; then
            verdict "bench ddp --device cuda --workers $workers" PASS
            cat "$OUT/bench-ddp-$workers.log"
        else
            verdict "bench ddp --device cuda --workers $workers" FAIL "($OUT/bench-ddp-$workers.log)"
        fi
    done
    ;;
multigpu)
    if [ "$GPUS" -lt 2 ]; then
        verdict "multigpu tests (a GPU a rank: NCCL)" SKIP "(needs two GPUs, this machine has $GPUS)"
        verdict "train --strategy ddp a GPU a rank" SKIP "(needs two GPUs, this machine has $GPUS)"
    else
        pytest_item "multigpu tests (a GPU a rank: NCCL)" 200 "$OUT/pytest-multigpu.log" -m multigpu \
            tests/test_host_staging.py
        train_item "--strategy ddp a GPU a rank" 60 nccl --workers 2 --strategy ddp
    fi
    ;;
esac
exit $failed
