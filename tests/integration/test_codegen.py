"""The generated step function (runtime/codegen.py): after a first step that the interpreter measured against the
plan, later steps run a straight-line Python function of the graph. It computes exactly what the interpreter does
(bit for bit, every case, under budgets that evict chunks every step), equal to eager PyTorch; it frees values where
the plan does (the pool's count after each step is the interpreter's); a failing op names its node and source line
as the interpreter does and rolls the step back; a traceback shows the generated line; `debug=True` keeps every
step on the interpreter.
"""
import sys
import traceback

import pytest
import torch

import pstar_fx as px

from harness import DEVICE, HYPER, eager_run, host_params, rel_err, tight_budget
from models import CASES, CASES_BY_NAME, assert_state_close

STEPS = 4


def _step(case, budget, debug):
    return px.compile(case.build_model(), optimizer=px.AdamW(**HYPER), device_memory=budget, chunk_size=1024,
                      device=DEVICE, debug=debug)(case.loss_fn)


def _executor(step):
    return step._compiler.latest.executor


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_generated_steps_equal_interpreted_ones_and_eager(case):
    budget = tight_budget(case, 1024)
    generated, interpreted = _step(case, budget, debug=False), _step(case, budget, debug=True)
    got, want = [], []
    pool_after = []
    for i in range(STEPS):
        got.append(generated(*case.batch(i)).item())
        want.append(interpreted(*case.batch(i)).item())
        pool_after.append((generated._compiler.store.pool.in_use, interpreted._compiler.store.pool.in_use))
    assert callable(_executor(generated)._generated)           # steps 2.. ran the generated function
    assert not _executor(interpreted)._generated               # debug=True: never made, never used
    assert got == want
    for k, v in interpreted.state_dict().items():
        assert torch.equal(generated.state_dict()[k], v), k
    assert all(a == b for a, b in pool_after), pool_after
    # the measured run's peak is the plan's, and what every later step reports
    g = generated.graphs["scheduled"]
    assert generated.last_step.measured_peak == g.plan.predicted_peak <= budget
    ref_losses, ref_sd = eager_run(case, STEPS, host_params=host_params(generated))
    assert rel_err(got, ref_losses) <= 1e-6, (got, ref_losses)
    assert_state_close(generated.state_dict(), ref_sd, rtol=1e-6)


def _out_of_range(case, i):
    idx, targets = case.batch(i)
    idx = idx.clone()
    idx[0, 3] = 10_000          # past the vocabulary: the embedding's lookup fails inside the step
    return idx, targets


@pytest.mark.parametrize("debug", [False, True], ids=["generated", "interpreted"])
def test_a_failing_op_names_its_node_and_rolls_the_step_back(debug):
    case = CASES_BY_NAME["gpt_tied"]
    budget = tight_budget(case, 1024)
    step, ref = _step(case, budget, debug), _step(case, budget, debug=True)
    for i in range(2):
        step(*case.batch(i))
        ref(*case.batch(i))
    before = {k: v.clone() for k, v in step.state_dict().items()}
    with pytest.raises(RuntimeError) as info:
        step(*_out_of_range(case, 2))
    message = str(info.value)
    assert message.startswith("pstar-fx: aten.embedding.default failed at node embedding"), message
    assert "gpt.py" in message and "self.wte(idx)" in message    # the model's source line
    assert info.value.__cause__ is not None
    if not debug:
        text = "".join(traceback.format_exception(info.value.__cause__))
        assert "<generated step" in text and "= f" in text, text   # the generated line, shown
    for k, v in before.items():
        assert torch.equal(step.state_dict()[k], v), k          # rolled back
    assert step(*case.batch(2)).item() == ref(*case.batch(2)).item()
    for k, v in ref.state_dict().items():
        assert torch.equal(step.state_dict()[k], v), k


def test_values_are_freed_after_the_same_nodes_as_the_interpreters():
    """At every node the generated function holds exactly the values the interpreter's list holds (read from the
    running frame's locals by a before_node hook, which both call)."""
    case = CASES_BY_NAME["hf_llama"]
    budget = tight_budget(case, 1024)
    live: dict[str, list[frozenset[int]]] = {"generated": [], "interpreted": []}

    def held(i, node):
        frame = sys._getframe(1)
        while "env" not in frame.f_locals and "<generated step" not in frame.f_code.co_filename:
            frame = frame.f_back
        if "env" in frame.f_locals:        # the interpreter: a list of values by node position
            live["interpreted"].append(frozenset(j for j, v in enumerate(frame.f_locals["env"]) if v is not None))
        else:                              # the generated function: a local v<position> per value
            live["generated"].append(frozenset(int(k[1:]) for k, v in frame.f_locals.items()
                                               if k[0] == "v" and k[1:].isdigit() and v is not None))

    step = _step(case, budget, debug=False)
    step(*case.batch(0))
    step._before_node = held
    step(*case.batch(1))                   # the generated function
    assert callable(_executor(step)._generated) and live["generated"] and not live["interpreted"]
    _executor(step)._generated, generated = None, _executor(step)._generated
    step(*case.batch(2))                   # the interpreter (no generated function: it measures, then makes one)
    assert len(live["interpreted"]) == len(live["generated"]) == len(step.final_graph.nodes)
    assert live["generated"] == live["interpreted"]
    assert generated is not _executor(step)._generated
