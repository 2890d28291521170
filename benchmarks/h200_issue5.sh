#!/usr/bin/env bash
# Issue 5 measurement on one H200 (through the device tool), in one call: the CUDA runtime tests, then
# benchmarks/gpt.py for 1.3B (24 x 2048, 16 heads) and 4.24B (20 x 4096, 32 heads). Logs under $OUT; table last.
set -u
out=${OUT:-h200_logs}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
start=$(date +%s)
left() { echo $(( ${DEADLINE:-540} - ($(date +%s) - start) )); }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/env.txt"
python3 -c 'import torch; print("torch", torch.__version__)' | tee -a "$out/env.txt"
PSTAR_TEST_DEVICE=cuda timeout 150 python3 -m pytest tests/test_cuda_runtime.py tests/test_equivalence.py \
  -k "cuda_runtime or tight or host_step or least_budget or own_streams" -q -p no:cacheprovider -rf 2>&1 \
  | tee "$out/cuda_tests.txt" | tail -4
b() {  # name, then gpt.py arguments
  local name=$1; shift
  if [ "$(left)" -lt 60 ]; then echo "SKIPPED $name: device time"; return; fi
  timeout $(left) python3 benchmarks/gpt.py --timeout 170 --json "$out/$name.json" "$@" 2>&1 | tee "$out/$name.txt" | grep -v '^{'
}
b gpt1b3_b8 --layers 24 --hidden 2048 --heads 16 --batch 8 --systems pstar,eager,fsdp2 --budgets none --profile /tmp/prof
# batch 4 for the 20 GiB budget: at batch 8 the activations alone (~32 GiB, no recomputation yet) exceed 20 GiB
b gpt1b3_b4 --layers 24 --hidden 2048 --heads 16 --batch 4 --systems pstar,eager --budgets 20GiB --profile /tmp/prof
b gpt4b24_b4 --layers 20 --hidden 4096 --heads 32 --batch 4 --systems pstar,eager,fsdp2 --budgets 40GiB --profile /tmp/prof
for f in /tmp/prof/pstar_40GiB.json.gz /tmp/prof/pstar_20GiB.json.gz; do
  [ -f "$f" ] && [ "$(stat -c %s "$f")" -lt 16000000 ] && cp "$f" "$out/" && break
done
echo "elapsed $(( $(date +%s) - start )) s"
for n in gpt1b3_b8 gpt1b3_b4 gpt4b24_b4; do [ -f "$out/$n.txt" ] && sed -n '/^| system/,$p' "$out/$n.txt"; done
