"""verify: check a TrainGraph's invariants; on failure, show the nodes around the fault.

Checked at every stage (each check applies once the stage has what it is about):
- the fx graph is well formed (def before use) and every node has an annotation;
- chunks: every parameter sits inside its chunk, parameters of a chunk do not overlap;
- reads and gradients: no parameter placeholder is left once param_views exist; each parameter with a gradient has
  one write_grad per micro-batch, the first copying, the later ones adding, the last marked final; in a chunk whose gradients overwrite its parameters, no parameter is read after that;
- guards: every guard node (ir/guards.py) is a `guard` op, after the nodes it reads, and comes before the commit and
  before every optimizer_step (a failed guard reruns the step, which must have changed nothing);
- optimizer: one optimizer_step per trainable chunk, after every read and gradient write of its parameters, and
  after the commit except where atomic=False updates a host-placed chunk early or a chunk keeps an undo buffer
  (ChunkInfo.undo: the CPU updates its host states, in an atomic step of one rank whose commit decides nothing),
  whose step comes before the commit;
- schedule: every chunk buffer a node reads or writes is resident on the device; a fetch copies only data the host
  holds, and a buffer whose host copy holds data is fetched, never allocated zeroed; nothing written on the device
  is dropped while still needed; the cycle closes: the buffers resident at the end are exactly the plan's carried
  set, the one the step starts from, and none assumed fresh on the host at the start ends stale; a host-side step
  finds its chunk off the device
  with its gradient on the host; a streamed update's states are fetched (copied from their host home) once, before
  its step, and released with a write-back once, after it; static + resident + live + workspace <= budget at every node, and the plan's
  predicted peak is that maximum.
- the disk tier: a chunk whose states live on disk is updated on the CPU (a disk budget given); its
  states are read into a staging buffer once, before its step, and written back once, after it (never
  before the commit unless atomic=False updates it early); no other chunk's are; a staging buffer takes no read
  while a chunk read into it is not yet written back; the host bytes (ir.needs.host_bytes, staging included) stay
  within the host budget at every node and the files within the disk budget.
- collectives (more than one rank, from the shard stage on): every parameter buffer is brought in by all_gather,
  never by a plain fetch; every trainable chunk is reduce-scattered exactly once, after the last write of any of its
  gradients and before its optimizer step; no collective in a one-rank graph. The graph is the same on every rank,
  so the order is too; the step compares `shard.collectives(g)` across ranks before its first run.
"""
from __future__ import annotations

from ..ir import ops
from ..ir.graph import BufKind, ChunkGroup, ParamHome, Role, StateHome, TrainGraph, UpdateSite
from ..ir.needs import BufKey, all_needs, buf_bytes, disk_bytes, host_bytes, staging, static_bytes
from ..ir.printing import format_lines
from .liveness import analyze


class VerificationError(AssertionError):
    pass


def _fail(g: TrainGraph, i: int | None, msg: str):
    context = ""
    if i is not None:
        lines = format_lines(g)
        lo, hi = max(0, i - 4), min(len(lines), i + 5)
        context = "\n".join((">> " if k == i else "   ") + lines[k] for k in range(lo, hi))
    raise VerificationError(f"stage '{g.stage}' (made by {g.made_by}): {msg}\n{context}")


def verify(g: TrainGraph) -> TrainGraph:
    try:
        g.gm.graph.lint()
    except Exception as e:  # noqa: BLE001 - fx raises plain RuntimeError
        _fail(g, None, f"malformed fx graph: {e}")
    nodes = g.nodes
    for i, n in enumerate(nodes):
        if n.name not in g.ann:
            _fail(g, None, f"node {n.name} has no annotation")
    roles = [g.ann[n.name].role for n in nodes]
    _check_chunks(g)
    has_views = Role.PARAM_VIEW in roles
    if has_views:
        for i, r in enumerate(roles):
            if r is Role.PARAM:
                _fail(g, i, "a parameter placeholder remains after assign_chunks")
        micro = g.settings.accumulate if g.settings.optimizer is not None else 0   # forward only: no gradients
        writes = [g.ann[n.name].param for n in nodes if g.ann[n.name].role is Role.WRITE_GRAD]
        want = sorted(p.name for p in g.params if p.trainable for _ in range(micro))
        if sorted(writes) != want:
            _fail(g, None, f"write_grad per parameter ({micro} per micro-batch count): got {sorted(writes)}, "
                           f"want {want}")
        written: set[str] = set()
        for i, n in enumerate(nodes):
            a = g.ann[n.name]
            if a.role is Role.WRITE_GRAD:
                kw = n.kwargs
                first, last = a.param not in written, writes.count(a.param) == 1
                if kw.get("accumulate", False) == first:
                    _fail(g, i, f"the {'first' if first else 'a later'} gradient write of {a.param} must "
                                f"{'copy' if first else 'add'} (accumulate={kw.get('accumulate')})")
                if kw.get("final", True) != last:
                    _fail(g, i, f"final={kw.get('final')} on a gradient write of {a.param} that is "
                                f"{'' if last else 'not '}its last")
                writes.remove(a.param)
                written.add(a.param)
            elif a.role is Role.PARAM_VIEW and a.param in written and g.chunk_of(a.param).grad_inplace:
                _fail(g, i, f"parameter {a.param} is read after its gradient overwrote it (chunk in place)")
    if Role.GUARD in roles:
        _check_guards(g, roles)
    if Role.OPTIMIZER_STEP in roles:
        _check_steps(g)
    if g.plan is not None:
        _check_schedule(g)
    if Role.OPTIMIZER_STEP in roles:
        _check_disk(g)
    _check_collectives(g, roles)
    return g


