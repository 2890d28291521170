"""Checkpoints that never run code, never lie, never tear and never delete the user's files.

- Loading unpickles nothing beyond torch.load(weights_only=True) and JSON: a pickled `.metadata` (stray in a plain
  checkpoint, or the only metadata of a directory) and DCP byte entries whose unpickling would create a marker
  directory are refused or ignored, and the marker never appears.
- Every single-bit flip and every truncation, at random places of every file of a checkpoint (plain files and
  sharded), is refused with an error naming the file; the step loading it is left exactly as it was.
- A checkpoint that is well formed but wrong (RNG states the generator refuses, a NaN or zero loss scale, an
  optimizer state of another structure, another model's keys or dtypes, an old checkpoint without a manifest) is
  refused before anything is applied: parameters, optimizer states, RNG state, loss scaler and `step._broken` are
  as before.
- A thread that saves while the main thread trains writes only whole steps (each checkpoint equals the state after
  some step).
- `save` replaces only its own checkpoints, removes what killed saves left beside the path once a new checkpoint is
  published, saves through a symbolic link into its target (the link kept, nothing left beside it), and names the
  file and the cause of a file system error (disk full, read-only, permission denied).
"""
from __future__ import annotations

import errno
import os
import pickle
import random
import shutil
import threading
import time
from types import SimpleNamespace

import pytest
import torch

import pstar_fx as px
import pstar_fx.checkpoint as ckpt
import pstar_fx.checkpoint.files as files
import pstar_fx.checkpoint.sharded as pdcp

import resume_script as rs
from ranks import run_ranks

RUN = dict(name="safety", mode="full", precision="fp16", budget=None, chunk_size=2048, dropout=0.1, overflow_at=None,
           k=2, steps=4, ckpt=None)


