"""One rank of the disk tier's tests on several ranks (tests/distributed/test_disk_ranks.py launches `world` of
these, as torchrun would; gloo on the CPU).

    python tests/support/disk_ranks_worker.py MODE TMP OUT

Every run trains the MLP below on this rank's slice of each global batch (batches are a pure function of the step
index), chunks evicted and fetched again every step (a small device budget), with host_memory set so that about
three of its six chunks' optimizer states go to disk (`offload_dir` TMP/scratch, shared by the ranks).

MODE "train": in order, one process,
  memory     every state in memory: losses, state_dict (gathered), optimizer.state_dict() after STEPS steps
  disk       the same with the disk tier: the same records, the chunks' homes, this rank's scratch directory and
             files (name, sizes, bytes), the disk bytes moved, and whether the directory is gone after the step is
  resumed    a disk-tier step saves a sharded and a plain checkpoint before step SAVE_AT and trains on; a fresh
             disk-tier step and a fresh all-in-memory one, each lowered first (their stores exist, the load writes
             this rank's shards, on disk where they live), load the sharded one and train the rest; a fresh
             disk-tier step loads the plain one; and a fresh disk-tier step takes the state dict and optimizer state
             dict instead (load_state_dict)
  fault      a disk-tier step trains SAVE_AT steps, then every rank fails before the same node of the next step
             (after a disk read was issued; at the commit), the files are read after each failure; then it trains on
MODE "one_fails": a disk-tier step trains SAVE_AT steps; then rank 1 fails before a node of the next step, after a
  disk read was issued and before the commit; rank 0 gets DistributedError. Each rank records its files before and
  after; rank 1 exits with code 3.
Each rank writes OUT.rank{r}: a dict of these, or {"error": (type, message, traceback)}.
"""
from __future__ import annotations

import datetime
import gc
import os
import sys
import traceback

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))

import pstar_fx as px  # noqa: E402
from pstar_fx.ir import Role  # noqa: E402
from pstar_fx.ir.needs import aligned, host_bytes, state_bytes, state_layout  # noqa: E402
from harness import HYPER  # noqa: E402
from models import MLP, mlp_loss  # noqa: E402

CHUNK = 4200            # six chunks of the MLP (its hidden layers each fill one)
DEVICE_MEMORY = 60_000  # a few chunk buffers: chunks are evicted and fetched again every step
BATCH = 8               # the global batch
STEPS, SAVE_AT = 4, 2


def build():
    torch.manual_seed(0)
    return MLP(16, 64, 16, 6)


def global_batch(i: int):
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randn(BATCH, 16, generator=g), torch.randn(BATCH, 16, generator=g)


def local_batch(i: int, rank: int, world: int):
    per = BATCH // world
    return tuple(t[rank * per:(rank + 1) * per] for t in global_batch(i))


def compile_step(**kw):
    return px.compile(build(), optimizer=px.AdamW(**HYPER), device="cpu", precision="fp32", chunk_size=CHUNK,
                      device_memory=DEVICE_MEMORY, **kw)(mlp_loss)


def host_memory_for(rank: int, world: int, on_disk: int = 3) -> int:
    """host_memory (per node, shared by its `world` ranks) that the all-in-memory plan overflows on every rank by
    what `on_disk` chunks' states less the staging buffers free. Ranks after the first pass more, by two chunks'
    states each: alone they would put fewer chunks on disk; the ranks agree on the smallest."""
    ref = compile_step()
    ref.lower(*local_batch(0, rank, world))
    g = ref.final_graph
    s = state_bytes(g.chunks[1], g.settings.precision, world, state_layout(g.settings))
    return world * (host_bytes(g) - (on_disk * s - 2 * aligned(s)) + 1 + (2 * s if rank > 0 else 0))


def train(step, start: int, stop: int, rank: int, world: int) -> list[float]:
    return [float(step(*local_batch(i, rank, world))) for i in range(start, stop)]


def records(step, losses) -> dict:
    return {"losses": losses, "state": step.state_dict(), "optimizer": step.optimizer.state_dict()}


def files(step) -> dict[int, bytes]:
    disk = step._compiler.store.disk
    return {cid: disk.file_bytes(cid) for cid in sorted(disk.sizes)}


def disk_run(step, rank: int, world: int) -> dict:
    out = records(step, train(step, 0, STEPS, rank, world))
    g = step.final_graph
    disk = step._compiler.store.disk
    layout = state_layout(g.settings)
    out.update(
        stage=g.stage, homes=[c.state_home for c in g.chunks], root=disk.root, listing=sorted(os.listdir(disk.root)),
        sizes={cid: os.path.getsize(disk.path(cid)) for cid in disk.sizes},
        shard_bytes={c.id: aligned(state_bytes(c, g.settings.precision, world, layout)) for c in g.chunks},
        files=files(step), read=step.last_step.disk_read_bytes, written=step.last_step.disk_write_bytes,
        summary=str(step.summary()), host_budget=g.settings.host_budget, disk_budget=g.settings.disk_budget)
    return out


