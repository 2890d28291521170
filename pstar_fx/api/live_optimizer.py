"""The live optimizer, `step.optimizer`: torch.optim.Adam / AdamW's object, driven by the compiled step.

It is a real `torch.optim.AdamW` (or `Adam`) over the model's own tensors, so it has torch's `param_groups`,
`defaults`, hooks and state-dict format, and `torch.optim.lr_scheduler` schedulers (which check
`isinstance(optimizer, Optimizer)`) drive it unchanged. What differs:

- `step()` raises: the compiled step runs the update. At every step the runtime reads each group's options through
  `configs()` (checked like torch.optim checks them), so values set between steps take effect at the next step,
  with no retrace; the plan depends only on which parameters are in which group (`layout`).
- The moments live in the ChunkStore, chunk by chunk, not in `self.state` (which stays empty). `state_dict()`
  reads them out in torch's format (state keyed by parameter index in group order: 'step' as a 0-d float32 tensor,
  'exp_avg', 'exp_avg_sq' in the parameter's dtype and device); `load_state_dict()` takes torch's format (from eager
  PyTorch or from pstar-fx) and writes them into the store. A parameter has state once its chunk has stepped, as
  torch creates it at a parameter's first step. Before the first step there is no store: a loaded state is kept and
  written into the store when it is built.
- pstar-fx steps all parameters of a chunk together, so they share one step count; a loaded state whose
  parameters of one chunk differ in 'step' (or of which some have state and others not) is rejected.
"""
from __future__ import annotations

import copy

import torch
import torch.nn as nn

from ..ir.graph import ChunkGroup
from ..optim import AdamConfig, OptimizerLayout, OptimizerSpec, check_options

_STEP_EXPLAINED = ("step.optimizer is driven by the compiled step: calling step(*batch) runs forward, backward and "
                   "this optimizer's update. Do not call step.optimizer.step(); change param_groups (or use an "
                   "lr_scheduler) between calls of the compiled step.")


