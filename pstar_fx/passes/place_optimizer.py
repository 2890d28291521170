"""place_optimizer: one `commit()` after backward, then one `optimizer_step` per trainable chunk; states placed.

Invariant after: the graph has exactly one `commit()` node, placed after every node of the user's program, every
guard (ir/guards.py) and every gradient write (the last node that can fail with the user's code or data), and every
trainable chunk has exactly one `optimizer_step(chunk=c)`, after the commit. Before the commit nothing writes a
parameter value or an optimizer state, so a step that fails there leaves every value as it was (the step is atomic);
clipping by global norm and fp16 overflow checks, which need every gradient, are decided at the commit. The one
exception, asked for with `atomic=False` (Settings.atomic) where the commit decides nothing: host-side steps come
right after the last node that uses their chunk and after every guard, before the commit, so the CPU updates during
backward (with several ranks after the chunk's reduce-scatter, which the shard pass puts right after its last
gradient write); a step that fails after the first of them cannot be undone (the executor raises CommitError).
Every trainable chunk has a `state_home`, chosen from the cost model (`cost.py`): chunks are ranked by the slack of
their update window on the CPU (the time between the chunk's gradient being final and its next read, less the
update's own time at the CPU Adam rate; the tightest first, the embedding and first layers in practice), and go to
the device in that order while every node's minimum need still fits with room for two more chunk buffers. Where
that placement's estimated step exceeds its compute by more than WAITS, its busiest lane is the device's or a copy
lane (WAITED_ON), and the CPU's updates would take less than the device's compute, fewer device states may give a
faster step (the freed memory keeps parameters resident instead of fetching them again): then placements with 1,
2, 4, 8, ... fewer (the last in rank order back to the host) are scheduled (with the schedule pass's default
prefetch; on several ranks sharded, as the step runs) and estimated in turn until one is no faster, then those
halfway to the fastest one's neighbours, and the fastest is kept. Device steps come first, in chunk order (the
order the next forward needs them). Host steps, which the store's CPU worker runs one after another in graph order while the device goes on, come
in the order `update_order` chooses from the cost model: each chunk's update can start once its gradient is final
and written home and the executor has issued its step (with atomic=False right after the chunk's last use; otherwise
after the commit, which the cost model has it issue when the device reaches the commit: every update released at
once, so the order is the next forward's) and should end before the next forward reads the chunk; the order is the
earliest-deadline-first list schedule of those windows.
On one rank some of the CPU's chunks may instead update on the device, their states streamed over and back
(`ChunkInfo.streamed`, chosen with the cost model by update_sites.py). Where the updates wait for the commit, the
first chunks of the CPU's order, their steps last, after the commit, in that order; with atomic=False every other
chunk of that order first, each step right after its chunk's last use, as the CPU's are.
In an atomic step whose commit decides nothing, where the host budget has room, some of the last chunks
of the CPU's order (`ChunkInfo.undo`) update before the commit instead, each step right after its chunk's last use:
the CPU worker first copies the chunk's states into an undo buffer that puts them back if the step fails before its
commit (runtime/undo.py), so the step stays atomic. As many as the CPU can update before the device reaches the
commit, by the cost model's node times, within the host budget's room; kept, with the streamed chunks chosen again
beside them, only where the step is estimated faster so. The exception to the invariant above: their steps come
before the commit, after every guard.
With a host budget (Settings.host_budget) that the host-placed states overflow, the last chunks of the CPU's order
get a third home, the disk (StateHome.DISK, chosen by offload.py), their states read into a host staging buffer
before their update and written back after it (`disk_read` / `disk_write` nodes).
"""
from __future__ import annotations

import dataclasses

import torch.fx as fx

from ..cost import H200, Lane, Machine, compute_seconds, cpu_update_rate, estimate
from ..errors import BudgetError
from ..ir import ops
from ..ir.graph import (BufKind, Choice, ChunkGroup, NodeAnn, Phase, Role, Scheduled, StateHome, TrainGraph,
                        UpdateSite, copy_graph, to_module)
from ..ir.needs import (NO_NEEDS, all_needs, buf_bytes, host_bytes, needs, shard_numel, state_bytes, state_layout,
                        static_bytes, undo_bytes)
