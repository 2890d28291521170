#!/usr/bin/env bash
# The GPU suite: the GPU tests and every measurement in BENCHMARKS.md, as named stages, on a machine with NVIDIA GPUs
# (the figures are from one H200, 16 cores, 128 GiB host; the x2 stages from two H200s, 32 cores, 256 GiB).
#
#     bash benchmarks/gpu_suite.sh STAGE [STAGE ...]          (from the repository root; `list` names the stages)
#
# Each stage's output goes to $OUT/STAGE.log (OUT defaults to out/gpu), each benchmarks/gpt.py run's rows to
# $OUT/RUN.json, the machine to $OUT/machine.txt; a table of the runs ends the output. Two variables vary a stage:
#   EXTRA   benchmarks/gpt.py flags appended to every gpt.py run of the stages (a later flag wins), for example
#           EXTRA="--profile out/gpu/prof" or EXTRA="--budgets 136GiB,134GiB"
#   TESTS   the pytest arguments of the `tests` stage (default: -m cuda tests); CPU_TESTS those of `cpu_tests`
#   PLAN_EXTRA  pstar-fx-plan flags appended to the plan17b and x2_largest plans (e.g. --checkpoint)
#   THREADS the thread counts of host_fault_threads (default 16,14,16,24,32; the first row is not counted)
#   X2_LAYERS  the layers of the x2_largest GPT (default 57: 35.5B)
# optree, which pstar-fx needs, is installed from wheels in .whl/ when the machine lacks it and has no package index.
set -u
cd "$(dirname "$0")/.."
if [[ $# -eq 0 || $1 == list ]]; then
  grep -E '^    [a-z0-9_]+\)' benchmarks/gpu_suite.sh | sed 's/^    //'
  exit 0
fi
known=$(grep -oE '^    [a-z0-9_]+\)' benchmarks/gpu_suite.sh | tr -d ' )')
for s in "$@"; do
  grep -qx "$s" <<< "$known" || { echo "unknown stage: $s (bash benchmarks/gpu_suite.sh list)"; exit 2; }
done
out=${OUT:-out/gpu}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1   # NVLink multicast off
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
EXTRA=${EXTRA:-}
start=$(date +%s)

if ! python3 -c "import optree" 2>/dev/null; then
  if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/pstar_site \
        .whl/*.whl || exit 2
    export PYTHONPATH=$PYTHONPATH:/tmp/pstar_site
  else
    echo "optree is not installed and .whl/ holds no wheel: pip install optree (or download its wheel into .whl/)"
    exit 2
  fi
fi

{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  free -g; echo "cores: $(nproc)"; uname -r
  python3 -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__)'
  python3 -c 'import transformers; print("transformers", transformers.__version__)' 2>/dev/null
  echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
} > "$out/machine.txt" 2>&1
cat "$out/machine.txt"

elapsed() { echo "$1: $(( $(date +%s) - start )) s since the suite started"; }

gpt() {   # run name, seconds, gpt.py flags...: one benchmarks/gpt.py run, its rows in $out/NAME.json (each system's
          # child process gets the seconds less 10, unless the flags give --timeout)
  local name=$1 secs=$2; shift 2
  # shellcheck disable=SC2086   # EXTRA is a list of flags
  timeout "$secs" python3 benchmarks/gpt.py --timeout $(( secs - 10 )) --json "$out/$name.json" "$@" $EXTRA 2>&1 \
      | grep -v '^{'
  elapsed "$name"
}

# the 17.26B GPT (54 x 5120, 40 heads, 8 x 2048 tokens per step), built under px.init_empty(device="cuda") without
# activation checkpoints (the remat pass chooses what to recompute), at a 137 GiB budget on the 140 GiB H200
shape17=(--layers 54 --hidden 5120 --heads 40 --batch 8 --checkpoint off --systems pstar --budgets 137GiB
         --init-empty --warmup 1 --steps 5)
# transformers' LlamaForCausalLM of Llama-2-13B's shape, built under px.init_empty(device="cuda"), 4 x 2048 tokens
llama13=(--model llama --layers 40 --hidden 5120 --heads 40 --intermediate 13824 --vocab 32000 --batch 4
         --checkpoint off --systems pstar --init-empty --warmup 1 --steps 5)
gpt17() {   # run name, extra flags...: one 17.26B run, then its compile parts, host pool and per-step counters
  local name=$1; shift
  gpt "$name" 330 "${shape17[@]}" "$@"
  python3 benchmarks/show_run.py --brief "$out/$name.json" 2>&1
}
prof17() {  # run name, extra flags...: a 17.26B run with a profiler trace of 3 steps, read step by step
  local name=$1; shift
  gpt17 "$name" --profile "$out/prof_$name" --profile-steps 3 "$@"
  python3 benchmarks/trace_steps.py "$out/prof_$name/pstar_137GiB.json.gz" 2>&1 | grep -v '^   gap'
  python3 benchmarks/trace_steps.py "$out/prof_$name/pstar_137GiB.json.gz" --updates 2>&1
}
plan() {    # the pstar-fx-plan command (as pyproject.toml declares it, without installing the package)
  timeout 200 python3 -c 'import importlib, sys, tomllib
module, function = tomllib.load(open("pyproject.toml", "rb"))["project"]["scripts"]["pstar-fx-plan"].split(":")
sys.exit(getattr(importlib.import_module(module), function)(sys.argv[1:]))' "$@"
}

stage() {
  case $1 in
    # -- tests and checks ---------------------------------------------------------------------------------------
    tests)        # the tests marked cuda, on the GPU (PSTAR_TEST_DEVICE=cuda); each test's outcome by name in
                  # $OUT/tests_each.log, so a run cut by a time limit still says which tests ran
      # shellcheck disable=SC2086
      PSTAR_TEST_DEVICE=cuda timeout 560 python3 -m pytest ${TESTS:--m cuda tests} -vv -p no:cacheprovider -rfEs \
          > "$out/tests_each.log" 2>&1
      echo "pytest exit $?; $(grep -c ' PASSED' "$out/tests_each.log") passed by name"
      grep -E '^(FAILED|ERROR)|[0-9]+ (passed|failed)' "$out/tests_each.log" | tail -30 ;;
    cpu_tests)    # the CPU suite (or the files in CPU_TESTS) under this machine's torch
      # shellcheck disable=SC2086
      timeout 560 python3 -m pytest ${CPU_TESTS:-tests} -q -p no:cacheprovider -rf ;;
    example)      # the README's first command, on the GPU (bf16), 100 steps
      timeout 300 python3 examples/train_gpt.py --device cuda --steps 100 --no-progress --out "$out/example" ;;
    remat)        # a GPT under a budget that fits only with recomputation, against the same GPT unlimited
      timeout 300 python3 benchmarks/remat_check.py --layers 12 --hidden 1024 --heads 16 --batch 8 --seq 1024 ;;
    loss_rows)    # a 128k vocabulary's loss in blocks of rows against whole: least budgets, a tight step, the time
      timeout 300 python3 benchmarks/loss_rows.py --device cuda --precision bf16 --batch 8 --seq 2048 \
          --vocab 128256 --block-mib 256 --layers 4 --hidden 2048 --heads 16 --fuse off ;;

    # -- one GPU: pstar-fx beside eager PyTorch and FSDP2 with CPU offload (benchmarks/gpt.py) -------------------
    gpt1b3)       # 1.3B (24 x 2048), 8 x 2048 tokens, unlimited budget: pstar-fx against eager
      gpt gpt1b3 200 --layers 24 --hidden 2048 --heads 16 --batch 8 --systems eager,pstar --budgets none ;;
    gpt1b3_20gib) # 1.3B at batch 4 and a 20 GiB budget
      gpt gpt1b3_20gib 300 --layers 24 --hidden 2048 --heads 16 --batch 4 --systems eager,pstar --budgets 20GiB ;;
    gpt4b_40gib)  # 4.24B (20 x 4096), 4 x 2048 tokens: eager, FSDP2 offload, pstar-fx at 40 GiB
      gpt gpt4b_40gib 420 --layers 20 --hidden 4096 --heads 32 --batch 4 --systems eager,fsdp2,pstar \
          --budgets 40GiB --timeout 170 ;;
    gpt4b_prefetch) # 4.24B at 40 GiB, pstar-fx: fetches as early as the budget allows against 4 nodes ahead, twice
      for run in default prefetch4 default2 prefetch4_2; do
        flags=(); [[ $run == prefetch4* ]] && flags=(--prefetch 4)
        gpt "gpt4b_$run" 200 --layers 20 --hidden 4096 --heads 32 --batch 4 --systems pstar --budgets 40GiB \
            "${flags[@]}"
      done ;;
    gpt6b7_vs_fsdp2) # 6.66B (32 x 4096), 4 x 2048 tokens, no checkpoints: eager, FSDP2 offload, pstar-fx unlimited
      gpt gpt6b7 420 --layers 32 --hidden 4096 --heads 32 --batch 4 --checkpoint off --systems eager,fsdp2,pstar \
          --budgets none --timeout 200 ;;
    gpt15b)       # 15.4B (48 x 5120), 4 x 2048 tokens, built under px.init_empty, the device's free memory
      gpt gpt15b 560 --layers 48 --hidden 5120 --heads 40 --batch 4 --systems pstar --budgets none --init-empty ;;
    gpt17b)       # 17.26B: atomic=False and atomic at 137 GiB, then atomic=False at the default budget
      gpt17 gpt17b_free --no-atomic
      gpt17 gpt17b_atomic
      gpt17 gpt17b_default_budget --no-atomic --budgets none ;;
    undo)         # the 17.26B GPT atomic at the default budget: undo buffers (updates before the commit) as the cost
                  # model chooses them with host_memory given (the default leaves none on the H200 machine's host),
                  # against none; then the 4.24B GPT at 40 GiB (room by default) with and without
      gpt17 gpt17b_undo --budgets none --host-memory 113GiB
      gpt17 gpt17b_no_undo --budgets none --host-memory 113GiB --undo-updates 0
      gpt gpt4b_undo 200 --layers 20 --hidden 4096 --heads 32 --batch 4 --systems pstar --budgets 40GiB
      gpt gpt4b_no_undo 200 --layers 20 --hidden 4096 --heads 32 --batch 4 --systems pstar --budgets 40GiB \
          --undo-updates 0 ;;
    defaults)     # device_memory=None: the 17.26B GPT atomic under expandable segments and under torch's default
                  # segments, then transformers' Llama-2-13B shape (40 x 5120, 13824, vocab 32000, 4 x 2048 tokens)
      gpt17 gpt17b_default --budgets none --watch 5
      PYTORCH_CUDA_ALLOC_CONF= gpt17 gpt17b_default_segments --budgets none
      [[ ${SKIP_LLAMA:-} ]] || gpt llama13b_default 330 "${llama13[@]}" --budgets none ;;
    llama8b)      # transformers' Llama 8B shape (32 x 4096, 14336, vocab 128256, 4 x 2048): eager, pstar-fx default
      gpt llama8b 420 --model llama --layers 32 --hidden 4096 --heads 32 --intermediate 14336 --vocab 128256 \
          --batch 4 --systems eager,pstar --budgets none --timeout 200 ;;
    llama8b_gqa)  # Llama 3 8B's shape with 8 key/value heads, 4 x 2048: eager, pstar-fx default (on an H200 the remat
                  # pass recomputes 24 of its blocks light: matrix products and attention kept)
      gpt llama8b_gqa 420 --model llama --layers 32 --hidden 4096 --heads 32 --kv-heads 8 --intermediate 14336 \
          --vocab 128256 --batch 4 --systems eager,pstar --budgets none --timeout 200 ;;
    llama13b)     # the Llama-2-13B shape at the default budget, atomic and atomic=False
      gpt llama13b_default 330 "${llama13[@]}" --budgets none
      gpt llama13b_free 330 "${llama13[@]}" --budgets none --no-atomic ;;
    llama13b_b8)  # the Llama-2-13B shape at 8 x 2048 tokens, the default settings (fuse=None: regions where the cost
                  # model estimates the step faster with them, as it does for this plan); one run, within one call
      gpt llama13b_b8 330 "${llama13[@]}" --budgets none --batch 8 ;;
    llama13b_b8_unfused) # the same with fuse=False (its own stage: the two runs need more than a 600 s call)
      gpt llama13b_b8_unfused 330 "${llama13[@]}" --budgets none --batch 8 --no-fuse ;;
    state_rates)  # compressed moments' update rates: the host's native kernel, the GPU's Triton kernel, and the GPU's
      # kernel against the native one bit for bit
      (cd tests/support && timeout 120 python3 device_adam_check.py cuda | tail -3)
      timeout 200 python3 benchmarks/state_update_rate.py --repeat 5
      timeout 200 python3 benchmarks/state_update_rate.py --device cuda --chunk 100663296 --repeat 5 ;;
    int8_30b)     # 30.59B (49 x 7168, 56 heads, 8 x 2048 tokens) with int8 moments, built under px.init_empty
      gpt int8_30b 420 --layers 49 --hidden 7168 --heads 56 --batch 8 --systems pstar --init-empty \
          --state-dtype int8 --warmup 2 --steps 5 ;;
    disk_tier)    # the largest exact GPT with the disk tier: 19.15B (60 x 5120), host_memory 100 GiB, states of the
      # chunks beyond it in ../disk (the machine's one disk); 1 warm-up step
      mkdir -p ../disk
      gpt disk_tier 570 --layers 60 --hidden 5120 --heads 40 --batch 8 --systems pstar --init-empty \
          --host-memory 100GiB --offload-dir ../disk --disk-memory 58GiB --warmup 1 --steps 5 ;;
    gpt17b_native) # 17.26B at the default settings (the plans the native host update's rate chooses), atomic and
                   # atomic=False, each against the plan chosen at torch's route's rate (--no-native-update's)
      gpt17 gpt17b_native_atomic --budgets none
      gpt17 gpt17b_native_free --budgets none --no-atomic
      gpt17 gpt17b_torch_rate_atomic --budgets none --device-updates 42
      gpt17 gpt17b_torch_rate_free --budgets none --no-atomic --device-updates 27 --no-fuse ;;
    gpt17b_ckpt)  # 17.26B built with per-block torch.utils.checkpoint, atomic=False
      gpt17 gpt17b_ckpt --checkpoint on --no-atomic ;;
    gpt17b_budgets) # 17.26B, atomic=False, at 135 and 133 GiB (headroom for the CUDA allocator)
      gpt17 gpt17b_budgets --no-atomic --budgets 135GiB,133GiB ;;
    gpt17b_profile) # 17.26B, atomic and atomic=False, each with a trace of 3 consecutive steps
      prof17 gpt17b_atomic_prof
      prof17 gpt17b_free_prof --no-atomic ;;
    gpt17b_default_profile) # 17.26B at the default budget, atomic: a trace of 2 steps, read for its gaps and its
                  # update chains (trace_steps.py --all), then deleted (about a GiB)
      gpt17 gpt17b_default_prof --budgets none --profile "$out/prof_default" --profile-steps 2
      python3 benchmarks/trace_steps.py "$out/prof_default/pstar_none.json.gz" --all 2>&1
      rm -f "$out/prof_default/"*.json.gz ;;
    gpt17b_threads) # 17.26B with checkpoints, atomic=False, the CPU worker on 14 and on 12 intra-op threads
      gpt17 gpt17b_threads14 --checkpoint on --no-atomic --host-threads 14
      gpt17 gpt17b_threads12 --checkpoint on --no-atomic --host-threads 12 ;;
    gpt17b_prefetch4) # 17.26B with checkpoints, fetches at most 4 nodes ahead: atomic=False, then atomic
      gpt17 gpt17b_pf4_free --checkpoint on --no-atomic --prefetch 4
      gpt17 gpt17b_pf4_atomic --checkpoint on --prefetch 4 ;;
    gpt17b_async) # 17.26B, atomic=False, under torch's cudaMallocAsync allocator instead of expandable segments
      PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync gpt17 gpt17b_async --no-atomic ;;
    gpt17b_watch) # 17.26B, atomic=False, each process printing where it is twice a second (the first step)
      gpt17 gpt17b_watch --no-atomic --watch 0.5
      python3 -c "import json, sys; print('\n'.join(l for v in json.load(open(sys.argv[1]))['logs'].values()
          for l in v.splitlines() if l.startswith(('watch', 'step ', 'host memory'))))" "$out/gpt17b_watch.json" ;;
    plan17b)      # the plan of the 17.26B run, on this machine (host memory it needs, estimated step)
      # shellcheck disable=SC2086
      plan --layers 54 --d-model 5120 --heads 40 --batch 8 --device-memory 137GiB --no-atomic ${PLAN_EXTRA:-} ;;
    largest)      # the largest GPT eager PyTorch and FSDP2 offload train (d=4096, 4 x 2048 tokens, checkpoints)
      gpt largest 560 --hidden 4096 --heads 32 --batch 4 --checkpoint on --systems eager,fsdp2 --largest 32,40,48 \
          --timeout 200 ;;

    # -- what the runs above are made of ------------------------------------------------------------------------
    host_pin_and_update) # pinning 16 GiB five ways; the CPU worker's Adam update in several threads and blocks
      timeout 300 python3 benchmarks/host_pin_and_update.py --json "$out/host_pin_and_update.json" ;;
    host_page_faults)    # 100 GiB faulted in by page mode, and the Adam update on huge and 4 KiB pages
      timeout 300 python3 benchmarks/host_page_faults.py --json "$out/host_page_faults.json" ;;
    host_fault_threads)  # fresh pages faulted in with THREADS threads in turn (run first on a fresh machine)
      timeout 300 python3 benchmarks/host_page_faults.py --scaling "${THREADS:-16,14,16,24,32}" --gib 18 ;;
    host_retouch)        # 32 GiB faulted in three times in one process (is a fresh machine's first touch slower?)
      timeout 200 python3 benchmarks/host_page_faults.py --gib 32 --step-gib 32 --modes huge,huge,huge \
          --adam-numel 0 ;;
    compile_profile)     # the 17.26B plan pass by pass, the trace and the slowest passes under cProfile
      timeout 300 python3 benchmarks/profile_passes.py --layers 54 --d-model 5120 --heads 40 --batch 8 \
          --device-memory 137GiB --no-atomic --profile trace,remat,place_optimizer ;;
    setup_profile)       # where the 17.26B first compile's set-up goes (after its host memory was faulted in once)
      timeout 300 python3 benchmarks/profile_setup.py --layers 54 --d-model 5120 --heads 40 --batch 8 \
          --device-memory 137GiB --no-atomic ;;

    # -- two GPUs of one host (torchrun, data parallel) ---------------------------------------------------------
    x2_tests)     # the tests marked multi_gpu (NCCL data parallel against one process)
      PSTAR_TEST_DEVICE=cuda timeout 400 python3 -m pytest -m multi_gpu tests -q -p no:cacheprovider -rf ;;
    x2_gpt1b3)    # 1.3B on 1 and 2 GPUs, pstar-fx, unlimited budget
      gpt x2_gpt1b3 300 --layers 24 --hidden 2048 --heads 16 --batch 8 --gpus 1,2 --systems pstar --budgets none ;;
    x2)           # 6.66B on 1 and 2 GPUs: FSDP2 (with and without CPU offload) and pstar-fx, scaling efficiency
      gpt x2_gpt6b7 560 --layers 32 --hidden 4096 --heads 32 --batch 4 --gpus 1,2 --systems fsdp2,pstar \
          --budgets none --timeout 150 ;;
    x2_largest)   # 35.5B (57 x 7168) on both GPUs and their host: the plan first, the run only if it fits
      free -g; echo "locked memory limit: $(ulimit -l)"
      # shellcheck disable=SC2086
      plan --layers "${X2_LAYERS:-57}" --d-model 7168 --heads 56 --batch 1 --checkpoint --world-size 2 \
          --device-memory 134GiB --host-memory 236GiB ${PLAN_EXTRA:-} | tee "$out/x2_largest_plan.txt"
      grep -q "verdict: FITS" "$out/x2_largest_plan.txt" || { echo "the plan says it does not fit: not run"; return; }
      (while sleep 5; do echo "$(( $(date +%s) - start )) s $(free -g | grep Mem)"; done) > "$out/x2_memory.txt" &
      local watcher=$!
      gpt x2_largest 560 --layers "${X2_LAYERS:-57}" --hidden 7168 --heads 56 --batch 1 --gpus 2 --systems pstar \
          --budgets 134GiB --checkpoint on --init-empty --warmup 1 --steps 5
      kill "$watcher"
      sort -k5 -n "$out/x2_memory.txt" | tail -1 | sed 's/^/most host memory in use (free -g): /' ;;
    x2_b4)        # 35.5B on both GPUs at 4 x 2048 tokens a GPU, atomic=False (each rank's host shards updated during
                  # backward): the plan first (on the CPU machine: 360 TFLOP/s a GPU, 5.079 s, host 235.5 of 236 GiB),
                  # the run only if it fits
      # shellcheck disable=SC2086
      plan --layers "${X2_LAYERS:-57}" --d-model 7168 --heads 56 --batch 4 --checkpoint --world-size 2 --no-atomic \
          --device-memory 134GiB --host-memory 236GiB ${PLAN_EXTRA:-} | tee "$out/x2_b4_plan.txt"
      grep -q "verdict: FITS" "$out/x2_b4_plan.txt" || { echo "the plan says it does not fit: not run"; return; }
      gpt x2_b4 560 --layers "${X2_LAYERS:-57}" --hidden 7168 --heads 56 --batch 4 --gpus 2 --systems pstar \
          --budgets 134GiB --host-memory 236GiB --checkpoint on --init-empty --no-atomic --warmup 1 --steps 4 ;;
  esac
}

status=0
for s in "$@"; do
  echo "== $s"
  stage "$s" 2>&1 | tee "$out/$s.log"
  [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
  echo "== $s done: $(( $(date +%s) - start )) s since the suite started"
done
mapfile -t jsons < <(ls -tr "$out"/*.json 2>/dev/null | grep -v 'host_')
if [[ ${#jsons[@]} -gt 0 ]]; then
  echo "== runs"
  python3 benchmarks/show_run.py --table "${jsons[@]}"
fi
exit $status
