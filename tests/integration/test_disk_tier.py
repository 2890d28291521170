"""The disk tier: optimizer states that do not fit host_memory live in files of offload_dir (StateHome.DISK), read
into a staging buffer before their chunk's update and written back after it.

Training with some chunks' states on disk equals the same plan with every state in memory bit for bit (fp32 and
bf16, under a device budget that evicts chunks); checkpoints save, load and resume through the files; a failure
before the commit leaves the files' bytes as they were; bad knobs and budgets raise; the verifier rejects a graph
whose disk read is missing or misplaced; the files go when the step does.
"""
import gc
import os
import time

import pytest
import torch

import pstar_fx as px
from pstar_fx.ir import Role, ops
from pstar_fx.ir.graph import StateHome
from pstar_fx.ir.needs import aligned, host_bytes, state_bytes, state_layout
from pstar_fx.passes.verify import VerificationError, verify

from models import MLP, mlp_loss

CHUNK = 4200            # six chunks of the MLP below (its hidden layers each fill one)
DEVICE_MEMORY = 60_000  # a few chunk buffers: chunks are evicted and fetched again every step


def _model():
    torch.manual_seed(0)
    return MLP(16, 64, 16, 6)


def _batches(n, start=0):
    g = torch.Generator().manual_seed(1)
    out = [(torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)) for _ in range(start + n)]
    return out[start:]


def _optimizer(name: str = "adamw"):
    if name == "nadam":         # per-element states and 0-d ones besides the step count (mu_product)
        return px.optim_from_torch(torch.optim.NAdam, lr=1e-2, weight_decay=0.1)
    return px.AdamW(lr=1e-2, weight_decay=0.1)


def _step(precision, opt="adamw", **kw):
    return px.compile(_model(), optimizer=_optimizer(opt), device="cpu", precision=precision,
                      chunk_size=CHUNK, device_memory=DEVICE_MEMORY, **kw)(mlp_loss)


def _train(step, batches):
    return [float(step(x, y)) for x, y in batches]


def _host_memory_for(precision, on_disk: int, opt="adamw") -> int:
    """A host budget that the in-memory plan overflows by what `on_disk` chunks' states less the staging buffers
    free, so that about that many of the six chunks go to disk."""
    ref = _step(precision, opt)
    ref.lower(*_batches(1)[0])
    g = ref.final_graph
    s = state_bytes(g.chunks[1], g.settings.precision, 1, state_layout(g.settings))
    return host_bytes(g) - (on_disk * s - 2 * aligned(s)) + 1