from ..units import format_bytes
from .liveness import analyze
from .schedule import schedule
from .shard import shard
from .offload import host_memory, offload_states
from .update_sites import choose_streamed, no_stream_reason, no_undo_reason, undo_room

WAITS = 0.01     # fewer device states are tried where the fullest placement's step exceeds its compute by more
WAITED_ON = (Lane.COMPUTE, Lane.H2D, Lane.D2H)   # and its busiest lane is the device's or a copy's (not the
                                                 # executor issuing nodes, the CPU updating, or the network)


def min_need(g: TrainGraph) -> int:
    """The least device bytes any schedule of g needs: static + max over nodes of live + workspace + the node's own
    chunk buffers."""
    nodes = g.nodes
    lv = analyze(nodes, g.ann)
    worst = 0
    for i, nd in enumerate(all_needs(g)):
        worst = max(worst, lv.live[i] + nd.workspace + sum(buf_bytes(g, k) for k in nd.resident))
    return static_bytes(g) + worst


def place_optimizer(g: TrainGraph, machine: Machine = H200) -> TrainGraph:
    chunks = tuple(dataclasses.replace(c, state_home=StateHome.HOST) if c.group is ChunkGroup.TRAINABLE else c
                   for c in g.chunks)
    trainable = [c.id for c in chunks if c.group is ChunkGroup.TRAINABLE]
    all_host = with_steps(g, trainable).evolve(chunks=chunks)   # every step after the commit: for the windows
    node_s = compute_seconds(all_host, machine)        # the same program nodes in every placement
    ranked = device_priority(all_host, machine, node_s)
    most = _choose_homes(all_host, ranked)
    fewer = _fewer_states(most, ranked, machine, node_s)
    program_s = {n.name: s for n, s in zip(all_host.nodes, node_s)}
    best = _placed(g, all_host, most.chunks, machine, node_s, reuse=True)
    best_scheduled = schedule(best) if fewer else None
    fullest = _estimated(best_scheduled, machine, program_s) if fewer else None
    compute = sum(node_s)
    why = [_why_most(most)]
    if fullest is not None and fullest.seconds > compute * (1 + WAITS) and fullest.bound in WAITED_ON:
        all_host = with_steps(g, trainable).evolve(chunks=chunks)     # the first was used up by the fullest
        best, best_scheduled, best_s, tried = _fewer_search(g, all_host, most, fewer, best, best_scheduled,
                                                            fullest.seconds, machine, node_s, program_s)
        kept = sum(c.state_home is StateHome.DEVICE for c in best.chunks)
        why.append(f"that placement's step is estimated {fullest.seconds:.4g} s against its compute's {compute:.4g} "
                   f"s (busiest lane {fullest.bound.value}), so fewer device states were tried, keeping more "
                   f"parameters resident instead (device states: estimated step) "
                   f"{tried}: {kept} kept ({best_s:.4g} s)")
    else:
        why.append(_why_not_fewer(most, fewer, fullest, node_s, machine))
    best, best_scheduled, where = _stream(g, best, best_scheduled, machine, program_s)
    why.extend(where)
    offloaded = offload_states(best, machine)
    if offloaded is not best:
        best, best_scheduled = offloaded, offloaded.scheduled.result
        on_disk = sum(c.state_home is StateHome.DISK for c in best.chunks)
        why.append(f"{on_disk} chunks' optimizer states on disk: {host_memory(best.settings)} does not hold them "
                   "with the rest")
    choices = best.choices + tuple(Choice("place_optimizer", w) for w in why)
    out = best.evolve(stage="optimizer_placed", made_by="place_optimizer", choices=choices)
    if best_scheduled is None:
        return out
    return out.evolve(scheduled=Scheduled(out.gm, out.ann, out.chunks, out.settings,
                                          best_scheduled.evolve(choices=choices)))


def _estimated(scheduled: TrainGraph, machine: Machine, program_s: dict):
    """The cost model's estimate of a scheduled placement as it will run: on several ranks after the shard pass (its
    fetches all-gathers of shards, its host copies and updates per shard), not one rank's view of whole chunks."""
    return estimate(shard(scheduled) if scheduled.settings.world > 1 else scheduled, machine, program_s=program_s)


