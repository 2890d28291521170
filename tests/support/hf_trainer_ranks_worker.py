"""One rank of tests/distributed/test_hf_trainer_ranks.py, launched as torchrun would (tests/support/ranks.py): a
plain transformers Trainer (DistributedDataParallel over gloo) and PstarTrainers on the same tiny GPT-2, data and
arguments, in this order in one process:

  plain     the plain Trainer: the reference
  pstar     PstarTrainer, saving checkpoint-3 (the Trainer's files and the step's sharded checkpoint) and, after
            train(), evaluate() and save_model()
  resumed   a new PstarTrainer on a new model, resume_from_checkpoint=<pstar's checkpoint-3>
  plain-padded, pstar-padded   each trainer on sequences a collator pads per batch (run_padded)

    python tests/support/hf_trainer_ranks_worker.py OUT [fail]

With `fail`, only a PstarTrainer whose callback raises on rank 0 at its second step (the other rank then fails in
the Trainer's next collective): each rank records its error and exits, none waits for ever.

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

from transformers import Trainer, TrainerCallback  # noqa: E402

from pstar_fx.integrations.hf import PstarTrainer  # noqa: E402
from test_hf_trainer import Record, Tokens, Varied, arguments, pad_batch, tiny_gpt2  # noqa: E402


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


def run_padded(cls, out: str) -> dict:
    """Sequences of 4 to 16 tokens, each batch padded to its own longest by the collator, evaluated every 2 steps:
    the ranks' batches differ in length (PstarTrainer pads them to the longest over the ranks)."""
    model, record = tiny_gpt2(), Record()
    trainer = cls(model=model, args=arguments(out, ddp_backend="gloo", eval_strategy="steps", eval_steps=2,
                                              dataloader_drop_last=True, num_train_epochs=1),
                  train_dataset=Varied(64, seed=1), eval_dataset=Varied(16, seed=2), data_collator=pad_batch,
                  callbacks=[record])
    trainer.train()
    return {"logs": record.logs, "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


class FailOnRank0(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 2 and state.is_world_process_zero:
            raise RuntimeError("a failure on rank 0 alone")


def main(out: str, mode: str = "") -> None:
    rank = int(os.environ.get("RANK", "0"))
    base = os.path.dirname(out)
    dirs = {name: os.path.join(base, name) for name in ("plain", "pstar", "resumed", "plain-padded", "pstar-padded")}
    try:
        if mode == "fail":
            trainer = PstarTrainer(model=tiny_gpt2(), args=arguments(dirs["pstar"], ddp_backend="gloo",
                                                                     eval_strategy="no", save_strategy="no"),
                                   train_dataset=Tokens(64, seed=1), callbacks=[FailOnRank0()])
            trainer.train()
        result = {"dirs": dirs,
                  "plain": run(Trainer, dirs["plain"]),
                  "pstar": run(PstarTrainer, dirs["pstar"])}
        result["resumed"] = run(PstarTrainer, dirs["resumed"], resume=os.path.join(dirs["pstar"], "checkpoint-3"))
        result["plain-padded"] = run_padded(Trainer, dirs["plain-padded"])
        result["pstar-padded"] = run_padded(PstarTrainer, dirs["pstar-padded"])
    except Exception as e:  # noqa: BLE001 - recorded for the test
        result = {"error": (type(e).__name__, str(e), traceback.format_exc())}
    torch.save(result, f"{out}.rank{rank}")
    if "error" in result:
        sys.exit(3)


if __name__ == "__main__":
    main(*sys.argv[1:])
