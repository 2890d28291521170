"""Shared test helpers: run a case compiled and eagerly on the same batches, and pick budgets that force eviction."""
from __future__ import annotations

import dataclasses
import functools
import os

import torch

import pstar_fx as px
from pstar_fx.api import options
from pstar_fx.ir import Role, ops

from models import Case, assert_state_close

# PSTAR_TEST_DEVICE=cuda runs the compiled steps and their eager references on the GPU (see BENCHMARKS.md).
DEVICE = os.environ.get("PSTAR_TEST_DEVICE", "cpu")
HYPER = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def small_batches(case: Case) -> Case:
    """The same case with a smaller batch, so that model data, not activations, dominates device memory."""
    kw = {"hf_gpt2": dict(B=1, T=8), "hf_llama": dict(B=1, T=8), "gpt_tied": dict(B=1, T=8),
          "cnn_bn": dict(B=2, H=4, W=4)}.get(case.name, dict(B=2))
    return dataclasses.replace(case, make_batch=functools.partial(case.make_batch, **kw))


def eager_run(case: Case, steps: int, *, fused: bool | None = None, hyper=HYPER, host_params=()):
    """torch.optim.AdamW on the eager model. fused=None (pstar-fx's default, torch's fused kernel) compares with
    torch's fused AdamW; fused=False with the single-tensor implementation.

    host_params: parameters whose AdamW update runs on the CPU, on fp32 copies, as pstar-fx does for chunks whose
    optimizer states it placed on the host (ZeRO-Offload style); or a list with one such collection per step, when
    the placement changes between steps (a retrace with another plan). On a GPU this matters: torch's CPU and CUDA
    AdamW kernels round differently in the last bit, and Adam turns last-bit differences on near-zero gradients (a
    transformer's key bias) into visible ones. On the CPU both are the same kernel."""
    per_step = isinstance(host_params, list) and all(isinstance(h, (set, frozenset)) for h in host_params)
    model = case.build_model().to(DEVICE)
    kw = dict(fused=True) if fused is None else dict(foreach=False)
    opt = EagerAdamW(model, host_params[0] if per_step else host_params, **hyper, **kw)
    losses = []
    for i in range(steps):
        if per_step:
            opt.place(host_params[i])
        loss = case.loss_fn(model, *[x.to(DEVICE) for x in case.batch(i)])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


class EagerAdamW:
    """torch.optim.AdamW over a model, with the parameters named in host_params updated on the CPU on fp32 copies,
    as pstar-fx does for chunks whose optimizer states live on the host (see eager_run). step() also zeroes the
    gradients; place() moves parameters (with their optimizer states) between the two."""

    def __init__(self, model, host_params=(), **options):
        self.params = dict(model.named_parameters())
        self.options = options
        self.host = None
        self.opts, self.on_device, self.offloaded = [], [], []
        self.place(host_params)

    def place(self, host_params) -> None:
        host = frozenset(host_params)
        if host == self.host:
            return
        states = {}       # name -> its optimizer state, from the optimizers of the previous placement
        if self.host is not None:
            updated = {id(p): n for n, p in self.params.items() if n not in self.host}
            updated.update({id(c): n for n, p in self.params.items() for q, c in self.offloaded if q is p})
            for opt in self.opts:
                for q, st in opt.state.items():
                    states[updated[id(q)]] = st
        self.host = host
        self.on_device = [p for n, p in self.params.items() if n not in host]
        self.offloaded = [(p, p.detach().cpu().clone()) for n, p in self.params.items() if n in host]
        self.opts = [torch.optim.AdamW(self.on_device, **self.options)] if self.on_device else []
        if self.offloaded:
            self.opts.append(torch.optim.AdamW([c for _, c in self.offloaded], **self.options))
        names = {id(p): n for n, p in self.params.items()}
        for p in self.on_device:
            if names[id(p)] in states:
                self.opts[0].state[p] = {k: v.to(p.device) for k, v in states[names[id(p)]].items()}
        for p, c in self.offloaded:
            if names[id(p)] in states:
                self.opts[-1].state[c] = {k: v.to("cpu") for k, v in states[names[id(p)]].items()}

    def step(self) -> None:
        for p, c in self.offloaded:
            c.grad = p.grad.cpu() if p.grad is not None else None
        for opt in self.opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for p, c in self.offloaded:
                p.copy_(c)
                p.grad = None