def _assert_equal(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def _optimizer_tensors(step) -> dict:
    sd = step.optimizer.state_dict()["state"]
    return {f"{i}.{k}": v for i, st in sd.items() for k, v in st.items()}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_disk_states_train_like_states_in_memory(precision, tmp_path):
    ref = _step(precision)
    want = _train(ref, _batches(4))
    step = _step(precision, host_memory=_host_memory_for(precision, 3), offload_dir=tmp_path)
    got = _train(step, _batches(4))
    g = step.final_graph
    homes = [c.state_home for c in g.chunks]
    assert 0 < homes.count(StateHome.DISK) < len(homes), homes           # some on disk, some in host memory
    assert g.plan.h2d_bytes > 0 and g.plan.carried != ()                 # chunks evicted and fetched again
    assert got == want
    _assert_equal(step.state_dict(), ref.state_dict())
    _assert_equal(_optimizer_tensors(step), _optimizer_tensors(ref))
    summary = step.summary()
    assert summary.states_on_disk == homes.count(StateHome.DISK)
    assert summary.host_bytes <= summary.host_budget
    assert step.last_step.disk_read_bytes == step.last_step.disk_write_bytes == summary.disk_moved[0] > 0
    assert "read from disk" in str(summary) and summary.disk_io in str(summary)
    # each disk chunk: one read into a staging buffer before its step, one write after it
    roles = [(g.ann[n.name].role, g.ann[n.name].chunk) for n in g.nodes]
    for c in g.chunks:
        if c.state_home is StateHome.DISK:
            at = [roles.index((r, c.id)) for r in (Role.DISK_READ, Role.OPTIMIZER_STEP, Role.DISK_WRITE)]
            assert at == sorted(at), (c.id, at)
    assert "disk_read(chunk=" in str(g) and "disk_write(chunk=" in str(g)


@pytest.mark.parametrize("opt", ["adamw", "nadam"])
def test_checkpoints_save_load_resume_with_disk_states(opt, tmp_path):
    """Saved in the sharded format (the default with a disk tier), each disk chunk's states read from its file as
    they are written, for Adam and for an optimizer with other states (NAdam's mu_product)."""
    kw = dict(host_memory=_host_memory_for("fp32", 3, opt), offload_dir=tmp_path / "scratch")
    (tmp_path / "scratch").mkdir()
    first = _step("fp32", opt, **kw)
    _train(first, _batches(2))
    assert StateHome.DISK in first._compiler.store.state_home
    first.save(tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / ".metadata").exists()
    want = _train(first, _batches(2, start=2))
    want_sd = first.state_dict()
    # resumed into a disk-tier step, and into one that keeps every state in memory
    for resumed in (_step("fp32", opt, **kw), _step("fp32", opt)):
        resumed.load(tmp_path / "ckpt")
        assert _train(resumed, _batches(2, start=2)) == want
        _assert_equal(resumed.state_dict(), want_sd)
        _assert_equal(_optimizer_tensors(resumed), _optimizer_tensors(first))
    # the checkpoint holds the states, not the scratch files
    assert not any(p.suffix == ".bin" for p in (tmp_path / "ckpt").iterdir())


def test_saves_stream_disk_chunks_or_refuse_what_the_host_cannot_hold(tmp_path, monkeypatch):
    """One rank's save in the sharded format (the default with a disk tier) reads each disk chunk's states from its
    file as DCP's writer reaches them, one chunk in host memory at a time; the plain format reads them all, and where
    the host has less to spare, CheckpointError says so before anything is read or written (the process does not run
    out of memory). Loads stream too. Resumed, the step trains as the one that saved."""
    import pstar_fx.checkpoint.save_load as save_load
    kw = dict(host_memory=_host_memory_for("fp32", 3), offload_dir=tmp_path / "scratch")
    (tmp_path / "scratch").mkdir()
    ref, step = _step("fp32"), _step("fp32", **kw)
    assert _train(step, _batches(2)) == _train(ref, _batches(2))
    store = step._compiler.store
    monkeypatch.setattr(save_load, "spare_host_bytes", lambda ranks=1: 1000)
    with pytest.raises(px.CheckpointError, match=r"step.save\(.*reads every disk-tier chunk's optimizer states .* "
                                                 r"chunks in the disk tier .* to spare; this save does not stream"):
        step.save(tmp_path / "plain", sharded=False)
    assert not (tmp_path / "plain").exists()
    opened, most = store.open_states, []

    def counting(cid):
        opened(cid)
        most.append(sum(store.is_open(c) for c in range(len(store.state_home))))
    store.open_states = counting        # (an attribute of this store only)
    step.save(tmp_path / "ckpt")        # sharded: the default with a disk tier
    assert most and max(most) == 1, most
    assert sum(h is StateHome.DISK for h in store.state_home) >= 2 and len(most) >= 4   # (read twice each)
    del store.open_states
    ref.save(tmp_path / "ref")
    want = _train(ref, _batches(1, start=2))
    assert _train(step, _batches(1, start=2)) == want
    step.load(tmp_path / "ckpt")        # back to the state after 2 steps, a disk chunk at a time
    ref.load(tmp_path / "ref")
    assert _train(step, _batches(2, start=2)) == _train(ref, _batches(2, start=2))
    _assert_equal(_optimizer_tensors(step), _optimizer_tensors(ref))
    _assert_equal(step.state_dict(), ref.state_dict())


def test_a_sharded_checkpoint_loads_into_disk_states(tmp_path):
    """The sharded format (several ranks' default; one process loads it too) writes the loaded states and masters in
    place, one disk chunk at a time: each is read in, loaded into and written back to its file before the next."""
    kw = dict(host_memory=_host_memory_for("fp32", 3), offload_dir=tmp_path)
    first = _step("fp32", **kw)
    _train(first, _batches(2))
    first.save(tmp_path / "ckpt", sharded=True)
    want = _train(first, _batches(2, start=2))
    resumed = _step("fp32", **kw)
    resumed.lower(*_batches(1, start=2)[0])         # the store exists: the load writes into the disk chunks' files
    store = resumed._compiler.store
    opened, most = store.open_states, []

    def counting(cid):
        opened(cid)
        most.append(sum(store.is_open(c) for c in range(len(store.state_home))))
    store.open_states = counting        # (an attribute of this store only)
    resumed.load(tmp_path / "ckpt")
    del store.open_states
    assert most and max(most) == 1, most            # a disk chunk at a time
    assert _train(resumed, _batches(2, start=2)) == want
    _assert_equal(resumed.state_dict(), first.state_dict())
    _assert_equal(_optimizer_tensors(resumed), _optimizer_tensors(first))


def _disk_files(step) -> dict:
    disk = step._compiler.store.disk
    return {cid: disk.file_bytes(cid) for cid in sorted(disk.sizes)}


def test_failure_before_the_commit_leaves_the_files_as_they_were(tmp_path):
    kw = dict(host_memory=_host_memory_for("fp32", 3), offload_dir=tmp_path)
    ref = _step("fp32", **kw)
    want = _train(ref, _batches(3))
    step = _step("fp32", **kw)
    _train(step, _batches(2))
    g = step.final_graph
    roles = [g.ann[n.name].role for n in g.nodes]
    commit = roles.index(Role.COMMIT)
    reads = [i for i, r in enumerate(roles) if r is Role.DISK_READ and i < commit]
    assert reads, "no disk read before the commit to fail after"
    before = _disk_files(step)
    assert any(any(b) for b in before.values())              # the states of two steps, not zeros
    x, y = _batches(1, start=2)[0]
    for at in sorted({reads[0] + 1, reads[-1] + 1, commit}):   # after reads were issued, and at the commit itself

        def fail(i, node, at=at):
            if i == at:
                raise RuntimeError("injected")
        step._before_node = fail
        with pytest.raises(RuntimeError, match="injected"):
            step(x, y)
        assert _disk_files(step) == before, at
    step._before_node = None
    assert _train(step, [(x, y)]) == want[2:]
    _assert_equal(step.state_dict(), ref.state_dict())
    _assert_equal(_optimizer_tensors(step), _optimizer_tensors(ref))


def test_files_are_removed_with_the_step(tmp_path):
    step = _step("fp32", host_memory=_host_memory_for("fp32", 3), offload_dir=tmp_path)
    _train(step, _batches(1))
    root = step._compiler.store.disk.root
    assert os.path.dirname(root) == str(tmp_path) and len(os.listdir(root)) >= 1
    del step
    # the step's last host-side updates and fetches may still be running on pstar-fx's worker thread, which holds
    # the store until they are done; the store goes at the next collection after that
    deadline = time.monotonic() + 30
    while os.path.exists(root) and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.01)
    assert not os.path.exists(root)


