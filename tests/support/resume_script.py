"""Runs for tests/integration/test_checkpoint.py, in a process of their own (a resumed run must not share anything
with the run that saved it but the checkpoint directory).

    python tests/support/resume_script.py SPEC.json OUT.pt

SPEC.json is a list of runs; each is a dict with
  name        key of the run's result in OUT.pt
  mode        "full": steps [0, steps) from the seeded start; "save": the same, with step.save(ckpt) after step k;
              "resume": step.load(ckpt) into a freshly built model and step, then steps [k, steps)
  precision   "fp32" / "bf16" / "fp16"
  budget      null (unlimited), bytes, or "tight" (5% above the least this step runs in)
  chunk_size  elements per chunk
  dropout     dropout probability of the GPT (> 0: the RNG state matters)
  overflow_at a step whose loss is multiplied by 1e4 (fp16: its gradients overflow, the step is skipped and the loss
              scale halves), or null
  k, steps, ckpt
OUT.pt maps each name to {"losses", "state" (step.state_dict()), "optimizer" (step.optimizer.state_dict()),
"loss_scale", "budget" (bytes or None)}.
"""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pstar_fx as px  # noqa: E402
from models import GPT, _gpt_batch, gpt_loss  # noqa: E402

SEED = 1234


def loss_fn(model, idx, targets, weight):
    return gpt_loss(model, idx, targets) * weight


def batch(run: dict, i: int):
    gen = torch.Generator().manual_seed(5000 + i)
    idx, targets = _gpt_batch(i, gen, vocab=64, B=4, T=16)
    weight = torch.tensor(1e4 if i == run.get("overflow_at") else 1.0)
    return idx, targets, weight


def build(run: dict):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = GPT(vocab=64, block_size=16, n_layer=1, n_head=2, n_embd=32, dropout=run["dropout"]).train()
    kw = dict(optimizer=px.AdamW(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1),
              precision=run["precision"], chunk_size=run["chunk_size"], device="cpu")
    budget = run["budget"]
    if budget == "tight":
        probe = px.compile(model, **kw)(loss_fn)
        budget = int(probe.min_device_memory(*batch(run, 0)) * 1.05)
    return px.compile(model, device_memory=budget, **kw)(loss_fn), budget


def main(spec_path: str, out_path: str) -> None:
    with open(spec_path) as f:
        runs = json.load(f)
    out = {}
    for run in runs:
        step, budget = build(run)
        if run["mode"] == "resume":
            step.load(run["ckpt"])
            first = run["k"]
        else:
            torch.manual_seed(SEED)
            first = 0
        losses = []
        for i in range(first, run["steps"]):
            if run["mode"] == "save" and i == run["k"]:
                step.save(run["ckpt"])
            losses.append(step(*batch(run, i)).item())
        out[run["name"]] = {"losses": losses, "state": step.state_dict(), "optimizer": step.optimizer.state_dict(),
                            "loss_scale": step.loss_scale, "budget": budget}
    torch.save(out, out_path)


if __name__ == "__main__":
    main(*sys.argv[1:])
