"""Where a first compile's set-up goes (after the trace and passes): px.compile of the GPT of benchmarks/gpt.py built
under px.init_empty, `step.lower` under cProfile, and the cumulative time of the set-up's parts: the ChunkStore
(host buffers taken from the set-up thread, device optimizer states, streams, the CPU worker), the executor, the
optimizer's attach, and the cyclic garbage collections (graph_utils.cycle_collection_paused: one before the store,
one at the end).

    python3 benchmarks/profile_setup.py --layers 54 --d-model 5120 --heads 40 --batch 8 --device-memory 137GiB \\
        --no-atomic

Meant for a machine whose host memory was faulted in before (a second process): the set-up's own work, not the
wait for the host pool (gpt.py's host_waited_s says that one). cProfile slows the trace and passes (pure Python)
more than the set-up (mostly calls into torch and CUDA), so only the set-up's figures are printed.
"""
from __future__ import annotations

import cProfile
import io
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pstar_fx as px  # noqa: E402
from pstar_fx.api.plan_cli import _parser  # noqa: E402
from pstar_fx.models.gpt import GPT, GPTConfig, gpt_loss  # noqa: E402

# (file suffix, function) of the set-up's parts
PARTS = [("runtime/chunk_store.py", "__init__"), ("runtime/host_memory.py", "zeros"),
         ("runtime/host_memory.py", "release_unclaimed"), ("runtime/chunk_store.py", "take"),
         ("runtime/host_updates.py", "__init__"), ("runtime/executor.py", "__init__"), ("optimizer.py", "attach"),
         ("pstar_fx/api.py", "warn_chunk_padding"), ("pstar_fx/api.py", "warn_host_threads"),
         ("~", "<built-in method gc.collect>"), ("~", "<method 'zero_' of 'torch._C.TensorBase' objects>"),
         ("~", "<built-in method torch.empty>"), ("~", "<built-in method torch._C._cuda_synchronize>")]


def main() -> None:
    ap = _parser()
    ap.description = __doc__
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = GPTConfig(vocab=args.vocab, seq=args.seq, layers=args.layers, hidden=args.d_model, heads=args.heads)
    torch.manual_seed(0)
    with px.init_empty(device=dev):
        model = GPT(cfg, checkpoint=args.checkpoint)
    step = px.compile(model, optimizer=px.AdamW(lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1),
                      device_memory=args.device_memory, precision=args.precision, device=dev,
                      chunk_size=args.chunk_size, atomic=not args.no_atomic)(gpt_loss)
    tokens = torch.randint(0, cfg.vocab, (args.batch, cfg.seq), device=dev)
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    step.lower(tokens, tokens)
    prof.disable()
    wall = time.perf_counter() - t0
    trace_s, passes_s, setup_s = step.summary().compile_seconds
    hm = step._compiler.store.hostmem
    print(f"compile {wall:.2f} s under cProfile: trace {trace_s:.2f}, passes {passes_s:.2f}, set-up {setup_s:.2f} "
          f"(waited for host buffers {hm.waited:.2f} s)", flush=True)
    stats = pstats.Stats(prof)
    for (file, line, name), (cc, nc, tt, ct, callers) in sorted(stats.stats.items()):
        for suffix, fn in PARTS:
            if name == fn and (file.endswith(suffix) or suffix == "~" == file):
                print(f"  {ct:7.3f} s cumulative, {tt:7.3f} s own, {nc:6d} calls: {os.path.basename(file)}:{line} "
                      f"{name}", flush=True)
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_callees("chunk_store.py.*__init__")
    print(text.getvalue()[-6000:], flush=True)


if __name__ == "__main__":
    main()