def test_bad_knobs_raise(tmp_path):
    a_file = tmp_path / "f"
    a_file.write_text("x")
    cases = [
        (dict(offload_dir=tmp_path / "missing"), ValueError, "not an existing directory"),
        (dict(offload_dir=a_file), ValueError, "not an existing directory"),
        (dict(offload_dir="/proc"), ValueError, "not writable"),
        (dict(offload_dir=3), TypeError, "offload_dir must be a path"),
        (dict(offload_dir=tmp_path, disk_memory="lots"), ValueError, "disk_memory: cannot read 'lots'"),
        (dict(offload_dir=tmp_path, disk_memory=-1), ValueError, "disk_memory must be positive"),
        (dict(host_memory=True), TypeError, "host_memory must be an int"),
        (dict(disk_memory="1GiB"), ValueError, "needs offload_dir"),
    ]
    for kw, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            _step("fp32", **kw)
    with pytest.raises(ValueError, match="forward-only"):
        px.compile(_model(), optimizer=None, offload_dir=tmp_path)(mlp_loss)


def test_budgets_that_cannot_fit_name_the_tier(tmp_path):
    x, y = _batches(1)[0]
    small_host = _host_memory_for("fp32", 3)
    with pytest.raises(px.BudgetError, match="host_memory .* is too small.*give offload_dir") as e:
        _step("fp32", host_memory=small_host).lower(x, y)
    assert e.value.available == small_host and e.value.needed > small_host and e.value.tier is StateHome.HOST
    with pytest.raises(px.BudgetError, match="disk_memory .* is too small") as e:
        _step("fp32", host_memory=small_host, offload_dir=tmp_path, disk_memory=1000).lower(x, y)
    assert e.value.available == 1000 and e.value.needed > 1000 and e.value.tier is StateHome.DISK
    with pytest.raises(px.BudgetError, match="too small even with the optimizer states of 6 chunks on disk"):
        _step("fp32", host_memory=10_000, offload_dir=tmp_path).lower(x, y)


