#!/usr/bin/env bash
# wt-speed measurement (residency across steps + host-side updates on a worker): CUDA tests, then pstar-fx only
# (eager and FSDP2 figures are in BENCHMARKS.md's issue-5 section) at 1.3B unlimited and 4.24B / 40 GiB, profiled.
set -u
out=${OUT:-h200_logs}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
start=$(date +%s)
PSTAR_TEST_DEVICE=cuda timeout 150 python3 -m pytest tests/test_cuda_runtime.py tests/test_equivalence.py \
    tests/test_atomic.py -x -q 2>&1 | tail -20 | tee "$out/tests.txt"
echo "tests: $(( $(date +%s) - start )) s"
python3 benchmarks/gpt.py --timeout 90 --json "$out/g1b3.json" --layers 24 --hidden 2048 --heads 16 --batch 8 \
    --systems pstar --budgets none 2>&1 | grep -v '^{' | tee "$out/g1b3.txt"
echo "1.3B: $(( $(date +%s) - start )) s"
python3 benchmarks/gpt.py --timeout 150 --json "$out/g4b.json" --layers 20 --hidden 4096 --heads 32 --batch 4 \
    --systems pstar --budgets 40GiB --profile /tmp/prof 2>&1 | grep -v '^{' | tee "$out/g4b.txt"
cp /tmp/prof/*_streams.json "$out/" 2>/dev/null
echo "elapsed $(( $(date +%s) - start )) s"
