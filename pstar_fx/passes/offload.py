"""The disk tier: which chunks' optimizer states live in files of `offload_dir` (StateHome.DISK), and the nodes that
move them. A helper of place_optimizer, which calls `offload_states` on the placement it keeps.

With a host budget (Settings.host_budget), the host must hold every host-placed chunk's states (m, v and the fp32
master: 12 bytes per parameter with Adam in mixed precision) beside the parameter and gradient homes. Where that
does not fit, chunks move to the disk, one at a time, until the plan's host bytes (ir.needs.host_bytes, measured on
the scheduled graph, so the gradient homes the schedule writes back are counted) fit: the last chunks of the CPU
worker's update order first (the cost model's earliest-deadline-first order: the last one's update is due latest,
when the next forward reaches it, so its disk reads and writes hide best). A streamed chunk stays on the host.

A disk chunk's step reads its states into one of `STAGING_SLOTS` host staging buffers (`disk_read(chunk, slot)`),
the CPU worker updates them there, and `disk_write(chunk, slot)` right after the step writes them back to the file.
The disk chunks take the slots in turn, in the order of their steps: the first ones' reads are placed where the
compute before their steps, by the cost model's node times, covers the reads at the disk's read rate (backward, or
the forward for a long read); each later one's read follows the write of the chunk before it in its slot (the
runtime waits for that write before reading into the slot). Reads only read, and every write comes after its
chunk's step (after the commit, unless atomic=False updates the chunk during backward): a step that fails before
its commit leaves the files as they were.

Raises BudgetError, naming the tier, where the host cannot fit even with every host-placed chunk's states on disk,
where there is no disk tier (offload_dir=None) for what does not fit, or where the disk budget cannot hold them.
"""
from __future__ import annotations

import dataclasses

from ..cost import Machine, compute_seconds
from ..errors import BudgetError
from ..ir import ops
from ..ir.graph import NodeAnn, Role, Scheduled, StateHome, TrainGraph, UpdateSite, copy_graph, to_module
from ..ir.needs import STAGING_SLOTS, disk_bytes, host_bytes, state_bytes, state_layout
from ..units import format_bytes
from .schedule import schedule


def offload_states(g: TrainGraph, machine: Machine) -> TrainGraph:
    """g (states placed, steps arranged) with the fewest chunks' states on disk that fit the host budget, and their
    disk_read / disk_write nodes; g itself when everything fits (or no host budget is set)."""
    st = g.settings
    if st.host_budget is None:
        return g
    scheduled = g.scheduled.of(g) if g.scheduled is not None else None
    need = host_bytes(scheduled if scheduled is not None else schedule(g))
    if need <= st.host_budget:
        return g
    if st.disk_budget is None and st.host_default:
        raise BudgetError(
            f"this plan keeps {format_bytes(need)} ({need} bytes) in host memory (parameter and gradient homes, the "
            "optimizer states of the chunks not on the device), more than this machine has: "
            f"{format_bytes(st.host_budget)} ({st.host_budget} bytes) with host_memory=None, the host's memory (this "
            "rank's share of it) less a tenth for everything else. Give offload_dir (a directory on a local disk) so "
            "that optimizer states that do not fit go to disk, keep smaller states (px.AdamW(state_dtype='int8')), "
            "or add device memory or GPUs; pass host_memory to take more of the host.",
            node="", needed=need, available=st.host_budget, tier=StateHome.HOST)
    if st.disk_budget is None:
        raise BudgetError(
            f"{host_memory(st)} is too small: this plan keeps "
            f"{format_bytes(need)} ({need} bytes) in host memory (parameter and gradient homes, the optimizer states "
            "of the chunks not on the device). Raise host_memory, or give offload_dir (a directory on a local disk) "
            "so that optimizer states that do not fit go to disk.", node="", needed=need, available=st.host_budget, tier=StateHome.HOST)
    order = [g.ann[n.name].chunk for n in g.nodes if g.ann[n.name].role is Role.OPTIMIZER_STEP]
    movable = [cid for cid in reversed(order) if g.chunks[cid].update_site is UpdateSite.CPU
               and g.chunks[cid].state_home is StateHome.HOST]
    if not movable:
        raise BudgetError(
            f"{host_memory(st)} is too small: this plan keeps "
            f"{format_bytes(need)} ({need} bytes) in host memory, and no chunk's optimizer states there could move "
            "to disk (parameter and gradient homes stay on the host). Raise host_memory or device_memory.",
            node="", needed=need, available=st.host_budget, tier=StateHome.HOST)
    # a first guess from the bytes alone (each chunk moved frees its states, the staging buffers cost some back),
    # then checked on the scheduled graph, one more chunk at a time
    layout = state_layout(st)
    size = {cid: state_bytes(g.chunks[cid], st.precision, st.world, layout) for cid in movable}
    k, freed = 0, 0
    while k < len(movable) and need - freed + STAGING_SLOTS * max(size[c] for c in movable[:k + 1]) > st.host_budget:
        freed += size[movable[k]]
        k += 1
    k = max(1, min(k, len(movable)))
    seconds = {n.name: s for n, s in zip(g.nodes, compute_seconds(g, machine))}
    while True:
        placed = with_disk_nodes(_homes(g, movable[:k]), machine, seconds)
        _check_disk(placed)
        done = schedule(placed)
        have = host_bytes(done)
        if have <= st.host_budget:
            return placed.evolve(scheduled=Scheduled(placed.gm, placed.ann, placed.chunks, placed.settings, done))
        if k == len(movable):
            raise BudgetError(
                f"{host_memory(st)} is too small even with the "
                f"optimizer states of {k} chunks on disk: the host still needs {format_bytes(have)} ({have} bytes) "
                "for parameter and gradient homes and the disk tier's staging buffers. Raise host_memory, or lower "
                "chunk_size (smaller staging buffers), or device_memory's pressure on host homes.",
                node="", needed=have, available=st.host_budget, tier=StateHome.HOST)
        k += 1