def _without(g, node):
    graph = g.gm.graph
    graph.erase_node(node)
    return g.evolve(gm=torch.fx.GraphModule(g.gm, graph), ann={k: v for k, v in g.ann.items() if k != node.name})


def test_verifier_rejects_a_missing_or_misplaced_disk_read(tmp_path):
    kw = dict(host_memory=_host_memory_for("fp32", 3), offload_dir=tmp_path)
    step = _step("fp32", **kw)
    step.lower(*_batches(1)[0])
    verify(step.final_graph)
    reads = [n for n in step.final_graph.nodes if n.target is ops.disk_read]
    assert len(reads) >= 2

    def fresh(stage="scheduled"):
        s = _step("fp32", **kw)
        s.lower(*_batches(1)[0])
        return s.graphs[stage]

    g = fresh()
    read = next(n for n in g.nodes if n.target is ops.disk_read)
    with pytest.raises(VerificationError, match="must be read into a staging buffer"):
        verify(_without(g, read))
    g = fresh("optimizer_placed")        # (before the schedule, whose resident bytes a moved node would upset)
    verify(g)
    read = next(n for n in g.nodes if n.target is ops.disk_read)
    stepped = next(n for n in g.nodes if n.target is ops.optimizer_step and n.kwargs["chunk"] == read.kwargs["chunk"])
    stepped.append(read)                 # the read moved after its chunk's update
    with pytest.raises(VerificationError, match="must be read into a staging buffer"):
        verify(g)
    g = fresh()
    first, second = [n for n in g.nodes if n.target is ops.disk_read][:2]
    second.kwargs = {**second.kwargs, "slot": first.kwargs["slot"]}   # two reads in flight for one buffer
    with pytest.raises(VerificationError, match="while chunk .* not written back yet"):
        verify(g)


def test_cost_model_counts_the_disk(tmp_path):
    from pstar_fx.cost import Lane, estimate
    step = _step("bf16", host_memory=_host_memory_for("bf16", 3), offload_dir=tmp_path)
    step.lower(*_batches(1)[0])
    g = step.final_graph
    cost = estimate(g)
    moved = sum(state_bytes(c, g.settings.precision, 1, state_layout(g.settings)) for c in g.chunks
                if c.state_home is StateHome.DISK)
    m = cost.machine
    assert cost.busy[Lane.DISK] == pytest.approx(moved / m.disk_read_bytes + moved / m.disk_write_bytes)


def test_buffered_io_where_direct_io_is_refused(tmp_path, monkeypatch):
    """A file system that refuses O_DIRECT (tmpfs) gets buffered I/O, with the same results; summary() says which."""
    from pstar_fx.runtime.disk import DiskStates
    monkeypatch.setattr(DiskStates, "_direct_works", lambda self: False)
    ref = _step("fp32")
    want = _train(ref, _batches(3))
    step = _step("fp32", host_memory=_host_memory_for("fp32", 3), offload_dir=tmp_path)
    assert _train(step, _batches(3)) == want
    _assert_equal(_optimizer_tensors(step), _optimizer_tensors(ref))
    assert step.summary().disk_io == "buffered" and "buffered I/O" in str(step.summary())


