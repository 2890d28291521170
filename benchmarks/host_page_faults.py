"""How fast host memory is made (its pages faulted in) as the machine fills, with and without transparent huge pages,
and what the page size costs the CPU worker's Adam update. Behind "Host memory set-up" in docs/measurements.md.

    python3 benchmarks/host_page_faults.py [--gib 100] [--step-gib 10] [--json out.json]

touch: for each page mode in turn, one anonymous mapping of --gib is made and its pages faulted in --step-gib at a
time (zero_ on torch's intra-op threads, as pstar_fx.runtime.host_memory.zeroed does); one line per piece gives the
rate and the host's free memory after it, so a rate that falls as memory fills shows. Modes:
  huge     madvise(MADV_HUGEPAGE) (what zeroed() does)
  default  no advice (the kernel's THP setting decides)
  small    madvise(MADV_NOHUGEPAGE): 4 KiB pages
  huge     again, last: a fresh machine's first touch and a later one apart
scaling (--scaling T1,T2,...): fresh pages faulted in with each thread count in turn, one region of --gib each,
while the main thread runs a Python loop: the fault rate, and the loop's speed against its speed alone.
adam: one mixed-precision host-side update (pstar_fx.runtime.adam.host_step, 14 intra-op threads) of a 400M-element
chunk whose fp32 master and moments lie in huge-page or in 4 KiB-page memory, median of 3 after a warm-up.
"""
from __future__ import annotations

import argparse
import json
import mmap
import threading
import time

import torch

from pstar_fx.runtime.adam import host_step

from host_pin_and_update import ADAM, median_seconds, on_thread  # benchmarks/, beside this file

GIB = 1 << 30
ADVICE = {"huge": getattr(mmap, "MADV_HUGEPAGE", None), "default": None,
          "small": getattr(mmap, "MADV_NOHUGEPAGE", None)}


def meminfo(key: str) -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / (1 << 20)
    return float("nan")


def mapping(nbytes: int, mode: str) -> tuple[mmap.mmap, torch.Tensor]:
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if ADVICE[mode] is not None:
        m.madvise(ADVICE[mode])
    return m, torch.frombuffer(m, dtype=torch.uint8, count=nbytes)


def touch(gib: int, step_gib: int, mode: str, rows: list) -> None:
    m, t = mapping(gib * GIB, mode)
    total = 0.0
    for lo in range(0, gib, step_gib):
        hi = min(gib, lo + step_gib)
        t0 = time.perf_counter()
        t[lo * GIB:hi * GIB].zero_()
        dt = time.perf_counter() - t0
        total += dt
        row = dict(what="touch", mode=mode, gib=hi, seconds=dt, gbps=(hi - lo) * GIB / dt / 1e9,
                   free_gib=meminfo("MemFree"), huge_gib=meminfo("AnonHugePages"))
        rows.append(row)
        print(f"touch {mode:>7s} {lo:4d}-{hi:<4d} GiB: {dt:6.2f} s, {row['gbps']:5.1f} GB/s; free "
              f"{row['free_gib']:6.1f} GiB, huge pages {row['huge_gib']:6.1f} GiB", flush=True)
    print(f"touch {mode:>7s} all {gib} GiB: {total:.2f} s, {gib * GIB / total / 1e9:.1f} GB/s", flush=True)
    del t
    m.close()


def _python_work(seconds: float) -> float:
    """Rounds per second of a pure-Python loop that makes and drops objects (as tracing does): the main thread's
    speed while the set-up thread faults pages in."""
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        junk = [{"i": i, "s": str(i)} for i in range(2000)]
        del junk
        n += 1
    return n / (time.perf_counter() - t0)


def scaling(threads_list: list[int], gib: int, rows: list) -> None:
    """Fresh pages faulted in by a thread with T intra-op threads, one region of --gib per T in turn (each region
    memory this process has not touched), while the main thread runs a Python loop: the fault rate and the loop's
    speed against its speed alone."""
    alone = _python_work(2.0)
    print(f"python loop alone: {alone:.1f} rounds/s", flush=True)
    keep = []
    for threads in threads_list:
        m, t = mapping(gib * GIB, "huge")
        keep.append((m, t))
        box = {}

        def body():
            torch.set_num_threads(threads)
            t0 = time.perf_counter()
            for lo in range(0, gib, 1):
                t[lo * GIB:(lo + 1) * GIB].zero_()
            box["s"] = time.perf_counter() - t0
        th = threading.Thread(target=body)
        th.start()
        loops, t0 = 0.0, time.perf_counter()
        while th.is_alive():
            loops += _python_work(0.5) * 0.5
        th.join()
        wall = time.perf_counter() - t0
        row = dict(what="scaling", threads=threads, gib=gib, seconds=box["s"], gbps=gib * GIB / box["s"] / 1e9,
                   python_speed=loops / wall / alone, free_gib=meminfo("MemFree"))
        rows.append(row)
        print(f"fault {gib} GiB with {threads:2d} threads: {box['s']:6.2f} s, {row['gbps']:5.1f} GB/s; the Python "
              f"loop ran at {row['python_speed']:.2f} of its speed alone; free {row['free_gib']:.1f} GiB", flush=True)


def adam(numel: int, mode: str, rows: list, reps: int = 3, threads: int = 14) -> None:
    m_, states = mapping(3 * numel * 4, mode)
    states = states.view(torch.float32)
    states.zero_()
    master, m, v = states[:numel], states[numel:2 * numel], states[2 * numel:]
    g = torch.Generator().manual_seed(0)
    master.copy_(torch.randn(numel, generator=g))
    param = master.to(torch.bfloat16)
    grad = (torch.randn(numel, generator=g) * 1e-3).to(torch.bfloat16)
    step = torch.zeros(())
    s = median_seconds(lambda: on_thread(threads, lambda: host_step(ADAM, param, grad, m, v, step, master=master)),
                       reps)
    rows.append(dict(what="adam", mode=mode, numel=numel, seconds=s, gparams=numel / s / 1e9))
    print(f"adam {mode:>7s} pages: {s * 1e3:7.1f} ms, {numel / s / 1e9:5.2f} Gparam/s", flush=True)
    # the mapping is unmapped when its tensors are freed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=int, default=100)
    ap.add_argument("--step-gib", type=int, default=10)
    ap.add_argument("--modes", default="huge,default,small,huge")
    ap.add_argument("--adam-numel", type=int, default=400_000_000)
    ap.add_argument("--scaling", default=None, metavar="T1,T2,...",
                    help="instead: fresh pages faulted in with T1, T2, ... threads (--gib each) beside a Python loop")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.scaling:
        rows: list = []
        scaling([int(x) for x in args.scaling.split(",")], args.gib, rows)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
        return
    for f in ("enabled", "defrag"):
        try:
            with open(f"/sys/kernel/mm/transparent_hugepage/{f}") as fh:
                print(f"transparent_hugepage/{f}: {fh.read().strip()}")
        except OSError:
            pass
    rows: list = []
    for mode in args.modes.split(","):
        touch(args.gib, args.step_gib, mode, rows)
    if args.adam_numel:
        for mode in ("huge", "small", "huge"):
            adam(args.adam_numel, mode, rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