def host_memory(st) -> str:
    """The host budget as an error names it: with several ranks, this rank's share of px.compile's host_memory."""
    b = f"{format_bytes(st.host_budget)} ({st.host_budget} bytes)"
    return (f"host_memory {b}" if st.world == 1 else
            f"host_memory's share of each rank, {b} (host_memory is per node, divided among the node's ranks),")


def _homes(g: TrainGraph, disk: list[int]) -> TrainGraph:
    chosen = set(disk)
    return g.evolve(chunks=tuple(dataclasses.replace(c, state_home=StateHome.DISK) if c.id in chosen else c
                                 for c in g.chunks))


def _check_disk(g: TrainGraph) -> None:
    need = disk_bytes(g)
    if need > g.settings.disk_budget:
        raise BudgetError(
            f"disk_memory {format_bytes(g.settings.disk_budget)} ({g.settings.disk_budget} bytes"
            f"{', per rank' if g.settings.world > 1 else ''}) is too small: the optimizer states that do not fit "
            f"host_memory need {format_bytes(need)} ({need} bytes) on disk. Raise "
            "disk_memory (or free space in offload_dir), or raise host_memory.",
            node="", needed=need, available=g.settings.disk_budget, tier=StateHome.DISK)


def with_disk_nodes(g: TrainGraph, machine: Machine, seconds: dict[str, float] | None = None) -> TrainGraph:
    """g with a disk_read before and a disk_write right after the step of each disk-homed chunk (see the module
    docstring). seconds: the cost model's compute time of each program node by name, if already known."""
    nodes = g.nodes
    if seconds is None:
        seconds = {n.name: s for n, s in zip(nodes, compute_seconds(g, machine))}
    steps = [(i, g.ann[n.name].chunk) for i, n in enumerate(nodes) if g.ann[n.name].role is Role.OPTIMIZER_STEP
             and g.chunks[g.ann[n.name].chunk].state_home is StateHome.DISK]
    if not steps:
        return g
    slots = min(STAGING_SLOTS, len(steps))
    layout = state_layout(g.settings)
    first = next(i for i, n in enumerate(nodes) if n.op != "placeholder")
    graph, env = copy_graph(g)
    ann = dict(g.ann)
    written = []
    queued = 0.0                    # seconds of the reads issued so far at the disk's read rate
    for j, (i, cid) in enumerate(steps):
        slot = j % slots
        step = env[nodes[i]]
        with graph.inserting_after(step):
            w = graph.call_function(ops.disk_write, (), {"chunk": cid, "slot": slot})
        ann[w.name] = NodeAnn(role=Role.DISK_WRITE, phase=g.ann[nodes[i].name].phase, chunk=cid)
        written.append(w)
        if j >= slots:
            anchor, phase = written[j - slots].next, ann[written[j - slots].name].phase
        else:
            queued += state_bytes(g.chunks[cid], g.settings.precision, g.settings.world, layout) / machine.disk_read_bytes
            p, covered = i, 0.0
            while p > first and covered < queued:
                p -= 1
                covered += seconds.get(nodes[p].name, 0.0)
            anchor, phase = env[nodes[p]], g.ann[nodes[p].name].phase
        with graph.inserting_before(anchor):
            r = graph.call_function(ops.disk_read, (), {"chunk": cid, "slot": slot})
        ann[r.name] = NodeAnn(role=Role.DISK_READ, phase=phase, chunk=cid)
    return g.evolve(gm=to_module(graph, g.gm), ann=ann)