class MakesMarker:
    """Unpickling it creates a directory: what a crafted file's reduce could run."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def _trained(steps: int, **over):
    run = dict(RUN, **over)
    step, _ = rs.build(run)
    torch.manual_seed(rs.SEED + steps)
    for i in range(steps):
        step(*rs.batch(run, i))
    return step, run


def _snapshot(step) -> dict:
    """Everything a load may change: values, optimizer state, the CPU RNG state, the loss scaler, the broken flag."""
    snap = {f"model.{k}": v.clone() for k, v in step.state_dict().items()}
    opt = step.optimizer.state_dict()
    snap.update({f"optim.{i}.{k}": v.clone() for i, s in opt["state"].items() for k, v in s.items()})
    snap["groups"] = opt["param_groups"]
    snap["rng"] = torch.get_rng_state()
    snap["scaler"] = None if step._scaler is None else (step._scaler.scale, step._scaler.good_steps)
    snap["broken"] = step._broken
    return snap


def _assert_same(a: dict, b: dict, where: str) -> None:
    assert a.keys() == b.keys(), where
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), f"{where}: {k} changed"
        else:
            assert a[k] == b[k], f"{where}: {k} changed ({a[k]} -> {b[k]})"


def _reforge(directory: str) -> None:
    """Rewrite a checkpoint's manifest to match its files as they are now: what a forger who changed them does."""
    kind = files.Kind.PLAIN if os.path.exists(os.path.join(directory, files.PLAIN_MANIFEST)) else files.Kind.SHARDED
    m = files.read_manifest(directory, files.MANIFEST_OF[kind])
    sums = {n: files.checksum(os.path.join(directory, n)) for n in m.files}
    files.write_manifest(directory, files.Manifest(m.kind, sums, m.dcp))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One compiled step (compiling is what costs time here), saved after 1 step (to reset it to) and after 2, in
    both formats; returns (the step, {name: path}, its state after 2 steps)."""
    tmp = tmp_path_factory.mktemp("safety")
    step, run = _trained(1)
    step.save(tmp / "one")
    step(*rs.batch(run, 1))
    step._scaler.scale, step._scaler.good_steps = 2.0 ** 11, 5
    step.save(tmp / "plain")
    step.save(tmp / "sharded", sharded=True)
    return step, {n: str(tmp / n) for n in ("one", "plain", "sharded")}, step.state_dict()


@pytest.fixture()
def target(saved):
    """The step in another state than the saved one (after 1 step, its own scaler values, marked broken)."""
    step, paths, _ = saved
    step.load(paths["one"])
    step._scaler.scale, step._scaler.good_steps = 2.0 ** 7, 3
    step._broken = "a step failed after its commit point (set by the test)"
    return step


def _save_anyway(step, path, **kw):
    """Save a step the target fixture marked broken (which save refuses), leaving it marked."""
    broken, step._broken = step._broken, None
    try:
        step.save(path, **kw)
    finally:
        step._broken = broken


# -- nothing is unpickled --------------------------------------------------------------------------------------------
def test_a_stray_pickled_metadata_beside_a_plain_checkpoint_is_never_read(saved, tmp_path):
    _, paths, want = saved
    d = tmp_path / "c"
    shutil.copytree(paths["plain"], d)
    marker = tmp_path / "marker"
    (d / ".metadata").write_bytes(pickle.dumps(MakesMarker(str(marker))))
    step = rs.build(dict(RUN))[0]
    step.load(d)
    assert not marker.exists()
    _assert_same(step.state_dict(), want, "a plain checkpoint with a stray .metadata")


def test_a_pickled_dcp_metadata_is_refused_unread(saved, tmp_path, target):
    _, paths, _ = saved
    d = tmp_path / "c"
    shutil.copytree(paths["sharded"], d)
    marker = tmp_path / "marker"
    (d / ".metadata").write_bytes(pickle.dumps(MakesMarker(str(marker))))
    step = target
    before = _snapshot(step)
    with pytest.raises(px.CheckpointError, match=r"\.metadata is a pickle"):
        step.load(d)
    assert not marker.exists()
    _assert_same(_snapshot(step), before, "refused")


@pytest.mark.parametrize("entry", ["pstar_fx", "rng.0"])
def test_dcp_byte_entries_are_unpickled_weights_only(tmp_path, monkeypatch, target, entry):
    """A sharded checkpoint whose byte entry holds a crafted pickle (its manifest consistent, as a forger would
    write it) is refused, naming the entry, and the pickle's code never runs."""
    marker = tmp_path / "marker"
    real = pdcp._pack

    def crafted(obj):
        mine = ("format" in obj) if entry == "pstar_fx" else ("torch_cpu" in obj)
        return MakesMarker(str(marker)) if mine else real(obj)
    step = target
    monkeypatch.setattr(pdcp, "_pack", crafted)
    _save_anyway(step, tmp_path / "c", sharded=True)
    monkeypatch.undo()
    assert not marker.exists()
    before = _snapshot(step)
    with pytest.raises(px.CheckpointError, match=rf"'{entry}'.*weights_only"):
        step.load(tmp_path / "c")
    assert not marker.exists()
    _assert_same(_snapshot(step), before, "refused")


# -- corruption ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["plain", "sharded"])
def test_every_flipped_bit_and_truncation_is_refused_naming_the_file(saved, tmp_path, target, fmt):
    """24 single-bit flips and 6 truncations at random places of every file of the checkpoint, one at a time: each
    load is refused with an error naming the damaged file, and changes nothing."""
    _, paths, _ = saved
    step = target
    before = _snapshot(step)
    gen = random.Random(fmt)
    names = sorted(os.listdir(paths[fmt]))
    assert len(names) == (4 if fmt == "plain" else 2)
    for name in names:
        size = os.path.getsize(os.path.join(paths[fmt], name))
        damage = [("flip", gen.randrange(size), gen.randrange(8)) for _ in range(24)]
        damage += [("truncate", gen.randrange(size), None) for _ in range(6)]
        for k, (how, at, bit) in enumerate(damage):
            d = tmp_path / f"{name}-{k}"
            shutil.copytree(paths[fmt], d)
            with open(d / name, "r+b") as f:
                if how == "flip":
                    f.seek(at)
                    byte = f.read(1)[0]
                    f.seek(at)
                    f.write(bytes([byte ^ (1 << bit)]))
                else:
                    f.truncate(at)
            with pytest.raises(px.CheckpointError) as info:
                step.load(d)
            message = str(info.value)
            assert str(d / name) in message, (how, name, at, message)
            assert any(w in message for w in ("corrupted", "truncated", "empty")), message
            _assert_same(_snapshot(step), before, f"{how} of {name} at {at}")
            shutil.rmtree(d)


