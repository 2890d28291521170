#!/usr/bin/env bash
# The end-of-session check on one H200 at main: the CUDA tests of the training loop, residency, host updates and
# evaluation, then pstar-fx beside eager at 1.3B (unlimited) and pstar-fx at 4.24B / 40 GiB.
set -u
out=${OUT:-h200_logs}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
start=$(date +%s)
PSTAR_TEST_DEVICE=cuda timeout 200 python3 -m pytest tests/test_cuda_runtime.py tests/test_equivalence.py \
    tests/test_residency.py tests/test_host_updates.py tests/test_training_loop.py tests/test_evaluate.py \
    -q -k "not half_precision" 2>&1 | tail -25 | tee "$out/tests.txt"
echo "tests: $(( $(date +%s) - start )) s"
python3 benchmarks/gpt.py --timeout 100 --json "$out/g1b3.json" --layers 24 --hidden 2048 --heads 16 --batch 8 \
    --systems eager,pstar --budgets none 2>&1 | grep -v '^{' | tee "$out/g1b3.txt"
echo "1.3B: $(( $(date +%s) - start )) s"
python3 benchmarks/gpt.py --timeout 120 --json "$out/g4b.json" --layers 20 --hidden 4096 --heads 32 --batch 4 \
    --systems pstar --budgets 40GiB 2>&1 | grep -v '^{' | tee "$out/g4b.txt"
echo "elapsed $(( $(date +%s) - start )) s"