def _why_most(most: TrainGraph) -> str:
    """Why the fullest placement holds the device states it holds."""
    trainable = [c for c in most.chunks if c.group is ChunkGroup.TRAINABLE]
    on_device = sum(c.state_home is StateHome.DEVICE for c in trainable)
    if on_device == len(trainable):
        return (f"optimizer states of all {len(trainable)} chunks on the device: "
                + ("no budget" if most.settings.budget is None else "they fit beside the step's needs"))
    if on_device == 0:
        return (f"optimizer states of none of the {len(trainable)} chunks on the device: the first in rank order "
                "would not leave room for two chunk buffers beside every node's least need")
    return (f"optimizer states of {on_device} of {len(trainable)} chunks on the device: taken in rank order (the "
            "least time the CPU would have for their update first) while each leaves room for two chunk buffers "
            "beside every node's least need")


def _why_not_fewer(most: TrainGraph, fewer: list, fullest, node_s: list[float], machine: Machine) -> str:
    """Why placements with fewer device states were not compared (the tests of _fewer_states, then of the caller)."""
    host = [c for c in most.chunks if c.group is ChunkGroup.TRAINABLE and c.state_home is StateHome.HOST]
    if not host:
        return "no fewer device states tried: nothing to make room for"
    if not any(c.state_home is StateHome.DEVICE for c in most.chunks):
        return "no fewer device states tried: none is on the device"
    if not fewer:
        cpu = sum(shard_numel(c, most.settings.world) for c in host) / cpu_update_rate(most.settings, machine)
        return (f"no fewer device states tried: the CPU's updates ({cpu:.4g} s estimated) would take at least the "
                f"device's compute ({sum(node_s):.4g} s), and fewer would only add to them")
    if fullest.bound not in WAITED_ON:
        return (f"no fewer device states tried: its step is estimated {fullest.seconds:.4g} s, bound by the "
                f"{fullest.bound.value} lane, which resident parameters do not shorten")
    return (f"no fewer device states tried: its step is estimated {fullest.seconds:.4g} s, within {WAITS:.0%} of "
            f"its compute's {sum(node_s):.4g} s")