def _check_collectives(g: TrainGraph, roles: list[Role]) -> None:
    nodes = g.nodes
    # the shard pass makes them; the fuse pass, after it, keeps them (regions end at every chunk operation)
    sharded = g.stage == "sharded" or (g.stage == "fused" and g.settings.world > 1)
    if not sharded:
        for i, n in enumerate(nodes):
            if n.target in (ops.all_gather, ops.reduce_scatter):
                _fail(g, i, f"a collective in a graph of stage '{g.stage}' (collectives come from the shard pass)")
        return
    if g.settings.world < 2:
        _fail(g, None, "a sharded graph for a single rank")
    last_write: dict[int, int] = {}
    reduced: dict[int, int] = {}
    for i, n in enumerate(nodes):
        a = g.ann[n.name]
        if n.target is ops.fetch and a.buf is BufKind.PARAM:
            _fail(g, i, f"chunk {a.chunk}'s parameters are fetched without gathering the other ranks' shards")
        if a.role is Role.WRITE_GRAD:
            c = g.param(a.param).chunk
            if c in reduced:
                _fail(g, i, f"a gradient of chunk {c} is written after its reduce_scatter")
            last_write[c] = i
        elif a.role is Role.REDUCE_SCATTER:
            if a.chunk in reduced:
                _fail(g, i, f"chunk {a.chunk} is reduce-scattered twice")
            if last_write.get(a.chunk) != i - 1:
                _fail(g, i, f"reduce_scatter of chunk {a.chunk} does not follow its last gradient write")
            reduced[a.chunk] = i
        elif a.role is Role.OPTIMIZER_STEP and a.chunk not in reduced:
            _fail(g, i, f"chunk {a.chunk} is stepped before its gradient is reduce-scattered")
    for c in g.chunks:
        if c.group is ChunkGroup.TRAINABLE and c.id not in reduced and g.settings.optimizer is not None:
            _fail(g, None, f"trainable chunk {c.id} is never reduce-scattered")
        if c.capacity % g.settings.world:
            _fail(g, None, f"chunk {c.id}'s capacity {c.capacity} is not divisible by {g.settings.world} ranks")


def _check_chunks(g: TrainGraph) -> None:
    if not g.chunks:
        return
    for c in g.chunks:
        spans = sorted((g.param(p).offset, g.param(p).offset + g.param(p).numel, p) for p in c.params)
        for (a0, a1, pa), (b0, _, pb) in zip(spans, spans[1:]):
            if b0 < a1:
                _fail(g, None, f"chunk {c.id}: parameters {pa} and {pb} overlap")
        if spans and (spans[0][0] < 0 or spans[-1][1] > c.capacity):
            _fail(g, None, f"chunk {c.id}: a parameter lies outside its capacity {c.capacity}")
        for p in c.params:
            if g.param(p).chunk != c.id:
                _fail(g, None, f"parameter {p} listed in chunk {c.id} but assigned to {g.param(p).chunk}")
            if (c.group is ChunkGroup.TRAINABLE) != g.param(p).trainable:
                _fail(g, None, f"parameter {p} is in a chunk of the wrong group")


