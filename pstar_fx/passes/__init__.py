"""The pass pipeline: an explicit list of pure `TrainGraph -> TrainGraph` functions, each checked by the verifier.

    canonicalize -> loss_rows -> assign_chunks -> liveness -> remat -> place_optimizer -> schedule (-> shard, with 2+ ranks)
    (-> fuse_regions, with fuse=True; fuse_if_faster, which keeps it only where the cost model estimates it faster,
    with fuse_auto)
"""
from __future__ import annotations

import functools
import time

from ..cost import H200, Machine
from ..ir.graph import TrainGraph
from .assign_chunks import assign_chunks
from .canonicalize import canonicalize
from .liveness import liveness
from .loss_rows import loss_rows
from .place_optimizer import place_optimizer
from .regions import fuse_if_faster, fuse_regions
from .remat import remat
from .schedule import schedule
from .shard import collectives, shard
from .verify import VerificationError, verify

_remat = remat              # pipeline's keyword `remat` shadows the pass


def pipeline(*, chunk_size=None, layout=None, prefetch: int | None = None, train: bool = True, remat: bool = True,
             world: int = 1, fuse: bool = False, fuse_auto: bool = False, machine: Machine = H200):
    """The passes in order, with their settings bound as keyword arguments. A forward-only (evaluation) graph has
    no optimizer to place: its "optimizer_placed" stage is the liveness stage passed through (and nothing to
    recompute). remat=False: nothing is recomputed (the stage is passed through). With more than one rank the
    shard pass follows the schedule. fuse=True: the compute between chunk operations is grouped into regions, each
    run as compiled code (stage "fused", last); with fuse_auto (px.compile's fuse=None where fusing is the default)
    only where the cost model estimates the step faster so. machine: the rates remat, place_optimizer and
    fuse_if_faster weigh their choices at (px.plan's machine; for a compiled step
    the preset of its GPU, api/options.resolve_machine)."""
    return [
        canonicalize,
        loss_rows,
        functools.partial(assign_chunks, chunk_size=chunk_size, layout=layout),
        liveness,
        functools.partial(_remat, enabled=remat, machine=machine),
        functools.partial(place_optimizer, machine=machine) if train else _no_optimizer,
        functools.partial(schedule, prefetch=prefetch),
    ] + ([shard] if world > 1 else []) + \
        ([functools.partial(fuse_if_faster, machine=machine) if fuse_auto else fuse_regions] if fuse else [])


def _no_optimizer(g: TrainGraph) -> TrainGraph:
    """Forward only: nothing to update; the stage is stamped so every pipeline has the same stages."""
    return g.evolve(stage="optimizer_placed", made_by="no optimizer (forward only)")


def run_passes(g: TrainGraph, passes, after=None) -> list[TrainGraph]:
    """Run each pass, stamp its output with the time it took, verify it; return every stage, the input first.
    `after(stage)`, when given, sees each verified stage as soon as it is made (the compiler starts setting up host
    memory once the optimizer is placed)."""
    stages = [verify(g)]
    for p in passes:
        t0 = time.perf_counter()
        out = p(stages[-1])
        out = out.evolve(seconds=time.perf_counter() - t0)
        stages.append(verify(out))
        if after is not None:
            after(stages[-1])
    return stages


__all__ = ["assign_chunks", "canonicalize", "fuse_if_faster", "fuse_regions", "liveness", "loss_rows",
           "place_optimizer", "remat",
           "schedule", "shard",
           "collectives", "verify", "pipeline",
           "run_passes", "VerificationError"]