def _stream(g: TrainGraph, best: TrainGraph, best_scheduled: TrainGraph | None, machine: Machine, program_s
            ) -> tuple[TrainGraph, TrainGraph | None, list[str]]:
    """best (states placed, steps arranged) with the chunks update_sites chooses streamed, the CPU keeping the rest
    in its order. Atomic: the first of the CPU's order (the next forward's first needs first), their steps after
    the CPU's in that order. atomic=False (the CPU's steps right after their chunk's last use, during backward):
    every other chunk of the CPU's order first, each step right after its chunk's last use too, so that the
    device's updates thin the CPU's queue evenly along backward. A chunk whose streamed step alone would not fit the
    budget stays with the CPU. Atomic, where the host budget has room for undo buffers (update_sites.undo_room):
    the last of the CPU's chunks (the next forward needs them last; backward is done with them first) as many as fit
    update before the commit, right after their last use, keeping their previous values (ChunkInfo.undo), where the
    cost model estimates the step faster so, the streamed ones chosen again beside them. With it: why, in sentences
    (none where no chunk's states are on the host)."""
    reason = no_stream_reason(g.settings)
    if reason is not None and g.settings.device_updates:
        raise ValueError(f"_device_updates={g.settings.device_updates}: {reason}")
    undo_reason = no_undo_reason(g.settings)
    if undo_reason is not None and g.settings.undo_updates:
        raise ValueError(f"_undo_updates={g.settings.undo_updates}: no chunk updates before the commit with an undo "
                         f"buffer: {undo_reason}")
    if not any(c.update_site is UpdateSite.CPU for c in best.chunks):
        return best, best_scheduled, []
    if reason is not None and undo_reason is not None:
        return best, best_scheduled, [f"no host-placed chunk updated on the device: {reason}"]
    nodes = best.nodes
    lv = analyze(nodes, best.ann)
    static = static_bytes(best)
    budget = best.settings.budget

    early = g.settings.early_updates
    # atomic=False: where a streamed step will sit (a host-placed chunk's step has no device needs: its last use is
    # the program's)
    last = _earliest_steps(best) if early else {}

    def fits(i: int, cid: int) -> bool:
        """The chunk's streamed step (node i, the CPU's step of it) fits beside what is always on the device (its
        states, params, gradient, workspace and the activations live where it will run)."""
        trial = best.evolve(chunks=tuple(dataclasses.replace(c, streamed=True) if c.id == cid else c
                                         for c in best.chunks))
        nd = needs(trial, best.ann[nodes[i].name])
        need = static + lv.live[last.get(cid, i)] + nd.workspace + sum(buf_bytes(trial, k) for k in nd.resident)
        return budget is None or need <= budget

    steps = [(i, best.ann[n.name].chunk) for i, n in enumerate(nodes) if best.ann[n.name].role is Role.OPTIMIZER_STEP
             and best.chunks[best.ann[n.name].chunk].update_site is UpdateSite.CPU]
    cpu_only = [cid for i, cid in steps if reason is not None or not fits(i, cid)]
    order = [cid for i, cid in steps if cid not in cpu_only]       # those that may stream, in the CPU's order
    if early:
        order = order[::2] + order[1::2]
    device = [c.id for c in best.chunks if c.update_site is UpdateSite.DEVICE]

    def build(k: int, undo: list[int] = ()) -> TrainGraph:
        undo = set(undo)
        streamed = set([cid for cid in order if cid not in undo][:k])
        cpu = [cid for _, cid in steps if cid not in streamed]
        homes = tuple(dataclasses.replace(c, streamed=True) if c.id in streamed else
                      dataclasses.replace(c, undo=True) if c.id in undo else c for c in best.chunks)
        placed = with_steps(g, device, [cid for cid in cpu if cid not in undo], early=early,
                            streamed=[cid for cid in order if cid in streamed], undo=sorted(undo))
        return placed.evolve(chunks=homes)

    if undo_reason is None and g.settings.device_updates is not None and g.settings.undo_updates is None:
        undo_reason = "_device_updates sets the streamed chunks, and none is chosen beside them"
    if undo_reason is not None:
        chosen = choose_streamed(best, order, build, machine, program_s, (best, best_scheduled))
        return chosen.placed, chosen.scheduled, [chosen.why, f"no chunk updated before the commit: {undo_reason}"]
    if best_scheduled is None:
        best_scheduled = schedule(best)
    cpu = [cid for _, cid in steps]
    layout = state_layout(g.settings)
    size = {c: undo_bytes(best.chunks[c], g.settings.precision, g.settings.world, layout) for c in cpu}
    room = undo_room(best_scheduled)
    forced = g.settings.undo_updates
    undo = _undo_fit(best, cpu, size, room, machine, program_s) if forced is None else \
        cpu[len(cpu) - min(forced, len(cpu)):]
    u = len(undo)
    plain = None
    if forced is None or not u:
        plain = choose_streamed(best, order, build, machine, program_s, (best, best_scheduled))
    if not u:
        why = ("_undo_updates=0" if forced == 0 else
               f"the host budget has {format_bytes(room)} spare, less than an undo buffer "
               f"({format_bytes(min(size.values()))} for the smallest chunk)" if room < min(size.values()) else
               "the CPU could update none of them, undo copy included, before the device reaches the commit")
        return plain.placed, plain.scheduled, [plain.why, f"no chunk updated before the commit: {why}"]
    kept = choose_streamed(best, [c for c in order if c not in undo], lambda k: build(k, undo), machine, program_s,
                           (build(0, undo), None))
    held = sum(size[c] for c in undo)
    what = (f"{u} of the CPU's {len(cpu)} chunks updated before the commit, right after backward is done with "
            f"each, their previous values kept in undo buffers ({format_bytes(held)} of host memory) to put back "
            "if the step fails before the commit")
    if plain is None:
        return kept.placed, kept.scheduled, [kept.why, f"{what}, as _undo_updates asks"]
    plain, kept = plain.timed(machine, program_s), kept.timed(machine, program_s)
    if kept.seconds < plain.seconds:
        return kept.placed, kept.scheduled, [kept.why, (
            f"{what}: those of the last in the CPU's order (the next forward needs them last) the CPU can update, "
            f"undo copies included, before the device reaches the commit, within the {format_bytes(room)} the host "
            f"budget has spare; the step estimated {kept.seconds:.4g} s against {plain.seconds:.4g} s without")]
    return plain.placed, plain.scheduled, [plain.why, (
        f"no chunk updated before the commit: with {u} undo buffers (as many as the CPU could update before the "
        f"device reaches the commit, within the {format_bytes(room)} the host budget has spare) the step is estimated "
        f"{kept.seconds:.4g} s against {plain.seconds:.4g} s without")]


