"""The live optimizer, `step.optimizer`: the torch.optim object of the optimizer given to px.compile (torch.optim.AdamW
for px.AdamW, torch.optim.SGD for px.SGD, the class given to px.optim_from_torch), driven by the compiled step.

It is a real object of that class over the model's own tensors, so it has torch's `param_groups`,
`defaults`, hooks and state-dict format, and `torch.optim.lr_scheduler` schedulers (which check
`isinstance(optimizer, Optimizer)`) drive it unchanged. What differs:

- `step()` raises: the compiled step runs the update. At every step the runtime reads each group's options through
  `configs()` (checked like torch.optim checks them), so values set between steps take effect at the next step,
  with no retrace; the plan depends only on which parameters are in which group (`layout`).
- The states live in the ChunkStore, chunk by chunk, not in `self.state` (which stays empty; the states some
  constructors make, such as Adagrad's sums, are dropped). `state_dict()` reads them out in torch's format (state
  keyed by parameter index in group order, under torch's keys: Adam's 'step' as a 0-d float32 tensor, 'exp_avg',
  'exp_avg_sq' in the parameter's dtype and device; SGD's 'momentum_buffer'; the keys the class keeps for the
  group's options, `state_keys`); `load_state_dict()` takes torch's format (from eager PyTorch or from pstar-fx)
  and writes them into the store. A parameter has state once its chunk has stepped, as torch creates it at a
  parameter's first step. Before the first step there is no store: a loaded state is kept and written into the
  store when it is built. A state with other keys (another optimizer's) is rejected.
- pstar-fx steps all parameters of a chunk together, so they share their 0-d states; a loaded state whose
  parameters of one chunk differ in 'step' (or another 0-d state, or of which some have state and others not) is
  rejected.
- With several ranks, `state_dict()` gathers every chunk's states from every rank and `load_state_dict()` gathers
  them to write each rank's shard: both are collectives once the store exists (none before the first step, when
  the states wait in `_pending`), and begin with the ranks' check that every rank calls the same function
  (`Comm.agree_on`), so a rank that calls one while another trains is refused at once on every rank.
  `load_state_dict()` also compares a digest of what each rank loads (every group's options, every state's value):
  each rank writes its own shard from its own dict, so dicts that differ are refused on every rank, naming the
  option or the parameter's state, before anything is written. States loaded before the first step are compared
  likewise when the store is made (`attach`), and dropped on every rank where they differ. Inside step.load, which
  compared the checkpoint's files, only the call is checked.
"""
from __future__ import annotations

import copy

import torch
import torch.nn as nn

from ..checkpoint.checks import optimizer_state_dict
from ..errors import CheckpointError, DistributedError
from ..ir.graph import ChunkGroup
from ..optim import (ADAM_STATE, OptimizerLayout, OptimizerSpec, StateDtype, StateLayout, TorchConfig, check_group,
                     check_options, is_adam, probe)
from ..runtime.comm import collective_call
from ..runtime.store_values import full_dtype, half_precision
from .agreement import compare_contents

_STEP_EXPLAINED = ("step.optimizer is driven by the compiled step: calling step(*batch) runs forward, backward and "
                   "this optimizer's update. Do not call step.optimizer.step(); change param_groups (or use an "
                   "lr_scheduler) between calls of the compiled step.")
# what a collective that fails inside state_dict() / load_state_dict() leaves (Comm.failure says it after the call)
AFTER_READ = "The optimizer's states are as they were."
AFTER_WRITE = ("The optimizer's options are as they were; some chunks' states may be loaded and others not: load the "
               "state dict again, on every rank, before the next step.")
LOAD = "step.optimizer.load_state_dict()"


