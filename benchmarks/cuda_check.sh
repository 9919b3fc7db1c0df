#!/usr/bin/env bash
# The GPU checks, in one run on a machine with a CUDA GPU (at most 8 minutes), from a checkout:
#
#     benchmarks/cuda_check.sh [WHEELS]        # WHEELS: a folder of wheels for what the machine lacks
#
# Needs torch with CUDA importable by `python3` (or $PYTHON); with WHEELS, pytest, pytest-timeout,
# hypothesis, rich, matplotlib and scikit-learn (and setuptools, to build the native core) are
# installed from it into a venv beside the machine's torch, without a network. Prints one verdict
# line per item (PASS / FAIL / SKIP) and exits non-zero when any item failed.
#
#   1. the native core builds here (else the Python path runs the host collectives)
#   2. pytest -m "cuda or multigpu": 2, 3 and 4 ranks sharing cuda:0, every collective and dtype
#      against the CPU result, DDP and ZeRO-1 (float64, 10 steps) against one process, torch's DDP
#      on the gradsync backend against gloo's, no NCCL communicator made (tests/test_host_staging.py)
#   3. gradsync train --device cuda, each strategy, two ranks sharing the GPU
#   4. gradsync bench ddp --device cuda --workers 2,4: ours, torch DDP on gradsync, torch DDP on gloo
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WHEELS=${1:-}
OUT=${OUT:-/tmp/gradsync-cuda-check}
mkdir -p "$OUT"
if [ -n "$WHEELS" ]; then
    TORCH_SITE=$("$PY" -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))')
    "$PY" -m venv "$OUT/venv" && "$OUT/venv/bin/pip" install -q --no-index --find-links "$WHEELS" \
        pytest pytest-timeout hypothesis rich matplotlib scikit-learn setuptools numpy 2>&1 | tail -2
    PY="$OUT/venv/bin/python"
    export PYTHONPATH="src:$TORCH_SITE"
else
    export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
fi
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
failed=0
verdict() {   # verdict NAME STATUS [DETAIL]
    printf '%-58s %s %s\n' "$1" "$2" "${3:-}"
    [ "$2" = FAIL ] && failed=1
    return 0
}

"$PY" -c 'import torch; assert torch.cuda.is_available(); print("GPU:", torch.cuda.get_device_name(0), "x", torch.cuda.device_count(), "torch", torch.__version__)' \
    || { verdict "CUDA visible to torch" FAIL; exit 1; }

# 1. the native core
if timeout 120 "$PY" setup.py -q build_ext --inplace > "$OUT/build.log" 2>&1 \
        && "$PY" -c 'from gradsync.comm.transport.shm.native import _core'; then
    verdict "native core built" PASS
else
    verdict "native core built" FAIL "(the Python path runs; $OUT/build.log)"
fi

# 2. the cuda-marked tests
timeout 300 "$PY" -m pytest -q -p no:cacheprovider -m "cuda or multigpu" tests/test_host_staging.py \
    > "$OUT/pytest.log" 2>&1
status=$?
summary=$(tail -n 1 "$OUT/pytest.log")
if [ $status -eq 0 ]; then verdict "cuda tests (shared GPU: collectives, DDP, ZeRO-1, backend)" PASS "$summary"
else verdict "cuda tests (shared GPU: collectives, DDP, ZeRO-1, backend)" FAIL "$summary ($OUT/pytest.log)"; fi

# 3. the main job on the GPU, every strategy
for job in "ddp" "zero1" "ps-sync --workers 3" "diloco" "ddp --compress powersgd" "ddp --fault-tolerance live"; do
    name=${job// /_}
    if timeout 120 "$PY" -m gradsync.cli train --device cuda --workers 2 --strategy $job --quiet \
            --out "$OUT/train-$name" --overwrite > "$OUT/train-$name.log" 2>&1 \
            && grep -q '"device": "cuda' "$OUT/train-$name/metrics.jsonl"; then
        verdict "train --device cuda --strategy $job" PASS "$(grep -m1 -o 'test accuracy *│ *[0-9.]*%' "$OUT/train-$name.log" | tr -s ' │' ' ')"
    else
        verdict "train --device cuda --strategy $job" FAIL "($OUT/train-$name.log)"
    fi
done
# a CUDA run's checkpoint resumes on the CPU and trains on (portable checkpoints)
if timeout 120 "$PY" -m gradsync.cli train --device cpu --workers 2 --quiet --out "$OUT/train-ddp" --resume \
        --epochs 9 > "$OUT/resume-on-cpu.log" 2>&1; then verdict "a CUDA checkpoint resumed on the CPU" PASS
else verdict "a CUDA checkpoint resumed on the CPU" FAIL "($OUT/resume-on-cpu.log)"; fi

# 4. the step against gloo's, ranks sharing the GPU
for workers in 2 4; do
    if timeout 150 "$PY" -m gradsync.cli bench ddp --device cuda --workers "$workers" --steps 10 --bucket-mb 25 \
            --json "$OUT/bench-ddp-$workers.json" > "$OUT/bench-ddp-$workers.log" 2>&1; then
        verdict "bench ddp --device cuda --workers $workers" PASS
        cat "$OUT/bench-ddp-$workers.log"
    else
        verdict "bench ddp --device cuda --workers $workers" FAIL "($OUT/bench-ddp-$workers.log)"
    fi
done
exit $failed