def check_tight_budget_matches_eager(case: Case, steps: int, chunk_size: int = 1024, bounded_sizes: bool = False
                                     ) -> None:
    """Under a budget just above the least feasible one (below half the model data): chunks are evicted and fetched
    again, and losses and final values equal eager's to 1e-6; the measured peak is the plan's and within budget.
    bounded_sizes: the step has data-dependent sizes, planned at their upper bound, so the measured peak is at most
    the plan's instead of equal to it."""
    budget = tight_budget(case, chunk_size)
    losses, sd, step = compiled_run(case, steps, budget=budget, chunk_size=chunk_size)
    ref_losses, ref_sd = eager_run(case, steps, host_params=host_params(step))
    g = step.final_graph
    assert budget < step.summary().model_data_bytes / 2
    assert max(fetch_counts(g).values()) >= 2, "no chunk was evicted and fetched again"
    assert rel_err(losses, ref_losses) <= 1e-6, (losses, ref_losses)
    assert_state_close(sd, ref_sd, rtol=1e-6)
    assert step.last_step.measured_peak <= g.plan.predicted_peak <= budget
    if not bounded_sizes:
        assert step.last_step.measured_peak == g.plan.predicted_peak


def compiled_step(case: Case, *, budget=None, chunk_size=None, precision="fp32", fused=None, hyper=HYPER,
                  debug=True, prefetch=None):
    model = case.build_model()
    return px.compile(model, optimizer=px.AdamW(**hyper, fused=fused), device_memory=budget, chunk_size=chunk_size,
                      precision=precision, device=DEVICE, debug=debug, prefetch=prefetch)(case.loss_fn)


def compiled_run(case: Case, steps: int, **kw):
    step = compiled_step(case, **kw)
    losses = [step(*case.batch(i)).item() for i in range(steps)]
    return losses, step.state_dict(), step


def tight_budget(case: Case, chunk_size: int, slack: float = 1.05) -> int:
    """A budget just above the least this case can run in: most chunks cannot stay on the device."""
    settings = (options.CPU_DEVICE_IS_HOST, options.FUSE_IF_FASTER,
                tuple(sorted(options.DEFAULT_FUSE.items(), key=str)))
    return int(_least_memory(case, chunk_size, settings) * slack)


@functools.lru_cache(maxsize=None)
def _least_memory(case: Case, chunk_size: int, settings: tuple) -> int:
    """The least device memory a step of `case` runs in: a pure function of the case, the chunk size and the
    module-level options the tests change (`settings`, part of the key), so worked out (a compile) once a process."""
    step = compiled_step(case, chunk_size=chunk_size)
    return step.min_device_memory(*case.batch(0))


def host_params(step) -> set[str]:
    """Parameters (all their state_dict names) whose chunk's update runs on the CPU: optimizer states the plan put on
    the host and did not stream to the device for their update (a streamed chunk takes the device's kernel)."""
    g = step.final_graph
    names = set()
    for p in g.params:
        c = g.chunks[p.chunk]
        if c.update_site is not None and c.update_site.value == "cpu":
            names |= {p.name, *p.aliases}
    return names if DEVICE != "cpu" else set()


def fetch_counts(g) -> dict[int, int]:
    """How often each chunk's parameters are fetched in one step."""
    counts: dict[int, int] = {}
    for n in g.nodes:
        a = g.ann[n.name]
        if a.role is Role.FETCH and n.target is ops.fetch and a.buf.value == "param":
            counts[a.chunk] = counts.get(a.chunk, 0) + 1
    return counts


