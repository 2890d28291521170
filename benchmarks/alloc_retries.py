"""Where in a step torch's caching allocator retries: the node at which each retry happened, what it allocates, and
what the device pool and torch's allocator held then (a retry frees torch's whole cache, which waits for the device).

    python benchmarks/alloc_retries.py --layers 54 --hidden 5120 --heads 40 --batch 8 --no-atomic

The model and step are benchmarks/gpt.py's pstar-fx run (bench_models' GPT under px.init_empty, px.AdamW, bf16, the
default budget unless --budget). After --warmup steps, each of --steps steps runs with a hook before every node that
reads the allocator's retry count (the hook's reads slow the step: its time is not a measurement). Prints each step's
retries, then the retries grouped by the node's role, op and the bytes of its output, then the first --show events.
"""
from __future__ import annotations

import argparse
import collections
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_models as models  # noqa: E402
import pstar_fx as px  # noqa: E402
from pstar_fx.ir import ops  # noqa: E402
from pstar_fx.ir.needs import BufKey  # noqa: E402
from pstar_fx.models.gpt import GPTConfig  # noqa: E402

MiB = 2 ** 20


def asked_bytes(node, store) -> int:
    """What a node allocates: a fetch's (or alloc's) slot, else its outputs' bytes."""
    if node.target in (ops.fetch, ops.alloc):
        numel, dtype = store.slot_spec(BufKey(node.kwargs["chunk"], node.kwargs["buf"]))
        return numel * dtype.itemsize
    val = node.meta.get("val")
    vals = val if isinstance(val, (list, tuple)) else [val]
    return sum(v.numel() * v.element_size() for v in vals if isinstance(v, torch.Tensor))


def op_name(node) -> str:
    return str(node.target) if "OpOverload" in type(node.target).__name__ else getattr(node.target, "__name__",
                                                                                    str(node.target))


def retry_count(device: torch.device) -> int:
    """The allocator's retries so far in this process (0 on the CPU, where --device cpu is a smoke run)."""
    return torch.cuda.memory_stats(device).get("num_alloc_retries", 0) if device.type == "cuda" else 0


def held(device: torch.device) -> tuple[int, int]:
    """torch's allocator's allocated and reserved bytes (0, 0 on the CPU)."""
    if device.type != "cuda":
        return 0, 0
    return torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt", choices=[k.value for k in models.Kind])
    ap.add_argument("--layers", type=int, default=54)
    ap.add_argument("--hidden", type=int, default=5120)
    ap.add_argument("--heads", type=int, default=40)
    ap.add_argument("--intermediate", type=int, default=0)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--budget", default=None, help="device_memory (default: None, px.compile's default)")
    ap.add_argument("--no-atomic", action="store_true")
    ap.add_argument("--fuse", choices=["auto", "on", "off"], default="auto")
    ap.add_argument("--device-updates", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--show", type=int, default=40)
    ap.add_argument("--device", default="cuda", help="cuda (default), or cpu: a smoke run, no retries to count")
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    torch.backends.cuda.matmul.allow_tf32 = True
    spec = models.ModelSpec(models.Kind(args.model), GPTConfig(vocab=args.vocab, seq=args.seq, layers=args.layers,
                                                               hidden=args.hidden, heads=args.heads), args.intermediate)
    g = torch.Generator().manual_seed(1)
    batch = tuple(torch.randint(0, args.vocab, (args.batch, args.seq), generator=g).to(device) for _ in range(2))
    torch.manual_seed(0)
    with px.init_empty(device=device):
        model = models.make(spec)
    opt = px.AdamW(lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
    extra = {} if args.device_updates is None else dict(device_updates=args.device_updates)
    step = px.compile(model, optimizer=opt, device_memory=args.budget, precision="bf16", device=device,
                      atomic=not args.no_atomic, fuse={"auto": None, "on": True, "off": False}[args.fuse],
                      **extra)(models.loss)
    for i in range(args.warmup):
        loss = step(*batch)
        print(f"warm-up step {i}: loss {loss.item():.4f}, {step.last_step.alloc_retries} retries, "
              f"{step.last_step.seconds:.3f} s", flush=True)
    print(step.summary(), flush=True)
    graph = step.final_graph
    store = step._compiler.store
    pool = store.pool
    events = []                 # (step, node index, node, retries, pool in_use, pool cached, allocated, reserved)
    state = dict(last=None, prev=None)

    def hook(i, node):
        retries = retry_count(device)
        if state["last"] is not None and retries > state["last"] and state["prev"] is not None:
            j, prev = state["prev"]
            events.append((k, j, prev, retries - state["last"], pool.in_use, pool.cached, *held(device)))
        state["last"], state["prev"] = retries, (i, node)

    step._before_node = hook
    per_step = []
    for k in range(args.steps):
        before = len(events)
        state["last"] = state["prev"] = None
        loss = step(*batch)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        per_step.append((step.last_step.alloc_retries, sum(e[3] for e in events[before:])))
        print(f"hooked step {k}: loss {loss.item():.4f}, {per_step[-1][0]} retries in the step "
              f"({per_step[-1][1]} attributed to nodes)", flush=True)
    step._before_node = None
    n_nodes = len(graph.nodes)
    groups = collections.Counter()
    for _, j, node, d, *_ in events:
        role = graph.ann[node.name].role.name if node.name in graph.ann else "?"
        groups[(role, op_name(node), asked_bytes(node, store) // MiB)] += d
    print(f"\nretries by the role, op and bytes asked (MiB: a fetch's slot, else the outputs) of the node that ran "
          f"when they happened ({n_nodes} nodes):")
    for (role, op, mib), d in groups.most_common():
        print(f"  {d:4d}  {role:14s} {op:48s} {mib:6d} MiB")
    print(f"\nthe first {args.show} events: step, node index, node, op, MiB asked, retries, pool in use / cached, "
          "torch allocated / reserved (GiB)")
    for k, j, node, d, used, cached, alloc, res in events[:args.show]:
        asked = asked_bytes(node, store) // MiB
        print(f"  {k} {j:6d}/{n_nodes} {node.name[:40]:40s} {op_name(node)[:36]:36s} {asked:6d} "
              f"{d:2d}  {used / 2**30:7.2f} / {cached / 2**30:6.2f}  {alloc / 2**30:7.2f} / {res / 2**30:7.2f}")


if __name__ == "__main__":
    main()
