"""Where the updates of chunks whose optimizer states live on the host run: on the CPU worker, or on the device with
their states streamed over and back (`ChunkInfo.streamed`); and whether an atomic step's CPU updates may run before
its commit with undo buffers (`ChunkInfo.undo`: `no_undo_reason`, `undo_room`). A helper of place_optimizer, which
builds the graphs.

An atomic step can start its CPU updates only at the commit, at the end of backward; the next forward then waits
for them, chunk by chunk, while the device and the PCIe link sit mostly idle. A streamed chunk's update instead
copies its states (fp32: m, v and in mixed precision the master, 12 bytes per parameter) into a device slot, runs
the device's Adam on them (the kernel of device-state chunks) and copies them back to their host home: about 22 ms
each way at PCIe speed for a chunk of 91M parameters against 37-46 ms of CPU update on the H200 machine. The state
home stays the host (between steps the states live there; checkpoints and the store see no difference); what
changes is where the update runs. Streaming every chunk would make the copy lanes the bottleneck instead (the next
forward's parameter fetches share them), so the cost model chooses how many: the first k of an order of the CPU's
chunks (in an atomic step the CPU's update order, the chunks the next forward needs first; with atomic=False every
other chunk of it first, below), k chosen by estimating a few candidate schedules.

In an atomic step streamed updates come after the commit, so the atomic contract is unchanged. With atomic=False the
CPU updates during backward, each chunk as soon as the step is done with it, and can still bound the step: the
17.26B GPT's 82 host updates took 3.9-4.6 s of a 4.2-4.9 s step on the H200 machine, while the copy lanes were busy
about 15% of it. There the streamed chunks (every other one of the CPU's order first, so that the device thins
the CPU's queue evenly) update on the device right after their chunk's last use, their states fetched through the
idle link. With several ranks streaming is not built (a streamed shard would also need the chunk's all-gather after
its update).
"""
from __future__ import annotations

from typing import Callable, NamedTuple

from ..cost import Machine, cpu_update_rate, estimate
from ..errors import BudgetError
from ..ir.graph import Settings, TrainGraph
from ..ir.needs import host_bytes, shard_numel, state_bytes, state_layout
from .schedule import schedule


def no_stream_reason(settings: Settings) -> str | None:
    """Why no chunk may stream its update under these settings, or None when they may."""
    if settings.world > 1:
        return ("streamed updates are not built for several ranks (the updated shard would also need its chunk "
                "gathered again)")
    return None


def no_undo_reason(settings: Settings) -> str | None:
    """Why the planner gives no chunk an undo buffer under these settings (None: it may): what the verifier checks
    (`Settings.no_undo`), and a host budget to size the buffers against, with no disk tier."""
    if settings.no_undo is not None:
        return settings.no_undo
    if settings.disk_budget is not None:
        return "host memory is short enough for a disk tier"
    if settings.host_budget is None:
        return "no host budget to size undo buffers against"
    return None