def rel_err(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def two_layer_store(d: int = 64):
    """The chunk store of a 2-layer MLP (d x d) compiled on the CPU in fp32, one weight per chunk, after one step
    (its chunks left resident): for tests that drive the store's slots by hand."""
    import torch.nn as nn
    step = px.compile(nn.Sequential(nn.Linear(d, d), nn.Linear(d, d)), optimizer=px.AdamW(lr=1e-3), device="cpu",
                      precision="fp32", chunk_size=d * d)(lambda m, x: m(x).sum())
    step(torch.randn(4, d))
    return step._compiler.store


def step_values(step) -> dict:
    """Everything a training step may change, cloned to the CPU: its state dict, the optimizer states, the
    half-precision parameters' host homes (a chunk cast from its device master has none: its states hold them) and
    the fp16 loss scaler. Resident slots written on the device are made current on the host first."""
    store = step._compiler.store
    store.flush()
    snap = {f"sd.{k}": v.clone() for k, v in step.state_dict().items()}
    snap.update({f"states.{i}": s.detach().cpu().clone() for i, s in enumerate(store.states) if s is not None})
    snap.update({f"host_param.{i}": h.clone() for i, h in enumerate(store.host_param) if h is not None})
    snap["loss_scale"] = torch.tensor(step.loss_scale if step.loss_scale is not None else 0.0)
    snap["good_steps"] = torch.tensor(step._scaler.good_steps if step._scaler is not None else 0)
    return snap


def assert_values_equal(a: dict, b: dict, where: str) -> None:
    """Two step_values snapshots equal bit for bit."""
    assert a.keys() == b.keys(), where
    for k in a:
        assert torch.equal(a[k], b[k]), f"{where}: {k} differs"



def check_failures_before_the_commit(make, case: Case, where: str, after_each=None,
                                     through_first_update: bool = False) -> None:
    """Fault injection up to the commit point. `make()` compiles a step of `case`; a reference runs batches 0, 1, 2.
    A second step runs 0 and 1, then fails at every node up to the commit in turn (the commit itself may fail: fp16
    reads the overflow flag there), on a batch the reference never sees, with a RuntimeError, a KeyboardInterrupt and
    an out-of-memory error in rotation: each failure propagates and leaves every value exactly as it was
    (`after_each(step)` checks more), and batch 2 then gives the reference's values. `through_first_update`: on past
    the commit, up to (and before) the first update (one rank, no update before the commit: nothing written yet)."""
    ref = make()
    for i in range(3):
        ref(*case.batch(i))
    want = step_values(ref)
    step = make()
    step(*case.batch(0))
    step(*case.batch(1))
    nodes = step.final_graph.nodes          # the graph the step runs (fused regions where fuse=True)
    roles = [step.final_graph.ann[n.name].role for n in nodes]
    before = step_values(step)
    errors = [RuntimeError("injected"), KeyboardInterrupt(), torch.OutOfMemoryError("injected out of memory")]
    commit = roles.index(Role.COMMIT)
    failing = range(commit + 1)
    if through_first_update:
        first = next(i for i in range(commit, len(roles)) if roles[i] is Role.OPTIMIZER_STEP)
        assert Role.OPTIMIZER_STEP not in roles[:commit], f"{where}: an update before the commit"
        failing = range(first + 1)
    for at in failing:
        exc = errors[at % len(errors)]
        step._before_node = raiser(at, exc)
        try:
            step(*case.batch(99))
        except type(exc):
            pass
        else:
            raise AssertionError(f"{where}: the failure injected before node {at} did not propagate")
        finally:
            step._before_node = None
        if after_each is not None:
            after_each(step)
        assert_values_equal(step_values(step), before, f"{where}, failure before node {at} ({nodes[at].name})")
    step(*case.batch(2))
    assert_values_equal(step_values(step), want, f"{where}: the step after {len(failing)} failed ones")


def raiser(at: int, exc: BaseException):
    """A before-node hook (`step._before_node`) raising exc before node `at`."""
    def hook(i, node):
        if i == at:
            raise exc
    return hook


def line_of(path: str, marker: str) -> int:
    """The number of the first line of file `path` that contains `marker` (and is not a call of this function):
    where an error should point in a test's own source."""
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if marker in line and "line_of(" not in line:
                return i
    raise AssertionError(f"{marker!r} is not in {path}")
