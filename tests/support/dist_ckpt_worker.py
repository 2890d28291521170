"""One rank of a checkpoint test across world sizes (tests/distributed/test_distributed_checkpoint.py launches `world`
of these, as torchrun would; with WORLD_SIZE=1 it runs as a plain process, with no process group). On the CPU with gloo;
PSTAR_TEST_DEVICE=cuda: one GPU per rank with NCCL.

    python tests/support/dist_ckpt_worker.py SPEC.json OUT

SPEC.json is a list of runs, done in order in this process; each is a dict with
  name        key of the run's result
  case        a tests/support/models.py case name
  precision   "fp32" / "bf16"
  optimizer   "adamw" (the default), "nadam" (torch.optim.NAdam: 0-d states besides the step count) or "sgd"
              (torch.optim.SGD with momentum: a per-element state only), through px.optim_from_torch
  chunk_size  elements per chunk
  batch       the global batch size: `units` equal slices, so that every world size sees the same micro-batches
  units       micro-batches per global batch; rank r of `world` runs slices [r * units / world, (r + 1) * units /
              world) as `accumulate = units / world` micro-batches (a run at world 2 and one at world 1 compute the
              gradient of the same slices, summed in the same order)
  start, stop train steps [start, stop) (batches are a pure function of the step index)
  load        a checkpoint to step.load before training, or null; load_when: "before" (before anything is
              compiled) or "lowered" (after step.lower: the chunk store exists, the load reads this rank's shards)
  saves       [[at, path, sharded], ...]: pstar_fx.step.save(path, sharded=sharded) before
              step `at` (at == stop: after the last; sharded null: its default); the state dict and optimizer state dict
              right then are recorded under "saved"[path]
  optimizer_round_trip  after training: load step.optimizer.state_dict() back into the step (all ranks) and record
              the state dict read after that too
Every rank writes OUT.rank{r}: {name: {"losses", "state" (step.state_dict(), gathered), "optimizer"
(step.optimizer.state_dict()), "loaded_state" / "loaded_optimizer" (right after the load, when there is one),
"saved", "rank0_state" (step.state_dict(rank0_only=True)), "loss_scale", "world"}},
or {"error": (type, message, traceback)}.
"""
from __future__ import annotations

import datetime
import functools
import json
import os
import sys
import traceback

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))

import pstar_fx as px  # noqa: E402
from harness import HYPER  # noqa: E402
from models import CASES_BY_NAME  # noqa: E402

DEVICE = os.environ.get("PSTAR_TEST_DEVICE", "cpu")    # cuda: one GPU per rank (LOCAL_RANK), NCCL


def _case(run: dict):
    base = CASES_BY_NAME[run["case"]]
    return base.__class__(base.name, base.build, base.loss_fn, functools.partial(base.make_batch, B=run["batch"]))


def _optimizer(name: str):
    lr, wd = HYPER["lr"], HYPER["weight_decay"]
    if name == "nadam":
        return px.optim_from_torch(torch.optim.NAdam, lr=lr, weight_decay=wd, decoupled_weight_decay=True)
    if name == "sgd":
        return px.optim_from_torch(torch.optim.SGD, lr=lr * 10, momentum=0.9, weight_decay=wd)
    assert name == "adamw", name
    return px.AdamW(**HYPER)


def one_run(run: dict, rank: int, world: int) -> dict:
    case = _case(run)
    units = run.get("units", 2)
    assert units % world == 0 and run["batch"] % units == 0, (units, world, run["batch"])
    per = run["batch"] // world

    def local(i):
        return tuple(t[rank * per:(rank + 1) * per] for t in case.batch(i))

    model = case.build_model()
    step = px.compile(model, optimizer=_optimizer(run.get("optimizer", "adamw")), chunk_size=run["chunk_size"],
                      precision=run["precision"], device=DEVICE, accumulate=units // world)(case.loss_fn)
    out: dict = {"world": world, "losses": [], "saved": {}}

    def save_at(i):
        for at, path, sharded in run.get("saves", ()):
            if at == i:
                step.save(path, sharded=sharded)
                out["saved"][path] = {"state": step.state_dict(), "optimizer": step.optimizer.state_dict()}

    if run.get("load"):
        if run.get("load_when", "before") == "lowered":
            step.lower(*local(run["start"]))
        step.load(run["load"])
        out["loaded_state"] = step.state_dict()
        out["loaded_optimizer"] = step.optimizer.state_dict()
    for i in range(run["start"], run["stop"]):
        save_at(i)
        out["losses"].append(step(*local(i)).item())
    save_at(run["stop"])
    out["state"] = step.state_dict()
    out["rank0_state"] = step.state_dict(rank0_only=True)
    out["optimizer"] = step.optimizer.state_dict()
    out["loss_scale"] = step.loss_scale
    if run.get("optimizer_round_trip"):
        step.optimizer.load_state_dict(out["optimizer"])
        out["round_trip_optimizer"] = step.optimizer.state_dict()
    return out


def main(spec_path: str, out_path: str) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if DEVICE == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if world > 1:
        dist.init_process_group("nccl" if DEVICE == "cuda" else "gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank() if world > 1 else 0
    with open(spec_path) as f:
        runs = json.load(f)
    result: dict = {}
    try:
        for run in runs:
            result[run["name"]] = one_run(run, rank, world)
    except Exception as e:  # noqa: BLE001 - recorded for the test
        result = {"error": (type(e).__name__, str(e), traceback.format_exc())}
    torch.save(result, f"{out_path}.rank{rank}")
    if world > 1:
        dist.destroy_process_group()
    if "error" in result:
        sys.exit(3)


if __name__ == "__main__":
    main(*sys.argv[1:])
