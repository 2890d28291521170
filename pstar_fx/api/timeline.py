"""The memory plan as data, and as a picture: `step.memory_timeline()` and `px.plot_memory(step, "memory.png")`.

One `Row` per node of the scheduled graph, in execution order: the device bytes the plan predicts while the node runs,
by kind (static: module buffers, tensor constants and the optimizer states placed on the device; chunks: resident
chunk buffers; activations: live activation storages; workspace: the node's own temporaries), their sum
(`predicted`, the figure the verifier holds under the budget and whose maximum is `plan.predicted_peak`), the bytes
measured after the node by the step's latest `debug=True` call when that call ran this signature (None otherwise),
and the chunk move the node makes, if it is one (fetch, alloc, release).

Plotting needs matplotlib, an optional extra: `pip install pstar-fx[plot]`.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, fields

import torch.fx as fx

from ..ir import ops
from ..ir.graph import BufKind, Phase, Role, TrainGraph
from ..units import format_bytes


class MoveKind(enum.Enum):
    FETCH = "fetch"          # host -> device copy into a slot (or a cast from the chunk's master on the device)
    ALLOC = "alloc"          # a zeroed slot, no copy (a gradient buffer before its first write)
    RELEASE = "release"      # the slot is freed (written back to the host first when `writeback`)


_MOVES = {ops.fetch: MoveKind.FETCH, ops.all_gather: MoveKind.FETCH, ops.alloc: MoveKind.ALLOC,
          ops.release: MoveKind.RELEASE}


@dataclass(frozen=True)
class ChunkMove:
    kind: MoveKind
    chunk: int
    buf: BufKind
    writeback: bool = False


@dataclass(frozen=True)
class Row:
    index: int
    name: str
    phase: Phase
    role: Role
    static: int                  # bytes always on the device during the step
    chunks: int                  # resident chunk buffers
    activations: int             # live activation storages
    workspace: int               # the node's own temporaries (a device-side mixed-precision optimizer step)
    predicted: int               # static + chunks + activations + workspace
    measured: int | None         # device bytes measured after the node (debug=True step), else None
    move: ChunkMove | None       # the chunk move this node makes, if any


def _move(n: fx.Node) -> ChunkMove | None:
    kind = _MOVES.get(n.target) if n.op == "call_function" else None
    if kind is None:
        return None
    return ChunkMove(kind, n.kwargs["chunk"], n.kwargs["buf"], bool(n.kwargs.get("writeback", False)))


def memory_timeline(g: TrainGraph, measured: tuple[TrainGraph, list[int]] | None = None) -> list[Row]:
    """The rows of a scheduled graph. `measured` is (graph, per-node bytes) from a debug step; used only when it
    was measured on this very graph."""
    assert g.plan is not None, "memory_timeline needs a scheduled graph"
    per_node = measured[1] if measured is not None and measured[0] is g else None
    static = g.plan.static_bytes
    rows = []
    for i, n in enumerate(g.nodes):
        a = g.ann[n.name]
        chunks, acts = a.resident_bytes or 0, a.live_bytes or 0
        rows.append(Row(index=i, name=n.name, phase=a.phase, role=a.role, static=static, chunks=chunks,
                        activations=acts, workspace=a.workspace_bytes,
                        predicted=static + chunks + acts + a.workspace_bytes,
                        measured=None if per_node is None else per_node[i], move=_move(n)))
    return rows


def columns(rows: list[Row]) -> dict[str, list]:
    """The rows as a dict of columns (field name -> list), e.g. for `pandas.DataFrame(columns(rows))`."""
    return {f.name: [getattr(r, f.name) for r in rows] for f in fields(Row)}


# -- plotting --------------------------------------------------------------------------------------------------------
_PLOT_MISSING = ("px.plot_memory draws with matplotlib, which is not installed: pip install 'pstar-fx[plot]' "
                 "(or pip install matplotlib). step.memory_timeline() gives the same figures as data without it.")
_KINDS = (("static", "static (buffers, device optimizer states)", "#8c8c8c"),
          ("chunks", "chunks (parameters, gradients)", "#4c72b0"),
          ("activations", "activations", "#dd8452"),
          ("workspace", "workspace", "#c44e52"))
_PHASE_SHADE = {Phase.FORWARD: "#e8f1fa", Phase.BACKWARD: "#fbeee6", Phase.OPTIMIZER: "#eaf5e9"}
_MOVE_STYLE = {MoveKind.FETCH: ("^", "#2ca02c", "fetch"), MoveKind.ALLOC: ("s", "#9467bd", "alloc"),
               MoveKind.RELEASE: ("v", "#d62728", "release")}


def _unit(peak: int) -> tuple[float, str]:
    for scale, name in ((2 ** 30, "GiB"), (2 ** 20, "MiB"), (2 ** 10, "KiB")):
        if peak >= 2 * scale:
            return float(scale), name
    return 1.0, "bytes"


def _phase_spans(rows: list[Row]) -> list[tuple[Phase, int, int]]:
    """Contiguous (phase, first, end) runs for shading; a run of a few nodes inside another phase (a fetch the
    schedule placed between backward nodes) takes its neighbours' phase, so the picture shows the step's shape."""
    spans: list[list] = []
    for r in rows:
        if spans and spans[-1][0] is r.phase:
            spans[-1][2] = r.index + 1
        else:
            spans.append([r.phase, r.index, r.index + 1])
    short = max(2, len(rows) // 100)
    for k in range(1, len(spans) - 1):
        if spans[k][2] - spans[k][1] <= short and spans[k - 1][0] is spans[k + 1][0]:
            spans[k][0] = spans[k - 1][0]
    merged: list[list] = []
    for s in spans:
        if merged and merged[-1][0] is s[0]:
            merged[-1][2] = s[2]
        else:
            merged.append(list(s))
    return [(p, lo, hi) for p, lo, hi in merged if p in _PHASE_SHADE]


def plot_memory(step, path, *, title: str | None = None) -> list[Row]:
    """Draw the latest compiled step's memory timeline into an image file (format from the name: png, svg, pdf):
    stacked areas for the predicted bytes by kind, a line for the measured bytes after a debug=True step, the budget,
    forward / backward / optimizer phases shaded, and below, every chunk move (fetch, alloc, release) by chunk.
    Returns the rows it drew."""
    try:
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as e:
        raise ImportError(_PLOT_MISSING) from e
    g = step.final_graph
    rows = step.memory_timeline()
    peak = max(max(r.predicted for r in rows), max((r.measured or 0) for r in rows), g.plan.budget or 0)
    scale, unit = _unit(peak)
    x = [r.index for r in rows] + [len(rows)]        # each node spans [index, index + 1)

    fig = Figure(figsize=(12, 6.5), layout="constrained")
    ax, lane = fig.subplots(2, 1, sharex=True, height_ratios=(3, 1))
    for phase, lo, hi in _phase_spans(rows):
        for a in (ax, lane):
            a.axvspan(lo, hi, color=_PHASE_SHADE[phase], zorder=0, lw=0)
    bottom = [0.0] * len(rows)
    for key, label, color in _KINDS:
        top = [b + getattr(r, key) / scale for b, r in zip(bottom, rows)]
        if any(t != b for t, b in zip(top, bottom)):
            ax.stairs(top, x, baseline=bottom, fill=True, color=color, alpha=0.85, label=label, zorder=2)
        bottom = top
    if any(r.measured is not None for r in rows):
        ax.stairs([(r.measured or 0) / scale for r in rows], x, color="black", lw=1.0, ls="--",
                  label="measured (debug step)", zorder=3)
    if g.plan.budget is not None:
        ax.axhline(g.plan.budget / scale, color="#d62728", lw=1.2, label=f"budget {format_bytes(g.plan.budget)}",
                   zorder=3)
    ax.axhline(g.plan.predicted_peak / scale, color="#4c72b0", lw=0.8, ls=":",
               label=f"predicted peak {format_bytes(g.plan.predicted_peak)}", zorder=3)
    ax.set_ylabel(f"device memory ({unit})")
    ax.set_ylim(0, peak / scale * 1.05)
    ax.margins(x=0)
    s = g.settings
    ax.set_title(title or f"pstar-fx memory plan: {len(rows)} nodes, {len(g.chunks)} chunks, "
                          f"{s.precision.value} on {s.device.type}", fontsize=10)

    for kind, (marker, color, label) in _MOVE_STYLE.items():
        pts = [(r.index + 0.5, r.move.chunk) for r in rows if r.move is not None and r.move.kind is kind]
        if pts:
            lane.scatter([p[0] for p in pts], [p[1] for p in pts], marker=marker, s=16, color=color,
                         label=f"{label} (chunk)", zorder=2, linewidths=0)
    lane.set_ylabel("chunk")
    lane.set_xlabel("node (execution order)")
    lane.set_ylim(-0.7, max(len(g.chunks) - 0.3, 0.7))
    lane.yaxis.get_major_locator().set_params(integer=True)
    handles = ax.get_legend_handles_labels()[0] + lane.get_legend_handles_labels()[0]
    handles += [Patch(color=c, label=p.value) for p, c in _PHASE_SHADE.items()
                if any(span[0] is p for span in _phase_spans(rows))]
    fig.legend(handles=handles, loc="outside lower center", ncols=min(len(handles), 6), fontsize=8, frameon=False)
    fig.savefig(path, dpi=110)
    return rows
