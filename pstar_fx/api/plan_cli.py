"""Command line: will a GPT train on a cluster, and how fast? (`px.plan` for the reference GPT, pstar_fx.models.gpt)

    pstar-fx-plan --layers 96 --d-model 12288 --heads 96 --seq 2048 --batch 1 --world-size 32 \\
        --gpus-per-node 8 --device-memory 80GB --host-memory 1TB --checkpoint
    pstar-fx-plan --layers 88 --d-model 10240 --heads 80 --batch 8 --checkpoint --machine h200 --gpus-per-node 1 \\
        --host-memory 1.5TB
    pstar-fx-plan --layers 49 --d-model 7168 --heads 56 --batch 8 --gpus-per-node 1 --host-memory 126GiB \\
        --state-dtype int8

Runs on any machine (no GPU, no process group): the model is built on the meta device, the step traced and planned as
each of the --world-size ranks would, and the cost model (pstar_fx/cost.py) estimates the step time on --machine (a
preset: its rates and GPU memory; --host-memory and --gpus-per-node size its nodes, --pcie-gbps, --cpu-adam-gparams,
--no-native-update and --network-gbps replace its rates; --device-memory replaces the budget the GPU's memory
gives); --state-dtype compresses AdamW's moments, --disk-memory adds a disk tier for the states beyond
--host-memory. The GPT is nanoGPT's, the one benchmarks/gpt.py trains: vocab 50304 (--vocab), tied head, learned
positions, biases and LayerNorms, no dropout, loss cross-entropy; --checkpoint wraps every block in
torch.utils.checkpoint. --batch is per GPU. Exit status: 0 when the model fits, 1 when it does not.
`python -m pstar_fx.api.plan_cli` runs it too.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys

import torch

from ..cost import GPU, H200
from ..errors import BudgetError
from ..models.gpt import GPT, GPTConfig, gpt_loss
from ..optim import AdamW
from .plan import PlanReport, plan, resolve_machine


def _count(text: str) -> int:
    """An int >= 1 (argparse's type: a bad one is a usage error, exit status 2)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="pstar-fx-plan", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=_count, required=True)
    ap.add_argument("--d-model", type=_count, required=True)
    ap.add_argument("--heads", type=_count, required=True)
    ap.add_argument("--seq", type=_count, default=2048)
    ap.add_argument("--vocab", type=_count, default=50304)
    ap.add_argument("--batch", type=_count, default=1, help="sequences per GPU per step")
    ap.add_argument("--accumulate", type=_count, default=1, help="micro-batches per step (--batch is split into them)")
    ap.add_argument("--checkpoint", action="store_true", help="activation checkpointing per block")
    ap.add_argument("--world-size", type=_count, default=1)
    ap.add_argument("--machine", default=GPU.H200.value, choices=[g.value for g in GPU],
                    help="the GPU preset: its rates and memory (default: h200)")
    ap.add_argument("--gpus-per-node", type=_count, default=8)
    ap.add_argument("--device-memory", default=None,
                    help="budget per GPU, e.g. 80GB (default: the machine's GPU memory less what the process needs "
                         "beside the plan)")
    ap.add_argument("--host-memory", default=None, help="per node, e.g. 1.5TB (default: not checked)")
    ap.add_argument("--precision", default="bf16", choices=["bf16", "fp16", "fp32"])
    ap.add_argument("--chunk-size", type=_count, default=None, help="elements per chunk (default: chosen)")
    ap.add_argument("--max-grad-norm", type=float, default=None)
    ap.add_argument("--state-dtype", default="fp32", choices=["fp32", "bf16", "int8"],
                    help="AdamW's moments (px.AdamW state_dtype): exact fp32, or compressed to bf16 or int8")
    ap.add_argument("--disk-memory", default=None,
                    help="a disk tier per GPU, e.g. 500GB: the optimizer states that do not fit --host-memory go "
                         "to disk (px.compile's offload_dir); needs --host-memory")
    fusion = ap.add_mutually_exclusive_group()
    fusion.add_argument("--fuse", action="store_true",
                        help="px.compile's fuse=True: the step estimated with its compute between chunk operations "
                             "fused into regions")
    fusion.add_argument("--fuse-if-faster", action="store_true",
                        help="px.compile's default on a GPU (fuse=None): bf16 and fp16 on one GPU fused only where "
                             "the step is estimated no slower so")
    ap.add_argument("--no-atomic", action="store_true",
                    help="px.compile(atomic=False): host-side updates may start during backward")
    ap.add_argument("--network-gbps", type=float, default=None,
                    help="NCCL bus bandwidth across nodes in GB/s (default: the cost model's assumption, "
                         f"{H200.network_bus_bytes / 1e9:.0f})")
    ap.add_argument("--pcie-gbps", type=float, default=None,
                    help="host->device copies in GB/s, one way alone; the other rates scaled alike (default: "
                         f"{H200.h2d_bytes / 1e9:.0f}, measured)")
    ap.add_argument("--cpu-adam-gparams", type=float, default=None,
                    help="the host's fp32 AdamW per GPU in Gparam/s; the mixed-precision rate scaled alike "
                         f"(default: {H200.cpu_adam / 1e9:.1f}, measured with 16 cores per GPU)")
    ap.add_argument("--no-native-update", action="store_true",
                    help="the hosts update exact mixed-precision moments by torch's route, not pstar-fx's native "
                         f"kernel ({H200.native_exact_speedup}x slower; where no C compiler builds it, or "
                         "PSTAR_FX_NATIVE=0)")
    return ap


def main(argv=None) -> PlanReport | None:
    """Prints the plan's report and returns it; None where no plan exists (a disk tier too small: the BudgetError's
    message printed instead)."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.d_model % args.heads:
        parser.error(f"--d-model {args.d_model} is not divisible by --heads {args.heads}")
    cfg = GPTConfig(vocab=args.vocab, seq=args.seq, layers=args.layers, hidden=args.d_model, heads=args.heads)
    with torch.device("meta"):
        model = GPT(cfg, checkpoint=args.checkpoint)
    try:
        machine = resolve_machine(args.machine, args.gpus_per_node, args.host_memory)
        if args.network_gbps is not None:
            machine = dataclasses.replace(machine, network_bus_bytes=args.network_gbps * 1e9)
        if args.pcie_gbps is not None:
            machine = machine.with_pcie(args.pcie_gbps * 1e9)
        if args.cpu_adam_gparams is not None:
            machine = machine.with_cpu_adam(args.cpu_adam_gparams * 1e9)
        if args.no_native_update:
            machine = dataclasses.replace(machine, native_update=False)
    except (ValueError, TypeError) as e:
        parser.error(str(e))
    if args.disk_memory is not None and args.host_memory is None:
        parser.error("--disk-memory plans a disk tier for the optimizer states that do not fit --host-memory: give "
                     "--host-memory too")
    tokens = ((args.batch, args.seq), torch.long)
    optimizer = None if args.state_dtype == "fp32" else AdamW(state_dtype=args.state_dtype)
    try:
        report = plan(model, gpt_loss, tokens, tokens, world_size=args.world_size, device_memory=args.device_memory,
                      precision=args.precision, chunk_size=args.chunk_size, accumulate=args.accumulate,
                      max_grad_norm=args.max_grad_norm, machine=machine, atomic=not args.no_atomic,
                      optimizer=optimizer, disk_memory=args.disk_memory,
                      fuse=None if args.fuse_if_faster else args.fuse)
    except BudgetError as e:                 # the disk tier too small for what host memory leaves it: no plan
        print(f"DOES NOT FIT: {e}", file=sys.stderr)
        return None
    except (ValueError, TypeError) as e:     # an option out of its range (px.compile's checks): a usage error
        parser.error(str(e))
    print(f"GPT {args.layers} layers x d={args.d_model}, {args.heads} heads, seq {args.seq}, vocab {args.vocab}"
          f"{', activation checkpointing' if args.checkpoint else ''}; batch {args.batch} per GPU")
    print(report)
    return report


def run(argv=None) -> int:
    """The console script (`pstar-fx-plan`): exit status 0 when the model fits, 1 when it does not."""
    report = main(argv)
    return 0 if report is not None and report.fits else 1


if __name__ == "__main__":
    sys.exit(run())
