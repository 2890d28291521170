"""Batches of varying shapes: each new shape is a signature of its own, compiled once and cached; the 4th distinct
shape warns how to pad or bucket; `cache_size` bounds the cache; `step.reserve(*batch)` compiles a shape up front,
raising BudgetError there when it does not fit, and keeps it compiled.
"""
import functools
import gc
import linecache
import os
import warnings

import pytest
import torch

import pstar_fx as px

from harness import HYPER
from models import GPT, gpt_loss

VOCAB, BLOCK = 64, 32


def _model():
    torch.manual_seed(0)
    return GPT(vocab=VOCAB, block_size=BLOCK, n_layer=1, n_head=2, n_embd=16)


def _batch(T, seed=0, B=2):
    g = torch.Generator().manual_seed(seed * 1000 + T)
    return torch.randint(0, VOCAB, (B, T), generator=g), torch.randint(0, VOCAB, (B, T), generator=g)


def _compile(model, **kw):
    return px.compile(model, optimizer=px.AdamW(**HYPER), device="cpu", **kw)(gpt_loss)


def _shape_warnings(record):
    return [w for w in record if "different batch shapes" in str(w.message)]


def test_each_sequence_length_is_compiled_once_and_trains_as_eager():
    lengths = [8, 12, 8, 16, 12]
    model = _model()
    step = _compile(model)
    ref = _model()
    opt = torch.optim.AdamW(ref.parameters(), **HYPER, fused=True)
    compiled = {}
    for i, T in enumerate(lengths):
        loss = step(*_batch(T, i))
        compiled.setdefault(T, step.graphs["traced"])
        assert step.graphs["traced"] is compiled[T]          # cached: a length seen before is not traced again
        want = gpt_loss(ref, *_batch(T, i))
        want.backward()
        opt.step()
        opt.zero_grad()
        assert loss.item() == want.item()
    assert len(step._compiler.cache) == 3
    for k, v in ref.state_dict().items():
        assert torch.equal(step.state_dict()[k], v), k


def test_the_fourth_batch_shape_warns_once_how_to_pad_or_bucket():
    step = _compile(_model())
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for T in (4, 5, 6, 4, 5):
            step.lower(*_batch(T))
        assert not _shape_warnings(record)
        step.lower(*_batch(7))
        found = _shape_warnings(record)
        assert len(found) == 1
        message = str(found[0].message)
        for what in ("4 different batch shapes", "(2, 4)", "(2, 7)", "bucket", "step.reserve(*batch)",
                     "cache_size=N"):
            assert what in message, what
        for T in (8, 9, 7):
            step.lower(*_batch(T))
        assert len(_shape_warnings(record)) == 1                # once


def test_cache_size_bounds_the_compiled_signatures():
    step = _compile(_model(), cache_size=2)
    first = step.lower(*_batch(4))["traced"]
    step.lower(*_batch(5))
    step.lower(*_batch(6))
    assert len(step._compiler.cache) == 2
    assert step.lower(*_batch(4))["traced"] is not first        # dropped, traced again
    for bad in (0, -1, 2.0, True, "8"):
        with pytest.raises(ValueError, match="cache_size"):
            px.compile(_model(), optimizer=px.AdamW(), device="cpu", cache_size=bad)(gpt_loss)


@functools.cache
def _budgets():
    """A budget that fits the short batch but not the long one, and one that fits both."""
    probe = _compile(_model())
    short, long = probe.min_device_memory(*_batch(8)), probe.min_device_memory(*_batch(BLOCK, B=8))
    assert short < long
    return (short + long) // 2, long


def test_reserve_raises_budget_error_up_front_when_the_largest_batch_does_not_fit():
    tight, _ = _budgets()
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    step = _compile(model, device_memory=tight)
    with pytest.raises(px.BudgetError):
        step.reserve(*_batch(BLOCK, B=8))
    assert not step.holds_model()
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())   # nothing ran
    step(*_batch(8))                                            # a batch that fits still trains


def test_a_reserved_batch_never_compiles_again():
    _, enough = _budgets()
    step = _compile(_model(), device_memory=enough, cache_size=2)
    reserved = step.reserve(*_batch(BLOCK, B=8))["scheduled"]
    assert not step.holds_model()                               # compiled only: no step ran
    for T in (8, 12, 16):                                       # more shapes than the cache keeps
        step(*_batch(T))
        assert step.graphs["scheduled"] is not reserved
    step(*_batch(BLOCK, seed=1, B=8))
    assert step.graphs["scheduled"] is reserved                 # still compiled: no trace, no BudgetError
    step.reserve(*_batch(8))
    with pytest.raises(ValueError, match="cache_size"):         # every kept signature would be reserved
        step.reserve(*_batch(12))
    compiles = step._compiler.compiles
    for _ in range(3):
        step(*_batch(12))                   # every place is reserved: the latest other signature is kept too
    assert step._compiler.compiles == compiles + 1


def _generated_sources():
    gc.collect()
    return sum(name.startswith("<generated step") for name in map(os.path.basename, linecache.cache))


def test_evicted_steps_take_their_generated_source_with_them():
    step = _compile(_model(), cache_size=1)
    before = _generated_sources()
    for T in (8, 12, 16, 8, 12, 16):
        step(*_batch(T))
    assert step._compiler.compiles == 6
    assert _generated_sources() - before <= 1              # the one compiled step the cache keeps