def test_load_names_a_missing_file(saved, tmp_path, target):
    _, paths, _ = saved
    step = target
    before = _snapshot(step)
    for fmt, name in (("plain", "optimizer.pt"), ("sharded", "__0_0.distcp")):
        d = tmp_path / fmt
        shutil.copytree(paths[fmt], d)
        os.remove(d / name)
        with pytest.raises(FileNotFoundError, match=rf"{d / name} is missing"):
            step.load(d)
    _assert_same(_snapshot(step), before, "refused")


# -- well formed, but wrong ------------------------------------------------------------------------------------------
def _meta_with(**change):
    def edit(meta):
        scaler = dict(meta["loss_scaler"], **{k: v for k, v in change.items() if k in meta["loss_scaler"]})
        return dict(meta, loss_scaler=scaler, **{k: v for k, v in change.items() if k in meta and k != "loss_scaler"})
    return edit


PLAIN_FORGERIES = {
    "rng-size": ("meta.pt", lambda m: dict(m, rng={"torch_cpu": torch.zeros(100, dtype=torch.uint8)})),
    "rng-dtype": ("meta.pt", lambda m: dict(m, rng={"torch_cpu": m["rng"]["torch_cpu"].long()})),
    "scale-nan": ("meta.pt", _meta_with(scale=float("nan"))),
    "scale-zero": ("meta.pt", _meta_with(scale=0.0)),
    "good-steps": ("meta.pt", _meta_with(good_steps=-1)),
    "precision": ("meta.pt", _meta_with(precision="fp8")),
    "moment-shape": ("optimizer.pt", lambda o: dict(o, state={**o["state"], 0: dict(
        o["state"][0], exp_avg=o["state"][0]["exp_avg"].reshape(-1)[:3])})),
    "step-count": ("optimizer.pt", lambda o: dict(o, state={**o["state"], 0: dict(
        o["state"][0], step=torch.tensor(float("nan")))})),
    "lr-nan": ("optimizer.pt", lambda o: dict(o, param_groups=[dict(o["param_groups"][0], lr=float("nan"))])),
    "groups": ("optimizer.pt", lambda o: dict(o, param_groups=[dict(o["param_groups"][0], params=[0, 1])])),
    "model-dtype": ("model.pt", lambda sd: {k: v.double() if k == "wte.weight" else v for k, v in sd.items()}),
    "model-keys": ("model.pt", lambda sd: {k: v for k, v in sd.items() if k != "ln_f.bias"}),
}


@pytest.mark.parametrize("forgery", list(PLAIN_FORGERIES))
def test_a_refused_plain_checkpoint_changes_nothing(saved, tmp_path, target, forgery):
    """One file rewritten (and the manifest with it): refused before anything is applied."""
    _, paths, _ = saved
    name, edit = PLAIN_FORGERIES[forgery]
    d = tmp_path / "c"
    shutil.copytree(paths["plain"], d)
    torch.save(edit(torch.load(d / name, weights_only=True)), d / name)
    _reforge(str(d))
    step = target
    before = _snapshot(step)
    with pytest.raises(px.CheckpointError, match=rf"{name}|another model"):
        step.load(d)
    _assert_same(_snapshot(step), before, forgery)


@pytest.mark.parametrize("forgery", ["scale-nan", "rng-size", "param-groups", "model-dtype"])
@pytest.mark.parametrize("lowered", [False, True], ids=["before-first-step", "into-the-chunks"])
def test_a_refused_sharded_checkpoint_changes_nothing(tmp_path, monkeypatch, target, forgery, lowered):
    """The sharded format's meta, RNG states, optimizer groups and a value's dtype, saved wrong: refused before
    anything is applied, whether the values would go into the model (before the first step) or into the chunks."""
    source = target
    if forgery == "scale-nan":
        real = pdcp._meta
        monkeypatch.setattr(pdcp, "_meta", lambda step: dict(real(step), loss_scaler=dict(
            real(step)["loss_scaler"], scale=float("nan"))))
    elif forgery == "rng-size":
        monkeypatch.setattr(pdcp, "rng_state", lambda device: {"torch_cpu": torch.zeros(10, dtype=torch.uint8)})
    elif forgery == "param-groups":
        real = pdcp._param_groups
        monkeypatch.setattr(pdcp, "_param_groups", lambda opt: [dict(g, betas=(0.9, 2.0)) for g in real(opt)])
    else:
        real = pdcp.save_entries
        monkeypatch.setattr(pdcp, "save_entries", lambda step, values: {
            k: v.double() if k == "model.wte.weight" else v for k, v in real(step, values).items()})
    _save_anyway(source, tmp_path / "c", sharded=True)
    monkeypatch.undo()
    step = target if lowered else rs.build(dict(RUN))[0]
    before = _snapshot(step)
    with pytest.raises(px.CheckpointError):
        step.load(tmp_path / "c")
    _assert_same(_snapshot(step), before, forgery)


