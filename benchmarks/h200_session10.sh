#!/usr/bin/env bash
# Issue 5 on one H200 (nvidia-h200: 16 cores, 128 GiB host), session 10: fetches as early as the budget allows
# (px.compile's prefetch=None, the new default) against session 9's four nodes. Stages (first argument, any of):
#   first17  - the 17.26B GPT (54 x 5120, 40 heads, per-block checkpoints, 8 x 2048 tokens, px.init_empty(cuda),
#              137 GiB budget), atomic=False, default prefetch; run first on a fresh machine, it times the compile
#   pf4_17   - first17 with --prefetch 4 (session 9's schedule, with this session's release-early and host-step fix)
#   again17  - first17 once more (after pf4_17: does the order matter?)
#   atomic17 - the 17.26B run with atomic steps (the default); atomic17pf4: the same with --prefetch 4
#   profile17 - first17 with a torch.profiler trace of one step
#   tests    - the CUDA tests of the runtime
#   small    - 1.3B (24 x 2048, 8 x 2048 tokens): eager and pstar-fx, unlimited budget
#   mid      - 6.66B (32 x 4096, 4 x 2048 tokens): eager and pstar-fx, unlimited budget
#   b40      - 4.24B (20 x 4096, 4 x 2048 tokens) at a 40 GiB budget: default prefetch, --prefetch 4, and again
#   threads12 - first17 with 12 CPU worker threads (the default is every core but two: 14)
# Logs under $OUT.
stages=${1:-first17}
source "$(dirname "$0")/h200_prologue.sh"
run17() {   # name, extra flags... (the shared gpt17, then show_run.py's first lines)
  gpt17 "$@"
  python3 benchmarks/show_run.py "$out/$1.json" | head -3
  echo "$1: $(( $(date +%s) - start )) s"
}
for s in ${stages//,/ }; do
  case $s in
    first17) run17 g17b_first --no-atomic ;;
    pf4_17) run17 g17b_pf4 --no-atomic --prefetch 4 ;;
    again17) run17 g17b_again --no-atomic ;;
    atomic17) run17 g17b_atomic ;;
    atomic17pf4) run17 g17b_atomic_pf4 --prefetch 4 ;;
    profile17) run17 g17b_prof --no-atomic --profile "$out/prof" ;;
    threads12) run17 g17b_t12 --no-atomic --host-threads 12 ;;
    tests) cuda_tests ;;
    small) eager_and_pstar 1.3B g1b3.json 200 --layers 24 --hidden 2048 --heads 16 --batch 8 ;;
    mid) eager_and_pstar 6.66B g6b7.json 240 --layers 32 --hidden 4096 --heads 32 --batch 4 --checkpoint off ;;
    b40)
      for pf in default 4 default2 42; do
        flag=(); [[ $pf == 4* ]] && flag=(--prefetch 4)
        timeout 200 python3 benchmarks/gpt.py --timeout 190 --json "$out/g4b_$pf.json" --layers 20 --hidden 4096 \
            --heads 32 --batch 4 --systems pstar --budgets 40GiB "${flag[@]}" 2>&1 | grep -v '^{' | tail -2
      done
      echo "4.24B at 40 GiB: $(( $(date +%s) - start )) s" ;;
    *) echo "unknown stage $s"; exit 2 ;;
  esac
done