def _undo_fit(g: TrainGraph, cpu: list[int], size: dict[int, int], room: int, machine: Machine, program_s
              ) -> list[int]:
    """Those of the CPU's chunks (`cpu`, in its order) whose updates, undo copies included, the CPU worker can do
    before the device reaches the commit, their undo buffers (`size`: bytes by chunk) within `room` bytes, taken
    from the end of the CPU's order (the next forward needs them last; backward is done with them first), each from
    the end of its chunk's last use (program_s: the cost model's node times by name) at the rate beside backward and
    under copies (the gradients' write-backs); a chunk that would end past the commit, or not fit, is passed over."""
    st = g.settings
    nodes = g.nodes
    at, t = [], 0.0
    for n in nodes:
        t += program_s.get(n.name, 0.0)
        at.append(t)
    commit = next(at[i] for i, n in enumerate(nodes) if g.ann[n.name].role is Role.COMMIT)
    last = _last_use(all_needs(g))
    release = {cid: at[last[cid]] if cid in last else 0.0 for cid in cpu}
    rate = cpu_update_rate(st, machine, beside_backward=True)
    seconds = {cid: (shard_numel(g.chunks[cid], st.world) / rate + size[cid] / machine.host_copy_bytes)
               / machine.cpu_adam_under_copies for cid in cpu}
    chosen: list[int] = []
    for cid in reversed(cpu):
        if size[cid] > room:
            continue
        clock = 0.0
        for c in sorted(chosen + [cid], key=lambda c: (release[c], c)):
            clock = max(clock, release[c]) + seconds[c]
        if clock <= commit:
            chosen.append(cid)
            room -= size[cid]
    return chosen


def _placed(g: TrainGraph, all_host: TrainGraph, homes: tuple, machine: Machine,
            node_s: list[float] | None = None, reuse: bool = False) -> TrainGraph:
    """g with its optimizer steps for these state homes: device steps in chunk order, host ones in update order
    (computed on `all_host`, g with every step after the commit, whose nodes' compute times are node_s when known:
    the order reads the windows, not the steps). reuse: make it from all_host by moving its step nodes (no copy of
    g; all_host is then used up)."""
    device = [c.id for c in homes if c.update_site is UpdateSite.DEVICE]
    host = update_order(all_host.evolve(chunks=homes), machine, node_s)
    early = g.settings.early_updates
    if reuse:
        return _arranged(g, all_host, device, host, early).evolve(chunks=homes)
    return with_steps(g, device, host, early=early).evolve(chunks=homes)


def _arranged(g: TrainGraph, all_host: TrainGraph, order: list[int], host: list[int], early: bool) -> TrainGraph:
    """with_steps(g, order, host, early), made from all_host = with_steps(g, every trainable chunk), a graph of this
    pass's own that nothing else holds, by moving its step nodes into place: the same nodes in the same order (step
    nodes have no inputs and no users), without copying a largest model's graph again (about 0.4 s at 17B)."""
    graph = all_host.gm.graph
    steps: dict[int, fx.Node] = {}
    commit = None
    for n in graph.nodes:
        a = all_host.ann[n.name]
        if a.role is Role.OPTIMIZER_STEP:
            steps[a.chunk] = n
        elif a.role is Role.COMMIT:
            commit = n
    after = commit
    for cid in list(order) + list(host):
        after.append(steps[cid])
        after = steps[cid]
    if early and host:
        _move_early(g, graph, steps, host)
    return all_host.evolve(gm=to_module(graph, all_host.gm))