def test_a_checkpoint_without_a_manifest_is_refused(saved, tmp_path, target):
    """Written as before checkpoints had manifests (the same three files): refused, saying why and what to do."""
    _, paths, _ = saved
    d = tmp_path / "old"
    shutil.copytree(paths["plain"], d)
    os.remove(d / files.PLAIN_MANIFEST)
    step = target
    before = _snapshot(step)
    with pytest.raises(px.CheckpointError, match="no manifest.json.*weights_only=True"):
        step.load(d)
    _assert_same(_snapshot(step), before, "refused")


# -- saving ----------------------------------------------------------------------------------------------------------
def _state(step) -> dict:
    return {"model": step.state_dict(), "optimizer": step.optimizer.state_dict(), "rng": torch.get_rng_state()}


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def test_saves_from_another_thread_hold_whole_steps(tmp_path, target):
    """While the main thread trains (each node slowed down, so that a save would fall inside a step), a thread saves
    again and again: every checkpoint equals the state after some whole step (values, moments and RNG together)."""
    step, run = target, RUN
    step._broken = None
    step._before_node = lambda i, node: time.sleep(0.0005)
    after = [_state(step)]
    saved, failed, done = [], [], threading.Event()

    def saver():
        try:
            while not done.is_set():
                d = tmp_path / f"c{len(saved)}"
                step.save(d)
                saved.append(d)
        except BaseException as e:   # noqa: BLE001 - reported below
            failed.append(e)
    thread = threading.Thread(target=saver)
    thread.start()
    try:
        for i in range(1, 6):
            step(*rs.batch(run, i))
            with step._lock:
                after.append(_state(step))
    finally:
        done.set()
        thread.join()
        step._before_node = None
    assert not failed, failed
    assert len(saved) >= 3, saved
    matched = set()
    for d in saved:
        got = {"model": torch.load(d / "model.pt", weights_only=True),
               "optimizer": torch.load(d / "optimizer.pt", weights_only=True),
               "rng": torch.load(d / "meta.pt", weights_only=True)["rng"]["torch_cpu"]}
        which = [k for k, s in enumerate(after) if _equal(got, s)]
        assert which, f"{d.name} is no whole step's state (torn)"
        matched.add(which[0])
    assert len(matched) >= 2, "the saves did not interleave with the steps"


@pytest.fixture()
def whole(target):
    """The target step, not broken: one that may save."""
    target._broken = None
    return target


def test_save_never_replaces_a_directory_it_did_not_write(tmp_path, whole):
    step = whole
    mine = tmp_path / "mine"
    mine.mkdir()
    torch.save({"my": torch.arange(3.0)}, mine / "model.pt")
    data = (mine / "model.pt").read_bytes()
    with pytest.raises(ValueError, match="not a pstar-fx checkpoint"):
        step.save(mine)
    assert sorted(os.listdir(mine)) == ["model.pt"] and (mine / "model.pt").read_bytes() == data
    # a checkpoint the user put a file of their own into is no longer only pstar-fx's
    step.save(tmp_path / "c")
    (tmp_path / "c" / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match="not a pstar-fx checkpoint"):
        step.save(tmp_path / "c")
    assert (tmp_path / "c" / "notes.txt").read_text() == "keep me"
    # an empty directory and a checkpoint are replaced
    (tmp_path / "empty").mkdir()
    step.save(tmp_path / "empty")
    step.save(tmp_path / "empty")
    assert sorted(os.listdir(tmp_path / "empty")) == sorted(ckpt.FILES)


