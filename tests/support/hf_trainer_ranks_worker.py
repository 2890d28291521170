"""One rank of tests/distributed/test_hf_trainer_ranks.py, launched as torchrun would (tests/support/ranks.py): a
plain transformers Trainer (DistributedDataParallel over gloo) and PstarTrainers on the same tiny GPT-2, data and
arguments, in this order in one process:

  plain     the plain Trainer: the reference
  pstar     PstarTrainer, saving checkpoint-3 (the Trainer's files and the step's sharded checkpoint) and, after
            train(), evaluate() and save_model()
  resumed   a new PstarTrainer on a new model, resume_from_checkpoint=<pstar's checkpoint-3>

    python tests/support/hf_trainer_ranks_worker.py OUT

Each run evaluates every 4 steps. Each rank writes OUT.rank{r}: {name: {"logs": the Trainer's logs, "state": the
model's values after train(), "eval": evaluate()'s metrics (pstar and plain), "compiles": the step's traces
(PstarTrainer)}, "dirs": {name: output_dir}}, or {"error": (type, message, traceback)}.
"""
from __future__ import annotations

import os
import sys
import traceback

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "integration"))

from transformers import Trainer  # noqa: E402

from pstar_fx.integrations.hf import PstarTrainer  # noqa: E402
from test_hf_trainer import Record, Tokens, arguments, tiny_gpt2  # noqa: E402


def run(cls, out: str, resume: str | None = None) -> dict:
    model, record = tiny_gpt2(), Record()
    trainer = cls(model=model, args=arguments(out, ddp_backend="gloo", eval_strategy="steps", eval_steps=4,
                                              save_strategy="steps", save_steps=3, num_train_epochs=2),
                  train_dataset=Tokens(64, seed=1), eval_dataset=Tokens(16, seed=2), callbacks=[record])
    trainer.train(resume_from_checkpoint=resume)
    result = {"logs": record.logs, "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}
    if cls is PstarTrainer:
        result["compiles"] = trainer.step._compiler.compiles
    if resume is None:
        result["eval"] = trainer.evaluate(Tokens(16, seed=2))
        trainer.save_model(os.path.join(out, "final"))
    return result


def main(out: str) -> None:
    rank = int(os.environ.get("RANK", "0"))
    base = os.path.dirname(out)
    dirs = {name: os.path.join(base, name) for name in ("plain", "pstar", "resumed")}
    try:
        result = {"dirs": dirs,
                  "plain": run(Trainer, dirs["plain"]),
                  "pstar": run(PstarTrainer, dirs["pstar"])}
        result["resumed"] = run(PstarTrainer, dirs["resumed"], resume=os.path.join(dirs["pstar"], "checkpoint-3"))
    except Exception as e:  # noqa: BLE001 - recorded for the test
        result = {"error": (type(e).__name__, str(e), traceback.format_exc())}
    torch.save(result, f"{out}.rank{rank}")
    if "error" in result:
        sys.exit(3)


if __name__ == "__main__":
    main(*sys.argv[1:])
