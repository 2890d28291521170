"""The disk tier (offload_dir) on several ranks: each rank keeps its shard of the disk chunks' optimizer states in
files of its own (a directory named with its rank under the offload_dir the ranks share), reads and writes only
those, and trains as on one rank.

Two ranks (gloo, CPU; tests/support/disk_ranks_worker.py, launched as torchrun would) with some chunks' states on
disk equal the same two ranks with every state in memory bit for bit (fp32), and the single-process eager reference
(the global batch as rank slices accumulated in rank order, as tests/distributed/test_distributed.py explains) to
1e-6; sharded checkpoints and state dicts save, load and resume through the disk shards; a failure before the commit,
on every rank or on one, leaves every rank's files as they were; the files go with the step. The ranks agree on the
tier budgets (rank 1 passes a larger host_memory and still plans what rank 0 plans), and px.plan(world_size=2) plans
the disk tier as the ranks do. Option resolution and the files' names are checked without launching ranks.
"""
from __future__ import annotations

import os

import pytest
import torch

import pstar_fx as px
from pstar_fx.api.options import _UNSET, resolve_tiers
from pstar_fx.ir.graph import StateHome
from pstar_fx.ir.needs import disk_bytes
from pstar_fx.runtime.disk import DiskStates

from disk_ranks_worker import BATCH, CHUNK, DEVICE_MEMORY, SAVE_AT, STEPS, build, global_batch
from harness import HYPER, rel_err
from models import assert_state_close, mlp_loss
from ranks import run_ranks

WORLD = 2


def _assert_equal(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), what
    for k in a:
        if isinstance(a[k], dict):
            _assert_equal(a[k], b[k], f"{what}.{k}")
        elif isinstance(a[k], torch.Tensor):
            assert torch.equal(a[k], b[k]), f"{what}.{k}"
        else:
            assert a[k] == b[k], f"{what}.{k}"


def _assert_same_run(a: dict, b: dict, what: str) -> None:
    """Losses, gathered state dict and optimizer state dict equal bit for bit."""
    assert a["losses"] == b["losses"], what
    _assert_equal(a["state"], b["state"], f"{what} state")
    _assert_equal(a["optimizer"], b["optimizer"], f"{what} optimizer")


def launch(tmp, mode: str, failing: tuple[int, ...] = ()) -> list[dict]:
    out = os.path.join(tmp, "result")
    ranks = run_ranks("disk_ranks_worker.py", [mode, tmp, out], WORLD, out, timeout=240, failing=failing)
    for r, res in enumerate(ranks.results):
        if r not in failing:
            assert "error" not in res, f"rank {r}: {res['error'][2]}"
    return ranks.results


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("disk-ranks"))
    return tmp, launch(tmp, "train")


def eager_reference(steps: int):
    """One process, the global batch as WORLD rank slices whose gradients are divided by WORLD and summed in rank
    order (the ranks' reduce-scatter sums the same terms in the same order), torch.optim.AdamW."""
    model = build()
    opt = torch.optim.AdamW(model.parameters(), **HYPER)
    per = BATCH // WORLD
    losses = []
    for i in range(steps):
        loss, params = 0.0, list(model.parameters())
        for r in range(WORLD):
            part = mlp_loss(model, *(t[r * per:(r + 1) * per] for t in global_batch(i)))
            for p, g in zip(params, torch.autograd.grad(part, params)):
                p.grad = g / WORLD if p.grad is None else p.grad + g / WORLD
            loss = loss + part.detach() / WORLD
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.slow
def test_disk_states_on_two_ranks_train_like_states_in_memory_and_like_eager(trained):
    _, results = trained
    homes = results[0]["disk"]["homes"]
    assert 0 < homes.count(StateHome.DISK) < len(homes), homes        # some on disk, some in host memory
    for r, res in enumerate(results):
        disk = res["disk"]
        assert disk["stage"] == "sharded" and disk["homes"] == homes, r   # every rank planned the same chunks
        _assert_same_run(disk, res["memory"], f"rank {r}: disk tier against every state in memory")
        _assert_same_run(disk, results[0]["disk"], f"rank {r} against rank 0")
        assert "read from disk" in disk["summary"]
    want_losses, want_state = eager_reference(STEPS)
    got = results[0]["disk"]
    assert rel_err(got["losses"], want_losses) <= 1e-6, (got["losses"], want_losses)
    assert_state_close(got["state"], want_state, rtol=1e-6)