class _Live:
    """What the compiled Adam and AdamW add to torch's classes (mixed in before them)."""

    decoupled: bool

    def _setup(self, model: nn.Module) -> None:
        # every name of a model tensor (tied ones share the first name, as model_tables does)
        self._name_of: dict[int, str] = {}
        for name, t in model.named_parameters(remove_duplicate=False):
            self._name_of.setdefault(id(t), name)
        groups = []
        owner: dict[int, int] = {}
        for i, g in enumerate(self.param_groups):
            names = []
            for t in g["params"]:
                name = self._name_of.get(id(t))
                if name is None:
                    raise ValueError(f"px.{self._kind}: parameter group {i} holds a tensor of shape "
                                     f"{tuple(t.shape)} that is not a parameter of the model given to px.compile; "
                                     "build the groups from that model's parameters")
                if owner.setdefault(id(t), i) != i:   # torch.optim raises this too
                    raise ValueError("some parameters appear in more than one parameter group")
                if name not in names:
                    names.append(name)
            groups.append(tuple(names))
        self.layout = OptimizerLayout(groups=tuple(groups), live=self)
        self._ids = [[id(t) for t in g["params"]] for g in self.param_groups]
        self._store = None
        self._pending: dict[str, dict] | None = None    # loaded before the store existed: name -> state

    @property
    def _kind(self) -> str:
        return "AdamW" if self.decoupled else "Adam"

    def step(self, closure=None):
        raise RuntimeError(_STEP_EXPLAINED)

    # -- what the runtime reads at every step ---------------------------------------------------------------------
    def configs(self) -> tuple[AdamConfig, ...]:
        """Each group's options for the step about to run, checked before anything changes."""
        if [[id(t) for t in g["params"]] for g in self.param_groups] != self._ids:
            raise ValueError("step.optimizer.param_groups: the parameters of the groups changed after px.compile; "
                             "pstar-fx lays out its chunks by group, so keep each group's 'params' as compiled "
                             "(change options such as lr freely) or compile a new step")
        out = []
        for i, g in enumerate(self.param_groups):
            out.append(check_options(f"step.optimizer.param_groups[{i}]", g, self.decoupled, construction=False))
        # what torch's step() wrapper records, so that lr_scheduler does not warn that it ran before a step
        self._opt_called = True
        return tuple(out)

    # -- the store ------------------------------------------------------------------------------------------------
    def attach(self, store) -> None:
        """The ChunkStore now exists (first compile): write a state loaded before it into it."""
        self._store = store
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self._write(pending)

    def entries(self) -> list[tuple[torch.Tensor, str, dict]]:
        """(tensor, name, group) for every entry of every group, in torch's state-dict index order."""
        return [(t, self._name_of[id(t)], g) for g in self.param_groups for t in g["params"]]

    def _read(self) -> dict[str, dict]:
        """name -> torch's per-parameter state, read out of the store (parameters whose chunk has stepped)."""
        st = self._store
        out: dict[str, dict] = {}
        read: dict[int, dict] = {}       # chunk -> its states, read once (with several ranks: gathered once)
        for t, name, g in self.entries():
            if name in out or name not in st.params:
                continue
            p = st.params[name]
            c = st.chunks[p.chunk]
            if c.group is not ChunkGroup.TRAINABLE:
                continue
            if c.id not in read:
                read[c.id] = st.values.state_parts(c.id)
            parts = read[c.id]
            step = float(parts["step"].item())
            if step == 0:
                continue
            on_device = g.get("fused") or g.get("capturable")

            def value(key):
                v = parts[key][p.offset:p.offset + p.numel].view(p.shape)
                return v.to(device=t.device, dtype=t.dtype if t.is_floating_point() else v.dtype, copy=True)

            out[name] = {"step": torch.tensor(step, dtype=torch.float32, device=t.device if on_device else "cpu"),
                         "exp_avg": value("m"), "exp_avg_sq": value("v")}
        return out

    def _write(self, states: dict[str, dict]) -> None:
        """Write torch's per-parameter states into the store, chunk by chunk; check every chunk before changing
        any."""
        st = self._store
        trainable = {n: st.params[n] for n in st.params if st.chunks[st.params[n].chunk].group is ChunkGroup.TRAINABLE}
        for name in states:
            if name not in trainable:
                raise ValueError(f"optimizer load_state_dict: the state has moments for parameter '{name}', which "
                                 "this compiled step does not train (frozen, not reached by the loss, or in no "
                                 "group); drop that entry or make the parameter trainable")
        plan: dict[int, float] = {}
        for c in st.chunks:
            if c.group is not ChunkGroup.TRAINABLE:
                continue
            have = [n for n in c.params if n in states]
            if not have:
                plan[c.id] = 0.0
                continue
            if len(have) != len(c.params):
                missing = [n for n in c.params if n not in states]
                raise ValueError(
                    f"optimizer load_state_dict: parameters {have[:3]} have state but {missing[:3]} of the same "
                    "pstar-fx chunk have none; pstar-fx steps all parameters of a chunk together, so load a state "
                    "in which these parameters have all stepped, or none")
            steps = {n: float(states[n]["step"]) for n in have}
            if len(set(steps.values())) != 1:
                raise ValueError(
                    f"optimizer load_state_dict: parameters of one pstar-fx chunk have different step counts "
                    f"{steps}; pstar-fx steps all parameters of a chunk together (one count per chunk), so it "
                    "cannot continue this state exactly")
            for n in have:
                for key in ("exp_avg", "exp_avg_sq"):
                    v = states[n].get(key)
                    if not isinstance(v, torch.Tensor) or v.numel() != st.params[n].numel:
                        raise ValueError(f"optimizer load_state_dict: '{key}' of parameter '{n}' must be a tensor "
                                         f"of shape {st.params[n].shape}")
            plan[c.id] = steps[have[0]]
        for cid, step in plan.items():
            st.before_host_write(cid)
            parts = st.values.state_parts(cid)
            parts["m"].zero_()
            parts["v"].zero_()
            parts["step"].fill_(step)
            for n in st.chunks[cid].params:
                if n in states:
                    p = st.params[n]
                    parts["m"][p.offset:p.offset + p.numel].copy_(states[n]["exp_avg"].reshape(-1))
                    parts["v"][p.offset:p.offset + p.numel].copy_(states[n]["exp_avg_sq"].reshape(-1))
            st.values.put_state_parts(cid, parts)

    # -- torch's state-dict format ---------------------------------------------------------------------------------
    def state_dict(self):
        """torch.optim.AdamW's format: {'state': {index: {'step', 'exp_avg', 'exp_avg_sq'}}, 'param_groups': [...]}
        with fresh tensors (nothing shared with the store)."""
        if self._store is not None:
            states = self._read()
        else:
            states = {n: {k: v.clone() for k, v in s.items()} for n, s in (self._pending or {}).items()}
        for t, name, _ in self.entries():
            if name in states and t not in self.state:
                self.state[t] = states[name]
        try:
            return super().state_dict()
        finally:
            self.state.clear()

    def load_state_dict(self, state_dict) -> None:
        """Load torch.optim.Adam(W)'s format (from eager PyTorch or from pstar-fx). Options replace the groups'
        (as in torch); moments go into the store (or wait for it, before the first step)."""
        old_groups = self.param_groups
        super().load_state_dict(state_dict)
        loaded = {self._name_of[id(t)]: s for t, s in self.state.items() if isinstance(t, torch.Tensor)}
        self.state.clear()
        try:
            self.configs()
            if self._store is not None:
                self._write(loaded)
            else:
                self._pending = {n: {k: v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)
                                     for k, v in s.items()} for n, s in loaded.items()}
        except BaseException:
            self.param_groups = old_groups
            raise


class CompiledAdamW(_Live, torch.optim.AdamW):
    decoupled = True


class CompiledAdam(_Live, torch.optim.Adam):
    decoupled = False


def build(spec: OptimizerSpec, model: nn.Module) -> CompiledAdam | CompiledAdamW:
    """The live optimizer for a model: torch's groups as given (or one group of every parameter)."""
    params = [dict(g) for g in spec.groups] if spec.groups is not None else list(model.parameters())
    cls = CompiledAdamW if spec.decoupled else CompiledAdam
    opt = cls(params, **spec.defaults)
    opt._setup(model)
    return opt
