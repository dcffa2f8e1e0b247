#!/usr/bin/env bash
# The checks that need a GPU, for a lent one-GPU machine (CI has none): the CUDA tests, the
# main job on the GPU, and the one-GPU benchmark (bf16 MFU of a 1B GPT-2: the `gpu` suite,
# kolossos' fastest one-device plugins next to torch DDP and FSDP2). Writes its logs under $OUT
# (runs/gpu). BENCH_BATCH (default 16) and BENCH_REPS (default 2) size the benchmark.
# `capacity` (never by default: minutes per attempt) runs the single-GPU capacity benchmark at
# the machine's memory limit (benchmarks/gemini_capacity.py --auto); `capacity-nvme` (never by
# default either) the same with a share of the Adam states in files under runs/nvme, at 1.0 of
# Gemini's limit without the disk.
# Usage: bash scripts/gpu_check.sh [gpu|bench|train|fork|unit|capacity|capacity-nvme]...
# (all but the capacity steps by default)
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(gpu bench train fork unit)
nvidia-smi -L
$PY -c "import torch, transformers as t; print('torch', torch.__version__, 'transformers', \
t.__version__, torch.cuda.get_device_name())"
$PY -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 \
    || echo "[gpu] editable install failed: the kolossos command may be missing"
for step in "${steps[@]}"; do
    case $step in
    gpu)  # the CUDA-only tests
        timeout 150 $PY -m pytest -q -p no:cacheprovider tests/gpu \
            tests/unit/test_accelerator.py 2>&1 | tee "$OUT/tests-gpu.log" | tail -25 ;;
    fork)  # forked CPU/gloo ranks on a GPU host (the parent must not initialise CUDA), gpu last
        timeout 150 $PY -m pytest -q -p no:cacheprovider tests/gpu \
            tests/parity/test_sequence_parallel_plugin.py -k "sp2_matches or gpu or cuda" \
            2>&1 | tee "$OUT/tests-fork.log" | tail -15 ;;
    unit)  # the single-process suites with CUDA visible
        timeout 100 $PY -m pytest -q -p no:cacheprovider -n 12 tests/unit tests/compat \
            2>&1 | tee "$OUT/tests-unit.log" | tail -40 ;;
    train)
        d=$(mktemp -d)
        (cd "$d" && timeout 100 kolossos train) 2>&1 | tee "$OUT/train.log" | tail -15 ;;
    bench)
        b=${BENCH_BATCH:-16}
        timeout 420 $PY -m benchmarks gpu --world-size 1 --model gpt2-1b --precision bf16 \
            --batch "$b" --steps 6 --warmup 2 --reps "${BENCH_REPS:-2}" --interleave rep \
            --out "$OUT/mfu-b$b.json" 2>&1 | grep -v '^{' | tee "$OUT/bench-b$b.log" | tail -20 ;;
    capacity)  # Gemini at 0.9 of its limit, then 0.8 if that fails; DDP at 0.9 of its own
        for mode in gemini ddp; do
            timeout 290 $PY -m benchmarks.gemini_capacity --auto --hidden 4096 --heads 32 \
                --modes $mode --timeout 280 2>&1 | tee "$OUT/capacity-$mode.log" | tail -6
        done ;;
    capacity-nvme)  # the disk as a third memory: sizes plain Gemini cannot reach
        timeout 580 $PY -m benchmarks.gemini_capacity --auto --hidden 4096 --heads 32 \
            --modes gemini-nvme --nvme-fractions 1.0 --nvme-dir "$PWD/runs/nvme" --timeout 570 2>&1 \
            | tee "$OUT/capacity-nvme.log" | tail -6 ;;
    *) echo "unknown step $step" >&2; exit 2 ;;
    esac
done