def _check_guards(g: TrainGraph, roles: list[Role]) -> None:
    first_update = next((i for i, r in enumerate(roles) if r in (Role.COMMIT, Role.OPTIMIZER_STEP)), len(roles))
    for i, n in enumerate(g.nodes):
        if roles[i] is not Role.GUARD:
            continue
        if n.target is not ops.guard:
            _fail(g, i, f"node {n.name} has the role guard but runs {n.target}")
        if i > first_update:
            _fail(g, i, f"guard {n.name} comes after the {roles[first_update].value} at node {first_update}: a "
                        "failed guard reruns the step, which must not have committed or updated anything")


def _check_steps(g: TrainGraph) -> None:
    nodes = g.nodes
    pos = {n: i for i, n in enumerate(nodes)}
    last_use: dict[int, int] = {}
    step_at: dict[int, int] = {}
    committed = False
    for i, n in enumerate(nodes):
        a = g.ann[n.name]
        if a.role is Role.COMMIT:
            committed = True
        elif a.role is Role.OPTIMIZER_STEP and not committed and not g.chunks[a.chunk].undo and not (
                g.settings.early_updates and _host_placed(g.chunks[a.chunk])):
            _fail(g, i, f"optimizer_step of chunk {a.chunk} before the commit (a failure there could not be undone; "
                        "only the steps of chunks whose states live on the host, with atomic=False, or of chunks "
                        "keeping an undo buffer may come early)")
        elif a.role is Role.OPTIMIZER_STEP and committed and g.chunks[a.chunk].undo:
            _fail(g, i, f"chunk {a.chunk} keeps an undo buffer, but its optimizer_step comes after the commit")
        if a.role in (Role.PARAM_VIEW, Role.WRITE_GRAD):
            c = g.param(a.param).chunk
            if c in step_at:
                _fail(g, i, f"chunk {c} is used after its optimizer_step")
            last_use[c] = max([i] + [pos[u] for u in n.users]) if a.role is Role.PARAM_VIEW else i
        elif a.role is Role.OPTIMIZER_STEP:
            if a.chunk in step_at:
                _fail(g, i, f"chunk {a.chunk} is stepped twice")
            if g.chunks[a.chunk].group is not ChunkGroup.TRAINABLE:
                _fail(g, i, f"chunk {a.chunk} has no optimizer state but is stepped")
            if last_use.get(a.chunk, -1) > i:
                _fail(g, i, f"optimizer_step of chunk {a.chunk} comes before a use of the chunk")
            step_at[a.chunk] = i
    for c in g.chunks:
        if c.group is ChunkGroup.TRAINABLE and c.id not in step_at:
            _fail(g, None, f"trainable chunk {c.id} is never stepped")
        if c.group is ChunkGroup.TRAINABLE and c.state_home is None:
            _fail(g, None, f"trainable chunk {c.id} has no state home")
        if c.streamed and (c.state_home is not StateHome.HOST or g.settings.world > 1):
            _fail(g, None, f"chunk {c.id} streams its update, but only a chunk whose states live on the host, with "
                           "one rank, may")
        if c.undo and (c.update_site is not UpdateSite.CPU or c.state_home is not StateHome.HOST
                       or not g.settings.undo_possible):
            _fail(g, None, f"chunk {c.id} keeps an undo buffer, but only a chunk the CPU updates from host states, in "
                           "an atomic step of one rank whose commit decides nothing, may")


