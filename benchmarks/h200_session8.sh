#!/usr/bin/env bash
# Issue 5 on one H200 (nvidia-h200: 16 cores, 128 GiB host), session 8. Stages (first argument):
#   micro  - benchmarks/host_micro.py (pinning 16 GiB five ways; the CPU worker's Adam update in several thread
#            layouts and block sizes), then the CUDA tests of the runtime (session 8's first call, before tests had
#            a stage of their own)
#   big    - the 17.26B GPT (54 x 5120, 40 heads, per-block checkpoints, 8 x 2048 tokens, px.init_empty(cuda),
#            137 GiB budget) with atomic=False, profiled
#   atomic17 - the 17.26B run with atomic steps (the default)
#   tests  - the CUDA tests of the runtime
#   largest - benchmarks/gpt.py --largest for eager and FSDP2 offload at d=4096 (32, 40, 48 layers)
#   mid    - 6.66B (32 x 4096, 4 x 2048 tokens): FSDP2 CPU offload and pstar-fx at one commit
#   final  - CPU tests of tracing under the machine's torch, CUDA tests of the store, 17.26B atomic=False
#   last   - 17.26B atomic=False again (after a change to host set-up), then a cProfile of planning it
# Logs under $OUT.
stages=${1:-micro}
source "$(dirname "$0")/h200_prologue.sh"
if [[ $stages == *micro* ]]; then
  timeout 200 python3 benchmarks/host_micro.py --json "$out/micro.json" 2>&1 | tee "$out/micro.txt"
  echo "micro: $(( $(date +%s) - start )) s"
fi
if [[ $stages == *micro* && $stages != *tests* ]]; then
  PSTAR_TEST_DEVICE=cuda timeout 300 python3 -m pytest tests/test_cuda_runtime.py tests/test_equivalence.py \
      tests/test_residency.py tests/test_host_updates.py tests/test_training_loop.py tests/test_evaluate.py \
      tests/test_param_homes.py tests/test_early_updates.py -q -p no:logging -p no:cacheprovider \
      > "$out/tests_cuda.txt" 2>&1
  echo "tests rc $?"; grep -E "passed|failed|^FAILED|^ERROR" "$out/tests_cuda.txt" | tail -15
  echo "tests: $(( $(date +%s) - start )) s"
fi
shape17=(--layers 54 --hidden 5120 --heads 40 --batch 8 --checkpoint on --systems pstar --budgets 137GiB --init-empty)
if [[ $stages == *big* ]]; then        # atomic=False, profiled: the first 17B process of the call
  timeout 330 python3 benchmarks/gpt.py --timeout 320 --json "$out/g17b_no_atomic.json" "${shape17[@]}" \
      --warmup 1 --steps 5 --no-atomic --profile "$out/prof" 2>&1 | grep -v '^{' | tail -4
  python3 benchmarks/show_run.py "$out/g17b_no_atomic.json" | head -3
  echo "17B no-atomic: $(( $(date +%s) - start )) s"
fi
if [[ $stages == *atomic17* ]]; then   # the atomic default at 17B
  timeout 330 python3 benchmarks/gpt.py --timeout 320 --json "$out/g17b_atomic.json" "${shape17[@]}" \
      --warmup 1 --steps 5 2>&1 | grep -v '^{' | tail -4
  python3 benchmarks/show_run.py "$out/g17b_atomic.json" | head -3
  echo "17B atomic: $(( $(date +%s) - start )) s"
fi
if [[ $stages == *tests* ]]; then
  PSTAR_TEST_DEVICE=cuda timeout 300 python3 -m pytest tests/test_cuda_runtime.py tests/test_equivalence.py \
      tests/test_residency.py tests/test_host_updates.py tests/test_training_loop.py tests/test_evaluate.py \
      tests/test_param_homes.py tests/test_early_updates.py -q -p no:logging -p no:cacheprovider -rf \
      > "$out/tests_cuda.txt" 2>&1
  echo "tests rc $?"; tail -5 "$out/tests_cuda.txt"
  echo "tests: $(( $(date +%s) - start )) s"
fi
if [[ $stages == *largest* ]]; then    # the largest GPT eager and FSDP2 offload train (d=4096, 4 x 2048 tokens)
  timeout 560 python3 benchmarks/gpt.py --timeout 200 --json "$out/largest.json" --hidden 4096 --heads 32 \
      --batch 4 --checkpoint on --systems eager,fsdp2 --largest 32,40,48 2>&1 | grep -v '^{' | tail -14
  echo "largest: $(( $(date +%s) - start )) s"
fi
if [[ $stages == *mid* ]]; then        # 6.66B: FSDP2 offload (no checkpoints: its faster setting) and pstar-fx
  timeout 300 python3 benchmarks/gpt.py --timeout 200 --json "$out/g6b7.json" --layers 32 --hidden 4096 \
      --heads 32 --batch 4 --checkpoint off --systems fsdp2,pstar --budgets none 2>&1 | grep -v '^{' | tail -5
  echo "6.66B: $(( $(date +%s) - start )) s"
fi
if [[ $stages == *final* ]]; then      # the session's last commit: CPU tests of tracing under this torch, CUDA tests of
  # the store's host memory, then 17B atomic=False (compile time and the second step)
  timeout 150 python3 -m pytest tests/test_trace.py tests/test_inputs.py tests/test_api.py tests/test_host_memory.py \
      -q -p no:logging -p no:cacheprovider > "$out/tests_trace_cpu.txt" 2>&1
  echo "CPU trace tests rc $?"; tail -2 "$out/tests_trace_cpu.txt"
  PSTAR_TEST_DEVICE=cuda timeout 150 python3 -m pytest tests/test_cuda_runtime.py tests/test_host_updates.py \
      tests/test_param_homes.py -q -p no:logging -p no:cacheprovider > "$out/tests_cuda_final.txt" 2>&1
  echo "CUDA tests rc $?"; tail -2 "$out/tests_cuda_final.txt"
  echo "tests: $(( $(date +%s) - start )) s"
  timeout 250 python3 benchmarks/gpt.py --timeout 240 --json "$out/g17b_final.json" "${shape17[@]}" \
      --warmup 1 --steps 5 --no-atomic 2>&1 | grep -v '^{' | tail -3
  python3 benchmarks/show_run.py "$out/g17b_final.json" | head -1
  echo "17B final: $(( $(date +%s) - start )) s"
fi
if [[ $stages == *last* ]]; then       # 17B atomic=False at the arena commit; then where the trace's time goes here
  timeout 230 python3 benchmarks/gpt.py --timeout 220 --json "$out/g17b_last.json" "${shape17[@]}" \
      --warmup 1 --steps 5 --no-atomic 2>&1 | grep -v '^{' | tail -3
  python3 benchmarks/show_run.py "$out/g17b_last.json" | head -1
  echo "17B last: $(( $(date +%s) - start )) s"
  timeout 100 python3 -m cProfile -o "$out/plan17b.prof" -m pstar_fx.plan --layers 54 --d-model 5120 --heads 40 \
      --batch 8 --checkpoint --device-memory 137GiB --no-atomic > "$out/plan17b_profiled.txt" 2>&1
  python3 -c "import pstats; pstats.Stats('$out/plan17b.prof').sort_stats('tottime').print_stats(25)" \
      > "$out/plan17b_top.txt" 2>&1; tail -1 "$out/plan17b_profiled.txt"
fi
