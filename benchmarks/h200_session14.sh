#!/usr/bin/env bash
# Issue 5 on one H200 (nvidia-h200: 16 cores, 128 GiB host), session 14: where the atomic step of the 17.26B GPT goes
# (the default, atomic=True: 7.0-7.2 s measured against the cost model's 5.55 s). Stages (first argument,
# comma-separated):
#   atomic_prof - the 17.26B GPT (54 x 5120, 40 heads, no checkpoints, 8 x 2048 tokens, px.init_empty(cuda), 137 GiB
#                 budget), atomic, with a torch.profiler trace of 3 consecutive steps after the timed ones, read step
#                 by step by benchmarks/trace_steps.py
#   free_prof   - the same with --no-atomic
#   free135, free137 - the 17.26B GPT, atomic=False, at a 135 / 137 GiB budget (the CUDA allocator's retries and
#                 what they cost: 22 per step at 137 GiB, 5 at 135 in session 12)
#   tests       - the runtime's CUDA tests and tests/test_init_empty.py (PSTAR_TEST_DEVICE=cuda)
#   init_tests  - the CUDA tests of px.init_empty(device="cuda") and of host memory (PSTAR_TEST_DEVICE=cuda)
# Logs under $OUT.
stages=${1:-atomic_prof}
source "$(dirname "$0")/h200_prologue.sh"
uname -r | tee -a "$out/gpu.txt"
prof17() {   # name, extra flags...
  local name=$1; shift
  run17 "$name" --checkpoint off --profile "$out/prof_$name" --profile-steps 3 "$@"
  python3 benchmarks/trace_steps.py "$out/prof_$name/pstar_137GiB.json.gz" > "$out/${name}_steps.txt" 2>&1
  grep -v '^   gap' "$out/${name}_steps.txt"
  echo "$name traced: $(( $(date +%s) - start )) s"
}
for s in ${stages//,/ }; do
  case $s in
    atomic_prof) prof17 g17b_atomic ;;
    free_prof) prof17 g17b_free --no-atomic ;;
    tests) cuda_tests tests/test_init_empty.py ;;
    free135) run17 g17b_135 --checkpoint off --no-atomic --budgets 135GiB ;;
    free137) run17 g17b_137 --checkpoint off --no-atomic ;;
    init_tests)
      PSTAR_TEST_DEVICE=cuda timeout 200 python3 -m pytest tests/test_init_empty.py tests/test_host_memory.py -k \
          "cuda or host_memory" -q -p no:logging -p no:cacheprovider -rf > "$out/tests_init.txt" 2>&1
      echo "init_tests rc $?"; tail -4 "$out/tests_init.txt"
      echo "init_tests: $(( $(date +%s) - start )) s" ;;
    *) echo "unknown stage $s"; exit 2 ;;
  esac
done