def _check_schedule(g: TrainGraph) -> None:
    nodes = g.nodes
    lv = analyze(nodes, g.ann)
    static = static_bytes(g)
    budget = g.settings.budget
    start = dict(g.plan.carried)         # key -> host copy stale, at the start of every step
    resident: dict[BufKey, bool] = dict(start)    # key -> written on the device since its host copy was current
    host_has = {BufKey(c.id, BufKind.PARAM) for c in g.chunks} | {BufKey(c.id, BufKind.STATES)
                                                                   for c in g.chunks if c.streamed}
    holds_grads: set[int] = set()          # chunks whose PARAM buffer holds their gradients (in place)
    for c in g.chunks:
        if c.param_home is ParamHome.MASTER and not (g.settings.precision.mixed and c.group is ChunkGroup.TRAINABLE
                                                     and c.state_home is StateHome.DEVICE):
            _fail(g, None, f"chunk {c.id}'s parameters are cast from a device master, but it has none (only "
                  "mixed precision, trainable, with its optimizer states on the device)")
    for k in start:
        if k.buf is not BufKind.PARAM:
            _fail(g, None, f"{k} is carried across steps, but only parameter buffers are")
    later_uses: dict[BufKey, int] = {}
    nd = all_needs(g)
    for x in nd:
        for k in x.resident:
            later_uses[k] = later_uses.get(k, 0) + 1
    used = sum(buf_bytes(g, k) for k in start)
    peak = 0
    for i, n in enumerate(nodes):
        a = g.ann[n.name]
        x = nd[i]
        shown = used
        if a.role is Role.FETCH:
            key = BufKey(a.chunk, a.buf)
            if key in resident:
                _fail(g, i, f"{key} fetched while resident")
            if n.target in (ops.fetch, ops.all_gather) and key not in host_has:
                _fail(g, i, f"{key} fetched from a host copy that holds no data (use alloc)")
            if n.target is ops.alloc and key in host_has:
                _fail(g, i, f"{key} allocated zeroed while its host copy holds data that is needed (use fetch)")
            resident[key] = False
            used += buf_bytes(g, key)
            shown = used
        elif a.role is Role.RELEASE:
            key = BufKey(a.chunk, a.buf)
            if key not in resident:
                _fail(g, i, f"{key} released while not resident")
            dirty = resident.pop(key)
            master = g.chunks[key.chunk].param_home is ParamHome.MASTER and key.buf is BufKind.PARAM
            if master and n.kwargs["writeback"]:
                _fail(g, i, f"{key} is written back, but its parameters have no host home (cast from the master)")
            elif master and dirty and key.chunk in holds_grads:
                _fail(g, i, f"{key} holds gradients (in place) and is dropped: its parameters have no host home "
                      "to take them")
            elif master:
                pass        # the master rounded, cast again at the next fetch
            elif dirty and n.kwargs["writeback"]:
                host_has.add(key)
            elif dirty:
                needed_later = (key.buf is not BufKind.GRAD or later_uses.get(key, 0) > 0
                                or g.chunks[key.chunk].update_site is UpdateSite.CPU)
                if needed_later:
                    _fail(g, i, f"{key} was written on the device and is dropped without write-back")
            used -= buf_bytes(g, key)
        elif a.role is Role.WRITE_GRAD and g.chunk_of(a.param).grad_inplace:
            holds_grads.add(g.chunk_of(a.param).id)
        elif a.role is Role.OPTIMIZER_STEP and g.chunks[a.chunk].update_site is UpdateSite.DEVICE:
            holds_grads.discard(a.chunk)
        elif a.role is Role.OPTIMIZER_STEP and g.chunks[a.chunk].update_site is UpdateSite.CPU:
            c = g.chunks[a.chunk]
            if any(BufKey(c.id, b) in resident for b in c.buffers()):
                _fail(g, i, f"host-side step of chunk {c.id} while one of its buffers is on the device")
            if BufKey(c.id, c.grad_buf()) not in host_has:
                _fail(g, i, f"host-side step of chunk {c.id} but its gradient never reached the host")
        for k in x.resident:
            if k not in resident:
                _fail(g, i, f"{k} is used but not resident on the device")
            later_uses[k] -= 1
        for k in x.writes:
            resident[k] = True
        total = static + shown + lv.live[i] + x.workspace
        peak = max(peak, total)
        if budget is not None and total > budget:
            _fail(g, i, f"device bytes {total} exceed the budget {budget}")
        if a.resident_bytes is not None and a.resident_bytes != shown:
            _fail(g, i, f"annotated resident bytes {a.resident_bytes} != replayed {shown}")
    if resident.keys() != start.keys():
        _fail(g, len(nodes) - 1, "the cycle does not close: resident at the end "
              f"{sorted(k.order() for k in resident)}, carried into the step {sorted(k.order() for k in start)}")
    stale = sorted(k.order() for k, dirty in resident.items() if dirty and not start[k])
    if stale:
        _fail(g, len(nodes) - 1, f"the cycle does not close: {stale} end stale on the host, but the next step "
              "assumes their host copies current")
    if g.plan.predicted_peak != peak:
        _fail(g, None, f"plan's predicted peak {g.plan.predicted_peak} != replayed peak {peak}")
    _check_streamed(g)


def _host_placed(c) -> bool:
    """A chunk whose optimizer states live on the host or disk: updated by the CPU, or streamed to the device."""
    return c.update_site is UpdateSite.CPU or c.streamed