@pytest.mark.slow
def test_the_ranks_agree_on_the_budgets(trained):
    """Rank 1 passed a host_memory two chunks' states larger than rank 0's: alone it would put fewer chunks on disk.
    Each rank's budget is the smallest over the ranks: rank 0's per-node host_memory over the node's two ranks."""
    _, results = trained
    assert results[1]["host_memory"] > results[0]["host_memory"]
    budgets = {(res["disk"]["host_budget"], res["disk"]["disk_budget"]) for res in results}
    assert budgets == {(results[0]["host_memory"] // WORLD, results[0]["disk"]["disk_budget"])}


@pytest.mark.slow
def test_each_rank_reads_and_writes_files_of_its_own(trained):
    tmp, results = trained
    scratch = os.path.join(tmp, "scratch")
    disk_chunks = [c for c, h in enumerate(results[0]["disk"]["homes"]) if h is StateHome.DISK]
    for r, res in enumerate(results):
        disk = res["disk"]
        assert os.path.dirname(disk["root"]) == scratch
        assert os.path.basename(disk["root"]).startswith(f"pstar-fx-rank{r}-"), disk["root"]
        assert disk["listing"] == sorted(f"states-{c}.bin" for c in disk_chunks)
        # each file holds this rank's shard of its chunk's states (half of them), aligned to 4 KiB
        assert disk["sizes"] == {c: disk["shard_bytes"][c] for c in disk_chunks}
        shard = sum(disk["shard_bytes"][c] for c in disk_chunks)
        assert disk["read"] == disk["written"] == shard
        assert disk["removed"]                                         # gone with the step
    assert results[0]["disk"]["root"] != results[1]["disk"]["root"]
    for c in disk_chunks:                                              # the ranks' shards: different values
        a, b = results[0]["disk"]["files"][c], results[1]["disk"]["files"][c]
        assert any(a) and any(b) and a != b, c


@pytest.mark.slow
def test_checkpoints_and_state_dicts_save_load_and_resume_through_disk_shards(trained):
    _, results = trained
    for r, res in enumerate(results):
        resumed = res["resumed"]
        want = resumed["uninterrupted"]
        assert want["losses"] == res["disk"]["losses"][SAVE_AT:]
        assert StateHome.DISK in resumed["disk"]["homes"] and StateHome.DISK not in resumed["memory"]["homes"]
        assert StateHome.DISK in resumed["plain"]["homes"]
        for name in ("disk", "memory", "plain", "state_dicts"):
            _assert_same_run(resumed[name], want, f"rank {r}: resumed ({name}) against the uninterrupted run")


@pytest.mark.slow
def test_a_failure_on_every_rank_before_the_commit_leaves_the_files_as_they_were(trained):
    _, results = trained
    for r, res in enumerate(results):
        fault = res["fault"]
        assert any(any(b) for b in fault["before"].values())            # the states of two steps, not zeros
        assert len(fault["after"]) == 2
        for message, files in fault["after"]:
            assert message == f"injected on rank {r}"
            assert files == fault["before"], r
        _assert_same_run(fault, res["disk"], f"rank {r}: trained on after the failures")


@pytest.mark.slow
def test_a_failure_on_one_rank_leaves_every_ranks_files_as_they_were(tmp_path):
    results = launch(str(tmp_path), "one_fails", failing=(1,))
    assert results[1]["raised"] == ("RuntimeError", "injected on rank 1")
    assert results[0]["raised"][0] == "DistributedError", results[0]["raised"]
    for r, res in enumerate(results):
        assert any(any(b) for b in res["before"].values())
        assert res["after"] == res["before"], r


@pytest.mark.slow
def test_px_plan_plans_the_disk_tier_of_two_ranks_as_they_do(trained):
    _, results = trained
    x, y = global_batch(0)
    per = BATCH // WORLD
    kw = dict(world_size=WORLD, device_memory=DEVICE_MEMORY, host_memory=results[0]["host_memory"],
              precision="fp32", chunk_size=CHUNK, device="cpu", optimizer=px.AdamW(**HYPER))
    report = px.plan(build(), mlp_loss, x[:per], y[:per], disk_memory="1GiB", **kw)
    assert [c.state_home for c in report.graph.chunks] == results[0]["disk"]["homes"]
    assert report.graph.settings.host_budget == results[0]["disk"]["host_budget"]
    assert report.states_on_disk == results[0]["disk"]["homes"].count(StateHome.DISK)
    assert report.disk_bytes == disk_bytes(report.graph) == sum(results[0]["disk"]["sizes"].values())
    assert report.disk_per_node == WORLD * report.disk_bytes
    assert (f"per GPU: its shard of the optimizer states of {report.states_on_disk} chunks"
            in str(report)), str(report)
    with pytest.raises(px.BudgetError, match=r"disk_memory .* per rank\) is too small") as e:
        px.plan(build(), mlp_loss, x[:per], y[:per], disk_memory=1000, **kw)
    assert e.value.tier is StateHome.DISK
    with pytest.raises(px.BudgetError, match=r"host_memory's share of each rank, .* \(host_memory is per node") as e:
        px.plan(build(), mlp_loss, x[:per], y[:per], disk_memory="1GiB", **dict(kw, host_memory=20_000))
    assert e.value.tier is StateHome.HOST and e.value.available == 20_000 // WORLD


# -- without launching ranks ----------------------------------------------------------------------------------------
class _Ranks:
    """A stand-in for runtime.comm.Comm: `world` ranks, this one `rank`, whose peers passed `others` (per value
    of `smallest`: the other ranks' values, one list each)."""

    def __init__(self, world: int, rank: int, others: list[list[int]]):
        self.world, self.rank, self.others = world, rank, others
        self.calls = 0

    def smallest(self, values: list[int]) -> list[int]:
        self.calls += 1
        return [min([v] + [o[i] for o in self.others]) for i, v in enumerate(values)]


def test_host_memory_is_per_node_and_the_ranks_take_the_smallest_budgets(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    comm = _Ranks(8, 3, [[0, 0, _UNSET, _UNSET]])
    # host_memory per node, divided among the node's 4 ranks; no disk tier
    assert resolve_tiers("4000", None, None, comm) == (1000, None, None)
    assert comm.calls == 1                          # one agreement, even without a disk tier
    # disk_memory per rank; another rank's smaller budgets win
    comm = _Ranks(8, 3, [[1, -1, 700, 5000]])
    assert resolve_tiers(4000, tmp_path, 9000, comm) == (700, str(tmp_path), 5000)
    # the free space of offload_dir and the spare host memory, shared among the node's ranks
    host, _, disk = resolve_tiers(None, tmp_path, None, _Ranks(8, 3, [[1, -1, _UNSET, _UNSET]]))
    import shutil
    from pstar_fx.runtime.host_memory import host_limit_bytes, spare_host_bytes
    free = shutil.disk_usage(tmp_path).free
    assert abs(disk - free // 4) <= (64 << 20) // 4 and 0 < host <= spare_host_bytes(4) + (64 << 20) // 4
    # one process (no process group) takes host_memory whole, whatever LOCAL_WORLD_SIZE says
    assert resolve_tiers("4000", None, None, None) == (4000, None, None)
    # host_memory=None and no disk tier: this rank's share of the host's memory less the margin, the smallest over
    # the ranks (a peer with less wins); without LOCAL_WORLD_SIZE the ranks per node are not known: not checked
    assert resolve_tiers(None, None, None, _Ranks(8, 3, [[0, 0, _UNSET, _UNSET]])) == (host_limit_bytes(4), None,
                                                                                       None)
    assert resolve_tiers(None, None, None, _Ranks(8, 3, [[0, 0, 1234, _UNSET]])) == (1234, None, None)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert resolve_tiers(None, None, None, _Ranks(8, 3, [[0, 0, _UNSET, _UNSET]])) == (None, None, None)


def test_a_disk_tier_on_some_ranks_only_raises(tmp_path):
    with pytest.raises(ValueError, match="offload_dir is given on some ranks and not on others"):
        resolve_tiers(None, tmp_path, None, _Ranks(2, 0, [[0, 0, _UNSET, _UNSET]]))
    with pytest.raises(ValueError, match="offload_dir is given on some ranks and not on others"):
        resolve_tiers(None, None, None, _Ranks(2, 1, [[1, -1, 5000, 5000]]))


def test_host_memory_smaller_than_a_byte_per_rank_raises(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    with pytest.raises(ValueError, match="host_memory is per node, shared by its ranks"):
        resolve_tiers(7, None, None, _Ranks(8, 0, []))


def test_scratch_directories_are_named_by_rank(tmp_path):
    dirs = [DiskStates(str(tmp_path), rank=r) for r in (0, 1)] + [DiskStates(str(tmp_path))]
    names = [os.path.basename(d.root) for d in dirs]
    assert names[0].startswith("pstar-fx-rank0-") and names[1].startswith("pstar-fx-rank1-")
    assert names[2].startswith("pstar-fx-") and "rank" not in names[2]
    assert len({d.root for d in dirs}) == 3 and all(os.path.dirname(d.root) == str(tmp_path) for d in dirs)
    for d in dirs:
        d.close()
    assert os.listdir(tmp_path) == []