def resumed(tmp: str, kw: dict, rank: int, world: int) -> dict:
    sharded, plain = os.path.join(tmp, "ckpt"), os.path.join(tmp, "ckpt-plain")
    first = compile_step(**kw)
    train(first, 0, SAVE_AT, rank, world)
    first.save(sharded)
    first.save(plain, sharded=False)      # (rank 0 writes the gathered values)
    saved_state, saved_optimizer = first.state_dict(), first.optimizer.state_dict()
    out = {"uninterrupted": records(first, train(first, SAVE_AT, STEPS, rank, world))}
    for name, options, path in (("disk", kw, sharded), ("memory", {}, sharded), ("plain", kw, plain)):
        step = compile_step(**options)
        step.lower(*local_batch(SAVE_AT, rank, world))
        step.load(path)
        out[name] = records(step, train(step, SAVE_AT, STEPS, rank, world))
        out[name]["homes"] = [c.state_home for c in step.final_graph.chunks]
    step = compile_step(**kw)
    step.lower(*local_batch(SAVE_AT, rank, world))
    step.load_state_dict(saved_state)
    step.optimizer.load_state_dict(saved_optimizer)
    out["state_dicts"] = records(step, train(step, SAVE_AT, STEPS, rank, world))
    return out


def failing_nodes(step) -> tuple[int, int]:
    """Where to fail: right after the first disk read before the commit, and at the commit."""
    roles = [step.final_graph.ann[n.name].role for n in step.final_graph.nodes]
    commit = roles.index(Role.COMMIT)
    reads = [i for i, r in enumerate(roles) if r is Role.DISK_READ and i < commit]
    assert reads, "no disk read before the commit to fail after"
    return reads[0] + 1, commit


def fault(kw: dict, rank: int, world: int) -> dict:
    step = compile_step(**kw)
    losses = train(step, 0, SAVE_AT, rank, world)
    before = files(step)
    out = {"before": before, "after": []}
    for at in failing_nodes(step):

        def fail(i, node, at=at):
            if i == at:
                raise RuntimeError(f"injected on rank {rank}")
        step._before_node = fail
        try:
            step(*local_batch(SAVE_AT, rank, world))
            out["after"].append(("no error", files(step)))
        except RuntimeError as e:
            out["after"].append((str(e), files(step)))
    step._before_node = None
    out.update(records(step, losses + train(step, SAVE_AT, STEPS, rank, world)))
    return out


def one_fails(tmp: str, kw: dict, rank: int, world: int) -> dict:
    step = compile_step(**kw)
    train(step, 0, SAVE_AT, rank, world)
    out = {"before": files(step)}
    at, _ = failing_nodes(step)
    if rank == 1:
        def fail(i, node):
            if i == at:
                raise RuntimeError(f"injected on rank {rank}")
        step._before_node = fail
    try:
        step(*local_batch(SAVE_AT, rank, world))
        out["raised"] = None
    except (RuntimeError, px.DistributedError) as e:
        out["raised"] = (type(e).__name__, str(e))
    out["after"] = files(step)
    return out


def main(mode: str, tmp: str, out_path: str) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30 if mode == "train" else 15))
    rank, world = dist.get_rank(), dist.get_world_size()
    scratch = os.path.join(tmp, "scratch")
    os.makedirs(scratch, exist_ok=True)
    result: dict = {}
    failed = False
    try:
        kw = dict(host_memory=host_memory_for(rank, world), offload_dir=scratch)
        if mode == "train":
            memory = compile_step()
            result["memory"] = records(memory, train(memory, 0, STEPS, rank, world))
            result["host_memory"] = kw["host_memory"]
            step = compile_step(**kw)
            result["disk"] = disk_run(step, rank, world)
            root = step._compiler.store.disk.root
            del step
            gc.collect()
            result["disk"]["removed"] = not os.path.exists(root)
            result["resumed"] = resumed(tmp, kw, rank, world)
            result["fault"] = fault(kw, rank, world)
        else:
            result = one_fails(tmp, kw, rank, world)
            failed = rank == 1
    except Exception as e:  # noqa: BLE001 - recorded for the test
        result = {"error": (type(e).__name__, str(e), traceback.format_exc())}
        failed = True
    torch.save(result, f"{out_path}.rank{rank}")
    if failed:
        sys.exit(3)       # as a failing training script would; the others must not hang
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
