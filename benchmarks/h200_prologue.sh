# Sourced by benchmarks/h200_session8.sh to h200_session11.sh after they set `stages`: logs under
# $OUT (`out`), the environment of every run, the start time, and the machine (GPU, host memory, cores) in
# $out/gpu.txt; and the stages they share (cuda_tests, eager_and_pstar, gpt17, run17).
set -u
out=${OUT:-h200_logs}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
start=$(date +%s)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
free -g | tee -a "$out/gpu.txt"
nproc | tee -a "$out/gpu.txt"

# Stages the session scripts share.
cuda_tests() {   # the runtime's CUDA tests (and any test files given), log in $out/tests_cuda.txt
  PSTAR_TEST_DEVICE=cuda timeout 300 python3 -m pytest tests/test_cuda_runtime.py tests/test_equivalence.py \
      tests/test_residency.py tests/test_host_updates.py tests/test_training_loop.py tests/test_evaluate.py \
      tests/test_param_homes.py tests/test_early_updates.py tests/test_host_memory.py tests/test_writebacks.py \
      "$@" -q -p no:logging -p no:cacheprovider -rf > "$out/tests_cuda.txt" 2>&1
  echo "tests rc $?"; tail -5 "$out/tests_cuda.txt"
  echo "tests: $(( $(date +%s) - start )) s"
}
eager_and_pstar() {   # label, json name, seconds, gpt.py shape flags: eager and pstar-fx at an unlimited budget
  local label=$1 json=$2 secs=$3; shift 3
  timeout "$secs" python3 benchmarks/gpt.py --timeout $(( secs - 10 )) --json "$out/$json" "$@" \
      --systems eager,pstar --budgets none 2>&1 | grep -v '^{' | tail -4
  echo "$label: $(( $(date +%s) - start )) s"
}
# The 17.26B GPT of sessions 8-12 (54 x 5120, 40 heads, per-block checkpoints unless --checkpoint off follows, 8 x
# 2048 tokens, px.init_empty(cuda), 137 GiB budget): gpt17 runs it (name, extra flags: later flags override), run17
# also prints show_run.py's brief summary and the time since the start.
shape17=(--layers 54 --hidden 5120 --heads 40 --batch 8 --checkpoint on --systems pstar --budgets 137GiB --init-empty
         --warmup 1 --steps 5)
gpt17() {   # name, extra flags...
  local name=$1; shift
  timeout 300 python3 benchmarks/gpt.py --timeout 290 --json "$out/$name.json" "${shape17[@]}" "$@" 2>&1 \
      | grep -v '^{' | tail -2
}
run17() {   # name, extra flags...
  gpt17 "$@"
  python3 benchmarks/show_run.py --brief "$out/$1.json"
  echo "$1: $(( $(date +%s) - start )) s"
}
