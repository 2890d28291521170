"""Launching test ranks as torchrun would: one subprocess per rank of a worker script, with RANK, LOCAL_RANK,
WORLD_SIZE, MASTER_ADDR and MASTER_PORT set (gloo on the CPU; NCCL where a worker is told to use CUDA). Each rank
writes its result with torch.save to `<out>.rank<r>`."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import torch

SUPPORT = os.path.dirname(os.path.abspath(__file__))      # tests/support: the worker scripts and shared helpers
ROOT = os.path.dirname(os.path.dirname(SUPPORT))          # the repository


@dataclass
class Ranks:
    results: list            # what each rank saved
    codes: list[int]         # exit codes
    logs: list[str]          # each rank's output
    wall: float              # seconds from launch to the last exit


def child_env(**extra: str) -> dict:
    """The environment for a Python subprocess of the tests: this one's, with the repository and tests/support put
    before whatever PYTHONPATH already holds (where, on the GPU machine, optree lies), and `extra` set."""
    path = os.pathsep.join(p for p in (ROOT, SUPPORT, os.environ.get("PYTHONPATH", "")) if p)
    return dict(os.environ, PYTHONPATH=path, **extra)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(worker: str, argv: list, world: int, out: str, timeout: float = 240, failing: tuple[int, ...] = ()
              ) -> Ranks:
    """Run `world` ranks of tests/support/<worker> with argv. Every rank must write its result and exit with code 0,
    except those in `failing`, which must exit with another; else the assertion shows the rank's output (its log,
    kept in `<out>.rank<r>.log`: a file, not a pipe, so that no rank blocks on a full pipe while another is waited
    for). A launch that outlives `timeout` seconds is killed and the assertion shows every rank's output."""
    env = child_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    t0 = time.monotonic()
    files = [open(f"{out}.rank{r}.log", "wb+") for r in range(world)]
    try:
        procs = [subprocess.Popen([sys.executable, os.path.join(SUPPORT, worker), *map(str, argv)],
                                  env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), stdout=files[r],
                                  stderr=subprocess.STDOUT) for r in range(world)]
        timed_out = False
        try:
            for p in procs:
                p.wait(timeout=max(0.0, t0 + timeout - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            for p in procs:
                p.kill()
                p.wait()
        wall = time.monotonic() - t0
        logs = []
        for f in files:
            f.seek(0)
            logs.append(f.read().decode(errors="replace"))
    finally:
        for f in files:
            f.close()
    codes = [p.returncode for p in procs]
    results = [torch.load(f"{out}.rank{r}", weights_only=False) if os.path.exists(f"{out}.rank{r}") else None
               for r in range(world)]

    def output(r: int) -> str:
        error = results[r].get("error") if isinstance(results[r], dict) else None
        recorded = "" if error is None else f"\nits recorded error:\n{error[-1]}"
        return f"rank {r} (exit code {codes[r]}) wrote:\n{logs[r][-3000:]}{recorded}"

    assert not timed_out, (f"the ranks did not finish within {timeout} s and were killed:\n"
                           + "\n".join(output(r) for r in range(world)))
    for r in range(world):
        assert (codes[r] != 0) == (r in failing), (
            f"rank {r} exited with code {codes[r]}, expected {'non-zero' if r in failing else 0}; " + output(r))
        assert results[r] is not None, f"rank {r} wrote no result; " + output(r)
    return Ranks(results, codes, logs, wall)
