"""Host-side micro-benchmarks behind two parts of a large run: setting up pinned host memory, and the CPU worker's
Adam update. Prints one line per measurement (and writes them as JSON with --json).

    python3 benchmarks/host_pin_and_update.py [--pin-gib 16] [--chunk 100663296] [--json out.json]

Pinning: each variant makes --pin-gib of host memory in 1 GiB buffers, times it, and frees it again:
  zeros+register  torch.zeros, then cudaHostRegister each buffer (how host buffers were first made)
  empty+register  torch.empty, cudaHostRegister (which faults the pages in), then zero_
  register x4     the same as empty+register with four threads registering at once; `gil` is how many times the
                  main thread's Python loop ran meanwhile (near zero: the binding holds the GIL)
  mapped+register pstar_fx.runtime.host_memory.zeroed (an anonymous mapping advised to use transparent huge pages,
                  touched on torch's threads), then cudaHostRegister; huge_gib: AnonHugePages after the touch
  cudaHostAlloc   torch.empty(pin_memory=True) (1 GiB: a power of two, so nothing is rounded up), then zero_
Adam: one mixed-precision host-side update (bf16 parameters and gradient, fp32 master and moments) of a chunk of
--chunk elements with `pstar_fx.runtime.adam.host_step`, in Gparam/s (median of 3 after one warm-up):
  omp T, block B  one call on a thread with T intra-op threads, in blocks of B elements
  split T         T Python threads with one intra-op thread each, each updating its own contiguous run of blocks
"""
from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import torch

from pstar_fx.optim import AdamConfig
from pstar_fx.runtime.adam import HOST_BLOCK, host_step
from pstar_fx.runtime.host_memory import zeroed

GIB = 1 << 30


def _register(t: torch.Tensor) -> None:
    err = int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0))
    assert err == 0, err


