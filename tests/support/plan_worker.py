"""One rank of tests/integration/test_plan.py's gloo run: compile a test case, run two steps on this rank's slice of
the global batch, and write what the compiled step planned and measured (plan figures, measured peak, host bytes its
ChunkStore holds) to --out.rank<r>, so the test can compare them with `px.plan` made without any process group."""
from __future__ import annotations

import argparse
import datetime
import functools
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))

import pstar_fx as px  # noqa: E402
from harness import HYPER  # noqa: E402
from models import CASES_BY_NAME  # noqa: E402
from pstar_fx.ir import StateHome  # noqa: E402


def store_host_bytes(store) -> int:
    """Bytes of every host buffer a ChunkStore holds: parameter and gradient homes, optimizer states on the host, and
    (mixed precision) frozen parameters at full precision."""
    ts = (list(store.host_param) + [t for t in store.host_grad if t is not None]
          + [t for t in store.host_grad_full if t is not None]
          + [s for s, h in zip(store.states, store.state_home) if s is not None and h is StateHome.HOST]
          + list(store.values.frozen_full.values()))
    return sum(t.numel() * t.element_size() for t in ts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", required=True)
    ap.add_argument("--batch", type=int, required=True, help="global batch (split evenly over the ranks)")
    ap.add_argument("--budget", default="none", help="none, tight, or bytes")
    ap.add_argument("--chunk-size", type=int, required=True)
    ap.add_argument("--clip", type=float, default=None)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    base = CASES_BY_NAME[args.case]
    case = base.__class__(base.name, base.build, base.loss_fn, functools.partial(base.make_batch, B=args.batch))
    per = args.batch // world

    def local(i):
        return tuple(t[rank * per:(rank + 1) * per] for t in case.batch(i))

    def compile_step(budget):
        return px.compile(case.build_model(), optimizer=px.AdamW(**HYPER), device_memory=budget, device="cpu",
                          precision="fp32", chunk_size=args.chunk_size, max_grad_norm=args.clip, debug=True)(
            case.loss_fn)

    budget = None
    if args.budget == "tight":
        budget = int(compile_step(None).min_device_memory(*local(0)) * 1.05)
    elif args.budget != "none":
        budget = int(args.budget)
    step = compile_step(budget)
    for i in range(2):
        step(*local(i))
    p = step.final_graph.plan
    result = dict(budget=budget, stage=step.final_graph.stage, predicted_peak=p.predicted_peak,
                  measured_peak=step.last_step.measured_peak, h2d=p.h2d_bytes, d2h=p.d2h_bytes,
                  gathered=p.gathered_bytes, reduced=p.reduced_bytes, host_bytes=store_host_bytes(step._compiler.store),
                  chunks=len(step.final_graph.chunks), states_on_device=step.summary().states_on_device)
    torch.save(result, f"{args.out}.rank{rank}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
