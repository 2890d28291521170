"""One rank of tests/distributed/test_distributed_agreement.py: ranks that differ in what they loaded, in their
settings, in which function they call, or in the state dict they give step.load_state_dict() or the optimizer's
load_state_dict() (gloo, CPU), and ranks that call sync_model(), step.load_state_dict() and the optimizer's
state_dict() and load_state_dict() together.

`agree` runs every scenario in one launch, each on a model and step of its own, in the same order on every rank, and
records per scenario the losses of its steps, the error each call raised (type and message) and what the test
compares, into `<out>.rank<r>`. A scenario whose ranks raise at the same point leaves them in step with each other,
so the next one starts together. `dies-in-save`, `dies-in-load` and `dies-before-state-dict`: rank 1 exits in the
middle of the call (os._exit, as a killed process), and rank 0 records what it got.
"""
from __future__ import annotations

import argparse
import copy
import datetime
import glob
import os
import shutil
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))

import pstar_fx as px  # noqa: E402
import pstar_fx.checkpoint.dcp_storage as dcp_storage  # noqa: E402
import pstar_fx.checkpoint.files as ckpt_files  # noqa: E402
from harness import HYPER  # noqa: E402
from models import BATCH_SEED, CASES_BY_NAME  # noqa: E402

CASE = CASES_BY_NAME["mlp_ce"]      # batches: x (B, 16) float, y (B,) int64 in [0, 8)


def loss_fn(model, x, y):
    return F.cross_entropy(model(x), y)


