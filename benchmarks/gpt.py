"""
Train-step benchmark of a nanoGPT-style GPT: eager PyTorch, FSDP2 with CPU offload, and pstar-fx, side by side.

    python benchmarks/gpt.py --layers 24 --hidden 2048 --heads 16 --batch 8 --budgets none,20GiB
    python benchmarks/gpt.py --layers 20 --hidden 4096 --heads 32 --batch 4 --budgets 40GiB --profile prof/
    python benchmarks/gpt.py --device cpu --tiny             # a smoke run on the CPU
    python benchmarks/gpt.py --layers 48 --hidden 5120 --heads 40 --batch 4 --systems pstar --init-empty
    python benchmarks/gpt.py --layers 32 --hidden 4096 --heads 32 --batch 4 --gpus 1,2 --systems fsdp2,pstar

The GPT: vocab 50304, tied head, sequence 2048 (--seq), no dropout, biases and LayerNorms as in nanoGPT, random
tokens. Each system runs in its own child process (so memory figures are its own and an out-of-memory in one does not
end the others):
- eager: the model in fp32 on the device, bf16 autocast, fused AdamW. With --checkpoint auto (default) it retries with
  per-block activation checkpointing (torch.utils.checkpoint) when it runs out of memory without; on / off force it.
- fsdp2: `fully_shard` per block and at the root with CPUOffloadPolicy(pin_memory=True) and a bf16
  MixedPrecisionPolicy (fp32 reductions), in a one-process group the script initialises itself (nccl on CUDA, gloo on
  the CPU, where offloading means nothing and is left out); fused AdamW on the host shards. Per-block activation
  checkpointing with --checkpoint on only.
- pstar: px.compile(..., precision bf16, device_memory=each of --budgets), px.AdamW (its moments per --state-dtype).
  With --init-empty the model is built under `px.init_empty(device=device)` after torch.manual_seed(0) (no memory;
  initialised on the device at the first step, into the chunks) instead of on the device and moved to the host; the
  row's first_step_s is then the first step's time with that initialisation in it. --checkpoint on builds it with per-block checkpoints, which the
  remat pass keeps where the budget needs them; without them (auto, off) the remat pass chooses what to recompute
  (the 17.26B GPT on one H200: every block but the last, 8% faster than with the checkpoints; BENCHMARKS.md).
With --gpus N (a list: 1,2), every system runs on N GPUs of this host, one process per GPU launched by torchrun, data
parallel with --batch sequences per GPU: pstar-fx shards its chunks over the ranks (the default process group);
fsdp2 shards per block with and without CPU offload (fsdp2 and fsdp2:offload; on one GPU only with offload);
eager runs on one GPU only. Rows then show the GPUs, tokens/s over all GPUs, TFLOP/s per GPU, the host RSS summed
over ranks, and for every system run at 1 and N GPUs the scaling efficiency: tokens/s on N / (N * tokens/s on 1).
Per run: parameters, median step time over --steps steps after --warmup, TFLOP/s counted as 6*N*tokens + attention
(12 * layers * hidden * seq per token, as nanoGPT's MFU estimate; recompute not counted), peak device memory
(torch.cuda.max_memory_allocated over the timed steps), peak host RSS, bytes moved each way per step, compile time,
and for pstar-fx the plan's predicted peak beside its measured one and the seconds its CPU worker spends per step
updating host-state chunks and waiting for their gradients. --accumulate K splits --batch into K micro-batches per
step (one update; eager and FSDP2 call backward per micro-batch). --no-atomic compiles pstar-fx's step with
atomic=False (host-side updates start during backward; see px.compile). --profile DIR writes a torch.profiler trace of one
pstar-fx step per budget and prints where the step's time goes per stream (compute, H2D, D2H) and on the host.

The largest GPT each system trains: --largest 32,40,48 runs every system (and pstar-fx budget) at each of these layer
counts in turn (same hidden size, heads and batch), stopping at the first that fails (out of GPU memory, out of host
memory: the child is killed, or any error), and prints per system the largest that trained, with its row, and the
first that did not, with its error:

    python benchmarks/gpt.py --hidden 4096 --heads 32 --batch 4 --systems eager,fsdp2 --largest 32,40,48
"""
from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time

_STARTED = time.perf_counter()
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
GiB = 2 ** 30

# -----------------------------------------------------------------------------
# model: nanoGPT without dropout, the reference GPT that `pstar-fx-plan` plans

from pstar_fx.models.gpt import GPTConfig  # noqa: E402  (after ROOT is on the path)
import bench_models as models  # noqa: E402  (benchmarks/, beside this file)
from trace_steps import intersect, length, stream_lanes, union  # noqa: E402  (benchmarks/, beside this file)

IMPORT_SECONDS = time.perf_counter() - _STARTED     # torch's and pstar-fx's imports (not in compile time)


