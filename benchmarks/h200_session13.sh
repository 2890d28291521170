#!/usr/bin/env bash
# Issue 5 on one H200 (nvidia-h200: 16 cores, 128 GiB host), session 13: the compile of the 17.26B GPT in a fresh
# machine's first process with the trace and passes on one intra-op thread (b4d4987), and how fast a fresh machine
# faults memory in with more threads than the set-up thread uses (14). Stages (first argument, comma-separated):
#   remat17  - the 17.26B GPT (54 x 5120, 40 heads, no checkpoints, 8 x 2048 tokens, px.init_empty(cuda), 137 GiB
#              budget), atomic=False; run first on a fresh machine, it times the compile
#   watch17  - remat17 with gpt.py --watch 0.5: where the main thread is, twice a second (the first step's 9-12 s)
#   init_tests - the CUDA tests of px.init_empty(device="cuda") and of host memory (PSTAR_TEST_DEVICE=cuda)
#   tests    - the runtime's CUDA tests (PSTAR_TEST_DEVICE=cuda)
#   setup    - benchmarks/profile_setup.py on remat17's shape and flags: where the set-up after the passes goes
#              (a later process: its host memory faulted in before)
#   scaling  - benchmarks/host_touch.py --scaling 14,16,24,32: fresh pages faulted in with each thread count beside
#              a Python loop (run first on a fresh machine: 18 GiB per row after an uncounted first 18 GiB)
# Logs under $OUT.
stages=${1:-remat17}
source "$(dirname "$0")/h200_prologue.sh"
uname -r | tee -a "$out/gpu.txt"
for s in ${stages//,/ }; do
  case $s in
    remat17) run17 g17b_remat --checkpoint off --no-atomic ;;
    watch17) run17 g17b_watch --checkpoint off --no-atomic --watch 0.5
      python3 -c "import json, sys; print('\n'.join(l for v in json.load(open(sys.argv[1]))['logs'].values()
          for l in v.splitlines() if l.startswith(('watch', 'step ', 'host memory'))))" "$out/g17b_watch.json" \
          > "$out/watch.txt"
      wc -l < "$out/watch.txt" ;;
    tests) cuda_tests ;;
    init_tests)
      PSTAR_TEST_DEVICE=cuda timeout 200 python3 -m pytest tests/test_init_empty.py tests/test_host_memory.py -k \
          "cuda or host_memory" -q -p no:logging -p no:cacheprovider -rf > "$out/tests_init.txt" 2>&1
      echo "init_tests rc $?"; tail -4 "$out/tests_init.txt"
      echo "init_tests: $(( $(date +%s) - start )) s" ;;
    setup)
      timeout 200 python3 benchmarks/profile_setup.py --layers 54 --d-model 5120 --heads 40 --batch 8 \
          --device-memory 137GiB --no-atomic > "$out/setup.txt" 2>&1
      echo "setup rc $?"; head -20 "$out/setup.txt"
      echo "setup: $(( $(date +%s) - start )) s" ;;
    scaling)
      timeout 200 python3 benchmarks/host_touch.py --scaling 16,14,16,24,32 --gib 18 --json "$out/scaling.json" \
          2>&1 | tail -8
      echo "scaling: $(( $(date +%s) - start )) s" ;;
    *) echo "unknown stage $s"; exit 2 ;;
  esac
done
