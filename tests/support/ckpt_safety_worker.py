"""One rank of tests/integration/test_checkpoint_safety.py's two-rank check (launched as torchrun would, gloo on the
CPU):

    python tests/support/ckpt_safety_worker.py DIR OUT

Every rank: save a sharded checkpoint of a step (before its first step: no compile needed) into DIR/c; load it into
a step over a model with other values; then, after rank 0 has flipped one bit of the data file rank 1 wrote, load
it again. Writes OUT.rank{r}: {"files" (the checkpoint's listing), "manifest" (the files it lists), "loaded" (the
first load gave the saved values), "error" ((type, message) of the second load, or None), "unchanged" (the second
load left the step's values as they were)}.
"""
from __future__ import annotations

import datetime
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))

import pstar_fx as px  # noqa: E402
import pstar_fx.checkpoint.files as files  # noqa: E402
from harness import HYPER  # noqa: E402
from models import CASES_BY_NAME  # noqa: E402

CASE = CASES_BY_NAME["gpt_tied"]


def _step(seed: int):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = CASE.build()
    return px.compile(model, optimizer=px.AdamW(**HYPER), chunk_size=2048, device="cpu")(CASE.loss_fn)


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def main(directory: str, out: str) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    path = os.path.join(directory, "c")
    source = _step(1)
    source.save(path, sharded=True)
    result: dict = {"files": sorted(os.listdir(path)),
                    "manifest": sorted(files.read_manifest(path, files.SHARDED_MANIFEST).files)}
    target = _step(2)
    target.load(path)
    result["loaded"] = _equal(target.state_dict(), source.state_dict())
    other = _step(3)
    before = other.state_dict()
    dist.barrier()
    if rank == 0:
        with open(os.path.join(path, "__1_0.distcp"), "r+b") as f:
            f.seek(os.path.getsize(f.name) // 2)
            byte = f.read(1)[0]
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte ^ 0x10]))
    dist.barrier()
    try:
        other.load(path)
        result["error"] = None
    except Exception as e:   # noqa: BLE001 - recorded for the test
        result["error"] = (type(e).__name__, str(e))
    result["unchanged"] = _equal(other.state_dict(), before)
    torch.save(result, f"{out}.rank{rank}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
