"""The plan of transformers' LlamaForCausalLM at a shape, on any machine (the model on the meta device, px.plan):
what pstar-fx-plan answers for the reference GPT, for the Llama shapes benchmarks/gpt.py --model llama runs on a GPU.

    python benchmarks/plan_llama.py                                   # Llama-2-13B's shape, 4 x 2048 tokens, H200
    python benchmarks/plan_llama.py --batch 8
    python benchmarks/plan_llama.py --layers 32 --hidden 4096 --intermediate 14336 --heads 32 --kv-heads 8 \\
        --vocab 128256 --machine h100                                # Llama 3 8B's shape on an H100

Prints px.plan's report (its budget: the machine's GPU less what the process needs beside the plan), its why lines
among them.
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import pstar_fx as px  # noqa: E402


def main(argv=None) -> px.PlanReport:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--hidden", type=int, default=5120)
    ap.add_argument("--intermediate", type=int, default=13824)
    ap.add_argument("--heads", type=int, default=40)
    ap.add_argument("--kv-heads", type=int, default=None, help="default: --heads")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--machine", default="h200", choices=["h200", "h100"])
    ap.add_argument("--device-memory", default=None, help="default: the machine's GPU less what the process needs")
    ap.add_argument("--fuse", action="store_true", help="estimate with fused regions (px.plan's fuse=True)")
    args = ap.parse_args(argv)
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                      num_key_value_heads=args.kv_heads or args.heads, max_position_embeddings=args.seq,
                      tie_word_embeddings=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)

    def loss(m, ids, labels):
        return m(input_ids=ids, labels=labels).loss

    batch = ((args.batch, args.seq), torch.long)
    report = px.plan(model, loss, batch, batch, machine=args.machine, device_memory=args.device_memory,
                     fuse=args.fuse)
    print(report)
    return report


if __name__ == "__main__":
    main()