def _check_streamed(g: TrainGraph) -> None:
    """Each streamed chunk's states: fetched once (a copy of the host home), then its step, then one release that
    writes them back; nothing else moves them."""
    want = ("fetch", "step", "writeback")
    seen: dict[int, list[str]] = {c.id: [] for c in g.chunks if c.streamed}
    for i, n in enumerate(g.nodes):
        a = g.ann[n.name]
        if a.chunk not in seen:
            continue
        if a.buf is BufKind.STATES and a.role is Role.FETCH:
            what = "fetch" if n.target is ops.fetch else "alloc"
        elif a.buf is BufKind.STATES and a.role is Role.RELEASE:
            what = "writeback" if n.kwargs["writeback"] else "drop"
        elif a.role is Role.OPTIMIZER_STEP:
            what = "step"
        else:
            continue
        _in_order(g, i, seen, a.chunk, what, want, "streamed update",
                  "its states must be fetched, updated by its step, then written back")
    _all_in_order(g, seen, want, "streamed update", "its states must be fetched, updated by its step, then written back")


def _in_order(g: TrainGraph, i: int, seen: dict[int, list[str]], chunk: int, what: str, want: tuple[str, ...],
              kind: str, rule: str) -> None:
    """Record chunk's move `what` at node i; its moves so far must begin `want`."""
    got = seen[chunk]
    got.append(what)
    if tuple(got) != want[:len(got)]:
        _fail(g, i, f"chunk {chunk}'s {kind}: {got}, where {rule}")


def _all_in_order(g: TrainGraph, seen: dict[int, list[str]], want: tuple[str, ...], kind: str, rule: str) -> None:
    """At the end of the graph every chunk's moves are exactly `want`."""
    for cid, got in seen.items():
        if tuple(got) != want:
            _fail(g, None, f"chunk {cid}'s {kind}: {got}, where {rule}")


_DISK_RULE = "its states must be read into a staging buffer, updated by its step, then written back after it"


def _check_disk(g: TrainGraph) -> None:
    """Disk-homed states: each chunk's read, step and write in that order, once each; a staging buffer holds one
    chunk's states at a time; the host and disk budgets hold."""
    st = g.settings
    disk = {c.id for c in g.chunks if c.state_home is StateHome.DISK}
    for cid in sorted(disk):
        c = g.chunks[cid]
        if c.streamed or c.update_site is not UpdateSite.CPU:
            _fail(g, None, f"chunk {cid}'s states live on disk, but it is not updated by the CPU worker")
        if st.disk_budget is None:
            _fail(g, None, f"chunk {cid}'s states live on disk, but the plan has no disk budget")
    slots, _ = staging(g)
    seen: dict[int, list[str]] = {cid: [] for cid in disk}
    holder: dict[int, int] = {}         # staging buffer -> the chunk read into it and not yet written back
    committed = False
    want = ("read", "step", "write")
    for i, n in enumerate(g.nodes):
        a = g.ann[n.name]
        if a.role is Role.COMMIT:
            committed = True
        if a.role not in (Role.DISK_READ, Role.DISK_WRITE) and not (a.role is Role.OPTIMIZER_STEP and a.chunk in disk):
            continue
        if a.chunk not in disk:
            _fail(g, i, f"a disk {a.role.value.split('_')[1]} of chunk {a.chunk}, whose states do not live on disk")
        if a.role is Role.OPTIMIZER_STEP:
            what = "step"
        else:
            what = "read" if a.role is Role.DISK_READ else "write"
            slot = n.kwargs.get("slot")
            if not isinstance(slot, int) or not 0 <= slot < slots:
                _fail(g, i, f"staging buffer {slot!r} of chunk {a.chunk}'s disk {what}: the plan has {slots}")
            if what == "read":
                if slot in holder:
                    _fail(g, i, f"chunk {a.chunk}'s states are read into staging buffer {slot} while chunk "
                                f"{holder[slot]}'s, read into it before, are not written back yet")
                holder[slot] = a.chunk
            else:
                if holder.get(slot) != a.chunk:
                    _fail(g, i, f"chunk {a.chunk}'s states are written back from staging buffer {slot}, which holds "
                                f"{'nothing' if slot not in holder else f'chunk {holder[slot]}'}")
                del holder[slot]
                if not committed and not st.early_updates:
                    _fail(g, i, f"chunk {a.chunk}'s states are written to disk before the commit (a step that "
                                "failed there would have changed them)")
        _in_order(g, i, seen, a.chunk, what, want, "disk-homed update", _DISK_RULE)
    _all_in_order(g, seen, want, "disk-homed update", _DISK_RULE)
    if g.plan is not None and st.host_budget is not None:
        host = host_bytes(g)
        if host > st.host_budget:
            _fail(g, None, f"host bytes {host} exceed the host budget {st.host_budget} (at every node: the staging "
                           "buffers are held for the whole step)")
    if disk and disk_bytes(g) > st.disk_budget:
        _fail(g, None, f"disk bytes {disk_bytes(g)} exceed the disk budget {st.disk_budget}")