def test_atomic_false_updates_disk_chunks_during_backward(tmp_path):
    """atomic=False: disk-homed chunks are read, updated and written back during backward, before the commit,
    with the results of the atomic step."""
    ref = _step("fp32")
    want = _train(ref, _batches(3))
    step = _step("fp32", host_memory=_host_memory_for("fp32", 3), offload_dir=tmp_path, atomic=False)
    assert _train(step, _batches(3)) == want
    _assert_equal(_optimizer_tensors(step), _optimizer_tensors(ref))
    g = step.final_graph
    roles = [g.ann[n.name].role for n in g.nodes]
    commit = roles.index(Role.COMMIT)
    assert any(r is Role.DISK_WRITE for r in roles[:commit])


def test_px_plan_plans_the_disk_tier(tmp_path):
    """px.plan(host_memory=..., disk_memory=...) plans the states that do not fit the host on disk, as px.compile
    does, and the cost model's disk lane shows their time; a disk budget too small raises naming the disk."""
    from pstar_fx.cost import Lane
    x, y = _batches(1)[0]
    host = _host_memory_for("bf16", 3)
    compiled = _step("bf16", host_memory=host, offload_dir=tmp_path)
    compiled.lower(x, y)
    report = px.plan(_model(), mlp_loss, x, y, device_memory=DEVICE_MEMORY, host_memory=host, disk_memory="1GiB",
                     precision="bf16", chunk_size=CHUNK, device="cpu")
    homes = [c.state_home for c in report.graph.chunks]
    assert homes == [c.state_home for c in compiled.final_graph.chunks] and StateHome.DISK in homes
    assert report.cost.busy[Lane.DISK] > 0
    from pstar_fx.ir.needs import disk_bytes
    assert report.disk_per_node == disk_bytes(report.graph) > 0 and "disk" in str(report)
    with pytest.raises(px.BudgetError, match="disk_memory") as e:
        px.plan(_model(), mlp_loss, x, y, device_memory=DEVICE_MEMORY, host_memory=host, disk_memory=1000,
                precision="bf16", chunk_size=CHUNK, device="cpu")
    assert e.value.tier is StateHome.DISK
    # a disk slow enough to bound the step says so (its report printed a KeyError)
    import dataclasses
    from pstar_fx.cost import H200, Bound
    slow = dataclasses.replace(H200, disk_read_bytes=1e3, disk_write_bytes=1e3)
    report = px.plan(_model(), mlp_loss, x, y, device_memory=DEVICE_MEMORY, host_memory=host, disk_memory="1GiB",
                     precision="bf16", chunk_size=CHUNK, device="cpu", machine=slow)
    assert report.bounded_by is Bound.DISK and "bound by disk I/O" in str(report)


def test_states_move_between_disk_host_and_device(tmp_path):
    """A plan of another signature may home a chunk's states elsewhere: the store moves them from disk to host or
    device and back (ChunkStore.set_homes), values unchanged, and training goes on as if they had stayed."""
    import dataclasses
    ref = _step("fp32")
    want = _train(ref, _batches(3))
    step = _step("fp32", host_memory=_host_memory_for("fp32", 3), offload_dir=tmp_path)
    _train(step, _batches(2))
    before = _optimizer_tensors(step)
    store = step._compiler.store
    chunks = step.final_graph.chunks
    disk = [c.id for c in chunks if c.state_home is StateHome.DISK]
    host = [c.id for c in chunks if c.state_home is StateHome.HOST]
    moved = tuple(dataclasses.replace(c, state_home={disk[0]: StateHome.HOST, disk[1]: StateHome.DEVICE,
                                                     host[0]: StateHome.DISK}.get(c.id, c.state_home))
                  for c in chunks)
    store.set_homes(moved)
    assert store.states[disk[0]] is not None and store.states[host[0]] is None
    _assert_equal(_optimizer_tensors(step), before)
    assert _train(step, _batches(1, start=2)) == want[2:]      # the step's own plan puts them back first
    assert [store.state_home[c.id] for c in chunks] == [c.state_home for c in chunks]
    _assert_equal(_optimizer_tensors(step), _optimizer_tensors(ref))