def undo_room(scheduled: TrainGraph) -> int:
    """The host bytes the host budget has spare beside what `scheduled` (a schedule without undo buffers, nothing
    streamed: the most host bytes any of its streamed choices keeps) keeps in host memory: room for undo buffers.
    With the default budget (host_memory=None: the host's memory less a tenth, a guess at what the process may take)
    they leave a tenth of it free as well: the process's own memory beyond the plan also takes from that first tenth
    (at the 17.26B GPT on the H200 machine, about 9.7 GiB of it), and undo buffers are a speed-up, not a need. They
    also stay within what the host had free at px.compile (`Settings.host_spare`): on a node shared with other
    processes the budget, the host's whole memory, may be far more than there is."""
    st = scheduled.settings
    if st.host_budget is None:
        return 0
    limit = st.host_budget - (st.host_budget // 10 if st.host_default else 0)
    if st.host_default and st.host_spare is not None:
        limit = min(limit, st.host_spare)
    return max(0, limit - host_bytes(scheduled))


def candidates(n: int, cpu_s: float, copy_s: float) -> list[int]:
    """How many of n CPU-updated chunks to try streaming first: none, the balance point b where the CPU's updates
    take as long as the streamed chunks' copies each way (cpu_s and copy_s per chunk), b/2, and halfway from b to
    all. Each costs a schedule and an estimate (about 5 s for a 17B GPT), so only a few."""
    balance = round(n * cpu_s / (cpu_s + copy_s)) if cpu_s + copy_s > 0 else 0
    return sorted({0, balance // 2, balance, (balance + n + 1) // 2})


def _fastest(tried: dict) -> int:
    """The fewest streamed among the k estimated fastest (within 1e-9: the estimate sums the same times in another
    order for each k, which differ in the last bits)."""
    low = min(t[0] for t in tried.values())
    return min(k for k, t in tried.items() if t[0] <= low * (1 + 1e-9))


class Placement(NamedTuple):
    """A placed graph, its schedule (None: not scheduled yet), why it was chosen, and its estimated step (None: not
    estimated)."""
    placed: TrainGraph
    scheduled: TrainGraph | None
    why: str
    seconds: float | None = None

    def timed(self, machine: Machine, program_s) -> "Placement":
        """This placement scheduled and estimated (BudgetError where its schedule does not fit)."""
        scheduled = self.scheduled if self.scheduled is not None else schedule(self.placed)
        seconds = self.seconds if self.seconds is not None else \
            estimate(scheduled, machine, program_s=program_s).seconds
        return self._replace(scheduled=scheduled, seconds=seconds)


def choose_streamed(g: TrainGraph, order: list[int], build: Callable[[int], TrainGraph], machine: Machine,
                    program_s, base: tuple[TrainGraph, TrainGraph | None]) -> Placement:
    """The placed graph with the first k of `order` (the CPU's chunks in the order they stream) streamed, for the k
    whose schedule the cost model finds fastest, that schedule (None: not scheduled here), why, in a sentence, and
    its estimate (None where none was made). `build(k)` makes the placed graph for k; `base` is the one for k = 0
    and its schedule if known. A candidate whose schedule does not fit the budget is skipped; a tie goes to fewer
    streamed chunks."""
    forced = g.settings.device_updates
    reason = no_stream_reason(g.settings)
    if reason is not None:
        return Placement(*base, f"no host-placed chunk updated on the device: {reason}")
    if forced is not None:
        k = min(forced, len(order))
        why = f"{k} host-placed chunks updated on the device (states streamed), as _device_updates asks"
        return Placement(*((build(k), None) if k else base), why)
    if not order:
        return Placement(*base, "no host-placed chunk updated on the device: none has room for its states beside "
                                "its step")
    if g.settings.budget is None:
        return Placement(*base, "no host-placed chunk updated on the device: no budget")
    if g.settings.host_is_device:
        return Placement(*base, "no host-placed chunk updated on the device: a CPU device is the host, so a streamed "
                                "update would run on the same cores after two copies")
    world, prec = g.settings.world, g.settings.precision
    elems = sum(shard_numel(g.chunks[c], world) for c in order) / len(order)
    cpu_s = elems / cpu_update_rate(g.settings, machine)
    copy_s = sum(state_bytes(g.chunks[c], prec, world, state_layout(g.settings)) for c in order) / len(order) / machine.h2d_bytes
    tried: dict[int, tuple[float, TrainGraph, TrainGraph]] = {}

    def attempt(k: int) -> None:
        if k in tried:
            return
        placed = base[0] if k == 0 else build(k)
        scheduled = base[1] if k == 0 and base[1] is not None else None
        try:
            scheduled = scheduled if scheduled is not None else schedule(placed)
        except BudgetError:
            return
        tried[k] = (estimate(scheduled, machine, program_s=program_s).seconds, placed, scheduled)

    for k in candidates(len(order), cpu_s, copy_s):
        attempt(k)
    if not tried:
        return Placement(*base, "no host-placed chunk updated on the device: no candidate's schedule fits the budget")
    best = _fastest(tried)
    done = sorted(tried)
    at = done.index(best)
    for other in done[max(0, at - 1):at] + done[at + 1:at + 2]:      # halve the gaps to the best's neighbours
        attempt((best + other) // 2)
    best = _fastest(tried)
    seconds, placed, scheduled = tried[best]
    figures = ", ".join(f"{k}: {tried[k][0]:.4g} s" for k in sorted(tried))
    why = (f"{best} of {len(order)} host-placed chunks updated on the device, their states streamed over and "
           f"back (steps estimated with k streamed: {figures}); the CPU updates the rest" if best else
           f"none of {len(order)} host-placed chunks streamed: the CPU updating them all is estimated fastest "
           f"(steps estimated with k streamed: {figures})")
    return Placement(placed, scheduled, why, seconds)