def spec_of(args, layers: int) -> models.ModelSpec:
    return models.ModelSpec(models.Kind(args.model), GPTConfig(vocab=args.vocab, seq=args.seq, layers=layers,
                                                               hidden=args.hidden, heads=args.heads),
                            args.intermediate, args.kv_heads)


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())   # tied weight once


def flops_per_step(n: int, cfg: GPTConfig, batch: int) -> float:
    """6*N*tokens + attention: 12 * layers * hidden * seq flops per token (nanoGPT's MFU estimate)."""
    tokens = batch * cfg.seq
    return 6 * n * tokens + 12 * cfg.layers * cfg.hidden * cfg.seq * tokens


def build(spec: models.ModelSpec, device: torch.device, where: str = "device") -> nn.Module:
    """fp32 model, initialised on the compute device (fast) and moved to the host when where == 'host'."""
    torch.manual_seed(0)
    with torch.device(device):
        model = models.make(spec)
    if where == "host" and device.type == "cuda":
        model = model.cpu()
        torch.cuda.empty_cache()
    return model

# -----------------------------------------------------------------------------
# one system in this process


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def rss_peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024   # Linux reports KiB


def rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def allocator_counts(device) -> dict:
    """The CUDA caching allocator's cumulative counts of device allocations and frees (cudaMalloc / cudaFree, or
    mapping and unmapping with expandable segments) and of retries after a failed allocation (which free the cache)."""
    if device.type != "cuda":
        return {}
    s = torch.cuda.memory_stats(device)
    return {k: s.get(k, 0) for k in ("num_device_alloc", "num_device_free", "num_alloc_retries")}


def timed_steps(step_fn, device, warmup: int, steps: int, at_timed=None, per_step=None, probe=None
                ) -> tuple[list[float], list[float]]:
    """Times of the warm-up steps and of the timed steps; each step's loss goes to stderr (finite: it trained).
    at_timed() is called once, before the first timed step; per_step (a list), when given, receives after every
    step the allocator's counts (allocator_counts) and what probe() returns (a dict), read after the step's sync."""
    warm, times = [], []
    for i in range(warmup + steps):
        if i < 3:
            print(f"host memory of rank {os.environ.get('RANK', 0)} before step {i}: {rss_now() / 2**30:.2f} GiB",
                  file=sys.stderr, flush=True)
        if i == warmup and device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        if i == warmup and at_timed is not None:
            at_timed()
        sync(device)
        t0 = time.perf_counter()
        loss = step_fn()
        sync(device)
        (warm if i < warmup else times).append(time.perf_counter() - t0)
        if per_step is not None:
            per_step.append(dict(allocator_counts(device), **(probe() if probe is not None else {})))
        if os.environ.get("RANK", "0") == "0" and isinstance(loss, torch.Tensor):
            print(f"step {i}: loss {loss.item():.4f}", file=sys.stderr, flush=True)
    return warm, times


def micro_batches(batch, k: int):
    """The step's batch as k micro-batches along dimension 0 (gradient accumulation), as px.compile(accumulate=k)."""
    return zip(*(t.chunk(k) for t in batch))


def torch_step(model, batch, accumulate: int, autocast: str | None):
    """One training step of plain torch (eager, FSDP2): fused AdamW, backward per micro-batch, bf16 autocast on the
    device type `autocast` (None: none). Returns the mean loss."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)

    def step():
        total = 0.0
        for x, y in micro_batches(batch, accumulate):
            with torch.autocast(autocast or "cpu", dtype=torch.bfloat16, enabled=autocast is not None):
                loss = models.loss(model, x, y) / accumulate
            loss.backward()
            total = total + loss.detach()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return total
    return step


def run_eager(cfg, args, device, batch, checkpoint: bool) -> dict:
    model = build(cfg, device)
    models.set_checkpoint(model, checkpoint)
    step = torch_step(model, batch, args.accumulate, autocast=device.type)
    warm, times = timed_steps(step, device, args.warmup, args.steps)
    return dict(n=n_params(model), warm=warm, times=times, h2d=0, d2h=0, checkpoint=checkpoint)


def world() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_group(device) -> None:
    """The process group: torchrun's (several GPUs), or a one-process group (FSDP2 on one GPU)."""
    import torch.distributed as dist
    if dist.is_initialized():
        return
    if world() == 1:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    else:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")


