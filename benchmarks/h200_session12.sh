#!/usr/bin/env bash
# Issue 5 on one H200 (nvidia-h200: 16 cores, 128 GiB host), session 12: the 17.26B GPT built without activation
# checkpoints, the remat pass choosing what to recompute (by the peak device memory it frees, then the sum over
# nodes), against the same model with per-block checkpoints. Stages (first argument, any of, comma-separated):
#   remat17  - the 17.26B GPT (54 x 5120, 40 heads, no checkpoints, 8 x 2048 tokens, px.init_empty(cuda), 137 GiB
#              budget), atomic=False; run first on a fresh machine, it times the compile
#   b135, b133 - remat17 at a 135 or 133 GiB budget (does headroom for the CUDA allocator remove its retries?)
#   first17  - the same built with per-block checkpoints (torch.utils.checkpoint), as in sessions 8-11
#   atomic17 - remat17 with atomic steps (the default)
#   async17  - remat17 under torch's cudaMallocAsync allocator backend instead of expandable segments (does the
#              caching allocator's retrying cost the step?)
#   tests    - the CUDA tests of the runtime, and the remat and checkpointing tests (with PSTAR_TEST_DEVICE=cuda)
#   remat_tests - the remat and checkpointing tests alone, with PSTAR_TEST_DEVICE=cuda (CPU tests: some compile on
#              the CPU, some compare bitwise; run there to show checkpointed models trace for CUDA) and on the CPU
#              under this machine's torch
#   small    - 1.3B (24 x 2048, 8 x 2048 tokens): eager and pstar-fx, unlimited budget
#   mid      - 6.66B (32 x 4096, 4 x 2048 tokens): eager and pstar-fx, unlimited budget
# Logs under $OUT.
stages=${1:-remat17}
source "$(dirname "$0")/h200_prologue.sh"
uname -r | tee -a "$out/gpu.txt"          # MADV_POPULATE_WRITE needs Linux 5.14
for s in ${stages//,/ }; do
  case $s in
    remat17) run17 g17b_remat --checkpoint off --no-atomic ;;
    b135) run17 g17b_b135 --checkpoint off --no-atomic --budgets 135GiB ;;
    b133) run17 g17b_b133 --checkpoint off --no-atomic --budgets 133GiB ;;
    first17) run17 g17b_first --no-atomic ;;
    atomic17) run17 g17b_atomic --checkpoint off ;;
    async17) PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync run17 g17b_async --checkpoint off --no-atomic ;;
    tests) cuda_tests tests/test_remat.py tests/test_checkpointing.py ;;
    remat_tests)   # the remat and checkpointing tests alone: on the GPU, then on this machine's torch on the CPU
      PSTAR_TEST_DEVICE=cuda timeout 280 python3 -m pytest tests/test_remat.py tests/test_checkpointing.py -q \
          -p no:logging -p no:cacheprovider -rf > "$out/tests_remat_cuda.txt" 2>&1
      echo "cuda rc $?"; tail -4 "$out/tests_remat_cuda.txt"
      timeout 280 python3 -m pytest tests/test_remat.py tests/test_checkpointing.py -q -p no:logging \
          -p no:cacheprovider -rf > "$out/tests_remat_cpu.txt" 2>&1
      echo "cpu rc $?"; tail -4 "$out/tests_remat_cpu.txt"
      echo "remat_tests: $(( $(date +%s) - start )) s" ;;
    small) eager_and_pstar 1.3B g1b3.json 200 --layers 24 --hidden 2048 --heads 16 --batch 8 ;;
    mid) eager_and_pstar 6.66B g6b7.json 240 --layers 32 --hidden 4096 --heads 32 --batch 4 --checkpoint off ;;
    *) echo "unknown stage $s"; exit 2 ;;
  esac
done