def _fewer_states(most: TrainGraph, ranked: list[int], machine: Machine, node_s: list[float] | None = None
                  ) -> list[int]:
    """The device-placed chunks placements with fewer device states move back to the host, last first (rank order:
    those the CPU would have most time for), for place_optimizer to compare with the fullest placement where that
    one's step is estimated over its compute: none when every state fits on the device (nothing to make room for) or
    when the CPU's updates already take as long as the device's compute (fewer device states would only add to
    them)."""
    host_elems = sum(shard_numel(c, most.settings.world) for c in most.chunks
                     if c.group is ChunkGroup.TRAINABLE and c.state_home is StateHome.HOST)
    on_device = [cid for cid in ranked if most.chunks[cid].state_home is StateHome.DEVICE]
    if not on_device or host_elems == 0:
        return []
    compute = sum(compute_seconds(most, machine) if node_s is None else node_s)
    if host_elems / cpu_update_rate(most.settings, machine) >= compute:
        return []
    return on_device[::-1]


def moved_back(most: TrainGraph, fewer: list[int], back: int) -> tuple:
    """most's chunks with the first `back` of `fewer` (_fewer_states) moved back to the host."""
    chunks = list(most.chunks)
    for cid in fewer[:back]:
        chunks[cid] = dataclasses.replace(chunks[cid], state_home=StateHome.HOST)
    return tuple(chunks)


def _fewer_search(g: TrainGraph, all_host: TrainGraph, most: TrainGraph, fewer: list[int], best: TrainGraph,
                  best_scheduled: TrainGraph, best_s: float, machine: Machine, node_s: list[float], program_s: dict
                  ) -> tuple[TrainGraph, TrainGraph, float, str]:
    """The fastest of the fullest placement (best, its schedule and estimate best_s) and those with 1, 2, 4, 8, ...
    fewer device states (moved_back), tried in that order until one is estimated no faster than the fastest so far,
    then those halfway between the fastest and the counts tried beside it. Returns it, its schedule, its estimate
    and what each placement tried was estimated at (device states: seconds)."""
    tried: dict[int, float | str] = {0: best_s}          # by how many states fewer
    kept = 0
    host_budget = g.settings.host_budget if g.settings.disk_budget is None else None

    def attempt(back: int) -> bool:
        """Whether the placement `back` fewer was estimated faster than the fastest so far (and is now it)."""
        nonlocal best, best_scheduled, best_s, kept
        candidate = _placed(g, all_host, moved_back(most, fewer, back), machine, node_s)
        try:
            scheduled = schedule(candidate)
        except BudgetError:
            tried[back] = "does not fit"
            return False
        if host_budget is not None and host_bytes(scheduled) > host_budget:     # (no disk tier to take more)
            tried[back] = f"over {host_memory(g.settings)}"
            return False
        tried[back] = seconds = _estimated(scheduled, machine, program_s).seconds
        if seconds < best_s:
            best, best_scheduled, best_s, kept = candidate, scheduled, seconds, back
            return True
        return False

    for back in sorted({min(2 ** i, len(fewer)) for i in range(len(fewer).bit_length() + 1)}):
        if not attempt(back):
            break
    counts = sorted(tried)
    at = counts.index(kept)
    for j in (at - 1, at + 1):                # halfway to the counts tried beside the fastest
        if 0 <= j < len(counts):
            mid = (kept + counts[j]) // 2
            if mid not in tried:
                attempt(mid)
    full = sum(c.state_home is StateHome.DEVICE for c in most.chunks)
    listed = "; ".join(f"{full - b}: {v:.4g} s" if isinstance(v, float) else f"{full - b}: {v}"
                       for b, v in sorted(tried.items()))
    return best, best_scheduled, best_s, listed