def test_loading_values_holds_one_disk_chunk_in_memory_at_a_time(tmp_path):
    """px.init_empty's first step and load_state_dict (the model's, the optimizer's) write every master and state:
    a disk-homed chunk's states are read in for it and go back to their file before the next one is read, so host
    memory never holds all of them (a 20B model's 40 GiB of disk states read in at once ran its host out of
    memory). The values are right: the first step's initialisation reaches the files (it did not: it wrote the
    masters read into memory without marking them changed, and the step read the files' old ones)."""
    ref_model = _model()
    ref = px.compile(ref_model, optimizer=px.AdamW(lr=1e-2, weight_decay=0.1), device="cpu", precision="bf16",
                     chunk_size=CHUNK, device_memory=DEVICE_MEMORY)(mlp_loss)
    want = _train(ref, _batches(2))
    with px.init_empty(device="cpu"):
        model = _model()
    step = px.compile(model, optimizer=px.AdamW(lr=1e-2, weight_decay=0.1), device="cpu", precision="bf16",
                      chunk_size=CHUNK, device_memory=DEVICE_MEMORY, host_memory=_host_memory_for("bf16", 3),
                      offload_dir=tmp_path)(mlp_loss)
    step.lower(*_batches(1)[0])
    store = step._compiler.store
    assert sum(h is StateHome.DISK for h in store.state_home) >= 2
    most = []
    opened = store.open_states

    def counting(cid):
        opened(cid)
        most.append(sum(store.is_open(c) for c in range(len(store.state_home))))
    store.open_states = counting        # (an attribute of this store only)
    assert _train(step, _batches(2)) == want          # the first step initialises the values, as _model() does
    _train(ref, _batches(1, start=2))           # the reference moves on; loading its state brings the step there
    step.load_state_dict(ref.state_dict())
    step.optimizer.load_state_dict(ref.optimizer.state_dict())
    assert _train(step, _batches(1, start=3)) == _train(ref, _batches(1, start=3))
    assert most and max(most) == 1, most
    del store.open_states       # (optimizer.state_dict() below reads every chunk's states into memory, as asked)
    _assert_equal(_optimizer_tensors(step), _optimizer_tensors(ref))


def test_the_default_host_budget_refuses_a_plan_the_machine_cannot_hold(monkeypatch):
    """host_memory=None bounds the plan by the host's memory less a margin (runtime/host_memory.host_limit_bytes): a
    plan over it raises BudgetError at compile time, naming the bytes and what to change, and leaves the model as it
    was; not a process the out-of-memory killer ends in its first step. Where it fits, the step trains as before."""
    import pstar_fx.api.options as options
    monkeypatch.setattr(options, "host_limit_bytes", lambda ranks=1: 1000)
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    step = px.compile(model, optimizer=px.AdamW(lr=1e-2), device="cpu", chunk_size=CHUNK,
                      device_memory=DEVICE_MEMORY)(mlp_loss)
    assert step.settings.host_budget == 1000 and step.settings.host_default
    with pytest.raises(px.BudgetError, match=r"more than this machine has.*host_memory=None.*offload_dir") as e:
        step(*_batches(1)[0])
    assert e.value.needed > e.value.available == 1000
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    # given host_memory is the user's word; so is a roomy machine
    step = px.compile(_model(), optimizer=px.AdamW(lr=1e-2), device="cpu", chunk_size=CHUNK,
                      device_memory=DEVICE_MEMORY, host_memory="1GiB")(mlp_loss)
    assert not step.settings.host_default and torch.isfinite(step(*_batches(1)[0]))
    monkeypatch.setattr(options, "host_limit_bytes", lambda ranks=1: 1 << 30)
    step = px.compile(_model(), optimizer=px.AdamW(lr=1e-2), device="cpu", chunk_size=CHUNK,
                      device_memory=DEVICE_MEMORY)(mlp_loss)
    assert torch.isfinite(step(*_batches(1)[0]))
    assert step.summary().host_budget == 1 << 30       # the summary's tiers line names it
