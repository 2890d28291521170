#!/usr/bin/env bash
# Issue 5 on one H200 (nvidia-h200: 16 cores, 128 GiB host), session 11: the compile of the 17.26B GPT after the
# faster trace and passes (e4e87be), and the experiment of faulting the Adam moments in after compiling (measured at
# d85690d-49f476c, reverted: BENCHMARKS.md, session 11). Stages (first argument, any of, comma-separated):
#   first17  - the 17.26B GPT (54 x 5120, 40 heads, per-block checkpoints, 8 x 2048 tokens, px.init_empty(cuda),
#              137 GiB budget), atomic=False; run first on a fresh machine, it times the compile
#   atomic17 - the same with atomic steps (the default)
#   async17  - first17 under torch's cudaMallocAsync allocator backend instead of expandable segments (does the
#              caching allocator's retrying cost the step?)
#   tests    - the CUDA tests of the runtime
#   small    - 1.3B (24 x 2048, 8 x 2048 tokens): eager and pstar-fx, unlimited budget
#   mid      - 6.66B (32 x 4096, 4 x 2048 tokens): eager and pstar-fx, unlimited budget
# Logs under $OUT.
stages=${1:-first17}
source "$(dirname "$0")/h200_prologue.sh"
uname -r | tee -a "$out/gpu.txt"          # MADV_POPULATE_WRITE needs Linux 5.14
for s in ${stages//,/ }; do
  case $s in
    first17) run17 g17b_first --no-atomic ;;
    atomic17) run17 g17b_atomic ;;
    async17) PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync run17 g17b_async --no-atomic ;;
    tests) cuda_tests tests/test_atomic.py ;;
    small) eager_and_pstar 1.3B g1b3.json 200 --layers 24 --hidden 2048 --heads 16 --batch 8 ;;
    mid) eager_and_pstar 6.66B g6b7.json 240 --layers 32 --hidden 4096 --heads 32 --batch 4 --checkpoint off ;;
    *) echo "unknown stage $s"; exit 2 ;;
  esac
done