class _Live:
    """What the compiled optimizers add to torch's classes (mixed in before them)."""

    torch_class: type        # the torch.optim class (mixed in after this one)

    def _setup(self, model: nn.Module, state: StateLayout) -> None:
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
        self.layout = OptimizerLayout(groups=tuple(groups), state=state, live=self)
        self._keys_cache: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {}
        self._ids = [[id(t) for t in g["params"]] for g in self.param_groups]
        self._store = None
        self._pending: dict[str, dict] | None = None    # loaded before the store existed: name -> state

    @property
    def _kind(self) -> str:
        return self.torch_class.__name__

    @property
    def is_adam(self) -> bool:
        return is_adam(self.torch_class)

    def step(self, closure=None):
        raise RuntimeError(_STEP_EXPLAINED)

    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "_ids", None) is not None:      # (torch's constructor adds the groups it was given)
            raise ValueError("step.optimizer.add_param_group: pstar-fx lays out its chunks by the parameter groups "
                             "px.compile was given, so a group cannot be added to a compiled step; compile a new "
                             "step with the groups you want (step.sync_model() gives the model back first)")
        super().add_param_group(param_group)

    # -- what the runtime reads at every step ---------------------------------------------------------------------
    def configs(self) -> tuple:
        """Each group's options for the step about to run, checked before anything changes."""
        self._refuse_written_state()
        if [[id(t) for t in g["params"]] for g in self.param_groups] != self._ids:
            raise ValueError("step.optimizer.param_groups: the parameters of the groups changed after px.compile; "
                             "pstar-fx lays out its chunks by group, so keep each group's 'params' as compiled "
                             "(change options such as lr freely) or compile a new step")
        out = tuple(self.check_group(f"step.optimizer.param_groups[{i}]", g) for i, g in enumerate(self.param_groups))
        # what torch's step() wrapper records, so that lr_scheduler does not warn that it ran before a step
        self._opt_called = True
        return out

    def _refuse_written_state(self) -> None:
        """`self.state` stays empty (the states live in the chunks): an entry there was written by the user, whose
        value no step would read; refused, and dropped, rather than ignored or handed out by state_dict(). (An empty
        entry is what reading `.state[p]` leaves, torch's state being a defaultdict: dropped quietly.)"""
        written = any(v != {} for v in self.state.values())
        self.state.clear()
        if written:
            raise ValueError("step.optimizer.state was written to: pstar-fx keeps the optimizer's states in its "
                             "chunks, not in .state (which stays empty), so the write would be ignored. Read them "
                             "with step.optimizer.state_dict() and write them with step.optimizer.load_state_dict("
                             "...); the write was dropped")

    def check_group(self, where: str, g) -> object:
        """One group's options, checked (ValueError naming `where` and the option): Adam's AdamConfig, or the
        general route's TorchConfig, whose states must be among those px.compile laid out."""
        if self.is_adam:
            return check_options(where, g, self.torch_class is torch.optim.AdamW, construction=False)
        opts = check_group(self.torch_class, where, g, construction=False)
        vectors, scalars = self._keys(opts, where)
        have = self.layout.state.vectors + self.layout.state.scalars
        missing = [k for k in vectors + scalars if k not in have]
        if missing:
            raise ValueError(f"{where}: with these options {self._kind} keeps the state {missing}, which the "
                             "options given to px.compile did not need, so the chunks have no room for it; compile "
                             "the step with options that need it (for SGD: a momentum > 0)")
        return TorchConfig(self.torch_class, tuple(sorted(opts.items())), vectors, scalars)

    def _keys(self, opts: dict, where: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The states torch keeps with these options (optim.probe), once per set of options other than lr (a
        learning rate decides no state)."""
        key = repr(sorted((k, v) for k, v in opts.items() if k != "lr"))
        if key not in self._keys_cache:
            self._keys_cache[key] = probe(self.torch_class, opts, where)
        return self._keys_cache[key]

    def state_keys(self, group: int, options: dict | None = None) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(per-element, 0-d) state keys a parameter of group `group` has in torch's state dict once it has stepped,
        with that group's options or with `options` (a saved group's)."""
        if self.is_adam:
            return ADAM_STATE.vectors, ADAM_STATE.scalars
        where = f"step.optimizer.param_groups[{group}]"
        opts = self.param_groups[group] if options is None else options
        return self._keys(check_group(self.torch_class, where, opts, construction=False), where)

    # -- the store ------------------------------------------------------------------------------------------------
    def attach(self, store) -> None:
        """The ChunkStore now exists (first compile): write a state loaded before it into it. With several ranks,
        every rank first compares what it loaded before (nothing, or a state dict's states): each writes its own
        shard of every chunk from its own, so states that differ are refused on every rank (DistributedError), and
        dropped, before anything is written."""
        self._store = store
        pending, self._pending = self._pending, None
        if store.comm is not None:
            differ = compare_contents(store.comm, "the training step", {}, self._named(pending or {}),
                                      "optimizer states", AFTER_READ)
            if differ is not None:
                raise DistributedError(
                    f"pstar-fx: the ranks loaded different optimizer states before the first step ({differ}). Each "
                    "rank writes its own shard of every chunk's states from the states it loaded, so the ranks' "
                    "shards would hold different optimizers' states, with no error. The states loaded before the "
                    "first step were dropped on every rank (the options loaded stay): load the same state dict on "
                    f"every rank ({LOAD}), then call the step again.")
        if pending is not None:
            try:
                self._write(pending)
            except BaseException:       # refused before writing anything: the state stays loaded, for the next try
                self._store, self._pending = None, pending
                raise

    def entries(self) -> list[tuple[torch.Tensor, str, dict]]:
        """(tensor, name, group) for every entry of every group, in torch's state-dict index order."""
        return [(t, self._name_of[id(t)], g) for g in self.param_groups for t in g["params"]]

    def _read(self, device: torch.device | str | None = None) -> dict[str, dict]:
        """name -> torch's per-parameter state, read out of the store (parameters whose chunk has stepped), on each
        parameter's device as torch keeps them, or on `device`."""
        st = self._store
        layout = self.layout.state
        out: dict[str, dict] = {}
        read: dict[int, dict] = {}       # chunk -> its states, read once (with several ranks: gathered once)
        left: dict[int, int] = {}        # chunk -> its parameters not yet read: let go after its last (one chunk's
        for _, name, _ in self.entries():                 # gathered copies at a time, not the whole model's)
            if name in st.params:
                left[st.params[name].chunk] = left.get(st.params[name].chunk, 0) + 1
        for gi, g in enumerate(self.param_groups):
            vectors, scalars = self.state_keys(gi)
            for t in g["params"]:
                name = self._name_of[id(t)]
                if name in out or name not in st.params or layout.counter is None:
                    continue
                p = st.params[name]
                c = st.chunks[p.chunk]
                if c.group is not ChunkGroup.TRAINABLE:
                    continue
                if c.id not in read:
                    read[c.id] = st.values.state_parts(c.id)
                parts = read[c.id]
                left[c.id] -= 1
                if left[c.id] == 0:
                    del read[c.id]
                if float(parts[layout.counter].item()) == 0:
                    continue
                # Adam's step stays where torch keeps it (on the device for fused or capturable); others' 0-d
                # states on the CPU, as torch keeps step counts
                on_device = self.is_adam and (g.get("fused") or g.get("capturable"))
                entry = {k: torch.tensor(float(parts[k].item()), dtype=torch.float32,
                                         device=(device or t.device) if on_device else "cpu") for k in scalars}
                for k in vectors:
                    v = parts[k][p.offset:p.offset + p.numel].view(p.shape)
                    # (fp32 as the chunks hold them, for a half-precision parameter: torch would keep its dtype)
                    entry[k] = v.to(device=device or t.device, dtype=full_dtype(v, t), copy=True)
                out[name] = entry
        return out

    def _write(self, states: dict[str, dict]) -> None:
        """Write torch's per-parameter states into the store, chunk by chunk; check every chunk before changing
        any."""
        st = self._store
        layout = self.layout.state
        trainable = {n: st.params[n] for n in st.params if st.chunks[st.params[n].chunk].group is ChunkGroup.TRAINABLE}
        for name in states:
            if name not in trainable:
                raise ValueError(f"optimizer load_state_dict: the state has moments for parameter '{name}', which "
                                 "this compiled step does not train (frozen, not reached by the loss, or in no "
                                 "group); drop that entry or make the parameter trainable")
        group_of = {self._name_of[id(t)]: gi for gi, g in enumerate(self.param_groups) for t in g["params"]}
        plan: dict[int, dict[str, float] | None] = {}
        for c in st.chunks:
            if c.group is not ChunkGroup.TRAINABLE:
                continue
            have = [n for n in c.params if n in states]
            if not have:
                plan[c.id] = None
                continue
            if len(have) != len(c.params):
                missing = [n for n in c.params if n not in states]
                raise ValueError(
                    f"optimizer load_state_dict: parameters {have[:3]} have state but {missing[:3]} of the same "
                    "pstar-fx chunk have none; pstar-fx steps all parameters of a chunk together, so load a state "
                    "in which these parameters have all stepped, or none. Where the state comes from a run that "
                    f"did not train {missing[:3]} (frozen with requires_grad=False, or unused by its loss), freeze "
                    "them here too before px.compile, or start this optimizer's state anew (load the model's values "
                    "alone: step.load_state_dict(model values))")
            vectors, scalars = self.state_keys(group_of[have[0]])
            for n in have:
                if set(states[n]) != set(vectors + scalars):
                    raise ValueError(f"optimizer load_state_dict: the state of parameter '{n}' has the keys "
                                     f"{sorted(states[n])}; {self._kind} with this group's options keeps "
                                     f"{sorted(vectors + scalars)} (a state of another optimizer, or other options)")
                for key in vectors:
                    v = states[n][key]
                    if not isinstance(v, torch.Tensor) or v.numel() != st.params[n].numel:
                        raise ValueError(f"optimizer load_state_dict: '{key}' of parameter '{n}' must be a tensor "
                                         f"of shape {st.params[n].shape}")
                for key in scalars:
                    v = states[n][key]
                    if isinstance(v, torch.Tensor) and v.numel() != 1:
                        raise ValueError(f"optimizer load_state_dict: '{key}' of parameter '{n}' must be a number")
            values = {}
            for key in scalars:
                seen = {n: float(states[n][key]) for n in have}
                if len(set(seen.values())) != 1:
                    what = "step counts" if key == "step" else f"{key!r} values"
                    raise ValueError(
                        f"optimizer load_state_dict: parameters of one pstar-fx chunk have different {what} "
                        f"{seen}; pstar-fx steps all parameters of a chunk together (one {key!r} per chunk), so "
                        "it cannot continue this state exactly")
                values[key] = seen[have[0]]
            plan[c.id] = values
        for cid, values in plan.items():
            st.before_host_write(cid)
            parts = st.values.state_parts(cid)
            for k in layout.vectors + layout.scalar_parts:
                parts[k].zero_()
            if values is not None:
                for k, v in values.items():
                    parts[k].fill_(v)
                if layout.counter not in values:
                    parts[layout.counter].fill_(1)
                for n in st.chunks[cid].params:
                    p = st.params[n]
                    for k in layout.vectors:
                        if k in states[n]:
                            parts[k][p.offset:p.offset + p.numel].copy_(states[n][k].reshape(-1))
            st.values.put_state_parts(cid, parts)

    def _collective(self, call: str, after: str):
        """Around a call that, with several ranks, gathers chunks (once the store exists): every rank first checks
        that every rank is in `call` (collective_call); nothing to check with one rank or before the store."""
        return collective_call(None if self._store is None else self._store.comm, call, after)

    # -- torch's state-dict format ---------------------------------------------------------------------------------
    def state_dict(self, *, device: torch.device | str | None = None):
        """torch's format: {'state': {index: {key: value}}, 'param_groups': [...]} (AdamW: 'step', 'exp_avg',
        'exp_avg_sq'), with fresh tensors (nothing shared with the store), on each parameter's device as torch keeps
        them, or on `device` ("cpu": a model larger than the GPU's states do not fit there at once). With several
        ranks, once the store exists, a collective (every rank calls it)."""
        if self._store is not None:
            with self._collective("step.optimizer.state_dict()", AFTER_READ):
                states = self._read(device)
        else:
            states = {n: {k: v.clone() if device is None else v.to(device, copy=True) for k, v in s.items()}
                      for n, s in (self._pending or {}).items()}
        self._refuse_written_state()
        for t, name, _ in self.entries():
            if name in states and t not in self.state:
                self.state[t] = states[name]
        try:
            out = super().state_dict()
        finally:
            self.state.clear()
        if self.is_adam and self.layout.state.dtype is StateDtype.FP32:
            # fused=None runs torch's fused kernel: say so, so that an eager optimizer loading this runs it too
            out["param_groups"] = [dict(g, fused=True) if g.get("fused", False) is None else g
                                   for g in out["param_groups"]]
        return out

    def load_state_dict(self, state_dict) -> None:
        """Load torch's format for this class (from eager PyTorch or from pstar-fx). Options replace the groups'
        (as in torch); moments go into the store (or wait for it, before the first step). With several ranks, once
        the store exists, a collective: every rank calls it with the same state dict, which the ranks first compare
        (`_check_same`)."""
        self.load_compared(state_dict, compared=False)

    def load_compared(self, state_dict, compared: bool) -> None:
        """load_state_dict; `compared`: step.load, which compared the checkpoint's files across the ranks and checked
        the state dict already (checkpoint/checks), so with several ranks they check only that each is in it."""
        comm = None if self._store is None else self._store.comm
        if not compared:
            if comm is not None:
                self._check_same(comm, state_dict)
            # all of it checked before any of it is applied, as step.load's checks do (after the ranks agree that
            # they hold the same state dict, so every rank refuses it alike): a refused state dict changes nothing
            try:
                optimizer_state_dict(self, state_dict, "the state dict", call="step.optimizer.load_state_dict")
            except CheckpointError as e:
                raise ValueError(str(e)) from None
        with collective_call(comm, LOAD, AFTER_WRITE, check=compared):
            self._load(state_dict)

    def _check_same(self, comm, state_dict) -> None:
        """DistributedError on every rank, before anything is loaded, unless every rank is in load_state_dict with
        the same state dict: its groups' options and its states' values (agreement.compare_contents: one agree of
        a digest where they are). Each rank would write its own shard of every chunk's states from its own."""
        if isinstance(state_dict, dict):
            groups = state_dict.get("param_groups", [])
            options = {f"param_groups[{i}][{k!r}]": v for i, g in enumerate(groups)
                       for k, v in (g.items() if isinstance(g, dict) else [("?", g)])}
            names = {}          # a state's index -> its parameter's name, matched as torch matches them
            for saved, g in zip(groups, self.param_groups):
                if isinstance(saved, dict):
                    names.update(zip(saved.get("params", ()), (self._name_of[id(t)] for t in g["params"])))
            states = {names.get(i, f"state[{i!r}]"): s for i, s in state_dict.get("state", {}).items()}
        else:
            options, states = {"the state dict": type(state_dict).__name__}, {}
        differ = compare_contents(comm, LOAD, options, self._named(states), "optimizer states", AFTER_READ)
        if differ is not None:
            raise DistributedError(
                f"pstar-fx: the ranks called {LOAD} with different state dicts ({differ}). Each rank writes its own "
                "shard of every chunk's states from the state dict it was given (and takes its options), so the "
                "ranks' shards would hold different optimizers' states, with no error. Give every rank the same "
                "state dict (read from the same file on every rank, or broadcast from one rank). Nothing was "
                "loaded: the optimizer's options and states are as they were.")

    @staticmethod
    def _named(states: dict) -> dict[str, object]:
        """Per-parameter states ({name: {key: value}}) as one value per "name key" (what compare_contents
        compares)."""
        return {f"{n} {k}": v for n, s in states.items() for k, v in (s.items() if isinstance(s, dict) else [("", s)])}

    def _load(self, state_dict) -> None:
        old_groups = self.param_groups
        super().load_state_dict(state_dict)
        loaded = {self._name_of[id(t)]: s for t, s in self.state.items() if isinstance(t, torch.Tensor)}
        self.state.clear()
        for name, key, value in self._wider_states(state_dict):
            loaded[name][key] = value
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

    def _wider_states(self, state_dict):
        """(name, key, value) for each state in `state_dict` of a floating dtype wider than its parameter's (the
        fp32 states of a half-precision parameter, as step.optimizer.state_dict() gives them, per-element and 0-d
        alike): torch's load_state_dict casts those to the parameter's dtype (all but 'step'), and the chunks keep
        them as they were saved."""
        groups = state_dict.get("param_groups", [])
        saved = [i for g in groups for i in g.get("params", ())]
        ours = {i: (t, gi) for i, (t, gi) in zip(saved, ((t, gi) for gi, g in enumerate(self.param_groups)
                                                         for t in g["params"]))}
        for i, states in state_dict.get("state", {}).items():
            t, gi = ours.get(i, (None, None))
            if t is None or not isinstance(states, dict) or not t.is_floating_point():
                continue
            vectors, scalars = self.state_keys(gi)
            for k, v in states.items():     # (torch casts every state but 'step': NAdam's 0-d mu_product too)
                if k != "step" and k in vectors + scalars and torch.is_tensor(v) and half_precision(t.dtype) \
                        and full_dtype(v, t) is not t.dtype:
                    yield self._name_of[id(t)], k, v.detach().to(torch.float32, copy=True)


class CompiledAdamW(_Live, torch.optim.AdamW):
    torch_class = torch.optim.AdamW


class CompiledAdam(_Live, torch.optim.Adam):
    torch_class = torch.optim.Adam


def build(spec: OptimizerSpec, model: nn.Module) -> torch.optim.Optimizer:
    """The live optimizer for a model: torch's groups as given (or one group of every parameter). torch's constructor
    sees shape-only stand-ins of the parameters, then its groups get the parameters themselves: a constructor that
    makes states from them (Adagrad's `full_like` sums) would read a model another step holds, and the chunks hold
    the states anyway."""
    real: dict[int, torch.Tensor] = {}

    def stand_in(p):
        if isinstance(p, tuple):             # (name, parameter), as named_parameters() gives them
            return (p[0], stand_in(p[1]))
        s = torch.empty(p.shape, dtype=p.dtype, device="meta")
        real[id(s)] = p
        return s
    if spec.groups is None:              # (a flat list: torch refuses an empty one, as for a model without parameters)
        groups = [stand_in(p) for p in model.parameters()]
    else:
        groups = [dict(g) for g in spec.groups]
        for g in groups:
            g["params"] = [stand_in(p) for p in (list(g["params"]) if not isinstance(g["params"], torch.Tensor)
                                                 else [g["params"]])]
    if spec.is_adam:
        cls = CompiledAdamW if spec.decoupled else CompiledAdam
    else:
        cls = type(f"Compiled{spec.name}", (_Live, spec.torch_class), {"torch_class": spec.torch_class})
    opt = cls(groups, **spec.defaults)
    opt.state.clear()          # states a constructor made (Adagrad's sums): the chunks hold them
    for g in opt.param_groups:
        g["params"] = [real[id(s)] for s in g["params"]]
    opt._setup(model, spec.state)
    return opt