def test_what_killed_saves_left_goes_after_the_next_save_is_published(tmp_path, monkeypatch, whole):
    step = whole
    path = tmp_path / "c"
    step.save(path)
    shutil.copytree(path, tmp_path / "c.old-0123abcd")           # a killed save's previous checkpoint
    (tmp_path / "c.tmp-89abcdef").mkdir()                        # a killed save's partial new one
    shutil.copy(path / "model.pt", tmp_path / "c.tmp-89abcdef")
    (tmp_path / "c.tmp-fedcba98").mkdir()                        # named like one, but holding the user's file
    (tmp_path / "c.tmp-fedcba98" / "notes.txt").write_text("keep me")
    (tmp_path / "c.tmp-mine").mkdir()                            # not a name a save makes
    shutil.copy(path / "model.pt", tmp_path / "c.tmp-mine")
    everything = sorted(os.listdir(tmp_path))

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError):
        step.save(path)
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == everything, "a failed save removed something"
    step.save(path)
    assert sorted(os.listdir(tmp_path)) == ["c", "c.tmp-fedcba98", "c.tmp-mine"]
    rs.build(dict(RUN))[0].load(path)


def test_a_save_through_a_symbolic_link_replaces_its_target_and_keeps_the_link(tmp_path, whole):
    """A save to a symbolic link to a checkpoint writes the new checkpoint in the link's target, which the link keeps
    pointing at; a dangling link gets its target made; a save under a parent that is a link is a save under its
    target. Nothing is left beside the links or their targets."""
    step = whole
    real = tmp_path / "real"
    real.mkdir()
    step.save(real / "c")                                       # plain files
    link = tmp_path / "link"
    link.symlink_to(real / "c")
    step.save(link, sharded=True)                               # replaces them, through the link
    assert link.is_symlink() and os.readlink(link) == str(real / "c"), "the link was replaced"
    assert files.locate(str(real / "c")).kind is files.Kind.SHARDED, "the link's target holds the old checkpoint"
    (tmp_path / "dangling").symlink_to(os.path.join("real", "new"))     # relative, to nothing yet
    step.save(tmp_path / "dangling")
    assert (tmp_path / "dangling").is_symlink() and files.locate(str(real / "new")).kind is files.Kind.PLAIN
    (tmp_path / "parent").symlink_to(real)
    step.save(tmp_path / "parent" / "d")
    step.save(tmp_path / "parent" / "d")
    assert sorted(os.listdir(tmp_path)) == ["dangling", "link", "parent", "real"]
    assert sorted(os.listdir(real)) == ["c", "d", "new"]
    rs.build(dict(RUN))[0].load(link)


@pytest.mark.parametrize("fmt,code,call,cause,file", [
    ("plain", errno.ENOSPC, "fsync", "disk is full", "model.pt"),
    ("sharded", errno.ENOSPC, "fsync", "disk is full", ".distcp"),
    ("plain", errno.EACCES, "fsync", "permission denied", "model.pt"),
    ("plain", errno.EROFS, "mkdir", "read-only", ".tmp-"),
], ids=["plain-ENOSPC", "sharded-ENOSPC", "plain-EACCES", "plain-EROFS"])
def test_a_file_system_error_names_the_file_and_the_cause(tmp_path, monkeypatch, whole, fmt, code, call, cause,
                                                         file):
    """The write fails as the file system would (tests run as root: chmod does not stop writes); the error keeps its
    errno and names the file and the cause; the previous checkpoint stays, whole, and nothing is left beside it."""
    step = whole
    path = tmp_path / "c"
    step.save(path, sharded=fmt == "sharded")
    before = sorted(os.listdir(path))

    def refuse(*args, **kwargs):
        raise OSError(code, os.strerror(code))
    monkeypatch.setattr(os, call, refuse)
    with pytest.raises(OSError) as info:
        step.save(path, sharded=fmt == "sharded")
    monkeypatch.undo()
    assert info.value.errno == code, info.value
    assert cause in str(info.value) and file in str(info.value), str(info.value)
    assert sorted(os.listdir(tmp_path)) == ["c"] and sorted(os.listdir(path)) == before
    rs.build(dict(RUN))[0].load(path)


def _torch_writer_fails(monkeypatch, interrupted: bool):
    """torch.save's zip writer failing as it does on a full disk, or on a Ctrl-C inside it (its RuntimeError, raised
    while the KeyboardInterrupt was being handled)."""
    def write(contents, file):
        if not interrupted:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 1088 vs 982")
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 1 vs 0") from None
    monkeypatch.setattr(ckpt.plain, "write", write)