def with_steps(g: TrainGraph, order: list[int], host: list[int] = (), early: bool = False,
               streamed: list[int] = (), undo: list[int] = ()) -> TrainGraph:
    """g with a commit after its program and one optimizer_step per chunk: those of `order` after the commit, then
    those of `host`, then those of `streamed`, in that order; with `early`, each of `host` instead right after the
    last node that uses its chunk and after the previous one of `host` (so the CPU worker, which takes them in graph
    order, gets each as soon as the step is done with its chunk), and each of `streamed` right after the last node
    that uses its chunk (the device updates it there, in graph order). Each of `undo` (atomic: chunks of `host`
    whose previous values are kept until the commit) right after the last node that uses its chunk, in the order
    backward is done with them."""
    graph, _ = copy_graph(g)
    ann = dict(g.ann)
    program = [n for n in graph.nodes if ann[n.name].role in (Role.COMPUTE, Role.WRITE_GRAD, Role.GUARD)]
    assert program, "a training graph has at least the loss"
    with graph.inserting_after(program[-1]):
        commit = graph.call_function(ops.commit, (), {})
    ann[commit.name] = NodeAnn(role=Role.COMMIT, phase=Phase.OPTIMIZER)
    steps: dict[int, fx.Node] = {}
    after = commit
    for cid in list(order) + list(host) + list(streamed) + list(undo):
        with graph.inserting_after(after):
            after = steps[cid] = graph.call_function(ops.optimizer_step, (), {"chunk": cid})
        ann[after.name] = NodeAnn(role=Role.OPTIMIZER_STEP, phase=Phase.OPTIMIZER, chunk=cid)
    if early and (host or streamed):
        _move_early(g, graph, steps, host, streamed)
    if undo:
        earliest = _earliest_steps(g)
        _move_early(g, graph, steps, sorted(undo, key=lambda c: (earliest[c], c)))
    return g.evolve(gm=to_module(graph, g.gm), ann=ann)


def _move_early(g: TrainGraph, graph: fx.Graph, steps: dict[int, fx.Node], host: list[int],
                alone: list[int] = ()) -> None:
    """Move each of `host`'s step nodes (`steps`, in `graph`, which holds g's nodes under their names) right after
    the last node that uses its chunk, after the previous one of `host` and after every guard; then each of
    `alone`'s right after the last node that uses its chunk and after every guard."""
    earliest = _earliest_steps(g)
    by_name = {n.name: n for n in graph.nodes}
    original = g.nodes
    at: dict[int, fx.Node] = {}       # original position -> the last step moved after it

    def place(cid: int, after: int) -> int:
        pos = max(after, earliest[cid])
        at.get(pos, by_name[original[pos].name]).append(steps[cid])
        at[pos] = steps[cid]
        return pos

    pos = 0
    for cid in host:
        pos = place(cid, pos)
    for cid in alone:
        place(cid, 0)


def _earliest_steps(g: TrainGraph) -> dict[int, int]:
    """Each chunk's earliest position for a step before the commit (atomic=False): right after the last node that
    uses the chunk, and after every guard (a failed guard reruns the step, which must not have updated anything)."""
    guards = max((i for i, n in enumerate(g.nodes) if g.ann[n.name].role is Role.GUARD), default=0)
    return {cid: max(guards, i) for cid, i in _last_use(all_needs(g)).items()}


def _last_use(nd) -> dict[int, int]:
    """Each chunk's last node position that has one of its buffers resident, from all_needs."""
    return {k.chunk: i for i, x in enumerate(nd) for k in x.resident}


def _windows(g: TrainGraph, host: list[int], machine: Machine, node_s: list[float] | None = None
             ) -> dict[int, tuple[float, float, float]]:
    """Each host-stepped chunk's update window on the CPU, from the cost model's node times: (release, deadline,
    duration). Released when its gradient is final and the executor has issued its step: with early updates after
    the chunk's last use; otherwise at the commit, when the device reaches it (the cost model's rule: see cost.py).
    Due at the next step's first read of the chunk. Taking its elements at the CPU Adam rate. node_s:
    compute_seconds(g, machine), if already known."""
    nodes = g.nodes
    nd = all_needs(g)
    at, t = [], 0.0
    for s in compute_seconds(g, machine) if node_s is None else node_s:
        t += s
        at.append(t)
    step_s = t
    first_read: dict[int, float] = {}
    for i, n in enumerate(nodes):
        a = g.ann[n.name]
        if a.role in (Role.COMPUTE, Role.PARAM_VIEW):
            for k in nd[i].reads:
                if k.buf is BufKind.PARAM:
                    first_read.setdefault(k.chunk, at[i])
    if g.settings.early_updates:
        last_use = _last_use(nd)
        release = {cid: at[last_use[cid]] if cid in last_use else step_s for cid in host}
    else:
        release = dict.fromkeys(host, step_s)
    rate = cpu_update_rate(g.settings, machine)
    world = g.settings.world
    return {cid: (release[cid], step_s + first_read.get(cid, step_s), shard_numel(g.chunks[cid], world) / rate)
            for cid in host}


