"""step.memory_timeline() and px.plot_memory: the plan's per-node device bytes as data (and as a picture), with what a
debug=True step measured beside them."""
import sys

import pytest
import torch

import pstar_fx as px
from pstar_fx.ir import Role
from pstar_fx.api.timeline import ChunkMove, MoveKind, Row, columns

from harness import compiled_step, tight_budget
from models import CASES_BY_NAME

GPT_CASE = CASES_BY_NAME["gpt_tied"]
CNN_CASE = CASES_BY_NAME["cnn_bn"]


@pytest.fixture(scope="module")
def tight_gpt():
    """A tight budget: chunks move during the step. Two debug steps (the second starts from trained values)."""
    step = compiled_step(GPT_CASE, budget=tight_budget(GPT_CASE, 2048), chunk_size=2048, debug=True)
    for i in range(2):
        step(*GPT_CASE.batch(i))
    return step


def _plan_rows(g):
    """The plan's own per-node figures, as the verifier and api._check_measured compute them."""
    out = []
    for n in g.nodes:
        a = g.ann[n.name]
        out.append(g.plan.static_bytes + a.resident_bytes + a.live_bytes + a.workspace_bytes)
    return out


def test_predicted_is_the_plans_per_node_bytes_and_measured_equals_it_after_a_debug_step(tight_gpt):
    g = tight_gpt.graphs["scheduled"]
    rows = tight_gpt.memory_timeline()
    assert [r.index for r in rows] == list(range(len(g.nodes))) and [r.name for r in rows] == [n.name for n in g.nodes]
    assert [r.predicted for r in rows] == _plan_rows(g)
    assert all(r.predicted == r.static + r.chunks + r.activations + r.workspace for r in rows)
    assert max(r.predicted for r in rows) == g.plan.predicted_peak
    assert [r.measured for r in rows] == [r.predicted for r in rows]
    assert max(r.chunks for r in rows) > 0 and max(r.activations for r in rows) > 0
    # at the end, what the plan carries into the next step (residency across steps)
    assert rows[-1].chunks == sum(g.chunks[key.chunk].nbytes for key, _ in g.plan.carried)
    assert {r.phase for r in rows} >= {px.ir.Phase.FORWARD, px.ir.Phase.BACKWARD, px.ir.Phase.OPTIMIZER}


def test_chunk_moves_are_the_scheduled_fetches_and_releases(tight_gpt):
    g = tight_gpt.graphs["scheduled"]
    rows = tight_gpt.memory_timeline()
    moves = [(r.index, r.move) for r in rows if r.move is not None]
    want = [(i, g.ann[n.name]) for i, n in enumerate(g.nodes) if g.ann[n.name].role in (Role.FETCH, Role.RELEASE)]
    assert [i for i, _ in moves] == [i for i, _ in want]
    for (_, m), (_, a) in zip(moves, want):
        assert isinstance(m, ChunkMove) and m.chunk == a.chunk and m.buf is a.buf
        assert (m.kind is MoveKind.RELEASE) == (a.role is Role.RELEASE)
    kinds = {m.kind for _, m in moves}
    assert kinds == {MoveKind.FETCH, MoveKind.ALLOC, MoveKind.RELEASE}
    fetched = sum(g.chunks[m.chunk].nbytes for _, m in moves if m.kind is MoveKind.FETCH)
    assert fetched == g.plan.h2d_bytes
    assert sum(m.kind is not MoveKind.RELEASE for _, m in moves) == g.plan.fetches   # the plan counts allocs too
    assert sum(m.kind is MoveKind.RELEASE for _, m in moves) == g.plan.releases


def test_static_and_workspace_columns():
    """cnn_bn: BatchNorm buffers are static; bf16 unlimited: the optimizer states live on the device (static) and a
    device-side mixed-precision step has an fp32 workspace."""
    step = compiled_step(CNN_CASE, precision="bf16", debug=True)
    step(*CNN_CASE.batch(0))
    g = step.graphs["scheduled"]
    rows = step.memory_timeline()
    buffers = sum(b.nbytes for b in g.buffers)
    assert buffers > 0 and all(r.static == g.plan.static_bytes > buffers for r in rows)
    assert any(r.workspace > 0 and r.role is Role.OPTIMIZER_STEP for r in rows)
    assert [r.measured for r in rows] == [r.predicted for r in rows]
    cols = columns(rows)
    assert set(cols) == {f for f in Row.__dataclass_fields__} and all(len(v) == len(rows) for v in cols.values())
    assert cols["predicted"] == [r.predicted for r in rows]


def test_measured_is_none_without_a_debug_step_of_that_signature():
    step = compiled_step(GPT_CASE, debug=False)
    step(*GPT_CASE.batch(0))
    assert all(r.measured is None for r in step.memory_timeline())
    step.debug = True
    step(*GPT_CASE.batch(1))
    assert all(r.measured == r.predicted for r in step.memory_timeline())
    # another signature compiled since: its timeline has no measurements yet
    idx, targets = GPT_CASE.batch(2)
    step.lower(idx[:, :8].contiguous(), targets[:, :8].contiguous())
    assert all(r.measured is None for r in step.memory_timeline())


def test_plot_memory_writes_a_png(tight_gpt, tmp_path):
    import matplotlib.image
    path = tmp_path / "memory.png"
    rows = px.plot_memory(tight_gpt, path)
    assert rows == tight_gpt.memory_timeline()
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    img = torch.from_numpy(matplotlib.image.imread(path))
    assert img.shape[0] > 400 and img.shape[1] > 800
    # not a blank canvas: many distinct colours (the stacked areas, marks, shading)
    assert len(torch.unique(img[..., :3].reshape(-1, 3), dim=0)) > 50


def test_plot_memory_without_matplotlib_says_how_to_install_it(tight_gpt, tmp_path, monkeypatch):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)     # import matplotlib now raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'pstar-fx\[plot\]'"):
        px.plot_memory(tight_gpt, tmp_path / "memory.png")
    assert not (tmp_path / "memory.png").exists()
    assert len(tight_gpt.memory_timeline()) > 0   # the data needs no matplotlib
