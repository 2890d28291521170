"""
Fine-tune a transformers Llama with peft's LoRA through pstar-fx: the frozen base weights sit in pstar-fx's chunks
(no gradients, no optimizer states for them), only the adapters' parameters train, and the adapter is saved in peft's
format at the end.

Run from the repository root:

    python examples/finetune_lora.py                                # a tiny Llama on tiny_corpus.txt's bytes, CPU
    python examples/finetune_lora.py --model NAME --device cuda --device-memory 20GiB --seq-len 512

pstar-fx trains exactly the parameters with requires_grad=True when the step is first compiled (peft's
get_peft_model freezes the rest): px.AdamW without params= takes those, and the base weights are never updated. The
default run (2 layers, hidden 64, rank-8 adapters on q_proj and v_proj) takes seconds on 2 CPU cores; the base model
is random there, so the few adapter weights learn only a little of the corpus's byte statistics: the loss falls from
~5.6 to ~5.2. With --model it fine-tunes `AutoModelForCausalLM.from_pretrained(NAME)` on the corpus tokenized by its
tokenizer.
"""

import argparse
import os
import sys

import torch

# let the example run from a source checkout without installing pstar-fx
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from peft import LoraConfig, get_peft_model  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig  # noqa: E402

import pstar_fx as px  # noqa: E402

CORPUS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "tiny_corpus.txt")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[1].strip(),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a Hugging Face model name or path (default: a tiny Llama)")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank")
    parser.add_argument("--device-memory", default=None, help="pstar-fx's device budget, e.g. 20GiB")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--out", default="out/lora")
    args = parser.parse_args()

    text = open(CORPUS, encoding="utf-8").read()
    torch.manual_seed(0)
    if args.model is None:
        base = AutoModelForCausalLM.from_config(LlamaConfig(
            vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=args.seq_len))
        ids = torch.tensor(list(text.encode("utf-8")), dtype=torch.long)
    else:
        base = AutoModelForCausalLM.from_pretrained(args.model)
        ids = AutoTokenizer.from_pretrained(args.model)(text, return_tensors="pt")["input_ids"][0]
    model = get_peft_model(base, LoraConfig(r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.0,
                                            target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print(f"trainable parameters: {trainable:,} of {sum(p.numel() for p in model.parameters()):,}")

    @px.compile(model, optimizer=px.AdamW(lr=args.lr, weight_decay=0.0), device=args.device,
                device_memory=args.device_memory)
    def step(model, input_ids):
        return model(input_ids=input_ids, labels=input_ids).loss       # the model shifts the labels

    g = torch.Generator().manual_seed(0)
    for i in range(args.steps):
        starts = torch.randint(len(ids) - args.seq_len, (args.batch_size,), generator=g)
        batch = torch.stack([ids[s:s + args.seq_len] for s in starts]).to(args.device)     # (B, T)
        loss = step(batch)
        if i % args.log_every == 0 or i == args.steps - 1:
            print(f"step {i:4d} | loss {loss.item():.4f}")

    model = step.sync_model()                  # the trained adapters back in the model
    changed = [n for n, p in model.named_parameters() if n in frozen and not torch.equal(p.detach(), frozen[n])]
    assert not changed, f"frozen base weights changed: {changed}"
    print(f"base weights unchanged: {len(frozen)} frozen tensors")
    model.save_pretrained(args.out)            # peft's adapter_config.json + adapter_model.safetensors
    print(f"saved the adapter to {args.out}")


if __name__ == "__main__":
    main()
