"""
Train a transformers Llama with the Hugging Face Trainer, each optimizer step run by pstar-fx
(pstar_fx.integrations.hf.PstarTrainer): the Trainer's warm-up + cosine schedule, weight decay off for biases and
norms, clipping, gradient accumulation, evaluation and checkpoints, with the model's parameters, gradients and AdamW
states in pstar-fx's chunks under a device-memory budget.

Run from the repository root:

    python examples/hf_trainer.py                                  # a tiny Llama on tiny_corpus.txt's bytes, CPU
    python examples/hf_trainer.py --resume                          # continue from the last checkpoint in --out
    python examples/hf_trainer.py --model NAME --device-memory 40GiB --bf16 --seq-len 1024   # a real model, GPU
    torchrun --nproc_per_node 2 examples/hf_trainer.py             # two ranks (gloo on the CPU; one GPU each)

The default model (2 layers, hidden 64, a byte-level vocabulary of 256) trains 40 steps in seconds on 2 CPU cores;
the loss falls from ~5.5 (uniform over 256 bytes) towards ~3. With --model, the model and tokenizer are
`AutoModelForCausalLM.from_pretrained(NAME)` / `AutoTokenizer`, and the corpus is tokenized with them. The trained
model is written in Hugging Face format to OUT/final (`from_pretrained` loads it).
"""

import argparse
import os
import sys

import torch

# let the example run from a source checkout without installing pstar-fx
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, TrainingArguments  # noqa: E402

from pstar_fx.integrations.hf import PstarTrainer  # noqa: E402

CORPUS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "tiny_corpus.txt")


class Blocks(torch.utils.data.Dataset):
    """Consecutive blocks of seq_len tokens (labels = inputs: the model shifts them), all of one length, so the
    micro-batches of an accumulation group stack into one batch."""

    def __init__(self, ids: torch.Tensor, seq_len: int):
        n = len(ids) // seq_len
        self.blocks = ids[:n * seq_len].view(n, seq_len)        # (N, T)

    def __len__(self):
        return len(self.blocks)

    def __getitem__(self, i):
        return {"input_ids": self.blocks[i], "labels": self.blocks[i]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[1].strip(),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a Hugging Face model name or path (default: a tiny Llama)")
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps")
    parser.add_argument("--batch-size", type=int, default=4, help="sequences per micro-batch")
    parser.add_argument("--accumulate", type=int, default=2, help="gradient_accumulation_steps")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--device-memory", default=None, help="pstar-fx's device budget, e.g. 40GiB")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--bf16", action="store_true", help="pstar-fx's bf16 step (fp32 master weights)")
    parser.add_argument("--out", default="out/hf_trainer")
    parser.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --out")
    args = parser.parse_args()

    text = open(CORPUS, encoding="utf-8").read()
    if args.model is None:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(LlamaConfig(
            vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=args.seq_len))
        ids = torch.tensor(list(text.encode("utf-8")), dtype=torch.long)
    else:
        model = AutoModelForCausalLM.from_pretrained(args.model)       # weights on the CPU: pstar-fx moves chunks
        ids = AutoTokenizer.from_pretrained(args.model)(text, return_tensors="pt")["input_ids"][0]
    data = Blocks(ids, args.seq_len)
    n_eval = 8 * args.batch_size                                  # 8 evaluation batches
    train, evaluation = torch.utils.data.random_split(data, [len(data) - n_eval, n_eval],
                                                      generator=torch.Generator().manual_seed(0))

    training = TrainingArguments(
        output_dir=args.out, max_steps=args.steps, per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size, gradient_accumulation_steps=args.accumulate,
        learning_rate=args.lr, lr_scheduler_type="cosine", warmup_steps=max(args.steps // 10, 1), weight_decay=0.1,
        max_grad_norm=1.0, logging_steps=max(args.steps // 8, 1), eval_strategy="steps",
        eval_steps=max(args.steps // 2, 1), save_strategy="steps", save_steps=max(args.steps // 2, 1),
        save_total_limit=2, bf16=args.bf16, use_cpu=args.device == "cpu", dataloader_drop_last=True,
        report_to=[], disable_tqdm=True, seed=0)
    trainer = PstarTrainer(model=model, args=training, train_dataset=train, eval_dataset=evaluation,
                           device_memory=args.device_memory)
    trainer.train(resume_from_checkpoint=True if args.resume else None)

    final = os.path.join(args.out, "final")
    trainer.save_model(final)                  # Hugging Face format (safetensors): from_pretrained(final) loads it
    if trainer.is_world_process_zero():        # (with several ranks: every rank saves with the others, one prints)
        print(trainer.step.summary())
        print(f"saved the trained model to {final}")


if __name__ == "__main__":
    main()