def _anon_huge_gib() -> float:
    """The host's memory in transparent huge pages now (AnonHugePages), in GiB."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) / (1 << 20)
    return 0.0


def _unregister(bufs) -> None:
    for t in bufs:
        torch.cuda.cudart().cudaHostUnregister(t.data_ptr())


def pinning(gib: int) -> list[dict]:
    n = GIB // 4
    rows = []

    def row(name, **kw):
        rows.append({"what": "pin", "variant": name, "gib": gib, **kw})
        print(f"pin {name:>15s}: " + ", ".join(f"{k} {v:.2f} s" if isinstance(v, float) else f"{k} {v}"
                                                for k, v in kw.items()), flush=True)

    t0 = time.perf_counter()
    bufs = [torch.zeros(n) for _ in range(gib)]
    t1 = time.perf_counter()
    for b in bufs:
        _register(b)
    t2 = time.perf_counter()
    _unregister(bufs)
    t3 = time.perf_counter()
    row("zeros+register", zeros=t1 - t0, register=t2 - t1, unregister=t3 - t2, total=t2 - t0)
    del bufs

    t0 = time.perf_counter()
    bufs = [torch.empty(n) for _ in range(gib)]
    for b in bufs:
        _register(b)
    t1 = time.perf_counter()
    for b in bufs:
        b.zero_()
    t2 = time.perf_counter()
    _unregister(bufs)
    row("empty+register", register=t1 - t0, zero=t2 - t1, total=t2 - t0)
    del bufs

    t0 = time.perf_counter()
    bufs = [torch.empty(n) for _ in range(gib)]
    done = []

    def reg(part):
        for b in part:
            _register(b)
        done.append(1)
    threads = [threading.Thread(target=reg, args=(bufs[i::4],)) for i in range(4)]
    for th in threads:
        th.start()
    spins = 0
    while len(done) < 4:
        spins += 1
    for th in threads:
        th.join()
    t1 = time.perf_counter()
    for b in bufs:
        b.zero_()
    t2 = time.perf_counter()
    _unregister(bufs)
    row("register x4", register=t1 - t0, zero=t2 - t1, total=t2 - t0, gil=spins)
    del bufs

    t0 = time.perf_counter()
    bufs = [zeroed(n, torch.float32) for _ in range(gib)]
    t1 = time.perf_counter()
    huge = _anon_huge_gib()
    for b in bufs:
        _register(b)
    t2 = time.perf_counter()
    _unregister(bufs)
    row("mapped+register", touch=t1 - t0, register=t2 - t1, total=t2 - t0, huge_gib=round(huge, 1))
    del bufs

    t0 = time.perf_counter()
    bufs = [torch.empty(n, pin_memory=True) for _ in range(gib)]
    t1 = time.perf_counter()
    for b in bufs:
        b.zero_()
    t2 = time.perf_counter()
    row("cudaHostAlloc", alloc=t1 - t0, zero=t2 - t1, total=t2 - t0)
    del bufs
    return rows


ADAM = AdamConfig(lr=1e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, decoupled=True, maximize=False,
                  fused=None)


def median_seconds(run, reps: int = 3, warm: int = 1) -> float:
    """The median time of `reps` calls of run(), after `warm` warm-up calls."""
    for _ in range(warm):
        run()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def on_thread(threads: int, fn) -> None:
    """fn() on a thread of its own with `threads` intra-op threads (as the CPU worker runs an update)."""
    th = threading.Thread(target=lambda: (torch.set_num_threads(threads), fn()))
    th.start()
    th.join()


def adam(numel: int, reps: int = 3) -> list[dict]:
    cfg = ADAM
    g = torch.Generator().manual_seed(0)
    master = torch.randn(numel, generator=g)
    param = master.to(torch.bfloat16)
    grad = (torch.randn(numel, generator=g) * 1e-3).to(torch.bfloat16)
    m, v = torch.zeros(numel), torch.zeros(numel)
    step = torch.zeros(())
    rows = []

    def timed(name, run):
        s = median_seconds(run, reps)
        rows.append({"what": "adam", "variant": name, "numel": numel, "seconds": s, "gparams": numel / s / 1e9})
        print(f"adam {name:>16s}: {s * 1e3:7.1f} ms, {numel / s / 1e9:5.2f} Gparam/s", flush=True)

    def omp(threads, block):
        return lambda: on_thread(threads, lambda: host_step(cfg, param, grad, m, v, step, master=master,
                                                             block=block))

    def split(threads):
        blocks = -(-numel // HOST_BLOCK)
        bounds = [min(numel, HOST_BLOCK * (blocks * i // threads)) for i in range(threads + 1)]

        def run():
            def body(lo, hi):
                torch.set_num_threads(1)
                # the step count is shared: each part counts from the same value (incremented once below)
                host_step(cfg, param[lo:hi], grad[lo:hi], m[lo:hi], v[lo:hi], step.clone(), master=master[lo:hi])
            ths = [threading.Thread(target=body, args=(bounds[i], bounds[i + 1])) for i in range(threads)]
            for th in ths:
                th.start()
            for th in ths:
                th.join()
            step.add_(1)
        return run

    cores = torch.get_num_threads()
    for threads in sorted({cores, max(1, cores - 2), max(1, cores - 4), max(1, cores // 2)}, reverse=True):
        timed(f"omp {threads}, block 1M", omp(threads, HOST_BLOCK))
    for block in (2, 4, 8):
        timed(f"omp {max(1, cores - 2)}, block {block}M", omp(max(1, cores - 2), block * HOST_BLOCK))
    for threads in sorted({cores, max(1, cores - 2), max(1, cores // 2)}, reverse=True):
        timed(f"split {threads}", split(threads))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pin-gib", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=96 * HOST_BLOCK, help="elements of the updated chunk")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = []
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            print("transparent huge pages:", f.read().strip())
    except OSError:
        print("transparent huge pages: unknown")
    if torch.cuda.is_available() and args.pin_gib > 0:
        torch.cuda.init()
        rows += pinning(args.pin_gib)
    rows += adam(args.chunk)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
