#!/usr/bin/env bash
# Issue 5 on one H200 (nvidia-h200: 16 cores, 128 GiB host), session 8. Stages (first argument):
#   micro  - benchmarks/host_micro.py (pinning 16 GiB four ways; the CPU worker's Adam update in several thread
#            layouts), then the CUDA tests of the runtime
#   big    - the 17.26B GPT (54 x 5120, 40 heads, per-block checkpoints, 8 x 2048 tokens, px.init_empty(cuda),
#            137 GiB budget), atomic=False then atomic; each as the first 17B process on its machine only if it is
#            the first run of the call (BENCHMARKS.md marks the order)
#   mid    - 6.66B (32 x 4096, 4 x 2048 tokens): eager, pstar-fx and FSDP2 CPU offload at one commit
# Logs under $OUT.
set -u
out=${OUT:-h200_logs}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
stages=${1:-micro}
start=$(date +%s)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
free -g | tee -a "$out/gpu.txt"
nproc | tee -a "$out/gpu.txt"
if [[ $stages == *micro* ]]; then
  timeout 200 python3 benchmarks/host_micro.py --json "$out/micro.json" 2>&1 | tee "$out/micro.txt"
  echo "micro: $(( $(date +%s) - start )) s"
  PSTAR_TEST_DEVICE=cuda timeout 300 python3 -m pytest tests/test_cuda_runtime.py tests/test_equivalence.py \
      tests/test_residency.py tests/test_host_updates.py tests/test_training_loop.py tests/test_evaluate.py \
      tests/test_param_homes.py tests/test_early_updates.py -q -p no:logging -p no:cacheprovider \
      > "$out/tests_cuda.txt" 2>&1
  echo "tests rc $?"; grep -E "passed|failed|^FAILED|^ERROR" "$out/tests_cuda.txt" | tail -15
  echo "tests: $(( $(date +%s) - start )) s"
fi
