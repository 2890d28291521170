# Sourced by benchmarks/h200_session8.sh, h200_session9.sh and h200_session10.sh after they set `stages`: logs under
# $OUT (`out`), the environment of every run, the start time, and the machine (GPU, host memory, cores) in
# $out/gpu.txt.
set -u
out=${OUT:-h200_logs}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
start=$(date +%s)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
free -g | tee -a "$out/gpu.txt"
nproc | tee -a "$out/gpu.txt"