def run_fsdp2(cfg, args, device, batch, offload: bool = True) -> dict:
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    init_group(device)
    model = build(cfg, device)
    models.set_checkpoint(model, args.checkpoint == "on")    # per-block checkpoints only when asked (auto: without)
    kw = dict(mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    if device.type == "cuda" and offload:
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=True)
    for block in models.blocks(model):
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    n = n_params(model)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    step = torch_step(model, batch, args.accumulate, autocast=None)     # the policy casts
    warm, times = timed_steps(step, device, args.warmup, args.steps)
    # estimated, not measured: with offload FSDP2 copies each fp32 shard to the device for forward and again for
    # backward (reshard after forward), and each fp32 gradient back (per rank: its shard)
    moved = (8 * n // world(), 4 * n // world()) if device.type == "cuda" and offload else (0, 0)
    return dict(n=n, warm=warm, times=times, h2d=moved[0], d2h=moved[1], moved_estimated=True)


def host_pool(mem) -> dict | None:
    """The host memory prefaulted while the step was traced: its size, how much was faulted in, in how many seconds
    of the set-up thread, and how much was given back (GiB)."""
    if not mem.pool_bytes:
        return None
    return dict(gib=round(mem.pool_bytes / GiB, 1), touched_gib=round(mem.pool_touched / GiB, 1),
                seconds=round(mem.pool_seconds, 2), given_back_gib=round(mem.pool_given_back / GiB, 1))


def run_pstar(cfg, args, device, batch, budget: str) -> dict:
    import pstar_fx as px
    if world() > 1:
        init_group(device)          # px.compile shards over the default process group
    if args.init_empty:
        torch.manual_seed(0)
        with px.init_empty(device=device):      # nothing allocated; the first step makes the values on the device
            model = models.make(cfg)
    else:
        model = build(cfg, device, where="host")
    models.set_checkpoint(model, args.checkpoint == "on")    # the user's per-block checkpoints (remat may undo them)
    n = n_params(model)
    dm = None if budget == "none" else budget
    opt = px.AdamW(lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, state_dtype=args.state_dtype)
    step = px.compile(model, optimizer=opt, device_memory=dm, precision=args.precision, device=device,
                      chunk_size=args.chunk_size, accumulate=args.accumulate, atomic=not args.no_atomic,
                      host_memory=args.host_memory, offload_dir=args.offload_dir, disk_memory=args.disk_memory,
                      fuse=True if args.fuse else False if args.no_fuse else None,
                      **prefetch_kw(args), **device_updates_kw(args))(models.loss)
    if args.plan_only:       # px.plan of this very step (model, optimizer, budget, ranks), without a store
        report = px.plan(model, models.loss, *batch, world_size=world(), device_memory=dm, precision=args.precision,
                         chunk_size=args.chunk_size, accumulate=args.accumulate, atomic=not args.no_atomic,
                         optimizer=opt, device=device.type, host_memory=args.host_memory,
                         disk_memory=None if not args.offload_dir else args.disk_memory or shutil.disk_usage(args.offload_dir).free,
                         **prefetch_kw(args))
        print(f"plan of rank {os.environ.get('RANK', 0)}:\n{report}", file=sys.stderr, flush=True)
        raise SystemExit(0)
    t0 = time.perf_counter()
    step.lower(*batch)                                       # trace + passes + chunk set-up
    compile_s = time.perf_counter() - t0
    trace_s, passes_s, setup_s = step.summary().compile_seconds
    compile_parts = dict(trace_s=round(trace_s, 2), passes_s=round(passes_s, 2), setup_s=round(setup_s, 2),
                         rest_s=round(compile_s - trace_s - passes_s - setup_s, 2),   # verifying each stage
                         import_s=round(IMPORT_SECONDS, 2),
                         per_pass={name: round(g.seconds, 2) for name, g in step.graphs.items() if name != "traced"},
                         host_arenas=[(round(b / GiB, 1), round(t, 2)) for b, t in step._compiler.store.hostmem.arena_seconds],
                         host_waited_s=round(step._compiler.store.hostmem.waited, 2),
                         host_pool=host_pool(step._compiler.store.hostmem))
    if args.host_threads and step._compiler.store.updates is not None:   # the CPU worker's intra-op threads (an experiment)
        step._compiler.store.updates.threads = args.host_threads
    from pstar_fx.ir.needs import host_bytes, host_setup_bytes
    steady, setup = host_bytes(step.final_graph), host_setup_bytes(step.final_graph)
    print(f"host memory of rank {os.environ.get('RANK', 0)} after set-up: {rss_now() / 2**30:.2f} GiB; the plan's "
          f"store: {setup / 2**30:.2f} GiB at set-up, {steady / 2**30:.2f} GiB in steps; cudaHostRegister refused "
          f"{len(step._compiler.store.hostmem.fallbacks)} buffers {step._compiler.store.hostmem.fallbacks[:3]}", file=sys.stderr,
          flush=True)
    updates = step._compiler.store.updates            # the CPU worker (None: updates run inline)
    start = []                               # its WorkerTime when the timed steps begin

    steps_log = []                           # after each step: allocator counts, the worker's time so far

    def worker_so_far() -> dict:
        w = updates.time
        return dict(updating_s=round(w.updating, 3), waiting_s=round(w.waiting, 3), updates=w.updates)
    warm, times = timed_steps(lambda: step(*batch), device, args.warmup, args.steps, per_step=steps_log,
                              probe=worker_so_far if updates is not None else None,
                              at_timed=lambda: start.append(dataclasses.replace(updates.time)) if updates else None)
    s = step.summary()
    st = step.last_step
    worker = None
    if start:          # per timed step: since the timed steps began, per update, times updates per step
        updates.wait_all()                   # the last step's updates may still be pending
        now, then = updates.time, start[0]
        done = max(now.updates - then.updates, 1)
        per_step = s.trainable_chunks - s.states_on_device - s.states_streamed     # the CPU's updates a step
        worker = dict(updating_s=round((now.updating - then.updating) / done * per_step, 3),
                      waiting_s=round((now.waiting - then.waiting) / done * per_step, 3), updates=per_step)
    out = dict(n=n, warm=warm, times=times, h2d=st.h2d_bytes, d2h=st.d2h_bytes, compile_s=compile_s,
               cpu_worker_per_step=worker, per_step=steps_log, compile_parts=compile_parts,
               init_empty=args.init_empty, atomic=not args.no_atomic, host_threads=args.host_threads,
               prefetch=args.prefetch, device_updates=args.device_updates, undo_updates=args.undo_updates,
               predicted_peak=s.predicted_peak, measured_peak=st.measured_peak, chunks=s.chunks,
               states_on_device=f"{s.states_on_device}/{s.trainable_chunks}", states_on_disk=s.states_on_disk,
               states_streamed=s.states_streamed, states_undo=s.states_undo,
               nodes=s.nodes, fused=s.fused or None,
               budget=s.default_budget or fmt_bytes(s.budget), alloc_retries=st.alloc_retries,
               estimated_s=None if s.estimated_seconds is None else round(s.estimated_seconds, 3))
    if args.profile:
        out["profile"] = profile_step(lambda: step(*batch), device, args.profile, f"pstar_{budget}",
                                      steps=args.profile_steps)
    return out


def prefetch_kw(args) -> dict:
    """px.compile's prefetch from --prefetch (N or 'none'); nothing when the flag is not given (its default)."""
    if args.prefetch is None:
        return {}
    return dict(prefetch=None if args.prefetch == "none" else int(args.prefetch))


def device_updates_kw(args) -> dict:
    """px.compile's private _device_updates and _undo_updates from --device-updates K and --undo-updates K (the cost
    model chooses without them)."""
    kw = {} if args.device_updates is None else dict(_device_updates=args.device_updates)
    return kw if args.undo_updates is None else dict(kw, _undo_updates=args.undo_updates)


def watch(every: float) -> None:
    """Print this process's host memory and where its main thread is, every `every` seconds (a daemon thread)."""
    import threading
    import traceback
    main = threading.main_thread().ident

    def loop():
        t0 = time.perf_counter()
        while True:
            time.sleep(every)
            stack = traceback.extract_stack(sys._current_frames()[main])
            frames = [f for f in stack if "pstar_fx" in f.filename or f.filename.endswith("gpt.py")][-3:] + stack[-1:]
            where = " < ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in reversed(frames))
            print(f"watch rank {os.environ.get('RANK', 0)} {time.perf_counter() - t0:.0f}s: host "
                  f"{rss_now() / 2**30:.1f} GiB, in {where}", file=sys.stderr, flush=True)
    threading.Thread(target=loop, daemon=True).start()


def child(args) -> None:
    if args.watch:
        watch(args.watch)
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", torch.cuda.current_device())))
    if device.type == "cuda":
        torch.cuda.set_device(device)     # set_device, NCCL and FSDP2 want an index
    cfg = spec_of(args, args.layers)
    g = torch.Generator().manual_seed(1)
    batch = tuple(torch.randint(0, cfg.cfg.vocab, (args.batch, cfg.cfg.seq), generator=g).to(device) for _ in range(2))
    system, _, variant = args.child.partition(":")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    try:
        if system == "eager":
            r = run_eager(cfg, args, device, batch, checkpoint=variant == "ckpt")
        elif system == "fsdp2":
            r = run_fsdp2(cfg, args, device, batch, offload=variant == "offload")
        else:
            r = run_pstar(cfg, args, device, batch, variant)
    except torch.OutOfMemoryError as e:
        r = dict(error="out of memory", detail=str(e).splitlines()[0][:200])
    except Exception as e:   # report and let the other systems run
        r = dict(error=type(e).__name__, detail=str(e).splitlines()[0][:300] if str(e) else "")
    r["peak_gpu"] = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    if device.type == "cuda":     # what the allocator held beyond its tensors, and what the process held beyond it
        free, total = torch.cuda.mem_get_info(device)
        r["peak_reserved"] = torch.cuda.max_memory_reserved(device)
        r["outside_torch"] = total - free - torch.cuda.memory_reserved(device)
    r["peak_rss"] = rss_peak()
    r["gpus"] = world()
    import torch.distributed as dist
    if dist.is_initialized():
        if world() > 1 and "error" not in r:
            every = [None] * world()
            dist.all_gather_object(every, (r["peak_rss"], r["peak_gpu"], max(r["times"])))
            r["peak_rss"] = sum(e[0] for e in every)          # the host is shared: every rank's RSS
            r["peak_gpu"] = max((e[1] for e in every if e[1] is not None), default=None)   # per GPU: the largest
        dist.destroy_process_group()
    if int(os.environ.get("RANK", "0")) == 0:
        print("RESULT " + json.dumps(r), flush=True)

# -----------------------------------------------------------------------------
# profile of one step: time busy per stream, overlap, host-side time


def stream_summary(events: list[dict]) -> dict:
    """From a chrome trace: busy time per stream, labelled by what dominates it (kernels: compute, HtoD copies: H2D,
    DtoH copies: D2H), the overlap of copies with compute, and host-side totals (CPU AdamW, waits on the GPU)."""
    lanes, streams = stream_lanes(events)
    host = dict(cpu_adam=0.0, sync_wait=0.0)
    for e in events:
        if e.get("ph") != "X":
            continue
        if e.get("cat") == "cpu_op" and "_fused_adam" in e["name"] and e["dur"] > 200:   # CPU kernels, not launches
            host["cpu_adam"] += e["dur"]
        if e.get("cat") == "cuda_runtime" and e["name"] in ("cudaEventSynchronize", "cudaStreamSynchronize",
                                                           "cudaDeviceSynchronize"):
            host["sync_wait"] += e["dur"]
    ms = 1e-3
    if not lanes:
        return dict(cpu_adam_ms=host["cpu_adam"] * ms)
    t0 = min(iv[0][0] for iv in lanes.values())
    t1 = max(iv[-1][1] for iv in lanes.values())
    copies = union(lanes.get("H2D", []) + lanes.get("D2H", []))
    compute = lanes.get("compute", [])
    return dict(gpu_span_ms=(t1 - t0) * ms,
                busy_ms={k: length(v) * ms for k, v in lanes.items()},
                copies_overlapping_compute_ms=length(intersect(compute, copies)) * ms,
                compute_idle_ms=((t1 - t0) - length(compute)) * ms,
                cpu_adam_ms=host["cpu_adam"] * ms, host_sync_wait_ms=host["sync_wait"] * ms,
                streams=streams)


def profile_step(fn, device, out_dir: str, name: str, steps: int = 1) -> dict:
    """A torch.profiler trace of `steps` calls of fn (each inside record_function('pstar-fx step i')), gzipped into
    out_dir, and its summary (stream_summary; wall_ms: all the calls and the final synchronize)."""
    from torch.profiler import ProfilerActivity, profile, record_function
    os.makedirs(out_dir, exist_ok=True)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    try:   # the CPU worker's thread too (it started before the profiler): torch 2.8 on
        from torch._C._profiler import _ExperimentalConfig
        extra = dict(experimental_config=_ExperimentalConfig(profile_all_threads=True))
    except (ImportError, TypeError):
        extra = {}
    sync(device)
    with profile(activities=acts, **extra) as prof:
        t0 = time.perf_counter()
        for i in range(steps):
            with record_function(f"pstar-fx step {i}"):
                fn()
        sync(device)
        wall = time.perf_counter() - t0
    path = os.path.join(out_dir, f"{name}.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    with open(path, "rb") as f, gzip.open(path + ".gz", "wb") as g:
        g.write(f.read())
    os.remove(path)
    summary = stream_summary(events)
    summary["wall_ms"] = wall * 1e3
    # where the host's time goes: the operators with the most self CPU time (copies, conversions, AdamW, launches)
    ops = sorted(prof.key_averages(), key=lambda a: a.self_cpu_time_total, reverse=True)[:10]
    summary["top_host_ops_ms"] = {a.key: round(a.self_cpu_time_total / 1e3, 1) for a in ops}
    with open(os.path.join(out_dir, f"{name}_streams.json"), "w") as f:
        json.dump(summary, f, indent=1)
    return summary

# -----------------------------------------------------------------------------
# the parent: one child per system, then the table


def fmt_bytes(n) -> str:
    if n is None:
        return "-"
    return f"{n / GiB:.2f} GiB" if n >= GiB / 10 else f"{n / 2 ** 20:.1f} MiB"


def run_child(argv: list[str], label: str, timeout: float, gpus: int = 1) -> dict:
    t0 = time.perf_counter()
    launcher = [sys.executable] if gpus == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                   f"--nproc_per_node={gpus}"]
    try:
        # torchrun sets OMP_NUM_THREADS=1 unless it is set: host-side optimizer steps want the cores of their GPU
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // gpus)))
        p = subprocess.run(launcher + [os.path.abspath(__file__)] + argv, capture_output=True, text=True,
                           timeout=timeout, env=env)
        out = p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        return dict(error=f"timed out after {timeout:.0f} s", log=out)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    r = json.loads(lines[-1][7:]) if lines else dict(error=f"exit {p.returncode}", detail=out.strip()[-300:])
    r["log"] = out
    r["wall_s"] = time.perf_counter() - t0
    return r


def row(label, cfg, args, r) -> dict:
    if "error" in r:
        return dict(system=label, error=r["error"] + (": " + r.get("detail", "") if r.get("detail") else ""))
    med = statistics.median(r["times"])
    n = r["n"]
    tflops = flops_per_step(n, cfg.cfg, args.batch) / med / 1e12        # per GPU: each runs --batch sequences
    gpus = r.get("gpus", 1)
    out = dict(system=label, gpus=gpus, params=f"{n / 1e9:.3f}B" if n >= 1e8 else f"{n / 1e6:.3f}M",
               step_s=round(med, 4), tokens_per_s=round(gpus * args.batch * cfg.cfg.seq / med),
               tflops=round(tflops, 1) if tflops >= 1 else float(f"{tflops:.3g}"),
               peak_gpu=fmt_bytes(r.get("peak_gpu")), peak_rss=fmt_bytes(r.get("peak_rss")),
               h2d=("~" if r.get("moved_estimated") else "") + fmt_bytes(r["h2d"]),
               d2h=("~" if r.get("moved_estimated") else "") + fmt_bytes(r["d2h"]),
               first_steps_s=[round(t, 2) for t in r["warm"]])
    if "compile_s" in r:
        if r.get("init_empty"):
            out["system"] += "+init_empty"
        if not r.get("atomic", True):
            out["system"] += "+no_atomic"
        if r.get("host_threads"):
            out["system"] += f"+{r['host_threads']}threads"
        if r.get("prefetch"):
            out["system"] += f"+prefetch={r['prefetch']}"
        if r.get("fused") and not str(r["fused"]).startswith("none"):    # (fuse=None may leave the step unfused)
            out["system"] += "+fuse"
        out.update(compile_s=round(r["compile_s"], 2), first_step_s=round(r["warm"][0], 2),
                   first_minus_steady_s=round(r["warm"][0] - med, 2),
                   predicted_peak=fmt_bytes(r["predicted_peak"]), measured_peak=fmt_bytes(r["measured_peak"]),
                   states_on_device=r["states_on_device"], states_streamed=r.get("states_streamed"),
                   states_undo=r.get("states_undo"),
                   chunks=r["chunks"], nodes=r["nodes"],
                   cpu_worker_per_step=r.get("cpu_worker_per_step"), budget=r.get("budget"),
                   estimated_s=r.get("estimated_s"), alloc_retries=r.get("alloc_retries"),
                   peak_reserved=fmt_bytes(r.get("peak_reserved")), outside_torch=fmt_bytes(r.get("outside_torch")))
    for k in ("compile_parts", "per_step", "fused"):
        if r.get(k):
            out[k] = r[k]
    if "profile" in r:
        out["profile"] = r["profile"]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip(),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--batch", type=int, default=8, help="sequences per step")
    ap.add_argument("--accumulate", type=int, default=1,
                    help="micro-batches per step: --batch is split into them, gradients accumulate, one update")
    ap.add_argument("--no-atomic", action="store_true",
                    help="pstar: px.compile(atomic=False): host-side updates start during backward")
    ap.add_argument("--prefetch", default=None, metavar="N|none",
                    help="pstar: px.compile(prefetch=N) (nodes a fetch may move earlier; 'none': no limit); default: "
                         "px.compile's")
    ap.add_argument("--device-updates", type=int, default=None, metavar="K",
                    help="pstar (one GPU, atomic or not): stream the updates of K host-placed chunks to the device "
                         "(px.compile's private _device_updates, for measuring the cost model's choice); default: the "
                         "model's")
    ap.add_argument("--undo-updates", type=int, default=None, metavar="K",
                    help="pstar, atomic: update K of the CPU's chunks before the commit with undo buffers (px.compile's "
                         "private _undo_updates; 0: none); default: the model's")
    ap.add_argument("--host-threads", type=int, default=0,
                    help="pstar: intra-op threads of the CPU worker that runs host-side updates (default: pstar-fx's)")
    ap.add_argument("--fuse", action="store_true", help="pstar-fx fuse=True: the compute between chunk operations "
                                                        "runs as compiled regions (default: the device's default)")
    ap.add_argument("--no-fuse", action="store_true", help="pstar-fx fuse=False: every node runs eagerly")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--systems", default="eager,fsdp2,pstar", help="comma-separated: eager, fsdp2, pstar")
    ap.add_argument("--budgets", default="none", help="pstar-fx device_memory values, comma-separated ('none': "
                                                      "unlimited)")
    ap.add_argument("--checkpoint", choices=["auto", "on", "off"], default="auto",
                    help="eager: per-block activation checkpointing (auto: only if it does not fit without); "
                         "pstar: on builds the model with the checkpoints (remat may undo them), else without")
    ap.add_argument("--precision", default="bf16", help="pstar-fx precision")
    ap.add_argument("--host-memory", default=None, help="pstar-fx host_memory (e.g. 100GiB; default: unchecked)")
    ap.add_argument("--offload-dir", default=None, help="pstar-fx offload_dir: a disk tier for the optimizer states "
                    "that do not fit --host-memory")
    ap.add_argument("--disk-memory", default=None, help="pstar-fx disk_memory (default: the free space there)")
    ap.add_argument("--state-dtype", default="fp32", choices=["fp32", "bf16", "int8"],
                    help="pstar-fx's AdamW moments (px.AdamW state_dtype; eager and FSDP2 keep fp32)")
    ap.add_argument("--chunk-size", type=int, default=None, help="pstar-fx elements per chunk (default: its own)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="a tiny shape (2 x 64, 2 heads, 2 x 64 tokens, vocab 512)")
    ap.add_argument("--profile", default=None, metavar="DIR", help="torch.profiler trace of one pstar-fx step")
    ap.add_argument("--profile-steps", type=int, default=1, metavar="N",
                    help="with --profile: N consecutive steps in the trace (each marked 'pstar-fx step i'); the first "
                         "starts with no pending host-side update, the later ones as the timed steps do")
    ap.add_argument("--init-empty", action="store_true",
                    help="pstar-fx: build the model under px.init_empty(device=...), initialised at the first step")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per system run")
    ap.add_argument("--gpus", default="1", help="GPUs per run, a comma-separated list (torchrun, data parallel)")
    ap.add_argument("--plan-only", action="store_true",
                    help="pstar: print the compiled step's plan (host memory, states on the device) and stop")
    ap.add_argument("--watch", type=float, default=0,
                    help="every this many seconds, each process prints its host memory and where it is (diagnosis)")
    ap.add_argument("--json", default=None, help="also write the rows (and the children's logs) to this file")
    ap.add_argument("--largest", default=None, metavar="L1,L2,...",
                    help="find the largest GPT each system trains: these layer counts in turn, up to the first failure")
    ap.add_argument("--model", choices=[k.value for k in models.Kind], default="gpt",
                    help="gpt (the reference GPT) or llama (transformers' LlamaForCausalLM; see benchmarks/bench_models.py)")
    ap.add_argument("--intermediate", type=int, default=0, help="the Llama's MLP width (0: 8/3 x hidden)")
    ap.add_argument("--kv-heads", type=int, default=0, help="the Llama's key/value heads (0: --heads)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.tiny:
        args.layers, args.hidden, args.heads, args.batch, args.seq, args.vocab = 2, 64, 2, 2, 64, 512
    if args.child:
        return child(args)
    assert args.steps >= 5, "the median is over at least 5 steps"
    assert args.batch % args.accumulate == 0, "--batch must split evenly into --accumulate micro-batches"
    assert args.warmup >= 1 or not args.init_empty, "--init-empty reports the first step: --warmup 1 or more"
    cfg = spec_of(args, args.layers)
    passthrough = ["--model", args.model, "--intermediate", str(args.intermediate), "--kv-heads", str(args.kv_heads),
                   "--layers", str(args.layers), "--hidden", str(args.hidden), "--heads", str(args.heads),
                   "--batch", str(args.batch), "--seq", str(args.seq), "--vocab", str(args.vocab),
                   "--warmup", str(args.warmup), "--steps", str(args.steps), "--device", args.device,
                   "--precision", args.precision, "--state-dtype", args.state_dtype, "--checkpoint", args.checkpoint,
                   "--accumulate", str(args.accumulate)]
    if args.chunk_size:
        passthrough += ["--chunk-size", str(args.chunk_size)]
    if args.init_empty:
        passthrough += ["--init-empty"]
    if args.watch:
        passthrough += ["--watch", str(args.watch)]
    if args.plan_only:
        passthrough += ["--plan-only"]
    if args.no_atomic:
        passthrough += ["--no-atomic"]
    if args.fuse:
        passthrough += ["--fuse"]
    if args.no_fuse:
        passthrough += ["--no-fuse"]
    for flag, value in (("--host-memory", args.host_memory), ("--offload-dir", args.offload_dir),
                        ("--disk-memory", args.disk_memory)):
        if value:
            passthrough += [flag, value]
    if args.host_threads:
        passthrough += ["--host-threads", str(args.host_threads)]
    if args.prefetch:
        passthrough += ["--prefetch", args.prefetch]
    if args.device_updates is not None:
        passthrough += ["--device-updates", str(args.device_updates)]
    if args.undo_updates is not None:
        passthrough += ["--undo-updates", str(args.undo_updates)]
    print(f"{cfg}, batch {args.batch} x {args.seq} tokens"
          f"{f' in {args.accumulate} micro-batches' if args.accumulate > 1 else ''}"
          f"{f', pstar-fx moments {args.state_dtype}' if args.state_dtype != 'fp32' else ''}, device {args.device}"
          f"{' (' + torch.cuda.get_device_name() + ')' if args.device.startswith('cuda') else ''}, "
          f"torch {torch.__version__}; TFLOP/s = (6*N*tokens + 12*layers*hidden*seq*tokens) / median step time",
          flush=True)
    rows, logs = [], {}
    if args.largest:
        return largest(args, passthrough)
    for gpus in map(int, args.gpus.split(",")):
        for system in args.systems.split(","):
            if system == "eager" and gpus > 1:
                continue
            variants = {"eager": ["ckpt"] if args.checkpoint == "on" else ["plain"],
                        "fsdp2": ["", "offload"] if gpus > 1 else ["offload"],
                        "pstar": args.budgets.split(",")}[system]
            for v in variants:
                label = f"{system}:{v}" if v else system
                extra = (["--profile", args.profile, "--profile-steps", str(args.profile_steps)]
                         if system == "pstar" and args.profile and gpus == 1 else [])
                r = run_child(passthrough + extra + ["--child", label], label, args.timeout, gpus)
                if system == "eager" and args.checkpoint == "auto" and r.get("error") == "out of memory":
                    label = "eager:ckpt"
                    r = run_child(passthrough + ["--child", label], label, args.timeout)
                logs[f"{label}@{gpus}"] = r.pop("log", "")
                rows.append(row(label, cfg, args, r))
                rows[-1]["gpus"] = gpus
                print(json.dumps(rows[-1]), flush=True)
    for r in rows:      # scaling efficiency: tokens/s on N GPUs / (N * tokens/s on one), same per-GPU batch
        one = [o for o in rows if o["system"] == r["system"] and o["gpus"] == 1 and "tokens_per_s" in o]
        if r["gpus"] > 1 and one and "tokens_per_s" in r:
            r["scaling"] = round(r["tokens_per_s"] / (r["gpus"] * one[0]["tokens_per_s"]), 3)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(config=vars(args), rows=rows, logs=logs), f, indent=1)
    print_table(rows)


def largest(args, passthrough: list[str]) -> None:
    """--largest: per system (and pstar-fx budget), the layer counts in increasing order until the first failure."""
    counts = sorted(int(x) for x in args.largest.split(","))
    rows, logs, found = [], {}, []
    at = passthrough.index("--layers") + 1
    for system in args.systems.split(","):
        variants = {"eager": ["ckpt" if args.checkpoint == "on" else "plain"], "fsdp2": ["offload"],
                    "pstar": args.budgets.split(",")}[system]
        for v in variants:
            label, best, failed = f"{system}:{v}", None, None
            for layers in counts:
                argv = list(passthrough)
                argv[at] = str(layers)
                cfg = spec_of(args, layers)
                r = run_child(argv + ["--child", label], label, args.timeout)
                if system == "eager" and args.checkpoint == "auto" and r.get("error") == "out of memory":
                    r = run_child(argv + ["--child", "eager:ckpt"], "eager:ckpt", args.timeout)
                logs[f"{label}@{layers}L"] = r.pop("log", "")
                rows.append(dict(row(label, cfg, args, r), layers=layers))
                print(json.dumps(rows[-1]), flush=True)
                if "error" in r:
                    failed = rows[-1]
                    break
                best = rows[-1]
            found.append((label, best, failed))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(config=vars(args), rows=rows, logs=logs), f, indent=1)
    print_table(rows)
    print("\n| system | largest that trained | step | TFLOP/s | peak GPU | peak host RSS | first that did not |\n"
          "|---|---|---|---|---|---|---|")
    for label, best, failed in found:
        ok = (f"{best['params']} ({best['layers']} layers) | {best['step_s']} s | {best['tflops']} | {best['peak_gpu']} "
              f"| {best['peak_rss']}" if best else "none of those tried | - | - | - | -")
        bad = f"{failed['layers']} layers: {failed['error'][:120]}" if failed else "all trained"
        print(f"| {label} | {ok} | {bad} |")


def print_table(rows):
    cols = ["system", "gpus", "params", "step_s", "tokens_per_s", "tflops", "scaling", "peak_gpu", "peak_rss",
            "h2d", "d2h", "compile_s", "first_step_s", "predicted_peak", "measured_peak"]
    print("\n| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for r in rows:
        if "error" in r:
            print(f"| {r['system']} | {r['error'][:150]} |")
        else:
            print("| " + " | ".join(str(r.get(c, "-")) for c in cols) + " |")
    for r in rows:
        if "profile" in r:
            print(f"profile {r['system']}: {json.dumps(r['profile'])}")


if __name__ == "__main__":
    main()
