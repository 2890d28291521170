"""What the ranks must share beyond their batches, checked before it could mix them or pair unlike collectives: two
gloo ranks on the CPU, every scenario in one launch (tests/support/dist_agreement_worker.py; process start-up
dominates), and one launch per rank killed in the middle of a call.

- Checkpoints: ranks loading different ones (other paths, or copies on disks of their own that differ) are refused
  on every rank, before the first step and after it, with the step's values and optimizer states as they were;
  identical copies load.
- Settings: the optimizer's class, its options (lr, also when an lr scheduler is stepped on one rank only),
  state_dtype, max_grad_norm, accumulate and precision are refused by name, at once; where only the plans differ
  (chunk_size, device_memory), the message names the setting.
- Calls: one rank evaluating, saving, loading, reading state_dict(), compiling, giving the model back
  (step.sync_model() or px.sync_model), loading a state dict (into the step's chunks, or through a step that gives
  the model back first) or reading or loading the optimizer's state dict while the other trains is refused on both,
  at once, naming both functions; then both train on together. Ranks that give the model back through either
  sync_model agree, and a sync_model() with nothing to give back needs no other rank; ranks that load the same
  state dicts train on.
- State dicts: ranks that give step.load_state_dict() or step.optimizer.load_state_dict() different dicts (a
  parameter's value, a group's lr, a parameter's exp_avg; optimizer states loaded before the first step, refused at
  that step) are refused on both, at once, naming what differs, with the values as they were.
- A rank that exits during step.save, step.load or before step.state_dict(): the survivor gets px.DistributedError
  naming the call (not gloo's RuntimeError), and a save leaves the previous checkpoint and nothing beside it.
In one process: the thread warning compares torch's threads with this process's share of the cores.
"""
from __future__ import annotations

import re
import types

import pytest
import torch

from pstar_fx.api.warnings import warn_host_threads
from pstar_fx.ir.graph import ChunkGroup, StateHome
from ranks import run_ranks

WORLD = 2


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("agreement")
    out = str(tmp / "result")
    return run_ranks("dist_agreement_worker.py", ["agree", "--out", out, "--tmp", tmp], WORLD, out,
                     timeout=240).results


def refused(rec: dict, r: int) -> str:
    """The DistributedError the scenario raised on rank r, before any step trained."""
    assert "error" in rec, f"rank {r} ran with settings the other rank did not have: {rec['losses']}"
    name, msg, _ = rec["error"]
    assert name == "DistributedError", rec.get("traceback")
    return msg


