"""One rank of a multi-process test (tests/distributed/test_distributed.py launches `world` of these, as torchrun
would).

Each rank trains a test case with pstar-fx on its slice of every global batch (gloo, CPU) and rank 0 writes the
losses the step reported and the final state_dict to --out. With --fail-rank, that rank fails in the middle of
step --fail-step (an error raised before a node of the graph, as a device fault would); the other ranks record the
error they get (type and message) instead of hanging.
"""
from __future__ import annotations

import argparse
import datetime
import functools
import importlib
import os
import sys
import traceback

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))

import pstar_fx as px  # noqa: E402
from pstar_fx.ir import ops  # noqa: E402
from pstar_fx.ir import ParamHome, Role  # noqa: E402
from harness import HYPER  # noqa: E402
from models import CASES_BY_NAME  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", required=True)
    ap.add_argument("--batch", type=int, required=True, help="global batch size (split evenly over the ranks)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--budget", default="none", help="none, tight, xF (F times the least budget), or bytes")
    ap.add_argument("--host-param-homes", action="store_true",
                    help="every chunk keeps a host parameter home (the reference for cast-from-master homes)")
    ap.add_argument("--chunk-size", type=int, default=None)
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--clip", type=float, default=None)
    ap.add_argument("--accumulate", type=int, default=1)
    ap.add_argument("--fail-rank", type=int, default=-1)
    ap.add_argument("--fail-step", type=int, default=-1)
    ap.add_argument("--fail-node", default="middle",
                    help="where --fail-rank fails: the middle node, the commit, or the first optimizer step")
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--poison-rank", type=int, default=-1, help="this rank's inputs are scaled by 1e6 at --poison-step")
    ap.add_argument("--poison-step", type=int, default=-1)
    ap.add_argument("--eval", action="store_true", help="after training, evaluate each rank's first batch slice")
    ap.add_argument("--init-empty", action="store_true", help="build the model under px.init_empty()")
    ap.add_argument("--device", default="cpu", help="cpu (gloo) or cuda (NCCL, one GPU per rank)")
    ap.add_argument("--state-dtype", default="fp32", help="px.AdamW's state_dtype: fp32, bf16 or int8")
    ap.add_argument("--fuse", action="store_true", help="px.compile(fuse=True)")
    ap.add_argument("--no-atomic", action="store_true", help="px.compile(atomic=False)")
    ap.add_argument("--undo", type=int, default=None, help="px.compile's _undo_updates")
    ap.add_argument("--host-memory", type=int, default=None, help="px.compile's host_memory (bytes per node)")
    ap.add_argument("--fail-before-commit", type=int, default=-1,
                    help="every rank fails just before this step's commit, then calls the step again on its batch")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            timeout=datetime.timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    global DEVICE
    DEVICE = device
    base = CASES_BY_NAME[args.case]
    case = base.__class__(base.name, base.build, base.loss_fn,
                          functools.partial(base.make_batch, B=args.batch))
    per = args.batch // world

    def loss_fn(model, *batch):
        return case.loss_fn(model, *batch)

    def fail_at_commit(i, node):
        if step.final_graph.ann[node.name].role is Role.COMMIT:
            raise RuntimeError(f"injected failure on rank {rank} before the commit")

    def fail_at_first_step(i, node):
        if step.final_graph.ann[node.name].role is Role.OPTIMIZER_STEP:
            raise RuntimeError(f"injected failure on rank {rank} before its first optimizer step")

    def fail(i, node):
        if i == len(step.final_graph.nodes) // 2:
            raise RuntimeError(f"injected failure on rank {rank} at node {node.name}")

    if args.init_empty:
        from models import MODEL_SEED
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(MODEL_SEED)
            with px.init_empty():
                model = case.build()
        model.train()
    else:
        model = case.build_model()
    budget = None

    def compile_step(budget):
        return px.compile(model, optimizer=px.AdamW(**HYPER, state_dtype=args.state_dtype), device_memory=budget,
                          chunk_size=args.chunk_size, precision=args.precision, device=device, debug=True,
                          max_grad_norm=args.clip, accumulate=args.accumulate, fuse=args.fuse,
                          atomic=not args.no_atomic, _undo_updates=args.undo,
                          host_memory=args.host_memory)(loss_fn)

    if args.host_param_homes:
        schedule_mod = importlib.import_module("pstar_fx.passes.schedule")
        schedule_mod.param_homes = lambda g, moves: {c.id: ParamHome.HOST for c in g.chunks}
    if args.budget == "tight" or args.budget.startswith("x"):
        slack = 1.05 if args.budget == "tight" else float(args.budget[1:])
        budget = int(compile_step(None).min_device_memory(*_local(case.batch(0), rank, per)) * slack)
    elif args.budget != "none":
        budget = int(args.budget)
    step = compile_step(budget)
    result: dict = {"losses": [], "grad_norms": [], "skipped": [], "scale": [], "params": [], "budget": budget}
    try:
        for i in range(args.steps):
            if rank == args.fail_rank and i == args.fail_step:
                step._before_node = {"middle": fail, "commit": fail_at_commit,
                                     "first_step": fail_at_first_step}[args.fail_node]
            batch = _local(case.batch(i), rank, per)
            if rank == args.poison_rank and i == args.poison_step:
                batch = (batch[0] * 1e6,) + batch[1:]      # fp16 overflows in this rank's gradients only
            if i == args.fail_before_commit:
                step._before_node = fail_at_commit
                try:
                    step(*batch)
                    raise AssertionError("the injected failure did not happen")
                except RuntimeError as e:
                    result["failed_once"] = str(e)
                step._before_node = None
            loss = step(*batch)
            result["losses"].append(loss.item())
            result["grad_norms"].append(step.last_step.grad_norm)
            result["skipped"].append(step.last_step.skipped)
            result["scale"].append(step._scaler.scale if step._scaler is not None else None)
            if args.poison_rank >= 0:
                result["params"].append({k: v.cpu() for k, v in step.state_dict().items()})
        if args.eval:
            evaluate = px.compile(model, optimizer=None, precision=args.precision, device=device,
                                  debug=True)(loss_fn)
            result["eval_loss"] = evaluate(*_local(case.batch(0), rank, per)).item()
        sd = {k: v.cpu() for k, v in step.state_dict().items()}   # collective: every rank gathers the values
        g = step.final_graph
        result.update(state_dict=sd, stage=g.stage, measured_peak=step.last_step.measured_peak,
                      predicted_peak=g.plan.predicted_peak, gathered=g.plan.gathered_bytes,
                      reduced=g.plan.reduced_bytes, states_on_device=step.summary().states_on_device,
                      h2d=(step.last_step.h2d_bytes, g.plan.h2d_bytes), d2h=(step.last_step.d2h_bytes, g.plan.d2h_bytes),
                      chunks=len(g.chunks), optimizer=step.optimizer.state_dict(),
                      early_steps=_early_steps(g), undo_chunks=sum(c.undo for c in g.chunks),
                      master_homes=sum(c.param_home is ParamHome.MASTER for c in g.chunks),
                      cast_gathers=sum(1 for n in g.nodes if n.target is ops.all_gather
                                       and g.chunks[g.ann[n.name].chunk].param_home is ParamHome.MASTER))
    except Exception as e:  # noqa: BLE001 - recorded for the test
        result["error"] = (type(e).__name__, str(e), traceback.format_exc())
    torch.save(result, f"{args.out}.rank{rank}")
    if "error" in result and rank == args.fail_rank:
        sys.exit(3)       # as a failing training script would; the others must not hang
    dist.destroy_process_group()


def _early_steps(g) -> int:
    """How many optimizer steps come before the commit (atomic=False: host-side steps during backward)."""
    roles = [g.ann[n.name].role for n in g.nodes]
    commit = roles.index(Role.COMMIT) if Role.COMMIT in roles else len(roles)
    return sum(r is Role.OPTIMIZER_STEP for r in roles[:commit])


def _local(batch, rank: int, per: int):
    return tuple(t[rank * per:(rank + 1) * per].to(DEVICE) for t in batch)


DEVICE = "cpu"


if __name__ == "__main__":
    main()