def device_priority(g: TrainGraph, machine: Machine = H200, node_s: list[float] | None = None) -> list[int]:
    """The trainable chunks of g (its steps in any order), the one whose states the device should hold first: the
    least slack in its update window as a host-stepped chunk (deadline - release - duration, `_windows`), then chunk
    order. A chunk with little slack is the one the CPU would make the step wait for."""
    trainable = [c.id for c in g.chunks if c.group is ChunkGroup.TRAINABLE]
    win = _windows(g, trainable, machine, node_s)
    return sorted(trainable, key=lambda c: (win[c][1] - win[c][0] - win[c][2], c))


def update_order(g: TrainGraph, machine: Machine = H200, node_s: list[float] | None = None) -> list[int]:
    """The host-stepped chunks of g (states placed) in the order the CPU should update them: non-preemptive
    earliest-deadline-first over each update's window (`_windows`). With every release at one moment this is
    first-use order."""
    host = [c.id for c in g.chunks if c.update_site is UpdateSite.CPU]
    if len(host) < 2:
        return host
    todo = {cid: (r, d, cid, u) for cid, (r, d, u) in _windows(g, host, machine, node_s).items()}
    order, clock = [], 0.0
    while todo:
        ready = [cid for cid, (r, _, _, _) in todo.items() if r <= clock]
        if not ready:
            clock = min(r for r, _, _, _ in todo.values())
            continue
        cid = min(ready, key=lambda c: todo[c][1:3])          # earliest deadline, then chunk order
        clock += todo.pop(cid)[3]
        order.append(cid)
    return order


def _choose_homes(g: TrainGraph, ranked: list[int]) -> TrainGraph:
    """Greedy in `ranked` order: a chunk's states go to the device while min_need + two chunk buffers fit the
    budget. Only a chunk's own step node changes need with its home, so the other nodes' needs are computed once."""
    budget = g.settings.budget
    chunks = list(g.chunks)
    trainable = [c.id for c in chunks if c.group is ChunkGroup.TRAINABLE]
    if budget is None:
        for cid in trainable:
            chunks[cid] = dataclasses.replace(chunks[cid], state_home=StateHome.DEVICE)
        return g.evolve(chunks=tuple(chunks))
    nodes = g.nodes
    lv = analyze(nodes, g.ann)
    base = all_needs(g)

    def node_need(graph: TrainGraph, i: int) -> int:
        own = needs(graph, graph.ann[nodes[i].name])   # only a step's own needs change with its home
        nd = base[i] if own is NO_NEEDS or graph is g else own
        return lv.live[i] + nd.workspace + sum(buf_bytes(graph, k) for k in nd.resident)

    step_at = {g.ann[n.name].chunk: i for i, n in enumerate(nodes) if g.ann[n.name].role is Role.OPTIMIZER_STEP}
    others = max((node_need(g, i) for i in range(len(nodes)) if i not in step_at.values()), default=0)
    step_need = {cid: node_need(g, i) for cid, i in step_at.items()}
    static = static_bytes(g)
    layout = state_layout(g.settings)
    reserve = 2 * max((c.nbytes for c in chunks), default=0)
    for cid in ranked:
        trial = list(chunks)
        trial[cid] = dataclasses.replace(chunks[cid], state_home=StateHome.DEVICE)
        candidate = g.evolve(chunks=tuple(trial))
        need = node_need(candidate, step_at[cid]) if cid in step_at else 0
        extra = state_bytes(trial[cid], g.settings.precision, g.settings.world, layout)
        if static + extra + max(others, need, *step_need.values()) + reserve <= budget:
            chunks, static, step_need[cid] = trial, static + extra, need
    return g.evolve(chunks=tuple(chunks))