def same(a: dict, b: dict) -> bool:
    """Two nests of tensors and plain values are equal, bit for bit."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.slow
def test_ranks_loading_different_checkpoints_are_refused_and_keep_their_values(ranks):
    recs = [res["mixed_checkpoints"] for res in ranks]
    for r, rec in enumerate(recs):
        assert "error" not in rec, rec.get("traceback")
        for key in ("refused", "stale_refused", "fresh_refused"):
            msg = rec.get(key)
            assert msg is not None, f"rank {r} loaded another checkpoint than the other rank ({key})"
            assert "the ranks opened different checkpoints" in msg and "rank 0: '" in msg and "rank 1: '" in msg
        assert "/a', sharded checkpoint" in rec["refused"] and "/b', sharded checkpoint" in rec["refused"]
        assert same(rec["after_refused"], rec["saved_b"]), f"rank {r}: a refused load changed the step"
        assert not same(rec["after_copies"], rec["saved_b"]), "identical copies of a load"
        assert len(rec["losses"]) == 3
    assert same(recs[0]["after_copies"], recs[1]["after_copies"])
    assert recs[0]["losses"] == recs[1]["losses"]


@pytest.mark.slow
@pytest.mark.parametrize("scenario, named", [
    ("lr", "optimizer param_groups[0]['lr']: rank 0: 0.001; rank 1: 0.002"),
    ("optimizer_class", "optimizer: rank 0: AdamW; rank 1: SGD"),
    ("state_dtype", "optimizer state_dtype: rank 0: fp32; rank 1: bf16"),
    ("max_grad_norm", "max_grad_norm: rank 0: 1.0; rank 1: None"),
    ("accumulate", "accumulate: rank 0: 1; rank 1: 2"),
    ("precision", "precision: rank 0: fp32; rank 1: bf16"),
    ("chunk_size", "chunk_size: rank 0: 512; rank 1: 1024"),
    ("device_memory", "device_memory: rank 0: "),
])
def test_settings_that_differ_are_refused_by_name(ranks, scenario, named):
    for r, res in enumerate(ranks):
        rec = res[scenario]
        msg = refused(rec, r)
        assert rec["losses"] == [], f"rank {r} trained"
        assert named in msg, msg
        assert rec["error"][2] - rec["started"] < 10, "at once, not after the process group's timeout"
        if scenario in ("chunk_size", "device_memory"):
            # (named among the settings that differ: on the CPU each rank's default budget is the memory it finds
            # free, so device_memory may be named beside chunk_size)
            same = re.search(r"give every rank the same ([\w, ]+)", msg)
            assert "would issue different collectives" in msg and same and scenario in same.group(1).split(", "), msg


@pytest.mark.slow
def test_an_lr_scheduler_stepped_on_one_rank_is_refused_at_the_next_step(ranks):
    for r, res in enumerate(ranks):
        rec = res["scheduler"]
        msg = refused(rec, r)
        assert len(rec["losses"]) == 1
        assert "optimizer param_groups[0]['lr']: rank 0: 0.0005; rank 1: 0.001" in msg, msg
        assert "lr scheduler" in msg


@pytest.mark.slow
@pytest.mark.parametrize("what, called", [
    ("evaluate", "an evaluation function"), ("save", "step.save"), ("load", "step.load"),
    ("state_dict", "step.state_dict()"), ("compile", "px.compile"), ("sync_model", "sync_model()"),
    ("px_sync_model", "sync_model()"), ("optimizer_state_dict", "step.optimizer.state_dict()"),
    ("optimizer_load_state_dict", "step.optimizer.load_state_dict()"), ("load_state_dict", "step.load_state_dict()"),
    ("load_state_dict_given_back", "step.load_state_dict()")])
def test_a_call_on_one_rank_while_the_other_trains_is_refused_on_both(ranks, what, called):
    recs = [res[f"one_rank_{what}"] for res in ranks]
    for r, rec in enumerate(recs):
        assert "error" not in rec, rec.get("traceback")
        assert "refused" in rec, f"rank {r} ran its call"
        name, msg, at = rec["refused"]
        assert name == "DistributedError"
        assert f"the ranks called different functions (rank 0: {called}; rank 1: the training step)" in msg, msg
        assert at - rec["started"] < 10, "at once, not after the process group's timeout"
        assert rec["unchanged"] and not rec["saved"]
        assert rec["held"], f"rank {r}: a refused call gave the model back"
        assert len(rec["losses"]) == 2
    assert recs[0]["losses"] == recs[1]["losses"]


@pytest.mark.slow
def test_ranks_that_sync_and_read_and_load_the_optimizer_together_train_on(ranks):
    recs = [res["sync_and_optimizer_together"] for res in ranks]
    for r, rec in enumerate(recs):
        assert "error" not in rec, rec.get("traceback")
        assert rec["given_back"], f"rank {r}: sync_model() left the model held"
        assert same(rec["loaded"]["state"], rec["saved"]["state"]), f"rank {r}: the loaded optimizer state differs"
        assert len(rec["losses"]) == 3
    assert recs[0]["losses"] == recs[1]["losses"]


@pytest.mark.slow
def test_ranks_that_load_the_same_state_dicts_train_on(ranks):
    recs = [res["load_state_dict_together"] for res in ranks]
    for r, rec in enumerate(recs):
        assert "error" not in rec, rec.get("traceback")
        assert same(rec["loaded"], rec["saved"]["model"]), f"rank {r}: the loaded values differ"
        assert rec["given_back"], f"rank {r}: loading through another step left the model held"
        assert len(rec["losses"]) == 3
    assert recs[0]["losses"] == recs[1]["losses"]


@pytest.mark.slow
@pytest.mark.parametrize("what, call, named", [
    ("model", "step.load_state_dict()", "the values of 1 of 8 state dict entries: {param} (rank 0 | rank 1)"),
    ("optimizer_options", "step.optimizer.load_state_dict()", "param_groups[0]['lr']: rank 0: 0.001; rank 1: 0.002"),
    ("optimizer_states", "step.optimizer.load_state_dict()",
     "the values of 1 of 24 optimizer states: {param} exp_avg (rank 0 | rank 1)"),
    ("optimizer_before_the_first_step", "",
     "the values of 1 of 24 optimizer states: {param} exp_avg (rank 0 | rank 1)")])
def test_ranks_loading_different_state_dicts_are_refused_naming_what_differs(ranks, what, call, named):
    recs = [res[f"different_{what}"] for res in ranks]
    for r, rec in enumerate(recs):
        assert "error" not in rec, rec.get("traceback")
        assert "refused" in rec, f"rank {r} loaded a state dict the other rank did not"
        name, msg, at = rec["refused"]
        assert name == "DistributedError"
        said = named.format(param=rec["first_param"])
        assert (f"the ranks called {call} with different state dicts ({said}" if call else
                f"the ranks loaded different optimizer states before the first step ({said}") in msg, msg
        assert at - rec["started"] < 10, "at once, not after the process group's timeout"
        if what == "optimizer_before_the_first_step":
            assert same(rec["loaded"]["state"], rec["saved"]["state"]), f"rank {r}: the state loaded after differs"
            assert len(rec["losses"]) == 2, "the refused first step ran"
        else:
            assert same(rec["unchanged"], rec["before"]), f"rank {r}: a refused load changed the step"
            assert rec["lr"] == 1e-3
            assert len(rec["losses"]) == 2
    assert recs[0]["losses"] == recs[1]["losses"]


@pytest.mark.slow
@pytest.mark.parametrize("how, call", [("dies-in-save", "step.save"), ("dies-in-load", "step.load"),
                                       ("dies-before-state-dict", "step.state_dict()")])
def test_a_rank_exiting_in_a_call_gives_the_other_a_distributed_error(tmp_path, how, call):
    out = str(tmp_path / "result")
    res = run_ranks("dist_agreement_worker.py", [how, "--out", out, "--tmp", tmp_path, "--timeout", 30], WORLD, out,
                    timeout=120, failing=(1,)).results[0]
    assert "error" in res, "rank 0 went on without the rank that exited"
    name, msg, _ = res["error"]
    assert name == "DistributedError", res["traceback"]
    assert f"a collective ({call}" in msg and "another rank probably failed or exited" in msg, msg
    assert res["seconds"] < 20
    if how == "dies-in-save":
        assert res["beside"] == ["ckpt"], "the previous checkpoint, and nothing of the save cut short"


def _host_graph(world: int):
    """What warn_host_threads reads of a graph: one trainable chunk whose states live on the host."""
    chunk = types.SimpleNamespace(group=ChunkGroup.TRAINABLE, state_home=StateHome.HOST)
    return types.SimpleNamespace(chunks=[chunk], settings=types.SimpleNamespace(world=world))


@pytest.mark.parametrize("cores, ranks_on_node, share", [(2, 2, None), (8, 2, 4), (8, 8, None), (16, 1, 16)])
def test_the_thread_warning_compares_with_each_process_share_of_the_cores(monkeypatch, recwarn, cores,
                                                                           ranks_on_node, share):
    monkeypatch.setattr("os.cpu_count", lambda: cores)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(ranks_on_node))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        warn_host_threads(_host_graph(ranks_on_node))
    finally:
        torch.set_num_threads(threads)
    said = [str(w.message) for w in recwarn if "OMP_NUM_THREADS" in str(w.message)]
    if share is None:
        assert said == [], "one thread is this process's share of the cores"
    else:
        assert len(said) == 1 and f"OMP_NUM_THREADS={share}" in said[0], said
