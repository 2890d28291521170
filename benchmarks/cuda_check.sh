#!/usr/bin/env bash
# The CUDA check of issue 2, run on the lent H200 machine (see BENCHMARKS.md for the exact invocation):
#   1. the equivalence, property and precision tests with compiled steps and eager references on the GPU,
#   2. the CPU tests under that machine's torch (2.11): all of them, or those named in $CPU_TESTS,
#   3. the main example on the GPU.
# Logs go to $OUT (or ./cuda_logs when OUT is unset).
set -u
out=${OUT:-cuda_logs}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 -c 'import torch, transformers, hypothesis; print("torch", torch.__version__, "cuda", torch.cuda.is_available(), torch.cuda.get_device_name(0), "transformers", transformers.__version__)' 2>&1 | tee "$out/env.txt"
status=0
PSTAR_TEST_DEVICE=cuda python3 -m pytest tests/test_equivalence.py tests/test_precision.py tests/test_properties.py \
  -q -p no:cacheprovider -rf 2>&1 | tee "$out/cuda_tests.txt" | tail -8 || status=1
PSTAR_TEST_DEVICE=cuda python3 -m pytest tests/test_cuda_runtime.py -q -p no:cacheprovider -rf 2>&1 | tee "$out/cuda_runtime.txt" | tail -3 || status=1
python3 -m pytest ${CPU_TESTS:-tests} -q -p no:cacheprovider -rf 2>&1 | tee "$out/cpu_tests.txt" | tail -5 || status=1
python3 examples/train_gpt.py --device cuda --steps 100 2>&1 | tee "$out/train_gpt_cuda.txt" | tail -12 || status=1
exit $status
