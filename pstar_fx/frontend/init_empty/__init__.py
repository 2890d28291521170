"""`px.init_empty()`: build a model without allocating it; its first compiled step initialises it in its chunks.

    torch.manual_seed(0)
    with px.init_empty():
        model = GPT(cfg)                 # no parameter memory is allocated
    step = px.compile(model, optimizer=px.AdamW(lr=3e-4))(loss_fn)
    step(x, y)                           # first: the initial values are made in the chunks, then the step runs

The values equal, bit for bit, those `torch.manual_seed(0); model = GPT(cfg)` makes on the CPU (the default device),
and at no time does a second copy of the model exist in host memory: each initialisation op writes straight into the
chunk memory that holds the parameter for training.

How: recording.py records the construction (a dispatch mode over meta tensors) and leaves an `EmptyTensor` in each
of the model's parameter and buffer slots; replay.py makes the values in the chunks at the first step (`fill_chunks`)
and tells the ranks of a sharded step what each value is made from (`origin_digests`).

The global RNG: building on meta draws nothing, so after the block the global CPU RNG is where it was when the block
began (or where a `torch.manual_seed` inside the block set it), not advanced as an eager build advances it; the replay
uses its own generator and leaves the global RNG untouched. Code that draws after building the model (dropout, data
order) draws different numbers than after an eager build: seed again after building to make both agree.
"""
from ...errors import EmptyModelError
from .recording import EmptyTensor, init_empty, is_empty
from .replay import fill_chunks, origin_digests

__all__ = ["init_empty", "EmptyModelError", "EmptyTensor", "fill_chunks", "is_empty", "origin_digests"]