@pytest.mark.parametrize("interrupted", [False, True], ids=["disk_full", "ctrl_c"])
def test_a_failure_inside_torchs_file_writer_says_what_it_was(tmp_path, monkeypatch, whole, interrupted):
    """A Ctrl-C inside torch's writer comes out as the KeyboardInterrupt (an `except KeyboardInterrupt` takes it), a
    full disk as ENOSPC naming the cause, not torch's bare RuntimeError; the previous checkpoint stays whole."""
    step = whole
    path = tmp_path / "c"
    step.save(path)
    before = sorted(os.listdir(path))
    _torch_writer_fails(monkeypatch, interrupted)
    if interrupted:
        with pytest.raises(KeyboardInterrupt):
            step.save(path)
    else:
        monkeypatch.setattr(ckpt.save_load.shutil, "disk_usage", lambda p: SimpleNamespace(total=1 << 30, free=0))
        with pytest.raises(OSError, match="disk is full") as info:
            step.save(path)
        assert info.value.errno == errno.ENOSPC
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ["c"] and sorted(os.listdir(path)) == before


def test_ctrl_c_during_a_load_comes_after_the_whole_load(saved, target, monkeypatch):
    """A Ctrl-C while a load writes values waits until every value is in: never the checkpoint's optimizer states
    beside the old parameters."""
    import signal
    step, paths, after_two = saved
    apply_meta = ckpt.save_load.sharded_format.apply_meta

    def interrupted(*args):
        signal.raise_signal(signal.SIGINT)       # arrives after the optimizer state went in, before the rest
        return apply_meta(*args)
    monkeypatch.setattr(ckpt.save_load.sharded_format, "apply_meta", interrupted)
    with pytest.raises(KeyboardInterrupt):
        step.load(paths["plain"])
    monkeypatch.undo()
    got = _snapshot(step)
    step.load(paths["plain"])
    _assert_same(got, _snapshot(step), "an interrupted load against a whole one")


def test_two_ranks_verify_the_files_they_read_and_agree(tmp_path):
    """Two ranks (gloo): rank 0 writes the manifest after both wrote their data file, listing both; a save loads on
    both; after one bit of rank 1's file flips, both ranks refuse the load naming that file, and neither changed."""
    out = str(tmp_path / "out")
    ranks = run_ranks("ckpt_safety_worker.py", [tmp_path, out], 2, out, timeout=120)
    assert ranks.codes == [0, 0], ranks.logs
    for r, res in enumerate(ranks.results):
        assert res["files"] == [".metadata", "__0_0.distcp", "__1_0.distcp"], (r, res["files"])
        assert res["manifest"] == ["__0_0.distcp", "__1_0.distcp"], (r, res["manifest"])
        assert res["loaded"], f"rank {r}: the load did not give the saved values"
        assert res["error"] is not None and res["error"][0] == "CheckpointError", (r, res["error"])
        assert "__1_0.distcp is corrupted" in res["error"][1], (r, res["error"])
        assert res["unchanged"], f"rank {r}: the refused load changed the step"


@pytest.mark.parametrize("saved_frozen", [False, True], ids=["into-fewer-trained", "into-more-trained"])
def test_a_checkpoint_of_other_trained_parameters_is_a_checkpoint_error_and_changes_nothing(tmp_path, saved_frozen):
    """The same model with another parameter set trained: its optimizer state does not fit; refused as a
    CheckpointError (not whatever the optimizer raised), before anything is applied."""
    def build(frozen: bool):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
        model[0].weight.requires_grad_(not frozen)
        return px.compile(model, optimizer=px.AdamW(lr=1e-2), device="cpu")(
            lambda m, x, y: torch.nn.functional.mse_loss(m(x), y))
    batch = (torch.randn(3, 4), torch.randn(3, 2))
    source = build(saved_frozen)
    source(*batch)
    source.save(tmp_path / "c")
    step = build(not saved_frozen)
    step(*batch)
    step(*batch)
    values, opt = step.state_dict(), step.optimizer.state_dict()
    with pytest.raises(px.CheckpointError, match="optimizer state does not fit this step"):
        step.load(tmp_path / "c")
    assert all(torch.equal(v, step.state_dict()[k]) for k, v in values.items())
    after = step.optimizer.state_dict()["state"]
    assert after.keys() == opt["state"].keys() and all(
        torch.equal(v, after[i][k]) for i, s in opt["state"].items() for k, v in s.items())
