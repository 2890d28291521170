#!/usr/bin/env bash
# Issue 5 on one H200 (nvidia-h200: 16 cores, 128 GiB host), session 7. Stages (first argument, default all):
#   check  - the CUDA tests of the runtime at this commit (parameter homes, residency, host updates, the training
#            loop, evaluation); 1.3B and 6.66B: eager vs pstar-fx at the device's free memory
#   big    - the CUDA tests of atomic=False; the 17.26B GPT (54 x 5120, 40 heads) with per-block checkpoints,
#            8 x 2048 tokens per step, built with px.init_empty(device=cuda), at a 137 GiB budget, with atomic=False
#            (profiled) and then atomic; its plan first (runs only if the host memory fits)
#   threads - the 17.26B run with atomic=False and 14, then 12, intra-op threads for the CPU worker (of 16 cores)
#   final   - the 17.26B run at pstar-fx's default worker threads: atomic=False (profiled), then atomic
# Logs under $OUT.
set -u
out=${OUT:-h200_logs}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
stages=${1:-check,big}
start=$(date +%s)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
free -g | tee -a "$out/gpu.txt"
if [[ $stages == *check* ]]; then
  PSTAR_TEST_DEVICE=cuda timeout 220 python3 -m pytest tests/test_cuda_runtime.py tests/test_equivalence.py \
      tests/test_residency.py tests/test_host_updates.py tests/test_training_loop.py tests/test_evaluate.py \
      tests/test_param_homes.py -q -p no:logging -p no:cacheprovider > "$out/tests_cuda.txt" 2>&1
  echo "tests rc $?"; grep -E "passed|failed|^FAILED|^ERROR" "$out/tests_cuda.txt" | tail -15
  echo "tests: $(( $(date +%s) - start )) s"
  timeout 120 python3 benchmarks/gpt.py --timeout 100 --json "$out/g1b3.json" --layers 24 --hidden 2048 --heads 16 \
      --batch 8 --systems eager,pstar --budgets none 2>&1 | grep -v '^{' | tee "$out/g1b3.txt"
  echo "1.3B: $(( $(date +%s) - start )) s"
  timeout 200 python3 benchmarks/gpt.py --timeout 180 --json "$out/g6b7.json" --layers 32 --hidden 4096 --heads 32 \
      --batch 4 --systems eager,pstar --budgets none 2>&1 | grep -v '^{' | tee "$out/g6b7.txt"
  echo "6.66B: $(( $(date +%s) - start )) s"
fi
if [[ $stages == *threads* ]]; then     # atomic=False at 17.26B with fewer intra-op threads for the CPU worker
  shape=(--layers 54 --hidden 5120 --heads 40 --batch 8 --checkpoint on --systems pstar --budgets 137GiB)
  for threads in 14 12; do
    timeout 240 python3 benchmarks/gpt.py --timeout 230 --json "$out/g17b_t$threads.json" "${shape[@]}" \
        --init-empty --warmup 1 --steps 5 --no-atomic --host-threads $threads 2>&1 | grep -v '^{' | tail -3
    python3 benchmarks/show_run.py "$out/g17b_t$threads.json" | head -1
    echo "threads $threads: $(( $(date +%s) - start )) s"
  done
fi
if [[ $stages == *final* ]]; then      # the library's default worker threads (cores - 2): atomic=False, then atomic
  shape=(--layers 54 --hidden 5120 --heads 40 --batch 8 --checkpoint on --systems pstar --budgets 137GiB)
  for variant in --no-atomic ""; do
    name=g17b_final${variant:+_no_atomic}
    timeout 250 python3 benchmarks/gpt.py --timeout 240 --json "$out/$name.json" "${shape[@]}" --init-empty \
        --warmup 1 --steps 5 $variant ${variant:+--profile "$out/prof"} 2>&1 | grep -v '^{' | tail -3
    python3 benchmarks/show_run.py "$out/$name.json" | head -1
    echo "$name: $(( $(date +%s) - start )) s"
  done
fi
if [[ $stages == *big* ]]; then
  PSTAR_TEST_DEVICE=cuda timeout 100 python3 -m pytest tests/test_early_updates.py -q -p no:logging \
      -p no:cacheprovider > "$out/tests_early_cuda.txt" 2>&1
  echo "early-update tests rc $?"; tail -3 "$out/tests_early_cuda.txt"
  shape=(--layers 54 --hidden 5120 --heads 40 --batch 8 --checkpoint on --systems pstar --budgets 137GiB)
  timeout 150 python3 -m pstar_fx.plan --layers 54 --d-model 5120 --heads 40 --batch 8 --checkpoint \
      --device-memory 137GiB --host-memory 118GiB --no-atomic 2>&1 | tee "$out/plan17b.txt"
  echo "plan: $(( $(date +%s) - start )) s"
  if grep -q "verdict: FITS" "$out/plan17b.txt"; then
    for variant in --no-atomic ""; do       # atomic=False (host-side updates during backward), then the default
      name=g17b${variant:+_no_atomic}
      timeout 300 python3 benchmarks/gpt.py --timeout 290 --json "$out/$name.json" "${shape[@]}" --init-empty \
          --warmup 1 --steps 5 --watch 60 $variant ${variant:+--profile "$out/prof"} 2>&1 | grep -v '^{' \
          | tee "$out/$name.txt"
      python3 benchmarks/show_run.py "$out/$name.json"
      echo "$name: $(( $(date +%s) - start )) s"
    done
  fi
fi
