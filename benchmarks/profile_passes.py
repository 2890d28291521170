"""Where planning a GPT's step goes, pass by pass: trace once, then run each pass of the pipeline in turn, timing it,
under cProfile for the passes named in --profile. Runs on any machine (the model on the meta device, as
`pstar-fx-plan`, whose flags it takes: --fuse or --fuse-if-faster add the fused stage), with the cyclic garbage
collector paused as px.compile pauses it.

    python3 benchmarks/profile_passes.py --layers 54 --d-model 5120 --heads 40 --batch 8 --checkpoint \\
        --device-memory 137GiB --no-atomic --profile assign_chunks,schedule
"""
from __future__ import annotations

import cProfile
import gc
import io
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pstar_fx.api import plan as planning  # noqa: E402
from pstar_fx.ir import Precision, Settings  # noqa: E402
from pstar_fx.passes import pipeline, verify  # noqa: E402
from pstar_fx.api.plan_cli import _parser  # noqa: E402
from pstar_fx.models.gpt import GPT, GPTConfig, gpt_loss  # noqa: E402
from pstar_fx.frontend.trace import trace_step  # noqa: E402
from pstar_fx.units import parse_bytes  # noqa: E402


def main() -> None:
    ap = _parser()             # the GPT and plan flags of `pstar-fx-plan`
    ap.description = __doc__
    ap.add_argument("--profile", default="", help="comma-separated pass names (and trace) to run under cProfile")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    cfg = GPTConfig(vocab=args.vocab, seq=args.seq, layers=args.layers, hidden=args.d_model, heads=args.heads)
    with torch.device("meta"):
        model = GPT(cfg, checkpoint=args.checkpoint)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    settings = Settings(precision=Precision(args.precision), device=dev,
                        budget=None if args.device_memory is None else parse_bytes(args.device_memory),
                        chunk_size=args.chunk_size, optimizer=planning._layout(model, None),
                        max_grad_norm=args.max_grad_norm, accumulate=args.accumulate, world=args.world_size,
                        atomic=not args.no_atomic)
    tokens = torch.empty(args.batch, args.seq, dtype=torch.long, device="meta")
    wanted = {p for p in args.profile.split(",") if p}
    gc.disable()

    def timed(name, fn, *a):
        prof = cProfile.Profile() if name in wanted else None
        t0 = time.perf_counter()
        if prof is not None:
            prof.enable()
        out = fn(*a)
        if prof is not None:
            prof.disable()
        seconds = time.perf_counter() - t0
        if name == "trace":
            print(f"trace: {seconds:.2f} s, {len(out.nodes)} nodes (traced for {dev.type})", flush=True)
        else:
            t0 = time.perf_counter()
            verify(out)
            print(f"{name}: {seconds:.2f} s (verify {time.perf_counter() - t0:.2f} s), {len(out.nodes)} nodes",
                  flush=True)
        if prof is not None:
            for order in ("tottime", "cumulative"):
                text = io.StringIO()
                pstats.Stats(prof, stream=text).sort_stats(order).print_stats(args.top)
                print(f"--- {name} by {order}\n" + text.getvalue().split("\n\n", 1)[-1], flush=True)
        return out

    g = timed("trace", trace_step, gpt_loss, model, (tokens, tokens), settings)
    # the fused stage last, as px.compile runs it (--fuse-if-faster: fuse=None, the default on a GPU)
    for p in pipeline(chunk_size=args.chunk_size, world=args.world_size, fuse=args.fuse or args.fuse_if_faster,
                      fuse_auto=args.fuse_if_faster):
        g = timed(getattr(p, "func", p).__name__, p, g)


if __name__ == "__main__":
    main()
