#!/usr/bin/env bash
# Multi-GPU check and benchmark on nvidia-h200-x2 (2 H200s of one host). Stages (first argument, default all):
#   tests  - the NCCL data-parallel equivalence tests (tests/test_distributed.py, 2 ranks, one GPU each)
#   small  - 1.3B GPT on 1 and 2 GPUs, pstar-fx only (a quick look at scaling)
#   scale  - 6.66B GPT on 1 and 2 GPUs: pstar-fx and FSDP2 (without and with CPU offload), scaling efficiency
#   big    - the largest GPT on both GPUs and their host (57 x 7168, 35.5B; px.plan: 224 GiB host of 256), built with
#            px.init_empty(device=cuda), per-block checkpoints, 1 sequence per GPU, a 134 GiB budget per GPU
# Logs under $OUT. NCCL's NVLink multicast stays off (the machine's environment sets NCCL_NVLS_ENABLE=0).
set -u
out=${OUT:-h200x2_logs}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
stages=${1:-tests,small,scale}
start=$(date +%s)
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$out/gpus.txt"
if [[ $stages == *tests* ]]; then
  PSTAR_TEST_DEVICE=cuda timeout 240 python3 -m pytest tests/test_distributed.py -k nccl -x -p no:logging 2>&1 \
      | tail -40 | tee "$out/tests.txt"
  echo "tests: $(( $(date +%s) - start )) s"
fi
if [[ $stages == *small* ]]; then
  timeout 200 python3 benchmarks/gpt.py --timeout 90 --json "$out/g1b3.json" --layers 24 --hidden 2048 --heads 16 \
      --batch 8 --gpus 1,2 --systems pstar --budgets none 2>&1 | grep -v '^{' | tee "$out/g1b3.txt"
  echo "1.3B: $(( $(date +%s) - start )) s"
fi
if [[ $stages == *scale* ]]; then
  timeout 420 python3 benchmarks/gpt.py --timeout 100 --json "$out/g6b.json" --layers 32 --hidden 4096 --heads 32 \
      --batch 4 --gpus 1,2 --systems fsdp2,pstar --budgets none 2>&1 | grep -v '^{' | tee "$out/g6b.txt"
  echo "6.66B: $(( $(date +%s) - start )) s"
fi
if [[ $stages == *big* ]]; then
  free -g | tee "$out/free.txt"; ulimit -l
  python3 -c "
import torch; from pstar_fx.runtime.host_memory import HostMemory
h = HostMemory(True); t = h.zeros(1 << 28, torch.float32)
print('1 GiB host buffer pinned by cudaHostRegister:', bool(h._registered))"
  # the plan, traced for CUDA here: run the benchmark only if it says the model fits both memories
  timeout 200 python3 -m pstar_fx.plan --layers ${BIG_LAYERS:-57} --d-model 7168 --heads 56 --batch 1 --checkpoint \
      --world-size 2 --device-memory 134GiB --host-memory 236GiB 2>&1 | tee "$out/plan35b.txt" | tail -14
  grep -q "verdict: FITS" "$out/plan35b.txt" || { echo "the plan says it does not fit: not run"; exit 1; }
  export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
  (while sleep 5; do echo "$(( $(date +%s) - start )) s $(free -g | grep Mem) rss_gib: $(ps -C python3 -o rss= \
      | awk '{printf "%.0f ", $1 / 1048576}')"; done) > "$out/mem.txt" &
  mon=$!
  timeout 560 python3 benchmarks/gpt.py --timeout 540 --json "$out/g35b.json" --layers ${BIG_LAYERS:-57} --hidden 7168 \
      --heads 56 --batch 1 --gpus 2 --systems pstar --budgets 134GiB --checkpoint on --init-empty --warmup 1 --steps 5 \
      2>&1 | grep -v '^{' | tee "$out/g35b.txt"
  kill $mon
  python3 -c "
import json; d = json.load(open('$out/g35b.json'))
print('\n'.join(l for v in d['logs'].values() for l in v.splitlines() if 'host memory' in l or 'loss' in l or 'Error' in l))"
  sort -k5 -n "$out/mem.txt" | tail -1 | sed 's/^/most host memory used (GiB, free -g): /'
  echo "big: $(( $(date +%s) - start )) s"
fi
