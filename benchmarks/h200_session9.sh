#!/usr/bin/env bash
# Issue 5 on one H200 (nvidia-h200: 16 cores, 128 GiB host), session 9. Stages (first argument, any of):
#   warmup17 - the 17.26B GPT (54 x 5120, 40 heads, per-block checkpoints, 8 x 2048 tokens, px.init_empty(cuda),
#              137 GiB budget), atomic=False: compile time by part (import, trace, each pass, host arenas, set-up),
#              first, second and steady steps
#   touch    - host pages touched three times in one process (is a fresh machine's first touch slower?); the
#              first call of the session ran it after warmup17
#   scaling  - fresh host pages faulted in with 16, 8, 4 and 2 threads beside a Python loop (the first 20 GiB,
#              which a fresh machine faults in fast, with 16 threads first and not counted); then a warmup17 run
#              comes second on memory the machine has touched before
#   budgets17 - warmup17's run at budgets of 136 and 134 GiB (room for the allocator: its retries per step)
#   atomic17 - the 17.26B run with atomic steps (the default)
#   tests    - the CUDA tests of the runtime
#   mid      - 6.66B (32 x 4096, 4 x 2048 tokens), pstar-fx only
#   profile17 - warmup17's run with a torch.profiler trace of one step
# Logs under $OUT.
stages=${1:-warmup17}
source "$(dirname "$0")/h200_prologue.sh"
if [[ $stages == *scaling* ]]; then
  timeout 200 python3 benchmarks/host_touch.py --scaling 16,16,8,4,2 --gib 18 --json "$out/scaling.json" 2>&1 \
      | tee "$out/scaling.txt"
  echo "scaling: $(( $(date +%s) - start )) s"
fi
shape17=(--layers 54 --hidden 5120 --heads 40 --batch 8 --checkpoint on --systems pstar --budgets 137GiB --init-empty)
if [[ $stages == *warmup17* || $stages == *profile17* ]]; then
  prof=(); [[ $stages == *profile17* ]] && prof=(--profile "$out/prof")
  timeout 300 python3 benchmarks/gpt.py --timeout 290 --json "$out/g17b.json" "${shape17[@]}" \
      --warmup 1 --steps 5 --no-atomic "${prof[@]}" 2>&1 | grep -v '^{' | tail -4
  python3 benchmarks/show_run.py "$out/g17b.json" | head -3
  echo "17B no-atomic: $(( $(date +%s) - start )) s"
fi
if [[ $stages == *touch* ]]; then
  timeout 120 python3 - <<'PY' 2>&1 | tee "$out/touch.txt"
import time, torch
from pstar_fx.runtime.host_memory import zeroed
for i in range(3):
    t0 = time.perf_counter(); t = zeroed(32 << 30, torch.uint8); dt = time.perf_counter() - t0
    print(f"touch 32 GiB, time {i + 1} in this process: {dt:.2f} s ({32 * 2**30 / dt / 1e9:.1f} GB/s)"); del t
PY
fi
if [[ $stages == *budgets17* ]]; then
  timeout 330 python3 benchmarks/gpt.py --timeout 160 --json "$out/g17b_budgets.json" "${shape17[@]/137GiB/136GiB,134GiB}" \
      --warmup 1 --steps 5 --no-atomic 2>&1 | grep -v '^{' | tail -4
  python3 benchmarks/show_run.py "$out/g17b_budgets.json" | head -2
  echo "17B budgets: $(( $(date +%s) - start )) s"
fi
if [[ $stages == *atomic17* ]]; then
  timeout 300 python3 benchmarks/gpt.py --timeout 290 --json "$out/g17b_atomic.json" "${shape17[@]}" \
      --warmup 1 --steps 5 2>&1 | grep -v '^{' | tail -4
  python3 benchmarks/show_run.py "$out/g17b_atomic.json" | head -3
  echo "17B atomic: $(( $(date +%s) - start )) s"
fi
if [[ $stages == *tests* ]]; then
  PSTAR_TEST_DEVICE=cuda timeout 300 python3 -m pytest tests/test_cuda_runtime.py tests/test_equivalence.py \
      tests/test_residency.py tests/test_host_updates.py tests/test_training_loop.py tests/test_evaluate.py \
      tests/test_param_homes.py tests/test_early_updates.py tests/test_host_memory.py tests/test_writebacks.py \
      -q -p no:logging \
      -p no:cacheprovider -rf > "$out/tests_cuda.txt" 2>&1
  echo "tests rc $?"; tail -5 "$out/tests_cuda.txt"
  echo "tests: $(( $(date +%s) - start )) s"
fi
if [[ $stages == *mid* ]]; then
  timeout 200 python3 benchmarks/gpt.py --timeout 190 --json "$out/g6b7.json" --layers 32 --hidden 4096 \
      --heads 32 --batch 4 --checkpoint off --systems pstar --budgets none 2>&1 | grep -v '^{' | tail -3
  echo "6.66B: $(( $(date +%s) - start )) s"
fi
