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

HERE = os.path.dirname(os.path.abspath(__file__))


@dataclass
class Ranks:
    results: list            # what each rank saved
    codes: list[int]         # exit codes
    logs: list[str]          # each rank's output
    wall: float              # seconds from launch to the last exit


def child_env(**extra: str) -> dict:
    """The environment for a Python subprocess of the tests: this one's, with the repository and tests/ put before
    whatever PYTHONPATH already holds (where, on the GPU machine, optree lies), and `extra` set."""
    path = os.pathsep.join(p for p in (os.path.dirname(HERE), HERE, os.environ.get("PYTHONPATH", "")) if p)
    return dict(os.environ, PYTHONPATH=path, **extra)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(worker: str, argv: list, world: int, out: str, timeout: float = 240) -> Ranks:
    """Run `world` ranks of tests/<worker> with argv; every rank must write its result (else the assertion shows
    that rank's output)."""
    env = child_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    t0 = time.monotonic()
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, worker), *map(str, argv)],
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in range(world)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=timeout)[0].decode(errors="replace"))
    finally:
        for p in procs:
            p.kill()
    wall = time.monotonic() - t0
    results = []
    for r in range(world):
        path = f"{out}.rank{r}"
        assert os.path.exists(path), f"rank {r} wrote no result; its output:\n{logs[r][-3000:]}"
        results.append(torch.load(path, weights_only=False))
    return Ranks(results, [p.returncode for p in procs], logs, wall)