def rows(step: int, rank: int, n: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's n rows of the step's global batch."""
    gen = torch.Generator().manual_seed(BATCH_SEED + step)
    return tuple(t[rank * n:(rank + 1) * n] for t in CASE.make_batch(step, gen, B=dist.get_world_size() * n))


def compiled(optimizer=None, **kw):
    """A training step on a fresh model (built from the same seed on every rank)."""
    kw = dict(dict(chunk_size=512, device="cpu"), **kw)
    return px.compile(CASE.build_model(), optimizer=optimizer or px.AdamW(**HYPER), **kw)(loss_fn)


def error(e: BaseException) -> tuple[str, str, float]:
    return type(e).__name__, str(e), time.monotonic()


def values(step) -> dict:
    """The step's values and optimizer state, to compare before and after a refused call."""
    return {"model": step.state_dict(), "optimizer": step.optimizer.state_dict()}


def agree(rank: int, tmp: str, result: dict) -> None:
    def scenario(name, fn):
        rec = result[name] = {"losses": []}
        rec["started"] = time.monotonic()
        try:
            fn(rec)
        except Exception as e:  # noqa: BLE001 - recorded for the test
            rec["error"] = error(e)
            rec["traceback"] = traceback.format_exc()

    def train(step, rec, i):
        rec["losses"].append(step(*rows(i, rank)).item())

    def mixed_checkpoints(rec):
        """Save a after one step and b after two; then rank 0 loads a and rank 1 b: refused, nothing changes;
        identical copies on disks of each rank's own load; copies of different checkpoints are refused."""
        step = compiled()
        train(step, rec, 0)
        step.save(f"{tmp}/a")
        train(step, rec, 1)
        step.save(f"{tmp}/b")
        rec["saved_b"] = values(step)
        try:
            step.load(f"{tmp}/a" if rank == 0 else f"{tmp}/b")
        except px.DistributedError as e:
            rec["refused"] = str(e)
        rec["after_refused"] = values(step)
        shutil.copytree(f"{tmp}/a", f"{tmp}/copy{rank}")
        dist.barrier()
        step.load(f"{tmp}/copy{rank}")          # identical copies: loads
        rec["after_copies"] = values(step)
        shutil.copytree(f"{tmp}/a" if rank == 0 else f"{tmp}/b", f"{tmp}/stale{rank}")
        dist.barrier()
        try:
            step.load(f"{tmp}/stale{rank}")
        except px.DistributedError as e:
            rec["stale_refused"] = str(e)
        train(step, rec, 2)
        fresh = compiled()
        try:                                    # before the first step too
            fresh.load(f"{tmp}/a" if rank == 0 else f"{tmp}/b")
        except px.DistributedError as e:
            rec["fresh_refused"] = str(e)

    def differing(rank1, make=None, **kw):
        """Rank 1 compiles with `rank1` (px.compile's keywords; optimizer: a px optimizer), the others with `kw`."""
        def run(rec):
            mine = dict(kw, **(rank1 if rank == 1 else {}))
            step = compiled(**mine)
            for i in range(2):
                train(step, rec, i)
        return run

    def scheduler_on_rank0(rec):
        step = compiled()
        sched = torch.optim.lr_scheduler.StepLR(step.optimizer, 1, 0.5)
        for i in range(3):
            train(step, rec, i)
            if rank == 0:
                sched.step()

    def one_rank_calls(what):
        """Both ranks train a step; then rank 0 calls `what` while rank 1 trains: both refuse; then both train."""
        def run(rec):
            step = compiled()
            evaluate = px.compile(step._model, optimizer=None, device="cpu")(loss_fn)
            train(step, rec, 0)
            before = values(step)
            try:
                if rank == 0:
                    if what == "evaluate":
                        evaluate(*rows(1, rank))
                    elif what == "save":
                        step.save(f"{tmp}/one-rank")
                    elif what == "load":
                        step.load(f"{tmp}/a")
                    elif what == "state_dict":
                        step.state_dict()
                    elif what == "compile":
                        compiled()             # a training step's construction agrees its host budget: a collective
                    elif what == "sync_model":
                        step.sync_model()
                    elif what == "px_sync_model":
                        px.sync_model(step._model)
                    elif what == "optimizer_state_dict":
                        step.optimizer.state_dict()
                    elif what == "optimizer_load_state_dict":
                        step.optimizer.load_state_dict(before["optimizer"])
                    elif what == "load_state_dict":
                        step.load_state_dict(before["model"])      # into the chunks: each rank its own shard
                    elif what == "load_state_dict_given_back":
                        evaluate.load_state_dict(before["model"])  # gives the model back from `step` first
                else:
                    train(step, rec, 1)
            except px.DistributedError as e:
                rec["refused"] = error(e)
            rec["held"] = step.holds_model()
            rec["unchanged"] = all(torch.equal(v, before["model"][k]) for k, v in values(step)["model"].items())
            rec["saved"] = os.path.exists(f"{tmp}/one-rank")
            train(step, rec, 1)      # the ranks are in step again
        return run

    def together(rec):
        """Every rank gives the model back, rank 0 through step.sync_model() and rank 1 through px.sync_model (the
        same call); a second sync_model() on rank 0 alone has nothing to give back, so it runs no collective and
        needs no other rank; every rank reads and loads the optimizer's state; then both train on together."""
        step = compiled()
        train(step, rec, 0)
        saved = step.optimizer.state_dict()
        train(step, rec, 1)
        if rank == 0:
            step.sync_model()
        else:
            px.sync_model(step._model)
        rec["given_back"] = not step.holds_model()
        if rank == 0:
            step.sync_model()
        step.optimizer.load_state_dict(saved)      # the store exists: a collective, on every rank
        rec["loaded"] = step.optimizer.state_dict()
        rec["saved"] = saved
        train(step, rec, 2)

    def load_together(rec):
        """Every rank loads the same state dict into a step that holds the model (into its chunks), then through an
        evaluation function compiled on the same model (which gives it back from the step first), and the
        optimizer's; then both train on together."""
        step = compiled()
        evaluate = px.compile(step._model, optimizer=None, device="cpu")(loss_fn)
        train(step, rec, 0)
        saved = values(step)
        train(step, rec, 1)
        step.load_state_dict(saved["model"])
        rec["loaded"] = step.state_dict()
        evaluate.load_state_dict(saved["model"])
        rec["given_back"] = not step.holds_model()
        step.optimizer.load_state_dict(saved["optimizer"])
        rec["saved"] = saved
        train(step, rec, 2)

    def different_dicts(what):
        """Both ranks train a step; then each loads a state dict, rank 1's with one value changed (`what`): both
        refuse, and the step keeps its values; then both train on together. `optimizer_before_the_first_step`:
        a fresh step's optimizer loads them before its store exists, so the first step is refused (the states are
        compared as the store is made); the same state dict loaded on both after that trains."""
        def run(rec):
            step = compiled()
            train(step, rec, 0)
            before = values(step)
            rec["first_param"] = next(n for n, _ in step._model.named_parameters())
            sd = copy.deepcopy(before["model"] if what == "model" else before["optimizer"])
            if rank == 1:
                if what == "model":
                    sd[rec["first_param"]] += 1
                elif what == "optimizer_options":
                    sd["param_groups"][0]["lr"] = 2e-3
                else:
                    sd["state"][0]["exp_avg"] += 1
            rec["started"] = time.monotonic()
            try:
                if what == "model":
                    step.load_state_dict(sd)
                elif what == "optimizer_before_the_first_step":
                    step = compiled()
                    step.optimizer.load_state_dict(sd)      # no store yet: waits in the optimizer
                    train(step, rec, 0)
                else:
                    step.optimizer.load_state_dict(sd)
            except px.DistributedError as e:
                rec["refused"] = error(e)
            if what == "optimizer_before_the_first_step":
                step.optimizer.load_state_dict(before["optimizer"])     # the same on both: loads
                rec["loaded"], rec["saved"] = step.optimizer.state_dict(), before["optimizer"]
            else:
                rec["unchanged"] = values(step)
                rec["before"] = before
                rec["lr"] = step.optimizer.param_groups[0]["lr"]
            train(step, rec, 1)      # the ranks are in step again
        return run

    budget = int(compiled().min_device_memory(*rows(0, rank)) * 1.05)
    scenario("mixed_checkpoints", mixed_checkpoints)
    scenario("lr", differing({"optimizer": px.AdamW(**dict(HYPER, lr=2e-3))}))
    scenario("scheduler", scheduler_on_rank0)
    scenario("optimizer_class", differing({"optimizer": px.SGD(lr=1e-3)}))
    scenario("state_dtype", differing({"optimizer": px.AdamW(**HYPER, state_dtype="bf16")}))
    scenario("max_grad_norm", differing({"max_grad_norm": None}, max_grad_norm=1.0))
    scenario("accumulate", differing({"accumulate": 2}))
    scenario("precision", differing({"precision": "bf16"}))
    scenario("chunk_size", differing({"chunk_size": 1024}))
    scenario("device_memory", differing({"device_memory": budget}))
    for what in ("evaluate", "save", "load", "state_dict", "compile", "sync_model", "px_sync_model",
                 "optimizer_state_dict", "optimizer_load_state_dict"):
        scenario(f"one_rank_{what}", one_rank_calls(what))
    scenario("sync_and_optimizer_together", together)
    # (last: without the ranks' checks these would leave the ranks out of step for whatever came after)
    scenario("load_state_dict_together", load_together)
    for what in ("load_state_dict", "load_state_dict_given_back"):
        scenario(f"one_rank_{what}", one_rank_calls(what))
    for what in ("model", "optimizer_options", "optimizer_states", "optimizer_before_the_first_step"):
        scenario(f"different_{what}", different_dicts(what))


def dies(how: str, rank: int, tmp: str, result: dict, out: str) -> None:
    """Rank 1 exits in the middle of `how` (its result written first); rank 0 records the error it gets and what
    is on disk."""
    step = compiled()
    step(*rows(0, rank))
    step.save(f"{tmp}/ckpt")
    step(*rows(1, rank))
    if rank == 1:
        def exit_now(*args, **kwargs):
            torch.save({"exited": how}, f"{out}.rank{rank}")
            os._exit(9)
        if how == "dies-in-save":
            ckpt_files.checksum = exit_now
        elif how == "dies-in-load":
            dcp_storage.Reader.read_data = exit_now
        else:
            exit_now()
    started = time.monotonic()
    try:
        if how == "dies-in-save":
            step.save(f"{tmp}/ckpt")
        elif how == "dies-in-load":
            step.load(f"{tmp}/ckpt")
        else:
            step.state_dict()
    except Exception as e:  # noqa: BLE001 - recorded for the test
        result["error"] = error(e)
        result["traceback"] = traceback.format_exc()
    result["seconds"] = time.monotonic() - started
    result["beside"] = sorted(os.path.basename(p) for p in glob.glob(f"{tmp}/ckpt*"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("how", choices=["agree", "dies-in-save", "dies-in-load", "dies-before-state-dict"])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tmp", required=True)
    ap.add_argument("--timeout", type=float, default=30.0)
    args = ap.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    rank = dist.get_rank()
    result: dict = {}
    if args.how == "agree":
        agree(rank, args.tmp, result)
    else:
        dies(args.how, rank, args.tmp, result, args.out)
    torch.save(result, f"{args.out}.rank{rank}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
