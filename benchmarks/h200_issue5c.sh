#!/usr/bin/env bash
# Issue 5 on one H200 (nvidia-h200: 16 cores, 128 GiB host). Stages (first argument, default all):
#   check  - CUDA tests of init_empty's device replay and remat; benchmarks/remat_check.py; 1.3B eager vs pstar-fx
#   big    - the largest GPT px.plan says fits (48 x 5120, 15.4B; 128 GiB host), built with px.init_empty(device=cuda)
# Logs under $OUT.
set -u
out=${OUT:-h200_logs}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
stages=${1:-check,big}
start=$(date +%s)
if [[ $stages == *check* ]]; then
  PSTAR_TEST_DEVICE=cuda timeout 150 python3 -m pytest tests/test_init_empty.py -k "cuda or device" -x -p no:logging \
      2>&1 | tail -15 | tee "$out/tests_init.txt"
  timeout 120 python3 benchmarks/remat_check.py --layers 12 --hidden 1024 --heads 16 --batch 8 --seq 1024 2>&1 \
      | tail -15 | tee "$out/remat_check.txt"
  echo "checks: $(( $(date +%s) - start )) s"
  timeout 150 python3 benchmarks/gpt.py --timeout 70 --json "$out/g1b3.json" --layers 24 --hidden 2048 --heads 16 \
      --batch 8 --systems eager,pstar --budgets none 2>&1 | grep -v '^{' | tee "$out/g1b3.txt"
  echo "1.3B: $(( $(date +%s) - start )) s"
fi
if [[ $stages == *big* ]]; then
  timeout 560 python3 benchmarks/gpt.py --timeout 540 --json "$out/g15b.json" --layers 48 --hidden 5120 --heads 40 \
      --batch 4 --systems pstar --budgets none --init-empty 2>&1 | grep -v '^{' | tee "$out/g15b.txt"
  echo "15.4B: $(( $(date +%s) - start )) s"
fi
