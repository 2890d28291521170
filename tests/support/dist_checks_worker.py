"""One rank of tests/distributed/test_distributed_checks.py: the scenarios where ranks disagree, in one launch (gloo,
CPU).

Every rank runs the scenarios in the same order, each on a model and step of its own, and records per scenario the
losses of its steps and the error it got (type and message) into `<out>.rank<r>`. A rank's batch is its slice of
the step's global batch (`rows`; some scenarios give the ranks different sizes). At the end the process group is destroyed while the compiled steps are still alive, and the rank records
whether its groups are gone.
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
import traceback
import weakref

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))

import pstar_fx as px  # noqa: E402
from harness import HYPER  # noqa: E402
from models import BATCH_SEED, CASES_BY_NAME, MODEL_SEED  # noqa: E402

CASE = CASES_BY_NAME["mlp_ce"]      # batches: x (B, 16) float, y (B,) int64 in [0, 8)


def normed_mlp() -> nn.Module:
    """Linear layers (random initial values) around a LayerNorm (ones and zeros whatever the seed)."""
    return nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.ReLU(), nn.Linear(32, 8))


def built(seed: int, empty: bool) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if empty:
            with px.init_empty():
                return normed_mlp()
        return normed_mlp()


def loss_fn(model, x, y):
    return F.cross_entropy(model(x), y)


def compiled(model, optimizer=True):
    return px.compile(model, optimizer=px.AdamW(**HYPER) if optimizer else None, chunk_size=512, device="cpu",
                      debug=True)(loss_fn)


def rows(step: int, rank: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's n rows of the step's global batch of WORLD * n rows (with n = 2, the batches of the eager
    reference of tests/distributed/test_distributed.py on a global batch of 4)."""
    gen = torch.Generator().manual_seed(BATCH_SEED + step)
    return tuple(t[rank * n:(rank + 1) * n] for t in CASE.make_batch(step, gen, B=dist.get_world_size() * n))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--timeout", type=float, default=30.0)
    ap.add_argument("--only", default=None, help="comma-separated scenarios to run (default: all)")
    args = ap.parse_args()
    only = None if args.only is None else set(args.only.split(","))
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    rank = dist.get_rank()
    result: dict = {}
    alive: list = []              # every step made, kept alive to the end

    def scenario(name, fn):
        if only is not None and name not in only:
            return
        rec = result[name] = {"losses": []}
        try:
            fn(rec)
        except Exception as e:  # noqa: BLE001 - recorded for the test
            rec["error"] = (type(e).__name__, str(e), traceback.format_exc())

    def batch_sizes(rec):
        """Rank 0 calls with 2 rows, rank 1 with 3; then both with 2 rows: trains as if the first never ran."""
        model = CASE.build_model()
        step = compiled(model)
        alive.append(step)
        try:
            step(*rows(0, rank, 2 if rank == 0 else 3))
        except px.DistributedError as e:
            rec["refused"] = str(e)
        for i in range(2):
            rec["losses"].append(step(*rows(i, rank, 2)).item())
        rec["state_dict"] = step.state_dict()
        evaluate = compiled(model, optimizer=False)
        alive.append(evaluate)
        try:
            evaluate(*rows(0, rank, 2 if rank == 0 else 3))
        except px.DistributedError as e:
            rec["eval_refused"] = str(e)
        rec["eval_loss"] = evaluate(*rows(0, rank, 2)).item()

    def shape_change(rec):
        """Both ranks call with 2 rows, then at the third step rank 1 with 1 row."""
        step = compiled(CASE.build_model())
        alive.append(step)
        for i in range(3):
            rec["losses"].append(step(*rows(i, rank, 1 if (rank == 1 and i == 2) else 2)).item())

    def trains(seed_of_rank, empty):
        def run(rec):
            step = compiled(built(seed_of_rank(rank), empty))
            alive.append(step)
            for i in range(2):
                rec["losses"].append(step(*rows(i, rank, 2)).item())
        return run

    def batch_norm(rec):
        """BatchNorm's running statistics from each rank's own rows: after every step every rank holds rank 0's
        (as DDP's broadcast_buffers); sync_model() and another step then work (the ranks agree on the model)."""
        torch.manual_seed(MODEL_SEED)
        model = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 8))
        step = compiled(model)
        alive.append(step)
        for i in range(2):
            rec["losses"].append(step(*rows(i, rank, 2)).item())
        rec["buffers"] = {k: v for k, v in step.state_dict().items() if k.startswith("1.running")}
        step.sync_model()
        rec["losses"].append(step(*rows(2, rank, 2)).item())

    def architecture(rec):
        """Rank 1's hidden layer is narrower: refused before anything runs, naming the parameters."""
        torch.manual_seed(MODEL_SEED)
        width = 32 if rank == 0 else 16
        step = compiled(nn.Sequential(nn.Linear(16, width), nn.ReLU(), nn.Linear(width, 8)))
        alive.append(step)
        rec["losses"].append(step(*rows(0, rank, 2)).item())

    def state_set_up(on_every_rank):
        def run(rec):
            """A module noting, on its first forward, that it ran (a plain attribute, part of the step's signature;
            api/plan_reuse.py): on every rank, or on rank 0 only."""
            class Noting(nn.Sequential):
                def forward(self, x):
                    if (on_every_rank or rank == 0) and not getattr(self, "noted", False):
                        self.noted = True
                    return super().forward(x)
            torch.manual_seed(MODEL_SEED)
            step = compiled(Noting(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)))
            alive.append(step)
            for i in range(3):
                rec["losses"].append(step(*rows(i, rank, 2)).item())
                rec["traces"], rec["plans"] = step._compiler.compiles, step._compiler.plans
        return run

    scenario("batch_sizes", batch_sizes)
    scenario("state_every_rank", state_set_up(True))
    scenario("state_rank_0", state_set_up(False))
    scenario("batch_norm", batch_norm)
    scenario("architecture", architecture)
    scenario("shape_change", shape_change)
    scenario("seeds_plain", trains(lambda r: MODEL_SEED + r, empty=False))
    scenario("seeds_empty", trains(lambda r: MODEL_SEED + r, empty=True))
    scenario("same_seed_plain", trains(lambda r: MODEL_SEED, empty=False))
    scenario("same_seed_empty", trains(lambda r: MODEL_SEED, empty=True))

    # the groups a live step uses end where the user destroys them (not at interpreter exit)
    groups = [weakref.ref(dist.group.WORLD)] + [weakref.ref(s._comm.control) for s in alive[:1]
                                                 if hasattr(s._comm, "control")]
    dist.destroy_process_group()
    result["groups_alive_after_destroy"] = [g() is not None for g in groups]
    result["steps_alive"] = len(alive)
    torch.save(result, f"{args.out}.rank{rank}")


if __name__ == "__main__":
    main()
